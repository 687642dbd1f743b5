"""Measure one aligned pair: how far the candidate tensor is from the reference tensor.

All arithmetic is done in float64 on the tensors' device so the metric adds no error of its
own; integer and bool tensors compare exactly.  A pair passes when every element satisfies
``|c - r| <= atol + rtol * |r|`` and the candidate has no NaN/Inf the reference lacks.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

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


class PendingStats:
    """Metrics computed on the tensors' device, on their way to the host.

    The scalars travel as one small float64 vector through pinned memory behind a CUDA event, so
    measuring many pairs costs no synchronisation until `result()` is asked for."""

    def __init__(self, packed: torch.Tensor | None, shape: tuple[int, ...], atol: float, rtol: float,
                 ready: Stats | None = None):
        self.shape, self.atol, self.rtol = shape, atol, rtol
        self._stats = ready
        self.rel_l2 = 0.0
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
            (mism, max_abs, mean_abs, max_rel, cosine, r_nan, r_inf, c_nan, c_inf, flat, wr, wc, n, rel_l2) = \
                self._host.tolist()
            self.rel_l2 = rel_l2  # ||c - r|| / ||r|| over finite elements (align's value-agreement measure)
            wabs = abs(wc - wr)
            self._stats = Stats(int(n), max_abs, mean_abs, max_rel, int(mism), cosine, int(r_nan), int(r_inf),
                                int(c_nan), int(c_inf), Worst(_unravel(int(flat), self.shape), wr, wc,
                                                              wabs if wabs == wabs and wabs != float("inf") else float("inf")),
                                self.atol, self.rtol)
            self._host = None
        return self._stats


def measure(ref: torch.Tensor, cand: torch.Tensor, atol: float, rtol: float) -> Stats:
    """Compare `cand` against `ref` (same shape; bring the layout in line before calling)."""
    return measure_async(ref, cand, atol, rtol).result()


# elements per reduction step, so float64 temporaries stay bounded whatever the tensor's size:
# ~8 MiB each on the CPU, ~32 MiB on a GPU (where fewer, larger launches matter more)
CHUNK = 1 << 20
CHUNK_CUDA = 1 << 22


def _partials(r: torch.Tensor, c: torch.Tensor, atol: float, rtol: float, exact: bool, offset: int) -> torch.Tensor:
    """One chunk's sufficient statistics, as a float64 vector (see _PARTS)."""
    rd = r.to(torch.float64)
    cd = c.to(torch.float64)
    zero = torch.zeros((), dtype=torch.float64, device=rd.device)
    n = rd.numel()
    if exact:
        diff = (cd - rd).abs()
        bad = c != r
        nan_bad = torch.zeros_like(bad)
        counts = zero.expand(4)
        fr, fc = rd, cd
    else:
        r_nan_m, c_nan_m = torch.isnan(rd), torch.isnan(cd)
        r_inf_m, c_inf_m = torch.isinf(rd), torch.isinf(cd)
        # NaN where the reference has NaN, or the same infinity, is agreement; anything else is not
        special = r_nan_m | c_nan_m | r_inf_m | c_inf_m
        nan_bad = special & ~((r_nan_m & c_nan_m) | (r_inf_m & c_inf_m & (rd == cd)))
        finite = ~special
        diff = torch.where(finite, (cd - rd).abs(), zero)
        bad = (finite & (diff > atol + rtol * rd.abs())) | nan_bad
        counts = torch.stack([m.sum(dtype=torch.float64) for m in (r_nan_m, r_inf_m, c_nan_m, c_inf_m)])
        fr = torch.where(torch.isfinite(rd), rd, zero)
        fc = torch.where(torch.isfinite(cd), cd, zero)
    rel = torch.where((rd.abs() > 0) & torch.isfinite(rd) & torch.isfinite(cd), diff / rd.abs().clamp_min(1e-300), zero)
    excess = diff - (atol + rtol * rd.abs())
    i_ex, i_d = torch.argmax(excess), torch.argmax(diff)
    any_nb = nan_bad.any()
    first_nb = torch.where(any_nb, torch.argmax(nan_bad.to(torch.uint8)).to(torch.float64) + offset, float("inf"))
    return torch.cat([torch.stack([bad.sum(dtype=torch.float64), diff.max(), diff.sum(), rel.max(), (fr * fc).sum(),
                                   (fr * fr).sum(), (fc * fc).sum()]), counts,
                      torch.stack([excess[i_ex], i_ex.to(torch.float64) + offset, diff[i_d],
                                   i_d.to(torch.float64) + offset, first_nb, (diff * diff).sum()])])


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
        return PendingStats(None, shape, atol, rtol, ready=Stats(0, 0.0, 0.0, 0.0, 0, 1.0, 0, 0, 0, 0, None, atol, rtol))
    r = ref.detach().reshape(-1)
    c = cand.detach().reshape(-1)
    exact = not (ref.is_floating_point() or ref.is_complex()) and not (c.is_floating_point() or c.is_complex())
    step = CHUNK_CUDA if r.is_cuda else CHUNK
    parts = torch.stack([_partials(r[i:i + step], c[i:i + step], atol, rtol, exact, i) for i in range(0, n, step)])
    # combine the chunks (argmax takes the first of equal maxima, as one pass over the whole would)
    mism = parts[:, 0].sum()
    dot, nr, nc = parts[:, 4].sum(), parts[:, 5].sum().sqrt(), parts[:, 6].sum().sqrt()
    denom = nr * nc
    cosine = torch.where(denom > 0, dot / torch.where(denom > 0, denom, 1.0), (nr == nc).to(torch.float64))
    by_excess = parts[torch.argmax(parts[:, 11]), 12]
    by_diff = parts[torch.argmax(parts[:, 13]), 14]
    first_nb = parts[:, 15].min()
    # the worst element: the first NaN/Inf disagreement, else the element exceeding its tolerance by
    # the most (all passing: the largest error)
    flat = torch.where(first_nb < n, first_nb, torch.where(mism > 0, by_excess, by_diff)).to(torch.int64)
    packed = torch.cat([torch.stack([mism, parts[:, 1].max(), parts[:, 2].sum() / n, parts[:, 3].max(), cosine]),
                        parts[:, 7:11].sum(0),
                        torch.stack([flat.to(torch.float64), r[flat].to(torch.float64), c[flat].to(torch.float64),
                                     torch.tensor(float(n), dtype=torch.float64, device=r.device),
                                     parts[:, 16].sum().sqrt() / torch.where(nr > 0, nr, 1.0)])])
    return PendingStats(packed, shape, atol, rtol)
