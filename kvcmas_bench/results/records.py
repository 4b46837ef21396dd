"""Run directories: config.json, samples.jsonl, requests.jsonl, summary.json, with resume.

Records are appended one line at a time and fsync'ed: a sample's request lines first, then its
sample line. A sample counts as finished only once its sample line is complete, so a run killed at
any point resumes by skipping finished samples and dropping what the kill cut off: a torn last line
and the request lines of the unfinished sample. Nothing else is ever dropped or rewritten: any other
damage (a corrupt line in the middle, a line that is not a record, a sample or request written
twice, a sample id that its request lines do not carry) stops the run with one line naming the
file and line, and leaves every file as it was. Readers (``report``, ``compare``, ``ablate``,
``analyze``, through :mod:`.frames`) check a run directory by the same :func:`read_run_files`,
only worded for input (:func:`corrupt_input`). A run directory is locked (:mod:`.outdir`) while a
``RunDir`` is open, so two processes never write into the same one.
"""

from __future__ import annotations

import functools
import json
import math
import os
import weakref
from collections.abc import Callable
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
    "warmup_samples",
    "engine",
)


_NOT_JSON = object()  # what _parse gives for a line that is not JSON at all


def _parse(path: Path) -> tuple[list[tuple[int, bytes, object]], bool]:
    """``path``'s lines as (line number, raw bytes, parsed object or ``_NOT_JSON``), and whether its last
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
            obj = _NOT_JSON
        rows.append((n, line, obj))
    torn = bool(rows) and (not raw[-1].endswith(b"\n") or not isinstance(rows[-1][2], dict))
    return (rows[:-1] if torn else rows), torn


#: ``corrupt(path, line number, what is wrong)``: the error raised for a damaged line
Corrupt = Callable[[Path, int, str], BenchError]


def _corrupt(path: Path, n: int, what: str) -> BenchError:
    """The error of a damaged line for a job that writes into the directory (``run``'s resume)."""
    return BenchError(
        f"{path} line {n} {what}; nothing was changed (repair or remove that line, or use another --output-path)"
    )


def corrupt_input(path: Path, n: int, what: str) -> BenchError:
    """The error of a damaged line for a job that only reads the directory (``report``, ``compare``)."""
    return BenchError(f"{path} is corrupt (line {n} {what})")


def read_jsonl_objects(path: Path, corrupt: Corrupt = _corrupt) -> tuple[list[tuple[int, bytes, dict]], bool]:
    """Every line of ``path`` as (line number, raw bytes, JSON object), and whether a torn last line
    was dropped; any other line that is not a JSON object raises ``corrupt(...)`` naming it."""
    rows, torn = _parse(path)
    for n, _, obj in rows:
        if not isinstance(obj, dict):
            raise corrupt(path, n, "is not JSON" if obj is _NOT_JSON else "is not a JSON object")
    return rows, torn  # type: ignore[return-value]


def request_steps(config: dict | None) -> int | None:
    """Request lines per finished sample of the run ``config`` describes (one per workflow node,
    listed as ``agents``), or None when the config does not say."""
    agents = (config or {}).get("agents")
    return len(agents) if isinstance(agents, list) and agents else None


def sample_judge(config: dict | None) -> Callable[[str | None, str | None], bool] | None:
    """The scoring rule (``Workload.judge``) of the workload the run ``config`` names, or None when
    the config names none; an unknown workload is a one-line :class:`BenchError`."""
    name = (config or {}).get("workload")
    if name is None:
        return None
    from ..workloads import WORKLOADS

    return WORKLOADS.lookup(str(name)).judge


def dataset_gold(config: dict | None) -> dict[str, str] | None:
    """Sample id -> gold answer in the data of the text workload the run ``config`` names (its
    ``data_path`` and ``subjects``), read once per process and data version; None where the config
    names none, names a vision workload or a hub dataset, or its data cannot be read here (a local
    path absent on this machine): readers then check ``correct`` against the record's own gold."""
    cfg = config or {}
    name, data_path, subjects = cfg.get("workload"), cfg.get("data_path"), cfg.get("subjects")
    if not isinstance(name, str) or not isinstance(data_path, str | None) or str(data_path).startswith("hub"):
        return None
    if subjects is not None and not (isinstance(subjects, list) and all(isinstance(x, str) for x in subjects)):
        return None
    try:
        version = os.stat(data_path).st_mtime_ns if data_path else None
    except OSError:
        return None
    return _gold_of(name, data_path, tuple(subjects) if subjects else None, version)


@functools.lru_cache(maxsize=8)
def _gold_of(name: str, data_path: str | None, subjects: tuple | None, _version: int | None) -> dict | None:
    from ..workloads import WORKLOADS

    cls = WORKLOADS.lookup(name)
    if cls.modality != "text":
        return None
    try:
        samples = cls(data_path=data_path, subjects=list(subjects) if subjects else None).load()
    except (BenchError, OSError, ValueError, NotImplementedError):  # not readable here: not checked
        return None
    return {s.id: s.gold for s in samples}


def read_run_files(samples_path: Path, requests_path: Path, config: dict | None = None, corrupt: Corrupt = _corrupt):
    """The finished samples and their request records of a run directory, checked line by line:
    the one rule set of every job that opens a run directory, writers (``run``'s resume) and
    readers (``report``, ``compare``, ``ablate``, ``analyze``) alike.

    A sample is finished once its sample line is complete. A torn last line of either file and the
    request lines of the one unfinished sample at the end of ``requests.jsonl`` (written before a
    kill cut its sample line) are dropped; any other damage raises ``corrupt(path, line, what)``
    naming the file and line: a corrupt line anywhere else, a line that is not a JSON object, a
    sample without an id or written twice, request lines of no finished sample followed by finished
    ones (a sample id changed) or of more than one unfinished sample, a finished sample's request
    line that is not a valid ``RequestRecord`` or is written twice, a finished sample with missing
    request steps (how many each sample has, when the ``config`` says, see :func:`request_steps`;
    else steps 0..k-1 without gaps). What the run ``config`` (its ``config.json``) fixes is checked
    too: every sample is one of its ``sample_ids`` (when recorded), its ``gold`` is the one the
    workload's data gives that sample (where the data can be read here, see :func:`dataset_gold`),
    and its ``correct`` is the workload's scoring of its ``prediction`` against that ``gold``
    (re-scored here, not trusted).
    Returns (sample rows, request rows, requests, whether a file must be rewritten without the
    dropped lines); rows are (line number, raw bytes, object).
    """
    samples, torn_s = read_jsonl_objects(samples_path, corrupt)
    done = _finished_samples(samples, samples_path, corrupt)
    _check_samples(samples, config, samples_path, corrupt)
    lines, torn_r = read_jsonl_objects(requests_path, corrupt)
    kept, records = _finished_requests(lines, done, requests_path, samples_path, corrupt)
    _check_steps(records, done, request_steps(config), samples_path, requests_path, corrupt)
    _check_gold(samples, config, samples_path, corrupt)
    rewrite = torn_s or torn_r or len(kept) != len(lines)
    return samples, kept, records, rewrite


def _finished_samples(samples: list, samples_path: Path, corrupt: Corrupt) -> dict[str, int]:
    """Sample id -> line number of every sample line; refuses a line that is not a sample record
    and a sample written twice."""
    done: dict[str, int] = {}
    for n, _, s in samples:
        sid = s.get("sample_id")
        if not isinstance(sid, str) or not isinstance(s.get("correct"), bool):
            raise corrupt(samples_path, n, "is not a sample record (sample_id, correct)")
        for key in ("latency_s", "ttft_s"):
            v = s.get(key)
            if v is not None and not (isinstance(v, int | float) and not isinstance(v, bool) and 0 <= v < math.inf):
                raise corrupt(samples_path, n, f"is not a valid sample record ({key} {v!r} is not a duration)")
        if sid in done:
            raise corrupt(samples_path, n, f"repeats sample {sid!r} of line {done[sid]} (two runs wrote at once?)")
        done[sid] = n
    return done


def _check_samples(samples: list, config: dict | None, samples_path: Path, corrupt: Corrupt) -> None:
    """Every sample line is one of the run's samples (``config["sample_ids"]``, when recorded) and
    its ``correct`` is what the workload's rule says of its ``prediction`` and ``gold``."""
    ids = (config or {}).get("sample_ids")
    wanted = set(ids) if isinstance(ids, list) else None
    judge = sample_judge(config)
    for n, _, s in samples:
        sid = s["sample_id"]
        if wanted is not None and sid not in wanted:
            raise corrupt(
                samples_path, n, f"is sample {sid!r}, which is not one of the run's {len(wanted)} samples (config.json)"
            )
        if judge is None:
            continue
        pred, gold = s.get("prediction"), s.get("gold")
        for key, v in (("prediction", pred), ("gold", gold)):
            if v is not None and not isinstance(v, str):
                raise corrupt(samples_path, n, f"is not a valid sample record ({key} {v!r} is not a string)")
        if judge(pred, gold) != s["correct"]:
            raise corrupt(
                samples_path,
                n,
                f"says correct {str(s['correct']).lower()}, but prediction {pred!r} against gold {gold!r} "
                f"scores {str(not s['correct']).lower()}",
            )


def _check_gold(samples: list, config: dict | None, samples_path: Path, corrupt: Corrupt) -> None:
    """Every sample is one of the workload's data and carries the gold answer the data gives it
    (where the data can be read here, :func:`dataset_gold`): a record whose prediction and gold
    were both changed still re-scores as written, so the gold is taken from the data."""
    data_gold = dataset_gold(config)
    if data_gold is None:
        return
    for n, _, s in samples:
        sid, gold = s["sample_id"], s.get("gold")
        if sid not in data_gold:
            raise corrupt(samples_path, n, f"is sample {sid!r}, which is not in the {config['workload']} data")
        if data_gold[sid] != gold:
            raise corrupt(
                samples_path,
                n,
                f"gives gold {gold!r} for sample {sid!r}, but the {config['workload']} data says {data_gold[sid]!r}",
            )


def _finished_requests(
    lines: list, done: dict[str, int], requests_path: Path, samples_path: Path, corrupt: Corrupt
) -> tuple[list, list[RequestRecord]]:
    """The request lines of finished samples, as rows and as records; the lines of the one
    unfinished sample at the end are dropped, any other line of no finished sample refused."""
    kept, records, seen = [], [], {}
    orphan: tuple[int, object] | None = None  # first line of the unfinished sample and its id
    for n, line, r in lines:
        sid = r.get("sample_id")
        if not isinstance(sid, str) or sid not in done:  # of the sample a kill cut off: only ever the tail
            if orphan is None:
                orphan = (n, sid)
            elif sid != orphan[1]:
                raise corrupt(
                    requests_path,
                    n,
                    f"belongs to sample {sid!r}, which has no line in {samples_path.name}, after line "
                    f"{orphan[0]} of unfinished sample {orphan[1]!r} (a kill cuts off one sample only)",
                )
            continue
        if orphan is not None:
            raise corrupt(
                requests_path,
                orphan[0],
                f"belongs to sample {orphan[1]!r}, which has no line in {samples_path.name}, "
                "but finished samples follow it",
            )
        rec = _request_record(r, n, requests_path, corrupt)
        key = (rec.sample_id, rec.step)
        if key in seen:
            raise corrupt(
                requests_path, n, f"repeats request {rec.step} of sample {rec.sample_id!r} of line {seen[key]}"
            )
        seen[key] = n
        kept.append((n, line, r))
        records.append(rec)
    return kept, records


def _request_record(r: dict, n: int, requests_path: Path, corrupt: Corrupt) -> RequestRecord:
    """Line ``n`` as a ``RequestRecord`` with an integer step (its place in the sample's workflow:
    without it a request could be missing or written twice unseen), else ``corrupt(...)``."""
    try:
        rec = RequestRecord.from_dict(r)
        if rec.step is None:
            raise ValueError("no step")
        if not isinstance(rec.step, int) or isinstance(rec.step, bool):
            raise ValueError(f"step {rec.step!r} is not an integer")
    except (ValueError, TypeError, AttributeError, KeyError) as exc:
        raise corrupt(requests_path, n, f"is not a valid request record ({str(exc)[:200]})") from None
    return rec


def _check_steps(
    records: list[RequestRecord],
    done: dict[str, int],
    steps: int | None,
    samples_path: Path,
    requests_path: Path,
    corrupt: Corrupt,
) -> None:
    """Every finished sample has its request steps: ``steps`` of them (0..steps-1) when given, else
    0..k-1 without gaps."""
    got_steps: dict[str, list] = {}
    for rec in records:
        got_steps.setdefault(rec.sample_id, []).append(rec.step)
    for sid, n in done.items():
        got = got_steps.get(sid, [])
        want = list(range(len(got) if steps is None else steps))
        if not got or sorted(got) != want:
            bad = steps is not None and not set(got) <= set(want)
            what = f"are not its {steps} steps 0..{steps - 1}" if bad else "are incomplete"
            raise corrupt(samples_path, n, f"is sample {sid!r}, whose request lines in {requests_path.name} {what}")


def check_run_dir(path: str | Path) -> None:
    """Raise ``BenchError`` if the run directory ``path`` is damaged beyond a torn last line (as
    opening it would), without changing anything: lets a job fail before it loads the model."""
    path = Path(path)
    config = _run_config(path)
    read_run_files(path / "samples.jsonl", path / "requests.jsonl", config)


def _run_config(path: Path) -> dict | None:
    """The ``config.json`` of the run directory ``path`` (None: a new directory). A run writes it
    before its first record, so records without one are refused: nothing says which run wrote them
    (resuming them as another method would relabel its records)."""
    config = _read_config(path / "config.json")
    records = [f for f in ("samples.jsonl", "requests.jsonl") if (path / f).is_file() and (path / f).stat().st_size]
    if config is None and records:
        raise BenchError(
            f"{path} holds {records[0]} but no config.json, so nothing says which run wrote it; "
            "use another --output-path"
        )
    return config


def _check_resumed_set(samples: list, config: dict, samples_path: Path) -> None:
    """A resumed run's finished samples are all among the samples it now evaluates (a smaller
    ``--limit`` than before would leave samples that its summary leaves out and the readers count)."""
    ids = config.get("sample_ids")
    if not isinstance(ids, list):
        return
    wanted = set(ids)
    outside = [(n, s["sample_id"]) for n, _, s in samples if s["sample_id"] not in wanted]
    if outside:
        n, sid = outside[0]
        raise BenchError(
            f"{samples_path} line {n} is sample {sid!r}, outside this run's {len(wanted)} samples "
            f"({len(outside)} finished samples are; a smaller --limit than before?); nothing was changed "
            "(rerun with the earlier --limit or use another --output-path)"
        )


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
        old = _run_config(self.path)
        if old is not None:
            diff = [k for k in RESUME_KEYS if old.get(k) != config.get(k)]
            if diff:
                raise BenchError(
                    f"{self.path} holds a run with a different {diff[0]} "
                    f"({old.get(diff[0])!r} vs {config.get(diff[0])!r}); use another --output-path"
                )
        samples, requests, self.requests, rewrite = read_run_files(self.samples_path, self.requests_path, old)
        _check_resumed_set(samples, config, self.samples_path)
        self.samples = [s for _, _, s in samples]
        # what a kill cut off (a torn last line, the request lines of the unfinished sample) is
        # dropped by repair(): after the caller's own checks (the method state), before the first append
        self._repair = (samples, requests) if rewrite else None
        self._config = config

    def repair(self) -> None:
        """Drop what a kill cut off (kept lines stay byte-identical) and write the run's config:
        the first change to the directory, made once every check has passed."""
        if self._repair is not None:
            samples, requests = self._repair
            atomic_write(self.samples_path, b"".join(line for _, line, _ in samples))
            atomic_write(self.requests_path, b"".join(line for _, line, _ in requests))
            self._repair = None
        if self._config is not None:
            write_json(self.config_path, self._config)
            self._config = None

    @property
    def done_ids(self) -> set[str]:
        return {s["sample_id"] for s in self.samples}

    def close(self) -> None:
        """Release the directory's lock (also done when the object is garbage collected)."""
        self._finalizer()

    def append(self, sample: dict, requests: list[RequestRecord]) -> None:
        """Commit one sample: its request lines, then its sample line (the commit point), each
        fsync'ed. A failed write (a full disk) is an ``OSError`` naming the file; what it cut off
        is what a kill cuts off, dropped by the next resume."""
        self.repair()
        _append_lines(self.requests_path, [json.dumps(r.to_dict()) + "\n" for r in requests])
        _append_lines(self.samples_path, [json.dumps(sample) + "\n"])
        self.samples.append(sample)
        self.requests.extend(requests)

    def log_prompts(self, rows: list[dict]) -> None:
        """Append a committed sample's rendered prompts to ``prompts.jsonl`` (``--log-prompts``): a
        log for people, read by no figure; a kill between the commit and this write loses that
        sample's lines only."""
        _append_lines(self.path / "prompts.jsonl", [json.dumps(r) + "\n" for r in rows])


def _append_lines(path: Path, lines: list[str]) -> None:
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.writelines(lines)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from None
