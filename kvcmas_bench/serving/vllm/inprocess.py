"""``VLLMInProcessEngine``: the serving engine on vLLM (see :mod:`kvcmas_bench.serving.vllm`).

vLLM's engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the uni executor), so
its scheduler, its worker, the KV connector and the harness share memory: the harness computes
reused/corrected K/V with the methods' own code and hands it to the connector as a plan, and reads
captured K/V back from it. ``AsyncLLM`` always starts a separate engine-core process, which would
put every shared cache behind IPC; the step loop of ``LLMEngine`` streams tokens just the same.
Only one engine per process (vLLM keeps its KV-transfer group in module globals).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ...errors import BenchError
from ...memory import reset_peaks
from ...methods import Method, MethodSpec
from ...modeling import DEFAULT_MODEL, check_supported, default_model_dir, resolve_dtype
from ...results.request import RequestRecord
from ..engines import Schedules, ServeResult, calibrated
from ..traces import Trace
from . import why_not
from .client import Client, Event, fetch_kv
from .flow import EngineRequest, ModelFacts, Runtime, TrajectoryRun
from .options import parse_engine_options

CONNECTOR_MODULE = "kvcmas_bench.serving.vllm.connector"
CONNECTOR_CLASS = "KVCMASConnector"
SERVER = (
    "vLLM continuous batching (in-process LLMEngine step loop), requests served for real on the wall clock; "
    "agent j+1 of a trajectory arrives when agent j completes; TTFT at the first streamed token"
)


@dataclass
class VLLMOptions:
    """Engine options (``--engine-arg KEY=VALUE``)."""

    #: tokens per KV block; the CPU backend needs a multiple of 32 (None: 32 on CPU, vLLM's default on GPU)
    block_size: int | None = None
    #: CPU KV cache size in GiB (``VLLM_CPU_KVCACHE_SPACE``; an integer)
    kv_cache_gib: int = 1
    #: GPU memory share for weights + KV cache
    gpu_memory_utilization: float = 0.5
    #: most requests batched at once (None: vLLM's default)
    max_num_seqs: int | None = None
    #: most tokens per engine step (chunked prefill beyond; None: vLLM's default)
    max_num_batched_tokens: int | None = None
    #: context length the engine accepts (None: the model's, at most 4096)
    max_model_len: int | None = None
    #: vLLM's exact prefix cache; requests carrying injected K/V are then salted per request so
    #: approximate K/V is never served as a prefix-cache hit
    prefix_caching: bool = False

    @classmethod
    def parse(cls, options: dict) -> VLLMOptions:
        """Converted and checked ``--engine-arg`` values (:func:`~.options.parse_engine_options`)."""
        return parse_engine_options(cls, options)


def _resolve_model(spec: str | None) -> tuple[str, str]:
    if spec in (None, "", DEFAULT_MODEL):
        return str(default_model_dir()), DEFAULT_MODEL
    if str(spec).endswith(".gguf"):
        raise BenchError("--engine vllm takes an HF folder or id, not a .gguf file (the default model is converted)")
    p = Path(spec).expanduser()
    if p.exists():
        marked = (p / "RANDOM_WEIGHTS.json").exists()  # benchmarks/random_model.py, as load_model marks it
        return str(p), f"{spec} (random weights)" if marked else str(spec)
    if str(spec).startswith((".", "/", "~")) or str(spec).count("/") != 1:
        raise BenchError(f"model not found: {spec} (not a local folder or HF id)")
    return str(spec), str(spec)


def _rotary_inv_freq(config) -> torch.Tensor:
    """The model's own RoPE ``inv_freq`` (llama3 scaling included), from its transformers module."""
    import importlib

    mt = config.model_type
    mod = importlib.import_module(f"transformers.models.{mt}.modeling_{mt}")
    cls = next(v for k, v in vars(mod).items() if k.endswith("RotaryEmbedding") and isinstance(v, type))
    rot = cls(config=config)
    if abs(float(getattr(rot, "attention_scaling", 1.0)) - 1.0) > 1e-12:
        raise BenchError("rotary attention_scaling != 1 is not supported")
    return rot.inv_freq.float().cpu()


def load_config_and_tokenizer(path: str, spec):
    """The model's transformers config (checked supported) and tokenizer, or one clear error."""
    from transformers import AutoConfig, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise BenchError(f"cannot load model {spec!r}: {str(exc).splitlines()[0]}") from None
    check_supported(config)
    return config, AutoTokenizer.from_pretrained(path)


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def eos_ids(config) -> set[int]:
    eos = config.eos_token_id
    return set(eos if isinstance(eos, (list, tuple)) else ([eos] if eos is not None else []))


def model_facts(
    config, torch_dtype, device: str, n_kv: int | None = None, keep_ready: bool = False, shards=None
) -> ModelFacts:
    """What the methods read from the model when they plan requests for vLLM (``n_kv``: the KV heads
    this worker holds; ``shards``: its tensor-parallel share, :class:`~.tp.HeadShards`)."""
    return ModelFacts(
        _rotary_inv_freq(config),
        config.num_hidden_layers,
        n_kv or config.num_key_value_heads,
        head_dim_of(config),
        torch_dtype,
        device,
        keep_ready=keep_ready,
        shards=shards,
    )


def _engine_kwargs(path: str, config, dtype: str, opts: VLLMOptions, cpu: bool) -> dict:
    """``EngineArgs`` of the in-process engine (CPU: block size a multiple of 32, head_dim >= 32)."""
    block = opts.block_size or (32 if cpu else None)
    if cpu and (block % 32 or head_dim_of(config) < 32):
        raise BenchError(f"vLLM's CPU backend needs a block size multiple of 32 (got {block}) and head_dim >= 32")
    max_len = opts.max_model_len or min(int(getattr(config, "max_position_embeddings", 4096) or 4096), 4096)
    kwargs = dict(
        model=path,
        tokenizer=path,
        dtype=dtype,
        seed=0,
        enforce_eager=True,
        max_model_len=max_len,
        block_size=block,
        enable_prefix_caching=opts.prefix_caching,
        max_num_seqs=opts.max_num_seqs,
        max_num_batched_tokens=opts.max_num_batched_tokens,
        disable_log_stats=False,
    )
    if not cpu:
        kwargs["gpu_memory_utilization"] = opts.gpu_memory_utilization
    return kwargs


class VLLMEngine:
    """:class:`~.client.StepEngine` over vLLM's in-process ``LLMEngine`` (plans go to the connector)."""

    def __init__(self, llm, ignore_eos: bool):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        from .plan import KEY, STORE

        self.llm, self.ignore_eos = llm, ignore_eos
        self._sp, self._delta, self._key, self.store = SamplingParams, RequestOutputKind.DELTA, KEY, STORE
        #: key -> vLLM's request metrics of finished requests (RequestStateStats), for checks
        self.metrics: dict[str, object] = {}

    def submit(self, req: EngineRequest) -> None:
        extra = None
        if req.plan is not None:
            self.store.plans[req.key] = req.plan
            extra = {"kv_transfer_params": {self._key: req.key}}
        params = self._sp(
            temperature=0.0,
            max_tokens=req.max_tokens,
            ignore_eos=self.ignore_eos or req.kind == "kv",
            output_kind=self._delta,
            logprobs=req.logprobs,
            extra_args=extra,
        )
        prompt: dict = {"prompt_token_ids": list(req.prompt)}
        if req.salt:
            prompt["cache_salt"] = req.salt
        self.llm.add_request(req.key, prompt, params)

    def step(self) -> list[Event]:
        events = []
        for o in self.llm.step():
            c = o.outputs[0] if o.outputs else None
            toks = list(c.token_ids) if c is not None else []
            lp = None
            if c is not None and c.logprobs and toks:
                lp = {int(t): float(x.logprob) for t, x in c.logprobs[0].items()}
            events.append(Event(o.request_id, toks, bool(o.finished), o.num_cached_tokens, lp))
            if o.finished:
                self.metrics[o.request_id] = o.metrics
        return events

    def busy(self) -> bool:
        return self.llm.has_unfinished_requests()

    def forget(self, key: str) -> None:
        self.store.forget(key)


_ENGINE: dict = {}


def _make_engine(kwargs: dict):
    """vLLM's in-process engine (one per process: vLLM keeps the KV-transfer group global)."""
    if _ENGINE:
        if _ENGINE["kwargs"] != kwargs:
            raise BenchError("a vLLM engine with other settings already runs in this process; start a new process")
        return _ENGINE["llm"]
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    kv = KVTransferConfig(kv_connector=CONNECTOR_CLASS, kv_connector_module_path=CONNECTOR_MODULE, kv_role="kv_both")
    llm = LLMEngine.from_engine_args(EngineArgs(**kwargs, kv_transfer_config=kv))
    _ENGINE.update(kwargs=kwargs, llm=llm)
    return llm


class ServedModel:
    """What both vLLM engines tell about the model they serve (from its config)."""

    config: object
    max_model_len: int | None

    @property
    def max_positions(self) -> int | None:
        return self.max_model_len

    @property
    def vocab_size(self) -> int | None:
        return getattr(self.config, "vocab_size", None)

    @property
    def kv_width(self) -> int:
        """The K/V row width (heads x head_dim) one worker's anchors hold: its tensor-parallel rank's
        KV heads (:func:`~.tp.kv_head_range`)."""
        heads = getattr(self.config, "num_key_value_heads", None) or self.config.num_attention_heads
        world = int(getattr(getattr(self, "opts", None), "tensor_parallel_size", 1) or 1)
        return max(1, heads // world) * head_dim_of(self.config)


class VLLMInProcessEngine(ServedModel):
    """Serve trace requests for real on vLLM (see the package docstring)."""

    name = "vllm-inprocess"
    server = SERVER
    replays_service = False

    def __init__(self, model, device: str, dtype: str, ignore_eos: bool, warmup: bool, opts: VLLMOptions):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(opts.kv_cache_gib))
        torch_dtype = resolve_dtype(dtype)
        path, self.model_name = _resolve_model(model)
        self.model_source = path
        self.config, self.tokenizer = load_config_and_tokenizer(path, model)
        import vllm
        from vllm.platforms import current_platform

        self.platform = current_platform.device_type or "unknown"
        if device != "auto" and not str(device).startswith(self.platform):
            raise BenchError(f"this vLLM build runs on {self.platform}; --device {device} is not available to it")
        self.opts, self.dtype, self.ignore_eos, self.warmup = opts, dtype, ignore_eos, warmup
        self.engine_kwargs = _engine_kwargs(path, self.config, dtype, opts, current_platform.is_cpu())
        self.max_model_len = self.engine_kwargs["max_model_len"]
        self.vllm_version = vllm.__version__
        self.llm = _make_engine(self.engine_kwargs)
        device_type = "cpu" if current_platform.is_cpu() else current_platform.device_type
        self.rt = Runtime(
            model_facts(self.config, torch_dtype, device_type),
            eos_ids=eos_ids(self.config),
            ignore_eos=ignore_eos,
            salt_injected=opts.prefix_caching,
        )
        self.engine = VLLMEngine(self.llm, ignore_eos)
        self.rss_reset = False
        if warmup:
            self._warm()

    # ---- ServingEngine attributes ------------------------------------------------------------------
    @property
    def why_unsupported(self):
        """``why_unsupported(method_cls)``: the reason this engine cannot run a method, or None."""
        return why_not

    def describe(self) -> dict:
        return {
            "name": self.name,
            "engine": f"vLLM {self.vllm_version} LLMEngine in-process (continuous batching) + KVCMASConnector",
            "vllm_version": self.vllm_version,
            "device": self.platform,
            "dtype": self.dtype,
            "ignore_eos": self.ignore_eos,
            "warmup": self.warmup,
            "decoding": "greedy",
            "prefix_caching": self.opts.prefix_caching,
            "injected_requests_salted": self.rt.salt_injected,
            "options": asdict(self.opts),
            "engine_args": {k: v for k, v in self.engine_kwargs.items() if k not in ("model", "tokenizer")},
            "kv_injection": "system prompt (exact, per agent) + first shared segment claimed as a prefix; "
            "later shared segments overridden per layer before attention; dense segments and outputs captured",
            "clock": "wall clock (time.perf_counter); TTFT at the end of the engine step that streams the first token",
            "rss_peak_reset_per_method": self.rss_reset,
        }

    # ---- running -----------------------------------------------------------------------------
    def _client(self) -> Client:
        return Client(self.engine, self.rt, forget=self.engine.forget)

    def _warm(self) -> None:
        """Unmeasured: a plain request and a captured prefill (first-use costs, the layout probe)."""
        ids = [int(i) for i in torch.arange(64) % max(2, (self.vocab_size or 64) - 1) + 1]
        fetch_kv(self.engine, self.rt, ids, self.engine.forget)
        self.engine.submit(EngineRequest(self.rt.key("warm"), ids, 2, None))
        while self.engine.busy():
            self.engine.step()

    def system_prompts(self, traces: Sequence[Trace]) -> None:
        """Exact K/V of every agent's system prompt (the PF segment at position 0 before a shared
        one), captured once before timing, as a server's prefix cache would hold it."""
        for tr in traces:
            for a in tr.agents:
                segs = a.segments
                if len(segs) > 1 and segs[0]["kind"] == "PF" and segs[0]["ids"] and segs[1]["kind"] == "PH":
                    ids = tuple(segs[0]["ids"])
                    if ids not in self.rt.system_kv:
                        self.rt.system_kv[ids] = fetch_kv(self.engine, self.rt, ids, self.engine.forget)

    def run_trajectory(self, trace: Trace, method, qps: float | None = None) -> TrajectoryRun:
        """One trajectory, single stream (calibration, warm-up, tests)."""
        self.system_prompts([trace])
        run = TrajectoryRun(self.rt, trace, method, capture_outputs=True, qps=qps)
        self._client().serve([run], None)
        return run

    def prepare(self, spec: MethodSpec, calibration: Sequence[Trace]) -> Method:
        """A fresh method: calibrated on the held-out trajectories of split "calibration" through vLLM
        when it needs it, then warmed up (online learners run every held-out trajectory, the
        "warmup" split included; the others one)."""
        reason = why_not(spec.cls)
        if reason:
            raise BenchError(f"--engine vllm cannot run {spec.name}: {reason}")
        held = list(calibration)
        m = calibrated(spec, held, lambda rec: _Flow(self, rec), self.config.num_hidden_layers)
        if self.warmup and held:
            for tr in held if m.learns_online else held[:1]:
                self.run_trajectory(tr, m)
        self.rss_reset = reset_peaks()
        return m

    def serve(self, method: Method, traces: Sequence[Trace], schedules: Schedules, on_point=None) -> ServeResult:
        """Every QPS point served for real (method state carries over from one point to the next);
        ``on_point`` gets each point's records as it completes."""
        self.system_prompts(traces)
        timelines: dict[float, list[RequestRecord]] = {}
        for q, arrivals in schedules.items():
            runs = [TrajectoryRun(self.rt, tr, method, capture_outputs=True, qps=q) for tr in traces]
            timelines[q] = self._client().serve(runs, None if arrivals is None else list(arrivals))
            if on_point is not None:
                on_point(q, timelines[q])
        return ServeResult(timelines, None)


class _Flow:
    """``run_unit`` for :func:`kvcmas_bench.calibration.collect`."""

    def __init__(self, backend: VLLMInProcessEngine, method):
        self.backend, self.method = backend, method

    def run_unit(self, trace: Trace):
        return self.backend.run_trajectory(trace, self.method)
