"""Where a suite's or ablation's cells run: in this process, or each in a fresh Python process.

On CPU a cell's peak memory is the process's resident-set high-water mark. Reset at the cell's
start, it restarts at the *current* resident set, which in one long process also holds what earlier
cells freed but the allocators kept, so earlier cells move a later cell's peak (measured on the
default model, ``suite --methods fullshared,kvcmas --limit 2``: FullShared 80 MiB and KVCMAS 117
MiB above their peaks in fresh processes). A fresh interpreter per cell (``--cell-process fresh``,
the default on CPU with the in-process engine) starts every cell from the same empty process: no
earlier cell can move its figure. The price is the imports of every cell (~5 s here; the model is
loaded per cell either way). On CUDA the device's peak counters are exact in one process, and with
``--engine vllm`` the memory is the server's, so ``auto`` keeps those cells in this process.

The worker (``python -c`` with this process's ``sys.path``, so it imports the same code) reads the
cell's ``RunOptions`` pickled on stdin (method knob values keep how the user typed them; a method or
workload class registered from outside the package travels by reference and is registered there
too; one that cannot, e.g. defined in ``__main__``, runs its cell in this process), runs the ``run``
job, and writes one JSON object per line to a pipe: the progress calls of the run (``start``,
``advance``, ``note``, ``resumed``), then its summary or its error. The parent forwards the progress
to its display and turns the end into what an in-process cell gives: the summary, a
:class:`BenchError` (the cell fails, the others run), an ``OSError`` (as in-process, it stops the
job), or ``KeyboardInterrupt``. The worker runs in its own session, so a terminal's Ctrl-C reaches
the parent only, which passes one SIGINT on and waits for the worker to keep its finished samples;
on Linux the worker also ends when its parent dies (``PR_SET_PDEATHSIG``). Its stderr (library
warnings, a bug's traceback) is the parent's.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import pickle
import signal
import subprocess
import sys
import threading

from ..errors import BenchError, os_error_reason

CELL_PROCESSES = ("auto", "fresh", "same")
#: ``auto`` runs cells in fresh processes on CPU; tests that run many tiny in-process suites turn it off
AUTO_FRESH_ON_CPU = True
#: how long the worker has after a forwarded Ctrl-C to keep its finished samples before it is killed
INTERRUPT_GRACE_S = 30.0
_BOOT = "import sys; sys.path[:] = {path!r}; from kvcmas_bench.jobs.cells import worker; sys.exit(worker({fd}, {ppid}))"


def check_cell_process(mode: str, engine: str) -> None:
    """One line for an unknown ``--cell-process`` or ``fresh`` on a serving engine."""
    if mode not in CELL_PROCESSES:
        raise BenchError(f"--cell-process must be one of {', '.join(CELL_PROCESSES)}, got {mode!r}")
    if mode == "fresh" and engine != "in-process":
        raise BenchError(
            f"--cell-process fresh applies to the in-process engine; with --engine {engine} the memory "
            "measured is the server's, and every cell already runs against one server"
        )


def fresh_cells(mode: str, engine: str, device: str) -> bool:
    """Whether each cell runs in a fresh process (``auto``: on CPU with the in-process engine); ``mode``
    was checked when the job was planned (:func:`check_cell_process`)."""
    if mode != "auto":
        return mode == "fresh"
    if engine != "in-process" or not AUTO_FRESH_ON_CPU:
        return False
    from ..modeling import resolve_device

    return resolve_device(device).type == "cpu"


def plugins(ro) -> dict | None:
    """The method and workload classes of ``ro`` registered from outside the package, pickled by
    reference for the worker ({} when none); None when one cannot travel (defined in ``__main__``
    or in a function): its cell runs in this process."""
    from ..methods import METHODS
    from ..workloads import WORKLOADS

    extra = {
        kind: (name, cls)
        for kind, reg, name in (("method", METHODS, ro.method), ("workload", WORKLOADS, ro.workload))
        for cls in [reg.get(name)]
        if cls is not None and not getattr(cls, "__module__", "").startswith("kvcmas_bench.")
    }
    try:
        pickle.dumps(extra)
    except (pickle.PicklingError, AttributeError, TypeError):
        return None
    return None if any(getattr(cls, "__module__", None) == "__main__" for _, cls in extra.values()) else extra


def run_in_fresh_process(ro, extra: dict, progress=None) -> dict:
    """Run the ``run`` job with options ``ro`` in a new Python process; its summary, as ``run`` returns
    it. ``extra``: the classes the worker registers, :func:`plugins` of ``ro`` (not None)."""
    from ..results import provenance

    read_end, write_end = os.pipe()
    boot = _BOOT.format(path=[str(p) for p in sys.path], fd=write_end, ppid=os.getpid())
    proc = subprocess.Popen(
        [sys.executable, "-c", boot], stdin=subprocess.PIPE, pass_fds=(write_end,), start_new_session=True
    )
    os.close(write_end)
    job = {"options": ro, "plugins": extra, "command_line": provenance.COMMAND_LINE}
    try:
        proc.stdin.write(pickle.dumps(job))
    except BrokenPipeError:
        pass  # the worker is gone already: its exit status tells
    finally:
        with contextlib.suppress(BrokenPipeError):
            proc.stdin.close()
    with os.fdopen(read_end, "rb") as messages:
        try:
            end = _relay(messages, progress)
        except KeyboardInterrupt:
            _stop(proc, messages)
            raise
    return _outcome(end, proc.wait())


def _relay(messages, progress) -> dict:
    """Forward the worker's progress calls until it closes the pipe; its last other message."""
    end: dict = {}
    for line in messages:
        try:
            msg = json.loads(line)
        except ValueError:  # a line cut short by a killed worker: its exit status says what happened
            continue
        if "call" in msg:
            _forward(progress, msg)
        else:
            end = msg
    return end


def _forward(progress, msg: dict) -> None:
    """One progress call of the worker's run, made on the parent's display (optional calls only where it has them)."""
    fn = getattr(progress, msg["call"], None) if progress is not None else None
    if fn is not None:
        fn(*msg.get("args", ()), **msg.get("kwargs", {}))


def _stop(proc: subprocess.Popen, messages) -> None:
    """Pass Ctrl-C on to the worker, and read its pipe until it has kept its finished samples and
    ended (killed after :data:`INTERRUPT_GRACE_S`, or at a second Ctrl-C)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    timer = threading.Timer(INTERRUPT_GRACE_S, proc.kill)
    timer.start()
    try:
        _relay(messages, None)
    except KeyboardInterrupt:
        proc.kill()
    finally:
        timer.cancel()
        proc.wait()


def _outcome(end: dict, rc: int) -> dict:
    """The worker's last message (and exit status) as what an in-process run gives or raises."""
    if "summary" in end:
        return end["summary"]
    if "error" in end:
        raise BenchError(end["error"])
    if "os_error" in end:
        errno, strerror, filename = end["os_error"]
        raise OSError(errno, strerror, filename)
    if "interrupted" in end:
        raise KeyboardInterrupt
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        why = " (out of memory?)" if -rc == signal.SIGKILL else ""
        raise BenchError(f"the cell's worker process was killed by {name}{why}; run the same command to resume")
    raise RuntimeError(f"the cell's worker process failed (exit {rc}): {end.get('bug', 'see its traceback above')}")


class _PipeProgress:
    """The worker's stand-in for the parent's display: every call becomes one line on the pipe."""

    def __init__(self, send):
        self._send = send

    def start(self, total: int, done: int) -> None:
        self._send({"call": "start", "kwargs": {"total": total, "done": done}})

    def advance(self, rec: dict) -> None:
        self._send({"call": "advance", "args": [rec]})

    def note(self, message: str) -> None:
        self._send({"call": "note", "args": [message]})

    def resumed(self, samples: list[dict]) -> None:
        """The finished samples' count and correctness (all the display reads of them)."""
        self._send({"call": "resumed", "args": [[{"correct": s.get("correct")} for s in samples]]})


def _die_with_parent(ppid: int) -> None:
    """Ask Linux to end this worker when its parent dies (a killed suite leaves no cell running);
    a parent that died before the request was made ends the worker now."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != ppid:
        os._exit(1)


def worker(fd: int, ppid: int) -> int:
    """Run one cell from the job on stdin; report on ``fd``. Returns the exit status. Ctrl-C (the
    parent's one SIGINT) at any point ends it quietly with what the run has kept."""
    out = os.fdopen(fd, "w", encoding="utf-8")

    def send(msg: dict) -> None:
        with contextlib.suppress(BrokenPipeError):  # the parent is gone: nothing to tell
            out.write(json.dumps(msg, default=str) + "\n")
            out.flush()

    try:
        _die_with_parent(ppid)
        return _work(send)
    except KeyboardInterrupt:
        send({"interrupted": True})
        return 130


def _work(send) -> int:
    import traceback

    from ..console import quiet_libraries
    from ..methods import METHODS
    from ..results import provenance
    from ..workloads import WORKLOADS
    from .run import run

    quiet_libraries()
    job = pickle.loads(sys.stdin.buffer.read())
    for kind, (name, cls) in job["plugins"].items():
        (METHODS if kind == "method" else WORKLOADS).setdefault(name, cls)
    provenance.COMMAND_LINE = job["command_line"]
    try:
        send({"summary": run(job["options"], progress=_PipeProgress(send))})
    except BenchError as exc:
        send({"error": str(exc)})
    except OSError as exc:
        send({"os_error": [exc.errno, os_error_reason(exc), exc.filename]})
    except Exception as exc:  # a bug: its traceback on stderr, its one line to the parent
        traceback.print_exc()
        send({"bug": f"{type(exc).__name__}: {exc}"})
        return 1
    return 0
