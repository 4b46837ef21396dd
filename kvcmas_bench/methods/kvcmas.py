"""KVCMAS (the paper, Sections 3 and A.3): chained, low-rank, online delta correction.

- Chained reference: the source of edge i -> j is agent i's materialized cache C_i (exact for the
  first agent, which always prefills densely); Delta_{j<-i} = C_j - align(C_i) (Eq. 6, 12); no
  context-free reference prefill ever runs.
- Low-rank anchors: per slot up to V = 10 anchors, each holding truncated-SVD factors A = U_r S_r,
  B = R_r^T (Eq. 7) of the source cache and of each consumer's delta, per layer, K and V apart
  (rank r_C = r_D = ``rank``, default 32): O(V N r (L + D)) memory instead of O(V N L D).
- Gate (Eq. 9-11) on the reconstructed anchor values, normalized entropy <= tau (workload default);
  token-wise K/V weights; correction applied to the aligned source and materialized full-dimensional
  (Eq. 8); it becomes the source of the next edge.
- Anchor construction (SVD of the source and the delta) runs after the request's first token.

``kvcmas-nonchained`` is the ablation of Table 8/9: same low-rank pool, but corrections relative to
a context-free reference that must be prefilled (also for the first agent).
"""

from __future__ import annotations

from .base import register
from .delta import OnlineDeltaCorrection


@register
class KVCMAS(OnlineDeltaCorrection):
    name = "kvcmas"
    label, order, color, chain_label = "KVCMAS", 90, "C2", "Chained"
    summary = "chained low-rank online delta correction (the paper's method)"
    # anchors (V = 10), rank (r = 32), tau and chained: OnlineDeltaCorrection's defaults


@register
class KVCMASNonChained(KVCMAS):
    name = "kvcmas-nonchained"
    label, order, color, chain_label = "KVCMAS (non-chained)", 80, "C3", "Non-chained"
    summary = "KVCMAS ablation: low-rank anchors relative to a context-free reference"
    chained: bool = False
