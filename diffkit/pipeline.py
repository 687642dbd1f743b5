"""The pipeline: one path from two trace sources to a judged Result.

    source (live model | capture file) -> capture -> align -> measure/locate -> explain -> judge -> Result

Every surface goes through `run`: the CLI in-process or isolated (its candidate process reads the
reference's capture; a crash is diffed from what both capture files hold), streaming, two capture
files, `diffkit.compare` and `assert_models_close`.  A streaming diff differs only in how the traces
are obtained (values in a tiered store, the candidate's records measured as they are made); everything
after that is shared.  `judge` is the only place that sets the verdict.
"""
from __future__ import annotations

import contextlib
import copy
import gc
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.utils._pytree as pytree

from .align import Alignment, align, map_params_by_use, param_map, record_numel, to_ref_layout, torch_op
from .capture import (FOLD_AFTER, StopCapture, Trace, capture, input_values, materialized, set_rng_state,
                      written_in_place)
from .diagnose import diagnose
from .inputs import copy_inputs
from .locate import build_stages, locate, undone_stages
from .measure import ask_kernelbench, kernelbench_note, measure
from .options import Options
from .result import ErrorInfo, Finding, Result, Values
from .rootcause import analyse
from .trials import WRITTEN_PARAMETER, Trial, attribute_state, bitwise_difference, changed_attributes, \
    ParameterGuard, all_parameters, difference_words, parameter_marks, parameter_sums, restore_state, seed_all, \
    snapshot_state, to_first_state, to_where_it_left, written_parameters

__all__ = ["ModelSource", "CaptureSource", "TraceSource", "run", "judge", "run_captured", "clone_inputs"]

STREAM_WINDOW = 8  # stages before the first divergence whose values a streaming diff keeps
LOCKSTEP_LOW_WATER = 8  # a lockstep diff frees 1/8 of the reference's budget beyond what it waits for
LOCKSTEP_RECOVERIES = 2  # re-runs of the reference that recover evicted values align asks for


# a fresh copy of a forward's inputs for each run, keeping what KernelBench's objects are (diffkit.inputs)
clone_inputs = copy_inputs


def named_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A model's parameters and buffers by qualified name (what diagnosis checks errors against)."""
    out = {n: p.detach() for n, p in materialized(model.named_parameters())}
    out.update({n: b.detach() for n, b in materialized(model.named_buffers())})
    return out


# ------------------------------------------------------------------------------------------ sources
@dataclass
class ModelSource:
    """A live model and the inputs of its forward (cloned before every run).

    `seed`: set before its captured forward (KernelBench seeds each trial before the forwards, so a
    model that draws random numbers draws the same ones); `rng`, when set, instead.  `fold`: the element counts its records
    may pair with, set by a diff once the other side is captured (see capture's folding);
    `fold_writes`: those of its records written in place, the sizes a write may pair with."""

    model: torch.nn.Module
    inputs: Sequence[Any]
    seed: int | None = None
    # the random generators' states its forward starts from, in place of `seed`: for a candidate, where the
    # reference's forward left them (KernelBench seeds a trial once, before both forwards)
    rng: dict | None = None
    # a candidate given the reference's inputs: the inputs as the reference's forward left them replace them
    # (False: inputs of its own, `compare(cand_inputs=…)`)
    follows_inputs: bool = True
    fold: frozenset | None = None
    fold_writes: frozenset | None = None

    def params(self) -> dict[str, torch.Tensor]:
        return named_tensors(self.model)

    def device(self) -> str:
        for p in self.model.parameters():
            return str(p.device)
        for t in pytree.tree_leaves(list(self.inputs)):
            if isinstance(t, torch.Tensor):
                return str(t.device)
        return "cpu"


@dataclass
class CaptureSource:
    """A forward saved as a capture directory (complete, or cut short by a crash).

    `device`: where its values are compared (a live model on the other side decides it)."""

    path: str
    device: str = "cpu"
    mapped: bool = False  # its values as views of its mapped files (a capture this diff's own child wrote)
    _file: Any = field(default=None, repr=False)

    @property
    def file(self):
        if self._file is None:
            from .store import CaptureFile

            handed = None
            if self.mapped:  # this diff's own handoff: its values may still be on the reference's GPU
                from .handoff import receive

                handed = receive(self.path)  # (before the index is read: a failure there rewrites it)
            self._file = CaptureFile.open(self.path)
            self._file.mapped = self.mapped
            self._file.handed = handed
        return self._file

    def params(self) -> dict[str, torch.Tensor]:
        get = getattr(self.file, "parameters", None)
        return get() if get is not None else {}

    def trace(self, values: bool = True) -> Trace:
        trace = self.file.load(values=values)
        if values and self.device != "cpu":
            for r in trace.records:
                if r.value is not None:
                    r.value = r.value.to(self.device)
        return trace


@dataclass
class TraceSource:
    """A trace already in memory (its values in its records); `params` by qualified name, if known."""

    trace_: Trace
    params_: dict = field(default_factory=dict)
    device: str = "cpu"

    def params(self) -> dict[str, torch.Tensor]:
        return self.params_

    def trace(self, values: bool = True) -> Trace:
        return self.trace_


Source = ModelSource | CaptureSource | TraceSource


# ------------------------------------------------------------------------------------------ running
@contextlib.contextmanager
def collector_quiet():
    """While a diff runs, the cycle collector makes no full pass (its oldest generation's threshold is
    raised, and put back at the end): a full pass over everything alive (the models, torch's and the user's
    modules) took ~0.1 s, at a moment set by the diff's own allocations, a large part of a streaming diff's
    run-to-run spread.  The young generations are collected as usual, and the first collection after the
    diff makes the full pass it put off (nothing is kept from it, as `gc.freeze` would keep the garbage of
    the diffs before).  Nothing is changed where the collector is off."""
    if not gc.isenabled():
        yield
        return
    before = gc.get_threshold()
    quiet = (before[0], before[1], max(before[2], 1 << 30))
    gc.set_threshold(*quiet)
    try:
        yield
    finally:
        if gc.get_threshold()[2] == quiet[2]:  # (else changed meanwhile: left as it is)
            gc.set_threshold(*before)


def run_captured(model: torch.nn.Module, inputs: Sequence[Any], *, no_grad: bool = True, only=None,
                 stream_to: str | None = None, sink: Any = None, info: dict | None = None, snapshot: bool = True,
                 mutator: Any = None, fold: frozenset | None = None, fold_writes: frozenset | None = None,
                 stream_values: bool = True) -> Trace:
    """Run one forward under capture; an exception is kept in ``trace.error``, not raised.
    `stream_to` writes each record to a capture directory as it is made (crash insurance), with the
    model's parameters and `info` (`stream_values=False`: names and shapes only); `sink` receives the records instead (store.CaptureWriter,
    stream.TieredStore, stream.StreamComparer, whatif's grab); `snapshot=False` keeps no values;
    `mutator` plants a what-if mistake (see diffkit.whatif); `fold`, `fold_writes` as `capture` takes them."""
    inputs = list(inputs)
    cm = torch.no_grad() if no_grad else contextlib.nullcontext()
    if stream_to and sink is None:
        sink = capture_writer(stream_to, model, info, values=stream_values)
    cap = capture(model, inputs=tuple(inputs), only=only, sink=sink, snapshot=snapshot, fold=fold,
                  fold_writes=fold_writes)
    cap.state.mutator = mutator
    if hasattr(sink, "bind_capture"):  # a streaming diff's lockstep suspends and resumes it (diffkit.stream)
        sink.bind_capture(cap)
    try:
        with cm, cap, collector_quiet():
            model(*inputs)
    except (Exception, SystemExit, StopCapture):
        pass  # recorded in trace.error (or trace.stopped) by capture's __exit__ (sys.exit() in forward too)
    return cap.state.trace


def capture_writer(path: str, model: torch.nn.Module, info: dict | None = None, values: bool = True,
                   write_through: bool = False):
    """A capture directory that streams each record as it is made (crash insurance), holding the
    model's parameters and `info` (how the side was built: source, init inputs, inputs …);
    `values=False`: the records' names and shapes only, no values and no parameters;
    `write_through`: the trace keeps no values, the directory does (`CaptureFile.fill` reads them back)."""
    from .store import CaptureWriter

    writer = CaptureWriter(path, shard_bytes=0, values=values, write_through=write_through)
    if info is not None:
        writer.set_info(info)
    if values:
        writer.add_parameters(named_tensors(model))
    return writer


@dataclass
class _Traces:
    """What the front half hands the back half: both traces, how they were paired so far, and where
    values too large to keep in the records can be read."""

    ref: Trace
    cand: Trace
    alignment: Alignment
    known: dict = field(default_factory=dict)  # (ref, cand, transform) -> Stats measured already
    window: int | None = None  # root-cause replays limited to this many stages (streaming)
    fetch: Callable[[Any], None] | None = None  # load the values the report needs into the records
    meta: dict = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    cleanup: list[Callable[[], None]] = field(default_factory=list)
    # each live model's buffers before and after its captured forward (extra runs restore them)
    state: dict = field(default_factory=dict)


def _device(source: Source) -> str:
    return source.device() if isinstance(source, ModelSource) else source.device


def _run_side(src: ModelSource, options: Options, state: dict, side: str, **capture) -> Trace:
    """One side's captured forward as a trial runs it: seeded with the trial's seed, its parameters and
    buffers recorded before and after (`state[side]`), since a training-mode forward changes buffers."""
    before = snapshot_state(src.model)
    attrs = attribute_state(src.model)
    guard = ParameterGuard(src.model)
    if src.rng:
        set_rng_state(src.rng)
    elif src.seed is not None:
        seed_all(src.seed)
    trace = run_captured(src.model, clone_inputs(list(src.inputs)), no_grad=options.no_grad, fold=src.fold,
                         fold_writes=src.fold_writes, **capture)
    state[side] = (before, snapshot_state(src.model))
    state[side + "_attrs_before"], state[side + "_attrs_after"] = attrs, attribute_state(src.model)
    changed = changed_attributes(attrs, state[side + "_attrs_after"])
    written = guard.after_run(before=trace.params_written)  # (a write that changed no value is not named)
    state[side + "_attributes"] = changed + [n + WRITTEN_PARAMETER for n in written]
    state[side + "_parameters"] = guard  # (the values it wrote, put back after the reruns)
    if changed or written:
        state[side + "_stateful"] = {"parameters": written, "attributes": [c.split(" (")[0] for c in changed]}
    return trace


def _full_traces(reference: Source, candidate: Source, options: Options, known: dict | None) -> _Traces:
    """Both sides captured with every value in memory (or read from their capture files)."""
    sd = options.stream_dir

    state: dict = {}

    def trace_of(src: Source, side: str) -> Trace:
        if not isinstance(src, ModelSource):
            return src.trace(values=True)
        return _run_side(src, options, state, side, stream_to=os.path.join(sd, f"{side}.dkt") if sd else None,
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
    return _Traces(ref, cand, alignment, known={**alignment.measured, **(known or {})}, state=state, warnings=said)


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
    from .errors import DiffkitError

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


def _streaming_traces(reference: Source, candidate: ModelSource, options: Options) -> _Traces:
    """The two-pass diff in bounded memory (see diffkit.stream): the reference's values in a tiered
    store (or read lazily from its capture file), the candidate's records paired by name and measured
    as they are produced, only the values the report needs kept."""
    from .stream import Budget, FileStore, Lockstep, StreamComparer, TieredStore, default_budget, \
        default_host_budget, name_filter

    dev = candidate.device()
    budget = options.max_memory if options.max_memory is not None else default_budget(dev)
    host = options.host_memory if options.host_memory is not None else (
        default_host_budget() if dev.startswith("cuda") else 0)
    ref_dev, keep_dev = Budget(budget - budget // 4), Budget(budget // 4)
    ref_host, keep_host = Budget(host - host // 4), Budget(host // 4)
    sd = options.stream_dir
    meta_ref = meta_cand = journal = None
    if sd:
        from .store import CaptureWriter

        if not isinstance(reference, CaptureSource):
            meta_ref = CaptureWriter(os.path.join(sd, "ref.dkt"), shard_bytes=0, values=False)
        meta_cand = CaptureWriter(os.path.join(sd, "cand.dkt"), shard_bytes=0, values=False)
        journal = open(os.path.join(sd, "stats.jsonl"), "w", encoding="utf-8")
    keep_filter = name_filter(options.only)
    keep = TieredStore(keep_dev, keep_host)
    state: dict = {}
    rename = param_map(reference.params(), candidate.params())  # by value too: before a forward changes buffers
    lockstep = None
    if isinstance(reference, CaptureSource):  # captured in another process (with the same --only filter)
        ref_store = FileStore(reference.file)
        ref_trace = reference.file.load(values=False)
    elif options.lockstep:
        # the reference runs on a thread of its own, ahead of the candidate by what its budget holds
        lockstep = Lockstep(low_water=ref_dev.limit // LOCKSTEP_LOW_WATER)
        ref_store = TieredStore(ref_dev, ref_host, meta=meta_ref, lockstep=lockstep)
        lockstep.start(lambda: _run_side(reference, options, state, "ref", only=keep_filter, sink=ref_store))
        ref_trace = lockstep.live_trace()
        if ref_trace is None:  # it failed before its capture began
            ref_trace = lockstep.finish()
    else:
        ref_store = TieredStore(ref_dev, ref_host, meta=meta_ref)
        ref_trace = _run_side(reference, options, state, "ref", only=keep_filter, sink=ref_store)
    said: list[str] = []
    if lockstep is None or lockstep.ref_done:
        _fold_against(candidate, ref_trace, options)  # (while the reference runs, its sizes are not all known)
        said = _follow_reference(ref_trace, candidate)  # (a lockstep diff finding it later starts again)
    comparer = StreamComparer(ref_trace, ref_store, keep, options.tolerance.atol, options.tolerance.rtol,
                              window=STREAM_WINDOW, stop_at_first=options.stop_at_first, journal=journal,
                              meta=meta_cand, rename=rename, stat=options.tolerance.stat,
                              lockstep=lockstep if lockstep is not None and not lockstep.ref_done else None)
    try:
        cand_trace = _run_side(candidate, options, state, "cand", only=keep_filter, sink=comparer)
    finally:
        if lockstep is not None:
            ref_trace = lockstep.finish()
            ref_store.lockstep = None
    if comparer.lockstep is not None and (ref_trace.drew_random or ref_trace.inputs_left):
        # the candidate continues the generators where the whole reference left them (KernelBench seeds a
        # trial once), and a reference that changes its inputs hands the candidate the changed values:
        # neither order can run side by side; the diff is made again, the reference first
        for clean in (ref_store.clear, keep.clear) + ((journal.close,) if journal is not None else ()):
            clean()
        for k in ("ref", "cand"):
            if k in state:
                restore_state((reference if k == "ref" else candidate).model, state[k][0])
        return _streaming_traces(reference, candidate, options.replace(lockstep=False))
    if comparer.lockstep is not None:
        comparer.settle()
    try:
        comparer.finish()
    except StopCapture:
        pass
    # leftovers are aligned by order and value afterwards, reading values lazily (a few at a time); a
    # lockstep diff may have evicted values align reads: those it asked for are recovered by one more
    # forward of the reference and align runs again (at most LOCKSTEP_RECOVERIES times)
    recovered, rounds = 0, 0
    wanted = {comparer.pairs[ci][0] for ci in comparer.late if ci in comparer.pairs}
    # parameters no name or value pairs: by the order the forwards read them (known now)
    rename = map_params_by_use(rename, ref_trace.records, cand_trace.records, reference.params(), candidate.params())
    while True:
        missed: set[int] = set()
        read = _lazy(ref_store, dev)

        def ref_value(rec, read=read, missed=missed):
            v = read(rec)
            if v is None and rec.index in comparer.evicted:
                missed.add(rec.index)
            return v
        alignment = align(ref_trace.records, cand_trace.records, fixed=comparer.pairs,
                          ref_value=ref_value, cand_value=_lazy(keep, dev), rename=rename)
        wanted |= missed
        if lockstep is None or not wanted or rounds == LOCKSTEP_RECOVERIES:
            break
        got = _recapture(reference, options, state, ref_store, ref_trace, wanted, keep_filter, comparer)
        recovered, rounds, wanted = recovered + got, rounds + 1, set()
        if not (missed & set(ref_store.slots)):
            break  # align read nothing that has come back: its answer stands
    known = dict(comparer.stats)
    for p in alignment.pairs:  # pairs made by order or value: measure them now, one at a time
        r, c = ref_trace.records[p.ref], cand_trace.records[p.cand]
        if (p.ref, p.cand, p.transform) in known or p.cand not in keep or p.transform == ("shape-mismatch",):
            continue
        rv, cv = ref_store.get(p.ref, dev), keep.get(p.cand, dev)
        if rv is not None and cv is not None:
            known[(p.ref, p.cand, p.transform)] = measure(rv, to_ref_layout(cv, tuple(r.shape), p.transform),
                                                          *options.tolerance.for_dtype(r.dtype),
                                                          options.tolerance.stat)
    for p in alignment.pairs:  # the outputs: KernelBench's own torch.allclose call decides them (locate._kernelbench)
        r, c = ref_trace.records[p.ref], cand_trace.records[p.cand]
        st = known.get((p.ref, p.cand, p.transform))
        if st is None or p.transform != () or not (r.is_output and c.is_output):
            continue
        rv, cv = ref_store.get(p.ref, dev), keep.get(p.cand, dev)
        if rv is not None and cv is not None:
            ask_kernelbench(st, rv, cv)

    def fetch(result: Result) -> None:
        # values for the stages the report, diagnosis and root cause look at: the window before the
        # first divergence (and those stages' inputs), the first few divergent stages, the output
        fd = result.first_divergence
        measured = [s for s in result.stages if s.stats is not None and s.ref is not None and s.cand is not None]
        show: list = []
        if fd is not None:
            show += [s for s in measured if s.index <= fd.index][-(STREAM_WINDOW + 1):]
        show += [s for s in measured if s.status in ("diverged", "after-divergence")][:comparer.keep_diverged]
        show += [s for s in measured if s.cand.is_output]
        by_cand = alignment.by_cand()
        if lockstep is not None and comparer.evicted:
            wanted = {ri for s in show for ri in [s.ref.index, *s.ref.inputs] + [by_cand[x].ref for x in s.cand.inputs
                                                                                 if x in by_cand]}
            out.meta["lockstep"]["recovered"] += _recapture(reference, options, state, ref_store, ref_trace, wanted,
                                                            keep_filter, comparer)
        for s in show:
            crec = cand_trace.records[s.cand.index]
            if crec.value is None and s.cand.index in keep:
                crec.value = keep.get(s.cand.index, dev)
            # the stage's reference value, its reference inputs (diagnosis) and the candidate inputs' partners (replays)
            for ri in [s.ref.index, *s.ref.inputs] + [by_cand[x].ref for x in s.cand.inputs if x in by_cand]:
                if ref_trace.records[ri].value is None:
                    ref_trace.records[ri].value = ref_store.get(ri, dev)  # on the device, as replays need

    out = _Traces(ref_trace, cand_trace, alignment, known=known, window=STREAM_WINDOW, fetch=fetch,
                  cleanup=[ref_store.clear, keep.clear] + ([journal.close] if journal is not None else []), state=state,
                  warnings=said)
    out.meta.update({
        "mode": "streaming", "max_memory": budget, "host_memory": host,
        "peak_device_bytes": ref_dev.peak + keep_dev.peak, "peak_host_bytes": ref_host.peak + keep_host.peak,
        "spilled_bytes": getattr(ref_store, "spilled_bytes", 0) + keep.spilled_bytes,
        "reference_tiers": dict(ref_store.tiers), "compared_bytes": comparer.compared_bytes,
        "kept_candidate_values": len(keep.slots)})
    if lockstep is not None:
        out.meta["lockstep"] = {"switches": lockstep.switches, "evicted": len(comparer.evicted),
                                "recovered": recovered}
    if options.only:
        out.meta["only"] = options.only
        out.warnings.append(f"only records matching {options.only!r} were captured")
    if cand_trace.stopped:
        out.meta["stopped"] = cand_trace.stopped
        out.warnings.append(f"--stop-at-first: the candidate's forward was {cand_trace.stopped}; later stages "
                            f"were not run")
    return out


def _recapture(reference: ModelSource, options: Options, state: dict, store, ref_trace: Trace, wanted: set[int],
               only, comparer) -> int:
    """Run the reference once more as its streamed forward ran (state, seed) and put back the values
    of `wanted` that a lockstep diff evicted; how many came back."""
    wanted = {ri for ri in wanted if ri in comparer.evicted}
    if not wanted:
        return 0
    from .stream import Pick

    before, after = state["ref"]
    restore_state(reference.model, before)
    pick = Pick(store, {ri: ref_trace.records[ri] for ri in wanted})
    try:
        _run_side(reference, options, {}, "ref", only=only, sink=pick)
    finally:
        restore_state(reference.model, after)
    comparer.evicted -= pick.got
    return len(pick.got)


def run(reference: Source, candidate: Source, options: Options | None = None, *, known: dict | None = None,
        error: ErrorInfo | None = None, evidence: Callable[[Result], None] | None = None) -> Result:
    """Diff `candidate` against `reference` and judge it.

    known:    Stats measured already (an isolated child's journal), keyed (ref, cand, transform)
    error:    a failure observed outside the traces (a child process that crashed or hung)
    evidence: called with the result before it is judged, to attach findings from outside the run
              (compute-sanitizer reports)
    """
    options = options or Options()
    if options.tolerance.mode == "auto":
        if options.is_streaming:
            raise ValueError("--tolerance auto needs every reference value twice; it does not combine with streaming")
        if not isinstance(reference, ModelSource):
            raise ValueError("--tolerance auto re-runs the reference in float64: it needs the reference model, "
                             "not a capture")
    with collector_quiet():
        return _run(reference, candidate, options, known, error, evidence)


def _run(reference: Source, candidate: Source, options: Options, known: dict | None, error: ErrorInfo | None,
         evidence: Callable[[Result], None] | None) -> Result:
    streaming = options.is_streaming and isinstance(candidate, ModelSource)
    traces = _streaming_traces(reference, candidate, options) if streaming else \
        _full_traces(reference, candidate, options, known)
    try:
        result = _explain(traces, reference, candidate, options, error)
        if evidence is not None:
            evidence(result)
        result.verdict = judge(result)
        what_if(result, traces, reference, options)
        return result
    finally:
        # extra runs (health, the second run, replays) leave each model as its captured forward did
        for side, src in (("ref", reference), ("cand", candidate)):
            if side in traces.state and isinstance(src, ModelSource):
                restore_state(src.model, traces.state[side][1])
        for fn in traces.cleanup:
            fn()


def _explain(traces: _Traces, reference: Source, candidate: Source, options: Options,
             error: ErrorInfo | None) -> Result:
    """Measure, locate, find the root cause and diagnose: everything between the traces and the verdict."""
    ref, cand = traces.ref, traces.cand
    tol = options.tolerance
    stages = build_stages(ref, cand, traces.alignment, tol, known=traces.known)
    values = Values.of_traces(ref, cand)
    for s in stages:
        s.values = values
    result = Result(verdict="", stages=stages, first_divergence=None, error=None, output=None, atol=tol.atol,
                    rtol=tol.rtol, strict=options.strict, warnings=list(traces.warnings),
                    meta={**traces.meta, "stat": tol.stat})
    if tol.mode == "auto":
        from dataclasses import replace

        fixed = [replace(s) for s in stages]
        fixed_fd = locate(fixed)
        result.fixed_verdict = "diverged" if _output_failed(fixed) or (options.strict and fixed_fd) else "match"
        ref64 = run_captured(_to_float64(reference.model), _to_float64(clone_inputs(list(reference.inputs))),
                             no_grad=options.no_grad)
        apply_auto_tolerance(stages, ref, ref64)
        result.tolerance_mode = "auto"
    if tol.mode == "fixed":  # (under --tolerance auto the float64 rule decides, not KernelBench's call)
        for s in result.output_stages:
            note = kernelbench_note(s.stats, getattr(torch, s.ref.dtype)) if s.stats is not None else ""
            if note:
                result.warnings.append(f"{'the output' if s.ref_name == 'output' else 'output ' + str(s.ref_name)}: "
                                       f"{note}")
    passed_over = undone_stages(stages, cand.records)
    result.first_divergence = locate(stages, passed_over)
    fd = result.first_divergence
    for s in stages:
        if fd is not None and s.failed and s.index < fd.index:
            result.warnings.append(f"stage {s.index} {s.ref_name} (candidate {s.cand_name}) is out of tolerance, but "
                                   f"every stage reading it agrees with the reference: the candidate computes it "
                                   f"otherwise, or undoes its error at once; the error that goes on starts at stage "
                                   f"{fd.index}")
    result.output_structure = output_structure(ref, cand)
    out = result.output_stage
    result.output = out.stats if out is not None else None
    shapes = [s for s in result.output_stages if tuple(s.ref.shape) != tuple(s.cand.shape)]
    # an output tensor whose shape differs may be left unpaired (its element count differs): compare
    # the two outputs path by path, as KernelBench compares them
    r_leaves, c_leaves = _leaves(ref), _leaves(cand)
    differing = [(tuple(r_leaves[p].shape), tuple(c_leaves[p].shape)) for p in sorted(set(r_leaves) & set(c_leaves))
                 if tuple(r_leaves[p].shape) != tuple(c_leaves[p].shape)]
    if differing:
        result.output_shape_mismatch = differing[0]
    from .describe import output_shape_words, output_structure_words

    if result.output_structure is not None:
        result.findings.append(Finding("structure", output_structure_words(result.output_structure), 1.0))
        if bare_against_held(ref, cand):
            held = "candidate" if ref.output_form == "tensor" else "reference"
            result.warnings.append(f"the {held} returns a {(cand if held == 'candidate' else ref).output_form}, not a "
                                   f"tensor: KernelBench's evaluator reads `output.shape` and fails it whatever its "
                                   f"values (a trailing comma in `return y,`?)")
    elif ref.output_form and ref.output_form != "tensor" and cand.output_form:
        result.meta["reference_returns"] = ref.output_form  # (the trials' clause says KernelBench's answer too)
        result.warnings.append(f"the reference returns a {ref.output_form}: KernelBench's evaluator reads "
                               f"`output.shape` and fails any candidate of it; diffkit compares it tensor by tensor")
    for st in shapes:
        st.diagnosis.append(Finding("shape", output_shape_words((st.ref.shape, st.cand.shape)), 1.0))
    for mismatch in differing:
        result.findings.append(Finding("shape", output_shape_words(mismatch), 1.0))
    result.error = error or _trace_error(ref, cand)
    if result.error is None and out is None and not cand.stopped and result.output_structure is None:
        missing = "candidate" if ref.output is not None else "reference"
        form = (cand if missing == "candidate" else ref).output_form
        what = {"NoneType": "None", "": "no tensor"}.get(form, ("an " if form[:1].lower() in "aeiou" else "a ") + form)
        result.error = ErrorInfo(missing, "output", f"the {missing} returned {what}, not a tensor (nor tensors in a "
                                 f"tuple, list or dict): nothing to compare", "its forward's return value")
    result.meta.update({"ref_records": len(ref.records), "cand_records": len(cand.records),
                        "paired": len(traces.alignment.pairs)})
    if cand.folded:
        # loop results folded into lineage (capture's folding): how many, and where the most were made
        top = sorted(cand.folded.items(), key=lambda kv: -kv[1])[:10]
        result.meta["cand_folded"] = {"results": sum(cand.folded.values()), "sites": dict(top),
                                      "recorded_per_site": FOLD_AFTER}
    if traces.fetch is not None:
        traces.fetch(result)
    # buffers as they were before each side's captured forward (a capture file keeps them so): a BatchNorm's
    # running statistics, moved by the forwards (and by a re-run), are compared as the two models began
    ref_params = {**reference.params(), **traces.state.get("ref", ({},))[0]}
    cand_params = {**candidate.params(), **traces.state.get("cand", ({},))[0]}
    # the candidate's buffers its forward changed: (the live tensor, its value before, its value after)
    changed = {}
    if "cand" in traces.state:
        before, after = traces.state["cand"]
        live = dict(candidate.model.named_buffers()) if isinstance(candidate, ModelSource) else {}
        changed = {n: (live.get(n), b, after[n]) for n, b in before.items()
                   if n in after and not torch.equal(b, after[n])}
    analyse(result, ref, cand, traces.alignment, window=traces.window, changed=changed, passed_over=passed_over)
    if traces.window is not None and result.first_divergence is not None and result.first_divergence.local is not None:
        result.meta["root_cause_window"] = traces.window
    for s in {id(x): x for x in (result.first_divergence, result.root_cause) if x is not None}.values():
        s.diagnosis = diagnose(s, ref, cand, ref_params, cand_params, rename=traces.alignment.rename or None) \
            + s.diagnosis
        if any(f.kind == "nondeterministic" for f in s.diagnosis):  # the re-run disagreed with the run
            _drop_statistical(s)
            s.diagnosis.sort(key=lambda f: f.kind != "nondeterministic")
    if isinstance(reference, ModelSource) and options.health and tol.mode == "fixed" and not traces.window:
        result.health = reference_health(reference.model, list(reference.inputs), ref, options.no_grad,
                                         state=traces.state.get("ref", ({},))[0],
                                         rerun=result.first_divergence is not None or _output_failed(result.stages)
                                         or may_be_random(reference.model, ref))
        # (a reference changing its own state: as its run left it)
        to_where_it_left(reference.model, None, traces.state.get("ref_parameters"), {},
                         traces.state.get("ref_attrs_after"))
    elif isinstance(reference, CaptureSource) and options.health:
        health = reference.file.info.get("health")  # measured in the reference's own process
        result.health = [str(h) for h in health] if isinstance(health, list) else []
    fd = result.first_divergence
    second = None
    if traces.state.get("cand_stateful"):
        result.meta["stateful"] = traces.state["cand_stateful"]
    if options.rerun and isinstance(candidate, ModelSource) and result.error is None and not cand.stopped:
        # (attributes put back for the reruns may make them repeat a one-time step, a fold into the weights guarded
        # by a flag: every parameter as the first run left it is kept then, whoever writes it, a kernel included)
        whole = traces.state["cand_whole"] = all_parameters(candidate.model) if traces.state.get(
            "cand_attrs_before") != traces.state.get("cand_attrs_after") else {}
        try:
            second = _check_nondeterminism(result, ref, cand, candidate, options, traces)
        finally:  # the parameters its forward wrote and its attributes, as its first run left them
            to_where_it_left(candidate.model, None, traces.state.get("cand_parameters"), whole,
                             traces.state.get("cand_attrs_after"))
    elif isinstance(candidate, CaptureSource) and fd is not None and fd.cand is not None:
        # `diffkit capture` ran the forward twice and kept which records changed between the runs
        d = (candidate.file.info.get("rerun_differs") or {}).get(fd.cand.name)
        if isinstance(d, dict) and {"elements", "numel", "max_abs"} <= set(d):
            _nondeterministic(result, fd, d)
    seen = traces.state.get("cand_attributes") or []
    if seen and not any(f.kind == "stateful" for f in result.findings) and (
            result.first_divergence is not None or _output_failed(result.stages)):
        result.findings.append(Finding("stateful", f"the candidate's forward changes its own state ({', '.join(seen[:3])}): "
                                       f"one call computes otherwise than the next, and KernelBench's trials make one "
                                       f"call each, on the state the calls before them left", 0.6))
    for s in result.stages:
        if s.failed and result.output is not None and not _output_failed(result.stages) and s is not out:
            result.warnings.append(f"stage {s.index} {s.ref_name} (candidate {s.cand_name}) out of tolerance: "
                                   f"max_abs={s.stats.max_abs:.3g}" if s.stats else f"stage {s.index} {s.note}")
    result.trials = [_this_trial(result, candidate, second).to_dict()]
    _batch_statistics_hint(result, reference)
    if result.fixed_verdict is not None:
        verdict = judge(result)
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
        from .load import load_reference_for_capture

        try:
            side = load_reference_for_capture(reference.file, device=reference.device)
        except Exception:  # a reference that cannot be rebuilt here: no what-if, the diff stands
            return None
        if side is None:
            return None
        return ModelSource(side.model, side.inputs, seed=side.seed), snapshot_state(side.model)
    return None


def what_if(result: Result, traces: _Traces, reference: Source, options: Options,
            progress: Callable[[int, int], None] | None = None) -> None:
    """Explain a divergence by what-if runs of the reference (`diffkit.whatif`): on by default when
    the divergent candidate record covers more than one reference stage (`options.explain` None),
    always with True, never with False.  Fills `result.what_if` (best first) and
    `result.meta["what_if"]` (forwards, seconds, window; or why none ran)."""
    from . import whatif

    fd = result.first_divergence
    if options.explain is False or fd is None or fd.ref is None or fd.cand is None or fd.stats is None:
        return
    if result.error is not None or options.explain_budget == 0:
        return
    if options.explain is None and (fd.stats.max_abs == 0 or fd.diagnosis and fd.diagnosis[0].kind == "mask_value"
                                    and fd.diagnosis[0].confidence >= 0.9):
        return  # (all its error in non-finite elements, or a mask written two ways: nothing to search for)
    win = whatif.window(result.stages, traces.ref, fd)
    if options.explain is None and len(win) <= 1 and isinstance(reference, ModelSource):
        return
    cand_value = fd.cand_value
    if cand_value is None:
        result.meta["what_if"] = {"skipped": "the candidate's value at the divergence is not at hand"}
        return
    if isinstance(reference, CaptureSource) and not (options.explain is True or options.trusted_capture):
        # rebuilding means running the file the capture names: only for captures this diff made, or on request
        result.meta["what_if"] = {"skipped": "the reference is a capture: --explain rebuilds and runs the file it "
                                             "names for what-if runs"}
        return
    live = _live_reference(reference, options)
    if live is None:
        result.meta["what_if"] = {"skipped": "the reference cannot be run here (no model, or its capture does not "
                                             "say how to rebuild it)"}
        return
    src, rebuilt_state = live
    before = traces.state.get("ref", (rebuilt_state,))[0] if isinstance(reference, ModelSource) else rebuilt_state
    after = snapshot_state(src.model)
    keep = None
    if options.is_streaming:
        from .stream import name_filter

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
            result.meta["what_if"] = {"skipped": "the reference rebuilt from its capture does not record the same "
                                                 "stages as the capture (its source changed?)"}
            return
        win = whatif.window(result.stages, rebuilt, fd)
        if options.explain is None and len(win) <= 1:
            return
    target = to_ref_layout(cand_value, tuple(fd.ref.shape), fd.pair_transform)
    search = whatif.Search(model=src.model, inputs=list(src.inputs), run=run_once, target=fd.ref.index,
                           cand_value=target, atol=fd.stats.atol, rtol=fd.stats.rtol, window=win,
                           budget=options.explain_budget, seconds_budget=options.explain_seconds or math.inf,
                           progress=progress)
    params = {n: p.detach().clone() for n, p in materialized(src.model.named_parameters())}
    try:
        found = whatif.search(search, whatif.model_constants(src.model), records)
    except Exception as e:  # a what-if failure never costs the diff its answer
        result.meta["what_if"] = {"skipped": f"the what-if search failed: {type(e).__name__}: {e}"[:300],
                                  "forwards": search.forwards}
        return
    finally:
        restore_state(src.model, after)
        with torch.no_grad():
            for n, p in materialized(src.model.named_parameters()):
                if n in params and not torch.equal(p, params[n]):
                    p.copy_(params[n])
    result.what_if = [w.to_dict(fd.stats) for w in found[:5]]
    result.meta["what_if"] = {"forwards": search.forwards, "seconds": round(search.seconds, 3),
                              "variants": search.tried, "window": len(win), "stage": fd.ref.name,
                              "explained": bool(found and found[0].explains)}
    if search.left:
        result.meta["what_if"].update(out_of_time=True, variants_left=search.left,
                                      seconds_budget=options.explain_seconds)


def _leaves(trace: Trace) -> dict[str, Any]:
    """The output's tensors by their path in the returned structure ('' for a lone tensor)."""
    out = {}
    for r in trace.records:
        if r.is_output:
            path = r.name.split("#")[0]
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
        return None

    def words(leaves: dict, form: str) -> str:
        text = _describe_leaves(leaves)
        if bare_vs_held and form != "tensor":
            return f"a {form} holding " + (text if len(leaves) > 1 else text.replace("a tensor", "one tensor", 1))
        return text
    return words(r, rf), words(c, cf)


def _output_failed(stages) -> bool:
    out = next((s for s in stages if s.cand is not None and s.cand.is_output and s.ref is not None
                and s.ref.is_output), None)
    return out is not None and (out.failed or tuple(out.ref.shape) != tuple(out.cand.shape))


def _trace_error(ref: Trace, cand: Trace) -> ErrorInfo | None:
    for side, tr in (("reference", ref), ("candidate", cand)):
        if tr.error is not None:
            e = tr.error
            return ErrorInfo(side, "forward", f"{e.type}: {e.message}", e.stage, e.traceback)
    return None


# ------------------------------------------------------------------------------------------ judge
def judge(result: Result) -> str:
    """The verdict, from the evidence in `result` (and nothing else sets it).

    error      a side failed to build, run or return an output (a forward stopped on purpose by
               --stop-at-first is not a failure)
    diverged   the output is out of tolerance or of another shape; or, with `strict`, any stage is;
               or a KernelBench trial failed (another trial's inputs, or the candidate's second run on
               the same inputs: see diffkit.trials); or the output passed but compute-sanitizer
               reported errors, or a stage carries a race / memory-error finding
    match      otherwise (stages out of tolerance under a passing output are warnings)
    """
    if result.error is not None:
        return "error"
    stopped = bool(result.meta.get("stopped"))
    if result.output_structure is not None:
        return "diverged"
    outs = result.output_stages
    if not outs:
        return "diverged" if stopped and result.first_divergence is not None else "error"
    if result.output_shape_mismatch is not None or any(s.failed or s.stats is None for s in outs):
        return "diverged"
    if stopped and result.first_divergence is not None:
        return "diverged"
    if result.strict and any(s.failed for s in result.stages):
        return "diverged"
    if result.tolerance_mode == "fixed" and any(not t.get("allclose", True) for t in result.trials):
        return "diverged"  # a trial (or the candidate's second run on one) failed KernelBench's rule
    if result.meta.get("sanitizer_errors") or any(f.kind in ("race", "memory_error") for s in result.stages
                                                   for f in s.diagnosis):
        if not any("compute-sanitizer reported" in w for w in result.warnings):
            n = result.meta.get("sanitizer_errors") or "some"
            result.warnings.insert(0, f"compute-sanitizer reported {n} error(s): the output matched, the kernels "
                                      f"are still wrong")
        return "diverged"
    return "match"


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
def reference_health(model: torch.nn.Module, inputs: list, trace: Trace, no_grad: bool,
                     state: dict | None = None, rerun: bool = True) -> list[str]:
    """Warnings about the reference itself: random (dropout live in training mode, randomness in its
    forward), constant output, zero-initialised parameters.  `state`: its buffers before the
    captured forward, restored for the second run (and the state after it put back).  The second run
    (randomness) only with `rerun`: a diff runs it when the candidate diverged, the only answer a
    random reference can explain."""
    notes: list[str] = []
    out = trace.output
    if out is not None and out.value is not None and out.value.is_floating_point():
        v = out.value
        if v.numel() and bool((v == 0).all()):
            notes.append("the reference output is all zeros: a candidate returning zeros would pass")
        elif v.numel() > 1 and float(v.max() - v.min()) == 0:
            notes.append(f"the reference output is constant ({float(v.flatten()[0]):g}): a constant candidate would pass")
    if rerun and out is not None and out.value is not None and out.value.is_floating_point():
        v = out.value
        after = snapshot_state(model)
        restore_state(model, state or {})
        again = run_captured(model, clone_inputs(inputs), no_grad=no_grad)  # not re-seeded: randomness shows
        restore_state(model, after)
        if again.output is not None and again.output.value is not None and \
                bitwise_difference(again.output.value, v) is not None:
            first = next((a.name for a, b in zip(trace.records, again.records)
                          if a.value is not None and b.value is not None and a.shape == b.shape
                          and bitwise_difference(a.value, b.value) is not None), "?")
            reason = stochastic_reason(model)
            w = again.output.value
            tol = 1e-2 if v.dtype in (torch.float16, torch.bfloat16) else 1e-4  # (KernelBench's, by dtype)
            close = w.shape == v.shape and bool(torch.allclose(w, v, atol=tol, rtol=tol, equal_nan=True))
            if close:  # noise too small to matter at the output: no reason to say no candidate can match
                gap = float((w.double() - v.double()).abs().nan_to_num(0.0).max()) if v.numel() else 0.0
                notes.append(f"the reference is random: two runs on the same inputs differ, first at {first} "
                             f"({reason}), by at most {gap:.3g} at the output: within KernelBench's tolerance "
                             f"({tol:g}), so a candidate can still match it")
            else:
                notes.append(f"the reference is random: two runs on the same inputs differ, first at {first} "
                             f"({reason}); its output depends on the random draw, so no candidate can match it "
                             f"reliably (KernelBench never calls eval())"
                             + ("; --eval turns dropout off" if reason.startswith(_LIVE_DROPOUT) else ""))
    # weights (not norm biases, which start at zero by design) that are all zero
    zero = [n for n, p in materialized(model.named_parameters()) if p.dim() >= 2 and not bool(p.detach().any())]
    if zero:
        notes.append(f"parameters initialised to zero hide the paths through them: {', '.join(zero[:5])}"
                     + (" …" if len(zero) > 5 else "") + " (--reinit-zero gives them random values for the diff)")
    return notes


_RANDOM_OPS = ("dropout", "rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "randperm",
               "bernoulli", "multinomial", "normal", "poisson", "uniform", "exponential", "geometric", "cauchy",
               "log_normal", "feature_dropout", "alpha_dropout", "feature_alpha_dropout", "rrelu", "random",
               "gumbel_softmax", "fractional_max_pool2d", "fractional_max_pool3d", "dropout1d", "dropout2d",
               "dropout3d")


def may_be_random(model: torch.nn.Module, trace: Trace) -> bool:
    """Whether a forward may draw random numbers: a dropout module live in training mode, or a record
    made by a sampling function (the second-run check confirms it)."""
    if stochastic_reason(model).startswith(_LIVE_DROPOUT):
        return True
    for r in trace.records:
        name = torch_op(r)
        if name in _RANDOM_OPS:
            return True
        if name == "scaled_dot_product_attention" and r.call is not None:  # attention dropout
            (_, _, tmpl), _ = r.call
            try:
                args, kwargs = tmpl
                p = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
            except (TypeError, ValueError, AttributeError):
                p = 0.0
            if isinstance(p, (int, float)) and p > 0:
                return True
    return False


_LIVE_DROPOUT = "dropout live in training mode: "


def stochastic_reason(model: torch.nn.Module) -> str:
    """Why a model's forward is random, in words: the dropout modules live in training mode, else
    randomness drawn in its own code."""
    drop = (torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d, torch.nn.AlphaDropout,
            torch.nn.FeatureAlphaDropout)
    active = [f"{n or type(m).__name__} (p={m.p:g})" for n, m in model.named_modules()
              if isinstance(m, drop) and m.training and m.p > 0]
    mha = [n for n, m in model.named_modules() if isinstance(m, torch.nn.MultiheadAttention) and m.training
           and m.dropout > 0]
    if active or mha:
        return _LIVE_DROPOUT + ", ".join((active + [f"{n} (attention dropout)" for n in mha])[:4])
    return "randomness drawn in its forward (torch.rand/randn/dropout in its code)"


def reinit_zero_parameters(ref: torch.nn.Module, cand: torch.nn.Module | None = None, seed: int = 0) -> list[str]:
    """Give all-zero parameters of the reference random values (and copy them to the candidate)."""
    g = torch.Generator().manual_seed(seed)
    done = []
    cparams = dict(materialized(cand.named_parameters())) if cand is not None else {}
    with torch.no_grad():
        for n, p in materialized(ref.named_parameters()):
            if p.dim() >= 2 and not bool(p.detach().any()):
                p.copy_((torch.randn(p.shape, generator=g) * 0.1).to(p))
                if n in cparams and cparams[n].shape == p.shape:
                    cparams[n].copy_(p)
                done.append(n)
    return done


def _drop_statistical(stage) -> None:
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


def _nondeterministic(result: Result, stage, d: dict, drop: bool = True, kept: Sequence[str] = ()) -> None:
    if kept:  # the forward changed the model's own state: a second call is another computation
        if any(f.kind == "stateful" for f in stage.diagnosis):
            return
        found = Finding(
            "stateful", f"running the candidate twice on the same inputs gives different values here "
            f"({difference_words(d)}), and its forward changes its own state: {', '.join(kept[:3])} -- it "
            f"computes otherwise from one call to the next (KernelBench calls it once per trial)", 0.8)
        if any(k.endswith(WRITTEN_PARAMETER) for k in kept):
            # its weights moved under it: what the values look like says nothing of a kernel's mistake
            _drop_statistical(stage)
            stage.diagnosis.insert(0, found)
        else:  # (a call counter taking another path: what that path computes is still worth naming)
            stage.diagnosis.append(found)
        return
    if drop:
        _drop_statistical(stage)  # run-to-run noise is the explanation; a rounding-size guess would be wrong
        if result.root_cause is not None and result.root_cause is not stage:
            _drop_statistical(result.root_cause)
    if any(f.kind == "nondeterministic" for f in stage.diagnosis):
        return
    stage.diagnosis.insert(0, Finding(
        "nondeterministic", f"running the candidate twice on the same inputs gives different values here: "
        f"{difference_words(d)} -- a race, an uninitialised read or randomness in the kernel", 0.9))


def _check_nondeterminism(result: Result, ref: Trace, cand_trace: Trace, candidate: "ModelSource", options: Options,
                          traces: _Traces) -> dict | None:
    """Run the candidate a second time on the same inputs, from the same state (its buffers as they
    were before its captured forward; not re-seeded, so randomness shows): any record whose value
    differs bitwise is a `nondeterministic` finding on its stage, whatever the tolerance.  Returns
    how the second run's output fares against the reference when it differs from the first's:
    {"allclose", "max_abs", "mean_abs"}."""
    model, inputs = candidate.model, list(candidate.inputs)
    before = traces.state.get("cand", ({},))[0]
    guard = traces.state.get("cand_parameters")

    def from_first_state() -> bool:
        return to_first_state(model, before, traces.state.get("cand_attrs_before"), guard)

    same = from_first_state()
    # a plain second forward first: only when its output differs from the first run's bitwise does the
    # record that first changed matter, and only then is the candidate captured a third time to find it
    marks = parameter_marks(model)
    differs = _second_output_differs(model, inputs, cand_trace, options)
    whole = traces.state.get("cand_whole") or {}
    if differs and (whole or (guard is not None and guard.kept)):
        # the state put back may be one the model is never in (weights unfolded, the flag that guards the fold
        # kept): once more from where the first run left it (buffers put back); the same output then says the
        # difference was the state, not a race
        to_where_it_left(model, before, guard, whole, traces.state.get("cand_attrs_after"))
        differs = _second_output_differs(model, inputs, cand_trace, options)
    if not differs:
        result.meta["second_run"] = {"differs": 0}
        return None
    # from the same state, a forward that changes its own state repeats itself: a difference is a race, unless
    # the state could not all be put back (parameters it wrote with no values from before), or it wrote into
    # its parameters unseen (a kernel given the pointer: found by value around the captured run that follows)
    written = [w for w in written_parameters(marks, parameter_marks(model))  # (a write that moved no value aside)
               if guard is None or guard.moved_since(w[:-len(WRITTEN_PARAMETER)])]
    same = from_first_state() and same
    sums = parameter_sums(model) if same else None
    if traces.window is None:
        sink = _RerunComparer(cand_trace)
        run_captured(model, clone_inputs(inputs), no_grad=options.no_grad, sink=sink, fold=candidate.fold,
                     fold_writes=candidate.fold_writes)
        diffs = sink.differences()
    else:
        # streaming: the first run's values are kept for a few stages only -- re-capture those (the first
        # divergence) and the output (a filter sees names before their #k suffix, so the k-th of them gets
        # the same name again)
        fd = result.first_divergence
        wanted = {n for s in result.output_stages for n in s.cand.names()}
        if fd is not None and fd.cand is not None:
            wanted |= set(fd.cand.names())
        bases = {n.split("#")[0] for n in wanted}
        again = run_captured(model, clone_inputs(inputs), no_grad=options.no_grad,
                             only=lambda n: n.split("#")[0] in bases, fold=candidate.fold,
                             fold_writes=candidate.fold_writes)
        by_name = {r.name: r for r in again.records}
        diffs = {n: (d, by_name[n].value) for n, d in rerun_differences(cand_trace, again, wanted).items()}
    if sums is not None:
        unseen = written_parameters(sums, parameter_sums(model))
        kept = unseen  # (the first run wrote them too, and their values from before were not known)
    else:
        kept = (traces.state.get("cand_attributes") or [])
        kept = kept + [w for w in written if w not in kept]
    result.meta["second_run"] = {"differs": len(diffs)}
    if not diffs:
        if kept:  # the second run's output differed, the captured third equals the first: state, not a race
            words = (f"running the candidate again on the same inputs gives another output, and its forward changes "
                     f"its own state ({', '.join(kept[:3])}): it computes otherwise from one call to the next")
            result.findings.append(Finding("stateful", words, 0.9))
            result.meta["second_run"]["stateful"] = kept[:20]
        return None
    result.meta["second_run"]["records"] = {n: d for n, (d, _) in list(diffs.items())[:20]}
    by_cand = {s.cand.name: s for s in result.stages if s.cand is not None}
    hit = sorted((by_cand[n] for n in diffs if n in by_cand), key=lambda s: s.index)
    fd = result.first_divergence
    first = hit[0] if hit else None
    if first is not None and first.failed:  # a passing stage keeps a clean row: the run-level finding names it
        _nondeterministic(result, first, diffs[first.cand.name][0], drop=first is fd, kept=kept)
    if fd is not None and fd.cand is not None and fd.cand.name in diffs and fd is not first:
        _nondeterministic(result, fd, diffs[fd.cand.name][0], kept=kept)
    second = None
    for s in result.output_stages:
        got = diffs.get(s.cand.name)
        rv = ref.records[s.ref.index].value if s.ref is not None else None
        if got is None or got[1] is None or rv is None or s.stats is None or \
                tuple(got[1].shape) != tuple(s.cand.shape):
            continue
        st = measure(rv, to_ref_layout(got[1], tuple(s.ref.shape), s.pair_transform), s.stats.atol, s.stats.rtol,
                     s.stats.stat)
        if second is None or not st.ok:
            second = {"allclose": st.ok, "max_abs": st.max_abs, "mean_abs": st.mean_abs, "stage": s.index,
                      "stateful": bool(kept)}
    where = f"stage {first.index} {first.ref_name or first.cand_name}" if first is not None else next(iter(diffs))
    out_name = next((s.cand.name for s in result.output_stages if s.cand.name in diffs), None)
    out_d = diffs[out_name][0] if out_name is not None else None
    if out_d is not None:
        result.meta["second_run"]["output"] = {**out_d, "where": out_name}
    words = (f"running the candidate twice on the same inputs gives different values, first at {where}"
             + (f"; output: {difference_words(out_d)}" if out_d is not None else "; the output is bitwise equal")
             + (f" -- its forward changes its own state ({', '.join(kept[:3])}): it computes otherwise from one "
                f"call to the next" if kept else " -- a race, an uninitialised read or randomness"))
    result.findings.append(Finding("stateful" if kept else "nondeterministic", words, 0.9))
    if not _output_failed(result.stages) and (second is None or second["allclose"]):
        result.warnings.append(f"the candidate is nondeterministic: {words}; both runs are within tolerance, "
                               f"another GPU or input may not be")
    result.meta["second_run"]["first_difference"] = where
    return second


def _second_output_differs(model: torch.nn.Module, inputs: list, first: Trace, options: Options) -> bool:
    """Run the candidate once more, uncaptured, on the same inputs: does any output leaf differ bitwise
    from the captured run's?  (An error or a missing value counts as a difference: the captured
    rerun that follows reports it.)"""
    from .trials import output_leaves

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


def _batch_statistics_hint(result: Result, reference: Source) -> None:
    """A first divergence at a BatchNorm the reference runs in training mode: say that the reference
    normalises with the batch's statistics there, the usual reason a candidate written for eval()
    (running statistics) fails KernelBench's protocol."""
    fd = result.first_divergence
    if fd is None or fd.ref is None or "BatchNorm" not in (fd.ref.op or ""):
        return
    training = None
    if isinstance(reference, ModelSource):
        mod = dict(reference.model.named_modules()).get(fd.ref.name.split("#")[0])
        training = getattr(mod, "training", None)
    elif isinstance(reference, CaptureSource):
        training = reference.file.info.get("training")
    if training:
        result.warnings.append(f"stage {fd.index} {fd.ref_name} is a {fd.ref.op.split('.')[-1]} in training mode: the "
                               f"reference normalises with this batch's mean and variance (KernelBench never calls "
                               f"eval()); a candidate using the running statistics differs exactly here (--eval "
                               f"compares both models in eval mode)")


def _this_trial(result: Result, candidate: Source, second: dict | None) -> Trial:
    """This run as one KernelBench trial: did the output (of both of the candidate's runs) pass?"""
    t = Trial(1, getattr(candidate, "seed", None), captured=True)
    out = result.output
    if out is not None:
        t.max_abs, t.mean_abs = out.max_abs, out.mean_abs
    outs = result.output_stages
    if result.error is not None:
        t.error, t.error_side = result.error.message, result.error.side
    dtypes = [s for s in outs if s.ref.dtype != s.cand.dtype]
    if dtypes:  # torch.allclose refuses mixed dtypes: KernelBench fails the trial
        t.dtype_mismatch = [dtypes[0].ref.dtype, dtypes[0].cand.dtype]
    if result.output_shape_mismatch is not None:
        t.shape_mismatch = [list(x) for x in result.output_shape_mismatch]
    passed = result.error is None and result.output_structure is None and bool(outs) and \
        result.output_shape_mismatch is None and all(s.passed for s in outs) and not dtypes
    t.failed_run = None if passed else 1
    second_run = result.meta.get("second_run", {})
    if second_run.get("output"):
        t.nondeterministic = dict(second_run["output"])
    elif second_run.get("records"):
        name, d = next(iter(second_run["records"].items()))
        t.nondeterministic = {**d, "where": name}
    # (the second run of a forward that changes its own state is another computation, one KernelBench never makes:
    # it says how the runs differ and does not fail the trial)
    if passed and second is not None and not second["allclose"] and not second.get("stateful"):
        passed, t.failed_run, t.max_abs, t.mean_abs = False, 2, second["max_abs"], second["mean_abs"]
    t.allclose = passed
    return t
