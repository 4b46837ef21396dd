"""The one place a request's ``kv_transfer_params`` are checked, and the capabilities they carry.

A client of a shared ``vllm serve`` deployment is untrusted: everything it puts in
``kv_transfer_params`` is checked here for type, range and existence before anything is looked up
with it, on the API server (:mod:`.edge`, HTTP 400 with one line) and again on the scheduler side
of the connector (:mod:`.connector`: a request that slipped past the edge is answered at once with
the reason, never planned and never able to raise inside the engine loop).

Capabilities, not names: a session is named by its secret (:func:`new_secret`, 128 random bits,
32 hex digits): whoever holds it can plan, report and end that session, nobody else can reach it,
and trajectory ids live inside it. Records and logs name a session by :func:`session_tag` (a hash
of the secret). Every kvcmas request is prefix-cache salted from its session's secret
(:func:`salt_for`), so blocks that received injected or corrected K/V live in that session's
namespace and a plain request can never hit them.

No vLLM import here: the harness (client side) and the tests use it anywhere.
"""

from __future__ import annotations

import hashlib
import math
import re
import secrets
import typing

PROTOCOL = "kvcmas"
VERSION = 1
#: the in-process engine's plan key (``--engine vllm-inprocess``: plans registered in the process)
KEY = "kvcmas_key"

MAX_TEXT = 200
MAX_SEGMENTS = 4096
MAX_AGENTS = 4096
MAX_TOKENS = 1 << 24
MAX_OPTIONS = 64
#: the largest integer a method option may take (anchors, ranks, groups: sizes of state the worker
#: holds; the budget bounds what they add up to, this bounds one request's ask)
MAX_KNOB = 1 << 16

_SECRET = re.compile(r"[0-9a-f]{32,64}")
_OPS = ("agent", "capture", "report", "calibrate")
_SEGMENT_KEYS = {"kind", "n", "slot", "name", "content_key", "schedule"}
_FIELDS = {
    "agent": {"v", "op", "session", "method", "options", "trajectory", "index", "agent", "node", "ancestors",
              "segments", "max_new_tokens", "capture_output", "ignore_eos", "last", "key", "calibrating", "salt"},
    "capture": {"v", "op", "session", "what", "salt"},
    "report": {"v", "op", "session", "end", "salt"},
    "calibrate": {"v", "op", "session", "method", "options", "salt"},
}  # fmt: skip
_REQUIRED = {
    "agent": {"v", "op", "session", "method", "trajectory", "index", "agent", "segments", "max_new_tokens", "key"},
    "capture": {"v", "op", "session", "what"},
    "report": {"v", "op", "session"},
    "calibrate": {"v", "op", "session", "method"},
}


class Invalid(ValueError):
    """Metadata a request may not carry; the message is the one-line reason the client gets."""


def new_secret() -> str:
    """A session's secret: 128 random bits as 32 hex digits (the session's only name)."""
    return secrets.token_hex(16)


def session_tag(secret: str) -> str:
    """The public name of the session ``secret`` (records, logs, reports): not invertible."""
    return "s-" + hashlib.sha256(("kvcmas-session:" + secret).encode()).hexdigest()[:12]


def salt_for(secret: str, label: str = "") -> str:
    """The prefix-cache salt of a kvcmas request of session ``secret``; ``label`` (the client's own
    salt: a QPS point, a request key) splits the session's namespace further but never leaves it."""
    return "kvcmas-" + hashlib.sha256(f"kvcmas-salt:{secret}:{label}".encode()).hexdigest()[:32]


def _text(meta: dict, key: str, optional: bool = False) -> str | None:
    v = meta.get(key)
    if v is None and optional:
        return None
    if not isinstance(v, str) or not v or len(v) > MAX_TEXT or not v.isprintable():
        raise Invalid(f"{key!r} must be a non-empty printable string of at most {MAX_TEXT} characters")
    return v


def _int(meta: dict, key: str, lo: int, hi: int) -> int:
    v = meta.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise Invalid(f"{key!r} must be an integer in [{lo}, {hi}]")
    return v


def _bool(meta: dict, key: str) -> None:
    if key in meta and not isinstance(meta[key], bool):
        raise Invalid(f"{key!r} must be true or false")


def _method(meta: dict) -> None:
    """The method exists, and its options are its own knobs with values of their types."""
    from ...methods.base import METHODS
    from ...settings import field_type

    name = _text(meta, "method")
    if name.startswith("_") or name not in METHODS:
        raise Invalid(f"unknown method {name!r}")
    cls = METHODS[name]
    options = meta.get("options")
    if options is None:
        return
    if not isinstance(options, dict) or len(options) > MAX_OPTIONS:
        raise Invalid(f"'options' must be an object of at most {MAX_OPTIONS} knobs")
    knobs = cls.knobs()
    for key, value in options.items():
        if key not in knobs:
            raise Invalid(f"method {name!r} has no option {str(key)[:40]!r}")
        base, optional = field_type(typing.get_type_hints(cls)[key])
        ok = _of_type(value, base, optional)
        if ok and isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_KNOB:
            raise Invalid(f"option {key!r} of method {name!r} must be at most {MAX_KNOB} in size")
        if not ok:
            raise Invalid(
                f"option {key!r} of method {name!r} must be {base.__name__}" + (" or null" if optional else "")
            )
    try:
        cls(**options)
    except Exception as exc:  # noqa: BLE001  (the method's own check, as one line)
        raise Invalid(
            f"method {name!r}: {str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__}"
        ) from None


def _of_type(value, base: type, optional: bool) -> bool:
    """Whether a JSON option value fits a knob of type ``base`` (an int fits a float knob; a bool
    fits only a bool knob; a float must be finite)."""
    if value is None:
        return optional
    if isinstance(value, bool):
        return base is bool
    if isinstance(value, float) and not math.isfinite(value):
        return False
    return isinstance(value, base) or (base is float and isinstance(value, int))


def _segments(meta: dict, prompt_len: int | None) -> None:
    segs = meta.get("segments")
    if not isinstance(segs, list) or not 1 <= len(segs) <= MAX_SEGMENTS:
        raise Invalid(f"'segments' must be a list of 1 to {MAX_SEGMENTS} segments")
    total = 0
    for i, s in enumerate(segs):
        if not isinstance(s, dict) or not set(s) <= _SEGMENT_KEYS or not {"kind", "n"} <= set(s):
            raise Invalid(f"segment {i} must be an object with 'kind', 'n' and only {sorted(_SEGMENT_KEYS)}")
        if s["kind"] not in ("PF", "PH"):
            raise Invalid(f"segment {i}: 'kind' must be PF or PH")
        total += _int(s, "n", 1, MAX_TOKENS)
        for key in ("slot", "name", "content_key"):
            if s.get(key) is not None and s.get(key) != "":
                _text(s, key)
        if s["kind"] == "PH" and not s.get("slot"):
            raise Invalid(f"segment {i}: a PH segment needs a 'slot'")
        if s.get("schedule") not in (None, "dense", "reuse"):
            raise Invalid(f"segment {i}: 'schedule' must be dense, reuse or null")
    if prompt_len is not None and total != prompt_len:
        raise Invalid(f"the segments cover {total} tokens, the prompt has {prompt_len}")


def _agent(meta: dict, prompt_len: int | None, max_tokens: int | None) -> None:
    _method(meta)
    for key in ("trajectory", "agent", "key"):
        _text(meta, key)
    _text(meta, "node", optional=True)
    index = _int(meta, "index", 0, MAX_AGENTS - 1)
    anc = meta.get("ancestors", [])
    if not isinstance(anc, list) or any(not isinstance(a, int) or isinstance(a, bool) for a in anc):
        raise Invalid("'ancestors' must be a list of agent indices")
    if len(set(anc)) != len(anc) or any(not 0 <= a < index for a in anc):
        raise Invalid("'ancestors' must be distinct indices of earlier agents (0 <= i < index)")
    _segments(meta, prompt_len)
    for key in ("capture_output", "ignore_eos", "last", "calibrating"):
        _bool(meta, key)
    n = _int(meta, "max_new_tokens", 0, MAX_TOKENS)
    if max_tokens is not None and n > max_tokens and meta.get("capture_output", True):
        # the output capture buffer is sized from max_new_tokens: never beyond what the request generates
        raise Invalid(f"'max_new_tokens' ({n}) exceeds the request's max_tokens ({max_tokens})")


def check(
    params, prompt_len: int | None = None, max_tokens: int | None = None, in_process: bool = False
) -> dict | None:
    """The kvcmas metadata of ``kv_transfer_params`` ``params``, checked; None for a request that
    carries none (a plain request). ``prompt_len``/``max_tokens``: the request's own, where known
    (the segments must cover the prompt; an agent's output budget must fit its request).
    ``in_process``: the in-process engine's plan key is allowed. Raises :class:`Invalid`."""
    meta = _envelope(params, in_process)
    if meta is None:
        return None
    op = _header(meta)
    if op == "agent":
        _agent(meta, prompt_len, max_tokens)
    elif op == "capture":
        if meta.get("what") not in ("system", "reference"):
            raise Invalid("'what' must be system or reference")
    elif op == "report":
        _bool(meta, "end")
    else:
        _method(meta)
    return meta


def _envelope(params, in_process: bool) -> dict | None:
    """The kvcmas object inside ``params`` (None: none), its surroundings checked."""
    if params is None:
        return None
    if not isinstance(params, dict):
        raise Invalid("kv_transfer_params must be an object")
    unknown = set(params) - {PROTOCOL, KEY}
    if unknown:
        raise Invalid(f"unknown kv_transfer_params key {str(sorted(map(str, unknown))[0])[:40]!r}")
    if KEY in params:
        if not in_process:
            raise Invalid(f"{KEY!r} is the in-process engine's; a server request uses {PROTOCOL!r}")
        if not isinstance(params[KEY], str):
            raise Invalid(f"{KEY!r} must be a string")
    if PROTOCOL not in params:
        return None
    if not isinstance(params[PROTOCOL], dict):
        raise Invalid(f"{PROTOCOL!r} must be an object")
    return params[PROTOCOL]


def _header(meta: dict) -> str:
    """The fields every op has (version, op, the session's secret, the client's salt label), and
    no field the op does not have; the op."""
    if meta.get("v") != VERSION or isinstance(meta.get("v"), bool):
        raise Invalid(f"'v' must be {VERSION} (this connector's protocol version)")
    op = meta.get("op")
    if op not in _OPS:
        raise Invalid(f"'op' must be one of {', '.join(_OPS)}")
    extra = set(meta) - _FIELDS[op]
    if extra:
        raise Invalid(f"unknown field {str(sorted(map(str, extra))[0])[:40]!r} for op {op!r}")
    missing = _REQUIRED[op] - set(meta)
    if missing:
        raise Invalid(f"missing field {sorted(missing)[0]!r} for op {op!r}")
    session = meta.get("session")
    if not isinstance(session, str) or not _SECRET.fullmatch(session):
        raise Invalid("'session' must be the session's secret: 32 to 64 lowercase hex digits (128+ random bits)")
    _text(meta, "salt", optional=True)
    return op


def expected_salt(meta: dict) -> str:
    """The salt a checked kvcmas request must carry (:func:`salt_for` its session and label)."""
    return salt_for(meta["session"], meta.get("salt") or "")


def screen_request(request) -> tuple[dict | None, str | None]:
    """The connector's scheduler-side check of a vLLM request, before anything is looked up: (its
    kvcmas metadata or None, the one-line reason it is refused or None). Also refuses a kvcmas
    request whose ``cache_salt`` is not its session's: it would share prefix-cache blocks outside
    the session's namespace. Never raises."""
    try:
        meta = check(
            getattr(request, "kv_transfer_params", None),
            int(request.num_prompt_tokens),
            getattr(request, "max_tokens", None),
            in_process=True,
        )
        if meta is not None and getattr(request, "cache_salt", None) != expected_salt(meta):
            raise Invalid(
                "the request's cache_salt is not its session's (serve with the kvcmas_bench edge middleware, "
                "or salt it with kvcmas_bench.serving.vllm.guard.salt_for)"
            )
        return meta, None
    except Invalid as exc:
        return None, f"invalid kv_transfer_params: {exc}"
    except Exception as exc:  # noqa: BLE001  (nothing a client sends may raise in the engine loop)
        return None, f"invalid kv_transfer_params ({type(exc).__name__})"
