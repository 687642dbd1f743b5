"""The CUDA metric kernel: every statistic a pair's `Stats` needs, in one read of both tensors.

Three to five launches per batch of pairs (one dtype combination, one tolerance; mostly three or four: the
host's time per launch is what bounds a diff's metric passes), nothing built per block on the host:

* `partials`: each program reads a tile of `TILE` elements of one pair (its pair found by a binary
  search of the pairs' first tiles, through a table of the pairs' addresses; a large pair is
  launched on its own; a launch for each way the table's pairs are read, `READ_*`), `BLOCK` lanes at a time
  (`BLOCK // GROUP` rows of `GROUP`), keeping per-lane accumulators (float32 arithmetic --
  float64 when either side is -- with float32 sums within the tile and float64 from the tile up;
  each lane keeps the first index of its maxima), and reduces them once into the tile's partial
  statistics (the `metric_slots.Part` slots).  This pass assumes every value finite and in float32's
  square range; a tile where that was not so (found from the lanes' sums after the loop) is marked.
* `partials` again (`REDO`), over the whole table: the marked tiles only, by the full NaN/Inf rules with float64
  sums, a program a tile (the others return at once).  (Session 33 had `combine` measure a pair's marked tiles
  itself, a launch fewer a batch; but one program a pair measuring every tile of a pair full of NaN made such
  pairs 13x slower on an H100, 24.5 ms against 1.9 ms for 24 pairs of 4M float32: `bench/nan_pairs.py`, and a
  candidate full of NaN is what a diff is often run on.)
* `combine`: one program per pair folds its tiles' partials (sums; maxima with the first index of
  each, as `torch.argmax` takes the first of equal maxima), reads the worst element's two values and
  writes the pair's packed vector (`metric_slots.Packed` slots).

A non-contiguous pair (a transposed value, one of q/k/v sliced from a fused projection, an expanded one) is read
where it lies, in logical order, through its row of a layout table (its shape merged to at most `MAX_DIMS`
dims, each side's strides): a lane carries its position forward as digits of the shape, so the indices kept
and the worst element are those of the logical order, as for a contiguous pair.  Where the last dim is
contiguous on both sides and a multiple of `GROUP` long (`READ_ROWS`), only each row of lanes does, its lanes
reading neighbours.  (Before, such a pair was first copied to contiguous memory: a write and a read more of its
bytes, 28 % of what the mid transformer compares: `bench/metric_passes.py --calls`.)

The per-element work is what bounds the programs (session 32, sm_90 code of the finite-first pass, instructions
per float32 element: contiguous 51.5 -> 34, its address and mask arithmetic in 32 bits within the tile and four
elements a load where `_aligned` allows, and a float32 quotient by the approximate division; strided 95 -> 86;
rows 43).

The packed vectors of the whole batch travel to the host in one copy behind one event; nothing
synchronises until a result is read.  The rule is `measure.compare_elements`'s
(``torch.allclose(equal_nan=False)``); `tests/test_metrics.py` checks the kernel against the
float64 reductions of `measure._packed_exact` (on a GPU, or on the CPU under ``TRITON_INTERPRET=1``).
"""
from __future__ import annotations

import functools
import os

import torch

from .metric_slots import Packed, Part

# (measured on an H200 by bench/metrics_kernel_tune.py, 1 GiB float32 pair, copy bandwidth ~4.0 TB/s: with
# these settings the finite-first pass reads both tensors at ~2.17 TB/s; float64 lane sums, 128 lanes x 4
# warps x 128 blocks, at 1.84; the full rules on every element at 1.25.  Prefetching the next block and
# software pipelining made no difference: the loop is bound by instructions, not memory latency)
BLOCK = 256  # lanes of a program
NUM_WARPS = 2  # (two lanes a thread, next to each other: the per-lane accumulators stay in registers)
TILE_BLOCKS = 128  # blocks of BLOCK elements a program reads, in a loop (a tile; 64: 2271 against 2476 GB/s, round 8)
# pairs at least this large are launched on their own, tensors passed directly; the rest are read through the batch's
# address table, one launch for all of them.  (H100, bench/direct_vs_table.py: the table reads as fast as a launch
# of its own at every size, 890 GB/s against 29 for 256 pairs of 256 Ki elements, 2435 against 452 at 4 Mi, 2560
# against 2575 at 256 Mi; a launch costs ~70 us of host time, so a diff's hundreds of activations of a few Mi
# elements each were launch-bound: a 12-block transformer's metric passes 21.5 -> 10.6 ms.  Only pairs of 1 GiB
# of float32 and more keep a launch each.)
DIRECT_MIN = 1 << 28
# the finite-first pass's per-lane running sums: True float64; False the working precision over a tile's
# blocks, float64 from the tile up (a tile whose magnitudes leave float32's square range is measured again
# with float64 sums).  The full-rules pass always sums in float64.
LANE_SUMS_64 = False
FAST = True  # a tile is first measured assuming finite values, again by the NaN/Inf rules only if it holds one
TILE = BLOCK * TILE_BLOCKS
COMBINE_ROWS = 256  # tiles a combining program reads at a time
_NPART = len(Part)
_NPACKED = len(Packed)


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


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
    """The `partials` and `combine` programs, or None without Triton."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:
        return None
    # (imported here, not at the top: the module imports Triton, an optional dependency that is slow to import)
    from . import metrics_triton

    return metrics_triton.partials, metrics_triton.combine


def _triton_dtype(dtype: torch.dtype):
    import triton.language as tl

    return {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16,
            torch.float64: tl.float64}[dtype]


# a pair's row of the layout table: [how it is read (READ_*), sizes of dims 1..4, ref strides of dims 0..4, cand strides
# of dims 0..4, one unused] (16 integers: each row 16-byte aligned)
LAYOUT = 16
# how a pair's tiles are read (a launch each: `metrics_triton.tile_stats`): both sides contiguous; each element's place
# through the layout; each row of GROUP lanes' place through it, the row's elements next to each other on both sides
# (the last dim has stride 1 on both and a size that is a multiple of GROUP: the q/k/v slices of a fused projection,
# heads transposed, most permutes)
READ_FLAT, READ_STRIDED, READ_ROWS = 0, 1, 2
GROUP = 16
MAX_DIMS = 5  # dims a strided pair may keep (after merging): more, and it is copied to contiguous memory first
_CONTIGUOUS = [0] * LAYOUT


def layout(r: torch.Tensor, c: torch.Tensor) -> list[int] | None:
    """The layout-table row of a pair of equal shapes read where they lie: dims of one element dropped, neighbours
    that both sides lay out as one merged, at most MAX_DIMS dims left (padded in front) and every element's place
    within int32; None where that does not hold (the pair is then copied to contiguous memory first)."""
    dims: list[list[int]] = []  # [size, ref stride, cand stride], outermost first
    for n, a, b in zip(r.shape, r.stride(), c.stride()):
        if n == 1:
            continue
        if dims and dims[-1][1] == a * n and dims[-1][2] == b * n:
            dims[-1] = [dims[-1][0] * n, a, b]
        else:
            dims.append([n, a, b])
    if len(dims) > MAX_DIMS:
        return None
    dims = [[1, 0, 0]] * (MAX_DIMS - len(dims)) + dims
    if max(sum((n - 1) * a for n, a, _ in dims), sum((n - 1) * b for n, _, b in dims)) >= 1 << 31:
        return None
    rows = dims[-1][1] == 1 and dims[-1][2] == 1 and dims[-1][0] % GROUP == 0
    return ([READ_ROWS if rows else READ_STRIDED] + [d[0] for d in dims[1:]] + [d[1] for d in dims]
            + [d[2] for d in dims] + [0])


def _row(r: torch.Tensor, c: torch.Tensor) -> list[int] | None:
    """A pair's row of the layout table as `packed_batch` reads it: all zeros for a contiguous pair, `layout` for a
    small non-contiguous one; None where it copies the pair to contiguous memory first (no layout, or large)."""
    if r.is_contiguous() and c.is_contiguous():
        return _CONTIGUOUS
    return layout(r, c) if r.numel() < DIRECT_MIN else None


def _aligned(r: torch.Tensor, c: torch.Tensor, lay: list[int] | None) -> bool:
    """Whether the pair's tiles keep the kernel's ALIGNED promise (`metrics_triton.tile_stats`): each element read
    through its layout (`lay`; no promise needed); its rows read through it, both sides starting 16-byte aligned
    and every stride but the last dim's (1) a multiple of 4; or contiguous (as it is, or as copied: a new
    allocation) with a length that is a multiple of 4 and both sides starting 16-byte aligned."""
    how = lay[0] if lay is not None else READ_FLAT
    if how == READ_STRIDED:
        return True
    if how == READ_ROWS:
        # (the strides of dims 0..3 on each side: the last dim's are 1)
        return r.data_ptr() % 16 == 0 and c.data_ptr() % 16 == 0 and all(s % 4 == 0 for s in lay[5:9] + lay[10:14])
    return r.numel() % 4 == 0 and all(t.data_ptr() % 16 == 0 for t in (r, c) if t.is_contiguous())


def planned(r: torch.Tensor, c: torch.Tensor) -> tuple[list[int] | None, int]:
    """A pair's row of the layout table as `packed_batch` reads it (`_row`) and the bytes of the contiguous copies it
    makes of the pair (none where it reads both sides where they lie): worked out once a pair, by the caller that
    batches pairs, and given to `packed_batch` (host time a pair counts: a diff measures hundreds)."""
    row = _row(r, c)
    if row is not None:
        return row, 0
    return row, sum(t.numel() * t.element_size() for t in (r, c) if not t.is_contiguous())


def packed_batch(pairs: list[tuple[torch.Tensor, torch.Tensor]], atol: float, rtol: float,
                 rows: list[list[int] | None] | None = None) -> torch.Tensor:
    """The packed metric vectors ([len(pairs), len(Packed)], float64, on the device) of pairs that
    share one device, one dtype combination and one tolerance; each pair is two tensors of one shape, at
    least one element.  A non-contiguous pair is read where it lies, in logical order, through its row of the
    layout table (`layout`); one that has none, or is large, is copied to contiguous memory first.  `rows`: each
    pair's `planned` row, where the caller has them."""
    partials, combine = _kernels()
    pairs = list(pairs)
    dev = pairs[0][0].device
    P = len(pairs)
    sizes = [r.numel() for r, _ in pairs]
    lays = []
    # for each way of reading, whether every pair the table's launch reads that way keeps the ALIGNED promise: then
    # it reads four elements a load (a large pair's launch, and the REDO launch over marked tiles, make none)
    aligned = {READ_FLAT: True, READ_STRIDED: False, READ_ROWS: True}
    for k, (r, c) in enumerate(pairs):
        lay = rows[k] if rows is not None else _row(r, c)
        if sizes[k] < DIRECT_MIN and not _aligned(r, c, lay):
            aligned[lay[0] if lay is not None else READ_FLAT] = False
        if lay is None:
            pairs[k] = (r.detach().contiguous(), c.detach().contiguous())
            lay = _CONTIGUOUS
        lays.append(lay)
    # the table holds the small pairs first, by how they are read (a launch reads all those read one way through
    # it), then the large ones (a launch each, their tensors passed directly); `dest` says where each one's vector
    # goes
    ways = (READ_FLAT, READ_ROWS, READ_STRIDED)
    order: list[int] = []
    ends = []  # where each way's pairs end in the table
    for way in ways:
        order += [k for k in range(P) if sizes[k] < DIRECT_MIN and lays[k][0] == way]
        ends.append(len(order))
    small = len(order)
    order += [k for k in range(P) if sizes[k] >= DIRECT_MIN]
    refs = [pairs[k][0] for k in order]
    cands = [pairs[k][1] for k in order]
    mixed = any(lay[0] for lay in lays)
    rdt, cdt = refs[0].dtype, cands[0].dtype
    work = torch.float64 if torch.float64 in (rdt, cdt) else torch.float32
    numels = [sizes[k] for k in order]
    first = [0]
    for n in numels:
        first.append(first[-1] + -(-n // TILE))
    out = torch.empty((first[-1], _NPART), dtype=torch.float64, device=dev)
    rt, ct = _triton_dtype(rdt), _triton_dtype(cdt)
    # the finite-first pass marks the tiles it could not measure (a NaN, an infinity, magnitudes out of
    # float32's square range) in `redo`; one more launch over the whole table measures those by the full rules
    redo = torch.empty(first[-1], dtype=torch.int32, device=dev)
    full = not FAST
    sums = torch.float64 if LANE_SUMS_64 or full else work
    const = dict(REF_T=rt, CAND_T=ct, WORK_T=_triton_dtype(work), BLOCK=BLOCK, TILE_BLOCKS=TILE_BLOCKS, NPART=_NPART,
                 num_warps=NUM_WARPS, FULL=full, SUM_T=_triton_dtype(sums), RANGE=sums != torch.float64,
                 LAYOUT=LAYOUT, GROUP=GROUP)
    # the large pairs first: their launches read no table (their tensors are passed directly), so the device
    # works on them while the host builds the table for the rest
    if small < P:
        none = _no_table(dev)
        for k in range(small, P):
            _launch(partials, first[k + 1] - first[k], refs[k], cands[k], none, none, none, out, redo, float(atol),
                    float(rtol), P, numels[k], first[k], 0, DIRECT=True, READ=READ_FLAT, ALIGNED=False, REDO=False,
                    MIXED=False, **const)
    # the address table goes over in one small copy (pinned and asynchronous on a GPU)
    # (one flat list, one tensor: every torch call here costs host time per batch, a batch per pair when streaming)
    # Each of its parts starts 16 bytes in (an even number of int64s before it): Triton compiles a program per
    # alignment of its pointer arguments, and an odd number of pairs would otherwise give another one
    Q = P + P % 2
    pad = [0] * (Q - P)
    table = [r.data_ptr() for r in refs] + pad + [c.data_ptr() for c in cands] + pad + numels + pad + order + pad
    for k in order:
        table += lays[k]
    table += [0] * (LAYOUT * (Q - P)) + first
    host = torch.tensor(table, dtype=torch.int64)
    if dev.type == "cuda":
        host = host.pin_memory()
    sent = host.to(dev, non_blocking=True)
    L = 4 * Q + LAYOUT * Q
    ref_ptrs, cand_ptrs, ns, dest, lay_t, tile_first = (sent[:P], sent[Q:Q + P], sent[2 * Q:2 * Q + P],
                                                        sent[3 * Q:3 * Q + P], sent[4 * Q:L], sent[L:])
    if _interpreted():  # the interpreter reads addresses as host pointers into these tensors' storage
        ref_ptrs = torch.tensor([r.data_ptr() for r in refs], dtype=torch.int64)
        cand_ptrs = torch.tensor([c.data_ptr() for c in cands], dtype=torch.int64)
    # the small pairs' tiles, a launch for each way of reading them
    for way, lo, hi in zip(ways, [0] + ends, ends):
        if hi > lo:
            _launch(partials, first[hi] - first[lo], ref_ptrs, cand_ptrs, ns, tile_first, lay_t, out, redo,
                    float(atol), float(rtol), small, 0, first[lo], max(1, (small - 1).bit_length()), DIRECT=False,
                    READ=way, ALIGNED=aligned[way], REDO=False, MIXED=False, **const)
    if not full:
        _launch(partials, first[-1], ref_ptrs, cand_ptrs, ns, tile_first, lay_t, out, redo, float(atol), float(rtol),
                P, 0, 0, max(1, (P - 1).bit_length()), DIRECT=False, READ=READ_FLAT, ALIGNED=False, REDO=True,
                MIXED=mixed, **const)
    packed = torch.empty((P, _NPACKED), dtype=torch.float64, device=dev)
    _launch(combine, P, out, ref_ptrs, cand_ptrs, ns, tile_first, lay_t, dest, packed, REF_T=rt, CAND_T=ct,
            NPART=_NPART, NPACKED=_NPACKED, ROWS=COMBINE_ROWS, MIXED=mixed, LAYOUT=LAYOUT)
    # (temporaries freed here are reused only by later work on this stream: no wait is needed)
    return packed


def _launch(program, programs: int, *args, **kwargs) -> None:
    """`program[(programs,)](*args, **kwargs)`, through `run`, not ``[grid]``: a capture records the Triton launches
    of a model by wrapping ``[grid]`` (`capture_kernels._TritonPatch`), and diffkit's own launches are never the
    model's, whatever thread makes them and whatever state the capture is in."""
    program.run(*args, grid=(programs,), warmup=False, **kwargs)


@functools.cache
def _no_table(dev: torch.device) -> torch.Tensor:
    """A stand-in for the table arguments of a launch that reads none (one int64 per device, kept)."""
    return torch.zeros(1, dtype=torch.int64, device=dev)


def packed(r: torch.Tensor, c: torch.Tensor, atol: float, rtol: float) -> torch.Tensor:
    """One pair's packed metric vector (see `packed_batch`)."""
    return packed_batch([(r, c)], atol, rtol)[0]
