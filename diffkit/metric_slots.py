"""The slots of the metric vectors every measuring path fills: a chunk's sufficient statistics (`Part`)
and a pair's packed result (`Packed`).  The torch paths (`diffkit.measure`), the CPU kernel
(`diffkit.host_kernel`, `host_metrics.c`) and the CUDA kernel (`diffkit.metrics_kernel`) agree on them.
"""
from __future__ import annotations

from enum import IntEnum


class Part(IntEnum):
    """The slots of one chunk's sufficient statistics (`measure._partials`), combined over the chunks by
    `measure.measure_async`.  Flat indices are into the whole tensor; absolute errors are over elements
    finite on both sides (a NaN/Inf pair counts as 0 there and is judged by its own rule)."""

    MISMATCHES = 0  # elements out of tolerance, or with a NaN/Inf the other side does not share
    MAX_ABS = 1  # the largest |c - r|
    MAX_ABS_AT = 2  # its flat index (the first of equal maxima)
    SUM_ABS = 3  # the sum of |c - r|
    MAX_REL = 4  # the largest |c - r| / |r| where r != 0
    DOT = 5  # the sum of r * c over finite values (a non-finite value counts as 0)
    REF_SQ = 6  # the sum of r * r, likewise
    CAND_SQ = 7  # the sum of c * c, likewise
    REF_NAN = 8  # NaN and Inf counts (0 for integer tensors); these four slots stay consecutive
    REF_INF = 9
    CAND_NAN = 10
    CAND_INF = 11
    MAX_EXCESS = 12  # the largest |c - r| - (atol + rtol * |r|): how far the worst element is out of tolerance
    MAX_EXCESS_AT = 13  # its flat index
    FIRST_DISAGREE_AT = 14  # the flat index of the first NaN/Inf disagreement, inf if there is none
    DIFF_SQ = 15  # the sum of (c - r)^2


# the NaN/Inf counts among `Part`'s slots
COUNTS = (Part.REF_NAN, Part.REF_INF, Part.CAND_NAN, Part.CAND_INF)
assert COUNTS == tuple(range(COUNTS[0], COUNTS[-1] + 1)), "the NaN/Inf counts are summed as one slice"


class Packed(IntEnum):
    """The slots of the vector that carries one pair's metrics to the host (see `measure.PendingStats`)."""

    MISMATCHES = 0
    MAX_ABS = 1
    MEAN_ABS = 2
    MAX_REL = 3
    COSINE = 4
    REF_NAN = 5
    REF_INF = 6
    CAND_NAN = 7
    CAND_INF = 8
    WORST_AT = 9  # the worst element's flat index (see `measure.measure_async`)
    WORST_REF = 10  # its reference and candidate values
    WORST_CAND = 11
    REL_L2 = 12  # ||c - r|| / ||r|| over finite elements (align's value-agreement measure)
