"""KVComm (Ye et al. 2025): online anchor pool, full-dimensional, non-chained.

Each anchor stores the context-free reference cache of its segment (positions at 0) and, per
consuming agent, Delta_j = C_j - C_ref (full K and V, every layer). The gate accepts when the
entropy of softmax(-||V_ref - V_anchor||) is <= gamma * log2(N) (normalized entropy <= gamma);
token-wise weights softmax(-mean|ref - anchor|); layer 0 is recomputed exactly (it depends only on
tokens and positions; counted as S recomputed token-layers). As in KVCOMM's public code, the gate and
the correction use only the anchors covering the whole segment (fewer than two: dense prefill).
V = 20 anchors, LFU eviction among the 5 oldest. Memory O(V N L D) per slot. The first agent is
corrected too (non-chained).

KVComm's own defaults stay KVComm's: gamma (``--tau``) is 0.3 on every workload unless the user sets
it (the per-workload taus are KVCMAS's), and the anchors are always full-dimensional: ``--rank`` is
not an option here (the low-rank non-chained variant is ``kvcmas-nonchained``).
"""

from __future__ import annotations

from dataclasses import field
from typing import ClassVar

from .base import register
from .delta import OnlineDeltaCorrection


@register
class KVComm(OnlineDeltaCorrection):
    name = "kvcomm"
    label, order, color = "KVComm", 70, "C4"
    summary = "full-dimensional online anchors relative to a context-free reference"
    anchors: int = 20
    rank: int | None = field(default=None, init=False)
    delta_rank: int | None = field(default=None, init=False)
    #: full-dimensional anchors are never factorized
    svd: str = field(default="auto", init=False)
    chained: bool = False
    exact_layer0: bool = True
    #: KVComm applies every compatible anchor, as its code does
    prune_tol: float = 0.0
    full_coverage: ClassVar[bool] = True

    @classmethod
    def workload_defaults(cls, workload) -> dict:
        return {}
