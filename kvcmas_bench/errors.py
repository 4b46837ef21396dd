"""User-facing errors: the CLI turns these into one line on stderr and exit code 2."""


class BenchError(Exception):
    """Bad input or missing resource, reported to the user without a traceback."""


class OptionError(BenchError, ValueError):
    """An invalid method option (knob) value; raised by a method's own validation."""
