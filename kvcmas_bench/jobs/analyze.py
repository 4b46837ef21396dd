"""The ``analyze`` jobs: the paper's analyses as tables and figures.

- ``rank`` (:func:`rank_analysis`): effective rank per layer of base caches, PH-induced and
  PF-induced deltas, and the reconstruction error vs retained rank, per workload, K and V apart
  (Figures 2 and 7; definitions in :mod:`kvcmas_bench.analysis.rank`). Samples run densely.
- ``chain`` (:func:`chain_analysis`): chained (``kvcmas``) vs non-chained (``kvcmas-nonchained``)
  correction over the same samples with ``--fidelity``: relative KV error per layer and per agent in
  execution order (Figure 3). Each method is an ordinary, resumable run directory.
- ``coverage``: :mod:`kvcmas_bench.jobs.coverage` (Table 2).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from ..analysis.rank import DEFAULT_RANKS, Spectra, per_layer, rank_figure, reconstruction, summary
from ..calibration import Recorder
from ..engine import Engine
from ..errors import BenchError
from ..ops.lowrank import canonical_keys, to_rows
from ..results.outdir import atomic_write, lock_output_dir
from ..results.records import write_json
from ..segments import Request
from ..settings import SampleSettings, cli, comma_ints, comma_items
from ..workflow import Workflow
from ..workloads import get_workload
from .ablate import AblateOptions, run_ablation
from .run import select_samples


@dataclass(kw_only=True)
class RankOptions(SampleSettings):
    """One ``analyze rank`` (the shared settings: :class:`~kvcmas_bench.settings.SampleSettings`)."""

    workloads: list[str] = cli(parse=comma_items, factory=lambda: ["mmlu"])
    limit: int = 8
    #: share of the squared singular values the effective rank keeps
    energy: float = 0.9
    ranks: Sequence[int] = cli(DEFAULT_RANKS, parse=comma_ints)
    output_path: str = "runs/analyze-rank"
    plots: bool = True

    def validate(self) -> None:
        if self.limit < 2:
            raise BenchError(
                f"--limit must be at least 2 (PF-induced deltas pair consecutive samples), got {self.limit}"
            )
        if not 0.0 < self.energy <= 1.0:
            raise BenchError(f"--energy must lie in (0, 1], got {self.energy}")
        if not self.ranks or any(r < 1 for r in self.ranks):
            raise BenchError(f"--ranks takes positive integers, got {','.join(map(str, self.ranks))!r}")
        self.check_samples()
        if not self.workloads:
            raise BenchError("no workloads given (comma-separated, e.g. mmlu,gsm8k)")


@dataclass
class RankResult:
    out_dir: Path
    summary: pd.DataFrame
    layers: pd.DataFrame
    recon: pd.DataFrame
    figures: list = field(default_factory=list)


def rank_analysis(opts: RankOptions) -> RankResult:
    """Run ``limit`` samples of each workload densely, collect the matrices of the three kinds and
    write ``rank_summary.csv``, ``rank_per_layer.csv``, ``rank_recon.csv``, ``rank.json`` and figures."""
    from ..modeling import load_model, resolve_device, resolve_dtype

    opts.validate()
    workloads = [get_workload(w) for w in dict.fromkeys(opts.workloads)]
    for wl in workloads:
        if wl.modality != "text":
            raise BenchError(f"analyze rank runs text workloads; {wl.name} is {wl.modality}")
    resolve_device(opts.device)
    resolve_dtype(opts.dtype)
    with lock_output_dir(opts.output_path) as out:
        lm = load_model(opts.model, opts.dtype, opts.device)
        engine = Engine(lm.model, lm.tokenizer)
        spectra = Spectra(opts.energy, tuple(opts.ranks))
        used = {}
        for wl in workloads:
            samples = select_samples(wl.load(), opts.limit, opts.seed)
            used[wl.name] = [s.id for s in samples]
            collect_spectra(engine, wl, samples, opts, spectra)
        df = spectra.frame()
        res = RankResult(out, summary(df, opts.ranks), per_layer(df), reconstruction(df, opts.ranks))
        for name, frame in (("rank_summary", res.summary), ("rank_per_layer", res.layers), ("rank_recon", res.recon)):
            atomic_write(out / f"{name}.csv", frame.to_csv(index=False))
        write_json(
            out / "rank.json",
            {
                "model": lm.name,
                "device": str(engine.device),
                "energy": opts.energy,
                "ranks": list(opts.ranks),
                "samples": used,
                "summary": res.summary.to_dict(orient="records"),
            },
        )
        if opts.plots:
            res.figures = _rank_figures(res, out, f"{lm.name} on {engine.device}", opts.energy)
    return res


def collect_spectra(engine: Engine, wl, samples: list, opts: RankOptions, spectra: Spectra) -> None:
    """Every shared segment's exact cache (base) and PH-induced delta against its source on the
    workflow edge, and the PF-induced delta of every recurring PF segment between consecutive samples."""
    rec = Recorder()
    flow = Workflow(engine, rec, wl, opts.max_new_tokens, opts.final_max_new_tokens)
    inv = engine.inv_freq
    previous: dict[tuple, tuple] = {}
    for sample in samples:
        run = flow.run_unit(sample)
        for o in rec.observations:
            ex_k, ex_v = to_rows(canonical_keys(o.exact.k, o.start, inv)), to_rows(o.exact.v)
            spectra.add("base", "K", ex_k, workload=wl.name, slot=o.slot, node=o.consumer)
            spectra.add("base", "V", ex_v, workload=wl.name, slot=o.slot, node=o.consumer)
            dk = to_rows(canonical_keys(o.exact.k - o.source.k, o.start, inv))
            spectra.add("ph_delta", "K", dk, ref=ex_k, workload=wl.name, slot=o.slot, node=o.consumer)
            spectra.add("ph_delta", "V", to_rows(o.exact.v - o.source.v), ref=ex_v, workload=wl.name, slot=o.slot)
        rec.observations.clear()
        for step in run.steps:
            for key, (k, v) in pf_caches(engine, step.request).items():
                old = previous.get((step.node.id, key))
                if old is not None:
                    spectra.add("pf_delta", "K", k - old[0], ref=k, workload=wl.name, slot=key[0], node=step.node.id)
                    spectra.add("pf_delta", "V", v - old[1], ref=v, workload=wl.name, slot=key[0], node=step.node.id)
                previous[(step.node.id, key)] = (k, v)


def pf_caches(engine: Engine, request: Request) -> dict[tuple, tuple]:
    """The exact cache (canonical keys, values) of every PF segment that follows shared content in
    ``request``'s prompt, keyed by (segment name, token ids): one dense prefill of the whole prompt."""
    ids = request.prompt_ids
    cache = engine.new_cache(len(ids))
    engine.prefill(cache, ids, 0)
    out, pos, after_ph = {}, 0, False
    for seg in request.segments:
        S = len(seg.ids)
        if seg.kind == "PH":
            after_ph = True
        elif after_ph and S:
            k = cache.k[:, :, pos : pos + S]
            out[(seg.name, tuple(seg.ids))] = (
                to_rows(canonical_keys(k, pos, engine.inv_freq)),
                to_rows(cache.v[:, :, pos : pos + S]),
            )
        pos += S
    return out


def _rank_figures(res: RankResult, out: Path, meta: str, energy: float) -> list:
    from ..report.plots import save

    figs = []
    for w in dict.fromkeys(res.layers["workload"]):
        fig, _ = rank_figure(
            res.layers[res.layers["workload"] == w],
            res.recon[res.recon["workload"] == w],
            f"{w}: effective rank and reconstruction error of caches and deltas ({meta})",
            energy,
        )
        figs.append(save(fig, out / "figures", f"rank_{w}", f"{w}: effective rank and reconstruction error"))
    return figs


# ---- chain ----------------------------------------------------------------------------------------
@dataclass
class ChainResult:
    out_dir: Path
    per_agent: pd.DataFrame
    per_layer: pd.DataFrame
    table: pd.DataFrame
    failed: dict[str, str] = field(default_factory=dict)
    figures: list = field(default_factory=list)
    #: what could not be compared (a workload where no method corrected a segment)
    notes: list[str] = field(default_factory=list)


def chain_analysis(opts: AblateOptions, progress=None) -> ChainResult:
    """Run the chained and non-chained methods (``opts.methods``, default both KVCMAS variants) over
    the same samples with fidelity, then tabulate their KV error per agent and per layer."""
    from ..analysis.chain import chain_figure, chain_frames

    opts.kind, opts.fidelity, opts.reference = "chain", True, False
    res = run_ablation(opts, progress)
    out = res.out_dir
    done = [p for p in res.points if p.cell not in res.failed]
    agents, layers = chain_frames([(p.method, p.workload, out / p.workload / p.name) for p in done])
    cr = ChainResult(out, agents, layers, res.table, dict(res.failed))
    if not agents.empty:
        atomic_write(out / "chain_per_agent.csv", agents.to_csv(index=False))
        atomic_write(out / "chain_per_layer.csv", layers.to_csv(index=False))
        if opts.plots:
            from ..report.plots import save

            for w in dict.fromkeys(agents["workload"]):
                if not agents.loc[agents["workload"] == w, "corrected"].sum():
                    continue
                fig, _ = chain_figure(agents[agents["workload"] == w], layers[layers["workload"] == w], w)
                cr.figures.append(save(fig, out / "figures", f"chain_{w}", f"{w}: chained vs non-chained KV error"))
        for w in dict.fromkeys(agents["workload"]):
            if not agents.loc[agents["workload"] == w, "corrected"].sum():
                cr.notes.append(
                    f"{w}: no method corrected a single segment (every gated segment fell back densely), so there "
                    "is no chained vs non-chained error to compare and no figure was drawn; add --warmup N or "
                    "raise --limit"
                )
    return cr
