"""Serving-efficiency sweeps (paper Section 4.3): controlled four-agent traces, trajectory
arrivals, an event-driven one-request-at-a-time FCFS queue over measured service times, metrics
and plots. Entry point for the CLI: :func:`serve_sweep`."""

from .arrivals import arrival_times
from .queueing import SERVER_MODEL, Backend, ServiceRecord, simulate
from .sweep import evaluate_service, percentile, serve_sweep
from .traces import Trace, build_traces, load_traces, save_traces

__all__ = ["arrival_times", "SERVER_MODEL", "Backend", "ServiceRecord", "simulate", "evaluate_service",
           "percentile", "serve_sweep", "Trace", "build_traces", "load_traces", "save_traces"]
