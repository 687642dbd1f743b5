"""The pipeline: one path from two trace sources to a judged Result.

    source (live model | capture file) -> traces (captured, aligned) -> measure -> locate -> outputs
        -> root cause -> diagnose -> health -> nondeterminism check -> Result -> evidence -> what-if -> judge

Every surface goes through `run` (= `settle(diff(...))`): the CLI in-process or isolated (its candidate
process reads the reference's capture; a crash is diffed from what both capture files hold), streaming, two
capture files, `diffkit.compare` and `assert_models_close`; the trial protocol (diffkit.trials) calls `diff`
for the trials it diffs in full and `settle`s the result it reports.  A streaming diff differs only in how
the traces are obtained (diffkit.traces); everything after that is shared: `explain` runs the back half's
steps, each taking typed values and returning one, and assembles the Result from what they return.
`verdict_of` is the only place that decides the verdict; `settle` (through `judge`) the only one that sets it.
"""
from __future__ import annotations

import copy
import gc
import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from . import progress, whatif
from .align import to_ref_layout
from .capture import FOLD_AFTER, Trace, parameters_of
from .device_memory import Ladder, OutOfDeviceMemory, is_out_of_memory, trace_ran_out
from .describe import output_shape_words, output_structure_words
from .diagnose import diagnose
from .health import may_be_random, reference_health, reinit_zero_parameters, stochastic_reason
from .load import load_reference_for_capture
from .locate import build_stages, locate, output_failed, output_stages, undone_stages
from .measure import FLOAT32_TOLERANCE, Stats, kernelbench_note
from .modelstate import SideState, Sides, Trial, all_parameters, restore_state, seed_all, snapshot_state, to_where_it_left
from .options import Options
from .rerun import SecondRun, check_nondeterminism, drop_statistical, nondeterministic, rerun_differences
from .result import ErrorInfo, Finding, Result, Stage, Values
from .rootcause import find_root_cause
from .runner import capture_writer, clone_inputs, collector_quiet, named_tensors, run_captured
from .sources import CaptureSource, ModelSource, Source, TraceSource
from .stream import name_filter
from .traces import Traces, full_traces, restore_sides, streaming_traces

__all__ = ["ModelSource", "CaptureSource", "TraceSource", "run", "diff", "settle", "judge", "verdict_of",
           "run_captured", "clone_inputs", "capture_writer", "collector_quiet", "named_tensors", "reference_health",
           "may_be_random", "stochastic_reason", "reinit_zero_parameters", "rerun_differences",
           "apply_auto_tolerance", "explain"]


def run(reference: Source, candidate: Source, options: Options | None = None, *, known: dict | None = None,
        error: ErrorInfo | None = None, evidence: Callable[[Result], None] | None = None) -> Result:
    """Diff `candidate` against `reference` and judge it: `settle(diff(...))`.

    known:    Stats measured already (an isolated child's journal), keyed (ref, cand, transform)
    error:    a failure observed outside the traces (a child process that crashed or hung)
    evidence: called with the result before it is judged, to attach findings from outside the run
              (compute-sanitizer reports)
    """
    return settle(diff(reference, candidate, options, known=known, error=error, evidence=evidence))


def diff(reference: Source, candidate: Source, options: Options | None = None, *, known: dict | None = None,
         error: ErrorInfo | None = None, evidence: Callable[[Result], None] | None = None) -> Result:
    """The diff, not yet judged (its verdict ""): the two traces, then `explain` (every step of the back half),
    `evidence` and the what-if search.  `run` judges it at once; the trial protocol (diffkit.trials) adds the
    later trials first, and then `settle`s it."""
    options = options or Options()
    if options.tolerance.mode == "auto":
        if options.is_streaming:
            raise ValueError("--tolerance auto needs every reference value twice; it does not combine with streaming")
        if not isinstance(reference, ModelSource):
            raise ValueError("--tolerance auto re-runs the reference in float64: it needs the reference model, "
                             "not a capture")
    with collector_quiet():
        return _diff(reference, candidate, options, known, error, evidence)


def settle(result: Result) -> Result:
    """Set the verdict of an assembled result, once (`judge`), and return it."""
    result.verdict = judge(result)
    return result


def _diff(reference: Source, candidate: Source, options: Options, known: dict | None, error: ErrorInfo | None,
          evidence: Callable[[Result], None] | None) -> Result:
    """`_diff_once`, again in a mode that keeps fewer values on the device each time the GPU runs out of memory
    (`device_memory.Ladder`): a diff adapts to the card it is given, or says what it needed (exit 2)."""
    device = candidate.device() if isinstance(candidate, ModelSource) else None
    ladder = Ladder.start(device, options.device_memory) if device is not None else None
    if options.gpu_streaming and options.streaming is None and options.tolerance.mode != "auto" \
            and device is not None and device.startswith("cuda"):
        options = options.replace(streaming=True)  # (under the models' own size: traces._stream_setup)
    while True:
        sides = Sides()
        try:
            result = _diff_once(reference, candidate, options, known, error, evidence, sides, ladder is not None)
        except OutOfDeviceMemory as e:
            ran_out = OutOfDeviceMemory(e.where)  # (not `e`: its traceback and context hold the attempt's tensors)
        else:
            if ladder is not None:
                result.meta["device_memory"] = ladder.meta(options)
            return result
        restore_sides(sides, reference, candidate, "before")  # each model as it was before this attempt
        del sides
        gc.collect()
        torch.cuda.empty_cache()
        options = ladder.next(options, ran_out)


def _diff_once(reference: Source, candidate: Source, options: Options, known: dict | None, error: ErrorInfo | None,
               evidence: Callable[[Result], None] | None, sides: Sides, watch: bool) -> Result:
    """One diff in the mode `options` ask for.  `watch`: a device that runs out of memory (in a forward, kept in
    its trace, or raised by diffkit's own steps) raises `OutOfDeviceMemory` for `_diff`'s next step."""
    streaming = options.is_streaming and isinstance(candidate, ModelSource)
    traces = None
    try:
        traces = streaming_traces(reference, candidate, options, sides) if streaming else \
            full_traces(reference, candidate, options, known, sides)
        for trace, side in ((traces.ref, "reference"), (traces.cand, "candidate")):
            if watch and trace_ran_out(trace):
                raise OutOfDeviceMemory(f"in the {side}'s forward at {trace.error.stage}")
        result = explain(traces, reference, candidate, options, error)
        if evidence is not None:
            evidence(result)
        searched = what_if(result, traces, reference, options)
        if searched is not None:
            result.what_if = searched.found
            result.meta["what_if"] = searched.meta
        return result
    except Exception as e:
        if watch and is_out_of_memory(e):
            raise OutOfDeviceMemory(f"{'comparing' if traces is not None else 'capturing'}: "
                                    f"{str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__}") from None
        raise
    finally:
        if traces is not None:
            # extra runs (health, the second run, replays) leave each model as its captured forward did
            restore_sides(traces.sides, reference, candidate, "after")
            for fn in traces.cleanup:
                fn()


# ------------------------------------------------------------------------------------------ the back half
def explain(traces: Traces, reference: Source, candidate: Source, options: Options,
            error: ErrorInfo | None) -> Result:
    """Everything between the traces and the verdict, step by step: measure, locate, the outputs compared,
    root cause, diagnosis, the reference's health, the nondeterminism check; the Result assembled in one
    place (`_assemble`) from what they return.  (The steps annotate the stage rows they are given: status,
    replay, diagnosis.)"""
    measured = measure_stages(traces, reference, options)
    located = locate_divergence(measured.stages, traces.cand)
    outputs = compare_outputs(measured.stages, traces.ref, traces.cand, error)
    if traces.fetch is not None:
        traces.fetch(measured.stages, located.first_divergence)
    cause = find_cause(traces, measured.stages, located, candidate)
    diagnose_stages(traces, (located.first_divergence, cause), reference, candidate)
    health = check_health(traces, reference, options, measured.stages, located.first_divergence)
    second = check_second_run(traces, candidate, options, measured.stages, located.first_divergence, cause,
                              outputs.error)
    return _assemble(traces, reference, candidate, options, measured, located, outputs, cause, health, second)


@dataclass
class Measured:
    """measure: every stage's numbers against tolerance.

    tolerance_mode: "fixed" or "auto" (each stage against a float64 run of the reference);
    fixed_verdict:  with auto, what the fixed rule says; warnings: KernelBench's own call at an output"""

    stages: list[Stage]
    tolerance_mode: str = "fixed"
    fixed_verdict: str | None = None
    warnings: list[str] = field(default_factory=list)


def measure_stages(traces: Traces, reference: Source, options: Options) -> Measured:
    """Every pair measured into a stage row (with --tolerance auto, judged against float64 instead)."""
    ref, cand, tol = traces.ref, traces.cand, options.tolerance
    stages = build_stages(ref, cand, traces.alignment, tol, known=traces.known)
    values = Values.of_traces(ref, cand)
    for s in stages:
        s.values = values
    measured = Measured(stages)
    if tol.mode == "auto":
        fixed = [replace(s) for s in stages]
        fixed_fd = locate(fixed)
        measured.fixed_verdict = "diverged" if output_failed(fixed) or (options.strict and fixed_fd) else "match"
        ref64 = run_captured(_to_float64(reference.model), _to_float64(clone_inputs(list(reference.inputs))),
                             no_grad=options.no_grad)
        apply_auto_tolerance(stages, ref, ref64)
        measured.tolerance_mode = "auto"
    if tol.mode == "fixed":  # (under --tolerance auto the float64 rule decides, not KernelBench's call)
        for s in output_stages(stages):
            note = kernelbench_note(s.stats, getattr(torch, s.ref.dtype)) if s.stats is not None else ""
            if note:
                measured.warnings.append(f"{'the output' if s.ref_name == 'output' else 'output ' + str(s.ref_name)}"
                                         f": {note}")
    return measured


@dataclass
class Located:
    """locate: the first divergence, and the failing stages whose error every reader left behind."""

    first_divergence: Stage | None
    passed_over: set[int]
    warnings: list[str] = field(default_factory=list)


def locate_divergence(stages: list[Stage], cand: Trace) -> Located:
    passed_over = undone_stages(stages, cand.records)
    fd = locate(stages, passed_over)
    located = Located(fd, passed_over)
    for s in stages:
        if fd is not None and s.failed and s.index < fd.index:
            located.warnings.append(f"stage {s.index} {s.ref_name} (candidate {s.cand_name}) is out of tolerance, "
                                    f"but every stage reading it agrees with the reference: the candidate computes it "
                                    f"otherwise, or undoes its error at once; the error that goes on starts at stage "
                                    f"{fd.index}")
    return located


@dataclass
class Outputs:
    """The two outputs compared as KernelBench compares them.

    stage:          the output pair that decides (the first failing one, else the last), or None
    output:         its numbers; structure: (reference, candidate) in words when they nest differently
    shape_mismatch: the first (reference shape, candidate shape) that differs, path by path
    error:          a side that failed, or returned nothing to compare; meta: {"reference_returns"} where the
                    reference returns a container"""

    stage: Stage | None
    output: Stats | None
    structure: tuple[str, str] | None
    shape_mismatch: tuple | None
    error: ErrorInfo | None
    findings: list[Finding] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    meta: dict = field(default_factory=dict)


def compare_outputs(stages: list[Stage], ref: Trace, cand: Trace, error: ErrorInfo | None) -> Outputs:
    outs = output_stages(stages)
    out = next((s for s in outs if s.failed or s.stats is None), outs[-1] if outs else None)
    shapes = [s for s in outs if tuple(s.ref.shape) != tuple(s.cand.shape)]
    # an output tensor whose shape differs may be left unpaired (its element count differs): compare
    # the two outputs path by path, as KernelBench compares them
    r_leaves, c_leaves = _leaves(ref), _leaves(cand)
    differing = [(tuple(r_leaves[p].shape), tuple(c_leaves[p].shape)) for p in sorted(set(r_leaves) & set(c_leaves))
                 if tuple(r_leaves[p].shape) != tuple(c_leaves[p].shape)]
    found = Outputs(out, out.stats if out is not None else None, output_structure(ref, cand),
                    differing[0] if differing else None, error or _trace_error(ref, cand))
    if found.structure is not None:
        found.findings.append(Finding("structure", output_structure_words(found.structure), 1.0))
        if bare_against_held(ref, cand):
            held = "candidate" if ref.output_form == "tensor" else "reference"
            found.warnings.append(f"the {held} returns a {(cand if held == 'candidate' else ref).output_form}, not a "
                                  f"tensor: KernelBench's evaluator reads `output.shape` and fails it whatever its "
                                  f"values (a trailing comma in `return y,`?)")
    elif ref.output_form and ref.output_form != "tensor" and cand.output_form:
        found.meta["reference_returns"] = ref.output_form  # (the trials' clause says KernelBench's answer too)
        found.warnings.append(f"the reference returns a {ref.output_form}: KernelBench's evaluator reads "
                              f"`output.shape` and fails any candidate of it; diffkit compares it tensor by tensor")
    for st in shapes:
        st.diagnosis.append(Finding("shape", output_shape_words((st.ref.shape, st.cand.shape)), 1.0))
    for mismatch in differing:
        found.findings.append(Finding("shape", output_shape_words(mismatch), 1.0))
    if found.error is None and out is None and not cand.stopped and found.structure is None:
        missing = "candidate" if ref.output is not None else "reference"
        form = (cand if missing == "candidate" else ref).output_form
        what = {"NoneType": "None", "": "no tensor"}.get(form, ("an " if form[:1].lower() in "aeiou" else "a ") + form)
        found.error = ErrorInfo(missing, "output", f"the {missing} returned {what}, not a tensor (nor tensors in a "
                                f"tuple, list or dict): nothing to compare", "its forward's return value")
        if form.startswith("tensor of layout"):
            found.error.message = (f"the {missing} returned a {form}: KernelBench's torch.allclose compares dense "
                                   f"(strided) tensors only (return it with .to_dense())")
    return found


def _params_as_begun(source: Source, state: SideState | None) -> dict[str, torch.Tensor]:
    """A side's parameters, with its buffers as they were before its captured forward (a capture file keeps
    them so): a BatchNorm's running statistics, moved by the forwards (and by a re-run), are compared as the
    two models began."""
    return {**source.params(), **(state.before if state is not None else {})}


def find_cause(traces: Traces, stages: list[Stage], located: Located, candidate: Source) -> Stage | None:
    """root cause: the earliest stage that introduces the first divergence's error (diffkit.rootcause)."""
    # the candidate's buffers its forward changed: (the live tensor, its value before, its value after)
    changed = {}
    if traces.sides.cand is not None:
        before, after = traces.sides.cand.before, traces.sides.cand.after
        live = dict(candidate.model.named_buffers()) if isinstance(candidate, ModelSource) else {}
        changed = {n: (live.get(n), b, after[n]) for n, b in before.items()
                   if n in after and not torch.equal(b, after[n])}
    return find_root_cause(stages, located.first_divergence, traces.ref, traces.cand, traces.alignment,
                           window=traces.window, changed=changed, passed_over=located.passed_over)


def diagnose_stages(traces: Traces, stages: tuple[Stage | None, Stage | None], reference: Source,
                    candidate: Source) -> None:
    """diagnose: the first divergence's and the root cause's findings, ranked, put first on each."""
    ref_params = _params_as_begun(reference, traces.sides.ref)
    cand_params = _params_as_begun(candidate, traces.sides.cand)
    for s in {id(x): x for x in stages if x is not None}.values():
        s.diagnosis = diagnose(s, traces.ref, traces.cand, ref_params, cand_params,
                               rename=traces.alignment.rename or None) + s.diagnosis
        if any(f.kind == "nondeterministic" for f in s.diagnosis):  # the re-run disagreed with the run
            drop_statistical(s)
            s.diagnosis.sort(key=lambda f: f.kind != "nondeterministic")


def check_health(traces: Traces, reference: Source, options: Options, stages: list[Stage],
                 fd: Stage | None) -> list[str]:
    """The reference's own health (random, constant output, zero weights): run here, or as its capture says."""
    if isinstance(reference, ModelSource) and options.health and options.tolerance.mode == "fixed" \
            and not traces.window:
        state = traces.sides.ref  # (set: a live reference's forward ran here, in full)
        health = reference_health(reference.model, list(reference.inputs), traces.ref, options.no_grad,
                                  state=state.before,
                                  rerun=fd is not None or output_failed(stages) or may_be_random(reference.model,
                                                                                                 traces.ref))
        # (a reference changing its own state: as its run left it)
        to_where_it_left(reference.model, None, state.parameters, {}, state.attrs_after)
        return health
    if isinstance(reference, CaptureSource) and options.health:
        health = reference.file.info.get("health")  # measured in the reference's own process
        return [str(h) for h in health] if isinstance(health, list) else []
    return []


def check_second_run(traces: Traces, candidate: Source, options: Options, stages: list[Stage], fd: Stage | None,
                     cause: Stage | None, error: ErrorInfo | None) -> SecondRun | None:
    """The nondeterminism check: a live candidate run a second time on the same inputs (diffkit.rerun); a
    capture made by `diffkit capture`, which ran its forward twice, says which records changed."""
    if options.rerun and isinstance(candidate, ModelSource) and error is None and not traces.cand.stopped:
        state = traces.sides.cand  # (set: a live candidate's forward ran here)
        # (attributes put back for the reruns may make them repeat a one-time step, a fold into the weights guarded
        # by a flag: every parameter as the first run left it is kept then, whoever writes it, a kernel included)
        state.whole = all_parameters(candidate.model) if state.attrs_before != state.attrs_after else {}
        try:
            return check_nondeterminism(stages, fd, cause, traces.ref, traces.cand, candidate, options, state,
                                        traces.window)
        finally:  # the parameters its forward wrote and its attributes, as its first run left them
            to_where_it_left(candidate.model, None, state.parameters, state.whole, state.attrs_after)
    if isinstance(candidate, CaptureSource) and fd is not None and fd.cand is not None:
        # `diffkit capture` ran the forward twice and kept which records changed between the runs
        d = (candidate.file.info.get("rerun_differs") or {}).get(fd.cand.name)
        if isinstance(d, dict) and {"elements", "numel", "max_abs"} <= set(d):
            nondeterministic(cause, fd, d)
    return None


def _assemble(traces: Traces, reference: Source, candidate: Source, options: Options, measured: Measured,
              located: Located, outputs: Outputs, cause: Stage | None, health: list[str],
              second: SecondRun | None) -> Result:
    """The Result, from what the steps returned (its verdict is `settle`'s)."""
    stages, fd, cand, tol = measured.stages, located.first_divergence, traces.cand, options.tolerance
    meta = {**traces.meta, "stat": tol.stat, **outputs.meta, "ref_records": len(traces.ref.records),
            "cand_records": len(cand.records), "paired": len(traces.alignment.pairs)}
    if cand.folded:
        # loop results folded into lineage (capture's folding): how many, and where the most were made
        top = sorted(cand.folded.items(), key=lambda kv: -kv[1])[:10]
        meta["cand_folded"] = {"results": sum(cand.folded.values()), "sites": dict(top),
                               "recorded_per_site": FOLD_AFTER}
    if traces.window is not None and fd is not None and fd.local is not None:
        meta["root_cause_window"] = traces.window
    state = traces.sides.cand
    if state is not None and state.stateful:
        meta["stateful"] = state.stateful
    if second is not None:
        meta["second_run"] = second.meta
    findings = outputs.findings + (second.findings if second is not None else [])
    seen = (state.attributes if state is not None else None) or []
    if seen and not any(f.kind == "stateful" for f in findings) and (fd is not None or output_failed(stages)):
        findings.append(Finding("stateful", f"the candidate's forward changes its own state ({', '.join(seen[:3])}): "
                                f"one call computes otherwise than the next, and KernelBench's trials make one "
                                f"call each, on the state the calls before them left", 0.6))
    warnings = list(traces.warnings) + measured.warnings + located.warnings + outputs.warnings \
        + (second.warnings if second is not None else [])
    for s in stages:
        if s.failed and outputs.output is not None and not output_failed(stages) and s is not outputs.stage:
            warnings.append(f"stage {s.index} {s.ref_name} (candidate {s.cand_name}) out of tolerance: "
                            f"max_abs={s.stats.max_abs:.3g}" if s.stats else f"stage {s.index} {s.note}")
    hint = _batch_statistics_hint(fd, reference)
    trial = _this_trial(outputs, output_stages(stages), second, candidate)
    result = Result(verdict="", stages=stages, first_divergence=fd, error=outputs.error, output=outputs.output,
                    atol=tol.atol, rtol=tol.rtol, strict=options.strict, warnings=warnings + ([hint] if hint else []),
                    meta=meta, output_shape_mismatch=outputs.shape_mismatch, root_cause=cause, health=health,
                    tolerance_mode=measured.tolerance_mode, fixed_verdict=measured.fixed_verdict,
                    output_structure=outputs.structure, findings=findings, trials=[trial.to_dict()])
    if result.fixed_verdict is not None:
        verdict, _ = verdict_of(result)
        if result.fixed_verdict != verdict:
            result.warnings.append(f"the fixed tolerance says {result.fixed_verdict}; against the float64 reference "
                                   f"the verdict is {verdict}")
    return result


def _live_reference(reference: Source, options: Options) -> tuple[ModelSource, dict] | None:
    """The reference as a live model for what-if runs, with its buffers as they were before its
    captured forward: the model itself, or rebuilt from a capture that says how it was made."""
    if isinstance(reference, ModelSource):
        return reference, {}
    if isinstance(reference, CaptureSource):
        try:
            side = load_reference_for_capture(reference.file, device=reference.device)
        except Exception:  # a reference that cannot be rebuilt here: no what-if, the diff stands
            return None
        if side is None:
            return None
        return ModelSource(side.model, side.inputs, seed=side.seed), snapshot_state(side.model)
    return None


@dataclass
class WhatIf:
    """what-if: the runs of the reference that explain the divergence, best first (`Result.what_if`), and how
    the search went, or why none ran (`Result.meta["what_if"]`: forwards, seconds, window …, or "skipped")."""

    meta: dict
    found: list[dict] = field(default_factory=list)


def _what_if_steps(done: int, total: int) -> None:
    progress.say(f"what-if runs of the reference: {done} of {total}")


def what_if(result: Result, traces: Traces, reference: Source, options: Options,
            progress: Callable[[int, int], None] | None = None) -> WhatIf | None:
    """Explain the divergence of `result` (assembled, its evidence attached) by what-if runs of the reference
    (`diffkit.whatif`): on by default when the divergent candidate record covers more than one reference stage
    (`options.explain` None), always with True, never with False.  None when no search was due."""
    fd = result.first_divergence
    if options.explain is False or fd is None or fd.ref is None or fd.cand is None or fd.stats is None:
        return None
    if result.error is not None or options.explain_budget == 0:
        return None
    if options.explain is None and (fd.stats.max_abs == 0 or fd.diagnosis and fd.diagnosis[0].kind == "mask_value"
                                    and fd.diagnosis[0].confidence >= 0.9):
        return None  # (all its error in non-finite elements, or a mask written two ways: nothing to search for)
    win = whatif.window(result.stages, traces.ref, fd)
    if options.explain is None and len(win) <= 1 and isinstance(reference, ModelSource):
        return None
    cand_value = fd.cand_value
    if cand_value is None:
        return WhatIf({"skipped": "the candidate's value at the divergence is not at hand"})
    if isinstance(reference, CaptureSource) and not (options.explain is True or options.trusted_capture):
        # rebuilding means running the file the capture names: only for captures this diff made, or on request
        return WhatIf({"skipped": "the reference is a capture: --explain rebuilds and runs the file it "
                                  "names for what-if runs"})
    live = _live_reference(reference, options)
    if live is None:
        return WhatIf({"skipped": "the reference cannot be run here (no model, or its capture does not "
                                  "say how to rebuild it)"})
    src, rebuilt_state = live
    ref_state = traces.sides.ref
    before = (ref_state.before if ref_state is not None else rebuilt_state) if isinstance(reference, ModelSource) \
        else rebuilt_state
    after = snapshot_state(src.model)
    keep = None
    if options.is_streaming:
        keep = name_filter(options.only)

    def run_once(model, inputs, sink, mutator, snapshot=True) -> Trace:
        """One forward of the reference as its captured one ran (state, seed), under capture."""
        restore_state(model, before)
        if src.seed is not None:
            seed_all(src.seed)
        return run_captured(model, clone_inputs(list(inputs)), no_grad=options.no_grad, only=keep, sink=sink,
                            snapshot=snapshot, mutator=mutator)

    records = traces.ref.records
    if not isinstance(reference, ModelSource):
        # a captured reference keeps no calls to plant into: capture the rebuilt one (values not kept)
        # and use its records, if it makes the same records under the same names
        rebuilt = run_once(src.model, src.inputs, None, None, snapshot=False)
        records = rebuilt.records
        if [r.name for r in records[:fd.ref.index + 1]] != [r.name for r in traces.ref.records[:fd.ref.index + 1]]:
            return WhatIf({"skipped": "the reference rebuilt from its capture does not record the same "
                                      "stages as the capture (its source changed?)"})
        win = whatif.window(result.stages, rebuilt, fd)
        if options.explain is None and len(win) <= 1:
            return None
    target = to_ref_layout(cand_value, tuple(fd.ref.shape), fd.pair_transform)
    search = whatif.Search(model=src.model, inputs=list(src.inputs), run=run_once, target=fd.ref.index,
                           cand_value=target, atol=fd.stats.atol, rtol=fd.stats.rtol, window=win,
                           budget=options.explain_budget, seconds_budget=options.explain_seconds or math.inf,
                           progress=progress or _what_if_steps)
    params = {n: p.detach().clone() for n, p in parameters_of(src.model)}
    try:
        found = whatif.search(search, whatif.model_constants(src.model), records)
    except Exception as e:  # a what-if failure never costs the diff its answer
        return WhatIf({"skipped": f"the what-if search failed: {type(e).__name__}: {e}"[:300],
                       "forwards": search.forwards})
    finally:
        restore_state(src.model, after)
        with torch.no_grad():
            for n, p in parameters_of(src.model):
                if n in params and not torch.equal(p, params[n]):
                    p.copy_(params[n])
    searched = WhatIf({"forwards": search.forwards, "seconds": round(search.seconds, 3), "variants": search.tried,
                       "window": len(win), "stage": fd.ref.name, "explained": bool(found and found[0].explains)},
                      [w.to_dict(fd.stats) for w in found[:5]])
    if search.left:
        searched.meta.update(out_of_time=True, variants_left=search.left, seconds_budget=options.explain_seconds)
    return searched


def _leaves(trace: Trace) -> dict[str, Any]:
    """The output's tensors by their path in the returned structure ('' for a lone tensor)."""
    out = {}
    for r in trace.records:
        if r.is_output:
            # (a submodule's output returned as it is keeps the submodule's name: `output` is an alias)
            path = next((n for n in (r.name, *r.aliases) if n.split("#")[0] == "output"), r.name).split("#")[0]
            out[path[len("output"):] if path.startswith("output") else path] = r
            for a in r.aliases:  # the same tensor returned at several places (``return y, y``)
                if a.startswith("output[") or a.startswith("output."):
                    out.setdefault(a.split("#")[0][len("output"):], r)
    return out


def _describe_leaves(leaves: dict[str, Any]) -> str:
    if list(leaves) == [""]:
        return f"a tensor {list(leaves[''].shape)}"
    if not leaves:
        return "no tensor"
    paths = sorted(leaves)
    return f"{len(leaves)} tensors at " + ", ".join(f"output{p} {list(leaves[p].shape)}" for p in paths[:6]) \
        + (" …" if len(leaves) > 6 else "")


def _other_leaves_differ(ro: dict | None, co: dict | None, form: str) -> tuple[str, str] | None:
    """The outputs' leaves that are not tensors (``return y, 3`` against ``return y, 4``), in words, when both are
    known and they differ; else None."""
    if ro is None or co is None or ro == co:
        return None
    paths = sorted(set(ro) | set(co))
    diff = [p for p in paths if not _same_leaf(ro.get(p), co.get(p))]
    if not diff:
        return None

    def words(side: dict) -> str:
        shown = ", ".join(f"{side.get(p, 'no such leaf')} at output{p}" for p in diff[:4]) + (" …" if len(diff) > 4
                                                                                               else "")
        return f"a {form or 'structure'} holding {shown}"
    return words(ro), words(co)


def _same_leaf(r: str | None, c: str | None) -> bool:
    """Two non-tensor output leaves as kept (their text): equal, or two floats within KernelBench's float32
    tolerance (a Python float computed in another order)."""
    if r == c:
        return True
    try:
        a, b = float(r), float(c)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False
    return math.isclose(a, b, rel_tol=FLOAT32_TOLERANCE, abs_tol=FLOAT32_TOLERANCE) or (a != a and b != b)


def bare_against_held(ref: Trace, cand: Trace) -> bool:
    """One side returned a bare tensor, the other its tensor(s) inside a container (known for both)."""
    rf, cf = ref.output_form, cand.output_form
    return bool(rf and cf) and (rf == "tensor") != (cf == "tensor")


def output_structure(ref: Trace, cand: Trace) -> tuple[str, str] | None:
    """(reference, candidate) in words when the two outputs nest differently (a tensor against a
    tuple, another number of tensors, other keys); None when their structures agree or a side
    returned nothing (that is an error, not a divergence).  A bare tensor against one inside a
    container differs too: KernelBench's evaluator reads ``output.shape``, which a tuple has not."""
    r, c = _leaves(ref), _leaves(cand)
    if not r or not c:
        return None
    rf, cf = ref.output_form, cand.output_form
    bare_vs_held = bare_against_held(ref, cand)
    if set(r) == set(c) and not bare_vs_held:
        return _other_leaves_differ(ref.output_others, cand.output_others, rf)

    def words(leaves: dict, form: str) -> str:
        text = _describe_leaves(leaves)
        if bare_vs_held and form != "tensor":
            return f"a {form} holding " + (text if len(leaves) > 1 else text.replace("a tensor", "one tensor", 1))
        return text
    return words(r, rf), words(c, cf)


def _trace_error(ref: Trace, cand: Trace) -> ErrorInfo | None:
    for side, tr in (("reference", ref), ("candidate", cand)):
        if tr.error is not None:
            e = tr.error
            return ErrorInfo(side, "forward", f"{e.type}: {e.message}", e.stage, e.traceback)
    return None


# ------------------------------------------------------------------------------------------ judge
def judge(result: Result) -> str:
    """The verdict of `result` (`verdict_of`), putting first the warning that goes with it; `settle` sets it."""
    verdict, warning = verdict_of(result)
    if warning:
        result.warnings.insert(0, warning)
    return verdict


def verdict_of(result: Result) -> tuple[str, str | None]:
    """The verdict, from the evidence in `result` (the one place it is decided), and the warning to put first
    with it (None where none is due).

    error      a side failed to build, run or return an output (a forward stopped on purpose by
               --stop-at-first is not a failure)
    diverged   the output is out of tolerance or of another shape; or, with `strict`, any stage is;
               or a KernelBench trial failed (another trial's inputs, or the candidate's second run on
               the same inputs: see diffkit.trials); or the output passed but compute-sanitizer
               reported errors, or a stage carries a race / memory-error finding (the warning says so)
    match      otherwise (stages out of tolerance under a passing output are warnings)
    """
    if result.error is not None:
        return "error", None
    stopped = bool(result.meta.get("stopped"))
    if result.output_structure is not None:
        return "diverged", None
    outs = result.output_stages
    if not outs:
        return ("diverged" if stopped and result.first_divergence is not None else "error"), None
    if result.output_shape_mismatch is not None or any(s.failed or s.stats is None for s in outs):
        return "diverged", None
    if stopped and result.first_divergence is not None:
        return "diverged", None
    if result.strict and any(s.failed for s in result.stages):
        return "diverged", None
    if result.tolerance_mode == "fixed" and any(not t.get("allclose", True) for t in result.trials):
        return "diverged", None  # a trial (or the candidate's second run on one) failed KernelBench's rule
    if result.meta.get("sanitizer_errors") or any(f.kind in ("race", "memory_error") for s in result.stages
                                                   for f in s.diagnosis):
        if any("compute-sanitizer reported" in w for w in result.warnings):
            return "diverged", None
        n = result.meta.get("sanitizer_errors") or "some"
        return "diverged", f"compute-sanitizer reported {n} error(s): the output matched, the kernels are still wrong"
    return "match", None


# ------------------------------------------------------------------------------------------ --tolerance auto
# TorchDynamo's same() rule against a float64 run of the reference
AUTO_MULTIPLIER = 3.0
AUTO_FLOOR = 1e-6


def _rmse(a: torch.Tensor, b: torch.Tensor) -> float:
    d = a.double() - b.double()
    d = torch.where(torch.isfinite(d), d, torch.zeros_like(d))
    return float(d.pow(2).mean().sqrt()) if d.numel() else 0.0


def apply_auto_tolerance(stages: list, ref: Trace, ref64: Trace) -> None:
    """A stage passes when its RMS error against float64 is within AUTO_MULTIPLIER times the float32
    reference's own RMS error against float64, plus AUTO_FLOOR times the value's RMS size.  The
    verdict then follows `Stage.passed`, which reads this rule's answer."""
    same_code = len(ref.records) == len(ref64.records) and all(
        a.name == b.name for a, b in zip(ref.records, ref64.records))
    for s in stages:
        if s.stats is None or s.ref is None or not same_code:
            continue
        rrec = ref.records[s.ref.index]
        if not rrec.dtype.is_floating_point:
            continue
        r64 = ref64.records[s.ref.index].value
        if r64 is None or tuple(r64.shape) != tuple(s.ref.shape):
            continue
        c = to_ref_layout(s.cand_value, tuple(s.ref.shape), s.pair_transform)
        ref_err = _rmse(rrec.value, r64)
        cand_err = _rmse(c, r64)
        size = float(r64.double().pow(2).mean().sqrt()) if r64.numel() else 0.0
        bound = AUTO_MULTIPLIER * ref_err + AUTO_FLOOR * max(size, 1.0)
        nan_bad = bool((~torch.isfinite(c) & torch.isfinite(r64)).any())
        ok = cand_err <= bound and not nan_bad
        s.auto = {"ref_rmse": ref_err, "cand_rmse": cand_err, "bound": bound, "ok": ok}
        s.status = "ok" if ok else "diverged"


def _to_float64(obj: Any) -> Any:
    if isinstance(obj, torch.nn.Module):
        return copy.deepcopy(obj).to(torch.float64)
    return pytree.tree_map(lambda v: v.to(torch.float64) if isinstance(v, torch.Tensor) and v.is_floating_point()
                           else v, obj)


# ------------------------------------------------------------------------------------------ evidence


def _batch_statistics_hint(fd: Stage | None, reference: Source) -> str | None:
    """A first divergence at a BatchNorm the reference runs in training mode: the warning that the reference
    normalises with the batch's statistics there, the usual reason a candidate written for eval() (running
    statistics) fails KernelBench's protocol."""
    if fd is None or fd.ref is None or "BatchNorm" not in (fd.ref.op or ""):
        return None
    training = None
    if isinstance(reference, ModelSource):
        mod = dict(reference.model.named_modules()).get(fd.ref.name.split("#")[0])
        training = getattr(mod, "training", None)
    elif isinstance(reference, CaptureSource):
        training = reference.file.info.get("training")
    if not training:
        return None
    return (f"stage {fd.index} {fd.ref_name} is a {fd.ref.op.split('.')[-1]} in training mode: the reference "
            f"normalises with this batch's mean and variance (KernelBench never calls eval()); a candidate using the "
            f"running statistics differs exactly here (--eval compares both models in eval mode)")


def _this_trial(outputs: Outputs, outs: list[Stage], second: SecondRun | None, candidate: Source) -> Trial:
    """This run as one KernelBench trial: did the output (of both of the candidate's runs) pass?"""
    t = Trial(1, getattr(candidate, "seed", None), captured=True)
    out = outputs.output
    if out is not None:
        t.max_abs, t.mean_abs = out.max_abs, out.mean_abs
    if outputs.error is not None:
        t.error, t.error_side = outputs.error.message, outputs.error.side
    dtypes = [s for s in outs if s.ref.dtype != s.cand.dtype]
    if dtypes:  # torch.allclose refuses mixed dtypes: KernelBench fails the trial
        t.dtype_mismatch = [dtypes[0].ref.dtype, dtypes[0].cand.dtype]
    if outputs.shape_mismatch is not None:
        t.shape_mismatch = [list(x) for x in outputs.shape_mismatch]
    passed = outputs.error is None and outputs.structure is None and bool(outs) and \
        outputs.shape_mismatch is None and all(s.passed for s in outs) and not dtypes
    t.failed_run = None if passed else 1
    second_run = second.meta if second is not None else {}
    if second_run.get("output"):
        t.nondeterministic = dict(second_run["output"])
    elif second_run.get("records"):
        name, d = next(iter(second_run["records"].items()))
        t.nondeterministic = {**d, "where": name}
    # (the second run of a forward that changes its own state is another computation, one KernelBench never makes:
    # it says how the runs differ and does not fail the trial)
    again = second.second if second is not None else None
    if passed and again is not None and not again["allclose"] and not again.get("stateful"):
        passed, t.failed_run, t.max_abs, t.mean_abs = False, 2, again["max_abs"], again["mean_abs"]
    t.allclose = passed
    # torch.allclose itself, whatever rule judged the stages (--stat, --tolerance auto): both runs
    kb = outputs.error is None and outputs.structure is None and outputs.shape_mismatch is None and not dtypes \
        and bool(outs) and all(s.stats is not None and s.stats.allclose for s in outs) \
        and (again is None or again.get("stateful") or bool(again.get("kernelbench", again["allclose"])))
    t.kernelbench = kb if kb != passed else None
    return t
