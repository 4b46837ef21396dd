"""Visual sample types of the VLM workloads (MathVista images, Video-MME frames).

Samples carry their image or video lazily (``VisualSample.visual()``), so loading a workload never
decodes pixels; the VLM workflow (:mod:`kvcmas_bench.workflow_vlm`) turns the content into a shared
PH segment of visual embeddings.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..errors import BenchError
from .base import Sample

#: LLaVA-OneVision's video setting in the paper (Appendix B.1)
VIDEO_FRAMES = 32


@dataclass
class VisualContent:
    """What a sample shows: ``kind`` "image" (one or more PIL images) or "video" (PIL frames)."""

    kind: str
    images: list = field(default_factory=list)
    #: identity of the content (same key -> same pixels); used to cache features across samples
    key: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("image", "video"):
            raise ValueError(f"visual kind must be image or video, not {self.kind!r}")
        if not self.images:
            raise BenchError(f"no {self.kind} content" + (f" for {self.key}" if self.key else ""))


@dataclass
class VisualSample(Sample):
    """A :class:`Sample` whose visual content is loaded lazily by ``visual()`` (kept out of ``meta``,
    which is written to samples.jsonl and must stay JSON)."""

    visual: Callable[[], VisualContent] | None = field(default=None, repr=False, compare=False)
    #: the content's key without loading it (lets the workflow skip decoding a cached video)
    visual_key: str | None = None


def sample_frame_indices(total: int, frames: int = VIDEO_FRAMES) -> list[int]:
    """``frames`` indices spread uniformly over ``total`` frames, first and last included
    (``np.linspace(0, total - 1, frames, dtype=int)``, as LLaVA-OneVision's lmms-eval loader)."""
    if total < 1:
        raise BenchError("video has no frames")
    return np.linspace(0, total - 1, frames, dtype=int).tolist()
