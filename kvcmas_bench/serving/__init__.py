"""Serving-efficiency sweeps (paper Section 4.3): controlled four-agent traces, trajectory
arrivals, backends that serve them (in-process: an event-driven one-request-at-a-time FCFS queue
over measured service times), metrics and plots. The job itself is :mod:`kvcmas_bench.jobs.sweep`."""

from . import vllm as _vllm  # noqa: F401  (registers the optional vLLM backend; vLLM loads lazily)
from .arrivals import arrival_times
from .backends import BACKENDS, Backend, InProcessBackend, ServeResult, get_backend, register_backend
from .queueing import SERVER_MODEL, replay, simulate
from .traces import Trace, build_traces, load_traces, save_traces

__all__ = [
    "arrival_times",
    "BACKENDS",
    "Backend",
    "InProcessBackend",
    "ServeResult",
    "get_backend",
    "register_backend",
    "SERVER_MODEL",
    "replay",
    "simulate",
    "Trace",
    "build_traces",
    "load_traces",
    "save_traces",
]
