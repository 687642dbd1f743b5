"""Locate: measure every aligned pair, give each stage a status, find the first divergence, decide.

The first divergence is the earliest pair, in the candidate's execution order, with any element
out of tolerance or a NaN/Inf the reference does not have.  The verdict follows the final output
as KernelBench judges it; intermediates that fail while the output passes are warnings unless
`strict`.
"""
from __future__ import annotations

import bisect

from .align import Alignment, to_ref_layout
from .capture import Record, Trace
from .measure import PendingStats, measure_async, tolerances
from .result import ErrorInfo, Result, Stage


def build_stages(ref: Trace, cand: Trace, alignment: Alignment, atol: float | None, rtol: float | None,
                 known: dict | None = None) -> list[Stage]:
    """Stages in candidate order; reference-only stages follow the stage paired before them.

    `known` maps (ref index, cand index, transform) to Stats already measured (streaming mode).
    Every pair is measured on its device first and the scalars gathered afterwards, so a GPU
    diff waits for the device once, not once per stage."""
    pending: list[tuple[Stage, PendingStats]] = []
    by_cand = alignment.by_cand()
    rows: list[Stage] = []
    ref_after: dict[int, list[int]] = {}
    paired_refs = sorted(p.ref for p in alignment.pairs)
    # place each unmatched reference record after the candidate stage that holds the nearest earlier ref
    ref_to_cand = {}
    for p in alignment.pairs:
        ref_to_cand.setdefault(p.ref, p.cand)
    leading: list[int] = []
    for ri in alignment.ref_unmatched:
        if ref.records[ri].kind == "input":
            continue
        k = bisect.bisect_left(paired_refs, ri)  # the nearest paired reference record before it
        if k:
            ref_after.setdefault(ref_to_cand[paired_refs[k - 1]], []).append(ri)
        else:
            leading.append(ri)
    for ri in leading:
        rows.append(Stage(index=0, ref=ref.records[ri], cand=None))
    for c in cand.records:
        p = by_cand.get(c.index)
        if c.kind == "input" and (p is None or ref.records[p.ref].kind == "input"):
            continue  # inputs are alignment anchors, not stages
        if p is None:
            rows.append(Stage(index=0, ref=None, cand=c, note="no reference counterpart"))
        else:
            r = ref.records[p.ref]
            rows.append(_measured(r, c, p.paired_by, p.transform, p.describe_transform(), atol, rtol, pending,
                                  (known or {}).get((r.index, c.index, p.transform))))
        for ri in ref_after.get(c.index, []):
            rows.append(Stage(index=0, ref=ref.records[ri], cand=None, note="no candidate counterpart"))
    for st, ps in pending:
        st.stats = ps.result()
        st.status = "ok" if st.stats.ok else "diverged"
    for i, s in enumerate(rows):
        s.index = i
    return rows


def _measured(r: Record, c: Record, how: str, transform: tuple, transform_text: str,
              atol: float | None, rtol: float | None, pending: list, known=None) -> Stage:
    stage = Stage(index=0, ref=r, cand=c, paired_by=how, transform=transform_text, pair_transform=transform)
    a, t = tolerances(atol, rtol, r.dtype)
    if transform == ("shape-mismatch",):
        stage.status = "diverged"
        stage.note = f"shape mismatch: reference {list(r.shape)}, candidate {list(c.shape)}"
        return stage
    if c.dtype != r.dtype:
        stage.note = f"dtype {str(c.dtype).replace('torch.', '')} compared against {str(r.dtype).replace('torch.', '')}"
    if known is not None:
        stage.stats = known
        stage.status = "ok" if known.ok else "diverged"
        return stage
    if r.value is None or c.value is None:
        stage.note = "values not captured"
        return stage
    pending.append((stage, measure_async(r.value, to_ref_layout(c.value, r.shape, transform), a, t)))
    return stage


def locate(stages: list[Stage], ref: Trace, cand: Trace, atol, rtol, strict: bool = False) -> Result:
    first = None
    for s in stages:
        if s.status == "diverged":
            if first is None:
                first = s
            else:
                s.status = "after-divergence"
    out_stage = next((s for s in stages if s.cand is not None and s.cand.is_output and s.ref is not None
                      and s.ref.is_output), None)
    error = None
    for side, tr in (("reference", ref), ("candidate", cand)):
        if tr.error is not None:
            e = tr.error
            error = ErrorInfo(side, "forward", f"{e.type}: {e.message}", e.stage, e.traceback)
            break
    shape_mismatch = None
    output_stats = out_stage.stats if out_stage else None
    if out_stage is not None and out_stage.ref.shape != out_stage.cand.shape:
        shape_mismatch = (out_stage.ref.shape, out_stage.cand.shape)
    warnings: list[str] = []
    if error is not None:
        verdict = "error"
    elif out_stage is None:
        verdict = "error"
        missing = "candidate" if ref.output is not None else "reference"
        error = ErrorInfo(missing, "output", f"the {missing} returned no tensor output to compare", "")
    elif shape_mismatch is not None or out_stage.status in ("diverged", "after-divergence"):
        verdict = "diverged"
    else:
        verdict = "match"
        failing = [s for s in stages if s.failed]
        if failing:
            for s in failing:
                warnings.append(f"stage {s.index} {s.ref_name} (candidate {s.cand_name}) out of tolerance: "
                                f"max_abs={s.stats.max_abs:.3g}" if s.stats else f"stage {s.index} {s.note}")
            if strict:
                verdict = "diverged"
    return Result(verdict=verdict, stages=stages, first_divergence=first, error=error, output=output_stats,
                  atol=atol, rtol=rtol, strict=strict, warnings=warnings, output_shape_mismatch=shape_mismatch)
