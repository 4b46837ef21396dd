"""compare: identical inputs pass; injected accuracy, agreement and TTFT regressions fail with exit 1
naming the metric; missing, corrupt and incomparable inputs exit 2 with one line; --exact; sweeps."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from kvcmas_bench.jobs.compare import Limits, compare, parse_threshold, write_baseline
from kvcmas_bench.results.frames import read_jsonl

from .conftest import run_cli
from .synthetic import make_matrix, make_sweep


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A suite-shaped directory of synthetic runs (NonShared, FullShared, KVCMAS, CacheBlend x2)."""
    root = tmp_path_factory.mktemp("base")
    runs = make_matrix(root)
    cells = {}
    for name, path in runs.items():
        cells[name] = {"workload": "mmlu", "method": name.split("-")[0], "path": path.name, "status": "done"}
    (root / "suite.json").write_text(json.dumps({"command": "suite", "settings": {}, "cells": cells}))
    return root


@pytest.fixture
def cand(base, tmp_path):
    out = tmp_path / "cand"
    shutil.copytree(base, out)
    return out


def edit_jsonl(path, fn):
    rows = [fn(r) for r in read_jsonl(path)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def cli(args, capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = run_cli(["compare", *map(str, args)])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_identical_inputs_pass(base, cand, tmp_path, capsys):
    md = tmp_path / "cmp.md"
    rc, out, _ = cli([base, cand, "--exact", "--markdown", md], capsys)
    assert rc == 0
    lines = out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("PASS") and "deterministic values identical" in lines[0]
    text = md.read_text()
    assert "compare: PASS" in text and "passing checks" in text


def _wrong_answer(r):
    # KVCMAS on mmlu-0 (gold A, NonShared A): a wrong answer lowers accuracy and agreement
    return {**r, "prediction": "D", "correct": False} if r["sample_id"] == "mmlu-0" else r


def _other_wrong_answer(r):
    # KVCMAS on mmlu-4 (gold A): NonShared said B, KVCMAS B; now C: still wrong, agreement drops
    return {**r, "prediction": "C"} if r["sample_id"] == "mmlu-4" else r


def _slower(r):
    return {**r, "ttft_s": r["ttft_s"] * 3}


@pytest.mark.parametrize(
    "edit,file,metric",
    [
        (_wrong_answer, "samples.jsonl", "accuracy"),
        (_other_wrong_answer, "samples.jsonl", "agreement"),
        (_slower, "requests.jsonl", "TTFT"),
    ],
)
def test_injected_regression_fails_naming_the_metric(base, cand, tmp_path, capsys, edit, file, metric):
    edit_jsonl(cand / "kv" / file, edit)
    md = tmp_path / "cmp.md"
    rc, out, err = cli([base, cand, "--markdown", md], capsys)
    assert rc == 1
    (line,) = out.strip().splitlines()
    assert line.startswith("FAIL") and f"mmlu/kvcmas {metric} " in line
    assert metric in err and "**FAIL**" in md.read_text()
    if metric == "agreement":
        assert "accuracy" not in line  # the accuracy did not change


def test_thresholds_absolute_and_relative(base, cand):
    edit_jsonl(cand / "kv" / "samples.jsonl", _wrong_answer)  # accuracy 5/6 -> 4/6, agreement 5/6 -> 4/6
    loose = Limits(accuracy_drop=parse_threshold("x", "0.2"), agreement_drop=parse_threshold("x", "20%"))
    assert not compare(str(base), str(cand), loose).regressed
    tight = Limits(accuracy_drop=parse_threshold("x", "10%"), agreement_drop=parse_threshold("x", "0.2"))
    assert [c.metric for c in compare(str(base), str(cand), tight).failures] == ["accuracy"]
    assert parse_threshold("x", "64MiB", byte_units=True).value == 64 * 2**20
    for bad in ("-1", "abc", "5MiB"):
        with pytest.raises(Exception, match="x"):
            parse_threshold("x", bad)


def _all_wrong(r):
    # KVCMAS wrong on every sample: it was right on 5 (mmlu-0..3, mmlu-5), so 5 discordant pairs, none
    # the other way: exact McNemar p = 2 * 0.5**5 = 0.0625
    return {**r, "prediction": "X", "correct": False}


def test_significance_counts_only_a_significant_accuracy_drop(base, cand, tmp_path, capsys):
    edit_jsonl(cand / "kv" / "samples.jsonl", _wrong_answer)  # 5/6 -> 4/6: one discordant pair, p = 1
    rc, out, _ = cli([base, cand], capsys)
    assert rc == 1 and "mmlu/kvcmas accuracy" in out
    md = tmp_path / "cmp.md"
    # the agreement drop is not under the significance rule: allowed here to isolate the accuracy check
    rc, out, _ = cli([base, cand, "--significance", "0.05", "--max-agreement-drop", "1", "--markdown", md], capsys)
    assert rc == 0 and out.startswith("PASS")
    text = md.read_text()
    assert "unless McNemar p >= 0.05" in text
    note = "mmlu/kvcmas: accuracy -0.167, not significant: McNemar p = 1 (of 6 paired samples, 1 lost, 0 gained)"
    assert note in text
    cmp = compare(str(base), str(cand), Limits(significance=0.05))
    (acc,) = [c for c in cmp.checks if c.metric == "accuracy" and c.scope == "mmlu/kvcmas"]
    assert acc.status == "ok" and "p = 1" in acc.note


def test_significance_level_decides_a_larger_drop(base, cand, capsys):
    edit_jsonl(cand / "kv" / "samples.jsonl", _all_wrong)  # 5/6 -> 0/6: b = 5, c = 0, p = 0.0625
    lim = dict(agreement_drop=parse_threshold("x", "1"))
    assert not compare(str(base), str(cand), Limits(significance=0.05, **lim)).regressed
    cmp = compare(str(base), str(cand), Limits(significance=0.1, **lim))
    (fail,) = cmp.failures
    assert fail.metric == "accuracy" and "McNemar p = 0.0625 (of 6 paired samples, 5 lost, 0 gained)" in fail.line()
    rc, out, _ = cli([base, cand, "--significance", "0.1", "--max-agreement-drop", "1"], capsys)
    assert rc == 1 and "McNemar p = 0.0625" in out
    for bad in ("0", "1", "1.5", "-0.1"):
        assert "--significance" in _one_line_exit_2([base, cand, "--significance", bad])


def test_repeats_are_matched_by_seed(tmp_path):
    from .synthetic import make_run

    def suite(root, preds_seed1):
        cells = {}
        for seed, preds in ((0, ["A", "B", "C", "D", "B", "B"]), (1, preds_seed1)):
            name = "mmlu/kvcmas" if seed == 0 else f"repeat-{seed}/mmlu/kvcmas"
            make_run(root / name, "kvcmas", preds, seed=seed)
            cells[name] = {"workload": "mmlu", "method": "kvcmas", "path": name, "status": "done"}
        (root / "suite.json").write_text(json.dumps({"command": "suite", "settings": {}, "cells": cells}))
        return root

    a = suite(tmp_path / "a", ["A", "B", "C", "D", "A", "B"])
    b = suite(tmp_path / "b", ["A", "B", "C", "D", "A", "C"])  # seed 1: 6/6 -> 5/6
    cmp = compare(str(a), str(b), Limits(exact=True))
    assert cmp.pairs == 2 and [(c.scope, c.metric) for c in cmp.failures] == [("mmlu/kvcmas seed=1", "accuracy")]


def test_exact_fails_on_a_changed_first_token(base, cand, capsys):
    edit_jsonl(cand / "kv" / "requests.jsonl", lambda r: {**r, "first_token_id": 99} if r["step"] == 0 else r)
    # first-token agreement with NonShared drops too; without that check, --exact still fails
    rc, out, err = cli([base, cand, "--max-agreement-drop", "1", "--exact"], capsys)
    assert rc == 1 and "first_token_id differs in 6 of 12 requests" in out + err
    rc, out, _ = cli([base, cand, "--max-agreement-drop", "1"], capsys)
    assert rc == 0 and "deterministic values differ" in out


def test_timings_skipped_across_hardware(base, cand, capsys):
    edit_jsonl(cand / "kv" / "requests.jsonl", _slower)
    cfg = json.loads((cand / "kv" / "config.json").read_text())
    cfg["hardware"]["cpu_count"] = 64
    (cand / "kv" / "config.json").write_text(json.dumps(cfg))
    rc, out, err = cli([base, cand], capsys)
    assert rc == 0 and "timings not compared, hardware differs" in err


def _one_line_exit_2(args) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "kvcmas_bench.cli", "compare", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


def _model(cand):
    p = cand / "kv" / "config.json"
    p.write_text(json.dumps({**json.loads(p.read_text()), "model": "other-model"}))


def _seed(cand):
    for d in ("ns", "fs", "kv", "cb9", "cb5"):
        p = cand / d / "config.json"
        p.write_text(json.dumps({**json.loads(p.read_text()), "seed": 7}))


def _samples(cand):
    for name in ("samples.jsonl", "requests.jsonl"):  # a coherent run over another sample
        edit_jsonl(cand / "kv" / name, lambda r: {**r, "sample_id": "mmlu-10"} if r["sample_id"] == "mmlu-0" else r)


def _corrupt(cand):
    with open(cand / "kv" / "requests.jsonl", "r+") as f:
        f.write("garbage\n")


def _missing_run(cand):
    shutil.rmtree(cand / "kv")


@pytest.mark.parametrize(
    "damage,needle",
    [
        (_model, "different model"),
        (_seed, "different seed"),
        (_samples, "different samples"),
        (_corrupt, "corrupt (line 1 is not JSON)"),
        (_missing_run, "no run of mmlu/kvcmas"),
    ],
)
def test_unusable_inputs_exit_2_with_one_line(base, cand, damage, needle):
    damage(cand)
    assert needle in _one_line_exit_2([base, cand])


def test_missing_directory_and_kind_mismatch(base, tmp_path):
    assert "does not exist" in _one_line_exit_2([base, tmp_path / "nope"])
    sweep = make_sweep(tmp_path / "sweep")
    assert "is a suite directory and the candidate a sweep" in _one_line_exit_2([base, sweep])
    assert "--max-ttft-increase" in _one_line_exit_2([base, base, "--max-ttft-increase", "fast"])


def test_sweeps(tmp_path, capsys):
    a, b = make_sweep(tmp_path / "a"), make_sweep(tmp_path / "b")
    rc, out, _ = cli([a, b], capsys)
    assert rc == 0 and out.startswith("PASS")
    s = json.loads((b / "summary.json").read_text())
    s["rows"][4]["ttft_p90_s"] *= 2  # kvcmas at QPS 0.25
    (b / "summary.json").write_text(json.dumps(s))
    rc, out, _ = cli([a, b], capsys)
    assert rc == 1 and "kvcmas@2048 qps 0.25 TTFT p90" in out
    cfg = json.loads((b / "config.json").read_text())
    (b / "config.json").write_text(json.dumps({**cfg, "traces_sha256": "other"}))
    rc, _, _ = cli([a, b], capsys)
    assert rc == 2


def test_write_baseline_is_compact_and_compares_equal(base, tmp_path):
    out = write_baseline(str(base), str(tmp_path / "baseline"))
    assert (out / "suite.json").exists() and (out / "kv" / "requests.jsonl").exists()
    cmp = compare(str(out), str(base), Limits(exact=True))
    assert not cmp.regressed and not cmp.differences


def test_compare_console_fits_80_columns(base, cand):
    import io

    from rich.console import Console

    from kvcmas_bench.console import print_compare

    edit_jsonl(cand / "kv" / "samples.jsonl", _wrong_answer)
    edit_jsonl(cand / "kv" / "requests.jsonl", _slower)
    con = Console(width=80, file=io.StringIO(), record=True)
    print_compare(compare(str(base), str(cand), Limits(exact=True)), con)
    text = con.export_text()
    assert "…" not in text and "accuracy" in text and "TTFT" in text and "prediction differs" in text


def test_committed_ci_baseline_is_usable():
    """The baseline of scripts/regression.sh loads, matches the CI suite's settings, and passes
    against itself (a corrupt or hand-edited baseline fails here, not in CI's last step)."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    baseline = root / "benchmarks" / "baselines" / "ci-suite"
    script = (root / "scripts" / "ci_suite.sh").read_text()
    cmp = compare(str(baseline), str(baseline), Limits(exact=True))
    assert cmp.pairs == 3 and not cmp.regressed
    for method in ("nonshared", "fullshared", "kvcmas"):
        cfg = json.loads((baseline / "mmlu" / method / "config.json").read_text())
        assert cfg["fidelity"] and cfg["device"] == "cpu" and method in script
        assert f"--limit {cfg['limit']} " in script and f"--max-new-tokens {cfg['max_new_tokens']} " in script
        assert f"--final-max-new-tokens {cfg['final_max_new_tokens']} " in script
