"""reproduce: the claims file, the plan and its cost, bad input, and end to end on a tiny model
(verdicts from the records, a second invocation doing no work, a forged verdict file rewritten,
damaged records giving "not comparable", kill -9 mid-experiment resuming with nothing duplicated)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvcmas_bench.errors import BenchError
from kvcmas_bench.jobs import reproduce as job
from kvcmas_bench.reproduce.claims import load_claims, markdown_table
from kvcmas_bench.reproduce.plan import SCALES, params_from_name, plan

from .conftest import run_cli

ROOT = Path(__file__).resolve().parents[1]
#: the rule forms tests/test_reproduce_rules.py covers
TESTED_FORMS = {"value", "ratio", "difference", "within", "extreme"}


def test_every_claim_loads_names_a_planned_experiment_and_a_tested_form():
    claims = load_claims()
    assert len(claims) >= 25
    for scale in SCALES:
        names = {e.name for e in plan(scale)}
        assert {c.experiment for c in claims} <= names, scale
    assert {c.rule["form"] for c in claims} <= TESTED_FORMS
    ids = {c.id for c in claims}
    for needed in ("ttft-p50-vs-nonshared", "ttft-p90-vs-nonshared", "chained-accuracy-mmlu", "anchor-memory-v20",
                   "best-accuracy-3-of-5", "accuracy-std", "vlm-coverage", "generated-context-speedup"):  # fmt: skip
        assert needed in ids


def test_the_docs_list_every_claim_with_its_rule():
    doc = (ROOT / "docs" / "claims.md").read_text()
    assert markdown_table(load_claims()) in doc  # regenerate the table after changing claims.toml
    for c in load_claims():
        assert f"`{c.id}`" in doc and c.rule_text in doc, c.id


@pytest.mark.parametrize(
    "text,needle",
    [
        ("[[claim]]\nid = 'x'\n", "lacks"),
        ("not toml ===", "not valid TOML"),
        ("", r"no \[\[claim\]\]"),
    ],
)
def test_a_damaged_claims_file_is_one_error_line(tmp_path, text, needle):
    p = tmp_path / "claims.toml"
    p.write_text(text)
    with pytest.raises(BenchError, match=needle):
        load_claims(p)


def _claim(**over) -> str:
    base = {
        "id": "'c1'", "words": "'w'", "source": "'s'", "paper": "'2x'", "setting": "{ model = 'm' }",
        "experiment": "'load'",
        "rule": "{ form = 'ratio', figure = 'ttft_p50_s', a = 'x', b = 'y', op = '>=', value = 2 }",
    }  # fmt: skip
    base.update(over)
    return "[[claim]]\n" + "".join(f"{k} = {v}\n" for k, v in base.items())


@pytest.mark.parametrize(
    "text,needle",
    [
        (_claim() + _claim(), "appears twice"),
        (_claim(experiment="'nowhere'"), "unknown experiment"),
        (
            _claim(rule="{ form = 'ratio', figure = 'no_such_figure', a = 'x', b = 'y', op = '>=', value = 2 }"),
            "figure",
        ),
        (_claim(rule="{ form = 'ratio', figure = 'ttft_p50_s', a = 'x', op = '>=', value = 2 }"), "operand b"),
    ],
)
def test_a_wrong_claim_names_itself(tmp_path, text, needle):
    p = tmp_path / "claims.toml"
    p.write_text(text)
    with pytest.raises(BenchError, match=needle):
        load_claims(p, experiments={e.name for e in plan("smoke")})


def test_params_from_name():
    assert params_from_name("meta-llama/Llama-3.1-8B-Instruct") == 8e9
    assert params_from_name("HuggingFaceTB/SmolLM2-135M-Instruct") == 135e6
    assert params_from_name("some/model") is None


def test_paper_dry_run_plans_llama_8b_on_a_gpu_this_machine_lacks(capsys):
    rc = run_cli(["reproduce", "--scale", "paper", "--dry-run", "--model", "meta-llama/Llama-3.1-8B-Instruct",
                  "--device", "cuda", "--dtype", "bfloat16", "-o", "/nonexistent/never-written"])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 0
    assert "--shared-tokens 2048,8192,32768" in err and "--qps 0,1,2,4,8" in err
    assert "assumed, not measured: 8.0B parameters" in err
    assert "total:" in err and "days" in err
    assert not Path("/nonexistent").exists()


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--scale", "huge"], "--scale"),
        (["--claims", "nope"], "unknown claim"),
        (["--engine", "tgi"], "--engine"),
        (["--dtype", "float64"], "dtype"),
    ],
)
def test_bad_options_are_one_line_exit_2(tmp_path, capsys, args, needle):
    rc = run_cli(["reproduce", "--dry-run", *args, "-o", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and "Traceback" not in err


def test_a_foreign_or_mismatched_directory_is_refused(tmp_path):
    d = tmp_path / "r"
    d.mkdir()
    (d / "something.txt").write_text("x")
    opts = job.ReproduceOptions(output_path=str(d))
    with pytest.raises(BenchError, match="not empty"):
        job.open_manifest(d, opts)
    (d / "reproduce.json").write_text(
        json.dumps({"command": "reproduce", "settings": {**opts.settings(), "scale": "paper"}, "experiments": {}})
    )
    with pytest.raises(BenchError, match="different scale"):
        job.open_manifest(d, opts)
    (d / "reproduce.json").write_text(json.dumps({"command": "suite"}))
    with pytest.raises(BenchError, match="not a reproduce manifest"):
        job.open_manifest(d, opts)


RANK_CLAIMS = "pf-delta-effective-rank,pf-delta-rank8-energy"


def test_end_to_end_then_no_work_then_forged_and_damaged_records(tiny_model_dir, tmp_path, capsys, monkeypatch):
    out = tmp_path / "r"
    cmd = ["reproduce", "--claims", RANK_CLAIMS, "--model", tiny_model_dir, "--device", "cpu", "-o", str(out)]
    assert run_cli(cmd) == 0
    printed = capsys.readouterr()
    assert "2 claims:" in printed.out
    manifest = json.loads((out / "reproduce.json").read_text())
    assert manifest["experiments"]["rank"]["status"] == "done"
    verdicts = json.loads((out / "verdicts.json").read_text())
    rows = {r["claim"]: r for r in verdicts["claims"]}
    assert set(rows) == set(RANK_CLAIMS.split(","))
    summary = json.loads((out / "rank" / "rank.json").read_text())["summary"]
    pf_k = next(r for r in summary if r["kind"] == "pf_delta" and r["part"] == "K")
    assert rows["pf-delta-effective-rank"]["verdict"] in ("holds", "does not hold")
    assert f"{pf_k['effective_rank']:.4g}" in rows["pf-delta-effective-rank"]["reason"]
    html = (out / "reproduce.html").read_text()
    assert "pf-delta-rank8-energy" in html and "data:image/png;base64" in html

    def no_work(*a, **k):
        raise AssertionError("a finished experiment ran again")

    monkeypatch.setattr(job, "run_experiment", no_work)
    (out / "verdicts.json").write_text(
        json.dumps({"claims": [{"claim": "pf-delta-effective-rank", "verdict": "holds"}]})
    )
    assert run_cli(cmd) == 0
    again = {r["claim"]: r for r in json.loads((out / "verdicts.json").read_text())["claims"]}
    assert again == rows  # the forged file is replaced by verdicts re-derived from the records

    (out / "rank" / "rank.json").write_text('{"summary": "forged"}')
    assert run_cli(cmd) == 0
    damaged = {r["claim"]: r for r in json.loads((out / "verdicts.json").read_text())["claims"]}
    assert {r["verdict"] for r in damaged.values()} == {"not comparable"}
    assert all("unreadable records" in r["reason"] for r in damaged.values())
    assert "Traceback" not in capsys.readouterr().err


def _lines(p: Path) -> list[dict]:
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()] if p.exists() else []


def test_kill_9_mid_experiment_resumes_with_nothing_duplicated(tiny_model_dir, tmp_path):
    out = tmp_path / "r"
    argv = [sys.executable, "-m", "kvcmas_bench.cli", "reproduce", "--claims", "rank-16-to-32,rank-beyond-32",
            "--model", tiny_model_dir, "--device", "cpu", "-o", str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env=env)
    point = out / "ablate-rank" / "mmlu" / "kvcmas-r16-16" / "samples.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and not _lines(point):
        if proc.poll() is not None:
            pytest.fail(f"reproduce ended (rc {proc.returncode}) before the kill")
        time.sleep(0.2)
    assert _lines(point), "no sample finished in time"
    os.killpg(proc.pid, signal.SIGKILL)  # the whole plan: parent and the ablate child
    proc.wait()
    manifest = json.loads((out / "reproduce.json").read_text())
    assert manifest["experiments"]["ablate-rank"]["status"] == "running"
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    manifest = json.loads((out / "reproduce.json").read_text())
    assert manifest["experiments"]["ablate-rank"]["status"] == "done"
    runs = sorted((out / "ablate-rank" / "mmlu").glob("*/samples.jsonl"))
    assert len(runs) == 4  # nonshared and r16, r32, r64
    for p in runs:
        ids = [r["sample_id"] for r in _lines(p)]
        assert len(ids) == len(set(ids)) == 2, p
        reqs = [(r["sample_id"], r["step"]) for r in _lines(p.with_name("requests.jsonl"))]
        assert len(reqs) == len(set(reqs)), p
    rows = {r["claim"]: r["verdict"] for r in json.loads((out / "verdicts.json").read_text())["claims"]}
    assert set(rows) == {"rank-16-to-32", "rank-beyond-32"}


def test_a_foreign_directory_is_refused_before_the_plan_prints_or_a_model_loads(tmp_path, capsys, monkeypatch):
    def boom(*a, **kw):
        raise AssertionError("the model was loaded to cost the plan")

    monkeypatch.setattr(job, "measure_token_cost", boom)
    d = tmp_path / "r"
    d.mkdir()
    (d / "notes.txt").write_text("x")
    capsys.readouterr()
    assert run_cli(["reproduce", "--scale", "smoke", "-o", str(d)]) == 2
    out, err = capsys.readouterr()
    assert "plan" not in out.lower() and err.count("\n") == 1 and "not empty and holds no reproduce.json" in err
    (tmp_path / "f").write_text("x")
    assert run_cli(["reproduce", "--scale", "smoke", "-o", str(tmp_path / "f")]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_on_vllm_the_accuracy_suites_run_there_and_the_fidelity_experiments_stay_in_process():
    """--engine vllm: Table 1 and the seeds on the deployment (samples in flight), Table 1's two
    methods vLLM cannot run in-process beside it (their facts count as Table 1's), and every
    experiment that records fidelity (analyses, ablations) in-process."""
    from kvcmas_bench.reproduce.plan import CONCURRENCY, plan

    exps = {e.name: e for e in plan("smoke", "vllm")}
    served = ["--engine", "vllm", "--max-concurrency", str(CONCURRENCY["smoke"])]
    for name in ("table1", "seeds"):
        argv = exps[name].argv
        assert argv[argv.index("--engine") :][:4] == served, name
    part = exps["table1-in-process"]
    assert part.facts_as == "table1" and "--engine" not in part.argv
    assert part.argv[part.argv.index("--methods") + 1] == "droidspeak,relaycaching"
    for name in ("chain", "ablate-rank", "ablate-anchors", "ablate-agents", "ablate-rounds"):
        assert "--engine" not in exps[name].argv, name
    assert "table1-in-process" not in {e.name for e in plan("smoke")}
    assert all("--engine" not in e.argv for e in plan("smoke") if e.reader == "runs")


def test_an_experiment_whose_command_changed_moves_its_old_directory_aside(tmp_path):
    """A reproduce directory from another version (or other model flags): the experiment's old
    results are moved to ``<name>.superseded-<k>``, byte for byte, before the new command runs;
    the same command, or no earlier run, moves nothing."""
    from kvcmas_bench.jobs.reproduce import supersede

    (tmp_path / "rank").mkdir()
    (tmp_path / "rank" / "rank.json").write_text("old")
    assert supersede(tmp_path, "rank", {"argv": ["a"], "status": "done"}, ["a"]) is None
    assert supersede(tmp_path, "rank", {}, ["b"]) is None
    assert supersede(tmp_path, "missing", {"argv": ["a"]}, ["b"]) is None
    assert supersede(tmp_path, "rank", {"argv": ["a"], "status": "done"}, ["b"]) == "rank.superseded-1"
    assert not (tmp_path / "rank").exists()
    assert (tmp_path / "rank.superseded-1" / "rank.json").read_text() == "old"
    (tmp_path / "rank").mkdir()
    assert supersede(tmp_path, "rank", {"argv": ["b"], "status": "failed"}, ["c"]) == "rank.superseded-2"
