"""``serve-sweep --engine vllm``: the harness as an HTTP client of a normal ``vllm serve`` deployment
that loads :class:`~.connector.KVCMASConnector` (see :mod:`.worker` for what runs where).

:func:`serve_command` is the deployment (``kvcmas-bench serve`` prints and runs it); the engine
starts it on a free loopback port (or targets ``--engine-arg base_url=http://host:port``), and
sends each trajectory over the OpenAI-compatible streaming completions API, as ``vllm bench serve``
does: token-id prompts, greedy decoding, ``kv_transfer_params`` holding the request's small plan
metadata. Trajectories arrive open-loop at their scheduled times (one client thread each); agent
j + 1 is sent when agent j's stream ends; TTFT is taken at the first streamed token. Each
trajectory's worker-side state is freed when its last agent finishes. After every QPS point one
report request collects the worker's per-request records (segment statuses, costs, method
accounting), which the client completes with its own clock.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from ...errors import BenchError
from ...methods import Method, MethodSpec
from ...results.request import RequestRecord
from ...segments import Request
from ...workflow import Node
from ..engines import EngineLost, Schedules, ServeResult, trace_nodes
from ..traces import Trace
from .flow import agent_output
from .guard import PROTOCOL, expected_salt, new_secret
from .inprocess import ServedModel, eos_ids
from .options import parse_engine_options
from .worker import agent_params, calibrate_params, capture_params, report_params

CONNECTOR_MODULE = "kvcmas_bench.serving.vllm.connector"
CONNECTOR_CLASS = "KVCMASConnector"
#: the API server's edge check of kv_transfer_params (:mod:`.edge`), loaded with ``--middleware``
EDGE_MIDDLEWARE = "kvcmas_bench.serving.vllm.edge.KVCMASGuard"
SERVED_NAME = "kvcmas-model"
SERVER = (
    "vLLM continuous batching behind its OpenAI-compatible server (`vllm serve` with KVCMASConnector), "
    "served for real on the wall clock; agent j+1 of a trajectory is sent when agent j's stream ends; "
    "TTFT at the first streamed token"
)


@dataclass
class ServerOptions:
    """Options of the served deployment (``--engine-arg KEY=VALUE``)."""

    #: a running server to use instead of starting one (``http://host:port``)
    base_url: str | None = None
    #: tokens per KV block (None: 32 on CPU, vLLM's default on GPU)
    block_size: int | None = None
    #: CPU KV cache size in GiB (``VLLM_CPU_KVCACHE_SPACE``)
    kv_cache_gib: int = 1
    #: GPU memory share for weights + KV cache
    gpu_memory_utilization: float = 0.9
    #: context length (None: the model's own)
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    #: vLLM's exact prefix cache (salted per method and QPS point, per request when injected)
    prefix_caching: bool = False
    #: CUDA graphs off (on GPU; the connector needs piecewise graphs, which vLLM then selects)
    enforce_eager: bool = False
    #: stop every request at its first token (the paper's TTFT setting, B.4)
    stop_at_first_token: bool = False
    #: worker-side byte budget for everything the methods hold (GiB, per tensor-parallel rank; None:
    #: on CUDA half of what gpu_memory_utilization leaves of the device, on CPU a quarter of the
    #: host memory available at start)
    budget_gib: float | None = None
    #: seconds a session may sit idle before the worker drops it with everything it holds
    session_idle_s: float | None = None
    #: seconds the scheduler holds a request for its plan or answer before it goes on with an error
    deadline_s: float | None = None
    #: tensor-parallel ranks (``--tensor-parallel-size``): each rank's worker runs the methods on its
    #: own KV heads, the gate's distances summed over all of them (see :mod:`.tp`)
    tensor_parallel_size: int = 1
    #: seconds to wait for the server to come up
    startup_timeout: float = 600.0
    #: the ``vllm`` executable (None: next to this Python, else on PATH)
    vllm_bin: str | None = None
    #: more ``vllm serve`` arguments, as one shell-quoted string
    extra_args: str | None = None

    @classmethod
    def parse(cls, options: dict) -> ServerOptions:
        """Converted and checked ``--engine-arg`` values (:func:`~.options.parse_engine_options`)."""
        return parse_engine_options(cls, options)


def kv_transfer_config(
    budget_gib: float | None = None, session_idle_s: float | None = None, deadline_s: float | None = None
) -> dict:
    given = {"budget_gib": budget_gib, "session_idle_s": session_idle_s, "deadline_s": deadline_s}
    extra = {k: v for k, v in given.items() if v}
    return {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


def launcher(model: str, vllm_bin: str | None = None) -> list[str]:
    """How to start vLLM's OpenAI-compatible server on ``model``: ``vllm serve MODEL`` with a given
    ``vllm`` executable; else this Python's vLLM as ``python -m vllm.entrypoints.openai.api_server
    --model MODEL`` (the same server; vllm-cpu 0.32.0's ``vllm`` script fails, its metadata being
    named vllm-cpu); else ``vllm serve`` from PATH."""
    import importlib.util

    if vllm_bin:
        if not Path(vllm_bin).exists():
            raise BenchError(f"--engine-arg vllm_bin={vllm_bin}: no such file")
        return [vllm_bin, "serve", model]
    if importlib.util.find_spec("vllm") is not None:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    found = shutil.which("vllm")
    if found:
        return [found, "serve", model]
    raise BenchError(
        "vLLM is not installed here: `bash scripts/setup.sh --vllm`, or --engine-arg vllm_bin=PATH to a `vllm`, "
        "or --engine-arg base_url=URL of a running `kvcmas-bench serve`"
    )


def serve_command(model: str, port: int, dtype: str, opts: ServerOptions, cpu: bool, host: str = "127.0.0.1") -> list:
    """The command line of a vLLM deployment with the connector (``vllm serve`` and its flags)."""
    cmd = launcher(model, opts.vllm_bin) + ["--host", host, "--port", str(port)]
    cmd += ["--served-model-name", SERVED_NAME, "--dtype", dtype, "--seed", "0"]
    config = kv_transfer_config(opts.budget_gib, opts.session_idle_s, opts.deadline_s)
    cmd += ["--kv-transfer-config", json.dumps(config)]
    cmd += ["--middleware", EDGE_MIDDLEWARE]
    cmd += ["--enable-prefix-caching" if opts.prefix_caching else "--no-enable-prefix-caching"]
    # the connector hands finished requests' outputs to the worker in the next step's metadata and
    # reads captures right after each forward; it is not checked under overlapped (async) scheduling
    cmd += ["--no-async-scheduling"]
    block = opts.block_size or (32 if cpu else None)
    if block:
        cmd += ["--block-size", str(block)]
    for flag, value in (
        ("--max-model-len", opts.max_model_len),
        ("--max-num-seqs", opts.max_num_seqs),
        ("--max-num-batched-tokens", opts.max_num_batched_tokens),
    ):
        if value is not None:
            cmd += [flag, str(value)]
    if not cpu:
        cmd += ["--gpu-memory-utilization", str(opts.gpu_memory_utilization)]
    if opts.tensor_parallel_size > 1:
        cmd += ["--tensor-parallel-size", str(opts.tensor_parallel_size)]
    if opts.enforce_eager:
        cmd += ["--enforce-eager"]
    if opts.extra_args:
        import shlex

        cmd += shlex.split(opts.extra_args)
    return cmd


def server_env(opts: ServerOptions, cpu: bool) -> dict[str, str]:
    """Environment defaults of the deployment (a caller's own settings win). On CPU:
    ``VLLM_CPU_KVCACHE_SPACE`` (per rank), and with tensor parallelism ``VLLM_CPU_OMP_THREADS_BIND``
    split over the CPUs this process may use: vLLM's automatic binding gives each CPU worker a NUMA
    node of its own and refuses ("Not enough allowed NUMA nodes to bind threads of 2 local
    CPUWorkers") on a one-node machine."""
    env = {"VLLM_CPU_KVCACHE_SPACE": str(opts.kv_cache_gib)} if cpu else {}
    if cpu and opts.tensor_parallel_size > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_thread_bind(opts.tensor_parallel_size)
    return env


def cpu_thread_bind(world: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``world`` CPU workers: the allowed CPUs in ``world``
    contiguous lists ("0|1" on two CPUs), or "nobind" with fewer CPUs than workers."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if len(cpus) < world:
        return "nobind"
    n = len(cpus) // world
    return "|".join(",".join(str(c) for c in cpus[i * n : (i + 1) * n]) for i in range(world))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A ``vllm serve`` process on a loopback port (stopped by :meth:`stop` or at exit)."""

    def __init__(self, cmd: list, env: dict, port: int, timeout: float):
        self.port = port
        self.log = tempfile.NamedTemporaryFile("w+", prefix="kvcmas-vllm-serve-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        import atexit

        atexit.register(self.stop)
        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise BenchError(f"vllm serve exited ({self.proc.returncode}): {self.tail()} (log: {self.log.name})")
            if _healthy(port):
                return
            if time.monotonic() - t0 > timeout:
                self.stop()
                raise BenchError(f"vllm serve did not come up within {timeout:.0f} s (log: {self.log.name})")
            time.sleep(0.5)

    def tail(self, n: int = 3) -> str:
        lines = [x for x in Path(self.log.name).read_text(errors="replace").splitlines() if x.strip()]
        return " | ".join(lines[-n:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def _healthy(port: int, host: str = "127.0.0.1") -> bool:
    try:
        c = http.client.HTTPConnection(host, port, timeout=2)
        c.request("GET", "/health")
        ok = c.getresponse().status == 200
        c.close()
        return ok
    except OSError:
        return False


# ---- the client -------------------------------------------------------------------------------
@dataclass
class Streamed:
    """One streamed completion as the client saw it (times on the client's clock)."""

    sent_s: float
    first_s: float | None = None
    done_s: float | None = None
    tokens: list[int] = field(default_factory=list)
    first_logprobs: dict | None = None


class HTTP:
    """Completions over HTTP/1.1 (stdlib: a line arrives as soon as the server flushes it)."""

    def __init__(self, base_url: str):
        u = urlparse(base_url)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80

    def _conn(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=3600)

    def post(self, body: dict) -> dict:
        try:
            c = self._conn()
            c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            r = c.getresponse()
            data = r.read()
            c.close()
        except (OSError, http.client.HTTPException) as exc:
            raise ServerLost(
                f"the vLLM server at {self.host}:{self.port} was lost ({type(exc).__name__}: {exc})"
            ) from None
        if r.status != 200:
            raise BenchError(f"vLLM server answered {r.status}: {data[:300].decode(errors='replace')}")
        return json.loads(data)

    def get_text(self, path: str) -> str | None:
        """The body of ``GET path``, or None when the server does not answer it with 200."""
        try:
            c = self._conn()
            c.request("GET", path)
            r = c.getresponse()
            data = r.read()
            c.close()
        except OSError:
            return None
        return data.decode(errors="replace") if r.status == 200 else None

    def stream(self, body: dict, clock) -> Streamed:
        """One streamed completion; a stream that breaks off (no ``[DONE]``, a cut chunk, a lost
        connection) is a failed request (:class:`ServerLost`), never a short answer."""
        try:
            return self._stream(body, clock)
        except (OSError, http.client.HTTPException, json.JSONDecodeError) as exc:
            raise ServerLost(
                f"the vLLM server at {self.host}:{self.port} broke off a stream ({type(exc).__name__}: {exc})"
            ) from None

    def _stream(self, body: dict, clock) -> Streamed:
        out = Streamed(clock())
        done = False
        c = self._conn()
        c.request("POST", "/v1/completions", json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            raise BenchError(f"vLLM server answered {r.status}: {r.read()[:300].decode(errors='replace')}")
        while True:
            line = r.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[6:]
            if data == b"[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise BenchError(f"vLLM server error: {chunk['error']}")
            for ch in chunk.get("choices", []):
                toks = ch.get("token_ids") or []
                if toks and out.first_s is None:
                    out.first_s = clock()
                    lp = (ch.get("logprobs") or {}).get("top_logprobs")
                    if lp:
                        out.first_logprobs = {int(k.split(":", 1)[1]): float(v) for k, v in lp[0].items()}
                out.tokens += toks
        c.close()
        if not done:
            raise ServerLost(f"the vLLM server at {self.host}:{self.port} ended a stream without [DONE]")
        out.done_s = clock()
        return out


class ServerLost(EngineLost):
    """The server went away or broke off a response: the request failed."""


@dataclass
class ClientSession:
    """One prepared method: its worker-side session (named by its secret, :func:`~.guard.new_secret`),
    and what the client must send for it."""

    id: str
    name: str
    options: dict
    references: bool
    #: the method's name in the sweep (its records' ``method``)
    label: str = ""
    sent_refs: dict = field(default_factory=dict)
    #: system prompts captured on the worker for this session (they end with it), by ids: set once in
    system_sent: dict = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class Unit:
    """What the client sends as one trajectory: a serving trace, or a workload sample's agent graph
    (``run --engine vllm``). Its agents go in node order, each sent when the one before it ended."""

    id: str
    nodes: list[Node]
    #: ``request(index, outputs)``: agent ``index``'s whole request given the outputs so far (by node id)
    request: Callable[[int, dict[str, list[int]]], Request]


def trace_unit(trace: Trace) -> Unit:
    return Unit(trace.id, trace_nodes(trace), lambda i, outputs: trace.request(i, outputs))


@dataclass
class AgentSent:
    key: str
    trajectory: str
    agent: str
    arrival_s: float
    streamed: Streamed
    prompt: list[int] = field(default_factory=list)
    #: the agent's position in its unit, and its output as the client cut it (its next agents'
    #: prompts hold that output)
    index: int = 0
    output: list[int] = field(default_factory=list)

    @property
    def output_tokens(self) -> int:
        return len(self.output)


#: vLLM's own TTFT histogram (frontend arrival to the first token's output processing)
SERVER_TTFT_METRIC = "vllm:time_to_first_token_seconds"


def histogram_totals(text: str, name: str) -> tuple[float, int] | None:
    """Sum and count of the Prometheus histogram ``name`` in the exposition ``text``, added over its
    label sets (engines, model names); None when it is absent. A line whose value does not parse is
    skipped (a figure beside the measurement must not end a sweep)."""
    total, count, seen = 0.0, 0, False
    for line in text.splitlines():
        if not line.startswith(name + "_"):
            continue
        head, _, value = line.rpartition(" ")
        metric = head.split("{", 1)[0]
        try:
            number = float(value)
        except ValueError:
            continue
        if metric == name + "_sum":
            total += number
            seen = True
        elif metric == name + "_count":
            count += int(number)
            seen = True
    return (total, count) if seen else None


def ttft_cross_check(before, after, sent: Sequence[AgentSent]) -> dict:
    """The client's TTFT beside the server's over one QPS point: vLLM's histogram grew by the
    point's requests (``before``/``after``: :func:`histogram_totals`). The client's figure is
    send-to-first-streamed-token, so the difference is HTTP, the frontend's hand-offs and the
    client's own reading; it is given only when the server counted exactly the point's agents
    (context-free reference captures served in the point count too)."""
    client = [s.streamed.first_s - s.streamed.sent_s for s in sent if s.streamed.first_s is not None]
    out: dict = {"client_ttft_mean_s": sum(client) / len(client) if client else None}
    if before is None or after is None:
        return {**out, "server_ttft_count": None, "server_ttft_mean_s": None, "client_minus_server_ttft_s": None}
    n, total = after[1] - before[1], after[0] - before[0]
    server = total / n if n > 0 else None
    same = n == len(client) and server is not None and out["client_ttft_mean_s"] is not None
    return {
        **out,
        "server_ttft_count": n,
        "server_ttft_mean_s": server,
        "client_minus_server_ttft_s": out["client_ttft_mean_s"] - server if same else None,
    }


class VLLMServerEngine(ServedModel):
    """Serve trace requests through ``vllm serve`` with the connector (see the module docstring)."""

    name = "vllm"
    server = SERVER
    replays_service = False

    def __init__(self, model, device: str, dtype: str, ignore_eos: bool, warmup: bool, opts: ServerOptions):
        from .inprocess import _resolve_model, load_config_and_tokenizer

        path, self.model_name = _resolve_model(model)
        self.model_source = path
        self.config, self.tokenizer = load_config_and_tokenizer(path, model)
        #: the worker's EOS ids (it reads the same config: :func:`~.connector._runtime`)
        self.eos_ids = eos_ids(self.config)
        self.opts, self.dtype, self.ignore_eos, self.warmup = opts, dtype, ignore_eos, warmup
        self.cpu = device == "cpu" or (device == "auto" and not _has_cuda())
        self.server_proc: Server | None = None
        self.command: list | None = None
        if opts.base_url:
            self.base_url = opts.base_url.rstrip("/")
            if not _healthy(urlparse(self.base_url).port or 80, urlparse(self.base_url).hostname or "127.0.0.1"):
                raise BenchError(f"no healthy vLLM server at {self.base_url} (GET /health failed)")
        else:
            port = _free_port()
            self.command = serve_command(path, port, _dtype_arg(dtype, self.cpu), opts, self.cpu)
            env = {**server_env(opts, self.cpu), **os.environ}
            env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
            self.server_proc = Server(self.command, env, port, opts.startup_timeout)
            self.base_url = f"http://127.0.0.1:{port}"
        self.http = HTTP(self.base_url)
        self.max_model_len = opts.max_model_len or int(getattr(self.config, "max_position_embeddings", 4096) or 4096)
        self.logprobs: int | None = None
        #: the worker's session figures after each served QPS point (:meth:`serve`), in
        #: ``describe()["worker_reports"]``, hence in the sweep's ``config.json``
        self.point_reports: list[dict] = []
        self.last_session: dict = {}
        #: the worker's summary of each calibration (:meth:`calibrate`), in ``describe()``
        self.calibrations: list[dict] = []
        self.last_calibration: dict | None = None
        self._n = 0
        if warmup:
            self._request([1] * 8, 2, None)

    # ---- ServingEngine attributes ------------------------------------------------------------------
    @property
    def why_unsupported(self):
        return why_not_http

    def describe(self) -> dict:
        return {
            "name": self.name,
            "engine": "vLLM OpenAI-compatible server (`vllm serve`) + KVCMASConnector, harness as HTTP client",
            "base_url": self.base_url,
            "command": self.command,
            "device": "cpu" if self.cpu else "cuda",
            "dtype": self.dtype,
            "ignore_eos": self.ignore_eos,
            "warmup": self.warmup,
            "decoding": "greedy",
            "options": asdict(self.opts),
            "stop_at_first_token": self.opts.stop_at_first_token,
            "clock": "client wall clock (time.perf_counter); TTFT at the first streamed token",
            "prefix_cache": "salted per method session and QPS point; injected requests salted per request",
            "worker_reports": self.point_reports,
            "calibrations": self.calibrations,
        }

    def close(self) -> None:
        if self.server_proc is not None:
            self.server_proc.stop()

    # ---- requests ----------------------------------------------------------------------------
    def _body(self, prompt: Sequence[int], max_tokens: int, params: dict | None, salt: str | None = None) -> dict:
        body = {
            "model": SERVED_NAME,
            "prompt": [int(t) for t in prompt],
            "max_tokens": max_tokens,
            "temperature": 0.0,
            # run's agents stop at EOS (the client cuts at the same ids: agent_output); traces ignore it
            "ignore_eos": self.ignore_eos,
            **({} if self.ignore_eos else {"stop_token_ids": sorted(self.eos_ids)}),
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        }
        if self.logprobs:
            body["logprobs"] = self.logprobs
        if params is not None:
            body["kv_transfer_params"] = params
        meta = (params or {}).get(PROTOCOL)
        if isinstance(meta, dict):  # salted in the session's namespace (the server's edge does the same)
            if salt:
                meta["salt"] = salt
            body["cache_salt"] = expected_salt(meta)
        elif salt:
            body["cache_salt"] = salt
        return body

    def _request(self, prompt, max_tokens: int, params: dict | None, salt: str | None = None) -> dict:
        return self.http.post(self._body(prompt, max_tokens, params, salt))

    def _key(self) -> str:
        self._n += 1
        return f"k{self._n}-{uuid.uuid4().hex[:8]}"

    def _system_prompts(self, sess: ClientSession, traces: Sequence[Trace]) -> None:
        """Exact K/V of every agent's system prompt, captured on the worker once before timing."""
        for tr in traces:
            for a in getattr(tr, "agents", ()):  # a Unit's are captured as its agents are sent
                segs = a.segments
                if len(segs) > 1 and segs[0]["kind"] == "PF" and segs[0]["ids"] and segs[1]["kind"] == "PH":
                    self._system_prompt(sess, tuple(segs[0]["ids"]))

    def _system_prompt(self, sess: ClientSession, ids: tuple[int, ...]) -> None:
        """One system prompt captured on the worker, once per session; the prompt of a request that
        opens ``[PF_sys, PH, ...]``."""
        self._capture_once(sess, sess.system_sent, ids, "system")

    def _reference(self, sess: ClientSession, ids: tuple[int, ...]) -> None:
        """A context-free prefill of shared content, once per content per session (the worker keeps
        it)."""
        self._capture_once(sess, sess.sent_refs, ids, "reference")

    def _capture_once(self, sess: ClientSession, sent: dict, ids: tuple[int, ...], what: str) -> None:
        """A capture request of ``ids`` (:func:`~.worker.capture_params`), once per key of ``sent``:
        concurrent senders of the same one wait for the first, which lets them go even when it fails
        (their agents' plans then say what is missing)."""
        with sess.lock:
            ev = sent.get(ids)
            mine = ev is None
            if mine:
                ev = sent[ids] = threading.Event()
        if not mine:
            ev.wait()
            return
        try:
            self._request(ids, 1, capture_params(sess.id, what), salt=self._key())
        finally:
            ev.set()

    def _trajectory(
        self,
        sess: ClientSession,
        unit: Unit,
        qps,
        arrival: float | None,
        t0: float,
        out: list,
        calibrating: bool = False,
    ) -> None:
        """One unit's agents in order; ``arrival`` (None: now, single stream) on the point's clock.
        ``calibrating``: a held-out calibration trajectory the worker's recorder keeps."""
        now = lambda: time.perf_counter() - t0  # noqa: E731
        if arrival is not None and arrival > now():
            time.sleep(arrival - now())
        outputs: dict[str, list[int]] = {}
        tid = f"{unit.id}@{qps}"
        n = len(unit.nodes)
        stop_first = self.opts.stop_at_first_token
        for i, node in enumerate(unit.nodes):
            req = unit.request(i, outputs)
            req.node = node.id
            segs = req.segments
            if len(segs) > 1 and segs[0].kind == "PF" and segs[0].ids and segs[1].kind == "PH":
                self._system_prompt(sess, tuple(segs[0].ids))  # captured before timing (serve-sweep: all)
            arr = arrival if (i == 0 and arrival is not None) else now()
            if sess.references:
                for seg in req.segments:
                    if seg.kind == "PH":
                        self._reference(sess, tuple(seg.ids))
            key = self._key()
            params = agent_params(
                sess.id,
                sess.name,
                sess.options,
                tid,
                i,
                req,
                sorted(node.ancestors),
                key,
                last=i == n - 1,
                capture_output=not stop_first,
                ignore_eos=self.ignore_eos,
                calibrating=calibrating,
            )
            salt = f"{qps}" + (f"-{key}" if sess.name != "nonshared" else "")
            max_tokens = 1 if stop_first else req.max_new_tokens + 1
            got = self.http.stream(self._body(req.prompt_ids, max_tokens, params, salt), now)
            # the worker's definition of the output, on the same tokens: what its record and the next
            # agent's source hold (checked against its record in _records)
            toks = agent_output(got.tokens, req.max_new_tokens, self.eos_ids, self.ignore_eos)
            outputs[node.id] = toks
            out.append(AgentSent(key, unit.id, node.id, arr, got, list(req.prompt_ids), i, toks))

    def _serve_point(self, sess: ClientSession, traces, arrivals, qps, calibrating: bool = False) -> list[AgentSent]:
        """Every trajectory (a :class:`Trace` or a :class:`Unit`) of one point: one after another
        (``arrivals`` None), or each in its own thread from its arrival time."""
        sent: list[AgentSent] = []
        traces = [t if isinstance(t, Unit) else trace_unit(t) for t in traces]
        t0 = time.perf_counter()
        if arrivals is None:  # single stream: one trajectory after another
            for tr in traces:
                self._trajectory(sess, tr, qps, None, t0, sent, calibrating)
            return sent
        threads = []
        errors: list[BaseException] = []

        def run(tr, at):
            try:
                self._trajectory(sess, tr, qps, at, t0, sent, calibrating)
            except BaseException as exc:  # noqa: BLE001 (re-raised in the caller's thread)
                errors.append(exc)

        for tr, at in zip(traces, arrivals):
            th = threading.Thread(target=run, args=(tr, float(at)), daemon=True)
            th.start()
            threads.append(th)
        for th in threads:
            th.join()
        if errors:
            raise errors[0]
        return sent

    def report(self, sess: ClientSession, end: bool = False) -> tuple[dict, dict[str, dict]]:
        """The worker's records of ``sess`` finished so far, by request key, and its session figures
        (with the scheduler side's: ``requests_held_for_plan``, the requests it held back until
        their plan was in, since the previous report). The worker drops the session's context-free
        references with it (:func:`~.worker.report_params`)."""
        resp = self._request([1], 1, report_params(sess.id, end), salt=self._key())
        with sess.lock:  # the worker dropped the session's references: the next point sends its own
            sess.sent_refs.clear()
        params = resp.get("kv_transfer_params") or {}
        if params.get("kvcmas_error"):
            raise BenchError(f"the vLLM server refused the report: {params['kvcmas_error']}")
        reports = params.get("kvcmas_reports")
        if reports is None:
            raise BenchError("the vLLM server did not answer the report (is it running KVCMASConnector?)")
        failed = next((r["error"] for r in reports if "error" in r and "kvcmas_key" not in r), None)
        if failed:
            raise BenchError(f"the vLLM worker could not answer the report: {failed}")
        session = {**next((r["session"] for r in reports if "session" in r), {}), **params.get("kvcmas_scheduler", {})}
        return session, {r.pop("kvcmas_key"): r for r in reports if "kvcmas_key" in r}

    def calibrate(self, sess: ClientSession, traces: Sequence[Trace]) -> dict:
        """Offline calibration on the server: ``traces`` served single stream as calibration agents
        (every shared segment prefilled by vLLM and recorded by the worker, with its context-free
        reference when the method needs one), then one calibrate request builds the method's state
        in the worker from those caches. Returns the worker's summary (observations, config)."""
        self._system_prompts(sess, traces)
        self._serve_point(sess, list(traces), None, "calibration", calibrating=True)
        self.report(sess)  # the calibration agents' records are not measurements
        resp = self._request([1], 1, calibrate_params(sess.id, sess.name, sess.options), salt=self._key())
        answers = (resp.get("kv_transfer_params") or {}).get("kvcmas_reports")
        if not answers:
            raise BenchError("the vLLM server did not answer the calibration (is it running KVCMASConnector?)")
        got = answers[0]
        if "error" in got:
            raise BenchError(f"calibration of {sess.label or sess.name} on the vLLM worker failed: {got['error']}")
        self.last_calibration = got["calibration"]
        self.calibrations.append({"method": sess.label or sess.name, **self.last_calibration})
        return self.last_calibration

    def _records(self, sess: ClientSession, sent: list[AgentSent], qps) -> list[RequestRecord]:
        session, by_key = self.report(sess)
        out = [self.record(s, by_key.get(s.key), qps) for s in sorted(sent, key=lambda s: s.streamed.done_s)]
        self.last_session = session
        return out

    @staticmethod
    def record(s: AgentSent, d: dict | None, qps) -> RequestRecord:
        """The worker's record ``d`` of the request ``s``, completed with the client's clock."""
        if d is None:
            raise BenchError(f"the vLLM worker has no record of request {s.key}")
        if "error" in d and "segments" not in d:
            raise BenchError(f"the vLLM worker could not plan request {s.key}: {d['error']}")
        rec = RequestRecord.from_dict(d)
        if rec.output_tokens != s.output_tokens:
            raise BenchError(
                f"request {s.key}: the vLLM worker recorded {rec.output_tokens} output tokens, the client "
                f"sent the next agents {s.output_tokens}"
            )
        st = s.streamed
        rec.qps, rec.arrival_s, rec.start_s = qps, s.arrival_s, st.sent_s
        rec.first_token_s, rec.completion_s = st.first_s, st.done_s
        rec.queue_s = st.sent_s - s.arrival_s
        rec.ttft_s, rec.e2e_s = st.first_s - s.arrival_s, st.done_s - s.arrival_s
        return rec

    # ---- the ServingEngine protocol ------------------------------------------------------------------
    def session(self, spec: MethodSpec) -> tuple[Method, ClientSession]:
        reason = why_not_http(spec.cls)
        if reason:
            raise BenchError(f"--engine vllm cannot run {spec.name}: {reason}")
        m = spec()
        sess = ClientSession(
            new_secret(),
            spec.cls.name,
            dict(spec.kwargs),
            m.reuse_from == "reference",
            label=spec.name,
        )
        m._kvcmas_session = sess  # type: ignore[attr-defined]
        return m, sess

    def prepare(self, spec: MethodSpec, calibration: Sequence[Trace]) -> Method:
        """A fresh worker-side session, calibrated in the worker on the held-out trajectories of split
        "calibration" when the method needs it (:meth:`calibrate`); online learners warm up on every
        held-out trajectory, the others on one."""
        m, sess = self.session(spec)
        held = list(calibration)
        if m.needs_calibration:
            calib = [t for t in held if t.split == "calibration"]
            if not calib:
                raise BenchError(f"method {spec.name!r} needs calibration trajectories (none given)")
            self.calibrate(sess, calib)
        if self.warmup and held:
            self._system_prompts(sess, held)
            warm = held if m.learns_online else held[:1]
            self._serve_point(sess, warm, None, "warmup")
            self.report(sess)
        return m

    def _server_ttft(self, expect: int = 0, since: tuple[float, int] | None = None) -> tuple[float, int] | None:
        """vLLM's TTFT histogram totals from ``/metrics`` (None: not served there). With ``since``,
        waits up to a second for ``expect`` more observations (the frontend records a step's
        stats right after handing its tokens out)."""
        deadline = time.monotonic() + 1.0
        while True:
            text = self.http.get_text("/metrics")
            got = None if text is None else histogram_totals(text, SERVER_TTFT_METRIC)
            if since is None or got is None or got[1] - since[1] >= expect or time.monotonic() > deadline:
                return got
            time.sleep(0.05)

    def run_trajectory(self, trace: Trace, method: Method, qps=None) -> list[RequestRecord]:
        sess = method._kvcmas_session  # type: ignore[attr-defined]
        self._system_prompts(sess, [trace])
        self.last_sent = self._serve_point(sess, [trace], None, qps)
        return self._records(sess, self.last_sent, qps)

    def serve(self, method: Method, traces: Sequence[Trace], schedules: Schedules, on_point=None) -> ServeResult:
        """Every QPS point served on the deployment (the session's method state carries over from
        one point to the next); ``on_point`` gets each point's records as it completes."""
        sess = method._kvcmas_session  # type: ignore[attr-defined]
        self._system_prompts(sess, traces)
        timelines = {}
        for q, arrivals in schedules.items():
            before = self._server_ttft()
            sent = self._serve_point(sess, traces, None if arrivals is None else list(arrivals), q)
            check = ttft_cross_check(before, self._server_ttft(len(sent), before), sent)
            timelines[q] = self._records(sess, sent, q)
            self.point_reports.append({**point_report(sess.label or sess.name, traces, q, self.last_session), **check})
            if on_point is not None:
                on_point(q, timelines[q])
        self.report(sess, end=True)
        return ServeResult(timelines, None)


def point_report(method: str, traces: Sequence[Trace], qps, session: dict) -> dict:
    """One QPS point's worker figures (scalars of the session report: memory held and its peak, the
    bytes per trajectory at completion, trajectories still live, requests held for a plan, how the
    connector reaches the paged cache)."""
    shared = sorted({t.shared_tokens for t in traces})
    figures = {k: v for k, v in session.items() if v is None or isinstance(v, (int, float, str))}
    return {"method": method, "shared_tokens": shared[0] if len(shared) == 1 else shared, "qps": qps, **figures}


def why_not_http(method_cls) -> str | None:
    from . import why_not

    return why_not(method_cls, partial_forwards=True)


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


def _dtype_arg(dtype: str, cpu: bool) -> str:
    if dtype in (None, "", "auto"):
        return "float32" if cpu else "bfloat16"
    return dtype
