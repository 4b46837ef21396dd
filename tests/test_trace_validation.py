"""Damaged serving traces (issue 48): ``serve-sweep --traces`` checks every field of every line when
the file is read, before the model loads, and refuses a damaged one with exit 2 and one line naming
the file, the line, the trajectory and the field. Token ids past the vocabulary are refused once the
model is known, before any request runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvcmas_bench.errors import BenchError
from kvcmas_bench.serving.traces import FORMAT, load_traces

from .conftest import VOCAB, run_cli, tiny_model


def good_trace(tid: str = "t0") -> dict:
    """A hand-written controlled trajectory: two agents over an 8-token shared context, 2 output tokens each."""
    return {
        "format": FORMAT,
        "id": tid,
        "shared_tokens": 8,
        "context_tokens": 8,
        "output_tokens": 2,
        "accumulated": False,
        "context_ids": list(range(10, 18)),
        "agents": [
            {
                "name": "Reader",
                "segments": [
                    {"kind": "PF", "name": "sys", "ids": [3, 4, 5]},
                    {"kind": "PH", "slot": "ctx"},
                    {"kind": "PF", "name": "tail", "ids": [6, 7]},
                ],
                "max_new_tokens": 2,
            },
            {
                "name": "Critic",
                "segments": [
                    {"kind": "PF", "name": "sys", "ids": [8, 9]},
                    {"kind": "PH", "slot": "ctx"},
                    {"kind": "PF", "name": "glue0", "ids": [20]},
                    {"kind": "PH", "slot": "out:Reader"},
                    {"kind": "PF", "name": "tail", "ids": [21, 22]},
                ],
                "max_new_tokens": 2,
            },
        ],
        "split": "eval",
        "meta": {"by": "hand"},
    }


def _set(path: str, value):
    """A damage: set the field at ``path`` (``a.b[1].c``-style, as the error names it)."""

    def damage(d: dict) -> None:
        *parents, last = _steps(path)
        for step in parents:
            d = d[step]
        d[last] = value

    return damage


def _drop(path: str):
    def damage(d: dict) -> None:
        *parents, last = _steps(path)
        for step in parents:
            d = d[step]
        del d[last]

    return damage


def _steps(path: str) -> list:
    out: list = []
    for part in path.split("."):
        name, *idx = part.replace("]", "").split("[")
        out += [name] + [int(i) for i in idx]
    return out


#: case -> (damage, what the one error line must name)
DAMAGED = {
    "negative max_new_tokens": (
        _set("agents[1].max_new_tokens", -5),
        "agents[1].max_new_tokens must be an integer >= 1",
    ),
    "zero max_new_tokens": (_set("agents[0].max_new_tokens", 0), "agents[0].max_new_tokens must be an integer >= 1"),
    "string max_new_tokens": (_set("agents[0].max_new_tokens", "2"), "agents[0].max_new_tokens"),
    "max_new_tokens off output_tokens": (_set("agents[1].max_new_tokens", 3), "agents[1].max_new_tokens is 3"),
    "negative token id": (_set("context_ids[3]", -7), "context_ids[3] must be a non-negative integer token id"),
    "string token id": (
        _set("agents[0].segments[0].ids[1]", "abc"),
        'agents[0].segments[0].ids[1] must be a non-negative integer token id, got "abc"',
    ),
    "float token id": (
        _set("agents[1].segments[2].ids[0]", 1.5),
        "agents[1].segments[2].ids[0] must be a non-negative integer token id, got 1.5",
    ),
    "bool token id": (
        _set("agents[1].segments[4].ids[1]", True),
        "agents[1].segments[4].ids[1] must be a non-negative integer token id, got true",
    ),
    "null token id": (_set("context_ids[0]", None), "context_ids[0] must be a non-negative integer token id, got null"),
    "ids not a list": (_set("agents[0].segments[2].ids", 7), "agents[0].segments[2].ids must be a list of token ids"),
    "segment without ids": (_drop("agents[0].segments[2].ids"), "agents[0].segments[2]: missing field 'ids'"),
    "PH segment with ids": (
        _set("agents[0].segments[1].ids", [1, 2]),
        "agents[0].segments[1].ids: a PH segment holds no ids",
    ),
    "unknown segment kind": (
        _set("agents[1].segments[1].kind", "XX"),
        'agents[1].segments[1].kind must be PF or PH, got "XX"',
    ),
    "segment without kind": (
        _drop("agents[1].segments[0].kind"),
        "agents[1].segments[0].kind must be PF or PH, got null",
    ),
    "unknown slot": (_set("agents[1].segments[3].slot", "out:Nobody"), "agents[1].segments[3].slot must be"),
    "slot of a later agent": (_set("agents[0].segments[1].slot", "out:Critic"), "agents[0].segments[1].slot must be"),
    "no agents": (_set("agents", []), "agents must be a non-empty list of agents"),
    "agents not a list": (_set("agents", {"Reader": {}}), "agents must be a non-empty list of agents"),
    "agent without segments": (_set("agents[0].segments", []), "agents[0].segments must be a non-empty list"),
    "repeated agent name": (_set("agents[1].name", "Reader"), 'agents[1].name "Reader" repeats agents[0]'),
    "agent unknown field": (_set("agents[0].temperature", 0.5), 'agents[0]: unknown field "temperature"'),
    "empty context": (_set("context_ids", []), "context_ids is empty"),
    "context shorter than context_tokens": (
        _set("context_ids", [10, 11]),
        "context_ids holds 2 token ids, context_tokens says 8",
    ),
    "zero context_tokens": (_set("context_tokens", 0), "context_tokens must be an integer >= 1, got 0"),
    "negative shared_tokens": (_set("shared_tokens", -8), "shared_tokens must be an integer >= 1, got -8"),
    "zero output_tokens": (_set("output_tokens", 0), "output_tokens must be an integer >= 1, got 0"),
    "shared_tokens off the context": (
        _set("shared_tokens", 9),
        "shared_tokens is 9 but a controlled trace shares its 8",
    ),
    "accumulated not a bool": (_set("accumulated", "no"), 'accumulated must be true or false, got "no"'),
    "unknown split": (_set("split", "test"), 'split must be one of eval, calibration, warmup, got "test"'),
    "meta not an object": (_set("meta", [1]), "meta must be an object"),
    "missing field": (_drop("output_tokens"), "missing field 'output_tokens'"),
    "unknown field": (_set("extra", 1), 'unknown field "extra"'),
    "bad schedule": (_set("schedule", [{"ctx": "maybe"}, {}]), "schedule[0] must map the slots"),
}


@pytest.fixture
def no_model(monkeypatch):
    """Fail the test if the sweep loads a model or starts an engine: validation must come first."""
    import kvcmas_bench.jobs.sweep as sweep
    import kvcmas_bench.modeling as modeling

    def boom(*a, **kw):
        raise AssertionError("the model was loaded before the trace file was checked")

    monkeypatch.setattr(modeling, "load_model", boom)
    monkeypatch.setattr(sweep, "get_engine", boom)


def write_lines(path: Path, *objs) -> Path:
    path.write_text("".join(json.dumps(o) + "\n" for o in objs))
    return path


def sweep_argv(traces: Path, out: Path, model: str) -> list[str]:
    return [
        "serve-sweep",
        "--traces",
        str(traces),
        "--method",
        "nonshared",
        "--qps",
        "0",
        "--shared-tokens",
        "8",
        "--trajectories",
        "1",
        "--model",
        model,
        "--device",
        "cpu",
        "-o",
        str(out),
    ]


def error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("kvcmas-bench: error: "), lines[0]
    return lines[0].removeprefix("kvcmas-bench: error: ")


@pytest.mark.parametrize("case", list(DAMAGED))
def test_a_damaged_trace_is_one_line_before_the_model_loads(case, tmp_path, no_model, capsys):
    damage, needle = DAMAGED[case]
    bad = good_trace("t1")
    damage(bad)
    traces = write_lines(tmp_path / "traces.jsonl", good_trace("t0"), bad)  # the damage on line 2
    out = tmp_path / "sweep"
    capsys.readouterr()
    assert run_cli(sweep_argv(traces, out, str(tmp_path / "no-such-model"))) == 2
    msg = error_line(capsys)
    assert msg.startswith(f'{traces}: line 2 (trajectory "t1") is not a valid serving trace: '), msg
    assert needle in msg, msg
    assert not out.exists()  # refused before the output directory is touched
    with pytest.raises(BenchError) as exc:  # the reader itself, as the job calls it
        load_traces(traces)
    assert str(exc.value) == msg


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        (json.dumps({**good_trace(), "id": 7}).encode() + b"\n", "id must be a non-empty string, got 7"),
        (b'{"format": "kvcmas-serve-trace/1", "id": "t1"}\n', "missing field 'shared_tokens'"),
        (b'{"format": "other/1", "id": "t1"}\n', 'format "other/1", expected'),
        (b"[1, 2]\n", "a JSON list, not an object"),
        (b'{"id": "t1", "format": "kvcmas-serve-trace/1", \n', "Expecting"),
    ],
)
def test_unreadable_lines_name_the_line(line, needle, tmp_path, no_model, capsys):
    traces = tmp_path / "traces.jsonl"
    traces.write_bytes(json.dumps(good_trace()).encode() + b"\n" + line)
    assert run_cli(sweep_argv(traces, tmp_path / "sweep", "unused")) == 2
    msg = error_line(capsys)
    assert msg.startswith(f"{traces}: line 2") and "is not a valid serving trace: " in msg and needle in msg, msg


def test_a_repeated_trajectory_id_is_refused(tmp_path, no_model, capsys):
    traces = write_lines(tmp_path / "traces.jsonl", good_trace("t0"), good_trace("t1"), good_trace("t0"))
    assert run_cli(sweep_argv(traces, tmp_path / "sweep", "unused")) == 2
    assert error_line(capsys) == (
        f'{traces}: line 3 (trajectory "t0") is not a valid serving trace: id repeats the trajectory of line 1'
    )


def test_a_trace_that_does_not_suit_the_options_fails_before_the_model_loads(tmp_path, no_model, capsys):
    traces = write_lines(tmp_path / "traces.jsonl", good_trace("t0"))
    argv = sweep_argv(traces, tmp_path / "sweep", "unused")
    argv[argv.index("--shared-tokens") + 1] = "16"
    assert run_cli(argv) == 2
    assert error_line(capsys) == f"{traces} has no trajectories with shared_tokens 16 (has [8])"
    argv[argv.index("--shared-tokens") + 1] = "8"
    argv[argv.index("--trajectories") + 1] = "2"
    assert run_cli(argv) == 2
    assert error_line(capsys) == f"{traces} has 1 trajectories at shared_tokens 8, 2 asked"


def test_a_good_hand_written_trace_validates(tmp_path):
    d = good_trace()
    (tr,) = load_traces(write_lines(tmp_path / "one.jsonl", d))
    assert tr.to_dict() == d
    assert [a.name for a in tr.agents] == ["Reader", "Critic"]
    assert tr.max_positions() == 2 + 8 + 1 + 2 + 2 + 2  # Critic: PF + ctx + glue + Reader's output + tail + output
    req = tr.request(1, {"Reader": [30, 31]})
    assert [s.ids for s in req.segments] == [[8, 9], list(range(10, 18)), [20], [30, 31], [21, 22]]
    # the variants the format allows: an empty PF segment, an accumulated trace, held-out splits, a schedule
    acc = good_trace("acc")
    acc.update(accumulated=True, shared_tokens=2, split="calibration")
    acc["agents"][0]["segments"].append({"kind": "PF", "name": "empty", "ids": []})
    sched = good_trace("sched")
    sched["schedule"] = [{"ctx": "dense"}, {"ctx": "reuse", "out:Reader": "dense"}]
    assert [t.id for t in load_traces(write_lines(tmp_path / "three.jsonl", d, acc, sched))] == ["t0", "acc", "sched"]


# ---- with a model: the vocabulary bound, then a good trace served end to end ------------------------
class FakeTokenizer:
    chat_template = None
    name_or_path = "fake-chars"

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [3 + ord(c) % (VOCAB - 3) for c in text]}


@pytest.fixture
def tiny_loader(monkeypatch):
    """``--model`` loads a tiny random Llama (vocabulary VOCAB) whatever it names; its path recorded."""
    import torch

    import kvcmas_bench.modeling as modeling
    from kvcmas_bench.modeling import LoadedModel

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    loaded: list[str] = []

    def load(spec, *a, **kw):
        loaded.append(spec)
        return LoadedModel(model=tiny_model("llama", layers=2), tokenizer=FakeTokenizer(), name="tiny", source="tests")

    monkeypatch.setattr(modeling, "load_model", load)
    yield loaded
    torch.set_num_threads(before)


def test_a_token_id_past_the_vocabulary_is_refused_before_any_request_runs(tmp_path, tiny_loader, monkeypatch, capsys):
    from kvcmas_bench.engine import Engine

    def no_request(*a, **kw):
        raise AssertionError("a request ran before the token ids were checked against the vocabulary")

    monkeypatch.setattr(Engine, "run", no_request)
    bad = good_trace("t1")
    bad["agents"][1]["segments"][4]["ids"][1] = VOCAB + 4
    traces = write_lines(tmp_path / "traces.jsonl", good_trace("t0"), bad)
    argv = sweep_argv(traces, tmp_path / "sweep", "tiny")
    argv[argv.index("--trajectories") + 1] = "2"
    capsys.readouterr()
    assert run_cli(argv) == 2
    assert tiny_loader == ["tiny"]  # the model loaded (the bound needs its vocabulary), then nothing ran
    assert error_line(capsys) == (
        f'{traces}: trajectory "t1": agents[1].segments[4].ids[1] holds token id {VOCAB + 4} >= vocabulary '
        f"size {VOCAB} of the model (built with another tokenizer?)"
    )
    assert not (tmp_path / "sweep" / "requests.jsonl").exists()


def test_a_good_hand_written_trace_is_served(tmp_path, tiny_loader, capsys):
    traces = write_lines(tmp_path / "traces.jsonl", good_trace("t0"))
    out = tmp_path / "sweep"
    assert run_cli(sweep_argv(traces, out, "tiny")) == 0, capsys.readouterr().err
    reqs = [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines()]
    assert len(reqs) == 2  # one trajectory, two agents
    assert load_traces(out / "traces.jsonl")[0].to_dict() == good_trace("t0")
