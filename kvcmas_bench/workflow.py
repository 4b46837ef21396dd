"""Agent workflows: role prompts over one model, chained through shared (PH) segments.

Each agent's prompt follows the paper's convention ``[PF_sys, PH_q, PF_glue0, PH_out0, ..., PF_tail]``:
the chat template is rendered once with markers where the shared parts go, the text between
markers is tokenized as PF segments and the shared parts are inserted as token ids (PH_q tokenized
once per sample, PH_out_k = the ids agent k generated), so every boundary is token-exact and a PH
segment has the same ids in every agent.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .engine import Engine, Request, RequestResult, Segment, SegmentKV
from .workloads.base import Role, Sample, Workload

_MARK = "\x00{}\x00"
_MARK_RE = re.compile("\x00(\\d+)\x00")


@dataclass
class SharedRef:
    """A placeholder for a PH segment inside an agent's user turn."""

    slot: str


def render_segments(tokenizer, system: str, parts: list[str | SharedRef],
                    shared_ids: dict[str, list[int]], sources: dict[str, str]) -> list[Segment]:
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
            tokenize=False, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - templates without a system role raise template errors
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": system + "\n\n" + content}], tokenize=False,
            add_generation_prompt=True)
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


@dataclass
class AgentStep:
    role: Role
    result: RequestResult
    text: str


@dataclass
class SampleRun:
    sample: Sample
    steps: list[AgentStep] = field(default_factory=list)

    @property
    def final_text(self) -> str:
        return self.steps[-1].text


def out_slot(role: Role) -> str:
    return f"out:{role.name}"


class ChainWorkflow:
    """Sequential chain: task agents in order, each reading the query and all earlier outputs,
    then the final agent. The source of each PH segment is the agent that materialized the slot
    most recently (the predecessor on the workflow edge), so corrections chain along the edges."""

    def __init__(self, engine: Engine, method, workload: Workload, max_new_tokens: int | None = None,
                 final_max_new_tokens: int | None = None, fidelity: bool = False):
        self.engine = engine
        self.tok = engine.tokenizer
        self.method = method
        self.workload = workload
        self.max_new = max_new_tokens or workload.max_new_tokens
        self.final_max_new = final_max_new_tokens or workload.final_max_new_tokens
        self.fidelity = fidelity

    def agents(self) -> list[tuple[Role, int]]:
        return [(r, self.max_new) for r in self.workload.roles] + [(self.workload.final_role, self.final_max_new)]

    def user_parts(self, role: Role, upstream: list[Role]) -> list[str | SharedRef]:
        parts: list[str | SharedRef] = ["Task:\n", SharedRef("q")]
        for up in upstream:
            parts += [f"\n\nAnalysis from the {up.name}:\n", SharedRef(out_slot(up))]
        parts.append("\n\n" + role.instruction)
        return parts

    def run_sample(self, sample: Sample) -> SampleRun:
        shared_ids = {"q": self.tok(sample.query, add_special_tokens=False)["input_ids"]}
        store: dict[str, SegmentKV] = {}
        run = SampleRun(sample)
        upstream: list[Role] = []
        for role, max_new in self.agents():
            parts = self.user_parts(role, upstream)
            sources = {slot: kv.agent for slot, kv in store.items()}
            segs = render_segments(self.tok, role.system, parts, shared_ids, sources)
            req = Request(role.name, segs, max_new)
            res = self.engine.run(req, self.method, sources=dict(store), fidelity=self.fidelity)
            store.update(res.materialized)
            if res.output_kv is not None:
                res.output_kv.slot = out_slot(role)
                store[out_slot(role)] = res.output_kv
            shared_ids[out_slot(role)] = list(res.output_ids)
            res.shared_store_bytes = sum(kv.nbytes for kv in store.values())  # type: ignore[attr-defined]
            text = self.tok.decode(res.output_ids, skip_special_tokens=True)
            run.steps.append(AgentStep(role, res, text))
            upstream.append(role)
        return run
