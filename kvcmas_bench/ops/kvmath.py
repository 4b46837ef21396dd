"""Pure tensor math shared by the engine and the methods.

Every function here is side-effect free and unit-tested against a closed form or a dense forward.
KV tensors use the layout ``[layers, kv_heads, tokens, head_dim]`` unless noted.
"""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """HF/Llama convention: split the last dim in halves, return (-x2, x1)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_angles(inv_freq: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of ``offsets * inv_freq`` duplicated to the full head dim, computed in float32."""
    freqs = offsets.to(torch.float32)[..., None] * inv_freq.to(torch.float32)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def shift_keys(keys: torch.Tensor, delta: int | torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Re-align RoPE'd keys by a position shift ``delta`` (R(p+d) = R(d) R(p)).

    ``keys`` is ``[..., tokens, head_dim]``. Values need no rotation. The rotary ``attention_scaling``
    is deliberately not applied: it is already inside the cached keys.
    """
    if isinstance(delta, int) and delta == 0:
        return keys
    d = torch.as_tensor(delta, device=keys.device)
    cos, sin = rope_angles(inv_freq.to(keys.device), d.reshape(-1) if d.ndim else d.reshape(()))
    if d.ndim == 0:
        cos, sin = cos.reshape(-1), sin.reshape(-1)
    k32 = keys.to(torch.float32)
    return (k32 * cos + rotate_half(k32) * sin).to(keys.dtype)


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """||approx - exact||_F / ||exact||_F."""
    num = torch.linalg.vector_norm((approx - exact).to(torch.float32))
    den = torch.linalg.vector_norm(exact.to(torch.float32)).clamp_min(1e-30)
    return float(num / den)
