"""Gate outcomes as a structured field (issue 47): the outcome type and the gate's routing rules, the
correction's pure pieces (``ops/correction.py``) against hand-computed values, ``SegmentRecord.gate``
(new records and hand-written old-format lines), and the readers that count outcomes from the field."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvcmas_bench.errors import BenchError
from kvcmas_bench.methods import get_method
from kvcmas_bench.ops.correction import CorrectionTally, applied_figures, block_ranges, select_terms, weighted_rows
from kvcmas_bench.ops.gate import rounded_distances
from kvcmas_bench.ops.gate_outcome import GateOutcome, entropy_verdict, gate_route
from kvcmas_bench.results.records import read_run_files
from kvcmas_bench.results.request import RequestRecord, SegmentRecord
from kvcmas_bench.results.summary import accounting

from .test_delta_methods import _fake_pool

G = GateOutcome


# ---- the outcome type -----------------------------------------------------------------------------
def test_gate_outcome_values_are_the_strings_files_hold():
    """The values are what requests.jsonl and summary.json hold (old files included): renaming one
    would make old files unreadable and the committed baseline's accounting differ."""
    assert {o.value for o in G} == {
        "accepted",
        "rejected",
        "scheduled",
        "scheduled_dense",
        "bypassed",
        "no_anchor",
        "too_few_anchors",
    }
    o = G.TOO_FEW_ANCHORS
    assert o == "too_few_anchors" and str(o) == "too_few_anchors" and f"{o}" == "too_few_anchors"
    assert f"{o:>16}" == "too_few_anchors".rjust(16)
    assert json.dumps({o: [o]}) == '{"too_few_anchors": ["too_few_anchors"]}'
    assert {"too_few_anchors": 1}[o] == 1 and o in {"too_few_anchors"}  # hashes as its string


def test_gate_outcome_properties():
    assert {o for o in G if o.compared} == {G.ACCEPTED, G.REJECTED}
    assert {o for o in G if o.accepted} == {G.ACCEPTED}
    assert {o for o in G if o.reuses} == {G.ACCEPTED, G.SCHEDULED, G.BYPASSED}


@pytest.mark.parametrize(
    "lengths, S, pool_size, force, expected",
    [
        ([], 10, 1, False, (G.NO_ANCHOR, 0)),
        ([7], 10, 1, False, (G.BYPASSED, 7)),  # the anchor's prefix
        ([12], 10, 1, False, (G.BYPASSED, 10)),  # at most the segment
        ([9, 8], 10, 1, False, (G.BYPASSED, 9)),  # pool of one: the longest anchor, never compared
        ([7], 10, 4, True, (G.SCHEDULED, 7)),  # a scheduled reuse with one anchor
        ([7], 10, 4, False, (G.TOO_FEW_ANCHORS, 0)),
        ([], 10, 4, True, (G.TOO_FEW_ANCHORS, 0)),  # scheduled, but nothing to correct with
        ([], 10, 4, False, (G.TOO_FEW_ANCHORS, 0)),
        ([12, 8, 3], 10, 4, False, (None, 8)),  # compare: the longest prefix two anchors cover
        ([12, 11], 10, 4, True, (None, 10)),  # scheduled with two anchors: compared too
    ],
)
def test_gate_route_by_hand(lengths, S, pool_size, force, expected):
    assert gate_route(lengths, S, pool_size, force) == expected


def test_entropy_verdict_by_hand():
    assert entropy_verdict(0.3, 0.3, False) is G.ACCEPTED  # at tau: accepted
    assert entropy_verdict(0.31, 0.3, False) is G.REJECTED
    assert entropy_verdict(0.31, 0.3, True) is G.SCHEDULED
    assert entropy_verdict(0.1, 0.3, True) is G.ACCEPTED  # scheduled, but the gate accepts anyway
    assert entropy_verdict(math.nan, 0.3, False) is G.SCHEDULED  # as recorded before (see the docstring)


def test_the_gate_records_outcomes_as_gate_outcomes():
    """Every path of ``OnlineDeltaCorrection.gate`` puts a ``GateOutcome`` (not a bare string) in details."""
    ref_v = torch.zeros(2, 8, 6)
    cases = [
        (dict(tau=1.0), _fake_pool(10, 1), False, G.TOO_FEW_ANCHORS),
        (dict(tau=1.0), _fake_pool(10, 2), False, G.ACCEPTED),
        (dict(tau=1.0), _fake_pool(10, 1), True, G.SCHEDULED),
        (dict(tau=1.0, anchors=1), _fake_pool(1, 0), False, G.NO_ANCHOR),
        (dict(tau=1.0, anchors=1), _fake_pool(1, 1), False, G.BYPASSED),
    ]
    for kw, pool, force, outcome in cases:
        details: dict = {}
        decision = get_method("kvcmas", **kw).gate(pool, "B", ref_v, 8, details, force=force)
        assert type(details["gate"]) is GateOutcome and details["gate"] is outcome, (kw, force)
        assert (decision is not None) == outcome.reuses
    pool = _fake_pool(10, 2)
    pool.anchors[1].entries["B"].base_v = pool.anchors[0].entries["B"].base_v  # equidistant: entropy 1
    details = {}
    assert get_method("kvcmas", tau=0.5).gate(pool, "B", ref_v, 8, details) is None
    assert details["gate"] is G.REJECTED


# ---- the correction's pieces ------------------------------------------------------------------------
def test_block_ranges_by_hand():
    assert block_ranges(10, 4) == [(0, 4), (4, 4), (8, 2)]
    assert block_ranges(8, 4) == [(0, 4), (4, 4)]
    assert block_ranges(3, 256) == [(0, 3)]
    assert block_ranges(0, 4) == []
    assert block_ranges(3, 0) == [(0, 1), (1, 1), (2, 1)]  # at least one row per block


def test_select_terms_prunes_only_when_most_terms_go():
    # 2 anchors x 4 tokens, tol 0.2: 6 of 8 terms kept (> half): every term, by the stacked GEMM
    w = torch.tensor([[0.9, 0.5, 0.6, 0.98], [0.1, 0.5, 0.4, 0.02]])
    keep, mass, stacked = select_terms(w, 0.2)
    assert stacked and keep.all() and keep.shape == w.shape and torch.equal(mass, torch.zeros(4))
    # 3 anchors x 2 tokens, tol 0.1: 2 of 6 kept: the sparse apply, dropped mass 0.01 + 0.01, 0.05 + 0.05
    w = torch.tensor([[0.98, 0.05], [0.01, 0.9], [0.01, 0.05]])
    keep, mass, stacked = select_terms(w, 0.1)
    assert not stacked
    assert keep.tolist() == [[True, False], [False, True], [False, False]]
    assert torch.allclose(mass, torch.tensor([0.02, 0.10]))
    # exactly half kept: still sparse (more than half switches)
    keep, mass, stacked = select_terms(torch.tensor([[0.9, 0.8], [0.1, 0.2]]), 0.5)
    assert not stacked and keep.tolist() == [[True, True], [False, False]]
    assert torch.allclose(mass, torch.tensor([0.1, 0.2]))
    # tol 0: nothing pruned, stacked
    assert select_terms(w, 0.0)[2]


def test_weighted_rows_is_the_weighted_sum_by_hand():
    r0 = torch.tensor([[[1.0], [2.0]]])  # [layers 1, tokens 2, D 1]
    r1 = torch.tensor([[[10.0], [20.0]]], dtype=torch.bfloat16)
    w = torch.tensor([[0.25, 0.5], [0.75, 0.5]])
    out = weighted_rows(w, [r0, r1])
    assert out.dtype == torch.float32
    assert out.flatten().tolist() == [0.25 * 1 + 0.75 * 10, 0.5 * 2 + 0.5 * 20]  # 7.75, 11.0


def test_correction_tally_adds_blocks_and_reads_once():
    t0 = CorrectionTally.zeros("cpu")
    t = t0.add("k", torch.ones(2, 3), torch.tensor([[True, False], [True, True]]), torch.tensor([0.1, 0.3]))
    t = t.add("v", torch.ones(2, 3), torch.tensor([[True, True]]), torch.empty(0))  # no token dropped anything
    t = t.add("k", torch.ones(1), torch.tensor([[True]]), torch.tensor([0.2]))
    assert t.read() == (False, 4.0, 2.0, float(torch.tensor(0.3)))
    assert t0.read() == (False, 0.0, 0.0, 0.0)  # adding returns a new tally
    nan = t.add("v", torch.tensor([1.0, math.nan]), torch.tensor([[True]]), torch.tensor([0.0]))
    assert nan.read()[0] is True and t.read()[0] is False
    assert t.add("v", torch.tensor([math.inf]), torch.tensor([[True]]), torch.tensor([0.0])).read()[0]
    # another rank's heads held the NaN: the reduced flag makes this rank bad too
    assert t.read(reduce=lambda bad: bad + 1.0)[0] is True
    assert t.read(reduce=lambda bad: bad)[0] is False


def test_applied_figures_by_hand():
    assert applied_figures(30.0, 15.0, 0.123456789, 20) == {"anchors_applied": [1.5, 0.75], "dropped_weight": 0.123457}
    assert applied_figures(7.0, 7.0, 0.0, 3) == {"anchors_applied": [2.333, 2.333], "dropped_weight": 0.0}


def test_rounded_distances_by_hand():
    assert rounded_distances(torch.tensor([4.0, 2.0, 0.0])) == [2.0, 1.41421, 0.0]
    assert rounded_distances(torch.tensor([1.5e10])) == [122474.0]  # sqrt = 122474.487...


# ---- the record's field -----------------------------------------------------------------------------
def test_segment_record_moves_the_gate_out_of_details_and_writes_its_string():
    details = {"anchors_available": 2, "gate": G.ACCEPTED, "entropy": 0.1}
    rec = SegmentRecord("PH", 12, "corrected", slot="q", details=details)
    assert rec.gate is G.ACCEPTED and rec.details == {"anchors_available": 2, "entropy": 0.1}
    assert details["gate"] is G.ACCEPTED  # the caller's dict is left as it was
    d = rec.to_dict()
    assert type(d["gate"]) is str and d["gate"] == "accepted" and "gate" not in d["details"]
    again = SegmentRecord.from_dict(json.loads(json.dumps(d)))
    assert again == rec and again.gate is G.ACCEPTED
    assert "gate" not in SegmentRecord("PH", 3).to_dict()  # no gate: no key
    with pytest.raises(ValueError, match="differ"):
        SegmentRecord("PH", 3, gate=G.ACCEPTED, details={"gate": "rejected"})
    with pytest.raises(ValueError):
        SegmentRecord.from_dict({"kind": "PH", "tokens": 3, "gate": "maybe"})


OLD_LINE = (
    '{"agent": "B", "ttft_s": 0.1, "e2e_s": 0.2, "sample_id": "s0", "step": 0, "segments": ['
    '{"kind": "PF", "tokens": 5, "status": "exact", "name": "sys"}, '
    '{"kind": "PH", "tokens": 12, "status": "corrected", "slot": "q", "details": '
    '{"anchors_available": 3, "compare_tokens": 12, "entropy": 0.2, "anchors_compared": 3, '
    '"distances": [1.0, 2.0, 3.0], "gate": "accepted", "anchors_used": 1}}, '
    '{"kind": "PH", "tokens": 7, "status": "exact", "slot": "r", "details": '
    '{"anchors_available": 2, "compare_tokens": 7, "entropy": 0.9, "anchors_compared": 2, '
    '"distances": [1.0, 1.1], "gate": "rejected"}}, '
    '{"kind": "PH", "tokens": 4, "status": "exact", "slot": "s", "details": '
    '{"anchors_available": 1, "gate": "too_few_anchors"}}]}'
)


def _old_run(tmp_path, line: str = OLD_LINE):
    """A run directory written before the field existed: the outcome only in ``details["gate"]``."""
    run = tmp_path / "old-run"
    run.mkdir()
    (run / "samples.jsonl").write_text('{"sample_id": "s0", "correct": true}\n')
    (run / "requests.jsonl").write_text(line + "\n")
    return run


def test_an_old_format_line_reads_into_the_field(tmp_path):
    run = _old_run(tmp_path)
    _, _, records, _ = read_run_files(run / "samples.jsonl", run / "requests.jsonl")
    (rec,) = records
    assert [s.gate for s in rec.segments] == [None, G.ACCEPTED, G.REJECTED, G.TOO_FEW_ANCHORS]
    assert all("gate" not in s.details for s in rec.segments)
    assert rec.segments[1].details["distances"] == [1.0, 2.0, 3.0]
    # written again, the outcome is the segment's field
    seg = rec.to_dict()["segments"][1]
    assert seg["gate"] == "accepted" and "gate" not in seg["details"]


def test_an_unknown_outcome_in_a_file_is_a_corrupt_line(tmp_path):
    run = _old_run(tmp_path, OLD_LINE.replace('"gate": "rejected"', '"gate": "perhaps"'))
    with pytest.raises(BenchError, match=r"requests\.jsonl.*line 1.*perhaps"):
        read_run_files(run / "samples.jsonl", run / "requests.jsonl")


def test_ablate_accept_share_and_decisions_read_old_runs_from_the_field(tmp_path):
    from kvcmas_bench.jobs.ablate import _accept_share, recorded_decisions

    run = _old_run(tmp_path)
    assert _accept_share(run) == 12 / (12 + 7)  # accepted tokens over compared (accepted + rejected)
    assert recorded_decisions(run) == [([1.0, 2.0, 3.0], 12), ([1.0, 1.1], 7)]


def test_accounting_counts_outcomes_from_the_field_as_strings():
    def seg(gate, **details):
        return SegmentRecord("PH", 4, slot="q", gate=gate, details=details)

    reqs = [
        RequestRecord("A", 0.1, 0.2, segments=[seg(G.TOO_FEW_ANCHORS, anchors_available=1), seg(None)]),
        RequestRecord("B", 0.1, 0.2, segments=[seg(G.ACCEPTED, entropy=0.25, compare_tokens=4, anchors_used=1)]),
        # an old record: the outcome in details only
        RequestRecord.from_dict(
            {
                "agent": "C",
                "ttft_s": 0.1,
                "e2e_s": 0.2,
                "segments": [{"kind": "PH", "tokens": 4, "details": {"gate": "too_few_anchors"}}],
            }
        ),
        RequestRecord("D", 0.1, 0.2, segments=[SegmentRecord("PF", 4, gate=G.ACCEPTED)]),  # not shared: not counted
    ]
    acc = accounting(reqs)
    assert acc["gate"] == {"too_few_anchors": 2, "accepted": 1}
    assert list(acc["gate"]) == ["too_few_anchors", "accepted"] and all(type(k) is str for k in acc["gate"])
    assert json.dumps(acc["gate"]) == '{"too_few_anchors": 2, "accepted": 1}'
    assert acc["gate_entropy"]["n"] == 1 and acc["compare_tokens"]["mean"] == 4.0
    assert "gate" not in accounting([RequestRecord("A", 0.1, 0.2, segments=[seg(None)])])
