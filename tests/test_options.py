"""One declaration per option: every option more than one command takes has one spelling, one help
text and (but for the documented cases below) one default, declared in ``kvcmas_bench/options.py``;
the method knobs are taken under one spelling by every command that runs methods, checked against
the methods' dataclass fields."""

from __future__ import annotations

import re
import typing
from collections import defaultdict

import pytest
import torch
import typer

from kvcmas_bench import options
from kvcmas_bench.cli import app, main
from kvcmas_bench.methods import METHODS, resolve_methods

#: commands that run methods: each takes every typed knob flag and --method-arg
METHOD_COMMANDS = ("run", "suite", "serve-sweep", "ablate", "analyze chain")

#: (primary flag) -> commands whose default differs from the others', and why it must
PER_COMMAND_DEFAULTS = {
    "--output-path": "every job writes its own directory (runs/latest, runs/suite, ...; ablate: runs/ablate-KIND)",
    "--limit": "run/suite evaluate every sample by default; ablations and analyses a small seeded subset",
    "--methods": "suite/serve-sweep: all; ablate: per KIND; analyze chain: the chained/non-chained pair",
    "--fidelity": "ablate records fidelity by default (its tables compare KV error against dense)",
    "--dtype": "serve deploys (auto: bfloat16 on CUDA, float32 on CPU); the measuring commands use float32 everywhere "
    "so numbers compare across engines",
}
#: (command, primary flag) -> why that command's option is another option under the same flag
OTHER_MEANING = {
    ("coverage", "--rho"): "coverage sweeps a comma-separated list of reuse ratios; it runs no method",
    ("analyze coverage", "--rho"): "coverage sweeps a comma-separated list of reuse ratios; it runs no method",
}
#: flags that name one option on one command and an alias of another elsewhere
ALIAS_FLAGS = {
    "--method": "run's single method; elsewhere the alias of --methods",
    "--workload": "run and coverage take one workload; elsewhere the alias of --workloads",
}


def _commands() -> dict:
    """Command path ('analyze chain') -> its click command."""
    out = {}

    def walk(group, prefix: str) -> None:
        for name, cmd in group.commands.items():
            path = f"{prefix} {name}".strip()
            if hasattr(cmd, "commands"):
                walk(cmd, path)
            else:
                out[path] = cmd

    walk(typer.main.get_command(app), "")
    return out


def _options(cmd) -> dict:
    """Primary flag (first long flag) -> click option."""
    return {p.opts[0]: p for p in cmd.params if p.param_type_name == "option"}


def _type(p):
    """The Python type an option converts its value to (typer keeps it on the parameter)."""
    td = getattr(p, "type_descriptor", None)
    return td.annotation if td is not None else p.type


def _declared() -> dict:
    """Primary flag -> (all flags, help) of every alias declared in kvcmas_bench/options.py."""
    out = {}
    for name in dir(options):
        hint = getattr(options, name)
        if typing.get_origin(hint) is not typing.Annotated:
            continue
        info = next(m for m in hint.__metadata__ if isinstance(m, typer.models.OptionInfo))
        # typer takes an Annotated option's first flag as its ``default`` argument
        decls = (info.default, *info.param_decls) if isinstance(info.default, str) else info.param_decls
        flags = [f for d in decls for f in d.split("/")]
        out[flags[0]] = (flags, info.help)
    return out


def test_every_shared_option_is_declared_once_with_one_help_and_default():
    cmds = _commands()
    by_flag: dict[str, dict[str, object]] = defaultdict(dict)
    for path, cmd in cmds.items():
        for flag, p in _options(cmd).items():
            if (path, flag) not in OTHER_MEANING:
                by_flag[flag][path] = p
    declared = _declared()
    problems = []
    for flag, where in by_flag.items():
        if len(where) < 2:
            continue
        if flag not in declared:
            problems.append(f"{flag} is taken by {', '.join(where)} but not declared in kvcmas_bench/options.py")
            continue
        for path, p in where.items():
            if p.help != declared[flag][1]:
                problems.append(f"{path} {flag}: help {p.help!r} differs from options.py's")
            if [*p.opts, *p.secondary_opts] != declared[flag][0]:
                problems.append(f"{path} {flag}: flags {p.opts + p.secondary_opts} differ from options.py's")
        types = {repr(_type(p)) for p in where.values()}
        if len(types) > 1:
            problems.append(f"{flag}: types differ across commands: {types}")
        defaults = {repr(p.default) for p in where.values()}
        if len(defaults) > 1 and flag not in PER_COMMAND_DEFAULTS:
            problems.append(f"{flag}: defaults differ across commands: {sorted(defaults)}")
    assert not problems, "\n".join(problems)
    # a flag string names one option everywhere (but for the documented aliases)
    primaries = defaultdict(set)
    for path, cmd in cmds.items():
        for flag, p in _options(cmd).items():
            if (path, flag) not in OTHER_MEANING:
                for f in p.opts:
                    primaries[f].add(flag)
    assert {f: s for f, s in primaries.items() if len(s) > 1 and f not in ALIAS_FLAGS} == {}
    # every documented exception is still needed
    for flag in PER_COMMAND_DEFAULTS:
        assert len({repr(p.default) for p in by_flag[flag].values()}) > 1, flag
    for path, flag in OTHER_MEANING:
        assert flag in _options(cmds[path]), (path, flag)


def _knob_owner(key: str) -> str:
    return next(n for n, cls in METHODS.items() if not n.startswith("_") and key in cls.knobs())


def _all_knobs() -> dict[str, str]:
    """Every knob of every public method (what `kvcmas-bench methods --options` lists) -> a method having it."""
    keys = {k for n, cls in METHODS.items() if not n.startswith("_") for k in cls.knobs()}
    return {k: _knob_owner(k) for k in sorted(keys)}


def _base_type(cls, key):
    hint = typing.get_type_hints(cls)[key]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def test_typed_knob_flags_match_the_method_dataclasses():
    knobs = _all_knobs()
    cmds = _commands()
    for key, help_text in options.KNOB_FLAGS.items():
        assert key in knobs, f"--{key} is a typed knob flag but no method has a knob {key!r}"
        types = {_base_type(cls, key) for cls in METHODS.values() if key in cls.knobs()}
        assert len(types) == 1, (key, types)
        (base,) = types
        flag = "--" + key.replace("_", "-")
        for path in METHOD_COMMANDS:
            p = _options(cmds[path]).get(flag)
            assert p is not None, f"{path} does not take {flag}"
            assert _type(p) is base, (path, flag, _type(p))
            assert p.default is None and p.help == help_text
        # help texts name no default (the dataclasses hold them) and point at `methods --options`
        assert "methods --options" in help_text
        assert not re.search(r"\bdefault\b(?!s)", help_text), help_text
        for cls in METHODS.values():
            f = cls.knobs().get(key)
            if f is not None and isinstance(f.default, (int, float)) and f.default not in (0, 1):
                assert not re.search(rf"(?<![\w.]){re.escape(f'{f.default:g}')}(?![\w.])", help_text), (key, f.default)
    for path in METHOD_COMMANDS:
        assert "--method-arg" in _options(cmds[path]), path


def test_anchor_dtype_help_lists_exactly_the_accepted_dtypes():
    cls = METHODS["kvcmas"]
    for dt in options.ANCHOR_DTYPES:
        assert dt in options.KNOB_FLAGS["anchor_dtype"]
        assert cls(anchor_dtype=dt).anchor_dtype == dt
    with pytest.raises(Exception, match="^anchor_dtype must be bfloat16"):
        cls(anchor_dtype="float64")


class _Parsed(Exception):
    """Raised by a patched job: the command got past option parsing with these method knobs."""

    def __init__(self, method_args):
        self.method_args = method_args


def _patch_jobs(monkeypatch) -> None:
    from kvcmas_bench.jobs import ablate, analyze, suite, sweep
    from kvcmas_bench.jobs import run as run_job

    def stop(opts, progress=None):
        raise _Parsed(opts.method_args)

    monkeypatch.setattr(run_job, "run", stop)
    monkeypatch.setattr(suite, "run_suite", stop)
    monkeypatch.setattr(ablate, "run_ablation", stop)
    monkeypatch.setattr(analyze, "chain_analysis", stop)
    monkeypatch.setattr(sweep, "run_sweep", stop)


def _argv(command: str, method: str, knob_argv: list[str]) -> list[str]:
    head = {
        "run": ["run", "--method", method],
        "suite": ["suite", "--methods", method],
        "serve-sweep": ["serve-sweep", "--methods", method],
        "ablate": ["ablate", "agents", "--methods", method],
        "analyze chain": ["analyze", "chain", "--methods", method],
    }[command]
    return [*head, *knob_argv, "-o", "/nonexistent/never-written"]


def _parse(command: str, method: str, knob_argv: list[str]) -> dict:
    with pytest.raises(_Parsed) as exc:
        main(_argv(command, method, knob_argv))
    return exc.value.method_args


def test_serve_sweep_builds_one_options_object_with_engine_and_its_hidden_old_name(monkeypatch, capsys):
    from kvcmas_bench.jobs import sweep

    got = []
    monkeypatch.setattr(sweep, "run_sweep", lambda opts, progress=None: got.append(opts))
    for argv, engine in (([], "in-process"), (["--engine", "vllm"], "vllm"), (["--backend", "vllm"], "vllm")):
        with pytest.raises(SystemExit) as exc:
            main(["serve-sweep", *argv, "--qps", "0,2", "--engine-arg", "block_size=16", "-o", "/nonexistent/x"])
        assert exc.value.code == 0
        opts = got.pop()
        assert isinstance(opts, sweep.SweepOptions) and opts.engine == engine
        assert opts.qps == [0.0, 2.0] and opts.engine_options == {"block_size": "16"}
        assert opts.output_path == "/nonexistent/x" and opts.methods == ["all"]
    with pytest.raises(SystemExit) as exc:
        main(["serve-sweep", "--engine", "vllm", "--backend", "in-process", "-o", "/nonexistent/x"])
    assert exc.value.code == 2 and "--backend is the old name of --engine" in capsys.readouterr().err
    assert not got
    # --backend works but is not shown
    serve_sweep = _commands()["serve-sweep"]
    assert {p.name: p.hidden for p in serve_sweep.params if p.name in ("engine", "backend")} == {
        "engine": False,
        "backend": True,
    }


def test_suite_takes_rank(monkeypatch):
    _patch_jobs(monkeypatch)
    assert _parse("suite", "kvcmas", ["--rank", "16"]) == {"rank": 16}


#: values to set each knob to (others: their default, as text)
_VALUES = {"anchor_dtype": "bfloat16", "rank": "16", "delta_rank": "8", "tau": "0.5", "rho": "0.7"}


def _text(key: str, cls) -> str:
    if key in _VALUES:
        return _VALUES[key]
    d = cls.knobs()[key].default
    return "none" if d is None else str(d).lower() if isinstance(d, bool) else str(d)


@pytest.mark.parametrize("command", METHOD_COMMANDS)
def test_every_knob_is_taken_under_one_spelling(monkeypatch, command):
    _patch_jobs(monkeypatch)
    for key, method in _all_knobs().items():
        cls = METHODS[method]
        text = _text(key, cls)
        flag = "--" + key.replace("_", "-")
        argv = [flag, text] if key in options.KNOB_FLAGS else ["--method-arg", f"{key}={text}"]
        args = _parse(command, method, argv)
        assert set(args) == {key}, (command, argv, args)
        spec = resolve_methods([method], args)[method]
        expected = resolve_methods([method], {key: text})[method].kwargs[key]
        assert spec.kwargs[key] == expected, (command, key)


def test_a_knob_given_twice_is_refused(capsys):
    from .conftest import run_cli

    assert run_cli(["suite", "--rank", "16", "--method-arg", "rank=8", "-o", "/nonexistent/x"]) == 2
    assert "--rank is given twice" in capsys.readouterr().err


def test_rank_full_is_the_rank_knobs_word_for_none(monkeypatch):
    _patch_jobs(monkeypatch)
    args = _parse("run", "kvcmas", ["--method-arg", "rank=full"])
    assert resolve_methods(["kvcmas"], args)["kvcmas"].kwargs["rank"] is None


def test_ablate_sweeps_knobs_through_the_knob_converter():
    from kvcmas_bench.jobs.ablate import AblateOptions, sweep_points
    from kvcmas_bench.methods.knobs import convert

    pts = sweep_points(AblateOptions(kind="rank", values=["full"], delta_ranks=["full", "8"]), "mmlu", ["kvcmas"])
    assert [p.method_args for p in pts] == [{"rank": None, "delta_rank": None}, {"rank": None, "delta_rank": 8}]
    pts = sweep_points(AblateOptions(kind="rank", values=["16", "none"]), "mmlu", ["kvcmas"])
    assert [p.method_args for p in pts] == [{"rank": 16, "delta_rank": None}, {"rank": None, "delta_rank": None}]
    cls = METHODS["kvcmas"]
    for p in sweep_points(AblateOptions(kind="tau", values=["0.25"], rhos=["0.5"]), "mmlu", ["kvcmas", "cacheblend"]):
        for key, value in p.method_args.items():
            assert value == convert(METHODS[p.method], key, str(value)), (p.name, key)
    assert convert(cls, "rank", "full") is None


def test_ablate_refuses_a_knob_it_sweeps(tmp_path, capsys):
    from .conftest import run_cli

    assert run_cli(["ablate", "rank", "--rank", "16", "--model", "unused", "-o", str(tmp_path / "a")]) == 2
    assert "ablate rank sets 'rank' at every point" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()


def test_delta_rank_none_means_the_base_rank_everywhere():
    import inspect

    from kvcmas_bench.methods.anchors import AnchorPool

    assert inspect.signature(AnchorPool.add).parameters["delta_rank"].default is None
    assert METHODS["kvcmas"].knobs()["delta_rank"].default is None


def test_the_gate_temperature_default_is_written_once():
    from pathlib import Path

    import kvcmas_bench
    from kvcmas_bench.ops.gate import DEFAULT_GATE_TEMPERATURE

    src = "\n".join(p.read_text() for p in Path(kvcmas_bench.__file__).parent.rglob("*.py"))
    assert len(re.findall(r"DEFAULT_GATE_TEMPERATURE = 0\.01\b", src)) == 1
    assert not re.findall(r"gate_temperature[^\n]*\b0\.01\b", src)
    assert not re.findall(r"\btemps\b[^\n]*\b0\.01\b", src)
    assert METHODS["kvcmas"].knobs()["gate_temperature"].default == DEFAULT_GATE_TEMPERATURE


def test_choice_knobs_list_their_valid_values_and_kvcomm_has_no_factorization():
    """`methods --options` shows the valid values of the knobs that declare them (the same tuples the
    validation checks); KVComm's full-dimensional anchors are never factorized, so `svd` is not a
    KVComm option (as `rank` is not) and `--method-arg svd=...` is refused for it."""
    from kvcmas_bench.cli import _knob_text
    from kvcmas_bench.ops.gate import GATES
    from kvcmas_bench.ops.lowrank import FACTORIZATIONS

    from .conftest import run_cli

    kvcmas = METHODS["kvcmas"]
    knobs = kvcmas.knobs()
    assert _knob_text("svd", knobs["svd"], kvcmas) == "svd='auto' (auto|gram|exact|subspace)"
    assert knobs["svd"].metadata["choices"] == FACTORIZATIONS and knobs["gate_mode"].metadata["choices"] == GATES
    assert (
        _knob_text("anchor_dtype", knobs["anchor_dtype"], kvcmas) == "anchor_dtype=None (none|bfloat16|float16|float32)"
    )
    assert knobs["anchor_dtype"].metadata["choices"] == (None, *options.ANCHOR_DTYPES)
    per_workload = "gsm8k 0.32, humaneval 0.34, mathvista 0.5, mmlu 0.29, videomme 0.6"
    assert _knob_text("tau", knobs["tau"], kvcmas) == f"tau=0.3 (per workload: {per_workload})"
    assert _knob_text("tau", METHODS["kvcomm"].knobs()["tau"], METHODS["kvcomm"]) == "tau=0.3"  # keeps its own
    assert "svd" not in METHODS["kvcomm"].knobs() and "rank" not in METHODS["kvcomm"].knobs()
    assert run_cli(["run", "--method", "kvcomm", "--method-arg", "svd=gram", "-o", "/nonexistent/x"]) == 2
    assert run_cli(["run", "--method", "kvcmas", "--method-arg", "svd=qr", "-o", "/nonexistent/x"]) == 2


def test_the_resolved_factorization_is_what_auto_means_on_the_device():
    kvcmas = METHODS["kvcmas"]
    assert kvcmas().resolved("cpu") == {"svd": "gram"} and kvcmas().resolved("cuda") == {"svd": "subspace"}
    assert kvcmas(svd="exact").resolved("cuda:0") == {"svd": "exact"}
    assert METHODS["kvcomm"]().resolved("cuda") == {} and METHODS["nonshared"]().resolved("cpu") == {}
    # rank 32 + 16 oversampling columns span rows up to 48 wide: there the iteration runs the Gram path
    assert kvcmas().resolved("cuda", width=192) == {"svd": "subspace"}  # SmolLM2: 3 KV heads x 64
    assert kvcmas().resolved("cuda", width=49) == {"svd": "subspace"}
    assert kvcmas().resolved("cuda", width=48) == {"svd": "gram"}
    assert kvcmas().resolved("cuda", width=32) == {"svd": "gram"}  # the tests' tiny models
    assert kvcmas(rank=8).resolved("cuda", width=32) == {"svd": "subspace"}  # 8 + 16 < 32
    assert kvcmas(svd="exact").resolved("cuda", width=32) == {"svd": "exact"}


def test_the_subspace_iteration_takes_the_gram_path_where_resolved_says_so():
    from kvcmas_bench.ops.lowrank import subspace_factors, truncated_svd_gram

    g = torch.Generator().manual_seed(0)
    for width, gram in ((48, True), (49, False)):
        z = torch.randn(2, 64, width, generator=g)
        (a, b), (ga, gb) = subspace_factors([z], 32)[0], truncated_svd_gram(z, 32)
        same = torch.equal(a, ga) and torch.equal(b, gb)
        assert same is gram, width
