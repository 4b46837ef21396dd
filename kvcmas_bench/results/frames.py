"""Results as data: run, suite and serve-sweep directories loaded into tidy pandas frames.

A directory is recognised by its files: ``suite.json`` (a suite: one run directory per
workload x method cell), ``config.json`` with ``"command": "serve-sweep"`` (a sweep) or with a
``method`` and a ``workload`` (a run). :func:`load_dirs` loads any mix of them; :class:`Results`
combines them into one frame per kind of record (runs, samples, requests, sweep rows), each row
carrying the run's ``run_id``, ``workload``, ``method`` and ``label``.

Readers check what writers check: a run directory (alone or as a suite cell) is read by
:func:`~kvcmas_bench.results.records.read_run_files`, the rule set of ``run``'s resume. What a kill
leaves (a torn last line, the request lines of the one unfinished sample at the end) is dropped as
resume drops it; any other damage (an unreadable line, a sample or request line written twice, a
request line of no finished sample followed by finished ones, a finished sample with missing
request steps, a request line that is not a :class:`~kvcmas_bench.results.request.RequestRecord`)
and an unreadable JSON file are a :class:`BenchError` naming the file and line ("corrupt input":
exit 2 for ``report`` and ``compare``, before anything is written). A sweep's ``service.jsonl``
and ``requests.jsonl`` are read by the same line rules, and a measurement or served request written
twice is an error too.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from ..errors import BenchError
from .figures import canonical
from .records import corrupt_input, read_jsonl_objects, read_run_files
from .request import RequestRecord, request_row

#: config keys that define *what* a run evaluated, apart from the method: runs agreeing on them
#: evaluate the same prompts (given the same samples), so NonShared is their reference
SETTING_KEYS = (
    "workload",
    "model",
    "dtype",
    "seed",
    "subjects",
    "data_path",
    "max_new_tokens",
    "final_max_new_tokens",
    "topology",
    "n_agents",
    "rounds",
)
#: the reference method of agreement
REFERENCE = "nonshared"


def read_json(path: Path) -> dict:
    """A JSON object file; missing or unreadable -> one-line :class:`BenchError`."""
    if not path.exists():
        raise BenchError(f"{path} is missing")
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, OSError) as exc:
        raise BenchError(f"{path} is corrupt ({type(exc).__name__}: {str(exc).splitlines()[0]})") from None
    if not isinstance(obj, dict):
        raise BenchError(f"{path} is corrupt (not a JSON object)")
    return obj


def read_jsonl(path: Path, required: bool = True) -> list[dict]:
    """Complete JSON lines of ``path`` by the line rules of ``run``'s resume
    (:func:`~kvcmas_bench.results.records.read_jsonl_objects`): a torn last line is dropped, any
    other line that is not a JSON object is a one-line :class:`BenchError` naming it."""
    return [obj for _, _, obj in _jsonl_rows(path, required)]


def _jsonl_rows(path: Path, required: bool = True) -> list[tuple[int, bytes, dict]]:
    if not path.exists():
        if required:
            raise BenchError(f"{path} is missing")
        return []
    return read_jsonl_objects(path, corrupt_input)[0]


def dir_kind(path: str | Path) -> str:
    """``run``, ``suite`` or ``sweep``; anything else is a one-line :class:`BenchError`."""
    p = Path(path)
    if not p.exists():
        raise BenchError(f"{p} does not exist")
    if not p.is_dir():
        raise BenchError(f"{p} is not a directory")
    if (p / "suite.json").exists():
        return "suite"
    if not (p / "config.json").exists():
        raise BenchError(f"{p} holds no run, suite or sweep (no config.json or suite.json)")
    cfg = read_json(p / "config.json")
    if cfg.get("command") == "serve-sweep":
        return "sweep"
    if "method" in cfg and "workload" in cfg:
        return "run"
    raise BenchError(f"{p}/config.json is not the config of a run or a sweep")


def requests_frame(rows: list[dict], path: Path) -> pd.DataFrame:
    recs = []
    for i, r in enumerate(rows, start=1):
        try:
            recs.append(request_row(RequestRecord.from_dict(r)))
        except (TypeError, ValueError, KeyError) as exc:
            raise BenchError(f"{path} is corrupt (record {i}: {exc})") from None
    return pd.DataFrame(recs)


@dataclass
class Run:
    """One run directory: its config and summary (dicts) and its records (frames)."""

    path: Path
    config: dict
    summary: dict
    samples: pd.DataFrame
    requests: pd.DataFrame
    label: str = ""
    run_id: str = ""
    #: the request records themselves (the frames flatten away their method counters)
    records: list[RequestRecord] = field(default_factory=list)
    #: figures of ``summary.json`` that its records contradict (reported; the records are used)
    disagreements: list[str] = field(default_factory=list)

    @property
    def method(self) -> str:
        return self.config["method"]

    @property
    def workload(self) -> str:
        return self.config["workload"]

    @property
    def sample_ids(self) -> set[str]:
        return set(self.samples["sample_id"]) if not self.samples.empty else set()

    def figures(self) -> dict:
        """Every figure of the run recomputed from its records (as ``summary.json`` computes them)."""
        from .summary import run_figures

        return run_figures(self.samples, self.requests)

    def settings(self) -> tuple:
        """What the run evaluated apart from the method (see :data:`SETTING_KEYS`)."""
        return tuple(json.dumps(self.config.get(k), sort_keys=True) for k in SETTING_KEYS)


@dataclass
class Sweep:
    """One serve-sweep directory: config, summary, its rows and its records as frames."""

    path: Path
    config: dict
    summary: dict
    rows: pd.DataFrame
    service: pd.DataFrame
    run_id: str = ""
    #: figures of ``summary.json``'s rows that its served requests contradict (the records are used)
    disagreements: list[str] = field(default_factory=list)
    #: the served requests (``requests.jsonl``) as flat rows, the source of the rows
    requests: pd.DataFrame = field(default_factory=pd.DataFrame)


def load_run(path: str | Path) -> Run:
    """A run directory (``summary.json`` optional: every table is computed from the records), its
    finished samples and their requests checked as ``run``'s resume checks them
    (:func:`~kvcmas_bench.results.records.read_run_files`)."""
    p = Path(path)
    config = read_json(p / "config.json")
    summary = canonical(read_json(p / "summary.json")) if (p / "summary.json").exists() else {}
    if not (p / "samples.jsonl").exists():
        raise BenchError(f"{p / 'samples.jsonl'} is missing")
    samples, _, records, _ = read_run_files(p / "samples.jsonl", p / "requests.jsonl", config, corrupt_input)
    sdf = pd.DataFrame([s for _, _, s in samples])
    rdf = pd.DataFrame([request_row(r) for r in records])
    run = Run(p, config, summary, sdf, rdf, records=records)
    run.disagreements = summary_disagreements(summary, run.figures())
    return run


def summary_disagreements(summary: dict, figs: dict, what: str = "") -> list[str]:
    """The scalar figures of a ``summary.json`` (or one of its rows) that differ from the same
    figures recomputed from the records, as "name: summary X, records Y" (relative tolerance 1e-9:
    both come from the same records by the same functions when nothing was edited)."""
    out = []
    for k, v in figs.items():
        old = summary.get(k)
        if k not in summary or not _scalar(v) or not _scalar(old):
            continue
        if isinstance(v, float) or isinstance(old, float):
            same = v is not None and old is not None and not isinstance(old, (str, bool)) and _close(old, v)
        else:
            same = old == v
        if not same:
            out.append(f"{what}{k}: summary {old!r}, records {v!r}")
    return out


def _close(a, b) -> bool:
    try:
        a, b = float(a), float(b)
    except (TypeError, ValueError):
        return False
    return a == b or abs(a - b) <= 1e-9 * max(abs(a), abs(b))


def load_sweep(path: str | Path) -> Sweep:
    """A serve-sweep directory: its rows recomputed from the served requests (``requests.jsonl``,
    by the function ``serve-sweep`` writes them with), the isolated measurements, and the summary
    figures the records contradict. Only a sweep without served requests (written by hand) shows
    its ``summary.json`` rows as they are, with a disagreement saying so."""
    from ..serving.metrics import capacity, sweep_rows

    p = Path(path)
    config = read_json(p / "config.json")
    summary = read_json(p / "summary.json")
    if not isinstance(summary.get("rows"), list) or not all(isinstance(r, dict) for r in summary["rows"]):
        raise BenchError(f"{p / 'summary.json'} is corrupt (its rows are not a list of objects)")
    service = [
        request_row(r)
        for r in _records(p / "service.jsonl", ("method", "shared_tokens", "trajectory", "step"), "measurement")
    ]
    served = _records(p / "requests.jsonl", ("method", "shared_tokens", "qps", "trajectory", "step"), "served request")
    old = [canonical(r) for r in summary["rows"]]
    if not served:
        _check_rows(old, p / "summary.json")
        summary["rows"] = old
        return Sweep(p, config, summary, pd.DataFrame(old), pd.DataFrame(service), disagreements=[
            "no requests.jsonl: the rows are summary.json's, not recomputed"
        ])  # fmt: skip
    rows = sweep_rows(served)
    written = {(r.get("method"), r.get("shared_tokens"), r.get("qps")): r for r in old}
    disagreements = []
    for row in rows:
        key = (row["method"], row["shared_tokens"], row["qps"])
        mine = written.pop(key, None)
        row["rho_target"] = (mine or {}).get("rho_target")
        what = f"{row['method']} @ {row['shared_tokens']} tokens, QPS {row['qps']:g}: "
        disagreements += [f"{what}no summary row"] if mine is None else summary_disagreements(mine, row, what)
    disagreements += [f"{m} @ {s} tokens, QPS {q}: a summary row without served requests" for m, s, q in written]
    summary = {**summary, "rows": rows, "capacity": capacity(rows)}
    summary["saturated"] = [
        {k: r.get(k) for k in ("method", "shared_tokens", "qps", "utilization", "latency_inflation", "drain_ratio")}
        for r in rows
        if r.get("saturated")
    ]
    served_rows = pd.DataFrame([request_row(r) for r in served])
    return Sweep(
        p, config, summary, pd.DataFrame(rows), pd.DataFrame(service), disagreements=disagreements, requests=served_rows
    )


#: the sweep row fields that hold text; every other one is a number, a bool or null
_TEXT_FIELDS = ("method", "utilization_basis")


def _check_rows(rows: list[dict], path: Path) -> None:
    """Rows shown as written (a sweep without served requests): typed as the metrics write them."""
    for i, row in enumerate(rows, 1):
        for k, v in row.items():
            text = k in _TEXT_FIELDS
            ok = isinstance(v, str) if text else v is None or isinstance(v, (bool, int, float))
            if k in ("method", "qps", "shared_tokens") and v is None:
                ok = False
            if ok and k in ("qps", "shared_tokens") and (isinstance(v, bool) or not 0 <= v < float("inf")):
                ok = False
            if not ok:
                want = "a string" if text else "a number"
                raise BenchError(f"{path} is corrupt (row {i}: {k} {v!r} is not {want})")


def _records(path: Path, key: tuple[str, ...], what: str) -> list[RequestRecord]:
    """A sweep's record file (optional) as request records, each carrying the ``key`` fields."""
    out = []
    for n, d in _unique_rows(path, key, what):
        try:
            rec = RequestRecord.from_dict(d)
            need = ("method", "shared_tokens", "qps", *(("arrival_s", "completion_s") if "qps" in key else ()))
            missing = [k for k in need if (k in key or k.endswith("_s")) and getattr(rec, k) is None]
            if missing:
                raise ValueError(f"no {missing[0]}")
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise corrupt_input(path, n, f"is not a valid request record ({str(exc)[:200]})") from None
        out.append(rec)
    return out


def _unique_rows(path: Path, key: tuple[str, ...], what: str) -> list[tuple[int, dict]]:
    """The lines of a sweep's record file (optional) as (line number, object), by the line rules of
    resume; two records of the same ``key`` (a line written twice) are a one-line
    :class:`BenchError` naming both lines."""
    seen: dict[str, int] = {}
    out = []
    for n, _, d in _jsonl_rows(path, required=False):
        k = json.dumps([d.get(f) for f in key], sort_keys=True, default=str)
        if d.get("trajectory") is None or d.get("step") is None:
            k = f"line {n}"  # not a numbered step of a trajectory: nothing to repeat
        if k in seen:
            raise corrupt_input(path, n, f"repeats the {what} of line {seen[k]}")
        seen[k] = n
        out.append((n, d))
    return out


#: suite settings that do not change what a suite evaluates (its shards may differ in them)
LOCAL_SETTINGS = ("device",)


def plan_id(settings: dict, cells: list[str]) -> str:
    """The identity of a suite's plan: its cells and the settings that change results. A suite and
    each of its shards (``suite --shard K/N``) have the same."""
    kept = {k: v for k, v in settings.items() if k not in LOCAL_SETTINGS}
    text = json.dumps({"settings": kept, "cells": sorted(map(str, cells))}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _shard_of(p: Path, manifest: dict) -> tuple[str, int | None, int | None]:
    """(plan id, K, N) of a suite directory (K, N None: not a shard); a shard manifest whose plan,
    slice or cells do not hold together is corrupt (one line)."""
    shard = manifest.get("shard")
    cells = manifest.get("cells") if isinstance(manifest.get("cells"), dict) else {}
    if shard is None:
        return plan_id(manifest.get("settings") or {}, list(cells)), None, None
    bad = f"{p / 'suite.json'} is corrupt (its shard"
    try:
        k, n, names = int(shard["index"]), int(shard["count"]), [str(x) for x in shard["cells"]]
        recorded = str(shard["plan"])
    except (KeyError, TypeError, ValueError):
        raise BenchError(f"{bad} is not {{index, count, plan, cells}})") from None
    if not 1 <= k <= n or plan_id(manifest.get("settings") or {}, names) != recorded:
        raise BenchError(f"{bad} record does not match its settings and cells)")
    if set(cells) != {c for i, c in enumerate(names) if i % n == k - 1}:
        raise BenchError(f"{bad} {k}/{n} lists cells outside its slice of the plan)")
    return recorded, k, n


def check_shards(paths: list[Path]) -> list[str]:
    """Suite directories that are shards of one plan must merge into that whole plan: each shard
    once, none missing, not beside the unsharded suite. One line otherwise. A shard alone (the only
    suite given) reports its own cells; unsharded suites of one plan (say on two devices) are no
    shards and pass. Returns a note per merged suite ("one suite merged from 2 shards: A, B")."""
    groups: dict[str, list[tuple[Path, int | None, int | None]]] = {}
    for p in paths:
        plan, k, n = _shard_of(p, read_json(p / "suite.json"))
        groups.setdefault(plan, []).append((p, k, n))
    notes = []
    for entries in groups.values():
        shards = [e for e in entries if e[1] is not None]
        if shards and len(shards) < len(entries):
            whole = next(e[0] for e in entries if e[1] is None)
            raise BenchError(f"{whole} and its shard {shards[0][0]} hold the same cells; give the suite or its shards")
        if not shards or len(paths) == 1:
            continue
        counts = sorted({n for _, _, n in shards})
        if len(counts) > 1:
            raise BenchError(f"shards of one suite split {' and '.join(map(str, counts))} ways: give one split")
        n, seen = counts[0], {}
        for p, k, _ in shards:
            if k in seen:
                raise BenchError(f"shard {k}/{n} given twice ({seen[k]} and {p})")
            seen[k] = p
        missing = [k for k in range(1, n + 1) if k not in seen]
        if missing:
            raise BenchError(
                f"shard(s) {', '.join(f'{k}/{n}' for k in missing)} missing: the merged suite would lack their cells "
                f"(given {', '.join(f'{k}/{n}' for k in sorted(seen))})"
            )
        notes.append(f"one suite merged from {n} shards: {', '.join(str(seen[k]) for k in range(1, n + 1))}")
    return notes


def suite_cells(path: str | Path) -> list[Path]:
    """The run directories of a suite (cells not started yet are skipped); :func:`load_dirs` reads
    each with :func:`load_run`, so every cell is checked as a run directory is."""
    p = Path(path)
    manifest = read_json(p / "suite.json")
    cells = manifest.get("cells")
    if not isinstance(cells, dict):
        raise BenchError(f"{p / 'suite.json'} is corrupt (no cells)")
    out = []
    for name, cell in cells.items():
        if not isinstance(cell, dict):
            raise BenchError(f"{p / 'suite.json'} is corrupt (cell {name!r} is not an object)")
        d = p / str(cell.get("path", name))
        if (d / "config.json").exists() and (d / "samples.jsonl").exists():
            out.append(d)
    return out


@dataclass
class Results:
    """Everything loaded from a set of directories."""

    runs: list[Run] = field(default_factory=list)
    sweeps: list[Sweep] = field(default_factory=list)
    #: kind of each input directory, in the order given
    inputs: dict[str, str] = field(default_factory=dict)
    #: how the inputs were combined (shards merged into one suite)
    notes: list[str] = field(default_factory=list)

    def runs_frame(self) -> pd.DataFrame:
        """One row per run: identity, settings and its figures recomputed from its records (never
        copied from ``summary.json``; ``summary_disagrees`` names the summary figures they contradict)."""
        rows = []
        for r in self.runs:
            row = {"run_id": r.run_id, "path": str(r.path), "label": r.label}
            row.update({k: r.config.get(k) for k in ("method", *SETTING_KEYS, "device", "limit", "fidelity")})
            row["method_config"] = json.dumps(r.config.get("method_config"), sort_keys=True)
            row.update({k: v for k, v in r.figures().items() if _scalar(v)})
            row["summary_disagrees"] = "; ".join(r.disagreements) or None
            rows.append(row)
        return pd.DataFrame(rows)

    def samples_frame(self) -> pd.DataFrame:
        return _tagged([(r, r.samples) for r in self.runs])

    def requests_frame(self) -> pd.DataFrame:
        return _tagged([(r, r.requests) for r in self.runs])

    def sweep_frame(self) -> pd.DataFrame:
        frames = [s.rows.assign(run_id=s.run_id, model=s.config.get("model")) for s in self.sweeps]
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def _scalar(v) -> bool:
    return v is None or isinstance(v, (str, int, float, bool))


def _tagged(pairs: list[tuple[Run, pd.DataFrame]]) -> pd.DataFrame:
    frames = [
        df.assign(run_id=r.run_id, workload=r.workload, method=r.method, label=r.label)
        for r, df in pairs
        if not df.empty
    ]
    if not frames:
        return pd.DataFrame()
    out = pd.concat(frames, ignore_index=True)
    for col in ("meta", "visual"):
        if col in out:
            out[col] = out[col].map(lambda v: json.dumps(v, sort_keys=True) if isinstance(v, dict) else v)
    return out


def load_dirs(paths: list[str | Path]) -> Results:
    """Run, suite and sweep directories, in order; labels and ids assigned across all runs."""
    if not paths:
        raise BenchError("no directories given")
    res = Results()
    kinds = {str(p): dir_kind(p) for p in paths}
    res.notes = check_shards([Path(p) for p in paths if kinds[str(p)] == "suite"])
    for path in paths:
        kind = kinds[str(path)]
        res.inputs[str(path)] = kind
        if kind == "sweep":
            res.sweeps.append(load_sweep(path))
        elif kind == "suite":
            res.runs.extend(load_run(d) for d in suite_cells(path))
        else:
            res.runs.append(load_run(path))
    label_runs(res.runs)
    for i, s in enumerate(res.sweeps):
        s.run_id = f"sweep{i}:{s.path.name}"
    return res


def label_runs(runs: list[Run]) -> None:
    """``label``: the method name, plus the method options that tell apart several runs of the same
    method on the same workload (``cacheblend rho=0.8``); ``run_id``: unique per run."""
    groups: dict[tuple, list[Run]] = {}
    for r in runs:
        groups.setdefault((r.workload, r.method), []).append(r)
    for group in groups.values():
        cfgs = [_flat_config(r) for r in group]
        keys = sorted({k for c in cfgs for k in c if len({json.dumps(x.get(k)) for x in cfgs}) > 1})
        for r, c in zip(group, cfgs):
            r.label = r.method + "".join(f" {k}={_short(c.get(k))}" for k in keys)
        labels = [r.label for r in group]
        for r in group:  # nothing in the configs tells them apart: the directory does
            if labels.count(r.label) > 1:
                where = f"{r.path.parent.name}/{r.path.name}" if r.path.name == r.method else r.path.name
                r.label = f"{r.label} ({where})"
    seen: dict[str, int] = {}
    for r in runs:
        base = f"{r.workload}/{r.label}"
        seen[base] = seen.get(base, 0) + 1
        r.run_id = base if seen[base] == 1 else f"{base}#{seen[base]}"


def _flat_config(r: Run) -> dict:
    mc = {k: v for k, v in (r.config.get("method_config") or {}).items() if k != "name"}
    for k in ("target_reuse", "auto_tau", "fidelity"):
        if r.config.get(k) is not None:
            mc[k] = r.config[k]
    if r.config.get("warmup_samples"):
        mc["warmup"] = len(r.config["warmup_samples"])
    mc["engine"] = "vllm" if str(r.config.get("engine") or "").startswith("vllm") else "in-process"
    mc["max_concurrency"] = r.config.get("max_concurrency") or 1
    for k in SETTING_KEYS[1:]:
        mc[f"{k}"] = r.config.get(k)
    return mc


def _short(v) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)
