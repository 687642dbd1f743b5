"""Matching by dataflow: the dataflow pass (`pass_dataflow`) pairs records by what they were computed from (their
covers, see `align_graph.covers`), in rounds (`_dataflow_round`); among several reference records of the same
cover the counterpart is chosen by `_choose`.  Part of `diffkit.align`."""
from __future__ import annotations

import bisect
import functools
from collections.abc import Callable, Container, Iterable

import torch

from .align_graph import (Cover, Dataflow, _forget_downstream, _reads_elsewhere, _stage_params, cover_of,
                          is_layout_op, reused_name, same_op, torch_op)
from .align_layout import _flattened, record_numel, same_layout
from .align_state import AlignState, _value_err, layout_known
from .align_tuning import (DATAFLOW_AMBIGUOUS_CONFIDENCE, DATAFLOW_CLEARLY_CLOSER, DATAFLOW_CONFIDENCE,
                           DATAFLOW_DEFER_ABOVE, DATAFLOW_MAX_ROUNDS, DATAFLOW_PARTIAL_CONFIDENCE, DATAFLOW_TIE,
                           DATAFLOW_VALUE_FIRST_BYTES, DATAFLOW_WINDOW, DATAFLOW_WINDOW_FROM, IDENTICAL_REL_ERR,
                           VALUE_MATCH_REL_ERR)
from .align_values import _holds_another, _later_holds
from .capture import Record


class _Rivals:
    """The unpaired candidate records after one record `c` that could be the stage its contenders stand for,
    found as far as they are asked for (a lone contender whose values `c` holds needs none of them): `later`,
    those of `c`'s own cover; `elsewhere`, those from the same parameters below more anchors (a step after a
    paired one).  `scan` yields them in order as (index, "later" | "elsewhere"); `kind(x)` says which one `x`
    is (None: neither) without scanning; `made_by(op)` lists the records after `c` a torch function made;
    `only(keep)` is the same rivals with `later` kept to those `keep` holds."""

    def __init__(self, scan: Iterable[tuple[int, str]] | None = None, kind: Callable[[int], str | None] | None = None,
                 made_by: Callable[[str], Iterable[int]] | None = None, parent: "_Rivals | None" = None,
                 keep: Callable[[int], bool] | None = None):
        self._scan = iter(scan) if scan is not None else None
        self._kind, self._made_by, self._parent, self._keep = kind, made_by, parent, keep
        self._later: list[int] = []
        self._elsewhere: list[int] = []

    def _more(self) -> bool:
        """One more rival found; False once the scan is over."""
        if self._scan is not None:
            for x, k in self._scan:
                (self._later if k == "later" else self._elsewhere).append(x)
                return True
            self._scan = None
        return False

    def lists(self) -> tuple[list[int], list[int]]:
        if self._parent is not None:
            later, elsewhere = self._parent.lists()
            return [x for x in later if self._keep(x)], elsewhere
        while self._more():
            pass
        return self._later, self._elsewhere

    @property
    def later(self) -> list[int]:
        return self.lists()[0]

    @property
    def elsewhere(self) -> list[int]:
        return self.lists()[1]

    def any_later(self, pred: Callable[[int], bool] | None = None, op: str | None = None) -> bool:
        """Whether a `later` record exists that `pred` holds, scanning no further than the first.  `op`: `pred`
        holds only for records made by that torch function, so where the scan is not over, only the records
        `made_by` it need asking."""
        if self._parent is not None:
            keep = self._keep
            return self._parent.any_later(lambda x: keep(x) and (pred is None or pred(x)), op)
        if op is not None and self._scan is not None and self._made_by is not None:
            return any((pred is None or pred(x)) and x in self for x in self._made_by(op))
        i = 0
        while True:
            for x in self._later[i:]:
                if pred is None or pred(x):
                    return True
            i = len(self._later)
            if not self._more():
                return False

    def __contains__(self, x: int) -> bool:
        """Whether `x` is a `later` record."""
        if self._parent is not None:
            return self._keep(x) and x in self._parent
        if self._scan is not None and self._kind is not None:
            return self._kind(x) == "later"
        return x in self._later

    def only(self, keep: Callable[[int], bool]) -> "_Rivals":
        return _Rivals(parent=self, keep=keep)


def _eligible(rec: Record, flow: Dataflow, cover: Cover) -> bool:
    """A record the dataflow pass pairs: computed from something (not an input, not weight preparation)."""
    return rec.kind != "input" and not flow.derived[rec.index] and bool(cover[0] or cover[1])


def _known_roots(state: AlignState, ci: int, contenders: list[int]) -> list[int]:
    """The contenders whose layout against `ci` is known (`layout_known`), without those that only
    re-lay out another (a view of a fused output holds the same values: the stage that computed them is
    the counterpart); a layout copy stands in for a contender only when that one's layout is not known.
    (Contenders come in reference order, so a copy comes after what it copies; no layout is computed for a copy.)"""
    rf = state.ref_flow
    accepted: list[int] = []
    taken: set[int] = set()  # the accepted contenders and the layout copies (of copies) of them
    for ri in contenders:
        if is_layout_op(state.ref[ri]) and any(j in taken for j in rf.inputs[ri]):
            taken.add(ri)  # a copy of an accepted contender holds the same values (so does a copy of it)
            continue
        if layout_known(state, ci, ri):
            accepted.append(ri)
            taken.add(ri)
    return accepted


def _feeds_partner(state: AlignState, ri: int) -> set[int]:
    """The candidate records, of `ri`'s element count, that the counterparts of `ri`'s paired consumers
    read: where a record the reference hands to a paired stage sits in the candidate (the last step of
    a hand-written LSTM, which its final linear layer reads, for the reference's ``out[:, -1, :]``)."""
    rf, cf = state.flows()
    n = record_numel(state.ref[ri])
    found: set[int] = set()
    for rj in rf.consumers[ri]:
        cj = state.paired_ref.get(rj)
        if cj is None:
            continue
        for ck in cf.inputs[cj]:
            if ck not in state.pairs and record_numel(state.cand[ck]) == n:
                found.add(ck)
    return found


def _fed_elsewhere(state: AlignState, ri: int, c: Record, later: Container[int]) -> bool:
    """Whether the counterparts of `ri`'s paired consumers read some of the candidate records `later`
    of its size but not `c` (`_feeds_partner`)."""
    feeds = _feeds_partner(state, ri)
    return bool(feeds) and c.index not in feeds and any(x in later for x in feeds)


def _count_only(c: Record, r: Record) -> bool:
    """Whether only the element count ties two records whose values disagree: other shapes, other
    torch functions.  What they were computed from is then no evidence enough to pair them (a [4, 192]
    gate pre-activation in the last layer of a hand-written LSTM is not the module's [4, 4, 48] final
    cell state, though both read every layer's weights)."""
    return not same_layout(c, r) and not same_op(c, r) and not _flattened(c, r)


def _base_names(rec: Record) -> set[str]:
    """A record's names without the ``#n`` of a variable's later assignments."""
    return {n.split("#", 1)[0] for n in rec.names()}


def _holding_bar(r: Record) -> float:
    """The relative error within which a candidate record "holds" the values of reference record `r`:
    DATAFLOW_DEFER_ABOVE, or twice the rounding step of a coarser floating dtype (bfloat16 rounds at 4e-3)."""
    try:
        return max(DATAFLOW_DEFER_ABOVE, 2 * torch.finfo(r.dtype).eps)
    except TypeError:  # not a floating dtype
        return DATAFLOW_DEFER_ABOVE


def _holds_it_alone(state: AlignState, c: Record, r: Record, others: list[int]) -> bool:
    """`c` holds the values of `r` (`_holding_bar`) and none of the candidate records `others` does: a
    fused consumer that reads one of them (``(y * clamp(y + 3, 0, 6)) / 6`` for a Hardswish) only
    finishes a stage `c` began, and `c` is the counterpart of `r`."""
    bar = _holding_bar(r)
    mine = _value_err(state, c, r)
    if mine is None or mine > bar:
        return False
    theirs = [_value_err(state, state.cand[x], r) for x in others]
    return all(e is not None and e > bar for e in theirs)


def _choose(state: AlignState, c: Record, contenders: list[int], rivals: _Rivals) -> tuple[int | None, bool]:
    """Among reference records of the same cover, the counterpart of `c`: the closest in value when
    values decide, else by position (a candidate record that is the last of its cover takes the last
    contender: a fused kernel's output equals the last stage it covers).  `later`: the unpaired
    candidate records after `c` of the same cover; a lone contender whose values one of them holds,
    while `c` does not, is left to it (None).  `elsewhere`: unpaired candidate records after `c`
    computed from the same parameters below more paired records; a contender whose values one of them
    holds while `c` does not is left to it too (both in `rivals`, found only where they can matter).  Returns
    (index, whether values decided)."""
    if len(contenders) > 1:
        narrowed = _narrow(state, c, contenders, rivals)
        if narrowed is None:
            return None, False
        contenders, rivals = narrowed
    if len(contenders) == 1:
        return _choose_lone(state, c, contenders[0], rivals)
    if state.cand_value(c) is not None:
        chosen = _choose_by_value(state, c, contenders, rivals)
        if chosen is not None:
            return chosen
    return (contenders[0] if rivals.any_later() else contenders[-1]), False


def _narrow(state: AlignState, c: Record, contenders: list[int], rivals: _Rivals) -> tuple[list[int], _Rivals] | None:
    """`_choose`'s first step among several contenders: those the records after `c` do not claim (None: every one
    is theirs), then those made by `c`'s own torch function (`_by_function`)."""
    # a contender whose paired consumers' counterparts read later records of its size, not `c`, is
    # theirs (a recurrent cell's output, which the output stacks, against a gate of the hand-written
    # step: the step's new state is what the output holds)
    mine = [ri for ri in contenders if not _fed_elsewhere(state, ri, c, rivals)]
    if not mine:
        return None
    if len(mine) > 1:
        return _by_function(state, c, mine, rivals)
    return mine, rivals


def _by_function(state: AlignState, c: Record, contenders: list[int], rivals: _Rivals) -> tuple[list[int], _Rivals]:
    """The contenders made by `c`'s own torch function, and the rivals that stay rivals: the same torch function on
    both sides (softmax and softmax) is the same stage; a later candidate record with its own such contender is
    no rival for the others (by the function's name, so that a recurrence's thousands of steps cost linear, not
    cubic, time)."""
    op = torch_op(c)
    mine = [ri for ri in contenders if op and torch_op(state.ref[ri]) == op]
    if mine:
        return mine, rivals.only(lambda x: torch_op(state.cand[x]) == op)
    has: dict[str, bool] = {}  # a contender's function: whether a later record's is the same

    def later_has(o: str) -> bool:
        if o not in has:
            has[o] = bool(o) and rivals.any_later(lambda x: torch_op(state.cand[x]) == o, op=o)
        return has[o]

    taken = {ri for ri in contenders if later_has(torch_op(state.ref[ri]))}
    if taken and len(taken) < len(contenders):
        taken_ops = {torch_op(state.ref[ri]) for ri in taken}
        return ([ri for ri in contenders if ri not in taken],
                rivals.only(lambda x: torch_op(state.cand[x]) not in taken_ops))
    return contenders, rivals


def _choose_lone(state: AlignState, c: Record, ri: int, rivals: _Rivals) -> tuple[int | None, bool]:
    """`_choose` for one contender `ri`: it is `c`'s unless a record after `c` is the stage instead (what the
    consumer's counterpart reads, or a record clearly closer in value), or only the element count ties them."""
    r = state.ref[ri]
    feeds = _feeds_partner(state, ri)
    if len(feeds) == 1:  # (several: no telling which)
        if c.index in feeds:
            return ri, True  # it is what the consumer's counterpart reads: the same place
        fed = [x for x in sorted(feeds) if x in rivals]
        if fed and not _holds_it_alone(state, c, r, fed):
            return None, False  # a later record is (`_feeds_partner`)
    if same_layout(c, r):
        # the records after `c` matter only when its values are far from the contender's: whichever is
        # cheaper is asked first (a value, a pass over both tensors; the rivals, a cover for each record
        # of `c`'s size after it)
        if record_numel(c) * c.dtype.itemsize <= DATAFLOW_VALUE_FIRST_BYTES:
            mine = _value_err(state, c, r)
            if mine is None or mine <= DATAFLOW_DEFER_ABOVE or not rivals.any_later():
                return ri, True
        elif not rivals.any_later():
            return ri, True
    mine = _value_err(state, c, r)
    if mine is not None and mine > DATAFLOW_DEFER_ABOVE:
        # a later record of the same cover that holds the values (clearly closer) is the stage
        bar = min(VALUE_MATCH_REL_ERR, DATAFLOW_CLEARLY_CLOSER * mine)
        for x in rivals.later:
            theirs = _value_err(state, state.cand[x], r)
            if theirs is not None and theirs <= bar:
                return None, False
        if _later_holds(state, [ri], rivals.elsewhere, bar):
            return None, False
    if mine is not None and mine > VALUE_MATCH_REL_ERR and _count_only(c, r):
        return None, False
    return ri, True


def _choose_by_value(state: AlignState, c: Record, contenders: list[int],
                     rivals: _Rivals) -> tuple[int | None, bool] | None:
    """`_choose` among several contenders by their values' distance from `c`'s: the closest where values decide
    (the earliest of those tied with it), none where a record after `c` holds one of them; by position where they
    do not decide.  None where a contender's value is not at hand."""
    first = _value_err(state, c, state.ref[contenders[0]])
    if first is not None and first <= IDENTICAL_REL_ERR and all(
            state.ref_value(state.ref[ri]) is not None for ri in contenders[1:]):
        # the earliest contender holds `c`'s values: whatever the others' errors, it is the earliest of
        # those tied with the closest (as below), and no later record need be asked
        return contenders[0], True
    scored = []
    for ri in contenders:
        err = _value_err(state, c, state.ref[ri])
        if err is None:
            return None
        scored.append((err, ri))
    scored.sort()
    best, second = scored[0][0], scored[1][0]
    if best > DATAFLOW_DEFER_ABOVE and _later_holds(state, contenders, [*rivals.later, *rivals.elsewhere],
                                                    min(VALUE_MATCH_REL_ERR, DATAFLOW_CLEARLY_CLOSER * best)):
        # a later record of the same cover holds one of them (the last step of a hand-written
        # recurrence, for a recurrent module's final state): that is the stage; `c` (a gate of an
        # earlier step, say) is none, however much closer it is to one contender than to another
        return None, False
    if best <= VALUE_MATCH_REL_ERR or best < DATAFLOW_CLEARLY_CLOSER * second:
        pick = min(ri for e, ri in scored if e <= best * DATAFLOW_TIE + IDENTICAL_REL_ERR)
        if best > VALUE_MATCH_REL_ERR and _count_only(c, state.ref[pick]):
            return None, False
        return pick, True
    other = _holds_another(state, c.index, -1)
    if other is not None and other.ref not in contenders:
        return None, False  # it holds another reference tensor's values (a copy of one): no stage here
    pick = contenders[0] if rivals.any_later() else contenders[-1]
    if _count_only(c, state.ref[pick]):
        return None, False
    return pick, False


def _dataflow_round(state: AlignState, partial: bool) -> int:
    """One round of `pass_dataflow`: in candidate order, pair each candidate record whose cover equals
    (or, `partial`, shares its anchors and some parameters with) a free reference record's.  Covers
    are taken fresh, under every pair made so far (a pair changes the covers downstream of it).
    Returns the pairs made."""
    return _Round(state, partial).run()


def _cand_by_op(state: AlignState) -> dict[tuple[int, str], list[int]]:
    """The candidate records by (element count, torch function), in order (built once per alignment)."""
    by_op = state.__dict__.get("_cand_by_op")
    if by_op is None:
        by_op = state.__dict__["_cand_by_op"] = {}
        for n, xs in state.by_numel("cand").items():
            for x in xs:
                by_op.setdefault((n, torch_op(state.cand[x])), []).append(x)
    return by_op


class _Round:
    """One round of the dataflow pass (`_dataflow_round`): the covers under the pairs made so far (`memo_r`,
    `memo_c`, forgotten downstream of each new pair), and the reference records that can be contenders, by
    element count and anchors (a contender shares the candidate record's anchors, which are then upstream of
    it; `by_key`), kept up to date as a pair changes the covers downstream of it.  In a trace of more than
    DATAFLOW_WINDOW_FROM reference records they are placed only as far as a window past the anchors reaches."""

    def __init__(self, state: AlignState, partial: bool):
        self.state, self.partial = state, partial
        self.rf, self.cf = state.flows()
        self.ref_numel = state.by_numel("ref")
        self.cand_numel = state.by_numel("cand")
        self.by_op = _cand_by_op(state)
        self.paired = state.paired_ref
        self.partner = {ci: p.ref for ci, p in state.pairs.items()}
        self.memo_r: dict[int, Cover] = {}
        self.memo_c: dict[int, Cover] = {}
        self.by_key: dict[tuple, list[int]] = {}
        self.placed: dict[int, tuple] = {}
        # by element count: records whose cover changed, placed again when asked for
        self.dirty: dict[int, set[int]] = {}
        # the reference records placed so far are those up to `placed_to` (all of them, unless the trace is long
        # enough for a window: DATAFLOW_WINDOW_FROM)
        self.windowed = len(state.ref) > DATAFLOW_WINDOW_FROM
        self.placed_to = -1
        if not self.windowed:
            self.place_to(len(state.ref) - 1)

    def ref_anchor(self, i: int) -> int | None:
        return i if i in self.paired else None

    def ref_cover(self, ri: int) -> Cover:
        return cover_of(self.rf, ri, self.ref_anchor, self.memo_r)

    def cand_cover(self, ci: int) -> Cover:
        return cover_of(self.cf, ci, self.partner.get, self.memo_c)

    def matches(self, cc: Cover, rc: Cover) -> bool:
        if not self.partial:
            return cc == rc
        return cc[0] == rc[0] and bool(cc[1] & rc[1]) and (cc[1] <= rc[1] or rc[1] <= cc[1]) and cc[1] != rc[1]

    def free_cand(self, x: int) -> bool:
        state = self.state
        return x not in state.pairs and x not in state.superseded and state.cand[x].kind != "input" \
            and not self.cf.derived[x]

    def place(self, ri: int) -> None:
        key = self.placed[ri] = (record_numel(self.state.ref[ri]), self.ref_cover(ri)[0])
        bisect.insort(self.by_key.setdefault(key, []), ri)

    def place_to(self, end: int) -> None:
        for ri in range(self.placed_to + 1, min(end, len(self.state.ref) - 1) + 1):
            if ri not in self.paired and self.state.ref[ri].kind != "input" and not self.rf.derived[ri]:
                self.place(ri)
        self.placed_to = max(self.placed_to, end)

    def run(self) -> int:
        """Visit the candidate records in order; the number of pairs made."""
        made = 0
        for c in self.state.cand:
            made += self.visit(c)
        return made

    def visit(self, c: Record) -> int:
        """Pair candidate record `c` if a free reference record's cover matches its own (1), else not (0)."""
        ci = c.index
        numel = record_numel(c)
        if numel not in self.ref_numel or not self.free_cand(ci):  # no reference record holds as many elements
            return 0
        cc = self.cand_cover(ci)
        if not (cc[0] or cc[1]):
            return 0
        for ri in sorted(self.dirty.pop(numel, ())):  # (a lookup asks for records of `c`'s size only)
            self.place(ri)
        if self.windowed:  # (a cover without anchors, from parameters and constants alone, may be anywhere)
            self.place_to(max(cc[0]) + DATAFLOW_WINDOW if cc[0] else len(self.state.ref) - 1)
        contenders, confidence = self.contenders(ci, numel, cc)
        if not contenders:
            return 0
        ri, by_value = self.decide(c, numel, cc, contenders)
        if ri is None:
            return 0
        self.pair(ci, ri, confidence if by_value else min(confidence, DATAFLOW_AMBIGUOUS_CONFIDENCE))
        return 1

    def contenders(self, ci: int, numel: int, cc: Cover) -> tuple[list[int], float]:
        """The free reference records whose cover matches `cc` (in a partial round, those overlapping it most),
        their layout against `ci` known (`_known_roots`), and the confidence of a pair with one of them."""
        contenders = [ri for ri in self.by_key.get((numel, cc[0]), ())
                      if ri not in self.paired and self.matches(cc, self.ref_cover(ri))]
        if not contenders:
            return [], DATAFLOW_CONFIDENCE
        confidence = DATAFLOW_CONFIDENCE
        if self.partial:
            def overlap(ri: int) -> float:
                rp = self.ref_cover(ri)[1]
                return len(cc[1] & rp) / len(cc[1] | rp)
            top = max(overlap(ri) for ri in contenders)
            contenders = [ri for ri in contenders if overlap(ri) == top]
            confidence = DATAFLOW_PARTIAL_CONFIDENCE
        return _known_roots(self.state, ci, contenders), confidence

    def decide(self, c: Record, numel: int, cc: Cover, contenders: list[int]) -> tuple[int | None, bool]:
        """The contender `c` pairs with (None: none), and whether values decided (`_choose`)."""
        ci = c.index
        if self.partial and all(cc[1] < self.ref_cover(ri)[1] for ri in contenders):
            if _reads_elsewhere(self.cf, ci, frozenset().union(*(self.ref_cover(ri)[1] - cc[1] for ri in contenders))):
                # the candidate reads the rest elsewhere: this is a stage inside the reference's (one
                # layer of a multi-layer nn.GRU), not its counterpart
                return None, False
            # the candidate left some of the reference's parameters out: its computation departs from
            # the reference's at the first stage that reads one of them, whatever it computes after
            return contenders[0], True
        rivals = _Rivals(self.scan(ci, cc, numel), functools.partial(self.kind_of, ci=ci, cc=cc, numel=numel),
                         made_by=functools.partial(self.made_by, ci=ci, numel=numel))
        return _choose(self.state, c, contenders, rivals)

    def pair(self, ci: int, ri: int, confidence: float) -> None:
        """Pair `ci` with `ri`, and forget the covers the new pair changes (those downstream of it)."""
        self.state.add(ci, ri, "dataflow", confidence)
        self.partner[ci] = ri
        for j in _forget_downstream(self.memo_r, self.rf, ri, self.paired.__contains__):
            key = self.placed.pop(j, None)
            if key is not None:
                self.by_key[key].remove(j)
                self.dirty.setdefault(key[0], set()).add(j)
        _forget_downstream(self.memo_c, self.cf, ci, self.partner.__contains__)

    def rival(self, x: int, ci: int, cc: Cover, need: int | None = None) -> str | None:
        """Whether candidate record `x` (after `ci`, of its size) is a later record of `ci`'s cover (those
        that only re-lay out another hold no other values: not rivals), or one from the same parameters
        and more anchors: a step after a paired one (the last hidden state of a hand-written LSTM is made
        from its last cell state).  `need`: `_need(cc)`, where the caller has it."""
        cf = self.cf
        if need is None:
            need = self._need(cc)
        if (cf.ancestors[x] & need) != need or not self.free_cand(x):
            return None
        xc = self.memo_c.get(x) or self.cand_cover(x)
        if xc[1] != cc[1]:  # (both kinds read the same parameters: most records are told apart here)
            return None
        if xc == cc and not (is_layout_op(self.state.cand[x]) and any(
                j == ci or (self.free_cand(j) and self.cand_cover(j) == cc) for j in cf.inputs[x])):
            return "later"
        if cc[0] < xc[0]:
            return "elsewhere"
        return None

    def _need(self, cc: Cover) -> int:
        """The candidate records (as bits) a rival of a record of cover `cc` descends from: its anchors' partners."""
        need = 0
        for k in cc[0]:
            a = self.paired.get(k, -1)
            if a >= 0:
                need |= 1 << a
        return need

    def scan(self, ci: int, cc: Cover, numel: int) -> Iterable[tuple[int, str]]:
        """The rivals of `ci` (`rival`) in order, among the candidate records after it of its size (in the window)."""
        same_size = self.cand_numel.get(numel, [])
        need = self._need(cc)
        for x in same_size[bisect.bisect_right(same_size, ci):]:
            if self.windowed and x > ci + DATAFLOW_WINDOW:
                break
            k = self.rival(x, ci, cc, need)
            if k is not None:
                yield x, k

    def made_by(self, o: str, ci: int, numel: int) -> list[int]:
        """The candidate records after `ci` (in the window) of its size made by torch function `o`."""
        xs = self.by_op.get((numel, o), ())
        lo = bisect.bisect_right(xs, ci)
        return xs[lo:bisect.bisect_right(xs, ci + DATAFLOW_WINDOW)] if self.windowed else xs[lo:]

    def kind_of(self, x: int, ci: int, cc: Cover, numel: int) -> str | None:
        """`rival` for any candidate record `x` (None: not after `ci` in the window, or not of its size)."""
        if x <= ci or (self.windowed and x > ci + DATAFLOW_WINDOW) or record_numel(self.state.cand[x]) != numel:
            return None
        return self.rival(x, ci, cc)


def _elementwise_from(state: AlignState, ci: int, held: int, ccov: list[Cover]) -> bool:
    """Whether every unpaired record between `held` and `ci` keeps their element count (constants
    aside): `ci` is `held` transformed element by element, not a new reduction of it."""
    cf = state.cand_flow
    numel = record_numel(state.cand[ci])
    todo, seen = list(cf.inputs[ci]), set()
    while todo:
        j = todo.pop()
        if j in seen or j == held or j in state.pairs:
            continue
        seen.add(j)
        if not ccov[j][0]:
            continue  # made from constants and parameters only
        if record_numel(state.cand[j]) != numel:
            return False
        todo.extend(cf.inputs[j])
    return True


def _continuations(state: AlignState) -> int:
    """Move a pair to the candidate record that finishes the paired stage's computation: an unpaired
    record downstream of one paired candidate record only (constants aside), of the reference
    record's element count, reading no parameter the reference record's call did not read
    (``proj = linear(ctx, W, b); proj = proj + b`` – the second ``proj`` is what the candidate passes
    on, so it is the counterpart of the reference's projection).  Layout copies do not count.
    Returns the pairs moved."""
    rf, cf = state.flows()
    rcov, ccov = state.covers()
    moved = 0
    for c in state.cand:
        ci = c.index
        if ci in state.pairs or ci in state.superseded or not _eligible(c, cf, ccov[ci]) or is_layout_op(c):
            continue
        anchors, params = ccov[ci]
        if len(anchors) != 1:
            continue
        (ri,) = anchors
        held = state.paired_ref.get(ri)
        r = state.ref[ri]
        if held is None or r.kind == "input" or rf.derived[ri] or record_numel(r) != record_numel(c) \
                or r.is_output or not params <= _stage_params(rf, ri):
            continue
        was = state.pairs[held]
        if was.via not in ("dataflow", "name") or not (cf.ancestors[ci] >> held) & 1 \
                or not _elementwise_from(state, ci, held, ccov):
            continue
        if any(j != ci and not (cf.ancestors[ci] >> j) & 1 for j in cf.consumers[held]):
            # the paired record is passed on besides (``z * sigmoid(z)`` reads `z` itself): it is the stage's
            # result, and this record one more step reading it
            continue
        h, names = state.cand[held], set(r.names())
        if set(h.names()) & names and not reused_name(h, r) and not set(c.names()) & names:
            continue  # the record holding the reference's own (unique) name is the stage's counterpart
        if not params and any(j not in state.paired_ref and record_numel(state.ref[j]) == record_numel(c)
                              and same_op(c, state.ref[j]) for j in rf.consumers[ri]):
            # reading none of the stage's parameters (as ``proj + b`` would, finishing it), while the reference
            # goes on the same way itself (``(x - m) / s``): this is its next stage, not the end of this one
            continue
        if not params and not _base_names(c) & (_base_names(h) | _base_names(r)) and _holds_it_alone(state, h, r, [ci]):
            # the paired record holds the reference's values; this one does not, reads none of the stage's
            # parameters (as ``proj + b`` would, finishing it) and is no new value of the same variable (``attn =
            # attn + noise``): it begins the next stage (``h = fc(x) * 3; 0.5 * h * …``, a GELU written out)
            continue
        state.remove(held)
        state.superseded.add(held)  # part of the stage its continuation now stands for: not paired again here
        state.add(ci, ri, "dataflow", DATAFLOW_CONFIDENCE)
        moved += 1
    return moved


# torch calls that build one tensor out of several, each part whole (a loop's steps stacked or concatenated)
COLLECT_OPS = frozenset({"stack", "cat", "concat", "concatenate", "hstack", "vstack", "dstack", "column_stack"})


def _parts(state: AlignState, ci: int, ri: int) -> list[tuple[int, int]] | None:
    """The parts of two collections position by position, where they are counterparts: as many parts, of
    the same shapes in the same order, and every position paired on either side paired together (one at
    least, unless the two collections are paired with each other already and no part is); else None."""
    rf, cf = state.flows()
    c, r = state.cand[ci], state.ref[ri]
    if not (collects_in(state, "cand", ci) and collects_in(state, "ref", ri)) or c.op.rsplit(".", 1)[-1] != \
            r.op.rsplit(".", 1)[-1] or tuple(c.shape) != tuple(r.shape):
        return None
    cp, rp = cf.inputs[ci], rf.inputs[ri]
    if len(cp) != len(rp):
        return None
    anchored = 0
    for a, b in zip(cp, rp):
        if tuple(state.cand[a].shape) != tuple(state.ref[b].shape):
            return None
        pa, pb = state.partner(a), state.paired_ref.get(b)
        if pa is not None or pb is not None:
            if pa != b:
                return None  # a part paired elsewhere: not the same collection, position by position
            anchored += 1
    free = not any(state.partner(a) is not None or b in state.paired_ref for a, b in zip(cp, rp))
    return list(zip(cp, rp)) if anchored or (free and state.partner(ci) == ri) else None


def collects_in(state: AlignState, side: str, i: int) -> bool:
    """Whether record `i` of one side (`side`: "cand" or "ref") is a collection of other records
    (`COLLECT_OPS`), each read once and whole: its inputs' elements add up to its own."""
    recs, flow = (state.cand, state.cand_flow) if side == "cand" else (state.ref, state.ref_flow)
    rec = recs[i]
    ins = flow.inputs[i]
    return rec.kind == "op" and rec.op.rsplit(".", 1)[-1] in COLLECT_OPS and len(ins) >= 2 \
        and sum(record_numel(recs[j]) for j in ins) == record_numel(rec)


def _collections(state: AlignState) -> int:
    """A loop's steps collected (stacked, concatenated) on both sides: the collections are counterparts
    where a paired stage reads one unpaired collection on each side, and paired collections pair their
    unpaired parts position by position (`_parts`: as many parts, of the same shapes, the paired ones
    paired together), so the first wrong step is compared, not only the collection built from the steps.
    Returns the pairs made."""
    rf, cf = state.flows()
    made = 0
    for cj, p in sorted(state.pairs.items()):
        rj = p.ref
        c_col = [k for k in cf.inputs[cj] if k not in state.pairs and k not in state.superseded
                 and collects_in(state, "cand", k)]
        r_col = [k for k in rf.inputs[rj] if k not in state.paired_ref and collects_in(state, "ref", k)]
        if len(c_col) == 1 and len(r_col) == 1 and _parts(state, c_col[0], r_col[0]) is not None:
            state.add(c_col[0], r_col[0], "dataflow", DATAFLOW_PARTIAL_CONFIDENCE)
            made += 1
    for ci, p in sorted(state.pairs.items()):
        for a, b in _parts(state, ci, p.ref) or ():
            if a not in state.pairs and b not in state.paired_ref and a not in state.superseded \
                    and state.cand[a].kind != "input" and not cf.derived[a] and not rf.derived[b]:
                state.add(a, b, "dataflow", DATAFLOW_PARTIAL_CONFIDENCE)
                made += 1
    return made


def pass_dataflow(state: AlignState) -> None:
    """Pair records by what they were computed from (their covers, see `covers`): a candidate record
    that consumed the counterparts of a reference record's inputs and read the same parameters is its
    counterpart, whatever its values.  Rounds repeat while they pair something, each new pair making
    the records downstream of it comparable; a round of exact covers comes first, then one allowing
    a candidate that read only some of the reference's parameters (or more of them)."""
    rf, cf = state.flows()
    if not (rf.known and cf.known):
        return
    for _ in range(DATAFLOW_MAX_ROUNDS):
        if not (_dataflow_round(state, partial=False) or _dataflow_round(state, partial=True)
                or _continuations(state) or _collections(state)):
            break
