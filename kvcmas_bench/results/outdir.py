"""Output directories: one writer at a time, checked before any work, files replaced atomically.

Every job writes into one output directory. :func:`lock_output_dir` runs before the model loads: it
refuses a path that is a file, lies under a file or cannot be created or written (one ``BenchError``
line; :func:`check_output_dir` is that check alone), and takes an
exclusive, non-blocking ``flock`` on ``<dir>/.kvcmas-bench.lock`` that the job holds until it ends.
A second process writing into the same directory is refused with the holder's pid. The kernel
drops the lock when its holder dies, so a killed run never leaves a stale lock behind; the lock
file itself stays (deleting it would race with a new holder). Within one process the lock is
re-entrant, so a job and the run directory it opens can both hold it.

A single output file (``compare --markdown``) is checked up front by :func:`check_output_file`
the same way (not a directory, not under a file, its folder writable) without creating anything.

:func:`atomic_write` replaces a file through a temporary file with a unique name
(``.<name>.<pid>.<random>.tmp``) in the same directory, fsync'ed before the rename.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import threading
from collections.abc import Iterator
from pathlib import Path

from ..errors import BenchError

LOCK_NAME = ".kvcmas-bench.lock"

_guard = threading.Lock()
#: lock files this process holds: real path of the directory -> [descriptor, holders]
_held: dict[str, list[int]] = {}


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc)


def atomic_write(path: str | Path, data: str | bytes) -> None:
    """Write ``data`` to ``path`` through a uniquely named temporary file and an atomic rename."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    raw = data.encode("utf-8") if isinstance(data, str) else data
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:  # a full disk names the file it could not write
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from None
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _existing_ancestor(path: Path) -> Path:
    """``path`` itself or its nearest ancestor that exists (``.`` for a relative path with none)."""
    for p in (path, *path.parents):
        if p.exists():
            return p
    return Path(".")


def _probe(folder: Path) -> None:
    """Create and remove a uniquely named file in ``folder`` (an ``OSError`` when it cannot be written)."""
    probe = folder / f".kvcmas-bench-probe.{os.getpid()}.{secrets.token_hex(4)}"
    os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
    os.unlink(probe)


def _check_creatable(folder: Path, flag: str, shown: Path) -> None:
    """The missing directory ``folder`` can be created: its nearest existing ancestor is a writable
    directory (``shown``: the path the user gave, for the message)."""
    anc = _existing_ancestor(folder)
    if not anc.is_dir():
        raise BenchError(f"cannot create {flag} {shown}: {anc} is not a directory")
    try:
        _probe(anc)
    except OSError as exc:
        raise BenchError(f"cannot create {flag} {shown}: {anc} is not writable ({_reason(exc)})") from None


def check_output_dir(path: str | Path, flag: str = "--output-path") -> Path:
    """Refuse (one ``BenchError`` line) an output directory that is a file, lies under a file, or
    cannot be created or written; creates nothing. :func:`lock_output_dir` runs the same check."""
    path = Path(path)
    if not path.exists():
        _check_creatable(path, flag, path)
    elif not path.is_dir():
        raise BenchError(f"{flag} {path} exists and is not a directory")
    else:
        try:
            _probe(path)
        except OSError as exc:
            raise BenchError(f"cannot write to {flag} {path}: {_reason(exc)}") from None
    return path


def check_output_file(path: str | Path, flag: str) -> Path:
    """Refuse (one ``BenchError`` line) an output file path that is a directory, lies under a file,
    or whose folder cannot be created or written; creates nothing."""
    path = Path(path)
    if path.is_dir():
        raise BenchError(f"{flag} {path} is a directory, not a file")
    if path.exists() and not path.is_file():
        raise BenchError(f"{flag} {path} exists and is not a regular file")
    folder = path.parent
    if not folder.exists():
        _check_creatable(folder, flag, path)
    elif not folder.is_dir():
        raise BenchError(f"cannot create {flag} {path}: {folder} is not a directory")
    else:
        try:
            _probe(folder)
        except OSError as exc:
            raise BenchError(f"cannot write {flag} {path}: {folder} is not writable ({_reason(exc)})") from None
    return path


def write_output_file(path: str | Path, text: str) -> Path:
    """Write an output file checked by :func:`check_output_file` (its folder created if missing)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, text)
    return path


def _holder(fd: int) -> str:
    try:
        pid = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        pid = ""
    return f"pid {pid}" if pid.isdigit() else "pid unknown"


def _acquire(path: Path, flag: str) -> tuple[str, bool]:
    if path.exists() and not path.is_dir():
        raise BenchError(f"{flag} {path} exists and is not a directory")
    created = not path.exists()
    if created:
        _check_creatable(path, flag, path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BenchError(f"cannot create {flag} {path}: {_reason(exc)}") from None
    key = os.path.realpath(path)
    with _guard:
        if key in _held:
            _held[key][1] += 1
            return key, False
        try:
            fd = os.open(path / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise BenchError(f"cannot write to {flag} {path}: {_reason(exc)}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            who = _holder(fd)
            os.close(fd)
            raise BenchError(
                f"{path} is in use by another kvcmas-bench process ({who}); wait for it to end or use another {flag}"
            ) from None
        try:  # the lock file may be writable where the directory is not: create a file to be sure
            probe = path / f".kvcmas-bench-probe.{os.getpid()}.{secrets.token_hex(4)}"
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
            os.unlink(probe)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
        except OSError as exc:
            os.close(fd)
            raise BenchError(f"cannot write to {flag} {path}: {_reason(exc)}") from None
        _held[key] = [fd, 1]
    return key, created


def _release(key: str, path: Path, remove_if_empty: bool) -> None:
    with _guard:
        entry = _held.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] > 0:
            return
        del _held[key]
        if remove_if_empty:  # a job that failed before writing anything leaves no empty directory
            with contextlib.suppress(OSError):
                if {p.name for p in path.iterdir()} == {LOCK_NAME}:
                    (path / LOCK_NAME).unlink()
                    path.rmdir()
        os.close(entry[0])


@contextlib.contextmanager
def lock_output_dir(path: str | Path, flag: str = "--output-path") -> Iterator[Path]:
    """Hold the exclusive lock of output directory ``path`` (created if missing) for the block.

    Raises :class:`BenchError` when ``path`` is a file, cannot be created or written, or is held by
    another process. When the block fails and the directory was created here and is still empty,
    it is removed again.
    """
    path = Path(path)
    key, created = _acquire(path, flag)
    ok = False
    try:
        yield path
        ok = True
    finally:
        _release(key, path, remove_if_empty=created and not ok)


class DirLock:
    """The lock of ``path`` held by an object (a run directory) until :meth:`release` or exit."""

    def __init__(self, path: str | Path, flag: str = "--output-path"):
        self.path = Path(path)
        self._key, _ = _acquire(self.path, flag)
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            _release(self._key, self.path, remove_if_empty=False)
