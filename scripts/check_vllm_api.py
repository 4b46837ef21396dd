"""Does KVCMASConnector satisfy the KV-connector interface of a given vLLM, without importing it?

    python scripts/check_vllm_api.py PATH

PATH: an installed ``vllm`` package directory, an unpacked wheel, or a ``.whl`` (``pip download
vllm==0.34.0 --no-deps -d /tmp/w`` fetches one without its CUDA libraries). The check reads vLLM's
``KVConnectorBase_V1`` and the connector factory from source (AST) and our connector likewise: every
abstract method is defined with the base's parameters, the constructor takes ``kv_cache_config``
(the factory refuses a two-argument one), and whether the hybrid KV-cache manager would be turned off
(no ``SupportsHMA``). Prints one line per finding; exit 1 when a required item is missing.
"""

from __future__ import annotations

import ast
import sys
import zipfile
from pathlib import Path

BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
CONNECTOR = Path(__file__).resolve().parents[1] / "kvcmas_bench/serving/vllm/connector.py"


def _read(path: Path, member: str) -> str:
    if path.suffix == ".whl":
        with zipfile.ZipFile(path) as z:
            return z.read(member).decode()
    root = path.parent if path.name == "vllm" else path
    return (root / member).read_text()


def _class(src: str, name: str) -> ast.ClassDef:
    return next(n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.ClassDef) and n.name == name)


def _methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _decorators(fn) -> set[str]:
    return {d.id if isinstance(d, ast.Name) else getattr(d, "attr", "") for d in fn.decorator_list}


def _params(fn) -> list[str]:
    return [a.arg for a in fn.args.posonlyargs + fn.args.args]


def check(path: Path) -> tuple[list[str], list[str]]:
    """(problems, notes) of our connector against the vLLM at ``path``."""
    base = _class(_read(path, BASE), "KVConnectorBase_V1")
    ours = _methods(_class(CONNECTOR.read_text(), "KVCMASConnector"))
    problems, notes = [], []
    for name, fn in _methods(base).items():
        if "abstractmethod" not in _decorators(fn):
            continue
        mine = ours.get(name)
        if mine is None:
            problems.append(f"abstract method {name}{tuple(_params(fn))} is not defined")
        elif len(_params(mine)) < len(_params(fn)) and mine.args.vararg is None:
            problems.append(f"{name}: takes {_params(mine)}, vLLM passes {_params(fn)}")
        else:
            notes.append(f"ok: {name}")
    init = ours.get("__init__")
    if init is None or "kv_cache_config" not in _params(init) + [a.arg for a in init.args.kwonlyargs]:
        problems.append("__init__ does not take kv_cache_config (the factory refuses 2-argument constructors)")
    for hook in ("requires_piecewise_for_cudagraph", "build_connector_worker_meta", "update_connector_output"):
        if hook in _methods(base) and hook not in ours:
            notes.append(f"note: {hook} not overridden")
        elif hook not in _methods(base):
            problems.append(f"{hook}: no longer in vLLM's base class (the connector relies on it)")
    src = _read(path, BASE)
    if "class SupportsHMA" in src:
        notes.append("note: no SupportsHMA: vLLM turns the hybrid KV-cache manager off for this connector (a warning)")
    return problems, notes


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: check_vllm_api.py PATH (a vllm package dir, unpacked wheel or .whl)", file=sys.stderr)
        return 2
    try:
        problems, notes = check(Path(argv[0]))
    except (OSError, KeyError, StopIteration, SyntaxError) as exc:
        print(f"check_vllm_api: cannot read vLLM's connector base at {argv[0]}: {exc}", file=sys.stderr)
        return 2
    for line in notes + [f"MISSING: {p}" for p in problems]:
        print(line)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
