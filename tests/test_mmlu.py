"""MMLU loading and letter extraction."""

from __future__ import annotations

import pytest

from kvcmas_bench.errors import BenchError
from kvcmas_bench.workloads import get_workload
from kvcmas_bench.workloads.mmlu import extract_letter


def test_offline_mmlu_drops_header_rows():
    samples = get_workload("mmlu").load()
    assert len(samples) == 14042
    assert all(s.gold in "ABCD" for s in samples)
    assert "\nA. " in samples[0].query and "\nD. " in samples[0].query
    assert len({s.meta["subject"] for s in samples}) == 57


def test_subjects_filter_and_unknown_subject():
    anatomy = get_workload("mmlu", subjects=["anatomy"]).load()
    assert anatomy and all(s.meta["subject"] == "anatomy" for s in anatomy)
    with pytest.raises(BenchError, match="unknown MMLU subject"):
        get_workload("mmlu", subjects=["astrology"]).load()


@pytest.mark.parametrize(
    "text,letter",
    [
        ("Answer: C", "C"),
        ("The answer is (b).", "B"),
        ("Answer: **A**", "A"),
        ("B. because ...", "B"),
        ("I think option D is right", "D"),
        ("(C) is correct", "C"),
        ("", None),
        ("none of these", None),
        ("The final answer is: D\nA is wrong", "D"),
        ("42", None),
    ],
)
def test_extract_letter(text, letter):
    assert extract_letter(text) == letter


def test_score():
    wl = get_workload("mmlu")
    s = wl.load()[0]
    assert wl.score(s, f"Answer: {s.gold}") == (s.gold, True)
    assert wl.score(s, "no idea")[1] is False
