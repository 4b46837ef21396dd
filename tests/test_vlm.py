"""VLM path: a tiny random-weight LLaVA-OneVision (SigLIP tower + Qwen2 decoder) built here.

(a) segment-wise prefill with the visual embeddings segment equals the HF model's own forward on
input_ids + pixel_values (images: any-resolution incl. the anyres_max interpolation; video), and
NonShared decoding equals ``generate``; (b) every method runs a sample on the VLM path; (c) the
loaders fail with one-line messages; plus the MathVista / Video-MME loaders and scoring offline.
"""

from __future__ import annotations

import json
import shutil
import types

import numpy as np
import pytest
import torch
from PIL import Image

from kvcmas_bench import modeling_vlm, workflow_vlm
from kvcmas_bench.calibration import collect
from kvcmas_bench.engine import Engine
from kvcmas_bench.errors import BenchError
from kvcmas_bench.methods import METHODS, get_method
from kvcmas_bench.workloads import get_workload, visual

# LLaVA-OneVision's processor chat template (images/videos first in a turn, then "\n" + text)
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + ' '}}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'video') %}{{ '<video>' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ '\\n' + content['text'] }}"
    "{% endfor %}{{'<|im_end|>\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TILE = 32  # vision tower input (384 for LLaVA-OneVision-7B)
PATCH = 8  # 4x4 = 16 tokens per tile, pooled to 2x2 per video frame
PINPOINTS = [[32, 32], [32, 64], [64, 32], [64, 64], [96, 96], [128, 128]]


def _build_checkpoint(d) -> None:
    from transformers import (
        AutoTokenizer,
        LlavaOnevisionConfig,
        LlavaOnevisionForConditionalGeneration,
        LlavaOnevisionImageProcessorPil,
        Qwen2Config,
        SiglipVisionConfig,
    )

    from kvcmas_bench.modeling import default_model_dir

    tok = AutoTokenizer.from_pretrained(default_model_dir())
    tok.add_special_tokens({"additional_special_tokens": ["<image>", "<video>"]})
    vision = SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=TILE,
        patch_size=PATCH,
        vision_use_head=False,
    )
    text = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_sliding_window=False,
        max_position_embeddings=4096,
        eos_token_id=tok.eos_token_id,
    )
    cfg = LlavaOnevisionConfig(
        vision_config=vision,
        text_config=text,
        image_grid_pinpoints=PINPOINTS,
        image_token_index=tok.convert_tokens_to_ids("<image>"),
        video_token_index=tok.convert_tokens_to_ids("<video>"),
    )
    torch.manual_seed(0)
    model = LlavaOnevisionForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim > 1:
                p.normal_(0, 0.2)
    model.save_pretrained(d)
    tok.save_pretrained(d)
    image_processor = LlavaOnevisionImageProcessorPil(
        size={"height": TILE, "width": TILE}, image_grid_pinpoints=PINPOINTS
    )
    image_processor.save_pretrained(d)
    (d / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    (d / "processor_config.json").write_text(
        json.dumps(
            {
                "processor_class": "LlavaOnevisionProcessor",
                "num_image_tokens": (TILE // PATCH) ** 2,
                "vision_feature_select_strategy": "full",
                "vision_aspect_ratio": "anyres_max_9",
            }
        ),
        encoding="utf-8",
    )


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny matrices: one intra-op thread is faster and immune to oversubscribed shared CPUs."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-llava-ov")
    _build_checkpoint(d)
    return d


@pytest.fixture(scope="module")
def lv(vlm_dir):
    return modeling_vlm.load_vlm(str(vlm_dir))


@pytest.fixture(scope="module")
def engine(lv):
    return Engine(lv.model, lv.tokenizer)


def _image(seed: int, h: int, w: int) -> Image.Image:
    return Image.fromarray((np.random.RandomState(seed).rand(h, w, 3) * 255).astype("uint8"))


def image_sample(i: int, h: int = 50, w: int = 90, key: str | None = None) -> visual.VisualSample:
    img = _image(i, h, w)
    return visual.VisualSample(
        id=f"img-{i}",
        query=f"How many bars are in the chart {i}?",
        gold="3",
        meta={"question_type": "free_form", "answer_type": "integer", "precision": None},
        visual=lambda: visual.VisualContent("image", [img], key=key or f"img-{i}"),
    )


def video_sample(i: int, frames: int = 7, key: str | None = None) -> visual.VisualSample:
    fr = [_image(100 * i + j, 40, 56) for j in range(frames)]
    return visual.VisualSample(
        id=f"vid-{i}",
        query="What happens?\nA. a\nB. b\nC. c\nD. d",
        gold="B",
        visual=lambda: visual.VisualContent("video", fr, key=key or f"vid-{i}"),
    )


def _flow(engine, lv, method, workload="mathvista", **kw):
    kw.setdefault("max_new_tokens", 3)
    kw.setdefault("final_max_new_tokens", 3)
    return workflow_vlm.VLMWorkflow(engine, method, get_workload(workload), processor=lv.processor, **kw)


def _segmentwise_logits(engine, segments) -> torch.Tensor:
    cache = engine.new_cache(sum(len(s.ids) for s in segments))
    pos, outs = 0, []
    for s in segments:
        _, h = engine.prefill(cache, s.ids, pos, embeds=s.embeds)
        outs.append(engine.logits(h)[0])
        pos += len(s.ids)
    return torch.cat(outs)


def _processor_token_count(lv, h: int, w: int) -> int:
    """Image tokens the stock LlavaOnevisionProcessor would insert (its own formula)."""
    from transformers import LlavaOnevisionProcessor as P

    ns = types.SimpleNamespace(
        image_processor=lv.processor.image_processor,
        num_image_tokens=(TILE // PATCH) ** 2,
        vision_aspect_ratio="anyres_max_9",
    )
    ns._get_unpadded_features = lambda *a: P._get_unpadded_features(ns, *a)
    return P._get_number_of_features(ns, h, w, TILE, TILE)


# ---- (a) exactness -----------------------------------------------------------------------------


@pytest.mark.parametrize("h,w", [(50, 90), (120, 118)])  # 3 tiles; 17 tiles -> anyres_max_9 interpolation
def test_image_segments_match_hf_forward(lv, engine, h, w):
    flow = _flow(engine, lv, get_method("nonshared"), agents=2)
    sample = image_sample(1, h, w)
    run = flow.run_sample(sample)
    req = run.steps[0].request
    segs = req.segments
    img_id = lv.model.config.image_token_id
    assert [s.kind for s in segs] == ["PF", "PH", "PF", "PH", "PF"]
    assert segs[1].slot == "image" and segs[1].embeds is not None and set(segs[1].ids) == {img_id}
    assert segs[3].slot == "q" and segs[3].embeds is None
    assert len(segs[1].ids) == _processor_token_count(lv, h, w) == run.visual["tokens"]
    # token-exact: the segments are what whole-string tokenization of the expanded prompt gives
    tok = lv.tokenizer
    assert tok(tok.decode(req.prompt_ids), add_special_tokens=False)["input_ids"] == req.prompt_ids
    assert tok.decode(segs[0].ids).endswith("<|im_start|>user ")
    inputs = lv.processor.image_inputs(sample.visual().images)
    with torch.no_grad():
        ref = lv.model(input_ids=torch.tensor([req.prompt_ids]), **inputs).logits[0]
    got = _segmentwise_logits(engine, segs)
    assert (got - ref).abs().max().item() < 1e-4


def test_video_segments_match_hf_forward(lv, engine):
    flow = _flow(engine, lv, get_method("nonshared"), workload="videomme", agents=2)
    sample = video_sample(1)
    run = flow.run_sample(sample)
    req = run.steps[0].request
    seg = req.segments[1]
    per_frame = modeling_vlm.tokens_per_frame(lv.model.config)
    assert per_frame == 4 and seg.slot == "video"
    assert len(seg.ids) == visual.VIDEO_FRAMES * per_frame + 1
    assert set(seg.ids) == {lv.model.config.video_token_id}
    frames = sample.visual().images
    pix = lv.processor.video_inputs([frames[i] for i in visual.sample_frame_indices(len(frames))])
    assert tuple(pix.shape) == (1, 32, 3, TILE, TILE)
    with torch.no_grad():
        ref = lv.model(input_ids=torch.tensor([req.prompt_ids]), pixel_values_videos=pix).logits[0]
    assert (_segmentwise_logits(engine, req.segments) - ref).abs().max().item() < 1e-4


def test_plain_tokenizer_template_fallback(lv, engine):
    """Without a processor chat template the visual segment opens the user turn of the tokenizer's."""
    from dataclasses import replace

    from transformers import AutoTokenizer

    from kvcmas_bench.modeling import default_model_dir

    tok = AutoTokenizer.from_pretrained(default_model_dir())  # SmolLM2's own (text) chat template
    tok.add_special_tokens({"additional_special_tokens": ["<image>", "<video>"]})
    flow = workflow_vlm.VLMWorkflow(
        engine,
        get_method("nonshared"),
        get_workload("mathvista"),
        2,
        2,
        agents=2,
        processor=replace(lv.processor, chat_template=None, tokenizer=tok),
    )
    sample = image_sample(8)
    req = flow.run_sample(sample).steps[0].request
    assert req.segments[1].slot == "image" and tok.decode(req.segments[0].ids).endswith("<|im_start|>user\n")
    assert tok.decode(req.segments[2].ids).startswith("\nTask:")
    with torch.no_grad():
        inputs = lv.processor.image_inputs(sample.visual().images)
        ref = lv.model(input_ids=torch.tensor([req.prompt_ids]), **inputs).logits[0]
    assert (_segmentwise_logits(engine, req.segments) - ref).abs().max().item() < 1e-4


def test_nonshared_vlm_workflow_equals_generate(lv, engine):
    flow = _flow(engine, lv, get_method("nonshared"), fidelity=True)
    sample = image_sample(2)
    run = flow.run_sample(sample)
    assert len(run.steps) == 4
    inputs = lv.processor.image_inputs(sample.visual().images)
    first = run.steps[0].request.segments[1]
    for i, step in enumerate(run.steps):
        segs = step.request.segments
        assert segs[0].kind == "PF" and segs[1].slot == "image"
        assert segs[1].ids == first.ids and torch.equal(segs[1].embeds, first.embeds)
        img_rec = step.result.segments[1]
        assert img_rec.source_agent == (run.steps[i - 1].role.name if i else None)
        assert img_rec.kv_rel_error < 1e-5 and step.result.top1_agree  # embeds-aware fidelity
    for step in (run.steps[0], run.steps[-1]):
        ids = torch.tensor([step.request.prompt_ids])
        gen = lv.model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            **inputs,
            do_sample=False,
            max_new_tokens=step.request.max_new_tokens,
            pad_token_id=0,
        )
        ref = gen[0, ids.shape[1] :].tolist()
        eos = lv.model.config.text_config.eos_token_id
        assert step.result.output_ids == (ref[: ref.index(eos)] if eos in ref else ref)


# ---- (b) every method --------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(METHODS))
def test_every_method_runs_on_vlm_path(lv, engine, name):
    from dataclasses import fields

    # tau = 1: once the anchor pool is filled, the gate accepts, so the corrected path runs too
    method = get_method(name, **({"tau": 1.0} if "tau" in {f.name for f in fields(METHODS[name])} else {}))
    if method.needs_calibration:
        obs = collect(
            lambda m: _flow(engine, lv, m, max_new_tokens=2, final_max_new_tokens=2),
            [image_sample(9)],
            with_reference=method.calibration_reference,
        )
        assert any(o.slot == "image" for o in obs)
        method.calibrate(obs, engine.n_layers)
    flow = _flow(engine, lv, method, max_new_tokens=2, final_max_new_tokens=2)
    # three samples for the online-anchor methods, so that their gate sees a filled pool
    samples = [image_sample(i, 40, 40) for i in (3, 4, 5)][: 3 if hasattr(method, "pools") else 1]
    for s in samples:
        run = flow.run_sample(s)
        assert len(run.steps) == 4
        for i, step in enumerate(run.steps):
            rec = step.result.segments[1]
            assert rec.slot == "image" and rec.tokens == run.visual["tokens"]
            assert rec.source_agent == (run.steps[i - 1].role.name if i else None)
        flow.workload.score(s, run.final_text)
    statuses = [step.result.segments[1].status for step in run.steps]
    if name == "fullshared":
        assert statuses[1:] == ["reused"] * 3
    if hasattr(method, "pools"):
        assert method.entropies and "corrected" in statuses and method.pools["image"].nbytes > 0


def test_visual_recorder_reference_uses_embeddings(lv, engine):
    obs = collect(lambda m: _flow(engine, lv, m, agents=2, max_new_tokens=2), [image_sample(5)], with_reference=True)
    ob = next(o for o in obs if o.slot == "image")
    flow = _flow(engine, lv, get_method("nonshared"), agents=2)
    seg = flow.run_sample(image_sample(5)).steps[0].request.segments[1]
    ref = engine.prefill_alone(seg.ids, embeds=seg.embeds)
    assert torch.allclose(ob.reference.k, ref.k, atol=1e-5)
    assert (engine.prefill_alone(seg.ids).k - ref.k).abs().max() > 1e-2  # ids alone would be wrong


def test_cached_reference_follows_visual_content(lv, engine):
    method = get_method("kvcomm")
    flow = _flow(engine, lv, method, agents=2, max_new_tokens=2, final_max_new_tokens=2)
    a = flow.run_sample(image_sample(6, key="same"))
    b = flow.run_sample(image_sample(6, key="same"))  # same content: features and reference reused

    def fail():
        raise AssertionError("a cached visual_key must not load the content again")

    again = flow.run_sample(
        visual.VisualSample(
            id="again", query=image_sample(6).query, gold="3", meta=image_sample(6).meta, visual=fail, visual_key="same"
        )
    )
    c = flow.run_sample(image_sample(7))  # same size, other image: both recomputed
    n = a.visual["tokens"]
    assert a.steps[0].result.reference_tokens >= n and a.visual["encode_s"] > 0
    assert b.steps[0].result.reference_tokens < n and b.visual["encode_s"] == 0.0
    assert again.visual["encode_s"] == 0.0 and again.steps[0].result.reference_tokens < n
    assert c.visual["tokens"] == n and c.steps[0].result.reference_tokens >= n
    key = next(k for k in method.references if k[0] == "image")
    seg = c.steps[0].request.segments[1]
    assert torch.allclose(method.references[key].k, engine.prefill_alone(seg.ids, embeds=seg.embeds).k, atol=1e-5)


# ---- workloads ---------------------------------------------------------------------------------


def _mathvista_rows():
    return [
        {
            "pid": "1",
            "question": "Which is larger?",
            "choices": ["3", "7", "9"],
            "answer": "7",
            "question_type": "multi_choice",
            "answer_type": "text",
            "precision": None,
            "image": "images/1.png",
        },
        {
            "pid": "2",
            "question": "How many?",
            "choices": None,
            "answer": "12",
            "question_type": "free_form",
            "answer_type": "integer",
            "precision": None,
            "image": "images/2.png",
            "query": "Hint: Please answer the question requiring an integer answer.\nQuestion: How many?",
        },
        {
            "pid": "3",
            "question": "Length?",
            "choices": None,
            "answer": "1.45",
            "question_type": "free_form",
            "answer_type": "float",
            "precision": 2,
            "image": "images/3.png",
        },
        {
            "pid": "4",
            "question": "Values?",
            "choices": None,
            "answer": "[1, 2, 3]",
            "question_type": "free_form",
            "answer_type": "list",
            "precision": None,
            "image": "images/4.png",
        },
        {
            "pid": "5",
            "question": "Color?",
            "choices": None,
            "answer": "Red",
            "question_type": "free_form",
            "answer_type": "text",
            "precision": None,
            "image": "images/5.png",
        },
    ]


def test_mathvista_local_annotations_and_scoring(tmp_path):
    (tmp_path / "images").mkdir()
    for i in range(1, 6):
        _image(i, 20, 30).save(tmp_path / "images" / f"{i}.png")
    path = tmp_path / "testmini.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in _mathvista_rows()), encoding="utf-8")
    wl = get_workload("mathvista", data_path=str(path))
    assert wl.default_tau == 0.50 and [r.name for r in wl.roles][0] == "Math Solver"
    samples = wl.load()
    assert [s.gold for s in samples] == ["B", "12", "1.45", "[1, 2, 3]", "red"]
    assert "(B) 7" in samples[0].query and samples[1].query.startswith("Hint: Please answer")
    content = samples[0].visual()
    assert content.kind == "image" and content.images[0].size == (30, 20)
    json.dumps(samples[0].meta)  # records stay JSON
    cases = [
        (0, "so the answer is B.", True),
        (0, "The answer is 7", True),
        (0, "The answer is (C) 9", False),
        (1, "3 + 9 = 12. The answer is 12", True),
        (1, "The answer is 13", False),
        (2, "The answer is 1.449", True),
        (2, "The answer is 1.5", False),
        (3, "The answer is [1, 2, 3].", True),
        (4, "The answer is red.", True),
        (4, "Answer: blue", False),
    ]
    for i, text, ok in cases:
        assert wl.score(samples[i], text)[1] is ok, (i, text)


def test_mathvista_hub_rows(monkeypatch):
    import datasets

    rows = _mathvista_rows()
    data = {
        k: [r.get(k) for r in rows]
        for k in ("pid", "question", "choices", "answer", "question_type", "answer_type", "precision", "image")
    }
    data["query"] = [r.get("query") or "" for r in rows]
    data["decoded_image"] = [_image(i, 12, 16) for i in range(len(rows))]
    ds = datasets.Dataset.from_dict(data)
    seen = {}

    def fake(repo, split=None, **kw):
        seen.update(repo=repo, split=split)
        return ds

    monkeypatch.setattr(datasets, "load_dataset", fake)
    samples = get_workload("mathvista").load()
    assert seen == {"repo": "AI4Math/MathVista", "split": "testmini"} and len(samples) == 5
    assert samples[2].visual().images[0].size == (16, 12)


def test_videomme_local_frames_and_scoring(tmp_path):
    rows = [
        {
            "video_id": "001",
            "videoID": "abc",
            "question_id": "001-1",
            "duration": "short",
            "domain": "x",
            "sub_category": "y",
            "task_type": "Counting",
            "question": "How many cats?",
            "options": ["A. 1.", "B. 2.", "C. 3.", "D. 4."],
            "answer": "C",
        },
        {
            "video_id": "002",
            "videoID": "missing",
            "question_id": "002-1",
            "question": "Q?",
            "options": ["one", "two", "three", "four"],
            "answer": "A",
        },
    ]
    (tmp_path / "videomme.jsonl").write_text("\n".join(json.dumps(r) for r in rows), encoding="utf-8")
    (tmp_path / "frames" / "abc").mkdir(parents=True)
    for j in range(40):
        _image(j, 24, 32).save(tmp_path / "frames" / "abc" / f"{j:04d}.jpg")
    wl = get_workload("videomme", data_path=str(tmp_path))
    assert wl.default_tau == 0.60 and wl.roles[0].name == "Knowledgeable Expert"
    s, m = wl.load()
    assert s.gold == "C" and s.query.endswith("D. 4.") and m.query.endswith("D. four")
    content = s.visual()
    assert content.kind == "video" and len(content.images) == 32
    assert wl.score(s, "Answer: C")[1] and not wl.score(s, "Answer: A")[1]
    with pytest.raises(BenchError, match="missing not found"):
        m.visual()


# ---- (c) one-line errors -----------------------------------------------------------------------


def _one_line(exc_info) -> str:
    msg = str(exc_info.value)
    assert msg and "\n" not in msg, msg
    return msg


def test_model_loader_errors_are_one_line(tmp_path, vlm_dir, tiny_model_dir):
    with pytest.raises(BenchError) as e:
        modeling_vlm.load_vlm(None)
    assert "LLaVA-OneVision" in _one_line(e)
    with pytest.raises(BenchError) as e:
        modeling_vlm.load_vlm(str(tmp_path / "nope"))
    assert "not found" in _one_line(e)
    with pytest.raises(BenchError) as e:
        modeling_vlm.load_vlm(str(tmp_path))
    assert "config.json" in _one_line(e)
    with pytest.raises(BenchError) as e:
        modeling_vlm.load_vlm(tiny_model_dir)
    assert "'llama'" in _one_line(e)
    no_w = tmp_path / "no-weights"
    shutil.copytree(vlm_dir, no_w, ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(BenchError) as e:
        modeling_vlm.load_vlm(str(no_w))
    assert "no model weights" in _one_line(e)
    no_p = tmp_path / "no-processor"
    shutil.copytree(vlm_dir, no_p, ignore=shutil.ignore_patterns("preprocessor_config.json"))
    with pytest.raises(BenchError) as e:
        modeling_vlm.load_vlm(str(no_p))
    assert "preprocessor_config.json" in _one_line(e)


def test_data_loader_errors_are_one_line(tmp_path, monkeypatch):
    import datasets

    def offline(*a, **k):
        raise ConnectionError("Couldn't reach 'AI4Math/MathVista' on the Hub (LocalEntryNotFoundError)\nmore\ndetail")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(BenchError) as e:
        get_workload("mathvista").load()
    assert "AI4Math/MathVista" in _one_line(e)
    with pytest.raises(BenchError) as e:
        get_workload("mathvista", data_path=str(tmp_path / "nope.json")).load()
    assert "not found" in _one_line(e)
    with pytest.raises(BenchError) as e:
        get_workload("videomme").load()
    assert "--data-path" in _one_line(e)
    with pytest.raises(BenchError) as e:  # no local annotations -> hub, offline here
        get_workload("videomme", data_path=str(tmp_path)).load()
    assert "lmms-lab/Video-MME" in _one_line(e)
    (tmp_path / "videomme.jsonl").write_text(
        json.dumps({"videoID": "abc", "question": "Q", "options": ["A. a", "B. b", "C. c", "D. d"], "answer": "A"})
    )
    with pytest.raises(BenchError) as e:
        get_workload("videomme", data_path=str(tmp_path)).load()
    assert "no Video-MME videos" in _one_line(e)
    import importlib.util

    if importlib.util.find_spec("av") is None:
        (tmp_path / "data").mkdir()
        (tmp_path / "data" / "abc.mp4").write_bytes(b"\x00")
        s = get_workload("videomme", data_path=str(tmp_path)).load()[0]
        with pytest.raises(BenchError) as e:
            s.visual()
        assert "pip install av" in _one_line(e)
