"""Align two captures: pair each candidate record with the reference record it should equal.

Alignment is a list of passes (`PASSES`) over one shared `AlignState`; each pass pairs what the
passes before it left over, and every `Pair` records the pass that made it (`via`) and how strong
that evidence is (`confidence`):

1. ``name``  (`pass_name`) — identical names: taps, module paths, ``scope.function:label`` (aliases
   count); then `pass_outputs` pairs the model's outputs with each other, whatever their shapes;
2. ``order`` (`pass_order`) — within one module scope, a longest common subsequence on (label,
   element count), so a rewrite that renames functions, splits or drops steps still lines up;
3. ``value`` (`pass_value`) — a leftover candidate tensor (say, a fused kernel's output) is paired
   with the reference tensor of equal element count whose values are closest, allowing a reshape
   or a permutation of axes.  Cheap permutation-invariant fingerprints (quantiles) pick a few
   contenders before any full comparison;
4. `pass_deferred` — a name or order pair set aside because a reused variable's values disagreed
   stands after all when no value partner was found for the candidate.

When shapes are equal the tensors are compared as they are (a permuted result is then a bug to
diagnose, not a layout to forgive); when only the element count agrees, the layout that brings
the candidate closest to the reference is used and recorded in `Pair.transform`.
"""
from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from .capture import Record

__all__ = ["Pair", "Alignment", "AlignState", "align", "PASSES", "pass_name", "pass_outputs", "pass_order",
           "pass_value", "pass_deferred", "to_ref_layout", "from_ref_layout", "best_layout", "Layout"]

ValueReader = Callable[[Record], "torch.Tensor | None"]

# A pair's transform (see `to_ref_layout`): () same shape; RESHAPE; ("permute", perm): the candidate
# permuted, then reshaped; ("unpermute", permuted_shape, inverse): the candidate reshaped, then
# permuted; SHAPE_MISMATCH: the outputs' element counts differ, there is nothing to compare.
RESHAPE = ("reshape",)
SHAPE_MISMATCH = ("shape-mismatch",)

# How strongly each kind of evidence says two records hold the same tensor.  These rank the
# evidence in the order the passes trust it; they are priors, not calibrated probabilities.
NAME_CONFIDENCE = 1.0  # the same name, not a reused variable: names are unique within a trace
OUTPUT_CONFIDENCE = 1.0  # the models' results are the pair being compared, by definition
REBOUND_NAME_CONFIDENCE = 0.9  # a reused variable's name, its values agreeing within NAME_MATCH_REL_ERR
ORDER_CONFIDENCE = 0.7  # same scope, label and element count at the same place in the sequence
UNCHECKED_REBOUND_CONFIDENCE = 0.5  # a reused variable's name whose values were not at hand to check
VALUE_CONFIDENCE_BEST = 0.6  # a value pair of identical values: below order, the pass trusted last ...
VALUE_CONFIDENCE_WORST = 0.2  # ... falling linearly to this at the acceptance limit VALUE_MATCH_REL_ERR
DEFERRED_CONFIDENCE = 0.3  # a reused name whose values disagreed, standing for want of a value partner


@dataclass
class Pair:
    """One candidate record paired with the reference record it should equal."""

    ref: int  # index into the reference's records
    cand: int  # index into the candidate's records
    via: str  # the pass that made it: "name" | "order" | "value"
    confidence: float  # how strong that pass's evidence is, in (0, 1]: see the *_CONFIDENCE constants
    transform: tuple = ()  # how the candidate's value is brought into the reference's layout (see RESHAPE)

    def __post_init__(self):
        if not 0.0 < self.confidence <= 1.0:
            raise ValueError(f"a pair's confidence is in (0, 1], got {self.confidence!r}")

    @property
    def paired_by(self) -> str:
        """The pass that made the pair (the name stages and reports show)."""
        return self.via

    def describe_transform(self) -> str:
        """The transform in words for a report: '', 'reshape', 'permute(0, 2, 1)+reshape', …"""
        if not self.transform:
            return ""
        if self.transform[0] == "reshape":
            return "reshape"
        if self.transform[0] == "permute":
            return f"permute{tuple(self.transform[1])}+reshape"
        if self.transform[0] == "unpermute":
            return f"reshape+permute{tuple(self.transform[2])}"
        return str(self.transform)


@dataclass
class Alignment:
    """Pairs in candidate order, plus what stayed unmatched on either side."""

    pairs: list[Pair] = field(default_factory=list)
    ref_unmatched: list[int] = field(default_factory=list)
    cand_unmatched: list[int] = field(default_factory=list)

    def by_cand(self) -> dict[int, Pair]:
        return {p.cand: p for p in self.pairs}


def to_ref_layout(cand: torch.Tensor, ref_shape: tuple, transform: tuple) -> torch.Tensor:
    """Bring a candidate value into the reference's shape using a pair's transform."""
    if not transform:
        return cand
    if transform[0] == "reshape":
        return cand.reshape(ref_shape)
    if transform[0] == "permute":
        return cand.permute(*transform[1]).reshape(ref_shape)
    if transform[0] == "unpermute":  # ref.permute(q) reshaped is cand: invert
        permuted_shape, inv = transform[1], transform[2]
        return cand.reshape(permuted_shape).permute(*inv)
    raise ValueError(f"unknown transform {transform!r}")


def from_ref_layout(ref: torch.Tensor, cand_shape: tuple, transform: tuple) -> torch.Tensor:
    """The inverse of `to_ref_layout`: a reference value in the candidate's layout."""
    if not transform:
        return ref
    if transform[0] == "reshape":
        return ref.reshape(cand_shape)
    if transform[0] == "permute":
        p = transform[1]
        inv = tuple(sorted(range(len(p)), key=lambda i: p[i]))
        permuted = tuple(cand_shape[i] for i in p)
        return ref.reshape(permuted).permute(*inv)
    if transform[0] == "unpermute":
        inv = transform[2]
        q = tuple(sorted(range(len(inv)), key=lambda i: inv[i]))
        return ref.permute(*q).reshape(cand_shape)
    raise ValueError(f"cannot invert transform {transform!r}")


def _groupable(a: tuple, b: tuple) -> bool:
    """Can shape `a` become shape `b` by merging/splitting consecutive dims?"""
    a = [s for s in a if s != 1]
    b = [s for s in b if s != 1]
    i = j = 0
    pa = pb = 1
    while i < len(a) or j < len(b):
        if pa == pb and pa != 1:
            pa = pb = 1
            continue
        if pa <= pb and i < len(a):
            pa *= a[i]
            i += 1
        elif j < len(b):
            pb *= b[j]
            j += 1
        else:
            return False
    return pa == pb


def _rel_err(c: torch.Tensor, r: torch.Tensor) -> float:
    c = c.reshape(-1).to(torch.float64)
    r = r.reshape(-1).to(torch.float64)
    finite = torch.isfinite(c) & torch.isfinite(r)
    if not bool(finite.any()):
        return float("inf")
    d = float((c[finite] - r[finite]).norm())
    s = float(r[finite].norm())
    return d / s if s > 0 else (0.0 if d == 0 else float("inf"))


_MAX_PERM_DIMS = 6  # beyond this many axes the permutations are too many to try (6! = 720)
# below this relative error two tensors hold the same values (float32 rounding, not a difference)
_IDENTICAL_REL_ERR = 1e-6


class Layout(NamedTuple):
    """A way to bring a candidate value into the reference's layout, and how close it comes."""

    transform: tuple  # see `to_ref_layout`
    rel_err: float  # ||c - r|| / ||r|| over elements finite on both sides, the candidate so transformed


def best_layout(cand: torch.Tensor, ref: torch.Tensor) -> Layout:
    """The transform bringing `cand` closest to `ref` (equal element counts), and its relative error.

    A plain reshape (same memory order) is the default; a permutation is taken only when it
    makes the two nearly agree, so a wrong tensor is not "explained" by a lucky permutation."""
    if tuple(cand.shape) == tuple(ref.shape):
        return Layout((), _rel_err(cand, ref))
    plain = Layout(RESHAPE, _rel_err(cand.reshape(ref.shape), ref))
    if plain.rel_err < _IDENTICAL_REL_ERR:
        return plain
    best = _best_permutation(cand, ref, plain)
    return best if best is not plain and best.rel_err <= PERMUTE_ACCEPT_REL_ERR else plain


# a permuted layout is accepted only when it brings the candidate this close to the reference
PERMUTE_ACCEPT_REL_ERR = 0.1


_SAMPLE = 4096  # positions on which permutations are screened before the best is checked in full


def _strides(shape: tuple) -> list[int]:
    out, acc = [], 1
    for size in reversed(shape):
        out.append(acc)
        acc *= size
    return list(reversed(out))


def _unravel_many(j: torch.Tensor, shape: tuple) -> list[torch.Tensor]:
    return [(j // st) % size for st, size in zip(_strides(shape), shape)]


def _source_index(j: torch.Tensor, cshape: tuple, rshape: tuple, t: tuple) -> torch.Tensor:
    """For reference flat positions `j`, the candidate flat positions `to_ref_layout` takes them from."""
    if t[0] == "permute":
        p = t[1]
        m = _unravel_many(j, tuple(cshape[i] for i in p))  # reshape keeps the permuted view's order
        cst = _strides(cshape)
        return sum(m[i] * cst[p[i]] for i in range(len(p)))
    qshape, inv = t[1], t[2]
    m = _unravel_many(j, rshape)
    qst = _strides(qshape)
    return sum(m[i] * qst[inv[i]] for i in range(len(inv)))


@functools.lru_cache(maxsize=512)
def _layout_options(cshape: tuple, rshape: tuple) -> tuple[list[tuple], torch.Tensor, torch.Tensor]:
    """Every permuted layout between two shapes, with sampled reference positions and, per layout,
    the candidate positions they come from (computed once per pair of shapes)."""
    options: list[tuple] = []
    if len(cshape) <= _MAX_PERM_DIMS:
        for p in itertools.permutations(range(len(cshape))):
            if list(p) != sorted(p) and _groupable(tuple(cshape[i] for i in p), rshape):
                options.append(("permute", p))
    if len(rshape) <= _MAX_PERM_DIMS:
        for q in itertools.permutations(range(len(rshape))):
            qshape = tuple(rshape[i] for i in q)
            if list(q) != sorted(q) and _groupable(qshape, cshape):
                options.append(("unpermute", qshape, tuple(sorted(range(len(q)), key=lambda i: q[i]))))
    n = 1
    for size in rshape:
        n *= size
    g = torch.Generator().manual_seed(0)
    j = torch.randint(n, (_SAMPLE,), generator=g) if n > _SAMPLE else torch.arange(n)
    idx = torch.stack([_source_index(j, cshape, rshape, t) for t in options]) if options else torch.empty(0, len(j))
    return options, j, idx.long()


def _best_permutation(cand: torch.Tensor, ref: torch.Tensor, best: Layout) -> Layout:
    cshape, rshape = tuple(cand.shape), tuple(ref.shape)
    options, j, idx = _layout_options(cshape, rshape)
    if not options:
        return best
    # screen every layout on the same sampled positions at once, then check the best two in full
    cf = cand.reshape(-1).to(torch.float64)
    rj = ref.reshape(-1)[j.to(ref.device)].to(torch.float64)
    cs = cf[idx.to(cf.device)]
    ok = torch.isfinite(cs) & torch.isfinite(rj)
    d = torch.where(ok, cs - rj, 0.0).norm(dim=1)
    scale = torch.where(ok, rj.expand_as(cs), 0.0).norm(dim=1)
    errs = torch.where(scale > 0, d / scale.clamp_min(1e-300), torch.where(d == 0, 0.0, float("inf")))
    for k in torch.argsort(errs)[:2].tolist():
        t = options[k]
        err = _rel_err(to_ref_layout(cand, rshape, t), ref)
        if err < best.rel_err:
            best = Layout(t, err)
    return best


def _fingerprint(r: Record, k: int = 33, v: torch.Tensor | None = None) -> torch.Tensor | None:
    """`k` quantiles of a floating value's finite elements (`v`, else the record's; subsampled past
    65536 elements): a summary that no reshape or permutation changes.  None for other values."""
    v = r.value if v is None else v
    if v is None or not (v.is_floating_point()) or v.numel() == 0:
        return None
    flat = v.detach().reshape(-1)
    if flat.numel() > 65536:
        step = flat.numel() // 65536 + 1
        flat = flat[::step]
    flat = flat.to(torch.float64)
    flat = flat[torch.isfinite(flat)]
    if flat.numel() == 0:
        return None
    qs = torch.linspace(0, 1, k, dtype=torch.float64, device=flat.device)
    return torch.quantile(flat, qs).cpu()


def _lcs(a: list, b: list) -> list[tuple[int, int]]:
    """The index pairs (i in a, j in b) of a longest common subsequence, in order."""
    n, m = len(a), len(b)
    if n == 0 or m == 0:
        return []
    dp = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(n - 1, -1, -1):
        ai = a[i]
        row, nxt = dp[i], dp[i + 1]
        for j in range(m - 1, -1, -1):
            row[j] = nxt[j + 1] + 1 if ai == b[j] else max(nxt[j], row[j + 1])
    out, i, j = [], 0, 0
    while i < n and j < m:
        if a[i] == b[j]:
            out.append((i, j))
            i += 1
            j += 1
        elif dp[i + 1][j] >= dp[i][j + 1]:
            i += 1
        else:
            j += 1
    return out


def record_numel(r: Record) -> int:
    """A record's element count, from its shape (the value may not be held)."""
    n = 1
    for s in r.shape:
        n *= s
    return n


def reused_name(c: Record, r: Record) -> bool:
    """Whether a name pair needs its values to agree as well.

    A variable assigned more than once (`q = f(q)`) names several tensors, and a helper's result
    bound to it leaves no record of its own, so its name alone does not say which tensor it is."""
    return c.rebound or r.rebound


def names_index(records: Sequence[Record]) -> dict[str, list[int]]:
    """Record indices under each name and alias, in capture order."""
    index: dict[str, list[int]] = {}
    for r in records:
        for n in r.names():
            index.setdefault(n, []).append(r.index)
    return index


def name_partner(rec: Record, ref: Sequence[Record], index: dict[str, list[int]], taken: Container[int]) -> int | None:
    """The reference record `rec` pairs with by name: under the first of its names (aliases after)
    that has one, the first reference record not `taken` with `rec`'s element count."""
    numel = record_numel(rec)
    return next((ri for n in rec.names() for ri in index.get(n, ())
                 if ri not in taken and record_numel(ref[ri]) == numel), None)


# A value pair is accepted when the candidate, in its best layout, is within this relative
# L2 distance of the reference: loose enough to pair a tensor with a real bug (a missing bias,
# a small offset), tight enough not to pair unrelated tensors.
VALUE_MATCH_REL_ERR = 0.5
# A pair made by the name of a rebound variable is first checked:
# beyond this relative error the value search gets a chance to find the tensor it should equal.
NAME_MATCH_REL_ERR = 1.0

# The value pass ranks contenders by fingerprint distance plus these priors (in units of the
# fingerprint distance relative to the candidate's largest quantile), so that among equally close
# values it prefers the same module scope, a similar position in the run, and a reference record
# not yet paired.
VALUE_PRIOR_OTHER_SCOPE = 0.1
VALUE_PRIOR_POSITION = 0.2  # times the difference of the two records' relative positions (0..1)
VALUE_PRIOR_TAKEN = 0.1
VALUE_CONTENDERS = 6  # contenders compared in full, closest fingerprints first


def value_confidence(rel_err: float) -> float:
    """A value pair's confidence: VALUE_CONFIDENCE_BEST for identical values, falling linearly
    with the relative error to VALUE_CONFIDENCE_WORST at VALUE_MATCH_REL_ERR."""
    closeness = 1.0 - min(max(rel_err, 0.0) / VALUE_MATCH_REL_ERR, 1.0)
    return VALUE_CONFIDENCE_WORST + (VALUE_CONFIDENCE_BEST - VALUE_CONFIDENCE_WORST) * closeness


def _value_reader(fetch: ValueReader | None) -> ValueReader:
    """A record's value: the one it holds, else (given `fetch`) the one fetched lazily for it."""

    def value(rec: Record) -> torch.Tensor | None:
        if rec.value is not None or fetch is None:
            return rec.value
        return fetch(rec)

    return value


@dataclass
class Deferred:
    """A name or order pair set aside: a reused variable's name whose values disagree."""

    ref: int
    cand: int
    via: str  # the pass that proposed it
    rel_err: float  # the candidate's relative L2 distance from the reference in its best layout


@dataclass
class AlignState:
    """What the passes share: both sides' records and values, and the pairs made so far.

    A pass reads the records, pairs with `add` (or `add_checked`, which sets a pair on a reused
    name aside in `deferred` when its values disagree) and leaves paired records alone."""

    ref: list[Record]
    cand: list[Record]
    ref_value: ValueReader  # a reference record's value, fetched lazily where the record holds none
    cand_value: ValueReader
    value_match: bool = True  # whether `pass_value` runs
    pairs: dict[int, Pair] = field(default_factory=dict)  # candidate index -> its pair
    paired_ref: dict[int, int] = field(default_factory=dict)  # reference index -> first candidate paired with it
    deferred: dict[int, Deferred] = field(default_factory=dict)  # candidate index -> the pair set aside

    @classmethod
    def start(cls, ref: list[Record], cand: list[Record], value_match: bool = True, *,
              fixed: dict[int, tuple[int, tuple]] | None = None, ref_value: ValueReader | None = None,
              cand_value: ValueReader | None = None) -> AlignState:
        """The state before any pass: `fixed` (candidate index → (reference index, transform)) are
        name pairs made already (a streaming diff checks a reused name's values before it keeps one)."""
        state = cls(ref, cand, _value_reader(ref_value), _value_reader(cand_value), value_match)
        for ci, (ri, transform) in (fixed or {}).items():
            confidence = REBOUND_NAME_CONFIDENCE if reused_name(cand[ci], ref[ri]) else NAME_CONFIDENCE
            state.add(ci, ri, "name", confidence, transform)
        return state

    def numel_agrees(self, ci: int, ri: int) -> bool:
        return record_numel(self.cand[ci]) == record_numel(self.ref[ri])

    def layout(self, ci: int, ri: int) -> tuple:
        """The transform for a pair of equal element counts: none for equal shapes, else the layout
        closest in value (a plain reshape where the values are not at hand)."""
        c, r = self.cand[ci], self.ref[ri]
        if c.shape == r.shape:
            return ()
        v, w = self.ref_value(r), self.cand_value(c)
        return best_layout(w, v).transform if v is not None and w is not None else RESHAPE

    def add(self, ci: int, ri: int, via: str, confidence: float, transform: tuple | None = None) -> Pair:
        """Pair candidate `ci` with reference `ri` (`transform`: as given, else `layout`)."""
        pair = Pair(ref=ri, cand=ci, via=via, confidence=confidence,
                    transform=self.layout(ci, ri) if transform is None else transform)
        self.pairs[ci] = pair
        self.paired_ref.setdefault(ri, ci)
        return pair

    def add_checked(self, ci: int, ri: int, via: str, confidence: float) -> None:
        """`add`, unless the pair is on a reused name (`reused_name`) and its values disagree beyond
        NAME_MATCH_REL_ERR: then it is set aside in `deferred` for the value pass to overrule."""
        c, r = self.cand[ci], self.ref[ri]
        if not reused_name(c, r):
            self.add(ci, ri, via, confidence)
            return
        w = self.cand_value(c)
        v = self.ref_value(r) if w is not None else None
        if v is None:
            self.add(ci, ri, via, min(confidence, UNCHECKED_REBOUND_CONFIDENCE))
            return
        layout = best_layout(w, v)
        if layout.rel_err > NAME_MATCH_REL_ERR:
            self.deferred[ci] = Deferred(ref=ri, cand=ci, via=via, rel_err=layout.rel_err)
            return
        self.add(ci, ri, via, min(confidence, REBOUND_NAME_CONFIDENCE), layout.transform)

    def alignment(self) -> Alignment:
        return Alignment(pairs=[self.pairs[ci] for ci in sorted(self.pairs)],
                         ref_unmatched=[r.index for r in self.ref if r.index not in self.paired_ref],
                         cand_unmatched=[c.index for c in self.cand if c.index not in self.pairs])


def pass_name(state: AlignState) -> None:
    """Pair each unpaired candidate record with a free reference record of the same name (aliases
    count) and element count; a pair on a reused variable's name must also agree in value."""
    index = names_index(state.ref)
    for c in state.cand:
        if c.index in state.pairs:
            continue
        ri = name_partner(c, state.ref, index, state.paired_ref)
        if ri is not None:
            state.add_checked(c.index, ri, "name", NAME_CONFIDENCE)


def pass_outputs(state: AlignState) -> None:
    """Pair the two models' outputs (one on each side) whatever their shapes: with SHAPE_MISMATCH
    as the transform where their element counts differ."""
    rout = [r.index for r in state.ref if r.is_output]
    cout = [c.index for c in state.cand if c.is_output]
    if len(rout) == 1 and len(cout) == 1 and cout[0] not in state.pairs:
        ri, ci = rout[0], cout[0]
        state.add(ci, ri, "name", OUTPUT_CONFIDENCE,
                  state.layout(ci, ri) if state.numel_agrees(ci, ri) else SHAPE_MISMATCH)


def _order_key(rec: Record) -> tuple[str, int]:
    return rec.label, record_numel(rec)


def pass_order(state: AlignState) -> None:
    """Within each module scope, pair the unpaired records of both sides along a longest common
    subsequence of (label, element count)."""
    for scope in sorted({r.scope for r in state.ref} | {c.scope for c in state.cand}):
        rs = [r for r in state.ref if r.scope == scope and r.index not in state.paired_ref]
        cs = [c for c in state.cand if c.scope == scope and c.index not in state.pairs]
        for i, j in _lcs([_order_key(c) for c in cs], [_order_key(r) for r in rs]):
            state.add_checked(cs[i].index, rs[j].index, "order", ORDER_CONFIDENCE)


@dataclass
class _Contenders:
    """The reference records of one element count that have a fingerprint."""

    refs: list[int]
    fingerprints: torch.Tensor | None  # one row per record in `refs`
    positions: torch.Tensor  # each record's index relative to the reference's length (0..1)
    scopes: list[str]


@dataclass
class _ValueMatch:
    ref: int
    transform: tuple
    rel_err: float
    score: float  # rel_err plus the contender's prior: the lowest wins


def _contenders(state: AlignState, refs: list[int], fingerprints: dict[int, torch.Tensor | None]) -> _Contenders:
    for ri in refs:
        if ri not in fingerprints:
            fingerprints[ri] = _fingerprint(state.ref[ri], v=state.ref_value(state.ref[ri]))
    have = [ri for ri in refs if fingerprints[ri] is not None]
    return _Contenders(refs=have, fingerprints=torch.stack([fingerprints[ri] for ri in have]) if have else None,
                       positions=torch.tensor([ri / max(len(state.ref), 1) for ri in have], dtype=torch.float64),
                       scopes=[state.ref[ri].scope for ri in have])


def _closest_by_value(state: AlignState, c: Record, c_value: torch.Tensor, fc: torch.Tensor,
                      group: _Contenders) -> _ValueMatch | None:
    """The contender whose values are closest to `c`'s within VALUE_MATCH_REL_ERR (priors break
    near-ties), screening by fingerprint before comparing the few best in full."""
    scale = float(fc.abs().max()) or 1.0
    prior = (VALUE_PRIOR_OTHER_SCOPE * torch.tensor([sc != c.scope for sc in group.scopes], dtype=torch.float64)
             + VALUE_PRIOR_POSITION * (group.positions - c.index / max(len(state.cand), 1)).abs()
             + VALUE_PRIOR_TAKEN * torch.tensor([ri in state.paired_ref for ri in group.refs], dtype=torch.float64))
    score = (group.fingerprints - fc).abs().max(dim=1).values / scale + prior
    top = torch.argsort(score)[:VALUE_CONTENDERS].tolist()
    priors = [float(prior[k]) for k in top]
    best: _ValueMatch | None = None
    for k, p in zip(top, priors):
        ri = group.refs[k]
        layout = best_layout(c_value, state.ref_value(state.ref[ri]))
        err = layout.rel_err
        if err <= VALUE_MATCH_REL_ERR and (best is None or err + p < best.score):
            best = _ValueMatch(ref=ri, transform=layout.transform, rel_err=err, score=err + p)
        if err < _IDENTICAL_REL_ERR and (k == top[0] or p <= min(priors)):
            break  # the closest fingerprint holds identical values: no need to look further
    return best


def pass_value(state: AlignState) -> None:
    """Pair each unpaired candidate record whose value is at hand with the reference record of equal
    element count whose values are closest in some layout (see `best_layout`), within
    VALUE_MATCH_REL_ERR.  Skipped unless `state.value_match`."""
    if not state.value_match:
        return
    fingerprints: dict[int, torch.Tensor | None] = {}
    groups: dict[int, _Contenders] = {}  # by element count, built once each
    by_numel: dict[int, list[int]] = {}
    for r in state.ref:
        by_numel.setdefault(record_numel(r), []).append(r.index)
    for c in state.cand:
        if c.index in state.pairs:
            continue
        c_value = state.cand_value(c)
        if c_value is None:
            continue
        numel = record_numel(c)
        if not by_numel.get(numel):
            continue
        fc = _fingerprint(c, v=c_value)
        if fc is None:
            continue
        if numel not in groups:
            groups[numel] = _contenders(state, by_numel[numel], fingerprints)
        group = groups[numel]
        if not group.refs:
            continue
        best = _closest_by_value(state, c, c_value, fc, group)
        if best is not None:
            state.add(c.index, best.ref, "value", value_confidence(best.rel_err), best.transform)


def pass_deferred(state: AlignState) -> None:
    """A pair set aside by `add_checked` stands where no later pass paired its candidate: as a
    ``name`` pair, since what speaks for it is the variable's name (the order pass matches the same
    label), whichever pass proposed it last (`Deferred.via`)."""
    for ci, d in state.deferred.items():
        if ci not in state.pairs:
            state.add(ci, d.ref, "name", DEFERRED_CONFIDENCE)


# The passes `align` runs, in order.  A new pass is a function of the state inserted where its
# evidence ranks (a dataflow pass: after pass_outputs, before pass_order).
PASSES: list[Callable[[AlignState], None]] = [pass_name, pass_outputs, pass_order, pass_value, pass_deferred]


def align(ref: list[Record], cand: list[Record], value_match: bool = True, *,
          fixed: dict[int, tuple[int, tuple]] | None = None,
          ref_value: ValueReader | None = None, cand_value: ValueReader | None = None,
          passes: Sequence[Callable[[AlignState], None]] | None = None) -> Alignment:
    """Pair the candidate's records with the reference's by running `passes` (default `PASSES`).

    `fixed` (candidate index → (reference index, transform)) are pairs made already (a streaming
    diff pairs by name as records are produced); `ref_value` fetches a reference value that is
    not held in its record (read lazily from a store); `cand_value` likewise.  `value_match=False`
    skips the value pass."""
    state = AlignState.start(ref, cand, value_match, fixed=fixed, ref_value=ref_value, cand_value=cand_value)
    for run_pass in PASSES if passes is None else passes:
        run_pass(state)
    return state.alignment()
