"""Pure selection math for the selective-recomputation methods and the coverage analysis.

Shared by CacheBlend (token selection by KV deviation at a check layer), DroidSpeak (contiguous
layer groups chosen by an offline per-layer deviation profile), RelayCaching (deviation x attention
token scores inside a profiled layer range) and the reconstruction-coverage analysis of the paper's
Appendix A.1 (:mod:`kvcmas_bench.analysis.coverage`). Every function is side-effect free.

Layouts: KV ``[layers, kv_heads, tokens, head_dim]``; one layer ``[kv_heads, tokens, head_dim]``;
(layer, token) entry masks and error maps ``[layers, tokens]``.

Budget rounding (all functions below guard against float noise such as ``(1 - 0.8) * 15 =
3.0000000000000004``):

- token counts use ``ceil`` (LMCache/CacheBlend: ``ceil((1 - rho) * S)``), so a non-zero budget
  never rounds to nothing;
- layer counts use round-half-up (``floor(x + 0.5)``), not Python's banker's ``round``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

_EPS = 1e-9


def _check_rho(rho: float) -> None:
    if not 0.0 <= rho <= 1.0:
        raise ValueError(f"rho must be in [0, 1], got {rho}")


# ---- budgets ---------------------------------------------------------------------------------
def n_selected_tokens(rho: float, tokens: int) -> int:
    """``ceil((1 - rho) * S)`` tokens, within ``[0, S]``."""
    _check_rho(rho)
    return max(0, min(tokens, math.ceil((1.0 - rho) * tokens - _EPS)))


def n_selected_layers(rho: float, layers: int) -> int:
    """``(1 - rho) * L`` rounded half up, within ``[0, L]``."""
    _check_rho(rho)
    return max(0, min(layers, math.floor((1.0 - rho) * layers + 0.5 + _EPS)))


def n_tokens_in_range(rho: float, tokens: int, layers: int, range_layers: int) -> int:
    """Tokens to recompute inside a range of ``range_layers`` layers so that the recomputed
    (token, layer) entries there reach ``(1 - rho) * S * L``: ``ceil((1-rho) S L / R)``, capped at S."""
    _check_rho(rho)
    if range_layers <= 0 or tokens <= 0:
        return 0
    want = (1.0 - rho) * tokens * layers / range_layers
    return max(0, min(tokens, math.ceil(want - _EPS)))


# ---- token scores ----------------------------------------------------------------------------
def token_deviation(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """CacheBlend's score: ``sum((new - old)^2)`` over heads and dims, per token.

    ``new``/``old``: one layer ``[kv_heads, tokens, head_dim]``; returns ``[tokens]`` (float32).
    """
    d = new.to(torch.float32) - old.to(torch.float32)
    return (d * d).sum(dim=(0, 2))


def normalize(x: torch.Tensor) -> torch.Tensor:
    """``x / sum(x)`` (float32); uniform when the sum is not positive and finite."""
    x = x.to(torch.float32).clamp_min(0)
    s = float(x.sum())
    if not math.isfinite(s) or s <= 0.0:
        return torch.full_like(x, 1.0 / max(1, x.numel()))
    return x / s


def top_tokens(score: torch.Tensor, n: int) -> torch.Tensor:
    """Indices of the ``n`` largest scores, ascending (ties: lower index first)."""
    n = max(0, min(int(n), score.numel()))
    order = torch.sort(score.to(torch.float32), descending=True, stable=True).indices[:n]
    return order.sort().values


def attention_mass(
    q: torch.Tensor,
    K: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    col_start: int,
    col_end: int,
    max_elems: int = 1 << 25,
) -> torch.Tensor:
    """Attention probability mass that the queries place on key rows ``col_start:col_end``.

    ``q`` ``[1, heads, T, hd]`` (RoPE applied), ``K`` ``[1, kv_heads, kmax, hd]`` (grouped-query
    attention: kv heads are repeated), ``mask`` bool ``[T, kmax]`` (True = may attend) or None.
    Softmax over all ``kmax`` keys per (head, query), then summed over heads and queries; returns
    ``[col_end - col_start]`` float32. Queries are processed in chunks of at most ``max_elems``
    score entries.
    """
    heads, T = q.shape[1], q.shape[2]
    kv = K.shape[1]
    Kr = K[0].to(torch.float32).repeat_interleave(heads // kv, dim=0)  # [heads, kmax, hd]
    kmax = Kr.shape[1]
    out = torch.zeros(col_end - col_start, dtype=torch.float32, device=q.device)
    step = max(1, max_elems // max(1, heads * kmax))
    for i in range(0, T, step):
        s = torch.einsum("htd,hkd->htk", q[0, :, i : i + step].to(torch.float32), Kr) * scaling
        if mask is not None:
            s = s.masked_fill(~mask[i : i + step][None], float("-inf"))
        p = torch.softmax(s, dim=-1)
        out += p[..., col_start:col_end].sum(dim=(0, 1))
    return out


# ---- layer profiles --------------------------------------------------------------------------
def layer_deviation(src_k: torch.Tensor, src_v: torch.Tensor, ex_k: torch.Tensor, ex_v: torch.Tensor) -> torch.Tensor:
    """DroidSpeak's per-layer profile: ``||K_ex - K_src||_F/||K_ex||_F + ||V_ex - V_src||_F/||V_ex||_F``.

    All inputs ``[layers, kv_heads, tokens, head_dim]`` (source already RoPE-aligned); returns
    ``[layers]`` float32.
    """

    def rel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a, b = a.to(torch.float32).flatten(1), b.to(torch.float32).flatten(1)
        return torch.linalg.vector_norm(a - b, dim=1) / torch.linalg.vector_norm(b, dim=1).clamp_min(1e-30)

    return rel(src_k, ex_k) + rel(src_v, ex_v)


def profile_layer_deviation(pairs: Iterable[tuple], n_layers: int) -> torch.Tensor:
    """Mean of :func:`layer_deviation` over ``(source, exact)`` SegmentKV pairs; ``[n_layers]``."""
    total = torch.zeros(n_layers, dtype=torch.float32)
    count = 0
    for src, ex in pairs:
        if src.k.shape[0] != n_layers:
            raise ValueError(f"observation has {src.k.shape[0]} layers, expected {n_layers}")
        total += layer_deviation(src.k, src.v, ex.k, ex.v).cpu()
        count += 1
    if count == 0:
        raise ValueError("no observations to profile")
    return total / count


def runs(indices: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted unique indices -> maximal contiguous half-open runs ``[(a, b), ...]``."""
    out: list[list[int]] = []
    for i in sorted(set(int(i) for i in indices)):
        if out and out[-1][1] == i:
            out[-1][1] = i + 1
        else:
            out.append([i, i + 1])
    return [(a, b) for a, b in out]


def choose_layer_groups(
    dev: Sequence[float] | torch.Tensor, n: int, max_groups: int | None = None, lo: int = 0, hi: int | None = None
) -> list[tuple[int, int]]:
    """Contiguous layer groups ``[(a, b), ...]`` inside ``[lo, hi)`` covering exactly ``n`` layers
    and maximizing the summed deviation.

    Rule: with ``max_groups`` None (or >= n) this is the ``n`` layers of largest deviation merged
    into contiguous runs (ties: lower layer first). Otherwise an exact dynamic program picks at most
    ``max_groups`` disjoint contiguous runs of total length ``n`` with the largest summed deviation
    (``max_groups=1`` is the best sliding window). Groups are returned sorted.
    """
    vals = [float(x) for x in dev]
    hi = len(vals) if hi is None else hi
    if not 0 <= lo <= hi <= len(vals):
        raise ValueError(f"bad layer range [{lo}, {hi}) for {len(vals)} layers")
    m = hi - lo
    n = max(0, min(int(n), m))
    if n == 0:
        return []
    if max_groups is None or max_groups >= n:
        idx = sorted(range(lo, hi), key=lambda i: (-vals[i], i))[:n]
        return runs(idx)
    G = max(1, int(max_groups))
    # state (selected, groups used, last layer selected) -> (value, previous state)
    tables: list[dict[tuple[int, int, int], tuple[float, tuple | None]]] = [{(0, 0, 0): (0.0, None)}]
    for i in range(m):
        nxt: dict[tuple[int, int, int], tuple[float, tuple | None]] = {}

        def offer(state, value, prev, nxt=nxt):
            if state not in nxt or value > nxt[state][0]:
                nxt[state] = (value, prev)

        for st, (val, _) in tables[-1].items():
            j, g, s = st
            offer((j, g, 0), val, st)
            if j < n:
                g2 = g if s else g + 1
                if g2 <= G:
                    offer((j + 1, g2, 1), val + vals[lo + i], st)
        tables.append(nxt)
    finals = [(v, st) for st, (v, _) in tables[-1].items() if st[0] == n]
    _, st = max(finals, key=lambda t: t[0])
    chosen = []
    for i in range(m, 0, -1):
        if st[2]:
            chosen.append(lo + i - 1)
        st = tables[i][st][1]
    return runs(chosen)


# ---- coverage (paper Appendix A.1) -----------------------------------------------------------
def entry_sq_error(src_k: torch.Tensor, src_v: torch.Tensor, ex_k: torch.Tensor, ex_v: torch.Tensor) -> torch.Tensor:
    """Squared reuse error per (layer, token) entry, K and V together: ``[layers, tokens]``."""
    dk = src_k.to(torch.float32) - ex_k.to(torch.float32)
    dv = src_v.to(torch.float32) - ex_v.to(torch.float32)
    return (dk * dk).sum(dim=(1, 3)) + (dv * dv).sum(dim=(1, 3))


def layer_mask(layers: int, tokens: int, groups: Iterable[tuple[int, int]]) -> torch.Tensor:
    """Entry mask selecting every token of the layers in ``groups``."""
    m = torch.zeros(layers, tokens, dtype=torch.bool)
    for a, b in groups:
        m[a:b] = True
    return m


def token_mask(layers: int, tokens: int, selected: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """Entry mask selecting the tokens ``selected`` in every layer."""
    m = torch.zeros(layers, tokens, dtype=torch.bool)
    m[:, torch.as_tensor(selected, dtype=torch.long).cpu()] = True
    return m


def random_mask(layers: int, tokens: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """``count`` (layer, token) entries chosen uniformly without replacement."""
    total = layers * tokens
    count = max(0, min(int(count), total))
    m = torch.zeros(total, dtype=torch.bool)
    m[torch.randperm(total, generator=generator)[:count]] = True
    return m.view(layers, tokens)


def covered(err: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """(squared error removed by replacing the masked entries with exact ones, total squared error)."""
    err = err.to(torch.float32).cpu()
    return float(err[mask.cpu()].sum()), float(err.sum())
