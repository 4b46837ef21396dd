"""Importing this module registers every workload."""

from . import mmlu  # noqa: F401
from . import gsm8k  # noqa: F401
from . import humaneval  # noqa: F401
