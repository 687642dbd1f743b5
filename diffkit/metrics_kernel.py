"""The CUDA metric kernel: every statistic a pair's `Stats` needs, in one read of both tensors.

One Triton program measures one block of `BLOCK` elements of one pair, in float32 (float64 when
either side is float64), and writes that block's partial statistics (the `measure._Part` slots,
sums accumulated in float64); a batch of pairs of one dtype combination is one launch, the pairs'
tensors reached through a table of their addresses.  The blocks are then combined per pair on the
device (scatter reductions: sums, maxima, and the first index of each maximum, as `torch.argmax`
takes the first of equal maxima), the worst element's two values are gathered by a second small
launch, and the packed vectors (`measure._Packed` slots) of the whole batch travel to the host in
one copy behind one event.  Nothing synchronises until a result is read.

The rule is `measure.compare_elements`'s (``torch.allclose(equal_nan=False)``); `tests/test_metrics.py`
checks the kernel against the float64 reductions of `measure._packed_exact`.
"""
from __future__ import annotations

import functools

import torch

from .measure import _COUNTS, _Packed, _Part

BLOCK = 1024
_NPART = len(_Part)


@functools.cache
def available() -> bool:
    """Whether the kernel can run here (Triton importable and a CUDA device present)."""
    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:
        return False
    return _kernels() is not None


@functools.cache
def _kernels():
    try:
        import triton
        import triton.language as tl
    except Exception:
        return None

    @triton.jit
    def partials(ref_ptrs, cand_ptrs, numels, block_pair, block_first, out, atol, rtol,
                 REF_T: tl.constexpr, CAND_T: tl.constexpr, WORK_T: tl.constexpr, BLOCK: tl.constexpr,
                 NPART: tl.constexpr):
        pid = tl.program_id(0)
        pair = tl.load(block_pair + pid)
        start = (pid - tl.load(block_first + pair)).to(tl.int64) * BLOCK
        n = tl.load(numels + pair)
        rp = tl.load(ref_ptrs + pair).to(tl.pointer_type(REF_T))
        cp = tl.load(cand_ptrs + pair).to(tl.pointer_type(CAND_T))
        offs = start + tl.arange(0, BLOCK).to(tl.int64)
        live = offs < n
        r = tl.load(rp + offs, mask=live, other=0.0).to(WORK_T)
        c = tl.load(cp + offs, mask=live, other=0.0).to(WORK_T)
        # infinities without an infinite constant: x - x is NaN exactly where x is infinite (or NaN)
        r_nan = r != r
        c_nan = c != c
        r_inf = (~r_nan) & ((r - r) != 0)
        c_inf = (~c_nan) & ((c - c) != 0)
        special = r_nan | c_nan | r_inf | c_inf
        disagree = special & ~(r_inf & c_inf & (r == c))
        rabs = tl.abs(r)
        zero = tl.zeros_like(r)
        diff = tl.where(special, zero, tl.abs(c - r))
        bound = atol + rtol * rabs
        bad = ((~special) & (diff > bound)) | disagree
        bad = bad & live
        rel = tl.where((rabs > 0) & (~special) & live, diff / tl.where(rabs > 0, rabs, 1.0), zero)
        excess = diff - bound
        excess = tl.where((excess != excess) | (~live), -1.0e38, excess)  # "none" (as -inf in measure._partials)
        fr = tl.where(r_nan | r_inf, zero, r).to(tl.float64)
        fc = tl.where(c_nan | c_inf, zero, c).to(tl.float64)
        d64 = diff.to(tl.float64)
        big = tl.full([BLOCK], 9.0e18, tl.float64)
        idx = offs.to(tl.float64)
        i_d = tl.argmax(diff, axis=0)
        i_e = tl.argmax(excess, axis=0)
        base = out + pid.to(tl.int64) * NPART
        tl.store(base + 0, tl.sum(bad.to(tl.float64), axis=0))  # MISMATCHES
        tl.store(base + 1, tl.max(diff, axis=0).to(tl.float64))  # MAX_ABS
        tl.store(base + 2, (start + i_d).to(tl.float64))  # MAX_ABS_AT
        tl.store(base + 3, tl.sum(d64, axis=0))  # SUM_ABS
        tl.store(base + 4, tl.max(rel, axis=0).to(tl.float64))  # MAX_REL
        tl.store(base + 5, tl.sum(fr * fc, axis=0))  # DOT
        tl.store(base + 6, tl.sum(fr * fr, axis=0))  # REF_SQ
        tl.store(base + 7, tl.sum(fc * fc, axis=0))  # CAND_SQ
        tl.store(base + 8, tl.sum((r_nan & live).to(tl.float64), axis=0))  # REF_NAN
        tl.store(base + 9, tl.sum((r_inf & live).to(tl.float64), axis=0))  # REF_INF
        tl.store(base + 10, tl.sum((c_nan & live).to(tl.float64), axis=0))  # CAND_NAN
        tl.store(base + 11, tl.sum((c_inf & live).to(tl.float64), axis=0))  # CAND_INF
        tl.store(base + 12, tl.max(excess, axis=0).to(tl.float64))  # MAX_EXCESS
        tl.store(base + 13, (start + i_e).to(tl.float64))  # MAX_EXCESS_AT
        tl.store(base + 14, tl.min(tl.where(disagree & live, idx, big), axis=0))  # FIRST_DISAGREE_AT
        tl.store(base + 15, tl.sum(d64 * d64, axis=0))  # DIFF_SQ

    @triton.jit
    def gather(ref_ptrs, cand_ptrs, flat, out, REF_T: tl.constexpr, CAND_T: tl.constexpr):
        pair = tl.program_id(0)
        rp = tl.load(ref_ptrs + pair).to(tl.pointer_type(REF_T))
        cp = tl.load(cand_ptrs + pair).to(tl.pointer_type(CAND_T))
        i = tl.load(flat + pair)
        tl.store(out + 2 * pair, tl.load(rp + i).to(tl.float64))
        tl.store(out + 2 * pair + 1, tl.load(cp + i).to(tl.float64))

    return partials, gather


def _triton_dtype(dtype: torch.dtype):
    import triton.language as tl

    return {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16,
            torch.float64: tl.float64}[dtype]


def _first_max(values: torch.Tensor, at: torch.Tensor, group: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group: the largest of `values` and the smallest `at` among the blocks holding it."""
    top = torch.full((groups,), float("-inf"), dtype=values.dtype, device=values.device)
    top = top.scatter_reduce(0, group, values, "amax", include_self=True)
    cand_at = torch.where(values == top[group], at, torch.full_like(at, float("inf")))
    first = torch.full((groups,), float("inf"), dtype=at.dtype, device=at.device)
    first = first.scatter_reduce(0, group, cand_at, "amin", include_self=True)
    return top, first


def packed_batch(pairs: list[tuple[torch.Tensor, torch.Tensor]], atol: float, rtol: float) -> torch.Tensor:
    """The packed metric vectors ([len(pairs), len(_Packed)], float64, on the device) of pairs that
    share one device, one dtype combination and one tolerance; each pair is two equal-length flat
    tensors (made contiguous here when they are not)."""
    partials, gather = _kernels()
    dev = pairs[0][0].device
    refs = [r.contiguous() for r, _ in pairs]
    cands = [c.contiguous() for _, c in pairs]
    rdt, cdt = refs[0].dtype, cands[0].dtype
    work = torch.float64 if torch.float64 in (rdt, cdt) else torch.float32
    numels = [t.numel() for t in refs]
    blocks = [-(-n // BLOCK) for n in numels]
    first = [0]
    for b in blocks[:-1]:
        first.append(first[-1] + b)
    total = first[-1] + blocks[-1]
    # the address table and each block's pair go over in one pinned, asynchronous copy
    host = torch.cat([torch.tensor([[r.data_ptr() for r in refs], [c.data_ptr() for c in cands], numels, first],
                                   dtype=torch.int64).reshape(-1),
                      torch.repeat_interleave(torch.arange(len(pairs)), torch.tensor(blocks))])
    if torch.cuda.is_available():
        host = host.pin_memory()
    sent = host.to(dev, non_blocking=True)
    table = sent[:4 * len(pairs)].reshape(4, len(pairs))
    block_pair = sent[4 * len(pairs):]
    out = torch.empty((total, _NPART), dtype=torch.float64, device=dev)
    partials[(total,)](table[0], table[1], table[2], block_pair, table[3], out, float(atol), float(rtol),
                       REF_T=_triton_dtype(rdt), CAND_T=_triton_dtype(cdt), WORK_T=_triton_dtype(work),
                       BLOCK=BLOCK, NPART=_NPART)
    P = len(pairs)

    def total_of(slot):
        return torch.zeros(P, dtype=torch.float64, device=dev).index_add_(0, block_pair, out[:, slot])

    n = table[2].to(torch.float64)
    mism = total_of(_Part.MISMATCHES)
    max_abs, by_diff = _first_max(out[:, _Part.MAX_ABS], out[:, _Part.MAX_ABS_AT], block_pair, P)
    _, by_excess = _first_max(out[:, _Part.MAX_EXCESS], out[:, _Part.MAX_EXCESS_AT], block_pair, P)
    first_nb = torch.full((P,), float("inf"), dtype=torch.float64, device=dev).scatter_reduce(
        0, block_pair, out[:, _Part.FIRST_DISAGREE_AT], "amin", include_self=True)
    flat = torch.where(first_nb < n, first_nb, torch.where(mism > 0, by_excess, by_diff)).to(torch.int64)
    max_rel = torch.zeros(P, dtype=torch.float64, device=dev).scatter_reduce(
        0, block_pair, out[:, _Part.MAX_REL], "amax", include_self=True)
    dot, rsq, csq = total_of(_Part.DOT), total_of(_Part.REF_SQ), total_of(_Part.CAND_SQ)
    nr, nc = rsq.sqrt(), csq.sqrt()
    denom = nr * nc
    cosine = torch.where(denom > 0, dot / torch.where(denom > 0, denom, 1.0), (nr == nc).to(torch.float64))
    worst = torch.empty((P, 2), dtype=torch.float64, device=dev)
    gather[(P,)](table[0], table[1], flat, worst, REF_T=_triton_dtype(rdt), CAND_T=_triton_dtype(cdt))
    counts = {slot.name.lower(): total_of(slot) for slot in _COUNTS}
    cols = dict(mismatches=mism, max_abs=max_abs, mean_abs=total_of(_Part.SUM_ABS) / n, max_rel=max_rel,
                cosine=cosine, **counts, worst_at=flat.to(torch.float64), worst_ref=worst[:, 0],
                worst_cand=worst[:, 1], rel_l2=total_of(_Part.DIFF_SQ).sqrt() / torch.where(nr > 0, nr, 1.0))
    # (temporaries freed here are reused only by later work on this stream: no wait is needed)
    return torch.stack([cols[s.name.lower()] for s in _Packed], dim=1)


def packed(r: torch.Tensor, c: torch.Tensor, atol: float, rtol: float) -> torch.Tensor:
    """One pair's packed metric vector (see `packed_batch`)."""
    return packed_batch([(r, c)], atol, rtol)[0]
