"""Benchmark workloads (data, agent roles, scoring); importing this package registers them all.

Adding a workload: one file in this package (a registered :class:`Workload` subclass) and its name
in the import line below.
"""

from . import gsm8k, humaneval, mathvista, mmlu, videomme  # noqa: F401
from .base import WORKLOADS, Role, Sample, Workload

__all__ = ["WORKLOADS", "Role", "Sample", "Workload", "answer_fields", "get_workload"]


def get_workload(name: str, **kwargs) -> Workload:
    """A workload instance (one ``BenchError`` line for an unknown name)."""
    return WORKLOADS.lookup(name)(**kwargs)


def answer_fields() -> dict[str, str]:
    """Workload name -> the sample field compared for answer agreement (``answer_field``)."""
    return {n: WORKLOADS[n].answer_field for n in WORKLOADS.names()}
