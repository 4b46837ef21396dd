"""Shared pieces of the benchmark scripts: real shared text and agent prefixes."""

from __future__ import annotations

from kvcmas_bench.workloads import get_workload


def shared_ids(tok, n: int, offset: int = 0) -> list[int]:
    """``n`` tokens of real text (MMLU questions), starting ``offset`` questions in."""
    text = "\n\n".join(s.query for s in get_workload("mmlu").load()[offset : offset + 600])
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if len(ids) < n:
        raise SystemExit(f"not enough text for {n} tokens")
    return ids[:n]


def prefix(tok, role: str) -> list[int]:
    """An agent-specific prefix (system prompt and the opening of the user turn)."""
    return tok(
        f"<|im_start|>system\nYou are the {role}.<|im_end|>\n<|im_start|>user\nTask:\n", add_special_tokens=False
    )["input_ids"]
