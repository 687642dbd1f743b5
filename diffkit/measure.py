"""Measure one aligned pair: how far the candidate tensor is from the reference tensor.

Statistics are reduced in float64 (complex128 for complex values) on the tensors' device so the
metric adds no error of its own; integer and bool tensors compare exactly.  A pair passes as
``torch.allclose(c, r, atol, rtol, equal_nan=False)`` would pass it (KernelBench's rule): every
element satisfies ``|c - r| <= atol + rtol * |r|``, a NaN on either side is a mismatch, and
infinities agree only when equal.  On the CPU paths a float32 pair is judged by that rule in float32,
as torch.isclose computes it (so the count out of tolerance is KernelBench's to the element).
"""
from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import asdict, dataclass, field
from enum import IntEnum

import torch

from . import host_kernel, metrics_kernel  # (cheap: each builds or compiles its kernel on first use only)
from .metric_slots import COUNTS, Packed, Part

# KernelBench's tolerances, chosen by the reference tensor's dtype (field.md: 1e-4 float32, 1e-2 half);
# `options.Tolerance` takes them from here
HALF_TOLERANCE = 1e-2
FLOAT32_TOLERANCE = 1e-4
_HALF = (torch.float16, torch.bfloat16)


def default_tolerance(dtype: torch.dtype) -> float:
    """KernelBench's tolerance for a reference of this dtype."""
    return HALF_TOLERANCE if dtype in _HALF else FLOAT32_TOLERANCE


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


# which statistic of the error must stay within tolerance (`Stats.ok`): every element (torch.allclose's
# rule), or the largest / mean / median absolute error against atol + rtol * the same statistic of |r|
STATS = ("elementwise", "max", "mean", "median")


@dataclass
class Stats:
    """Per-pair error metrics (float64).  `mismatches` counts elements out of tolerance.

    `stat` is the statistic judged (`STATS`); for "max"/"mean"/"median" `stat_error` holds that
    statistic of |c - r| and `stat_bound` the tolerance it is held to, atol + rtol * the same
    statistic of |r| (see `apply_stat`)."""

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
    stat: str = "elementwise"
    stat_error: float | None = None
    stat_bound: float | None = None
    # a model output's pair: ``torch.allclose(reference, candidate, atol, rtol)`` as KernelBench's evaluator
    # calls it (`kernelbench_allclose`); it decides `ok` under the elementwise rule (None: not asked)
    kernelbench: bool | None = None

    @property
    def mismatch_fraction(self) -> float:
        return self.mismatches / self.numel if self.numel else 0.0

    @property
    def allclose(self) -> bool:
        """KernelBench's rule whatever `stat` says: torch.allclose's own answer where it was asked, else the
        elementwise count."""
        return self.kernelbench if self.kernelbench is not None else self.mismatches == 0

    @property
    def ok(self) -> bool:
        if self.stat == "elementwise" and self.kernelbench is not None:
            return self.kernelbench
        if self.stat == "elementwise" or self.stat_error is None or self.stat_bound is None:
            return self.mismatches == 0
        if self.ref_nan or self.cand_nan or self.ref_inf != self.cand_inf:
            return False  # a NaN never agrees, whatever the statistic (torch.allclose's equal_nan=False)
        return self.stat_error <= self.stat_bound

    def to_dict(self) -> dict:
        d = asdict(self)
        d["worst"] = self.worst.to_dict() if self.worst else None
        d["mismatch_fraction"] = self.mismatch_fraction
        return d


def kernelbench_allclose(ref: torch.Tensor, cand: torch.Tensor, atol: float, rtol: float) -> bool | None:
    """KernelBench's verdict on one output tensor: ``torch.allclose(reference, candidate, atol, rtol)``, the
    reference first as its evaluator passes them, so the bound is ``atol + rtol * |candidate|``, computed
    in the tensors' own dtype (float16 in float16), integers held to the tolerance too, NaN never equal.
    The elementwise count (`Stats.mismatches`) bounds by |reference| in float32 or wider: the two differ
    only for elements at the edge of the tolerance.  None where torch.allclose would not compare them
    (shapes or dtypes differ: judged apart)."""
    if tuple(ref.shape) != tuple(cand.shape) or ref.dtype != cand.dtype:
        return None
    try:
        cand = cand.to(ref.device)
        if ref.numel() <= ALLCLOSE_CHUNK or not (ref.is_contiguous() and cand.is_contiguous()):
            return bool(torch.allclose(ref, cand, atol=atol, rtol=rtol, equal_nan=False))
        # the same call on equal slices of both (it is elementwise): its temporaries (five of the output's size
        # at once, 11 GB for a 2 GB output) bounded by the slice
        r, c = ref.reshape(-1), cand.reshape(-1)
        return all(torch.allclose(r[i:i + ALLCLOSE_CHUNK], c[i:i + ALLCLOSE_CHUNK], atol=atol, rtol=rtol,
                                  equal_nan=False) for i in range(0, r.numel(), ALLCLOSE_CHUNK))
    except (RuntimeError, TypeError):
        return None


ALLCLOSE_CHUNK = 1 << 26  # elements KernelBench's torch.allclose is asked about at once (see kernelbench_allclose)


def ask_kernelbench(st: Stats, ref: torch.Tensor, cand: torch.Tensor) -> None:
    """Under the elementwise rule, let KernelBench's own call decide the pair `st` measured (a model output:
    `Stats.kernelbench`); other statistics are judged as they are."""
    if st.stat == "elementwise":
        st.kernelbench = kernelbench_allclose(ref, cand, st.atol, st.rtol)


def kernelbench_note(st: Stats, dtype: torch.dtype) -> str:
    """Why an output's verdict (KernelBench's `torch.allclose`) differs from its elementwise count, or ''."""
    if st.kernelbench is None or st.kernelbench == (st.mismatches == 0):
        return ""
    how = (f"in {str(dtype).replace('torch.', '')} arithmetic" if dtype in (torch.float16, torch.bfloat16)
           else "integers held to the tolerance" if not (dtype.is_floating_point or dtype.is_complex) else "")
    rule = "its bound is atol + rtol·|candidate|" + (f", {how}" if how else "")
    if st.kernelbench:
        return (f"passes KernelBench's torch.allclose(reference, candidate) although {st.mismatches} element(s) are "
                f"out of atol + rtol·|reference| ({rule}): the verdict follows KernelBench")
    return (f"fails KernelBench's torch.allclose(reference, candidate) although every element is within atol + "
            f"rtol·|reference| ({rule}): the verdict follows KernelBench")


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    idx = []
    for size in reversed(shape):
        idx.append(flat % size if size else 0)
        flat = flat // size if size else 0
    return tuple(reversed(idx))


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

    The scalars travel as one small float64 vector (slots: `Packed`) through pinned memory behind
    a CUDA event, so measuring many pairs costs no synchronisation until `result()` is asked for."""

    def __init__(self, packed: torch.Tensor | None, shape: tuple[int, ...], atol: float, rtol: float,
                 ready: Stats | None = None, batch: tuple["_HostBatch", int] | None = None):
        self.shape, self.atol, self.rtol = shape, atol, rtol
        self._stats = ready
        self.rel_l2 = 0.0  # ||c - r|| / ||r|| over finite elements, once `result()` has been read
        self._host = None  # a CPU vector, read at once
        self._batch = batch
        if packed is not None:
            if packed.is_cuda:
                self._batch = (_HostBatch(packed.reshape(1, -1)), 0)
            else:
                self._host = packed

    def done(self) -> bool:
        if self._batch is not None and self._stats is None:
            return self._batch[0].done()
        return True

    def result(self) -> Stats:
        if self._stats is None:
            host = self._batch[0].row(self._batch[1]) if self._batch is not None else self._host.tolist()
            self.rel_l2 = host[Packed.REL_L2]
            worst_ref, worst_cand = host[Packed.WORST_REF], host[Packed.WORST_CAND]
            abs_err = abs(worst_cand - worst_ref)
            if abs_err != abs_err:  # NaN against a number (or a NaN and an infinity): as far apart as can be
                abs_err = float("inf")
            self._stats = Stats(
                numel=math.prod(self.shape), max_abs=host[Packed.MAX_ABS], mean_abs=host[Packed.MEAN_ABS],
                max_rel=host[Packed.MAX_REL], mismatches=int(host[Packed.MISMATCHES]), cosine=host[Packed.COSINE],
                ref_nan=int(host[Packed.REF_NAN]), ref_inf=int(host[Packed.REF_INF]),
                cand_nan=int(host[Packed.CAND_NAN]), cand_inf=int(host[Packed.CAND_INF]),
                worst=Worst(index=_unravel(int(host[Packed.WORST_AT]), self.shape), ref=worst_ref, cand=worst_cand,
                            abs_err=abs_err),
                atol=self.atol, rtol=self.rtol)
            self._host = self._batch = None
        return self._stats


class _HostBatch:
    """The packed vectors of a batch of pairs ([pairs, len(Packed)] on a CUDA device), copied to
    pinned host memory in one transfer behind one event; read row by row."""

    def __init__(self, packed: torch.Tensor):
        with torch.cuda.device(packed.device):  # the event on the stream of the tensor's own device
            self._host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            self._host.copy_(packed, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        self._rows: list | None = None

    def done(self) -> bool:
        return self._rows is not None or self._event.query()

    def row(self, i: int) -> list[float]:
        if self._rows is None:
            self._event.synchronize()
            self._rows = self._host.tolist()
        return self._rows[i]


# pairs per launch of the batched CUDA kernel: the device measures a batch while the host builds the next one's
# address table (one batch of a full capture's 205 pairs left the device idle until the host had built all of it)
BATCH_PAIRS = 32
# the first batch of a call may be smaller: the device waits for it, idle, while the host builds it.  Measured
# (session 33, H100, the mid transformer, session 32's kernel): a first batch of 8 pairs read 11.7 GB at 65 % of
# copy bandwidth, one of 32 at 70 % (the more batches, the more launches): kept at BATCH_PAIRS
FIRST_BATCH_PAIRS = 32


# bytes of contiguous copies (of non-contiguous pairs) one launch may make
BATCH_COPY_BYTES = 1 << 30


def _contiguous_first(items: list, idx: list[int]) -> list[int]:
    """`idx` with the pairs contiguous on both sides first, the others after, each in their order: a batch whose
    pairs are all read one way takes one `partials` launch, not one a way (a launch costs the host tens of
    microseconds, and a diff's batches are bound by the host)."""
    return sorted(idx, key=lambda i: not (items[i][0].is_contiguous() and items[i][1].is_contiguous()))


def _batches(items: list, idx: list[int]):
    """`idx` in launches of at most BATCH_PAIRS pairs (the first of at most FIRST_BATCH_PAIRS) and BATCH_COPY_BYTES
    of contiguous copies: each launch's pairs with their rows of the layout table (`metrics_kernel.planned`)."""
    part: list[int] = []
    rows: list = []
    copies = 0
    most = min(FIRST_BATCH_PAIRS, BATCH_PAIRS)
    for i in idx:
        row, size = metrics_kernel.planned(items[i][0], items[i][1])
        if part and (len(part) >= most or copies + size > BATCH_COPY_BYTES):
            yield part, rows
            part, rows, copies, most = [], [], 0, BATCH_PAIRS
        part.append(i)
        rows.append(row)
        copies += size
    if part:
        yield part, rows


def measure_many(items: list[tuple[torch.Tensor, torch.Tensor, float, float]]) -> list[PendingStats]:
    """`measure_async` for many pairs ``(ref, cand, atol, rtol)`` at once: on CUDA, the pairs that
    share a device, dtypes and tolerance are measured by one launch of the metric kernel per batch
    (and come back in one copy); the rest one by one."""
    out: list[PendingStats | None] = [None] * len(items)
    groups: dict[tuple, list[int]] = {}
    host: list[int] = []
    for i, (r, c, atol, rtol) in enumerate(items):
        fast = tuple(r.shape) == tuple(c.shape) and r.numel() > 0 and r.dtype in _FAST_DTYPES \
            and c.dtype in _FAST_DTYPES
        if fast and r.is_cuda and c.device == r.device:
            groups.setdefault((r.device, r.dtype, c.dtype, atol, rtol), []).append(i)
        elif fast and r.device.type == "cpu" and c.device.type == "cpu":
            host.append(i)
        else:
            out[i] = measure_async(r, c, atol, rtol)
    if host:
        for i, pending in zip(host, _measure_host_many([items[i] for i in host])):
            out[i] = pending
    if groups:
        for (_, _, _, atol, rtol), idx in groups.items():
            if not metrics_kernel.available():
                for i in idx:
                    out[i] = measure_async(*items[i])
                continue
            for part, rows in _batches(items, _contiguous_first(items, idx)):
                with torch.cuda.device(items[part[0]][0].device):  # the launch on the pairs' own device
                    batch = _HostBatch(metrics_kernel.packed_batch([items[i][:2] for i in part], atol, rtol, rows))
                for k, i in enumerate(part):
                    out[i] = PendingStats(None, tuple(items[i][0].shape), atol, rtol, batch=(batch, k))
    return out  # type: ignore[return-value]


def measure(ref: torch.Tensor, cand: torch.Tensor, atol: float, rtol: float, stat: str = "elementwise") -> Stats:
    """Compare `cand` against `ref` (same shape; bring the layout in line before calling), judged
    by statistic `stat` (see `STATS`)."""
    return apply_stat(measure_async(ref, cand, atol, rtol).result(), ref, cand, stat)


def apply_stat(stats: Stats, ref: torch.Tensor, cand: torch.Tensor, stat: str) -> Stats:
    """Judge `stats` (of `cand` against `ref`) by statistic `stat`: for "max", "mean" and "median",
    stat(|c - r|) over the elements finite on both sides against atol + rtol * stat(|r|) there
    (`Stats.stat_error`, `Stats.stat_bound`).  "elementwise" (the default) leaves the rule
    torch.allclose's.  Returns `stats`, changed in place."""
    if stat not in STATS:
        raise ValueError(f"stat must be one of {', '.join(STATS)}, not {stat!r}")
    stats.stat = stat
    if stat == "elementwise" or stats.numel == 0:
        stats.stat_error = stats.stat_bound = None
        return stats
    if stat == "max":
        err, scale = stats.max_abs, _ref_stat(ref, cand, "max")
    elif stat == "mean":
        finite = stats.numel - max(stats.ref_nan + stats.ref_inf, stats.cand_nan + stats.cand_inf)
        err, scale = stats.mean_abs * stats.numel / max(1, finite), _ref_stat(ref, cand, "mean")
    else:
        err, scale = _ref_stat(ref, cand, "median_err"), _ref_stat(ref, cand, "median")
    stats.stat_error = float(err)
    stats.stat_bound = float(stats.atol + stats.rtol * scale)
    if stats.ref_inf or stats.cand_inf:
        # infinities agree only where both sides hold the same one (a NaN never agrees: `Stats.ok`)
        r, c = ref.detach().reshape(-1), cand.detach().reshape(-1).to(ref.device)
        ri, ci = torch.isinf(r), torch.isinf(c)
        if bool((ri != ci).any()) or bool((ri & (r != c)).any()):
            stats.stat_error = math.inf
    return stats


def _ref_stat(ref: torch.Tensor, cand: torch.Tensor, which: str) -> float:
    """max / mean / median of |r| (or, "median_err", of |c - r|) over elements finite on both sides."""
    r = ref.detach().reshape(-1)
    c = cand.detach().reshape(-1).to(r.device)
    if r.is_complex() or c.is_complex():
        r, c = r.abs(), c.abs()
    work = torch.float64 if torch.float64 in (r.dtype, c.dtype) else torch.float32
    r, c = r.to(work), c.to(work)
    keep = torch.isfinite(r) & torch.isfinite(c)
    if not bool(keep.all()):
        r, c = r[keep], c[keep]
    if r.numel() == 0:
        return 0.0
    if which == "max":
        return float(r.abs().amax())
    if which == "mean":
        return float(r.abs().sum(dtype=torch.float64)) / r.numel()
    x = (c - r).abs() if which == "median_err" else r.abs()
    return float(torch.quantile(x.double(), 0.5)) if x.numel() <= (1 << 24) else float(x.median())


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
    """One chunk's sufficient statistics, as a float64 vector (slots: `Part`); `offset` is the
    chunk's first flat index."""
    cplx = r.is_complex() or c.is_complex()
    rd = _numbers(r, cplx)
    cd = _numbers(c, cplx)
    zero = torch.zeros((), dtype=torch.float64, device=rd.device)
    if exact:
        diff = (cd - rd).abs()
        bad = c != r
        nan_bad = torch.zeros_like(bad)
        counts = {slot.name.lower(): zero for slot in COUNTS}
        fr, fc = rd, cd
        bound = atol + rtol * rd.abs()
    else:
        diff, bound, special, nan_bad, bad, (r_nan_m, r_inf_m, c_nan_m, c_inf_m) = compare_elements(rd, cd, atol, rtol)
        counts = {"ref_nan": r_nan_m.sum(dtype=torch.float64), "ref_inf": r_inf_m.sum(dtype=torch.float64),
                  "cand_nan": c_nan_m.sum(dtype=torch.float64), "cand_inf": c_inf_m.sum(dtype=torch.float64)}
        fr = torch.where(torch.isfinite(rd), rd, torch.zeros((), dtype=rd.dtype, device=rd.device))
        fc = torch.where(torch.isfinite(cd), cd, torch.zeros((), dtype=cd.dtype, device=cd.device))
    rabs = rd.abs()
    rel = torch.where((rabs > 0) & torch.isfinite(rd) & torch.isfinite(cd),
                      diff / torch.where(rabs > 0, rabs, torch.ones((), dtype=rabs.dtype, device=rabs.device)), zero)
    # an agreeing value can never be the worst: NaN excess (inf - inf) counts as none at all
    excess = torch.nan_to_num(diff - bound, nan=float("-inf"))
    i_ex, i_d = torch.argmax(excess), torch.argmax(diff)
    any_nb = nan_bad.any()
    first_nb = torch.where(any_nb, torch.argmax(nan_bad.to(torch.uint8)).to(torch.float64) + offset, float("inf"))
    dot = (fr.conj() * fc).real.sum() if cplx else (fr * fc).sum()
    # `take`, not indexing: indexing with a device scalar waits for the device
    return _pack(Part, mismatches=bad.sum(dtype=torch.float64), max_abs=diff.take(i_d),
                 max_abs_at=i_d.to(torch.float64) + offset, sum_abs=diff.sum(), max_rel=rel.max(),
                 dot=dot, ref_sq=(fr.abs() ** 2).sum(), cand_sq=(fc.abs() ** 2).sum(), **counts,
                 max_excess=excess.take(i_ex), max_excess_at=i_ex.to(torch.float64) + offset,
                 first_disagree_at=first_nb, diff_sq=(diff * diff).sum())


def _real(t: torch.Tensor) -> torch.Tensor:
    """A value as a float64 number for a report (a complex value by its real part)."""
    return (t.real if t.is_complex() else t).to(torch.float64)


def measure_async(ref: torch.Tensor, cand: torch.Tensor, atol: float, rtol: float) -> PendingStats:
    """`measure` without waiting for the device: every scalar is reduced on the device into one
    vector, chunk by chunk, so the temporary memory does not grow with the tensor.

    Three ways, one answer: on CUDA, the fused single-pass kernel of `diffkit.metrics_kernel` when
    Triton is there; on the CPU, the one-pass native kernel (`diffkit.host_kernel`) for float32 and
    float64, else `_measure_host_1` (a handful of torch passes over cache-sized chunks in the tensors'
    own precision); otherwise, and for integer, complex and non-finite values, the exact float64
    reductions of `_partials`."""
    if tuple(ref.shape) != tuple(cand.shape):
        raise ValueError(f"measure needs equal shapes, got {tuple(ref.shape)} and {tuple(cand.shape)}")
    if cand.device != ref.device:
        cand = cand.to(ref.device, non_blocking=ref.device.type != "cpu")  # (a copy to the host is read at once)
    n = ref.numel()
    shape = tuple(ref.shape)
    if n == 0:
        return PendingStats(None, shape, atol, rtol, ready=Stats(
            numel=0, max_abs=0.0, mean_abs=0.0, max_rel=0.0, mismatches=0, cosine=1.0, ref_nan=0, ref_inf=0,
            cand_nan=0, cand_inf=0, worst=None, atol=atol, rtol=rtol))
    floating = _FAST_DTYPES.get(ref.dtype) is not None and _FAST_DTYPES.get(cand.dtype) is not None
    if floating and ref.device.type == "cpu":  # read a chunk at a time in logical order: no flattened copy
        return _measure_host(ref.detach(), cand.detach(), atol, rtol, shape)
    if floating and ref.is_cuda and metrics_kernel.available():  # (read where they lie: no flattened copy)
        with torch.cuda.device(ref.device):
            return PendingStats(metrics_kernel.packed(ref.detach(), cand.detach(), atol, rtol), shape, atol, rtol)
    r = ref.detach().reshape(-1)
    c = cand.detach().reshape(-1)
    return PendingStats(_packed_exact(r, c, atol, rtol), shape, atol, rtol)


def _packed_exact(r: torch.Tensor, c: torch.Tensor, atol: float, rtol: float) -> torch.Tensor:
    """The float64 way (any dtype, any device): `_partials` per chunk, combined on the device."""
    n = r.numel()
    exact = not (r.is_floating_point() or r.is_complex()) and not (c.is_floating_point() or c.is_complex())
    step = CHUNK_CUDA if r.is_cuda else CHUNK
    parts = torch.stack([_partials(r[i:i + step], c[i:i + step], atol, rtol, exact, i) for i in range(0, n, step)])
    # combine the chunks (argmax takes the first of equal maxima, as one pass over the whole would)
    mism = parts[:, Part.MISMATCHES].sum()
    dot, nr, nc = parts[:, Part.DOT].sum(), parts[:, Part.REF_SQ].sum().sqrt(), parts[:, Part.CAND_SQ].sum().sqrt()
    denom = nr * nc
    cosine = torch.where(denom > 0, dot / torch.where(denom > 0, denom, 1.0), (nr == nc).to(torch.float64))
    by_excess = parts[:, Part.MAX_EXCESS_AT].take(torch.argmax(parts[:, Part.MAX_EXCESS]))
    by_diff = parts[:, Part.MAX_ABS_AT].take(torch.argmax(parts[:, Part.MAX_ABS]))
    first_nb = parts[:, Part.FIRST_DISAGREE_AT].min()
    # the worst element: the first NaN/Inf disagreement, else the element exceeding its tolerance by
    # the most (all passing: the largest error)
    flat = torch.where(first_nb < n, first_nb, torch.where(mism > 0, by_excess, by_diff)).to(torch.int64)
    counts = parts[:, COUNTS[0]:COUNTS[-1] + 1].sum(0)
    return _pack(Packed, mismatches=mism, max_abs=parts[:, Part.MAX_ABS].max(),
                 mean_abs=parts[:, Part.SUM_ABS].sum() / n, max_rel=parts[:, Part.MAX_REL].max(), cosine=cosine,
                 **{slot.name.lower(): counts[k] for k, slot in enumerate(COUNTS)},
                 worst_at=flat.to(torch.float64), worst_ref=_real(r.take(flat)),
                 worst_cand=_real(c.take(flat)),
                 rel_l2=parts[:, Part.DIFF_SQ].sum().sqrt() / torch.where(nr > 0, nr, 1.0))


# the working precision of the fast paths: half types are widened to float32 chunk by chunk (their
# difference is not exact in their own precision), float32 and float64 are used as they are
_FAST_DTYPES = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.float32: torch.float32,
                torch.float64: torch.float64}
# elements per chunk of the host path (sums in float32 within a chunk, float64 across), and chunks per
# torch call: about a million elements, long enough that threads measuring other pairs run meanwhile
CHUNK_HOST = 1 << 16
GROUP_ROWS = 16


# below this many elements in all, pairs are measured one after the other (threads cost more than they save)
HOST_PARALLEL_MIN = 1 << 18


# elements of one pair measured by one task of the native kernel: larger pairs are split, so the worker
# threads share a single large pair too; a side not in row-major order is gathered GATHER at a time
NATIVE_SPAN = 1 << 22
GATHER = 1 << 18
# the largest pair not in row-major order whose relative error (`native_rel_l2`) is gathered for the native kernel
# on one thread (2 vCPUs: 1 Mi elements 7.6 against 9.7 ms by the torch passes; 4 Mi 31 against 26; 16 Mi 164 against 100)
REL_GATHER_MAX = 1 << 21


def _native(r: torch.Tensor, c: torch.Tensor) -> bool:
    """Whether the pair goes to the native CPU kernel (`host_kernel`): float32/float64 CPU tensors with memory
    of their own (read in place when laid out in row-major order, else gathered a piece at a time)."""
    return host_kernel.supports(r) and host_kernel.supports(c) and host_kernel.available()


def _measure_host_many(items: list[tuple[torch.Tensor, torch.Tensor, float, float]]) -> list[PendingStats]:
    """`_measure_host` for many CPU pairs, spread over as many worker threads as torch has intra-op
    threads.  Pairs the native kernel reads are cut into spans of NATIVE_SPAN elements, one kernel call
    each (ctypes lets go of the GIL), and each pair's spans combined (`_from_parts`); the rest run the
    torch passes one pair per worker, each on one thread (torch releases the GIL inside an op)."""
    items = [(r.detach(), c.detach(), atol, rtol) for r, c, atol, rtol in items]
    native = [i for i, (r, c, _, _) in enumerate(items) if _native(r, c)]
    spans = [(i, lo, min(lo + NATIVE_SPAN, items[i][0].numel())) for i in native
             for lo in range(0, items[i][0].numel(), NATIVE_SPAN)]
    others = sorted(set(range(len(items))) - set(native))

    def span(job) -> list[list[float]]:
        i, lo, hi = job
        r, c, atol, rtol = items[i]
        if r.is_contiguous() and c.is_contiguous():
            return [host_kernel.partials(r, c, lo, hi, atol, rtol)]
        return _gathered_partials(r, c, lo, hi, atol, rtol)

    def one(i):
        r, c, atol, rtol = items[i]
        return _measure_host_1(r, c, atol, rtol, tuple(r.shape))

    out: list[PendingStats | None] = [None] * len(items)
    workers = min(torch.get_num_threads(), len(spans) + len(others))
    with _one_thread():
        if workers < 2 or sum(r.numel() for r, _, _, _ in items) < HOST_PARALLEL_MIN:
            parts = [span(job) for job in spans]
            done = [one(i) for i in others]
        else:
            from concurrent.futures import ThreadPoolExecutor

            # small spans travel in batches: a task per span would cost more than measuring it
            batches, cur, size = [], [], 0
            for job in spans:
                cur.append(job)
                size += job[2] - job[1]
                if size >= NATIVE_SPAN // 4 or len(cur) >= 256:
                    batches.append(cur)
                    cur, size = [], 0
            if cur:
                batches.append(cur)
            with ThreadPoolExecutor(workers, thread_name_prefix="diffkit-measure",
                                    initializer=torch.set_num_threads, initargs=(1,)) as pool:
                later = pool.map(one, others)
                parts = [p for got in pool.map(lambda b: [span(job) for job in b], batches) for p in got]
                done = list(later)
    for i, pending in zip(others, done):
        out[i] = pending
    by_pair: dict[int, list[list[float]]] = {}
    for (i, _, _), ps in zip(spans, parts):
        by_pair.setdefault(i, []).extend(ps)
    for i, ps in by_pair.items():
        r, c, atol, rtol = items[i]
        out[i] = _from_parts(ps, r, c, atol, rtol)
    return out  # type: ignore[return-value]


def _gathered_partials(r: torch.Tensor, c: torch.Tensor, lo: int, hi: int, atol: float, rtol: float) -> list[list[float]]:
    """The native kernel's `Part` vectors of elements lo..hi-1 (row-major order) of a pair with a side not laid out
    in that order: gathered GATHER elements at a time into buffers (the kernel's flat indices, into the buffer, are
    shifted back).  Called with torch's threads at one (`_one_thread`)."""
    fr, fc = _Flat(r), _Flat(c)
    rb = None if fr.flat is not None else torch.empty(min(GATHER, hi - lo), dtype=r.dtype)
    cb = None if fc.flat is not None else torch.empty(min(GATHER, hi - lo), dtype=c.dtype)
    out = []
    for g in range(lo, hi, GATHER):
        g2 = min(g + GATHER, hi)
        a, b = fr.part(g, g2, rb).contiguous(), fc.part(g, g2, cb).contiguous()
        p = host_kernel.partials(a, b, 0, g2 - g, atol, rtol)
        for slot in (Part.MAX_ABS_AT, Part.MAX_EXCESS_AT, Part.FIRST_DISAGREE_AT):
            p[slot] += g
        out.append(p)
    return out


def native_rel_l2(c: torch.Tensor, r: torch.Tensor) -> float | None:
    """||c - r|| / ||r|| (float64 sums) by the native kernel, for equal element counts; None where it does not
    apply (another dtype or device, or a NaN or an infinity on either side, whose rule `align._rel_err` owns).
    Both in row-major order: one call.  Both laid out alike over dense memory (each a permuted view of a whole
    buffer, the same permutation): their memory read in place, in memory order (the sums need no order).
    Otherwise read in row-major order, a side laid out otherwise gathered a piece at a time (`_Flat`), up to
    REL_GATHER_MAX elements (beyond, None: the torch passes)."""
    if c.numel() != r.numel() or c.numel() == 0 or not _native(r, c):
        return None
    r, c = r.detach(), c.detach()
    if not (r.is_contiguous() and c.is_contiguous()):
        same = _in_memory_order(r, c)
        if same is not None:
            r, c = same
    if r.is_contiguous() and c.is_contiguous():
        parts = [host_kernel.partials(r, c, 0, r.numel(), 0.0, 0.0)]
    elif r.numel() > REL_GATHER_MAX:
        return None  # (the torch passes, on all of torch's threads, are faster than one thread gathering)
    else:
        with _one_thread():
            parts = _gathered_partials(r, c, 0, r.numel(), 0.0, 0.0)
    if any(p[slot] for p in parts for slot in COUNTS):
        return None
    d, s = math.sqrt(sum(p[Part.DIFF_SQ] for p in parts)), math.sqrt(sum(p[Part.REF_SQ] for p in parts))
    if not (math.isfinite(d) and math.isfinite(s)):  # squares past float64's range: the torch way
        return None
    return d / s if s > 0 else (0.0 if d == 0 else math.inf)


def _in_memory_order(r: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`r` and `c` (one shape) permuted alike into their memory order, when that makes both contiguous (the same
    strides over dense memory: a transposed or permuted view of a whole buffer on both sides); else None.
    Element i of one is then element i of the other, as in row-major order, in another order.  (Gathering
    a slice in memory order instead of row-major order measured no faster.)"""
    if r.shape != c.shape:
        return None
    keep = [d for d in range(r.dim()) if r.shape[d] != 1]
    if [r.stride(d) for d in keep] != [c.stride(d) for d in keep]:
        return None
    order = sorted(range(r.dim()), key=lambda d: (-r.stride(d), d))
    pr, pc = r.permute(order), c.permute(order)
    return (pr, pc) if pr.is_contiguous() and pc.is_contiguous() else None


def _cosine(dot: float, nr: float, nc: float) -> float:
    """dot / (nr nc), kept within [-1, 1] against rounding; NaN where the sums overflowed (as the exact path
    gives), and 1 or 0 where a norm is zero (both zero: the same vector)."""
    if not nr * nc > 0:
        return float(nr == nc)
    cos = dot / (nr * nc)
    return max(-1.0, min(1.0, cos)) if cos == cos else cos


# the slots of `Part` that add up over chunks
_SUMMED = (Part.MISMATCHES, Part.SUM_ABS, Part.DOT, Part.REF_SQ, Part.CAND_SQ, Part.DIFF_SQ, *COUNTS)


def _combined(parts: list[list[float]]) -> tuple[dict, float, float]:
    """Chunks' `Part` vectors (host lists) combined: the summed slots, the largest relative error and the
    first NaN/Inf disagreement (the maxima with their indices are the caller's: ties are broken its way)."""
    tot = {slot: 0.0 for slot in _SUMMED}
    max_rel, first_nb = 0.0, math.inf
    for p in parts:
        for slot in _SUMMED:
            tot[slot] += p[slot]
        max_rel = max(max_rel, p[Part.MAX_REL])
        first_nb = min(first_nb, p[Part.FIRST_DISAGREE_AT])
    return tot, max_rel, first_nb


def _from_parts(parts: list[list[float]], r: torch.Tensor, c: torch.Tensor, atol: float, rtol: float) -> PendingStats:
    """One pair's Stats from the `Part` vectors of its consecutive spans (in index order, as host lists):
    sums added, maxima kept with the first index holding them, the worst element chosen as
    `_packed_exact` chooses it, and its values read from the tensors."""
    n, shape = r.numel(), tuple(r.shape)
    tot, max_rel, first_nb = _combined(parts)
    mism, sum_abs, dot, diff_sq = tot[Part.MISMATCHES], tot[Part.SUM_ABS], tot[Part.DOT], tot[Part.DIFF_SQ]
    ref_sq, cand_sq = tot[Part.REF_SQ], tot[Part.CAND_SQ]
    counts = [tot[s] for s in COUNTS]
    max_abs, at_abs = -math.inf, 0
    max_exc, at_exc = -math.inf, int(parts[0][Part.MAX_EXCESS_AT])  # (all -inf: the first element, as argmax)
    for p in parts:
        if p[Part.MAX_ABS] > max_abs:  # (strictly: an earlier span keeps an equal maximum)
            max_abs, at_abs = p[Part.MAX_ABS], int(p[Part.MAX_ABS_AT])
        if p[Part.MAX_EXCESS] > max_exc:
            max_exc, at_exc = p[Part.MAX_EXCESS], int(p[Part.MAX_EXCESS_AT])
    flat = int(first_nb) if first_nb < n else (at_exc if mism > 0 else at_abs)
    return _host_stats(_Flat(r), _Flat(c), shape, flat, max_abs=max_abs, sum_abs=sum_abs, max_rel=max_rel,
                       mism=mism, counts=counts, dot=dot, ref_sq=ref_sq, cand_sq=cand_sq, diff_sq=diff_sq,
                       atol=atol, rtol=rtol)


def _host_stats(fr: "_Flat", fc: "_Flat", shape: tuple, flat: int, *, max_abs: float, sum_abs: float,
                max_rel: float, mism: float, counts: list, dot: float, ref_sq: float, cand_sq: float,
                diff_sq: float, atol: float, rtol: float) -> PendingStats:
    """A host-measured pair's result from its combined sums and maxima, the worst element (flat index
    `flat`) read from the tensors: Stats, with rel_l2 beside them."""
    n = math.prod(shape)
    nr, nc = math.sqrt(ref_sq), math.sqrt(cand_sq)
    wr, wc = float(_real(fr.item(flat))), float(_real(fc.item(flat)))
    abs_err = abs(wc - wr)
    if abs_err != abs_err:
        abs_err = math.inf
    stats = Stats(numel=n, max_abs=max_abs, mean_abs=sum_abs / n, max_rel=max_rel, mismatches=int(mism),
                  cosine=_cosine(dot, nr, nc), ref_nan=int(counts[0]), ref_inf=int(counts[1]),
                  cand_nan=int(counts[2]), cand_inf=int(counts[3]),
                  worst=Worst(index=_unravel(flat, shape), ref=wr, cand=wc, abs_err=abs_err), atol=atol, rtol=rtol)
    pending = PendingStats(None, shape, atol, rtol, ready=stats)
    pending.rel_l2 = math.sqrt(diff_sq) / (nr if nr > 0 else 1.0)
    return pending


@contextlib.contextmanager
def _one_thread():
    """torch's intra-op threads set to one for the block: the passes over a cache-sized chunk are
    short, and waking a thread pool for each costs more than the pass (and stalls badly when the
    cores are shared)."""
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _row_major(t: torch.Tensor) -> bool:
    """Whether `t.reshape(-1)` is a view of `t`'s memory in row-major order (a strided 1-D tensor is)."""
    return t.dim() <= 1 or t.is_contiguous()


class _Flat:
    """A tensor's elements in row-major (logical) order, read a range at a time: a view of its memory
    when it is laid out that way, else gathered into a buffer the caller reuses (a permuted or
    transposed record is not copied whole: that costs a full-size allocation and its page faults)."""

    def __init__(self, t: torch.Tensor):
        self.t = t
        self.flat = t.reshape(-1) if _row_major(t) else None  # (a view)

    def part(self, lo: int, hi: int, buf: torch.Tensor | None = None) -> torch.Tensor:
        """Elements lo..hi-1: a view, or copied into `buf` (a fresh tensor without one)."""
        if self.flat is not None:
            return self.flat[lo:hi]
        out = buf[:hi - lo] if buf is not None else torch.empty(hi - lo, dtype=self.t.dtype)
        _gather(self.t, lo, hi, out)
        return out

    def item(self, i: int) -> torch.Tensor:
        return self.flat[i] if self.flat is not None else self.t[_unravel(i, tuple(self.t.shape))]


def _gather(t: torch.Tensor, lo: int, hi: int, out: torch.Tensor) -> None:
    """Copy elements lo..hi-1 of `t`, in row-major order, into the 1-D `out`: whole rows of the first
    dimension in one copy, a partial row at either end by the same rule one dimension down."""
    if _row_major(t):
        out.copy_(t.reshape(-1)[lo:hi])
        return
    inner = t[0].numel()
    i0, r0 = divmod(lo, inner)
    i1, r1 = divmod(hi, inner)
    if i0 == i1:  # within one row
        _gather(t[i0], r0, r1, out)
        return
    pos = 0
    if r0:
        _gather(t[i0], r0, inner, out[:inner - r0])
        pos, i0 = inner - r0, i0 + 1
    if i1 > i0:
        k = (i1 - i0) * inner
        out[pos:pos + k].view(i1 - i0, *t.shape[1:]).copy_(t[i0:i1])
        pos += k
    if r1:
        _gather(t[i1], 0, r1, out[pos:pos + r1])


def _measure_host(r: torch.Tensor, c: torch.Tensor, atol: float, rtol: float, shape) -> PendingStats:
    if _native(r, c):
        return _measure_host_many([(r, c, atol, rtol)])[0]
    with _one_thread():
        return _measure_host_1(r, c, atol, rtol, shape)


def _measure_host_1(r: torch.Tensor, c: torch.Tensor, atol: float, rtol: float, shape) -> PendingStats:
    """The CPU path.  Per chunk of CHUNK_HOST elements (a row; up to GROUP_ROWS rows go through each
    torch call, so a call is long enough for worker threads to run side by side): d = |c - r| in the
    working precision, its maximum and sum, the extremes of d / r, and the norms of d, r and c
    (float32 within a chunk, float64 across chunks).  Where d exceeds atol the rows' excess
    e = d - rtol |r| is reduced as well (maximum, and the count out of tolerance).  A chunk holding a
    NaN or an infinity takes the exact float64 path (`_partials`, which owns the NaN/Inf rules).  The
    worst element's index is looked up once, in the chunk that holds it.  Same numbers as
    `_packed_exact` up to float32 rounding of single terms (cosine from ||r||², ||c||², ||c - r||²)."""
    n = r.numel()
    work = torch.float64 if torch.float64 in (r.dtype, c.dtype) else torch.float32
    fr, fc = _Flat(r), _Flat(c)
    acc = _HostSums()
    step = CHUNK_HOST
    # the groups of rows: whole chunks, GROUP_ROWS at a time, then the short last chunk as a row of its own
    full = n // step * step
    groups = [(g, min(GROUP_ROWS, (full - g) // step), step) for g in range(0, full, GROUP_ROWS * step)]
    if full < n:
        groups.append((full, 1, n - full))
    size = max(rows * length for _, rows, length in groups)
    d_buf, q_buf = torch.empty(size, dtype=work), torch.empty(size, dtype=work)  # allocated once
    # a tensor not laid out in row-major order is gathered a group at a time (in the working precision)
    r_buf = None if fr.flat is not None else torch.empty(size, dtype=work)
    c_buf = None if fc.flat is not None else torch.empty(size, dtype=work)
    # rows whose largest error is within atol (as the working precision rounds it: the bound is computed
    # there) hold no element out of tolerance
    gate = min(atol, float(torch.tensor(atol, dtype=work)))
    for g, rows, length in groups:
        a, b = fr.part(g, g + rows * length, r_buf), fc.part(g, g + rows * length, c_buf)
        if a.dtype != work:
            a = a.to(work)
        if b.dtype != work:
            b = b.to(work)
        a, b = a.view(rows, length), b.view(rows, length)
        d = torch.sub(b, a, out=d_buf[:rows * length].view(rows, length)).abs_()
        # max |c - r| / |r| as the larger magnitude of d / r's extremes (IEEE division is sign-symmetric,
        # so |d / r| is d / |r| exactly)
        q = torch.div(d, a, out=q_buf[:rows * length].view(rows, length))
        _host_group(acc, g, length, a, b, d, q, atol, rtol, gate)
    counts, by_abs, by_exc, first_nb = _host_add_exact(acc)
    exact_starts = {start for start, _ in acc.exact_parts}

    def locate(chunk: int, excess: bool) -> int:
        """The flat index of the first maximum of d (or e) in the chunk at `chunk`."""
        a, b = fr.part(chunk, min(chunk + step, n)).to(work), fc.part(chunk, min(chunk + step, n)).to(work)
        d = torch.sub(b, a).abs_()
        key = torch.add(d, a.abs(), alpha=-rtol) if excess else d
        return chunk + int(torch.argmax(key))

    if first_nb < n:
        flat = int(first_nb)
    elif acc.mism > 0:
        flat = by_exc if acc.max_exc_chunk in exact_starts else locate(acc.max_exc_chunk, True)
    else:
        flat = by_abs if acc.max_abs_chunk in exact_starts else locate(acc.max_abs_chunk, False)
    return _host_stats(fr, fc, shape, flat, max_abs=acc.max_abs, sum_abs=acc.sum_abs, max_rel=acc.max_rel,
                       mism=acc.mism, counts=counts, dot=acc.dot, ref_sq=acc.ref_sq, cand_sq=acc.cand_sq,
                       diff_sq=acc.diff_sq, atol=atol, rtol=rtol)


@dataclass
class _HostSums:
    """`_measure_host_1`'s running sums and maxima over the chunks measured so far."""

    mism: int = 0
    sum_abs: float = 0.0
    diff_sq: float = 0.0
    ref_sq: float = 0.0
    cand_sq: float = 0.0
    dot: float = 0.0
    max_abs: float = 0.0
    max_rel: float = 0.0
    max_abs_chunk: int | None = None  # the first chunk holding the maximum
    max_exc_chunk: int | None = None
    max_exc: float = -math.inf
    exact_parts: list[tuple[int, list[float]]] = field(default_factory=list)  # chunks with NaN/Inf, by `_partials`

    def exact(self, start: int, a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float) -> None:
        """The chunk at `start` (its values `a`, `b`, widened to the working precision: exact) by `_partials`."""
        self.exact_parts.append((start, _partials(a, b, atol, rtol, False, start).tolist()))


def _host_group(acc: _HostSums, g: int, length: int, a: torch.Tensor, b: torch.Tensor, d: torch.Tensor,
                q: torch.Tensor, atol: float, rtol: float, gate: float) -> None:
    """One group of rows of `_measure_host_1` (the chunks at g, g + length, …: values `a`, `b` in the working
    precision, d = |b - a|, q = d / a) added to `acc`."""
    work = a.dtype
    norm = torch.linalg.vector_norm
    # the sums of squares as norms (one pass each, nothing written), squared on the host
    per_row = torch.stack([d.amax(dim=1), q.amin(dim=1), q.amax(dim=1), d.sum(dim=1), norm(d, dim=1),
                           norm(a, dim=1), norm(b, dim=1)]).tolist()
    excess = None
    if any(x > gate for x in per_row[0]):  # (False for NaN) some row out of atol: the excess is needed
        e = torch.add(d, a.abs(), alpha=-rtol)  # |c - r| - rtol |r|: how far past the bound, less atol
        # out of tolerance by torch.isclose's own rule in the working precision: |c - r| > atol + |rtol r|
        bound = a.abs().mul_(rtol).add_(atol)
        excess = torch.stack([e.amax(dim=1), (d > bound).sum(dim=1).to(work)]).tolist()
    for i, (dmax, lo, hi, sa, nd, na, nb) in enumerate(zip(*per_row)):
        start = g + i * length
        if not math.isfinite(dmax):
            acc.exact(start, a[i], b[i], atol, rtol)
            continue
        if dmax > atol and excess is not None:
            emax = excess[0][i] - atol
            row_mism = int(excess[1][i])
        else:
            emax, row_mism = dmax - atol, 0  # every element within atol: a bound on the excess, at most 0
        if math.isfinite(lo) and math.isfinite(hi):
            rmax = max(-lo, hi)
        else:  # an exact zero in the reference (0/0, d/0): over r != 0 only
            rmax = float(q[i].abs().nan_to_num_(nan=0.0, posinf=0.0).amax())
        dd, rr, cc = nd * nd, na * na, nb * nb
        if not (math.isfinite(dd) and math.isfinite(rr) and math.isfinite(cc)) or \
                (dd == 0.0 and dmax > 0) or (rr == 0.0 and float(a[i].abs().amax()) > 0):
            # squares beyond float32's range (or below it): this chunk the exact float64 way
            acc.exact(start, a[i], b[i], atol, rtol)
            continue
        acc.mism += row_mism
        acc.max_rel = max(acc.max_rel, rmax)
        acc.sum_abs += sa
        acc.diff_sq, acc.ref_sq, acc.cand_sq, acc.dot = (acc.diff_sq + dd, acc.ref_sq + rr, acc.cand_sq + cc,
                                                         acc.dot + (rr + cc - dd) / 2)
        if acc.max_abs_chunk is None or dmax > acc.max_abs:
            acc.max_abs, acc.max_abs_chunk = dmax, start
        if acc.max_exc_chunk is None or emax > acc.max_exc:
            acc.max_exc, acc.max_exc_chunk = emax, start


def _host_add_exact(acc: _HostSums) -> tuple[list[int], int | None, int | None, float]:
    """The chunks `_measure_host_1` measured by `_partials` added to `acc`: the NaN/Inf counts, the flat indices
    of the largest error and excess where an exact chunk holds them (else None), the first NaN/Inf disagreement."""
    tot, rel, first_nb = _combined([p for _, p in acc.exact_parts])
    acc.mism += int(tot[Part.MISMATCHES])
    acc.sum_abs, acc.diff_sq, acc.dot = acc.sum_abs + tot[Part.SUM_ABS], acc.diff_sq + tot[Part.DIFF_SQ], \
        acc.dot + tot[Part.DOT]
    acc.ref_sq, acc.cand_sq = acc.ref_sq + tot[Part.REF_SQ], acc.cand_sq + tot[Part.CAND_SQ]
    acc.max_rel = max(acc.max_rel, rel)
    counts = [int(tot[s]) for s in COUNTS]
    by_abs = by_exc = None  # (value, flat index) found in the exact chunks
    for start, p in acc.exact_parts:
        if (acc.max_abs_chunk is None or p[Part.MAX_ABS] > acc.max_abs
                or (p[Part.MAX_ABS] == acc.max_abs and start < acc.max_abs_chunk)):
            acc.max_abs, acc.max_abs_chunk, by_abs = p[Part.MAX_ABS], start, int(p[Part.MAX_ABS_AT])
        if (acc.max_exc_chunk is None or p[Part.MAX_EXCESS] > acc.max_exc
                or (p[Part.MAX_EXCESS] == acc.max_exc and start < acc.max_exc_chunk)):
            acc.max_exc, acc.max_exc_chunk, by_exc = p[Part.MAX_EXCESS], start, int(p[Part.MAX_EXCESS_AT])
    return counts, by_abs, by_exc, first_nb


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
