"""Results: the request record, run directories, summaries and provenance."""

from .request import RequestRecord, SegmentRecord

__all__ = ["RequestRecord", "SegmentRecord"]
