"""The tuned constants of alignment (`diffkit.align`), grouped by what they decide.

Every threshold, prior and limit the alignment passes use is defined here once, each with what it decides;
the modules of the passes (`align`, `align_state`, `align_layout`, `align_values`, `align_dataflow`) import
them by name.  (A test that changes one patches it where it is read.)
"""
from __future__ import annotations

# ------------------------------------------------------------------------------ confidence of a pair
# How strongly each kind of evidence says two records hold the same tensor (`Pair.confidence`).  These rank
# the evidence in the order the passes trust it; they are priors, not calibrated probabilities.
NAME_CONFIDENCE = 1.0  # the same name, not a reused variable: names are unique within a trace
OUTPUT_CONFIDENCE = 1.0  # the models' results are the pair being compared, by definition
REBOUND_NAME_CONFIDENCE = 0.9  # a reused variable's name, confirmed by its dataflow or values
DATAFLOW_CONFIDENCE = 0.85  # the same paired inputs and the same parameters read: the same computation
DATAFLOW_PARTIAL_CONFIDENCE = 0.75  # the same paired inputs, some of the same parameters (a bias left out …)
DATAFLOW_AMBIGUOUS_CONFIDENCE = 0.65  # one of several equal covers, chosen by position, values not deciding
ORDER_CONFIDENCE = 0.7  # same scope, label and element count at the same place in the sequence
ORDER_SHAPE_CONFIDENCE = 0.5  # the one record of equal shape left on each side of a gap between pairs
UNCHECKED_REBOUND_CONFIDENCE = 0.5  # a reused variable's name whose values were not at hand to check
VALUE_CONFIDENCE_BEST = 0.6  # a value pair of identical values: below order, the pass trusted last ...
VALUE_CONFIDENCE_WORST = 0.2  # ... falling linearly to this at the acceptance limit VALUE_MATCH_REL_ERR
DEFERRED_CONFIDENCE = 0.3  # a reused name whose values disagreed, standing for want of a value partner

# ------------------------------------------------------------------------------ layouts (by shape)
# Which layout (reshape, permutation of axes) compares a candidate value with a reference value.
MAX_PERM_DIMS = 6  # beyond this many axes the permutations are too many to try (6! = 720)
IDENTICAL_REL_ERR = 1e-6  # below this relative error two tensors hold the same values (float32 rounding)
PERMUTE_ACCEPT_REL_ERR = 0.1  # a permuted layout is accepted only when it brings the candidate this close
PERMUTE_SAMPLE = 4096  # positions on which permutations are screened before the best is checked in full
LAYOUT_CHAIN_DEPTH = 16  # layout ops walked up from a record looking for one that reorders (`reorders`)

# ------------------------------------------------------------------------------ matching by values
# A value pair is accepted when the candidate, in its best layout, is within this relative L2 distance of the
# reference: loose enough to pair a tensor with a real bug (a missing bias, a small offset), tight enough not
# to pair unrelated tensors.
VALUE_MATCH_REL_ERR = 0.5
# A pair made by the name of a rebound variable is first checked: beyond this relative error the value search
# gets a chance to find the tensor it should equal.
NAME_MATCH_REL_ERR = 1.0
# The value pass ranks contenders by fingerprint distance plus these priors (in units of the fingerprint
# distance relative to the candidate's largest quantile), so that among equally close values it prefers the
# same module scope and a similar position in the run.  (A reference record paired already is no contender:
# the value pass never overrides another pass's pair.)
VALUE_PRIOR_OTHER_SCOPE = 0.1  # added for a contender in another module scope
VALUE_PRIOR_POSITION = 0.2  # times the difference of the two records' relative positions (0..1)
VALUE_CONTENDERS = 6  # contenders compared in full, closest fingerprints first
# A value pair whose two records did not read the same parameters upstream (one computed with weights the
# other never read) must hold the same values to this relative error: a LayerNorm output is within 0.2 of its
# own input on normal data, and must not pair with it.
VALUE_UNSUPPORTED_REL_ERR = 1e-3
# `pass_read_inputs`: what two different functions read pairs only within this relative error.
READ_INPUTS_CLOSE_REL_ERR = 1e-2
FINGERPRINT_QUANTILES = 33  # quantiles in a value's fingerprint (`_fingerprint`)
FINGERPRINT_SAMPLE = 65536  # a fingerprint subsamples a value of more elements than this
# `_beyond` screens values of at most this many elements (larger ones are measured one by one: their passes
# cost more than the Python around them).
BEYOND_MAX_NUMEL = 1 << 16

# ------------------------------------------------------------------------------ matching by dataflow
DATAFLOW_MAX_ROUNDS = 64  # rounds of the dataflow pass: each pairs what the round before made comparable
# Values "decide" among dataflow contenders when the closest is within VALUE_MATCH_REL_ERR, or when it is this
# much closer than the next; contenders within DATAFLOW_TIE of the closest are tied (equal values in another
# layout), and the earliest of them is taken.
DATAFLOW_CLEARLY_CLOSER = 0.7
DATAFLOW_TIE = 1.25
# A lone contender's values this far from a record's (relative error) leave it to a later record of the same
# cover that is clearly closer (the step that finishes what this one began).
DATAFLOW_DEFER_ABOVE = 1e-3
# A lone contender of the same layout is measured against the record before the rivals after it are looked
# for (only a distant value makes them matter) when the pair holds at most this many bytes a side.
DATAFLOW_VALUE_FIRST_BYTES = 1 << 20

# ------------------------------------------------------------------------------ windows and limits
# A trace of more than DATAFLOW_WINDOW_FROM reference records (a recurrence written as a loop: thousands of
# steps of the same few calls) is paired in a window: a candidate record's contenders are looked for among the
# reference records up to DATAFLOW_WINDOW records past its latest anchor (further when an earlier record's
# anchors reached further), and its rivals among the next DATAFLOW_WINDOW candidate records of its size.
# Every step of a chain has the same cover until the step before it is paired, so without a window each
# pair re-derives the covers of all the steps after it, and the pass costs the square of the trace's length
# (a 3000-step RNN cell: hours); in the window it costs the trace's length times the window.  The window
# keeps what decides the small cases: the earliest contenders (position), the nearest by value among them,
# and a record holding another reference record's values (`_holds_another`, searched in the whole trace) is
# left to the value pass.
DATAFLOW_WINDOW_FROM = 2000
DATAFLOW_WINDOW = 128
CONSUMERS_VISITED = 256  # unpaired records walked through looking for the paired consumers of a pair
PREFETCH_BYTES = 1 << 30  # bytes of values `AlignState.prefetch_errors` holds for one batch of measurements

# ------------------------------------------------------------------------------ consistency of pairs
# A pair "disagrees" beyond this relative L2 error (far outside float32 rounding, well inside any real bug's
# error: the false findings `pass_consistency` exists for were off by 0.85-5.6 absolute) ...
DISAGREE_REL_ERR = 1e-3
# ... and a record consuming it "agrees" within this relative error, and within AGREE_FRACTION of the
# disagreeing pair's: a real error flows on at a comparable size, a wrong pairing leaves none behind.
AGREE_REL_ERR = 1e-4
AGREE_FRACTION = 1e-2
# The candidate's values "are" another reference record's within this relative error (in some layout).
ANOTHER_ROLE_REL_ERR = 1e-3
