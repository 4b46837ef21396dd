"""Peak-memory counters that each run reads from its own start.

On CUDA the device's peak-allocation counter (``torch.cuda.max_memory_allocated``) is reset; on
Linux the process's resident-set high-water mark (``VmHWM`` in ``/proc/self/status``) is reset by
writing ``5`` to ``/proc/self/clear_refs``. After a reset the high-water mark restarts at the
current resident set (the loaded model included), so every run, suite cell or sweep method in one
process reports its own peak whatever ran before it. Where the reset is not possible the RSS figure
is the process-wide high-water mark since start-up (``reset_peaks`` returns False).

Limit on CPU: the high-water mark restarts at the *current* resident set, which also holds memory
that earlier runs freed but the allocators kept (small blocks on the C heap; free heap pages are
handed back with ``malloc_trim`` at each reset). So in one process a later cell's RSS peak can
include some of an earlier cell's retained memory; matrix jobs therefore run each cell in a fresh
process on CPU (:mod:`~kvcmas_bench.jobs.cells`). The CUDA counters have no such limit.
"""

from __future__ import annotations

import ctypes
import gc
import resource

import torch


def peak_rss() -> int:
    """The process's resident-set high-water mark in bytes (VmHWM; ``ru_maxrss`` where /proc is absent)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _malloc_trim() -> None:
    """Hand the C heap's free pages back to the OS (glibc ``malloc_trim``), so that the resident set
    a reset starts from holds less of what earlier runs freed; a no-op elsewhere."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def reset_peaks(device: torch.device | str | None = None) -> bool:
    """Restart peak tracking: the CUDA peak counters of ``device`` and the RSS high-water mark.
    Returns whether the RSS high-water mark could be reset."""
    gc.collect()
    _malloc_trim()
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
