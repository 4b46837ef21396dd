"""Low-rank structure of caches and cross-agent deltas (paper Section 3.1, Figure 2; Appendix A.2,
Figure 7): effective rank per layer and relative reconstruction error vs retained rank.

Matrices are per layer ``S x D`` (``D = kv_heads x head_dim``), keys in canonical (position-0)
coordinates as KVCMAS stores them, keys and values apart. Three kinds:

- ``base``: an agent's exact cache of a shared (PH) segment;
- ``ph_delta``: the PH-induced delta ``C_j - align(C_i)`` of the same shared segment in two agents
  with different prefixes (target j, its source i on the workflow edge): what KVCMAS's anchors store;
- ``pf_delta``: the PF-induced delta of Appendix A.2: a recurring agent-specific (PF) segment (the
  same node's glue or tail prompt, the same tokens in every request) whose cache differs between two
  requests because the shared content before it differs: ``C_b(PF) - align(C_a(PF))`` for consecutive
  samples a, b of the same workflow node.

A layer whose matrix is (numerically) zero, e.g. layer 0 of a delta (its K/V depend only on the
token and its position), has no deviation to compress: it is left out of the means (``NaN`` per layer).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pandas as pd
import torch

from ..ops.spectrum import effective_ranks_from, singular_values, truncation_errors_from

KINDS = ("base", "ph_delta", "pf_delta")
KIND_LABELS = {"base": "base cache", "ph_delta": "PH-induced delta", "pf_delta": "PF-induced delta"}
PARTS = ("K", "V")
#: ranks of the reconstruction-error curve
DEFAULT_RANKS = (1, 2, 4, 8, 16, 32, 64)
#: a layer whose Frobenius norm is below this fraction of its reference cache's counts as zero
REL_ZERO = 1e-4


@dataclass
class Spectra:
    """Accumulates per-layer spectra of matrices as rows (one per matrix and layer)."""

    energy: float = 0.9
    ranks: tuple[int, ...] = DEFAULT_RANKS
    rows: list[dict] = field(default_factory=list)

    def add(self, kind: str, part: str, z: torch.Tensor, ref: torch.Tensor | None = None, **meta) -> None:
        """One ``[layers, S, D]`` matrix; ``ref`` (same shape) is the cache a zero test is relative to."""
        s = singular_values(z)
        norm = s.square().sum(-1).sqrt()
        floor = REL_ZERO * ref.double().flatten(1).norm(dim=1) if ref is not None else torch.zeros_like(norm)
        er = effective_ranks_from(s, self.energy)
        te = truncation_errors_from(s, self.ranks)
        for layer in range(z.shape[0]):
            zero = bool(norm[layer] <= floor[layer]) or float(norm[layer]) == 0.0
            row = {
                "kind": kind,
                "part": part,
                "layer": layer,
                "tokens": z.shape[1],
                "dim": z.shape[2],
                "effective_rank": float("nan") if zero else int(er[layer]),
                **meta,
            }
            for r, e in zip(self.ranks, te[layer].tolist()):
                row[f"err_r{r}"] = float("nan") if zero else e
            self.rows.append(row)

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.rows)


def per_layer(df: pd.DataFrame) -> pd.DataFrame:
    """Mean effective rank per (workload, kind, part, layer) over the matrices, with their count and
    mean length."""
    keys = [k for k in ("workload", "kind", "part", "layer") if k in df]
    g = df.groupby(keys, sort=False)
    out = g.agg(
        effective_rank=("effective_rank", "mean"),
        matrices=("effective_rank", "count"),
        tokens=("tokens", "mean"),
        dim=("dim", "first"),
    )
    return out.reset_index()


def reconstruction(df: pd.DataFrame, ranks: Sequence[int]) -> pd.DataFrame:
    """Mean relative reconstruction error per (workload, kind, part, retained rank)."""
    keys = [k for k in ("workload", "kind", "part") if k in df]
    rows = []
    for key, g in df.groupby(keys, sort=False):
        key = key if isinstance(key, tuple) else (key,)
        for r in ranks:
            rows.append({**dict(zip(keys, key)), "rank": r, "rel_error": float(g[f"err_r{r}"].mean())})
    return pd.DataFrame(rows)


def summary(df: pd.DataFrame, ranks: Sequence[int]) -> pd.DataFrame:
    """One row per (workload, kind, part): effective rank averaged over layers (layers without
    deviation left out), mean segment length, the reconstruction error at a few ranks and the
    share of singular-value energy a rank keeps (``energy_rN``: mean of 1 - err^2)."""
    keys = [k for k in ("workload", "kind", "part") if k in df]
    rows = []
    for key, g in df.groupby(keys, sort=False):
        key = key if isinstance(key, tuple) else (key,)
        layer_means = g.groupby("layer")["effective_rank"].mean()
        row = {
            **dict(zip(keys, key)),
            "effective_rank": float(layer_means.mean()),
            "effective_rank_max_layer": float(layer_means.max()),
            "tokens": float(g["tokens"].mean()),
            "dim": int(g["dim"].iloc[0]),
            "matrices": int(g.groupby("layer").size().max()),
        }
        for r in ranks:
            row[f"err_r{r}"] = float(g[f"err_r{r}"].mean())
        for r in ranks:  # the kept energy of each matrix, 1 - err^2, averaged (not 1 - mean(err)^2)
            row[f"energy_r{r}"] = float((1.0 - g[f"err_r{r}"] ** 2).mean())
        rows.append(row)
    return pd.DataFrame(rows)


def rank_figure(layers: pd.DataFrame, recon: pd.DataFrame, title: str, energy: float, mark_rank: int = 32):
    """(a) effective rank per layer, one line per kind and K/V (paper Figures 2 and 7a); (b) relative
    reconstruction error vs retained rank (Figure 7b). Artists carry ``gid`` ``rank:<kind>:<part>``
    and ``recon:<kind>:<part>``. Returns (figure, (axes a, axes b))."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11.0, 4.2))
    colors = {"base": "C0", "ph_delta": "C3", "pf_delta": "C2"}
    for (kind, part), g in layers.groupby(["kind", "part"], sort=False):
        mean = g["effective_rank"].mean()
        ax.plot(
            g["layer"],
            g["effective_rank"],
            color=colors.get(kind, "gray"),
            ls="-" if part == "K" else "--",
            marker="o",
            ms=3,
            label=f"{KIND_LABELS.get(kind, kind)} {part} (mean {mean:.1f})",
            gid=f"rank:{kind}:{part}",
        )
    ax.axhline(mark_rank, color="gray", ls=":", lw=1, gid=f"rank-{mark_rank}")
    ax.set_xlabel("layer")
    ax.set_ylabel(f"effective rank ({energy:.0%} singular-value energy)")
    ax.set_title("(a) effective rank per layer", fontsize=9)
    for (kind, part), g in recon.groupby(["kind", "part"], sort=False):
        bx.plot(
            g["rank"],
            g["rel_error"],
            color=colors.get(kind, "gray"),
            ls="-" if part == "K" else "--",
            marker="o",
            ms=3,
            label=f"{KIND_LABELS.get(kind, kind)} {part}",
            gid=f"recon:{kind}:{part}",
        )
    bx.set_xscale("log", base=2)
    bx.set_xlabel("retained rank r")
    bx.set_ylabel("relative reconstruction error ||Z - Z_r|| / ||Z||")
    bx.set_title("(b) reconstruction error vs retained rank", fontsize=9)
    for a in (ax, bx):
        a.grid(alpha=0.3)
        a.legend(fontsize=7, frameon=False)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig, (ax, bx)
