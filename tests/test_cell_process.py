"""Suite cells in a fresh process each (``--cell-process fresh``): no earlier state of the harness
process can move a cell's CPU peak, the run's progress reaches the parent's display, a cell's
one-line error fails that cell only, and Ctrl-C or a killed suite leaves nothing running and loses
no finished sample."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kvcmas_bench.errors import BenchError
from kvcmas_bench.jobs import cells
from kvcmas_bench.jobs.suite import SuiteOptions, run_suite
from kvcmas_bench.methods import METHODS, register
from kvcmas_bench.methods.fullshared import FullShared

from .conftest import run_cli

MiB = 2**20


class Plugin(FullShared):
    """A method registered from outside the package (as a user's plugin is): it must reach the worker."""

    name = "plugin-test"
    label = "Plugin"
    summary = "test only"


@pytest.fixture
def plugin():
    register(Plugin)
    yield
    METHODS.pop(Plugin.name, None)


TINY = ["--max-new-tokens", "2", "--final-max-new-tokens", "2", "--device", "cpu", "--no-plots"]


def _rss() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _peaks(out: Path, methods: tuple[str, ...]) -> dict[str, int]:
    return {m: json.loads((out / "mmlu" / m / "summary.json").read_text())["peak_mem_bytes"] for m in methods}


def test_no_memory_the_harness_process_holds_reaches_a_fresh_cells_peak(tiny_model_dir, tmp_path):
    """512 MiB held by the process that runs the suite (as an earlier cell's retained memory would
    be) lands in every in-process cell's peak, and in no fresh cell's."""
    held = torch.ones(128 * MiB, dtype=torch.float32)  # 512 MiB, every page written
    rss = _rss()
    base = ["suite", "--methods", "fullshared", "--workloads", "mmlu", "--model", tiny_model_dir, "--limit", "1", *TINY]
    assert run_cli([*base, "--cell-process", "same", "-o", str(tmp_path / "same")]) == 0
    assert run_cli([*base, "--cell-process", "fresh", "-o", str(tmp_path / "fresh")]) == 0
    cells_ = ("nonshared", "fullshared")
    same, fresh = _peaks(tmp_path / "same", cells_), _peaks(tmp_path / "fresh", cells_)
    assert held.sum().item() == 128 * MiB
    for m in cells_:
        # the old way, the held memory is in the figure (the process's RSS can fall a little below
        # ``rss`` at the cell's reset, which hands free heap pages back); a fresh cell never sees it
        assert same[m] - fresh[m] > 256 * MiB, (same, fresh)
        assert fresh[m] < rss - 256 * MiB, (fresh, rss)


class _Recorder:
    """A suite display that records what each cell's run told it."""

    def __init__(self):
        self.calls: dict[str, list] = {}
        self.ended: dict[str, tuple] = {}

    def begin(self, cells_, done):
        self.planned = [c.name for c in cells_]

    def cell(self, cell):
        calls = self.calls.setdefault(cell.name, [])

        class Run:
            def start(self, total, done):
                calls.append(("start", total, done))

            def advance(self, rec):
                calls.append(("advance", rec["sample_id"], rec["correct"]))

            def note(self, message):
                calls.append(("note", message))

        return Run()

    def end_cell(self, cell, status, detail):
        self.ended[cell.name] = (status, detail)


def _opts(model: str, out: Path, methods=("fullshared",), **kw) -> SuiteOptions:
    return SuiteOptions(
        model=model, methods=list(methods), workloads=["mmlu"], limit=2, max_new_tokens=2,
        final_max_new_tokens=2, device="cpu", plots=False, output_path=str(out), cell_process="fresh", **kw,
    )  # fmt: skip


def test_a_fresh_cells_progress_summary_and_one_line_error_reach_the_suite(
    tiny_model_dir, tmp_path, plugin, monkeypatch
):
    """The first cell's directory is damaged, so its worker refuses it with the reader's one line: that
    cell fails, the next one (a plugin method) runs, and its progress calls and summary reach the
    suite's display; no cell runs in the test process."""

    def not_here(*a, **k):
        raise AssertionError("a cell ran in the suite's own process")

    monkeypatch.setattr("kvcmas_bench.jobs.suite.run_job", not_here)
    monkeypatch.setattr("kvcmas_bench.jobs.run.run", not_here)
    bad = tmp_path / "s" / "mmlu" / "nonshared"
    bad.mkdir(parents=True)
    (bad / "samples.jsonl").write_text('{"sample_id": "x"}\nnot json\n')
    rec = _Recorder()
    res = run_suite(_opts(tiny_model_dir, tmp_path / "s", methods=["plugin-test"]), progress=rec)
    assert rec.planned == ["mmlu/nonshared", "mmlu/plugin-test"] and list(res.failed) == ["mmlu/nonshared"]
    assert "samples.jsonl" in res.failed["mmlu/nonshared"] and "\n" not in res.failed["mmlu/nonshared"]
    assert rec.ended["mmlu/nonshared"] == ("failed", res.failed["mmlu/nonshared"])
    assert (bad / "samples.jsonl").read_text() == '{"sample_id": "x"}\nnot json\n'
    lines = [json.loads(x) for x in (tmp_path / "s" / "mmlu/plugin-test" / "samples.jsonl").read_text().splitlines()]
    calls = rec.calls["mmlu/plugin-test"]
    assert [c for c in calls if c[0] == "start"] == [("start", 2, 0)]
    assert [c for c in calls if c[0] == "advance"] == [("advance", s["sample_id"], s["correct"]) for s in lines]
    status, summary = rec.ended["mmlu/plugin-test"]
    assert status == "done" and summary["n"] == 2 and summary["method"] == "plugin-test"
    assert summary["accuracy"] == sum(s["correct"] for s in lines) / 2
    manifest = json.loads((tmp_path / "s" / "suite.json").read_text())
    states = {k: (c["status"], c["process"]) for k, c in manifest["cells"].items()}
    assert states == {"mmlu/nonshared": ("failed", "fresh"), "mmlu/plugin-test": ("done", "fresh")}


def test_which_classes_travel_to_a_worker(plugin):
    """Built-in classes are the worker's own; a module-level plugin travels by reference; a class the
    worker cannot import (local, or from __main__) keeps its cell in this process."""
    from kvcmas_bench.jobs.run import RunOptions

    assert cells.plugins(RunOptions(method="kvcmas", workload="gsm8k")) == {}
    assert cells.plugins(RunOptions(method="plugin-test")) == {"method": ("plugin-test", Plugin)}

    class Local(FullShared):
        name = "local-test"

    Main = type("Main", (FullShared,), {"name": "main-test", "__module__": "__main__"})
    for cls in (Local, Main):
        register(cls)
        try:
            assert cells.plugins(RunOptions(method=cls.name)) is None
        finally:
            METHODS.pop(cls.name)


@pytest.mark.parametrize(
    ("end", "rc", "raised", "words"),
    [
        ({"error": "bad thing"}, 0, BenchError, "bad thing"),
        ({"os_error": [28, "No space left on device", "/x/y"]}, 0, OSError, "No space left on device"),
        ({"interrupted": True}, 130, KeyboardInterrupt, ""),
        ({}, -9, BenchError, "killed by SIGKILL (out of memory?)"),
        ({}, -15, BenchError, "killed by SIGTERM"),
        ({"bug": "ZeroDivisionError: division by zero"}, 1, RuntimeError, "ZeroDivisionError"),
        ({}, 1, RuntimeError, "exit 1"),
    ],
)
def test_a_workers_end_becomes_what_an_in_process_cell_gives(end, rc, raised, words):
    with pytest.raises(raised) as info:
        cells._outcome(end, rc)
    assert words in str(info.value)
    if raised is OSError:
        assert info.value.filename == "/x/y" and info.value.errno == 28


def test_an_unknown_cell_process_or_fresh_on_a_server_is_one_line(tmp_path, capsys, monkeypatch):
    assert run_cli(["suite", "--cell-process", "forked", "-o", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "kvcmas-bench: error: --cell-process must be one of auto, fresh, same, got 'forked'"
    with pytest.raises(BenchError, match="applies to the in-process engine"):
        cells.check_cell_process("fresh", "vllm")
    monkeypatch.setenv("KVCMAS_BENCH_CELL_PROCESS", "spawn")  # the option's environment variable
    assert run_cli(["suite", "-o", str(tmp_path / "a")]) == 2
    assert capsys.readouterr().err.strip().endswith("got 'spawn'")
    assert not (tmp_path / "a").exists()


def test_auto_is_fresh_on_cpu_with_the_in_process_engine_only(monkeypatch):
    monkeypatch.setattr(cells, "AUTO_FRESH_ON_CPU", True)  # the default outside this test suite
    assert cells.fresh_cells("auto", "in-process", "cpu")
    assert not cells.fresh_cells("auto", "vllm", "cpu")
    assert cells.fresh_cells("fresh", "in-process", "cpu") and not cells.fresh_cells("same", "in-process", "cpu")
    monkeypatch.setattr("kvcmas_bench.modeling.resolve_device", lambda d: torch.device("cuda"))
    assert not cells.fresh_cells("auto", "in-process", "cuda") and cells.fresh_cells("fresh", "in-process", "cuda")


def _children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _start_suite(model: str, out: Path) -> subprocess.Popen:
    args = ["suite", "--methods", "fullshared", "--workloads", "mmlu", "--model", model, "--limit", "6"]
    args += [*TINY, "--cell-process", "fresh", "-o", str(out)]
    return subprocess.Popen(
        [sys.executable, "-m", "kvcmas_bench.cli", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip


def _wait_for_worker(proc: subprocess.Popen, first: Path | None = None) -> int:
    """The worker's pid once it exists (and, given ``first``, once its cell has committed a sample)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        kids = _children(proc.pid)
        if kids and (first is None or first.exists() and first.read_text().count("\n") >= 1):
            return kids[0]
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    raise AssertionError("no worker (or no committed sample) in 120 s")


def test_ctrl_c_on_a_suite_stops_its_worker_keeps_every_sample_and_resumes(tiny_model_dir, tmp_path):
    out = tmp_path / "s"
    proc = _start_suite(tiny_model_dir, out)
    worker = _wait_for_worker(proc, out / "mmlu" / "nonshared" / "samples.jsonl")
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)  # a terminal's Ctrl-C reaches the suite; the worker has its own session
    _, stderr = proc.communicate(timeout=60)
    assert time.monotonic() - t0 < cells.INTERRUPT_GRACE_S / 2  # the worker stopped on the SIGINT passed on
    assert proc.returncode == 130, stderr
    assert "interrupted: finished samples are saved" in stderr.decode() and "Traceback" not in stderr.decode()
    assert not _alive(worker)
    kept = (out / "mmlu" / "nonshared" / "samples.jsonl").read_text().splitlines()
    assert 1 <= len(kept) < 6
    assert run_cli(["suite", "--methods", "fullshared", "--workloads", "mmlu", "--model", tiny_model_dir,
                    "--limit", "6", *TINY, "--cell-process", "same", "-o", str(out)]) == 0  # fmt: skip
    lines = (out / "mmlu" / "nonshared" / "samples.jsonl").read_text().splitlines()
    assert lines[: len(kept)] == kept and len(lines) == 6
    assert len({json.loads(x)["sample_id"] for x in lines}) == 6


def test_ctrl_c_while_the_worker_starts_is_quiet(tiny_model_dir, tmp_path):
    proc = _start_suite(tiny_model_dir, tmp_path / "s")
    worker = _wait_for_worker(proc)  # still importing torch
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in stderr.decode(), stderr.decode()
    assert "interrupted: finished samples are saved" in stderr.decode()
    assert not _alive(worker)


def test_a_killed_suite_leaves_no_worker_running(tiny_model_dir, tmp_path):
    proc = _start_suite(tiny_model_dir, tmp_path / "s")
    worker = _wait_for_worker(proc)
    proc.kill()
    proc.communicate(timeout=60)
    deadline = time.monotonic() + 30
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(worker)
