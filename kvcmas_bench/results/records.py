"""Run directories: config.json, samples.jsonl, requests.jsonl, summary.json, with resume.

Records are appended one line at a time and fsync'ed: a sample's request lines first, then its
sample line. A sample counts as finished only once its sample line is complete, so a run killed at
any point resumes by skipping finished samples and dropping what the kill cut off: a torn last line
and the request lines of the unfinished sample. Nothing else is ever dropped or rewritten: any other
damage (a corrupt line in the middle, a line that is not a record, a sample or request written
twice) stops the run with one line naming the file and line, and leaves every file as it was. A
run directory is locked (:mod:`.outdir`) while a ``RunDir`` is open, so two processes never write
into the same one.
"""

from __future__ import annotations

import json
import os
import weakref
from pathlib import Path

from ..errors import BenchError
from .outdir import DirLock, atomic_write
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


def _parse(path: Path) -> tuple[list[tuple[int, bytes, object]], bool]:
    """``path``'s lines as (line number, raw bytes, parsed object or None), and whether its last
    line is torn (killed mid-write: no newline at the end, or not parseable) and dropped."""
    if not path.exists():
        return [], False
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise BenchError(f"cannot read {path}: {exc.strerror or exc}") from None
    raw = [line + b"\n" for line in data.split(b"\n")]
    raw[-1] = raw[-1][:-1]  # what follows the last newline: b"" or a line cut before its newline
    if not raw[-1]:
        raw.pop()
    rows: list[tuple[int, bytes, object]] = []
    for n, line in enumerate(raw, 1):
        try:
            obj = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            obj = None
        rows.append((n, line, obj))
    torn = bool(rows) and (not raw[-1].endswith(b"\n") or not isinstance(rows[-1][2], dict))
    return (rows[:-1] if torn else rows), torn


def _corrupt(path: Path, n: int, what: str) -> BenchError:
    return BenchError(
        f"{path} line {n} {what}; nothing was changed (repair or remove that line, or use another --output-path)"
    )


def read_jsonl_objects(path: Path) -> tuple[list[tuple[int, bytes, dict]], bool]:
    """Every line of ``path`` as (line number, raw bytes, JSON object), and whether a torn last line
    was dropped; any other line that is not a JSON object raises ``BenchError`` naming it."""
    rows, torn = _parse(path)
    for n, _, obj in rows:
        if not isinstance(obj, dict):
            raise _corrupt(path, n, "is not a JSON object")
    return rows, torn  # type: ignore[return-value]


def read_run_files(samples_path: Path, requests_path: Path):
    """The finished samples and their request records of a run directory, checked line by line.

    A sample is finished once its sample line is complete. A torn last line of either file and the
    request lines of the unfinished sample at the end of ``requests.jsonl`` (written before a kill
    cut its sample line) are dropped; any other damage (a corrupt line anywhere else, a line that is
    not a JSON object, a sample without an id or written twice, a finished sample's request line
    that is not a valid ``RequestRecord`` or is written twice, a finished sample with missing
    request steps) raises ``BenchError`` naming the file and line.
    Returns (sample rows, request rows, requests, whether a file must be rewritten without the
    dropped lines); rows are (line number, raw bytes, object).
    """
    samples, torn_s = read_jsonl_objects(samples_path)
    done: dict[str, int] = {}
    for n, _, s in samples:
        sid = s.get("sample_id")
        if not isinstance(sid, str) or not isinstance(s.get("correct"), bool):
            raise _corrupt(samples_path, n, "is not a sample record (sample_id, correct)")
        if sid in done:
            raise _corrupt(samples_path, n, f"repeats sample {sid!r} of line {done[sid]} (two runs wrote at once?)")
        done[sid] = n
    lines, torn_r = read_jsonl_objects(requests_path)
    kept, records, seen, orphan = [], [], {}, None
    for n, line, r in lines:
        if r.get("sample_id") not in done:
            orphan = orphan or n  # of a sample cut off by a kill: only ever the tail of the file
            continue
        if orphan is not None:
            raise _corrupt(requests_path, orphan, "belongs to no finished sample but is followed by finished ones")
        try:
            rec = RequestRecord.from_dict(r)
        except (ValueError, TypeError, AttributeError, KeyError) as exc:
            raise _corrupt(requests_path, n, f"is not a valid request record ({str(exc)[:200]})") from None
        key = (rec.sample_id, rec.step)
        if rec.step is not None and key in seen:
            raise _corrupt(
                requests_path, n, f"repeats request {rec.step} of sample {rec.sample_id!r} of line {seen[key]}"
            )
        seen[key] = n
        kept.append((n, line, r))
        records.append(rec)
    steps: dict[str, list] = {}
    for rec in records:
        steps.setdefault(rec.sample_id, []).append(rec.step)
    for sid, n in done.items():
        got = steps.get(sid, [])
        if not got or (None not in got and sorted(got) != list(range(len(got)))):
            raise _corrupt(
                samples_path, n, f"is sample {sid!r}, whose request lines in {requests_path.name} are incomplete"
            )
    rewrite = torn_s or torn_r or len(kept) != len(lines)
    return samples, kept, records, rewrite


def check_run_dir(path: str | Path) -> None:
    """Raise ``BenchError`` if the run directory ``path`` is damaged beyond a torn last line (as
    opening it would), without changing anything: lets a job fail before it loads the model."""
    path = Path(path)
    _read_config(path / "config.json")
    read_run_files(path / "samples.jsonl", path / "requests.jsonl")


def _read_config(path: Path) -> dict | None:
    if not path.exists():
        return None
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        raise BenchError(f"{path} is not valid JSON; use another --output-path") from None
    if not isinstance(old, dict):
        raise BenchError(f"{path} is not a run configuration; use another --output-path")
    return old


def write_json(path: Path, obj: dict) -> None:
    atomic_write(path, json.dumps(obj, indent=2, default=str) + "\n")


class RunDir:
    """One output directory of one (method, workload, model) run, locked while the object lives."""

    def __init__(self, path: str | Path, config: dict):
        self.path = Path(path)
        lock = DirLock(self.path)
        self._finalizer = weakref.finalize(self, lock.release)
        try:
            self._open(config)
        except BaseException:
            self.close()
            raise

    def _open(self, config: dict) -> None:
        self.config_path = self.path / "config.json"
        self.samples_path = self.path / "samples.jsonl"
        self.requests_path = self.path / "requests.jsonl"
        self.summary_path = self.path / "summary.json"
        config = json.loads(json.dumps(config, default=str))  # compare as stored (tuples -> lists)
        old = _read_config(self.config_path)
        if old is not None:
            diff = [k for k in RESUME_KEYS if old.get(k) != config.get(k)]
            if diff:
                raise BenchError(
                    f"{self.path} holds a run with a different {diff[0]} "
                    f"({old.get(diff[0])!r} vs {config.get(diff[0])!r}); use another --output-path"
                )
        samples, requests, self.requests, rewrite = read_run_files(self.samples_path, self.requests_path)
        self.samples = [s for _, _, s in samples]
        if rewrite:  # drop a torn last line and orphaned request lines; kept lines stay byte-identical
            atomic_write(self.samples_path, b"".join(line for _, line, _ in samples))
            atomic_write(self.requests_path, b"".join(line for _, line, _ in requests))
        write_json(self.config_path, config)

    @property
    def done_ids(self) -> set[str]:
        return {s["sample_id"] for s in self.samples}

    def close(self) -> None:
        """Release the directory's lock (also done when the object is garbage collected)."""
        self._finalizer()

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
