"""The house rules: no import circle, knobs as data (a method added from a test file runs through
``run`` and ``serve-sweep``), methods and workloads known by their classes only (one added here
shows up in Table 1 and the figures), engines as plugins (a fake engine serves a sweep), and the
60-line rule of CONTRIBUTING.md (ruff's size rules: tests/test_lint.py)."""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass
from pathlib import Path

import pytest

import kvcmas_bench
from kvcmas_bench.errors import BenchError
from kvcmas_bench.methods import Method, get_method, register
from kvcmas_bench.methods.base import METHODS, check
from kvcmas_bench.report.plots import COLORS, display, pareto_axes
from kvcmas_bench.report.tables import METHOD_ORDER, table1
from kvcmas_bench.results.frames import load_dirs
from kvcmas_bench.results.request import RequestRecord
from kvcmas_bench.serving.engines import ENGINES, ServeResult, get_engine, register_engine
from kvcmas_bench.serving.plots import LABELS
from kvcmas_bench.serving.queueing import simulate
from kvcmas_bench.workloads import get_workload
from kvcmas_bench.workloads.base import WORKLOADS, Workload
from kvcmas_bench.workloads.base import register as register_workload

from .conftest import run_cli
from .synthetic import make_run

PKG = Path(kvcmas_bench.__file__).parent


# ---- size rules --------------------------------------------------------------------------------
MAX_LINES = 60


def long_functions(source: str, limit: int = MAX_LINES) -> list[tuple[str, int, int]]:
    """``(name, first line, lines)`` of every function (methods and typer commands included, their
    decorators not) longer than ``limit`` lines."""
    return [
        (n.name, n.lineno, n.end_lineno - n.lineno + 1)
        for n in ast.walk(ast.parse(source))
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.end_lineno - n.lineno + 1 > limit
    ]


def test_the_line_counter_finds_a_61_line_function_and_passes_a_60_line_one():
    body = "    x = 0\n" * 58
    sixty = "def f():\n" + body + "    return x\n"
    assert long_functions(sixty) == []
    nested = "class C:\n" + "".join("    " + line + "\n" for line in (sixty + "    x += 1\n").splitlines())
    assert long_functions(nested) == [("f", 2, 61)]


def test_no_function_over_60_lines_in_the_package_or_the_benchmarks():
    root = PKG.parent
    found = [
        f"{p.relative_to(root)}:{line} {name} ({n} lines)"
        for d in (PKG, root / "benchmarks")
        for p in sorted(d.rglob("*.py"))
        for name, line, n in long_functions(p.read_text())
    ]
    assert not found, "over 60 lines (CONTRIBUTING.md, 'Keep functions small'): " + "; ".join(found)


# ---- import graph ------------------------------------------------------------------------------
def _modules() -> dict[str, tuple[Path, bool]]:
    mods = {}
    for p in PKG.rglob("*.py"):
        parts = list(p.relative_to(PKG.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        mods[".".join(parts[:-1] if is_pkg else parts)] = (p, is_pkg)
    return mods


def _targets(mod: str, is_pkg: bool, node: ast.AST, mods) -> list[str]:
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = mod.split(".") if is_pkg else mod.split(".")[:-1]
        prefix = (
            ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
            if node.level
            else node.module
        )
        names = [prefix] + [f"{prefix}.{a.name}" for a in node.names]
    return [n for n in names if n in mods]


def import_graph() -> dict[str, set[str]]:
    """Module -> package modules it imports anywhere (lazy imports and TYPE_CHECKING included),
    plus the packages whose ``__init__`` such an import runs (not the importer's own parents)."""
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for mod, (path, is_pkg) in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for t in _targets(mod, is_pkg, node, mods):
                    parts = t.split(".")
                    deps |= {
                        a
                        for a in (".".join(parts[:i]) for i in range(2, len(parts) + 1))
                        if a in mods and a != mod and not (mod + ".").startswith(a + ".")
                    }
        graph[mod] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_cycle_detector_finds_a_planted_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_among_the_package_modules():
    graph = import_graph()
    assert "kvcmas_bench.engine" in graph and "kvcmas_bench.jobs.run" in graph
    assert cycles(graph) == []


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module ``start`` imports, directly or not."""
    seen, todo = set(), [start]
    while todo:
        mod = todo.pop()
        if mod not in seen:
            seen.add(mod)
            todo.extend(graph[mod])
    return seen - {start}


def test_the_in_process_path_imports_no_vllm_code_and_the_data_types_no_engine():
    """The in-process engine, the workflow and the methods run without the vLLM package's code (its
    hooks, e.g. tensor-parallel head reduction, live under serving/vllm); segments, requests and
    caches (``kvcmas_bench.segments``) load without the engine and the model code."""
    graph = import_graph()
    for start in ("kvcmas_bench.engine", "kvcmas_bench.workflow", "kvcmas_bench.methods", "kvcmas_bench.calibration"):
        assert not {m for m in reachable(graph, start) if m.startswith("kvcmas_bench.serving.vllm")}, start
    assert not reachable(graph, "kvcmas_bench.segments") & {"kvcmas_bench.engine", "kvcmas_bench.modeling"}


# ---- a method added from this file only ---------------------------------------------------------
@dataclass
class ScaledReuse(Method):
    """Test-only method: reuse the aligned source, scaling its values by ``scale``."""

    name = "scaled"
    summary = "test method: scaled reuse"
    scale: float = 1.0

    def validate(self) -> None:
        check(0.0 < self.scale <= 2.0, "scale", f"must lie in (0, 2], got {self.scale}")

    def materialize(self, ctx):
        if ctx.source is None:
            return ctx.dense()
        kv = ctx.aligned_source()
        kv.v = kv.v * self.scale
        kv.status = "reused"
        kv.hidden = {}
        return kv


@pytest.fixture
def public_test_method():
    """Registered for the duration of a test only (other modules parametrize over METHODS)."""
    register(ScaledReuse)
    yield ScaledReuse.name
    METHODS.pop(ScaledReuse.name, None)


def test_toy_method_runs_through_run_with_a_method_arg(tiny_model_dir, tmp_path, public_test_method):
    out = tmp_path / "run"
    args = [
        "run",
        "--method",
        public_test_method,
        "--method-arg",
        "scale=0.5",
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
    assert run_cli(args) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["method_config"] == {"name": "scaled", "scale": 0.5}
    reqs = [RequestRecord.from_dict(json.loads(x)) for x in (out / "requests.jsonl").read_text().splitlines()]
    assert [s.status for s in reqs[1].shared_segments][0] == "reused"
    # the method's own validation and unknown keys: one line, exit 2, before any model loads
    for bad in ("scale=7", "nope=1", "scale=abc", "scale"):
        assert run_cli([*args[:3], "--method-arg", bad, *args[5:]]) == 2, bad


def test_toy_method_runs_through_serve_sweep(tiny_model_dir, tmp_path, public_test_method):
    out = tmp_path / "sweep"
    assert (
        run_cli(
            [
                "serve-sweep",
                "--methods",
                f"nonshared,{public_test_method}",
                "--method-arg",
                "scale=0.5",
                "--qps",
                "0,1",
                "--shared-tokens",
                "24",
                "--trajectories",
                "1",
                "--output-tokens",
                "2",
                "--model",
                tiny_model_dir,
                "--device",
                "cpu",
                "-o",
                str(out),
            ]
        )
        == 0
    )
    summary = json.loads((out / "summary.json").read_text())
    assert {r["method"] for r in summary["rows"]} == {"nonshared", "scaled"}
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["method_configs"]["scaled"]["scale"] == 0.5
    # a key no selected method has is an error, never dropped
    assert (
        run_cli(
            [
                "serve-sweep",
                "--methods",
                "nonshared",
                "--method-arg",
                "scale=0.5",
                "--qps",
                "0",
                "--shared-tokens",
                "24",
                "--trajectories",
                "1",
                "--model",
                tiny_model_dir,
                "-o",
                str(tmp_path / "x"),
            ]
        )
        == 2
    )


# ---- a method and a workload named only here: Table 1 and the figures know them -----------------
@dataclass
class ToyDense(Method):
    """Test-only method: dense prefill, placed between NonShared and FullShared, no colour of its own."""

    name = "toy"
    summary = "test method: dense prefill"
    label, order = "Toy (test)", 15


class ToyWorkload(Workload):
    """Test-only workload whose answers are compared on the final output."""

    name = "toy-wl"
    summary = "test workload"
    answer_field = "final_output"


@pytest.fixture
def toy_method_and_workload():
    register(ToyDense)
    register_workload(ToyWorkload)
    yield
    METHODS.pop(ToyDense.name, None)
    WORKLOADS.pop(ToyWorkload.name, None)


def _set_final_outputs(run_dir: Path, outputs: dict[str, str]) -> None:
    path = run_dir / "samples.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    for r in rows:
        r["final_output"] = outputs.get(r["sample_id"], r["final_output"])
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_method_and_workload_defined_here_reach_table1_and_the_figures(tmp_path, toy_method_and_workload):
    preds = ["A", "B", "C", "D", "A", "B"]  # all correct (synthetic.GOLD)
    ns = make_run(tmp_path / "ns", "nonshared", preds, workload="toy-wl", latency=2.0)
    fs = make_run(tmp_path / "fs", "fullshared", preds[:5] + ["C"], workload="toy-wl", latency=1.0)
    toy = make_run(tmp_path / "toy", "toy", preds, workload="toy-wl", latency=1.5)
    # NonShared's predictions, but two final outputs differ: toy-wl compares final outputs
    _set_final_outputs(toy, {"mmlu-0": "Answer: A, surely", "mmlu-3": "D?"})
    t = table1(load_dirs([fs, toy, ns]))
    assert list(t["method"]) == ["nonshared", "toy", "fullshared"]  # by ``order``: 10, 15, 20
    assert list(METHOD_ORDER)[:3] == ["nonshared", "toy", "fullshared"]
    row = t.set_index("method").loc["toy"]
    assert row["accuracy"] == 1.0 and row["answer_agreement"] == pytest.approx(4 / 6)  # predictions: 6/6

    assert LABELS["toy"] == "Toy (test)" and display("toy rho=0.5") == "Toy (test) rho=0.5"
    # the methods' colours of every figure so far (C<i> in the order they were listed), and the next
    # free one for the newcomer
    before = ["nonshared", "fullshared", "kvcmas", "kvcmas-nonchained", "kvcomm", "graphflow", "cacheblend"]
    before += ["droidspeak", "relaycaching"]
    colors = dict(COLORS)
    assert {m: colors[m] for m in before} == {m: f"C{i}" for i, m in enumerate(before)}
    assert colors["toy"] == "C9"
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgba

    fig, ax = pareto_axes(t, "latency_mean_s", "accuracy", "t")
    drawn = {a.get_gid(): a for a in ax.get_children() if a.get_gid()}
    assert tuple(drawn["point:toy"].get_edgecolor()[0]) == pytest.approx(to_rgba("C9"))
    assert drawn["label:toy"].get_text() == "Toy (test)"
    plt.close(fig)


def test_one_message_for_an_unknown_name_in_every_registry():
    for get, kind in ((get_method, "method"), (get_workload, "workload"), (get_engine, "engine")):
        with pytest.raises(BenchError, match=rf"^unknown {kind} 'nope'; use one of "):
            get("nope")
    with pytest.raises(BenchError, match="use one of .*kvcmas, kvcmas-nonchained, kvcomm"):
        get_method("_hidden")


# ---- an engine added from this file only --------------------------------------------------------
class FakeTokenizer:
    chat_template = None
    name_or_path = "fake-chars"

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [3 + ord(c) % 90 for c in text]}


class FakeEngine:
    """Serves every request in 10 ms of prefill and 1 ms per output token, one at a time."""

    name = "fake"
    server = "fake server: fixed service times, FCFS"
    replays_service = False
    model_name = "fake-model"
    model_source = None
    tokenizer = FakeTokenizer()
    max_positions = 10_000
    vocab_size = 100
    served: list = []

    def describe(self) -> dict:
        return {"name": self.name, "device": "cpu"}

    def prepare(self, spec, calibration):
        return spec()

    def serve(self, method, traces, schedules) -> ServeResult:
        FakeEngine.served.append(method.name)
        service = [[(0.01, 0.01 + 0.001 * a.max_new_tokens) for a in tr.agents] for tr in traces]
        out = {}
        for q, arrivals in schedules.items():
            out[q] = [
                RequestRecord(
                    traces[s.trajectory].agents[s.agent_index].name,
                    s.ttft_s,
                    s.e2e_s,
                    trajectory=traces[s.trajectory].id,
                    step=s.agent_index,
                    qps=q,
                    arrival_s=s.arrival_s,
                    first_token_s=s.first_token_s,
                    completion_s=s.completion_s,
                    output_tokens=traces[s.trajectory].output_tokens,
                    layers=1,
                )
                for s in simulate(service, arrivals)
            ]
        return ServeResult(out)


@pytest.fixture
def fake_engine():
    @register_engine("fake")
    def make(**options):
        return FakeEngine()

    yield "fake"
    ENGINES.pop("fake", None)


def test_fake_engine_runs_through_serve_sweep(tmp_path, fake_engine, monkeypatch):
    from kvcmas_bench.serving import traces

    monkeypatch.setattr(traces, "mmlu_texts", lambda: [f"question {i} with options" for i in range(50)])
    FakeEngine.served = []
    out = tmp_path / "fake"
    assert (
        run_cli(
            [
                "serve-sweep",
                "--engine",
                fake_engine,
                "--methods",
                "nonshared,fullshared",
                "--qps",
                "0,4",
                "--shared-tokens",
                "32",
                "--trajectories",
                "2",
                "--output-tokens",
                "5",
                "-o",
                str(out),
            ]
        )
        == 0
    )
    assert FakeEngine.served == ["nonshared", "fullshared"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["engine"] == "fake" and len(summary["rows"]) == 4
    single = next(r for r in summary["rows"] if r["method"] == "nonshared" and r["qps"] == 0.0)
    assert single["ttft_p50_s"] == pytest.approx(0.01)  # single stream: nothing queues
    reqs = [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines()]
    assert len(reqs) == 2 * 2 * 2 * 4 and {r["qps"] for r in reqs} == {0.0, 4.0}
    assert run_cli(["serve-sweep", "--engine", "nope", "-o", str(tmp_path / "y")]) == 2
