"""Malformed ``kv_transfer_params`` for the guard's tests (pure) and the server's fuzz test: each one
breaks one rule of the wire format (wrong type, nesting, huge or negative numbers, unknown keys,
unicode, missing fields) of an otherwise valid agent, capture, report or calibrate request."""

from __future__ import annotations

import copy
import random

#: the prompt every valid agent below covers: 3 agent-specific tokens, then 5 shared ones
PROMPT = [11, 12, 13, 21, 22, 23, 24, 25]


def valid(secret: str) -> dict:
    """One valid payload per op, by op."""
    agent = {
        "v": 1,
        "op": "agent",
        "session": secret,
        "method": "fullshared",
        "options": {},
        "trajectory": "t1",
        "index": 1,
        "agent": "critic",
        "node": "critic",
        "ancestors": [0],
        "segments": [{"kind": "PF", "n": 3}, {"kind": "PH", "n": 5, "slot": "question"}],
        "max_new_tokens": 2,
        "capture_output": True,
        "ignore_eos": True,
        "last": False,
        "key": "k1",
    }
    return {
        "agent": agent,
        "capture": {"v": 1, "op": "capture", "session": secret, "what": "reference"},
        "report": {"v": 1, "op": "report", "session": secret, "end": False},
        "calibrate": {"v": 1, "op": "calibrate", "session": secret, "method": "graphflow", "options": {}},
    }


_BAD_VALUES = [
    None, True, -1, 2**63, 10**30, 1.5, float("inf"), "", "x" * 5000, "\u202e\u0000", "😀" * 3, [], [[]], {},
    {"a": {"b": {"c": []}}}, [1, "a", None],
]  # fmt: skip


def _mutations(base: dict, rng: random.Random):
    """One broken copy of ``base`` per call."""
    m = copy.deepcopy(base)
    kind = rng.randrange(7)
    keys = sorted(m)
    if kind == 0:  # a field of the wrong type or range
        key = rng.choice([k for k in keys if k not in ("options",)])
        bad = rng.choice([v for v in _BAD_VALUES if v != m[key] and type(v) is not type(m[key])] or [None])
        if key in ("capture_output", "ignore_eos", "last", "end", "node") and bad is None:
            bad = "yes" if key != "node" else []
        m[key] = bad
    elif kind == 1:  # a required field missing
        m.pop(rng.choice([k for k in ("v", "op", "session", "method", "what", "segments", "key") if k in m]))
    elif kind == 2:  # an unknown field, maybe unicode
        m[rng.choice(["extra", "sessión", "\u0000", "x" * 300, "__class__"])] = rng.choice(_BAD_VALUES)
    elif kind == 3:  # a session that is not a secret
        m["session"] = rng.choice(["s", "victim", "0" * 31, "G" * 32, "A" * 32, "0" * 65, "s-1234567890ab"])
    elif kind == 4 and "segments" in m:  # a broken segment
        seg = m["segments"][rng.randrange(len(m["segments"]))]
        seg[rng.choice(["kind", "n", "bogus"])] = rng.choice(_BAD_VALUES + ["PX", 0, -5])
    elif kind == 5:  # nesting: the metadata, or the whole params, of the wrong shape
        return rng.choice([[m], "kvcmas", 7, {"kvcmas": [m]}, {"kvcmas": {"kvcmas": m}}, {"kvcmas_key": []},
                           {"kvcmas_key": {"a": 1}}, {"kvcmas": m, "other": 1}])  # fmt: skip
    else:  # numbers out of range
        key = rng.choice([k for k in ("v", "index", "max_new_tokens") if k in m] or ["v"])
        m[key] = rng.choice([-1, 2**40, 2**64, 0 if key == "v" else -7])
    return {"kvcmas": m}


def malformed(secret: str, n: int = 300, seed: int = 0) -> list:
    """``n`` malformed ``kv_transfer_params`` values (deterministic for ``seed``)."""
    rng = random.Random(seed)
    bases = list(valid(secret).values())
    return [_mutations(bases[i % len(bases)], rng) for i in range(n)]
