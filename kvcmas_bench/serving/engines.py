"""Serving engines as plugins: a registry of engines that serve traces and return timelines.

An engine takes a method, the evaluated trajectories and an arrival schedule per QPS, and returns
*served timelines*: every request with its arrival, first-token and completion times
(:class:`ServeResult`). How it gets them is its own business: the in-process engine measures
every request once, in isolation, on :class:`~kvcmas_bench.engine.Engine` and replays those
service times on a virtual-clock FCFS server (:func:`~.queueing.replay`); a batching engine serves
the arrivals for real. Register a new one with :func:`register_engine`; ``serve-sweep --engine``
picks it by name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from .. import memory
from ..engine import Engine
from ..errors import BenchError
from ..methods import Method, MethodSpec
from ..registry import Registry
from ..results.request import RequestRecord
from ..workflow import Node, UnitRun, execute, request_records
from ..workloads.base import Role
from .queueing import SERVER_MODEL, replay
from .traces import Trace

#: a QPS value -> trajectory start times (None: single stream, each trajectory after the last)
Schedules = Mapping[float, Sequence[float] | None]
#: called by engines that serve live (not replayed) with each QPS point's records as soon as it is
#: complete, so a sweep can write them ahead of its end
OnPoint = Callable[[float, list[RequestRecord]], None]


@dataclass
class ServeResult:
    """What an engine returns for one method on one set of trajectories."""

    #: per QPS value: every request of every trajectory, timeline fields set
    timelines: dict[float, list[RequestRecord]]
    #: isolated measurements ``[trajectory][agent]`` when the engine replays them (else None)
    service: list[list[RequestRecord]] | None = None


@runtime_checkable
class ServingEngine(Protocol):
    """An engine that serves trace requests.

    ``prepare`` builds the method from ``spec`` (calibrating it on the held-out ``calibration``
    trajectories when it needs it, and warming it up); ``serve`` returns the served timelines.
    ``describe`` goes into the sweep's config (it must hold ``device``). ``tokenizer`` builds the
    traces; ``max_positions`` and ``vocab_size`` (None if unknown) bound them. Backends with
    ``replays_service = True`` also return isolated measurements and provide ``replay(service,
    schedules)``, so a resumed sweep or a re-sweep at other QPS needs no model.
    """

    name: str
    server: str
    replays_service: bool
    model_name: str | None
    model_source: str | None
    tokenizer: object
    max_positions: int | None
    vocab_size: int | None

    def describe(self) -> dict: ...

    def prepare(self, spec: MethodSpec, calibration: Sequence[Trace]) -> Method: ...

    def serve(
        self, method: Method, traces: Sequence[Trace], schedules: Schedules, on_point: OnPoint | None = None
    ) -> ServeResult: ...


class EngineLost(BenchError):
    """The engine (a server) went away or broke off a response mid-sweep: the request failed."""


#: engine name (a ``serve-sweep --engine`` value) -> engine factory, filled by :func:`register_engine`
ENGINES: Registry[Callable[..., ServingEngine]] = Registry("engine")
#: engine name -> ``why_not(method_class) -> str | None``: methods the engine cannot run
ENGINE_LIMITS: dict[str, Callable[[type[Method]], str | None]] = {}


def register_engine(name: str, why_not: Callable[[type[Method]], str | None] | None = None):
    """Register ``factory(model=None, device="auto", dtype="float32", ignore_eos=True, warmup=True,
    **engine_options)``. ``why_not(method_class)`` names why the engine cannot run a method (None:
    it can); :func:`check_engine` asks it before any model loads."""

    def deco(factory: Callable[..., ServingEngine]) -> Callable[..., ServingEngine]:
        ENGINES.register(factory, name=name)
        if why_not is not None:
            ENGINE_LIMITS[name] = why_not
        return factory

    return deco


def check_engine(name: str, methods: Mapping[str, MethodSpec] | Sequence[type[Method]]) -> None:
    """Refuse an unknown engine, or methods it cannot run, with one line (before a model loads)."""
    ENGINES.lookup(name)
    why_not = ENGINE_LIMITS.get(name)
    classes = [m.cls for m in methods.values()] if isinstance(methods, Mapping) else list(methods)
    bad = [(c.name, why_not(c)) for c in classes] if why_not is not None else []
    bad = [(n, w) for n, w in bad if w]
    if bad:
        raise BenchError(
            f"--engine {name} cannot run {', '.join(n for n, _ in bad)}: {bad[0][1]}; "
            "use --engine in-process for these methods"
        )


def get_engine(name: str, **options) -> ServingEngine:
    """An engine built by the factory registered as ``name`` (one ``BenchError`` line when unknown)."""
    return ENGINES.lookup(name)(**options)


def replay_all(service: list[list[RequestRecord]], schedules: Schedules) -> dict[float, list[RequestRecord]]:
    return {q: replay(service, None if arr is None else list(arr), q) for q, arr in schedules.items()}


# ---- the in-process engine -------------------------------------------------------------------------
def calibrated(spec: MethodSpec, held: Sequence[Trace], flow: Callable, n_layers: int) -> Method:
    """A fresh instance of ``spec``, calibrated when it needs it on the held-out trajectories of split
    "calibration", each run through ``flow(recorder)`` (the engine's own flow)."""
    from ..calibration import collect

    m = spec()
    calibration = [t for t in held if t.split == "calibration"]
    if m.needs_calibration:
        if not calibration:
            raise BenchError(f"method {spec.name!r} needs calibration trajectories (none given)")
        obs = collect(flow, calibration, with_reference=m.calibration_reference)
        if not obs:
            raise BenchError("calibration produced no observations (no shared segment with a source)")
        m.calibrate(obs, n_layers)
    return m


def trace_nodes(trace: Trace) -> list[Node]:
    """A trajectory as an agent graph: a chain in which every agent reads every earlier output.
    Node ids are the agent names, so ``out:<agent>`` slots match the trace's segment specs; the
    roles' text is already inside the trace's PF ids."""
    return [
        Node(a.name, Role(a.name, "", ""), list(range(i)), set(range(i)), final=i == len(trace.agents) - 1)
        for i, a in enumerate(trace.agents)
    ]


class TraceFlow:
    """Runs serving trajectories through the one executor (:func:`~kvcmas_bench.workflow.execute`)."""

    def __init__(self, engine: Engine, method, fidelity: bool = False):
        self.engine = engine
        self.method = method
        self.fidelity = fidelity

    def run_unit(self, trace: Trace) -> UnitRun:
        def build(idx, node, sources, outputs):
            return trace.request(idx, outputs, {slot: kv.agent for slot, kv in sources.items()})

        steps = execute(self.engine, self.method, trace_nodes(trace), build, self.fidelity, decode=lambda ids: "")
        return UnitRun(trace.id, steps)


class InProcessEngine:
    """Measure each request for real on the in-process engine (one request at a time), then replay
    the measured service times under every arrival schedule."""

    name = "in-process"
    server = SERVER_MODEL
    replays_service = True

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer=None,
        ignore_eos: bool = True,
        warmup: bool = True,
        model_name: str | None = None,
        model_source: str | None = None,
    ):
        self.engine = Engine(model, tokenizer)
        self.ignore_eos = ignore_eos
        self.warmup = warmup
        self.model_name = model_name
        self.model_source = model_source
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

    @property
    def kv_width(self) -> int:
        """The K/V row width (kv_heads x head_dim) of the anchors' factorizations."""
        return self.engine.n_kv * self.engine.head_dim

    def describe(self) -> dict:
        return {
            "name": self.name,
            "engine": "kvcmas_bench.engine.Engine (one request at a time)",
            "device": str(self.engine.device),
            "dtype": str(self.engine.dtype).replace("torch.", ""),
            "ignore_eos": self.ignore_eos,
            "warmup": self.warmup,
            "prefix_caching": False,
            "decoding": "greedy",
            "rss_peak_reset_per_method": self.rss_reset,
        }

    def run_trajectory(self, trace: Trace, method) -> UnitRun:
        return TraceFlow(self.engine, method).run_unit(trace)

    def prepare(self, spec: MethodSpec, calibration: Sequence[Trace]) -> Method:
        """A fresh method instance: calibrated on the held-out ``calibration`` trajectories of split
        "calibration" when it needs it, then warmed up.

        Warm-up (unmeasured): methods with online state (anchor pools) run all held-out
        trajectories (calibration and "warmup" splits) so their pools are in steady state; every
        other method runs one request so one-off initialisation stays out of the timings.
        """
        held = list(calibration)
        m = calibrated(spec, held, lambda rec: TraceFlow(self.engine, rec), self.engine.n_layers)
        if self.warmup and held:
            if m.learns_online:
                for tr in held:
                    self.run_trajectory(tr, m)
            else:
                self.engine.run(held[0].request(0, {}), m, keep_output_kv=False)
        self.rss_reset = memory.reset_peaks(self.engine.device)
        return m

    def measure(self, trace: Trace, method) -> list[RequestRecord]:
        return request_records(self.run_trajectory(trace, method), self.engine.n_layers, trajectory=trace.id)

    def serve(
        self, method: Method, traces: Sequence[Trace], schedules: Schedules, on_point: OnPoint | None = None
    ) -> ServeResult:
        """Measure each trajectory once, replay every point (``service.jsonl`` is the sweep's
        write-ahead record here, so ``on_point`` is not called)."""
        service = [self.measure(tr, method) for tr in traces]
        return ServeResult(replay_all(service, schedules), service)

    replay = staticmethod(replay_all)


@register_engine("in-process")
def in_process(
    model=None, device: str = "auto", dtype: str = "float32", ignore_eos: bool = True, warmup: bool = True, **options
) -> InProcessEngine:
    """This package's engine: each request measured once in isolation, FCFS replay per QPS.

    ``model``: None/spec string for :func:`~kvcmas_bench.modeling.load_model`, or a loaded
    :class:`~kvcmas_bench.modeling.LoadedModel` (tests pass a tiny model this way). It takes no
    engine options (``--engine-arg``).
    """
    if options:
        raise BenchError(f"--engine in-process takes no --engine-arg (got {', '.join(sorted(options))})")
    if model is None or isinstance(model, str):
        from ..modeling import load_model, resolve_device, resolve_dtype

        resolve_dtype(dtype)
        model = load_model(model, dtype, str(resolve_device(device)))
    return InProcessEngine(
        model.model,
        model.tokenizer,
        ignore_eos=ignore_eos,
        warmup=warmup,
        model_name=model.name,
        model_source=model.source,
    )
