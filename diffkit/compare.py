"""The pipeline in one call: capture both sides → align → measure/locate → (diagnose) → Result."""
from __future__ import annotations

import contextlib
from typing import Any, Sequence

import torch

from .align import align
from .capture import Trace, capture
from .load import LoadedPair, _clone, load_pair
from .locate import build_stages, locate
from .result import Result


def run_captured(model: torch.nn.Module, inputs: Sequence[Any], *, no_grad: bool = True, only=None) -> Trace:
    """Run one forward under capture; an exception is kept in ``trace.error``, not raised."""
    inputs = list(inputs)
    cm = torch.no_grad() if no_grad else contextlib.nullcontext()
    cap = capture(model, inputs=tuple(inputs), only=only)
    try:
        with cm, cap as trace:
            model(*inputs)
    except Exception:
        pass  # recorded in trace.error by capture's __exit__
    return cap.state.trace


def compare(ref_model: torch.nn.Module, cand_model: torch.nn.Module, inputs: Sequence[Any], atol: float | None = None,
            rtol: float | None = None, *, strict: bool = False, no_grad: bool = True,
            cand_inputs: Sequence[Any] | None = None) -> Result:
    """Run both models on (clones of) `inputs` and say where the candidate first diverges.

    `atol`/`rtol` default to KernelBench's per-dtype tolerance (1e-4 float32, 1e-2 half/bfloat16).
    """
    ref_trace = run_captured(ref_model, _clone(list(inputs)), no_grad=no_grad)
    cand_trace = run_captured(cand_model, _clone(list(cand_inputs if cand_inputs is not None else inputs)), no_grad=no_grad)
    return compare_traces(ref_trace, cand_trace, atol, rtol, strict=strict)


def compare_traces(ref: Trace, cand: Trace, atol: float | None = None, rtol: float | None = None, *,
                   strict: bool = False) -> Result:
    alignment = align(ref.records, cand.records)
    stages = build_stages(ref, cand, alignment, atol, rtol)
    result = locate(stages, ref, cand, atol, rtol, strict=strict)
    result.meta.update({"ref_records": len(ref.records), "cand_records": len(cand.records),
                        "paired": len(alignment.pairs)})
    return result


def diff_files(ref_path: str, cand_path: str, *, atol: float | None = None, rtol: float | None = None,
               seed: int = 42, device: str | None = None, strict: bool = False, train: bool = False) -> Result:
    """Load a KernelBench reference/candidate pair from files and compare them."""
    pair: LoadedPair = load_pair(ref_path, cand_path, seed=seed, device=device, train=train)
    result = compare(pair.ref, pair.cand, pair.ref_inputs, atol, rtol, strict=strict, no_grad=True,
                     cand_inputs=pair.cand_inputs)
    result.weights = pair.weights
    result.ref_path, result.cand_path = ref_path, cand_path
    result.meta["seed"] = seed
    if pair.weights.shape_mismatch or pair.weights.cand_only:
        result.warnings.insert(0, "weights: " + pair.weights.summary())
    return result
