"""The ``coverage`` job: reconstruction coverage of selective recomputation (paper Table 2)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from ..analysis.coverage import reconstruction_coverage
from ..calibration import ImportanceRecorder
from ..engine import Engine
from ..errors import BenchError
from ..methods import resolve_methods
from ..results.outdir import atomic_write, lock_output_dir
from ..results.records import write_json
from ..workflow import Workflow
from ..workloads import get_workload
from .run import select_samples

#: knobs of the selection methods that parameterize the criteria -> reconstruction_coverage's names
CRITERION_KNOBS = {"check_layer": "check_layer", "score_on": "score_on", "max_groups": "layer_groups"}


def criterion_options(method_args: dict | None) -> dict:
    """``--method-arg`` values of the criteria, validated as CacheBlend/DroidSpeak knobs."""
    args = {k: v for k, v in (method_args or {}).items() if v is not None}
    for key in args:
        if key not in CRITERION_KNOBS:
            raise BenchError(f"--method-arg {key} does not apply to coverage (options: {', '.join(CRITERION_KNOBS)})")
    specs = resolve_methods(["cacheblend", "droidspeak"], args)
    merged = {**specs["cacheblend"].kwargs, **specs["droidspeak"].kwargs}
    return {CRITERION_KNOBS[k]: merged[k] for k in args}


def coverage_report(
    workload: str,
    limit: int,
    rhos: Sequence[float],
    model: str | None = None,
    device: str = "auto",
    dtype: str = "float32",
    seed: int = 0,
    max_new_tokens: int | None = None,
    output_path: str = "runs/coverage",
    method_args: dict | None = None,
) -> pd.DataFrame:
    """Run ``limit`` samples densely, record every reused segment's source/exact caches and
    attention importance, and tabulate coverage for each ``rho``; saved as CSV and JSON."""
    from ..modeling import load_model, resolve_device, resolve_dtype

    if limit < 1:
        raise BenchError(f"--limit must be a positive integer, got {limit}")
    if max_new_tokens is not None and max_new_tokens < 1:
        raise BenchError(f"--max-new-tokens must be a positive integer, got {max_new_tokens}")
    for r in rhos:
        if not 0.0 <= r <= 1.0:
            raise BenchError(f"--rho must lie in [0, 1], got {r}")
    if not rhos:
        raise BenchError("no --rho values given")
    options = criterion_options(method_args)
    wl = get_workload(workload)
    resolve_device(device)
    resolve_dtype(dtype)
    path = Path(output_path)
    with lock_output_dir(path):  # a busy, unwritable or file output path fails before any work
        samples = select_samples(wl.load(), limit, seed)
        lm = load_model(model, dtype, device)
        rec = ImportanceRecorder()
        flow = Workflow(Engine(lm.model, lm.tokenizer), rec, wl, max_new_tokens)
        for s in samples:
            flow.run_unit(s)
        if not rec.observations:
            raise BenchError("no reused segments observed")
        frames = []
        for r in rhos:
            df = reconstruction_coverage(rec.observations, 1.0 - r, importance=rec.importance, **options)
            df.insert(0, "rho", r)
            frames.append(df)
        out = pd.concat(frames, ignore_index=True)
        atomic_write(path / "coverage.csv", out.to_csv(index=False))
        write_json(
            path / "coverage.json",
            {
                "workload": workload,
                "model": lm.name,
                "samples": [s.id for s in samples],
                "options": options,
                "rows": out.to_dict(orient="records"),
            },
        )
    return out
