"""Reconstruction coverage of selective recomputation (paper Appendix A.1, Table 2).

For observations of reused segments (RoPE-aligned source K/V next to the exact target K/V, e.g.
:class:`kvcmas_bench.calibration.Observation`) and a recomputation budget ``1 - rho``, each
selection criterion picks a set of (layer, token) entries; replacing those entries by the exact ones
removes part of the reuse error.

- **Coverage** is measured on the *squared* error: ``sum over selected entries of
  ||C_src - C_exact||^2 / sum over all entries`` (K and V together, every head and dim of an
  entry), pooled over all observations (the fraction of the total squared reuse error removed).
  Squared error is additive over entries, so coverage is exactly a fraction; the equivalent
  fraction of the Frobenius *norm* removed, ``1 - sqrt(1 - coverage)``, is reported as
  ``norm_coverage``.
- **Relative coverage** divides by the coverage of uniformly random entry selection with the same
  number of entries per observation (mean over ``seeds`` seeds).

Criteria (each isolated, as in the paper, not the full execution of a method):

- ``layer`` (DroidSpeak): the ``round_half_up(budget * L)`` layers with the largest mean relative
  K + V deviation over the given observations, all tokens (``layer_groups`` limits them to that
  many contiguous groups as DroidSpeak's calibration does; None = plain top layers);
- ``deviation`` (CacheBlend): per observation the ``ceil(budget * S)`` tokens with the largest
  ``sum((k_src - k_exact)^2)`` at ``check_layer`` (``score_on`` "k" or "v"; ``check_layer=None``
  scores the token's squared error summed over all layers), in every layer;
- ``attention`` (RelayCaching's importance criterion): the ``ceil(budget * S)`` tokens of largest
  given importance, in every layer; only when ``importance`` (one ``[S]`` tensor per observation)
  is given;
- ``random``: a uniformly random selection of ``budget * L * S`` entries with seeds disjoint from
  the normalizing ones (its relative coverage is ~1 by construction: a sanity row).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pandas as pd
import torch

from ..ops.selection import (
    choose_layer_groups,
    covered,
    entry_sq_error,
    layer_mask,
    n_selected_layers,
    n_selected_tokens,
    profile_layer_deviation,
    random_mask,
    token_deviation,
    token_mask,
    top_tokens,
)


def _random_coverage(errs: list[torch.Tensor], counts: list[int], seeds: Sequence[int]) -> float:
    vals = []
    for seed in seeds:
        g = torch.Generator().manual_seed(int(seed))
        rem = tot = 0.0
        for err, cnt in zip(errs, counts):
            r, t = covered(err, random_mask(err.shape[0], err.shape[1], cnt, g))
            rem, tot = rem + r, tot + t
        vals.append(rem / tot if tot > 0 else 0.0)
    return sum(vals) / len(vals)


def reconstruction_coverage(
    observations: Sequence,
    budget: float,
    importance: Sequence[torch.Tensor | None] | None = None,
    seeds: int = 8,
    layer_groups: int | None = None,
    check_layer: int | None = 1,
    score_on: str = "k",
) -> pd.DataFrame:
    """Coverage and relative coverage of the layer / deviation / (attention) / random criteria.

    ``observations``: objects with ``.source`` and ``.exact`` SegmentKV (source already aligned).
    ``budget``: recomputed share ``1 - rho`` in [0, 1]. Returns one row per criterion with columns
    ``criterion, budget, selected_fraction, coverage, norm_coverage, random_coverage,
    relative_coverage, observations``.
    """
    if not 0.0 <= budget <= 1.0:
        raise ValueError(f"budget must be in [0, 1], got {budget}")
    if not observations:
        raise ValueError("no observations")
    if score_on not in ("k", "v"):
        raise ValueError(f"score_on must be 'k' or 'v', got {score_on!r}")
    errs = [entry_sq_error(o.source.k, o.source.v, o.exact.k, o.exact.v) for o in observations]
    total_entries = sum(e.numel() for e in errs)
    masks = criterion_masks(observations, errs, budget, importance, layer_groups, check_layer, score_on)
    rows = []
    seed_list = list(range(seeds))
    for crit, ms in masks.items():
        rem = tot = 0.0
        for e, m in zip(errs, ms):
            r, t = covered(e, m)
            rem, tot = rem + r, tot + t
        cov = rem / tot if tot > 0 else 0.0
        counts = [int(m.sum()) for m in ms]
        rnd = _random_coverage(errs, counts, seed_list)
        rows.append(
            {
                "criterion": crit,
                "budget": budget,
                "selected_fraction": sum(counts) / total_entries,
                "coverage": cov,
                "norm_coverage": 1.0 - math.sqrt(max(0.0, 1.0 - cov)),
                "random_coverage": rnd,
                "relative_coverage": cov / rnd if rnd > 0 else float("nan"),
                "observations": len(observations),
            }
        )
    return pd.DataFrame(rows)


def criterion_masks(
    observations: Sequence,
    errs: list[torch.Tensor],
    budget: float,
    importance: Sequence[torch.Tensor | None] | None,
    layer_groups: int | None,
    check_layer: int | None,
    score_on: str,
) -> dict[str, list[torch.Tensor]]:
    """Per criterion, one ``[layers, tokens]`` selection mask per observation (see the module doc)."""
    rho = 1.0 - budget
    L = observations[0].exact.k.shape[0]
    masks: dict[str, list[torch.Tensor]] = {}
    dev = profile_layer_deviation(((o.source, o.exact) for o in observations), L)
    groups = choose_layer_groups(dev, n_selected_layers(rho, L), layer_groups)
    masks["layer"] = [layer_mask(L, e.shape[1], groups) for e in errs]

    dmasks = []
    for o, e in zip(observations, errs):
        S = e.shape[1]
        if check_layer is None:
            score = e.sum(dim=0)
        else:
            src, ex = (o.source.k, o.exact.k) if score_on == "k" else (o.source.v, o.exact.v)
            score = token_deviation(ex[check_layer], src[check_layer]).cpu()
        dmasks.append(token_mask(L, S, top_tokens(score, n_selected_tokens(rho, S))))
    masks["deviation"] = dmasks

    if importance is not None:
        if len(importance) != len(observations):
            raise ValueError("importance needs one tensor per observation")
        if all(imp is not None for imp in importance):
            masks["attention"] = [
                token_mask(L, e.shape[1], top_tokens(imp.detach().cpu().flatten(), n_selected_tokens(rho, e.shape[1])))
                for e, imp in zip(errs, importance)
            ]

    masks["random"] = [
        random_mask(
            L, e.shape[1], math.floor(budget * e.numel() + 0.5 + 1e-9), torch.Generator().manual_seed(10_000 + i)
        )
        for i, e in enumerate(errs)
    ]
    return masks
