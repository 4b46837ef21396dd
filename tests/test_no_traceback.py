"""No traceback anywhere (issue 48): broken model files, method knobs the model cannot satisfy,
damaged or unwritable method state. Each is one line and exit 2."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest

from .conftest import one_line, run_cli
from .test_integrity import tiny_run


@pytest.fixture
def model_copy(tiny_model_dir, tmp_path) -> Path:
    d = tmp_path / "model"
    shutil.copytree(tiny_model_dir, d)
    return d


def test_corrupt_weights_file_is_one_line(model_copy, tmp_path, capsys):
    w = model_copy / "model.safetensors"
    w.write_bytes(w.read_bytes()[:1000])
    assert run_cli(tiny_run(str(model_copy), tmp_path / "r", "--limit", "1")) == 2
    one_line(capsys, "cannot load the weights of model")


def test_corrupt_tokenizer_file_is_one_line(model_copy, tmp_path, capsys):
    (model_copy / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": 7')
    assert run_cli(tiny_run(str(model_copy), tmp_path / "r", "--limit", "1")) == 2
    one_line(capsys, "cannot load the tokenizer of model")


@pytest.mark.parametrize(
    "method,arg,needle",
    [
        ("cacheblend", "check_layer=5", "check_layer 5 is outside the model's 2 layers"),
        ("relaycaching", "check_layer=2", "check_layer 2 is outside the model's 2 layers"),
    ],
)
def test_knob_past_the_model_layers_is_refused_before_the_weights_load(
    tiny_model_dir, tmp_path, capsys, monkeypatch, method, arg, needle
):
    import transformers

    def boom(*a, **kw):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", boom)
    args = tiny_run(tiny_model_dir, tmp_path / "r", "--limit", "1", "--method", method, "--method-arg", arg)
    assert run_cli(args) == 2
    one_line(capsys, needle)


@pytest.fixture(scope="module")
def kvcmas_run(tiny_model_dir, tmp_path_factory) -> Path:
    """A 2-sample KVCMAS run (it keeps method state) to damage in copies."""
    out = tmp_path_factory.mktemp("state") / "run"
    assert run_cli(tiny_run(tiny_model_dir, out, "--limit", "2", "--method", "kvcmas")) == 0
    assert list((out / "method_state").glob("manifest-*.json"))
    return out


def _manifest(d: Path) -> Path:
    (m,) = (d / "method_state").glob("manifest-*.json")
    return m


@pytest.mark.parametrize(
    "damage",
    [
        lambda d: _manifest(d).write_text("[1, 2]"),
        lambda d: _manifest(d).write_text(json.dumps({**json.loads(_manifest(d).read_text()), "state": {"x": 1}})),
        lambda d: _manifest(d).write_text(json.dumps({**json.loads(_manifest(d).read_text()), "next_uid": "7"})),
        lambda d: [p.write_bytes(p.read_bytes()[:50]) for p in (d / "method_state" / "tensors").glob("*.pt")],
        lambda d: [p.unlink() for p in (d / "method_state" / "tensors").glob("*.pt")],
    ],
    ids=["manifest-not-an-object", "manifest-foreign-state", "manifest-string-uid", "tensors-cut", "tensors-gone"],
)
def test_damaged_method_state_is_one_line_on_resume(kvcmas_run, tiny_model_dir, tmp_path, capsys, damage):
    d = tmp_path / "run"
    shutil.copytree(kvcmas_run, d)
    damage(d)
    with open(d / "requests.jsonl", "ab") as f:  # and a kill's torn line: not dropped before the refusal
        f.write(b'{"sample_id": "mmlu-')
    files = {str(p): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}
    capsys.readouterr()
    assert run_cli(tiny_run(tiny_model_dir, d, "--limit", "3", "--method", "kvcmas")) == 2
    line = one_line(capsys, "method_state")
    assert "manifest" in line
    assert {str(p): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()} == files


def test_full_disk_while_saving_method_state(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """torch.save fails with ENOSPC on the first tensor: one line naming the state directory, no
    temporary file left, no sample committed; the same command then resumes and finishes."""
    import kvcmas_bench.results.state as state

    real = state.torch.save

    def full(obj, f, *a, **kw):
        Path(f).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(state.torch, "save", full)
    out = tmp_path / "run"
    args = tiny_run(tiny_model_dir, out, "--limit", "1", "--method", "kvcmas")
    assert run_cli(args) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # after the progress bar's line
    assert "Traceback" not in err and last.startswith("kvcmas-bench: error: cannot save the method state in ")
    assert str(out / "method_state") in last and "No space left on device" in last
    assert not list(out.rglob("*.tmp"))
    assert not (out / "samples.jsonl").exists() or not (out / "samples.jsonl").read_bytes()
    monkeypatch.setattr(state.torch, "save", real)
    assert run_cli(args) == 0
    assert len((out / "samples.jsonl").read_text().splitlines()) == 1


@pytest.mark.parametrize("command", ["run", "suite"])
def test_humaneval_refused_without_landlock_unless_unsafe_sandbox(tmp_path, capsys, monkeypatch, command):
    """Where the sandbox cannot confine file reads, HumanEval is refused before anything runs;
    --unsafe-sandbox lets it through (to the next check: here, a model that does not exist)."""
    import kvcmas_bench.workloads.sandbox as sandbox

    monkeypatch.setattr(sandbox, "file_reads_confined", lambda: False)
    workload = ["--workload" if command == "run" else "--workloads", "humaneval"]
    args = [command, *workload, "--limit", "1", "--model", str(tmp_path / "no-model"), "-o", str(tmp_path / "o")]
    assert run_cli(args) == 2
    one_line(capsys, "pass --unsafe-sandbox to run it anyway")
    assert not (tmp_path / "o").exists()
    assert run_cli([*args, "--unsafe-sandbox"]) != 0
    assert "--unsafe-sandbox" not in capsys.readouterr().err


def test_full_disk_while_appending_records_names_the_file(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """fsync fails with ENOSPC on the first record file: one line with the reason and the file's
    path; the same command then resumes (the cut-off request lines dropped) and finishes."""
    import kvcmas_bench.results.records as records

    real = records.os.fsync

    def full(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("requests.jsonl"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd)

    monkeypatch.setattr(records.os, "fsync", full)
    out = tmp_path / "run"
    args = tiny_run(tiny_model_dir, out, "--limit", "1")
    assert run_cli(args) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert "Traceback" not in err and last == f"kvcmas-bench: error: No space left on device: {out / 'requests.jsonl'}"
    monkeypatch.setattr(records.os, "fsync", real)
    assert run_cli(args) == 0
    assert len((out / "samples.jsonl").read_text().splitlines()) == 1
    assert len((out / "requests.jsonl").read_text().splitlines()) == 4


@pytest.mark.parametrize(
    "key,value,needle",
    [("ttft_p50_s", "abc", "ttft_p50_s 'abc' is not a number"), ("qps", "x", "qps 'x' is not a number"),
     ("method", 7, "method 7 is not a string"), ("shared_tokens", -1, "shared_tokens -1 is not a number")],
)  # fmt: skip
def test_sweep_rows_of_the_wrong_type_are_one_line(tmp_path, capsys, key, value, needle):
    """A sweep without served requests shows its summary rows as written: typed, or refused."""
    from .synthetic import make_sweep

    d = make_sweep(tmp_path / "s")
    s = json.loads((d / "summary.json").read_text())
    s["rows"][1][key] = value
    (d / "summary.json").write_text(json.dumps(s))
    capsys.readouterr()
    assert run_cli(["report", str(d), "--no-plots", "-o", str(tmp_path / "rep")]) == 2
    one_line(capsys, f"summary.json is corrupt (row 2: {needle})")
    assert run_cli(["compare", str(d), str(d)]) == 2
    one_line(capsys, f"summary.json is corrupt (row 2: {needle})")
