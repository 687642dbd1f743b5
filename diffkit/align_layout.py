"""How a candidate value is compared with a reference value: the transforms between their layouts
(`to_ref_layout`), the layout bringing them closest (`best_layout`), the relative error, and value
fingerprints (`_fingerprint`) no reshape or permutation changes.  Part of `diffkit.align`."""
from __future__ import annotations

import functools
import itertools
import math
from typing import NamedTuple

import torch

from .align_tuning import (FINGERPRINT_QUANTILES, FINGERPRINT_SAMPLE, IDENTICAL_REL_ERR, MAX_PERM_DIMS,
                           PERMUTE_ACCEPT_REL_ERR, PERMUTE_SAMPLE)
from .capture import Record
from .measure import native_rel_l2


# A pair's transform (see `to_ref_layout`): () same shape; RESHAPE; ("permute", perm): the candidate
# permuted, then reshaped; ("unpermute", permuted_shape, inverse): the candidate reshaped, then
# permuted; SHAPE_MISMATCH: the outputs' element counts differ, there is nothing to compare.
RESHAPE = ("reshape",)
SHAPE_MISMATCH = ("shape-mismatch",)


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
            # (both read back in one copy: on a GPU, one wait for the device instead of two)
            d, s = torch.stack([torch.linalg.vector_norm(c - r), torch.linalg.vector_norm(r)]).tolist()
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
    if plain.rel_err < IDENTICAL_REL_ERR:
        return plain
    best = _best_permutation(cand, ref, plain)
    return best if best is not plain and best.rel_err <= PERMUTE_ACCEPT_REL_ERR else plain


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
    if len(cshape) <= MAX_PERM_DIMS:
        for p in itertools.permutations(range(len(cshape))):
            if list(p) != sorted(p) and _groupable(tuple(cshape[i] for i in p), rshape):
                options.append(("permute", p))
    if len(rshape) <= MAX_PERM_DIMS:
        for q in itertools.permutations(range(len(rshape))):
            qshape = tuple(rshape[i] for i in q)
            if list(q) != sorted(q) and _groupable(qshape, cshape):
                options.append(("unpermute", qshape, tuple(sorted(range(len(q)), key=lambda i: q[i]))))
    n = 1
    for size in rshape:
        n *= size
    g = torch.Generator().manual_seed(0)
    j = torch.randint(n, (PERMUTE_SAMPLE,), generator=g) if n > PERMUTE_SAMPLE else torch.arange(n)
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


def _fingerprint(r: Record, k: int = FINGERPRINT_QUANTILES, v: torch.Tensor | None = None) -> torch.Tensor | None:
    """`k` quantiles of a floating value's finite elements (`v`, else the record's; subsampled past
    FINGERPRINT_SAMPLE elements): a summary that no reshape or permutation changes.  None for other values."""
    v = r.value if v is None else v
    if v is None or not (v.is_floating_point()) or v.numel() == 0 or v.layout != torch.strided:
        return None  # (a sparse or nested value: no quantiles without densifying it)
    flat = v.detach().reshape(-1)
    if flat.numel() > FINGERPRINT_SAMPLE:
        step = flat.numel() // FINGERPRINT_SAMPLE + 1
        flat = flat[::step]
    flat = flat.to(torch.float64)
    flat = flat[torch.isfinite(flat)]
    if flat.numel() == 0:
        return None
    qs = torch.linspace(0, 1, k, dtype=torch.float64, device=flat.device)
    return torch.quantile(flat, qs).cpu()


def record_numel(r: Record) -> int:
    """A record's element count, from its shape (the value may not be held)."""
    return math.prod(r.shape)


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


def _flattened(c: Record, r: Record) -> bool:
    """One shape is the other with its leading axes merged (a [B*T, H] kernel output for [B, T, H])."""
    a = tuple(s for s in c.shape if s != 1)
    b = tuple(s for s in r.shape if s != 1)
    return bool(a and b) and a[-1] == b[-1] and (_refines(a, b) or _refines(b, a))


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
