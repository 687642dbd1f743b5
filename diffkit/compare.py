"""The Python entry points: `compare` (two live models), `compare_traces` (two traces or captures),
`diff_files` (KernelBench files or capture directories).  Each builds `Options` once and calls
`pipeline.run`; nothing here runs a stage of the diff itself."""
from __future__ import annotations

import os
from typing import Any, Sequence

import torch

from .capture import Trace
from .errors import DiffkitError
from .load import LoadedPair, load_candidate_for_capture, load_pair
from .options import Options
from .pipeline import (CaptureSource, ModelSource, TraceSource, apply_auto_tolerance, clone_inputs, reference_health,
                       reinit_zero_parameters, run, run_captured)
from .result import Result

__all__ = ["compare", "compare_traces", "diff_files", "capture_reference", "run_captured", "reference_health",
           "reinit_zero_parameters", "apply_auto_tolerance", "is_capture"]


def compare(ref_model: torch.nn.Module, cand_model: torch.nn.Module, inputs: Sequence[Any], atol: float | None = None,
            rtol: float | None = None, *, cand_inputs: Sequence[Any] | None = None, options: Options | None = None,
            **settings) -> Result:
    """Run both models on (clones of) `inputs` and say where the candidate first diverges.

    `atol`/`rtol` default to KernelBench's per-dtype tolerance (1e-4 float32, 1e-2 half/bfloat16).
    Any other `Options` field may be given by keyword (`tolerance="auto"`, `strict=True`,
    `max_memory=…`, `only=…`, `stop_at_first=True`, `health=False` …), or a whole `options`.
    """
    opts = options or Options.build(atol=atol, rtol=rtol, **settings)
    ref_in = clone_inputs(list(inputs))
    cand_in = clone_inputs(list(cand_inputs if cand_inputs is not None else inputs))
    return run(ModelSource(ref_model, ref_in), ModelSource(cand_model, cand_in), opts)


def compare_traces(ref: Trace, cand: Trace, atol: float | None = None, rtol: float | None = None, *,
                   options: Options | None = None, **settings) -> Result:
    """Diff two captured traces (no models: nothing is re-run)."""
    opts = options or Options.build(atol=atol, rtol=rtol, **settings)
    return run(TraceSource(ref), TraceSource(cand), opts)


def is_capture(path: str) -> bool:
    """Is `path` a capture directory written by `diffkit capture -o` (or an isolated diff)?"""
    return os.path.isdir(path) and os.path.exists(os.path.join(path, "index.json"))


def capture_reference(ref_path: str, out_dir: str, options: Options | None = None, cand_path: str | None = None) -> Trace:
    """Build the reference as a diff would and stream its forward, parameters and the facts a later
    candidate needs (source, init inputs, inputs, seed) to a capture directory."""
    from .load import load_reference

    options = options or Options()
    side = load_reference(ref_path, seed=options.seed, device=options.device, train=options.train)
    if options.reinit_zero:
        reinit_zero_parameters(side.model)
    from .stream import name_filter

    return run_captured(side.model, clone_inputs(list(side.inputs)), stream_to=out_dir,
                        only=name_filter(options.only), no_grad=options.no_grad, info=side.info())


def diff_files(ref_path: str, cand_path: str, *, options: Options | None = None, atol: float | None = None,
               rtol: float | None = None, evidence=None, **settings) -> Result:
    """Diff KernelBench files: REF (`Model`) against CAND (`ModelNew`).  Either may instead be a capture
    directory; a candidate file against a captured reference runs on the capture's inputs, with the
    reference's weights copied by name from it."""
    opts = options or Options.build(atol=atol, rtol=rtol, **settings)
    ref_cap, cand_cap = is_capture(ref_path), is_capture(cand_path)
    if cand_cap and not ref_cap:
        raise DiffkitError("", "read", "a captured candidate needs a captured reference: give the reference as a "
                           "capture directory too (diffkit capture REF.py -o ref.dkt)", cand_path)
    if ref_cap:
        ref_src = CaptureSource(ref_path, device=opts.device or "cpu")
        if cand_cap:
            result = run(ref_src, CaptureSource(cand_path, device=opts.device or "cpu"), opts, evidence=evidence)
            weights, reinit = None, []
        else:
            side, weights = load_candidate_for_capture(cand_path, ref_src.file, seed=opts.seed, device=opts.device,
                                                       train=opts.train, sync=opts.sync_weights)
            ref_src.device = side.device()
            result = run(ref_src, ModelSource(side.model, side.inputs), opts, evidence=evidence)
            reinit = []
    else:
        pair: LoadedPair = load_pair(ref_path, cand_path, seed=opts.seed, device=opts.device, train=opts.train,
                                     sync=opts.sync_weights)
        reinit = reinit_zero_parameters(pair.ref, pair.cand) if opts.reinit_zero else []
        result = run(ModelSource(pair.ref, pair.ref_inputs), ModelSource(pair.cand, pair.cand_inputs), opts,
                     evidence=evidence)
        weights = pair.weights
    if reinit:
        result.warnings.append(f"re-initialised all-zero parameters randomly for this diff: {', '.join(reinit)}")
    result.weights = weights
    result.ref_path, result.cand_path = ref_path, cand_path
    result.meta["seed"] = opts.seed
    if weights is not None and (weights.shape_mismatch or weights.cand_only):
        result.warnings.insert(0, "weights: " + weights.summary())
    return result
