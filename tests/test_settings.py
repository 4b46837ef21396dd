"""The one settings object: layers declare each shared setting once, ``from_cli`` builds every job's
options from its command's parameters (none dropped), one KEY=VALUE parser, one string-to-type
converter, and a method's validation message naming the knob the way the user gave it."""

from __future__ import annotations

from dataclasses import fields

import pytest

from kvcmas_bench.errors import BenchError, OptionError
from kvcmas_bench.jobs.ablate import AblateOptions
from kvcmas_bench.jobs.analyze import RankOptions
from kvcmas_bench.jobs.coverage import CoverageOptions
from kvcmas_bench.jobs.run import RunOptions
from kvcmas_bench.jobs.suite import SuiteOptions
from kvcmas_bench.jobs.sweep import SweepOptions
from kvcmas_bench.methods import resolve_methods
from kvcmas_bench.methods.knobs import parse_method_args
from kvcmas_bench.options import KNOB_FLAGS
from kvcmas_bench.settings import (
    TYPED_KNOBS,
    EvalSettings,
    MethodSettings,
    ModelSettings,
    SampleSettings,
    from_cli,
    parse_pairs,
    to_type,
)

from .test_options import _commands

JOBS = {
    "run": RunOptions,
    "suite": SuiteOptions,
    "ablate": AblateOptions,
    "analyze chain": AblateOptions,
    "analyze rank": RankOptions,
    "analyze coverage": CoverageOptions,
    "serve-sweep": SweepOptions,
}


def test_the_typed_knob_flags_are_the_typed_knobs():
    assert tuple(KNOB_FLAGS) == TYPED_KNOBS


def test_a_shared_setting_is_declared_in_its_layer_only():
    shared = {f.name for layer in (ModelSettings, SampleSettings, MethodSettings) for f in fields(layer)}
    shared |= {"fidelity", "calib_samples"}
    for cls in set(JOBS.values()):
        own = set(cls.__dict__.get("__annotations__", {}))
        # a job may change a default (output_path, limit) or widen a type (a sweep's loaded model), never
        # declare the setting's check again or drop it
        redeclared = own & shared - {"output_path", "limit", "fidelity", "model"}
        assert not redeclared, f"{cls.__name__} declares {sorted(redeclared)} again"
        assert {f.name for f in fields(ModelSettings)} <= {f.name for f in fields(cls)}


@pytest.mark.parametrize("command", sorted(JOBS))
def test_every_parameter_of_a_job_command_reaches_its_options(command):
    cls = JOBS[command]
    params = {p.name for p in _commands()[command].params}
    taken = {f.metadata.get("source") or f.name for f in fields(cls)} | {"method_arg"} | set(KNOB_FLAGS)
    cli_only = {"backend"} if command == "serve-sweep" else set()  # the hidden old name of --engine
    assert params - taken - cli_only == set()


def test_from_cli_builds_the_options_a_hand_written_command_did():
    params = dict(
        method="kvcmas",
        workload="gsm8k",
        model=None,
        limit=3,
        output_path="out/x",
        seed=7,
        device="cpu",
        dtype="bfloat16",
        subjects=" anatomy, virology,,",
        data_path=None,
        max_new_tokens=16,
        final_max_new_tokens=None,
        fidelity=True,
        tau=0.25,
        rho=None,
        rank=None,
        anchors=4,
        anchor_dtype=None,
        method_arg=["check-layer=2"],
        target_reuse=None,
        topology="fan-out",
        agents=3,
        rounds=2,
        calib_samples=5,
    )
    opts = from_cli(RunOptions, params)
    assert opts == RunOptions(
        method="kvcmas",
        workload="gsm8k",
        limit=3,
        output_path="out/x",
        seed=7,
        device="cpu",
        dtype="bfloat16",
        subjects=["anatomy", "virology"],
        max_new_tokens=16,
        fidelity=True,
        topology="fan-out",
        agents=3,
        rounds=2,
        calib_samples=5,
        method_args={"tau": 0.25, "anchors": 4, "check_layer": "2"},
    )


def test_from_cli_parses_lists_and_keeps_defaults_for_what_was_not_given():
    sweep = from_cli(
        SweepOptions,
        dict(methods=None, qps="0, 2.5", shared_tokens="64,128", traces=None, engine_arg=["block-size=32"]),
        engine="vllm",
    )
    assert sweep.methods == ["all"] and sweep.qps == [0.0, 2.5] and sweep.shared_tokens == [64, 128]
    assert sweep.engine == "vllm" and sweep.engine_options == {"block_size": "32"} and sweep.traces_path is None
    suite = from_cli(SuiteOptions, dict(methods="", workloads="mmlu,gsm8k", report_format="csv"))
    assert suite.methods == [] and suite.workloads == ["mmlu", "gsm8k"] and suite.report_formats == ["csv"]
    with pytest.raises(BenchError, match="^--qps takes comma-separated numbers, got '1,x'$"):
        from_cli(SweepOptions, dict(qps="1,x"))
    with pytest.raises(BenchError, match="^--rho takes comma-separated numbers"):
        from_cli(CoverageOptions, dict(rhos="0.9;0.8"))
    assert isinstance(from_cli(RunOptions, {}), EvalSettings)


def test_one_key_value_parser_for_method_and_engine_args():
    assert parse_pairs("--engine-arg", ["a=1", " b-c = x=y "]) == {"a": "1", "b_c": "x=y"}
    assert parse_pairs("--engine-arg", None) == {}
    with pytest.raises(BenchError, match="^--engine-arg takes KEY=VALUE, got 'novalue'$"):
        parse_pairs("--engine-arg", ["novalue"])
    with pytest.raises(BenchError, match=r"^--method-arg rank is given twice \(rank=1 and rank=2\)$"):
        parse_method_args(["rank=1", "rank=2"])
    got = parse_method_args(["check-layer=3"])
    assert got == {"check_layer": "3"} and got["check_layer"].option == "--method-arg check-layer=3"


@pytest.mark.parametrize(
    ("text", "hint", "value"),
    [
        ("yes", bool, True),
        ("Off", bool, False),
        (" 12 ", int, 12),
        ("1e-3", float, 0.001),
        (" keep Case ", str, "keep Case"),
        ("None", int | None, None),
        ("null", float | None, None),
        ("full", int | None, None),
    ],
)
def test_to_type_converts_as_the_field_type_says(text, hint, value):
    assert to_type(text, hint, none_words=("full",)) == value


@pytest.mark.parametrize(("text", "hint"), [("maybe", bool), ("1.5", int), ("nan", float), ("none", int)])
def test_to_type_refuses_a_value_of_another_type(text, hint):
    with pytest.raises(ValueError):
        to_type(text, hint)


def test_to_type_refuses_a_type_the_command_line_cannot_give():
    with pytest.raises(TypeError):
        to_type("1,2", list[int])


def test_a_method_names_its_knob_and_the_cli_names_the_flag_the_user_typed():
    with pytest.raises(OptionError) as direct:
        resolve_methods(["kvcmas"])["kvcmas"](tau=2.0)
    assert direct.value.knob == "tau" and str(direct.value) == "tau must lie in [0, 1], got 2.0"
    with pytest.raises(OptionError, match=r"^method 'kvcmas': --tau must lie in \[0, 1\], got 2.0$"):
        resolve_methods(["kvcmas"], {"tau": 2.0})
    with pytest.raises(OptionError, match=r"^method 'kvcmas': --method-arg tau=2 must lie in \[0, 1\], got 2.0$"):
        resolve_methods(["kvcmas"], parse_method_args(["tau=2"]))
    msg = r"^method 'cacheblend': check_layer must be >= 0, got -1 \(given as --method-arg check-layer=-1\)$"
    with pytest.raises(OptionError, match=msg):
        resolve_methods(["cacheblend"], parse_method_args(["check-layer=-1"]))


def test_tau_has_one_default_and_the_workloads_override_it():
    from kvcmas_bench.methods.delta import OnlineDeltaCorrection
    from kvcmas_bench.methods.kvcmas import KVCMAS
    from kvcmas_bench.methods.kvcomm import KVComm
    from kvcmas_bench.workloads.base import WORKLOADS, Workload

    assert "tau" not in KVCMAS.__dict__.get("__annotations__", {})
    assert "tau" not in KVComm.__dict__.get("__annotations__", {})
    assert KVCMAS().tau == OnlineDeltaCorrection.__dataclass_fields__["tau"].default == 0.3
    assert Workload.default_tau is None
    specs = resolve_methods(["kvcmas", "kvcomm"], workload=WORKLOADS["mmlu"])
    assert specs["kvcmas"]().tau == 0.29 and specs["kvcomm"]().tau == 0.3  # KVComm keeps its own
