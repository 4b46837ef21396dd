"""The correction applies only the anchors whose token weights change the result (``prune_tol``):
against the unpruned correction on the tiny model, the difference stays within the dropped weight
mass times the dropped deltas' magnitude, and nothing changes when nothing is pruned."""

from __future__ import annotations

import torch

from kvcmas_bench.methods import get_method
from kvcmas_bench.ops.lowrank import prune_weights, sparse_apply

from .conftest import rand_ids
from .test_paper_semantics import NODES, chain, chain_request


def test_prune_weights_by_hand():
    w = torch.tensor([[0.70, 0.20, 0.999], [0.29, 0.7995, 0.0009], [0.01, 0.0005, 0.0001]])
    keep, mass = prune_weights(w, 0.05)
    assert keep.tolist() == [[True, True, True], [True, True, False], [False, False, False]]
    assert torch.allclose(mass, torch.tensor([0.01, 0.0005, 0.0010]))
    keep, mass = prune_weights(w, 0.0)
    assert keep.all() and (mass == 0).all()
    keep, _ = prune_weights(torch.full((4, 2), 0.25), 0.3)  # nothing reaches tol: each token keeps its best
    assert keep.sum(0).tolist() == [1, 1]


def test_sparse_apply_equals_the_masked_dense_sum_by_hand():
    g = torch.Generator().manual_seed(4)
    L, k, D, r = 2, 5, 6, 3
    a_list = [torch.randn(L, 7, r, generator=g) for _ in range(3)]
    b_list = [torch.randn(L, r, D, generator=g) for _ in range(3)]
    w = torch.softmax(torch.randn(3, k, generator=g) * 3, dim=0)
    keep = w >= 0.2
    keep[1] = True  # one anchor with every token (the unindexed path)
    got = sparse_apply(w, keep, a_list, b_list)
    want = torch.zeros(L, k, D)
    for v in range(3):
        for t in range(k):
            if keep[v, t]:
                want[:, t] += w[v, t] * torch.einsum("lr,lrd->ld", a_list[v][:, t], b_list[v])
    assert torch.allclose(got, want, atol=1e-5)
    full = [a[:, :k] @ b for a, b in zip(a_list, b_list)]  # full-dimensional anchors
    assert torch.allclose(sparse_apply(w, keep, full, [None] * 3), want, atol=1e-5)


def _filled(engine, prune_tol, temperature):
    m = get_method("kvcmas", anchors=4, rank=None, tau=1.0, temperature=temperature, prune_tol=prune_tol)
    m.gate_mode, m.gate_temperature, m.tau = "scaled", 1e6, 0.0  # store three questions
    for seed in (91, 92, 93):
        chain(engine, m, rand_ids(12, seed))
    m.gate_mode, m.gate_temperature, m.tau = "paper", 0.01, 1.0
    return m


def test_pruned_correction_is_within_the_dropped_mass_of_the_unpruned_one(engine):
    q = rand_ids(12, 99)
    temperature = 0.01  # peaked token weights: most (anchor, token) terms weigh almost nothing
    full, pruned = _filled(engine, 0.0, temperature), _filled(engine, 0.02, temperature)
    a = engine.run(chain_request("A#0", q), full)
    src = a.materialized["q"]
    res_full = engine.run(chain_request("B#1", q), full, sources={"q": src})
    res_pruned = engine.run(chain_request("B#1", q), pruned, sources={"q": src})
    seg_f, seg_p = res_full.segments[1], res_pruned.segments[1]
    assert seg_f.status == seg_p.status == "corrected"
    assert seg_f.details["anchors_applied"] == [3, 3] and seg_f.details["dropped_weight"] == 0.0
    assert min(seg_p.details["anchors_applied"]) < 3  # terms were skipped
    dropped = seg_p.details["dropped_weight"]
    assert 0 < dropped < 2 * 0.02
    # bound by hand: |sum of dropped w_v,t Delta_v,t| <= dropped mass * max |Delta| over the pool
    deltas = [
        f.a.abs().max() for x in pruned.pools["q"].anchors for f in (x.entries["B#1"].delta_k, x.entries["B#1"].delta_v)
    ]
    bound = dropped * float(max(deltas)) * 1.001 + 1e-5
    kf, kp = res_full.materialized["q"], res_pruned.materialized["q"]
    assert 0 < float((kf.v - kp.v).abs().max()) <= bound  # the pruned path ran, within the bound
    assert float((kf.k - kp.k).abs().max()) <= 2**0.5 * bound  # keys: a rotation of the rows


def test_nothing_pruned_is_bit_identical(engine):
    q = rand_ids(12, 98)
    full, tiny_tol = _filled(engine, 0.0, 1.0), _filled(engine, 1e-12, 1.0)
    a = engine.run(chain_request("A#0", q), full)
    src = a.materialized["q"]
    x = engine.run(chain_request("B#1", q), full, sources={"q": src}).materialized["q"]
    y = engine.run(chain_request("B#1", q), tiny_tol, sources={"q": src}).materialized["q"]
    assert torch.equal(x.k, y.k) and torch.equal(x.v, y.v)


def test_pruning_on_and_off_give_the_same_first_tokens_on_a_four_agent_chain(engine):
    """The default tolerance vs none on the tiny model's 4-agent chain, with peaked token weights
    (T = 0.01) so that terms are really skipped: same first tokens, the same KV error to 1e-3."""
    runs = {}
    for tol in (0.0, 1e-4):
        m = _filled(engine, tol, 0.01)
        runs[tol] = chain(engine, m, rand_ids(12, 97), fidelity=True)
    assert [r.segments[1].status for r in runs[1e-4]] == ["exact"] + ["corrected"] * (len(NODES) - 1)
    assert max(r.segments[1].details["dropped_weight"] for r in runs[1e-4][1:]) > 0
    assert all(r.segments[1].details["dropped_weight"] < 3e-4 for r in runs[1e-4][1:])
    for a, b in zip(runs[0.0], runs[1e-4]):
        assert a.first_token_id == b.first_token_id
        ea, eb = a.segments[1].kv_rel_error, b.segments[1].kv_rel_error
        assert abs(ea - eb) <= 1e-3 * max(ea, 1e-6) + 1e-6
