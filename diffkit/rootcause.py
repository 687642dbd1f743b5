"""Root cause: does a stage introduce its error, or only inherit it?

A candidate stage is re-run alone (the module, the torch op, or the extension call that made
it) on the *reference's* values of its inputs.  Its error then is its own (`local`); the error
of its inputs in the full run is what it `inherited`.  The root cause is the earliest stage
whose local error is real: out of tolerance, or above float32 noise (`INTRODUCED_REL` of the
reference's magnitude) so that, once propagated, it can take a later stage out of tolerance.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
import torch.utils._pytree as pytree

from .align import Alignment, from_ref_layout, is_layout_op, to_ref_layout
from .capture import Ref, Trace
from .measure import measure
from .result import Finding, Stage

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


def replay(stage: Stage, ref: Trace, cand: Trace, ref_of_cand: dict[int, tuple[int, tuple]],
           changed: dict | None = None) -> torch.Tensor:
    """Re-run the candidate call behind `stage` on the reference's inputs; its output, reference layout.
    A call that read a buffer the forward changed (`changed`: name -> (live tensor, before, after)) cannot
    be given the value it read; it is re-run with the buffer as before the forward and as after it, and
    counts only when both give the same output (a training-mode batch norm, whose output does not read
    its running statistics; not a counter it scales by)."""
    if stage.cand is None:
        raise NotReplayable("no candidate record")
    rec = cand.records[stage.cand.index]
    if rec.call is None:
        raise NotReplayable("the producing call was not captured")
    if rec.kind == "write":
        raise NotReplayable("the call writes into an argument (it mutates state); not re-run")
    (kind, fn, tmpl), pos = rec.call
    if isinstance(pos, tuple) and pos and pos[0] == "arg" or _in_place(fn, tmpl):
        raise NotReplayable("the call writes into an argument (it mutates state); not re-run")
    changed = changed or {}
    stale = [n for n in sorted(set(getattr(rec, "params", ()) or ())) if n in changed]
    if not stale:
        out = _rerun(rec, ref, cand, ref_of_cand, GLUE_DEPTH)
    else:
        if any(changed[n][0] is None for n in stale):
            raise NotReplayable(f"it read {stale[0]}, which the forward changed, and the model is not here")
        outs = []
        for when in (1, 2):  # (the buffers as before the forward, then as after it)
            with _state_kept(None, [changed[n][0] for n in stale]), torch.no_grad():
                for n in stale:
                    changed[n][0].copy_(changed[n][when])
                outs.append(_rerun(rec, ref, cand, ref_of_cand, GLUE_DEPTH))
        if not torch.equal(outs[0], outs[1]):
            raise NotReplayable(f"it read {stale[0]}, which the forward changed: the value it read is not known")
        out = outs[1]
    return to_ref_layout(out, tuple(stage.ref.shape), stage.pair_transform)


_IN_PLACE_DUNDERS = frozenset(f"__i{op}__" for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and",
                                                      "or", "xor", "lshift", "rshift", "matmul")) | {"__setitem__"}


def _in_place(fn: Any, tmpl: Any) -> bool:
    """Does the call change a tensor it is given (``x.add_(1)``, ``torch.ops.aten.add_.Tensor``, ``x += 1``,
    ``x[...] = y``, ``out=``)?  Re-running it would change live state (a buffer of the model), on a value that
    is no longer the one it was called with."""
    name = str(getattr(fn, "__name__", "") or "")
    base = name.split(".")[0]  # (an aten overload: "add_.Tensor")
    if name in _IN_PLACE_DUNDERS or (base.endswith("_") and not base.endswith("__")):
        return True
    kwargs = tmpl[1] if isinstance(tmpl, tuple) and len(tmpl) == 2 and isinstance(tmpl[1], dict) else {}
    return kwargs.get("out") is not None


@contextlib.contextmanager
def _state_kept(fn: Any, tmpl: Any):
    """Whatever a re-run changes of the live tensors it is given (a training-mode batch norm's running
    statistics, a kernel writing into a buffer argument) or of a module's buffers is put back afterwards."""
    live = [v for v in pytree.tree_leaves(tmpl) if isinstance(v, torch.Tensor)]
    if isinstance(fn, torch.nn.Module):
        live += [b for b in fn.buffers() if isinstance(b, torch.Tensor)]
    with torch.no_grad():
        saved = [(t, t.clone()) for t in live]
    try:
        yield
    finally:
        with torch.no_grad():
            for t, copy in saved:
                if not torch.equal(t, copy):
                    t.copy_(copy)


GLUE_DEPTH = 4  # unpaired layout calls (view, contiguous …) re-run between a stage and its paired inputs


def _input_value(index: int, ref: Trace, cand: Trace, ref_of_cand: dict, depth: int) -> torch.Tensor:
    """The reference's value of a candidate record, in the candidate's layout: its counterpart's, or,
    for an unpaired call that only re-lays out its inputs (``x.contiguous()``, ``x.view(…)``), that
    call re-run on its inputs' reference values."""
    src = cand.records[index]
    hit = ref_of_cand.get(index)
    if hit is None:
        if depth > 0 and src.kind == "op" and is_layout_op(src) and src.call is not None:
            return _rerun(src, ref, cand, ref_of_cand, depth - 1)
        raise NotReplayable(f"its input {src.name} has no reference counterpart")
    ref_rec = ref.records[hit[0]]
    value = ref_rec.value
    if ref_rec.kind == "input" and ref_rec.name in ref.inputs_left:
        # the reference's forward changed this input: the candidate ran on it as that forward left it
        value = ref.inputs_left[ref_rec.name].to(value.device if value is not None else "cpu")
    if value is None:
        raise NotReplayable("reference values were not kept")
    try:
        v = from_ref_layout(value, tuple(src.shape), hit[1]).to(src.dtype)
        # fresh memory laid out as the candidate's own argument was (its snapshot keeps the strides: a
        # kernel may take another path for a transposed view than for a contiguous tensor)
        like = src.value
        if like is not None and tuple(like.shape) == tuple(v.shape) and like.layout == torch.strided:
            return torch.empty_like(like, dtype=v.dtype, device=v.device).copy_(v)
        return torch.empty(v.shape, dtype=v.dtype, device=v.device).copy_(v)
    except Exception as e:
        raise NotReplayable(f"cannot bring input {src.name} into the candidate's layout: {e}")


def _rerun(rec, ref: Trace, cand: Trace, ref_of_cand: dict, depth: int) -> torch.Tensor:
    """Re-run the call that made candidate record `rec` on the reference's values of its inputs."""
    (kind, fn, tmpl), pos = rec.call
    values: dict[int, torch.Tensor] = {}
    # the records the call's arguments held exactly (its dataflow inputs also name views and writes)
    for r in dict.fromkeys(v for v in pytree.tree_leaves(tmpl) if isinstance(v, Ref)):
        values[r.index] = _input_value(r.index, ref, cand, ref_of_cand, depth)
    args, kwargs = _substitute(tmpl, values)
    with torch.no_grad(), _state_kept(fn, tmpl):
        try:
            out = fn(*args, **kwargs)
        except Exception as e:
            raise NotReplayable(f"re-running it raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    out = _pick(out, pos)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(rec.shape):
        raise NotReplayable("re-running it gave a different shape")
    return out


def find_root_cause(stages: list[Stage], fd: Stage | None, ref: Trace, cand: Trace, alignment: Alignment,
                    window: int | None = None, changed: dict | None = None,
                    passed_over: set[int] | frozenset = frozenset()) -> Stage | None:
    """The root cause: the earliest stage that introduces the error of the first divergence `fd` (one of
    `stages`), or None; fills `local`, `inherited_max_abs` and `replay_note` per stage on the way.

    `window` limits the replays to that many measured stages before the first divergence (a
    streaming diff keeps the reference values of those only).  A stage that cannot be re-run (a
    capture file holds no calls) still counts as introducing its error when its own error is above
    float32 noise while every input it read, by dataflow, matches the reference to that noise.
    `changed`: the candidate's buffers its forward changed, by name: (the live tensor, its value before
    the forward, after it); see `replay`.  `passed_over`: the failing stages whose error every reader left behind
    (`locate.undone_stages`): none is the root cause while another introducing stage is."""
    ref_of_cand = {p.cand: (p.ref, p.transform) for p in alignment.pairs}
    stage_of_cand = {s.cand.index: s for s in stages if s.cand is not None}
    last = fd.index if fd is not None else -1
    todo = [s for s in stages if s.stats is not None and (s.index <= last or s.failed)]
    if window is not None:
        todo = [s for s in todo if s.index <= last][-(window + 1):]
    introduced: list[Stage] = []
    for s in todo[:MAX_REPLAYS]:
        if s.cand.kind == "input":
            continue
        # the measured stages it reads, through records with no counterpart (glue like views, contiguous)
        between: list = []
        ins = upstream_stages(s, cand, stage_of_cand, between)
        errs = [x.stats.max_abs for x in ins if x is not None and x.stats is not None]
        s.inherited_max_abs = max(errs) if errs else 0.0
        ref_value = ref.records[s.ref.index].value
        try:
            out = replay(s, ref, cand, ref_of_cand, changed or {})
        except NotReplayable as e:
            s.replay_note = f"not re-run: {e}"
            if ref_value is not None and _inputs_clean(s, ins, ref) and _above_noise(s.stats.max_abs, ref_value):
                extra = _extra_steps(between)
                if extra:  # the error starts in this call or in the candidate's own steps feeding it
                    upstream = ", ".join(f"stage {x.index} {x.ref_name}" for x in ins[:3])
                    s.replay_note += (f"; what it reads upstream matches the reference ({upstream}), so the error "
                                      f"arises here or in the candidate's step(s) in between that the reference "
                                      f"does not have: {extra}")
                else:
                    s.replay_note += "; its inputs match the reference, so the error is its own"
                introduced.append(s)
            continue
        if ref_value is None:
            s.replay_note = "not re-run: the reference value was not kept"
            continue
        s.local = measure(ref_value, out, s.stats.atol, s.stats.rtol, s.stats.stat)
        disagreement = _replay_disagrees(s, ins, ref, cand, out)
        if disagreement:
            s.diagnosis.insert(0, Finding("nondeterministic", disagreement, 0.75))
        if s.stats.ok and not s.local.ok and not s.stats.max_abs > s.local.max_abs:
            # within tolerance as it ran, out of it on the reference's inputs: what it read is paired with a
            # quantity the candidate computes otherwise (``x / sqrt(v)`` read against ``rsqrt(v)``), and the
            # re-run says nothing of this stage
            s.replay_note = (f"re-run on the reference's inputs gives max_abs {s.local.max_abs:.3g} while the run "
                             f"itself agrees: an input it reads is paired with a quantity the candidate computes "
                             f"otherwise; not taken as a cause")
            continue
        if not s.local.ok or _above_noise(s.local.max_abs, ref_value):
            introduced.append(s)
    if fd is None:
        return None
    before = [s for s in introduced if s.index <= fd.index]
    # an error every stage reading it left behind (`passed_over`, locate.undone_stages) is not where the one
    # that goes on starts
    before = [s for s in before if s is fd or s.index not in passed_over] or before
    if before:
        return before[0]
    elif fd.local is not None:
        # it only inherits its error: follow the error upstream along the dataflow to where it starts,
        # even where it is still inside tolerance (or below the noise bound above)
        origin, note = walk_back(fd, ref, cand, stage_of_cand)
        if origin is not None:
            origin.replay_note = (origin.replay_note + "; " if origin.replay_note else "") + note
            return origin
        else:
            fd.replay_note = (fd.replay_note + "; " if fd.replay_note else "") + note
    elif fd.local is None:
        # it could not be re-run; every stage before it that could was clean, so it is the earliest
        # suspect -- say so rather than pretend it was shown to introduce the error
        fd.replay_note = (fd.replay_note or "not re-run") + "; taken as the root cause because no earlier stage " \
            "introduces error"
        return fd
    return None


def _replay_disagrees(stage: Stage, inputs: list, ref: Trace, cand: Trace, out: torch.Tensor) -> str:
    """Words when the same call gave other outputs on the same inputs: its inputs in the run match
    the reference's (bitwise, or to float32 noise) yet the re-run on them disagrees with what the
    run produced (bitwise inputs: the two outputs differ beyond noise; noise-level inputs: the run
    is out of tolerance, the re-run within).  "" when they agree."""
    ref_value = ref.records[stage.ref.index].value
    if stage.local is None or ref_value is None or not _inputs_clean(stage, inputs, ref):
        return ""
    captured = cand.records[stage.cand.index].value
    exact = all(x.stats.max_abs == 0 for x in inputs)
    if exact and captured is not None:
        try:
            a = to_ref_layout(captured, tuple(stage.ref.shape), stage.pair_transform).double()
            b = out.double().to(a.device)
            same = (a == b) | (torch.isnan(a) & torch.isnan(b))  # a NaN both runs make is no difference
            gap = float(torch.where(same, 0.0, (a - b).abs().nan_to_num(nan=float("inf"))).max()) if a.numel() else 0.0
        except Exception:
            return ""
        if not _above_noise(gap, ref_value):
            return ""
    elif stage.stats.ok or not stage.local.ok:
        return ""
    same = "bitwise equal to" if exact else f"within {stage.inherited_max_abs or 0:.3g} of"
    return (f"the same call gives other outputs on the same inputs: its inputs were {same} the reference's, yet "
            f"in the run it was off by max_abs {stage.stats.max_abs:.4g} and re-run alone on them by "
            f"{stage.local.max_abs:.4g} -- a race, a read of memory it never wrote, or a dependence on its "
            f"inputs' memory layout (the re-run gets fresh contiguous copies)")


# Walking an inherited error upstream: an input "carries" error above this fraction of its reference's
# largest magnitude (about 8 float32 ulps: more than one correct kernel's re-association leaves) ...
CARRIES_REL = 1e-6
# ... and a stage re-run alone "starts" the error when its own error is at least this share of its error
# in the full run (the rest came in through its inputs)
OWN_SHARE = 0.5
WALK_VISITED = 512  # records visited looking for the measured stages upstream of one stage


def _relative(stage: Stage, ref: Trace) -> float:
    """A stage's max |error| relative to its reference's largest magnitude (absolute without a value)."""
    v = ref.records[stage.ref.index].value if stage.ref is not None else None
    if v is None or not v.numel() or not (v.is_floating_point() or v.is_complex()):
        return stage.stats.max_abs
    scale = float(v.detach().abs().max())
    return stage.stats.max_abs / scale if scale > 0 else stage.stats.max_abs


def upstream_stages(stage: Stage, cand: Trace, stage_of_cand: dict[int, Stage],
                    between: list | None = None) -> list[Stage]:
    """The measured stages nearest upstream of `stage` along the candidate's dataflow (walking through
    records with no reference counterpart; those records are appended to `between` when it is given)."""
    out: dict[int, Stage] = {}
    todo = [i for i in stage.cand.inputs]
    seen: set[int] = set()
    while todo and len(seen) < WALK_VISITED:
        i = todo.pop()
        if i in seen or not 0 <= i < len(cand.records):
            continue
        seen.add(i)
        s = stage_of_cand.get(i)
        if s is not None and s.stats is not None and s.ref is not None:
            out[s.index] = s
        else:
            if between is not None:
                between.append(cand.records[i])
            todo.extend(r.index for r in cand.records[i].inputs)
    return [out[k] for k in sorted(out)]


def _extra_steps(between: list) -> str:
    """Words for the candidate's computing steps with no reference counterpart that lie between a stage
    and the matching stages it reads (views and copies left out): "" when there are none."""
    steps = sorted((r for r in between if r.kind in ("op", "ext", "write", "tap") and not is_layout_op(r)),
                   key=lambda r: -r.index)
    if not steps:
        return ""
    words = [f"{r.name} ({r.op}" + (f" at {os.path.basename(r.file)}:{r.line}" if r.file else "") + ")"
             for r in steps[:3]]
    if len(steps) > 3:
        return f"{len(steps)} of them, nearest first: " + ", ".join(words) + ", …"
    return ", ".join(words)


def walk_back(fd: Stage, ref: Trace, cand: Trace, stage_of_cand: dict[int, Stage]) -> tuple[Stage | None, str]:
    """From a first divergence that only inherits its error, the stage upstream where the error starts:
    step to the input stage carrying the largest relative error until a stage's own error (re-run on
    the reference's inputs) is most of its error, or its inputs carry none (CARRIES_REL).  Returns
    (that stage, or None when the error comes from records with no reference counterpart; a note)."""
    cur, path = fd, [fd]
    while len(path) <= WALK_VISITED:
        carrying = [u for u in upstream_stages(cur, cand, stage_of_cand)
                    if u.cand.kind != "input" and u.stats.max_abs > 0 and _relative(u, ref) > CARRIES_REL]
        if not carrying:
            break
        cur = max(carrying, key=lambda u: (_relative(u, ref), u.index))
        path.append(cur)
        if cur.local is not None and cur.local.max_abs > 0 and cur.local.max_abs >= OWN_SHARE * cur.stats.max_abs:
            break
    if cur is fd:
        between: list = []
        upstream_stages(fd, cand, stage_of_cand, between)
        extra = _extra_steps(between) or ", ".join(cand.records[i].name for i in fd.cand.inputs
                                                   if i not in stage_of_cand)
        return None, ("the error it inherits comes from records with no reference counterpart"
                      + (f" ({extra})" if extra else ""))
    chain = " ← ".join(f"{s.index} {s.ref_name}" for s in path)
    own = (f"re-run alone it is off by max_abs {cur.local.max_abs:.3g} of its {cur.stats.max_abs:.3g}"
           if cur.local is not None else "its inputs carry no error")
    return cur, f"the error the first divergence inherits starts here, by dataflow ({chain}): {own}"


def _above_noise(err: float, ref_value: torch.Tensor) -> bool:
    v = ref_value.detach()
    v = v.to(torch.uint8) if v.dtype == torch.bool else v  # bool has no abs()
    scale = float(v.abs().max()) if v.numel() else 0.0
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
