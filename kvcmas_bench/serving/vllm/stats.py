"""The worker's memory ledger on vLLM's own ``/metrics``: the connector's stats travel from the
worker to the API server with vLLM's KV-connector stats (:class:`LedgerStats`) and are exposed as
gauges (:class:`LedgerMetrics`): ``vllm:kvcmas_worker_held_bytes`` (every tensor the methods hold,
:meth:`~.worker.WorkerRuntime.held_bytes`), ``vllm:kvcmas_worker_budget_bytes`` and
``vllm:kvcmas_sessions``, summed over tensor-parallel ranks. A worker sends its figures when they
changed, at most every :data:`MIN_INTERVAL_S` (with a step: an idle server shows the last ones)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import Gauge
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

#: the figures and their gauges
FIGURES = {
    "held_bytes": ("vllm:kvcmas_worker_held_bytes", "Bytes of K/V and buffers the KVCMAS methods hold in the worker."),
    "budget_bytes": ("vllm:kvcmas_worker_budget_bytes", "The KVCMAS worker's byte budget (budget_gib)."),
    "sessions": ("vllm:kvcmas_sessions", "Live KVCMAS method sessions in the worker."),
}
MIN_INTERVAL_S = 0.5


@dataclass
class LedgerStats(KVConnectorStats):
    """``data``: each rank's latest figures, by rank (``{"0": {"held_bytes": ...}}``): aggregating
    over ranks or over time keeps each rank's latest, and the reduction sums the ranks."""

    def reset(self):
        self.data = {}

    def aggregate(self, other):
        if other is not None:
            self.data = {**self.data, **other.data}
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: sum(int((r or {}).get(k) or 0) for r in self.data.values()) for k in FIGURES}

    def is_empty(self) -> bool:
        return not self.data


class LedgerMetrics(KVConnectorPromMetrics):
    """The ledger's gauges, one child per engine."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        gauge = metric_types.get(Gauge, self._gauge_cls)
        self.gauges = {
            key: create_metric_per_engine(
                gauge(name=name, documentation=doc, labelnames=labelnames, multiprocess_mode="mostrecent"),
                per_engine_labelvalues,
            )
            for key, (name, doc) in FIGURES.items()
        }

    def observe(self, transfer_stats_data: dict, engine_idx: int = 0):
        for key, value in LedgerStats(data=dict(transfer_stats_data or {})).reduce().items():
            self.gauges[key][engine_idx].set(value)
