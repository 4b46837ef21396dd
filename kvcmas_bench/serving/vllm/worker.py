"""The connector's worker side in a normal vLLM deployment (``vllm serve`` with the connector): the
methods run here, next to the paged KV cache, from metadata the requests carry.

A request's ``kv_transfer_params`` hold ``{"kvcmas": {...}}`` (:func:`agent_params`,
:func:`capture_params`, :func:`report_params` build them on the client): for an agent, its session
(one method instance with its options: its pools live here for the whole session), trajectory,
position in it, node (id and ancestors) and its segments as lengths, kinds and slot ids. The prompt
tokens come with the request. No tensor crosses the wire.

:class:`WorkerRuntime` keeps, per session, each live trajectory's materialized segments and
captured outputs (the sources of its later agents; freed when its last agent finishes, and
evicted least-recently-used beyond a byte budget), the agents' system-prompt K/V and the
context-free references (captured by prefill-only requests the client sends once per content).
Every piece of method work (planning a request: gate, correction, re-alignment; anchor updates
after a dense prefill; chaining and the request's record at its end) runs in one background
thread (:class:`Jobs`: plans first, everything else in arrival order, each trajectory's own jobs in
order), so it never runs inside an engine step: a request whose plan is not
ready is simply not scheduled yet (``get_num_new_matched_tokens`` answers None), and the other
requests keep stepping. Requests of a method with nothing to plan (NonShared,
:func:`waits_for_plan`) are never held: the scheduler side answers 0 at once, vLLM serves them as
plain requests, and the worker only writes their records. The plan itself
(:class:`~.plan.Plan`: prefix, overrides, captures) is executed by the connector exactly as on the
in-process engine, through :func:`~.flow.TrajectoryRun.plan`, so both engines share the methods'
plan code.
"""

from __future__ import annotations

import copy
import ctypes
import os
import threading
import time
import traceback
import zlib
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch

from ...methods.knobs import method_class
from ...segments import Request, Segment, SegmentKV
from ...workflow import Node
from ...workloads.base import Role
from .flow import EngineRequest, ModelFacts, NeedKV, Runtime, TrajectoryRun, plans_nothing
from .guard import PROTOCOL, VERSION, session_tag
from .plan import Capture, Plan

#: seconds a session may sit idle (no request, report or end) before the worker drops it
SESSION_IDLE_S = 900.0
ABANDONED = "TimeoutError: the scheduler gave up waiting for its plan (deadline_s) and served it plain"


# ---- the wire format (client side) ------------------------------------------------------------
def agent_params(  # noqa: PLR0913  (the fields of one request's kv_transfer_params)
    session: str,
    method: str,
    options: dict,
    trajectory: str,
    index: int,
    req: Request,
    ancestors: list[int],
    key: str,
    last: bool,
    capture_output: bool = True,
    ignore_eos: bool = True,
    calibrating: bool = False,
) -> dict:
    """``kv_transfer_params`` of one agent request: small metadata, never tensors. ``calibrating``:
    an agent of a held-out calibration trajectory, served densely while the session's recorder
    keeps its caches (:meth:`WorkerRuntime._calibrate` then builds the method's state from them)."""
    params = {
        PROTOCOL: {
            "v": VERSION,
            "op": "agent",
            "session": session,
            "method": method,
            "options": options,
            "trajectory": trajectory,
            "index": index,
            "agent": req.agent,
            "node": req.node or req.agent,
            "ancestors": list(ancestors),
            "segments": [
                {
                    "kind": s.kind,
                    "n": len(s.ids),
                    "slot": s.slot,
                    "name": s.name,
                    "content_key": s.content_key,
                    "schedule": s.schedule,
                }
                for s in req.segments
            ],
            "max_new_tokens": req.max_new_tokens,
            "capture_output": capture_output,
            "ignore_eos": ignore_eos,
            "last": last,
            "key": key,
        }
    }
    if calibrating:
        params[PROTOCOL]["calibrating"] = True
    return params


def capture_params(session: str, what: str) -> dict:
    """A prefill-only request whose K/V (positions 0..) the worker keeps: ``what`` is "system" (an
    agent's system prompt, exact) or "reference" (a context-free prefill of shared content)."""
    return {PROTOCOL: {"v": VERSION, "op": "capture", "session": session, "what": what}}


def calibrate_params(session: str, method: str, options: dict) -> dict:
    """A one-token request that calibrates ``session``'s method (GraphFlow: its per-relation mean
    corrections) on what the session's calibration agents recorded, answered like a report with
    the calibration's summary (or its error)."""
    return {PROTOCOL: {"v": VERSION, "op": "calibrate", "session": session, "method": method, "options": options}}


#: operations answered in the finished response's ``kv_transfer_params`` (``kvcmas_reports``)
ANSWERED_OPS = ("report", "calibrate")


def report_params(session: str, end: bool = False) -> dict:
    """A one-token request answered with every record of ``session`` finished so far (in the
    non-streamed response's ``kv_transfer_params``); ``end`` also drops the session. It also drops
    the session's context-free references: a report closes a QPS point (or the warm-up, or the
    calibration), and the next one computes its own, as the other engines do, so no point is
    served references another point paid for."""
    return {PROTOCOL: {"v": VERSION, "op": "report", "session": session, "end": end}}


def _traj_key(meta: dict) -> tuple:
    return (meta.get("session"), meta.get("trajectory"))


def waits_for_plan(meta: dict) -> bool:
    """Whether the scheduler side holds this request until the worker has planned it: agents of a
    method that plans (reuses, corrects or captures K/V). NonShared leaves every segment to vLLM, so
    its requests go through as plain ones (no planning round trip in their TTFT); capture and
    report requests are not planned either. An unknown method waits (its planning reports it)."""
    if meta.get("op") != "agent":
        return False
    try:
        return not plans_nothing(method_class(meta["method"]))
    except Exception:  # noqa: BLE001  (the worker's planning says what is wrong)
        return True


def request_from(meta: dict, prompt: list[int]) -> tuple[Node, Request]:
    """The agent's node and whole request, rebuilt from its metadata and prompt tokens."""
    segs, pos = [], 0
    for s in meta["segments"]:
        n = int(s["n"])
        segs.append(
            Segment(
                s["kind"],
                list(prompt[pos : pos + n]),
                slot=s.get("slot"),
                name=s.get("name") or "",
                content_key=s.get("content_key"),
                schedule=s.get("schedule"),
            )
        )
        pos += n
    if pos != len(prompt):
        raise ValueError(f"segments cover {pos} tokens, the prompt has {len(prompt)}")
    ancestors = [int(i) for i in meta.get("ancestors") or []]
    name = meta.get("node") or meta["agent"]
    node = Node(name, Role(name, "", ""), ancestors, set(ancestors), final=bool(meta.get("last")))
    return node, Request(meta["agent"], segs, int(meta["max_new_tokens"]), node=name)


# ---- the worker side ----------------------------------------------------------------------------
@dataclass
class Live:
    """A request the worker holds a plan for (agents), or captures for (prefill-only requests)."""

    meta: dict
    plan: Plan | None = None
    session: Session | None = None
    trajectory: TrajectoryRun | None = None
    capture: Capture | None = None
    ids: tuple[int, ...] = ()
    claim: int = 0
    prompt_done: bool = False
    error: str | None = None
    #: the scheduler side waits for this request's claim (:func:`waits_for_plan`)
    waits: bool = True
    #: the scheduler side gave up waiting for its plan (:meth:`WorkerRuntime.abandon`)
    abandoned: bool = False
    #: the agent's own state and position (several agents of one trajectory may be in flight at
    #: once, a fan-out: the trajectory is pointed at this one before any of its work runs, :meth:`on`)
    agent: object | None = None
    index: int = 0
    #: when the worker heard of it (``time.perf_counter``), and how long its plan waited for the
    #: method thread after that (other jobs ahead of it)
    arrived: float = field(default_factory=time.perf_counter)
    plan_wait_s: float | None = None


def limit_blas_threads(n: int) -> int | None:
    """Limit MKL to ``n`` threads for the calling thread only (``MKL_Set_Num_Threads_Local``); MKL's
    thread count for this thread afterwards, or None where torch's build exports no MKL.

    The method thread needs it: MKL's LAPACK, run from a thread other than the main one while MKL
    keeps the process's thread count (2 here), is an order of magnitude slower. On this 2-core
    machine one batched ``torch.linalg.eigh`` of 30 192x192 Gram matrices (an anchor factorization's
    core) took 0.49 s on a second thread against 0.044 s on the main thread, and 0.046 s on the
    second thread once limited to one thread. ``torch.set_num_threads`` cannot do this: it is
    process-wide (it slowed the main thread's GEMMs too), and vLLM's CPU worker replaces it with a
    no-op once its threads are bound. The forward's OpenMP threads are left alone."""
    lib = mkl_library()
    if lib is None:
        return None
    lib.MKL_Set_Num_Threads_Local(int(n))
    return int(lib.MKL_Get_Max_Threads())


def mkl_library() -> ctypes.CDLL | None:
    """Torch's own ``libtorch_cpu`` when it exports MKL's per-thread controls
    (``MKL_Set_Num_Threads_Local``, ``MKL_Get_Max_Threads``); None for a build without them."""
    if not torch.backends.mkl.is_available():
        return None
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        lib.MKL_Set_Num_Threads_Local, lib.MKL_Get_Max_Threads  # noqa: B018  (both exported, or None)
    except (OSError, AttributeError):
        return None
    return lib


class Jobs:
    """The method thread's queue. A plan (``urgent``: a request is held until it is in) runs before
    background work (anchor updates, chaining, records, reports), except the background jobs of its
    own trajectory queued before it, which run first: an agent is planned on its predecessors'
    chained caches. Everything else keeps arrival order. Plans thus no longer wait behind other
    trajectories' anchor factorizations; a plan may see a pool without the anchors those would have
    added (as it would had it arrived earlier). ``prioritize=False``: one FIFO queue (tensor
    parallelism: every rank must run its jobs in the same order, whatever their timing)."""

    def __init__(self, prioritize: bool = True):
        self.prioritize = prioritize
        self._cv = threading.Condition()
        self._urgent: deque = deque()
        self._background: deque = deque()
        self._seq = 0

    def put(self, fn: Callable[[], None] | None, urgent: bool = False, trajectory: Hashable = None) -> None:
        with self._cv:
            self._seq += 1
            (self._urgent if urgent and self.prioritize else self._background).append((self._seq, trajectory, fn))
            self._cv.notify()

    def get(self) -> Callable[[], None] | None:
        """The next job (None: stop), blocking until there is one."""
        with self._cv:
            while not self._urgent and not self._background:
                self._cv.wait()
            if self._urgent:
                seq, traj, fn = self._urgent[0]
                for i, (s, t, job) in enumerate(self._background):
                    if s > seq:
                        break
                    if t is not None and t == traj:
                        del self._background[i]
                        return job
                return self._urgent.popleft()[2]
            return self._background.popleft()[2]


@dataclass
class Session:
    """One method instance (its pools) and the trajectories it serves."""

    method: object
    rt: Runtime
    trajectories: OrderedDict = field(default_factory=OrderedDict)
    reports: list = field(default_factory=list)
    evicted: int = 0
    #: what the session's calibration agents recorded (:class:`~kvcmas_bench.calibration.Recorder`:
    #: dense prefills, their context-free references), until :meth:`WorkerRuntime._calibrate`
    recorder: object | None = None
    #: since the previous report: the bytes each trajectory held when its last agent finished
    completed_bytes: list[int] = field(default_factory=list)


class WorkerRuntime:
    """Method work next to vLLM's KV cache (see the module docstring). ``budget_bytes`` bounds the
    K/V held for live trajectories and captured references (least recently used go first)."""

    def __init__(  # noqa: PLR0913
        self,
        facts: ModelFacts,
        eos_ids: set[int],
        budget_bytes: int | None = None,
        rank: int = 0,
        layers=None,
        idle_s: float = SESSION_IDLE_S,
    ):
        self.facts, self.eos_ids, self.budget, self.idle_s = facts, set(eos_ids), budget_bytes, idle_s
        #: partial forwards on the served model (:class:`~.layers.LazyLayers`; None in tests without vLLM)
        self.layers = layers
        #: under tensor parallelism: this rank's KV heads and the group's collectives (:mod:`.tp`)
        self.shards = facts.shards
        self.rank = self.shards.rank if self.shards is not None else rank
        #: rank 0 answers the scheduler and keeps the records; the other ranks plan the same
        #: requests on their own heads, in the same order, and answer nothing
        self.publishes = self.rank == 0
        #: every map below is keyed by a session's secret (:mod:`.guard`): nothing crosses sessions.
        #: Each session's agents' system-prompt K/V (exact; captured by prefill-only requests)
        self.system_kv: dict[str, dict[tuple[int, ...], SegmentKV]] = {}
        #: when each session last sent anything (``time.monotonic``): idle ones expire (:meth:`_expire`)
        self.touched: dict[str, float] = {}
        #: sessions expired for idleness, and whole sessions evicted beyond the budget, so far
        self.expired = 0
        self.sessions_evicted = 0
        #: CUDA: an event recorded on the engine's stream after the last step's capture copies; every
        #: method-thread job waits for it first (the copies were only queued on that stream, and the
        #: method thread reads them from another thread); None on CPU, where the copies are done
        self.step_event = None
        self.ledger_bytes = 0  #: the method thread's last count (:meth:`_note_held`), read for /metrics
        #: the ledger figures last sent to ``/metrics`` and when (:meth:`ledger_figures`)
        self._ledger_sent: dict | None = None
        self._ledger_at = float("-inf")
        #: context-free references per session (captured before the session's first agent may
        #: exist), each session's ``facts.ready``; dropped at the session's every report
        self.references: dict[str, dict[tuple[int, ...], SegmentKV]] = {}
        self.sessions: dict[str, Session] = {}
        self.live: dict[str, Live] = {}
        self.lock = threading.Lock()
        #: answers for the scheduler side (through the connector's worker metadata)
        self.claims: dict[str, int] = {}
        self.answers: dict[str, list] = {}
        self.errors: dict[str, str] = {}
        self.jobs = Jobs(prioritize=self.shards is None or self.shards.world <= 1)
        #: busy seconds by kind of job (:meth:`submit`'s ``kind``); :attr:`busy_s` is their sum
        self.busy_by_kind: dict[str, float] = {}
        #: the thread's CPU seconds by kind (:func:`time.thread_time`): below :attr:`busy_by_kind`
        #: by the time its jobs waited for a core or for the GIL
        self.cpu_by_kind: dict[str, float] = {}
        #: the most :meth:`held_bytes` since the previous report (:meth:`_note_held`)
        self.held_peak = 0
        #: how the connector reaches each layer's paged cache: "strided" views or "flat" offsets
        #: (:class:`~.layout.KVLayout`), by layer name
        self.kv_access: dict[str, str] = {}
        #: MKL's threads for the method thread (:func:`limit_blas_threads`; None: no MKL)
        self.blas_threads: int | None = None
        self._thread = threading.Thread(target=self._loop, name="kvcmas-method-work", daemon=True)
        self._thread.start()

    # ---- the background thread -----------------------------------------------------------------
    def _loop(self) -> None:
        self.blas_threads = limit_blas_threads(1)
        while True:
            fn = self.jobs.get()
            if fn is None:
                return
            try:
                fn()
            except Exception:  # a failed job must not stop the worker: report it, go on
                traceback.print_exc()

    @property
    def busy_s(self) -> float:
        """Seconds the method thread has spent on jobs since it started."""
        return sum(self.busy_by_kind.values())

    def submit(
        self, fn: Callable[[], None], urgent: bool = False, trajectory: Hashable = None, kind: str = "other"
    ) -> None:
        """Queue method work (:class:`Jobs`): ``urgent`` for a plan, ``trajectory`` (session,
        trajectory) for work whose order within its trajectory matters. Its run time is added to
        :attr:`busy_by_kind` under ``kind`` (plan, first_token, finish, report)."""

        def job() -> None:
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                event = self.step_event
                if event is not None:  # the captures this job may read are on the device by now
                    event.synchronize()
                fn()
            finally:
                self.busy_by_kind[kind] = self.busy_by_kind.get(kind, 0.0) + time.perf_counter() - t0
                self.cpu_by_kind[kind] = self.cpu_by_kind.get(kind, 0.0) + time.thread_time() - c0

        self.jobs.put(job, urgent, trajectory)

    def drain(self) -> None:
        """Wait until every queued job ran (tests)."""
        done = threading.Event()
        self.submit(done.set)
        done.wait()

    def close(self) -> None:
        self.jobs.put(None)

    # ---- sessions ------------------------------------------------------------------------------
    def session(self, meta: dict) -> Session:
        name = meta["session"]
        s = self.sessions.get(name)
        if s is None:
            method = method_class(meta["method"])(**(meta.get("options") or {}))
            facts = copy.copy(self.facts)  # the model's facts, with this session's references
            with self.lock:
                facts.ready = self._references(name)
                system = self.system_kv.setdefault(name, {})
            rt = Runtime(facts, system_kv=system, eos_ids=self.eos_ids, layers=self.layers)
            rt.ignore_eos = bool(meta.get("ignore_eos", True))
            s = Session(method, rt)
            self.sessions[name] = s
        return s

    def _references(self, session) -> dict:
        """The session's references (its ``facts.ready``); the caller holds :attr:`lock`."""
        return self.references.setdefault(str(session), {})

    def _expire(self) -> None:
        """Drop every session idle for more than :attr:`idle_s` (its trajectories, references and
        system prompts): a client that vanished leaves nothing behind. Method thread only."""
        cutoff = time.monotonic() - self.idle_s
        with self.lock:
            busy = {str(live.meta.get("session")) for live in self.live.values()}
            stale = [name for name, t in self.touched.items() if t < cutoff and name not in busy]
        for name in stale:
            self.expired += name in self.sessions
            self._drop_session(name)

    # ---- what the connector calls ----------------------------------------------------------------
    def new_request(self, req_id: str, meta: dict, prompt: list[int]) -> None:
        """A request with kvcmas metadata reached the worker: plan it (agents), or get its capture
        ready (prefill-only requests), or answer it (reports), off the engine's thread."""
        op = meta.get("op")
        with self.lock:
            self.touched[str(meta.get("session"))] = time.monotonic()
        if op == "capture":
            cap = self._capture_buffer(len(prompt))  # None: over the budget, nothing is kept
            with self.lock:
                self.live[req_id] = Live(meta, capture=cap, ids=tuple(prompt), error=None if cap else "over budget")
            return
        if op == "report":
            self.submit(lambda: self._report(req_id, meta), kind="report")
            return
        if op == "calibrate":
            self.submit(lambda: self._calibrate(req_id, meta), kind="calibrate")
            return
        with self.lock:
            self.live[req_id] = Live(meta, waits=waits_for_plan(meta))
        self.submit(lambda: self._plan(req_id, meta, prompt), urgent=True, trajectory=_traj_key(meta), kind="plan")

    def _capture_buffer(self, tokens: int) -> Capture | None:
        """Buffers for a prefill-only capture (engine thread), or None when they would take the
        ledger past the budget or cannot be allocated: the request then runs plain and keeps nothing."""
        need = self.facts.token_bytes * tokens
        try:
            if self.budget is not None and self.held_bytes() + need > self.budget:
                return None
            k, v = self.facts.empty(tokens)
        except (RuntimeError, MemoryError):  # a count that raced the method thread, or out of memory
            return None
        return Capture(0, k, v)

    def abandon(self, req_id: str) -> None:
        """The scheduler side gave up waiting for ``req_id``'s plan (its deadline) and lets it run
        plain: whatever its planning produces, or produced, is not applied, and its record is the error."""
        with self.lock:
            live = self.live.get(req_id)
            if live is not None:
                live.abandoned = True
                live.plan, live.claim, live.trajectory = None, 0, None
                live.error = live.error or ABANDONED

    def _tidy(self) -> None:
        """After a capture is kept: expire idle sessions, count the ledger, get back under the budget."""
        self._expire()
        self._note_held()
        try:
            self._evict(None, None)
        except MemoryError:
            pass

    def _plan(self, req_id: str, meta: dict, prompt: list[int]) -> None:
        live = self.live[req_id]
        live.plan_wait_s = time.perf_counter() - live.arrived
        sess = traj = plan = None
        claim, error, outcome = 0, None, ""
        try:
            self._expire()
            sess = self.session(meta)
            traj = self._trajectory(sess, meta)
            node, req = request_from(meta, prompt)
            traj.index = int(meta["index"])
            traj.begin_request(node, req, 0.0)
            same_tokens(req, traj.agent.sources)
            got = traj.plan()
            if isinstance(got, NeedKV):
                raise RuntimeError(
                    f"no context-free reference of a {len(got.ids)}-token segment on the worker "
                    "(the client sends one capture request per content before the agent)"
                )
            assert isinstance(got, EngineRequest)
            if list(got.prompt) != list(prompt):
                raise RuntimeError("the plan's prompt differs from the request's")
            traj.submitted(0.0)
            live.agent, live.index = traj.agent, traj.index
            plan = got.plan
            claim = min(plan.prefix_len if plan is not None else 0, len(prompt) - 1)
            outcome = "|".join(f"{m}:{r.status}" for m, r in zip(traj.agent.modes, traj.agent.records))
            self._evict(traj, sess)
        except Exception as exc:  # serve it dense, say why in its record
            traceback.print_exc()
            error = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, MemoryError) and sess is not None:  # over budget: keep nothing of it
                sess.trajectories.pop(meta["trajectory"], None)
        if self.shards is not None and self.shards.world > 1:
            # one outcome for the whole TP group: the tokens claimed and every segment's mode and status
            lo, hi, failed = self.shards.agree([claim, zlib.crc32(outcome.encode())], error is not None)
            if error is None and failed:
                error = "RuntimeError: planning failed on another tensor-parallel rank"
            elif error is None and lo != hi:
                error = f"RuntimeError: tensor-parallel ranks disagree on the plan (claims {lo[0]}..{hi[0]} tokens)"
        with self.lock:
            if live.abandoned:
                error = error or ABANDONED
            if error is not None:
                sess = traj = plan = None
                claim = 0
            live.session, live.trajectory, live.plan, live.claim, live.error = sess, traj, plan, claim, error
        if self.shards is not None:
            self.shards.barrier()  # every rank's request state is final before the scheduler hears of it
        if self.publishes and live.waits:  # nothing to answer for a request that is not held (NonShared)
            with self.lock:
                self.claims[req_id] = claim
                if error:
                    self.errors[req_id] = error

    def _trajectory(self, sess: Session, meta: dict) -> TrajectoryRun:
        """The request's trajectory in its session (new for its first agent), marked as just used."""
        traj = sess.trajectories.get(meta["trajectory"])
        if traj is None:
            method = self._recorder(sess) if meta.get("calibrating") else sess.method
            traj = TrajectoryRun(
                sess.rt, None, method, bool(meta.get("capture_output", True)), trajectory_id=meta["trajectory"]
            )
            sess.trajectories[meta["trajectory"]] = traj
        sess.trajectories.move_to_end(meta["trajectory"])
        traj.used = time.monotonic()
        return traj

    @staticmethod
    def _recorder(sess: Session):
        """The session's recorder: every shared segment of a calibration agent prefilled by vLLM and
        kept with its context-free reference when the method calibrates against one (GraphFlow),
        as :func:`kvcmas_bench.calibration.collect` records on the other engines."""
        if sess.recorder is None:
            from ...calibration import Recorder

            sess.recorder = Recorder(with_reference=bool(getattr(type(sess.method), "calibration_reference", False)))
        return sess.recorder

    def _calibrate(self, req_id: str, meta: dict) -> None:
        """Calibrate the session's method on its recorder's observations (each rank on its own
        heads), then drop them; the answer is the calibration's summary or its error."""
        out: dict
        try:
            sess = self.session(meta)
            obs = list(getattr(sess.recorder, "observations", None) or [])
            if not obs:
                raise RuntimeError("calibration produced no observations (no calibration agent was served)")
            sess.method.calibrate(obs, self.facts.n_layers)
            sess.recorder = None
            out = {"calibration": {"observations": len(obs), "config": sess.method.config()}}
        except Exception as exc:  # noqa: BLE001  (the client raises it as one line)
            traceback.print_exc()
            out = {"error": f"{type(exc).__name__}: {exc}"}
        if self.publishes:
            with self.lock:
                self.answers[req_id] = [out]

    def plan_of(self, req_id: str) -> Plan | None:
        live = self.live.get(req_id)
        return None if live is None else (live.plan if live.capture is None else Plan(captures=[live.capture]))

    def captured(self, req_id: str) -> None:
        """After a step wrote K/V of ``req_id``: a complete capture request is kept; an agent whose
        dense segments are all in gets its deferred method work (anchor updates) queued."""
        live = self.live.get(req_id)
        if live is None:
            return
        if live.capture is not None:
            if live.capture.complete and not live.prompt_done:
                live.prompt_done = True
                kv = SegmentKV(k=live.capture.k, v=live.capture.v, start=0, ids=live.ids)
                with self.lock:
                    if live.meta.get("what") == "system":
                        self.system_kv.setdefault(str(live.meta.get("session")), {})[live.ids] = kv
                    else:
                        self._references(live.meta.get("session"))[live.ids] = kv
                self.submit(self._tidy, kind="tidy")
            return
        if live.plan is None or live.prompt_done or live.trajectory is None:
            return
        agent = live.agent
        if agent is not None and all(c.complete for c in agent.captures):
            live.prompt_done = True
            self.submit(lambda: on(live).first_token(0.0, None), trajectory=_traj_key(live.meta), kind="first_token")

    def finished(self, req_id: str, output: list[int]) -> None:
        """The request completed with ``output`` tokens: chain its caches and write its record."""
        live = self.live.get(req_id)
        if live is None:
            return
        if live.meta.get("op") == "capture":
            with self.lock:
                self.live.pop(req_id, None)
            return
        self.submit(lambda: self._finish(req_id, live, list(output)), trajectory=_traj_key(live.meta), kind="finish")

    def _finish(self, req_id: str, live: Live, output: list[int]) -> None:
        with self.lock:
            self.live.pop(req_id, None)
            self.claims.pop(req_id, None)
        meta = live.meta
        if live.trajectory is None or live.session is None:
            sess = self.sessions.get(meta["session"])
            if sess is not None:
                sess.reports.append({"kvcmas_key": meta["key"], "error": live.error or "not planned"})
            return
        traj, sess = on(live), live.session
        try:
            if not live.prompt_done and traj.agent is not None:
                traj.first_token(0.0, None)
            if traj.agent is not None and output:
                traj.agent.first_token = output[0]
            rec = traj.finished(0.0, output, live.claim).to_dict()
        except Exception as exc:
            traceback.print_exc()
            rec = {"error": f"{type(exc).__name__}: {exc}"}
        rec["kvcmas_key"] = meta["key"]
        rec["plan_wait_s"] = live.plan_wait_s
        sess.reports.append(rec)
        self._note_held()  # the agent's caches are chained: the trajectory holds the most now
        if meta.get("last"):
            sess.completed_bytes.append(_unique_bytes(kv for hist in traj.store.values() for _, kv in hist))
            sess.trajectories.pop(meta["trajectory"], None)
            self._note_held()  # freed: the ledger /metrics shows drops now
            return
        try:  # the chained caches count from now: back under the budget before anything else runs
            self._evict(traj, sess)
        except MemoryError:  # this trajectory alone is over the budget: its later agents find no source
            if sess.trajectories.pop(meta["trajectory"], None) is not None:
                sess.evicted += 1

    def _report(self, req_id: str, meta: dict) -> None:
        """Answer a report (or its error: a failed step never leaves the request waiting)."""
        try:
            out = self._report_out(meta)
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            out = [{"error": f"{type(exc).__name__}: {exc}"}]
        if self.publishes:
            with self.lock:
                self.answers[req_id] = out

    def _report_out(self, meta: dict) -> list:
        """The session's records since its previous report, after one figures entry: the worker's
        own (memory ledger, method work; given to any session's report, as on ``/metrics``) and, for
        a session the worker holds, the session's."""
        self._expire()
        name = str(meta["session"])
        sess = self.sessions.get(name)
        self._note_held()  # the peak, references included
        with self.lock:  # in place: the session's facts hold this dict
            self.references.get(name, {}).clear()
        figures = {"session": session_tag(name), **self._worker_figures()}
        out: list = []
        if sess is not None:
            out, sess.reports = sess.reports, []
            figures.update(self._session_figures(sess))
        if meta.get("end"):
            self._drop_session(name)
        # the next report's peak starts from what is held now
        self.held_peak = self.ledger_bytes = self.held_bytes()
        return [{"session": figures}] + out

    def _worker_figures(self) -> dict:
        figures = {
            "sessions_expired": self.expired,
            "sessions_evicted": self.sessions_evicted,
            "budget_bytes": self.budget,
            # what stays after the point: system prompts, other sessions' K/V
            "held_bytes": self.held_bytes(),
            # the worker's whole K/V store (every session), at its highest since the previous report
            "held_peak_bytes": self.held_peak,
            "method_work_s": self.busy_s,
            # the same by kind of job, as method_work_<kind>_s: plan (gate, corrections),
            # first_token (anchor updates after the first token), finish (chaining, records), report
            **{f"method_work_{k}_s": v for k, v in self.busy_by_kind.items()},
            # and the method thread's CPU seconds of the same jobs, as method_cpu_<kind>_s
            **{f"method_cpu_{k}_s": v for k, v in self.cpu_by_kind.items()},
            "method_thread_blas_threads": self.blas_threads,
            # "strided", "flat" or "flat,strided" (some layers each; a scalar: point reports keep it)
            "kv_cache_access": ",".join(sorted(set(self.kv_access.values()))) or None,
        }
        if self.shards is not None:
            figures["tensor_parallel"] = self.shards.describe()
        return figures

    @staticmethod
    def _session_figures(sess: Session) -> dict:
        done, sess.completed_bytes = sess.completed_bytes, []
        figures = {
            "method_state_bytes": sess.method.state_bytes(),
            "live_trajectories": len(sess.trajectories),
            "trajectories_evicted": sess.evicted,
            # this session's trajectories whose last agent finished since the previous report
            "trajectories_completed": len(done),
            "trajectory_bytes_at_completion_max": max(done) if done else None,
            "trajectory_bytes_at_completion_mean": sum(done) / len(done) if done else None,
        }
        layout = getattr(sess.method, "state_layout", None)
        if callable(layout):
            figures["method_state"] = layout()
        return figures

    # ---- memory --------------------------------------------------------------------------------
    def held_bytes(self) -> int:
        """The ledger: every tensor this worker holds (live trajectories' K/V, references, system
        prompts, in-flight requests' plans and capture buffers, each storage once) and every
        session's method state (anchor pools, corrections: ``state_bytes``)."""
        with self.lock:  # the engine thread adds captures under the lock
            kvs = [
                kv for held in (self.system_kv, self.references) for d in list(held.values()) for kv in list(d.values())
            ]
        for attempt in range(3):  # sessions change on the method thread only: a count from another may race it
            try:
                sessions = list(self.sessions.values())
                stored = [
                    kv
                    for s in sessions
                    for t in list(s.trajectories.values())
                    for h in list(t.store.values())
                    for _, kv in list(h)
                ]
                state = sum(int(s.method.state_bytes()) for s in sessions)
                break
            except RuntimeError:
                if attempt == 2:
                    raise
        return _unique_bytes(kvs + stored) + state + self.inflight_bytes()

    def ledger_figures(self, min_interval_s: float = 0.5) -> dict | None:
        """The ledger's figures for ``/metrics`` (:mod:`.stats`), when they changed since the last
        ones returned and at least ``min_interval_s`` later; else None. Engine thread, every step:
        it reads the method thread's last count (:attr:`ledger_bytes`) and counts nothing itself."""
        now = time.monotonic()
        if now - self._ledger_at < min_interval_s:
            return None
        self._ledger_at = now
        figures = {"held_bytes": self.ledger_bytes, "budget_bytes": self.budget, "sessions": len(self.sessions)}
        if figures == self._ledger_sent:
            return None
        self._ledger_sent = figures
        return figures

    def inflight_bytes(self) -> int:
        """Bytes of in-flight requests' plans (prefix, overrides) and capture buffers, each storage once."""
        with self.lock:
            lives = list(self.live.values())
        tensors = []
        for live in lives:
            plan = live.plan if live.capture is None else Plan(captures=[live.capture])
            if plan is None:
                continue
            tensors += list(plan.prefix or ()) + [t for _, k, v in plan.overrides for t in (k, v)]
            tensors += [t for c in plan.captures for t in (c.k, c.v)]
        seen, total = set(), 0
        for t in tensors:
            st = t.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
        return total

    def _note_held(self) -> int:
        """:meth:`held_bytes` now, folded into the peak. Called on the method thread after a
        trajectory stores an agent's caches, before anything is freed (a finished trajectory,
        evictions, a session's end) and at each report. Captures stored from the engine's thread
        (system prompts, references) only add bytes, so measuring before every free and at the
        report finds the true peak."""
        held = self.ledger_bytes = self.held_bytes()
        self.held_peak = max(self.held_peak, held)
        return held

    def _evict(self, current: TrajectoryRun | None, session: Session | None = None) -> None:
        """Beyond the budget: drop references, then system prompts, then whole trajectories of any
        session, least recently planned first (never ``current``, the one being served, nor one
        with an agent in flight), then whole sessions other than ``session``, least recently used
        first (their method state too); a later agent of an evicted trajectory finds no source, an
        agent whose system prompt went computes it. When nothing is left to drop, the request being
        planned is refused (served densely with the error, its trajectory dropped) rather than the
        budget passed: the ledger exceeds the budget only by the buffers of requests in flight."""
        if self.budget is None:
            return
        while (held := self._note_held()) > self.budget:
            with self.lock:
                kept = next((d for kind in (self.references, self.system_kv) for d in kind.values() if d), None)
                if kept is not None:
                    kept.pop(next(iter(kept)))
                    continue
                busy = {id(live.trajectory) for live in self.live.values() if live.trajectory is not None}
                held_by = {str(live.meta.get("session")) for live in self.live.values()}
            victims = [
                (s, tid, t)
                for s in self.sessions.values()
                for tid, t in s.trajectories.items()
                if t is not current and id(t) not in busy
            ]
            if victims:
                s, tid, _ = min(victims, key=lambda v: getattr(v[2], "used", 0.0))
                s.trajectories.pop(tid)
                s.evicted += 1
                continue
            idle = [n for n, s in self.sessions.items() if s is not session and n not in held_by]
            if not idle:
                raise MemoryError(f"the worker holds {held} bytes, over its budget of {self.budget} (budget_gib)")
            name = min(idle, key=lambda n: self.touched.get(n, 0.0))
            self._drop_session(name)
            self.sessions_evicted += 1

    def _drop_session(self, name: str) -> None:
        """Forget session ``name`` and everything it holds (method thread)."""
        with self.lock:
            self.touched.pop(name, None)
            self.references.pop(name, None)
            self.system_kv.pop(name, None)
        self.sessions.pop(name, None)

    # ---- the scheduler side's answers ------------------------------------------------------------
    def take_answers(self) -> tuple[dict[str, int], dict[str, list], dict[str, str]]:
        with self.lock:
            claims, self.claims = self.claims, {}
            answers, self.answers = self.answers, {}
            errors, self.errors = self.errors, {}
        return claims, answers, errors


def on(live: Live) -> TrajectoryRun:
    """``live``'s trajectory, pointed at ``live``'s agent (method thread only: the jobs of one
    trajectory never run at once, so each finds its own agent there)."""
    traj = live.trajectory
    traj.agent, traj.index = live.agent, live.index
    return traj


def same_tokens(req: Request, sources: dict[str, SegmentKV]) -> None:
    """A source is reused only under its own tokens: every shared segment with a source must hold
    exactly the source's token ids (a request may not borrow K/V it did not send the tokens of)."""
    for seg in req.segments:
        src = sources.get(seg.slot) if seg.kind == "PH" else None
        if src is not None and src.ids is not None and tuple(src.ids) != tuple(seg.ids):
            raise ValueError(
                f"segment {seg.slot!r}: its tokens differ from its source's, which is not reused under them"
            )


def _unique_bytes(kvs) -> int:
    """Bytes of the K/V tensors of ``kvs``, each tensor once (a segment reused unchanged, at the
    same positions, is its source's tensor; the records' ``shared_store_bytes`` count it per use)."""
    seen, total = set(), 0
    for kv in kvs:
        if id(kv.k) not in seen:
            seen.add(id(kv.k))
            total += kv.k.nbytes + kv.v.nbytes
    return total
