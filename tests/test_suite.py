"""suite: validation before any model loads, resume after an interrupt without redoing finished
cells, a failing cell recorded while the others run, and agreement with NonShared end to end."""

from __future__ import annotations

import json

import pytest

from kvcmas_bench.errors import BenchError
from kvcmas_bench.jobs import run as runner
from kvcmas_bench.jobs import suite as suite_job

from .conftest import run_cli


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def args(model: str, out, *extra: str) -> list[str]:
    return [
        "suite",
        "--model",
        model,
        "--device",
        "cpu",
        "--limit",
        "2",
        "--max-new-tokens",
        "2",
        "--final-max-new-tokens",
        "2",
        "--no-plots",
        "-o",
        str(out),
        *extra,
    ]


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--methods", "nope"], "unknown method"),
        (["--workloads", "mmlu,nope"], "unknown workload"),
        (["--method-arg", "bogus=1"], "unknown method option 'bogus'"),
        (["--methods", "cacheblend", "--rho", "1.5"], "rho"),
        (["--workloads", "videomme"], "videomme"),
        (["--limit", "0"], "--limit"),
        (["--format", "pdf"], "--format"),
        (["--device", "tpu"], "--device"),
        (["--repeats", "0"], "--repeats"),
    ],
)
def test_everything_is_checked_before_a_model_loads(tmp_path, monkeypatch, capsys, extra, needle):
    import kvcmas_bench.modeling as modeling

    def no_model(*a, **kw):
        raise AssertionError("a model was loaded before the options were checked")

    monkeypatch.setattr(modeling, "load_model", no_model)
    capsys.readouterr()
    rc = run_cli([*args("unused", tmp_path / "s"), *extra])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 2 and len(err) == 1 and needle in err[0], err


def test_suite_resumes_after_an_interrupt_without_redoing_finished_cells(tiny_model_dir, tmp_path, monkeypatch):
    out = tmp_path / "suite"
    cmd = args(tiny_model_dir, out, "--methods", "fullshared", "--workloads", "mmlu")
    real_one, real_prepare = runner.run_one, runner.prepare
    calls = {"one": 0, "prepare": 0}

    def one(*a, **kw):
        calls["one"] += 1
        if calls["one"] == 4:  # NonShared's 2 samples, FullShared's first, then Ctrl-C
            raise KeyboardInterrupt
        return real_one(*a, **kw)

    def prepare(*a, **kw):
        calls["prepare"] += 1
        return real_prepare(*a, **kw)

    monkeypatch.setattr(runner, "run_one", one)
    monkeypatch.setattr(runner, "prepare", prepare)
    assert run_cli(cmd) == 130
    manifest = json.loads((out / "suite.json").read_text())
    assert manifest["cells"]["mmlu/nonshared"]["status"] == "done"
    assert manifest["cells"]["mmlu/fullshared"]["status"] == "running"
    ns_samples = (out / "mmlu" / "nonshared" / "samples.jsonl").read_bytes()
    assert len((out / "mmlu" / "fullshared" / "samples.jsonl").read_text().splitlines()) == 1

    calls.update(one=0, prepare=0)
    assert run_cli(cmd) == 0
    # only the interrupted cell was prepared again, and only its missing sample ran
    assert calls == {"one": 1, "prepare": 1}
    assert (out / "mmlu" / "nonshared" / "samples.jsonl").read_bytes() == ns_samples
    manifest = json.loads((out / "suite.json").read_text())
    assert {c["status"] for c in manifest["cells"].values()} == {"done"}
    assert "repeats" not in manifest["settings"]  # the default --repeats 1: the manifest of before
    keys = {"workload", "method", "path", "status", "error", "run_options", "n", "accuracy", "process"}
    assert all(set(c) == keys for c in manifest["cells"].values())
    assert (out / "report" / "report.md").exists() and (out / "report" / "report.html").exists()

    calls.update(one=0, prepare=0)
    assert run_cli(cmd) == 0
    assert calls == {"one": 0, "prepare": 0}
    # the same directory with other settings is refused
    assert run_cli([*cmd[:-4], "--seed", "3", *cmd[-4:]]) == 2


def test_repeats_run_every_cell_at_successive_seeds_and_resume(tiny_model_dir, tmp_path, monkeypatch):
    out = tmp_path / "suite"
    cmd = args(tiny_model_dir, out, "--methods", "fullshared", "--seed", "5", "--repeats", "2")
    assert run_cli(cmd) == 0
    manifest = json.loads((out / "suite.json").read_text())
    # repeat 0 is the ordinary cell (seed 5), repeat 1 lies under repeat-1/ (seed 6)
    assert list(manifest["cells"]) == [
        "mmlu/nonshared",
        "mmlu/fullshared",
        "repeat-1/mmlu/nonshared",
        "repeat-1/mmlu/fullshared",
    ]
    assert {c["status"] for c in manifest["cells"].values()} == {"done"} and manifest["settings"]["repeats"] == 2
    for cell, seed in (("mmlu/fullshared", 5), ("repeat-1/mmlu/fullshared", 6), ("repeat-1/mmlu/nonshared", 6)):
        assert json.loads((out / cell / "config.json").read_text())["seed"] == seed, cell
    md = (out / "report" / "report.md").read_text()
    assert "## Accuracy across repeats: mmlu" in md and "Table 1: mmlu, seed=6" in md
    assert "| fullshared | 2 | 5,6 | 2 |" in md

    # resumed: nothing runs again; one more repeat runs only its own cells
    real = runner.prepare
    calls = []
    monkeypatch.setattr(runner, "prepare", lambda opts: calls.append(opts.seed) or real(opts))
    assert run_cli(cmd) == 0 and calls == []
    assert run_cli([*cmd[:-1], "3"]) == 0 and calls == [7, 7]
    assert (out / "repeat-2" / "mmlu" / "nonshared" / "samples.jsonl").exists()


def test_a_failing_cell_is_recorded_and_the_others_run(tiny_model_dir, tmp_path, monkeypatch, capsys):
    out = tmp_path / "suite"
    real = suite_job.run_job

    def flaky(opts, progress=None):
        if opts.method == "fullshared":
            raise BenchError("this method cannot run here")
        return real(opts, progress=progress)

    monkeypatch.setattr(suite_job, "run_job", flaky)
    capsys.readouterr()
    rc = run_cli(args(tiny_model_dir, out, "--methods", "fullshared,kvcmas"))
    err = capsys.readouterr().err
    assert rc == 2 and "1 of 3 cells failed (mmlu/fullshared: this method cannot run here)" in err
    cells = json.loads((out / "suite.json").read_text())["cells"]
    assert cells["mmlu/fullshared"] == {**cells["mmlu/fullshared"], "status": "failed"}
    assert cells["mmlu/fullshared"]["error"] == "this method cannot run here"
    assert cells["mmlu/kvcmas"]["status"] == "done"
    assert "kvcmas" in (out / "report" / "report.md").read_text()


@pytest.fixture(scope="module")
def one_layer_model_dir(tmp_path_factory):
    """A one-layer random Llama: the K/V of a token depend only on the token and its position, so
    every agent's shared segments have the same cache whatever precedes them (the prefixes are
    identical as far as the cache can tell), and FullShared's re-aligned reuse is exact."""
    from transformers import AutoTokenizer

    from kvcmas_bench.modeling import default_model_dir

    from .conftest import tiny_model

    tok = AutoTokenizer.from_pretrained(default_model_dir())
    model = tiny_model("llama", vocab=len(tok), layers=1)
    model.config.eos_token_id = tok.eos_token_id
    d = tmp_path_factory.mktemp("one-layer")
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)


def test_agreement_is_the_parsed_share_for_nonshared_and_exact_fullshared(one_layer_model_dir, tmp_path):
    """Exact FullShared answers as NonShared does: first tokens agree on every request, and the
    answers on every sample whose answer parsed (an unparsed answer agrees with nothing, so both
    rows read NonShared's parsed share)."""
    from kvcmas_bench.jobs.report import build_report
    from kvcmas_bench.report.tables import sample_agreement
    from kvcmas_bench.results.frames import load_dirs

    out = tmp_path / "suite"
    cmd = args(one_layer_model_dir, out, "--methods", "fullshared", "--fidelity", "--limit", "3")
    cmd[cmd.index("--max-new-tokens") + 1] = "6"
    assert run_cli(cmd) == 0
    t = build_report([out], tmp_path / "rep", ["md"], plots=False).table1.set_index("method")
    assert t.loc["fullshared", "reuse_ratio"] == 1.0 and t.loc["fullshared", "kv_rel_error"] < 1e-5
    ns, fs = sorted(load_dirs([out]).runs, key=lambda r: r.method != "nonshared")
    parsed = ns.samples["prediction"].notna().sum() / len(ns.samples)
    for m in ("nonshared", "fullshared"):
        assert t.loc[m, "answer_agreement"] == parsed and t.loc[m, "first_token_agreement"] == 1.0
    # not only the extracted answers: the final outputs are identical too
    assert list(fs.samples["final_output"]) == list(ns.samples["final_output"])
    assert list(fs.samples["prediction"]) == list(ns.samples["prediction"])
    agree = sample_agreement(fs, ns)
    assert list(agree["agree"]) == list(agree["reference_answer"].notna())


def test_resumed_manifest_is_refused_or_reset_as_its_settings_demand(tmp_path):
    settings = {"model": "m", "seed": 0, "limit": 5}
    assert suite_job.resume_manifest(tmp_path, "suite", settings, ("model", "seed")) == ({}, {})
    cells = {"mmlu/kvcmas": {"path": "mmlu/kvcmas", "status": "done", "n": 5}}
    (tmp_path / "suite.json").write_text(json.dumps({"command": "ablate", "settings": settings, "cells": cells}))
    with pytest.raises(BenchError, match="is not a suite manifest"):
        suite_job.resume_manifest(tmp_path, "suite", settings, ("model", "seed"))
    _, states = suite_job.resume_manifest(tmp_path, "ablate", settings, ("model", "seed"))
    assert states == cells
    with pytest.raises(BenchError, match=r"holds an ablation with a different seed \(0 vs 1\)"):
        suite_job.resume_manifest(tmp_path, "ablate", {**settings, "seed": 1}, ("model", "seed"))
    _, states = suite_job.resume_manifest(tmp_path, "ablate", {**settings, "limit": 8}, ("model", "seed"))
    assert states == {"mmlu/kvcmas": {"path": "mmlu/kvcmas", "status": "pending", "n": 5}}


# ---- sharded suites ------------------------------------------------------------------------------------
DETERMINISTIC = ["accuracy", "answer_agreement", "first_token_agreement", "reuse_ratio", "kv_rel_error", "n"]


def test_a_suite_run_as_two_shards_merges_into_the_same_table_1(one_layer_model_dir, tmp_path, capsys):
    """Three cells (NonShared, FullShared, KVCMAS on MMLU) as one suite and as shards 1/2 and 2/2:
    the shards hold disjoint cells (NonShared and KVCMAS in 1/2, FullShared in 2/2), the merged report
    has the unsharded suite's Table 1 (every deterministic value), and compare of the two passes.
    Hostile inputs: a shard twice, a missing shard, a suite beside its own shard, a shard whose
    manifest claims another slice: one line each, exit 2."""
    import json

    from kvcmas_bench.jobs.report import build_report

    common = ["--methods", "fullshared,kvcmas", "--fidelity"]
    whole, s1, s2 = tmp_path / "whole", tmp_path / "s1", tmp_path / "s2"
    assert run_cli(args(one_layer_model_dir, whole, *common)) == 0
    assert run_cli(args(one_layer_model_dir, s1, *common, "--shard", "1/2")) == 0
    assert run_cli(args(one_layer_model_dir, s2, *common, "--shard", "2/2")) == 0
    cells = [sorted(json.loads((d / "suite.json").read_text())["cells"]) for d in (s1, s2)]
    assert cells == [["mmlu/kvcmas", "mmlu/nonshared"], ["mmlu/fullshared"]]
    t_whole = build_report([whole], tmp_path / "r0", ["md"], plots=False).table1.set_index("method")
    merged = build_report([s1, s2], tmp_path / "r1", ["md"], plots=False)
    t_merged = merged.table1.set_index("method")
    cols = [c for c in DETERMINISTIC if c in t_whole]
    assert sorted(t_merged.index) == sorted(t_whole.index) == ["fullshared", "kvcmas", "nonshared"]
    assert t_merged.loc[t_whole.index, cols].equals(t_whole[cols])
    assert any("merged from 2 shards" in line for line in (tmp_path / "r1" / "report.md").read_text().splitlines())
    capsys.readouterr()
    assert run_cli(["compare", str(whole), f"{s1},{s2}", "--no-timings"]) == 0
    for dirs, words in (
        ([s1, s1], "shard 1/2 given twice"),
        ([s1], None),
        ([s2, s2, s1], "shard 2/2 given twice"),
        ([whole, s2], "and its shard"),
        ([s2, whole], "and its shard"),
        ([whole, whole], None),
    ):
        if words is None:
            assert (
                run_cli(["report", *map(str, dirs), "-o", str(tmp_path / "alone"), "--format", "md", "--no-plots"]) == 0
            )
            continue
        _refused(capsys, ["report", *map(str, dirs), "-o", str(tmp_path / "r"), "--no-plots"], words)
    s3 = tmp_path / "s3"
    assert run_cli(args(one_layer_model_dir, s3, *common, "--shard", "1/3")) == 0
    _refused(capsys, ["report", str(s1), str(s2), str(s3), "--no-plots"], "split 2 and 3 ways")
    _refused(capsys, ["report", str(s1), str(s3), "--no-plots"], "split 2 and 3 ways")
    s5 = tmp_path / "s5"  # shard 2/2 of another plan (another --limit): not the other half of s1
    assert run_cli(args(one_layer_model_dir, s5, *common, "--shard", "2/2", "--limit", "3")) == 0
    _refused(capsys, ["report", str(s1), str(s5), "--no-plots"], "shard(s) 2/2 missing")
    s4 = tmp_path / "s4"
    assert run_cli(args(one_layer_model_dir, s4, *common, "--shard", "2/3")) == 0
    _refused(capsys, ["report", str(s3), str(s4), "--no-plots"], "shard(s) 3/3 missing")
    forged = json.loads((s2 / "suite.json").read_text())
    forged["cells"]["mmlu/kvcmas"] = {"workload": "mmlu", "method": "kvcmas", "path": "mmlu/kvcmas"}
    (s2 / "suite.json").write_text(json.dumps(forged))
    _refused(capsys, ["report", str(s1), str(s2), "--no-plots"], "lists cells outside its slice")
    _refused(capsys, args(one_layer_model_dir, tmp_path / "x", "--shard", "3/2"), "must be K/N")
    _refused(capsys, args(one_layer_model_dir, tmp_path / "y", *common, "--shard", "4/4"), "shard 4 would be empty")


def _refused(capsys, argv, needle):
    from .conftest import one_line

    capsys.readouterr()
    assert run_cli(argv) == 2
    one_line(capsys, needle)
