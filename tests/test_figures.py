"""The figure records (kvcmas_bench.results.figures): one name per figure, old names mapped, and a
figure added from this file alone reaching Table 1, the console table, compare and the sweep table."""

from __future__ import annotations

import json
import shutil

import pandas as pd
import pytest
from rich.console import Console

from kvcmas_bench.console import print_run_summary, print_sweep_table
from kvcmas_bench.jobs.compare import compare
from kvcmas_bench.report.tables import TABLE1, table1
from kvcmas_bench.results import figures
from kvcmas_bench.results.figures import CheckRule, Figure, View, canonical, registered
from kvcmas_bench.results.frames import load_dirs, load_run, load_sweep
from kvcmas_bench.results.request import RequestRecord
from kvcmas_bench.results.summary import run_figures
from kvcmas_bench.serving.metrics import sweep_row

from .synthetic import GOLD, make_run, make_sweep


def _widest_output(samples, requests):
    return int(requests["output_tokens"].max())


WIDEST = Figure(
    "output_tokens_widest",
    "widest output (tok)",
    "tokens",
    "the largest number of tokens one agent request generated",
    _widest_output,
    "int",
    ("run", "sweep"),
    views={"table1": View(99, 0), "console": View(99, 0), "sweep": View(99, 0)},
    check=CheckRule("increase", "memory_increase", "widest output", 99, scopes=("run",)),
)


def test_one_name_per_figure_and_no_key_twice():
    keys = [k for f in figures.FIGURES.values() for k in f.keys()]
    assert len(keys) == len(set(keys))
    for old, new in figures.LEGACY_NAMES.items():
        assert old not in figures.FIGURES and new in figures.FIGURES
    # the scheme: TTFT statistics are <quantity>_<stat>_s at both levels, the state peak has one name
    for name in ("ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "e2e_mean_s", "method_state_peak_bytes"):
        assert {"run", "sweep"} <= set(figures.FIGURES[name].scopes)
    with pytest.raises(ValueError, match="already defined"):
        figures.register(Figure("ttft_s", "x", "s", "a legacy name taken again"))


def test_legacy_summary_keys_are_mapped_when_an_old_run_directory_is_read(tmp_path):
    run = make_run(tmp_path / "old", "kvcmas", ["A", "B", "C", "D"])
    old = {"method": "kvcmas", "ttft_s": 0.5, "ttft_s_p50": 0.4, "ttft_s_p90": 0.9, "latency_s": 2.0,
           "latency_s_p50": 1.5, "e2e_s": 0.7, "method_state_bytes": 123, "reuse_ratio": 0.8}  # fmt: skip
    (run / "summary.json").write_text(json.dumps(old))
    s = load_run(run).summary
    assert s == {"method": "kvcmas", "ttft_mean_s": 0.5, "ttft_p50_s": 0.4, "ttft_p90_s": 0.9,
                 "latency_mean_s": 2.0, "latency_p50_s": 1.5, "e2e_mean_s": 0.7, "method_state_peak_bytes": 123,
                 "reuse_ratio": 0.8}  # fmt: skip
    # a current key beside its legacy one wins
    assert canonical({"ttft_s": 1.0, "ttft_mean_s": 2.0}) == {"ttft_mean_s": 2.0}
    sweep = make_sweep(tmp_path / "sweep")
    summary = json.loads((sweep / "summary.json").read_text())
    for row in summary["rows"]:
        row["method_state_bytes"] = 7
    (sweep / "summary.json").write_text(json.dumps(summary))
    rows = load_sweep(sweep).rows
    assert "method_state_bytes" not in rows and (rows["method_state_peak_bytes"] == 7).all()


def test_run_figures_by_hand(tmp_path):
    """Synthetic requests (tests/synthetic.py): per sample a 30-token first agent and a final agent
    with 10 shared tokens over 2 layers, 4 of the 20 entries recomputed (rho 0.8); TTFT 0.1 s each."""
    run = load_run(make_run(tmp_path / "r", "cacheblend", ["A", "B", "C", "D"], rho=0.8, ttft=0.1, latency=2.0))
    f = run_figures(run.samples, run.requests)
    assert f["n"] == 4 and f["accuracy"] == pytest.approx(sum(p == g for p, g in zip("ABCD", GOLD)) / 4)
    assert f["reuse_ratio"] == pytest.approx((4 * 10 * 2 - 4 * 4) / (4 * 10 * 2))
    assert f["ttft_mean_s"] == pytest.approx(0.1) and f["e2e_mean_s"] == pytest.approx(0.2)
    assert f["latency_mean_s"] == pytest.approx(2.0) and f["prompt_tokens_max"] == 40
    assert f["prefilled_tokens"] == 4 * 60 and f["eligible_tokens"] == 40


def _served(traj: str, step: int, arrival: float, ttft: float, out_tokens: int) -> RequestRecord:
    return RequestRecord(f"a{step}", ttft, 2 * ttft, trajectory=traj, step=step, arrival_s=arrival,
                         start_s=arrival, first_token_s=arrival + ttft, completion_s=arrival + 2 * ttft,
                         queue_s=0.0, output_tokens=out_tokens, prompt_tokens=20, layers=2)  # fmt: skip


def test_a_figure_added_here_reaches_table1_console_compare_and_the_sweep_table(tmp_path):
    base = make_run(tmp_path / "base", "kvcmas", ["A", "B", "C", "D"])
    with registered(WIDEST):
        # Table 1: the column, under the figure's header, with the value over the records (4 and 2 tokens)
        assert "widest output (tok)" in [c.header for c in TABLE1]
        t1 = table1(load_dirs([base]))
        assert t1.loc[0, "output_tokens_widest"] == 4
        # the run console table
        con = Console(record=True, width=250)
        run = load_run(base)
        print_run_summary({"method": "kvcmas", "workload": "mmlu", **run_figures(run.samples, run.requests)}, con)
        text = con.export_text()
        assert "widest output (tok)" in text
        # compare: the figure's own check; a candidate generating 8 tokens where the baseline made 4 fails it
        cand = tmp_path / "cand"
        shutil.copytree(base, cand)
        rows = [json.loads(x) for x in (cand / "requests.jsonl").read_text().splitlines()]
        for r in rows:
            r["output_tokens"] = 8 if r["output_tokens"] == 4 else r["output_tokens"]
        (cand / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        cmp = compare(str(base), str(cand))
        check = [c for c in cmp.checks if c.metric == "widest output"]
        assert len(check) == 1 and check[0].status == "FAIL" and (check[0].baseline, check[0].candidate) == (4, 8)
        assert compare(str(base), str(base)).verdict().startswith("PASS")
        # the sweep row and table
        served = [_served("t0", 0, 0.0, 0.1, 5), _served("t0", 1, 0.3, 0.2, 9), _served("t1", 0, 1.0, 0.1, 3)]
        row = sweep_row("kvcmas", 64, 0.0, served)
        assert row["output_tokens_widest"] == 9 and row["ttft_mean_s"] == pytest.approx(0.4 / 3)
        con = Console(record=True, width=400)
        print_sweep_table({"model": "m", "device": "cpu", "rows": [row]}, con)
        assert "widest output (tok)" in con.export_text()
    assert "output_tokens_widest" not in figures.FIGURES
    assert "output_tokens_widest" not in table1(load_dirs([base])).columns


def test_compare_checks_come_from_the_figure_rules():
    assert [f.check.label for f in figures.checked("run")] == [
        "accuracy", "rho", "method state", "agreement", "first-token agreement", "TTFT", "peak mem"]  # fmt: skip
    assert [f.check.label for f in figures.checked("sweep")] == ["rho", "KV+state", "TTFT p50", "TTFT p90", "peak mem"]
    assert pd.Series([f.name for f in figures.checked("sweep")]).is_unique
