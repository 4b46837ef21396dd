"""``run``/``suite``/``ablate --engine``: what each engine refuses, with one line and exit 2, before a
model loads or the output path is touched (the runs themselves: tests/test_vllm_server.py)."""

from __future__ import annotations

import pytest

from .conftest import one_line, run_cli


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--engine", "vllm", "--fidelity"], "--fidelity needs --engine in-process"),
        (["--engine", "vllm", "--target-reuse", "0.5", "--method", "kvcmas"], "--target-reuse needs --engine"),
        (["--engine", "vllm", "--workload", "mathvista"], "runs text workloads"),
        (["--engine", "vllm", "--method", "droidspeak"], "cannot run droidspeak"),
        (["--engine", "vllm-inprocess"], "--engine must be one of in-process, vllm"),
        (["--engine", "nope"], "--engine must be one of in-process, vllm"),
        (["--max-concurrency", "4"], "--max-concurrency applies to --engine vllm"),
        (["--engine-arg", "base_url=http://127.0.0.1:1"], "--engine-arg applies to --engine vllm"),
        (["--engine", "vllm", "--max-concurrency", "0"], "--max-concurrency must be a positive integer"),
        (["--engine", "vllm", "--engine-arg", "no_such=1"], "no_such"),
        (["--engine", "vllm", "--engine-arg", "block_size=abc"], "block_size"),
    ],
)
def test_run_refuses_what_its_engine_cannot_do_in_one_line(args, needle, tmp_path, capsys, no_model):
    out = tmp_path / "out"
    assert run_cli(["run", "-o", str(out), "--limit", "2", *args]) == 2
    assert needle in one_line(capsys, needle)
    assert not out.exists()


def test_suite_and_ablate_refuse_the_vllm_engine_with_fidelity(tmp_path, capsys, no_model):
    """ablate records fidelity by default: on --engine vllm it must be turned off (--no-fidelity)."""
    assert run_cli(["ablate", "rank", "--engine", "vllm", "-o", str(tmp_path / "a")]) == 2
    assert "--fidelity needs --engine in-process" in one_line(capsys, "--fidelity")
    assert run_cli(["suite", "--engine", "vllm", "--fidelity", "-o", str(tmp_path / "s")]) == 2
    assert "--fidelity needs --engine in-process" in one_line(capsys, "--fidelity")
    assert run_cli(["suite", "--engine", "vllm", "--methods", "kvcmas,droidspeak", "-o", str(tmp_path / "s")]) == 2
    assert "cannot run droidspeak" in one_line(capsys, "droidspeak")


def test_a_suite_of_all_methods_on_vllm_plans_the_ones_the_engine_runs(no_model):
    """``--methods all`` on --engine vllm: every method but those needing the source's hidden states."""
    from kvcmas_bench.jobs.suite import SuiteOptions, plan_suite

    cells = plan_suite(SuiteOptions(engine="vllm", limit=2, engine_args={"base_url": "http://127.0.0.1:1"}))
    names = {c.method for c in cells}
    assert "nonshared" in names and "kvcmas" in names and "cacheblend" in names
    assert not names & {"droidspeak", "relaycaching"}
