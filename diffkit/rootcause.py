"""Root cause: does a stage introduce its error, or only inherit it?

A candidate stage is re-run alone (the module, the torch op, or the extension call that made
it) on the *reference's* values of its inputs.  Its error then is its own (`local`); the error
of its inputs in the full run is what it `inherited`.  The root cause is the earliest stage
whose local error is real: out of tolerance, or above float32 noise (`INTRODUCED_REL` of the
reference's magnitude) so that, once propagated, it can take a later stage out of tolerance.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from .align import Alignment, from_ref_layout, to_ref_layout
from .capture import Record, Ref, Trace
from .measure import measure
from .result import Result, Stage

# a local error above this fraction of the reference's largest magnitude is not float32 rounding
# (a correct fused kernel re-associating sums is ~1e-7 here)
INTRODUCED_REL = 1e-5
MAX_REPLAYS = 400


class NotReplayable(Exception):
    pass


def _substitute(obj: Any, values: dict[int, torch.Tensor]) -> Any:
    """The call's argument template with every `Ref` replaced by its value."""
    return pytree.tree_map(lambda v: values[v.index] if isinstance(v, Ref) else v, obj)


def _pick(out: Any, pos: tuple) -> Any:
    for p in pos:
        out = out[p]
    return out


def replay(stage: Stage, ref: Trace, cand: Trace, ref_of_cand: dict[int, tuple[int, tuple]]) -> torch.Tensor:
    """Re-run the candidate call behind `stage` on the reference's inputs; its output, reference layout."""
    if stage.cand is None:
        raise NotReplayable("no candidate record")
    rec = cand.records[stage.cand.index]
    if rec.call is None:
        raise NotReplayable("the producing call was not captured")
    if rec.kind == "write":
        raise NotReplayable("the call writes into an argument (it mutates state); not re-run")
    (kind, fn, tmpl), pos = rec.call
    if isinstance(pos, tuple) and pos and pos[0] == "arg":
        raise NotReplayable("the call writes into an argument (it mutates state); not re-run")
    values: dict[int, torch.Tensor] = {}
    for r in rec.inputs:
        src = cand.records[r.index]
        hit = ref_of_cand.get(r.index)
        if hit is None:
            raise NotReplayable(f"its input {src.name} has no reference counterpart")
        ref_rec = ref.records[hit[0]]
        if ref_rec.value is None:
            raise NotReplayable("reference values were not kept")
        try:
            v = from_ref_layout(ref_rec.value, tuple(src.shape), hit[1]).to(src.dtype)
            values[r.index] = torch.empty(v.shape, dtype=v.dtype, device=v.device).copy_(v)  # fresh, contiguous
        except Exception as e:
            raise NotReplayable(f"cannot bring input {src.name} into the candidate's layout: {e}")
    args, kwargs = _substitute(tmpl, values)
    with torch.no_grad():
        try:
            out = fn(*args, **kwargs)
        except Exception as e:
            raise NotReplayable(f"re-running it raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    out = _pick(out, pos)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(rec.shape):
        raise NotReplayable("re-running it gave a different shape")
    return to_ref_layout(out, tuple(stage.ref.shape), stage.pair_transform)


def analyse(result: Result, ref: Trace, cand: Trace, alignment: Alignment, window: int | None = None) -> None:
    """Fill `local`, `inherited_max_abs` and `replay_note` per stage, and `result.root_cause`.

    `window` limits the replays to that many measured stages before the first divergence (a
    streaming diff keeps the reference values of those only).  A stage that cannot be re-run (a
    capture file holds no calls) still counts as introducing its error when its own error is above
    float32 noise while every input it read, by dataflow, matches the reference to that noise."""
    ref_of_cand = {p.cand: (p.ref, p.transform) for p in alignment.pairs}
    stage_of_cand = {s.cand.index: s for s in result.stages if s.cand is not None}
    fd = result.first_divergence
    last = fd.index if fd is not None else -1
    todo = [s for s in result.stages if s.stats is not None and (s.index <= last or s.failed)]
    if window is not None:
        todo = [s for s in todo if s.index <= last][-(window + 1):]
    introduced: list[Stage] = []
    for s in todo[:MAX_REPLAYS]:
        if s.cand.kind == "input":
            continue
        ins = [stage_of_cand.get(i) for i in s.cand.inputs]
        errs = [x.stats.max_abs for x in ins if x is not None and x.stats is not None]
        s.inherited_max_abs = max(errs) if errs else 0.0
        ref_value = ref.records[s.ref.index].value
        try:
            out = replay(s, ref, cand, ref_of_cand)
        except NotReplayable as e:
            s.replay_note = f"not re-run: {e}"
            if ref_value is not None and _inputs_clean(s, ins, ref) and _above_noise(s.stats.max_abs, ref_value):
                s.replay_note += "; its inputs match the reference, so the error is its own"
                introduced.append(s)
            continue
        if ref_value is None:
            s.replay_note = "not re-run: the reference value was not kept"
            continue
        s.local = measure(ref_value, out, s.stats.atol, s.stats.rtol)
        if not s.local.ok or _above_noise(s.local.max_abs, ref_value):
            introduced.append(s)
    if fd is None:
        return
    before = [s for s in introduced if s.index <= fd.index]
    if before:
        result.root_cause = before[0]
    elif fd.local is None:
        # it could not be re-run; every stage before it that could was clean, so it is the earliest
        # suspect -- say so rather than pretend it was shown to introduce the error
        fd.replay_note = (fd.replay_note or "not re-run") + "; taken as the root cause because no earlier stage " \
            "introduces error"
        result.root_cause = fd


def _above_noise(err: float, ref_value: torch.Tensor) -> bool:
    scale = float(ref_value.detach().abs().max()) if ref_value.numel() else 0.0
    return err > INTRODUCED_REL * max(scale, 1e-30)


def _inputs_clean(stage: Stage, inputs: list, ref: Trace) -> bool:
    """Every input the stage read is paired and matches the reference within float32 noise."""
    if not inputs or any(x is None or x.stats is None or x.ref is None for x in inputs):
        return False
    for x in inputs:
        v = ref.records[x.ref.index].value
        if v is None or _above_noise(x.stats.max_abs, v) or not x.stats.ok:
            return False
    return True
