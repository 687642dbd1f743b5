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
"""
from __future__ import annotations

import bisect
import collections
import functools
import itertools
import math
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from .capture import Record
from .measure import _FAST_DTYPES as _FAST
from .measure import measure_async, measure_many, native_rel_l2, tolerances

__all__ = ["Pair", "Alignment", "AlignState", "align", "PASSES", "pass_name", "pass_outputs", "pass_dataflow",
           "pass_proposed", "pass_order", "pass_value", "pass_read_inputs", "pass_deferred", "pass_consistency", "to_ref_layout",
           "from_ref_layout", "best_layout", "permuted_or_plain", "Layout", "Dataflow", "covers", "compatible", "param_map",
           "rebound_pair_agrees"]

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


@dataclass
class Pair:
    """One candidate record paired with the reference record it should equal."""

    ref: int  # index into the reference's records
    cand: int  # index into the candidate's records
    via: str  # the pass that made it: "name" | "dataflow" | "order" | "value"
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
    dropped: list[Pair] = field(default_factory=list)  # pairs `pass_consistency` undid (two different roles)
    # full metrics measured while pairing (ref, cand, transform) -> measure.Stats, for locate to reuse
    measured: dict = field(default_factory=dict)
    # the candidate's parameter names -> the reference's counterparts it paired by (`param_map`,
    # `map_params_by_use`); diagnosis reads weights through it
    rename: dict = field(default_factory=dict)

    def by_cand(self) -> dict[int, Pair]:
        return {p.cand: p for p in self.pairs}


def permuted(transform: tuple | None) -> bool:
    """Whether a pair's transform reorders axes (a permutation, not a plain reshape): a consumer compared
    through one may have absorbed the same permutation."""
    return tuple(transform or ())[:1] in (("permute",), ("unpermute",))


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
    """||c - r|| / ||r|| over the elements finite on both sides (norms accumulated in float64)."""
    fast = native_rel_l2(c, r)  # (one pass, where it applies)
    if fast is not None:
        return fast
    work = torch.promote_types(torch.promote_types(c.dtype, r.dtype), torch.float32)
    if not (work.is_floating_point or work.is_complex):
        work = torch.float64
    c = c.reshape(-1).to(work)
    r = r.reshape(-1).to(work)

    def norms(c, r):
        if work == torch.float32:
            # float32 norms (no widened copies); exact enough for a relative error, and checked for overflow
            d, s = float(torch.linalg.vector_norm(c - r)), float(torch.linalg.vector_norm(r))
            if math.isfinite(d) and math.isfinite(s) and s > 1e-18 and (d == 0 or d > 1e-18):
                return d, s  # (tiny norms may have lost their squares below float32's range: float64 then)
        wide = torch.complex128 if work.is_complex else torch.float64  # (a complex norm is real all the same)
        return (float(torch.linalg.vector_norm(c - r, dtype=wide)), float(torch.linalg.vector_norm(r, dtype=wide)))

    d, s = norms(c, r)
    if not (math.isfinite(d) and math.isfinite(s)):  # a NaN or Inf somewhere: those elements do not count
        finite = torch.isfinite(c) & torch.isfinite(r)
        if not bool(finite.any()):
            return float("inf")
        d, s = norms(c[finite], r[finite])
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
    return permuted_or_plain(cand, ref, Layout(RESHAPE, _rel_err(cand.reshape(ref.shape), ref)))


def permuted_or_plain(cand: torch.Tensor, ref: torch.Tensor, plain: Layout) -> Layout:
    """`best_layout`, given the plain reshape's error (`plain`, measured elsewhere: a streaming diff
    has it from the pair's metrics): the plain reshape unless it differs and a permutation brings
    the two nearly together."""
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
    cf = cand.reshape(-1)
    rj = ref.reshape(-1)[j.to(ref.device)].to(torch.float64)
    cs = cf[idx.to(cf.device)].to(torch.float64)  # the sampled positions only, not the whole tensor, widened
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
    if v is None or not (v.is_floating_point()) or v.numel() == 0 or v.layout != torch.strided:
        return None  # (a sparse or nested value: no quantiles without densifying it)
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


def record_numel(r: Record) -> int:
    """A record's element count, from its shape (the value may not be held)."""
    return math.prod(r.shape)


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
# values it prefers the same module scope and a similar position in the run.  A reference record
# paired already is no contender: the value pass never overrides another pass's pair.
VALUE_PRIOR_OTHER_SCOPE = 0.1
VALUE_PRIOR_POSITION = 0.2  # times the difference of the two records' relative positions (0..1)
VALUE_CONTENDERS = 6  # contenders compared in full, closest fingerprints first


# A value pair whose two records did not read the same parameters upstream (one computed with
# weights the other never read) must hold the same values to this relative error: a LayerNorm output
# is within 0.2 of its own input on normal data, and must not pair with it
VALUE_UNSUPPORTED_REL_ERR = 1e-3


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


# ---------------------------------------------------------------------------------------------- dataflow
# torch calls whose output holds their input's values in another layout (or a copy of them)
LAYOUT_OPS = frozenset({"view", "reshape", "permute", "transpose", "contiguous", "flatten", "unflatten", "squeeze",
                        "unsqueeze", "t", "clone", "movedim", "moveaxis", "swapaxes", "swapdims", "view_as",
                        "reshape_as", "detach", "to", "float", "as_strided", "expand_as"})


def is_layout_op(rec: Record) -> bool:
    """Whether a record is a torch call that only re-lays out (or copies) its input."""
    return rec.kind == "op" and rec.op.rsplit(".", 1)[-1] in LAYOUT_OPS


# the layout ops that change the order of the elements (a reshape of their result is no plain reshape)
REORDERING_OPS = frozenset({"permute", "transpose", "t", "movedim", "moveaxis", "swapaxes", "swapdims", "as_strided"})


def reorders(records: Sequence[Record], flow: Dataflow, i: int) -> bool:
    """Whether record `i` is its producer's value with the elements in another order: a chain of
    layout ops (``x.permute(...).reshape(...)``) of which one reorders."""
    for _ in range(16):
        rec = records[i]
        if not is_layout_op(rec) or len(flow.inputs[i]) != 1:
            return False
        if rec.op.rsplit(".", 1)[-1] in REORDERING_OPS:
            return True
        i = flow.inputs[i][0]
    return False


@dataclass
class Dataflow:
    """One side's dataflow graph, as the capture recorded it.

    inputs:    per record, the earlier records its producing call consumed
    params:    per record, the parameters and buffers that call read (a candidate's under the
               reference's names, see `param_map`)
    derived:   per record, whether it was made from parameters alone (``W.t()``, ``W * s``): weight
               preparation, not a stage of the computation
    consumers: per record, the records that consumed it
    ancestors: per record, a bitset (int) of every record upstream of it
    known:     whether the capture recorded any dataflow (capture files written before it did not)
    """

    inputs: list[tuple[int, ...]]
    params: list[frozenset]
    derived: list[bool]
    consumers: list[list[int]]
    ancestors: list[int]
    known: bool

    @classmethod
    def of(cls, records: Sequence[Record], rename: dict[str, str] | None = None) -> Dataflow:
        flow = cls([], [], [], [], [], False)
        for r in records:
            flow.append(r, rename)
        return flow

    def readers(self) -> dict[str, list[int]]:
        """The records that read each parameter (built once, again only after records were added)."""
        cached = getattr(self, "_readers", None)
        if cached is None or cached[0] != len(self.params):
            by: dict[str, list[int]] = {}
            for j, ps in enumerate(self.params):
                for n in ps:
                    by.setdefault(n, []).append(j)
            cached = self._readers = (len(self.params), by)
        return cached[1]

    def append(self, r: Record, rename: dict[str, str] | None = None) -> None:
        """Add the next record (a streaming diff builds the candidate's graph as records are made)."""
        pos = len(self.inputs)
        # only earlier records can be inputs (a damaged capture file cannot make a cycle)
        ins = tuple(dict.fromkeys(j for j in (getattr(x, "index", x) for x in r.inputs)
                                  if isinstance(j, int) and 0 <= j < pos))
        ps = frozenset((rename or {}).get(n, n) for n in (getattr(r, "params", ()) or ()))
        bits = 0
        for j in ins:
            bits |= self.ancestors[j] | (1 << j)
            self.consumers[j].append(pos)
        self.inputs.append(ins)
        self.params.append(ps)
        self.derived.append(bool(ps) and all(self.derived[j] for j in ins))
        self.ancestors.append(bits)
        self.consumers.append([])
        self.known = self.known or bool(ins) or bool(ps)


Cover = tuple[frozenset, frozenset]  # (anchors: reference indices of the paired records upstream, params read)


def covers(flow: Dataflow, anchor: Callable[[int], int | None]) -> list[Cover]:
    """Per record, what it was computed from: the paired records reached going upstream through
    unpaired ones (`anchor` gives a paired record's reference index, None for an unpaired one), and
    the parameters read by it and by those unpaired records on the way."""
    out: list[Cover] = []
    empty: frozenset = frozenset()
    for i, ins in enumerate(flow.inputs):
        anchors: set | frozenset = empty
        params = flow.params[i]
        for j in ins:
            a = anchor(j)
            if a is not None:
                anchors = anchors | {a}
            else:
                aj, pj = out[j]
                if aj:
                    anchors = anchors | aj
                if pj:
                    params = params | pj
        out.append((frozenset(anchors), frozenset(params)))
    return out


def layout_of_equal(r: torch.Tensor, c: torch.Tensor) -> str | None:
    """How tensor `c` holds tensor `r`'s values: "" equal, "transposed" (its last two axes swapped: a weight
    stored for ``x @ W``), "reshaped" (the same values in the same order, another shape); None otherwise."""
    if r.numel() != c.numel() or r.dtype != c.dtype:
        return None
    try:
        r, c = r.detach().to(c.device), c.detach()
        if r.shape == c.shape and torch.equal(r, c):
            return ""
        if r.dim() >= 2 and c.shape == r.transpose(-1, -2).shape and torch.equal(r.transpose(-1, -2), c):
            return "transposed"
        if torch.equal(r.reshape(-1), c.reshape(-1)):
            return "reshaped"
    except RuntimeError:
        return None
    return None


def param_map(ref_params: dict[str, torch.Tensor] | None, cand_params: dict[str, torch.Tensor] | None) -> dict[str, str]:
    """The reference name of each candidate parameter or buffer: the same name where the reference has
    one of that shape; else, in creation order, a reference one of identical shape and values that no
    name claimed (a candidate that renamed a module but built it from the same seed), or of its values
    in another layout (`layout_of_equal`: a weight stored transposed); else the one left of its shape on
    each side (a renamed module created in another order holds other values,
    but plays the same part; `map_params_by_use` pairs shapes of which there are several)."""
    if not cand_params:
        return {}
    ref_params = ref_params or {}
    out: dict[str, str] = {}
    left: list[str] = []
    for n, t in cand_params.items():
        r = ref_params.get(n)
        if r is not None and tuple(r.shape) == tuple(t.shape):
            out[n] = n
        else:
            left.append(n)
    if not left:
        return out
    free: dict[tuple, list[str]] = {}
    for n, r in ref_params.items():
        if n not in out.values() and n not in cand_params:
            free.setdefault((tuple(r.shape), r.dtype), []).append(n)
    for n in left:
        t = cand_params[n]
        pool = free.get((tuple(t.shape), t.dtype), [])
        for k, rn in enumerate(pool):
            r = ref_params[rn]
            try:
                same = bool(torch.equal(r.detach().to(t.device), t.detach()))
            except RuntimeError:
                same = False
            if same:
                out[n] = rn
                del pool[k]
                break
    for n in left:  # the same values in another layout (a weight stored transposed for ``x @ W``)
        if n in out:
            continue
        t = cand_params[n]
        hit = next(((key, rn) for key, pool in free.items() for rn in pool
                    if layout_of_equal(ref_params[rn], t) is not None), None)
        if hit is not None:
            out[n] = hit[1]
            free[hit[0]].remove(hit[1])
    unmatched: dict[tuple, list[str]] = {}
    for n in left:
        if n not in out:
            t = cand_params[n]
            unmatched.setdefault((tuple(t.shape), t.dtype), []).append(n)
    for key, names in unmatched.items():
        pool = free.get(key, [])
        if len(pool) == 1 and len(names) == 1:
            out[names[0]] = pool[0]
    return out


def map_params_by_use(mapping: dict[str, str], ref_records: Sequence[Record], cand_records: Sequence[Record],
                      ref_params: dict[str, torch.Tensor] | None,
                      cand_params: dict[str, torch.Tensor] | None) -> dict[str, str]:
    """`param_map`'s answer extended: the parameters still without a counterpart pair shape by shape in
    the order the two forwards first read them, where each side read as many of that shape (a
    candidate that creates its parameters in another order, under other names, still reads them in
    the order its computation needs them)."""
    ref_params, cand_params = ref_params or {}, cand_params or {}
    taken = set(mapping.values())

    def first_reads(records: Sequence[Record], free: set) -> list[str]:
        order: list[str] = []
        for r in records:
            for n in getattr(r, "params", ()) or ():
                if n in free:
                    free.discard(n)
                    order.append(n)
        return order

    r_order = first_reads(ref_records, {n for n in ref_params if n not in taken and n not in cand_params})
    c_order = first_reads(cand_records, {n for n in cand_params if n not in mapping})
    groups: dict[tuple, tuple[list, list]] = {}
    for n in r_order:
        groups.setdefault((tuple(ref_params[n].shape), ref_params[n].dtype), ([], []))[0].append(n)
    for n in c_order:
        groups.setdefault((tuple(cand_params[n].shape), cand_params[n].dtype), ([], []))[1].append(n)
    out = dict(mapping)
    for rs, cs in groups.values():
        if len(rs) == len(cs):
            out.update(zip(cs, rs))
    return out


def compatible(c_cover: Cover, r_cover: Cover, c_ancestors: int, r_ancestors: int,
               ref_partner: Callable[[int], int | None]) -> bool:
    """Whether pairing a candidate and a reference record contradicts neither side's dataflow: every
    paired record upstream of the candidate has its counterpart upstream of the reference record, and
    the reverse (`ref_partner` gives a reference record's candidate counterpart)."""
    for a in c_cover[0]:
        if not (r_ancestors >> a) & 1:
            return False
    for a in r_cover[0]:
        ci = ref_partner(a)
        if ci is not None and not (c_ancestors >> ci) & 1:
            return False
    return True


def rebound_pair_agrees(c: Record, r: Record, c_flow: Dataflow, r_flow: Dataflow,
                        partner: Callable[[int], int | None]) -> bool | None:
    """Whether a name pair on a reused variable is confirmed by dataflow: both records consumed
    counterpart records (weight preparation aside; `partner` gives a candidate record's reference
    counterpart) and read the same parameters.  None when neither side recorded dataflow (then the
    values have to decide)."""
    if not (c_flow.known and r_flow.known):
        return None
    c_in = {partner(j) for j in c_flow.inputs[c.index] if not c_flow.derived[j]}
    r_in = {j for j in r_flow.inputs[r.index] if not r_flow.derived[j]}
    c_params = c_flow.params[c.index].union(*(c_flow.params[j] for j in c_flow.inputs[c.index] if c_flow.derived[j]))
    r_params = r_flow.params[r.index].union(*(r_flow.params[j] for j in r_flow.inputs[r.index] if r_flow.derived[j]))
    if None in c_in:  # an input with no counterpart (an unpaired reshape, say): dataflow cannot tell
        return None
    return c_in == r_in and c_params == r_params


@dataclass
class Deferred:
    """A name or order pair set aside: a reused variable's name whose values disagree."""

    ref: int
    cand: int
    via: str  # the pass that proposed it
    rel_err: float  # the candidate's relative L2 distance from the reference in its best layout


@dataclass
class AlignState:
    """What the passes share: both sides' records, values and dataflow, and the pairs made so far.

    A pass reads the records, pairs with `add` (or `add_checked`, which sets a pair on a reused
    name aside in `deferred` when its values disagree) and leaves paired records alone.  Pairs are
    one-to-one: a reference record pairs with one candidate record at most."""

    ref: list[Record]
    cand: list[Record]
    ref_value: ValueReader  # a reference record's value, fetched lazily where the record holds none
    cand_value: ValueReader
    value_match: bool = True  # whether `pass_value` runs
    rename: dict[str, str] = field(default_factory=dict)  # candidate parameter name -> the reference's
    pairs: dict[int, Pair] = field(default_factory=dict)  # candidate index -> its pair
    paired_ref: dict[int, int] = field(default_factory=dict)  # reference index -> the candidate paired with it
    deferred: dict[int, Deferred] = field(default_factory=dict)  # candidate index -> the pair set aside
    proposed: dict[int, int] = field(default_factory=dict)  # candidate -> reference: a reused name, for later
    superseded: set = field(default_factory=set)  # candidate records whose stage a continuation took over
    errors: dict[int, float] = field(default_factory=dict)  # candidate index -> its pair's relative L2 error
    dropped: list[Pair] = field(default_factory=list)
    # (atol, rtol) by reference dtype: a pair whose error is asked for is measured in full once, and
    # locate reuses those metrics (`measured`: (ref, cand, transform) -> Stats)
    tolerance: Callable[[torch.dtype], tuple[float, float]] | None = None
    measured: dict = field(default_factory=dict)
    _flows: tuple | None = field(default=None, repr=False)

    @classmethod
    def start(cls, ref: list[Record], cand: list[Record], value_match: bool = True, *,
              fixed: dict[int, tuple] | None = None, ref_value: ValueReader | None = None,
              cand_value: ValueReader | None = None, rename: dict[str, str] | None = None) -> AlignState:
        """The state before any pass: `fixed` (candidate index → (reference index, transform[, relative
        error[, the pass that made it, "name" by default]])) are pairs made already (a streaming diff
        pairs as records are produced)."""
        state = cls(ref, cand, _value_reader(ref_value), _value_reader(cand_value), value_match, dict(rename or {}))
        for ci, fix in (fixed or {}).items():
            ri, transform = fix[0], fix[1]
            via = fix[3] if len(fix) > 3 else "name"
            if via == "dataflow":
                confidence = DATAFLOW_CONFIDENCE
            else:
                confidence = REBOUND_NAME_CONFIDENCE if reused_name(cand[ci], ref[ri]) else NAME_CONFIDENCE
            state.add(ci, ri, via, confidence, transform)
            if len(fix) > 2 and fix[2] is not None:
                state.errors[ci] = float(fix[2])
        return state

    @property
    def ref_flow(self) -> Dataflow:
        return self.flows()[0]

    @property
    def cand_flow(self) -> Dataflow:
        return self.flows()[1]

    def flows(self) -> tuple[Dataflow, Dataflow]:
        """Both sides' dataflow graphs (built once)."""
        if self._flows is None:
            self._flows = (Dataflow.of(self.ref), Dataflow.of(self.cand, self.rename))
        return self._flows

    def partner(self, ci: int) -> int | None:
        """The reference record a candidate record is paired with, if any."""
        p = self.pairs.get(ci)
        return None if p is None else p.ref

    def covers(self) -> tuple[list[Cover], list[Cover]]:
        """Both sides' covers (see `covers`) under the pairs made so far."""
        rf, cf = self.flows()
        paired = self.paired_ref
        partners = {ci: p.ref for ci, p in self.pairs.items()}
        return (covers(rf, {i: i for i in paired}.get), covers(cf, partners.get))

    def compatible(self, ci: int, ri: int, ccov: list[Cover], rcov: list[Cover]) -> bool:
        """`compatible` for one candidate and one reference record, under the given covers."""
        rf, cf = self.flows()
        if not (rf.known and cf.known):
            return True
        return compatible(ccov[ci], rcov[ri], cf.ancestors[ci], rf.ancestors[ri], self.paired_ref.get)

    def by_numel(self, side: str) -> dict[int, list[int]]:
        """One side's record indices by element count, in order (built once)."""
        key = "_numel_" + side
        hit = self.__dict__.get(key)
        if hit is None:
            hit = {}
            for r in (self.ref if side == "ref" else self.cand):
                hit.setdefault(record_numel(r), []).append(r.index)
            self.__dict__[key] = hit
        return hit

    def numel_agrees(self, ci: int, ri: int) -> bool:
        return record_numel(self.cand[ci]) == record_numel(self.ref[ri])

    def best(self, ci: int, ri: int) -> Layout | None:
        """`best_layout` of a candidate record against a reference record (cached), None where a
        value is not at hand."""
        cache = self.__dict__.setdefault("_layouts", {})
        key = (ci, ri)
        if key not in cache:
            w = self.cand_value(self.cand[ci])
            v = self.ref_value(self.ref[ri]) if w is not None else None
            cache[key] = best_layout(w, v.to(w.device)) if v is not None else None
        return cache[key]

    def layout(self, ci: int, ri: int) -> tuple:
        """The transform for a pair of equal element counts: none for equal shapes, else the layout
        closest in value (a plain reshape where the values are not at hand)."""
        c, r = self.cand[ci], self.ref[ri]
        if c.shape == r.shape:
            return ()
        got = self.best(ci, ri)
        return got.transform if got is not None else RESHAPE

    def add(self, ci: int, ri: int, via: str, confidence: float, transform: tuple | None = None) -> Pair:
        """Pair candidate `ci` with reference `ri` (`transform`: as given, else `layout`)."""
        pair = Pair(ref=ri, cand=ci, via=via, confidence=confidence,
                    transform=self.layout(ci, ri) if transform is None else transform)
        self.pairs[ci] = pair
        self.paired_ref.setdefault(ri, ci)
        taken = self.__dict__.get("_ref_taken")
        if taken is not None:
            taken[ri] = True
        return pair

    def ref_taken(self) -> torch.Tensor:
        """A bool per reference record: paired (`paired_ref`), kept up to date by `add` and `remove`."""
        taken = self.__dict__.get("_ref_taken")
        if taken is None:
            taken = self.__dict__["_ref_taken"] = torch.zeros(len(self.ref), dtype=torch.bool)
            if self.paired_ref:
                taken[torch.tensor(list(self.paired_ref), dtype=torch.long)] = True
        return taken

    def remove(self, ci: int) -> Pair:
        """Undo the pair of candidate `ci`."""
        pair = self.pairs.pop(ci)
        self.errors.pop(ci, None)
        if self.paired_ref.get(pair.ref) == ci:
            del self.paired_ref[pair.ref]
            taken = self.__dict__.get("_ref_taken")
            if taken is not None:
                taken[pair.ref] = False
        return pair

    def _pair_values(self, ci: int) -> tuple[Pair, torch.Tensor, torch.Tensor] | None:
        """A pair's reference value and its candidate value in the reference's layout, None where a
        value is not at hand or not floating."""
        p = self.pairs.get(ci)
        if p is None or p.transform == SHAPE_MISMATCH:
            return None
        r = self.ref[p.ref]
        w = self.cand_value(self.cand[ci])
        v = self.ref_value(r) if w is not None else None
        if v is None or not (v.is_floating_point() or v.is_complex()):
            return None
        return p, v, to_ref_layout(w, tuple(r.shape), p.transform).to(v.device)

    def _fast(self, v: torch.Tensor, cv: torch.Tensor) -> tuple[float, float] | None:
        """The tolerance to measure a pair's full metrics by, None where the fast metric paths do
        not take its dtypes."""
        if v.is_floating_point() and cv.is_floating_point() and v.dtype in _FAST and cv.dtype in _FAST:
            return (self.tolerance or (lambda d: tolerances(None, None, d)))(v.dtype)
        return None

    def _settle(self, ci: int, p: Pair, v: torch.Tensor, cv: torch.Tensor, pending) -> float:
        err = None
        if pending is not None:
            # the pair's full metrics (the stage will need them), its relative error with them
            st = pending.result()
            if not (st.ref_nan or st.ref_inf or st.cand_nan or st.cand_inf):
                self.measured[(p.ref, ci, p.transform)] = st
                err = pending.rel_l2
        if err is None:
            err = _rel_err(cv, v)
        self.errors[ci] = err
        return err

    def pair_error(self, ci: int) -> float | None:
        """The relative L2 distance of a pair's candidate (in the pair's layout) from its reference,
        None where a value is not at hand."""
        if ci in self.errors:
            return self.errors[ci]
        got = self._pair_values(ci)
        if got is None:
            return None
        p, v, cv = got
        tol = self._fast(v, cv)
        return self._settle(ci, p, v, cv, measure_async(v, cv, *tol) if tol is not None else None)

    def prefetch_errors(self, cis: Sequence[int]) -> None:
        """`pair_error` for many pairs at once: their metrics measured together (`measure_many`: one
        launch per batch on CUDA, worker threads on the CPU), so later `pair_error` calls find them."""
        todo, items, held = [], [], 0

        def flush():
            for (ci, (p, v, cv)), pending in zip(todo, measure_many(items) if items else ()):
                self._settle(ci, p, v, cv, pending)
            todo.clear()
            items.clear()

        for ci in cis:
            if ci in self.errors:
                continue
            got = self._pair_values(ci)
            if got is None:
                continue
            tol = self._fast(got[1], got[2])
            if tol is not None:
                todo.append((ci, got))
                items.append((got[1], got[2], *tol))
                # values read from a store (streaming) are held only a batch at a time
                held += sum(t.numel() * t.element_size() for t in got[1:])
                if held >= PREFETCH_BYTES:
                    flush()
                    held = 0
        flush()

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
        self.errors[ci] = layout.rel_err

    def alignment(self) -> Alignment:
        return Alignment(measured=self.measured, pairs=[self.pairs[ci] for ci in sorted(self.pairs)],
                         ref_unmatched=[r.index for r in self.ref if r.index not in self.paired_ref],
                         cand_unmatched=[c.index for c in self.cand if c.index not in self.pairs],
                         dropped=list(self.dropped), rename=dict(self.rename))


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


# rounds of the dataflow pass: each pairs what the pairs of the round before made comparable
DATAFLOW_MAX_ROUNDS = 64
# values "decide" among dataflow contenders when the closest is within VALUE_MATCH_REL_ERR, or when it
# is this much closer than the next; contenders within DATAFLOW_TIE of the closest are tied (equal values in
# another layout), and the earliest of them is taken
DATAFLOW_CLEARLY_CLOSER = 0.7
# a lone contender's values this far from a record's (relative error) leave it to a later record of the
# same cover that is clearly closer (the step that finishes what this one began)
DATAFLOW_DEFER_ABOVE = 1e-3
DATAFLOW_TIE = 1.25
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
# a lone contender of the same layout is measured against the record before the rivals after it are looked for
# (only a distant value makes them matter) when the pair holds at most this many bytes a side
DATAFLOW_VALUE_FIRST_BYTES = 1 << 20


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


def _refines(a: tuple, b: tuple) -> bool:
    """Whether shape `b` is shape `a` with runs of consecutive axes merged (1s ignored)."""
    a = [s for s in a if s != 1]
    b = [s for s in b if s != 1]
    i = 0
    for size in b:
        acc = 1
        while acc < size and i < len(a):
            acc *= a[i]
            i += 1
        if acc != size:
            return False
    return i == len(a)


def same_layout(c: Record, r: Record) -> bool:
    """Equal shapes (axes of size 1 aside).  (Shapes that only multiply out alike, [24, 96] and a
    head-split [3, 2, 4, 12, 8], may hold the same elements in another order.)"""
    return [s for s in c.shape if s != 1] == [s for s in r.shape if s != 1]


def layout_known(state: AlignState, ci: int, ri: int) -> bool:
    """Whether the layout comparing two records of equal element count is known: equal shapes, one
    shape the other with consecutive axes merged (a reshape), or a permutation the values confirm.
    Values that are wrong cannot say which axes a permuted layout swapped: such a pair would compare
    elements that do not correspond."""
    c, r = tuple(state.cand[ci].shape), tuple(state.ref[ri].shape)
    if c == r or _refines(c, r) or _refines(r, c):
        return True
    return permuted(state.layout(ci, ri))


def _eligible(rec: Record, flow: Dataflow, cover: Cover) -> bool:
    """A record the dataflow pass pairs: computed from something (not an input, not weight preparation)."""
    return rec.kind != "input" and not flow.derived[rec.index] and bool(cover[0] or cover[1])


def torch_op(rec: Record) -> str:
    """The torch function or module class that made a record ('' for extension and Triton calls,
    whose names their authors chose): ``F.softmax``, ``Tensor.softmax`` and ``torch.softmax`` alike."""
    return _torch_op(rec.kind, rec.op)


@functools.lru_cache(maxsize=8192)
def _torch_op(kind: str, op: str) -> str:
    if kind not in ("op", "module") or op.startswith(("ext:", "triton:")):
        return ""
    return op.rsplit(".", 1)[-1].lower().rstrip("_")


def same_op(c: Record, r: Record) -> bool:
    """Both records made by the same torch function or module class."""
    a = torch_op(c)
    return bool(a) and a == torch_op(r)


def _value_err(state: AlignState, c: Record, r: Record) -> float | None:
    got = state.best(c.index, r.index)
    return None if got is None else got.rel_err


def _known_roots(state: AlignState, ci: int, contenders: list[int]) -> list[int]:
    """The contenders whose layout against `ci` is known (`layout_known`), without those that only
    re-lay out another (a view of a fused output holds the same values: the stage that computed them is
    the counterpart); a layout copy stands in for a contender only when that one's layout is not known.  (Contenders come
    in reference order, so a copy comes after what it copies; no layout is computed for a copy.)"""
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


def _flattened(c: Record, r: Record) -> bool:
    """One shape is the other with its leading axes merged (a [B*T, H] kernel output for [B, T, H])."""
    a = tuple(s for s in c.shape if s != 1)
    b = tuple(s for s in r.shape if s != 1)
    return bool(a and b) and a[-1] == b[-1] and (_refines(a, b) or _refines(b, a))


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
        # a contender whose paired consumers' counterparts read later records of its size, not `c`, is
        # theirs (a recurrent cell's output, which the output stacks, against a gate of the hand-written
        # step: the step's new state is what the output holds)
        mine = [ri for ri in contenders if not _fed_elsewhere(state, ri, c, rivals)]
        if not mine:
            return None, False
        contenders = mine
    if len(contenders) > 1:
        # the same torch function on both sides (softmax and softmax) is the same stage; a later
        # candidate record with its own such contender is no rival for the others (by the function's
        # name, so that a recurrence's thousands of steps cost linear, not cubic, time)
        op = torch_op(c)
        mine = [ri for ri in contenders if op and torch_op(state.ref[ri]) == op]
        if mine:
            contenders = mine
            rivals = rivals.only(lambda x: torch_op(state.cand[x]) == op)
        else:
            has: dict[str, bool] = {}  # a contender's function: whether a later record's is the same

            def later_has(o: str) -> bool:
                if o not in has:
                    has[o] = bool(o) and rivals.any_later(lambda x: torch_op(state.cand[x]) == o, op=o)
                return has[o]

            taken = {ri for ri in contenders if later_has(torch_op(state.ref[ri]))}
            if taken and len(taken) < len(contenders):
                taken_ops = {torch_op(state.ref[ri]) for ri in taken}
                contenders = [ri for ri in contenders if ri not in taken]
                rivals = rivals.only(lambda x: torch_op(state.cand[x]) not in taken_ops)
    if len(contenders) == 1:
        r = state.ref[contenders[0]]
        feeds = _feeds_partner(state, contenders[0])
        if len(feeds) == 1:  # (several: no telling which)
            if c.index in feeds:
                return contenders[0], True  # it is what the consumer's counterpart reads: the same place
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
                    return contenders[0], True
            elif not rivals.any_later():
                return contenders[0], True
        mine = _value_err(state, c, r)
        if mine is not None and mine > DATAFLOW_DEFER_ABOVE:
            # a later record of the same cover that holds the values (clearly closer) is the stage
            bar = min(VALUE_MATCH_REL_ERR, DATAFLOW_CLEARLY_CLOSER * mine)
            for x in rivals.later:
                theirs = _value_err(state, state.cand[x], r)
                if theirs is not None and theirs <= bar:
                    return None, False
            if _later_holds(state, contenders, rivals.elsewhere, bar):
                return None, False
        if mine is not None and mine > VALUE_MATCH_REL_ERR and _count_only(c, r):
            return None, False
        return contenders[0], True
    if state.cand_value(c) is not None:
        first = _value_err(state, c, state.ref[contenders[0]])
        if first is not None and first <= _IDENTICAL_REL_ERR and all(
                state.ref_value(state.ref[ri]) is not None for ri in contenders[1:]):
            # the earliest contender holds `c`'s values: whatever the others' errors, it is the earliest of
            # those tied with the closest (as below), and no later record need be asked
            return contenders[0], True
        scored = []
        for ri in contenders:
            err = _value_err(state, c, state.ref[ri])
            if err is None:
                scored = []
                break
            scored.append((err, ri))
        if scored:
            scored.sort()
            best, second = scored[0][0], scored[1][0]
            if best > DATAFLOW_DEFER_ABOVE and _later_holds(state, contenders, [*rivals.later, *rivals.elsewhere],
                                                            min(VALUE_MATCH_REL_ERR, DATAFLOW_CLEARLY_CLOSER * best)):
                # a later record of the same cover holds one of them (the last step of a hand-written
                # recurrence, for a recurrent module's final state): that is the stage; `c` (a gate of an
                # earlier step, say) is none, however much closer it is to one contender than to another
                return None, False
            if best <= VALUE_MATCH_REL_ERR or best < DATAFLOW_CLEARLY_CLOSER * second:
                pick = min(ri for e, ri in scored if e <= best * DATAFLOW_TIE + _IDENTICAL_REL_ERR)
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
    return (contenders[0] if rivals.any_later() else contenders[-1]), False


def _cached_fingerprint(state: AlignState, side: str, i: int) -> torch.Tensor | None:
    """`_fingerprint` of one side's record, computed once per alignment."""
    cache = state.__dict__.setdefault("_fingerprints", {})
    key = (side, i)
    if key not in cache:
        rec = (state.ref if side == "ref" else state.cand)[i]
        v = (state.ref_value if side == "ref" else state.cand_value)(rec)
        cache[key] = _fingerprint(rec, v=v) if v is not None else None
    return cache[key]


def _later_holds(state: AlignState, contenders: list[int], later: list[int], bar: float) -> bool:
    """Whether one of the candidate records `later` holds the values of one of the reference records
    `contenders` within relative error `bar` (the closest by fingerprint, VALUE_CONTENDERS of them,
    compared in full)."""
    if not later:
        return False
    fps = [(x, _cached_fingerprint(state, "cand", x)) for x in later]
    fps = [(x, f) for x, f in fps if f is not None]
    if not fps:
        return False
    stacked = torch.stack([f for _, f in fps])
    for ri in contenders:
        fr = _cached_fingerprint(state, "ref", ri)
        if fr is None:
            continue
        scale = float(fr.abs().max()) or 1.0
        order = torch.argsort((stacked - fr).abs().max(dim=1).values / scale)[:VALUE_CONTENDERS].tolist()
        for k in order:
            err = _value_err(state, state.cand[fps[k][0]], state.ref[ri])
            if err is not None and err <= bar:
                return True
    return False


def cover_of(flow: Dataflow, i: int, anchor: Callable[[int], int | None], memo: dict[int, Cover]) -> Cover:
    """`covers` for one record, walking up only as far as the paired records (`memo` holds what was
    walked already, valid while no pair changes)."""
    hit = memo.get(i)
    if hit is not None:
        return hit
    stack = [i]
    while stack:
        j = stack[-1]
        if j in memo:
            stack.pop()
            continue
        todo = [k for k in flow.inputs[j] if anchor(k) is None and k not in memo]
        if todo:
            stack.extend(todo)
            continue
        stack.pop()
        ins = flow.inputs[j]
        if len(ins) == 1 and anchor(ins[0]) is None:
            up = memo[ins[0]]
            if flow.params[j] <= up[1]:  # one input, nothing read of its own: its cover, the same objects
                memo[j] = up
                continue
        anchors: set = set()
        params = flow.params[j]
        for k in ins:
            a = anchor(k)
            if a is not None:
                anchors.add(a)
            else:
                ak, pk = memo[k]
                anchors |= ak
                params = params | pk
        memo[j] = (frozenset(anchors), frozenset(params))
    return memo[i]


def _dataflow_round(state: AlignState, partial: bool) -> int:
    """One round of `pass_dataflow`: in candidate order, pair each candidate record whose cover equals
    (or, `partial`, shares its anchors and some parameters with) a free reference record's.  Covers
    are taken fresh, under every pair made so far (a pair changes the covers downstream of it).
    Returns the pairs made."""
    rf, cf = state.flows()
    ref_numel = state.by_numel("ref")
    cand_numel = state.by_numel("cand")
    by_op = state.__dict__.get("_cand_by_op")
    if by_op is None:  # candidate records by (element count, torch function), in order
        by_op = state.__dict__["_cand_by_op"] = {}
        for n, xs in cand_numel.items():
            for x in xs:
                by_op.setdefault((n, torch_op(state.cand[x])), []).append(x)
    paired = state.paired_ref
    ref_anchor = lambda i: i if i in paired else None  # noqa: E731
    memo_r: dict[int, Cover] = {}
    memo_c: dict[int, Cover] = {}

    def ref_cover(ri: int) -> Cover:
        return cover_of(rf, ri, ref_anchor, memo_r)

    partner = {ci: p.ref for ci, p in state.pairs.items()}

    def cand_cover(ci: int) -> Cover:
        return cover_of(cf, ci, partner.get, memo_c)

    def matches(cc: Cover, rc: Cover) -> bool:
        if not partial:
            return cc == rc
        return cc[0] == rc[0] and bool(cc[1] & rc[1]) and (cc[1] <= rc[1] or rc[1] <= cc[1]) and cc[1] != rc[1]

    def free_cand(x: int) -> bool:
        return x not in state.pairs and x not in state.superseded and state.cand[x].kind != "input" \
            and not cf.derived[x]

    # the reference records that can be contenders, by element count and anchors (a contender shares
    # the candidate record's anchors, which are then upstream of it); kept up to date as a pair changes
    # the covers downstream of it
    by_key: dict[tuple, list[int]] = {}
    placed: dict[int, tuple] = {}
    dirty: dict[int, set[int]] = {}  # by element count: records whose cover changed, placed again when asked for

    def place(ri: int) -> None:
        key = placed[ri] = (record_numel(state.ref[ri]), ref_cover(ri)[0])
        bisect.insort(by_key.setdefault(key, []), ri)

    # the reference records placed so far are those up to `placed_to` (all of them, unless the trace is long
    # enough for a window: DATAFLOW_WINDOW_FROM)
    windowed = len(state.ref) > DATAFLOW_WINDOW_FROM
    placed_to = -1

    def place_to(end: int) -> None:
        nonlocal placed_to
        for ri in range(placed_to + 1, min(end, len(state.ref) - 1) + 1):
            if ri not in paired and state.ref[ri].kind != "input" and not rf.derived[ri]:
                place(ri)
        placed_to = max(placed_to, end)

    if not windowed:
        place_to(len(state.ref) - 1)

    made = 0
    for c in state.cand:
        ci = c.index
        numel = record_numel(c)
        if numel not in ref_numel or not free_cand(ci):  # no reference record holds as many elements
            continue
        cc = cand_cover(ci)
        if not (cc[0] or cc[1]):
            continue
        for ri in sorted(dirty.pop(numel, ())):  # (a lookup asks for records of `c`'s size only)
            place(ri)
        if windowed:  # (a cover without anchors, from parameters and constants alone, may be anywhere)
            place_to(max(cc[0]) + DATAFLOW_WINDOW if cc[0] else len(state.ref) - 1)
        contenders = [ri for ri in by_key.get((numel, cc[0]), ()) if ri not in paired and matches(cc, ref_cover(ri))]
        if not contenders:
            continue
        confidence = DATAFLOW_CONFIDENCE
        if partial:
            def overlap(ri: int) -> float:
                rp = ref_cover(ri)[1]
                return len(cc[1] & rp) / len(cc[1] | rp)
            top = max(overlap(ri) for ri in contenders)
            contenders = [ri for ri in contenders if overlap(ri) == top]
            confidence = DATAFLOW_PARTIAL_CONFIDENCE
        contenders = _known_roots(state, ci, contenders)
        if not contenders:
            continue
        same_size = cand_numel.get(numel, [])

        def rival(x: int, ci=ci, cc=cc) -> str | None:
            """Whether candidate record `x` (after `ci`, of its size) is a later record of `ci`'s cover (those
            that only re-lay out another hold no other values: not rivals), or one from the same parameters
            and more anchors: a step after a paired one (the last hidden state of a hand-written LSTM is made
            from its last cell state)."""
            if not (free_cand(x) and all((cf.ancestors[x] >> a) & 1 for a in (state.paired_ref.get(k, -1)
                                                                               for k in cc[0]) if a >= 0)):
                return None
            xc = cand_cover(x)
            if xc == cc and not (is_layout_op(state.cand[x]) and any(
                    j == ci or (free_cand(j) and cand_cover(j) == cc) for j in cf.inputs[x])):
                return "later"
            if xc[1] == cc[1] and cc[0] < xc[0]:
                return "elsewhere"
            return None

        def scan(ci=ci, same_size=same_size, rival=rival):
            for x in same_size[bisect.bisect_right(same_size, ci):]:
                if windowed and x > ci + DATAFLOW_WINDOW:
                    break
                k = rival(x)
                if k is not None:
                    yield x, k

        def made_by(o: str, ci=ci) -> list[int]:
            """The candidate records after `ci` (in the window) of its size made by torch function `o`."""
            xs = by_op.get((numel, o), ())
            lo = bisect.bisect_right(xs, ci)
            return xs[lo:bisect.bisect_right(xs, ci + DATAFLOW_WINDOW)] if windowed else xs[lo:]

        def kind_of(x: int, ci=ci, rival=rival) -> str | None:
            if x <= ci or (windowed and x > ci + DATAFLOW_WINDOW) or record_numel(state.cand[x]) != numel:
                return None
            return rival(x)

        if partial and all(cc[1] < ref_cover(ri)[1] for ri in contenders):
            if _reads_elsewhere(cf, ci, frozenset().union(*(ref_cover(ri)[1] - cc[1] for ri in contenders))):
                # the candidate reads the rest elsewhere: this is a stage inside the reference's (one
                # layer of a multi-layer nn.GRU), not its counterpart
                continue
            # the candidate left some of the reference's parameters out: its computation departs from
            # the reference's at the first stage that reads one of them, whatever it computes after
            ri, by_value = contenders[0], True
        else:
            ri, by_value = _choose(state, c, contenders, _Rivals(scan(), kind_of, made_by=made_by))
        if ri is None:
            continue
        state.add(ci, ri, "dataflow", confidence if by_value else min(confidence, DATAFLOW_AMBIGUOUS_CONFIDENCE))
        partner[ci] = ri
        made += 1
        # the new pair changes the covers downstream of it
        for j in _forget_downstream(memo_r, rf, ri, paired.__contains__):
            key = placed.pop(j, None)
            if key is not None:
                by_key[key].remove(j)
                dirty.setdefault(key[0], set()).add(j)
        _forget_downstream(memo_c, cf, ci, partner.__contains__)
    return made


def _reads_elsewhere(flow: Dataflow, i: int, names: frozenset) -> bool:
    """Whether a record other than `i` and those upstream of it reads one of `names` (later on, or in
    a record made after the fact: a filled buffer recorded when the forward returned)."""
    readers = flow.readers()
    up = flow.ancestors[i]
    return any(j != i and not (up >> j) & 1 for n in names for j in readers.get(n, ()))


def _forget_downstream(memo: dict[int, Cover], flow: Dataflow, k: int, anchored: Callable[[int], bool]) -> list[int]:
    """Drop (and return) the covers that change now that `k` is an anchor (paired): those of its
    consumers, and on through consumers not anchored themselves (a cover walks up to the anchors
    and no further); `k`'s own is unchanged.  (A record whose cover is not held has none held
    downstream of it either: each was computed from the one above.)"""
    gone = []
    stack = list(flow.consumers[k])
    while stack:
        j = stack.pop()
        if memo.pop(j, None) is None:
            continue
        gone.append(j)
        if not anchored(j):
            stack.extend(flow.consumers[j])
    return gone


def _stage_params(flow: Dataflow, i: int) -> frozenset:
    """The parameters a record's own call read, weight preparation feeding it included."""
    return flow.params[i].union(*(flow.params[j] for j in flow.inputs[i] if flow.derived[j]))


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
                or _continuations(state)):
            break


def pass_proposed(state: AlignState) -> None:
    """A name pair `pass_name` only proposed (a permuted layout, or a reused name dataflow did not
    confirm) pairs now if both records are still free, the values confirm the layout
    (`layout_known`) and, on a reused name, agree (`AlignState.add_checked`)."""
    for ci, ri in state.proposed.items():
        if ci not in state.pairs and ri not in state.paired_ref and layout_known(state, ci, ri):
            state.add_checked(ci, ri, "name", NAME_CONFIDENCE)


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


def _params_support(c_cover: Cover, r_cover: Cover) -> bool:
    """The parameters read upstream agree: none on either side, or some of the same ones."""
    return (not c_cover[1] and not r_cover[1]) or bool(c_cover[1] & r_cover[1])


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


@dataclass
class _Contenders:
    """The reference records of one element count that may have a fingerprint (a floating dtype), their
    fingerprints computed as they are asked for (`rows`): most of a long trace's records are paired by the time
    the value pass looks, and only the free ones are scored."""

    refs: list[int]
    positions: torch.Tensor  # each record's index relative to the reference's length (0..1)
    scopes: list[str]
    scope_ids: torch.Tensor  # each record's scope as a number (`scope_id`), to compare them all at once
    ref_ids: torch.Tensor  # `refs` as a tensor
    fingerprint: Callable[[int], torch.Tensor | None] = field(repr=False, default=lambda ri: None)
    _rows: torch.Tensor | None = field(default=None, repr=False)  # one row per record, NaN until computed
    _known: torch.Tensor | None = field(default=None, repr=False)  # rows computed
    _valid: torch.Tensor | None = field(default=None, repr=False)  # rows computed that have a fingerprint

    def scope_id(self, scope: str) -> int:
        """The number standing for `scope` in `scope_ids` (-1: no record of this group has it)."""
        ids = self.__dict__.get("_ids")
        if ids is None:
            ids = self.__dict__["_ids"] = {sc: k for k, sc in enumerate(dict.fromkeys(self.scopes))}
        return ids.get(scope, -1)

    def rows(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The positions `idx` (into `refs`) that have a fingerprint, and their fingerprints (computed now where
        not yet), in the order given."""
        if self._known is None:
            self._known = torch.zeros(len(self.refs), dtype=torch.bool)
            self._valid = torch.zeros(len(self.refs), dtype=torch.bool)
        for k in idx[~self._known[idx]].tolist():
            fp = self.fingerprint(self.refs[k])
            self._known[k] = True
            if fp is None:
                continue
            if self._rows is None:
                self._rows = torch.full((len(self.refs), fp.numel()), math.nan, dtype=fp.dtype)
            self._rows[k] = fp
            self._valid[k] = True
        idx = idx[self._valid[idx]]
        return idx, (self._rows[idx] if self._rows is not None else torch.empty(0, 0, dtype=torch.float64))

    def all_rows(self) -> tuple[list[int], torch.Tensor]:
        """Every record that has a fingerprint, and the fingerprints (one row each)."""
        idx, fps = self.rows(torch.arange(len(self.refs)))
        return [self.refs[k] for k in idx.tolist()], fps


@dataclass
class _ValueMatch:
    ref: int
    transform: tuple
    rel_err: float
    score: float  # rel_err plus the contender's prior: the lowest wins


def _contenders(state: AlignState, refs: list[int], fingerprints: dict[int, torch.Tensor | None]) -> _Contenders:
    """The group of reference records `refs` (those of a floating dtype), their fingerprints kept in
    `fingerprints` (by record index) as they are computed."""

    def fingerprint(ri: int) -> torch.Tensor | None:
        if ri not in fingerprints:
            fingerprints[ri] = _fingerprint(state.ref[ri], v=state.ref_value(state.ref[ri]))
        return fingerprints[ri]

    have = [ri for ri in refs if state.ref[ri].dtype.is_floating_point and record_numel(state.ref[ri]) > 0
            and fingerprints.get(ri, True) is not None]
    scopes = [state.ref[ri].scope for ri in have]
    ids = {sc: k for k, sc in enumerate(dict.fromkeys(scopes))}
    return _Contenders(refs=have, positions=torch.tensor([ri / max(len(state.ref), 1) for ri in have],
                                                         dtype=torch.float64),
                       scopes=scopes, scope_ids=torch.tensor([ids[sc] for sc in scopes], dtype=torch.long),
                       ref_ids=torch.tensor(have, dtype=torch.long), fingerprint=fingerprint)


def _numel_group(state: AlignState, numel: int) -> _Contenders:
    """`_contenders` of every reference record of `numel` elements, built once per alignment."""
    groups = state.__dict__.setdefault("_numel_groups", {})
    if numel not in groups:
        groups[numel] = _contenders(state, state.by_numel("ref").get(numel, []),
                                    state.__dict__.setdefault("_ref_fingerprints", {}))
    return groups[numel]


# `_beyond` screens values of at most this many elements (larger ones are measured one by one: their passes
# cost more than the Python around them)
BEYOND_MAX_NUMEL = 1 << 16


def _beyond(c: torch.Tensor, values: list[torch.Tensor | None], limit: float) -> list[bool]:
    """For each of `values` (each as many elements as `c`), whether `best_layout` of `c` against it must come out
    above relative error `limit`, found at once for them all: of the same shape, its plain error (the only one
    `best_layout` takes); of another, the error of both sides sorted, below which no reordering of the
    elements goes.  Computed in float64, with a margin for the float32 norms of `_rel_err`; False wherever
    that cannot be said (a NaN or an infinity, a zero reference, a value not at hand or too large)."""
    out = [False] * len(values)
    if c.numel() > BEYOND_MAX_NUMEL or not c.is_floating_point() or c.layout != torch.strided:
        return out
    flat = c.detach().reshape(-1).to(torch.float64)
    if not bool(torch.isfinite(flat).all()):
        return out
    ok = [j for j, v in enumerate(values) if v is not None and v.is_floating_point() and v.layout == torch.strided
          and v.device == c.device and v.numel() == c.numel()]
    for same in (True, False):
        js = [j for j in ok if (tuple(values[j].shape) == tuple(c.shape)) == same]
        if not js:
            continue
        refs = torch.stack([values[j].detach().reshape(-1).to(torch.float64) for j in js])
        mine = flat.expand_as(refs)
        if not same:
            refs, mine = torch.sort(refs, dim=1).values, torch.sort(flat).values.expand_as(refs)
        err = (mine - refs).norm(dim=1) / refs.norm(dim=1)
        for j, e, fin in zip(js, err.tolist(), torch.isfinite(refs).all(dim=1).tolist()):
            out[j] = fin and math.isfinite(e) and e > limit * (1 + 1e-4)
    return out


def _closest_by_value(state: AlignState, c: Record, c_value: torch.Tensor, fc: torch.Tensor,
                      group: _Contenders, allowed: Callable[[int], bool] = lambda ri: True) -> _ValueMatch | None:
    """The free contender (one `allowed`) whose values are closest to `c`'s within VALUE_MATCH_REL_ERR
    (priors break near-ties), screening by fingerprint before comparing the few best in full."""
    free = (~state.ref_taken()[group.ref_ids]).nonzero().squeeze(1)  # (scored alone: most may be paired)
    free, fps = group.rows(free)
    if free.numel() == 0:
        return None
    scale = float(fc.abs().max()) or 1.0
    prior = (VALUE_PRIOR_OTHER_SCOPE * (group.scope_ids[free] != group.scope_id(c.scope)).to(torch.float64)
             + VALUE_PRIOR_POSITION * (group.positions[free] - c.index / max(len(state.cand), 1)).abs())
    score = (fps - fc).abs().max(dim=1).values / scale + prior
    # the VALUE_CONTENDERS of lowest score among the free ones `allowed` (asked lazily, best first)
    picked = []
    for k in torch.argsort(score, stable=True).tolist():
        if allowed(group.refs[int(free[k])]):
            picked.append((int(free[k]), float(prior[k])))
            if len(picked) == VALUE_CONTENDERS:
                break
    top, priors = [k for k, _ in picked], [p for _, p in picked]
    best: _ValueMatch | None = None
    values: list[torch.Tensor | None] = []  # (fetched once: a streaming diff's reference values may be stored)
    beyond: list[bool] = []
    for n, (k, p) in enumerate(zip(top, priors)):
        ri = group.refs[k]
        if n == 1:  # the closest fingerprint did not hold `c`'s values: the rest screened at once
            values = [state.ref_value(state.ref[group.refs[j]]) for j in top[1:]]
            beyond = _beyond(c_value, values, VALUE_MATCH_REL_ERR)
        if n and beyond[n - 1]:
            continue  # further from `c`'s values than any layout could bring within VALUE_MATCH_REL_ERR
        layout = best_layout(c_value, values[n - 1] if n else state.ref_value(state.ref[ri]))
        err = layout.rel_err
        if err <= VALUE_MATCH_REL_ERR and (best is None or err + p < best.score):
            best = _ValueMatch(ref=ri, transform=layout.transform, rel_err=err, score=err + p)
        if err < _IDENTICAL_REL_ERR and (k == top[0] or p <= min(priors)):
            break  # the closest fingerprint holds identical values: no need to look further
    return best


def pass_value(state: AlignState) -> None:
    """Pair each unpaired candidate record whose value is at hand with the free reference record of
    equal element count whose values are closest in some layout (see `best_layout`), within
    VALUE_MATCH_REL_ERR, and whose pairing does not contradict the dataflow (`compatible`).
    One-to-one.  Skipped unless `state.value_match`."""
    if not state.value_match:
        return
    rcov, ccov = state.covers()
    by_numel: dict[int, list[int]] = {}
    for r in state.ref:
        by_numel.setdefault(record_numel(r), []).append(r.index)
    for c in state.cand:
        if c.index in state.pairs:
            continue
        numel = record_numel(c)
        if not by_numel.get(numel):  # no reference record of its size: nothing to fetch or fingerprint
            continue
        group = _numel_group(state, numel)
        if not group.refs or bool(state.ref_taken()[group.ref_ids].all()):
            continue  # (every reference record of its size is paired)
        c_value = state.cand_value(c)
        if c_value is None:
            continue
        fc = _fingerprint(c, v=c_value)
        if fc is None:
            continue
        best = _closest_by_value(state, c, c_value, fc, group,
                                 lambda ri: state.compatible(c.index, ri, ccov, rcov))
        if best is not None and best.rel_err > VALUE_UNSUPPORTED_REL_ERR \
                and not _params_support(ccov[c.index], rcov[best.ref]):
            best = None  # close values, but computed from other parameters: a coincidence of the data
        if best is not None:
            state.add(c.index, best.ref, "value", value_confidence(best.rel_err), best.transform)
            state.errors[c.index] = best.rel_err


# `pass_read_inputs`: what two different functions read pairs only within this relative error
READ_INPUTS_CLOSE_REL_ERR = 1e-2


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


# A pair "disagrees" beyond this relative L2 error (far outside float32 rounding, well inside any
# real bug's error: the false findings this pass exists for were off by 0.85-5.6 absolute) ...
DISAGREE_REL_ERR = 1e-3
# ... and a record consuming it "agrees" within this relative error, and within AGREE_FRACTION of the
# disagreeing pair's: a real error flows on at a comparable size, a wrong pairing leaves none behind
AGREE_REL_ERR = 1e-4
AGREE_FRACTION = 1e-2
CONSUMERS_VISITED = 256  # unpaired records walked through looking for the paired consumers of a pair


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


# the candidate's values "are" another reference record's within this relative error (in some layout)
ANOTHER_ROLE_REL_ERR = 1e-3


def _holds_another(state: AlignState, ci: int, ri: int) -> _ValueMatch | None:
    """The reference record other than `ri` whose values the candidate record holds (in some layout,
    within ANOTHER_ROLE_REL_ERR), closest first by fingerprint; None if it holds no other's."""
    c = state.cand[ci]
    w = state.cand_value(c)
    fc = _fingerprint(c, v=w) if w is not None else None
    if fc is None:
        return None
    refs, fps = _numel_group(state, record_numel(c)).all_rows()
    if not refs or refs == [ri]:
        return None
    scale = float(fc.abs().max()) or 1.0
    order = torch.argsort((fps - fc).abs().max(dim=1).values / scale, stable=True).tolist()
    for other in [refs[k] for k in order if refs[k] != ri][:VALUE_CONTENDERS]:
        layout = best_layout(w, state.ref_value(state.ref[other]).to(w.device))
        if layout.rel_err <= ANOTHER_ROLE_REL_ERR:
            return _ValueMatch(ref=other, transform=layout.transform, rel_err=layout.rel_err, score=layout.rel_err)
    return None


# bytes of values `AlignState.prefetch_errors` holds for one batch of measurements
PREFETCH_BYTES = 1 << 30


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
