"""Serving-efficiency sweeps (paper Section 4.3): controlled four-agent traces, trajectory
arrivals, engines that serve them (in-process: an event-driven one-request-at-a-time FCFS queue
over measured service times), metrics and plots. The job itself is :mod:`kvcmas_bench.jobs.sweep`."""

from . import vllm as _vllm  # noqa: F401  (registers the optional vLLM engines; vLLM loads lazily)
from .arrivals import arrival_times
from .engines import ENGINES, InProcessEngine, ServeResult, ServingEngine, get_engine, register_engine
from .queueing import SERVER_MODEL, replay, simulate
from .traces import Trace, build_traces, load_traces, save_traces

__all__ = [
    "arrival_times",
    "ENGINES",
    "ServingEngine",
    "InProcessEngine",
    "ServeResult",
    "get_engine",
    "register_engine",
    "SERVER_MODEL",
    "replay",
    "simulate",
    "Trace",
    "build_traces",
    "load_traces",
    "save_traces",
]
