"""Selective recomputation (CacheBlend, DroidSpeak, RelayCaching), their selection math and the
reconstruction-coverage analysis, on tiny random-weight llamas (float32)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from kvcmas_bench.analysis.coverage import reconstruction_coverage
from kvcmas_bench.calibration import Recorder
from kvcmas_bench.engine import Engine
from kvcmas_bench.methods import get_method
from kvcmas_bench.methods.cacheblend import CacheBlend
from kvcmas_bench.methods.droidspeak import DroidSpeak
from kvcmas_bench.methods.relaycaching import RelayCaching
from kvcmas_bench.ops import selection as sel
from kvcmas_bench.segments import Request, Segment

from .conftest import rand_ids, tiny_model

S_Q = 40  # shared segment length


@pytest.fixture(scope="module")
def eng8():
    return Engine(tiny_model("llama", layers=8, seed=1))


@pytest.fixture(scope="module")
def eng10():
    return Engine(tiny_model("llama", layers=10, seed=2))


def requests(seed: int = 0, identical_prefix: bool = False, n_q: int = S_Q):
    sys_a = rand_ids(6, 100 + seed)
    sys_b = sys_a if identical_prefix else rand_ids(9, 200 + seed)
    q = rand_ids(n_q, 300 + seed)
    tail = rand_ids(4, 400 + seed)
    ra = Request("A", [Segment("PF", sys_a), Segment("PH", q, slot="q"), Segment("PF", tail)], 6)
    rb = Request("B", [Segment("PF", sys_b), Segment("PH", q, slot="q", source="A"), Segment("PF", tail)], 6)
    return ra, rb


def observations(engine, seeds=(11, 12, 13)):
    rec = Recorder()
    for s in seeds:
        ra, rb = requests(s)
        a = engine.run(ra, rec)
        engine.run(rb, rec, sources={"q": a.materialized["q"]})
    assert len(rec.observations) == len(seeds)
    return rec.observations


def run_pair(engine, method, ra, rb, fidelity=True):
    a = engine.run(ra, method)
    b = engine.run(rb, method, sources={"q": a.materialized["q"]}, fidelity=fidelity)
    return a, b


def calibrated(cls, engine, obs, **kw):
    m = cls(**kw)
    m.calibrate(obs, engine.n_layers)
    return m


# ---- selection math --------------------------------------------------------------------------
def test_budgets_round_as_documented():
    assert sel.n_selected_tokens(0.8, 15) == 3  # (1-0.8)*15 = 3.0000000000000004
    assert sel.n_selected_tokens(0.9, 10) == 1
    assert sel.n_selected_tokens(0.85, 10) == 2
    assert sel.n_selected_tokens(1.0, 10) == 0 and sel.n_selected_tokens(0.0, 10) == 10
    assert sel.n_selected_layers(0.9, 10) == 1 and sel.n_selected_layers(0.5, 3) == 2
    assert sel.n_selected_layers(0.75, 10) == 3  # half up, not banker's rounding
    assert sel.n_tokens_in_range(0.9, 40, 10, 5) == 8
    assert sel.n_tokens_in_range(0.0, 40, 10, 5) == 40  # capped
    with pytest.raises(ValueError):
        sel.n_selected_tokens(1.5, 3)


def test_choose_layer_groups_is_optimal():
    g = torch.Generator().manual_seed(0)
    for _ in range(30):
        L = 7
        dev = torch.rand(L, generator=g).tolist()
        for n, G in itertools.product(range(0, L + 1), (1, 2, 3, None)):
            got = sel.choose_layer_groups(dev, n, G)
            assert sum(b - a for a, b in got) == n
            assert G is None or len(got) <= G
            best = max(
                (
                    sum(dev[i] for i in c)
                    for c in itertools.combinations(range(L), n)
                    if G is None or len(sel.runs(c)) <= G
                ),
                default=0.0,
            )
            assert math.isclose(sum(dev[i] for a, b in got for i in range(a, b)), best, abs_tol=1e-12)
    assert sel.choose_layer_groups([5, 0, 9, 9, 1, 8], 2, 1, lo=1, hi=5) == [(2, 4)]
    assert sel.choose_layer_groups([0, 3, 1, 4, 0], 2, None) == [(1, 2), (3, 4)]


def test_attention_mass_matches_explicit_softmax():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 5, 8, generator=g)
    K = torch.randn(1, 2, 12, 8, generator=g)
    pos = torch.arange(7, 12)
    mask = torch.arange(12)[None, :] <= pos[:, None]
    got = sel.attention_mass(q, K, mask, 0.3, 7, 12, max_elems=50)
    Kr = K[0].repeat_interleave(2, 0)
    p = ((q[0] @ Kr.transpose(1, 2)) * 0.3).masked_fill(~mask, float("-inf")).softmax(-1)
    assert torch.allclose(got, p[..., 7:12].sum((0, 1)), atol=1e-5)
    assert sel.top_tokens(torch.tensor([0.1, 3.0, 3.0, 2.0]), 2).tolist() == [1, 2]


# ---- exactness at the ends of the budget ----------------------------------------------------
def _everything(cls, L):
    if cls is CacheBlend:
        return CacheBlend(rho=0.0)
    if cls is DroidSpeak:
        return DroidSpeak(rho=0.0, groups=((0, L),))
    return RelayCaching(rho=0.0, critical=(0, L))


@pytest.mark.parametrize("cls", [CacheBlend, DroidSpeak, RelayCaching])
def test_everything_selected_is_dense_prefill(eng8, cls):
    ra, rb = requests(0)
    m = _everything(cls, eng8.n_layers)
    _, b = run_pair(eng8, m, ra, rb)
    _, ref = run_pair(eng8, get_method("nonshared"), ra, rb)
    _, full = run_pair(eng8, get_method("fullshared"), ra, rb)
    assert full.segments[1].kv_rel_error > 1e-2  # the prefixes really differ
    got, exact = b.materialized["q"], ref.materialized["q"]
    assert b.segments[1].status == "recomputed"
    assert (got.k - exact.k).abs().max().item() < 1e-4
    assert (got.v - exact.v).abs().max().item() < 1e-4
    assert (b.first_logits - ref.first_logits).abs().max().item() < 1e-4
    assert b.recomputed_token_layers == S_Q * eng8.n_layers


def test_relaycaching_range_after_check_layer_is_dense_too(eng8):
    ra, rb = requests(0)
    m = RelayCaching(rho=0.0, check_layer=1, critical=(2, eng8.n_layers))
    _, b = run_pair(eng8, m, ra, rb)
    _, ref = run_pair(eng8, get_method("nonshared"), ra, rb)
    assert (b.materialized["q"].k - ref.materialized["q"].k).abs().max().item() < 1e-4
    assert (b.first_logits - ref.first_logits).abs().max().item() < 1e-4


@pytest.mark.parametrize("cls", [CacheBlend, DroidSpeak, RelayCaching])
def test_nothing_selected_is_fullshared(eng8, cls):
    ra, rb = requests(0)
    m = calibrated(cls, eng8, observations(eng8), rho=1.0)
    _, b = run_pair(eng8, m, ra, rb)
    _, full = run_pair(eng8, get_method("fullshared"), ra, rb)
    assert b.recomputed_token_layers == 0
    assert torch.equal(b.materialized["q"].k, full.materialized["q"].k)
    assert torch.equal(b.materialized["q"].v, full.materialized["q"].v)
    assert torch.equal(b.first_logits, full.first_logits)
    assert b.output_ids == full.output_ids


def test_uncalibrated_methods_behave_as_fullshared(eng8):
    ra, rb = requests(0)
    _, full = run_pair(eng8, get_method("fullshared"), ra, rb)
    for m in (DroidSpeak(), RelayCaching()):
        _, b = run_pair(eng8, m, ra, rb)
        assert b.recomputed_token_layers == 0
        assert torch.equal(b.materialized["q"].k, full.materialized["q"].k)


# ---- budgets and accuracy --------------------------------------------------------------------
# Hand-computed for S = 40 shared tokens, L = 10 layers, check layer 1:
# CacheBlend: 40 tokens x 2 layers (0..1) + ceil((1 - rho) * 40) tokens x 8 layers (2..9)
#   rho 0.9: 80 + 4 * 8 = 112; 0.8: 80 + 8 * 8 = 144; 0.5: 80 + 20 * 8 = 240
# DroidSpeak: 40 tokens x round_half_up((1 - rho) * 10) layers: 1 -> 40, 2 -> 80, 5 -> 200
# RelayCaching: range of 5 middle layers; ceil((1 - rho) * 40 * 10 / 5) tokens in it (capped at 40):
#   0.9 -> 8, 0.8 -> 16, 0.5 -> 40; plus the scoring pass, 40 tokens x 2 layers
EXPECTED = {CacheBlend: {0.9: 112, 0.8: 144, 0.5: 240}, DroidSpeak: {0.9: 40, 0.8: 80, 0.5: 200}}
RELAY_TOKENS = {0.9: 8, 0.8: 16, 0.5: 40}


@pytest.mark.parametrize("cls", [CacheBlend, DroidSpeak, RelayCaching])
def test_recomputed_token_layers_follow_the_budget(eng10, cls):
    L = eng10.n_layers
    obs = observations(eng10)
    ra, rb = requests(0)
    counts = []
    for rho in (0.9, 0.8, 0.5):
        m = calibrated(cls, eng10, obs, rho=rho)
        _, b = run_pair(eng10, m, ra, rb, fidelity=False)
        if cls is RelayCaching:
            a, e = m.critical
            assert 1 <= a < e <= L - 1 and e - a == 5  # middle layers, half of them
            # selected tokens enter the range at a > 2 with the source's hidden states (5 layers),
            # else continue from the scoring pass through layers 2..e-1
            expected = 80 + RELAY_TOKENS[rho] * (5 if a > 2 else e - 2)
        else:
            expected = EXPECTED[cls][rho]
        assert b.recomputed_token_layers == expected
        counts.append(b.recomputed_token_layers)
    assert counts[0] < counts[1] < counts[2]


@pytest.mark.parametrize("cls", [CacheBlend, DroidSpeak, RelayCaching])
def test_kv_error_falls_with_budget(eng8, cls):
    obs = observations(eng8)
    ra, rb = requests(0)
    _, full = run_pair(eng8, get_method("fullshared"), ra, rb)
    err = {}
    for rho in (0.9, 0.8):
        _, b = run_pair(eng8, calibrated(cls, eng8, obs, rho=rho), ra, rb)
        err[rho] = b.segments[1].kv_rel_error
    e_full = full.segments[1].kv_rel_error
    assert err[0.8] <= err[0.9] + 1e-6 <= e_full + 2e-6
    assert err[0.8] < e_full


# ---- hidden-state mechanics ------------------------------------------------------------------
def test_droidspeak_sources_keep_hidden_states(eng8):
    m = DroidSpeak(rho=0.5, groups=((0, 1), (3, 5), (6, 8)))
    assert m.decode_hidden_layers == (3, 6)
    ra, _ = requests(0)
    a = eng8.run(ra, m)
    q = a.materialized["q"]
    assert sorted(q.hidden) == [3, 6] and q.hidden[3].shape == (S_Q, eng8.config.hidden_size)
    out = a.output_kv
    assert sorted(out.hidden) == [3, 6] and out.hidden[6].shape[0] == out.length
    plain = eng8.run(ra, get_method("fullshared")).materialized["q"]
    assert q.nbytes == plain.nbytes + 2 * S_Q * eng8.config.hidden_size * 4


def _chain_with_output(engine, method):
    """A, then B whose prefix before PH out:A equals A's prompt (so every reused segment is exact)."""
    ra, _ = requests(0, identical_prefix=True)
    a = engine.run(ra, method)
    out = a.output_ids
    rb = Request("B", [*ra.segments, Segment("PH", out, slot="out:A", source="A"), Segment("PF", rand_ids(3, 77))], 4)
    b = engine.run(rb, method, sources={"q": a.materialized["q"], "out:A": a.output_kv}, fidelity=True)
    return a, b


@pytest.mark.parametrize(
    "method", [DroidSpeak(groups=((2, 5),)), RelayCaching(rho=0.75, check_layer=0, critical=(3, 7))]
)
def test_hidden_states_enter_groups_exactly(eng8, method):
    """With identical prefixes the source's hidden states are the target's, so entering a group (or
    range) with them must reproduce dense prefill; covers prefill and decode-phase sources."""
    a, b = _chain_with_output(eng8, method)
    assert a.output_kv.hidden and len(a.output_ids) >= 2
    assert [s.status for s in b.segments if s.kind == "PH"] == ["recomputed", "recomputed"]
    for s in b.segments:
        if s.kind == "PH":
            assert s.kv_rel_error < 1e-5
    assert b.first_token_kl < 1e-6
    n_out = len(a.output_ids)
    if isinstance(method, DroidSpeak):
        assert b.recomputed_token_layers == (S_Q + n_out) * 3
        assert sorted(b.materialized["q"].hidden) == [2]  # carried forward for the next edge
    else:
        # scoring pass: S tokens x 1 layer; then ceil(0.25 * S * 8 / 4) = ceil(S / 2) tokens x 4 layers
        per = lambda S: S + math.ceil(S / 2) * 4  # noqa: E731
        assert per(S_Q) == 120
        assert b.recomputed_token_layers == per(S_Q) + per(n_out)
        assert sorted(b.materialized["out:A"].hidden) == [3]


def test_missing_hidden_falls_back_to_full_recompute(eng8):
    m = DroidSpeak(groups=((2, 5),))
    ra, rb = requests(0)
    a = eng8.run(ra, m)
    src = a.materialized["q"]
    src.hidden = {}
    b = eng8.run(rb, m, sources={"q": src}, fidelity=True)
    assert b.recomputed_token_layers == S_Q * 5  # layers 0..4 from the embeddings
    _, ref = run_pair(eng8, get_method("nonshared"), ra, rb)
    # layers 0..4 are now the target's own (exact), layers 5..7 still the aligned source
    got, exact = b.materialized["q"], ref.materialized["q"]
    assert (got.k[:5] - exact.k[:5]).abs().max().item() < 1e-4
    assert sorted(got.hidden) == [2]
    # RelayCaching without the entry hidden state continues from the scoring pass instead
    r = RelayCaching(rho=0.75, check_layer=0, critical=(3, 7))
    src = eng8.run(ra, r).materialized["q"]
    assert sorted(src.hidden) == [3]
    src.hidden = {}
    b = eng8.run(rb, r, sources={"q": src})
    # scoring pass 40 x 1, then ceil(0.25 * 40 * 8 / 4) = 20 tokens through layers 1..6 (6 layers)
    assert b.recomputed_token_layers == 40 * 1 + 20 * 6


# ---- coverage --------------------------------------------------------------------------------
def test_coverage_ends_and_random_baseline(eng8):
    obs = observations(eng8, seeds=(21, 22, 23, 24))
    imp = [torch.rand(o.exact.length, generator=torch.Generator().manual_seed(i)) for i, o in enumerate(obs)]
    full = reconstruction_coverage(obs, 1.0, importance=imp, seeds=2).set_index("criterion")
    assert set(full.index) == {"layer", "deviation", "attention", "random"}
    assert (full["coverage"] - 1.0).abs().max() < 1e-6
    none = reconstruction_coverage(obs, 0.0, importance=imp, seeds=2).set_index("criterion")
    assert (none["coverage"].abs() < 1e-12).all() and (none["selected_fraction"] == 0).all()
    mid = reconstruction_coverage(obs, 0.3, importance=imp, seeds=16).set_index("criterion")
    assert "attention" in mid.index and "attention" not in reconstruction_coverage(obs, 0.3).criterion.values
    assert abs(mid.loc["random", "relative_coverage"] - 1.0) < 0.15
    assert abs(mid.loc["random", "selected_fraction"] - 0.3) < 0.01
    # deviation at the check layer is informative; the oracle per-token error is at least as good
    assert mid.loc["deviation", "relative_coverage"] > 1.0
    oracle = reconstruction_coverage(obs, 0.3, check_layer=None).set_index("criterion")
    assert oracle.loc["deviation", "coverage"] >= mid.loc["deviation", "coverage"] - 1e-9
    # the layer criterion removes the layers with the most relative deviation: beats random
    assert mid.loc["layer", "relative_coverage"] > 1.0


def test_calibrated_config_survives_json(eng8):
    """The run directory compares a resumed run's config with its JSON copy."""
    import json

    obs = observations(eng8)
    for cls in (DroidSpeak, RelayCaching):
        m = calibrated(cls, eng8, obs, rho=0.8)
        assert json.loads(json.dumps(m.config())) == m.config()
        assert len(m.layer_deviation) == eng8.n_layers and m.layer_deviation[0] < 1e-5  # layer 0 exact
    with pytest.raises(ValueError):
        DroidSpeak(groups=((0, 3), (2, 5)))


# ---- CacheBlend over a whole prompt in one pass ----------------------------------------------
def _blend_prompt(engine, seed: int = 0):
    """sys | q (source) | glue | out (source) | glue2 | r (no source) | glue3, and the sources:
    the same tokens as an earlier agent computed them (other system prompt, other positions)."""
    sys_b, q, glue, out, glue2, r, glue3 = (rand_ids(n, 500 + seed + i) for i, n in enumerate((7, 23, 3, 11, 2, 6, 4)))
    segs = [
        Segment("PF", sys_b),
        Segment("PH", q, slot="q"),
        Segment("PF", glue),
        Segment("PH", out, slot="out"),
        Segment("PF", glue2),
        Segment("PH", r, slot="r"),
        Segment("PF", glue3),
    ]
    a = engine.run(
        Request("A", [Segment("PF", rand_ids(5, 600 + seed)), *segs[1:4], Segment("PF", glue3)], 1),
        get_method("nonshared"),
    )
    sources = {"q": a.materialized["q"], "out": a.materialized["out"]}
    return segs, sources


def _one_by_one(engine, method, segs, sources):
    from kvcmas_bench.engine import SegmentContext

    req = Request("B", segs, 1)
    cache = engine.new_cache(sum(len(s.ids) for s in segs))
    pos, counts = 0, {}
    for seg in segs:
        if seg.kind == "PF":
            engine.prefill(cache, seg.ids, pos)
        else:
            ctx = SegmentContext(engine, cache, req, seg, pos, sources.get(seg.slot))
            cache.write(method.materialize(ctx))
            counts[seg.slot] = ctx.recomputed_token_layers
        pos += len(seg.ids)
    return cache, counts


def _whole(engine, method, segs, sources):
    from kvcmas_bench.methods.base import PromptPiece

    cache = engine.new_cache(sum(len(s.ids) for s in segs))
    pieces, pos = [], 0
    for seg in segs:
        src = sources.get(seg.slot) if seg.kind == "PH" else None
        pieces.append(
            PromptPiece(pos, engine.embed_ids(seg.ids), None if src is None else src.aligned(pos, engine.inv_freq))
        )
        pos += len(seg.ids)
    method.materialize_prompt(engine, cache, pieces)
    return cache, pieces


@pytest.fixture(scope="module")
def eng8_f64():
    return Engine(tiny_model("llama", layers=8, seed=1).double())


@pytest.mark.parametrize("rho,check", [(0.5, 1), (0.7, 0), (0.0, 1), (1.0, 2)])
def test_cacheblend_whole_prompt_pass_equals_segment_by_segment(eng8, eng8_f64, rho, check):
    """The layer-synchronous pass (what the vLLM worker runs) gives the cache of materializing the
    segments one by one, and recomputes the hand-counted (token, layer) entries:
    q (23 tokens) and out (11) reused, r without a source computed, L = 8.

    The same function: equal to 1e-10 in float64. In float32 the two paths' GEMMs have other
    shapes, so they round differently: up to 3.3e-5 on values up to 6 after 8 layers on one CPU
    (AMD EPYC, 2026-12-04), under 1e-5 on another; the bound is 1e-4."""
    for eng, atol in ((eng8_f64, 1e-10), (eng8, 1e-4)):
        segs, sources = _blend_prompt(eng)
        m = get_method("cacheblend", rho=rho, check_layer=check)
        want, counts = _one_by_one(eng, m, segs, sources)
        got, pieces = _whole(eng, m, segs, sources)
        n = len(got.k[0, 0])
        assert torch.allclose(got.k[:, :, :n], want.k[:, :, :n], rtol=0, atol=atol)
        assert torch.allclose(got.v[:, :, :n], want.v[:, :, :n], rtol=0, atol=atol)
    by_hand = {  # S * (check + 1) + ceil((1 - rho) S) * (L - check - 1); nothing at rho = 1
        (0.5, 1): {"q": 23 * 2 + 12 * 6, "out": 11 * 2 + 6 * 6},
        (0.7, 0): {"q": 23 * 1 + 7 * 7, "out": 11 * 1 + 4 * 7},
        (0.0, 1): {"q": 23 * 8, "out": 11 * 8},
        (1.0, 2): {"q": 0, "out": 0},
    }[(rho, check)]
    assert {"q": pieces[1].recomputed_token_layers, "out": pieces[3].recomputed_token_layers} == by_hand
    assert {k: counts[k] for k in ("q", "out")} == by_hand
    status = {0.0: "recomputed", 1.0: "reused"}.get(rho, "recomputed")
    assert pieces[1].status == pieces[3].status == status and pieces[5].status == "exact"


def test_cacheblend_whole_prompt_pass_is_not_a_dense_prefill(eng8):
    """At rho 0.5 the unselected rows above the check layer keep the source's K/V (the pass really
    reuses), and rho 0 gives the dense prefill of the whole prompt."""
    segs, sources = _blend_prompt(eng8)
    dense = eng8.new_cache(sum(len(s.ids) for s in segs))
    eng8.prefill(dense, [t for s in segs for t in s.ids], 0)
    half, pieces = _whole(eng8, get_method("cacheblend", rho=0.5, check_layer=1), segs, sources)
    q0, S = pieces[1].start, pieces[1].length
    old = pieces[1].old
    kept = (half.k[7, :, q0 : q0 + S] == old.k[7]).all(dim=(0, 2))
    assert int(kept.sum()) == S - 12  # ceil(0.5 * 23) = 12 rows recomputed at layer 7, 11 kept as is
    assert not torch.allclose(half.k, dense.k, atol=1e-3)
    full, _ = _whole(eng8, get_method("cacheblend", rho=0.0, check_layer=1), segs, sources)
    assert torch.allclose(full.k, dense.k, atol=1e-5) and torch.allclose(full.v, dense.v, atol=1e-5)
