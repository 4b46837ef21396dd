"""The ``coverage`` job: reconstruction coverage of selective recomputation (paper Table 2)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from ..analysis.coverage import reconstruction_coverage
from ..calibration import ImportanceRecorder
from ..engine import Engine
from ..errors import BenchError
from ..methods import resolve_methods
from ..results.outdir import atomic_write, lock_output_dir
from ..results.records import write_json
from ..settings import MethodSettings, SampleSettings, cli, comma_floats
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


@dataclass(kw_only=True)
class CoverageOptions(SampleSettings, MethodSettings):
    """One ``analyze coverage`` (the shared settings: :class:`~kvcmas_bench.settings.SampleSettings`;
    ``method_args``: the criteria's options)."""

    workload: str = "mmlu"
    limit: int = 4
    #: reuse ratios; the recomputation budget is 1 - rho
    rhos: list[float] = cli(parse=comma_floats, flag="--rho", factory=lambda: [0.9, 0.8])
    output_path: str = "runs/coverage"

    def validate(self) -> None:
        self.check_samples()
        for r in self.rhos:
            if not 0.0 <= r <= 1.0:
                raise BenchError(f"--rho must lie in [0, 1], got {r}")
        if not self.rhos:
            raise BenchError("no --rho values given")


def coverage_report(opts: CoverageOptions) -> pd.DataFrame:
    """Run ``limit`` samples densely, record every reused segment's source/exact caches and
    attention importance, and tabulate coverage for each ``rho``; saved as CSV and JSON."""
    from ..modeling import load_model, resolve_device, resolve_dtype

    opts.validate()
    options = criterion_options(opts.method_args)
    wl = get_workload(opts.workload)
    resolve_device(opts.device)
    resolve_dtype(opts.dtype)
    path = Path(opts.output_path)
    with lock_output_dir(path):  # a busy, unwritable or file output path fails before any work
        samples = select_samples(wl.load(), opts.limit, opts.seed)
        lm = load_model(opts.model, opts.dtype, opts.device)
        rec = ImportanceRecorder()
        flow = Workflow(Engine(lm.model, lm.tokenizer), rec, wl, opts.max_new_tokens)
        for s in samples:
            flow.run_unit(s)
        if not rec.observations:
            raise BenchError("no reused segments observed")
        frames = []
        for r in opts.rhos:
            df = reconstruction_coverage(rec.observations, 1.0 - r, importance=rec.importance, **options)
            df.insert(0, "rho", r)
            frames.append(df)
        out = pd.concat(frames, ignore_index=True)
        atomic_write(path / "coverage.csv", out.to_csv(index=False))
        write_json(
            path / "coverage.json",
            {
                "workload": opts.workload,
                "model": lm.name,
                "samples": [s.id for s in samples],
                "options": options,
                "rows": out.to_dict(orient="records"),
            },
        )
    return out
