"""NonShared: dense prefill of every agent's whole prompt (the accuracy reference)."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Method, register


@register
@dataclass
class NonShared(Method):
    name = "nonshared"
    label, order, color = "NonShared", 10, "C0"
    summary = "dense prefill of every prompt, no sharing (accuracy reference)"
