"""Never measure nothing in silence (issue 50): warm-up stated and controllable, the starved-pool
warning, self-describing runs (--version, the command line, logged prompts), the resume accuracy,
labels that tell runs apart and the note of a comparison with itself."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvcmas_bench.results.frames import load_dirs

from .conftest import run_cli
from .synthetic import make_run
from .test_integrity import tiny_run


def samples(d: Path) -> list[dict]:
    return [json.loads(x) for x in (d / "samples.jsonl").read_text().splitlines()]


def test_version_prints_the_package_version(capsys):
    from kvcmas_bench import __version__

    assert run_cli(["--version"]) == 0
    assert capsys.readouterr().out.startswith(f"kvcmas-bench {__version__}")


def test_limit_help_says_unset_is_the_whole_dataset(capsys):
    assert run_cli(["run", "--help"]) == 0
    assert "whole dataset" in " ".join(capsys.readouterr().out.split())


@pytest.fixture(scope="module")
def kvcmas_pair(tiny_model_dir, tmp_path_factory) -> tuple[Path, Path, str, str]:
    """KVCMAS on the same 2 measured samples, without and with 4 warm-up samples (and its output)."""
    import io
    from contextlib import redirect_stdout

    root = tmp_path_factory.mktemp("warm")
    outs = []
    for name, extra in (("cold", []), ("warm", ["--warmup", "4"])):
        buf = io.StringIO()
        with redirect_stdout(buf):
            args = tiny_run(tiny_model_dir, root / name, "--limit", "2", "--method", "kvcmas", "--log-prompts", *extra)
            assert run_cli(args) == 0
        outs.append(buf.getvalue())
    return root / "cold", root / "warm", *outs


def test_a_starved_pool_is_warned_about_and_warm_up_removes_it(kvcmas_pair):
    cold, warm, cold_out, warm_out = kvcmas_pair
    s_cold = json.loads((cold / "summary.json").read_text())
    s_warm = json.loads((warm / "summary.json").read_text())
    gate = s_cold["accounting"]["gate"]
    assert gate.get("too_few_anchors", 0) + gate.get("no_anchor", 0) >= sum(gate.values()) / 2
    (w,) = s_cold["warnings"]
    assert "add --warmup N" in w and "warning:" in cold_out and "--warmup" in " ".join(cold_out.split())
    assert "warnings" not in s_warm and "warning:" not in warm_out
    assert "too_few_anchors" not in s_warm["accounting"]["gate"] and "no_anchor" not in s_warm["accounting"]["gate"]


def test_warm_up_samples_are_held_out_and_in_no_figure(kvcmas_pair, tmp_path, tiny_model_dir):
    cold, warm, *_ = kvcmas_pair
    c_cfg, w_cfg = (json.loads((d / "config.json").read_text()) for d in (cold, warm))
    assert c_cfg["warmup_samples"] is None and len(w_cfg["warmup_samples"]) == 4
    assert c_cfg["sample_ids"] == w_cfg["sample_ids"]
    assert not set(w_cfg["warmup_samples"]) & set(w_cfg["sample_ids"] + w_cfg["calibration_samples"])
    assert [s["sample_id"] for s in samples(warm)] == [s["sample_id"] for s in samples(cold)]
    assert load_dirs([warm]).runs[0].figures()["n"] == 2
    # a method without online state: the same figures with and without warm-up (its samples add none)
    a, b = tmp_path / "a", tmp_path / "b"
    assert run_cli(tiny_run(tiny_model_dir, a, "--limit", "2")) == 0
    assert run_cli(tiny_run(tiny_model_dir, b, "--limit", "2", "--warmup", "3")) == 0
    fa, fb = (load_dirs([d]).runs[0].figures() for d in (a, b))
    for k in ("n", "accuracy", "prompt_tokens_mean", "reuse_ratio", "prefilled_tokens"):
        assert fa[k] == fb[k], k
    assert [s["prediction"] for s in samples(a)] == [s["prediction"] for s in samples(b)]


def test_config_records_the_command_line_and_prompts_are_logged(kvcmas_pair):
    cold, *_ = kvcmas_pair
    cfg = json.loads((cold / "config.json").read_text())
    assert cfg["command_line"].startswith("kvcmas-bench run --model ") and "--method kvcmas" in cfg["command_line"]
    assert cfg["kvcmas_bench_version"] and cfg["dtype"] and cfg["seed"] == 0 and cfg["device"] == "cpu"
    prompts = [json.loads(x) for x in (cold / "prompts.jsonl").read_text().splitlines()]
    reqs = [json.loads(x) for x in (cold / "requests.jsonl").read_text().splitlines()]
    assert [(p["sample_id"], p["step"]) for p in prompts] == [(r["sample_id"], r["step"]) for r in reqs]
    first = samples(cold)[0]
    assert all(p["prompt"].strip() for p in prompts)
    # each agent's own role prompt and the sample's shared question are in what it was shown
    assert len({p["prompt"][:200] for p in prompts if p["sample_id"] == first["sample_id"]}) == 4


def test_the_progress_accuracy_counts_the_samples_finished_before_a_resume():
    from kvcmas_bench.cli import _Progress

    p = _Progress()
    p.start(total=4, done=2)
    p.resumed([{"correct": True}, {"correct": True}])
    p.advance({"correct": False})
    p.stop()
    assert (p.correct, p.n) == (2, 3)
    assert p.bar.tasks[0].fields["acc"] == "0.667"


def test_runs_nothing_tells_apart_are_labelled_by_their_directory(tmp_path):
    a = make_run(tmp_path / "a" / "kvcmas", "kvcmas", ["A", "B"])
    b = make_run(tmp_path / "b" / "kvcmas", "kvcmas", ["A", "C"])
    runs = load_dirs([a, b]).runs
    assert sorted(r.label for r in runs) == ["kvcmas (a/kvcmas)", "kvcmas (b/kvcmas)"]
    assert sorted(r.run_id for r in runs) == ["mmlu/kvcmas (a/kvcmas)", "mmlu/kvcmas (b/kvcmas)"]
    c = make_run(tmp_path / "c", "kvcmas", ["A", "B"], fidelity=True)
    labels = sorted(r.label for r in load_dirs([a, c]).runs)
    assert labels == ["kvcmas fidelity=False", "kvcmas fidelity=True"]


def test_compare_notes_a_directory_compared_with_itself_or_a_copy(tmp_path, capsys):
    a = make_run(tmp_path / "a", "kvcmas", ["A", "B"])
    shutil.copytree(a, tmp_path / "b")
    capsys.readouterr()
    assert run_cli(["compare", str(a), str(a)]) == 0
    assert "the same directory: nothing was compared" in " ".join(capsys.readouterr().err.split())
    assert run_cli(["compare", str(a), str(tmp_path / "b")]) == 0
    assert "byte-identical records" in " ".join(capsys.readouterr().err.split())


COMMON = ["--device", "cpu", "--max-new-tokens", "3", "--final-max-new-tokens", "2"]


def test_analyze_chain_with_nothing_corrected_says_so_instead_of_drawing(tiny_model_dir, tmp_path, capsys):
    """One sample: the pools are empty, no segment is corrected by either variant."""
    out = tmp_path / "chain"
    capsys.readouterr()
    assert run_cli(["analyze", "chain", "--model", tiny_model_dir, "--limit", "1", *COMMON, "-o", str(out)]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "nothing to compare: mmlu: no method corrected a single segment" in err
    assert not (out / "figures" / "chain_mmlu.png").exists()


def test_ablate_marks_points_where_the_knob_could_not_act(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "abl"
    cmd = ["ablate", "rank", "--values", "2,8", "--model", tiny_model_dir, "--limit", "1", *COMMON, "-o", str(out)]
    capsys.readouterr()
    assert run_cli(cmd) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "not exercised (no segment corrected" in err
    import pandas as pd

    t = pd.read_csv(out / "ablate-rank.csv")
    assert list(t.loc[t["method"] != "nonshared", "exercised"]) == [False, False]
    assert "not exercised" in (out / "ablate-rank.md").read_text()
    assert not (out / "figures" / "mmlu_rank.png").exists()


@pytest.mark.parametrize("command", ["run", "suite", "ablate", "serve-sweep", "report", "compare", "analyze rank"])
def test_help_is_readable_at_80_columns(command, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    capsys.readouterr()
    assert run_cli([*command.split(), "--help"]) == 0
    text = capsys.readouterr().out
    assert text.strip() and "Options:" in text
    too_long = [ln for ln in text.splitlines() if len(ln) > 80]
    assert not too_long and "…" not in text and "``" not in text and "[bold" not in text, too_long


def test_engines_and_table1_fit_80_columns(tmp_path, monkeypatch):
    import io

    from rich.console import Console

    import kvcmas_bench.cli as cli
    from kvcmas_bench.jobs.report import build_report, console_table1

    from .synthetic import make_matrix

    con = Console(width=80, file=io.StringIO(), record=True)
    monkeypatch.setattr(cli, "out", con)
    cli.list_engines()
    engines = con.export_text()
    assert "``" not in engines and "…" not in engines
    assert "harness as its HTTP client." in " ".join(engines.replace("│", " ").split())  # not cut mid-sentence
    m = make_matrix(tmp_path / "m")
    res = build_report([p for k, p in m.items() if k != "sweep"], tmp_path / "rep", ["md"], plots=False)
    con = Console(width=80, file=io.StringIO(), record=True)
    console_table1(res, con)
    table = con.export_text()
    assert "0.667±.192" in table and "0.833±.152" in table
    assert all(len(ln) <= 80 for ln in table.splitlines())
    assert not [ln for ln in table.splitlines() if ln.strip().startswith("±")]  # never wrapped onto its own line
