"""Locate: measure every aligned pair, give each stage a status, find the first divergence.

The first divergence is the earliest pair, in the candidate's execution order, with any element
out of tolerance or a NaN/Inf the reference does not have.  Deciding the verdict is not done here:
pipeline.judge reads the statuses this module sets.
"""
from __future__ import annotations

import bisect
from typing import Any

import torch

from .align import Alignment, permuted, to_ref_layout
from .capture import Record, Trace
from .measure import apply_stat, ask_kernelbench, kernelbench_note, measure_async, measure_many
from .options import Tolerance
from .result import RecordInfo, Stage


def build_stages(ref: Trace, cand: Trace, alignment: Alignment, tolerance: Tolerance,
                 known: dict | None = None) -> list[Stage]:
    """Stages in candidate order; reference-only stages follow the stage paired before them.

    `known` maps (ref index, cand index, transform) to Stats already measured (streaming mode).
    Every pair is measured on its device first and the scalars gathered afterwards, so a GPU
    diff waits for the device once, not once per stage."""
    # (stage, (ref, cand, atol, rtol), PendingStats): on the CPU measured at once; on CUDA (None) measured
    # together below (batched launches, one copy back)
    pending: list[tuple[Stage, tuple, Any]] = []
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
        rows.append(Stage(index=0, ref=RecordInfo.of(ref.records[ri]), cand=None, note="no candidate counterpart"))
    for c in cand.records:
        p = by_cand.get(c.index)
        if c.kind == "input" and (p is None or ref.records[p.ref].kind == "input"):
            pass  # inputs are alignment anchors, not stages (the reference's unpaired records after them are)
        elif p is None:
            rows.append(Stage(index=0, ref=None, cand=RecordInfo.of(c), note="no reference counterpart"))
        else:
            r = ref.records[p.ref]
            rows.append(_measured(r, c, p, tolerance, pending, (known or {}).get((r.index, c.index, p.transform))))
        for ri in ref_after.get(c.index, []):
            rows.append(Stage(index=0, ref=RecordInfo.of(ref.records[ri]), cand=None, note="no candidate counterpart"))
    batched = iter(measure_many([item for _, item, got in pending if got is None]))
    for st, item, got in pending:
        st.stats = (got or next(batched)).result()
        if tolerance.stat != "elementwise":
            apply_stat(st.stats, item[0], item[1], tolerance.stat)
        _kernelbench(st, item[0], item[1], item[0].dtype)
        st.status = "ok" if st.stats.ok else "diverged"
    for i, s in enumerate(rows):
        s.index = i
    return rows


def _measured(r: Record, c: Record, pair, tolerance: Tolerance, pending: list, known=None) -> Stage:
    stage = Stage(index=0, ref=RecordInfo.of(r), cand=RecordInfo.of(c), paired_by=pair.paired_by,
                  confidence=getattr(pair, "confidence", 1.0), transform=pair.describe_transform(),
                  pair_transform=pair.transform)
    a, t = tolerance.for_dtype(r.dtype)
    if pair.transform == ("shape-mismatch",):
        stage.status = "diverged"
        stage.note = f"shape mismatch: reference {list(r.shape)}, candidate {list(c.shape)}"
        return stage
    if c.dtype != r.dtype:
        stage.note = f"dtype {str(c.dtype).replace('torch.', '')} compared against {str(r.dtype).replace('torch.', '')}"
    if known is not None and (known.atol, known.rtol) == (a, t):
        if tolerance.stat != known.stat and r.value is not None and c.value is not None:
            apply_stat(known, r.value, to_ref_layout(c.value, r.shape, pair.transform), tolerance.stat)
        stage.stats = known
        _kernelbench(stage, r.value, c.value, r.dtype)
        stage.status = "ok" if known.ok else "diverged"
        return stage
    if r.value is None or c.value is None:
        stage.note = "values not captured"
        return stage
    cv = to_ref_layout(c.value, r.shape, pair.transform)
    item = (r.value, cv, a, t)
    pending.append((stage, item, None if r.value.is_cuda else measure_async(*item)))
    return stage


def _kernelbench(stage: Stage, r: torch.Tensor | None, c: torch.Tensor | None, dtype: torch.dtype) -> None:
    """A pair of the two models' outputs, compared as laid out: KernelBench's own torch.allclose call decides
    it (`measure.kernelbench_allclose`; a streaming diff asked it already, its values are not in the
    records), with a note where that differs from the elementwise count."""
    st = stage.stats
    if st is None or st.stat != "elementwise" or stage.pair_transform != () or not (
            stage.ref.is_output and stage.cand.is_output):
        return
    if r is not None and c is not None:
        ask_kernelbench(st, r, c)
    note = kernelbench_note(st, dtype)
    if note:
        stage.note = f"{stage.note}; {note}" if stage.note else note


def locate(stages: list[Stage], passed_over: set[int] | frozenset = frozenset()) -> Stage | None:
    """Mark every failing stage after the first divergence as "after-divergence"; return the first
    divergence.  A failing stage in `passed_over` (`undone_stages`: its error every paired stage reading
    it has left behind) is passed over while a later failing stage is not: the first divergence is where
    the error that goes on starts.  Passed over, it keeps "diverged"."""
    failing = [s for s in stages if s.status in ("diverged", "after-divergence")]
    if not failing:
        return None
    first = next((s for s in failing if s.index not in passed_over), failing[0])
    for s in failing:
        s.status = "diverged" if s.index <= first.index else "after-divergence"
    return first


READERS_VISITED = 256  # unpaired records walked through looking for the paired stages that read a stage
# a reader has left a stage's error behind when its own is at most this fraction of the stage's
UNDONE_FRACTION = 1e-2


def undone_stages(stages: list[Stage], cand_records: list[Record]) -> set[int]:
    """The failing stages (by index) whose error stops there: not an output, and the nearest paired stages
    reading its candidate tensor (through unpaired records) are all within tolerance, with errors of at
    most UNDONE_FRACTION of its own and compared as laid out (no permutation), or failing and undone
    themselves -- the candidate computes that quantity otherwise (``x / sqrt(v)`` against ``x *
    rsqrt(v)``; a product before its bias is added) or its error is undone before it matters.  Decided
    from the last stage back (a reader comes after what it reads), without recursion."""
    by_cand = {s.cand.index: s for s in stages if s.cand is not None and s.ref is not None}
    readers: dict[int, list[int]] = {}
    for r in cand_records:
        for a in r.inputs:
            readers.setdefault(getattr(a, "index", a), []).append(r.index)
    decided: dict[int, bool] = {}
    failing = [s for s in by_cand.values() if s.failed and s.stats is not None]
    if len(failing) < 2:
        return set()  # (one failing stage is the first divergence whatever its readers say)
    for stage in sorted(failing, key=lambda s: -s.cand.index):
        decided[stage.index] = not stage.cand.is_output and _left_behind(stage, by_cand, readers, decided)
    return {i for i, v in decided.items() if v}


def _left_behind(stage: Stage, by_cand: dict[int, Stage], readers: dict[int, list[int]],
                 decided: dict[int, bool]) -> bool:
    seen: set[int] = set()
    todo = list(readers.get(stage.cand.index, ()))
    found = False
    while todo and len(seen) < READERS_VISITED:
        j = todo.pop()
        if j in seen:
            continue
        seen.add(j)
        s = by_cand.get(j)
        if s is None:
            todo.extend(readers.get(j, ()))
        elif s.stats is not None and s.failed and decided.get(s.index, False):
            found = True
        elif s.stats is None or s.failed or permuted(s.pair_transform) \
                or not s.stats.max_abs <= UNDONE_FRACTION * stage.stats.max_abs:
            # (compared through a permutation of axes, it may have absorbed the same permutation; an error
            # that shrinks below tolerance at a reader, a sum over many elements, still flows on)
            return False
        else:
            found = True
    return found and not todo


def output_stages(stages: list[Stage]) -> list[Stage]:
    """The stages pairing the two models' outputs (one per tensor of a nested output), as
    `Result.output_stages` gives them once the result is assembled."""
    return [s for s in stages if s.cand is not None and s.cand.is_output and s.ref is not None and s.ref.is_output]


def output_failed(stages: list[Stage]) -> bool:
    """Whether the (first) output pair is out of tolerance or of another shape."""
    out = next(iter(output_stages(stages)), None)
    return out is not None and (out.failed or tuple(out.ref.shape) != tuple(out.cand.shape))
