"""Trajectory arrival times, as ``vllm bench serve`` draws request arrivals.

Trajectory ``t`` starts at ``T_t``: ``T_0 = 0`` and ``T_{t+1} = T_t + gap_t`` with
``gap ~ Gamma(shape=burstiness, scale=1 / (qps * burstiness))`` (mean ``1 / qps``, coefficient of
variation ``1 / sqrt(burstiness)``). ``burstiness = 1`` is a Poisson process; smaller values are
burstier, larger ones more regular. ``qps`` counts *trajectories* per second (each trajectory is four
dependent agent requests: agent ``j`` arrives when agent ``j - 1`` of the same trajectory completes).

``qps = 0`` is single-stream execution: no open-loop arrivals at all, each trajectory starts when
the previous one has finished (``arrival_times`` returns ``None``).
"""

from __future__ import annotations

import numpy as np

from ..errors import BenchError


def check_rate(qps: float, burstiness: float = 1.0) -> None:
    if not np.isfinite(qps) or qps < 0:
        raise BenchError(f"--qps values must be finite and >= 0 (0 = single stream), got {qps}")
    if not np.isfinite(burstiness) or burstiness <= 0:
        raise BenchError(f"--burstiness must be > 0 (1 = Poisson), got {burstiness}")


def gaps(n: int, qps: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """``n`` inter-arrival gaps in seconds (gamma distributed, mean ``1 / qps``)."""
    check_rate(qps, burstiness)
    if qps == 0:
        raise BenchError("qps 0 is single-stream execution and has no inter-arrival gaps")
    rng = np.random.default_rng(seed)
    return rng.gamma(shape=burstiness, scale=1.0 / (qps * burstiness), size=n)


def arrival_times(n: int, qps: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray | None:
    """Start times of ``n`` trajectories (first at 0), or ``None`` for single stream (qps 0)."""
    check_rate(qps, burstiness)
    if qps == 0:
        return None
    if n <= 0:
        return np.zeros(0)
    return np.concatenate([[0.0], np.cumsum(gaps(n - 1, qps, burstiness, seed))])
