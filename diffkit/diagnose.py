"""Diagnose: what a diverged stage's error looks like, as ranked findings with numbers.

Each check looks at one pair (reference value, candidate value in the reference's layout, and
the candidate in its own layout) plus what the capture knows about the producing call (the
module or the extension call and its parameters).  A check only reports when its model of the
error explains the candidate to within a small residual, so a correct candidate gets nothing:
no finding is better than a wrong one.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .align import Pair, best_layout, from_ref_layout, layout_of_equal, map_params_by_use, param_map, permuted, \
    to_ref_layout
from .align_graph import in_ref_layout
from .capture import Record
from .load import describe_difference
from .result import Finding, Stage

# a model of the error "explains" the candidate when what is left is this small, relative to the error
EXPLAINED = 1e-2


@dataclass
class Context:
    """What a check may look at besides the two values."""

    stage: Stage
    ref: torch.Tensor  # float64, reference layout
    cand: torch.Tensor  # float64, reference layout
    cand_native: torch.Tensor  # float64, the candidate's own layout
    ref_records: list[Record]
    cand_records: list[Record]
    ref_params: dict[str, torch.Tensor] = field(default_factory=dict)  # the reference model's, by name
    cand_params: dict[str, torch.Tensor] = field(default_factory=dict)
    # the candidate's parameter names -> the reference's (the alignment's); None: worked out here
    rename: dict[str, str] | None = None
    stop: bool = False  # set by a check whose finding leaves nothing for the checks after it
    found: list[str] = field(default_factory=list)  # kinds the checks before this one found

    @property
    def err(self) -> torch.Tensor:
        return self.cand - self.ref

    def ref_input(self, i: int = 0) -> torch.Tensor | None:
        """The value of the i-th tensor input of the reference call that made this stage."""
        rec = self.stage.ref
        if rec is None or not rec.inputs or i >= len(rec.inputs):
            return None
        src = self.ref_records[rec.inputs[i]]
        return None if src.value is None else src.value.to(torch.float64)


def _within(st, c: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """Per element, whether `c` is within the stage's tolerance of `r` (`st`: its Stats; allclose's rule)."""
    return (c - r).abs() <= st.atol + st.rtol * r.abs()


def _norm(t: torch.Tensor) -> float:
    return float(t.norm()) if t.numel() else 0.0


def _explains(model: torch.Tensor, ctx: Context) -> float:
    """Fraction of the error left after the model (0 = fully explained)."""
    e = _norm(ctx.err)
    return _norm(ctx.cand - model) / e if e > 0 else 1.0


# ------------------------------------------------------------------ checks
MASK_MAGNITUDE = 1e4  # a finite value at least this large standing for ±inf: a mask (-1e4, -1e9, finfo.min)


def check_mask_value(ctx: Context) -> list[Finding]:
    """One side holds ±inf where the other holds a large finite value of the same sign, and nowhere
    else is one side finite and the other not: a mask written as a large number on one side and as
    infinity on the other (``masked_fill(m, -inf)`` against a bias of -1e9).  After a softmax both
    give zeros; allclose still counts every such element out of tolerance."""
    r, c = ctx.ref, ctx.cand
    fr, fc = torch.isfinite(r), torch.isfinite(c)
    odd = fr ^ fc
    n = int(odd.sum())
    if n == 0:
        return []
    inf_side, fin_side = torch.where(fr, c, r), torch.where(fr, r, c)
    masked = odd & (torch.sign(inf_side) == torch.sign(fin_side)) & (fin_side.abs() >= MASK_MAGNITUDE)
    if int(masked.sum()) != n:
        return []
    at = tuple(int(i) for i in torch.nonzero(masked)[0])
    ref_inf = bool(~fr[at])
    inf_name, fin_name = ("reference", "candidate") if ref_inf else ("candidate", "reference")
    value = float(fin_side[at])
    both = fr & fc
    s = ctx.stage.stats
    agree = bool(both.any()) and bool(_within(s, c[both], r[both]).all())
    rest = ("every other element agrees within tolerance" if agree else
            "the other elements differ too (max_abs " + f"{float((c - r).abs()[both].max()):.3g})" if both.any() else
            "no element is finite on both sides")
    return [Finding("mask_value", f"the {inf_name} holds {'-' if value < 0 else '+'}inf at {n} of {r.numel()} elements "
                    f"where the {fin_name} holds a large finite value ({value:.3g} at {list(at)}): the same mask "
                    f"written two ways; {rest}", 0.9 if agree else 0.6)]


def check_nan_inf(ctx: Context) -> list[Finding]:
    s = ctx.stage.stats
    if s is None or not (s.cand_nan > s.ref_nan or s.cand_inf > s.ref_inf):
        return []
    if "mask_value" in ctx.found:
        return []  # (the candidate's infinities are a mask the reference writes as a large number)
    bad = (~torch.isfinite(ctx.cand)) & torch.isfinite(ctx.ref)
    region = check_region(ctx)  # (NaN among the garbage of a block never written: the block is the finding)
    unwritten = [f for f in region if f.kind == "unwritten_region"]
    ctx.stop = True
    idx = torch.nonzero(bad)
    first = tuple(int(i) for i in idx[0]) if len(idx) else ()
    rows = sorted({int(i[0]) for i in idx[:1000]}) if len(idx) and idx.shape[1] else []
    return unwritten + [Finding("nan_inf", f"candidate produces {int(bad.sum())} non-finite values where the reference is finite "
                    f"({s.cand_nan} NaN, {s.cand_inf} Inf), first at index {list(first)}"
                    + (f"; along axis 0 they sit in {len(rows)} of {ctx.ref.shape[0]} slices" if rows else ""),
                    0.85 if unwritten else 0.95)]


def check_nonfinite_both(ctx: Context) -> list[Finding]:
    """Non-finite values on both sides at the same elements: NaN in the reference itself (torch.allclose,
    KernelBench's rule, accepts no NaN, however the candidate computes it), or infinities of the other sign."""
    r, c = ctx.ref, ctx.cand
    out = []
    nan = torch.isnan(r) & torch.isnan(c)
    n = int(nan.sum())
    if n:
        at = [int(i) for i in torch.nonzero(nan)[0]]
        out.append(Finding("nan_inf", f"the reference itself holds NaN at {n} of {r.numel()} elements (first at {at}), "
                           f"where the candidate does too: torch.allclose (KernelBench's rule, equal_nan=False) accepts "
                           f"no NaN, so this stage fails whatever the candidate computes -- the reference's inputs or "
                           f"its computation give NaN", 0.9))
    flipped = torch.isinf(r) & torch.isinf(c) & (torch.sign(r) != torch.sign(c))
    n = int(flipped.sum())
    if n:
        at = tuple(int(i) for i in torch.nonzero(flipped)[0])
        out.append(Finding("sign", f"the candidate holds {'-' if float(c[at]) < 0 else '+'}inf at {n} of {r.numel()} "
                           f"elements where the reference holds the infinity of the other sign (first at {list(at)})",
                           0.9))
    return out


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1]) if t.dim() >= 1 and t.numel() else t.reshape(1, -1)


def check_region(ctx: Context) -> list[Finding]:
    """An unwritten or wrong block of rows in the candidate's own [rows, last-dim] layout, else a block
    along one axis of it (`_region_along_axes`); a candidate that is zero everywhere the reference is not."""
    c = ctx.cand_native
    if c.numel() > 1 and not bool(c.any()) and bool(ctx.ref.any()):
        ctx.stop = True
        return [Finding("unwritten_region", f"the candidate is 0 in all {c.numel()} elements, where the reference is "
                        f"not ({int((ctx.ref != 0).sum())} nonzero): nothing was written to it, or it was computed "
                        f"into another buffer, or from an input that is all zero", 0.9)]
    found = _rows_region(ctx)
    return found or _region_along_axes(ctx)


def _rows_region(ctx: Context) -> list[Finding]:
    c = _rows(ctx.cand_native)  # the native layout is what the kernel wrote
    try:
        r = _rows(_native_ref(ctx))
    except Exception:
        return []
    if r is None or r.shape != c.shape:
        return []
    s = ctx.stage.stats
    tol = s.atol + s.rtol * r.abs()
    bad_rows = ((c - r).abs() > tol).any(dim=1) | ~torch.isfinite(c).all(dim=1)
    nbad = int(bad_rows.sum())
    m = c.shape[0]
    if nbad == 0 or nbad == m:
        return []
    idx = torch.nonzero(bad_rows).flatten()
    lo, hi = int(idx.min()), int(idx.max())
    if hi - lo + 1 != nbad:  # not one contiguous block
        return []
    shape = "×".join(map(str, ctx.cand_native.shape))
    where = f"rows {lo}..{hi} ({nbad} of {m}) of the candidate's [{m}, {c.shape[1]}] view of its {shape} output"
    return _block_finding(c[lo:hi + 1], lo, hi, m, where, "row", f"{m} rows", "{}-row tiles", _scale(ctx))


# a value this many times the reference's largest magnitude is no result of the stage's arithmetic
UNINITIALISED_FACTOR = 1e12


def _looks_uninitialised(region: torch.Tensor, scale: float) -> bool:
    """Whether every value of a block is one uninitialised float memory holds and a computation does not give:
    zero or subnormal (below float32's smallest normal), non-finite, or astronomically large; and not all zero
    (that is a constant, said otherwise)."""
    if not region.numel() or not bool(region.ne(0).any()):
        return False
    v = region.abs()
    odd = (v < torch.finfo(torch.float32).tiny) | ~torch.isfinite(region) | (v > UNINITIALISED_FACTOR * max(scale, 1.0))
    return bool(odd.all())


def _block_finding(region: torch.Tensor, lo: int, hi: int, n: int, where: str, unit: str, count: str,
                   tiles: str, scale: float | None = None) -> list[Finding]:
    """The finding for a block [lo, hi] of `n` along one axis that holds all of a stage's error: unwritten
    when the block holds one constant, a boundary when it is the last, partial tile; none otherwise.
    `where` names the block, `unit` what else matches ("row"), `count` how `n` reads ("12 rows"), `tiles`
    the tiles' words with {} for their size ("{}-row tiles")."""
    block = _block_size(lo, n) if hi == n - 1 else None
    tail = (f"; {count} = {lo // block}×{block} + {n - lo}: consistent with {tiles.format(block)} whose last, "
            f"partial one is ") if block else ""
    if region.numel() and float(region.max() - region.min()) == 0.0:
        return [Finding("unwritten_region", f"{where} are all {float(region.flatten()[0]):g} while every other {unit} "
                        f"matches: a block the kernel never wrote" + (tail + "skipped" if block else ""), 0.95)]
    if scale is not None and _looks_uninitialised(region, scale):
        return [Finding("unwritten_region", f"{where} hold only values no arithmetic on this stage's values gives "
                        f"(zeros, subnormal numbers below {torch.finfo(torch.float32).tiny:.3g}, magnitudes beyond "
                        f"{UNINITIALISED_FACTOR:.0e} × the reference's largest, or NaN) while every other {unit} matches: "
                        f"memory the kernel never wrote, holding whatever it held" + (tail + "skipped" if block else ""),
                        0.9)]
    if block:
        return [Finding("boundary", f"error confined to {where}{tail}computed wrongly", 0.8)]
    return []


def _region_along_axes(ctx: Context) -> list[Finding]:
    """`check_region` along any one axis of the candidate's own layout: the elements out of tolerance
    are exactly those whose index along axis d lies in one block [lo, hi] (every other element matches),
    as a kernel leaves the last tile of a tiled axis unwritten (columns of a GEMM, rows of an image)."""
    c = ctx.cand_native
    try:
        r = _native_ref(ctx)
    except Exception:
        return []
    if r.shape != c.shape or c.dim() < 1 or c.numel() < 2:
        return []
    s = ctx.stage.stats
    bad = ((c - r).abs() > s.atol + s.rtol * r.abs()) | ~torch.isfinite(c)
    total = int(bad.sum())
    if total == 0 or total == bad.numel():
        return []
    shape = "×".join(map(str, c.shape))
    for d in range(c.dim() - 1, -1, -1):
        n = c.shape[d]
        if n < 2:
            continue
        along = bad.movedim(d, 0).reshape(n, -1)
        hit = along.any(dim=1)
        idx = torch.nonzero(hit).flatten()
        lo, hi = int(idx.min()), int(idx.max())
        if hi - lo + 1 != len(idx) or hi - lo + 1 == n:
            continue
        block_bad = along[lo:hi + 1]
        if float(block_bad.float().mean()) < 0.9:  # (the block itself is wrong throughout, or nearly)
            continue
        where = (f"indices {lo}..{hi} ({hi - lo + 1} of {n}) along axis {d} of the candidate's {shape} output "
                 f"(its own layout)")
        found = _block_finding(c.movedim(d, 0)[lo:hi + 1], lo, hi, n, where, "element", f"{n}",
                               "{}-wide tiles along that axis", _scale(ctx))
        if found:
            return found
    return []


def unwritten_that_varies(stage: Stage, ref_value: torch.Tensor, cand_value: torch.Tensor, d: dict) -> Finding | None:
    """The stage's error fills one block of the candidate's output (its own layout: a block of rows of the
    [rows, last axis] view, else along one axis) and every element that differs between two runs on the same
    inputs (`d`: modelstate.bitwise_difference, with its spans) lies inside that block: memory the kernel never
    wrote, holding whatever it held (an output from ``torch.empty`` left partly unwritten), which is why it
    changes from run to run.  None when the error or the run-to-run difference reaches beyond one block."""
    if stage.stats is None or stage.ref is None or stage.cand is None or not d.get("span") or cand_value is None \
            or ref_value is None or not cand_value.is_floating_point():
        return None
    c = cand_value.detach().to(torch.float64)
    try:
        r = from_ref_layout(ref_value.detach().to(torch.float64).to(c.device), tuple(stage.cand.shape),
                            stage.pair_transform)
    except (RuntimeError, ValueError):
        return None
    if r.shape != c.shape or c.dim() == 0 or len(d["span"]) != c.dim():
        return None
    st = stage.stats
    bad = ((c - r).abs() > st.atol + st.rtol * r.abs()) | ~torch.isfinite(c)
    if not bool(bad.any()) or bool(bad.all()):
        return None
    shape = "×".join(map(str, c.shape))
    rows = bad.reshape(-1, c.shape[-1])
    views = [(rows, d.get("row_span"), f"rows {{}}..{{}} ({{}} of {rows.shape[0]}) of the candidate's "
              f"[{rows.shape[0]}, {rows.shape[1]}] view of its {shape} output", "{}-row tiles")]
    views += [(bad.movedim(a, 0).reshape(c.shape[a], -1), d["span"][a],
               f"indices {{}}..{{}} ({{}} of {c.shape[a]}) along axis {a} of the candidate's {shape} output",
               "{}-wide tiles along that axis") for a in range(c.dim() - 1, -1, -1)]
    for along, span, where, tiles in views:
        n = along.shape[0]
        idx = torch.nonzero(along.any(dim=1)).flatten()
        lo, hi = int(idx.min()), int(idx.max())
        if n < 2 or hi - lo + 1 != len(idx) or hi - lo + 1 == n or not span or not lo <= span[0] <= span[1] <= hi:
            continue
        if float(along[lo:hi + 1].float().mean()) < 0.9:  # (the block is wrong throughout, or nearly)
            continue
        block = _block_size(lo, n) if hi == n - 1 else None
        tail = (f"; {n} = {lo // block}×{block} + {n - lo}: consistent with {tiles.format(block)} whose last, "
                f"partial one is never written") if block else ""
        return Finding("unwritten_region", f"{where.format(lo, hi, hi - lo + 1)} hold values the kernel never wrote, "
                       f"while everything outside them matches: they hold whatever the memory held (an output "
                       f"allocated uninitialised, torch.empty or np.empty, left partly unwritten) -- running the candidate twice on the same inputs changes "
                       f"{d['elements']} of {d['numel']} elements, all inside that block (max difference "
                       f"{float(d.get('max_abs', 0.0)):.3g}){tail}", 0.95)
    return None


def _scale(ctx: Context) -> float:
    """The reference stage's largest finite magnitude."""
    fin = ctx.ref[torch.isfinite(ctx.ref)]
    return float(fin.abs().max()) if fin.numel() else 1.0


def _block_size(start: int, total: int) -> int | None:
    """Smallest power of two larger than the tail `total - start` that divides `start`: the
    tile size that leaves exactly this tail (a larger one is possible, but less likely)."""
    tail = total - start
    if start <= 0 or tail <= 0:
        return None
    b = 1
    while b <= tail:
        b *= 2
    return b if start % b == 0 else None


def _native_ref(ctx: Context) -> torch.Tensor:
    """The reference value in the candidate's own layout."""
    st = ctx.stage
    return from_ref_layout(ctx.ref, tuple(st.cand.shape), st.pair_transform)


def params_of(rec, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The parameters and buffers a record's producing call read, by qualified name: those the
    capture saw it read (`rec.params`), else, for a module's output, the module's own."""
    names = list(getattr(rec, "params", ()) or ())
    if not names and rec is not None and rec.kind == "module":
        prefix = rec.name.split("#")[0].split("[")[0] + "."
        names = [n for n in params if n.startswith(prefix) and "." not in n[len(prefix):]]
    return {n: params[n] for n in names if n in params}


# how many reference records upstream of a stage are searched for the bias its error may be missing
# (a candidate that left a projection's bias out may pair only at the residual sum after it)
UPSTREAM_RECORDS = 32
# a per-channel error is a multiple of a bias when what the multiple leaves is this small, relative
BIAS_FIT = 1e-3


def _upstream(rec, records: list, limit: int = UPSTREAM_RECORDS) -> list:
    """Records upstream of `rec` along its recorded dataflow, nearest first."""
    out, seen = [], set()
    frontier = [i for i in getattr(rec, "inputs", ()) or ()]
    while frontier and len(out) < limit:
        nxt = []
        for i in frontier:
            i = getattr(i, "index", i)
            if i in seen or not isinstance(i, int) or not 0 <= i < len(records):
                continue
            seen.add(i)
            out.append(records[i])
            nxt += list(records[i].inputs)
        frontier = nxt
    return out[:limit]


def _bias_of(ctx: Context, n: int) -> list[tuple[str, torch.Tensor]]:
    """1-D parameters of length `n` that may be the stage's bias: those the reference call read,
    those the candidate call read, then those read upstream of the reference stage (nearest first)."""
    out = []
    seen = set()
    sources = [(ctx.stage.ref, ctx.ref_params), (ctx.stage.cand, ctx.cand_params)]
    sources += [(rec, ctx.ref_params) for rec in _upstream(ctx.stage.ref, ctx.ref_records)]
    for rec, params in sources:
        for pname, p in params_of(rec, params).items():
            if p.dim() == 1 and p.shape[0] == n and pname not in seen:
                seen.add(pname)
                out.append((pname, p.detach().to(torch.float64)))
    return out


def _known_as(ctx: Context, name: str) -> str:
    """A reference parameter's name with the name the candidate declares it under, where that differs (a head
    re-declared as `fc_bias` for `fc.bias`): "fc.bias (the candidate's fc_bias)"."""
    if name not in ctx.ref_params or not ctx.cand_params or name in ctx.cand_params:
        return name
    try:
        counterpart = ctx.rename if ctx.rename is not None else map_params_by_use(
            param_map(ctx.ref_params, ctx.cand_params), ctx.ref_records, ctx.cand_records, ctx.ref_params,
            ctx.cand_params)
    except (RuntimeError, ValueError):
        return name
    theirs = [c for c, r in counterpart.items() if r == name and c != name]
    return f"{name} (the candidate's {theirs[0]})" if len(theirs) == 1 else name


def _per_channel(err: torch.Tensor, axis: int) -> torch.Tensor:
    """The error's mean over every axis but `axis`."""
    return err.movedim(axis, -1).reshape(-1, err.shape[axis]).mean(dim=0)


def _broadcast(v: torch.Tensor, shape: tuple, axis: int) -> torch.Tensor:
    view = [1] * len(shape)
    view[axis] = shape[axis]
    return v.reshape(view)


def check_bias_offset(ctx: Context) -> list[Finding]:
    """An additive error that depends on one axis only: a bias left out (or added twice, or scaled),
    matched against the 1-D parameters the stage and the reference upstream of it read."""
    if ctx.ref.dim() == 0:
        return []
    err = ctx.err
    shape = tuple(err.shape)
    # the last axis first (a linear layer's channels), then the others (a convolution's, NCHW)
    for axis in [err.dim() - 1, *range(err.dim() - 1)]:
        n = shape[axis]
        if n < 2 and err.dim() > 1:
            continue
        per_channel = _per_channel(err, axis)
        if _explains(ctx.ref + _broadcast(per_channel, shape, axis), ctx) > EXPLAINED:
            continue
        where = f"along axis {axis} (size {n})"
        pn = _norm(per_channel)
        for name, b in _bias_of(ctx, n):
            shown = _known_as(ctx, name)
            b = b.to(per_channel.device)
            bb = float((b * b).sum())
            if bb == 0:
                continue
            k = float((per_channel * b).sum()) / bb
            if _norm(per_channel - k * b) > BIAS_FIT * max(pn, 1e-30):
                continue
            big = f"max |{name}| {float(b.abs().max()):.3g}"
            if abs(k + 1) < 1e-3:
                return [Finding("missing_bias", f"candidate = reference − {shown} {where}, in all {n} channels "
                                f"({big}): the bias is not added", 0.95)]
            if abs(k - 1) < 1e-3:
                return [Finding("offset", f"candidate = reference + {shown} {where}, in all {n} channels "
                                f"({big}): the bias is added twice", 0.95)]
            return [Finding("offset", f"candidate = reference {'+' if k > 0 else '−'} {abs(k):.4g} × {name} {where} "
                            f"({big}): the bias enters scaled by {1 + k:.4g} instead of 1", 0.9)]
        spread = float(per_channel.max() - per_channel.min())
        if spread <= 1e-6 * (1 + float(per_channel.abs().max())):
            return [Finding("offset", f"candidate = reference + {float(per_channel.mean()):.6g} everywhere "
                            f"(a constant offset)", 0.85)]
        if n == err.numel():
            continue  # one value per element "explains" any error: only a parameter it matches says something
        return [Finding("offset", f"additive error {where}, one value per channel from {float(per_channel.min()):.4g} "
                        f"to {float(per_channel.max()):.4g}, matching no 1-D parameter the stage or the reference "
                        f"upstream of it read (± or scaled)", 0.75)]
    return []


def _reduction_sizes(ctx: Context) -> set[int]:
    """How many elements a normalisation producing this stage may have reduced over: the trailing axes
    (a LayerNorm over one or several), all but the channels (a BatchNorm) and, for a group norm, a
    group's channels by the rest."""
    shape = tuple(ctx.ref.shape)
    out = {math.prod(shape[k:]) for k in range(1, len(shape))}
    src = ctx.ref_input(0)
    if src is not None and ctx.ref.numel() and src.numel() % ctx.ref.numel() == 0:
        out.add(src.numel() // ctx.ref.numel())  # a reduction's: what it read per element it gave
    if len(shape) >= 2:
        out.add(math.prod(shape) // max(shape[1], 1))
        if "group" in ((ctx.stage.ref.op if ctx.stage.ref is not None else "") or "").lower():
            rest = math.prod(shape[2:])
            out |= {shape[1] // g * rest for g in range(1, shape[1] + 1) if shape[1] % g == 0}
    return {d for d in out if d > 1}


def _constants(shape: tuple[int, ...], sizes: frozenset | set = frozenset()) -> list[tuple[float, str, int | None, str]]:
    """Factors a scale error is compared with: (value, formula, the size d it uses, what a factor
    of that form would be consistent with).  Sizes are the stage's own, then common head sizes;
    `sizes` (what a normalisation may have reduced over) add the variance forms."""
    out: list[tuple[float, str, int | None, str]] = [(2.0, "2", None, ""), (0.5, "1/2", None, "")]
    for d in sorted(set(sizes)):
        out += [(d / (d - 1), f"d/(d−1), d = {d}", d, "a variance divided by d−1 where one divided by d is expected"),
                ((d - 1) / d, f"(d−1)/d, d = {d}", d, "a variance divided by d where one divided by d−1 is expected")]
    for d in sorted(set(sizes) - set(shape)):
        out += [(math.sqrt((d - 1) / d), f"√((d−1)/d), d = {d}", d,
                 "a variance divided by d−1 where one divided by d is expected"),
                (math.sqrt(d / (d - 1)), f"√(d/(d−1)), d = {d}", d,
                 "a variance divided by d where one divided by d−1 is expected")]
    for d in sorted({x for x in shape if x > 1} | {8, 16, 32, 64, 128}):
        out += [(math.sqrt(d), f"√d, d = {d}", d, "a 1/√d factor left out"),
                (1 / math.sqrt(d), f"1/√d, d = {d}", d, "a 1/√d factor applied where none belongs, or twice"),
                (float(d), f"d = {d}", d, "a sum over d elements where their mean is expected"),
                (1.0 / d, f"1/d, d = {d}", d, "a mean over d elements where their sum is expected"),
                (math.sqrt((d - 1) / d), f"√((d−1)/d), d = {d}", d,
                 "a variance divided by d−1 where one divided by d is expected"),
                (math.sqrt(d / (d - 1)), f"√(d/(d−1)), d = {d}", d,
                 "a variance divided by d where one divided by d−1 is expected")]
    return out


# a scale "is" one of the constants when it is within this relative distance of it
SCALE_MATCH = 2e-3


def _name_scale(s: float, shape, sizes: frozenset | set = frozenset()) -> tuple[str, bool]:
    """Words relating a scale factor to the nearest simple constant, if one is within SCALE_MATCH:
    the formula and, when its d is one of the stage's own sizes, what the factor is consistent with.
    Returns (words, whether a constant matched)."""
    value, formula, d, meaning = min(_constants(shape, sizes), key=lambda c: abs(c[0] - s) / abs(c[0]))
    if abs(value - s) / abs(value) >= SCALE_MATCH:
        return "", False
    if abs(value - s) > 0.05 * abs(value - 1):
        return "", False  # (a constant close to 1, d/(d−1) for a large d, matches only what is closer to it still)
    text = f" ≈ {formula} ({value:.6g})"
    if meaning and (d in shape or d in sizes):
        text += f": consistent with {meaning}"
    return text, True


def _per_row_scale(ctx: Context) -> Finding | None:
    """One scale factor per row of the last axis (a normalisation's statistics off by a factor)."""
    r, c = _rows(ctx.ref), _rows(ctx.cand)
    if r.shape[0] < 2 or r.shape[1] < 2:
        return None
    rr = (r * r).sum(dim=1)
    ok = rr > 0
    if not bool(ok.all()):
        return None
    k = (c * r).sum(dim=1) / rr
    if _norm(c - k[:, None] * r) > EXPLAINED * max(_norm(ctx.err), 1e-30):
        return None
    if "unwritten_region" in ctx.found or "boundary" in ctx.found or bool((k == 0).any()):
        return None  # rows left at zero are a region the kernel did not write, not a factor of 0
    lo, hi, med = float(k.min()), float(k.max()), float(k.median())
    # (factors that differ by more than a constant's match are no one constant: none is named)
    words = _name_scale(med, tuple(ctx.ref.shape))[0] if med and (hi - lo) / abs(med) < 1e-4 else ""
    return Finding("scale", f"candidate = reference × one factor per row of the last axis (size {r.shape[1]}), "
                   f"from {lo:.6g} to {hi:.6g}, median {med:.6g}{words}", 0.85)


def check_scale(ctx: Context) -> list[Finding]:
    r, c = ctx.ref.flatten(), ctx.cand.flatten()
    rr = float((r * r).sum())
    if rr == 0:
        return []
    s = float((c * r).sum()) / rr
    if abs(s - 1) < 1e-6:
        return []
    if _explains(s * ctx.ref, ctx) > EXPLAINED:
        row = _per_row_scale(ctx)
        return [row] if row is not None else []
    if abs(s + 1) < 1e-3:
        return [Finding("sign", f"candidate = {s:.6g} × reference: the sign is flipped", 0.95)]
    words, named = _name_scale(s, tuple(ctx.ref.shape) + tuple(ctx.stage.cand.shape if ctx.stage.cand else ()),
                               _reduction_sizes(ctx))
    return [Finding("scale", f"candidate = {s:.6g} × reference, one factor for all {ctx.ref.numel()} elements{words}",
                    0.9 if named else 0.8)]


# a shifted candidate must agree with the reference on at least this share of each axis's slices
SHIFT_MIN_OVERLAP = 0.5


def check_shift(ctx: Context) -> list[Finding]:
    """The candidate is the reference moved along one axis: rolled (parts concatenated in the other
    order, ``cat([b, a])`` for ``cat([a, b])``), or shifted by k with the slices moved past the border
    differing (padding put on one side, an index off by k)."""
    r, c = ctx.ref, ctx.cand
    st = ctx.stage.stats
    for d in range(r.dim()):
        n = r.shape[d]
        if n < 2:
            continue
        rs, cs = r.movedim(d, 0).reshape(n, -1), c.movedim(d, 0).reshape(n, -1)
        for first, sign in ((0, 1), (n - 1, -1)):  # the candidate's first slice found further on, its last earlier
            fit = _within(st, cs[first], rs).all(dim=1)
            if bool(fit[first]):
                continue  # (that slice is where it belongs: no shift seen from this end)
            found = torch.nonzero(fit).flatten().tolist()
            k = next((abs(j - first) for j in (found if sign > 0 else found[::-1]) if (j - first) * sign > 0), 0)
            if not k:
                continue
            rolled = torch.roll(rs, -sign * k, dims=0)
            rows = _within(st, cs, rolled).all(dim=1)
            if bool(rows.all()):
                return [Finding("permutation", f"candidate = the reference rolled by {k} along axis {d} (size {n}): "
                                f"its first {n - k if sign > 0 else k} and last {k if sign > 0 else n - k} slices in the "
                                f"other order -- parts concatenated the other way round, or an index wrapped by {k}",
                                0.9)]
            inner = rows[:n - k] if sign > 0 else rows[k:]
            if bool(inner.all()) and n - k >= SHIFT_MIN_OVERLAP * n:
                way = "towards the start" if sign > 0 else "towards the end"
                return [Finding("boundary", f"candidate = the reference shifted by {k} along axis {d} (size {n}), "
                                f"{way}: {n - k} slices agree once moved, the {k} at the border do not -- padding put on "
                                f"one side only, or an index off by {k}", 0.85)]
    return _shift_two_axes(ctx)


# a shift along two axes at once is searched up to this many elements along each (an off-by-one or -two
# padding or window offset), on stages of at most this many elements
SHIFT_2D_MAX = 3
SHIFT_2D_NUMEL = 1 << 22


def _overlap(k: int, n: int) -> tuple[slice, slice]:
    """For a shift by `k` along an axis of `n`: (the candidate's indices that have a source, those sources)."""
    return (slice(k, n), slice(0, n - k)) if k > 0 else (slice(0, n + k), slice(-k, n))


def _shift_two_axes(ctx: Context) -> list[Finding]:
    """The candidate is the reference moved by (k1, k2) along two axes at once, the elements moved past
    the border differing: cand[.., i, .., j] = ref[.., i − k1, .., j − k2] wherever that index exists (a
    window or padding off by one in both spatial axes of an image: a 'same' convolution padded on the
    top and left only, its output cropped to the input's size).  Only reported where the same elements
    compared unmoved do not agree (a reference constant along the axes shows no shift)."""
    r, c = ctx.ref, ctx.cand
    st = ctx.stage.stats
    if r.dim() < 2 or r.numel() > SHIFT_2D_NUMEL or c.shape != r.shape:
        return []
    for d1, d2 in itertools.combinations(range(r.dim()), 2):
        n1, n2 = r.shape[d1], r.shape[d2]
        if n1 < 3 or n2 < 3:
            continue
        rm, cm = r.movedim((d1, d2), (0, 1)), c.movedim((d1, d2), (0, 1))
        reach1 = [k for k in range(-SHIFT_2D_MAX, SHIFT_2D_MAX + 1) if k and n1 - abs(k) >= SHIFT_MIN_OVERLAP * n1]
        reach2 = [k for k in range(-SHIFT_2D_MAX, SHIFT_2D_MAX + 1) if k and n2 - abs(k) >= SHIFT_MIN_OVERLAP * n2]
        for k1, k2 in sorted(itertools.product(reach1, reach2), key=lambda kk: abs(kk[0]) + abs(kk[1])):
            (c1, s1), (c2, s2) = _overlap(k1, n1), _overlap(k2, n2)
            moved = cm[c1, c2]
            if not bool(_within(st, moved, rm[s1, s2]).all()) or bool(_within(st, moved, rm[c1, c2]).all()):
                continue
            border = cm.numel() - moved.numel()
            ways = [f"by {abs(k)} along axis {d} (size {n}) towards the {'end' if k > 0 else 'start'}"
                    for k, d, n in ((k1, d1, n1), (k2, d2, n2))]
            return [Finding("boundary", f"candidate = the reference shifted along two axes at once, {ways[0]} and "
                            f"{ways[1]}: the {moved.numel()} elements that overlap agree once moved, the {border} "
                            f"at the border do not -- the padding (or the window's start) off by ({k1}, {k2}) in "
                            f"both axes: padding put on one side only, the output cropped to the right size", 0.85)]
    return []


def check_permutation(ctx: Context) -> list[Finding]:
    shape = tuple(ctx.ref.shape)
    if ctx.ref.dim() < 2 or ctx.ref.dim() > 6:
        return []
    for p in itertools.permutations(range(ctx.ref.dim())):
        if list(p) == sorted(p) or tuple(shape[i] for i in p) != shape:
            continue
        if bool(_within(ctx.stage.stats, ctx.cand.permute(*p), ctx.ref).all()):
            moved = [i for i in range(len(p)) if p[i] != i]
            axes = " and ".join(str(i) for i in moved) if len(moved) == 2 else str(tuple(p))
            what = f"axes {axes} swapped" if len(moved) == 2 else f"axes permuted by {tuple(p)}"
            return [Finding("permutation", f"candidate equals the reference with {what} (shape {list(shape)}): "
                            f"an index mix-up in the kernel's writes or reads", 0.95)]
    return _merged_out_of_order(ctx)


# the candidate holds a reshaped tensor's values in another axis order within this relative error
MERGED_REL_ERR = 1e-5


def _merged_out_of_order(ctx: Context) -> list[Finding]:
    """The reference stage only reshapes what it reads (`y = t.reshape(B, L, H * D)`) and the candidate
    holds `t`'s values with its axes in another order before the same merge: axes merged without the
    transpose back (a head merge from (B, H, L, D) without ``transpose(1, 2)``)."""
    src = ctx.ref_input(0)
    if src is None or src.numel() != ctx.ref.numel() or tuple(src.shape) == tuple(ctx.ref.shape) or \
            not torch.equal(src.reshape(ctx.ref.shape), ctx.ref):
        return []
    lay = best_layout(ctx.cand_native, src)
    if not permuted(lay.transform) or not lay.rel_err <= MERGED_REL_ERR:
        return []
    how = Pair(ref=0, cand=0, via="", confidence=1.0, transform=lay.transform).describe_transform()
    return [Finding("permutation", f"the reference's stage reshapes a {list(src.shape)} tensor to "
                    f"{list(ctx.ref.shape)}; the candidate holds that tensor's values with its axes in another order "
                    f"({how} brings them back): axes merged without the transpose or permute before the reshape", 0.9)]


def _weight_of(ctx: Context, k: int) -> tuple[str, torch.Tensor | None, torch.Tensor | None]:
    """A 2-D parameter the reference call read whose rows are `k` long, and a 1-D one (its bias)
    as long as its columns, if any.  Returns (name, weight, bias)."""
    read = params_of(ctx.stage.ref, ctx.ref_params)
    name, w = next(((n, p) for n, p in read.items() if p.dim() == 2 and p.shape[1] == k), ("", None))
    if w is None:
        return "", None, None
    b = next((p for n, p in read.items() if p.dim() == 1 and p.shape[0] == w.shape[0]), None)
    return name, w.detach(), (b.detach() if b is not None else None)


# stages after the paired reference stage that a candidate's kernel may cover (it returns the last)
WHAT_IF_STEPS = 4
# an elementwise stage's map, estimated from the reference's own (input, output) values, is trusted
# when each value is predicted from its neighbours to this fraction of the output's range
ELEMENTWISE_FIT = 1e-3


def _read_by_candidate(ctx: Context, p: torch.Tensor) -> bool:
    """Whether the candidate's call read a parameter holding `p`'s values (names may differ)."""
    for q in params_of(ctx.stage.cand, ctx.cand_params).values():
        if q.shape == p.shape and bool(torch.equal(q.detach().to(p.device), p.detach())):
            return True
    return False


def _elementwise_map(x: torch.Tensor, y: torch.Tensor):
    """The function y = f(x) of an elementwise stage, as linear interpolation between the reference's
    own pairs of values, or None when they are not one function of the other."""
    x, y = x.reshape(-1).to(torch.float64), y.reshape(-1).to(torch.float64)
    ok = torch.isfinite(x) & torch.isfinite(y)
    x, y = x[ok], y[ok]
    if x.numel() < 16:
        return None
    order = torch.argsort(x)
    xs, ys = x[order], y[order]
    span = float(ys.max() - ys.min()) or 1.0
    # each interior value predicted from its two neighbours
    dx = (xs[2:] - xs[:-2]).clamp_min(1e-300)
    t = (xs[1:-1] - xs[:-2]) / dx
    pred = ys[:-2] + t * (ys[2:] - ys[:-2])
    if float((pred - ys[1:-1]).abs().max()) > ELEMENTWISE_FIT * span:
        return None

    def f(q: torch.Tensor) -> torch.Tensor:
        flat = q.reshape(-1).to(torch.float64)
        i = torch.searchsorted(xs, flat).clamp(1, xs.numel() - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        w = (flat - x0) / (x1 - x0).clamp_min(1e-300)
        return (y0 + w * (y1 - y0)).reshape(q.shape)

    return f


def check_missing_parameter(ctx: Context) -> list[Finding]:
    """The candidate is the reference with a 1-D parameter its stage read (and the candidate's call
    did not) left out, possibly carried on through up to WHAT_IF_STEPS later reference stages that
    apply one elementwise function each (a kernel covering several stages returns the last; each
    function is read off the reference's own values): a bias left out inside a fused kernel."""
    rec = ctx.ref_records[ctx.stage.ref.index]
    ref_v = ctx.ref
    missing = [(n, p.detach().to(torch.float64).to(ref_v.device)) for n, p in params_of(rec, ctx.ref_params).items()
               if p.dim() == 1 and not _read_by_candidate(ctx, p)]
    if not missing or ref_v.dim() == 0:
        return []
    consumers: dict[int, list[int]] = {}
    for r in ctx.ref_records[rec.index + 1:]:
        for i in r.inputs:
            consumers.setdefault(getattr(i, "index", i), []).append(r.index)
    e = _norm(ctx.err)
    shape = tuple(ref_v.shape)
    for name, p in missing:
        shown = _known_as(ctx, name)
        for axis in [ref_v.dim() - 1, *range(ref_v.dim() - 1)]:
            if shape[axis] != p.shape[0]:
                continue
            value, chain = ref_v - _broadcast(p, shape, axis), [rec]
            for _ in range(WHAT_IF_STEPS + 1):
                if value.numel() == ctx.cand_native.numel() and e > 0:
                    left = _norm(ctx.cand_native.reshape(-1) - value.reshape(-1)) / e
                    if left <= EXPLAINED:
                        through = "" if len(chain) == 1 else (f", carried through {' → '.join(r.name for r in chain[1:])} "
                                                              f"(the stage whose value the candidate returns)")
                        return [Finding("missing_bias", f"candidate = the reference without {shown} at {rec.name} "
                                        f"{'along axis ' + str(axis) + ' ' if ref_v.dim() > 1 else ''}"
                                        f"(max |{name}| {float(p.abs().max()):.3g}){through}, to within "
                                        f"{100 * left:.2g}% of the error: the bias is not added", 0.95)]
                last = chain[-1]
                nxt = [ctx.ref_records[j] for j in consumers.get(last.index, ())]
                nxt = [r for r in nxt if not r.params and r.value is not None and last.value is not None
                       and r.value.numel() == last.value.numel()]
                if len(nxt) != 1:
                    break
                f = _elementwise_map(last.value, nxt[0].value)
                if f is None:
                    break
                value = f(value)
                chain.append(nxt[0])
    return []


def check_transposed_weight(ctx: Context) -> list[Finding]:
    x = ctx.ref_input(0)
    if x is None or x.dim() == 0:
        return []
    wname, w, b = _weight_of(ctx, x.shape[-1])
    if w is None:
        return []
    n_out, k = w.shape
    wd = w.to(torch.float64)
    # the [N, K] weight's memory read as a [K, N] matrix (what a kernel indexing w[k*N + n] computes)
    y = x @ wd.reshape(k, n_out)
    if b is not None and b.shape[0] == n_out:
        y = y + b.detach().to(torch.float64)
    y = y.reshape(ctx.ref.shape)
    if _norm(y - ctx.cand) <= EXPLAINED * max(_norm(ctx.err), 1e-30):
        return [Finding("transposed_weight", f"the stage matches x @ W' where W' is the [{n_out}, {k}] weight {wname}'s "
                        f"memory read as [{k}, {n_out}]: the kernel indexes the weight as w[k*{n_out} + n] instead of "
                        f"w[n*{k} + k]", 0.95)]
    return []


# a GEMM's operands reproduce the reference stage when what they leave is this small, relative to it
GEMM_FIT = 1e-4
GEMM_MAX_OPERANDS = 6


def _input_values(records: list, rec) -> list[tuple[str, torch.Tensor]]:
    """(name, float64 value) of each floating tensor a reference record's call consumed."""
    out = []
    for i in getattr(rec, "inputs", ()) or ():
        i = getattr(i, "index", i)
        src = records[i] if isinstance(i, int) and 0 <= i < len(records) else None
        if src is not None and src.value is not None and src.value.is_floating_point():
            out.append((src.name, src.value.detach().to(torch.float64)))
    return out


def _elementwise_chain(ctx: Context) -> list[tuple[Any, list]]:
    """(reference record, the elementwise maps that carry its value to the stage's) for the stage's own record
    and up to WHAT_IF_STEPS records upstream of it, each the one input of a one-to-one elementwise stage (a
    kernel covering a GEMM and the scaling or activation after it returns the last)."""
    rec, maps, out = ctx.ref_records[ctx.stage.ref.index], [], []
    for _ in range(WHAT_IF_STEPS + 1):
        out.append((rec, list(maps)))
        ins = [getattr(i, "index", i) for i in rec.inputs]
        big = [i for i in ins if ctx.ref_records[i].value is not None and ctx.ref_records[i].value.numel() > 1]
        if len(big) != 1 or rec.params or rec.value is None:
            break
        src = ctx.ref_records[big[0]]
        if src.value.numel() != rec.value.numel():
            break
        f = _elementwise_map(src.value, rec.value)
        if f is None:
            break
        maps.insert(0, f)
        rec = src
    return out


def _gemm_forms(ctx: Context, rec) -> list[tuple[str, torch.Tensor, str, torch.Tensor, bool, torch.Tensor]]:
    """The ways the record's value is a product A @ B (+ a bias along the last axis) of what its call read:
    (A's name, A, B's name, B's stored tensor, whether B is that tensor transposed, the bias or 0).
    Operands: the tensors it consumed, and the 2-D parameters it read, as stored or transposed (a Linear)."""
    ops = [(n, t, False, False) for n, t in _input_values(ctx.ref_records, rec) if t.dim() >= 2]
    for n, p in params_of(rec, ctx.ref_params).items():
        if p.dim() == 2 and p.is_floating_point():
            p = p.detach().to(torch.float64)
            ops += [(n, p, False, True), (n, p, True, True)]
    ops = ops[:GEMM_MAX_OPERANDS * 2]
    target = rec.value.detach().to(torch.float64) if rec.value is not None else None
    if target is None or target.dim() < 2:
        return []
    out = []
    for (na, a, ta, _), (nb, b, tb, _) in itertools.permutations(ops, 2):
        if ta or na == nb:
            continue
        bb = b.mT if tb else b
        if a.shape[-1] != bb.shape[-2]:
            continue
        try:
            y = torch.matmul(a.to(target.device), bb.to(target.device))
        except RuntimeError:
            continue
        if tuple(y.shape) != tuple(target.shape):
            continue
        rest = target - y
        bias = rest.reshape(-1, rest.shape[-1]).mean(dim=0)
        scale = max(_norm(target), 1e-30)
        if _norm(rest) <= GEMM_FIT * scale:
            bias = torch.zeros_like(bias)
        elif _norm(rest - bias) > GEMM_FIT * scale:
            continue
        out.append((na, a, nb, b, tb, bias))
    return out


def _misread(t: torch.Tensor, transposed: bool) -> torch.Tensor:
    """The operand a kernel gets when it indexes a matrix's memory the other way: a [K, N] B fetched at
    k + n*K (its memory read as [N, K], transposed); a stored-[N, K] weight used as W.T fetched at k*N + n
    (its memory read as [K, N])."""
    r, c = t.shape[-2], t.shape[-1]
    return t.reshape(*t.shape[:-2], c, r) if transposed else t.reshape(*t.shape[:-2], c, r).mT


def check_transposed_operand(ctx: Context) -> list[Finding]:
    """The stage (or an elementwise chain after it that one kernel covers) is a matrix product of what the
    reference call read, and the candidate is that product with one operand's memory indexed the other way
    round: B read transposed (``A @ B.T`` for a square B, B fetched at k + n*K in a tiled kernel), a weight
    read as [in, out], A read transposed.  Any opaque matmul: only the reference's operands are used."""
    if "transposed_weight" in ctx.found or ctx.ref.dim() < 2:
        return []
    e = _norm(ctx.err)
    if e == 0:
        return []
    for rec, maps in _elementwise_chain(ctx):
        for na, a, nb, b, tb, bias in _gemm_forms(ctx, rec):
            is_param = nb in ctx.ref_params
            tries = [(nb, "B", a, _misread(b, tb), b)]
            if na not in ctx.ref_params and a.dim() >= 2:
                tries.append((na, "A", _misread(a, False), b.mT if tb else b, a))
            for name, role, aa, bb, stored in tries:
                try:
                    y = torch.matmul(aa, bb) + bias
                except RuntimeError:
                    continue
                for f in maps:
                    y = f(y)
                if y.numel() != ctx.cand.numel():
                    continue
                left = _norm(ctx.cand - y.reshape(ctx.cand.shape)) / e
                if left > EXPLAINED:
                    continue
                shape = list(stored.shape[-2:])
                through = "" if rec.index == ctx.stage.ref.index else f", carried through the elementwise stages after {rec.name}"
                how = (f"read with its memory taken as {shape[::-1]}" if role == "B" and tb else
                       f"read with its memory taken as {shape[::-1]} and transposed (for a square matrix: the "
                       f"matrix transposed)")
                what = "a kernel indexing the weight w[k*N + n]" if is_param and tb else \
                    f"a kernel fetching {role}'s element ({'k, n' if role == 'B' else 'm, k'}) at the index of the transposed matrix"
                kind = "transposed_weight" if is_param else "transposed_operand"
                return [Finding(kind, f"the stage matches the matrix product at {rec.name} with its operand {role} = "
                                f"{name} ({'×'.join(map(str, shape))}) {how}{through}, to within {100 * left:.2g}% of "
                                f"the error: {what}", 0.95)]
    return []


def check_reduction_axis(ctx: Context) -> list[Finding]:
    r, c = ctx.ref, ctx.cand
    if r.dim() < 2 or (r < 0).any():
        return []
    ones = torch.ones((), dtype=torch.float64)
    if not torch.allclose(r.sum(-1), ones.expand(r.shape[:-1]), atol=1e-4):
        return []
    if torch.allclose(c.sum(-1), ones.expand(c.shape[:-1]), atol=1e-4):
        return []
    for ax in range(r.dim() - 1):
        if torch.allclose(c.sum(ax), ones.expand(c.sum(ax).shape), atol=1e-4):
            return [Finding("wrong_reduction_axis", f"reference rows sum to 1 along the last axis (size {r.shape[-1]}); "
                            f"the candidate's sum to 1 along axis {ax} (size {r.shape[ax]}) instead: softmax/normalisation "
                            f"over the wrong axis", 0.95)]
    return []


def check_precision(ctx: Context) -> list[Finding]:
    r32 = ctx.ref.to(torch.float32)
    for dtype, name in ((torch.float16, "float16"), (torch.bfloat16, "bfloat16")):
        rounded = r32.to(dtype).to(torch.float64)
        if _norm(rounded - ctx.ref) == 0:
            continue
        e = _norm(ctx.err)
        # the candidate is the reference rounded to half precision, up to a fraction of that rounding
        if e > 0 and _norm(ctx.cand - rounded) <= 0.5 * _norm(rounded - ctx.ref):
            unit = {torch.float16: 2 ** -11, torch.bfloat16: 2 ** -8}[dtype]
            left = _norm(ctx.cand - rounded) / max(_norm(rounded - ctx.ref), 1e-30)
            return [Finding("precision", f"candidate ≈ the reference rounded to {name} (unit roundoff {unit:.2g}; "
                            f"{100 * left:.0f}% of that rounding left unexplained): consistent with a {name} "
                            f"intermediate where float32 is expected", 0.85)]
    if "approximation" in ctx.found:
        return []  # a smooth function of the input explains the error already
    rel_err = ctx.err.abs() / ctx.ref.abs().clamp_min(1e-30)
    rel = float(rel_err.median())
    mags = [(2 ** -11, "float16/TF32 (10-bit mantissa)"), (2 ** -8, "bfloat16 (7-bit mantissa)")]
    for unit, name in mags:
        if unit / 8 <= rel <= unit * 2 and float(ctx.err.abs().max()) <= 64 * unit * float(ctx.ref.abs().max()):
            return [Finding("precision", f"median relative error {rel:.2g} is the size of {name} rounding ({unit:.2g}) "
                            f"and no other pattern explains it: consistent with reduced-precision arithmetic "
                            f"(a TF32 matmul, half-precision accumulators)", 0.5)]
    return []


APPROX_PER_BIN = 8
APPROX_MAX_BINS = 512


def check_approximation(ctx: Context) -> list[Finding]:
    # an elementwise function's error is a function of its input (or, failing that, of its value)
    x = ctx.ref_input(0)
    r = x.flatten() if x is not None and x.numel() == ctx.ref.numel() else ctx.ref.flatten()
    e = ctx.err.flatten()
    if r.numel() < 64 or _norm(e) == 0:
        return []
    if float(e.abs().max()) > 0.05 * max(float(r.abs().max()), 1e-30):
        return []  # not small
    order = torch.argsort(r)
    es = e[order]
    # bins of APPROX_PER_BIN sorted inputs: the error's mean per bin follows a smooth function closely, while
    # noise unrelated to the input keeps only about 1/APPROX_PER_BIN of its variance in the bin means
    bins = max(8, min(APPROX_MAX_BINS, r.numel() // APPROX_PER_BIN))
    chunks = torch.tensor_split(es, bins)
    means = torch.cat([ch.mean().expand(ch.numel()) for ch in chunks])
    total = float(((es - es.mean()) ** 2).sum())
    if total == 0:
        return []
    explained = 1 - float(((es - means) ** 2).sum()) / total
    if explained < 0.9:
        return []
    of = "input" if x is not None and x.numel() == ctx.ref.numel() else "value"
    detail = (f"small smooth error (max {float(e.abs().max()):.3g}) that is a function of the stage's {of} "
              f"({100 * explained:.0f}% of its variance explained by it alone)")
    known = _known_approximation(ctx, x) if of == "input" else None
    if known:
        detail += f"; {known}"
    else:
        detail += ": consistent with an approximated elementwise function"
    return [Finding("approximation", detail, 0.7)]


def _known_approximation(ctx: Context, x: torch.Tensor) -> str:
    """Whether the error is what a known approximation of a function of the stage's input would
    leave: each pair (exact, approximate) is tried where the reference equals the exact one."""
    import torch.nn.functional as F

    x = x.reshape(ctx.ref.shape)
    pairs = [("erf GELU", lambda t: F.gelu(t), "tanh-approximated GELU", lambda t: F.gelu(t, approximate="tanh"))]
    for exact_name, exact, approx_name, approx in pairs:
        try:
            if _norm(exact(x) - ctx.ref) > 1e-6 * max(_norm(ctx.ref), 1e-30):
                continue  # the reference is not this function of its input
            left = _norm(ctx.cand - approx(x)) / max(_norm(ctx.err), 1e-30)
        except Exception:
            continue
        if left <= 0.05:
            return (f"candidate − reference = {approx_name}(input) − {exact_name}(input) to within {100 * left:.1f}% "
                    f"of the error: consistent with {approx_name} where {exact_name} is expected")
    return ""


def _span_params(ctx: Context) -> dict[str, torch.Tensor]:
    """The parameters read by the candidate's records between the stage's inputs and its record: upstream of
    the record, up to (not past) records holding one of the reference stage's inputs (a head written as
    ``h @ W + b`` reads W in a record of its own, which pairs with nothing)."""
    rec = ctx.stage.cand
    if rec is None or not 0 <= rec.index < len(ctx.cand_records):
        return {}
    inputs = [v for _, v in _input_values(ctx.ref_records, ctx.ref_records[ctx.stage.ref.index])]
    st = ctx.stage.stats

    def is_input(r) -> bool:
        if r.value is None or r.kind == "input":
            return r.kind == "input"
        v = r.value.detach().to(torch.float64)
        return any(v.shape == x.shape and bool(_within(st, v, x.to(v.device)).all()) for x in inputs)

    out: dict[str, torch.Tensor] = {}
    seen, frontier = set(), [getattr(i, "index", i) for i in ctx.cand_records[rec.index].inputs]
    while frontier and len(seen) < UPSTREAM_RECORDS:
        i = frontier.pop(0)
        if i in seen or not isinstance(i, int) or not 0 <= i < len(ctx.cand_records):
            continue
        seen.add(i)
        r = ctx.cand_records[i]
        if is_input(r):
            continue
        out.update(params_of(r, ctx.cand_params))
        frontier += [getattr(j, "index", j) for j in r.inputs]
    return out


def check_other_weights(ctx: Context) -> list[Finding]:
    """The candidate's call read a parameter holding other values than its reference counterpart (the
    same name, else as `align.param_map` pairs them: by values, then shape by shape in creation order):
    the two models were built with other weights (parameters created in another order, another init),
    and the stage is wrong whatever its kernel does.  KernelBench copies nothing between the models."""
    cread = {**_span_params(ctx), **params_of(ctx.stage.cand, ctx.cand_params)}
    if not cread or not ctx.ref_params:
        return []
    counterpart = ctx.rename if ctx.rename is not None else map_params_by_use(
        param_map(ctx.ref_params, ctx.cand_params), ctx.ref_records, ctx.cand_records, ctx.ref_params, ctx.cand_params)
    found = []
    for cn, q in cread.items():
        rn = counterpart.get(cn)
        p = ctx.ref_params.get(rn) if rn is not None else None
        if p is None or p.numel() != q.numel() or not (p.is_floating_point() and q.is_floating_point()):
            continue
        if layout_of_equal(p, q) is not None:  # (the same values in another layout: a weight stored transposed)
            continue
        view = in_ref_layout(p, q)  # (a copy stored in another shape, transposed or flattened, holding other values)
        if view is None:
            continue
        stored = f", stored {view[1]} as {list(q.shape)}" if view[1] else ""
        found.append(f"{cn}" + (f" (reference {rn}{stored})" if rn != cn or stored else "")
                     + f": {describe_difference(p, view[0])}")
    if not found:
        return []
    more = f" and {len(found) - 2} more" if len(found) > 2 else ""
    return [Finding("other_weights", "the candidate's call reads parameters with other values than the reference's "
                    f"(built with other weights; KernelBench copies nothing between the models): "
                    + "; ".join(found[:2]) + more, 0.9)]


def _integer_findings(stage: Stage, rv: torch.Tensor, cv: torch.Tensor) -> list[Finding]:
    """Integer or boolean values (indices, counts, masks) compare exactly: which elements differ, not a
    fitted offset or scale."""
    if rv.numel() == 0:
        return []
    try:
        c = to_ref_layout(cv.detach(), tuple(stage.ref.shape), stage.pair_transform).to(rv.device)
    except (RuntimeError, ValueError):
        return []
    if c.shape != rv.shape:
        return []
    diff = c != rv
    n = int(diff.sum())
    if n == 0:
        return []
    at = tuple(int(i) for i in torch.nonzero(diff)[0])
    what = "booleans" if rv.dtype == torch.bool else "integers"
    return [Finding("integer_values", f"{n} of {rv.numel()} {what} differ (they compare exactly), first at {list(at)}: "
                    f"reference {rv[at].item()}, candidate {c[at].item()}"
                    + (" -- other indices picked (a tie broken otherwise, the wrong extreme or axis?)"
                       if "arg" in (stage.ref.op or "") or "topk" in (stage.ref.op or "") else ""), 0.8)]


CHECKS: list[Callable[[Context], list[Finding]]] = [
    check_mask_value, check_nan_inf, check_nonfinite_both, check_other_weights, check_region, check_reduction_axis,
    check_permutation, check_shift, check_transposed_weight, check_transposed_operand,
    check_bias_offset, check_missing_parameter, check_scale, check_approximation, check_precision,
]


def diagnose(stage: Stage, ref: Any, cand: Any, ref_params: dict[str, torch.Tensor] | None = None,
             cand_params: dict[str, torch.Tensor] | None = None, rename: dict[str, str] | None = None) -> list[Finding]:
    """Ranked findings for a stage with an error (empty when nothing explains it).  A root cause
    may be within tolerance itself (its error crosses tolerance only later): it is diagnosed too.
    `ref`/`cand` are the two traces; `*_params` the models' parameters and buffers by name; `rename` the
    candidate's parameter names -> the reference's, as the alignment paired them (else worked out here)."""
    if stage.stats is None or stage.ref is None or stage.cand is None:
        return []
    if stage.stats.ok and (stage.local is None or stage.local.max_abs == 0):
        return []
    rv, cv = ref.records[stage.ref.index].value, cand.records[stage.cand.index].value
    if rv is None or cv is None or rv.is_complex() or cv.is_complex():
        return []  # (the checks read real values: a complex stage is left to its numbers)
    if not rv.is_floating_point() and not cv.is_floating_point():
        return _integer_findings(stage, rv, cv)
    ref_v = rv.detach().to(torch.float64)
    cand_native = cv.detach().to(torch.float64)
    cand_v = to_ref_layout(cand_native, tuple(stage.ref.shape), stage.pair_transform)
    ctx = Context(stage, ref_v, cand_v, cand_native, ref.records, cand.records, dict(ref_params or {}),
                  dict(cand_params or {}), rename=rename)
    findings: list[Finding] = []
    nonfinite = not (bool(torch.isfinite(ref_v).all()) and bool(torch.isfinite(cand_v).all()))
    for check in CHECKS:
        if check is check_other_weights and nonfinite:
            # what the non-finite elements show is said; the checks from here on read the elements finite on
            # both sides, and none runs when those agree (a factor or an offset of NaN explains nothing)
            keep = torch.isfinite(ctx.ref) & torch.isfinite(ctx.cand)
            if not bool(keep.any()) or bool(_within(stage.stats, ctx.cand[keep], ctx.ref[keep]).all()):
                break
            ctx.ref, ctx.cand = torch.where(keep, ctx.ref, 0.0), torch.where(keep, ctx.cand, 0.0)
        try:
            findings += check(ctx)
        except Exception:  # a check that cannot apply to this stage says nothing
            continue
        ctx.found = [f.kind for f in findings]
        if ctx.stop:
            break
    exact = {"missing_bias", "offset", "scale", "sign", "permutation", "transposed_weight", "transposed_operand",
             "unwritten_region",
             "wrong_reduction_axis", "other_weights"}
    if any(f.kind in exact for f in findings):
        # an exact explanation makes the statistical ones noise (compare.py drops them too when a
        # rerun later shows run-to-run noise)
        findings = [f for f in findings if f.kind not in ("approximation", "precision")]
    if any(f.kind == "scale" for f in findings):
        # an error one factor explains: per-channel offsets matching no parameter are the same error described
        # again (data with per-channel means, scaled), not a second one
        findings = [f for f in findings if not (f.kind == "offset" and f.confidence < 0.8)]
    findings.sort(key=lambda f: -f.confidence)
    # one finding per kind: two checks that reach the same explanation of one stage (the bias by its per-channel
    # offset and by re-running the call without it) say one thing, the more confident (or earlier) wording
    return [f for i, f in enumerate(findings) if all(g.kind != f.kind for g in findings[:i])]
