"""Benchmark workloads (data, agent roles, scoring)."""

from .base import WORKLOADS, Role, Sample, Workload, get_workload

__all__ = ["WORKLOADS", "Role", "Sample", "Workload", "get_workload"]
