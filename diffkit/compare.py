"""The Python entry points: `compare` (two live models), `compare_traces` (two traces or captures),
`diff_files` (KernelBench files or capture directories).  Each builds `Options` once and calls
`pipeline.run`; nothing here runs a stage of the diff itself."""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from typing import Any, Iterable, Sequence

import torch

from . import handoff
from .capture import Trace
from .device_memory import cap_process
from .errors import DiffkitError
from .harden import harden, harden_models
from .health import may_be_random, reference_health, reinit_zero_parameters
from .load import LoadedPair, load_candidate_for_capture, load_pair, load_reference, sync_weights
from .modelstate import restore_state, seed_all, snapshot_state
from .options import Options
from .pipeline import apply_auto_tolerance, run, settle
from .rerun import rerun_differences
from .result import ErrorInfo, Result
from .runner import capture_writer, clone_inputs, named_tensors, run_captured
from .sources import CaptureSource, ModelSource, TraceSource
from .store import CaptureFile
from .stream import name_filter
from .trials import CapturedTrials, LiveCandidate, LiveReference, run_trials, trial_seeds, write_trials

__all__ = ["compare", "compare_traces", "diff_files", "capture_reference", "run_captured", "reference_health",
           "reinit_zero_parameters", "apply_auto_tolerance", "is_capture", "error_result"]


def _check_models(ref_model: Any, cand_model: Any, inputs: Any) -> None:
    """A sentence for arguments compare() cannot take (paths belong to diff_files, inputs are a sequence)."""
    paths = [isinstance(m, (str, os.PathLike)) for m in (ref_model, cand_model)]
    if any(paths):
        raise TypeError("diffkit.compare() takes two models (torch.nn.Module) and their inputs; for files use "
                        "diffkit.diff_files(ref_path, cand_path, ...) (KernelBench's construction and inputs), or "
                        "diffkit.load_pair(ref_path, cand_path) to build the models yourself")
    for side, m in (("reference", ref_model), ("candidate", cand_model)):
        if not isinstance(m, torch.nn.Module):
            raise TypeError(f"diffkit.compare(): the {side} model must be a torch.nn.Module, not "
                            f"{type(m).__name__}")
    if inputs is None or isinstance(inputs, (torch.Tensor, str, bytes, dict)) or not isinstance(inputs, Iterable):
        raise TypeError(f"diffkit.compare(): `inputs` must be a list or tuple of the forward's arguments "
                        f"(e.g. [torch.randn(8, 512)]), not {type(inputs).__name__}")


def compare(ref_model: torch.nn.Module, cand_model: torch.nn.Module, inputs: Sequence[Any] | None = None,
            atol: float | None = None, rtol: float | None = None, *, cand_inputs: Sequence[Any] | None = None,
            options: Options | None = None, **settings) -> Result:
    """Run both models on (clones of) `inputs` and say where the candidate first diverges.

    `atol`/`rtol` default to KernelBench's per-dtype tolerance (1e-4 float32, 1e-2 half/bfloat16).
    Any other `Options` field may be given by keyword (`tolerance="auto"`, `strict=True`,
    `max_memory=…`, `only=…`, `stop_at_first=True`, `health=False`, `sync_weights=True` (the reference's
    parameters and buffers copied into the candidate by name first) …), or a whole `options`.  `inputs` may
    be any iterable (a generator is read once).
    """
    _check_models(ref_model, cand_model, inputs)
    inputs = list(inputs)
    opts = options or Options.build(atol=atol, rtol=rtol, **settings)
    weights = sync_weights(ref_model, cand_model) if opts.sync_weights else None
    ref_in = clone_inputs(inputs)
    cand_in = clone_inputs(list(cand_inputs if cand_inputs is not None else inputs))
    # eval=True: both models in eval() for the diff (dropout off, norms on running statistics), as the files'
    # surfaces put the models they build; the caller's models are left in the mode they were given in
    modes = [(m, m.training) for model in (ref_model, cand_model) for m in model.modules()] if opts.eval else []
    for m, _ in modes:
        m.train(False)
    try:
        result = run(ModelSource(ref_model, ref_in),
                     ModelSource(cand_model, cand_in, follows_inputs=cand_inputs is None), opts)
    finally:
        for m, training in modes:
            m.training = training
    if opts.eval:
        result.meta["protocol"] = {**result.meta.get("protocol", {}), "eval": True}
    if weights is not None:
        result.weights = weights
        result.meta["protocol"] = {**result.meta.get("protocol", {}), "sync_weights": True}
    if opts.harden and result.verdict != "error":
        if cand_inputs is not None:
            result.warnings.append("--harden: not run (the candidate was given inputs of its own)")
        else:
            result.harden = harden_models(ref_model, cand_model, clone_inputs(list(inputs)), opts)
    return result


def compare_traces(ref: Trace, cand: Trace, atol: float | None = None, rtol: float | None = None, *,
                   options: Options | None = None, **settings) -> Result:
    """Diff two captured traces (no models: nothing is re-run)."""
    opts = options or Options.build(atol=atol, rtol=rtol, **settings)
    return run(TraceSource(ref), TraceSource(cand), opts)


def error_result(e: DiffkitError, ref_path: str, cand_path: str, options: Options) -> Result:
    """The result of a diff that could not run (a file that does not load, build or construct)."""
    result = Result(verdict="", stages=[], first_divergence=None,
                    error=ErrorInfo(e.side, e.phase, e.message, e.where, e.detail), output=None,
                    atol=options.tolerance.atol, rtol=options.tolerance.rtol, ref_path=ref_path, cand_path=cand_path)
    settle(result)
    return result


def is_capture(path: str) -> bool:
    """Is `path` a capture directory written by `diffkit capture -o` (or an isolated diff)?"""
    return os.path.isdir(path) and os.path.exists(os.path.join(path, "index.json"))


def capture_reference(ref_path: str, out_dir: str, options: Options | None = None, cand_path: str | None = None, *,
                      class_name: str | None = "Model", inputs_from: str | None = None,
                      side: str = "reference", on_init=None, hand_over=None, outputs_only_trials: bool = False) -> Trace:
    """Build the reference as a diff would and stream its first trial's forward, parameters and the
    facts a later candidate needs (source, init inputs, inputs, seeds, health) to a capture directory;
    every later trial's inputs and output go beside it (``trial-K.dkt``, see diffkit.trials).
    `class_name`/`inputs_from`/`side` capture another class (``diffkit capture --side cand``): a
    candidate's capture also keeps which records change when it runs twice (``rerun_differs``).
    `on_init` is given the init inputs once the reference is built (as its constructor left them).
    `hand_over` (an isolated diff's reference process, `handoff.Holder.hand_over`): when the model computes
    on a GPU, its values are not written to the directory (its records are, as names and shapes) but kept on
    the device in the returned trace, and ``hand_over(trace, parameters, info)`` is called once the
    capture's metadata is complete.  `outputs_only_trials`: later trials keep their inputs, output and buffers
    only (`write_trials`; for a reader that can rebuild the reference, as an isolated diff's candidate
    process can)."""
    options = options or Options()
    cap_process(options.device or "cuda", options.device_memory)
    seeds = trial_seeds(options.trials, options.seed)
    built = load_reference(ref_path, seed=seeds[0], device=options.device, eval_mode=options.eval,
                           class_name=class_name, inputs_from=inputs_from, side=side, on_init=on_init)
    reinit = reinit_zero_parameters(built.model) if options.reinit_zero else []
    info = {**built.info(), "input_seed": seeds[0], "kernelbench_seed": options.seed, "reinit_zero": reinit,
            "trials": [{"trial": 1, "seed": seeds[0]}]}
    # written through: this process keeps no captured value (the forward reuses its memory); the few that
    # are needed here are read back from the directory (mapped: not copied).  Handed over on a GPU: the
    # trace keeps every value on the device and the directory gets names and shapes
    held = hand_over is not None and handoff.on_gpu(built.model, built.inputs)
    writer = capture_writer(out_dir, built.model, info, write_through=not held, values=not held)
    before = snapshot_state(built.model)
    seed_all(seeds[0])
    trace = run_captured(built.model, clone_inputs(list(built.inputs)), sink=writer, only=name_filter(options.only),
                         no_grad=options.no_grad)
    if trace.error is None:
        written = CaptureFile.open(out_dir)
        written.mapped = True  # (values read back are views of the files, not copies)

        def fill(which) -> None:
            if not held:  # (handed over, the trace holds them all)
                written.fill(trace, which)
        if built.class_name == "ModelNew":
            fill(lambda r: True)
            # a second forward on the same inputs, from the same state: records that change between runs (a
            # race, an uninitialised read) are kept with the capture, as a live diff's second run finds them
            after = snapshot_state(built.model)
            restore_state(built.model, before)
            again = run_captured(built.model, clone_inputs(list(built.inputs)), no_grad=options.no_grad)
            restore_state(built.model, after)
            info["rerun_differs"] = rerun_differences(trace, again)
        elif options.health and not options.only:
            # the second run only where the reference may draw random numbers: whether the candidate
            # diverges (the other reason to run it) is not known in this process
            random = may_be_random(built.model, trace)
            fill(lambda r: random or r.is_output)  # (all of them when a second run compares them)
            info["health"] = reference_health(built.model, list(built.inputs), trace, options.no_grad, state=before,
                                              rerun=random)
        info["trials"] = write_trials(out_dir, built.model, built.inputs_for, seeds, options.no_grad,
                                      only=name_filter(options.only),
                                      info={k: info[k] for k in ("source", "class", "training", "eval", "health")
                                            if k in info}, outputs_only=outputs_only_trials)
        writer.set_info(info)
    if held:  # the parameters, and the buffers as they were before the first forward (as a written capture has them)
        hand_over(trace, {**named_tensors(built.model), **before}, writer.info)
    return trace


def _scratch() -> str:
    """A folder of this process's own for a capture made during a diff (removed when the process exits: the
    result's values may be read from it until the report is written)."""
    path = tempfile.mkdtemp(prefix="diffkit-scratch-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def trial_entries(path: str) -> list:
    """The trials a capture directory lists (its info's `trials`, validated when it is opened)."""
    return list(CaptureFile.open(path).info.get("trials") or [])


def _resolved(device: str | torch.device) -> torch.device:
    """A device with its index filled in (the current CUDA device for a bare "cuda")."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return d


def diff_files(ref_path: str, cand_path: str, *, options: Options | None = None, atol: float | None = None,
               rtol: float | None = None, evidence=None, **settings) -> Result:
    """Diff KernelBench files: REF (`Model`) against CAND (`ModelNew`), by KernelBench's protocol
    (seed 42 construction, no eval(), nothing copied, `options.trials` trials; see diffkit.trials).
    Either may instead be a capture directory; a candidate file against a captured reference runs
    on the capture's trials (inputs and outputs)."""
    opts = options or Options.build(atol=atol, rtol=rtol, **settings)
    cap_process(opts.device or "cuda", opts.device_memory)
    ref_cap, cand_cap = is_capture(ref_path), is_capture(cand_path)
    if cand_cap and not ref_cap:  # the reference file captured as `diffkit capture` would, then two captures diffed
        ref_dkt = os.path.join(_scratch(), "ref.dkt")
        capture_reference(ref_path, ref_dkt, opts.replace(trials=len(trial_entries(cand_path)) or opts.trials))
        result = diff_files(ref_dkt, cand_path, options=opts, evidence=evidence)
        result.ref_path = ref_path
        result.warnings.append(f"the reference file was captured for this diff (its trials run here, as "
                               f"`diffkit capture {ref_path} -o DIR` would), then the two captures compared")
        return result
    reinit: list[str] = []
    modules = None  # (the two files as run here: --harden reuses them)
    if ref_cap:
        # an isolated diff's own handoff (its reference child wrote it, nothing else will): mapped, not read
        ref_src = CaptureSource(ref_path, device=opts.device or "cpu",
                                mapped=opts.trusted_capture and not opts.is_streaming, trusted=opts.trusted_capture)
        if cand_cap:  # nothing is re-run: the two captures' trials are compared
            cand_src = CaptureSource(cand_path, device=opts.device or "cpu")
            reference = CapturedTrials(ref_path, ref_src.file.info, device=ref_src.device,
                                       trusted_capture=opts.trusted_capture)
            candidate = CapturedTrials(cand_path, cand_src.file.info, device=ref_src.device)
            result = run_trials(reference, candidate, [], opts, evidence=evidence)
            weights = None
        else:
            captured_eval = bool(ref_src.file.info.get("eval"))  # the candidate runs in the mode the reference ran
            side, weights = load_candidate_for_capture(cand_path, ref_src.file, seed=opts.seed, device=opts.device,
                                                       eval_mode=opts.eval or captured_eval, sync=opts.sync_weights)
            if opts.reinit_zero and ref_src.file.info.get("reinit_zero"):
                # the reference's re-initialised weights (saved with its capture) go into the candidate
                params = ref_src.file.parameters()
                chosen = {n: params[n] for n in ref_src.file.info["reinit_zero"] if n in params}
                if chosen:
                    sync_weights(chosen, side.model)
                    reinit = sorted(chosen)
            if ref_src.file.handed is not None:  # its values are on the reference's GPU: compared where they are
                ref_src.device = side.device()
            same = _resolved(ref_src.device) == _resolved(side.device())  # ("cuda" is "cuda:0" on device 0)
            reference = CapturedTrials(ref_path, ref_src.file.info, device=side.device(), first=ref_src if same else None,
                                       trusted_capture=opts.trusted_capture)
            result = run_trials(reference, LiveCandidate(side.model, opts), side.inputs, opts, evidence=evidence)
            if ref_src.file.handed is not None:  # (how the reference's values came: see diffkit.handoff)
                result.meta["reference_values"] = "handed over on the device"
            if opts.eval and not captured_eval:
                result.warnings.append("--eval: the captured reference ran as constructed (training mode); capture "
                                       "it again with --eval to compare both in eval mode")
    else:
        seeds = trial_seeds(opts.trials, opts.seed)
        pair: LoadedPair = load_pair(ref_path, cand_path, seed=seeds[0], device=opts.device, eval_mode=opts.eval,
                                     sync=opts.sync_weights)
        reinit = reinit_zero_parameters(pair.ref, pair.cand) if opts.reinit_zero else []
        reference = LiveReference(pair.ref, pair.inputs_for, seeds, opts.no_grad)
        result = run_trials(reference, LiveCandidate(pair.cand, opts), pair.cand_inputs, opts, evidence=evidence)
        weights = pair.weights
        modules = (pair.ref_module, pair.cand_module)
    if reinit:
        result.warnings.append(f"re-initialised all-zero parameters randomly for this diff: {', '.join(reinit)}")
    result.weights = weights
    result.ref_path, result.cand_path = ref_path, cand_path
    result.meta["seed"] = opts.seed
    result.meta["protocol"] = {"eval": opts.eval, "sync_weights": opts.sync_weights, "trials": opts.trials,
                               "seed": opts.seed}
    if weights is not None and (weights.shape_mismatch or weights.cand_only or weights.differ):
        result.warnings.insert(0, "weights: " + weights.summary())
    if opts.harden and result.verdict != "error":
        _harden_files(ref_path, cand_path, ref_cap, cand_cap, opts, result, modules)
    return result


def _harden_files(ref_path: str, cand_path: str, ref_cap: bool, cand_cap: bool, opts: Options,
                  result: Result, modules: tuple | None) -> None:
    """`--harden` after the diff of two files (a captured reference: the file its capture names)."""
    if cand_cap:
        result.warnings.append("--harden: not run (it rebuilds both models: the candidate must be a .py file)")
        return
    ref_file = ref_path
    if ref_cap:
        ref_file = str(CaptureFile.open(ref_path).info.get("source") or "")
        if not ref_file.endswith(".py") or not os.path.isfile(ref_file):
            result.warnings.append("--harden: not run (the reference capture names no reference file to rebuild)")
            return
    result.harden = harden(ref_file, cand_path, opts, result, modules=modules)
