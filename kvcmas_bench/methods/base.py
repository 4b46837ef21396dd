"""The method interface: one dataclass per method, one override point (``materialize``).

For every shared (PH) segment of a target agent's request, the engine builds a
:class:`~kvcmas_bench.engine.SegmentContext` (the segment, its position, the source agent's
materialized cache of the same slot if any, and handles to ask the engine for a dense prefill,
a context-free reference, or deferred work) and asks the method for the segment's cache. What the
method returns is written into the request's cache and becomes the source of the next edge.

Knobs are data: a method's init fields are its options (``knobs()``), each validated by the
method itself in ``validate`` (raising :class:`~kvcmas_bench.errors.OptionError`). Fields marked
``state()`` hold what the method learns (anchor pools, calibration tables): they are not options.
Methods with state report its exact size through ``state_bytes``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..engine import SegmentContext
from ..errors import BenchError, OptionError
from ..registry import Registry
from ..segments import KVCache, SegmentKV

#: name -> method class, filled by ``@register`` as the method modules are imported
METHODS: Registry[type[Method]] = Registry("method")


def register(cls: type[Method] | None = None, *, name: str | None = None):
    """Register a method class (``@register``, or ``@register(name="x")``), made a dataclass first
    unless it is one already: its knobs are its fields."""

    def deco(c: type[Method]) -> type[Method]:
        if "__dataclass_fields__" not in c.__dict__:
            c = dataclasses.dataclass(c)
        return METHODS.register(c, name=name)

    return deco if cls is None else deco(cls)


def state(default=dataclasses.MISSING, *, init: bool = False, **kw):
    """A dataclass field holding learned state, not a user option (excluded from ``knobs()``)."""
    if default is dataclasses.MISSING and "default_factory" not in kw:
        raise TypeError("state() needs a default or a default_factory")
    if default is not dataclasses.MISSING:
        kw["default"] = default
    return dataclasses.field(init=init, repr=False, metadata={"state": True}, **kw)


def check(ok: bool, knob: str, message: str) -> None:
    """Raise the user-facing option error about ``knob`` when ``ok`` is false. ``message`` says what
    the value must be (``must lie in [0, 1], got 2``); the command line names the knob the way the
    user gave it (``--tau``, ``--method-arg check-layer=-1``)."""
    if not ok:
        raise OptionError(message, knob=knob)


@dataclass
class PromptPiece:
    """One span of a prompt in a whole-prompt pass (:meth:`Method.materialize_prompt`): rows
    ``start .. start + length`` with their input embeddings ``x`` (``[1, S, hidden]``), and ``old``,
    the aligned source K/V the method may reuse (None: every row computed at every layer)."""

    start: int
    x: torch.Tensor
    old: SegmentKV | None = None
    #: set by the pass: "exact" (computed), "recomputed" (partly) or "reused" (as is)
    status: str = "exact"
    #: set by the pass: (token, layer) entries of a reused piece it recomputed
    recomputed_token_layers: int = 0

    @property
    def length(self) -> int:
        return self.x.shape[1]


@dataclass
class Method:
    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    # How tables and figures show the method (read from the class itself, not inherited: a
    # registered subclass sets its own); see ``methods.method_order``/``method_labels``/``method_colors``.
    #: display name (default: ``name``)
    label: ClassVar[str] = ""
    #: row position in tables, lower first (None: after the ordered ones, as registered)
    order: ClassVar[float | None] = None
    #: matplotlib colour, the same in every figure ("": the next free ``C<i>``)
    color: ClassVar[str] = ""
    #: the line's name in the chained vs non-chained TTFT figure (""; not drawn there)
    chain_label: ClassVar[str] = ""
    #: offline profiling needed before evaluation (see ``calibrate``)
    needs_calibration: ClassVar[bool] = False
    #: calibration observations should include the context-free reference cache
    calibration_reference: ClassVar[bool] = False
    #: learns across requests (anchor pools): warmed up on held-out units before measurement
    learns_online: ClassVar[bool] = False
    #: where reused caches come from: "source" (the preceding agent's cache of the segment, so only
    #: segments with a source are reuse-eligible) or "reference" (a context-free prefill of the
    #: segment: every shared segment is eligible, the first agent's included)
    reuse_from: ClassVar[str] = "source"
    #: state fields that calibration rebuilds before every run (not persisted for resume)
    calibrated_state: ClassVar[tuple[str, ...]] = ()
    #: residual-stream layers the engine keeps for agent outputs during decode (as sources)
    decode_hidden_layers: ClassVar[tuple[int, ...]] = ()
    #: needs partial forwards through the model's layers (selective recomputation): only engines
    #: that expose their layers (in-process; the vLLM server's worker) can run it; others refuse it
    needs_model_internals: ClassVar[bool] = False
    #: enters layers with the source's residual stream (hidden states its prefill and decode kept):
    #: engines whose forward exposes no hidden states (vLLM) refuse it
    needs_source_hidden: ClassVar[bool] = False
    #: knobs whose None has a word of its own on the command line besides ``none`` (rank: ``full``)
    none_words: ClassVar[dict[str, str]] = {}

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check the knobs' values; raise :class:`OptionError` with a message naming the knob."""

    @classmethod
    def knobs(cls) -> dict[str, dataclasses.Field]:
        """The method's options: its init fields that are not learned state."""
        return {f.name: f for f in dataclasses.fields(cls) if f.init and not f.metadata.get("state")}

    @classmethod
    def workload_defaults(cls, workload) -> dict:
        """Knob defaults that depend on the workload (e.g. the paper's per-workload tau)."""
        return {}

    def materialize(self, ctx: SegmentContext) -> SegmentKV:
        """Return the cache of ``ctx.segment`` at ``ctx.start``. Default: dense prefill."""
        return ctx.dense()

    def materialize_prompt(self, engine, cache: KVCache, pieces: list[PromptPiece]) -> None:
        """Write every piece of a prompt into ``cache`` in one pass through the layers, for an engine
        that plans a prompt whole (the vLLM server's worker, for methods that need partial forwards)."""
        raise BenchError(f"{self.name} has no whole-prompt pass; it runs on the in-process engine only")

    def eligible(self, has_source: bool) -> bool:
        """Whether a shared segment counts in the reuse ratio's denominator: a property of the
        method family and the segment, fixed before the method runs (never of its outcome)."""
        return has_source or self.reuse_from == "reference"

    def counters(self) -> dict[str, int]:
        """Running totals of the method's accounting (accepted corrections, fallbacks, anchors
        inserted/evicted, ...); the executor records their change over each request."""
        return {}

    def check_model(self, n_layers: int) -> None:
        """Refuse knobs the model cannot satisfy (a layer index past its ``n_layers``) with an
        :class:`OptionError`; called once the model's config is read, before its weights load."""

    def calibrate(self, observations: list, n_layers: int) -> None:
        """Build offline state from :class:`~kvcmas_bench.calibration.Observation` records."""

    def state_bytes(self) -> int:
        """Exact bytes of tensors the method keeps between requests."""
        return 0

    def persistent_state(self) -> dict:
        """What the method learned while running (``state()`` fields not set at construction and not
        rebuilt by calibration): saved with every committed sample so a resumed run continues
        exactly as an uninterrupted one."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.metadata.get("state") and not f.init and f.name not in self.calibrated_state
        }

    def load_persistent_state(self, state: dict) -> None:
        names = {f.name for f in dataclasses.fields(self) if f.metadata.get("state")}
        for key, value in state.items():
            if key not in names:
                raise ValueError(f"{self.name} has no state field {key!r}")
            setattr(self, key, value)

    def resolved(self, device, width: int | None = None) -> dict:
        """Knobs whose value "auto" (or similar) stands for a choice made per ``device`` (and the model's
        K/V row ``width``, kv_heads x head_dim, where known): the choice made, recorded beside
        ``method_config`` (``method_resolved`` in ``config.json``). Default: none."""
        return {}

    def config(self) -> dict:
        """Name and every init field (knobs and settable state), as recorded in ``config.json``."""
        return {"name": self.name, **{f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}}
