"""Align two captures: pair each candidate record with the reference record it should equal.

Evidence is used in this order, and every pair remembers which one made it (`paired_by`):

1. ``name``  — identical names: taps, module paths, ``scope.function:label`` (aliases count);
2. ``order`` — within one module scope, a longest common subsequence on (label, element count),
   so a rewrite that renames functions, splits or drops steps still lines up;
3. ``value`` — a leftover candidate tensor (say, a fused kernel's output) is paired with the
   reference tensor of equal element count whose values are closest, allowing a reshape or a
   permutation of axes.  Cheap permutation-invariant fingerprints (quantiles) pick a few
   contenders before any full comparison.

When shapes are equal the tensors are compared as they are (a permuted result is then a bug to
diagnose, not a layout to forgive); when only the element count agrees, the layout that brings
the candidate closest to the reference is used and recorded in `transform`.
"""
from __future__ import annotations

import functools
import itertools
from typing import Callable
from dataclasses import dataclass, field

import torch

from .capture import Record

__all__ = ["Pair", "Alignment", "align", "to_ref_layout", "from_ref_layout"]


@dataclass
class Pair:
    cand: int  # index into the candidate's records
    ref: int  # index into the reference's records
    paired_by: str  # "name" | "order" | "value"
    transform: tuple = ()  # () same shape; ("reshape",); ("permute", perm) applied to cand then reshape

    def describe_transform(self) -> str:
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


def _numel(r: Record) -> int:
    n = 1
    for s in r.shape:
        n *= s
    return n


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


_MAX_PERM_DIMS = 6


def best_layout(cand: torch.Tensor, ref: torch.Tensor) -> tuple[tuple, float]:
    """The transform bringing `cand` closest to `ref` (equal element counts), and its relative error.

    A plain reshape (same memory order) is the default; a permutation is taken only when it
    makes the two nearly agree, so a wrong tensor is not "explained" by a lucky permutation."""
    if tuple(cand.shape) == tuple(ref.shape):
        return (), _rel_err(cand, ref)
    plain: tuple[tuple, float] = (("reshape",), _rel_err(cand.reshape(ref.shape), ref))
    if plain[1] < 1e-6:
        return plain
    best = _best_permutation(cand, ref, plain)
    return best if best is not plain and best[1] <= PERMUTE_ACCEPT_REL_ERR else plain


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


def _best_permutation(cand: torch.Tensor, ref: torch.Tensor, best: tuple[tuple, float]) -> tuple[tuple, float]:
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
        if err < best[1]:
            best = (t, err)
    return best


def _fingerprint(r: Record, k: int = 33, v: torch.Tensor | None = None) -> torch.Tensor | None:
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


# A value pair is accepted when the candidate, in its best layout, is within this relative
# L2 distance of the reference: loose enough to pair a tensor with a real bug (a missing bias,
# a small offset), tight enough not to pair unrelated tensors.
VALUE_MATCH_REL_ERR = 0.5
# A pair made by the name of a rebound variable is first checked:
# beyond this relative error the value search gets a chance to find the tensor it should equal.
NAME_MATCH_REL_ERR = 1.0


def align(ref: list[Record], cand: list[Record], value_match: bool = True, *,
          fixed: dict[int, tuple[int, tuple]] | None = None,
          ref_value: Callable[[Record], torch.Tensor | None] | None = None,
          cand_value: Callable[[Record], torch.Tensor | None] | None = None) -> Alignment:
    """`fixed` (candidate index → (reference index, transform)) are pairs made already (a streaming
    diff pairs by name as records are produced); `ref_value` fetches a reference value that is
    not held in its record (read lazily from a store); `cand_value` likewise."""
    paired_ref: dict[int, int] = {}
    pairs: dict[int, Pair] = {}
    rv = (lambda r: r.value if r.value is not None else ref_value(r)) if ref_value is not None else (lambda r: r.value)
    cv = (lambda c: c.value if c.value is not None else cand_value(c)) if cand_value is not None else (lambda c: c.value)
    for ci, (ri, t) in (fixed or {}).items():
        pairs[ci] = Pair(ci, ri, "name", t)
        paired_ref.setdefault(ri, ci)

    def can_pair(ci: int, ri: int) -> bool:
        return _numel(cand[ci]) == _numel(ref[ri])

    def layout(ci: int, ri: int) -> tuple:
        c, r = cand[ci], ref[ri]
        if c.shape == r.shape:
            return ()
        v, w = rv(r), cv(c)
        return best_layout(w, v)[0] if v is not None and w is not None else ("reshape",)

    def add(ci: int, ri: int, how: str, transform: tuple | None = None) -> None:
        pairs[ci] = Pair(ci, ri, how, layout(ci, ri) if transform is None else transform)
        paired_ref.setdefault(ri, ci)

    def weak(ci: int, ri: int) -> bool:
        # a variable assigned more than once (`q = f(q)`) names several tensors, and a helper's
        # result bound to it leaves no record of its own: such a name pair must agree in value
        return cand[ci].rebound or ref[ri].rebound

    deferred: dict[int, int] = {}  # cand -> ref of weak name/order pairs whose values disagree

    def add_checked(ci: int, ri: int, how: str) -> None:
        c, r = cand[ci], ref[ri]
        w = cv(c) if weak(ci, ri) else None
        v = rv(r) if w is not None else None
        if v is not None:
            t, err = best_layout(w, v)
            if err > NAME_MATCH_REL_ERR:
                deferred[ci] = ri
                return
            add(ci, ri, how, t)
            return
        add(ci, ri, how)

    # 1. names
    names: dict[str, list[int]] = {}
    for r in ref:
        for n in r.names():
            names.setdefault(n, []).append(r.index)
    for c in cand:
        if c.index in pairs:
            continue
        for n in c.names():
            hit = next((ri for ri in names.get(n, []) if ri not in paired_ref and can_pair(c.index, ri)), None)
            if hit is not None:
                add_checked(c.index, hit, "name")
                break
    # the outputs always pair with each other, whatever their shapes
    rout = [r.index for r in ref if r.is_output]
    cout = [c.index for c in cand if c.is_output]
    if len(rout) == 1 and len(cout) == 1 and cout[0] not in pairs:
        ri, ci = rout[0], cout[0]
        add(ci, ri, "name", layout(ci, ri) if can_pair(ci, ri) else ("shape-mismatch",))

    # 2. order within a scope, on (label, element count)
    scopes = sorted({r.scope for r in ref} | {c.scope for c in cand})
    for scope in scopes:
        rs = [r for r in ref if r.scope == scope and r.index not in paired_ref]
        cs = [c for c in cand if c.scope == scope and c.index not in pairs]
        for i, j in _lcs([(c.label, _numel(c)) for c in cs], [(r.label, _numel(r)) for r in rs]):
            add_checked(cs[i].index, rs[j].index, "order")

    # 3. values
    if value_match:
        fps: dict[int, torch.Tensor | None] = {}
        groups: dict[int, tuple] = {}
        by_numel: dict[int, list[int]] = {}
        for r in ref:
            by_numel.setdefault(_numel(r), []).append(r.index)
        for c in cand:
            if c.index in pairs:
                continue
            c_value = cv(c)
            if c_value is None:
                continue
            contenders = by_numel.get(_numel(c), [])
            if not contenders:
                continue
            fc = _fingerprint(c, v=c_value)
            if fc is None:
                continue
            scale = float(fc.abs().max()) or 1.0
            group = groups.get(_numel(c))
            if group is None:  # the contenders' fingerprints as one matrix, once per element count
                for ri in contenders:
                    if ri not in fps:
                        fps[ri] = _fingerprint(ref[ri], v=rv(ref[ri]))
                have = [ri for ri in contenders if fps[ri] is not None]
                group = groups[_numel(c)] = (have, torch.stack([fps[ri] for ri in have]) if have else None,
                                             torch.tensor([ri / max(len(ref), 1) for ri in have], dtype=torch.float64),
                                             [ref[ri].scope for ri in have])
            have, mat, pos, scopes = group
            if not have:
                continue
            # values first; then prefer the same module scope, a similar position, a free partner
            prior = (0.1 * torch.tensor([sc != c.scope for sc in scopes], dtype=torch.float64)
                     + 0.2 * (pos - c.index / max(len(cand), 1)).abs()
                     + 0.1 * torch.tensor([ri in paired_ref for ri in have], dtype=torch.float64))
            score = (mat - fc).abs().max(dim=1).values / scale + prior
            top = torch.argsort(score)[:6].tolist()
            scored = [(float(score[k]), float(prior[k]), have[k]) for k in top]
            best = None
            for _, prior, ri in scored[:6]:
                t, err = best_layout(c_value, rv(ref[ri]))
                if err <= VALUE_MATCH_REL_ERR and (best is None or err + prior < best[0]):
                    best = (err + prior, ri, t)
                if err < 1e-6 and (ri == scored[0][2] or prior <= min(x[1] for x in scored[:6])):
                    break  # the closest fingerprint holds identical values: no need to look further
            if best is not None:
                add(c.index, best[1], "value", best[2])
    # a rejected name pair stands when no value match was found instead
    for ci, ri in deferred.items():
        if ci not in pairs:
            add(ci, ri, "name")

    out = Alignment()
    out.pairs = [pairs[ci] for ci in sorted(pairs)]
    out.ref_unmatched = [r.index for r in ref if r.index not in paired_ref]
    out.cand_unmatched = [c.index for c in cand if c.index not in pairs]
    return out
