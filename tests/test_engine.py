"""Engine exactness against dense whole-prompt forwards of tiny random-weight models."""

from __future__ import annotations

import pytest
import torch

from kvcmas_bench.engine import Engine
from kvcmas_bench.methods import get_method
from kvcmas_bench.ops.kvmath import relative_error
from kvcmas_bench.segments import Request, Segment

from .conftest import LLAMA3_ROPE, rand_ids, tiny_model

PIECES = [rand_ids(n, s) for n, s in [(7, 1), (13, 2), (5, 3), (9, 4)]]


def segmentwise_logits(eng: Engine, pieces: list[list[int]]):
    """Logits of every token, the pieces prefilled one after the other into one cache; and the cache."""
    cache = eng.new_cache(sum(map(len, pieces)))
    pos, outs = 0, []
    for p in pieces:
        _, h = eng.prefill(cache, p, pos)
        outs.append(eng.logits(h)[0])
        pos += len(p)
    return torch.cat(outs), cache


@pytest.mark.parametrize("family,rope", [("llama", None), ("qwen2", None), ("mistral", None), ("llama", LLAMA3_ROPE)])
def test_segmentwise_prefill_matches_whole_forward(family, rope):
    model = tiny_model(family, rope)
    eng = Engine(model)
    ids = [t for p in PIECES for t in p]
    ref = model(torch.tensor([ids])).logits[0]
    got, _ = segmentwise_logits(eng, PIECES)
    assert (got - ref).abs().max().item() < 1e-4
    assert (eng.dense_logits(ids) - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("rope", [None, LLAMA3_ROPE])
def test_realignment_is_exact(rope):
    model = tiny_model("llama", rope)
    eng = Engine(model)
    seg = rand_ids(11, 5)
    for p, q in [(0, 37), (50, 3), (17, 1500)]:
        kv_p = _alone_at(eng, seg, p)
        kv_q = _alone_at(eng, seg, q)
        moved = kv_p.aligned(q, eng.inv_freq)
        # float32 RoPE angles at position ~1500 carry ~1e-4 absolute rounding themselves
        assert relative_error(moved.k, kv_q.k) < 2e-5
        assert (moved.k - kv_q.k).abs().max().item() < (1e-4 if max(p, q) < 100 else 1e-3)
        assert relative_error(moved.v, kv_q.v) < 2e-5
        assert (moved.k - kv_p.k).abs().max().item() > 1e-3  # the rotation did something


def _alone_at(eng, ids, p):
    """``ids`` prefilled with no prefix, with the rotary of positions p.. (rows 0..S-1)."""
    kv, _ = _prefill_with_positions(eng, eng.new_cache(len(ids)), eng.embed_ids(ids), torch.arange(p, p + len(ids)))
    return kv


@torch.no_grad()
def _prefill_with_positions(eng, cache, h, rope_positions):
    """Dense prefill whose rotary uses ``rope_positions`` while rows are 0..S-1."""
    from kvcmas_bench.ops.kvmath import rotate_half

    T = h.shape[1]
    cos, sin = eng.rotary(h, rope_positions[None])
    cos, sin = cos[:, None], sin[:, None]
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    for li, layer in enumerate(eng.layers):
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        q = attn.q_proj(x).view(1, T, -1, eng.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(1, T, -1, eng.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(1, T, -1, eng.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        cache.k[li, :, :T] = k[0]
        cache.v[li, :, :T] = v[0]
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=attn.scaling, enable_gqa=True
        )
        h = h + attn.o_proj(out.transpose(1, 2).reshape(1, T, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    seg = cache.segment(0, T, ids=())
    seg.start = int(rope_positions[0])
    return seg, h


def _two_agent_requests(shared_prefix_identical: bool):
    sys_a = rand_ids(6, 10)
    sys_b = sys_a if shared_prefix_identical else rand_ids(9, 11)
    q = rand_ids(15, 12)
    tail = rand_ids(4, 13)
    ra = Request("A", [Segment("PF", sys_a), Segment("PH", q, slot="q"), Segment("PF", tail)], 6)
    rb = Request("B", [Segment("PF", sys_b), Segment("PH", q, slot="q", source="A"), Segment("PF", tail)], 6)
    return ra, rb


def test_fullshared_equals_nonshared_with_identical_prefix(engine):
    ra, rb = _two_agent_requests(True)
    outs = {}
    for name in ("nonshared", "fullshared"):
        m = get_method(name)
        a = engine.run(ra, m)
        b = engine.run(rb, m, sources={"q": a.materialized["q"]}, fidelity=True)
        outs[name] = b
    assert outs["fullshared"].segments[1].status == "reused"
    assert outs["fullshared"].reused_tokens == 15
    assert outs["fullshared"].segments[1].kv_rel_error < 1e-6
    assert outs["fullshared"].output_ids == outs["nonshared"].output_ids
    assert torch.allclose(outs["fullshared"].first_logits, outs["nonshared"].first_logits, atol=1e-4)


def test_fullshared_differs_with_other_prefix(engine):
    ra, rb = _two_agent_requests(False)
    m = get_method("fullshared")
    a = engine.run(ra, m)
    b = engine.run(rb, m, sources={"q": a.materialized["q"]}, fidelity=True)
    assert b.segments[1].kv_rel_error > 1e-3
    dense = engine.dense_logits(rb.prompt_ids)[-1].double()
    p, q = torch.softmax(dense, -1), torch.softmax(b.first_logits.double(), -1)
    kl = float((p * (p.log() - q.log())).sum())  # KL(dense || method), by hand
    assert kl > 1e-8 and b.first_token_kl == pytest.approx(kl, rel=1e-3, abs=1e-9)
    n = engine.run(rb, get_method("nonshared"), sources={"q": a.materialized["q"]}, fidelity=True)
    assert n.segments[1].kv_rel_error < 1e-6 and n.first_token_kl < 1e-6


def test_decode_matches_generate(llama, engine):
    ra, _ = _two_agent_requests(False)
    ra.max_new_tokens = 12
    res = engine.run(ra, get_method("nonshared"))
    ids = torch.tensor([ra.prompt_ids])
    gen = llama.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=12,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    assert res.output_ids == gen[0, ids.shape[1] :].tolist()
    # the decode-phase KV of the output equals a dense prefill of prompt + output
    full = ra.prompt_ids + res.output_ids
    cache = engine.new_cache(len(full))
    engine.prefill(cache, full, 0)
    ref_k = cache.k[:, :, len(ra.prompt_ids) :]
    assert (res.output_kv.k - ref_k).abs().max().item() < 1e-4


def test_partial_forward_rows_match_dense(engine):
    ids = rand_ids(30, 21)
    cache = engine.new_cache(30)
    engine.prefill(cache, ids, 0)
    ref_k, ref_v = cache.k.clone(), cache.v.clone()
    sel = torch.tensor([12, 15, 16, 29])
    cache.k[:, :, sel] = 0
    cache.v[:, :, sel] = 0
    h = engine.embed_ids([ids[i] for i in sel.tolist()])
    engine.run_layers(cache, h, sel)
    assert (cache.k - ref_k).abs().max().item() < 1e-4
    assert (cache.v - ref_v).abs().max().item() < 1e-4


def test_unsupported_architectures_are_refused():
    from kvcmas_bench.errors import BenchError
    from kvcmas_bench.modeling import check_supported

    from .conftest import tiny_config

    yarn = tiny_config(
        "llama", {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 256}
    )
    with pytest.raises(BenchError, match="yarn"):
        check_supported(yarn)
    q = tiny_config("qwen2")
    q.use_sliding_window, q.sliding_window = True, 64
    with pytest.raises(BenchError, match="sliding"):
        check_supported(q)
    q.model_type = "gpt2"
    with pytest.raises(BenchError, match="not supported"):
        check_supported(q)
