"""Fidelity of reused caches against the exact dense cache (relative KV error, first-token KL)."""

from __future__ import annotations

import torch

from .ops.kvmath import relative_error


def segment_errors(approx, exact) -> dict:
    """Relative Frobenius error of K, V and both, overall and per layer."""
    per_layer = [
        relative_error(
            torch.cat([approx.k[l].flatten(), approx.v[l].flatten()]),
            torch.cat([exact.k[l].flatten(), exact.v[l].flatten()]),
        )
        for l in range(exact.k.shape[0])
    ]
    return {
        "kv_rel_error": relative_error(torch.stack([approx.k, approx.v]), torch.stack([exact.k, exact.v])),
        "k_rel_error": relative_error(approx.k, exact.k),
        "v_rel_error": relative_error(approx.v, exact.v),
        "kv_rel_error_per_layer": per_layer,
    }


def request_fidelity(engine, prompt_ids, logits: torch.Tensor, embeds=None) -> dict:
    """First-token agreement and KL(dense || method) against a dense forward of the same prompt."""
    dense = engine.dense_logits(prompt_ids, embeds)[-1]
    logp_dense = torch.log_softmax(dense.float(), -1)
    logp = torch.log_softmax(logits.float(), -1)
    kl = float((logp_dense.exp() * (logp_dense - logp)).sum())
    return {
        "top1_agree": bool(int(dense.argmax()) == int(logits.argmax())),
        "first_token_kl": max(kl, 0.0),
    }
