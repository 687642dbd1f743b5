"""The front half of the pipeline: both sides' traces, captured (or read from their capture files) and
paired, with each live model's state around its captured forward (`modelstate.Sides`).

    full_traces       every value in memory
    streaming_traces  the two-pass diff in bounded memory (see diffkit.stream): the reference's values in a
                      tiered store (or read lazily from its capture file), the candidate's records paired by
                      name and measured as they are produced, only the values the report needs kept

(Split from diffkit.pipeline; layer 9: it imports align, capture, errors, measure, modelstate, options,
runner, sources, store and stream.)
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from .align import Alignment, align, map_params_by_use, param_map, record_numel, to_ref_layout
from .capture import StopCapture, Trace, input_values, set_rng_state, written_in_place
from .errors import DiffkitError
from .measure import ask_kernelbench, measure
from .modelstate import (WRITTEN_PARAMETER, ParameterGuard, SideState, Sides, attribute_state, changed_attributes,
                         restore_state, seed_all, snapshot_state)
from .options import Options
from .result import Stage
from .runner import clone_inputs, run_captured
from .sources import CaptureSource, ModelSource, Source
from .store import CaptureWriter
from .stream import (Budget, FileStore, Lockstep, Pick, StreamComparer, TieredStore, default_host_budget,
                     models_budget, name_filter)

__all__ = ["Traces", "full_traces", "streaming_traces", "restore_sides", "STREAM_WINDOW", "LOCKSTEP_LOW_WATER",
           "LOCKSTEP_RECOVERIES"]

STREAM_WINDOW = 8  # stages before the first divergence whose values a streaming diff keeps
LOCKSTEP_LOW_WATER = 8  # a lockstep diff frees 1/8 of the reference's budget beyond what it waits for
LOCKSTEP_RECOVERIES = 2  # re-runs of the reference that recover evicted values align asks for


@dataclass
class Traces:
    """What the front half hands the back half: both traces, how they were paired so far, and where
    values too large to keep in the records can be read."""

    ref: Trace
    cand: Trace
    alignment: Alignment
    known: dict = field(default_factory=dict)  # (ref, cand, transform) -> Stats measured already
    window: int | None = None  # root-cause replays limited to this many stages (streaming)
    # load the values the report needs into the records, given the stages and the first divergence (streaming)
    fetch: Callable[[list[Stage], Stage | None], None] | None = None
    meta: dict = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    cleanup: list[Callable[[], None]] = field(default_factory=list)
    # each live model's state around its captured forward (extra runs restore it)
    sides: Sides = field(default_factory=Sides)


def _run_side(src: ModelSource, options: Options, sides: Sides, side: str, **capture) -> Trace:
    """One side's captured forward as a trial runs it: seeded with the trial's seed, its parameters,
    buffers and attributes recorded before and after (`sides.ref` / `sides.cand`), since a training-mode
    forward changes buffers."""
    before = snapshot_state(src.model)
    attrs = attribute_state(src.model)
    guard = ParameterGuard(src.model)
    if src.rng:
        set_rng_state(src.rng)
    elif src.seed is not None:
        seed_all(src.seed)
    trace = run_captured(src.model, clone_inputs(list(src.inputs)), no_grad=options.no_grad, fold=src.fold,
                         fold_writes=src.fold_writes, **capture)
    after, attrs_after = snapshot_state(src.model), attribute_state(src.model)
    changed = changed_attributes(attrs, attrs_after)
    written = guard.after_run(before=trace.params_written)  # (a write that changed no value is not named)
    setattr(sides, side, SideState(
        before, after, attrs, attrs_after, attributes=changed + [n + WRITTEN_PARAMETER for n in written],
        parameters=guard,  # (the values it wrote, put back after the reruns)
        stateful={"parameters": written, "attributes": [c.split(" (")[0] for c in changed]}
        if changed or written else None))
    return trace


def restore_sides(sides: Sides, reference: Source, candidate: Source, when: str) -> None:
    """Each live model put back as it was `when` ("before" or "after") its captured forward, as `sides` recorded."""
    for state, src in ((sides.ref, reference), (sides.cand, candidate)):
        if state is not None and isinstance(src, ModelSource):
            restore_state(src.model, getattr(state, when))


def full_traces(reference: Source, candidate: Source, options: Options, known: dict | None,
                sides: Sides | None = None) -> Traces:
    """Both sides captured with every value in memory (or read from their capture files).  `sides` (filled in
    as each side's forward ends) tells a caller whose diff failed later which state each model began in."""
    sd = options.stream_dir
    sides = sides if sides is not None else Sides()

    def trace_of(src: Source, side: str) -> Trace:
        if not isinstance(src, ModelSource):
            return src.trace(values=True)
        return _run_side(src, options, sides, side, stream_to=os.path.join(sd, f"{side}.dkt") if sd else None,
                         stream_values=options.insured or side == "ref")
    rename = param_map(reference.params(), candidate.params())  # by value too: before a forward changes buffers
    ref = trace_of(reference, "ref")
    _fold_against(candidate, ref, options)
    said = _follow_reference(ref, candidate)
    cand = trace_of(candidate, "cand")
    for trace, side in ((ref, "reference"), (cand, "candidate")):
        _no_meta_values(trace, side)
    # parameters no name or value pairs: by the order the forwards read them
    rename = map_params_by_use(rename, ref.records, cand.records, reference.params(), candidate.params())
    fixed = {k[1]: (k[0], k[2]) for k in known} if known else None
    alignment = align(ref.records, cand.records, fixed=fixed, rename=rename, tolerance=options.tolerance.for_dtype)
    return Traces(ref, cand, alignment, known={**alignment.measured, **(known or {})}, sides=sides,
                   warnings=said)


def _follow_reference(ref: Trace, candidate: Source) -> list[str]:
    """KernelBench hands the candidate the very input tensors the reference's forward ran on, so a
    reference that changes an input in place gives the candidate the changed values: a live candidate's
    inputs become the reference's inputs as its forward left them.  What the result should say of it.
    (KernelBench seeds a trial once, before both forwards: a live candidate's forward also starts from the
    random generators' states the reference's forward left.)"""
    if isinstance(candidate, ModelSource) and ref.rng_after:
        candidate.rng = ref.rng_after
    if not ref.inputs_left:
        return []
    names = [r.name for r in ref.records if r.kind == "input" and r.name in ref.inputs_left] or sorted(ref.inputs_left)
    which = ", ".join(names)
    where = ""
    ids = {r.index for r in ref.records if r.kind == "input" and r.name in ref.inputs_left}
    for r in ref.records:
        if written_in_place(r) and any(getattr(a, "index", a) in ids for a in r.inputs):
            how = r.op.split(".")[-1]
            how = "an indexed assignment" if how in ("__setitem__", "index_put_", "copy_") or r.kind == "write" else how
            where = f" (first by {how} at {os.path.basename(r.file)}:{r.line})" if r.file else f" (first by {how})"
            break
    if isinstance(candidate, ModelSource) and not candidate.follows_inputs:
        return [f"the reference's forward changes its {which} in place{where}; KernelBench would run the candidate "
                f"on them as the reference's forward left them; the candidate ran on the inputs it was given"]
    if isinstance(candidate, ModelSource):
        candidate.inputs = input_values(list(candidate.inputs), ref.inputs_left)
        return [f"the reference's forward changes its {which} in place{where}; as KernelBench does, the candidate "
                f"ran on the inputs as the reference's forward left them (a candidate that repeats the change makes "
                f"it twice)"]
    return [f"the reference's forward changes its {which} in place{where}; KernelBench runs the candidate on the "
            f"inputs as the reference's forward left them, but the candidate's capture was made from the inputs as "
            f"they were before: its verdict may differ from KernelBench's"]


def _no_meta_values(trace: Trace, side: str) -> None:
    """A meta tensor holds a shape and no values: an output that is one is the side's error (KernelBench
    cannot compare it either); an intermediate one is kept without a value."""
    for r in trace.records:
        v = r.value
        if isinstance(v, torch.Tensor) and v.is_meta:
            if r.is_output:
                raise DiffkitError(side, "forward", f"the {side} returned a tensor on the meta device ({r.name}, "
                                   f"shape {list(v.shape)}): it has a shape and no values to compare",
                                   f"{r.file}:{r.line}" if r.file else "")
            r.value = None


def _fold_against(candidate: Source, ref: Trace, options: Options) -> None:
    """With `options.fold`, a live candidate is captured folding what cannot pair with `ref`'s records
    (capture's folding): the element counts they hold (set once: its reruns fold alike)."""
    if options.fold and isinstance(candidate, ModelSource) and candidate.fold is None:
        candidate.fold = frozenset(record_numel(r) for r in ref.records)
        candidate.fold_writes = frozenset(record_numel(r) for r in ref.records if written_in_place(r))


def _lazy(store, device):
    cache: dict[int, torch.Tensor | None] = {}

    def get(rec):
        if rec.index not in cache:
            if len(cache) >= 2:
                cache.pop(next(iter(cache)))
            cache[rec.index] = store.get(rec.index, device)
        return cache[rec.index]
    return get


@dataclass
class _Stream:
    """The moving parts of a streaming diff: where values are held (budgets, stores), the reference's
    trace, its lockstep thread, and the comparer that measures the candidate's records as they come."""

    dev: str
    budget: int
    host: int
    ref_dev: Budget
    keep_dev: Budget
    ref_host: Budget
    keep_host: Budget
    keep: TieredStore
    keep_filter: Any
    meta_ref: Any = None
    meta_cand: Any = None
    journal: Any = None
    sides: Sides = field(default_factory=Sides)
    ref_store: Any = None
    ref_trace: Trace | None = None
    lockstep: Lockstep | None = None

    def cleanup(self) -> list[Callable[[], None]]:
        return [self.ref_store.clear, self.keep.clear] + ([self.journal.close] if self.journal is not None else [])


def _own_tensors(*sources: Source):
    """The tensors the live models hold (parameters, buffers) and are given (inputs)."""
    for src in sources:
        if isinstance(src, ModelSource):
            yield from src.params().values()
            yield from (t for t in pytree.tree_leaves(list(src.inputs)) if isinstance(t, torch.Tensor))


def _stream_setup(reference: Source, candidate: ModelSource, options: Options, sides: Sides | None = None) -> _Stream:
    """The budgets of a streaming diff (a quarter of each for the candidate values the report keeps) and,
    with a stream directory, the capture files of names and shapes and the journal of measured pairs."""
    dev = candidate.device()
    budget = options.max_memory if options.max_memory is not None else models_budget(
        dev, _own_tensors(reference, candidate), options.device_memory)
    host = options.host_memory if options.host_memory is not None else (
        default_host_budget() if dev.startswith("cuda") else 0)
    ref_dev, keep_dev = Budget(budget - budget // 4), Budget(budget // 4)
    ref_host, keep_host = Budget(host - host // 4), Budget(host // 4)
    sd = options.stream_dir
    meta_ref = meta_cand = journal = None
    if sd:
        if not isinstance(reference, CaptureSource):
            meta_ref = CaptureWriter(os.path.join(sd, "ref.dkt"), shard_bytes=0, values=False)
        meta_cand = CaptureWriter(os.path.join(sd, "cand.dkt"), shard_bytes=0, values=False)
        journal = open(os.path.join(sd, "stats.jsonl"), "w", encoding="utf-8")
    keep_filter = name_filter(options.only)
    return _Stream(dev, budget, host, ref_dev, keep_dev, ref_host, keep_host, TieredStore(keep_dev, keep_host),
                   keep_filter, meta_ref, meta_cand, journal, sides=sides if sides is not None else Sides())


def _stream_reference(st: _Stream, reference: Source, options: Options) -> None:
    """The reference's side of a streaming diff: read from its capture file, run ahead on a thread of its
    own (lockstep), or run whole first into its tiered store."""
    if isinstance(reference, CaptureSource):  # captured in another process (with the same --only filter)
        st.ref_store = FileStore(reference.file)
        st.ref_trace = reference.file.load(values=False)
    elif options.lockstep:
        # the reference runs on a thread of its own, ahead of the candidate by what its budget holds
        st.lockstep = Lockstep(low_water=st.ref_dev.limit // LOCKSTEP_LOW_WATER)
        st.ref_store = TieredStore(st.ref_dev, st.ref_host, meta=st.meta_ref, lockstep=st.lockstep)
        st.lockstep.start(lambda: _run_side(reference, options, st.sides, "ref", only=st.keep_filter,
                                            sink=st.ref_store))
        st.ref_trace = st.lockstep.live_trace()
        if st.ref_trace is None:  # it failed before its capture began
            st.ref_trace = st.lockstep.finish()
    else:
        st.ref_store = TieredStore(st.ref_dev, st.ref_host, meta=st.meta_ref)
        st.ref_trace = _run_side(reference, options, st.sides, "ref", only=st.keep_filter, sink=st.ref_store)


def streaming_traces(reference: Source, candidate: ModelSource, options: Options, sides: Sides | None = None) -> Traces:
    """The two-pass diff in bounded memory (see diffkit.stream): the reference's values in a tiered
    store (or read lazily from its capture file), the candidate's records paired by name and measured
    as they are produced, only the values the report needs kept.  `sides`: as for `full_traces`."""
    st = _stream_setup(reference, candidate, options, sides)
    rename = param_map(reference.params(), candidate.params())  # by value too: before a forward changes buffers
    _stream_reference(st, reference, options)
    lockstep, said = st.lockstep, []
    if lockstep is None or lockstep.ref_done:
        _fold_against(candidate, st.ref_trace, options)  # (while the reference runs, its sizes are not all known)
        said = _follow_reference(st.ref_trace, candidate)  # (a lockstep diff finding it later starts again)
    comparer = StreamComparer(st.ref_trace, st.ref_store, st.keep, options.tolerance.atol, options.tolerance.rtol,
                              window=STREAM_WINDOW, stop_at_first=options.stop_at_first, journal=st.journal,
                              meta=st.meta_cand, rename=rename, stat=options.tolerance.stat,
                              lockstep=lockstep if lockstep is not None and not lockstep.ref_done else None)
    try:
        cand_trace = _run_side(candidate, options, st.sides, "cand", only=st.keep_filter, sink=comparer)
    finally:
        if lockstep is not None:
            st.ref_trace = lockstep.finish()
            st.ref_store.lockstep = None
    ref_trace = st.ref_trace
    if comparer.lockstep is not None and (ref_trace.drew_random or ref_trace.inputs_left):
        # the candidate continues the generators where the whole reference left them (KernelBench seeds a
        # trial once), and a reference that changes its inputs hands the candidate the changed values:
        # neither order can run side by side; the diff is made again, the reference first
        for clean in st.cleanup():
            clean()
        restore_sides(st.sides, reference, candidate, "before")
        return streaming_traces(reference, candidate, options.replace(lockstep=False), st.sides)
    if comparer.lockstep is not None:
        comparer.settle()
    try:
        comparer.finish()
    except StopCapture:
        pass
    alignment, recovered = _align_streamed(st, reference, candidate, options, cand_trace, comparer, rename)
    known = _measure_late(st, alignment, cand_trace, options, dict(comparer.stats))
    meta = {"mode": "streaming", "max_memory": st.budget, "host_memory": st.host,
            "peak_device_bytes": st.ref_dev.peak + st.keep_dev.peak,
            "peak_host_bytes": st.ref_host.peak + st.keep_host.peak,
            "spilled_bytes": getattr(st.ref_store, "spilled_bytes", 0) + st.keep.spilled_bytes,
            "reference_tiers": dict(st.ref_store.tiers), "compared_bytes": comparer.compared_bytes,
            "kept_candidate_values": len(st.keep.slots)}
    if lockstep is not None:
        meta["lockstep"] = {"switches": lockstep.switches, "evicted": len(comparer.evicted), "recovered": recovered}
    out = Traces(ref_trace, cand_trace, alignment, known=known, window=STREAM_WINDOW, meta=meta,
                  fetch=_stream_fetch(st, reference, options, alignment, cand_trace, comparer, meta),
                  cleanup=st.cleanup(), sides=st.sides, warnings=said)
    if options.only:
        out.meta["only"] = options.only
        out.warnings.append(f"only records matching {options.only!r} were captured")
    if cand_trace.stopped:
        out.meta["stopped"] = cand_trace.stopped
        out.warnings.append(f"--stop-at-first: the candidate's forward was {cand_trace.stopped}; later stages "
                            f"were not run")
    return out


def _align_streamed(st: _Stream, reference: Source, candidate: ModelSource, options: Options, cand_trace: Trace,
                    comparer: StreamComparer, rename: dict) -> tuple[Alignment, int]:
    """Leftovers aligned by order and value once both forwards are over, reading values lazily (a few at a
    time); a lockstep diff may have evicted values align reads: those it asked for are recovered by one more
    forward of the reference and align runs again (at most LOCKSTEP_RECOVERIES times).  The alignment, and
    how many values came back."""
    ref_trace, ref_store, lockstep = st.ref_trace, st.ref_store, st.lockstep
    recovered, rounds = 0, 0
    wanted = {comparer.pairs[ci][0] for ci in comparer.late if ci in comparer.pairs}
    # parameters no name or value pairs: by the order the forwards read them (known now)
    rename = map_params_by_use(rename, ref_trace.records, cand_trace.records, reference.params(), candidate.params())
    while True:
        missed: set[int] = set()
        read = _lazy(ref_store, st.dev)

        def ref_value(rec, read=read, missed=missed):
            v = read(rec)
            if v is None and rec.index in comparer.evicted:
                missed.add(rec.index)
            return v
        alignment = align(ref_trace.records, cand_trace.records, fixed=comparer.pairs,
                          ref_value=ref_value, cand_value=_lazy(st.keep, st.dev), rename=rename)
        wanted |= missed
        if lockstep is None or not wanted or rounds == LOCKSTEP_RECOVERIES:
            break
        got = _recapture(reference, options, st.sides, ref_store, ref_trace, wanted, st.keep_filter, comparer)
        recovered, rounds, wanted = recovered + got, rounds + 1, set()
        if not (missed & set(ref_store.slots)):
            break  # align read nothing that has come back: its answer stands
    return alignment, recovered


def _measure_late(st: _Stream, alignment: Alignment, cand_trace: Trace, options: Options, known: dict) -> dict:
    """The pairs made by order or value after the forwards, measured now, one at a time, into `known`; the
    outputs asked of KernelBench's own torch.allclose call (locate._kernelbench)."""
    ref_trace, ref_store, keep, dev = st.ref_trace, st.ref_store, st.keep, st.dev
    for p in alignment.pairs:
        r, c = ref_trace.records[p.ref], cand_trace.records[p.cand]
        if (p.ref, p.cand, p.transform) in known or p.cand not in keep or p.transform == ("shape-mismatch",):
            continue
        rv, cv = ref_store.get(p.ref, dev), keep.get(p.cand, dev)
        if rv is not None and cv is not None:
            known[(p.ref, p.cand, p.transform)] = measure(rv, to_ref_layout(cv, tuple(r.shape), p.transform),
                                                          *options.tolerance.for_dtype(r.dtype),
                                                          options.tolerance.stat)
    for p in alignment.pairs:
        r, c = ref_trace.records[p.ref], cand_trace.records[p.cand]
        stats = known.get((p.ref, p.cand, p.transform))
        if stats is None or p.transform != () or not (r.is_output and c.is_output):
            continue
        rv, cv = ref_store.get(p.ref, dev), keep.get(p.cand, dev)
        if rv is not None and cv is not None:
            ask_kernelbench(stats, rv, cv)
    return known


def _stream_fetch(st: _Stream, reference: Source, options: Options, alignment: Alignment, cand_trace: Trace,
                  comparer: StreamComparer, meta: dict) -> Callable[[list[Stage], Stage | None], None]:
    """What loads, once the first divergence is known, the values the report, diagnosis and root cause
    look at into the records: the window before the first divergence (and those stages' inputs), the
    first few divergent stages, the output (a lockstep diff recovers those it evicted first)."""
    ref_trace, ref_store, keep, dev = st.ref_trace, st.ref_store, st.keep, st.dev

    def fetch(stages: list[Stage], fd: Stage | None) -> None:
        measured = [s for s in stages if s.stats is not None and s.ref is not None and s.cand is not None]
        show: list = []
        if fd is not None:
            show += [s for s in measured if s.index <= fd.index][-(STREAM_WINDOW + 1):]
        show += [s for s in measured if s.status in ("diverged", "after-divergence")][:comparer.keep_diverged]
        show += [s for s in measured if s.cand.is_output]
        by_cand = alignment.by_cand()
        if st.lockstep is not None and comparer.evicted:
            wanted = {ri for s in show for ri in [s.ref.index, *s.ref.inputs] + [by_cand[x].ref for x in s.cand.inputs
                                                                                 if x in by_cand]}
            meta["lockstep"]["recovered"] += _recapture(reference, options, st.sides, ref_store, ref_trace, wanted,
                                                        st.keep_filter, comparer)
        # with a divergence the values come to the device, where the diagnosis replays calls on them; on a match
        # nothing is replayed: the outputs alone, on the host (read there by the report and the second-run check),
        # so a large model's diff does not hold its outputs on the card twice over
        to = dev if fd is not None else "cpu"
        for s in show:
            crec = cand_trace.records[s.cand.index]
            if crec.value is None and s.cand.index in keep:
                crec.value = keep.get(s.cand.index, to)
            # the stage's reference value, its reference inputs (diagnosis) and the candidate inputs' partners (replays)
            wanted = [s.ref.index] if fd is None else \
                [s.ref.index, *s.ref.inputs] + [by_cand[x].ref for x in s.cand.inputs if x in by_cand]
            for ri in wanted:
                if ref_trace.records[ri].value is None:
                    ref_trace.records[ri].value = ref_store.get(ri, to)
    return fetch


def _recapture(reference: ModelSource, options: Options, sides: Sides, store, ref_trace: Trace, wanted: set[int],
               only, comparer) -> int:
    """Run the reference once more as its streamed forward ran (state, seed) and put back the values
    of `wanted` that a lockstep diff evicted; how many came back."""
    wanted = {ri for ri in wanted if ri in comparer.evicted}
    if not wanted:
        return 0
    before, after = sides.ref.before, sides.ref.after
    restore_state(reference.model, before)
    pick = Pick(store, {ri: ref_trace.records[ri] for ri in wanted})
    try:
        _run_side(reference, options, Sides(), "ref", only=only, sink=pick)
    finally:
        restore_state(reference.model, after)
    comparer.evicted -= pick.got
    return len(pick.got)
