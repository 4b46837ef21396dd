"""One adapter over vLLM's paged KV memory: where token ``t`` of block ``b``, head ``h``, dim ``d``
of K and of V lives in a layer's cache tensor.

The layout differs between attention backends and versions (the CPU backend keeps K transposed
inside each block, ``[num_blocks, kv_heads, block_size, 2 * head_dim]``; GPU backends use other
orders), so it is never hard-coded: :class:`KVLayout` probes it once per layer with the backend's
own cache-write op (``impl.do_kv_cache_update``, what vLLM itself calls before attention) on a
one-block scratch tensor that has the real tensor's shape and stride order. Coded keys and values
(token, head and dim codes; K positive, V negative) reveal every element's position; the map is
then checked by a round trip of random values. Where the probed offsets are affine in (token, head,
dim), as in vLLM's CPU backend (keys transposed inside a block) and in the token-major layouts of
its flash-attention backends, reads and writes index a strided ``[blocks, block_size, heads, dim]``
view of the tensor by (block, offset): one index per token, each moving a ``[heads, dim]`` tile.
Otherwise they go through flat element offsets (one int64 index per element, valid for any dense
stride order), 4-13x slower on a CPU (2K tokens x 30 layers of SmolLM2's shape: 0.07-0.13 s a
direction against 0.008-0.02 s).

Keys are stored after RoPE at the token's absolute position, exactly as vLLM wrote them; the
harness's ``SegmentKV`` keys are post-RoPE too, so no conversion happens here.
"""

from __future__ import annotations

import torch

from ...errors import BenchError

#: exactly representable integer codes (bfloat16 has an 8-bit significand)
_MAX_CODE = 256


def _dense_span(t: torch.Tensor) -> int:
    """Elements from the tensor's first to its last element; == numel for a dense (gap-free) layout."""
    return 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))


def _like(t: torch.Tensor, shape: list[int]) -> torch.Tensor:
    """A zero tensor of ``shape`` with ``t``'s stride order, dtype and device."""
    order = sorted(range(t.ndim), key=lambda i: (t.stride(i), -i), reverse=True)
    base = torch.zeros([shape[i] for i in order], dtype=t.dtype, device=t.device)
    inverse = [order.index(i) for i in range(t.ndim)]
    return base.permute(inverse)


class KVLayout:
    """Token-row access to one layer's paged cache (see the module docstring).

    ``write(cache, slots, k, v)`` and ``read(cache, slots) -> (k, v)`` take ``slots`` (``[T]``,
    ``block * block_size + offset``) and K/V as ``[T, kv_heads, head_dim]``.
    """

    def __init__(self, cache: torch.Tensor, layer, block_size: int, num_blocks: int, kv_heads: int, head_dim: int):
        if cache.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise BenchError(f"vLLM KV cache dtype {cache.dtype} is not supported (use --kv-cache-dtype auto)")
        if _dense_span(cache) != cache.numel():
            raise BenchError("vLLM KV cache tensor is not dense; this layout is not supported")
        dims = [i for i, s in enumerate(cache.shape) if s == num_blocks]
        if len(dims) != 1:
            raise BenchError(f"cannot find the block dimension of a KV cache of shape {tuple(cache.shape)}")
        if max(block_size, kv_heads, head_dim) > _MAX_CODE:
            raise BenchError("KV layout probe supports block size, kv heads and head dim up to 256")
        self.block_dim = dims[0]
        self.block_size, self.kv_heads, self.head_dim = block_size, kv_heads, head_dim
        self._inner_cache: dict = {}
        self.k_pos, self.v_pos = self._probe(cache, layer)
        self._check(cache, layer)
        #: reads and writes of ``cache`` go through strided views (see the module docstring)
        self.strided = self._views(cache) is not None

    # ---- probing -------------------------------------------------------------------------------
    def _scratch(self, cache: torch.Tensor) -> torch.Tensor:
        shape = list(cache.shape)
        shape[self.block_dim] = 1
        return _like(cache, shape)

    def _write_op(self, layer, scratch, k, v) -> None:
        slots = torch.arange(k.shape[0], device=scratch.device, dtype=torch.long)
        layer.impl.do_kv_cache_update(layer, k.contiguous(), v.contiguous(), scratch, slots)

    def _probe(self, cache: torch.Tensor, layer) -> tuple[torch.Tensor, torch.Tensor]:
        bs, H, D = self.block_size, self.kv_heads, self.head_dim
        dev = cache.device
        shape = (bs, H, D)
        codes = (
            torch.arange(bs, device=dev).view(bs, 1, 1).expand(shape),
            torch.arange(H, device=dev).view(1, H, 1).expand(shape),
            torch.arange(D, device=dev).view(1, 1, D).expand(shape),
        )
        seen = []
        for code in codes:
            scratch = self._scratch(cache)
            c = (code + 1).to(cache.dtype)
            self._write_op(layer, scratch, c, -c)
            seen.append(scratch.float())
        pos_k = (seen[0] > 0).nonzero()
        pos_v = (seen[0] < 0).nonzero()
        offs = []
        for pos, sign in ((pos_k, 1.0), (pos_v, -1.0)):
            if pos.shape[0] != bs * H * D:
                raise BenchError(f"KV layout probe found {pos.shape[0]} positions, expected {bs * H * D}")
            idx = tuple(pos.T)
            tok, head, dim = (s[idx].mul(sign).round().long() - 1 for s in seen)
            table = torch.full((*shape, cache.ndim), -1, dtype=torch.long, device=dev)
            table[tok, head, dim] = pos
            if (table < 0).any() or torch.unique(table.view(-1, cache.ndim), dim=0).shape[0] != bs * H * D:
                raise BenchError("KV layout probe: the cache-write op does not map tokens one to one")
            offs.append(table)
        return offs[0], offs[1]

    def _check(self, cache: torch.Tensor, layer) -> None:
        """Round trip: random K/V written by vLLM's op must read back through the offsets."""
        scratch = self._scratch(cache)
        g = torch.Generator(device="cpu").manual_seed(0)
        k = torch.randn(self.block_size, self.kv_heads, self.head_dim, generator=g).to(cache.device, cache.dtype)
        v = torch.randn(self.block_size, self.kv_heads, self.head_dim, generator=g).to(cache.device, cache.dtype)
        self._write_op(layer, scratch, k, v)
        slots = torch.arange(self.block_size, device=cache.device)
        rk, rv = self.read(scratch, slots)
        if not (torch.equal(rk, k) and torch.equal(rv, v)):
            raise BenchError("KV layout probe: read-back of vLLM's cache write does not match")

    # ---- access --------------------------------------------------------------------------------
    def _inner(self, t: torch.Tensor) -> tuple:
        """Flat offsets ``[bs, H, D]`` of K and V inside block 0 of ``t``, ``t``'s block stride, and the
        offsets' affine form per part (:func:`_affine`; None when they have none)."""
        key = tuple(t.stride())
        got = self._inner_cache.get(key)
        if got is None:
            strides = torch.as_tensor(t.stride(), dtype=torch.long, device=self.k_pos.device)
            k_in, v_in = (self.k_pos * strides).sum(-1), (self.v_pos * strides).sum(-1)
            got = (k_in, v_in, t.stride(self.block_dim), _affine(k_in), _affine(v_in))
            self._inner_cache[key] = got
        return got

    def _views(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """K and V of ``t`` as strided ``[blocks, block_size, H, D]`` views, or None where the layout
        is not affine in (token, head, dim)."""
        _, _, bstride, ka, va = self._inner(t)
        if ka is None or va is None:
            return None
        shape = (t.shape[self.block_dim], self.block_size, self.kv_heads, self.head_dim)
        return tuple(t.as_strided(shape, (bstride, *steps), t.storage_offset() + origin) for origin, steps in (ka, va))

    def offsets(self, t: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat element offsets ``[T, H, D]`` of K and V of ``slots`` in the tensor ``t``."""
        k_in, v_in, bstride, _, _ = self._inner(t)
        block, off = self._block_offset(slots, k_in.device)
        base = (block * bstride)[:, None, None]
        return base + k_in[off], base + v_in[off]

    @staticmethod
    def _flat(cache: torch.Tensor) -> torch.Tensor:
        return cache.as_strided((cache.numel(),), (1,))

    def read(self, cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[T, H, D]`` of ``slots`` (copies)."""
        views = self._views(cache)
        if views is not None:
            b, o = self._block_offset(slots, cache.device)
            return views[0][b, o], views[1][b, o]
        ko, vo = self.offsets(cache, slots)
        flat = self._flat(cache)
        return flat[ko], flat[vo]

    def write(self, cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K and V ``[T, H, D]`` at ``slots``."""
        views = self._views(cache)
        if views is not None:
            b, o = self._block_offset(slots, cache.device)
            views[0][b, o] = k.to(cache.dtype)
            views[1][b, o] = v.to(cache.dtype)
            return
        ko, vo = self.offsets(cache, slots)
        flat = self._flat(cache)
        flat[ko] = k.to(cache.dtype)
        flat[vo] = v.to(cache.dtype)

    def _block_offset(self, slots: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Each slot's block and offset in it, on ``device``."""
        slots = slots.to(device, torch.long)
        return slots // self.block_size, slots % self.block_size


def _affine(off: torch.Tensor) -> tuple[int, tuple[int, int, int]] | None:
    """``(origin, (token, head, dim) steps)`` when ``off[t, h, d] == origin + t*st + h*sh + d*sd`` for
    every element with steps >= 0 (a strided view can express it), else None."""
    bs, H, D = off.shape
    origin = int(off[0, 0, 0])
    steps = tuple(
        int(off[tuple(1 if j == i else 0 for j in range(3))]) - origin if n > 1 else 0 for i, n in enumerate((bs, H, D))
    )
    if min(steps) < 0:
        return None
    grid = torch.meshgrid(*(torch.arange(n, device=off.device) for n in (bs, H, D)), indexing="ij")
    expected = origin + sum(g * st for g, st in zip(grid, steps))
    return (origin, steps) if torch.equal(expected, off) else None


def slots_of(block_ids: list[int], start: int, end: int, block_size: int) -> torch.Tensor:
    """Cache slots of token positions ``[start, end)`` of a request holding ``block_ids``."""
    return slots_at(block_ids, torch.arange(start, end), block_size)


def slots_at(block_ids: list[int], positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slots of token ``positions`` of a request holding ``block_ids``."""
    return torch.as_tensor(block_ids, dtype=torch.long)[positions // block_size] * block_size + positions % block_size
