"""A controlled reuse ratio (serve-sweep ``--rho`` for every method): a segment scheduled "dense"
is prefilled densely by every reuse method (delta methods learn from it as from a fallback); one
scheduled "reuse" is reused by gated methods whatever the gate says."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvcmas_bench.methods import get_method
from kvcmas_bench.segments import Segment

from .conftest import rand_ids
from .test_paper_semantics import chain, chain_request


def _scheduled(request, decision):
    request.segments = [replace(s, schedule=decision) if s.kind == "PH" else s for s in request.segments]
    return request


def test_schedule_values_are_checked():
    with pytest.raises(ValueError):
        Segment("PH", [1, 2], slot="q", schedule="maybe")


def test_scheduled_reuse_overrides_a_rejecting_gate_and_scheduled_dense_a_bypassed_one(engine):
    rejecting = dict(anchors=4, rank=4, gate_mode="scaled", gate_temperature=1e6, tau=0.0)
    m = get_method("kvcmas", **rejecting)
    chain(engine, m, rand_ids(12, 1), nodes=("A#0", "B#1"))  # one anchor with B's entry
    q = rand_ids(12, 2)
    a = engine.run(chain_request("A#0", q), m)
    src = {"q": a.materialized["q"]}
    plain = engine.run(chain_request("B#1", q), m, sources=src)
    assert plain.segments[1].status == "exact" and plain.segments[1].gate == "too_few_anchors"
    forced = engine.run(_scheduled(chain_request("B#1", q), "reuse"), m, sources=src)
    assert forced.segments[1].status == "corrected" and forced.segments[1].gate == "scheduled"
    chain(engine, m, rand_ids(12, 3), nodes=("A#0", "B#1"))  # now 3 anchors; the gate still rejects
    forced = engine.run(_scheduled(chain_request("B#1", q), "reuse"), m, sources=src)
    seg = forced.segments[1]
    assert seg.status == "corrected" and seg.gate == "scheduled" and seg.details["entropy"] > 0.9
    v1 = get_method("kvcmas", anchors=1, rank=4)
    chain(engine, v1, rand_ids(12, 1), nodes=("A#0", "B#1"))
    before = len(v1.pools["q"].anchors[0].entries)
    dense = engine.run(_scheduled(chain_request("B#1", q), "dense"), v1, sources=src)
    assert dense.segments[1].status == "exact" and dense.segments[1].gate == "scheduled_dense"
    assert v1.stats["dense_fallback"] == 2 and len(v1.pools["q"].anchors) == 1 and before == 1  # learned from it


@pytest.mark.parametrize("name", ["fullshared", "graphflow"])
def test_scheduled_dense_is_prefilled_by_ungated_methods(engine, name):
    m = get_method(name)
    q = rand_ids(12, 4)
    a = engine.run(chain_request("A#0", q), get_method("nonshared"))
    res = engine.run(_scheduled(chain_request("B#1", q), "dense"), m, sources={"q": a.materialized["q"]})
    assert res.segments[1].status == "exact" and res.segments[1].prefilled_tokens == 12
