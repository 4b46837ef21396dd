"""The ``run`` job: samples -> workflow -> request records -> summary, resumable."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..calibration import auto_tau, collect
from ..engine import Engine
from ..errors import BenchError
from ..memory import reset_peaks
from ..methods import MethodSpec, resolve_method
from ..results.outdir import lock_output_dir
from ..results.provenance import provenance
from ..results.records import RunDir, check_run_dir
from ..results.request import RequestRecord
from ..results.state import MethodStateStore
from ..segments import UIDS
from ..settings import EvalSettings, check_positive, cli, comma_list
from ..workflow import TOPOLOGIES, Workflow, request_records
from ..workloads import Workload, get_workload
from .sampling import (
    begin,
    check_model,
    config_keys,
    finish,
    note,
    pick_samples,
    sample_record,
    select_samples,
    throughput,
)

__all__ = ["RunOptions", "check_sandbox", "resolve_options", "run", "select_samples"]

#: most agents of one workflow (``--agents``); the model's context bounds it further (:func:`check_context`)
MAX_AGENTS = 64
#: most task-agent requests of one sample (task agents x ``--rounds``), checked before the workflow is planned
MAX_TASK_REQUESTS = 512


@dataclass(kw_only=True)
class RunOptions(EvalSettings):
    """One ``run``: a method on a workload (the shared settings: :class:`~kvcmas_bench.settings.EvalSettings`)."""

    method: str = "nonshared"
    workload: str = "mmlu"
    output_path: str = "runs/latest"
    #: MMLU subjects (None: all)
    subjects: list[str] | None = cli(None, parse=comma_list)
    #: a local data file or ``hub[:repo]`` (videomme: the folder of its videos)
    data_path: str | None = None
    topology: str = "chain"
    agents: int | None = None
    rounds: int = 1
    #: pick tau on calibration samples to reach this reuse ratio (KVCMAS/KVComm)
    target_reuse: float | None = None

    def validate(self) -> None:
        """Job options (method knobs are validated by the method itself)."""
        if self.target_reuse is not None and not 0.0 <= self.target_reuse <= 1.0:
            raise BenchError(f"--target-reuse must lie in [0, 1], got {self.target_reuse}")
        if self.topology not in TOPOLOGIES:
            raise BenchError(f"unknown --topology {self.topology!r}; use one of {', '.join(TOPOLOGIES)}")
        if self.agents is not None and not 2 <= self.agents <= MAX_AGENTS:
            raise BenchError(
                f"--agents must lie in [2, {MAX_AGENTS}] (task agents + the final agent), got {self.agents}"
            )
        check_positive(rounds=self.rounds)
        self.check_eval()
        check_sandbox([self.workload], self.unsafe_sandbox)


def check_sandbox(workloads: list[str], unsafe: bool) -> None:
    """Workloads that execute generated code (HumanEval) run only where the sandbox keeps it from
    reading the user's files (Landlock, or a switch from root to an unprivileged user), unless
    ``--unsafe-sandbox`` says to run them anyway."""
    if unsafe or "humaneval" not in workloads:
        return
    from ..workloads.sandbox import file_reads_confined

    if not file_reads_confined():
        raise BenchError(
            "this kernel has no Landlock and the HumanEval sandbox cannot switch to an unprivileged user, so "
            "model-generated code could read your files; pass --unsafe-sandbox to run it anyway"
        )


@dataclass
class Prepared:
    """Everything a run needs once options are checked, the model loaded and calibration done."""

    workload: Workload
    spec: MethodSpec
    samples: list
    calib: list
    lm: object
    engine: Engine
    method: object = None
    chosen_tau: float | None = None
    rss_reset: bool = False
    #: held-out samples run before the measured ones (``--warmup``), in no figure
    warm: list = field(default_factory=list)

    def flow(self, method, opts: RunOptions, fidelity: bool = False) -> Workflow:
        kw = dict(fidelity=fidelity, topology=opts.topology, agents=opts.agents, rounds=opts.rounds)
        if self.workload.modality != "text":
            from ..workflow_vlm import VLMWorkflow

            return VLMWorkflow(
                self.engine,
                method,
                self.workload,
                opts.max_new_tokens,
                opts.final_max_new_tokens,
                processor=self.lm.processor,
                **kw,
            )
        return Workflow(self.engine, method, self.workload, opts.max_new_tokens, opts.final_max_new_tokens, **kw)


def resolve_options(opts: RunOptions) -> tuple[Workload, MethodSpec]:
    """Check every option without loading data or model (bad input never touches the output path)."""
    from ..modeling import resolve_device, resolve_dtype

    opts.validate()
    workload = get_workload(opts.workload, data_path=opts.data_path, subjects=opts.subjects)
    task_agents = opts.agents - 1 if opts.agents else len(workload.roles)
    if task_agents * opts.rounds > MAX_TASK_REQUESTS:
        raise BenchError(
            f"--rounds {opts.rounds} x {task_agents} task agents makes {task_agents * opts.rounds} requests per "
            f"sample; at most {MAX_TASK_REQUESTS}"
        )
    spec = resolve_method(opts.method, opts.method_args, workload)
    if opts.engine == "vllm":
        from .served import check_served

        check_served(opts, workload, {opts.method: spec})
    if opts.target_reuse is not None and "tau" not in spec.cls.knobs():
        raise BenchError(f"--target-reuse applies to methods with a gate threshold, not {opts.method!r}")
    resolve_device(opts.device)
    resolve_dtype(opts.dtype)
    return workload, spec


def prepare(opts: RunOptions) -> Prepared:
    """Check every option, load data and model, calibrate: all the work before the first sample."""
    from ..modeling import load_model, resolve_device

    workload, spec = resolve_options(opts)
    device = resolve_device(opts.device)
    samples, calib, warm = pick_samples(opts, workload, spec)
    if workload.modality != "text":
        from ..modeling_vlm import load_vlm

        lm = load_vlm(opts.model, opts.dtype, str(device))
        check_model(opts, workload, spec, lm.model.config)
    else:
        lm = load_model(opts.model, opts.dtype, str(device), check=lambda c: check_model(opts, workload, spec, c))
    p = Prepared(workload, spec, samples, calib, lm, Engine(lm.model, lm.tokenizer), warm=warm)
    p.method = spec()
    if p.method.needs_calibration:
        obs = collect(lambda m: p.flow(m, opts), calib, with_reference=p.method.calibration_reference)
        p.method.calibrate(obs, p.engine.n_layers)
    if opts.target_reuse is not None:
        p.method, p.chosen_tau = auto_tau(p.method, lambda m: p.flow(m, opts), calib, opts.target_reuse)
    # this run's peak from its first sample on: neither calibration traffic nor whatever ran before
    # in the process lands in it (the calibrated state itself stays resident and counts)
    p.rss_reset = reset_peaks(p.engine.device)
    return p


def run_config(opts: RunOptions, p: Prepared, flow: Workflow) -> dict:
    return {
        **config_keys(opts, p.method, flow, p.samples, p.calib, p.warm),
        "method_resolved": p.method.resolved(p.engine.device, p.engine.n_kv * p.engine.head_dim),
        "model": p.lm.name,
        "model_source": p.lm.source,
        "device": str(p.engine.device),
        "fidelity": opts.fidelity,
        "target_reuse": opts.target_reuse,
        "auto_tau": p.chosen_tau,
        "prefix_caching": False,
        "engine": "in-process (one request at a time)",
        "peak_memory": "per run: peak counters reset after the model is loaded and the method calibrated"
        + ("" if p.rss_reset or p.engine.device.type == "cuda" else " (RSS high-water mark not resettable here)"),
        **provenance(p.engine.device),
    }


def run(opts: RunOptions, progress=None) -> dict:
    """Run (or resume) one benchmark and return its summary."""
    workload, spec = resolve_options(opts)
    with lock_output_dir(opts.output_path) as path:  # a busy or unwritable output path fails before any work,
        check_run_dir(path)  # and so does a damaged run directory
        if opts.engine == "vllm":
            from .served import run_served

            return run_served(opts, workload, spec, progress)
        return _run(opts, progress)


def _run(opts: RunOptions, progress=None) -> dict:
    p = prepare(opts)
    flow = p.flow(p.method, opts, opts.fidelity)
    out = RunDir(opts.output_path, run_config(opts, p, flow))
    store = MethodStateStore(out.path)
    if out.samples and p.method.persistent_state():  # methods that learn while running
        UIDS.advance(store.load(len(out.samples), p.method, p.engine.device))
    out.repair()  # every check passed: only now is anything in the directory changed
    if p.warm and not out.samples:  # a resumed run restored the state its warm-up built
        warm_up(p, opts, progress)
    todo = [s for s in p.samples if s.id not in out.done_ids]
    begin(progress, opts, p.samples, todo, out)
    t0 = time.perf_counter()
    for sample in todo:
        prompts: list | None = [] if opts.log_prompts else None
        sample_rec, req_recs = run_one(flow, sample, p.engine, prompts)
        n = len(out.samples) + 1
        store.save(n, p.method, UIDS.next)
        out.append(sample_rec, req_recs)  # the commit point
        store.commit(n)
        if prompts:
            out.log_prompts(prompts)
        if progress is not None:
            progress.advance(sample_rec)
    wall = time.perf_counter() - t0
    meta = {
        "method": opts.method,
        "workload": opts.workload,
        "model": p.lm.name,
        "device": str(p.engine.device),
        **({"method_state": p.method.state_layout()} if hasattr(p.method, "state_layout") else {}),
    }
    return finish(out, p.samples, meta, {"name": "in-process", "max_concurrency": 1, **throughput(len(todo), wall)})


def warm_up(p: Prepared, opts: RunOptions, progress=None) -> None:
    """Run the ``--warmup`` samples through the method (no records, no fidelity) so its online state
    (anchor pools) is filled before the first measured sample, then restart the peak counters."""
    flow = p.flow(p.method, opts)
    for i, sample in enumerate(p.warm, 1):
        note(progress, f"warm-up sample {i}/{len(p.warm)}")
        flow.run_sample(sample)
    p.rss_reset = reset_peaks(p.engine.device)


def run_one(flow: Workflow, sample, engine: Engine, prompts: list | None = None) -> tuple[dict, list[RequestRecord]]:
    """Run one sample through the workflow; return its sample record and request records.
    ``prompts``: when given, receives one line per request with the prompt text it rendered."""
    sr = flow.run_sample(sample)
    if prompts is not None:
        decode = engine.tokenizer.decode
        prompts += [
            {"sample_id": sample.id, "step": i, "node": st.node.id, "agent": st.node.role.name,
             "prompt": decode(st.request.prompt_ids)}
            for i, st in enumerate(sr.steps)
        ]  # fmt: skip
    reqs = request_records(sr, engine.n_layers, sample_id=sample.id)
    sample_rec = sample_record(flow.workload, sample, sr.final_text, reqs)
    if sr.visual is not None:
        sample_rec["visual"] = sr.visual
    return sample_rec, reqs
