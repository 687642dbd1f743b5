"""Streaming two-pass diff: bounded memory, one comparison per record as it is produced.

Pass 1 runs the reference; a `TieredStore` (diffkit.tiers) keeps each record's value where the memory
budget allows: on the tensor's device, then (for CUDA tensors) pinned host memory, then disk.  Pass 2
runs the candidate; a `StreamComparer` pairs each record the moment it is made, as align's name
pass would (a reused variable's name only where dataflow confirms it), or else by the dataflow of
its inputs paired already, measures the pair on the device (no synchronisation: the scalars come
back through pinned memory), and keeps the candidate's value only where the report needs it: a
window of the stages before the first divergence (where the root cause lies), the first few
divergent stages, records it could not pair (for align's later passes) and the output.
Everything else is dropped as soon as its metrics are known.

With a live reference (`Lockstep`, the default), the two passes overlap: the reference's forward runs
on a thread of its own and stops whenever its next record does not fit its device budget; the
candidate's forward then runs, pairs and measures against what the reference has made, and evicts
reference values it has measured (then unpaired ones it has gone past) until that record fits.  So
each forward runs once and nothing goes through host memory; the few evicted values that align or
the report ask for afterwards are recovered by one more forward of the reference.

The objects that leave this module are the usual ones: two `Trace`s and a stats table that
`locate.build_stages` consumes, so the result is the same `Result` as an in-memory diff.
"""
from __future__ import annotations

import bisect
import collections
import fnmatch
import json
import os
import random
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .align import NAME_MATCH_REL_ERR, RESHAPE, Dataflow, Layout, _stage_params, best_layout, name_partner, \
    permuted_or_plain, _refines, rebound_pair_agrees, record_numel, reorders, reused_name, \
    same_layout, to_ref_layout
from .measure import PendingStats, Stats, Worst, apply_stat, measure_async, tolerances
from .records import Record, StopCapture, Trace
from .tiers import (Budget, FileStore, TieredStore, _nbytes, default_budget, default_host_budget, models_budget,
                    parse_size)

# A lockstep candidate that has gone this many records without freeing room for the parked reference
# evicts values align or the report will ask for too (recovered afterwards by one re-run), rather than
# leave the reference parked until the candidate ends and its remaining values go to host memory.
STALL_RECORDS = 32

# (Budget, FileStore, TieredStore, default_budget, default_host_budget, models_budget, parse_size: defined in
# diffkit.tiers)
__all__ = ["Budget", "FileStore", "Lockstep", "Pick", "TieredStore", "StreamComparer", "default_budget",
           "models_budget", "default_host_budget", "name_filter", "parse_size"]


def name_filter(patterns: str | None) -> Callable[[str], bool] | None:
    """`--only`: comma-separated glob patterns on record names; inputs and the output always pass
    (the verdict is the output's)."""
    if not patterns:
        return None
    pats = [p.strip() for p in patterns.split(",") if p.strip()]

    def keep(name: str) -> bool:
        base = name.split("#", 1)[0]
        return base == "output" or base.startswith(("output[", "input[")) or any(
            fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(base, p) for p in pats)

    return keep



def _rng_state() -> tuple:
    np = sys.modules.get("numpy")
    return (torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
            random.getstate(), np.random.get_state() if np is not None else None)


def _set_rng_state(saved: tuple) -> None:
    cpu, cuda, py, np_state = saved
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    random.setstate(py)
    if np_state is not None:
        sys.modules["numpy"].random.set_state(np_state)


class Lockstep:
    """The reference's forward on a thread of its own, kept ahead of the candidate's by what its
    device budget holds, so that a streaming diff runs each forward once and moves nothing to the host.

    One side runs at a time; control passes at record boundaries.  The reference runs until a record
    does not fit its budget (`wait_for_room`) or it ends; the candidate then runs, pairing and
    measuring as it goes, and hands control back once it has freed room for that record
    (`StreamComparer` evicts reference values it no longer needs).  At each switch the outgoing
    side's capture is suspended (its global hooks and kernel wrappers taken out) and the random
    number generators are swapped, so each forward draws what it would draw alone.  `caps` holds
    the two captures (bound by `run_captured`), `need` the bytes the parked reference waits for."""

    def __init__(self, low_water: int = 0):
        self.low_water = low_water  # room freed beyond `need` before the reference runs on (fewer switches)
        self.cv = threading.Condition()
        self.turn = "ref"
        self.ref_done = False
        self.cand_done = False
        self.need = 0
        self.switches = 0
        self.caps: dict[str, Any] = {}
        self.rng: dict[str, tuple] = {}
        self.trace: Trace | None = None
        self.failure: BaseException | None = None
        self.thread: threading.Thread | None = None

    def start(self, run_reference: Callable[[], Trace]) -> None:
        """Run `run_reference` on the reference's thread; return once it waits for room or has ended."""
        device = torch.cuda.current_device() if torch.cuda.is_initialized() else None

        def body() -> None:
            try:
                if device is not None:
                    torch.cuda.set_device(device)
                self.trace = run_reference()
            except BaseException as e:  # handed to the caller's thread by `finish`
                self.failure = e
            finally:
                with self.cv:
                    self.ref_done, self.need = True, 0
                    self.turn = "cand"
                    self.cv.notify_all()

        self.thread = threading.Thread(target=body, name="diffkit-reference", daemon=True)
        self.thread.start()
        with self.cv:
            while self.turn != "cand":
                self.cv.wait()

    def live_trace(self) -> Trace | None:
        """The reference's trace so far (the finished one once it has ended)."""
        cap = self.caps.get("ref")
        return self.trace if self.trace is not None else (cap.state.trace if cap is not None else None)

    def _hand(self, me: str, other: str) -> None:
        cap = self.caps.get(me)
        held = cap is not None and cap.active
        if held:
            cap.suspend()
        self.rng[me] = _rng_state()
        with self.cv:
            self.turn = other
            self.switches += 1
            self.cv.notify_all()
            while self.turn != me:
                self.cv.wait()
        _set_rng_state(self.rng[me])
        if held:
            cap.resume()

    # -- the reference's side
    def wait_for_room(self, nbytes: int) -> None:
        """The reference's next record needs `nbytes` its budget does not have: the candidate runs
        until it has freed them (or has ended: the record then goes to the next tier)."""
        cap = self.caps.get("ref")
        if self.cand_done or cap is None or not cap.active:
            return
        self.need = nbytes
        self._hand("ref", "cand")
        self.need = 0

    # -- the candidate's side
    def waiting(self) -> int:
        """Bytes the parked reference waits for (0: it is not waiting)."""
        return 0 if self.ref_done else self.need

    def resume_reference(self) -> None:
        self._hand("cand", "ref")

    def finish(self) -> Trace:
        """The candidate has ended: the reference runs to its end; its trace."""
        self.cand_done = True
        if not self.ref_done:
            mine = _rng_state()
            with self.cv:
                self.turn = "ref"
                self.switches += 1
                self.cv.notify_all()
                while not self.ref_done:
                    self.cv.wait()
            _set_rng_state(mine)
        if self.thread is not None:
            self.thread.join()
        if self.failure is not None:
            raise self.failure
        assert self.trace is not None
        return self.trace


class Pick:
    """Capture sink: the values of chosen reference records, into `store` (a re-run of the reference
    that recovers values a lockstep diff evicted).  A record is taken only if it is the one captured
    the first time at that index (same operation and shape)."""

    owns_values = True

    def __init__(self, store: "TieredStore", wanted: dict[int, Record]):
        self.store, self.wanted, self.got = store, wanted, set()

    def add(self, rec: Record, tensor: torch.Tensor) -> None:
        first = self.wanted.get(rec.index)
        if first is not None and first.op == rec.op and tuple(first.shape) == tuple(rec.shape):
            self.store.put(rec.index, tensor)
            self.got.add(rec.index)

    def update(self, rec: Record, tensor: torch.Tensor | None = None) -> None:
        pass

    def set_error(self, err) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class _Pending:
    cand: int
    ref: int
    transform: tuple
    stats: PendingStats
    weak: bool = False  # checked for value agreement when its metrics arrive (no sync at pairing time)
    values: tuple | None = None  # (ref, cand) until measured, when a statistic other than elementwise is judged
    # (ref, cand as made): measured as a plain reshape; a permuted layout is looked for when the metrics
    # say the plain one differs (`align.permuted_or_plain`), so pairing does not wait for the device
    relayout: tuple | None = None


@dataclass
class StreamComparer:
    """Capture sink for the candidate pass: pair by name, measure at once, keep little.

    Pairs as align's name pass does (`align.pass_name`): a reused variable's name pairs only where
    the dataflow confirms it (the candidate's graph is built as its records arrive); what it cannot
    pair is kept for align's later passes; a record no name pairs may pair by the dataflow of its
    inputs paired already (`_dataflow_partner`).  `pairs` maps a candidate index to (reference index,
    transform, relative L2 error once measured, the pass that made it), as `align(fixed=...)` takes it.
    `stats` maps (ref index, cand index, transform) to Stats, as `build_stages(known=...)` wants.
    `keep` holds the candidate values the report and root cause need (see the module doc).
    `rename` maps the candidate's parameter names to the reference's (align.param_map)."""

    ref: Trace
    ref_store: Any  # TieredStore or FileStore
    keep: TieredStore
    atol: float | None = None
    rtol: float | None = None
    window: int = 8  # candidate values kept before the first divergence
    keep_diverged: int = 4
    stop_at_first: bool = False
    journal: Any = None  # a text file: one JSON line per measured pair (crash insurance)
    meta: Any = None  # metadata-only CaptureWriter for the candidate
    rename: dict = field(default_factory=dict)
    stat: str = "elementwise"  # the statistic judged (measure.STATS)
    stats: dict = field(default_factory=dict)
    first: int | None = None  # candidate index of the first divergent pair, once known
    compared_bytes: int = 0
    lockstep: Lockstep | None = None  # the reference still running beside the candidate (see Lockstep)
    owns_values = True

    def __post_init__(self):
        self.paired: set[int] = set()
        self.deferred: list[int] = []  # no partner yet while the reference runs: tried again as it goes on
        self.evicted: set[int] = set()  # reference values dropped to make room (a re-run recovers them)
        self.late: list[int] = []  # candidate records paired with an evicted value: measured after recovery
        self.pairs: dict[int, tuple] = {}  # candidate index -> (reference index, transform[, relative error])
        self.ref_flow = Dataflow.of([])  # the reference's, extended by `_grew`
        self.flow = Dataflow.of([])  # the candidate's, record by record
        self._by_inputs: dict = {}  # reference records by the records they consumed (the first _by_inputs_n)
        self._by_inputs_n = 0
        self._measured_refs: set[int] = set()  # the reference records of `stats`
        self._freed: set[str] = set()  # names of reference records unpaired since the last `_retry`
        self._tried: dict[int, tuple] = {}  # a deferred record: `_tried_as` when it was last tried
        self._stalled = 0  # candidate records since the parked reference last found room
        self._grew()  # names, the reference's dataflow (as far as a lockstep reference has delivered)
        self.queue: collections.deque[_Pending] = collections.deque()
        self.ring: collections.deque[int] = collections.deque()  # ok candidate values before the first divergence
        self.diverged: list[int] = []
        self.unmatched: list[int] = []
        self.records: list[Record] = []

    # -- capture sink protocol
    def add(self, rec: Record, tensor: torch.Tensor) -> None:
        self.records.append(rec)
        self.flow.append(rec, self.rename)
        if self.meta is not None:
            self.meta.add(rec)
        ahead = len(self.deferred)
        self._place(rec, tensor, held=False)
        if self.lockstep is not None and self.lockstep.waiting():
            # (a weight prepared in the forward, `w.t()`, pairs with nothing: it says nothing of the pace)
            self._pace(caught_up=len(self.deferred) > ahead and not self.flow.derived[rec.index])

    def bind_capture(self, cap) -> None:
        self.keep.bind_capture(cap)  # (its values are the candidate's records: copied only before a write)
        if self.lockstep is not None:
            self.lockstep.caps["cand"] = cap

    def _ref_running(self) -> bool:
        return self.lockstep is not None and not self.lockstep.ref_done

    def _unpaired(self, rec: Record, tensor: torch.Tensor | None, held: bool) -> None:
        if not held:
            self.keep.put(rec.index, tensor, rec)  # align by dataflow/order/value afterwards
        (self.deferred if self._ref_running() else self.unmatched).append(rec.index)

    def _place(self, rec: Record, tensor: torch.Tensor, held: bool) -> None:
        """Pair `rec` and queue its measurement, or keep it for later (`held`: its value is in
        `keep` already, a deferred record tried again)."""
        ri = name_partner(rec, self.ref.records, self.names, self.paired)  # as align's name pass pairs
        r = self.ref.records[ri] if ri is not None else None
        if r is not None and not same_layout(rec, r) and not (
                (_refines(tuple(rec.shape), tuple(r.shape)) or _refines(tuple(r.shape), tuple(rec.shape)))
                and not reorders(self.records, self.flow, rec.index)
                and not reorders(self.ref.records, self.ref_flow, ri)):
            ri = r = None  # a name on a permuted tensor: align's dataflow pass decides first (a plain
            # reshape, [b*s, d] for [b, s, d], is measured now: a crashing child keeps its numbers; shapes
            # that merely multiply out alike, [b*s, 3*d] and a head-split permutation, are not one)
        weak = r is not None and reused_name(rec, r)
        if weak:
            agrees = rebound_pair_agrees(rec, r, self.flow, self.ref_flow, self._partner)
            if agrees is False:
                ri = None  # dataflow says another record may be its counterpart: align decides
            weak = agrees is None  # without dataflow, the pair must also agree in value
        via = "name"
        if ri is None and rec.kind != "input":
            ri, via = self._dataflow_partner(rec), "dataflow"
            r = self.ref.records[ri] if ri is not None else None
        if ri is None:
            if rec.kind != "input":
                self._unpaired(rec, tensor, held)
            return
        refv = self.ref_store.get(ri, tensor.device)
        if refv is None:
            if ri not in self.evicted:
                return
            if tuple(r.shape) == tuple(tensor.shape) and not weak:
                # its reference value made room earlier: measured once a re-run has recovered it
                self._pair(rec, ri, (), via)
                if not held:
                    self.keep.put(rec.index, tensor, rec)
                self.late.append(rec.index)
            elif rec.kind != "input":
                self._unpaired(rec, tensor, held)  # align pairs it, with the value a re-run recovers
            return
        transform: tuple = ()
        relayout = None
        if tuple(r.shape) != tuple(tensor.shape):
            # as align does: the layout closest in value
            if weak:
                layout = best_layout(tensor.detach(), refv)
                transform = layout.transform
                if layout.rel_err > NAME_MATCH_REL_ERR:
                    self._unpaired(rec, tensor, held)  # align by value afterwards
                    return
                weak = False
            else:
                transform, relayout = RESHAPE, refv  # (decided when measured: `drain`)
        self._pair(rec, ri, transform, via)
        needed = weak or self.first is None or len(self.diverged) < self.keep_diverged
        if needed and not held:
            self.keep.put(rec.index, tensor, rec)  # provisional: dropped once its metrics say it is not needed
        elif held and not needed:
            self.keep.drop(rec.index)
        if relayout is not None:
            # the value as made, for the layout search: `keep`'s copy, else one of its own (the
            # candidate's forward may write into its memory before the metrics arrive)
            relayout = (refv, None if rec.index in self.keep else tensor.detach() if held else tensor.detach().clone())
        a, t = tolerances(self.atol, self.rtol, r.dtype)
        cv = to_ref_layout(tensor.detach(), tuple(r.shape), transform)
        self.queue.append(_Pending(rec.index, ri, transform, measure_async(refv, cv, a, t), weak,
                                   (refv, cv) if self.stat != "elementwise" else None, relayout))
        self.compared_bytes += 2 * _nbytes(tensor)
        # a pair on a reused name is undone when its values disagree, which frees its reference record for
        # the records after it: decided before the next record is placed, not whenever its metrics arrive
        # (else which records pair online, and so the stage table, would change from run to run)
        self.drain(block=self.stop_at_first or weak)

    def update(self, rec: Record, tensor: torch.Tensor | None = None) -> None:
        if self.meta is not None:
            self.meta.update(rec)
        if rec.is_output and tensor is not None and rec.index not in self.keep:
            self.keep.put(rec.index, tensor, rec)

    def set_error(self, err) -> None:
        if self.meta is not None:
            self.meta.set_error(err)

    def close(self) -> None:
        if self.meta is not None:
            self.meta.close()

    def _pair(self, rec: Record, ri: int, transform: tuple, via: str) -> None:
        self.paired.add(ri)
        self.pairs[rec.index] = (ri, transform, None, via)

    # -- lockstep: room for the reference, partners found as it goes on
    def _grew(self) -> None:
        """The reference has made more records (its earlier ones may have been renamed meanwhile);
        those whose values have reached the store can pair.  The names index is kept up to date
        record by record: the records the store saw renamed are moved, the new ones added."""
        n = self._ref_n = self.ref_store.delivered if self.lockstep is not None else len(self.ref.records)
        records = self.ref.records
        renamed = getattr(self.ref_store, "renamed", None)
        touched: set[str] = set()  # names given another reference record (`_retry` tries their records)
        new_keys: set[frozenset] = set()  # `_by_inputs` entries given another record
        if not hasattr(self, "names"):
            # (as `align.names_index` builds it, record by record; a reference read from a capture file
            # has ended, so its store reports no renames)
            self.names, self._indexed, self._renamed_seen = {}, {}, 0
        for ri in dict.fromkeys((renamed or [])[self._renamed_seen:]):
            old = self._indexed.get(ri)
            if old is None:
                continue  # not indexed yet: indexed below under its names now
            now = tuple(records[ri].names())
            if now == old:
                continue
            for name in old:
                self.names[name].remove(ri)
                if not self.names[name]:
                    del self.names[name]
            for name in now:
                bisect.insort(self.names.setdefault(name, []), ri)  # (capture order)
            touched.update(now)
            self._indexed[ri] = now
        for r in records[len(self._indexed):n]:
            now = self._indexed[r.index] = tuple(r.names())
            touched.update(now)
            for name in now:
                self.names.setdefault(name, []).append(r.index)
        self._renamed_seen = len(renamed or ())
        rf = self.ref_flow
        for r in records[len(rf.inputs):n]:
            rf.append(r)
        for r in records[self._by_inputs_n:n]:
            if r.kind != "input" and not rf.derived[r.index]:
                key = frozenset(j for j in rf.inputs[r.index] if not rf.derived[j])
                self._by_inputs.setdefault(key, []).append(r.index)
                new_keys.add(key)
        self._by_inputs_n = max(self._by_inputs_n, n)
        self._touched, self._new_keys = touched, new_keys

    def _pace(self, caught_up: bool = True) -> None:
        """The parked reference waits for `need` bytes: hand control back once they are free and
        either `low_water` bytes more are too (the reference then makes several records before it
        parks again: a switch per batch of records, not per record) or the candidate has caught up
        with it (`caught_up`: its last record found no partner yet, so running on would only hold
        more of its values)."""
        ls = self.lockstep
        need = ls.waiting()
        if not need:
            return
        target = min(need + ls.low_water, self.ref_store.device_budget.limit)
        if not self._make_room(need, target):
            self._stalled += 1
            return
        self._stalled = 0
        if not caught_up and self._room() < target:
            self._evict(target)  # (by `_make_room`'s rule: measured values first, then those no one will read)
            if self._room() < target:
                return
        ls.resume_reference()
        self._grew()
        self._retry()

    def _retry(self, everything: bool = False) -> None:
        """The deferred records, in the order they were made, against what the reference has now:
        those `_may_pair` says something new could pair (all of them when `everything`)."""
        pending, self.deferred = self.deferred, []
        freed, self._freed = self._freed, set()
        self._touched = self._touched | freed
        for ci in pending:
            rec = self.records[ci]
            if not (everything or self._may_pair(rec)):
                self._unpaired(rec, None, held=True)  # as `_place` would leave it, without fetching its value
                continue
            self._tried[ci] = self._tried_as(self._inputs_key(rec))
            value = self.keep.get(ci, rec.device if rec.device != "cpu" else None)
            if value is not None:
                self._place(rec, value, held=True)

    def _may_pair(self, rec: Record) -> bool:
        """Whether `_place` could pair `rec` now where it could not before: one of its names was given
        another reference record by the last `_grew`, or (the dataflow way) every input it consumed is
        paired and either a reference record consuming their partners has just arrived or those
        partners changed since `rec` was last tried."""
        if any(n in self._touched or n in self._freed for n in rec.names()):
            return True
        key = self._inputs_key(rec)
        return key is not None and (key in self._new_keys or self._tried.get(rec.index) != self._tried_as(key))

    def _tried_as(self, key: frozenset | None) -> tuple:
        """What a dataflow attempt depends on: the inputs' partners, and which reference records
        consuming them are free (a pair made elsewhere can leave one contender where there were two)."""
        return key, tuple(ri for ri in self._by_inputs.get(key, ()) if ri not in self.paired)

    def _inputs_key(self, rec: Record) -> frozenset | None:
        """The partners of the records `rec` consumed (weight preparation aside), None unless all are paired."""
        flow, i = self.flow, rec.index
        if flow.derived[i]:
            return None
        ins = [self._partner(j) for j in flow.inputs[i] if not flow.derived[j]]
        return None if not ins or None in ins else frozenset(ins)

    def settle(self) -> None:
        """The reference has ended: what is still deferred is tried once more, then left to align."""
        self.lockstep = None
        self._grew()
        self._retry(everything=True)

    def _room(self) -> int:
        b = self.ref_store.device_budget
        return b.limit - b.used

    def _make_room(self, need: int, target: int) -> bool:
        """Free `need` bytes of the reference's budget if the candidate can, evicting towards `target`."""
        if self._room() >= need:
            return True
        self.drain()
        self._evict(target)
        if self._room() < need and self.queue:
            pending = sum(self.ref_store.slots[p.ref].nbytes for p in self.queue
                          if p.ref in self.ref_store.slots and self.ref_store.slots[p.ref].tier == "device")
            if self._room() + pending >= need:
                self.drain(block=True)  # waits for the device: only when that is what frees the room
                self._evict(target)
        if self._room() < need and self._stalled >= STALL_RECORDS:
            self._evict(target, wanted_later=True)
        return self._room() >= need

    def _pinned(self) -> set[int]:
        """Reference records whose values the report will want: the partners of the candidate values
        kept (the stages before the first divergence, the first divergent ones), their inputs, and
        the partners of those candidate records' inputs."""
        pins: set[int] = set()
        for ci in [*self.ring, *self.diverged[:self.keep_diverged]]:
            hit = self.pairs.get(ci)
            if hit is not None:
                pins.add(hit[0])
                pins.update(self.ref_flow.inputs[hit[0]])
            pins.update(p for p in (self._partner(j) for j in self.flow.inputs[ci]) if p is not None)
        return pins

    def _evict(self, target: int, wanted_later: bool = False) -> None:
        """Drop reference values until `target` bytes are free: those measured already, oldest first,
        then unpaired ones the candidate has gone past (paired a later record) whose element count no
        unpaired candidate record has, largest first; the values the report will want (`_pinned`)
        after the others.  `wanted_later` (the candidate has gone STALL_RECORDS records without
        freeing room otherwise): also the unpaired ones align may pair by value.  A re-run of the
        reference recovers what align or the report asks for."""
        if self._room() >= target:
            return
        store = self.ref_store
        pins = self._pinned()
        evicted = self.evicted

        def drop(order) -> bool:
            for ri in order:
                if self._room() >= target:
                    return True
                store.drop(ri)
                evicted.add(ri)
            return self._room() >= target

        # measured, or on its way: the kernel reading it is queued on the stream before any reuse of its memory
        measured_refs = self._measured_refs | {p.ref for p in self.queue
                                               if not p.weak and p.values is None and p.relayout is None}
        records = self.ref.records
        on_device = [ri for ri, sl in store.slots.items() if sl.tier == "device" and not records[ri].is_output]
        measured = sorted(ri for ri in on_device if ri in measured_refs)
        if drop([ri for ri in measured if ri not in pins]):  # (the common case: nothing more is looked at)
            return
        frontier = max(self.paired, default=-1)  # the latest reference record paired
        loose_numels = {record_numel(self.records[ci]) for ci in (*self.deferred, *self.unmatched)}
        # (each record's element count once: this runs on every hand-over while the budget is full)
        keyed = sorted((record_numel(records[ri]) in loose_numels, -store.slots[ri].nbytes, ri)
                       for ri in on_device if ri in store.slots and ri not in self.paired and ri < frontier)
        loose = [k[2] for k in keyed]
        # align will ask for an unpaired value of an element count some unpaired candidate record has
        later = {k[2] for k in keyed if k[0]}
        measured = [ri for ri in measured if ri in store.slots]
        drop([ri for ri in loose if ri not in pins and ri not in later]
             + [ri for ri in measured + loose if ri in pins and ri not in later]
             + ([ri for ri in loose if ri in later] if wanted_later else []))

    def _partner(self, ci: int) -> int | None:
        hit = self.pairs.get(ci)
        return None if hit is None else hit[0]

    def _dataflow_partner(self, rec: Record) -> int | None:
        """Dataflow from inputs paired already (cheap online): the one free reference record that
        consumed the counterparts of exactly this record's inputs (weight preparation aside) and read
        the same parameters, else the one that read some of them (a bias left out), in the same
        shape.  None where that is not one record: align's dataflow pass decides afterwards."""
        flow, rf = self.flow, self.ref_flow
        i = rec.index
        ins = self._inputs_key(rec)
        if ins is None:
            return None
        params = _stage_params(flow, i)
        exact, partial = [], []
        for ri in self._by_inputs.get(ins, ()):
            r = self.ref.records[ri]
            if ri in self.paired or not same_layout(rec, r):
                continue
            rp = _stage_params(rf, ri)
            if rp == params:
                exact.append(ri)
            elif params & rp and params < rp:
                # the candidate left some of the reference's parameters out (a bias): as align pairs it.
                # One that read more (a fused call) is left to align, which chooses among such by value
                partial.append(ri)
        found = exact or partial
        return found[0] if len(found) == 1 else None

    # -- resolution
    def drain(self, block: bool = False) -> None:
        """Collect the metrics that have arrived (all of them when `block`); decide what to keep."""
        while self.queue and (block or self.queue[0].stats.done()):
            p = self.queue.popleft()
            st = p.stats.result()
            if p.relayout is not None:
                refv, raw = p.relayout
                p.relayout = None
                if raw is None:
                    raw = self.keep.get(p.cand, refv.device)
                layout = Layout(RESHAPE, p.stats.rel_l2)
                if raw is not None:
                    layout = permuted_or_plain(raw, refv, layout)
                if layout.transform != RESHAPE:  # a permuted layout brings the two together: measured in it
                    p.transform = layout.transform
                    cv = to_ref_layout(raw, tuple(refv.shape), p.transform)
                    p.stats = measure_async(refv, cv, p.stats.atol, p.stats.rtol)
                    st = p.stats.result()
                    if p.values is not None:
                        p.values = (refv, cv)
            if p.values is not None:
                apply_stat(st, p.values[0], p.values[1], self.stat)
                p.values = None
            if p.weak and p.stats.rel_l2 > NAME_MATCH_REL_ERR:
                # the reused name pointed at a different tensor: unpair, let value alignment place it
                self.paired.discard(p.ref)
                self._freed.update(self.ref.records[p.ref].names())  # free again: `_may_pair` retries by them
                self.pairs.pop(p.cand, None)
                self.unmatched.append(p.cand)
                continue
            self.stats[(p.ref, p.cand, p.transform)] = st
            self._measured_refs.add(p.ref)
            if p.cand in self.pairs:
                self.pairs[p.cand] = (p.ref, p.transform, p.stats.rel_l2, self.pairs[p.cand][3])
            if self.journal is not None:
                self.journal.write(json.dumps({"ref": p.ref, "cand": p.cand, "transform": list(p.transform),
                                               "stats": st.to_dict()}) + "\n")
                self.journal.flush()
            self._decide(p.cand, st)

    def _decide(self, ci: int, st: Stats) -> None:
        is_out = self.records[ci].is_output
        if not st.ok:
            if self.first is None:
                self.first = ci
            self.diverged.append(ci)
            if len(self.diverged) > self.keep_diverged and not is_out:
                self.keep.drop(ci)
            if self.stop_at_first:
                raise StopCapture(f"stopped at the first divergence ({self.records[ci].name})")
            return
        if self.first is None:
            self.ring.append(ci)
            while len(self.ring) > self.window:
                old = self.ring.popleft()
                if not self.records[old].is_output:
                    self.keep.drop(old)
        elif not is_out:
            self.keep.drop(ci)

    def finish(self) -> None:
        self.drain(block=True)


def read_journal(path: str) -> dict:
    """Stats measured by a streaming child before it died: (ref, cand, transform) → Stats."""
    out: dict = {}
    if not os.path.exists(path):
        return out
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            try:
                d = json.loads(line)
                s = dict(d["stats"])
                s.pop("mismatch_fraction", None)
                w = s.pop("worst")
                st = Stats(**s, worst=Worst(tuple(w["index"]), w["ref"], w["cand"], w["abs_err"]) if w else None)
                tr = d["transform"]
                out[(int(d["ref"]), int(d["cand"]), tuple(tr))] = st
            except (ValueError, KeyError, TypeError):
                break
    return out
