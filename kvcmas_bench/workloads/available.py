"""Importing this module registers every workload."""

from . import mmlu  # noqa: F401
from . import gsm8k  # noqa: F401
from . import humaneval  # noqa: F401
from . import mathvista  # noqa: F401
from . import videomme  # noqa: F401
