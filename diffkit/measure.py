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


def measure(ref: torch.Tensor, cand: torch.Tensor, atol: float, rtol: float) -> Stats:
    """Compare `cand` against `ref` (same shape; bring the layout in line before calling)."""
    if tuple(ref.shape) != tuple(cand.shape):
        raise ValueError(f"measure needs equal shapes, got {tuple(ref.shape)} and {tuple(cand.shape)}")
    if cand.device != ref.device:
        cand = cand.to(ref.device)
    n = ref.numel()
    exact = not (ref.is_floating_point() or ref.is_complex())
    r = ref.detach().reshape(-1)
    c = cand.detach().reshape(-1)
    if n == 0:
        return Stats(0, 0.0, 0.0, 0.0, 0, 1.0, 0, 0, 0, 0, None, atol, rtol)
    if exact and not (c.is_floating_point() or c.is_complex()):
        diff = (c.to(torch.float64) - r.to(torch.float64)).abs()
        bad = c != r
        rd, cd = r.to(torch.float64), c.to(torch.float64)
        r_nan = r_inf = c_nan = c_inf = 0
        nan_bad = torch.zeros_like(bad)
    else:
        rd = r.to(torch.float64)
        cd = c.to(torch.float64)
        r_nan_m, c_nan_m = torch.isnan(rd), torch.isnan(cd)
        r_inf_m, c_inf_m = torch.isinf(rd), torch.isinf(cd)
        # NaN where the reference has NaN, or the same infinity, is agreement; anything else is not
        both_nan = r_nan_m & c_nan_m
        same_inf = r_inf_m & c_inf_m & (rd == cd)
        special = r_nan_m | c_nan_m | r_inf_m | c_inf_m
        nan_bad = special & ~(both_nan | same_inf)
        finite = ~special
        diff = torch.where(finite, (cd - rd).abs(), torch.zeros_like(rd))
        tol_bad = finite & (diff > atol + rtol * rd.abs())
        bad = tol_bad | nan_bad
        r_nan, r_inf = int(r_nan_m.sum()), int(r_inf_m.sum())
        c_nan, c_inf = int(c_nan_m.sum()), int(c_inf_m.sum())
    mismatches = int(bad.sum())
    max_abs = float(diff.max())
    mean_abs = float(diff.mean())
    nz = rd.abs() > 0
    rel = torch.where(nz & torch.isfinite(rd) & torch.isfinite(cd), diff / rd.abs().clamp_min(1e-300), torch.zeros_like(diff))
    max_rel = float(rel.max())
    fr = torch.where(torch.isfinite(rd), rd, torch.zeros_like(rd))
    fc = torch.where(torch.isfinite(cd), cd, torch.zeros_like(cd))
    denom = float(fr.norm() * fc.norm())
    cosine = float((fr * fc).sum() / denom) if denom > 0 else (1.0 if float(fr.norm()) == float(fc.norm()) else 0.0)
    if mismatches and bool(nan_bad.any()):
        flat = int(torch.nonzero(nan_bad)[0, 0])
    else:
        # the element that exceeds its tolerance by the most (or, all passing, the largest error)
        excess = diff - (atol + rtol * rd.abs())
        flat = int(torch.argmax(excess if mismatches else diff))
    worst = Worst(_unravel(flat, tuple(ref.shape)), float(rd[flat]), float(cd[flat]),
                  float(abs(float(cd[flat]) - float(rd[flat]))) if bool(torch.isfinite(cd[flat] - rd[flat])) else float("inf"))
    return Stats(n, max_abs, mean_abs, max_rel, mismatches, cosine, r_nan, r_inf, c_nan, c_inf, worst, atol, rtol)
