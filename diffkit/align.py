"""Align two captures: pair each candidate record with the reference record it should equal.

Alignment is a list of passes (`PASSES`) over one shared `AlignState`; each pass pairs what the
passes before it left over (none overrides another), and every `Pair` records the pass that made it
(`via`) and how strong that evidence is (`confidence`):

1. ``name``  (`pass_name`) — identical names: taps, module paths, ``scope.function:label`` (aliases
   count); then `pass_outputs` pairs the model's outputs with each other, whatever their shapes.  A
   reused variable's name (``g = t @ W.t(); g = g + b``) names several tensors: it pairs at once only
   where the two records consumed counterpart inputs and read the same parameters, and is otherwise
   only proposed, for dataflow to overrule (`pass_proposed` takes what is left);
2. ``dataflow`` (`pass_dataflow`) — what a record was computed from: the paired records upstream of
   it and the parameters read on the way (its *cover*, see `covers`).  A candidate record whose cover
   equals a reference record's is its counterpart whatever its values, so a wrong-valued kernel
   output still pairs (a fused kernel covering several reference stages pairs with the last of them;
   one that reads only some of a stage's parameters, say without its bias, pairs in a second round
   with the first stage reading one it left out, where its computation departs from the reference's;
   a record that finishes a paired stage's computation, say adding its bias once more, takes its pair);
3. ``order`` (`pass_order`) — inside the gaps between pairs already made, within one module scope, a
   longest common subsequence on (label, element count), then a lone record of equal shape on each
   side of a gap;
4. ``value`` (`pass_value`) — a leftover candidate tensor is paired, one-to-one, with the free
   reference tensor of equal element count whose values are closest, allowing a reshape or a
   permutation of axes.  Cheap permutation-invariant fingerprints (quantiles) pick a few contenders
   before any full comparison;
5. `pass_read_inputs` — the one unpaired tensor a paired stage reads on each side pairs where their
   values agree (``dataflow``): a recurrent module's final states against a hand-written loop's last
   step, which no cover matches;
6. `pass_deferred` — a name pair set aside because a reused variable's values disagreed stands after
   all when no pass found the candidate another partner;
7. `pass_consistency` — a pair whose values disagree while every paired record consuming the
   candidate's tensor agrees with its reference is dropped: an error that does not flow on was a pair
   of two different roles (a BatchNorm output against a fused BatchNorm+ReLU), not a bug.

Order and value pairs must not contradict the dataflow (`compatible`).  When shapes are equal the
tensors are compared as they are (a permuted result is then a bug to diagnose, not a layout to
forgive); when only the element count agrees, the layout that brings the candidate closest to the
reference is used and recorded in `Pair.transform`.

The code is split by concern: this module holds the public entry (`align`, `PASSES`) and the passes by
names, order, read inputs and consistency; `align_dataflow` the dataflow pass; `align_values` the value
pass; `align_state` what the passes share and make (`AlignState`, `Pair`, `Alignment`); `align_graph` the
dataflow graphs, covers and parameter maps; `align_layout` layouts, relative errors and fingerprints; and
`align_tuning` every tuned constant, grouped by what it decides.  The names the rest of diffkit uses are
importable from here.
"""
from __future__ import annotations

import bisect
import collections
from collections.abc import Callable, Sequence

import torch

from .align_dataflow import pass_dataflow
from .align_graph import (Cover, Dataflow, _stage_params, compatible, covers, is_layout_op, layout_of_equal,
                          map_params_by_use, name_partner, names_index, param_map, rebound_pair_agrees, reorders,
                          reused_name, same_op, torch_op)
from .align_layout import (RESHAPE, SHAPE_MISMATCH, Layout, _refines, best_layout, from_ref_layout, permuted,
                           permuted_or_plain, record_numel, same_layout, to_ref_layout)
from .align_state import AlignState, Alignment, Pair, ValueReader, _value_err, layout_known
from .align_tuning import (AGREE_FRACTION, AGREE_REL_ERR, CONSUMERS_VISITED, DATAFLOW_CONFIDENCE,
                           DATAFLOW_PARTIAL_CONFIDENCE, DEFERRED_CONFIDENCE, DISAGREE_REL_ERR, NAME_CONFIDENCE,
                           NAME_MATCH_REL_ERR, ORDER_CONFIDENCE, ORDER_SHAPE_CONFIDENCE, OUTPUT_CONFIDENCE,
                           READ_INPUTS_CLOSE_REL_ERR, REBOUND_NAME_CONFIDENCE, VALUE_CONFIDENCE_BEST,
                           VALUE_CONFIDENCE_WORST, VALUE_CONTENDERS, VALUE_MATCH_REL_ERR)
from .align_values import _holds_another, pass_value, value_confidence
from .capture import Record

__all__ = ["Pair", "Alignment", "AlignState", "align", "PASSES", "pass_name", "pass_outputs", "pass_dataflow",
           "pass_proposed", "pass_order", "pass_value", "pass_read_inputs", "pass_deferred", "pass_consistency", "to_ref_layout",
           "from_ref_layout", "best_layout", "permuted_or_plain", "Layout", "Dataflow", "covers", "compatible", "param_map",
           "rebound_pair_agrees",
           # defined in the modules alignment is split into, and imported from here by the rest of diffkit
           "RESHAPE", "SHAPE_MISMATCH", "permuted", "record_numel", "same_layout", "torch_op", "is_layout_op",
           "layout_of_equal", "map_params_by_use", "name_partner", "reorders", "reused_name", "_refines",
           "_stage_params",
           # the tuned constants the tests and `stream` read (all of them: `align_tuning`)
           "NAME_CONFIDENCE", "OUTPUT_CONFIDENCE", "REBOUND_NAME_CONFIDENCE", "DATAFLOW_CONFIDENCE",
           "DATAFLOW_PARTIAL_CONFIDENCE", "ORDER_CONFIDENCE", "VALUE_CONFIDENCE_BEST", "VALUE_CONFIDENCE_WORST",
           "DEFERRED_CONFIDENCE", "NAME_MATCH_REL_ERR", "VALUE_MATCH_REL_ERR", "VALUE_CONTENDERS"]


def pass_name(state: AlignState) -> None:
    """Pair each unpaired candidate record with a free reference record of the same name (aliases
    count) and element count.  A pair of different shapes (`same_layout`: the same name on a
    re-laid-out tensor may name another role, ``qkv`` the projection on one side and its head-split
    permutation on the other) is only proposed, for `pass_proposed` after the dataflow pass; so is a
    pair on a reused variable's name that dataflow contradicts (`rebound_pair_agrees`).  Where no
    dataflow was recorded, a reused name's values must agree."""
    index = names_index(state.ref)
    rf, cf = state.flows()
    for c in state.cand:
        if c.index in state.pairs:
            continue
        ri = name_partner(c, state.ref, index, state.paired_ref)
        if ri is None:
            continue
        if not same_layout(c, state.ref[ri]):
            state.proposed[c.index] = ri  # a name on a permuted tensor may name another role: dataflow first
            continue
        if not reused_name(c, state.ref[ri]):
            state.add(c.index, ri, "name", NAME_CONFIDENCE)
            continue
        agrees = rebound_pair_agrees(c, state.ref[ri], cf, rf, state.partner)
        if agrees is None and cf.known and rf.known:
            # what it read has no counterpart yet (the records inside a block, under other module names):
            # the dataflow pass pairs first, the name after it if both are still free (`pass_proposed`) --
            # `x#3` names a block's output on one side and the whole stack's on the other
            state.proposed[c.index] = ri
        elif agrees is None:
            state.add_checked(c.index, ri, "name", NAME_CONFIDENCE)
        elif agrees:
            state.add(c.index, ri, "name", REBOUND_NAME_CONFIDENCE)
        else:
            state.proposed[c.index] = ri


def pass_outputs(state: AlignState) -> None:
    """Pair the two models' outputs whatever their shapes (one on each side; several by their place in
    the output structure, ``output[0]`` with ``output[0]``): with SHAPE_MISMATCH as the transform
    where their element counts differ."""
    rout = [r.index for r in state.ref if r.is_output]
    cout = [c.index for c in state.cand if c.is_output]
    if len(rout) == 1 and len(cout) == 1:
        matches = [(rout[0], cout[0])]
    else:  # several outputs (a tuple, a dict): the same position in the structure, whatever the shapes
        by_name = {state.ref[ri].name: ri for ri in rout}
        matches = [(by_name[state.cand[ci].name], ci) for ci in cout if state.cand[ci].name in by_name]
    for ri, ci in matches:
        if ci in state.pairs:
            if state.pairs[ci].ref == ri:
                continue
            # paired on the way with another record (a streaming diff pairs by name and dataflow as records
            # are made): the two outputs are each other's counterparts whatever that pair said
            state.remove(ci)
        if ri in state.paired_ref:  # a record the output aliases was paired by name: the output decides
            state.remove(state.paired_ref[ri])
        state.add(ci, ri, "name", OUTPUT_CONFIDENCE,
                  state.layout(ci, ri) if state.numel_agrees(ci, ri) else SHAPE_MISMATCH)


def pass_proposed(state: AlignState) -> None:
    """A name pair `pass_name` only proposed (a permuted layout, or a reused name dataflow did not
    confirm) pairs now if both records are still free, the values confirm the layout
    (`layout_known`) and, on a reused name, agree (`AlignState.add_checked`)."""
    for ci, ri in state.proposed.items():
        if ci not in state.pairs and ri not in state.paired_ref and layout_known(state, ci, ri):
            state.add_checked(ci, ri, "name", NAME_CONFIDENCE)


def _lcs(a: list, b: list) -> list[tuple[int, int]]:
    """The index pairs (i in a, j in b) of a longest common subsequence, in order: from the front, a
    pair wherever the elements are equal, else the step that keeps the longer rest (`a`'s on a tie).

    The table of rest lengths is held one bit per cell, a row of `b` as one Python integer, each row
    made from the one before in a few whole-row operations (the bit-parallel LCS of Allison and Dix,
    as Hyyrö writes it): time n·m/64 and n·m bits, where a list of lists took n·m Python steps and
    pointers (two loops of thousands of steps each: minutes and gigabytes)."""
    n, m = len(a), len(b)
    if n == 0 or m == 0:
        return []
    # rows[k] describes L(k, l) = LCS(a[n-k:], b[m-l:]) for l = 0..m: bit p of ~rows[k] says whether it
    # grows from l = p to l = p + 1 (bit p stands for b[m-1-p], so a low mask covers a suffix of `b`)
    match: dict = {}
    for p, x in enumerate(reversed(b)):
        match[x] = match.get(x, 0) | (1 << p)
    full = (1 << m) - 1
    rows = [full]
    v = full
    for x in reversed(a):
        u = v & match.get(x, 0)
        v = ((v + u) | (v - u)) & full
        rows.append(v)

    def rest(i: int, j: int) -> int:  # LCS(a[i:], b[j:])
        width = m - j
        return width - (rows[n - i] & ((1 << width) - 1)).bit_count()

    out, i, j = [], 0, 0
    while i < n and j < m:
        if a[i] == b[j]:
            out.append((i, j))
            i += 1
            j += 1
        elif rest(i + 1, j) >= rest(i, j + 1):
            i += 1
        else:
            j += 1
    return out


def _order_key(rec: Record) -> tuple[str, int]:
    return rec.label, record_numel(rec)


def _increasing_chain(pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The longest run of (candidate, reference) pairs, sorted by candidate, whose reference indices
    increase too: the pairs that agree on the order of both sides."""
    tails: list[int] = []  # tails[k]: position in `pairs` ending the best chain of length k + 1
    back: list[int] = []
    for n, (_, r) in enumerate(pairs):
        lo, hi = 0, len(tails)
        while lo < hi:
            mid = (lo + hi) // 2
            if pairs[tails[mid]][1] < r:
                lo = mid + 1
            else:
                hi = mid
        back.append(tails[lo - 1] if lo else -1)
        if lo == len(tails):
            tails.append(n)
        else:
            tails[lo] = n
    out, n = [], tails[-1] if tails else -1
    while n >= 0:
        out.append(pairs[n])
        n = back[n]
    return out[::-1]


def _gaps(state: AlignState, cs: list[Record], rs: list[Record]):
    """Split one scope's records at the pairs already made inside it: (candidate, reference) lists of
    the unpaired records between two consecutive pairs, for each gap."""
    scope_c = {c.index for c in cs}
    scope_r = {r.index for r in rs}
    made = sorted((ci, p.ref) for ci, p in state.pairs.items() if ci in scope_c and p.ref in scope_r)
    bounds = [(-1, -1), *_increasing_chain(made), (len(state.cand), len(state.ref))]
    c_at = [c.index for c in cs]  # (both lists are in record order: each gap is a slice of them)
    r_at = [r.index for r in rs]
    for (c0, r0), (c1, r1) in zip(bounds, bounds[1:]):
        yield ([c for c in cs[bisect.bisect_right(c_at, c0):bisect.bisect_left(c_at, c1)] if c.index not in state.pairs],
               [r for r in rs[bisect.bisect_right(r_at, r0):bisect.bisect_left(r_at, r1)]
                if r.index not in state.paired_ref])


def _params_consistent(c_cover: Cover, r_cover: Cover) -> bool:
    """Two covers that both read parameters read some of the same ones."""
    return not (c_cover[1] and r_cover[1]) or bool(c_cover[1] & r_cover[1])


def pass_order(state: AlignState) -> None:
    """Within each module scope, inside each gap between pairs already made, pair the unpaired
    records of both sides along a longest common subsequence of (label, element count); then, where
    a gap holds one computed record of equal shape on each side, pair those.  No pair contradicts the
    dataflow (`compatible`)."""
    rcov, ccov = state.covers()
    rf, cf = state.flows()
    for scope in sorted({r.scope for r in state.ref} | {c.scope for c in state.cand}):
        scope_r = [r for r in state.ref if r.scope == scope]
        scope_c = [c for c in state.cand if c.scope == scope]
        for cs, rs in list(_gaps(state, scope_c, scope_r)):
            for i, j in _lcs([_order_key(c) for c in cs], [_order_key(r) for r in rs]):
                if state.compatible(cs[i].index, rs[j].index, ccov, rcov) \
                        and layout_known(state, cs[i].index, rs[j].index):
                    state.add_checked(cs[i].index, rs[j].index, "order", ORDER_CONFIDENCE)
            cs = [c for c in cs if c.index not in state.pairs and c.kind != "input" and not cf.derived[c.index]]
            rs = [r for r in rs if r.index not in state.paired_ref and r.kind != "input" and not rf.derived[r.index]]
            if len(cs) == 1 and len(rs) == 1 and cs[0].shape == rs[0].shape and rf.known and cf.known \
                    and state.compatible(cs[0].index, rs[0].index, ccov, rcov) \
                    and _params_consistent(ccov[cs[0].index], rcov[rs[0].index]):
                state.add_checked(cs[0].index, rs[0].index, "order", ORDER_SHAPE_CONFIDENCE)


def pass_read_inputs(state: AlignState) -> None:
    """Pair the one unpaired tensor that a paired stage reads on each side (its other tensor inputs
    paired with each other), where the two hold the same values in some layout (within
    VALUE_MATCH_REL_ERR when the stage is the same torch function on both sides, else within
    READ_INPUTS_CLOSE_REL_ERR): what the same stage reads is the same quantity, whatever the covers say.  (A recurrent
    module makes its final states side by side; a hand-written loop makes its last hidden state from
    its last cell state, so once that is paired no cover matches: the reference's ``out[:, -1, :]``
    and the candidate's last ``h``, both read by the output layer, pair here.)  Walks upstream from
    each new pair."""
    rf, cf = state.flows()
    if not (rf.known and cf.known):
        return
    todo = collections.deque(sorted(state.pairs, reverse=True))
    while todo:
        cj = todo.popleft()
        p = state.pairs.get(cj)
        if p is None or p.transform == SHAPE_MISMATCH:
            continue
        rj = p.ref
        r_free = [k for k in rf.inputs[rj] if k not in state.paired_ref and state.ref[k].kind != "input"
                  and not rf.derived[k]]
        c_free = [k for k in cf.inputs[cj] if k not in state.pairs and k not in state.superseded
                  and state.cand[k].kind != "input" and not cf.derived[k]]
        if len(r_free) != 1 or len(c_free) != 1:
            continue
        ri, ci = r_free[0], c_free[0]
        if record_numel(state.ref[ri]) != record_numel(state.cand[ci]):
            continue
        others = [k for k in cf.inputs[cj] if k != ci]
        if any(k not in state.pairs for k in others) or \
                {state.pairs[k].ref for k in others} != {k for k in rf.inputs[rj] if k != ri}:
            continue  # the stage reads other things besides on one side
        err = _value_err(state, state.cand[ci], state.ref[ri])
        # the same torch function reading both (a fused kernel may read what the reference's stage read
        # before its own first step: a LayerNorm's input, not its output), or values all but equal
        if err is None or err > (VALUE_MATCH_REL_ERR if same_op(state.cand[cj], state.ref[rj])
                                 else READ_INPUTS_CLOSE_REL_ERR):
            continue
        state.add(ci, ri, "dataflow", DATAFLOW_CONFIDENCE)
        state.errors[ci] = err
        todo.appendleft(ci)


def pass_reader_layout(state: AlignState) -> None:
    """Where a paired stage is the same torch function or module on both sides and reads, at the same
    argument position, a tensor of the same shape on each side, the two are what it reads, compared as
    they are: a candidate tensor paired elsewhere only through a permutation of axes pairs with the
    reference's (when that is free) instead.  (A head merge ``y.reshape(B, L, E)`` without the
    transpose back holds the reference's ``(att @ v).transpose(1, 2)`` in (B, H, L, D) order: through
    the permutation it looks right, and the projection reading it took the blame.)"""
    rf, cf = state.flows()
    if not (rf.known and cf.known):
        return
    for cj in sorted(state.pairs):
        p = state.pairs.get(cj)
        if p is None or p.transform == SHAPE_MISMATCH:
            continue
        c_in, r_in = cf.inputs[cj], rf.inputs[p.ref]
        if len(c_in) != len(r_in) or not same_op(state.cand[cj], state.ref[p.ref]):
            continue
        for ci, ri in zip(c_in, r_in):
            q = state.pairs.get(ci)
            if q is None or q.ref == ri or not permuted(q.transform) or ri in state.paired_ref:
                continue
            c, r = state.cand[ci], state.ref[ri]
            if tuple(c.shape) != tuple(r.shape) or c.dtype != r.dtype or r.kind == "input":
                continue
            state.remove(ci)
            state.add(ci, ri, "dataflow", DATAFLOW_CONFIDENCE)


def pass_deferred(state: AlignState) -> None:
    """A pair set aside by `add_checked` stands where no later pass paired its candidate: as a
    ``name`` pair, since what speaks for it is the variable's name (the order pass matches the same
    label), whichever pass proposed it last (`Deferred.via`)."""
    for ci, d in state.deferred.items():
        if ci not in state.pairs and d.ref not in state.paired_ref:
            state.add(ci, d.ref, "name", DEFERRED_CONFIDENCE)
            state.errors[ci] = d.rel_err


def _paired_consumers(state: AlignState, ci: int) -> list[int]:
    """The nearest paired candidate records downstream of `ci` (walking through unpaired ones)."""
    cf = state.cand_flow
    out: list[int] = []
    seen: set[int] = set()
    todo = list(cf.consumers[ci])
    while todo and len(seen) < CONSUMERS_VISITED:
        j = todo.pop()
        if j in seen:
            continue
        seen.add(j)
        if j in state.pairs:
            out.append(j)
        else:
            todo.extend(cf.consumers[j])
    return out


def pass_consistency(state: AlignState) -> None:
    """Drop a pair of two different roles: its values disagree (DISAGREE_REL_ERR), every paired
    record consuming the candidate's tensor agrees with its reference (AGREE_REL_ERR), so the error
    vanishes at once, and the candidate's tensor holds another reference tensor's values (a BatchNorm
    output paired with a fused BatchNorm+ReLU output that equals the ReLU's; a tensor of the same shape
    but another role).  The candidate record pairs with that other tensor where it is free.  A real
    difference that a later stage undoes (its values no reference tensor's) stays, to be reported.
    Pairs of the models' inputs and outputs stand; the candidate is walked downstream first."""
    if not state.cand_flow.known:
        return
    state.prefetch_errors([ci for ci, p in state.pairs.items() if p.transform != SHAPE_MISMATCH])
    for ci in sorted(state.pairs, reverse=True):
        p = state.pairs[ci]
        c, r = state.cand[ci], state.ref[p.ref]
        if c.kind == "input" or c.is_output or r.is_output or p.transform == SHAPE_MISMATCH:
            continue
        err = state.pair_error(ci)
        if err is None or not err > DISAGREE_REL_ERR:
            continue
        consumers = _paired_consumers(state, ci)
        if not consumers:
            continue
        bound = min(AGREE_REL_ERR, AGREE_FRACTION * err)
        # a consumer compared through a permutation of axes may have absorbed this pair's error (the
        # same permutation): it is no evidence that the error vanished
        if any(permuted(state.pairs[j].transform) for j in consumers):
            continue
        errs = [state.pair_error(j) for j in consumers]
        if not all(e is not None and e <= bound for e in errs):
            continue
        other = _holds_another(state, ci, p.ref)
        if other is None:
            continue  # its values are no other reference tensor's: a real difference, undone later
        state.dropped.append(state.remove(ci))
        if other.ref not in state.paired_ref:
            state.add(ci, other.ref, "value", value_confidence(other.rel_err), other.transform)
            state.errors[ci] = other.rel_err


# The passes `align` runs, in order: each is a function of the state, inserted where its evidence ranks.
PASSES: list[Callable[[AlignState], None]] = [pass_name, pass_outputs, pass_dataflow, pass_proposed, pass_order,
                                              pass_value, pass_read_inputs, pass_reader_layout, pass_deferred,
                                              pass_consistency]


def align(ref: list[Record], cand: list[Record], value_match: bool = True, *,
          fixed: dict[int, tuple] | None = None,
          ref_value: ValueReader | None = None, cand_value: ValueReader | None = None,
          passes: Sequence[Callable[[AlignState], None]] | None = None,
          ref_params: dict[str, torch.Tensor] | None = None,
          cand_params: dict[str, torch.Tensor] | None = None,
          rename: dict[str, str] | None = None,
          tolerance: Callable[[torch.dtype], tuple[float, float]] | None = None) -> Alignment:
    """Pair the candidate's records with the reference's by running `passes` (default `PASSES`).

    `fixed` (candidate index → (reference index, transform[, relative error])) are pairs made already
    (a streaming diff pairs by name as records are produced); `ref_value` fetches a reference value
    that is not held in its record (read lazily from a store); `cand_value` likewise.  `ref_params` /
    `cand_params` (the models' parameters and buffers by name) let a candidate that renamed its
    modules be matched by the parameters it reads (`param_map`; or give that map as `rename`, made
    before the forwards changed any buffer); without them names must agree.  `value_match=False` skips
    the value pass.  `tolerance` ((atol, rtol) by reference dtype) is the diff's: pairs whose error a
    pass asks for are measured in full once, and `Alignment.measured` hands those metrics on."""
    if rename is None and cand_params:
        rename = param_map(ref_params, cand_params)
    state = AlignState.start(ref, cand, value_match, fixed=fixed, ref_value=ref_value, cand_value=cand_value,
                             rename=rename)
    state.tolerance = tolerance
    for run_pass in PASSES if passes is None else passes:
        run_pass(state)
    return state.alignment()
