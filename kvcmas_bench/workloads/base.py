"""Workload interface: samples, agent roles and scoring, in the style of lm-eval tasks."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from ..errors import BenchError, find_package
from ..registry import Registry

#: name -> workload class, filled by ``@register`` as the workload modules are imported
WORKLOADS: Registry[type[Workload]] = Registry("workload")
register = WORKLOADS.register


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


def package_file(package: str, relpath: str, install_hint: str, what: str | None = None) -> Path:
    """Locate a data file shipped inside a PyPI package without importing the package;
    ``install_hint`` ends the one-line error when the package is missing (``what``: the data's name)."""
    spec = find_package(package)
    if spec is None or not spec.submodule_search_locations:
        dist = package.replace("_", "-")
        name = f"the {what} (package {dist})" if what else f"dataset package {dist!r}"
        raise BenchError(f"{name} is not installed: {install_hint}")
    for root in spec.submodule_search_locations:
        p = Path(root) / relpath
        if p.exists():
            return p
    raise BenchError(f"package {package!r} has no {relpath}: {install_hint}")


def first_line(exc: BaseException) -> str:
    """The first non-empty line of an exception's message (or its type name)."""
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    return lines[0] if lines else type(exc).__name__


def read_jsonl_lines(path: str | Path, what: str) -> list[tuple[int, dict]]:
    """The JSON objects of a JSONL file (``.gz`` too) with their line numbers, blank lines skipped; an
    unreadable file or a line that is not UTF-8 JSON or not an object is one ``BenchError`` naming
    ``what`` and the line."""
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
                rows.append((n, row))
    except (OSError, EOFError, zlib.error) as exc:
        raise BenchError(f"cannot read {what} from {path}: {first_line(exc)}") from None
    return rows


def read_jsonl(path: str | Path, what: str) -> list[dict]:
    """The JSON objects of a JSONL file (see :func:`read_jsonl_lines`)."""
    return [row for _, row in read_jsonl_lines(path, what)]


_KIND_NAMES = {str: "a string", int: "an integer", float: "a number", list: "a list", dict: "an object"}


def _scalar(v) -> bool:
    """``v`` is a numpy scalar (parquet rows hold them)."""
    return type(v).__module__ == "numpy" and hasattr(v, "dtype") and getattr(v, "ndim", None) == 0


def _plain(v):
    return v.item() if _scalar(v) else v


def _short(v) -> str:
    text = repr(_plain(v))
    return text if len(text) <= 40 else text[:37] + "..."


def _is(v, kind: type) -> bool:
    """``v`` is of ``kind`` (str, int, float, list, dict), numpy scalars and arrays (parquet rows) included."""
    if isinstance(v, bool) or (_scalar(v) and v.dtype.kind == "b"):
        return False
    if kind is list:
        return isinstance(v, (list, tuple)) or type(v).__name__ == "ndarray"
    if kind in (int, float) and _scalar(v):
        return v.dtype.kind in ("iu" if kind is int else "iuf")
    if kind is float:
        return isinstance(v, (int, float))
    if kind is str and _scalar(v):
        return v.dtype.kind == "U"
    return isinstance(v, kind)


class DataRow:
    """One row of a workload's data and where it came from, with typed field access: a missing or
    mistyped field is one ``BenchError`` line naming the workload, the row and its file and line
    (``bad MMLU row 3 (data.jsonl line 4): field 'correct_answer' must be a string, got 1``)."""

    def __init__(self, data, what: str, index: int, where: str):
        self.what, self.index, self.where = what, index, where
        if not isinstance(data, dict):
            raise self.error(f"not an object but {_KIND_NAMES.get(type(data), type(data).__name__)} ({_short(data)})")
        self.data = data

    def error(self, problem: str) -> BenchError:
        return BenchError(f"bad {self.what} row {self.index} ({self.where}): {problem}")

    def has(self, key: str) -> bool:
        v = self.data.get(key)
        return v is not None and not (isinstance(v, float) and v != v)

    def get(self, key: str, *kinds: type, required: bool = True, default=None):
        """The value of ``key``, one of ``kinds``; missing (or None/NaN): ``default`` unless ``required``."""
        if not self.has(key):
            if required:
                raise self.error(f"missing field {key!r}")
            return default
        v = self.data[key]
        if kinds and not any(_is(v, k) for k in kinds):
            want = " or ".join(_KIND_NAMES.get(k, k.__name__) for k in kinds)
            raise self.error(f"field {key!r} must be {want}, got {_short(v)}")
        return v

    def text(self, key: str, required: bool = True, default: str | None = None, empty: bool = False) -> str | None:
        """A string field (``empty``: may be blank)."""
        v = self.get(key, str, required=required, default=default)
        if v is not None and not empty and not str(v).strip():
            raise self.error(f"field {key!r} is empty")
        return None if v is None else str(v)

    def scalar(self, key: str, required: bool = True, default=None) -> str | None:
        """A string or number field, as text (an answer or option that may be numeric)."""
        v = self.get(key, str, int, float, required=required, default=default)
        if v is None:
            return None
        return str(_plain(v))

    def strings(self, key: str, required: bool = True, length: int | None = None) -> list[str] | None:
        """A list of strings or numbers, as texts (``length``: exactly that many)."""
        v = self.get(key, list, required=required)
        if v is None:
            return None
        items = list(v)
        for x in items:
            if not (_is(x, str) or _is(x, float)):
                raise self.error(f"field {key!r} must be a list of strings, holds {_short(x)}")
        if length is not None and len(items) != length:
            raise self.error(f"field {key!r} must hold {length} items, holds {len(items)}")
        return [str(_plain(x)) for x in items]


def jsonl_rows(path: str | Path, what: str, label: str | None = None) -> list[DataRow]:
    """The rows of a JSONL data file, each knowing its file and line (``label``: the workload name
    in messages, default ``what``)."""
    return [
        DataRow(row, label or what, i, f"{path} line {n}") for i, (n, row) in enumerate(read_jsonl_lines(path, what))
    ]


def indexed_rows(rows, what: str, source: str) -> list[DataRow]:
    """The rows of a non-line source (a hub dataset, a parquet file, a JSON list), named by row index."""
    return [DataRow(r, what, i, str(source)) for i, r in enumerate(rows)]


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
    #: tau of the gated anchor methods on this workload (paper A.3); None: the method's own default
    default_tau: ClassVar[float | None] = None
    max_new_tokens: ClassVar[int] = 64
    final_max_new_tokens: ClassVar[int] = 32
    #: the sample field compared for answer agreement with NonShared (Table 1)
    answer_field: ClassVar[str] = "prediction"

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

    @staticmethod
    def judge(prediction: str | None, gold: str | None) -> bool:
        """Whether ``prediction`` is correct for ``gold``: the one rule :meth:`score` applies and the
        readers apply again to every stored sample (an edited ``correct`` is refused, not counted).
        An unparsed prediction (None) is never correct."""
        return prediction is not None and prediction == gold
