"""The reliability gate's scores (Eq. 9-11) and what a threshold tau does to recorded decisions.

The gate turns per-anchor distances into a softmax and accepts when its normalized entropy is at
most tau. :func:`gate_scores` is the one place that turns distances into the softmax input:

- ``paper`` (Eq. 9-10, KVCOMM's code): the raw Frobenius distance ``d_v``, summed over every layer
  and compared token. It scales with the cache's magnitude, the number of tokens k, layers and
  features, so on real caches the gaps between anchors are far larger than the temperature T = 1:
  the softmax is one-hot, the entropy ~0 and tau decides almost nothing.
- ``scaled``: the relative excess distance over the closest anchor, ``(d_v / d_min - 1) / T_g``.
  ``d_v / d_min`` is the ratio of per-element RMS distances (normalizing each ``d_v^2`` by the
  ``k x layers x D`` elements compared cancels in the ratio), so the score is invariant to the cache
  scale, the segment length and the model; ``T_g`` (``gate_temperature``) is the relative gap that
  weighs e times less. For two anchors the entropy is ``H2(sigmoid(gap / T_g))``: a smooth function
  of how much closer the best anchor is, from 1 (equidistant) towards 0 (one far closer).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

from .lowrank import gate_entropy

GATES = ("paper", "scaled")
#: the scaled gate's temperature ``T_g`` unless a method sets its own (``gate_temperature``)
DEFAULT_GATE_TEMPERATURE = 0.01


def gate_scores(sqdist: torch.Tensor, gate: str = "paper", gate_temperature: float = 1.0) -> torch.Tensor:
    """Softmax input ``x`` (the gate computes ``softmax(-x / T)``) from the squared distances ``[n]``.

    ``paper``: ``x_v = d_v = sqrt(sqdist_v)``. ``scaled``: ``x_v = (d_v / d_min - 1) / gate_temperature``
    (0 for the closest anchor); an anchor at distance 0 makes every other one infinitely far.
    """
    d = sqdist.clamp_min(0.0).sqrt()
    if gate == "paper":
        return d
    if gate != "scaled":
        raise ValueError(f"unknown gate {gate!r}; use one of {', '.join(GATES)}")
    d = d.double()
    dmin = d.min()
    rel = d / dmin - 1.0 if float(dmin) > 0 else torch.full_like(d, math.inf).masked_fill(d == 0, 0.0)
    return rel / gate_temperature


def rounded_distances(sqdist: torch.Tensor) -> list[float]:
    """The per-anchor distances ``sqrt(sqdist)`` a gate decision records, in float64 rounded to 6
    significant digits (what :func:`entropy_of` recomputes a decision's entropy from)."""
    return [float(f"{x:.6g}") for x in sqdist.double().sqrt().tolist()]


def entropy_of(distances: Sequence[float], gate: str = "paper", gate_temperature: float = 1.0, temperature=1.0):
    """Normalized gate entropy of one decision from its per-anchor (unsquared) distances."""
    d = torch.as_tensor(list(distances), dtype=torch.float64)
    return gate_entropy(gate_scores(d.square(), gate, gate_temperature), temperature)[0]


def acceptance_curve(decisions: Iterable[tuple[float, int]], taus: Sequence[float]) -> list[float]:
    """Share of gated tokens accepted at each tau: ``sum(n for h, n in decisions if h <= tau) / sum(n)``.

    ``decisions``: recorded (entropy, tokens) pairs, as the methods' ``entropies``. Non-decreasing in
    tau by construction; how much of [0, 1] it sweeps is what tells a useful gate from a degenerate one.
    """
    dec = list(decisions)
    total = sum(n for _, n in dec)
    if not total:
        return [math.nan for _ in taus]
    return [sum(n for h, n in dec if h <= t) / total for t in taus]


def two_anchor_entropy(gap: float) -> float:
    """Normalized entropy of two anchors whose scores differ by ``gap``: ``H2(sigmoid(gap))``."""
    p = 1.0 / (1.0 + math.exp(-gap))
    if p >= 1.0:
        return 0.0
    return -(p * math.log2(p) + (1 - p) * math.log2(1 - p))
