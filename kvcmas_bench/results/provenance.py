"""Provenance written into every job's ``config.json``: package versions, git revision, hardware."""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
from importlib import metadata
from pathlib import Path

import torch


def versions() -> dict:
    """Versions of the packages that change results (those installed)."""
    out = {}
    for pkg in ("kvcmas-bench", "torch", "transformers", "datasets", "vllm"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out


def git_revision() -> str | None:
    """The project's git revision when run from a checkout, else None."""
    try:
        here = Path(__file__).resolve().parent
        return (
            subprocess.run(
                ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        return None


def hardware(device: torch.device | str) -> dict:
    """Platform, CPU count, torch threads and, on CUDA, the GPU's name and memory."""
    device = torch.device(device)
    hw = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
    }
    if device.type == "cuda" and torch.cuda.is_available():
        hw["gpu"] = torch.cuda.get_device_name(device)
        hw["gpu_total_bytes"] = torch.cuda.get_device_properties(device).total_memory
    return hw


#: the command line that started this process's job (set by the CLI; None when called as a library)
COMMAND_LINE: list[str] | None = None


def version_line() -> str:
    """``kvcmas-bench 0.1.0 (git 1a2b3c4d5e6f)``: the package version and, from a checkout, its commit."""
    from .. import __version__

    rev = git_revision()
    return f"kvcmas-bench {__version__}" + (f" (git {rev[:12]})" if rev else "")


def provenance(device: torch.device | str) -> dict:
    """What every job's ``config.json`` records about how and where it ran."""
    from .. import __version__

    return {
        "command_line": shlex.join(COMMAND_LINE) if COMMAND_LINE is not None else None,
        "kvcmas_bench_version": __version__,
        "versions": versions(),
        "git_revision": git_revision(),
        "hardware": hardware(device),
    }
