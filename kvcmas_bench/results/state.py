"""Method state persisted with every committed sample, so that a resumed run continues exactly where
an uninterrupted one would be (anchor pools, cached references, counters).

Layout inside a run directory::

    method_state/manifest-<n>.json   the method's learned state after <n> committed samples
    method_state/tensors/<key>.pt    every tensor, written once (weights-only ``torch.save``)

The manifest is JSON: dataclasses (anchor pools, anchors, factors, segment caches) are stored by
class name and fields (fields marked ``transient``, derived caches, are rebuilt instead), tensors by
key. Tensors that did not change since the last sample (the pools'
factors, cached references) are not written again, so a sample costs only its new tensors. Order
per sample: write ``manifest-<n>`` (atomically), commit the sample's records (the commit point),
then drop the older manifest and unreferenced tensors. Loading imports only dataclasses of this
package and tensors through ``torch.load(weights_only=True)``: a run directory cannot make the
harness execute code.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import tempfile
from pathlib import Path

import torch

from ..errors import BenchError

FORMAT = "kvcmas-method-state/1"
_PACKAGE = "kvcmas_bench."


class MethodStateStore:
    """Saves and restores ``method.persistent_state()`` next to a run directory's records."""

    def __init__(self, run_dir: str | Path):
        self.dir = Path(run_dir) / "method_state"
        self.tensors = self.dir / "tensors"
        self._known: dict[int, tuple[str, torch.Tensor]] = {}  # id(tensor) -> (key, tensor kept alive)
        self._used: dict[int, tuple[str, torch.Tensor]] = {}
        self._counter = 0
        self._device = torch.device("cpu")

    # ---- writing ---------------------------------------------------------------------------------
    def save(self, n: int, method, next_uid: int) -> None:
        """Write the state after ``n`` committed samples (before the n-th sample's records). A
        failed write (a full disk) leaves no temporary file behind and raises one
        :class:`BenchError` naming the directory; the sample is then not committed, so a resumed
        run redoes it."""
        try:
            self._save(n, method, next_uid)
        except OSError as exc:
            raise BenchError(
                f"cannot save the method state in {self.dir}: {exc.strerror or exc}; the last sample was not "
                "committed (free space and rerun the same command to resume)"
            ) from None

    def _save(self, n: int, method, next_uid: int) -> None:
        self.tensors.mkdir(parents=True, exist_ok=True)
        self._used = {}
        self._counter = 0
        body = {
            "format": FORMAT,
            "n": n,
            "method": method.name,
            "next_uid": next_uid,
            "state": self._encode(method.persistent_state(), n),
        }
        self._known = self._used
        _atomic_write(self.dir / f"manifest-{n}.json", json.dumps(body).encode())

    def commit(self, n: int) -> None:
        """Sample ``n`` is committed: drop older manifests and tensors no manifest ``n`` uses."""
        keep = {key for key, _ in self._known.values()}
        for p in self.dir.glob("manifest-*.json"):
            if p.name != f"manifest-{n}.json":
                p.unlink(missing_ok=True)
        for p in self.tensors.glob("*.pt"):
            if p.stem not in keep:
                p.unlink(missing_ok=True)

    def _encode(self, obj, n: int):
        if isinstance(obj, torch.Tensor):
            return {"__tensor__": self._tensor_key(obj, n)}
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return obj
        if isinstance(obj, list):
            return [self._encode(x, n) for x in obj]
        if isinstance(obj, tuple):
            return {"__tuple__": [self._encode(x, n) for x in obj]}
        if isinstance(obj, dict):
            return {"__dict__": [[self._encode(k, n), self._encode(v, n)] for k, v in obj.items()]}
        if dataclasses.is_dataclass(obj) and type(obj).__module__.startswith(_PACKAGE):
            cls = type(obj)
            fields = {
                f.name: self._encode(getattr(obj, f.name), n)
                for f in dataclasses.fields(obj)
                if not f.metadata.get("transient")
            }
            return {"__dataclass__": f"{cls.__module__}:{cls.__qualname__}", "fields": fields}
        raise TypeError(f"cannot persist a {type(obj).__name__} in method state")

    def _tensor_key(self, t: torch.Tensor, n: int) -> str:
        known = self._used.get(id(t)) or self._known.get(id(t))  # shared tensors are written once
        if known is not None and known[1] is t:
            key = known[0]
        else:
            key = f"{n}-{self._counter}"
            self._counter += 1
            buf = tempfile.NamedTemporaryFile(dir=self.tensors, suffix=".tmp", delete=False)
            buf.close()
            try:
                torch.save(t.detach().cpu().clone(), buf.name)
                os.replace(buf.name, self.tensors / f"{key}.pt")
            except BaseException:
                Path(buf.name).unlink(missing_ok=True)
                raise
        self._used[id(t)] = (key, t)
        return key

    # ---- reading ---------------------------------------------------------------------------------
    def load(self, n: int, method, device: torch.device | str = "cpu") -> int:
        """Restore the state saved after ``n`` samples into ``method``; returns the saved next uid.
        Raises :class:`BenchError` when it is missing or unreadable."""
        path = self.dir / f"manifest-{n}.json"
        try:
            body = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise BenchError(
                f"{path.parent.parent} has {n} finished samples but no saved state of {method.name} after them, "
                "so a resumed run could not reproduce an uninterrupted one; use a new --output-path"
            ) from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise BenchError(f"cannot read {path}: {exc}") from None
        if (
            not isinstance(body, dict)
            or body.get("format") != FORMAT
            or body.get("method") != method.name
            or body.get("n") != n
            or not isinstance(body.get("next_uid"), int)
        ):
            raise BenchError(f"{path} does not hold {method.name}'s state after {n} samples")
        self._used = {}
        self._loaded: dict[str, torch.Tensor] = {}
        self._device = torch.device(device)
        try:
            state = self._decode(body["state"])
            method.load_persistent_state(state)
        except Exception as exc:  # noqa: BLE001 - any damage to the files (a truncated tensor, a wrong shape)
            what = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
            raise BenchError(
                f"cannot restore method state from {path} ({type(exc).__name__}{': ' + what if what else ''}); "
                "its records were not changed (use a new --output-path)"
            ) from None
        self._known = self._used
        return body["next_uid"]

    def _decode(self, obj):
        if isinstance(obj, list):
            return [self._decode(x) for x in obj]
        if not isinstance(obj, dict):
            return obj
        if "__tensor__" in obj:
            key = str(obj["__tensor__"])
            if not key.replace("-", "").isdigit():
                raise ValueError(f"bad tensor key {key!r}")
            if key in self._loaded:  # a tensor shared by several owners stays shared
                return self._loaded[key]
            t = torch.load(self.tensors / f"{key}.pt", map_location=self._device, weights_only=True)
            self._used[id(t)] = (key, t)
            self._loaded[key] = t
            return t
        if "__tuple__" in obj:
            return tuple(self._decode(x) for x in obj["__tuple__"])
        if "__dict__" in obj:
            return {self._decode(k): self._decode(v) for k, v in obj["__dict__"]}
        if "__dataclass__" in obj:
            cls = _dataclass(obj["__dataclass__"])
            inst = cls.__new__(cls)
            fields = {f.name: f for f in dataclasses.fields(cls)}
            for name, value in obj["fields"].items():
                if name not in fields or fields[name].metadata.get("transient"):
                    raise ValueError(f"{cls.__name__} has no persistent field {name!r}")
                object.__setattr__(inst, name, self._decode(value))
            for f in fields.values():  # derived caches start empty and are rebuilt on use
                if f.metadata.get("transient"):
                    object.__setattr__(inst, f.name, f.default_factory())
            return inst
        raise ValueError(f"unexpected object in method state: {sorted(obj)[:3]}")


def _dataclass(ref: str) -> type:
    module, _, qualname = str(ref).partition(":")
    if not module.startswith(_PACKAGE) or not qualname.isidentifier():
        raise ValueError(f"refusing to restore {ref!r}: not a dataclass of this package")
    cls = getattr(importlib.import_module(module), qualname, None)
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise ValueError(f"{ref!r} is not a dataclass")
    return cls


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
