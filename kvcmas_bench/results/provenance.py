"""Provenance written into every job's ``config.json``: package versions, git revision, hardware."""

from __future__ import annotations

import os
import platform
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


def provenance(device: torch.device | str) -> dict:
    return {"versions": versions(), "git_revision": git_revision(), "hardware": hardware(device)}
