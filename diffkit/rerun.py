"""The candidate run twice on the same inputs: a second run whose values differ bitwise from the first's is
a race, an uninitialised read or randomness (`nondeterministic`), or a forward that changes its own state
(`stateful`); and the second run's output is judged by KernelBench's rule too.

(Split from diffkit.pipeline; layer 9: it imports align, capture, locate, measure, modelstate, options, result
and runner.)
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Sequence

import torch

from .align import to_ref_layout
from .capture import Trace
from .diagnose import unwritten_that_varies
from .locate import output_failed, output_stages
from .measure import measure
from .modelstate import (WRITTEN_PARAMETER, SideState, bitwise_difference, difference_words, output_leaves,
                         parameter_marks, parameter_sums, to_first_state, to_where_it_left, written_parameters)
from .options import Options
from .result import Finding, Stage
from .runner import clone_inputs, run_captured

__all__ = ["SecondRun", "check_nondeterminism", "nondeterministic", "drop_statistical", "rerun_differences"]


def drop_statistical(stage) -> None:
    """Leave out a stage's rounding-size findings (approximation, precision): run-to-run noise explains it."""
    stage.diagnosis = [f for f in stage.diagnosis if f.kind not in ("approximation", "precision")]


def rerun_differences(first: Trace, again: Trace, names: set[str] | None = None) -> dict[str, dict]:
    """Records (by name) whose values differ bitwise between two runs on the same inputs:
    {name: {"elements", "numel", "max_abs", "at"}} (see trials.bitwise_difference)."""
    by_name = {r.name: r for r in again.records}
    out: dict[str, dict] = {}
    for a in first.records:
        b = by_name.get(a.name)
        if (names is not None and a.name not in names) or b is None or a.value is None or b.value is None \
                or a.shape != b.shape or a.kind == "input":
            continue
        d = bitwise_difference(a.value, b.value)
        if d is not None:
            out[a.name] = d
    return out


class _RerunComparer:
    """Capture sink for the candidate's second run: each record is compared bitwise with the first
    run's record at the same position as soon as it is made; only the differences are kept (and the
    values of output records that differ, to judge the second run's output)."""

    owns_values = True

    def __init__(self, first: Trace):
        self.first = first
        self.records: list = []
        self.found: dict[int, dict] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.error = None

    def _partner(self, rec):
        a = self.first.records[rec.index] if rec.index < len(self.first.records) else None
        return a if a is not None and a.value is not None else None

    def add(self, rec, tensor: torch.Tensor) -> None:
        self.records.append(rec)
        a = self._partner(rec)
        if rec.kind == "input" or a is None:
            return
        d = bitwise_difference(a.value, tensor.detach())
        if d is not None:
            self.found[rec.index] = d
            if rec.is_output:
                self.outputs[rec.index] = tensor.detach().clone()

    def update(self, rec, tensor: torch.Tensor | None = None) -> None:
        # another name for a record already compared (the same tensor); it may turn out to be the output
        if rec.is_output and rec.index in self.found and rec.index not in self.outputs and tensor is not None:
            self.outputs[rec.index] = tensor.detach().clone()

    def set_error(self, err) -> None:
        self.error = err

    def close(self) -> None:
        pass

    def differences(self) -> dict[str, tuple[dict, torch.Tensor]]:
        """{first run's record name: (difference, second run's value)}; positions whose records no
        longer correspond (another control flow) are left out."""
        out = {}
        for i, d in self.found.items():
            a, b = self.first.records[i], self.records[i] if i < len(self.records) else None
            if b is not None and b.name == a.name:
                out[a.name] = (d, self.outputs.get(i))
        return out


def nondeterministic(root_cause: Stage | None, stage: Stage, d: dict, drop: bool = True,
                     kept: Sequence[str] = (), traces: tuple[Trace, Trace] | None = None) -> None:
    """Say on `stage` that the candidate's two runs differ there (`d`: a bitwise difference): a race, or with
    `kept` (what its forward changed of its own state) a forward that computes otherwise from call to call.
    `drop`: the rounding-size findings of the stage and of `root_cause` go (run-to-run noise explains them).
    `traces` (reference, candidate's first run): where the difference stays inside the one block that holds
    the stage's error, that block is named first (`unwritten_region`), the difference its evidence."""
    if not kept and traces is not None and _unwritten(stage, d, traces):
        return
    if kept:  # the forward changed the model's own state: a second call is another computation
        if any(f.kind == "stateful" for f in stage.diagnosis):
            return
        found = Finding(
            "stateful", f"running the candidate twice on the same inputs gives different values here "
            f"({difference_words(d)}), and its forward changes its own state: {', '.join(kept[:3])} -- it "
            f"computes otherwise from one call to the next (KernelBench calls it once per trial)", 0.8)
        if any(k.endswith(WRITTEN_PARAMETER) for k in kept):
            # its weights moved under it: what the values look like says nothing of a kernel's mistake
            drop_statistical(stage)
            stage.diagnosis.insert(0, found)
        else:  # (a call counter taking another path: what that path computes is still worth naming)
            stage.diagnosis.append(found)
        return
    if drop:
        drop_statistical(stage)  # run-to-run noise is the explanation; a rounding-size guess would be wrong
        if root_cause is not None and root_cause is not stage:
            drop_statistical(root_cause)
    if any(f.kind == "nondeterministic" for f in stage.diagnosis):
        return
    stage.diagnosis.insert(0, Finding(
        "nondeterministic", f"running the candidate twice on the same inputs gives different values here: "
        f"{difference_words(d)} -- a race, an uninitialised read or randomness in the kernel", 0.9))


def _unwritten(stage: Stage, d: dict, traces: tuple[Trace, Trace]) -> bool:
    """Put an `unwritten_region` finding first on `stage` when its run-to-run difference `d` lies inside the block
    that holds its error (diagnose.unwritten_that_varies); the region findings made from one run go."""
    ref, cand = traces
    if stage.ref is None or stage.cand is None or stage.ref.index >= len(ref.records) or \
            stage.cand.index >= len(cand.records):
        return False
    found = unwritten_that_varies(stage, ref.records[stage.ref.index].value, cand.records[stage.cand.index].value, d)
    if found is None:
        return False
    drop_statistical(stage)
    stage.diagnosis = [found] + [f for f in stage.diagnosis if f.kind not in ("unwritten_region", "boundary",
                                                                             "nondeterministic")]
    return True


@dataclass
class SecondRun:
    """What running the candidate a second time on the same inputs found.

    meta:     Result.meta["second_run"]: {"differs": how many records differ, "stateful", "records",
              "output", "first_difference"}
    findings: run-level findings (nondeterministic, or stateful: its forward changes its own state)
    warnings: a nondeterministic candidate whose runs are both within tolerance
    second:   the second run's output against the reference when it differs from the first's: {"allclose",
              "max_abs", "mean_abs", "stage", "stateful"}; None otherwise"""

    meta: dict
    findings: list[Finding] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    second: dict | None = None


def check_nondeterminism(stages: list[Stage], fd: Stage | None, root_cause: Stage | None, ref: Trace,
                         cand_trace: Trace, candidate, options: Options, state: SideState,
                         window: int | None) -> SecondRun:
    """Run the candidate (`candidate`: a pipeline.ModelSource) a second time on the same inputs, from the
    same state (`state`: its buffers as they were before its captured forward; not re-seeded, so randomness
    shows): any record whose value differs bitwise is a `nondeterministic` finding on its stage, whatever
    the tolerance.  `window`: a streaming diff's (the first run's values kept for a few stages only)."""
    model, inputs = candidate.model, list(candidate.inputs)
    before, guard = state.before, state.parameters

    def from_first_state() -> bool:
        return to_first_state(model, before, state.attrs_before, guard)

    same = from_first_state()
    # a plain second forward first: only when its output differs from the first run's bitwise does the
    # record that first changed matter, and only then is the candidate captured a third time to find it
    marks = parameter_marks(model)
    differs = _second_output_differs(model, inputs, cand_trace, options)
    whole = state.whole
    if differs and (whole or (guard is not None and guard.kept)):
        # the state put back may be one the model is never in (weights unfolded, the flag that guards the fold
        # kept): once more from where the first run left it (buffers put back); the same output then says the
        # difference was the state, not a race
        to_where_it_left(model, before, guard, whole, state.attrs_after)
        differs = _second_output_differs(model, inputs, cand_trace, options)
    if not differs:
        return SecondRun({"differs": 0})
    # from the same state, a forward that changes its own state repeats itself: a difference is a race, unless
    # the state could not all be put back (parameters it wrote with no values from before), or it wrote into
    # its parameters unseen (a kernel given the pointer: found by value around the captured run that follows)
    written = [w for w in written_parameters(marks, parameter_marks(model))  # (a write that moved no value aside)
               if guard is None or guard.moved_since(w[:-len(WRITTEN_PARAMETER)])]
    same = from_first_state() and same
    sums = parameter_sums(model) if same else None
    diffs = _captured_differences(stages, fd, cand_trace, candidate, options, window)
    if sums is not None:
        kept = written_parameters(sums, parameter_sums(model))  # (the first run wrote them too, and their values
        # from before were not known)
    else:
        kept = state.attributes + [w for w in written if w not in state.attributes]
    return _differences_found(stages, fd, root_cause, (ref, cand_trace), diffs, kept)


def _captured_differences(stages: list[Stage], fd: Stage | None, cand_trace: Trace, candidate, options: Options,
                          window: int | None) -> dict[str, tuple[dict, torch.Tensor | None]]:
    """The candidate captured once more: {record name: (its bitwise difference from the first run, the
    second run's value where it is an output)}."""
    model, inputs = candidate.model, list(candidate.inputs)
    if window is None:
        sink = _RerunComparer(cand_trace)
        run_captured(model, clone_inputs(inputs), no_grad=options.no_grad, sink=sink, fold=candidate.fold,
                     fold_writes=candidate.fold_writes)
        return sink.differences()
    # streaming: the first run's values are kept for a few stages only -- re-capture those (the first
    # divergence) and the output (a filter sees names before their #k suffix, so the k-th of them gets
    # the same name again)
    wanted = {n for s in output_stages(stages) for n in s.cand.names()}
    if fd is not None and fd.cand is not None:
        wanted |= set(fd.cand.names())
    bases = {n.split("#")[0] for n in wanted}
    again = run_captured(model, clone_inputs(inputs), no_grad=options.no_grad,
                         only=lambda n: n.split("#")[0] in bases, fold=candidate.fold,
                         fold_writes=candidate.fold_writes)
    by_name = {r.name: r for r in again.records}
    return {n: (d, by_name[n].value) for n, d in rerun_differences(cand_trace, again, wanted).items()}


def _differences_found(stages: list[Stage], fd: Stage | None, root_cause: Stage | None, traces: tuple[Trace, Trace],
                       diffs: dict[str, tuple[dict, torch.Tensor | None]], kept: list[str]) -> SecondRun:
    """What the records that differ between the two runs say (`kept`: what the forward changed of its own
    state): findings on their stages (the first one that fails, the first divergence), one for the run,
    and how the second run's output fares against the reference."""
    ref = traces[0]
    found = SecondRun({"differs": len(diffs)})
    if not diffs:
        if kept:  # the second run's output differed, the captured third equals the first: state, not a race
            words = (f"running the candidate again on the same inputs gives another output, and its forward changes "
                     f"its own state ({', '.join(kept[:3])}): it computes otherwise from one call to the next")
            found.findings.append(Finding("stateful", words, 0.9))
            found.meta["stateful"] = kept[:20]
        return found
    found.meta["records"] = {n: d for n, (d, _) in list(diffs.items())[:20]}
    by_cand = {s.cand.name: s for s in stages if s.cand is not None}
    hit = sorted((by_cand[n] for n in diffs if n in by_cand), key=lambda s: s.index)
    first = hit[0] if hit else None
    if first is not None and first.failed:  # a passing stage keeps a clean row: the run-level finding names it
        nondeterministic(root_cause, first, diffs[first.cand.name][0], drop=first is fd, kept=kept, traces=traces)
    if fd is not None and fd.cand is not None and fd.cand.name in diffs and fd is not first:
        nondeterministic(root_cause, fd, diffs[fd.cand.name][0], kept=kept, traces=traces)
    outs = output_stages(stages)
    for s in outs:
        got = diffs.get(s.cand.name)
        rv = ref.records[s.ref.index].value if s.ref is not None else None
        if got is None or got[1] is None or rv is None or s.stats is None or \
                tuple(got[1].shape) != tuple(s.cand.shape):
            continue
        st = measure(rv, to_ref_layout(got[1], tuple(s.ref.shape), s.pair_transform), s.stats.atol, s.stats.rtol,
                     s.stats.stat)
        if found.second is None or not st.ok:
            found.second = {"allclose": st.ok, "kernelbench": st.allclose, "max_abs": st.max_abs,
                            "mean_abs": st.mean_abs, "stage": s.index, "stateful": bool(kept)}
    where = f"stage {first.index} {first.ref_name or first.cand_name}" if first is not None else next(iter(diffs))
    out_name = next((s.cand.name for s in outs if s.cand.name in diffs), None)
    out_d = diffs[out_name][0] if out_name is not None else None
    if out_d is not None:
        found.meta["output"] = {**out_d, "where": out_name}
    words = (f"running the candidate twice on the same inputs gives different values, first at {where}"
             + (f"; output: {difference_words(out_d)}" if out_d is not None else "; the output is bitwise equal")
             + (f" -- its forward changes its own state ({', '.join(kept[:3])}): it computes otherwise from one "
                f"call to the next" if kept else " -- a race, an uninitialised read or randomness"))
    found.findings.append(Finding("stateful" if kept else "nondeterministic", words, 0.9))
    if not output_failed(stages) and (found.second is None or found.second["allclose"]):
        found.warnings.append(f"the candidate is nondeterministic: {words}; both runs are within tolerance, "
                              f"another GPU or input may not be")
    found.meta["first_difference"] = where
    return found


def _second_output_differs(model: torch.nn.Module, inputs: list, first: Trace, options: Options) -> bool:
    """Run the candidate once more, uncaptured, on the same inputs: does any output leaf differ bitwise
    from the captured run's?  (An error or a missing value counts as a difference: the captured
    rerun that follows reports it.)"""
    try:
        with torch.no_grad() if options.no_grad else contextlib.nullcontext():
            out = model(*clone_inputs(inputs))
    except Exception:
        return True
    again = output_leaves(out)
    recs = {n: r for r in first.records if r.is_output for n in r.names()}
    for name, value in again.items():
        rec = recs.get(name)
        if rec is None or rec.value is None or bitwise_difference(rec.value, value) is not None:
            return True
    return not again
