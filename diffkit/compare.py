"""The pipeline in one call: capture both sides → align → measure/locate → root cause → diagnose → Result."""
from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import Any, Sequence

import torch

from .align import align, to_ref_layout
from .measure import measure, tolerances
from .capture import StopCapture, Trace, capture
from .diagnose import diagnose
from .load import LoadedPair, _clone, load_pair
from .locate import build_stages, locate
from .result import Finding, Result
from .rootcause import analyse


def run_captured(model: torch.nn.Module, inputs: Sequence[Any], *, no_grad: bool = True, only=None,
                 stream_to: str | None = None, sink: Any = None) -> Trace:
    """Run one forward under capture; an exception is kept in ``trace.error``, not raised.
    `stream_to` writes each record to a capture directory as it is made (crash insurance);
    `sink` receives the records instead (see store.CaptureWriter, stream.TieredStore)."""
    inputs = list(inputs)
    cm = torch.no_grad() if no_grad else contextlib.nullcontext()
    if stream_to and sink is None:
        from .store import CaptureWriter

        sink = CaptureWriter(stream_to, shard_bytes=0)
    cap = capture(model, inputs=tuple(inputs), only=only, sink=sink)
    try:
        with cm, cap:
            model(*inputs)
    except (Exception, StopCapture):
        pass  # recorded in trace.error (or trace.stopped) by capture's __exit__
    return cap.state.trace


def compare(ref_model: torch.nn.Module, cand_model: torch.nn.Module, inputs: Sequence[Any], atol: float | None = None,
            rtol: float | None = None, *, strict: bool = False, no_grad: bool = True,
            cand_inputs: Sequence[Any] | None = None, tolerance: str = "fixed", health: bool = True,
            rerun: bool = True, stream_dir: str | None = None, max_memory: int | None = None,
            only: str | None = None, stop_at_first: bool = False, streaming: bool | None = None,
            ref_capture: str | None = None) -> Result:
    """Run both models on (clones of) `inputs` and say where the candidate first diverges.

    `atol`/`rtol` default to KernelBench's per-dtype tolerance (1e-4 float32, 1e-2 half/bfloat16).
    `tolerance="auto"` judges each stage against a float64 run of the reference instead.
    `health` runs the reference twice to warn when it is itself random or degenerate; `rerun`
    runs the candidate again when it diverges, to tell a race from a deterministic bug.

    Streaming (`streaming=True`, implied by `max_memory`, `only` or `stop_at_first`) compares each
    candidate record as it is produced and keeps only what the report needs: see `compare_streaming`.
    `ref_capture` takes the reference's forward from a capture directory (written by another
    process from the same files) instead of running it here.
    """
    if tolerance not in ("fixed", "auto"):
        raise ValueError(f"tolerance must be 'fixed' or 'auto', not {tolerance!r}")
    ref_in = _clone(list(inputs))
    cand_in = _clone(list(cand_inputs if cand_inputs is not None else inputs))
    import os

    if streaming or (streaming is None and (max_memory is not None or only or stop_at_first)):
        if tolerance == "auto":
            raise ValueError("--tolerance auto needs every reference value twice; it does not combine with streaming")
        result = compare_streaming(ref_model, cand_model, ref_in, cand_in, atol, rtol, strict=strict, no_grad=no_grad,
                                   max_memory=max_memory, only=only, stop_at_first=stop_at_first,
                                   stream_dir=stream_dir, ref_capture=ref_capture)
        if rerun and result.first_divergence is not None and result.error is None and result.first_divergence.cand:
            names = set(result.first_divergence.cand.names())
            _check_nondeterminism(result, cand_model, cand_in, no_grad, only=lambda n: n in names)
        return result

    if ref_capture:
        from .store import load_trace

        ref_trace = rebind_modules(load_trace(ref_capture), ref_model)
        dev = _device_of(ref_model, ref_in)
        for r in ref_trace.records:
            r.value = r.value.to(dev) if r.value is not None else None
    else:
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


STREAM_WINDOW = 8  # stages before the first divergence whose values a streaming diff keeps


def compare_streaming(ref_model: torch.nn.Module, cand_model: torch.nn.Module, ref_in: list, cand_in: list,
                      atol: float | None = None, rtol: float | None = None, *, strict: bool = False,
                      no_grad: bool = True, max_memory: int | None = None, only: str | None = None,
                      stop_at_first: bool = False, stream_dir: str | None = None,
                      host_memory: int | None = None, ref_capture: str | None = None) -> Result:
    """The two-pass diff in bounded memory (see diffkit.stream).

    `max_memory` bounds the bytes of captured values held on the device (for a CPU model: in host
    memory); three quarters go to the reference's records, a quarter to the candidate values kept
    for the report.  Values beyond it go to pinned host memory (`host_memory`, CUDA only) and then
    to a spill directory on disk.  `only` is a comma-separated list of glob patterns on record
    names; `stop_at_first` ends the candidate's forward at its first divergent record."""
    import os

    from .stream import Budget, StreamComparer, TieredStore, default_budget, default_host_budget, name_filter

    dev = _device_of(ref_model, ref_in)
    budget = max_memory if max_memory is not None else default_budget(dev)
    host = host_memory if host_memory is not None else (default_host_budget() if dev.startswith("cuda") else 0)
    ref_dev, keep_dev = Budget(budget - budget // 4), Budget(budget // 4)
    ref_host, keep_host = Budget(host - host // 4), Budget(host // 4)
    meta_ref = meta_cand = journal = None
    if stream_dir:
        from .store import CaptureWriter

        if not ref_capture:
            meta_ref = CaptureWriter(os.path.join(stream_dir, "ref.dkt"), shard_bytes=0, values=False)
        meta_cand = CaptureWriter(os.path.join(stream_dir, "cand.dkt"), shard_bytes=0, values=False)
        journal = open(os.path.join(stream_dir, "stats.jsonl"), "w", encoding="utf-8")
    keep_filter = name_filter(only)
    keep = TieredStore(keep_dev, keep_host)
    if ref_capture:  # the reference ran in another process (captured with the same --only filter)
        from .store import CaptureFile
        from .stream import FileStore

        cf = CaptureFile.open(ref_capture)
        ref_store = FileStore(cf)
        ref_trace = rebind_modules(cf.load(values=False), ref_model)
    else:
        ref_store = TieredStore(ref_dev, ref_host, meta=meta_ref)
    try:
        if not ref_capture:
            ref_trace = run_captured(ref_model, _clone(ref_in), no_grad=no_grad, only=keep_filter, sink=ref_store)
        comparer = StreamComparer(ref_trace, ref_store, keep, atol, rtol, window=STREAM_WINDOW,
                                  stop_at_first=stop_at_first, journal=journal, meta=meta_cand)
        cand_trace = run_captured(cand_model, _clone(cand_in), no_grad=no_grad, only=keep_filter, sink=comparer)
        try:
            comparer.finish()
        except StopCapture:
            pass
        # leftovers are aligned by order and value afterwards, reading values lazily (a few at a time)
        def lazy(store, device):
            cache: dict[int, torch.Tensor | None] = {}

            def get(rec):
                if rec.index not in cache:
                    if len(cache) >= 2:
                        cache.pop(next(iter(cache)))
                    cache[rec.index] = store.get(rec.index, device)
                return cache[rec.index]
            return get

        alignment = align(ref_trace.records, cand_trace.records, fixed=comparer.pairs,
                          ref_value=lazy(ref_store, dev), cand_value=lazy(keep, dev))
        known = dict(comparer.stats)
        for p in alignment.pairs:  # pairs made by order or value: measure them now, one at a time
            r, c = ref_trace.records[p.ref], cand_trace.records[p.cand]
            if (p.ref, p.cand, p.transform) in known or p.cand not in keep or p.transform == ("shape-mismatch",):
                continue
            rv, cv = ref_store.get(p.ref, dev), keep.get(p.cand, dev)
            if rv is not None and cv is not None:
                known[(p.ref, p.cand, p.transform)] = measure(rv, to_ref_layout(cv, tuple(r.shape), p.transform),
                                                              *tolerances(atol, rtol, r.dtype))
        stages = build_stages(ref_trace, cand_trace, alignment, atol, rtol, known=known)
        result = locate(stages, ref_trace, cand_trace, atol, rtol, strict=strict)
        # values for the stages the report, diagnosis and root cause look at: the window before the
        # first divergence (and those stages' inputs), the first few divergent stages, the output
        fd = result.first_divergence
        measured = [s for s in stages if s.stats is not None and s.ref is not None and s.cand is not None]
        show: list = []
        if fd is not None:
            show += [s for s in measured if s.index <= fd.index][-(STREAM_WINDOW + 1):]
        show += [s for s in measured if s.status in ("diverged", "after-divergence")][:comparer.keep_diverged]
        show += [s for s in measured if s.cand.is_output]
        by_cand = alignment.by_cand()
        for s in show:
            if s.cand.value is None and s.cand.index in keep:
                s.cand.value = keep.get(s.cand.index, dev)
            for ri in [s.ref.index] + [by_cand[x.index].ref for x in s.cand.inputs if x.index in by_cand]:
                if ref_trace.records[ri].value is None:
                    ref_trace.records[ri].value = ref_store.get(ri, dev)  # on the device, as replays need
        result.meta.update({
            "mode": "streaming", "ref_records": len(ref_trace.records), "cand_records": len(cand_trace.records),
            "paired": len(alignment.pairs), "max_memory": budget, "host_memory": host,
            "peak_device_bytes": ref_dev.peak + keep_dev.peak, "peak_host_bytes": ref_host.peak + keep_host.peak,
            "spilled_bytes": ref_store.spilled_bytes + keep.spilled_bytes,
            "reference_tiers": dict(ref_store.tiers), "compared_bytes": comparer.compared_bytes,
            "kept_candidate_values": len(keep.slots)})
        if only:
            result.meta["only"] = only
            result.warnings.append(f"only records matching {only!r} were captured")
        if cand_trace.stopped:
            result.meta["stopped"] = cand_trace.stopped
            result.warnings.append(f"--stop-at-first: the candidate's forward was {cand_trace.stopped}; later stages "
                                   f"were not run")
            if result.error is not None and result.error.phase == "output":
                result.error = None  # the output is missing because we stopped, not because of the candidate
                result.verdict = "diverged"
        analyse(result, ref_trace, cand_trace, alignment, window=STREAM_WINDOW)
        if fd is not None and fd.local is not None:
            result.meta["root_cause_window"] = STREAM_WINDOW
        for s in {id(x): x for x in (result.first_divergence, result.root_cause) if x is not None}.values():
            s.diagnosis = diagnose(s, ref_trace.records, cand_trace.records) + s.diagnosis
        return result
    finally:
        ref_store.clear()
        keep.clear()
        if journal is not None:
            journal.close()


def rebind_modules(trace: Trace, model: torch.nn.Module) -> Trace:
    """A trace read from a capture file knows its modules by path only; point module records back
    at `model`'s modules (diagnosis reads their bias and weight)."""
    mods = dict(model.named_modules())
    for r in trace.records:
        if r.kind == "module" and r.call is None:
            m = next((mods[n.split("#")[0]] for n in r.names() if n.split("#")[0] in mods), None)
            if m is not None:
                r.call = (("module", m, None), ())
    return trace


def _device_of(model: torch.nn.Module, inputs: list) -> str:
    for p in model.parameters():
        return str(p.device)
    for t in inputs:
        if isinstance(t, torch.Tensor):
            return str(t.device)
    return "cpu"


def _drop_statistical(stage) -> None:
    stage.diagnosis = [f for f in stage.diagnosis if f.kind not in ("approximation", "precision")]


def compare_traces(ref: Trace, cand: Trace, atol: float | None = None, rtol: float | None = None, *,
                   strict: bool = False, ref64: Trace | None = None, known: dict | None = None) -> Result:
    """Align, measure, locate, find the root cause and diagnose, from two captured traces.
    `known`: stats measured already (a streaming child's journal), keyed (ref, cand, transform);
    their pairs are kept as they were made."""
    fixed = {k[1]: (k[0], k[2]) for k in known} if known else None
    alignment = align(ref.records, cand.records, fixed=fixed)
    stages = build_stages(ref, cand, alignment, atol, rtol, known=known)
    fixed_verdict = None
    if ref64 is not None:
        fixed_verdict = locate([dataclasses.replace(s) for s in stages], ref, cand, atol, rtol, strict=strict).verdict
        apply_auto_tolerance(stages, ref, ref64)
    result = locate(stages, ref, cand, atol, rtol, strict=strict)
    if ref64 is not None:
        result.tolerance_mode = "auto"
        result.fixed_verdict = fixed_verdict
        if fixed_verdict != result.verdict:
            result.warnings.append(f"the fixed tolerance says {fixed_verdict}; against the float64 reference the verdict "
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


def _check_nondeterminism(result: Result, model, inputs, no_grad: bool, only=None) -> None:
    again = run_captured(model, _clone(inputs), no_grad=no_grad, only=only)
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


def capture_reference(ref_path: str, cand_path: str, out_dir: str, *, seed: int = 42, device: str | None = None,
                      train: bool = False, reinit_zero: bool = False, only: str | None = None) -> Trace:
    """The reference side of an isolated diff: build the pair exactly as `diff_files` does and stream
    the reference's forward to `out_dir` (the candidate's process then reads it back)."""
    pair: LoadedPair = load_pair(ref_path, cand_path, seed=seed, device=device, train=train)
    if reinit_zero:
        reinit_zero_parameters(pair.ref, pair.cand)
    from .stream import name_filter

    return run_captured(pair.ref, _clone(list(pair.ref_inputs)), stream_to=out_dir, only=name_filter(only))


def diff_files(ref_path: str, cand_path: str, *, atol: float | None = None, rtol: float | None = None,
               seed: int = 42, device: str | None = None, strict: bool = False, train: bool = False,
               tolerance: str = "fixed", reinit_zero: bool = False, stream_dir: str | None = None,
               max_memory: int | None = None, only: str | None = None, stop_at_first: bool = False,
               streaming: bool | None = None, ref_capture: str | None = None) -> Result:
    """Load a KernelBench reference/candidate pair from files and compare them."""
    pair: LoadedPair = load_pair(ref_path, cand_path, seed=seed, device=device, train=train)
    reinit = reinit_zero_parameters(pair.ref, pair.cand) if reinit_zero else []
    result = compare(pair.ref, pair.cand, pair.ref_inputs, atol, rtol, strict=strict, no_grad=True,
                     cand_inputs=pair.cand_inputs, tolerance=tolerance, stream_dir=stream_dir,
                     max_memory=max_memory, only=only, stop_at_first=stop_at_first, streaming=streaming,
                     ref_capture=ref_capture)
    if reinit:
        result.warnings.append(f"re-initialised all-zero parameters randomly for this diff: {', '.join(reinit)}")
    result.weights = pair.weights
    result.ref_path, result.cand_path = ref_path, cand_path
    result.meta["seed"] = seed
    if pair.weights.shape_mismatch or pair.weights.cand_only:
        result.warnings.insert(0, "weights: " + pair.weights.summary())
    return result
