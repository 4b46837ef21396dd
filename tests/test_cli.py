"""CLI behaviour: outputs, resume after interruption, one-line errors with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvcmas_bench.jobs import run as runner

from .conftest import interrupt_on_call
from .conftest import run_cli as _run


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_run_writes_all_outputs(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    rc = _run(
        [
            "run",
            "--method",
            "fullshared",
            "--workload",
            "mmlu",
            "--model",
            tiny_model_dir,
            "--limit",
            "2",
            "--max-new-tokens",
            "3",
            "--final-max-new-tokens",
            "2",
            "--device",
            "cpu",
            "-o",
            str(out),
        ]
    )
    assert rc == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["method"] == "fullshared" and cfg["versions"]["torch"] and "hardware" in cfg
    assert cfg["method_resolved"] == {}  # FullShared has no per-device choice (KVCMAS: its factorization)
    samples = _lines(out / "samples.jsonl")
    reqs = _lines(out / "requests.jsonl")
    assert len(samples) == 2 and len(reqs) == 8
    assert {"prediction", "gold", "correct", "latency_s"} <= samples[0].keys()
    assert {"agent", "ttft_s", "e2e_s", "prefilled_tokens", "reused_tokens"} <= reqs[0].keys()
    summary = json.loads((out / "summary.json").read_text())
    for k in ("method", "workload", "n", "accuracy", "latency_mean_s", "ttft_mean_s", "peak_mem_bytes", "reuse_ratio"):
        assert k in summary
    assert summary["n"] == 2 and summary["reuse_ratio"] == 1.0
    # the first agent never reuses; later agents reuse every shared token under FullShared
    assert reqs[0]["reused_tokens"] == 0 and reqs[1]["reused_tokens"] > 0


def test_interrupted_run_resumes_without_duplicates(tiny_model_dir, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    args = [
        "run",
        "--model",
        tiny_model_dir,
        "--limit",
        "5",
        "--max-new-tokens",
        "2",
        "--final-max-new-tokens",
        "2",
        "--device",
        "cpu",
        "-o",
        str(out),
    ]
    real = interrupt_on_call(monkeypatch, runner, "run_one", 3)
    assert _run(args) == 130
    assert "run the same command again to resume" in capsys.readouterr().err
    assert len(_lines(out / "samples.jsonl")) == 2
    # a run killed mid-write leaves orphan request lines and a torn sample line
    with open(out / "requests.jsonl", "a") as f:
        f.write(json.dumps({"sample_id": "mmlu-orphan", "agent": "x"}) + "\n")
    with open(out / "samples.jsonl", "a") as f:
        f.write('{"sample_id": "mmlu-torn", "corr')
    monkeypatch.setattr(runner, "run_one", real)
    assert _run(args) == 0
    samples = _lines(out / "samples.jsonl")
    ids = [s["sample_id"] for s in samples]
    assert len(ids) == 5 and len(set(ids)) == 5
    reqs = _lines(out / "requests.jsonl")
    assert len(reqs) == 20 and {r["sample_id"] for r in reqs} == set(ids)
    assert json.loads((out / "summary.json").read_text())["n"] == 5
    # running again does nothing new
    assert _run(args) == 0
    assert len(_lines(out / "samples.jsonl")) == 5


@pytest.mark.parametrize(
    "args,needle",
    [
        (["run", "--method", "nope"], "unknown method"),
        (["run", "--workload", "nope"], "unknown workload"),
        (["run", "--limit", "0"], "--limit"),
        (["run", "--limit", "abc"], "--limit"),
        (["run", "--model", "/no/such/model"], "model not found"),
        (["run", "--model", "missing.gguf"], "model file not found"),
        (["run", "--device", "tpu"], "--device"),
        (["run", "--dtype", "int3"], "--dtype"),
        (["run", "--max-new-tokens", "-1"], "--max-new-tokens"),
        (["run", "--subjects", "astrology-of-cats", "--limit", "1"], "unknown MMLU subject"),
        (["run", "--bogus"], "No such option"),
        (["run", "--method-arg", "nope=1"], "--method-arg nope=1: unknown method option 'nope'"),
        (["run", "--workload", "mmlu", "--data-path", "/dev/null/x.jsonl"], "cannot read MMLU data"),
    ],
)
def test_bad_input_one_line_exit_2(args, needle):
    proc = subprocess.run(
        [sys.executable, "-m", "kvcmas_bench.cli", *args], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert needle in lines[0] and "Traceback" not in proc.stderr


def test_resume_refuses_other_config(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    base = [
        "run",
        "--model",
        tiny_model_dir,
        "--limit",
        "1",
        "--max-new-tokens",
        "2",
        "--final-max-new-tokens",
        "2",
        "--device",
        "cpu",
        "-o",
        str(out),
    ]
    assert _run(base) == 0
    capsys.readouterr()
    assert _run([*base[:1], "--method", "fullshared", *base[1:]]) == 2
    err = capsys.readouterr().err.strip()
    assert "holds a run with a different method" in err and "'fullshared'" in err and "\n" not in err


def test_list_commands(capsys):
    assert _run(["methods"]) == 0
    assert "nonshared" in capsys.readouterr().out
    assert _run(["workloads"]) == 0
    assert "mmlu" in capsys.readouterr().out
    assert _run(["engines"]) == 0
    engines = capsys.readouterr().out
    assert "in-process" in engines and "vllm" in engines
    assert _run(["backends"]) == 0  # the old name, hidden
    assert capsys.readouterr().out == engines
    assert _run(["--help"]) == 0
    listed = capsys.readouterr().out
    assert " engines " in listed and " backends " not in listed


@pytest.mark.slow
def test_real_model_mmlu_two_samples(tmp_path):
    """SmolLM2-135M end to end on 2 MMLU samples, NonShared then FullShared with fidelity."""
    for method in ("nonshared", "fullshared"):
        out = tmp_path / method
        assert (
            _run(
                [
                    "run",
                    "--method",
                    method,
                    "--limit",
                    "2",
                    "--device",
                    "cpu",
                    "--fidelity",
                    "--max-new-tokens",
                    "24",
                    "--final-max-new-tokens",
                    "8",
                    "-o",
                    str(out),
                ]
            )
            == 0
        )
        summary = json.loads((out / "summary.json").read_text())
        assert summary["n"] == 2 and 0.0 <= summary["accuracy"] <= 1.0
        fid = summary["fidelity"]
        if method == "nonshared":
            assert fid["top1_agree"] == 1.0 and fid["first_token_kl"] < 1e-6
            assert fid["kv_rel_error"] < 1e-6
        else:
            assert 0.01 < fid["kv_rel_error"] < 1.0
