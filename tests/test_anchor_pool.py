"""The anchor pool's rules (issue 48), each checked against values written by hand:

- identity: an anchor is one observation, not one content; two dense fallbacks of a consumer on
  identical content give two anchors (paper A.3: a fallback inserts a new anchor), and the ids
  survive a save and restore of the method state;
- eviction: LFU among the five oldest, with use counts that make FIFO, LFU among the five oldest
  and LFU over the whole pool pick three different anchors;
- variable lengths: three anchors of different lengths, the comparison/correction length set by
  the second-longest, which anchors and which of their rows are used.
"""

from __future__ import annotations

import math

import torch

from kvcmas_bench.methods import get_method
from kvcmas_bench.methods.anchors import AnchorPool
from kvcmas_bench.ops.gate_outcome import GateOutcome, gate_route
from kvcmas_bench.ops.kvmath import shift_keys
from kvcmas_bench.results.state import MethodStateStore
from kvcmas_bench.segments import Request, Segment

from .conftest import rand_ids

L, S, D = 2, 6, 4


def _add(pool: AnchorPool, content: str, consumer: str, value: float, n: int = S):
    """An entry whose base and delta are the constant ``value`` (so each entry is recognizable)."""
    z = torch.full((L, n, D), value)
    return pool.add(content, (consumer, value), z, z, consumer, z, z, None)


def _delta(anchor, consumer: str) -> float:
    return float(anchor.entries[consumer].delta_v.a[0, 0, 0])


# ---- identity ------------------------------------------------------------------------------------
def test_two_fallbacks_on_identical_content_give_two_anchors():
    pool = AnchorPool(3)
    _add(pool, "same", "B", 1.0)  # anchor 0
    _add(pool, "same", "C", 2.0)  # the same observation's next consumer: joins anchor 0
    _add(pool, "same", "B", 3.0)  # B again on identical content: a new anchor, anchor 0 untouched
    assert [(a.id, sorted(a.entries)) for a in pool.anchors] == [(0, ["B", "C"]), (1, ["B"])]
    assert [_delta(a, "B") for a in pool.anchors] == [1.0, 3.0]
    assert _delta(pool.anchors[0], "C") == 2.0
    _add(pool, "same", "C", 4.0)  # C joins the newest anchor of that content (no C entry there yet)
    assert [(a.id, sorted(a.entries)) for a in pool.anchors] == [(0, ["B", "C"]), (1, ["B", "C"])]
    assert [_delta(a, "C") for a in pool.anchors] == [2.0, 4.0]
    _add(pool, "other", "B", 5.0)  # anchor 2: the pool is full
    _add(pool, "same", "B", 6.0)  # anchor 3 evicts anchor 0 (all counts 0: the oldest)
    assert [a.id for a in pool.anchors] == [1, 2, 3]
    assert [_delta(a, "B") for a in pool.anchors] == [3.0, 5.0, 6.0]
    assert pool.lengths("B") == [S, S, S] and pool.inserted == 4 and pool.evicted == 1


def test_anchor_ids_survive_a_saved_and_restored_method_state(tmp_path):
    m = get_method("kvcmas", anchors=4, rank=None)
    pool = m.pools.setdefault("q", AnchorPool(4))
    _add(pool, "same", "B", 1.0)
    _add(pool, "same", "B", 2.0)
    _add(pool, "same", "C", 3.0)
    store = MethodStateStore(tmp_path)
    store.save(1, m, 0)
    m2 = get_method("kvcmas", anchors=4, rank=None)
    store.load(1, m2)
    got = m2.pools["q"]
    assert [(a.id, a.instance, sorted(a.entries)) for a in got.anchors] == [
        (0, "same", ["B"]),
        (1, "same", ["B", "C"]),
    ]
    assert [_delta(a, "B") for a in got.anchors] == [1.0, 2.0] and got.inserted == 2
    _add(got, "same", "B", 4.0)  # after a resume the next anchor's id continues, never reused
    _add(got, "same", "C", 5.0)  # and joins it
    assert [(a.id, sorted(a.entries)) for a in got.anchors][-1] == (2, ["B", "C"])


# ---- eviction ------------------------------------------------------------------------------------
#: the anchor each rule would evict from the pool of test_lfu_eviction_is_not_fifo, worked out by
#: hand from COUNTS (ids 0..6 in order of creation)
COUNTS = [4, 2, 3, 1, 5, 0, 0]
VICTIM = {
    "fifo": 0,  # the oldest
    "lfu_among_five_oldest": 3,  # ids 0-4 have counts 4, 2, 3, 1, 5: id 3 (count 1)
    "lfu_whole_pool": 5,  # ids 5 and 6 have count 0: the older, id 5
}


def test_lfu_eviction_is_not_fifo():
    pool = AnchorPool(7)
    for i, c in enumerate(COUNTS):
        _add(pool, f"content{i}", "B", float(i)).count = c
    assert len(set(VICTIM.values())) == 3  # the three rules disagree on this pool
    _add(pool, "new", "B", 7.0)
    survivors = [a.id for a in pool.anchors]
    assert survivors == [0, 1, 2, 4, 5, 6, 7]  # KVComm's / the paper's rule
    assert VICTIM["lfu_among_five_oldest"] not in survivors
    assert VICTIM["fifo"] in survivors and VICTIM["lfu_whole_pool"] in survivors


def test_lfu_eviction_ties_go_to_the_oldest_of_the_least_used():
    pool = AnchorPool(5)
    for i, c in enumerate([2, 1, 1, 3, 4]):  # ids 1 and 2 tie at count 1: id 1 goes (FIFO: id 0)
        _add(pool, f"content{i}", "B", float(i)).count = c
    _add(pool, "new", "B", 9.0)
    assert [a.id for a in pool.anchors] == [0, 2, 3, 4, 5]


# ---- variable lengths ----------------------------------------------------------------------------
def test_gate_route_takes_the_second_longest_length():
    assert gate_route([16, 9, 5], 12, 10, False) == (None, 9)  # l2 = 9 < S
    assert gate_route([16, 9, 5], 8, 10, False) == (None, 8)  # S <= l2: the whole segment
    assert gate_route([12, 12, 5], 16, 10, False) == (None, 12)  # equal lengths count separately
    assert gate_route([16], 12, 10, True) == (GateOutcome.SCHEDULED, 12)  # one anchor needed: l1
    assert gate_route([16], 12, 10, False) == (GateOutcome.TOO_FEW_ANCHORS, 0)


def test_three_anchor_lengths_correct_the_prefix_the_second_longest_covers(engine):
    """Anchors of 16, 9 and 5 tokens for a 12-token segment: k = 9 (the second-longest), the
    16- and 9-token anchors correct rows 0-8 through their rows 0-8, rows 9-11 stay the aligned
    source. Poison values mark what must not be read: the 16-token anchor's delta rows 9-15 and
    the whole 5-token anchor (whose base equals the source: had it taken part, it would have tied
    with the 16-token one at distance 0)."""
    q = rand_ids(12, 61)
    ra = Request("A", [Segment("PF", rand_ids(6, 10)), Segment("PH", q, slot="q"), Segment("PF", rand_ids(4, 13))], 2)
    rb = Request("B", [Segment("PF", rand_ids(9, 11)), Segment("PH", q, slot="q"), Segment("PF", rand_ids(5, 14))], 2)
    src = engine.run(ra, get_method("nonshared")).materialized["q"]
    inv = engine.inv_freq
    n_l, heads, _, hd = src.k.shape
    canon_k = shift_keys(src.k, -src.start, inv)

    def rows(x):  # [L, H, n, hd] -> [L, n, H*hd]
        return x.permute(0, 2, 1, 3).reshape(n_l, x.shape[2], heads * hd)

    canon = {"k": rows(canon_k), "v": rows(src.v)}
    pool = AnchorPool(10)

    def put(name, base, delta):  # the same base offset and delta for K and V
        pool.add(name, (name,), base["k"], base["v"], "B", delta, delta, None)

    # 16 tokens: base = the source on rows 0-11 (distance 0), delta 1 on rows 0-8, poison beyond
    long_delta = torch.full((n_l, 16, heads * hd), 1.0)
    long_delta[:, 9:] = 1000.0
    put("long", {p: torch.cat([canon[p], torch.zeros(n_l, 4, heads * hd)], 1) for p in "kv"}, long_delta)
    # 9 tokens: base = the source + 5 everywhere (mean absolute distance 5 per token), delta 3
    put("mid", {p: canon[p][:, :9] + 5.0 for p in "kv"}, torch.full((n_l, 9, heads * hd), 3.0))
    # 5 tokens: poison (base = the source, delta -100)
    put("short", {p: canon[p][:, :5].clone() for p in "kv"}, torch.full((n_l, 5, heads * hd), -100.0))
    m = get_method("kvcmas", tau=0.3, rank=None)
    m.pools["q"] = pool
    res = engine.run(rb, m, sources={"q": src})
    seg, got = res.segments[1], res.materialized["q"]
    assert seg.status == "corrected" and seg.gate == "accepted"
    assert seg.details["compare_tokens"] == 9 and seg.details["anchors_compared"] == 2
    # token weights softmax(-(0, 5)) on every corrected row, keys and values alike
    w_long = 1 / (1 + math.exp(-5.0))
    c = w_long * 1.0 + (1 - w_long) * 3.0  # 1.013386
    assert abs(c - 1.0133857) < 1e-6
    bump = torch.zeros(1, 1, 12, 1)
    bump[:, :, :9] = c
    assert torch.allclose(got.v, src.v + bump, atol=1e-5)
    assert torch.allclose(got.k, shift_keys(canon_k + bump, got.start, inv), atol=1e-5)
    assert torch.equal(got.v[:, :, 9:], src.v[:, :, 9:])  # rows 9-11: the aligned source as is
