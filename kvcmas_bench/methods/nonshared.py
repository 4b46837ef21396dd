"""NonShared: dense prefill of every agent's whole prompt (the accuracy reference)."""

from __future__ import annotations

from .base import Method, register


@register
class NonShared(Method):
    name = "nonshared"
    label, order, color = "NonShared", 10, "C0"
    summary = "dense prefill of every prompt, no sharing (accuracy reference)"
