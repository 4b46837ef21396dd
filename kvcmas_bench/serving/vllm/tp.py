"""Tensor parallelism for the connector's worker side: which KV heads a rank holds, and the few
collectives its method work needs so that every rank takes the same decisions.

vLLM shards the KV heads of every attention layer over the tensor-parallel (TP) group the way
``QKVParallelLinear`` loads the K/V projections (``vllm/model_executor/layers/linear.py``), and
``ModelConfig.get_num_kv_heads`` sizes each rank's paged cache to match:

- ``H >= W`` (H KV heads, W ranks; vLLM requires W to divide H): rank ``r`` holds heads
  ``[r * H / W, (r + 1) * H / W)``;
- ``H < W`` (W must be a multiple of H): every rank holds one head, head ``r // (W / H)``, so each
  head is replicated on ``W / H`` consecutive ranks.

Each rank's worker sees its own heads only, in its own paged cache, and captures everything the
methods keep (sources, references, system prompts, anchors) from it: nothing is sliced by hand,
the slice is what the rank's cache holds. What must span every head is the delta methods' gate
and token weights: :meth:`HeadShards.reduce` sums a per-rank figure over the TP group (divided by
the replication factor, so a replicated head counts once); :meth:`HeadShards.agree` and
:meth:`HeadShards.barrier` make each request's plan outcome (the tokens claimed, which segments
are reused) one decision for the whole group before the scheduler sees it.

The collectives run on the worker's method thread (never inside an engine step) over a process
group of their own (gloo, CPU tensors), so they can never interleave with the model's own
all-reduces on vLLM's TP device group.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import torch

from ...errors import BenchError
from ...segments import HeadReduction

#: an all-reduce over the TP group: (tensor, "sum" or "max") -> the reduced tensor, the same on every rank
AllReduce = Callable[[torch.Tensor, str], torch.Tensor]

#: how long a collective of the method thread waits for the other ranks
TIMEOUT = timedelta(minutes=10)


def kv_head_range(total_heads: int, world: int, rank: int) -> tuple[int, int, int]:
    """vLLM's KV-head sharding: rank ``rank`` of ``world`` holds heads ``[first, end)`` of the
    model's ``total_heads``, each replicated on ``replicas`` ranks (see the module docstring)."""
    if not 0 <= rank < world:
        raise BenchError(f"tensor-parallel rank {rank} outside a group of {world}")
    if world >= total_heads:
        if world % total_heads:
            raise BenchError(f"tensor_parallel_size {world} is not a multiple of the model's {total_heads} KV heads")
        replicas = world // total_heads
        head = rank // replicas
        return head, head + 1, replicas
    if total_heads % world:
        raise BenchError(f"the model's {total_heads} KV heads do not split over tensor_parallel_size {world}")
    n = total_heads // world
    return rank * n, (rank + 1) * n, 1


class HeadShards:
    """One rank's share of the KV heads and the TP group's collectives (see the module docstring).

    ``all_reduce`` is None on one device (every operation is then the identity)."""

    def __init__(self, rank: int, world: int, total_heads: int, all_reduce: AllReduce | None = None):
        if world > 1 and all_reduce is None:
            raise BenchError("a tensor-parallel group of more than one rank needs its all-reduce")
        self.rank, self.world, self.total_heads = rank, world, total_heads
        self.first, self.end, self.replicas = kv_head_range(total_heads, world, rank)
        self._all_reduce = all_reduce

    @property
    def heads(self) -> int:
        """KV heads this rank holds."""
        return self.end - self.first

    @property
    def count(self) -> int:
        """Distinct head shards over the group (``head_shards`` of a segment context): W, or H
        when heads are replicated."""
        return self.world // self.replicas

    @property
    def publishes(self) -> bool:
        """Rank 0 answers the scheduler and writes the records (one per request, not one per rank)."""
        return self.rank == 0

    def reduce(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (a figure summed over this rank's heads) summed over every rank's heads, each head
        counted once: the same tensor on every rank."""
        if self.world == 1:
            return t
        out = self._all_reduce(t, "sum")
        return out / self.replicas if self.replicas > 1 else out

    def agree(self, values: list[int], failed: bool) -> tuple[list[int], list[int], bool]:
        """One request's plan outcome over the group (``values``: integers every rank must share):
        their smallest and largest values over the ranks, and whether any rank failed."""
        if self.world == 1:
            return list(values), list(values), failed
        n = len(values)
        got = self._all_reduce(torch.tensor([*values, *(-v for v in values), int(failed)], dtype=torch.int64), "max")
        got = [int(x) for x in got]
        return [-x for x in got[n : 2 * n]], got[:n], bool(got[2 * n])

    def barrier(self) -> None:
        """Every rank got here (its request state is final before rank 0 answers the scheduler)."""
        if self.world > 1:
            self._all_reduce(torch.zeros(1, dtype=torch.int64), "max")

    def describe(self) -> dict:
        return {
            "size": self.world,
            "rank": self.rank,
            "kv_heads": [self.first, self.end],
            "total_kv_heads": self.total_heads,
            "replicas": self.replicas,
        }

    # ---- inside vLLM -----------------------------------------------------------------------------
    @classmethod
    def from_vllm(cls, vllm_config) -> HeadShards | None:
        """This worker's shard, from vLLM's TP group (after vLLM initialized it: worker side); None
        without tensor parallelism. A gloo group of the same ranks, created here (every rank of
        the group calls this while vLLM registers its KV caches), carries the method thread's
        collectives."""
        world = vllm_config.parallel_config.tensor_parallel_size
        if world == 1:
            return None
        total = vllm_config.model_config.get_total_num_kv_heads()
        import torch.distributed as dist
        from vllm.distributed.parallel_state import get_tp_group

        tp = get_tp_group()
        group = dist.new_group(
            ranks=list(tp.ranks),
            backend="gloo",
            timeout=TIMEOUT,
            use_local_synchronization=True,
            group_desc="kvcmas-tp-heads",
        )
        shards = cls(tp.rank_in_group, tp.world_size, total, gloo_all_reduce(group))
        expected = vllm_config.model_config.get_num_kv_heads(vllm_config.parallel_config)
        if shards.heads != expected:
            raise BenchError(f"KV-head sharding: {shards.heads} heads on rank {shards.rank}, vLLM holds {expected}")
        return shards


class ShardedHeads(HeadReduction):
    """The tensor-parallel :class:`~kvcmas_bench.segments.HeadReduction` of a segment context whose
    caches hold one rank's KV heads (``shards``; None: every head, the one-device default): the
    group's distinct head shards, and :meth:`HeadShards.reduce` over the TP group."""

    shards: HeadShards | None = None

    @property
    def head_shards(self) -> int:  # type: ignore[override]
        return 1 if self.shards is None else self.shards.count

    def reduce_heads(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.shards is None else self.shards.reduce(t)


def gloo_all_reduce(group) -> AllReduce:
    """An all-reduce over a torch.distributed (gloo) group, on CPU copies of the tensors."""
    import torch.distributed as dist

    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}

    def all_reduce(t: torch.Tensor, op: str) -> torch.Tensor:
        x = t.detach().to("cpu", copy=True).contiguous()
        dist.all_reduce(x, op=ops[op], group=group)
        return x.to(t.device)

    return all_reduce


def parallel_refusal(parallel_config) -> str | None:
    """Why the connector cannot run with this parallel layout (None: it can). Tensor parallelism
    is handled; the others would split what a plan holds in ways it does not know."""
    pp = getattr(parallel_config, "pipeline_parallel_size", 1)
    if pp > 1:
        return (
            f"pipeline_parallel_size {pp}: each pipeline stage holds some layers, while the connector's plans, "
            "sources and anchors hold every layer (tensor parallelism is supported)"
        )
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        n = getattr(parallel_config, name, 1) or 1
        if n > 1:
            return f"{name} {n}: the paged cache is split along tokens, which the connector's slot map does not know"
    return None
