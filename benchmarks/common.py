"""Shared pieces of the benchmark scripts: real shared text and agent prefixes, repeated timings
summarized the same way everywhere, and the provenance header every result starts with.

Timings: :func:`timed` runs a function ``repeats`` times (after ``warmup`` untimed runs) and returns
a :class:`Summary` of the samples; :func:`fmt` prints it as ``min / median / max`` with the spread
``(max - min) / median`` and, above :data:`SPREAD_LIMIT`, the flag :data:`FLAG`. The median is the
figure every ratio uses. :func:`spread_verdict` ends a script's output with how many of its timed
figures were flagged (:func:`record` counts a figure a table prints itself).

Provenance: :func:`command_header` is ``# command: <argv, shell-quoted>`` and one line with the date,
git revision and machine state; every script prints it first (so stdout redirected to a result file
starts with it) and writes it first into the files it writes itself.
"""

from __future__ import annotations

import datetime
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: a figure whose repeats spread more than this, (max - min) / median, is flagged
SPREAD_LIMIT = 0.20
FLAG = f"SPREAD > {SPREAD_LIMIT:.0%}: not reproducible on this machine now"
ROOT = Path(__file__).resolve().parents[1]
#: environment variables that change timings, recorded in the header when set
ENV_KEYS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES")

# ---- shared text and prefixes -------------------------------------------------------------------


#: the serve-sweep settings the sweep benchmarks take as flags of the same name
SWEEP_FLAGS = ("model", "dtype", "seed", "output_tokens", "calib_trajectories", "warmup_trajectories", "matched_rho")


def sweep_settings(args, *more: str) -> dict:
    """``SweepOptions`` keywords from a benchmark's parsed flags of the same names (``more``: others)."""
    return {k: getattr(args, k) for k in (*SWEEP_FLAGS, *more)}


def shared_ids(tok, n: int, offset: int = 0) -> list[int]:
    """``n`` tokens of real text (MMLU questions), starting ``offset`` questions in."""
    from kvcmas_bench.workloads import get_workload

    text = "\n\n".join(s.query for s in get_workload("mmlu").load()[offset : offset + 600])
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if len(ids) < n:
        raise SystemExit(f"not enough text for {n} tokens")
    return ids[:n]


def prefix(tok, role: str) -> list[int]:
    """An agent-specific prefix (system prompt and the opening of the user turn)."""
    return tok(
        f"<|im_start|>system\nYou are the {role}.<|im_end|>\n<|im_start|>user\nTask:\n", add_special_tokens=False
    )["input_ids"]


# ---- repeated timings ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Summary:
    """Samples of one figure (seconds, tokens/s, a ratio) and their min / median / max / spread."""

    samples: tuple[float, ...]
    #: what the last timed call returned (:func:`timed`), for checks on the result
    last: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.samples:
            raise ValueError("a Summary needs at least one sample")
        object.__setattr__(self, "samples", tuple(float(x) for x in self.samples))

    @classmethod
    def of(cls, samples: Iterable[float], last: Any = None) -> Summary:
        return cls(tuple(samples), last)

    @property
    def n(self) -> int:
        return len(self.samples)

    @property
    def min(self) -> float:
        return min(self.samples)

    @property
    def max(self) -> float:
        return max(self.samples)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def spread(self) -> float:
        """``(max - min) / median``; 0 for one sample (unknown, not zero: see :attr:`unstable`)."""
        if self.n < 2 or self.max == self.min:
            return 0.0
        return (self.max - self.min) / abs(self.median) if self.median else float("inf")

    @property
    def unstable(self) -> bool:
        return self.spread > SPREAD_LIMIT

    def map(self, f: Callable[[float], float]) -> Summary:
        """The same samples through ``f`` (a rate from a time, a share of another figure)."""
        return Summary(tuple(f(x) for x in self.samples))

    def as_dict(self) -> dict:
        return {
            "samples": list(self.samples),
            "min": self.min,
            "median": self.median,
            "max": self.max,
            "spread": self.spread,
            "unstable": self.unstable,
        }


def timed(
    fn: Callable[[], Any],
    repeats: int,
    *,
    warmup: int = 0,
    clock: Callable[[], float] = time.perf_counter,
    metric: Callable[[Any], float] | None = None,
) -> Summary:
    """``repeats`` timed calls of ``fn`` after ``warmup`` untimed ones.

    Samples: the wall time of each call on ``clock`` (pass ``engine.now``, which synchronizes the
    device), or ``metric(result)`` when the call measures itself (a request's ``ttft_s``).
    """
    if repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {repeats}")
    for _ in range(warmup):
        fn()
    out, last = [], None
    for _ in range(repeats):
        t0 = clock()
        last = fn()
        t = clock() - t0
        out.append(t if metric is None else metric(last))
    return Summary(tuple(out), last)


#: how many repeated figures were printed and how many of them were flagged (:func:`spread_verdict`)
_COUNTS = {"figures": 0, "flagged": 0}


def record(s: Summary) -> Summary:
    """Count a printed figure for :func:`spread_verdict` (:func:`fmt` does; tables that print the
    numbers themselves call it)."""
    if s.n > 1:
        _COUNTS["figures"] += 1
        _COUNTS["flagged"] += s.unstable
    return s


def fmt(s: Summary, unit: str = "s", digits: int = 3) -> str:
    """``0.671 / 0.679 / 0.702 s (min / median / max of 5; spread 3.4%)``, flagged above the limit."""

    def num(x: float) -> str:
        return f"{x:.{digits}f}"

    record(s)
    u = unit if unit in ("", "x", "%") else f" {unit}"
    if s.n == 1:
        return f"{num(s.median)}{u} (1 run: spread not measured)"
    text = f"{num(s.min)} / {num(s.median)} / {num(s.max)}{u} (min / median / max of {s.n}; spread {s.spread:.1%})"
    return f"{text}  <-- {FLAG}" if s.unstable else text


def spread_verdict() -> str:
    """One closing line: how many of the figures printed with :func:`fmt` spread above the limit."""
    n, bad = _COUNTS["figures"], _COUNTS["flagged"]
    if not n:
        return "spread: no figure was repeated (--repeats >= 2 measures it)"
    if not bad:
        return f"spread: all {n} repeated figures within {SPREAD_LIMIT:.0%} (max - min) / median"
    return (
        f"spread: {bad} of {n} repeated figures above {SPREAD_LIMIT:.0%} (max - min) / median: not reproducible "
        "on this machine now; rerun on an idle machine"
    )


# ---- provenance header --------------------------------------------------------------------------


def git_revision() -> str:
    """``<short revision>``, with ``+ uncommitted changes`` when tracked files differ from it
    (read-only: ``--no-optional-locks`` keeps ``git status`` from refreshing the index)."""

    def git(*args: str) -> str | None:
        try:
            p = subprocess.run(
                ["git", "--no-optional-locks", *args], cwd=ROOT, capture_output=True, text=True, timeout=10
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return p.stdout.strip() if p.returncode == 0 else None

    rev = git("rev-parse", "--short", "HEAD")
    if rev is None:
        return "unknown (not a git checkout)"
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return f"{rev} + uncommitted changes" if dirty else rev


def command_line(argv: Sequence[str] | None = None) -> str:
    """The exact command line, shell-quoted: the interpreter and arguments as typed
    (``sys.orig_argv``), or ``python <this script> <argv>`` for a programmatic ``main(argv)``."""
    if argv is None:
        words = list(getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv])
    else:
        words = [Path(sys.executable).name, sys.argv[0] if sys.argv and sys.argv[0] else "-", *argv]
    return shlex.join(words)


def provenance(argv: Sequence[str] | None = None) -> dict:
    """The command line (:func:`command_line`), date, git revision and machine state, as fields
    (JSON results start with them)."""
    machine = f"{os.cpu_count()} CPUs"
    try:
        machine += f", load average {os.getloadavg()[0]:.2f}"
    except OSError:
        pass
    torch = sys.modules.get("torch")
    if torch is not None:
        machine += f", torch {torch.__version__} threads {torch.get_num_threads()}"
    env = [f"{k}={os.environ[k]}" for k in ENV_KEYS if k in os.environ]
    if env:
        machine += f", env {' '.join(env)}"
    return {
        "command": command_line(argv),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "git": git_revision(),
        "machine": machine,
    }


def command_header(argv: Sequence[str] | None = None) -> str:
    """Two comment lines: ``# command: <argv>``, then date, git revision and the machine's state."""
    p = provenance(argv)
    return f"# command: {p['command']}\n# date {p['date']}, git {p['git']}, {p['machine']}"


def print_header(argv: Sequence[str] | None = None) -> None:
    """The header on stdout before anything else (a redirected stdout starts with it)."""
    print(command_header(argv), flush=True)


def append_header(path: Path, argv: Sequence[str] | None = None) -> None:
    """Append this command's header to ``path`` (``command.txt`` of an output directory): its first
    lines are the command that first wrote there, later ones the runs that resumed it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(command_header(argv) + "\n")
