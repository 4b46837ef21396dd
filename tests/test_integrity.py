"""Nothing lost, nothing faked (issue 11): damaged run directories stop the run and stay untouched,
one writer per output directory, method options and output paths checked before the model loads,
one-line errors for bad data / trace files, the Ctrl-C message, the --agents bound."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from kvcmas_bench.results.outdir import LOCK_NAME

from .conftest import run_cli

ROOT = Path(__file__).resolve().parents[1]


def tiny_run(model_dir: str, out, *extra: str) -> list[str]:
    return [
        "run",
        "--model",
        model_dir,
        "--max-new-tokens",
        "2",
        "--final-max-new-tokens",
        "2",
        "--device",
        "cpu",
        "-o",
        str(out),
        *extra,
    ]


def snapshot(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


def one_error_line(capsys, needle: str) -> str:
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("kvcmas-bench: error: ") and needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def finished_run(tiny_model_dir, tmp_path_factory):
    """A finished 4-sample run directory (16 request lines) to damage in copies."""
    out = tmp_path_factory.mktemp("runs") / "done"
    assert run_cli(tiny_run(tiny_model_dir, out, "--limit", "4")) == 0
    assert len((out / "requests.jsonl").read_text().splitlines()) == 16
    return out


def _replace_line(path: Path, n: int, text: bytes) -> None:
    lines = path.read_bytes().splitlines(keepends=True)
    lines[n - 1] = text
    path.write_bytes(b"".join(lines))


def _duplicate_line(path: Path, n: int) -> None:
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines + [lines[n - 1]]))


def _delete_line(path: Path, n: int) -> None:
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[: n - 1] + lines[n:]))


def _rename_sample(d: Path, n: int) -> None:
    """Sample line ``n`` gets another id (its request lines keep the old one)."""
    row = json.loads((d / "samples.jsonl").read_bytes().splitlines()[n - 1])
    _replace_line(d / "samples.jsonl", n, json.dumps({**row, "sample_id": "mmlu-renamed"}).encode() + b"\n")


def _append_orphans(path: Path, *ids: str) -> None:
    with open(path, "ab") as f:
        for sid in ids:
            f.write(
                json.dumps({"sample_id": sid, "agent": "x", "ttft_s": 0.1, "e2e_s": 0.2, "step": 0}).encode() + b"\n"
            )


# ---- defect 1: damaged run directories ------------------------------------------------------------
@pytest.mark.parametrize(
    "damage,needle",
    [
        (lambda d: _replace_line(d / "requests.jsonl", 3, b"\x00garbage{\n"), "requests.jsonl line 3"),
        (lambda d: _replace_line(d / "samples.jsonl", 2, b'{"sample_id": "mmlu-1", "corr\n'), "samples.jsonl line 2"),
        (lambda d: _replace_line(d / "requests.jsonl", 5, b"[1, 2]\n"), "requests.jsonl line 5 is not a JSON object"),
        (lambda d: _replace_line(d / "samples.jsonl", 1, b"\n"), "samples.jsonl line 1"),
        (lambda d: _replace_line(d / "samples.jsonl", 3, b'{"sample_id": 7, "correct": true}\n'), "line 3"),
        (
            lambda d: _replace_line(d / "requests.jsonl", 2, json.dumps({"sample_id": "x", "bogus": 1}).encode()),
            "requests.jsonl line 2",
        ),
        (lambda d: _duplicate_line(d / "samples.jsonl", 1), "samples.jsonl line 5 repeats sample"),
        (lambda d: _duplicate_line(d / "requests.jsonl", 1), "requests.jsonl line 17 repeats request"),
        (lambda d: (d / "config.json").write_bytes(b"\xff\xfe"), "config.json is not valid JSON"),
        # issue 18: the cases readers check too (one rule set, records.read_run_files)
        (lambda d: _delete_line(d / "requests.jsonl", 4), "samples.jsonl line 1 is sample"),
        (lambda d: _rename_sample(d, 2), "line 2 is sample 'mmlu-renamed', which is not one of the run's 4 samples"),
        (
            lambda d: _append_orphans(d / "requests.jsonl", "mmlu-x", "mmlu-y"),
            "requests.jsonl line 18 belongs to sample",
        ),
    ],
    ids=[
        "garbage-request-line-3",
        "garbage-sample-line-2",
        "request-not-object",
        "blank-sample-line",
        "sample-without-id",
        "request-unknown-field",
        "duplicate-sample",
        "duplicate-request",
        "binary-config",
        "missing-last-step",
        "changed-sample-id",
        "orphans-of-two-samples",
    ],
)
def test_damaged_run_directory_stops_the_run_and_stays_untouched(
    finished_run, tmp_path, tiny_model_dir, no_model, capsys, damage, needle
):
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    damage(out)
    before = snapshot(out)
    assert run_cli(tiny_run(tiny_model_dir, out, "--limit", "4")) == 2
    one_error_line(capsys, needle)
    assert snapshot(out) == before


def test_readers_read_a_real_run_and_refuse_what_resume_refuses(finished_run, tmp_path, capsys):
    """The run's own directory reads as it was written (its config's 4 agents: 4 request lines per
    sample); a sample missing its last request is refused by ``report`` as by resume (issue 18)."""
    from kvcmas_bench.results.frames import load_dirs

    (run,) = load_dirs([finished_run]).runs
    assert len(run.samples) == 4 and len(run.requests) == 16
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    _delete_line(out / "requests.jsonl", 4)
    before = snapshot(out)
    capsys.readouterr()
    assert run_cli(["report", str(out), "--no-plots"]) == 2
    one_error_line(capsys, "samples.jsonl is corrupt (line 1 is sample")
    assert snapshot(out) == before and not (out / "report").exists()


def test_request_line_of_a_finished_sample_that_is_not_a_record(
    finished_run, tmp_path, tiny_model_dir, no_model, capsys
):
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    first = json.loads((out / "samples.jsonl").read_text().splitlines()[0])["sample_id"]
    _replace_line(out / "requests.jsonl", 4, json.dumps({"sample_id": first, "agent": "x"}).encode() + b"\n")
    before = snapshot(out)
    assert run_cli(tiny_run(tiny_model_dir, out, "--limit", "4")) == 2
    one_error_line(capsys, "requests.jsonl line 4 is not a valid request record")
    assert snapshot(out) == before


def test_only_a_torn_last_line_is_repaired(finished_run, tmp_path, tiny_model_dir):
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    samples = (out / "samples.jsonl").read_bytes()
    requests = (out / "requests.jsonl").read_bytes()
    with open(out / "requests.jsonl", "ab") as f:
        f.write(json.dumps({"sample_id": "mmlu-unfinished", "agent": "x"}).encode() + b"\n")
        f.write(b'{"sample_id": "mmlu-unfinished", "ag')
    assert run_cli(tiny_run(tiny_model_dir, out, "--limit", "4")) == 0
    # the finished records are kept byte for byte; only the cut-off tail is gone
    assert (out / "samples.jsonl").read_bytes() == samples
    assert (out / "requests.jsonl").read_bytes() == requests


# ---- defect 3: one writer per directory -----------------------------------------------------------
HOLDER = textwrap.dedent(
    """
    import sys
    from kvcmas_bench.results.outdir import lock_output_dir
    with lock_output_dir(sys.argv[1]):
        print("locked", flush=True)
        sys.stdin.read()
    """
)

BLOCKED_RUN = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from kvcmas_bench.cli import main
    from kvcmas_bench.jobs import run as runner

    real, go = runner.run_one, Path(sys.argv[1])

    def gated(*a, **kw):
        while not go.exists():
            time.sleep(0.05)
        return real(*a, **kw)

    runner.run_one = gated
    main(sys.argv[2:])
    """
)


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path]), "OMP_NUM_THREADS": "1"}


def _lock_held(d: Path) -> bool:
    import fcntl

    try:
        fd = os.open(d / LOCK_NAME, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


def _wait_for_lock(d: Path, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    t0 = time.monotonic()
    while not _lock_held(d):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() - t0 < timeout, "the first process never took the lock"
        time.sleep(0.1)


def test_second_run_into_a_busy_directory_is_refused(tiny_model_dir, tmp_path, capsys):
    """Two real ``run`` processes into one directory: the second is refused at once with the first's pid
    (before loading anything), the first finishes undisturbed, nothing is duplicated."""
    out, go = tmp_path / "run", tmp_path / "go"
    args = tiny_run(tiny_model_dir, out, "--limit", "2")
    first = subprocess.Popen(
        [sys.executable, "-c", BLOCKED_RUN, str(go), *args],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for_lock(out, first)
        assert run_cli(args) == 2
        one_error_line(capsys, f"is in use by another kvcmas-bench process (pid {first.pid})")
        go.touch()
        _, err = first.communicate(timeout=300)
        assert first.returncode == 0, err
    finally:
        first.kill()
    ids = [json.loads(x)["sample_id"] for x in (out / "samples.jsonl").read_text().splitlines()]
    assert len(ids) == 2 == len(set(ids))
    assert len((out / "requests.jsonl").read_text().splitlines()) == 8
    assert run_cli(args) == 0  # free again once the first process is gone


@pytest.mark.parametrize(
    "command", [["serve-sweep"], ["coverage"], ["suite", "--methods", "fullshared"], ["ablate", "tau"]], ids=" ".join
)
def test_sweep_coverage_suite_and_ablate_directories_are_locked_too(tmp_path, command, no_model, capsys):
    out = tmp_path / "out"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(out)], env=_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert run_cli([*command, "-o", str(out)]) == 2
        one_error_line(capsys, f"in use by another kvcmas-bench process (pid {holder.pid})")
    finally:
        holder.communicate("")


def test_temporary_files_have_unique_names(tmp_path):
    from kvcmas_bench.results.records import write_json

    path, errors = tmp_path / "config.json", []

    def writer(k: int) -> None:
        try:
            for i in range(300):
                write_json(path, {"writer": k, "i": i})
        except Exception as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert json.loads(path.read_text())["i"] == 299
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]


# ---- defect 4: method options of serve-sweep ------------------------------------------------------
@pytest.mark.parametrize(
    "flag,value",
    [("--tau", "2"), ("--tau", "nan"), ("--rank", "0"), ("--anchors", "0"), ("--rho", "1.5"), ("--tau", "-0.1")],
)
@pytest.mark.parametrize("methods", ["all", "kvcmas,cacheblend,kvcomm"])
def test_serve_sweep_refuses_bad_method_options_before_the_model_loads(
    tmp_path, no_model, capsys, flag, value, methods
):
    out = tmp_path / "sweep"
    assert run_cli(["serve-sweep", "--method", methods, flag, value, "--qps", "0", "-o", str(out)]) == 2
    one_error_line(capsys, flag)
    assert not out.exists()


# ---- defect 5: bad data / trace files, unwritable output paths ---------------------------------------
BAD_LINES = {
    "binary": b'{"question": "q"}\n\xff\xfe\x00\x81garbage\n',
    "array": b"[1, 2, 3]\n",
    "string": b'"just a string"\n',
    "number": b"42\n",
}


@pytest.mark.parametrize("kind", list(BAD_LINES))
def test_bad_mmlu_data_file_is_one_line(tmp_path, kind, no_model, capsys):
    data = tmp_path / "mmlu.jsonl"
    data.write_bytes(BAD_LINES[kind])
    out = tmp_path / "run"
    assert run_cli(["run", "--data-path", str(data), "--limit", "1", "-o", str(out)]) == 2
    one_error_line(capsys, "cannot read MMLU data")
    assert not out.exists()  # nothing left behind by a run that never started


@pytest.mark.parametrize("kind", list(BAD_LINES))
def test_bad_trace_file_is_one_line(tmp_path, kind, no_model, capsys):
    traces = tmp_path / "traces.jsonl"
    traces.write_bytes(BAD_LINES[kind])
    out = tmp_path / "sweep"
    assert run_cli(["serve-sweep", "--traces", str(traces), "--method", "nonshared", "-o", str(out)]) == 2
    one_error_line(capsys, "is not a valid serving trace")
    assert not out.exists()


def _unwritable(tmp_path: Path, kind: str) -> Path:
    if kind == "below-a-file":
        (tmp_path / "file").write_text("x")
        return tmp_path / "file" / "out"
    if kind == "read-only-dir":
        if os.geteuid() == 0:
            pytest.skip("root writes into read-only directories; /proc covers it")
        d = tmp_path / "ro"
        d.mkdir()
        d.chmod(0o555)
        return d
    return Path("/proc")  # an existing directory nobody, not even root, can create files in


@pytest.mark.parametrize("kind", ["below-a-file", "read-only-dir", "proc"])
@pytest.mark.parametrize("command", ["run", "serve-sweep", "coverage"])
def test_unwritable_output_path_is_one_line_before_the_model_loads(tmp_path, command, kind, no_model, capsys):
    out = _unwritable(tmp_path, kind)
    assert run_cli([command, "-o", str(out)]) == 2
    one_error_line(capsys, str(out))


def test_coverage_refuses_an_existing_file_as_output_path(tmp_path, no_model, capsys):
    out = tmp_path / "coverage.csv"
    out.write_text("keep me")
    assert run_cli(["coverage", "-o", str(out)]) == 2
    one_error_line(capsys, "exists and is not a directory")
    assert out.read_text() == "keep me"


# ---- defect 6: minor ---------------------------------------------------------------------------------
def test_coverage_max_new_tokens_zero_is_refused(tmp_path, no_model, capsys):
    assert run_cli(["coverage", "--max-new-tokens", "0", "-o", str(tmp_path / "c")]) == 2
    one_error_line(capsys, "--max-new-tokens")


def test_agents_above_the_fixed_bound_are_refused(tmp_path, no_model, capsys):
    assert run_cli(["run", "--agents", "65", "--limit", "1", "-o", str(tmp_path / "a")]) == 2
    one_error_line(capsys, "--agents must lie in [2, 64]")


def test_agents_beyond_the_models_context_are_refused(tiny_model_dir, tmp_path, capsys, monkeypatch):
    from kvcmas_bench.jobs import run as runner

    def boom(*a, **kw):
        raise AssertionError("a sample ran")

    monkeypatch.setattr(runner, "run_one", boom)
    # within the fixed bound, but the outputs one chain prompt accumulates exceed the tiny model's 4096 positions
    args = tiny_run(tiny_model_dir, tmp_path / "b", "--limit", "1", "--agents", "40", "--max-new-tokens", "200")
    assert run_cli(args) == 2
    one_error_line(capsys, "model's context of 4096")


def test_interrupt_prints_how_to_resume(tiny_model_dir, tmp_path, monkeypatch, capsys):
    from kvcmas_bench.jobs import run as runner

    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "run_one", interrupted)
    assert run_cli(tiny_run(tiny_model_dir, tmp_path / "run", "--limit", "1")) == 130
    assert "run the same command again to resume" in capsys.readouterr().err


def test_serve_sweep_service_file_keeps_the_same_rules(tmp_path):
    """service.jsonl: a torn last line is dropped and re-measured; a corrupt middle line stops the
    sweep with one BenchError naming it and every file of the directory stays as it was."""
    from kvcmas_bench.errors import BenchError
    from kvcmas_bench.modeling import LoadedModel

    from .sweep_helper import serve_sweep
    from .test_serving import TEXTS, FakeTokenizer, quiet, tiny_model

    lm = LoadedModel(model=tiny_model("llama", layers=2), tokenizer=FakeTokenizer(), name="tiny", source="tests")
    out = tmp_path / "sweep"
    kw = dict(
        model=lm, output_tokens=2, device="cpu", texts=TEXTS, plots=False, console=quiet(), progress=lambda m: None
    )
    serve_sweep(["nonshared"], [0], [16], 2, str(out), **kw)
    service = (out / "service.jsonl").read_bytes()
    assert len(service.splitlines()) == 8
    with open(out / "service.jsonl", "ab") as f:
        f.write(b'{"agent": "Reader", "ttft')
    serve_sweep(["nonshared"], [0], [16], 2, str(out), **kw)
    assert (out / "service.jsonl").read_bytes() == service
    _replace_line(out / "service.jsonl", 2, b"\xffnot json\n")
    before = snapshot(out)
    with pytest.raises(BenchError, match="service.jsonl line 2"):
        serve_sweep(["nonshared"], [0], [16], 2, str(out), **kw)
    assert snapshot(out) == before
