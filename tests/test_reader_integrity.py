"""Readers check what writers check (issue 18): ``report`` and ``compare`` (and ``ablate``, through
the same loader) read a run directory, alone or as a suite cell, by ``run``'s resume rules. A
duplicated, orphaned or renamed sample or request line and a finished sample with missing requests
exit 2 with one line naming the file and the line, and nothing is written; what a kill leaves (a
torn last line, the requests of the one unfinished sample) is read as resume reads it. Hand-written
run directories, no model: expectations by hand."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvcmas_bench.errors import BenchError
from kvcmas_bench.results.frames import load_dirs, load_sweep
from kvcmas_bench.results.request import RequestRecord

from .conftest import run_cli
from .synthetic import make_run, make_sweep

ROOT = Path(__file__).resolve().parents[1]
#: 4 samples, gold A B C D: one correct (accuracy 0.25); two agent requests per sample (steps 0, 1)
PREDS = ["A", "A", "A", "A"]


def tree(d: Path) -> dict[str, bytes]:
    """Every file under ``d``, by relative path: what a failed command must leave as it was."""
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def lines(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines(keepends=True)


def write_lines(path: Path, rows: list[bytes]) -> None:
    path.write_bytes(b"".join(rows))


def one_error_line(err: str, needle: str) -> str:
    got = [ln for ln in err.splitlines() if ln.strip()]
    assert len(got) == 1 and "Traceback" not in err, err
    assert got[0].startswith("kvcmas-bench: error: ") and needle in got[0], got[0]
    return got[0]


def request_line(sample_id: str, step: int) -> bytes:
    rec = RequestRecord("A0", 0.1, 0.2, sample_id=sample_id, step=step, layers=2)
    return json.dumps(rec.to_dict()).encode() + b"\n"


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A finished run directory; its config lists its two agents (two request lines per sample)."""
    return make_run(tmp_path_factory.mktemp("base") / "run", "kvcmas", PREDS, rho=0.8, agents=["A0", "Final"])


@pytest.fixture
def cand(base, tmp_path) -> Path:
    out = tmp_path / "cand"
    shutil.copytree(base, out)
    return out


# ---- the damages, each by hand; lines of samples.jsonl: mmlu-0..3; of requests.jsonl: 2k+1, 2k+2 of mmlu-k
def duplicate_sample(d: Path) -> None:
    s = lines(d / "samples.jsonl")
    write_lines(d / "samples.jsonl", s + [s[1]])


def changed_sample_id(d: Path) -> None:
    s = lines(d / "samples.jsonl")
    s[1] = s[1].replace(b'"mmlu-1"', b'"mmlu-7"')
    write_lines(d / "samples.jsonl", s)


def changed_last_sample_id(d: Path) -> None:
    s = lines(d / "samples.jsonl")
    s[3] = s[3].replace(b'"mmlu-3"', b'"mmlu-9"')
    write_lines(d / "samples.jsonl", s)


def changed_request_id(d: Path) -> None:
    r = lines(d / "requests.jsonl")
    r[3] = r[3].replace(b'"mmlu-1"', b'"mmlu-2"')  # step 1 of mmlu-1 now claims mmlu-2: mmlu-2 has it twice
    write_lines(d / "requests.jsonl", r)


def duplicate_request(d: Path) -> None:
    r = lines(d / "requests.jsonl")
    write_lines(d / "requests.jsonl", r[:4] + [r[3]] + r[4:])


def duplicate_last_request(d: Path) -> None:
    r = lines(d / "requests.jsonl")
    write_lines(d / "requests.jsonl", r + [r[2]])


def orphan_request(d: Path) -> None:
    r = lines(d / "requests.jsonl")
    write_lines(d / "requests.jsonl", r[:2] + [request_line("mmlu-42", 0)] + r[2:])


def orphans_of_two_samples(d: Path) -> None:
    r = lines(d / "requests.jsonl")
    write_lines(d / "requests.jsonl", r + [request_line("mmlu-42", 0), request_line("mmlu-43", 0)])


def orphan_sample(d: Path) -> None:
    s = lines(d / "samples.jsonl")
    extra = {"sample_id": "mmlu-5", "gold": "A", "prediction": "A", "correct": True}
    write_lines(d / "samples.jsonl", s + [json.dumps(extra).encode() + b"\n"])


def missing_first_request(d: Path) -> None:
    r = lines(d / "requests.jsonl")
    write_lines(d / "requests.jsonl", r[:2] + r[3:])


def missing_last_request(d: Path) -> None:
    r = lines(d / "requests.jsonl")
    write_lines(d / "requests.jsonl", r[:3] + r[4:])  # step 1 of mmlu-1: steps 0..0 remain, no gap


def extra_step(d: Path) -> None:
    r = lines(d / "requests.jsonl")
    write_lines(d / "requests.jsonl", r[:4] + [request_line("mmlu-1", 2)] + r[4:])


def request_without_id(d: Path) -> None:
    r = lines(d / "requests.jsonl")
    r[0] = json.dumps({k: v for k, v in json.loads(r[0]).items() if k != "sample_id"}).encode() + b"\n"
    write_lines(d / "requests.jsonl", r)


def bad_step(d: Path) -> None:
    r = lines(d / "requests.jsonl")
    r[2] = json.dumps({**json.loads(r[2]), "step": [0]}).encode() + b"\n"
    write_lines(d / "requests.jsonl", r)


def request_without_step(d: Path) -> None:
    """The issue's case: one request of a sample loses its step (it then escaped every check)."""
    r = lines(d / "requests.jsonl")
    r[2] = json.dumps({k: v for k, v in json.loads(r[2]).items() if k != "step"}).encode() + b"\n"
    write_lines(d / "requests.jsonl", r)


def duplicate_without_step(d: Path) -> None:
    """A request written twice, the copy without its step (it was accepted, rho and TTFT moved)."""
    r = lines(d / "requests.jsonl")
    copy = json.dumps({k: v for k, v in json.loads(r[2]).items() if k != "step"}).encode() + b"\n"
    write_lines(d / "requests.jsonl", r[:3] + [copy] + r[3:])


def every_ttft_negative(d: Path) -> None:
    """The issue's case: ``ttft_s = -100`` everywhere flipped the timing verdict."""
    r = [json.dumps({**json.loads(x), "ttft_s": -100}).encode() + b"\n" for x in lines(d / "requests.jsonl")]
    write_lines(d / "requests.jsonl", r)


def first_token_text(d: Path) -> None:
    r = lines(d / "requests.jsonl")
    r[1] = json.dumps({**json.loads(r[1]), "first_token_id": "x"}).encode() + b"\n"
    write_lines(d / "requests.jsonl", r)


def latency_text(d: Path) -> None:
    """A string in ``latency_s`` ended report with a traceback."""
    s = lines(d / "samples.jsonl")
    s[1] = json.dumps({**json.loads(s[1]), "latency_s": "1.5"}).encode() + b"\n"
    write_lines(d / "samples.jsonl", s)


def segment_tokens_negative(d: Path) -> None:
    r = lines(d / "requests.jsonl")
    rec = {**json.loads(r[2]), "segments": [{"kind": "PH", "tokens": -4, "status": "reused"}]}
    r[2] = json.dumps(rec).encode() + b"\n"
    write_lines(d / "requests.jsonl", r)


DAMAGES = {
    "duplicate-sample": (duplicate_sample, "samples.jsonl is corrupt (line 5 repeats sample 'mmlu-1' of line 2"),
    "changed-sample-id": (
        changed_sample_id,
        "requests.jsonl is corrupt (line 3 belongs to sample 'mmlu-1', which has no line in samples.jsonl, "
        "but finished samples follow it)",
    ),
    "changed-last-sample-id": (
        changed_last_sample_id,
        "samples.jsonl is corrupt (line 4 is sample 'mmlu-9', whose request lines in requests.jsonl are incomplete)",
    ),
    "changed-request-id": (
        changed_request_id,
        "requests.jsonl is corrupt (line 6 repeats request 1 of sample 'mmlu-2' of line 4)",
    ),
    "duplicate-request": (duplicate_request, "requests.jsonl is corrupt (line 5 repeats request 1 of sample 'mmlu-1'"),
    "duplicate-last-request": (
        duplicate_last_request,
        "requests.jsonl is corrupt (line 9 repeats request 0 of sample 'mmlu-1' of line 3)",
    ),
    "orphan-request": (orphan_request, "requests.jsonl is corrupt (line 3 belongs to sample 'mmlu-42'"),
    "orphans-of-two-samples": (
        orphans_of_two_samples,
        "requests.jsonl is corrupt (line 10 belongs to sample 'mmlu-43', which has no line in samples.jsonl, "
        "after line 9 of unfinished sample 'mmlu-42'",
    ),
    "orphan-sample": (
        orphan_sample,
        "samples.jsonl is corrupt (line 5 is sample 'mmlu-5', whose request lines in requests.jsonl are incomplete)",
    ),
    "missing-first-request": (
        missing_first_request,
        "samples.jsonl is corrupt (line 2 is sample 'mmlu-1', whose request lines in requests.jsonl are incomplete)",
    ),
    "missing-last-request": (
        missing_last_request,
        "samples.jsonl is corrupt (line 2 is sample 'mmlu-1', whose request lines in requests.jsonl are incomplete)",
    ),
    "extra-step": (
        extra_step,
        "samples.jsonl is corrupt (line 2 is sample 'mmlu-1', whose request lines in requests.jsonl are not its "
        "2 steps 0..1)",
    ),
    "request-without-id": (request_without_id, "requests.jsonl is corrupt (line 1 belongs to sample None"),
    "bad-step": (bad_step, "requests.jsonl is corrupt (line 3 is not a valid request record (step [0]"),
    "every-ttft-negative": (
        every_ttft_negative,
        "requests.jsonl is corrupt (line 1 is not a valid request record (ttft_s -100 is negative))",
    ),
    "first-token-text": (
        first_token_text,
        "requests.jsonl is corrupt (line 2 is not a valid request record (first_token_id 'x' is not an integer))",
    ),
    "latency-text": (
        latency_text,
        "samples.jsonl is corrupt (line 2 is not a valid sample record (latency_s '1.5' is not a duration))",
    ),
    "segment-tokens-negative": (
        segment_tokens_negative,
        "requests.jsonl is corrupt (line 3 is not a valid request record (tokens -4 is negative))",
    ),
    "request-without-step": (
        request_without_step,
        "requests.jsonl is corrupt (line 3 is not a valid request record (no step))",
    ),
    "duplicate-without-step": (
        duplicate_without_step,
        "requests.jsonl is corrupt (line 4 is not a valid request record (no step))",
    ),
}


def report(d: Path, capsys, *extra: str) -> tuple[int, str]:
    capsys.readouterr()
    rc = run_cli(["report", str(d), "--no-plots", *extra])
    return rc, capsys.readouterr().err


def compare(a: Path, b: Path, capsys, *extra: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = run_cli(["compare", str(a), str(b), *extra])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


# ---- undamaged and killed directories still read --------------------------------------------------
def test_undamaged_run_reports_and_compares(base, cand, tmp_path, capsys):
    before = tree(base)
    (run,) = load_dirs([base]).runs
    assert len(run.samples) == 4 and run.samples["correct"].sum() == 1 and len(run.requests) == 8
    out = tmp_path / "report"
    rc, _ = report(base, capsys, "-o", str(out))
    assert rc == 0 and (out / "report.md").exists()
    assert "n = 4" in (out / "report.md").read_text() and "0.250" in (out / "report.md").read_text()
    md = tmp_path / "cmp.md"
    rc, stdout, _ = compare(base, cand, capsys, "--exact", "--markdown", str(md))
    assert rc == 0 and stdout.startswith("PASS") and "compare: PASS" in md.read_text()
    assert tree(base) == before


def test_a_killed_run_is_read_as_resume_reads_it(cand, capsys):
    """What a kill leaves (the requests of the one sample it cut off, a torn last line) is dropped,
    as resume drops it, and nothing is rewritten by a reader."""
    with open(cand / "requests.jsonl", "ab") as f:
        f.write(request_line("mmlu-4", 0) + request_line("mmlu-4", 1))
    with open(cand / "samples.jsonl", "ab") as f:
        f.write(b'{"sample_id": "mmlu-4", "corr')
    before = tree(cand)
    (run,) = load_dirs([cand]).runs
    assert sorted(run.samples["sample_id"]) == ["mmlu-0", "mmlu-1", "mmlu-2", "mmlu-3"]
    assert len(run.requests) == 8 and set(run.requests["sample_id"]) == set(run.samples["sample_id"])
    rc, _ = report(cand, capsys, "-o", str(cand.parent / "r"))
    assert rc == 0
    assert tree(cand) == before


# ---- damaged run directories: exit 2, one line naming file and line, nothing written -------------
@pytest.mark.parametrize("name", list(DAMAGES))
def test_damaged_run_directory_is_refused_by_every_reader(base, cand, tmp_path, capsys, name):
    damage, needle = DAMAGES[name]
    damage(cand)
    before = tree(cand)
    with pytest.raises(BenchError, match="line"):
        load_dirs([cand])
    rc, err = report(cand, capsys)  # default output: DIR/report, which must not appear
    assert rc == 2
    line = one_error_line(err, needle)
    assert str(cand) in line
    md = tmp_path / "cmp.md"
    for a, b in ((base, cand), (cand, base)):  # a damaged candidate or baseline: never a verdict
        rc, stdout, err = compare(a, b, capsys, "--markdown", str(md))
        assert rc == 2 and stdout == "", stdout
        one_error_line(err, needle)
        assert not md.exists()
    assert tree(cand) == before


def test_the_issue_cases_through_the_console_script(base, cand, tmp_path):
    """The reported symptoms, end to end in a subprocess: a duplicated sample line no longer reports
    n = 5 (exit 0) and a duplicated request line no longer makes a false rho regression (exit 1)."""
    dup = tmp_path / "dup-sample"
    shutil.copytree(cand, dup)
    duplicate_sample(dup)
    duplicate_request(cand)
    md = tmp_path / "cmp.md"
    for args, needle in (
        (["report", str(dup), "--no-plots"], "samples.jsonl is corrupt (line 5 repeats sample"),
        (["compare", str(base), str(cand), "--markdown", str(md)], "requests.jsonl is corrupt (line 5 repeats"),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "kvcmas_bench.cli", *args], capture_output=True, text=True, timeout=120, cwd=ROOT
        )
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert proc.stdout == ""
        one_error_line(proc.stderr, needle)
    assert not md.exists() and not (dup / "report").exists()


# ---- suites: the same checks per cell -------------------------------------------------------------
def make_suite(root: Path) -> Path:
    cells = {}
    for method, preds in (("nonshared", ["A", "B", "A", "A"]), ("kvcmas", PREDS)):
        make_run(root / "mmlu" / method, method, preds, agents=["A0", "Final"])
        cells[f"mmlu/{method}"] = {"workload": "mmlu", "method": method, "path": f"mmlu/{method}", "status": "done"}
    (root / "suite.json").write_text(json.dumps({"command": "suite", "settings": {}, "cells": cells}))
    return root


@pytest.mark.parametrize("name", ["duplicate-sample", "changed-sample-id", "duplicate-request", "missing-last-request"])
def test_damaged_suite_cell_is_refused(tmp_path, capsys, name):
    damage, needle = DAMAGES[name]
    good, bad = make_suite(tmp_path / "good"), make_suite(tmp_path / "bad")
    rc, _ = report(good, capsys, "-o", str(tmp_path / "r"))
    assert rc == 0
    rc, stdout, _ = compare(good, bad, capsys)
    assert rc == 0 and stdout.startswith("PASS")
    damage(bad / "mmlu" / "kvcmas")
    before = tree(bad)
    rc, err = report(bad, capsys)
    assert rc == 2
    assert str(bad / "mmlu" / "kvcmas") in one_error_line(err, needle)
    md = tmp_path / "cmp.md"
    for a, b in ((good, bad), (bad, good)):
        rc, stdout, err = compare(a, b, capsys, "--markdown", str(md))
        assert rc == 2 and stdout == ""
        one_error_line(err, needle)
        assert not md.exists()
    assert tree(bad) == before


def test_ablation_table_reads_its_cells_through_the_same_check(tmp_path):
    from kvcmas_bench.jobs.ablate import Point, ablation_table

    out = make_suite(tmp_path / "abl")
    points = [Point("mmlu", m, m) for m in ("nonshared", "kvcmas")]
    assert list(ablation_table(out, points)["point"]) == ["nonshared", "kvcmas"]
    duplicate_request(out / "mmlu" / "kvcmas")
    with pytest.raises(BenchError, match=r"requests.jsonl is corrupt \(line 5 repeats request 1"):
        ablation_table(out, points)


# ---- serve-sweep directories: a record written twice ----------------------------------------------
def make_records(d: Path) -> Path:
    service, served = [], []
    for method in ("nonshared", "kvcmas"):
        for t in ("t0", "t1"):
            for step in (0, 1):
                rec = RequestRecord("A0", 0.1, 0.2, method=method, shared_tokens=2048, trajectory=t, step=step)
                service.append(json.dumps(rec.to_dict()) + "\n")
                for qps in (0.0, 0.25, 8.0):
                    rec.qps, rec.arrival_s, rec.completion_s = qps, float(step), float(step) + 0.5
                    served.append(json.dumps(rec.to_dict()) + "\n")
    (d / "service.jsonl").write_text("".join(service))
    (d / "requests.jsonl").write_text("".join(served))
    return d


@pytest.mark.parametrize(
    "file,line,needle",
    [
        ("service.jsonl", 3, "service.jsonl is corrupt (line 9 repeats the measurement of line 3)"),
        ("requests.jsonl", 5, "requests.jsonl is corrupt (line 25 repeats the served request of line 5)"),
    ],
)
def test_sweep_with_a_record_written_twice_is_refused(tmp_path, capsys, file, line, needle):
    a, b = make_records(make_sweep(tmp_path / "a")), make_records(make_sweep(tmp_path / "b"))
    assert len(load_sweep(a).service) == 8
    rc, stdout, _ = compare(a, b, capsys)
    assert rc == 0 and stdout.startswith("PASS")
    rows = lines(b / file)
    write_lines(b / file, rows + [rows[line - 1]])
    before = tree(b)
    rc, err = report(b, capsys)
    assert rc == 2
    one_error_line(err, needle)
    md = tmp_path / "cmp.md"
    rc, stdout, err = compare(a, b, capsys, "--markdown", str(md))
    assert rc == 2 and stdout == ""
    one_error_line(err, needle)
    assert not md.exists() and tree(b) == before
