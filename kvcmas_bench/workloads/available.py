"""Importing this module registers every workload."""

from . import mmlu  # noqa: F401
