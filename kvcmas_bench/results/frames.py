"""Results as data: run, suite and serve-sweep directories loaded into tidy pandas frames.

A directory is recognised by its files: ``suite.json`` (a suite: one run directory per
workload x method cell), ``config.json`` with ``"command": "serve-sweep"`` (a sweep) or with a
``method`` and a ``workload`` (a run). :func:`load_dirs` loads any mix of them; :class:`Results`
combines them into one frame per kind of record (runs, samples, requests, sweep rows), each row
carrying the run's ``run_id``, ``workload``, ``method`` and ``label``.

Reading is strict where ``run`` resume is lenient: a torn last line (a run killed mid-write) is
dropped as resume drops it, but any other unreadable line, an unreadable JSON file or a request
line that is not a :class:`~kvcmas_bench.results.request.RequestRecord` is a :class:`BenchError`
naming the file and line ("corrupt input" for ``report`` and ``compare``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pandas as pd

from ..errors import BenchError
from .request import RequestRecord

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
#: request fields kept as columns (scalars); segments become status counts
_SEG_STATUSES = ("exact", "reused", "corrected", "recomputed")


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
    """Complete JSON lines of ``path``; a torn last line is dropped, any other bad line is an error."""
    if not path.exists():
        if required:
            raise BenchError(f"{path} is missing")
        return []
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError) as exc:
        raise BenchError(f"{path} is corrupt ({type(exc).__name__})") from None
    lines = text.split("\n")
    rows = []
    for i, line in enumerate(lines[:-1], start=1):  # lines[-1]: "" or a torn last line
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise BenchError(f"{path} is corrupt (line {i} is not JSON)") from None
        if not isinstance(row, dict):
            raise BenchError(f"{path} is corrupt (line {i} is not a JSON object)")
        rows.append(row)
    return rows


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


def request_row(rec: RequestRecord) -> dict:
    """One flat row of a request record: scalar fields, plus per-status counts of its shared segments."""
    d = asdict(rec)
    segs = d.pop("segments")
    d.pop("method_stats")
    shared = [s for s in segs if s["kind"] == "PH"]
    d["shared_segments"] = len(shared)
    for status in _SEG_STATUSES:
        d[f"seg_{status}"] = sum(s["status"] == status for s in shared)
    d["seg_statuses"] = ",".join(s["status"] for s in shared)
    errs = [s["kv_rel_error"] for s in shared if s["source_agent"] and s["kv_rel_error"] is not None]
    d["seg_kv_rel_error_sum"] = float(sum(errs))
    d["seg_kv_rel_error_n"] = len(errs)
    return d


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

    @property
    def method(self) -> str:
        return self.config["method"]

    @property
    def workload(self) -> str:
        return self.config["workload"]

    @property
    def sample_ids(self) -> set[str]:
        return set(self.samples["sample_id"]) if not self.samples.empty else set()

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


def load_run(path: str | Path) -> Run:
    """A run directory (``summary.json`` optional: every table is computed from the records)."""
    p = Path(path)
    config = read_json(p / "config.json")
    summary = read_json(p / "summary.json") if (p / "summary.json").exists() else {}
    samples = read_jsonl(p / "samples.jsonl")
    for i, s in enumerate(samples, start=1):
        if "sample_id" not in s or "correct" not in s:
            raise BenchError(f"{p / 'samples.jsonl'} is corrupt (line {i} has no sample_id/correct)")
    sdf = pd.DataFrame(samples)
    done = set(sdf["sample_id"]) if not sdf.empty else set()
    reqs = [r for r in read_jsonl(p / "requests.jsonl", required=False) if r.get("sample_id") in done]
    return Run(p, config, summary, sdf, requests_frame(reqs, p / "requests.jsonl"))


def load_sweep(path: str | Path) -> Sweep:
    """A serve-sweep directory: ``summary.json`` rows and the isolated measurements."""
    p = Path(path)
    config = read_json(p / "config.json")
    summary = read_json(p / "summary.json")
    if not isinstance(summary.get("rows"), list):
        raise BenchError(f"{p / 'summary.json'} is corrupt (no rows)")
    service = requests_frame(read_jsonl(p / "service.jsonl", required=False), p / "service.jsonl")
    return Sweep(p, config, summary, pd.DataFrame(summary["rows"]), service)


def suite_cells(path: str | Path) -> list[Path]:
    """The run directories of a suite (cells not started yet are skipped)."""
    p = Path(path)
    manifest = read_json(p / "suite.json")
    cells = manifest.get("cells")
    if not isinstance(cells, dict):
        raise BenchError(f"{p / 'suite.json'} is corrupt (no cells)")
    out = []
    for name, cell in cells.items():
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

    def runs_frame(self) -> pd.DataFrame:
        """One row per run: identity, settings and the scalar fields of its summary."""
        rows = []
        for r in self.runs:
            row = {"run_id": r.run_id, "path": str(r.path), "label": r.label}
            row.update({k: r.config.get(k) for k in ("method", *SETTING_KEYS, "device", "limit", "fidelity")})
            row["method_config"] = json.dumps(r.config.get("method_config"), sort_keys=True)
            row.update(_flat_summary(r.summary))
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


def _flat_summary(summary: dict) -> dict:
    """Scalar summary fields as ``summary_<key>``, dicts of scalars one level deep as ``summary_<key>_<sub>``."""
    out = {}
    for k, v in summary.items():
        if _scalar(v):
            out[f"summary_{k}"] = v
        elif isinstance(v, dict):
            out.update({f"summary_{k}_{sk}": sv for sk, sv in v.items() if _scalar(sv)})
    return out


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
    for path in paths:
        kind = dir_kind(path)
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
    seen: dict[str, int] = {}
    for r in runs:
        base = f"{r.workload}/{r.label}"
        seen[base] = seen.get(base, 0) + 1
        r.run_id = base if seen[base] == 1 else f"{base}#{seen[base]}"


def _flat_config(r: Run) -> dict:
    mc = {k: v for k, v in (r.config.get("method_config") or {}).items() if k != "name"}
    for k in ("target_reuse", "auto_tau"):
        if r.config.get(k) is not None:
            mc[k] = r.config[k]
    for k in SETTING_KEYS[1:]:
        mc[f"{k}"] = r.config.get(k)
    return mc


def _short(v) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)
