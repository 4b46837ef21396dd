"""Backends that execute trace requests and report measured service times.

:class:`InProcessBackend` runs every request on the package's own :class:`~kvcmas_bench.engine.Engine`,
one request at a time, sources chained as in :class:`~kvcmas_bench.workflow.Workflow` (chain): the
source of a shared slot is the cache that the most recent agent of the same trajectory materialized
for it (so ``ctx`` chains agent 0 -> 1 -> 2 -> 3) and the source of ``out:<agent k>`` is agent
``k``'s decode cache of its output (``output_kv``). The first agent has no source and prefills
densely. Nothing crosses trajectories except the method's own state (anchor pools, references,
calibration tables).
"""

from __future__ import annotations

import gc
from dataclasses import fields
from typing import Sequence

import torch

from ..engine import Engine, RequestResult, SegmentKV
from ..errors import BenchError
from .queueing import ServiceRecord
from .traces import Trace, out_slot


def method_kwargs(name: str, args: dict | None) -> dict:
    """User overrides (tau, rank, anchors, rho, ...) that apply to method ``name``; None = default."""
    from ..methods import METHODS

    if not args:
        return {}
    known = {f.name for f in fields(METHODS[name])}
    return {k: v for k, v in args.items() if v is not None and k in known}


def has_online_state(method) -> bool:
    """Whether the method learns online across requests (KVCMAS/KVComm anchor pools)."""
    return hasattr(method, "pools")


def reset_peaks(engine: Engine) -> bool:
    """Restart peak-memory tracking: CUDA peak stats and (Linux) the process RSS high-water mark.

    Returns whether the RSS high-water mark could be reset (``/proc/self/clear_refs``); when not,
    ``peak_rss_bytes`` stays the process-wide high-water mark since start-up.
    """
    gc.collect()
    if engine.device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(engine.device)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class InProcessBackend:
    """Measure each request for real on the in-process engine (one request at a time)."""

    name = "in-process"

    def __init__(self, model: torch.nn.Module, tokenizer=None, ignore_eos: bool = True, warmup: bool = True):
        self.engine = Engine(model, tokenizer)
        self.ignore_eos = ignore_eos
        self.warmup = warmup
        if ignore_eos:
            # like `vllm bench serve --ignore-eos`: every agent decodes exactly max_new_tokens
            self.engine.eos_ids = set()
        self.rss_reset = False

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_positions(self) -> int | None:
        return getattr(self.engine.config, "max_position_embeddings", None)

    @property
    def vocab_size(self) -> int | None:
        return getattr(self.engine.config, "vocab_size", None)

    def describe(self) -> dict:
        return {"name": self.name, "engine": "kvcmas_bench.engine.Engine (one request at a time)",
                "device": str(self.engine.device), "dtype": str(self.engine.dtype).replace("torch.", ""),
                "ignore_eos": self.ignore_eos, "warmup": self.warmup, "prefix_caching": False,
                "decoding": "greedy", "rss_peak_reset_per_method": self.rss_reset}

    def run_trajectory(self, trace: Trace, method) -> list[tuple[RequestResult, int]]:
        """Run the trajectory's agents in order; returns (result, shared-store bytes) per agent."""
        store: dict[str, SegmentKV] = {}
        outputs: dict[str, list[int]] = {}
        results = []
        for i, spec in enumerate(trace.agents):
            sources = {slot: kv.agent for slot, kv in store.items()}
            req = trace.request(i, outputs, sources)
            res = self.engine.run(req, method, sources=dict(store))
            store.update(res.materialized)
            if res.output_kv is not None:
                res.output_kv.slot = out_slot(spec.name)
                store[out_slot(spec.name)] = res.output_kv
            outputs[spec.name] = list(res.output_ids)
            results.append((res, sum(kv.nbytes for kv in store.values())))
        return results

    def prepare(self, method: str, calibration: Sequence[Trace], method_args: dict | None = None):
        """A fresh method instance: calibrated on ``calibration`` when it needs it, then warmed up.

        Warm-up (unmeasured): methods with online state (anchor pools) run all held-out
        trajectories so their pools do not start empty; every other method runs one request so
        one-off initialisation stays out of the timings.
        """
        from ..methods import get_method

        m = get_method(method, **method_kwargs(method, method_args))
        if m.needs_calibration:
            if not calibration:
                raise BenchError(f"method {method!r} needs calibration trajectories (none given)")
            from ..calibration import Recorder

            rec = Recorder(with_reference=m.calibration_reference)
            for tr in calibration:
                self.run_trajectory(tr, rec)
            if not rec.observations:
                raise BenchError("calibration produced no observations (no shared segment with a source)")
            m.calibrate(rec.observations, self.engine.n_layers)
            del rec
        if self.warmup and calibration:
            if has_online_state(m):
                for tr in calibration:
                    self.run_trajectory(tr, m)
            else:
                self.engine.run(calibration[0].request(0, {}), m, keep_output_kv=False)
        self.rss_reset = reset_peaks(self.engine)
        return m

    def measure(self, trace: Trace, method) -> list[ServiceRecord]:
        out = []
        for i, (r, store_bytes) in enumerate(self.run_trajectory(trace, method)):
            state = method.state_bytes()
            out.append(ServiceRecord(
                trajectory=trace.id, agent_index=i, agent=r.agent, prefill_s=r.ttft_s, service_s=r.e2e_s,
                prompt_tokens=r.prompt_tokens, output_tokens=len(r.output_ids),
                prefilled_tokens=r.prefilled_tokens, reused_tokens=r.reused_tokens,
                eligible_tokens=r.eligible_tokens, reference_tokens=r.reference_tokens,
                recomputed_token_layers=r.recomputed_token_layers, layers=self.engine.n_layers,
                kv_bytes=r.kv_bytes, shared_store_bytes=store_bytes, method_state_bytes=state,
                kv_state_bytes=r.kv_bytes + store_bytes + state, peak_rss_bytes=r.peak_rss_bytes,
                device_peak_bytes=r.device_peak_bytes,
                segments=[{k: v for k, v in s.items() if k != "kv_rel_error_per_layer"} for s in r.segments]))
        return out
