"""The VLM agent workflow: every agent's user turn opens with the sample's visual PH segment.

Prompt layout (paper Sec. 2.1 with the visual context first, as LLaVA-OneVision's chat template
puts images before the text of a turn)::

    [PF_sys, PH_visual, PF("\\nTask:\\n"), PH_q, PF_glue0, PH_out0, ..., PF_tail]

The chat template is the checkpoint's processor template, rendered with the visual item in place
and the image/video token replaced by a segment marker; the text between markers is tokenized as
PF segments. Because the image and video tokens are special tokens, splitting the text at them is
exactly what whole-string tokenization does, so the visual boundary is token-exact against the
processor.
"""

from __future__ import annotations

from dataclasses import replace

from .engine import Engine
from .errors import BenchError
from .modeling_vlm import VisualInput, VisualProcessor, encode_visual
from .segments import Segment, SegmentKV
from .workflow import _MARK, Node, SharedRef, UnitRun, Workflow, execute, out_slot, render_segments
from .workloads.base import Sample

# ---- rendering ---------------------------------------------------------------------------------


class _VisualChat:
    """Tokenizer stand-in for :func:`render_segments` that renders the checkpoint's multimodal chat
    template: the visual item goes where the template puts images/videos, its token is replaced by
    the segment marker of the visual ``SharedRef`` (index 0, the first user part)."""

    def __init__(self, processor: VisualProcessor, kind: str):
        self.p = processor
        self.kind = kind
        self.marker = _MARK.format(0)

    def __call__(self, text, **kwargs):
        return self.p.tokenizer(text, **kwargs)

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        tok = self.p.tokenizer
        if not self.p.chat_template:  # plain text template: the visual tokens open the user turn
            msgs = [
                {"role": m["role"], "content": m["content"].replace(self.marker, self.marker + "\n", 1)}
                for m in messages
            ]
            out = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=add_generation_prompt)
            if self.marker not in out:
                raise BenchError(
                    "the tokenizer's chat template drops plain-text content; the checkpoint needs "
                    "its processor chat template (chat_template.jinja or chat_template.json)"
                )
            return out
        msgs = []
        for m in messages:
            items: list[dict] = []
            text = m["content"]
            if self.marker in text:
                text = text.replace(self.marker, "", 1)
                items.append({"type": self.kind})
            items.append({"type": "text", "text": text})
            msgs.append({"role": m["role"], "content": items})
        out = tok.apply_chat_template(
            msgs, chat_template=self.p.chat_template, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        token = self.p.token(self.kind)
        if out.count(token) != 1:
            raise BenchError(f"the chat template rendered {out.count(token)} {token} tokens for one {self.kind}")
        return out.replace(token, self.marker)


def _forget_references(method, slot: str) -> None:
    """Drop a method's cached context-free references of ``slot``.

    GraphFlow and the non-chained delta methods cache the reference prefill under
    ``(slot, ids)``; visual placeholder ids are one token repeated, so two different images with
    the same token count would share a key. The workflow calls this whenever the visual content
    changes (see the proposed fix keying references by the segment's embeddings too)."""
    refs = getattr(method, "references", None)
    if isinstance(refs, dict):
        for k in [k for k in refs if isinstance(k, tuple) and k and k[0] == slot]:
            del refs[k]


class VLMWorkflow(Workflow):
    """:class:`Workflow` for LLaVA-OneVision: every agent's user turn opens with the sample's visual
    PH segment (right after PF_sys), then the text task (PH_q) and the upstream outputs. The visual
    segment is one shared slot (``image`` / ``video``) whose source is chained along the workflow
    edges exactly like PH_q. Features are computed once per distinct visual content (cached across
    samples with the same key, e.g. the three questions of one Video-MME video)."""

    def __init__(self, engine: Engine, method, workload, *args, processor: VisualProcessor | None = None, **kw):
        """:class:`Workflow`'s arguments, and the model's ``processor`` of visual inputs."""
        super().__init__(engine, method, workload, *args, **kw)
        if processor is None:
            raise ValueError("VLMWorkflow needs the model's VisualProcessor")
        self.processor = processor
        self._last: VisualInput | None = None

    def user_parts(self, node: Node, kind: str = "image") -> list[str | SharedRef]:
        return [SharedRef(kind)] + super().user_parts(node)

    def visual_input(self, sample: Sample) -> VisualInput:
        loader = getattr(sample, "visual", None)
        if loader is None:
            raise BenchError(f"sample {sample.id} carries no image or video (not a VLM workload sample)")
        key = getattr(sample, "visual_key", None)
        if self._last is not None and key is not None and key == self._last.key:
            return replace(self._last, encode_s=0.0)
        content = loader()
        if self._last is not None and content.key is not None and content.key == self._last.key:
            return replace(self._last, encode_s=0.0)
        vis = encode_visual(self.engine.model, self.processor, content)
        if self._last is None or self._last.key != vis.key:
            _forget_references(self.method, vis.kind)
        self._last = vis
        return vis

    def segments(
        self, node: Node, visual: VisualInput, shared_ids: dict[str, list[int]], sources: dict[str, SegmentKV]
    ) -> list[Segment]:
        chat = _VisualChat(self.processor, visual.kind)
        segs = render_segments(
            chat,
            node.role.system,
            self.user_parts(node, visual.kind),
            shared_ids,
            {slot: kv.agent for slot, kv in sources.items()},
        )
        return [
            replace(s, embeds=visual.embeds, content_key=visual.key) if s.kind == "PH" and s.slot == visual.kind else s
            for s in segs
        ]

    def run_sample(self, sample: Sample) -> UnitRun:
        visual = self.visual_input(sample)
        q_ids = self.tok(sample.query, add_special_tokens=False)["input_ids"]

        def build(idx, node, sources, outputs):
            shared = {
                "q": q_ids,
                visual.kind: list(visual.ids),
                **{out_slot(self.nodes[i]): outputs[self.nodes[i].id] for i in node.reads},
            }
            return self.request(node, self.segments(node, visual, shared, sources))

        steps = execute(self.engine, self.method, self.nodes, build, self.fidelity)
        # once per sample, outside every agent's TTFT: kind, visual tokens, vision-encoder seconds
        return UnitRun(
            sample.id, steps, visual={"kind": visual.kind, "tokens": visual.tokens, "encode_s": visual.encode_s}
        )

    run_unit = run_sample
