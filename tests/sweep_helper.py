"""The tests' shorthand for a serve-sweep: positional essentials, every other setting a keyword of
:class:`~kvcmas_bench.jobs.sweep.SweepOptions` (``backend``: its ``engine``; ``progress`` and
``console``: :func:`~kvcmas_bench.jobs.sweep.run_sweep`'s hooks)."""

from __future__ import annotations

from kvcmas_bench.jobs.sweep import SweepOptions, run_sweep


def serve_sweep(methods, qps, shared_tokens, num_trajectories, output_path, *, progress=None, console=None, **kw):
    if kw.get("backend") is not None:
        kw["engine"] = kw.pop("backend")
    kw.pop("backend", None)
    opts = SweepOptions(
        methods=list(methods),
        qps=list(qps),
        shared_tokens=list(shared_tokens),
        num_trajectories=num_trajectories,
        output_path=output_path,
        **kw,
    )
    return run_sweep(opts, progress=progress, console=console)
