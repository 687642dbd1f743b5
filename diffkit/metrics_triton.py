"""The Triton programs of the CUDA metric kernel (see `diffkit.metrics_kernel`, which launches them).

This module imports Triton at its top: `metrics_kernel` imports it only once Triton is known to be there.
The programs call each other by their global names (Triton resolves names in the module, not a closure).
"""
from __future__ import annotations

import os

import triton
import triton.language as tl

# a float32 quotient by the hardware's approximate division (two instructions, not the full-range division's ~12 of
# the finite-first pass's 51.5 per element: `bench/kernel_instructions.py`).  It differs only for divisors below
# float32's normal range (flushed to zero: a lane whose largest relative error comes out infinite is measured again
# by the full rules) or above 2**126 (a square past float32's range: measured again too).  The interpreter has no
# inline assembly.
APPROX_DIV = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")


@triton.jit
def digits(p, s1, s2, s3, s4):
    """`p` as digits of a shape whose dims 1..4 have sizes s1..s4 (the first digit unbounded)."""
    d4 = p % s4
    p = p // s4
    d3 = p % s3
    p = p // s3
    d2 = p % s2
    p = p // s2
    return p // s1, p % s1, d2, d3, d4


@triton.jit
def strided_setup(lay, start, lane, BLOCK: tl.constexpr):
    """A strided tile: its pair's elements are read through its layout (`lay`: its row of the layout table, see
    `metrics_kernel.layout`) in logical order, each lane's position kept as digits of the pair's shape and as its
    place on each side, both carried forward by BLOCK each step (`advance`: no division or product of a position
    per element).  Returns the sizes of dims 1..4, BLOCK as digits of dims 1..4 (what a step adds), each lane's first
    position as digits of dims 1..4 and its first places, and for each side what a step moves a place by (`sr`,
    `sc`) and what a carry out of dim i changes it by (``w[i] = stride[i-1] - size[i] * stride[i]``)."""
    s1 = tl.load(lay + 1).to(tl.int32)
    s2 = tl.load(lay + 2).to(tl.int32)
    s3 = tl.load(lay + 3).to(tl.int32)
    s4 = tl.load(lay + 4).to(tl.int32)
    r0 = tl.load(lay + 5).to(tl.int32)
    r1 = tl.load(lay + 6).to(tl.int32)
    r2 = tl.load(lay + 7).to(tl.int32)
    r3 = tl.load(lay + 8).to(tl.int32)
    r4 = tl.load(lay + 9).to(tl.int32)
    c0 = tl.load(lay + 10).to(tl.int32)
    c1 = tl.load(lay + 11).to(tl.int32)
    c2 = tl.load(lay + 12).to(tl.int32)
    c3 = tl.load(lay + 13).to(tl.int32)
    c4 = tl.load(lay + 14).to(tl.int32)
    e0, e1, e2, e3, e4 = digits(s1 * 0 + BLOCK, s1, s2, s3, s4)
    d0, d1, d2, d3, d4 = digits(start.to(tl.int32) + lane, s1, s2, s3, s4)
    ro = d0 * r0 + d1 * r1 + d2 * r2 + d3 * r3 + d4 * r4
    co = d0 * c0 + d1 * c1 + d2 * c2 + d3 * c3 + d4 * c4
    sr = e0 * r0 + e1 * r1 + e2 * r2 + e3 * r3 + e4 * r4
    sc = e0 * c0 + e1 * c1 + e2 * c2 + e3 * c3 + e4 * c4
    return (s1, s2, s3, s4, e1, e2, e3, e4, d1, d2, d3, d4, ro, co, sr, sc, r0 - s1 * r1, r1 - s2 * r2, r2 - s3 * r3,
            r3 - s4 * r4, c0 - s1 * c1, c1 - s2 * c2, c2 - s3 * c3, c3 - s4 * c4)


@triton.jit
def advance(d1, d2, d3, d4, ro, co, e1, e2, e3, e4, s1, s2, s3, s4, sr, sc, wr1, wr2, wr3, wr4, wc1, wc2, wc3, wc4):
    """A lane's next position and places: BLOCK (digits e1..e4) added digit by digit, a carry at most one per digit
    (each digit and each of BLOCK's is below its size; the first digit is not kept: past the end is masked), and
    each place moved by the step plus what each carry changes it by (see `strided_setup`)."""
    d4 += e4
    k4 = (d4 >= s4).to(tl.int32)
    d4 -= k4 * s4
    d3 += e3 + k4
    k3 = (d3 >= s3).to(tl.int32)
    d3 -= k3 * s3
    d2 += e2 + k3
    k2 = (d2 >= s2).to(tl.int32)
    d2 -= k2 * s2
    d1 += e1 + k2
    k1 = (d1 >= s1).to(tl.int32)
    d1 -= k1 * s1
    ro += sr + k4 * wr4 + k3 * wr3 + k2 * wr2 + k1 * wr1
    co += sc + k4 * wc4 + k3 * wc3 + k2 * wc2 + k1 * wc1
    return d1, d2, d3, d4, ro, co


@triton.jit
def quotient(num, den, WORK_T: tl.constexpr):
    """num / den (see APPROX_DIV)."""
    if APPROX_DIV and WORK_T == tl.float32:
        return tl.inline_asm_elementwise("div.approx.ftz.f32 $0, $1, $2;", "=r,r,r", [num, den], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return num / den


@triton.jit
def unmeasured(rsq, csq, dsq, top_r, top_c, max_d, max_rel, RANGE: tl.constexpr):
    """The lanes of a finite-first tile to measure again by the full rules, with float64 sums."""
    # a NaN or an infinity on either side leaves a lane's sum of squares NaN or infinite, and so does a square (or
    # a sum of them) past the sums' range (the differences' squares too: |c - r| can leave the range where neither
    # side does)
    both = rsq + csq + dsq.to(rsq.dtype)
    seen = ((both - both) != 0).to(tl.int32)
    # (an infinite relative error: a divisor below float32's normal range, flushed by the approximate division)
    seen |= ((max_rel - max_rel) != 0).to(tl.int32)
    if RANGE:
        # squares too small for a float32 sum (below 1e-18 a lane's largest ones vanish): likewise, on either side
        # or in the differences
        seen |= (((top_r < 1.0e-18) & (top_r > 0)) | ((top_c < 1.0e-18) & (top_c > 0))
                 | ((max_d < 1.0e-18) & (max_d > 0))).to(tl.int32)
    return seen


@triton.jit
def tile_reach(rp, cp, start, n, TILE: tl.constexpr, READ: tl.constexpr, ALIGNED: tl.constexpr):
    """The tile's elements left in its pair (int32: a tile's places and masks need no 64-bit arithmetic) and, for a
    contiguous pair (READ 0), each side's address at the tile's start (see `tile_stats`)."""
    rem = tl.minimum(n - start, TILE).to(tl.int32)
    if READ == 0:
        rp += start
        cp += start
    if ALIGNED:
        rem = tl.multiple_of(rem, 4)
        if READ == 0:
            rp = tl.multiple_of(rp, 16)
            cp = tl.multiple_of(cp, 16)
    return rp, cp, rem


@triton.jit
def read_step(rp, cp, loc, live, ro, co, cols, WORK_T: tl.constexpr, READ: tl.constexpr, ALIGNED: tl.constexpr):
    """One step's elements of each side, in the working precision (see `tile_stats`: `loc` the lanes' positions
    within the tile, `ro` and `co` the places of the lanes (READ 1) or of their rows (READ 2))."""
    if READ == 1:
        rq = rp + ro
        cq = cp + co
    elif READ == 2:
        if ALIGNED:
            # (each row's first address a multiple of 16 bytes, as the host checked; said of the addresses, as
            # Triton's analysis drops a hint on a loop-carried value or on a pointer cast from an integer)
            rq = tl.multiple_of(rp + ro, [16, 16]) + cols
            cq = tl.multiple_of(cp + co, [16, 16]) + cols
        else:
            rq = rp + ro + cols
            cq = cp + co + cols
    else:
        rq = rp + loc
        cq = cp + loc
    return tl.load(rq, mask=live, other=0.0).to(WORK_T), tl.load(cq, mask=live, other=0.0).to(WORK_T)


@triton.jit
def full_rules(r, c, rabs, bound, live, zero, SUM_T: tl.constexpr):
    """The elements judged by the NaN/Inf rules: the absolute error (0 where either side is not finite), whether
    out of tolerance, the relative error, the excess over the bound ("none" where not finite or masked off), whether
    they disagree for a NaN or an infinity, the values summed (0 where not finite), and which are NaN or infinite."""
    # infinities without an infinite constant: x - x is NaN exactly where x is infinite (or NaN)
    r_nan = r != r
    c_nan = c != c
    r_inf = (~r_nan) & ((r - r) != 0)
    c_inf = (~c_nan) & ((c - c) != 0)
    special = r_nan | c_nan | r_inf | c_inf
    disagree = special & ~(r_inf & c_inf & (r == c)) & live
    diff = tl.where(special, zero, tl.abs(c - r))
    bad = (((~special) & (diff > bound)) | disagree) & live
    rel = tl.where((rabs > 0) & (~special) & live, diff / tl.where(rabs > 0, rabs, 1.0), zero)
    excess = diff - bound
    excess = tl.where((excess != excess) | (~live), -1.0e38, excess)  # "none" (-inf in measure._partials)
    fr = tl.where(r_nan | r_inf, zero, r).to(SUM_T)
    fc = tl.where(c_nan | c_inf, zero, c).to(SUM_T)
    return diff, bad, rel, excess, disagree, fr, fc, r_nan, r_inf, c_nan, c_inf


@triton.jit
def tile_stats(rp, cp, start, n, atol, rtol, lay, WORK_T: tl.constexpr, BLOCK: tl.constexpr,
               TILE_BLOCKS: tl.constexpr, SUM_T: tl.constexpr, FULL: tl.constexpr, RANGE: tl.constexpr,
               READ: tl.constexpr, ALIGNED: tl.constexpr, GROUP: tl.constexpr):
    """One tile's per-lane accumulators.  FULL=False assumes no NaN or infinity on either side (about
    half the instructions per element) and returns, as `seen`, which lanes met one: the caller then
    measures the tile again with FULL=True, which applies the NaN/Inf rules.

    The lanes are BLOCK // GROUP rows of GROUP neighbouring elements.  READ (`metrics_kernel.READ_*`): 0, both sides
    contiguous; 1, each element's place through the pair's layout (`strided_setup`); 2, the same for each row of
    lanes only, its GROUP elements next to each other on both sides (the layout's last dim has stride 1 on both
    and a size that is a multiple of GROUP).  ALIGNED: every row of lanes starts 16-byte aligned on both sides and
    the pair's length is a multiple of 4, so a lane's four neighbouring elements are read in one load (the host
    checks it for every pair of the launch: `metrics_kernel._aligned`)."""
    R: tl.constexpr = BLOCK // GROUP
    rows = tl.arange(0, R)[:, None] * GROUP
    cols = tl.arange(0, GROUP)[None, :]
    lane = rows + cols
    ro = 0  # (READ 0: not read)
    co = 0
    # the places of each lane (READ 1) or of each row of lanes (READ 2), and how they move
    if READ == 1:
        (s1, s2, s3, s4, e1, e2, e3, e4, d1, d2, d3, d4, ro, co, sr, sc, wr1, wr2, wr3, wr4, wc1, wc2, wc3,
         wc4) = strided_setup(lay, start, lane, BLOCK)
    if READ == 2:
        (s1, s2, s3, s4, e1, e2, e3, e4, d1, d2, d3, d4, ro, co, sr, sc, wr1, wr2, wr3, wr4, wc1, wc2, wc3,
         wc4) = strided_setup(lay, start, rows, BLOCK)
    # positions within the tile (int32: fewer registers per lane); the tile's start is added at the end
    none = tl.full([R, GROUP], 1 << 30, tl.int32)
    mism = tl.zeros([R, GROUP], tl.int32)
    r_nans = tl.zeros([R, GROUP], tl.int32)
    r_infs = tl.zeros([R, GROUP], tl.int32)
    c_nans = tl.zeros([R, GROUP], tl.int32)
    c_infs = tl.zeros([R, GROUP], tl.int32)
    seen = tl.zeros([R, GROUP], tl.int32)
    sum_abs = tl.zeros([R, GROUP], SUM_T)
    dot = tl.zeros([R, GROUP], SUM_T)
    rsq = tl.zeros([R, GROUP], SUM_T)
    csq = tl.zeros([R, GROUP], SUM_T)
    dsq = tl.zeros([R, GROUP], SUM_T)
    max_d = tl.full([R, GROUP], -1.0, WORK_T)
    max_d_at = none
    max_e = tl.full([R, GROUP], -3.0e38, WORK_T)
    max_e_at = none
    max_rel = tl.zeros([R, GROUP], WORK_T)
    first_bad = none
    top_r = tl.zeros([R, GROUP], WORK_T)  # (FULL=False) each side's largest magnitude in the lane
    top_c = tl.zeros([R, GROUP], WORK_T)
    rp, cp, rem = tile_reach(rp, cp, start, n, BLOCK * TILE_BLOCKS, READ, ALIGNED)
    for k in tl.range(0, TILE_BLOCKS):  # a loop, not unrolled: unrolled, every load is hoisted and spills
        loc = k * BLOCK + lane
        live = loc < rem
        r, c = read_step(rp, cp, loc, live, ro, co, cols, WORK_T, READ, ALIGNED)
        if READ != 0:
            d1, d2, d3, d4, ro, co = advance(d1, d2, d3, d4, ro, co, e1, e2, e3, e4, s1, s2, s3, s4, sr, sc, wr1, wr2,
                                             wr3, wr4, wc1, wc2, wc3, wc4)
        rabs = tl.abs(r)
        zero = tl.zeros_like(r)
        bound = atol + rtol * rabs
        if FULL:
            diff, bad, rel, excess, disagree, fr, fc, r_nan, r_inf, c_nan, c_inf = full_rules(r, c, rabs, bound, live,
                                                                                             zero, SUM_T)
            first_bad = tl.minimum(first_bad, tl.where(disagree, loc, none))
            r_nans += (r_nan & live).to(tl.int32)
            r_infs += (r_inf & live).to(tl.int32)
            c_nans += (c_nan & live).to(tl.int32)
            c_infs += (c_inf & live).to(tl.int32)
        else:
            # every value assumed finite (a lane that met a NaN or an infinity is found after the
            # loop, by its sums of squares): no masks but the tail's.  A masked-off element reads 0
            # on both sides, so it is within tolerance, adds 0 to every sum and cannot be the first
            # of a maximum; only its excess (-atol) is kept out.
            if RANGE:
                top_r = tl.maximum(top_r, rabs)
                top_c = tl.maximum(top_c, tl.abs(c))
            diff = tl.abs(c - r)
            bad = diff > bound
            rel = tl.where(rabs > 0, quotient(diff, tl.where(rabs > 0, rabs, 1.0), WORK_T), zero)
            excess = tl.where(live, diff - bound, -1.0e38)
            fr = r.to(SUM_T)
            fc = c.to(SUM_T)
        mism += bad.to(tl.int32)
        max_rel = tl.maximum(max_rel, rel)
        up = diff > max_d  # strictly greater: a lane keeps the first position of its maximum
        max_d = tl.where(up, diff, max_d)
        max_d_at = tl.where(up, loc, max_d_at)
        up = excess > max_e
        max_e = tl.where(up, excess, max_e)
        max_e_at = tl.where(up, loc, max_e_at)
        d64 = diff.to(SUM_T)
        sum_abs += d64
        dot += fr * fc
        rsq += fr * fr
        csq += fc * fc
        dsq += d64 * d64
    if not FULL:
        seen = unmeasured(rsq, csq, dsq, top_r, top_c, max_d, max_rel, RANGE)
    return (mism, r_nans, r_infs, c_nans, c_infs, sum_abs, dot, rsq, csq, dsq, max_d, max_d_at, max_e, max_e_at,
            max_rel, first_bad, seen)


@triton.jit
def tile_partials(rp, cp, start, n, row, out, redo, atol, rtol, lay, WORK_T: tl.constexpr, BLOCK: tl.constexpr,
                  TILE_BLOCKS: tl.constexpr, NPART: tl.constexpr, SUM_T: tl.constexpr, FULL: tl.constexpr,
                  RANGE: tl.constexpr, READ: tl.constexpr, ALIGNED: tl.constexpr, GROUP: tl.constexpr):
    """Measure one tile and store its row of partial statistics; the finite-first pass (FULL=False)
    also stores in `redo` whether the tile must be measured again by the full rules."""
    (mism, r_nans, r_infs, c_nans, c_infs, sum_abs, dot, rsq, csq, dsq, max_d, max_d_at, max_e, max_e_at,
     max_rel, first_bad, seen) = tile_stats(rp, cp, start, n, atol, rtol, lay, WORK_T, BLOCK, TILE_BLOCKS, SUM_T,
                                            FULL, RANGE, READ, ALIGNED, GROUP)
    none = tl.full([BLOCK // GROUP, GROUP], 1 << 30, tl.int32)
    m_d = tl.max(max_d)
    m_e = tl.max(max_e)
    fb = tl.min(first_bad)
    s0 = start.to(tl.float64)
    base = out + row.to(tl.int64) * NPART
    tl.store(base + 0, tl.sum(mism).to(tl.float64))  # MISMATCHES
    tl.store(base + 1, m_d.to(tl.float64))  # MAX_ABS
    tl.store(base + 2, s0 + tl.min(tl.where(max_d == m_d, max_d_at, none)).to(tl.float64))  # MAX_ABS_AT
    tl.store(base + 3, tl.sum(sum_abs.to(tl.float64)))  # SUM_ABS
    tl.store(base + 4, tl.max(max_rel).to(tl.float64))  # MAX_REL
    tl.store(base + 5, tl.sum(dot.to(tl.float64)))  # DOT
    tl.store(base + 6, tl.sum(rsq.to(tl.float64)))  # REF_SQ
    tl.store(base + 7, tl.sum(csq.to(tl.float64)))  # CAND_SQ
    tl.store(base + 8, tl.sum(r_nans).to(tl.float64))  # REF_NAN
    tl.store(base + 9, tl.sum(r_infs).to(tl.float64))  # REF_INF
    tl.store(base + 10, tl.sum(c_nans).to(tl.float64))  # CAND_NAN
    tl.store(base + 11, tl.sum(c_infs).to(tl.float64))  # CAND_INF
    tl.store(base + 12, m_e.to(tl.float64))  # MAX_EXCESS
    tl.store(base + 13, s0 + tl.min(tl.where(max_e == m_e, max_e_at, none)).to(tl.float64))  # MAX_EXCESS_AT
    tl.store(base + 14, tl.where(fb < (1 << 30), s0 + fb.to(tl.float64), 9.0e18))  # FIRST_DISAGREE_AT
    tl.store(base + 15, tl.sum(dsq.to(tl.float64)))  # DIFF_SQ
    if not FULL:
        tl.store(redo + row, tl.max(seen))


@triton.jit
def table_tile(pid, ref_ptrs, cand_ptrs, numels, tile_first, n_pairs, search, REF_T: tl.constexpr,
               CAND_T: tl.constexpr, BLOCK: tl.constexpr, TILE_BLOCKS: tl.constexpr):
    """Tile `pid` of the table: its pair is the last whose first tile is at or before it (`search` steps of a
    binary search: a loop bound given at run time, so a batch of another size needs no other compiled program)."""
    lo = pid * 0
    hi = lo + n_pairs - 1
    step = search * 0
    while step < search:  # (a while loop: Triton's interpreter cannot take a run-time bound for `range`)
        mid = (lo + hi + 1) // 2
        ok = tl.load(tile_first + mid) <= pid
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
        step += 1
    start = (pid - tl.load(tile_first + lo)).to(tl.int64) * (BLOCK * TILE_BLOCKS)
    rp = tl.load(ref_ptrs + lo).to(tl.pointer_type(REF_T))
    cp = tl.load(cand_ptrs + lo).to(tl.pointer_type(CAND_T))
    return start, tl.load(numels + lo), rp, cp, lo


@triton.jit
def table_partials(pid, ref_ptrs, cand_ptrs, numels, tile_first, layout, out, redo, atol, rtol, n_pairs, search,
                   REF_T: tl.constexpr, CAND_T: tl.constexpr, WORK_T: tl.constexpr, BLOCK: tl.constexpr,
                   TILE_BLOCKS: tl.constexpr, NPART: tl.constexpr, SUM_T: tl.constexpr, FULL: tl.constexpr,
                   RANGE: tl.constexpr, LAYOUT: tl.constexpr, ALIGNED: tl.constexpr, READ: tl.constexpr,
                   GROUP: tl.constexpr):
    """Tile `pid` of the table measured, its pair read as READ says (`tile_stats`: every tile of a launch is of a
    pair read one way)."""
    start, n, rp, cp, pair = table_tile(pid, ref_ptrs, cand_ptrs, numels, tile_first, n_pairs, search, REF_T, CAND_T,
                                        BLOCK, TILE_BLOCKS)
    tile_partials(rp, cp, start, n, pid, out, redo, atol, rtol, layout + pair * LAYOUT, WORK_T, BLOCK, TILE_BLOCKS,
                  NPART, SUM_T, FULL, RANGE, READ, ALIGNED, GROUP)


# (integers not specialised on, where Triton would compile a program apart for a value of 1 or a multiple of 16:
# the table's size and the search's steps.  `n_direct`, a large pair's length, is: a multiple of 16 lets the tail
# mask allow four-wide loads)
@triton.jit(do_not_specialize=["n_pairs", "row0", "search"])
def partials(ref_ptrs, cand_ptrs, numels, tile_first, layout, out, redo, atol, rtol, n_pairs, n_direct, row0, search,
             REF_T: tl.constexpr, CAND_T: tl.constexpr, WORK_T: tl.constexpr, BLOCK: tl.constexpr,
             TILE_BLOCKS: tl.constexpr, NPART: tl.constexpr, DIRECT: tl.constexpr,
             SUM_T: tl.constexpr, FULL: tl.constexpr, RANGE: tl.constexpr, LAYOUT: tl.constexpr,
             ALIGNED: tl.constexpr, READ: tl.constexpr, GROUP: tl.constexpr, REDO: tl.constexpr,
             MIXED: tl.constexpr):
    """One tile a program.  REDO: the tiles of the whole table that the finite-first pass marked in `redo`, measured
    again by the full rules with float64 sums (the others return at once), each read through its pair's layout where
    it has one (MIXED: the table holds such pairs).  Otherwise the finite-first pass (FULL=False; a tile it cannot
    measure is marked in `redo`) or the full rules (FULL=True) on every tile of this launch: the table's tiles from
    `row0` on, all of pairs read one way (READ, see `tile_stats`: each way has its own program, as a program holding
    two reads is neither as fast), or (DIRECT) one large pair's, its tensors passed as they are.  ALIGNED: see
    `tile_stats` (a large pair's launch needs no such promise: Triton specialises on its tensors' alignment)."""
    pid = tl.program_id(0)
    if REDO:
        if tl.load(redo + pid) != 0:
            start, n, rp, cp, pair = table_tile(pid, ref_ptrs, cand_ptrs, numels, tile_first, n_pairs, search, REF_T,
                                                CAND_T, BLOCK, TILE_BLOCKS)
            lay = layout + pair * LAYOUT
            strided = False
            if MIXED:
                strided = tl.load(lay) != 0
            if strided:
                tile_partials(rp, cp, start, n, pid, out, redo, atol, rtol, lay, WORK_T, BLOCK, TILE_BLOCKS, NPART,
                              tl.float64, True, False, 1, False, GROUP)
            else:
                tile_partials(rp, cp, start, n, pid, out, redo, atol, rtol, lay, WORK_T, BLOCK, TILE_BLOCKS, NPART,
                              tl.float64, True, False, 0, False, GROUP)
    elif DIRECT:
        tile_partials(ref_ptrs, cand_ptrs, pid.to(tl.int64) * (BLOCK * TILE_BLOCKS), n_direct, row0 + pid,
                      out, redo, atol, rtol, layout, WORK_T, BLOCK, TILE_BLOCKS, NPART, SUM_T, FULL, RANGE, 0,
                      False, GROUP)
    else:
        table_partials(row0 + pid, ref_ptrs, cand_ptrs, numels, tile_first, layout, out, redo, atol, rtol,
                       n_pairs, search, REF_T, CAND_T, WORK_T, BLOCK, TILE_BLOCKS, NPART, SUM_T, FULL, RANGE,
                       LAYOUT, ALIGNED, READ, GROUP)


@triton.jit
def unravelled(lay, flat):
    """The places on each side of a strided pair's element at logical index `flat` (`lay`: the pair's layout row)."""
    d0, d1, d2, d3, d4 = digits(flat, tl.load(lay + 1), tl.load(lay + 2), tl.load(lay + 3), tl.load(lay + 4))
    at_r = d0 * tl.load(lay + 5) + d1 * tl.load(lay + 6) + d2 * tl.load(lay + 7) + d3 * tl.load(lay + 8) \
        + d4 * tl.load(lay + 9)
    at_c = d0 * tl.load(lay + 10) + d1 * tl.load(lay + 11) + d2 * tl.load(lay + 12) + d3 * tl.load(lay + 13) \
        + d4 * tl.load(lay + 14)
    return at_r, at_c


@triton.jit
def combine(parts, ref_ptrs, cand_ptrs, numels, tile_first, layout, dest, packed,
            REF_T: tl.constexpr, CAND_T: tl.constexpr, NPART: tl.constexpr, NPACKED: tl.constexpr,
            ROWS: tl.constexpr, MIXED: tl.constexpr, LAYOUT: tl.constexpr):
    """One program a pair: its tiles' partials folded into its packed vector."""
    pair = tl.program_id(0)
    first = tl.load(tile_first + pair)
    last = tl.load(tile_first + pair + 1)
    n = tl.load(numels + pair)
    rp = tl.load(ref_ptrs + pair).to(tl.pointer_type(REF_T))
    cp = tl.load(cand_ptrs + pair).to(tl.pointer_type(CAND_T))
    lay = layout + pair * LAYOUT
    rows0 = tl.arange(0, ROWS).to(tl.int64)
    big = 9.0e18
    s_mism = tl.zeros([ROWS], tl.float64)
    s_abs = tl.zeros([ROWS], tl.float64)
    s_dot = tl.zeros([ROWS], tl.float64)
    s_rsq = tl.zeros([ROWS], tl.float64)
    s_csq = tl.zeros([ROWS], tl.float64)
    s_dsq = tl.zeros([ROWS], tl.float64)
    s_rn = tl.zeros([ROWS], tl.float64)
    s_ri = tl.zeros([ROWS], tl.float64)
    s_cn = tl.zeros([ROWS], tl.float64)
    s_ci = tl.zeros([ROWS], tl.float64)
    m_rel = tl.zeros([ROWS], tl.float64)
    m_d = tl.full([ROWS], -2.0, tl.float64)
    m_d_at = tl.full([ROWS], big, tl.float64)
    m_e = tl.full([ROWS], -3.0e38, tl.float64)
    m_e_at = tl.full([ROWS], big, tl.float64)
    f_bad = tl.full([ROWS], big, tl.float64)
    lo = first
    while lo < last:
        rows = lo + rows0
        live = rows < last
        lo += ROWS
        b = parts + rows * NPART
        s_mism += tl.load(b + 0, mask=live, other=0.0)
        d = tl.load(b + 1, mask=live, other=-2.0)
        d_at = tl.load(b + 2, mask=live, other=big)
        up = d > m_d  # tiles come in order: strictly greater keeps the first
        m_d = tl.where(up, d, m_d)
        m_d_at = tl.where(up, d_at, m_d_at)
        s_abs += tl.load(b + 3, mask=live, other=0.0)
        m_rel = tl.maximum(m_rel, tl.load(b + 4, mask=live, other=0.0))
        s_dot += tl.load(b + 5, mask=live, other=0.0)
        s_rsq += tl.load(b + 6, mask=live, other=0.0)
        s_csq += tl.load(b + 7, mask=live, other=0.0)
        s_rn += tl.load(b + 8, mask=live, other=0.0)
        s_ri += tl.load(b + 9, mask=live, other=0.0)
        s_cn += tl.load(b + 10, mask=live, other=0.0)
        s_ci += tl.load(b + 11, mask=live, other=0.0)
        e = tl.load(b + 12, mask=live, other=-3.0e38)
        e_at = tl.load(b + 13, mask=live, other=big)
        up = e > m_e
        m_e = tl.where(up, e, m_e)
        m_e_at = tl.where(up, e_at, m_e_at)
        f_bad = tl.minimum(f_bad, tl.load(b + 14, mask=live, other=big))
        s_dsq += tl.load(b + 15, mask=live, other=0.0)
    mism = tl.sum(s_mism, axis=0)
    top_d = tl.max(m_d, axis=0)
    by_diff = tl.min(tl.where(m_d == top_d, m_d_at, big), axis=0)
    top_e = tl.max(m_e, axis=0)
    by_excess = tl.min(tl.where(m_e == top_e, m_e_at, big), axis=0)
    first_nb = tl.min(f_bad, axis=0)
    nf = n.to(tl.float64)
    flat = tl.where(first_nb < nf, first_nb, tl.where(mism > 0, by_excess, by_diff)).to(tl.int64)
    nr = tl.sqrt(tl.sum(s_rsq, axis=0))
    nc = tl.sqrt(tl.sum(s_csq, axis=0))
    denom = nr * nc
    cosine = tl.where(denom > 0, tl.sum(s_dot, axis=0) / tl.where(denom > 0, denom, 1.0),
                      (nr == nc).to(tl.float64))
    # the worst element's place on each side: its flat index, or through the pair's layout
    at_r = flat
    at_c = flat
    if MIXED:
        if tl.load(lay) != 0:
            at_r, at_c = unravelled(lay, flat)
    o = packed + tl.load(dest + pair) * NPACKED
    tl.store(o + 0, mism)  # MISMATCHES
    tl.store(o + 1, top_d)  # MAX_ABS
    tl.store(o + 2, tl.sum(s_abs, axis=0) / nf)  # MEAN_ABS
    tl.store(o + 3, tl.max(m_rel, axis=0))  # MAX_REL
    tl.store(o + 4, cosine)  # COSINE
    tl.store(o + 5, tl.sum(s_rn, axis=0))  # REF_NAN
    tl.store(o + 6, tl.sum(s_ri, axis=0))  # REF_INF
    tl.store(o + 7, tl.sum(s_cn, axis=0))  # CAND_NAN
    tl.store(o + 8, tl.sum(s_ci, axis=0))  # CAND_INF
    tl.store(o + 9, flat.to(tl.float64))  # WORST_AT
    tl.store(o + 10, tl.load(rp + at_r).to(tl.float64))  # WORST_REF
    tl.store(o + 11, tl.load(cp + at_c).to(tl.float64))  # WORST_CAND
    tl.store(o + 12, tl.sqrt(tl.sum(s_dsq, axis=0)) / tl.where(nr > 0, nr, 1.0))  # REL_L2
