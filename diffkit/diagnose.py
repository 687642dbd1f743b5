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

from .capture import Record, Ref
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


def _norm(t: torch.Tensor) -> float:
    return float(t.norm()) if t.numel() else 0.0


def _explains(model: torch.Tensor, ctx: Context) -> float:
    """Fraction of the error left after the model (0 = fully explained)."""
    e = _norm(ctx.err)
    return _norm(ctx.cand - model) / e if e > 0 else 1.0


# ------------------------------------------------------------------ checks
def check_nan_inf(ctx: Context) -> list[Finding]:
    s = ctx.stage.stats
    if s is None or not (s.cand_nan > s.ref_nan or s.cand_inf > s.ref_inf):
        return []
    bad = (~torch.isfinite(ctx.cand)) & torch.isfinite(ctx.ref)
    idx = torch.nonzero(bad)
    first = tuple(int(i) for i in idx[0]) if len(idx) else ()
    rows = sorted({int(i[0]) for i in idx[:1000]}) if len(idx) and idx.shape[1] else []
    return [Finding("nan_inf", f"candidate produces {int(bad.sum())} non-finite values where the reference is finite "
                    f"({s.cand_nan} NaN, {s.cand_inf} Inf), first at index {list(first)}"
                    + (f"; along axis 0 they sit in {len(rows)} of {ctx.ref.shape[0]} slices" if rows else ""), 0.95)]


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1]) if t.dim() >= 1 and t.numel() else t.reshape(1, -1)


def check_region(ctx: Context) -> list[Finding]:
    """An unwritten or wrong block of rows in the candidate's own [rows, last-dim] layout."""
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
    region = c[lo:hi + 1]
    const = float(region.max() - region.min()) == 0.0
    value = float(region.flatten()[0]) if const else None
    at_end = hi == m - 1
    block = _block_size(lo, m) if at_end else None
    shape = "×".join(map(str, ctx.cand_native.shape))
    where = f"rows {lo}..{hi} ({nbad} of {m}) of the candidate's [{m}, {c.shape[1]}] view of its {shape} output"
    if const:
        detail = f"{where} are all {value:g} while every other row matches: a block the kernel never wrote"
        if block:
            detail += f"; {m} rows = {lo // block}×{block} + {m - lo}: the last partial tile of a {block}-row block is skipped"
        return [Finding("unwritten_region", detail, 0.95)]
    if at_end and block:
        return [Finding("boundary", f"error confined to {where}: the last partial tile of a {block}-row block "
                        f"({m} rows = {lo // block}×{block} + {m - lo}) is computed wrongly", 0.8)]
    return []


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
    from .align import from_ref_layout

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


def _bias_of(ctx: Context) -> list[tuple[str, torch.Tensor]]:
    """1-D parameters read by the producing calls (either side) whose length is the last dim."""
    out = []
    n = ctx.ref.shape[-1] if ctx.ref.dim() else 0
    seen = set()
    for rec, params in ((ctx.stage.ref, ctx.ref_params), (ctx.stage.cand, ctx.cand_params)):
        for pname, p in params_of(rec, params).items():
            if p.dim() == 1 and p.shape[0] == n and pname not in seen:
                seen.add(pname)
                out.append((pname, p.detach().to(torch.float64)))
    return out


def check_bias_offset(ctx: Context) -> list[Finding]:
    if ctx.ref.dim() == 0:
        return []
    err = ctx.err
    n = err.shape[-1]
    per_channel = _rows(err).mean(dim=0)
    model = ctx.ref + per_channel
    if _explains(model, ctx) > EXPLAINED:
        return []
    for name, b in _bias_of(ctx):
        if b.device != per_channel.device:
            b = b.to(per_channel.device)
        if torch.allclose(-per_channel, b, atol=1e-5, rtol=1e-4):
            return [Finding("missing_bias", f"candidate = reference − {name} (all {n} channels, max |bias| "
                            f"{float(b.abs().max()):.3g}): the bias is not added", 0.95)]
        if torch.allclose(per_channel, b, atol=1e-5, rtol=1e-4):
            return [Finding("offset", f"candidate = reference + {name} (all {n} channels): the bias is added twice",
                            0.95)]
    spread = float(per_channel.max() - per_channel.min())
    if spread <= 1e-6 * (1 + float(per_channel.abs().max())):
        return [Finding("offset", f"candidate = reference + {float(per_channel.mean()):.6g} everywhere (a constant offset)", 0.85)]
    return [Finding("offset", f"per-channel additive error along the last axis (size {n}), from {float(per_channel.min()):.4g} "
                    f"to {float(per_channel.max()):.4g}, matching no bias parameter of the producing call", 0.75)]


def _constants(shape: tuple[int, ...]) -> list[tuple[float, str]]:
    out = [(2.0, "2"), (0.5, "1/2"), (-1.0, "-1")]
    sizes = sorted({s for s in shape if s > 1} | {8, 16, 32, 64, 128})
    for d in sizes:
        out += [(math.sqrt(d), f"sqrt({d})"), (1 / math.sqrt(d), f"1/sqrt({d})"), (float(d), f"{d}"),
                (1.0 / d, f"1/{d}"), (math.sqrt((d - 1) / d), f"sqrt(({d}-1)/{d})"),
                (math.sqrt(d / (d - 1)), f"sqrt({d}/({d}-1))")]
    return out


def _name_scale(s: float, shape) -> str:
    best = min(_constants(shape), key=lambda kv: abs(kv[0] - s) / abs(kv[0]))
    if abs(best[0] - s) / abs(best[0]) < 2e-3:
        meaning = ""
        if best[1].startswith("sqrt((") :
            meaning = " — the variance divided by n-1 instead of n (unbiased vs biased LayerNorm)"
        elif best[1].startswith("sqrt(") and not best[1].startswith("sqrt(("):
            meaning = " — a 1/sqrt(d) attention scale left out"
        elif best[1].startswith("1/sqrt("):
            meaning = " — a 1/sqrt(d) factor applied where none belongs (or twice)"
        return f" ≈ {best[1]}{meaning}"
    return ""


def check_scale(ctx: Context) -> list[Finding]:
    r, c = ctx.ref.flatten(), ctx.cand.flatten()
    rr = float((r * r).sum())
    if rr == 0:
        return []
    s = float((c * r).sum()) / rr
    if abs(s - 1) < 1e-6 or _explains(s * ctx.ref, ctx) > EXPLAINED:
        return []
    if abs(s + 1) < 1e-3:
        return [Finding("sign", "candidate = −reference: the sign is flipped", 0.95)]
    name = _name_scale(s, tuple(ctx.ref.shape) + tuple(ctx.stage.cand.shape if ctx.stage.cand else ()))
    return [Finding("scale", f"candidate ≈ {s:.6g} × reference{name}", 0.9 if name else 0.8)]


def check_permutation(ctx: Context) -> list[Finding]:
    shape = tuple(ctx.ref.shape)
    if ctx.ref.dim() < 2 or ctx.ref.dim() > 6:
        return []
    tol = ctx.stage.stats.atol + ctx.stage.stats.rtol * ctx.ref.abs()
    for p in itertools.permutations(range(ctx.ref.dim())):
        if list(p) == sorted(p) or tuple(shape[i] for i in p) != shape:
            continue
        if bool(((ctx.cand.permute(*p) - ctx.ref).abs() <= tol).all()):
            moved = [i for i in range(len(p)) if p[i] != i]
            axes = " and ".join(str(i) for i in moved) if len(moved) == 2 else str(tuple(p))
            what = f"axes {axes} swapped" if len(moved) == 2 else f"axes permuted by {tuple(p)}"
            return [Finding("permutation", f"candidate equals the reference with {what} (shape {list(shape)}): "
                            f"an index mix-up in the kernel's writes or reads", 0.95)]
    return []


def _weight_of(ctx: Context) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The 2-D weight (and 1-D bias, if any) the reference call read."""
    read = params_of(ctx.stage.ref, ctx.ref_params)
    w = next((p for n, p in read.items() if n.endswith("weight") and p.dim() == 2), None)
    b = next((p for n, p in read.items() if n.endswith("bias") and p.dim() == 1), None)
    return (w.detach() if w is not None else None), (b.detach() if b is not None else None)


def check_transposed_weight(ctx: Context) -> list[Finding]:
    w, b = _weight_of(ctx)
    x = ctx.ref_input(0)
    if w is None or x is None or x.shape[-1] != w.shape[1]:
        return []
    n_out, k = w.shape
    wd = w.to(torch.float64)
    # the [N, K] weight's memory read as a [K, N] matrix (what a kernel indexing w[k*N + n] computes)
    y = x @ wd.reshape(k, n_out)
    if b is not None and b.shape[0] == n_out:
        y = y + b.detach().to(torch.float64)
    y = y.reshape(ctx.ref.shape)
    if _norm(y - ctx.cand) <= EXPLAINED * max(_norm(ctx.err), 1e-30):
        return [Finding("transposed_weight", f"the stage matches x @ W' where W' is the [{n_out}, {k}] weight's memory "
                        f"read as [{k}, {n_out}]: the kernel indexes the weight as w[k*{n_out} + n] instead of "
                        f"w[n*{k} + k]", 0.95)]
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
            return [Finding("precision", f"candidate ≈ the reference rounded to {name} (unit roundoff {unit:.2g}): "
                            f"a {name} intermediate where float32 is expected", 0.85)]
    rel_err = ctx.err.abs() / ctx.ref.abs().clamp_min(1e-30)
    rel = float(rel_err.median())
    mags = [(2 ** -11, "float16/TF32 (10-bit mantissa)"), (2 ** -8, "bfloat16 (7-bit mantissa)")]
    for unit, name in mags:
        if unit / 8 <= rel <= unit * 2 and float(ctx.err.abs().max()) <= 64 * unit * float(ctx.ref.abs().max()):
            return [Finding("precision", f"median relative error {rel:.2g} is the size of {name} rounding ({unit:.2g}) "
                            f"and no other pattern explains it: reduced-precision accumulation (TF32 matmul, "
                            f"half accumulators)", 0.5)]
    return []


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
    bins = max(8, min(64, r.numel() // 16))
    chunks = torch.tensor_split(es, bins)
    means = torch.cat([ch.mean().expand(ch.numel()) for ch in chunks])
    total = float(((es - es.mean()) ** 2).sum())
    if total == 0:
        return []
    explained = 1 - float(((es - means) ** 2).sum()) / total
    if explained < 0.9:
        return []
    of = "input" if r is not ctx.ref.flatten() and x is not None and x.numel() == ctx.ref.numel() else "value"
    return [Finding("approximation", f"small smooth error (max {float(e.abs().max()):.3g}) that is a function of the "
                    f"stage's {of} ({100 * explained:.0f}% of its variance explained by it alone): an "
                    f"approximated function, e.g. tanh-GELU for erf-GELU or a fast exp", 0.7)]


CHECKS: list[Callable[[Context], list[Finding]]] = [
    check_nan_inf, check_region, check_reduction_axis, check_permutation, check_transposed_weight,
    check_bias_offset, check_scale, check_precision, check_approximation,
]


def diagnose(stage: Stage, ref: Any, cand: Any, ref_params: dict[str, torch.Tensor] | None = None,
             cand_params: dict[str, torch.Tensor] | None = None) -> list[Finding]:
    """Ranked findings for a stage with an error (empty when nothing explains it).  A root cause
    may be within tolerance itself (its error crosses tolerance only later): it is diagnosed too.
    `ref`/`cand` are the two traces; `*_params` the models' parameters and buffers by name."""
    if stage.stats is None or stage.ref is None or stage.cand is None:
        return []
    if stage.stats.ok and (stage.local is None or stage.local.max_abs == 0):
        return []
    rv, cv = ref.records[stage.ref.index].value, cand.records[stage.cand.index].value
    if rv is None or cv is None:
        return []
    from .align import to_ref_layout

    ref_v = rv.detach().to(torch.float64)
    cand_native = cv.detach().to(torch.float64)
    cand_v = to_ref_layout(cand_native, tuple(stage.ref.shape), stage.pair_transform)
    ctx = Context(stage, ref_v, cand_v, cand_native, ref.records, cand.records, dict(ref_params or {}),
                  dict(cand_params or {}))
    findings: list[Finding] = []
    for check in CHECKS:
        try:
            findings += check(ctx)
        except Exception:  # a check that cannot apply to this stage says nothing
            continue
        if findings and findings[-1].kind in ("nan_inf",):
            break
    exact = {"missing_bias", "offset", "scale", "sign", "permutation", "transposed_weight", "unwritten_region",
             "wrong_reduction_axis"}
    if any(f.kind in exact for f in findings):
        # an exact explanation makes the statistical ones noise (compare.py drops them too when a
        # rerun later shows run-to-run noise)
        findings = [f for f in findings if f.kind not in ("approximation", "precision")]
    findings.sort(key=lambda f: -f.confidence)
    return findings
