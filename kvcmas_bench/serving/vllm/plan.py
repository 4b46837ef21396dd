"""What the harness asks of the KV connector for one request (:class:`Plan`), and the process-wide
store the harness and both connector instances share (:data:`STORE`). No vLLM import here: the
harness builds plans on any machine; :mod:`.connector` executes them inside vLLM."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

KEY = "kvcmas_key"


@dataclass
class Capture:
    """Buffers ``k``/``v`` ``[layers, kv_heads, S, head_dim]`` filled with positions ``[start, start + S)``."""

    start: int
    k: torch.Tensor
    v: torch.Tensor
    filled: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.filled is None:
            self.filled = torch.zeros(self.k.shape[2], dtype=torch.bool)

    @property
    def end(self) -> int:
        return self.start + self.k.shape[2]

    @property
    def complete(self) -> bool:
        return bool(self.filled.all())


@dataclass
class Plan:
    """What the connector does for one request (see the module docstring)."""

    prefix: tuple[torch.Tensor, torch.Tensor] | None = None
    overrides: list[tuple[int, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    captures: list[Capture] = field(default_factory=list)

    @property
    def prefix_len(self) -> int:
        return 0 if self.prefix is None else self.prefix[0].shape[2]


class _Store:
    """Plans by key, plus what the connector observed (for tests and the records)."""

    def __init__(self) -> None:
        self.plans: dict[str, Plan] = {}
        #: key -> tokens claimed by the scheduler side (the last claim)
        self.claimed: dict[str, int] = {}
        #: key -> [(first computed position, tokens computed)] per step it was scheduled in
        self.steps: dict[str, list[tuple[int, int]]] = {}
        self.record_steps = False

    def forget(self, key: str) -> None:
        self.plans.pop(key, None)
        self.claimed.pop(key, None)
        self.steps.pop(key, None)


STORE = _Store()
