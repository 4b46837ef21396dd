"""Run directories: config.json, samples.jsonl, requests.jsonl, summary.json, with resume.

Records are appended one line at a time and fsync'ed: a sample's request lines first, then its
sample line. A sample counts as finished only once its sample line is complete, so a run killed at
any point resumes by skipping finished samples and dropping the orphaned request lines of the
sample that was cut off; nothing is duplicated or lost.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import BenchError
from .request import RequestRecord

# Config keys that must match for a resume: changing them would mix incomparable results.
RESUME_KEYS = (
    "method",
    "method_config",
    "workload",
    "model",
    "dtype",
    "seed",
    "subjects",
    "max_new_tokens",
    "final_max_new_tokens",
    "data_path",
    "fidelity",
    "topology",
    "n_agents",
    "rounds",
    "target_reuse",
)


def _read_jsonl(path: Path) -> list[dict]:
    """Complete JSON lines of ``path``; a torn last line (killed mid-write) is ignored."""
    if not path.exists():
        return []
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.endswith("\n"):
                break
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return rows


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def write_json(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n", encoding="utf-8")
    tmp.replace(path)


class RunDir:
    """One output directory of one (method, workload, model) run."""

    def __init__(self, path: str | Path, config: dict):
        self.path = Path(path)
        if self.path.exists() and not self.path.is_dir():
            raise BenchError(f"--output-path {self.path} exists and is not a directory")
        self.path.mkdir(parents=True, exist_ok=True)
        self.config_path = self.path / "config.json"
        self.samples_path = self.path / "samples.jsonl"
        self.requests_path = self.path / "requests.jsonl"
        self.summary_path = self.path / "summary.json"
        config = json.loads(json.dumps(config, default=str))  # compare as stored (tuples -> lists)
        if self.config_path.exists():
            try:
                old = json.loads(self.config_path.read_text(encoding="utf-8"))
            except json.JSONDecodeError:
                raise BenchError(f"{self.config_path} is not valid JSON; use another --output-path") from None
            diff = [k for k in RESUME_KEYS if old.get(k) != config.get(k)]
            if diff:
                raise BenchError(
                    f"{self.path} holds a run with a different {diff[0]} "
                    f"({old.get(diff[0])!r} vs {config.get(diff[0])!r}); use another --output-path"
                )
        self.samples = _read_jsonl(self.samples_path)
        done = {s["sample_id"] for s in self.samples}
        self.samples = list({s["sample_id"]: s for s in self.samples}.values())
        requests = [r for r in _read_jsonl(self.requests_path) if r.get("sample_id") in done]
        _write_jsonl(self.samples_path, self.samples)
        _write_jsonl(self.requests_path, requests)
        self.requests = [RequestRecord.from_dict(r) for r in requests]
        write_json(self.config_path, config)

    @property
    def done_ids(self) -> set[str]:
        return {s["sample_id"] for s in self.samples}

    def append(self, sample: dict, requests: list[RequestRecord]) -> None:
        with open(self.requests_path, "a", encoding="utf-8") as f:
            for r in requests:
                f.write(json.dumps(r.to_dict()) + "\n")
            f.flush()
            os.fsync(f.fileno())
        with open(self.samples_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(sample) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.samples.append(sample)
        self.requests.extend(requests)
