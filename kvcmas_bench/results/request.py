"""The one request record: what every job writes to ``requests.jsonl`` and every reader reads.

A :class:`RequestRecord` is one agent request: who ran it (sample or trajectory, node, agent), what
it cost (TTFT, E2E, token counts, bytes, peak memory), how every segment of its prompt was
materialized (:class:`SegmentRecord`), the method's accounting during the request, and, when
measured, its fidelity against dense prefill. ``run`` writes one per agent request; ``serve-sweep``
writes one per measured request (``service.jsonl``) and one per served request under load
(``requests.jsonl``, with the timeline fields set). Summaries, the queueing replay and reports read
them back with :meth:`RequestRecord.from_dict`.
"""

from __future__ import annotations

import functools
import math
import typing
from dataclasses import asdict, dataclass, field, fields

from ..ops.gate_outcome import GateOutcome
from ..settings import field_type


@dataclass
class SegmentRecord:
    """How one prompt segment was materialized.

    ``status``: ``exact`` (prefilled densely), ``reused`` (aligned source as is), ``corrected``
    (delta correction applied), ``recomputed`` (selective recomputation). ``eligible``: the segment
    counts in the reuse-ratio denominator. ``gate``: what the delta methods' gate decided (None for
    segments no gate saw), written as its string value. ``details``: method accounting of this
    segment (gate entropy, comparison prefix, anchors used, ...).

    A ``"gate"`` key of ``details`` moves into ``gate``: the methods record the outcome there, in
    ``SegmentContext.details``, and records written before the field existed kept it only there.
    """

    kind: str
    tokens: int
    status: str = "exact"
    name: str | None = None
    slot: str | None = None
    source_agent: str | None = None
    source_node: str | None = None
    eligible: bool = False
    reused_tokens: int = 0
    prefilled_tokens: int = 0
    reference_tokens: int = 0
    recomputed_token_layers: int = 0
    #: wall time of the method's decision and materialization (inside TTFT; CUDA-synchronized)
    materialize_s: float | None = None
    #: fidelity (with --fidelity): relative error against the rows of a full dense prefill of the
    #: same prompt, overall, K, V and per layer
    kv_rel_error: float | None = None
    k_rel_error: float | None = None
    v_rel_error: float | None = None
    kv_rel_error_per_layer: list[float] | None = None
    #: the error this segment's own materialization adds: against a dense prefill of the segment over
    #: the cache as the method built it (0 for a dense segment, whatever came before)
    local_kv_rel_error: float | None = None
    gate: GateOutcome | None = None
    details: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if "gate" in self.details:
            details = dict(self.details)
            recorded = details.pop("gate")
            if self.gate is not None and recorded != self.gate:
                raise ValueError(f"gate {self.gate!r} and details gate {recorded!r} differ")
            self.gate, self.details = recorded, details
        if self.gate is not None:
            self.gate = GateOutcome(self.gate)  # a string from a file; an unknown one raises ValueError

    def to_dict(self) -> dict:
        d = _compact(asdict(self), keep=("status",) if self.kind == "PF" else ("status", "source_agent"))
        if self.gate is not None:
            d["gate"] = self.gate.value
        return d

    @classmethod
    def from_dict(cls, d: dict) -> SegmentRecord:
        return _build(cls, d)


@dataclass
class RequestRecord:
    """One agent request of a run or a sweep (see the module docstring)."""

    agent: str
    ttft_s: float
    e2e_s: float
    #: seconds of work after the first token before decode (anchor construction), inside e2e_s
    deferred_s: float | None = None
    sample_id: str | None = None
    step: int | None = None
    node: str | None = None
    method: str | None = None
    trajectory: str | None = None
    shared_tokens: int | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    prefilled_tokens: int = 0
    reused_tokens: int = 0
    eligible_tokens: int = 0
    reference_tokens: int = 0
    recomputed_token_layers: int = 0
    layers: int = 0
    kv_bytes: int = 0
    shared_store_bytes: int = 0
    method_state_bytes: int = 0
    kv_state_bytes: int = 0
    peak_rss_bytes: int | None = None
    device_peak_bytes: int | None = None
    peak_mem_bytes: int | None = None
    segments: list[SegmentRecord] = field(default_factory=list)
    method_stats: dict = field(default_factory=dict)
    output: str | None = None
    #: the greedy first token (also when it is EOS and the output is empty): first-token agreement
    first_token_id: int | None = None
    top1_agree: bool | None = None
    first_token_kl: float | None = None
    kv_rel_error: float | None = None
    # timeline under load (serve-sweep requests.jsonl): seconds on the sweep's clock
    qps: float | None = None
    arrival_s: float | None = None
    start_s: float | None = None
    first_token_s: float | None = None
    completion_s: float | None = None
    queue_s: float | None = None
    service_ttft_s: float | None = None
    service_e2e_s: float | None = None
    #: --engine vllm: seconds from the worker hearing of the request to its plan starting (the
    #: worker's method thread busy with other jobs meanwhile)
    plan_wait_s: float | None = None

    def __post_init__(self) -> None:
        self.segments = [s if isinstance(s, SegmentRecord) else SegmentRecord.from_dict(s) for s in self.segments]
        if self.peak_mem_bytes is None:
            self.peak_mem_bytes = self.device_peak_bytes if self.device_peak_bytes is not None else self.peak_rss_bytes

    @property
    def shared_segments(self) -> list[SegmentRecord]:
        return [s for s in self.segments if s.kind == "PH"]

    def to_dict(self) -> dict:
        d = _compact(asdict(self), keep=("sample_id", "step") if self.sample_id is not None else ())
        d["segments"] = [s.to_dict() for s in self.segments]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> RequestRecord:
        return _build(cls, d)


def _compact(d: dict, keep: tuple[str, ...] = ()) -> dict:
    """Drop unset optional fields (None, empty dicts) so records stay short; ``keep`` stays."""
    return {k: v for k, v in d.items() if k in keep or not (v is None or (isinstance(v, dict) and not v))}


#: fields that are measured durations or counts: a negative value is damage, not a measurement
NON_NEGATIVE = frozenset(
    ("ttft_s", "e2e_s", "deferred_s", "materialize_s", "first_token_id", "tokens")
    + ("kv_rel_error", "k_rel_error", "v_rel_error", "local_kv_rel_error")
)


def _check_type(cls, name: str, value) -> None:
    """``value`` of field ``name`` as its type hint says: a bool, an int (not a bool), a finite number,
    a string, a list or a dict (None where the field is optional); counts, token ids and durations
    not negative. Other field types are checked by their own constructors."""
    if value is None:
        if not field_type(_hints(cls)[name])[1]:
            raise ValueError(f"{name} is missing")
        return
    base = field_type(_hints(cls)[name])[0]
    base = typing.get_origin(base) or base
    ok = {
        bool: lambda v: isinstance(v, bool),
        int: lambda v: isinstance(v, int) and not isinstance(v, bool),
        float: lambda v: isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v),
        str: lambda v: isinstance(v, str),
        list: lambda v: isinstance(v, list),
        dict: lambda v: isinstance(v, dict),
    }.get(base)
    if ok is not None and not ok(value):
        raise ValueError(f"{name} {value!r} is not {_WORDS[base]}")
    if base in (int, float) and value < 0 and (name in NON_NEGATIVE or name.endswith(("_bytes", "_tokens"))):
        raise ValueError(f"{name} {value!r} is negative")


_WORDS = {
    bool: "true or false",
    int: "an integer",
    float: "a finite number",
    str: "a string",
    list: "a list",
    dict: "an object",
}


@functools.cache
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def _build(cls, d: dict):
    names = {f.name for f in fields(cls)}
    unknown = set(d) - names
    if unknown:
        raise ValueError(f"unknown {cls.__name__} field(s): {', '.join(sorted(unknown))}")
    for name, value in d.items():
        _check_type(cls, name, value)
    return cls(**d)


#: segment statuses counted per request in the flat rows (:func:`request_row`)
_SEG_STATUSES = ("exact", "reused", "corrected", "recomputed")


def request_row(rec: RequestRecord) -> dict:
    """One flat row of a request record: scalar fields, plus per-status counts of its shared segments."""
    d = asdict(rec)
    segs = d.pop("segments")
    d.pop("method_stats")
    shared = [s for s in segs if s["kind"] == "PH"]
    d["shared_segments"] = len(shared)
    for status in _SEG_STATUSES:
        d[f"seg_{status}"] = sum(s["status"] == status for s in shared)
    d["seg_statuses"] = ",".join(s["status"] for s in shared)
    # every shared segment with a measured error (a densely prefilled one too: after a corrected
    # segment it differs from the full dense prefill): the
    # definition of ``summary.json``'s fidelity.kv_rel_error (``summary.fidelity_figures``)
    errs = [s["kv_rel_error"] for s in shared if s["kv_rel_error"] is not None]
    d["seg_kv_rel_error_sum"] = float(sum(errs))
    d["seg_kv_rel_error_n"] = len(errs)
    return d
