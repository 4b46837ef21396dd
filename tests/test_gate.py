"""The reliability gate: the paper's scores (raw distances, T = 1) and the scale-aware ``scaled`` gate
(relative excess distance over the closest anchor), on synthetic pools and on recorded decisions;
``--target-reuse`` under both."""

from __future__ import annotations

import math

import pytest
import torch

from kvcmas_bench.calibration import accepted_share, check_reachable, tau_for_reuse
from kvcmas_bench.errors import BenchError, OptionError
from kvcmas_bench.methods import get_method
from kvcmas_bench.methods.anchors import AnchorPool
from kvcmas_bench.ops.gate import acceptance_curve, entropy_of, gate_scores, two_anchor_entropy
from kvcmas_bench.ops.lowrank import gate_entropy

TAUS = [i / 20 for i in range(21)]


def _two_anchor_pool(eps: float, scale: float, L: int = 3, S: int = 16, D: int = 8) -> tuple[AnchorPool, torch.Tensor]:
    """A pool of two anchors: one at ``scale * u`` from the reference, the other ``(1 + eps)`` times as
    far (the same direction), so their relative gap is exactly ``eps`` whatever the scale."""
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(L, S, D, generator=g)
    u = torch.randn(L, S, D, generator=g)
    u = u / u.norm()
    pool = AnchorPool(10)
    for i, f in enumerate((1.0, 1.0 + eps)):
        base = ref + scale * f * u
        pool.add(f"src{i}", ("src", i), base, base, "B", 0.1 * base, 0.1 * base, None)
    return pool, ref


def _entropy(method, pool, ref) -> float:
    details: dict = {}
    method.gate(pool, "B", ref, ref.shape[1], details)
    return details["entropy"]


@pytest.mark.parametrize("scale", [0.01, 1.0, 300.0])
def test_scaled_gate_entropy_rises_smoothly_as_two_anchors_approach(scale):
    m = get_method("kvcmas", tau=1.0, gate_mode="scaled", gate_temperature=0.1)
    eps = [0.8, 0.4, 0.2, 0.1, 0.05, 0.02, 0.01, 0.0]
    h = [_entropy(m, *_two_anchor_pool(e, scale)) for e in eps]
    # the closed form of two anchors, and strictly rising as the gap closes, up to 1 when equidistant
    for e, got in zip(eps, h):
        assert got == pytest.approx(two_anchor_entropy(e / 0.1), abs=1e-4)
    assert all(a < b for a, b in zip(h, h[1:])) and h[-1] == pytest.approx(1.0)
    # smooth: no step between neighbouring gaps is larger than the closed form's own slope allows
    assert max(b - a for a, b in zip(h, h[1:])) < 0.45
    assert h[0] < 0.05


def test_paper_gate_is_one_hot_at_real_scale_and_flat_only_at_the_very_end():
    """The paper's scores depend on the cache's scale: at scale 300 the entropy is ~0 until the two
    anchors are within a fraction of a percent, then jumps; the scaled gate's curve does not move."""
    paper = get_method("kvcmas", tau=1.0)
    scaled = get_method("kvcmas", tau=1.0, gate_mode="scaled", gate_temperature=0.1)
    eps = [0.2, 0.05, 0.02, 0.01]
    hp = [_entropy(paper, *_two_anchor_pool(e, 300.0)) for e in eps]
    hs_small = [_entropy(scaled, *_two_anchor_pool(e, 0.01)) for e in eps]
    hs_big = [_entropy(scaled, *_two_anchor_pool(e, 300.0)) for e in eps]
    # one-hot while the gap (in raw units: eps x 300) is well above T = 1, i.e. down to a few percent
    assert max(hp[:2]) < 1e-4 and hp[-1] > 0.1
    assert hs_small == pytest.approx(hs_big, abs=1e-4)  # scale-invariant (up to float32 distances)
    assert min(hs_big) > 0.3


def test_gate_scores_closed_forms():
    sq = torch.tensor([4.0, 9.0, 16.0])
    assert torch.allclose(gate_scores(sq, "paper"), torch.tensor([2.0, 3.0, 4.0]))
    assert torch.allclose(gate_scores(sq, "scaled", 0.5), torch.tensor([0.0, 1.0, 2.0], dtype=torch.float64))
    # invariant to scaling every distance
    assert torch.allclose(gate_scores(sq * 1e6, "scaled", 0.5), gate_scores(sq, "scaled", 0.5))
    # an exact anchor makes the others infinitely far: one-hot, accepted at any tau
    exact = gate_scores(torch.tensor([0.0, 1.0, 2.0]), "scaled")
    assert exact[0] == 0 and torch.isinf(exact[1:]).all()
    h, g = gate_entropy(exact)
    assert h == pytest.approx(0.0) and g[0] == pytest.approx(1.0)
    # equidistant: flat, entropy 1, in both gates
    assert entropy_of([5.0, 5.0], "scaled") == pytest.approx(1.0)
    assert entropy_of([5.0, 5.0], "paper") == pytest.approx(1.0)
    with pytest.raises(ValueError):
        gate_scores(sq, "nope")


def test_gate_knobs_are_validated():
    with pytest.raises(OptionError, match="gate_mode"):
        get_method("kvcmas", gate_mode="soft")
    with pytest.raises(OptionError, match="gate_temperature"):
        get_method("kvcmas", gate_temperature=0.0)
    with pytest.raises(OptionError, match="delta_rank"):
        get_method("kvcmas", delta_rank=0)
    assert "delta_rank" not in get_method("kvcomm").knobs()  # KVComm's anchors are full-dimensional


def _recorded_decisions(n: int = 60, seed: int = 0) -> list[tuple[list[float], int]]:
    """A recorded set of gate decisions at the scale of real caches: per decision the anchors'
    distances (hundreds, a few percent apart: SmolLM2's MMLU caches give gaps of 0.3% to 15%,
    median 2%) and its token count."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        n_anchors = int(torch.randint(2, 6, (1,), generator=g))
        base = 300.0 + 600.0 * float(torch.rand(1, generator=g))
        gap = 0.02 * math.exp(0.8 * float(torch.randn(1, generator=g)))  # best vs runner-up, median 2%
        rel = [0.0, gap] + [gap + 0.05 * float(torch.rand(1, generator=g)) for _ in range(n_anchors - 2)]
        tokens = int(torch.randint(8, 120, (1,), generator=g))
        out.append(([base * (1 + r) for r in rel], tokens))
    return out


def test_rho_is_monotone_in_tau_on_recorded_decisions():
    decisions = _recorded_decisions()
    scaled = [(entropy_of(d, "scaled", 0.01), n) for d, n in decisions]
    paper = [(entropy_of(d, "paper"), n) for d, n in decisions]
    rho_s, rho_p = acceptance_curve(scaled, TAUS), acceptance_curve(paper, TAUS)
    assert all(a <= b for a, b in zip(rho_s, rho_s[1:])) and all(a <= b for a, b in zip(rho_p, rho_p[1:]))
    # scaled: tau trades rho over the whole range, in many small steps
    assert rho_s[0] < 0.1 and rho_s[-1] == 1.0
    assert len(set(rho_s)) >= 12 and max(b - a for a, b in zip(rho_s, rho_s[1:])) < 0.25
    # paper: a one-hot softmax at this scale; every tau in (0, 1) accepts over 90% (tau decides ~nothing)
    assert min(rho_p[1:-1]) > 0.9


def test_rho_is_monotone_in_tau_through_the_method_gate():
    """The same through ``gate()``: replaying a fixed pool of decisions at rising tau accepts a
    growing set of them (each decision accepted at tau stays accepted at any larger tau)."""
    pools = [_two_anchor_pool(e, 50.0) for e in (0.01, 0.03, 0.06, 0.1, 0.15, 0.25, 0.4, 0.7)]
    accepted_before: set[int] = set()
    counts = []
    for tau in TAUS:
        m = get_method("kvcmas", tau=tau, gate_mode="scaled", gate_temperature=0.1)
        acc = {i for i, (pool, ref) in enumerate(pools) if m.gate(pool, "B", ref, ref.shape[1]) is not None}
        assert accepted_before <= acc
        accepted_before = acc
        counts.append(len(acc))
    assert counts[0] == 0 and counts[-1] == len(pools) and len(set(counts)) >= 5


def test_gate_details_record_the_distances():
    m = get_method("kvcmas", tau=1.0)
    pool, ref = _two_anchor_pool(0.5, 2.0)
    details: dict = {}
    m.gate(pool, "B", ref, ref.shape[1], details)
    assert details["distances"] == pytest.approx([2.0, 3.0], rel=1e-4)
    assert details["entropy"] == pytest.approx(entropy_of(details["distances"], "paper"), abs=1e-6)
    assert m.entropies == [(details["entropy"], ref.shape[1])]


def test_target_reuse_is_reachable_under_the_scaled_gate_and_refused_under_a_one_hot_gate():
    decisions = _recorded_decisions(seed=1)
    scaled = [(entropy_of(d, "scaled", 0.01), n) for d, n in decisions]
    for target in (0.2, 0.5, 0.8):
        tau = tau_for_reuse(scaled, target)
        assert abs(accepted_share(scaled, tau) - target) < 0.05
        check_reachable(scaled, target, tau, "scaled")  # no error
    paper = [(entropy_of(d, "paper"), n) for d, n in decisions]
    tau = tau_for_reuse(paper, 0.5)
    with pytest.raises(BenchError, match="one-hot") as exc:
        check_reachable(paper, 0.5, tau, "paper")
    assert "gate_mode=scaled" in str(exc.value) and "\n" not in str(exc.value)
    check_reachable(paper, 1.0, tau_for_reuse(paper, 1.0), "paper")  # full reuse is reachable
    # coarse but not degenerate: a jump over the target is named as such
    with pytest.raises(BenchError, match="jumps from 0.10 to 0.90"):
        coarse = [(0.2, 10), (0.5, 80), (0.9, 10)]
        check_reachable(coarse, 0.5, tau_for_reuse(coarse, 0.5), "scaled")
    assert not math.isnan(acceptance_curve(paper, [0.5])[0])
