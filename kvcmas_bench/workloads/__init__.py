"""Benchmark workloads (data, agent roles, scoring); importing this package registers them all.

Adding a workload: one file in this package (a registered :class:`Workload` subclass) and its name
in the import line below.
"""

from ..errors import BenchError
from . import gsm8k, humaneval, mathvista, mmlu, videomme  # noqa: F401
from .base import WORKLOADS, Role, Sample, Workload

__all__ = ["WORKLOADS", "Role", "Sample", "Workload", "get_workload"]


def get_workload(name: str, **kwargs) -> Workload:
    if name not in WORKLOADS:
        raise BenchError(f"unknown workload {name!r}; available: {', '.join(sorted(WORKLOADS))}")
    return WORKLOADS[name](**kwargs)
