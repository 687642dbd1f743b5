"""Measure one aligned pair: how far the candidate tensor is from the reference tensor.

All arithmetic is done in float64 (complex128 for complex values) on the tensors' device so the
metric adds no error of its own; integer and bool tensors compare exactly.  A pair passes as
``torch.allclose(c, r, atol, rtol, equal_nan=False)`` would pass it (KernelBench's rule): every
element satisfies ``|c - r| <= atol + rtol * |r|``, a NaN on either side is a mismatch, and
infinities agree only when equal.
"""
from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass
from enum import IntEnum

import torch

# KernelBench's tolerances, chosen by the reference tensor's dtype
DEFAULT_TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 1e-2}
FLOAT32_TOLERANCE = 1e-4


def default_tolerance(dtype: torch.dtype) -> float:
    return DEFAULT_TOLERANCE.get(dtype, FLOAT32_TOLERANCE)


def tolerances(atol: float | None, rtol: float | None, dtype: torch.dtype) -> tuple[float, float]:
    """The (atol, rtol) a pair is judged by: as given, else the default for the reference's dtype."""
    return (atol if atol is not None else default_tolerance(dtype), rtol if rtol is not None else default_tolerance(dtype))


@dataclass
class Worst:
    """The worst element: its full index and both values."""

    index: tuple[int, ...]
    ref: float
    cand: float
    abs_err: float

    def to_dict(self) -> dict:
        return {"index": list(self.index), "ref": self.ref, "cand": self.cand, "abs_err": self.abs_err}


@dataclass
class Stats:
    """Per-pair error metrics (float64).  `mismatches` counts elements out of tolerance."""

    numel: int
    max_abs: float
    mean_abs: float
    max_rel: float
    mismatches: int
    cosine: float
    ref_nan: int
    ref_inf: int
    cand_nan: int
    cand_inf: int
    worst: Worst | None
    atol: float
    rtol: float

    @property
    def mismatch_fraction(self) -> float:
        return self.mismatches / self.numel if self.numel else 0.0

    @property
    def ok(self) -> bool:
        return self.mismatches == 0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["worst"] = self.worst.to_dict() if self.worst else None
        d["mismatch_fraction"] = self.mismatch_fraction
        return d


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    idx = []
    for size in reversed(shape):
        idx.append(flat % size if size else 0)
        flat = flat // size if size else 0
    return tuple(reversed(idx))


class _Part(IntEnum):
    """The slots of one chunk's sufficient statistics (`_partials`), combined over the chunks by
    `measure_async`.  Flat indices are into the whole tensor; absolute errors are over elements
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


_COUNTS = (_Part.REF_NAN, _Part.REF_INF, _Part.CAND_NAN, _Part.CAND_INF)
assert _COUNTS == tuple(range(_COUNTS[0], _COUNTS[-1] + 1)), "the NaN/Inf counts are summed as one slice"


class _Packed(IntEnum):
    """The slots of the vector that carries one pair's metrics to the host (see `PendingStats`)."""

    MISMATCHES = 0
    MAX_ABS = 1
    MEAN_ABS = 2
    MAX_REL = 3
    COSINE = 4
    REF_NAN = 5
    REF_INF = 6
    CAND_NAN = 7
    CAND_INF = 8
    WORST_AT = 9  # the worst element's flat index (see `measure_async`)
    WORST_REF = 10  # its reference and candidate values
    WORST_CAND = 11
    REL_L2 = 12  # ||c - r|| / ||r|| over finite elements (align's value-agreement measure)


@functools.cache
def _slot_names(slots: type[IntEnum]) -> tuple[str, ...]:
    return tuple(s.name.lower() for s in slots)


def _pack(slots: type[IntEnum], **values: torch.Tensor) -> torch.Tensor:
    """One float64 vector holding `values` (0-d float64 tensors on one device, each given by its
    slot's lower-case name) in the order of `slots`: a single stack, so no synchronisation."""
    names = _slot_names(slots)
    if values.keys() != set(names):
        raise TypeError(f"{slots.__name__}: missing {sorted(set(names) - values.keys())}, "
                        f"unknown {sorted(values.keys() - set(names))}")
    return torch.stack([values[n] for n in names])


class PendingStats:
    """Metrics computed on the tensors' device, on their way to the host.

    The scalars travel as one small float64 vector (slots: `_Packed`) through pinned memory behind
    a CUDA event, so measuring many pairs costs no synchronisation until `result()` is asked for."""

    def __init__(self, packed: torch.Tensor | None, shape: tuple[int, ...], atol: float, rtol: float,
                 ready: Stats | None = None):
        self.shape, self.atol, self.rtol = shape, atol, rtol
        self._stats = ready
        self.rel_l2 = 0.0  # ||c - r|| / ||r|| over finite elements, once `result()` has been read
        self._event = None
        self._host = None
        if packed is not None:
            if packed.is_cuda:
                self._host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
                self._host.copy_(packed, non_blocking=True)
                self._event = torch.cuda.Event()
                self._event.record()
            else:
                self._host = packed

    def done(self) -> bool:
        return self._stats is not None or self._event is None or self._event.query()

    def result(self) -> Stats:
        if self._stats is None:
            if self._event is not None:
                self._event.synchronize()
            host = self._host.tolist()
            self.rel_l2 = host[_Packed.REL_L2]
            worst_ref, worst_cand = host[_Packed.WORST_REF], host[_Packed.WORST_CAND]
            abs_err = abs(worst_cand - worst_ref)
            if abs_err != abs_err:  # NaN against a number (or a NaN and an infinity): as far apart as can be
                abs_err = float("inf")
            self._stats = Stats(
                numel=math.prod(self.shape), max_abs=host[_Packed.MAX_ABS], mean_abs=host[_Packed.MEAN_ABS],
                max_rel=host[_Packed.MAX_REL], mismatches=int(host[_Packed.MISMATCHES]), cosine=host[_Packed.COSINE],
                ref_nan=int(host[_Packed.REF_NAN]), ref_inf=int(host[_Packed.REF_INF]),
                cand_nan=int(host[_Packed.CAND_NAN]), cand_inf=int(host[_Packed.CAND_INF]),
                worst=Worst(index=_unravel(int(host[_Packed.WORST_AT]), self.shape), ref=worst_ref, cand=worst_cand,
                            abs_err=abs_err),
                atol=self.atol, rtol=self.rtol)
            self._host = None
        return self._stats


def measure(ref: torch.Tensor, cand: torch.Tensor, atol: float, rtol: float) -> Stats:
    """Compare `cand` against `ref` (same shape; bring the layout in line before calling)."""
    return measure_async(ref, cand, atol, rtol).result()


# elements per reduction step, so float64 temporaries stay bounded whatever the tensor's size:
# ~8 MiB each on the CPU, ~32 MiB on a GPU (where fewer, larger launches matter more)
CHUNK = 1 << 20
CHUNK_CUDA = 1 << 22


def _numbers(t: torch.Tensor, cplx: bool) -> torch.Tensor:
    return t.to(torch.complex128 if cplx else torch.float64)


def compare_elements(rd: torch.Tensor, cd: torch.Tensor, atol: float, rtol: float):
    """The elementwise rule, as ``torch.allclose(c, r, atol, rtol, equal_nan=False)`` applies it
    (complex values by their modulus, so the real and imaginary parts both count):

    diff      |c - r| where both are finite, else 0
    bound     atol + rtol * |r|
    special   either side NaN or infinite
    disagree  a NaN on either side, or infinities that are not equal
    bad       out of tolerance or disagreeing
    """
    r_nan, c_nan, r_inf, c_inf = torch.isnan(rd), torch.isnan(cd), torch.isinf(rd), torch.isinf(cd)
    special = r_nan | c_nan | r_inf | c_inf
    disagree = special & ~(r_inf & c_inf & (rd == cd))
    rabs = rd.abs()
    diff = torch.where(special, torch.zeros((), dtype=rabs.dtype, device=rd.device), (cd - rd).abs())
    bound = atol + rtol * rabs
    bad = (~special & (diff > bound)) | disagree
    return diff, bound, special, disagree, bad, (r_nan, r_inf, c_nan, c_inf)


def _partials(r: torch.Tensor, c: torch.Tensor, atol: float, rtol: float, exact: bool, offset: int) -> torch.Tensor:
    """One chunk's sufficient statistics, as a float64 vector (slots: `_Part`); `offset` is the
    chunk's first flat index."""
    cplx = r.is_complex() or c.is_complex()
    rd = _numbers(r, cplx)
    cd = _numbers(c, cplx)
    zero = torch.zeros((), dtype=torch.float64, device=rd.device)
    if exact:
        diff = (cd - rd).abs()
        bad = c != r
        nan_bad = torch.zeros_like(bad)
        counts = {slot.name.lower(): zero for slot in _COUNTS}
        fr, fc = rd, cd
        bound = atol + rtol * rd.abs()
    else:
        diff, bound, special, nan_bad, bad, (r_nan_m, r_inf_m, c_nan_m, c_inf_m) = compare_elements(rd, cd, atol, rtol)
        counts = {"ref_nan": r_nan_m.sum(dtype=torch.float64), "ref_inf": r_inf_m.sum(dtype=torch.float64),
                  "cand_nan": c_nan_m.sum(dtype=torch.float64), "cand_inf": c_inf_m.sum(dtype=torch.float64)}
        fr = torch.where(torch.isfinite(rd), rd, torch.zeros((), dtype=rd.dtype, device=rd.device))
        fc = torch.where(torch.isfinite(cd), cd, torch.zeros((), dtype=cd.dtype, device=cd.device))
    rabs = rd.abs()
    rel = torch.where((rabs > 0) & torch.isfinite(rd) & torch.isfinite(cd), diff / rabs.clamp_min(1e-300), zero)
    # an agreeing value can never be the worst: NaN excess (inf - inf) counts as none at all
    excess = torch.nan_to_num(diff - bound, nan=float("-inf"))
    i_ex, i_d = torch.argmax(excess), torch.argmax(diff)
    any_nb = nan_bad.any()
    first_nb = torch.where(any_nb, torch.argmax(nan_bad.to(torch.uint8)).to(torch.float64) + offset, float("inf"))
    dot = (fr.conj() * fc).real.sum() if cplx else (fr * fc).sum()
    # `take`, not indexing: indexing with a device scalar waits for the device
    return _pack(_Part, mismatches=bad.sum(dtype=torch.float64), max_abs=diff.take(i_d),
                 max_abs_at=i_d.to(torch.float64) + offset, sum_abs=diff.sum(), max_rel=rel.max(),
                 dot=dot, ref_sq=(fr.abs() ** 2).sum(), cand_sq=(fc.abs() ** 2).sum(), **counts,
                 max_excess=excess.take(i_ex), max_excess_at=i_ex.to(torch.float64) + offset,
                 first_disagree_at=first_nb, diff_sq=(diff * diff).sum())


def _real(t: torch.Tensor) -> torch.Tensor:
    """A value as a float64 number for a report (a complex value by its real part)."""
    return (t.real if t.is_complex() else t).to(torch.float64)


def measure_async(ref: torch.Tensor, cand: torch.Tensor, atol: float, rtol: float) -> PendingStats:
    """`measure` without waiting for the device: every scalar is reduced on the device into one
    vector, chunk by chunk, so the temporary memory does not grow with the tensor."""
    if tuple(ref.shape) != tuple(cand.shape):
        raise ValueError(f"measure needs equal shapes, got {tuple(ref.shape)} and {tuple(cand.shape)}")
    if cand.device != ref.device:
        cand = cand.to(ref.device, non_blocking=True)
    n = ref.numel()
    shape = tuple(ref.shape)
    if n == 0:
        return PendingStats(None, shape, atol, rtol, ready=Stats(
            numel=0, max_abs=0.0, mean_abs=0.0, max_rel=0.0, mismatches=0, cosine=1.0, ref_nan=0, ref_inf=0,
            cand_nan=0, cand_inf=0, worst=None, atol=atol, rtol=rtol))
    r = ref.detach().reshape(-1)
    c = cand.detach().reshape(-1)
    exact = not (ref.is_floating_point() or ref.is_complex()) and not (c.is_floating_point() or c.is_complex())
    step = CHUNK_CUDA if r.is_cuda else CHUNK
    parts = torch.stack([_partials(r[i:i + step], c[i:i + step], atol, rtol, exact, i) for i in range(0, n, step)])
    # combine the chunks (argmax takes the first of equal maxima, as one pass over the whole would)
    mism = parts[:, _Part.MISMATCHES].sum()
    dot, nr, nc = parts[:, _Part.DOT].sum(), parts[:, _Part.REF_SQ].sum().sqrt(), parts[:, _Part.CAND_SQ].sum().sqrt()
    denom = nr * nc
    cosine = torch.where(denom > 0, dot / torch.where(denom > 0, denom, 1.0), (nr == nc).to(torch.float64))
    by_excess = parts[:, _Part.MAX_EXCESS_AT].take(torch.argmax(parts[:, _Part.MAX_EXCESS]))
    by_diff = parts[:, _Part.MAX_ABS_AT].take(torch.argmax(parts[:, _Part.MAX_ABS]))
    first_nb = parts[:, _Part.FIRST_DISAGREE_AT].min()
    # the worst element: the first NaN/Inf disagreement, else the element exceeding its tolerance by
    # the most (all passing: the largest error)
    flat = torch.where(first_nb < n, first_nb, torch.where(mism > 0, by_excess, by_diff)).to(torch.int64)
    counts = parts[:, _COUNTS[0]:_COUNTS[-1] + 1].sum(0)
    packed = _pack(_Packed, mismatches=mism, max_abs=parts[:, _Part.MAX_ABS].max(),
                   mean_abs=parts[:, _Part.SUM_ABS].sum() / n, max_rel=parts[:, _Part.MAX_REL].max(), cosine=cosine,
                   **{slot.name.lower(): counts[k] for k, slot in enumerate(_COUNTS)},
                   worst_at=flat.to(torch.float64), worst_ref=_real(r.take(flat)),
                   worst_cand=_real(c.take(flat)),
                   rel_l2=parts[:, _Part.DIFF_SQ].sum().sqrt() / torch.where(nr > 0, nr, 1.0))
    return PendingStats(packed, shape, atol, rtol)


def _ranked(key: torch.Tensor, flat: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest keys with their flat indices, largest first; equal keys by smaller index (as
    argmax takes the first of equal maxima, so the top row is the element `Stats.worst` names)."""
    kk = min(k, key.numel())
    threshold = torch.topk(key, kk).values[-1]
    above = torch.nonzero(key > threshold).flatten()
    tied = torch.nonzero(key == threshold).flatten()
    pick = torch.cat([above, tied[torch.argsort(flat[tied])][: kk - above.numel()]])
    pick = pick[torch.argsort(flat[pick])]  # index order first, so the stable sort below breaks ties by it
    pick = pick[torch.sort(-key[pick], stable=True).indices]
    return key[pick], flat[pick]


def worst_elements(ref: torch.Tensor, cand: torch.Tensor, atol: float, rtol: float, k: int = 10) -> list[dict]:
    """The `k` worst elements of a pair (equal shapes: bring the candidate into the reference's layout
    first), worst first, ranked as `Stats.worst` chooses its one: elements where the candidate has a
    NaN/Inf the reference does not share come first (in index order), then the rest by how far they
    exceed their tolerance, ``|c - r| - (atol + rtol * |r|)``; when nothing is out of tolerance, by
    ``|c - r|``.  Float64 throughout, chunk by chunk.  Each row is ``{"index": [...], "ref", "cand",
    "abs_err", "excess"}`` as floats: ``abs_err`` is inf where only one side is finite (or the two
    are different non-finite values) and 0 where both hold the same infinity."""
    if tuple(ref.shape) != tuple(cand.shape):
        raise ValueError(f"worst_elements needs equal shapes, got {tuple(ref.shape)} and {tuple(cand.shape)}")
    n = ref.numel()
    if n == 0 or k <= 0:
        return []
    r = ref.detach().reshape(-1)
    c = cand.detach().reshape(-1).to(r.device)
    exact = not (ref.is_floating_point() or ref.is_complex()) and not (c.is_floating_point() or c.is_complex())
    inf = float("inf")
    any_bad = False
    by_excess, by_diff = [], []
    step = CHUNK_CUDA if r.is_cuda else CHUNK
    for start in range(0, n, step):
        cplx = r.is_complex() or c.is_complex()
        rd, cd = _numbers(r[start:start + step], cplx), _numbers(c[start:start + step], cplx)
        if exact:
            diff = (cd - rd).abs()
            disagree = torch.zeros_like(diff, dtype=torch.bool)
            bad = r[start:start + step] != c[start:start + step]
        else:
            diff, _, _, disagree, bad, _ = compare_elements(rd, cd, atol, rtol)
        excess = torch.nan_to_num(diff - (atol + rtol * rd.abs()), nan=-inf)
        excess = torch.where(disagree, torch.full_like(excess, inf), excess)
        any_bad = any_bad or bool(bad.any())
        flat = torch.arange(start, start + rd.numel(), device=rd.device)
        by_excess.append(_ranked(excess, flat, k))
        by_diff.append(_ranked(diff, flat, k))
    pool = by_excess if any_bad else by_diff
    _, top = _ranked(torch.cat([p[0] for p in pool]), torch.cat([p[1] for p in pool]), k)
    rows = []
    for flat_i, rv, cv in zip(top.tolist(), _real(r[top]).tolist(), _real(c[top]).tolist()):
        finite = rv - rv == 0 and cv - cv == 0  # neither NaN nor Inf
        if finite:
            abs_err = abs(cv - rv)
            excess = abs_err - (atol + rtol * abs(rv))
        elif rv == cv:  # the same infinity: agreement (a NaN never agrees, as in torch.allclose)
            abs_err, excess = 0.0, -inf
        else:
            abs_err, excess = inf, inf
        rows.append({"index": list(_unravel(flat_i, tuple(ref.shape))), "ref": rv, "cand": cv,
                     "abs_err": abs_err, "excess": excess})
    return rows
