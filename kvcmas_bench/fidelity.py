"""Fidelity of reused caches against the exact cache of a full dense prefill of the same prompt.

The reference of every shared segment is the rows of one dense forward of the whole prompt (paper
Figure 3: "against the exact cache obtained through full prefill"), so an error a corrected segment
introduces is still counted in every later segment it perturbs. ``local_kv_rel_error`` is the
conditional figure: the segment against a dense prefill of it over the cache *as the method built
it*, i.e. the error this segment's own materialization adds (0 for a dense segment).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .ops.kvmath import relative_error


@dataclass
class DenseReference:
    """A full dense forward of one prompt: its K/V rows ``[layers, kv_heads, tokens, head_dim]``
    and the last position's logits."""

    k: torch.Tensor
    v: torch.Tensor
    logits: torch.Tensor

    def rows(self, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[:, :, start : start + length], self.v[:, :, start : start + length]


def dense_reference(engine, prompt_ids, embeds=None) -> DenseReference:
    """One dense forward of the whole prompt (outside the request's timing)."""
    cache = engine.new_cache(len(prompt_ids))
    x = embeds[None].to(engine.device, engine.dtype) if embeds is not None else engine.embed_ids(prompt_ids)
    h, _ = engine.run_layers(cache, x, torch.arange(len(prompt_ids), device=engine.device))
    return DenseReference(cache.k, cache.v, engine.logits(h[:, -1:])[0, -1])


def kv_error(k: torch.Tensor, v: torch.Tensor, ek: torch.Tensor, ev: torch.Tensor) -> float:
    """||(K, V) - (K_ref, V_ref)||_F / ||(K_ref, V_ref)||_F."""
    return relative_error(torch.stack([k, v]), torch.stack([ek, ev]))


def segment_errors(approx, exact_k: torch.Tensor, exact_v: torch.Tensor) -> dict:
    """Relative Frobenius error of K, V and both, overall and per layer, against ``exact_k/v``."""
    k, v = approx.k.to(exact_k.dtype), approx.v.to(exact_v.dtype)
    per_layer = [kv_error(k[l], v[l], exact_k[l], exact_v[l]) for l in range(exact_k.shape[0])]
    return {
        "kv_rel_error": kv_error(k, v, exact_k, exact_v),
        "k_rel_error": relative_error(k, exact_k),
        "v_rel_error": relative_error(v, exact_v),
        "kv_rel_error_per_layer": per_layer,
    }


def request_fidelity(dense_logits: torch.Tensor, logits: torch.Tensor) -> dict:
    """First-token agreement and KL(dense || method) of the first token's distributions."""
    logp_dense = torch.log_softmax(dense_logits.float(), -1)
    logp = torch.log_softmax(logits.float(), -1)
    kl = float((logp_dense.exp() * (logp_dense - logp)).sum())
    return {
        "top1_agree": bool(int(dense_logits.argmax()) == int(logits.argmax())),
        # KL >= 0 in exact arithmetic; rounding can give -1e-9 for identical distributions
        "first_token_kl": max(kl, 0.0),
    }
