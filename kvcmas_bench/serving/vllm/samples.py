"""``run --engine vllm``: workload samples through one method session on a vLLM deployment.

Each sample is one :class:`~.http.Unit`: its agent graph (:class:`~kvcmas_bench.workflow.Workflow`'s
nodes, in workflow order) and each agent's request rendered exactly as the in-process ``run``
renders it (:meth:`~kvcmas_bench.workflow.Workflow.build`), sent when the agents it follows have
finished. Up to ``concurrency`` samples are in flight at once, each in its own client thread, so
vLLM batches different samples' requests. The method runs in the server's worker (one session for
the run: its online state, e.g. KVCMAS's anchors, is updated as requests finish there, in the order
they finish), and the worker's record of each request (segment statuses, costs, method accounting)
is fetched with a report once the sample's last agent has ended.

Methods that reuse context-free references (GraphFlow, non-chained KVCMAS/KVComm) run their
samples in waves of ``concurrency``: a report drops the session's references, which a sample
still in flight may need, so reports come only between waves.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

from ...errors import BenchError
from ...methods import MethodSpec
from ...results.request import RequestRecord
from ...workflow import Workflow
from .http import AgentSent, Unit, VLLMServerEngine

#: how long a finished sample waits for the worker's records of its requests (its last request's
#: record is written on the worker's method thread right after vLLM finishes it)
RECORD_WAIT_S = 30.0


@dataclass
class ServedSample:
    """One sample as served: what the client sent and saw per agent (in workflow order) and the
    worker's records of those requests, completed with the client's clock."""

    sample: object
    sent: list[AgentSent]
    records: list[RequestRecord]


class SampleClient:
    """One method session on ``engine`` running ``flow``'s agent graph over workload samples."""

    def __init__(self, engine: VLLMServerEngine, flow: Workflow, spec: MethodSpec):
        self.engine, self.flow = engine, flow
        self.method, self.sess = engine.session(spec)
        self._got: dict[str, dict] = {}
        self._lock = threading.Lock()

    def unit(self, sample) -> Unit:
        q_ids, nodes = self.flow.query_ids(sample), self.flow.nodes
        return Unit(sample.id, nodes, lambda i, outputs: self.flow.build(nodes[i], q_ids, outputs, {}))

    def calibrate(self, samples: Sequence) -> dict:
        """Calibrate the session's method in the worker on held-out samples (as serve-sweep does)."""
        return self.engine.calibrate(self.sess, [self.unit(s) for s in samples])

    def warm_up(self, samples: Sequence) -> None:
        """Serve held-out samples one after another through the method (its online state filled);
        their records are fetched and dropped."""
        self.engine._serve_point(self.sess, [self.unit(s) for s in samples], None, None)
        self.engine.report(self.sess)

    def run(self, samples: Sequence, concurrency: int) -> Iterator[ServedSample]:
        """Every sample served, up to ``concurrency`` at once; each yielded as it finishes (waves:
        in sample order after its wave)."""
        if self.sess.references:
            for i in range(0, len(samples), concurrency):
                yield from self._wave(samples[i : i + concurrency])
            return
        pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="kvcmas-sample")
        todo = iter(samples)
        pending: set[Future] = set()
        try:
            for s in todo:
                pending.add(pool.submit(self._one, s))
                if len(pending) >= concurrency:
                    break
            while pending:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for f in done:
                    nxt = next(todo, None)
                    if nxt is not None:
                        pending.add(pool.submit(self._one, nxt))
                    yield f.result()
        finally:
            for f in pending:
                f.cancel()
            pool.shutdown(wait=False, cancel_futures=True)

    def end(self) -> None:
        """Drop the session on the worker (its method state, system prompts, references)."""
        self.engine.report(self.sess, end=True)

    # ---- internals ---------------------------------------------------------------------------------
    def _one(self, sample) -> ServedSample:
        sent: list[AgentSent] = []
        self.engine._trajectory(self.sess, self.unit(sample), None, None, time.perf_counter(), sent)
        return self._served(sample, sent)

    def _wave(self, samples: Sequence) -> Iterator[ServedSample]:
        units = [self.unit(s) for s in samples]
        sent = self.engine._serve_point(self.sess, units, [0.0] * len(units), None)
        by_unit: dict[str, list[AgentSent]] = {}
        for s in sent:
            by_unit.setdefault(s.trajectory, []).append(s)
        for sample in samples:
            yield self._served(sample, by_unit.get(sample.id, []))

    def _served(self, sample, sent: list[AgentSent]) -> ServedSample:
        sent = sorted(sent, key=lambda s: s.index)
        dicts = self._records_of([s.key for s in sent])
        return ServedSample(sample, sent, [self.engine.record(s, d, None) for s, d in zip(sent, dicts)])

    def _records_of(self, keys: list[str]) -> list[dict]:
        """The worker's records of ``keys``: reports (one at a time) until every one is in; records
        of other samples' requests that come with them are kept for those samples."""
        deadline = time.monotonic() + RECORD_WAIT_S
        with self._lock:
            while any(k not in self._got for k in keys):
                if time.monotonic() > deadline:
                    missing = next(k for k in keys if k not in self._got)
                    raise BenchError(f"the vLLM worker has no record of request {missing} after {RECORD_WAIT_S:.0f} s")
                _, by_key = self.engine.report(self.sess)
                self._got.update(by_key)
                if any(k not in self._got for k in keys):
                    time.sleep(0.02)
            return [self._got.pop(k) for k in keys]
