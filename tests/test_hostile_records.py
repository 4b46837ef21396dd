"""Verdicts that cannot be bent (issue 48): damaged copies of one real finished run, each read by
``report``, ``compare`` (both directions) and ``run``'s resume. Every damage is either refused by
all three (exit 2, one line naming the file, no traceback, the directory byte-identical) or, when
it is harmless, gives identical numbers everywhere. A real serve-sweep whose summary rows were
edited is read from its served requests."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from kvcmas_bench.errors import BenchError
from kvcmas_bench.results.frames import load_dirs

from .conftest import one_line, run_cli
from .test_integrity import tiny_run

LIMIT = "4"


def tree(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def lines(p: Path) -> list[bytes]:
    return p.read_bytes().splitlines(keepends=True)


def edit_line(p: Path, n: int, change) -> None:
    """Line ``n`` (1-based) of the JSONL file ``p`` as ``change(obj)`` returns it."""
    rows = lines(p)
    rows[n - 1] = json.dumps(change(json.loads(rows[n - 1]))).encode() + b"\n"
    p.write_bytes(b"".join(rows))


def wrong_letter(s: dict) -> dict:
    """The prediction changed to a letter that is not the gold answer, ``correct`` left as it was."""
    wrong = next(x for x in "ABCD" if x != s["gold"])
    return {**s, "prediction": wrong, "correct": True}


def gold_and_prediction_forged(s: dict) -> dict:
    """A wrong letter written as both the prediction and the gold answer: it re-scores as correct,
    so only the workload's own data tells the forgery."""
    wrong = next(x for x in "ABCD" if x != s["gold"])
    return {**s, "prediction": wrong, "gold": wrong, "correct": True}


def foreign_sample(d: Path) -> None:
    """A fifth finished sample (with its 4 request lines) that the run never selected."""
    s = json.loads(lines(d / "samples.jsonl")[0])
    sid = s["sample_id"]
    reqs = [json.loads(x) for x in lines(d / "requests.jsonl") if json.loads(x)["sample_id"] == sid]
    with open(d / "requests.jsonl", "a", encoding="utf-8") as f:
        f.writelines(json.dumps({**r, "sample_id": "mmlu-99999"}) + "\n" for r in reqs)
    with open(d / "samples.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps({**s, "sample_id": "mmlu-99999"}) + "\n")


def drop_key(key: str):
    return lambda r: {k: v for k, v in r.items() if k != key}


def torn_middle(d: Path) -> None:
    rows = lines(d / "samples.jsonl")
    rows[1] = rows[1][:20] + b"\n"
    (d / "samples.jsonl").write_bytes(b"".join(rows))


#: (id, damage, needle of the one error line); samples.jsonl: 4 lines, requests.jsonl: 4 per sample
REFUSED = [
    ("correct-flipped", lambda d: edit_line(d / "samples.jsonl", 2, lambda s: {**s, "correct": not s["correct"]}),
     "samples.jsonl"),
    ("prediction-wrong-correct-true", lambda d: edit_line(d / "samples.jsonl", 1, wrong_letter),
     "samples.jsonl"),
    ("gold-and-prediction-forged", lambda d: edit_line(d / "samples.jsonl", 2, gold_and_prediction_forged),
     "the mmlu data says"),
    ("request-without-step", lambda d: edit_line(d / "requests.jsonl", 3, drop_key("step")), "requests.jsonl"),
    ("request-duplicated", lambda d: (d / "requests.jsonl").write_bytes(
        b"".join(lines(d / "requests.jsonl")[:3] + lines(d / "requests.jsonl")[2:])), "requests.jsonl"),
    ("negative-ttft", lambda d: edit_line(d / "requests.jsonl", 5, lambda r: {**r, "ttft_s": -100.0}),
     "requests.jsonl"),
    ("string-ttft", lambda d: edit_line(d / "requests.jsonl", 6, lambda r: {**r, "ttft_s": "0.5"}),
     "requests.jsonl"),
    ("string-latency", lambda d: edit_line(d / "samples.jsonl", 3, lambda s: {**s, "latency_s": "1.5"}),
     "samples.jsonl"),
    ("first-token-not-an-id", lambda d: edit_line(d / "requests.jsonl", 2, lambda r: {**r, "first_token_id": "x"}),
     "requests.jsonl"),
    ("missing-config", lambda d: (d / "config.json").unlink(), "config.json"),
    ("foreign-sample", foreign_sample, "samples.jsonl"),
    ("corrupt-middle-line", torn_middle, "samples.jsonl"),
]  # fmt: skip


def shuffle(p: Path) -> None:
    rows = lines(p)
    random.Random(0).shuffle(rows)
    p.write_bytes(b"".join(rows))


def crlf(p: Path) -> None:
    p.write_bytes(b"".join(x.replace(b"\n", b"\r\n") for x in lines(p)))


def edit_summary(d: Path) -> None:
    s = json.loads((d / "summary.json").read_text())
    s["accuracy"], s["ttft_mean_s"] = 1.0, s["ttft_mean_s"] / 100
    (d / "summary.json").write_text(json.dumps(s))


HARMLESS = [
    ("shuffled-samples", lambda d: shuffle(d / "samples.jsonl")),
    ("crlf", lambda d: (crlf(d / "samples.jsonl"), crlf(d / "requests.jsonl"))),
    ("unknown-extra-field", lambda d: edit_line(d / "samples.jsonl", 2, lambda s: {**s, "note": "hand-added"})),
    ("edited-summary", edit_summary),
]


@pytest.fixture(scope="module")
def finished(tiny_model_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hostile") / "run"
    assert run_cli(tiny_run(tiny_model_dir, out, "--limit", LIMIT)) == 0
    assert len(lines(out / "samples.jsonl")) == 4 and len(lines(out / "requests.jsonl")) == 16
    return out


def numbers(d: Path) -> dict:
    """Every figure the readers derive for the run directory ``d``."""
    (run,) = load_dirs([d]).runs
    return run.figures()


@pytest.mark.parametrize("name,damage,needle", REFUSED, ids=[c[0] for c in REFUSED])
def test_damage_is_refused_alike_by_report_compare_and_resume(
    finished, tmp_path, tiny_model_dir, no_model, capsys, name, damage, needle
):
    bad = tmp_path / "bad"
    shutil.copytree(finished, bad)
    damage(bad)
    before = tree(bad)
    capsys.readouterr()
    assert run_cli(["report", str(bad), "--no-plots", "-o", str(tmp_path / "rep")]) == 2
    one_line(capsys, needle)
    assert run_cli(["compare", str(finished), str(bad)]) == 2
    one_line(capsys, needle)
    assert run_cli(["compare", str(bad), str(finished)]) == 2
    one_line(capsys, needle)
    assert run_cli(tiny_run(tiny_model_dir, bad, "--limit", LIMIT)) == 2  # before the model loads
    one_line(capsys, needle)
    assert tree(bad) == before and not (tmp_path / "rep").exists()


@pytest.mark.parametrize("name,damage", HARMLESS, ids=[c[0] for c in HARMLESS])
def test_harmless_damage_gives_identical_numbers(finished, tmp_path, tiny_model_dir, capsys, name, damage):
    ok = tmp_path / "ok"
    shutil.copytree(finished, ok)
    damage(ok)
    records = {f: (ok / f).read_bytes() for f in ("samples.jsonl", "requests.jsonl")}
    assert numbers(ok) == numbers(finished)
    capsys.readouterr()
    assert run_cli(["compare", str(finished), str(ok)]) == 0
    assert run_cli(["compare", str(ok), str(finished)]) == 0
    assert run_cli(tiny_run(tiny_model_dir, ok, "--limit", LIMIT)) == 0  # nothing left to run
    assert {f: (ok / f).read_bytes() for f in records} == records
    assert numbers(ok) == numbers(finished)


def test_edited_summary_is_reported_not_believed(finished, tmp_path, capsys):
    ok = tmp_path / "ok"
    shutil.copytree(finished, ok)
    edit_summary(ok)
    (run,) = load_dirs([ok]).runs
    true_acc = sum(json.loads(x)["correct"] for x in lines(ok / "samples.jsonl")) / 4
    assert run.figures()["accuracy"] == true_acc != 1.0
    assert any(d.startswith("accuracy: summary 1.0, records") for d in run.disagreements), run.disagreements
    assert any(d.startswith("ttft_mean_s: summary") for d in run.disagreements)
    runs = load_dirs([ok]).runs_frame()
    assert runs["accuracy"].iloc[0] == true_acc and "accuracy: summary 1.0" in runs["summary_disagrees"].iloc[0]
    assert run_cli(["report", str(ok), "--no-plots", "-o", str(tmp_path / "rep")]) == 0
    assert "summary.json disagrees with its records" in (tmp_path / "rep" / "report.md").read_text()


def test_resume_with_a_smaller_limit_refuses_before_changing_anything(finished, tmp_path, tiny_model_dir, capsys):
    """Four finished samples, resumed with --limit 3: the fourth is outside the run's set (its
    summary would say n=3 and the readers n=4), so resume refuses; a torn last line appended too
    stays where it is (nothing is rewritten before the refusal)."""
    d = tmp_path / "run"
    shutil.copytree(finished, d)
    with open(d / "samples.jsonl", "ab") as f:
        f.write(b'{"sample_id": "mmlu-')
    before = tree(d)
    capsys.readouterr()
    assert run_cli(tiny_run(tiny_model_dir, d, "--limit", "3")) == 2
    one_line(capsys, "outside this run's 3 samples")
    assert tree(d) == before


def test_unparsed_answers_agree_with_nothing(tmp_path):
    """Two runs that both failed to answer a sample do not agree on it: NonShared (4 samples, one
    unparsed) agrees with itself on 3 of 4; a method unparsed on the same sample and equal
    elsewhere agrees on 3 of 4 too, not 4 of 4."""
    from kvcmas_bench.report.tables import agreement

    from .synthetic import make_run

    preds = ["A", "B", None, "D"]
    make_run(tmp_path / "ns", "nonshared", preds)
    make_run(tmp_path / "kv", "kvcmas", preds)
    res = load_dirs([tmp_path / "ns", tmp_path / "kv"])
    ns, kv = res.runs
    assert agreement(kv, ns)["answer_agreement"] == 0.75
    assert agreement(ns, ns)["answer_agreement"] == 0.75


def test_peak_counters_are_reset_after_calibration(tiny_model_dir, tmp_path, monkeypatch):
    """A calibrated method's calibration traffic stays out of its peak: the run resets the peak
    counters after ``calibrate`` (spied here), not before."""
    import kvcmas_bench.jobs.run as run_job
    from kvcmas_bench.methods.relaycaching import RelayCaching

    order: list[str] = []
    real_reset, real_cal = run_job.reset_peaks, RelayCaching.calibrate
    monkeypatch.setattr(run_job, "reset_peaks", lambda *a: order.append("reset") or real_reset(*a))
    monkeypatch.setattr(RelayCaching, "calibrate", lambda self, *a: order.append("calibrate") or real_cal(self, *a))
    args = tiny_run(tiny_model_dir, tmp_path / "r", "--limit", "1", "--method", "relaycaching", "--calib-samples", "1")
    assert run_cli(args) == 0
    assert order == ["calibrate", "reset"]


def test_edited_sweep_rows_are_recomputed_from_the_served_requests(tmp_path, capsys):
    """A real serve-sweep whose summary TTFT rows were divided by 100: the readers recompute every
    row from requests.jsonl and name the rows the summary contradicts."""
    from kvcmas_bench.modeling import LoadedModel

    from .sweep_helper import serve_sweep
    from .test_serving import TEXTS, FakeTokenizer, quiet, tiny_model

    lm = LoadedModel(model=tiny_model("llama", layers=2), tokenizer=FakeTokenizer(), name="tiny", source="tests")
    out = tmp_path / "sweep"
    kw = dict(
        model=lm, output_tokens=2, device="cpu", texts=TEXTS, plots=False, console=quiet(), progress=lambda m: None
    )
    serve_sweep(["nonshared", "fullshared"], [0, 1.0], [16], 2, str(out), **kw)
    (sweep,) = load_dirs([out]).sweeps
    assert sweep.disagreements == []
    true_rows = sweep.rows
    summary = json.loads((out / "summary.json").read_text())
    for r in summary["rows"]:
        r["ttft_p50_s"] /= 100
    (out / "summary.json").write_text(json.dumps(summary))
    (edited,) = load_dirs([out]).sweeps
    assert edited.rows["ttft_p50_s"].tolist() == true_rows["ttft_p50_s"].tolist()
    assert len([d for d in edited.disagreements if "ttft_p50_s: summary" in d]) == len(summary["rows"]) == 4


def test_gold_is_taken_from_the_data_where_it_can_be_read_here(tmp_path):
    """Synthetic MMLU data of two questions: a record whose gold differs from the data's, or whose
    sample the data lacks, is refused; with the data not readable here (a path that is gone, a hub
    dataset) only the record's own consistency is checked."""
    from kvcmas_bench.results.records import dataset_gold, read_run_files

    data = tmp_path / "mmlu.jsonl"
    row = {"question": "q", "answer_a": "a", "answer_b": "b", "answer_c": "c", "answer_d": "d", "topic": "t"}
    data.write_text("".join(json.dumps({**row, "correct_answer": g}) + "\n" for g in "CA"))
    cfg = {"workload": "mmlu", "data_path": str(data), "subjects": None}
    assert dataset_gold(cfg) == {"mmlu-0": "C", "mmlu-1": "A"}
    assert dataset_gold({**cfg, "data_path": str(tmp_path / "gone.jsonl")}) is None
    assert dataset_gold({**cfg, "data_path": "hub:cais/mmlu"}) is None

    def read(sid: str, gold: str, data_path=str(data)) -> None:
        d = tmp_path / "run"
        d.mkdir(exist_ok=True)
        (d / "samples.jsonl").write_text(
            json.dumps({"sample_id": sid, "gold": gold, "prediction": gold, "correct": True}) + "\n"
        )
        (d / "requests.jsonl").write_text(
            json.dumps({"agent": "a", "ttft_s": 0.1, "e2e_s": 0.2, "sample_id": sid, "step": 0}) + "\n"
        )
        read_run_files(d / "samples.jsonl", d / "requests.jsonl", {**cfg, "data_path": data_path})

    read("mmlu-0", "C")
    with pytest.raises(BenchError, match=r"line 1 gives gold 'A' for sample 'mmlu-0', but the mmlu data says 'C'"):
        read("mmlu-0", "A")
    with pytest.raises(BenchError, match=r"line 1 is sample 'mmlu-2', which is not in the mmlu data"):
        read("mmlu-2", "A")
    read("mmlu-0", "A", data_path=str(tmp_path / "gone.jsonl"))  # not checkable here: consistent is enough
