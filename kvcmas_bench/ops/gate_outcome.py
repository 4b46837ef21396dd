"""What the delta methods' reliability gate decides for a shared segment, and the rules that decide it.

:class:`GateOutcome` is defined once here, for the method that records it
(:meth:`~kvcmas_bench.methods.delta.OnlineDeltaCorrection.gate`) and for the records and summaries
that read it (``SegmentRecord.gate``, ``summary.accounting``, ``ablate``'s accepted share). The
module imports nothing (no torch), so the result readers can import it as cheaply as the methods.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum


class GateOutcome(str, Enum):
    """The gate's outcome for one shared segment, written to ``requests.jsonl`` as its value.

    A ``str``: an outcome equals, hashes and prints as its value (``GateOutcome.ACCEPTED ==
    "accepted"``), so JSON files and summaries keep the plain strings.
    """

    #: the gate compared anchors and their gate entropy was at most tau: corrected
    ACCEPTED = "accepted"
    #: the gate compared anchors and their gate entropy exceeded tau: dense fallback
    REJECTED = "rejected"
    #: a scheduled reuse (serve-sweep's controlled rho): corrected whatever the entropy, one anchor too
    SCHEDULED = "scheduled"
    #: a scheduled fallback (serve-sweep's controlled rho): dense, the gate not asked
    SCHEDULED_DENSE = "scheduled_dense"
    #: a pool of one anchor (paper C.3): corrected with it, nothing compared
    BYPASSED = "bypassed"
    #: a pool of one anchor, none of it for this consumer yet: dense fallback
    NO_ANCHOR = "no_anchor"
    #: fewer than two anchors for this consumer to compare: dense fallback
    TOO_FEW_ANCHORS = "too_few_anchors"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @property
    def compared(self) -> bool:
        """The gate compared anchors by entropy and its verdict stands: accepted or rejected (the
        decisions an acceptance share is taken over; a scheduled reuse may have compared anchors too,
        but the schedule, not the entropy, decided it)."""
        return self in (GateOutcome.ACCEPTED, GateOutcome.REJECTED)

    @property
    def accepted(self) -> bool:
        """The gate's entropy verdict accepted the anchors (a scheduled or bypassed reuse is no verdict)."""
        return self is GateOutcome.ACCEPTED

    @property
    def reuses(self) -> bool:
        """A correction from the anchors follows (accepted, scheduled, bypassed); else dense prefill."""
        return self in (GateOutcome.ACCEPTED, GateOutcome.SCHEDULED, GateOutcome.BYPASSED)


def gate_route(lengths: Sequence[int], S: int, pool_size: int, force: bool) -> tuple[GateOutcome | None, int]:
    """What the gate does before any comparison, for a segment of ``S`` tokens.

    ``lengths``: the stored lengths of the anchors the consumer may use, longest first; ``pool_size``:
    the method's ``anchors``; ``force``: a scheduled reuse. Returns the outcome decided without
    comparing (None: compare by entropy) and the comparison prefix ``k`` (0 when no anchor serves).

    The variable-length rule (paper A.3), with ``lengths`` = l1 >= l2 >= ...: ``k = min(S, l_m)``,
    where ``m`` is how many anchors the decision needs: ``m = 2`` when the gate compares (Eq. 9-11
    need two compatible anchors), so the *second-longest* anchor sets ``k``; ``m = 1`` with a pool of
    one (bypassed) or a scheduled reuse with one anchor (scheduled), so that anchor sets it. Equal
    lengths count separately (``[12, 12, 5]``, S = 16: k = 12). Fewer than ``m`` anchors: dense
    (``NO_ANCHOR`` / ``TOO_FEW_ANCHORS``). The caller then uses exactly the anchors at least ``k``
    long, each through its first ``k`` rows, and keeps the aligned reference for rows ``k..S-1``:
    ``[16, 9, 5]``, S = 12 gives k = 9 with the 16- and 9-token anchors, the 5-token one unused.
    The paper says the correction uses the anchors covering all S tokens, else "the longest covered
    prefix"; this reads "covered" as covered by the two anchors the gate needs, also when exactly one
    anchor covers S (which the paper leaves open), so a longer anchor never turns a segment that
    would be corrected on its first k rows into a dense fallback.
    """
    if pool_size == 1 or (force and len(lengths) == 1):
        if not lengths:
            return GateOutcome.NO_ANCHOR, 0
        return (GateOutcome.BYPASSED if pool_size == 1 else GateOutcome.SCHEDULED), min(S, lengths[0])
    if len(lengths) < 2:
        return GateOutcome.TOO_FEW_ANCHORS, 0
    return None, min(S, lengths[1])


def entropy_verdict(entropy: float, tau: float, force: bool) -> GateOutcome:
    """Eq. 11's decision on a normalized gate entropy: accepted at most ``tau``, else rejected, unless
    the reuse is scheduled (``force``), which corrects whatever the entropy (``SCHEDULED``).

    A NaN entropy (from non-finite distances) is neither above nor at most ``tau``: ``SCHEDULED``,
    as the gate has always recorded it; the correction's non-finite check then falls back to dense.
    """
    if entropy > tau and not force:
        return GateOutcome.REJECTED
    return GateOutcome.ACCEPTED if entropy <= tau else GateOutcome.SCHEDULED
