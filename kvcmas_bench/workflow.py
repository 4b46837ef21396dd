"""Agent workflows: role prompts over one model, chained through shared (PH) segments.

Each agent's prompt follows the paper's convention ``[PF_sys, PH_q, PF_glue0, PH_out0, ..., PF_tail]``:
the chat template is rendered once with markers where the shared parts go, the text between
markers is tokenized as PF segments and the shared parts are inserted as token ids (PH_q tokenized
once per sample, PH_out_k = the ids agent k generated), so every boundary is token-exact and a PH
segment has the same ids in every agent.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from .engine import Engine
from .results.request import RequestRecord
from .segments import Request, RequestResult, Segment, SegmentKV
from .workloads.base import Role, Sample, Workload

_MARK = "\x00{}\x00"
_MARK_RE = re.compile("\x00(\\d+)\x00")


@dataclass
class SharedRef:
    """A placeholder for a PH segment inside an agent's user turn."""

    slot: str


def render_segments(
    tokenizer, system: str, parts: list[str | SharedRef], shared_ids: dict[str, list[int]], sources: dict[str, str]
) -> list[Segment]:
    """Chat-template an agent turn and split it into token-exact PF/PH segments."""
    refs: list[SharedRef] = []
    content = ""
    for p in parts:
        if isinstance(p, SharedRef):
            content += _MARK.format(len(refs))
            refs.append(p)
        else:
            content += p
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": content}],
            tokenize=False,
            add_generation_prompt=True,
        )
    except Exception:  # noqa: BLE001 - templates without a system role raise template errors
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": system + "\n\n" + content}], tokenize=False, add_generation_prompt=True
        )
    pieces = _MARK_RE.split(text)
    segments: list[Segment] = []
    for i, piece in enumerate(pieces):
        if i % 2 == 0:
            ids = tokenizer(piece, add_special_tokens=False)["input_ids"] if piece else []
            if segments and segments[-1].kind == "PF":
                segments[-1].ids.extend(ids)
            else:
                segments.append(Segment("PF", list(ids), name="sys" if i == 0 else f"glue{i // 2}"))
        else:
            slot = refs[int(piece)].slot
            if not shared_ids[slot]:
                continue
            segments.append(Segment("PH", list(shared_ids[slot]), slot=slot, source=sources.get(slot)))
    segments[-1].name = "tail"
    return segments


TOPOLOGIES = ("chain", "fan-out", "fan-in", "loop")


@dataclass
class Node:
    """One agent execution: its role, whose outputs it reads, and its ancestors (possible sources)."""

    id: str
    role: Role
    reads: list[int]
    ancestors: set[int]
    final: bool = False


def plan(topology: str, task_roles: tuple[Role, ...], final_role: Role, agents: int, rounds: int) -> list[Node]:
    """Execution order of an agent graph of ``agents`` agents (the last one is the final agent).

    chain   : task agents in sequence, each reading every earlier output; ``rounds`` repeats them.
    loop    : task agents in a cycle for ``rounds`` rounds, each reading the previous cycle's outputs.
    fan-out : the first task agent, then the others in parallel reading only its output; the
              parallel layer repeats ``rounds`` times, reading the previous layer.
    fan-in  : task agents in parallel on the query alone (``rounds`` layers, each reading the
              previous layer), then the final agent reads them all.
    The final agent reads the outputs of the last layer (chain: all outputs).
    """
    if topology not in TOPOLOGIES:
        from .errors import BenchError

        raise BenchError(f"unknown --topology {topology!r}; use one of {', '.join(TOPOLOGIES)}")
    n_task = agents - 1
    roles = [task_roles[i % len(task_roles)] for i in range(n_task)]
    nodes: list[Node] = []

    def add(role: Role, reads: list[int], final: bool = False) -> int:
        anc = set(reads)
        for r in reads:
            anc |= nodes[r].ancestors
        nodes.append(Node(f"{role.name}#{len(nodes)}", role, reads, anc, final))
        return len(nodes) - 1

    last_layer: list[int] = []
    if topology == "chain":
        for _ in range(rounds):
            for role in roles:
                add(role, list(range(len(nodes))))
        last_layer = list(range(len(nodes)))
    elif topology == "loop":
        prev: list[int] = []
        for _ in range(rounds):
            layer = []
            for i, role in enumerate(roles):
                reads = prev[i:] + layer  # the last n_task outputs, oldest first
                layer.append(add(role, reads))
            prev = layer
        last_layer = prev
    elif topology == "fan-out":
        root = add(roles[0], [])
        prev = [root]
        others = roles[1:] or roles[:1]
        for _ in range(rounds):
            prev = [add(role, list(prev)) for role in others]
        last_layer = [root] + prev if rounds == 1 else prev
    else:  # fan-in
        prev = []
        for _ in range(rounds):
            prev = [add(role, list(prev)) for role in roles]
        last_layer = prev
    add(final_role, last_layer, final=True)
    return nodes


def out_slot(node: Node) -> str:
    return f"out:{node.id}"


@dataclass
class AgentStep:
    """One executed node: its request and result, what it generated, and the bytes held when it
    finished (the shared-segment store kept as sources, and the method's own state)."""

    node: Node
    request: Request
    result: RequestResult
    text: str
    shared_store_bytes: int = 0
    method_state_bytes: int = 0
    #: change of the method's counters over this request (accepted, fallbacks, anchors, ...)
    method_stats: dict = field(default_factory=dict)

    @property
    def role(self) -> Role:
        return self.node.role


@dataclass
class UnitRun:
    """One unit of work (a benchmark sample or a serving trajectory) run through the agent graph."""

    unit_id: str
    steps: list[AgentStep] = field(default_factory=list)
    #: visual tokens of the sample (VLM workloads): kind, tokens, vision-encoder seconds
    visual: dict | None = None

    @property
    def final_text(self) -> str:
        return self.steps[-1].text


#: ``build(index, node, sources, outputs)`` -> the node's request; ``sources`` maps a shared slot to
#: the cache it reuses, ``outputs`` maps every executed node id to its generated token ids
BuildRequest = Callable[[int, Node, dict[str, SegmentKV], dict[str, list[int]]], Request]


def execute(
    engine: Engine, method, nodes: Sequence[Node], build: BuildRequest, fidelity: bool = False, decode=None
) -> list[AgentStep]:
    """Run every node in order: the one place that chains sources along the agent graph.

    The source of each shared slot is its most recent materialization among the node's ancestors
    (the predecessor on the workflow edge; for an agent output, the producer's decode-phase cache),
    so corrections chain along edges and each incoming segment at a fan-in keeps its own source.
    ``decode(ids)`` turns generated ids into text (default: the engine's tokenizer).
    """
    decode = decode or (lambda ids: engine.tokenizer.decode(ids, skip_special_tokens=True))
    store: dict[str, list[tuple[int, SegmentKV]]] = {}  # slot -> (node index, cache), in order
    outputs: dict[str, list[int]] = {}
    steps: list[AgentStep] = []
    for idx, node in enumerate(nodes):
        sources = _sources(store, node)
        req = build(idx, node, sources, outputs)
        req.node = node.id
        before = method.counters()
        res = engine.run(req, method, sources=sources, fidelity=fidelity)
        for slot, kv in res.materialized.items():
            store.setdefault(slot, []).append((idx, kv))
        if res.output_kv is not None:
            res.output_kv.slot = out_slot(node)
            store.setdefault(out_slot(node), []).append((idx, res.output_kv))
        outputs[node.id] = list(res.output_ids)
        after = method.counters()
        steps.append(
            AgentStep(
                node,
                req,
                res,
                decode(res.output_ids),
                shared_store_bytes=sum(kv.nbytes for h in store.values() for _, kv in h),
                method_state_bytes=method.state_bytes(),
                method_stats={k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)},
            )
        )
    return steps


def _sources(store: dict[str, list[tuple[int, SegmentKV]]], node: Node) -> dict[str, SegmentKV]:
    sources: dict[str, SegmentKV] = {}
    for slot, hist in store.items():
        for producer, kv in reversed(hist):
            if producer in node.ancestors:
                sources[slot] = kv
                break
    return sources


class Workflow:
    """Runs benchmark samples through an agent graph (:func:`plan`) with one method."""

    def __init__(
        self,
        engine: Engine,
        method,
        workload: Workload,
        max_new_tokens: int | None = None,
        final_max_new_tokens: int | None = None,
        fidelity: bool = False,
        topology: str = "chain",
        agents: int | None = None,
        rounds: int = 1,
    ):
        self.engine = engine
        self.tok = engine.tokenizer
        self.method = method
        self.workload = workload
        self.max_new = max_new_tokens or workload.max_new_tokens
        self.final_max_new = final_max_new_tokens or workload.final_max_new_tokens
        self.fidelity = fidelity
        self.topology = topology
        self.n_agents = agents or len(workload.roles) + 1
        self.rounds = rounds
        self.nodes = plan(topology, workload.roles, workload.final_role, self.n_agents, rounds)

    def agents(self) -> list[tuple[Role, int]]:
        return [(n.role, self.final_max_new if n.final else self.max_new) for n in self.nodes]

    def user_parts(self, node: Node) -> list[str | SharedRef]:
        parts: list[str | SharedRef] = ["Task:\n", SharedRef("q")]
        for r in node.reads:
            up = self.nodes[r]
            parts += [f"\n\nAnalysis from the {up.role.name}:\n", SharedRef(out_slot(up))]
        parts.append("\n\n" + node.role.instruction)
        return parts

    def request(self, node: Node, segments: list[Segment]) -> Request:
        return Request(node.role.name, segments, self.final_max_new if node.final else self.max_new)

    def query_ids(self, sample: Sample) -> list[int]:
        return self.tok(sample.query, add_special_tokens=False)["input_ids"]

    def build(self, node: Node, q_ids: list[int], outputs: dict[str, list[int]], sources: dict[str, str]) -> Request:
        """``node``'s request: its role's prompt around the query and the outputs it reads (by node
        id), each shared segment labelled with the agent its cache comes from (``sources``)."""
        shared = {"q": q_ids, **{out_slot(self.nodes[i]): outputs[self.nodes[i].id] for i in node.reads}}
        segments = render_segments(self.tok, node.role.system, self.user_parts(node), shared, sources)
        return self.request(node, segments)

    def run_sample(self, sample: Sample) -> UnitRun:
        q_ids = self.query_ids(sample)

        def build(idx, node, sources, outputs):
            return self.build(node, q_ids, outputs, {slot: kv.agent for slot, kv in sources.items()})

        return UnitRun(sample.id, execute(self.engine, self.method, self.nodes, build, self.fidelity))

    run_unit = run_sample


def request_records(run: UnitRun, layers: int, **ids) -> list[RequestRecord]:
    """One :class:`RequestRecord` per executed node of ``run`` (``ids``: sample or trajectory keys)."""
    return [step_record(step, i, layers, **ids) for i, step in enumerate(run.steps)]


def step_record(step: AgentStep, i: int, layers: int, **ids) -> RequestRecord:
    """The :class:`RequestRecord` of ``step``, the ``i``-th executed node of its run (a serving engine
    records each step as it finishes, without going over the earlier ones again): the engine's
    record of the request with the step's own fields (``ids``: sample or trajectory keys)."""
    r = step.result.record
    return replace(
        r,
        agent=step.role.name,
        step=i,
        node=step.node.id,
        **ids,
        layers=layers,
        shared_store_bytes=step.shared_store_bytes,
        method_state_bytes=step.method_state_bytes,
        kv_state_bytes=r.kv_bytes + step.shared_store_bytes + step.method_state_bytes,
        output=step.text,
        method_stats=dict(step.method_stats),
    )
