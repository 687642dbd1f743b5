"""The pipeline in one call: capture both sides → align → measure/locate → root cause → diagnose → Result."""
from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import Any, Sequence

import torch

from .align import align, to_ref_layout
from .capture import Trace, capture
from .diagnose import diagnose
from .load import LoadedPair, _clone, load_pair
from .locate import build_stages, locate
from .result import Finding, Result
from .rootcause import analyse


def run_captured(model: torch.nn.Module, inputs: Sequence[Any], *, no_grad: bool = True, only=None,
                 stream_to: str | None = None) -> Trace:
    """Run one forward under capture; an exception is kept in ``trace.error``, not raised.
    `stream_to` writes each record to a capture directory as it is made (crash insurance)."""
    inputs = list(inputs)
    cm = torch.no_grad() if no_grad else contextlib.nullcontext()
    sink = None
    if stream_to:
        from .store import CaptureWriter

        sink = CaptureWriter(stream_to, shard_bytes=0)
    cap = capture(model, inputs=tuple(inputs), only=only, sink=sink)
    try:
        with cm, cap:
            model(*inputs)
    except Exception:
        pass  # recorded in trace.error by capture's __exit__
    return cap.state.trace


def compare(ref_model: torch.nn.Module, cand_model: torch.nn.Module, inputs: Sequence[Any], atol: float | None = None,
            rtol: float | None = None, *, strict: bool = False, no_grad: bool = True,
            cand_inputs: Sequence[Any] | None = None, tolerance: str = "fixed", health: bool = True,
            rerun: bool = True, stream_dir: str | None = None) -> Result:
    """Run both models on (clones of) `inputs` and say where the candidate first diverges.

    `atol`/`rtol` default to KernelBench's per-dtype tolerance (1e-4 float32, 1e-2 half/bfloat16).
    `tolerance="auto"` judges each stage against a float64 run of the reference instead.
    `health` runs the reference twice to warn when it is itself random or degenerate; `rerun`
    runs the candidate again when it diverges, to tell a race from a deterministic bug.
    """
    if tolerance not in ("fixed", "auto"):
        raise ValueError(f"tolerance must be 'fixed' or 'auto', not {tolerance!r}")
    ref_in = _clone(list(inputs))
    cand_in = _clone(list(cand_inputs if cand_inputs is not None else inputs))
    import os

    ref_trace = run_captured(ref_model, _clone(ref_in), no_grad=no_grad,
                             stream_to=os.path.join(stream_dir, "ref.dkt") if stream_dir else None)
    cand_trace = run_captured(cand_model, _clone(cand_in), no_grad=no_grad,
                              stream_to=os.path.join(stream_dir, "cand.dkt") if stream_dir else None)
    ref64 = None
    if tolerance == "auto":
        ref64 = run_captured(_to_float64(ref_model), _to_float64(_clone(ref_in)), no_grad=no_grad)
    result = compare_traces(ref_trace, cand_trace, atol, rtol, strict=strict, ref64=ref64)
    if health:
        result.health = reference_health(ref_model, ref_in, ref_trace, no_grad)
    if rerun and result.first_divergence is not None and result.error is None:
        _check_nondeterminism(result, cand_model, cand_in, no_grad)
    return result


def _drop_statistical(stage) -> None:
    stage.diagnosis = [f for f in stage.diagnosis if f.kind not in ("approximation", "precision")]


def compare_traces(ref: Trace, cand: Trace, atol: float | None = None, rtol: float | None = None, *,
                   strict: bool = False, ref64: Trace | None = None) -> Result:
    """Align, measure, locate, find the root cause and diagnose, from two captured traces."""
    alignment = align(ref.records, cand.records)
    stages = build_stages(ref, cand, alignment, atol, rtol)
    fixed = None
    if ref64 is not None:
        fixed = locate([dataclasses.replace(s) for s in stages], ref, cand, atol, rtol, strict=strict).verdict
        apply_auto_tolerance(stages, ref, ref64)
    result = locate(stages, ref, cand, atol, rtol, strict=strict)
    if ref64 is not None:
        result.tolerance_mode = "auto"
        result.fixed_verdict = fixed
        if fixed != result.verdict:
            result.warnings.append(f"the fixed tolerance says {fixed}; against the float64 reference the verdict "
                                   f"is {result.verdict}")
    result.meta.update({"ref_records": len(ref.records), "cand_records": len(cand.records),
                        "paired": len(alignment.pairs)})
    analyse(result, ref, cand, alignment)
    for s in {id(x): x for x in (result.first_divergence, result.root_cause) if x is not None}.values():
        s.diagnosis = diagnose(s, ref.records, cand.records) + s.diagnosis
    return result


# --tolerance auto: TorchDynamo's same() rule against a float64 run of the reference
AUTO_MULTIPLIER = 3.0
AUTO_FLOOR = 1e-6


def _rmse(a: torch.Tensor, b: torch.Tensor) -> float:
    d = a.double() - b.double()
    d = torch.where(torch.isfinite(d), d, torch.zeros_like(d))
    return float(d.pow(2).mean().sqrt()) if d.numel() else 0.0


def apply_auto_tolerance(stages: list, ref: Trace, ref64: Trace) -> None:
    """A stage passes when its RMS error against float64 is within AUTO_MULTIPLIER times the float32
    reference's own RMS error against float64, plus AUTO_FLOOR times the value's RMS size."""
    same_code = len(ref.records) == len(ref64.records) and all(
        a.name == b.name for a, b in zip(ref.records, ref64.records))
    for s in stages:
        if s.stats is None or s.ref is None or not same_code or not s.ref.dtype.is_floating_point:
            continue
        r64 = ref64.records[s.ref.index].value
        if r64 is None or tuple(r64.shape) != tuple(s.ref.shape):
            continue
        c = to_ref_layout(s.cand.value, tuple(s.ref.shape), s.pair_transform)
        ref_err = _rmse(s.ref.value, r64)
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
    if isinstance(obj, torch.Tensor):
        return obj.to(torch.float64) if obj.is_floating_point() else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_float64(v) for v in obj)
    return obj


def reference_health(model: torch.nn.Module, inputs: list, trace: Trace, no_grad: bool) -> list[str]:
    """Warnings about the reference itself: random, constant output, zero-initialised parameters."""
    notes: list[str] = []
    out = trace.output
    if out is not None and out.value is not None and out.value.is_floating_point():
        v = out.value
        if v.numel() and bool((v == 0).all()):
            notes.append("the reference output is all zeros: a candidate returning zeros would pass")
        elif v.numel() > 1 and float(v.max() - v.min()) == 0:
            notes.append(f"the reference output is constant ({float(v.flatten()[0]):g}): a constant candidate would pass")
        again = run_captured(model, _clone(inputs), no_grad=no_grad)
        if again.output is not None and again.output.value is not None and not torch.equal(again.output.value, v):
            first = next((a.name for a, b in zip(trace.records, again.records)
                          if a.value is not None and b.value is not None and a.shape == b.shape
                          and not torch.equal(a.value, b.value)), "?")
            active = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Dropout) and m.training and m.p > 0]
            why = f" (dropout active in {', '.join(active[:3])})" if active else ""
            notes.append(f"the reference is random: two runs on the same inputs differ, first at {first}{why}")
    # weights (not norm biases, which start at zero by design) that are all zero
    zero = [n for n, p in model.named_parameters() if p.dim() >= 2 and bool((p == 0).all())]
    if zero:
        notes.append(f"parameters initialised to zero hide the paths through them: {', '.join(zero[:5])}"
                     + (" …" if len(zero) > 5 else "") + " (--reinit-zero gives them random values for the diff)")
    return notes


def reinit_zero_parameters(ref: torch.nn.Module, cand: torch.nn.Module | None = None, seed: int = 0) -> list[str]:
    """Give all-zero parameters of the reference random values (and copy them to the candidate)."""
    g = torch.Generator().manual_seed(seed)
    done = []
    cparams = dict(cand.named_parameters()) if cand is not None else {}
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if p.dim() >= 2 and bool((p == 0).all()):
                p.copy_((torch.randn(p.shape, generator=g) * 0.1).to(p))
                if n in cparams and cparams[n].shape == p.shape:
                    cparams[n].copy_(p)
                done.append(n)
    return done


def _check_nondeterminism(result: Result, model, inputs, no_grad: bool) -> None:
    again = run_captured(model, _clone(inputs), no_grad=no_grad)
    fd = result.first_divergence
    a = fd.cand
    if a is None:
        return
    b = next((r for r in again.records if r.name == a.name), None)
    if b is None or a.value is None or b.value is None or a.shape != b.shape:
        return
    if torch.equal(torch.nan_to_num(a.value), torch.nan_to_num(b.value)):
        return
    diff = torch.nan_to_num((a.value.double() - b.value.double()).abs(), nan=0.0)
    n = int((diff > 0).sum())
    _drop_statistical(fd)  # run-to-run noise is the explanation; a rounding-size guess would be wrong
    if result.root_cause is not None and result.root_cause is not fd:
        _drop_statistical(result.root_cause)
    fd.diagnosis.insert(0, Finding(
        "nondeterministic", f"running the candidate twice on the same inputs gives different values here "
        f"({n} of {diff.numel()} elements, max difference {float(diff.max()):.3g}): a race, an uninitialised "
        f"read or randomness in the kernel", 0.9))


def diff_files(ref_path: str, cand_path: str, *, atol: float | None = None, rtol: float | None = None,
               seed: int = 42, device: str | None = None, strict: bool = False, train: bool = False,
               tolerance: str = "fixed", reinit_zero: bool = False, stream_dir: str | None = None) -> Result:
    """Load a KernelBench reference/candidate pair from files and compare them."""
    pair: LoadedPair = load_pair(ref_path, cand_path, seed=seed, device=device, train=train)
    reinit = reinit_zero_parameters(pair.ref, pair.cand) if reinit_zero else []
    result = compare(pair.ref, pair.cand, pair.ref_inputs, atol, rtol, strict=strict, no_grad=True,
                     cand_inputs=pair.cand_inputs, tolerance=tolerance, stream_dir=stream_dir)
    if reinit:
        result.warnings.append(f"re-initialised all-zero parameters randomly for this diff: {', '.join(reinit)}")
    result.weights = pair.weights
    result.ref_path, result.cand_path = ref_path, cand_path
    result.meta["seed"] = seed
    if pair.weights.shape_mismatch or pair.weights.cand_only:
        result.warnings.insert(0, "weights: " + pair.weights.summary())
    return result
