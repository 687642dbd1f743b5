"""Streaming two-pass diff: bounded memory, one comparison per record as it is produced.

Pass 1 runs the reference; a `TieredStore` keeps each record's value where the memory budget
allows: on the tensor's device, then (for CUDA tensors) pinned host memory, then disk.  Pass 2
runs the candidate; a `StreamComparer` pairs each record the moment it is made, as align's name
pass would (a reused variable's name only where dataflow confirms it), or else by the dataflow of
its inputs paired already, measures the pair on the device (no synchronisation: the scalars come
back through pinned memory), and keeps the candidate's value only where the report needs it: a
window of the stages before the first divergence (where the root cause lies), the first few
divergent stages, records it could not pair (for align's later passes) and the output.
Everything else is dropped as soon as its metrics are known.

The objects that leave this module are the usual ones: two `Trace`s and a stats table that
`locate.build_stages` consumes, so the result is the same `Result` as an in-memory diff.
"""
from __future__ import annotations

import collections
import fnmatch
import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .align import NAME_MATCH_REL_ERR, Dataflow, _stage_params, best_layout, name_partner, names_index, \
    _refines, rebound_pair_agrees, reused_name, same_layout, to_ref_layout
from .capture import Record, StopCapture, Trace
from .measure import PendingStats, Stats, apply_stat, measure_async, tolerances

__all__ = ["Budget", "TieredStore", "StreamComparer", "default_budget", "name_filter", "parse_size"]


def parse_size(text: str | int | None) -> int | None:
    """'512M', '2G', '1.5GiB', '1000000' → bytes."""
    if text is None or isinstance(text, int):
        return text
    t = str(text).strip().upper().replace("IB", "").rstrip("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    bad = ValueError(f"cannot read {text!r} as a size: give a finite number of bytes >= 0 (examples: 512M, 2G, "
                     f"1000000)")
    try:
        value = float(t[:-1]) * mult[t[-1]] if t and t[-1] in mult else float(t)
    except ValueError:
        raise bad from None
    if not math.isfinite(value) or value < 0:
        raise bad
    return int(value)


def _available_host() -> int:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


def default_budget(device: str) -> int:
    """A quarter of what is free on `device` (its GPU memory, or the host's available memory)."""
    if device.startswith("cuda") and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return free // 4
    return _available_host() // 4


def default_host_budget() -> int:
    """For a GPU diff: half the host's available memory for pinned copies before anything goes to disk."""
    return _available_host() // 2


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


@dataclass
class Budget:
    """Bytes allowed in one memory tier; `peak` is the most ever held."""

    limit: int
    used: int = 0
    peak: int = 0

    def take(self, n: int) -> bool:
        if self.used + n > self.limit:
            return False
        self.used += n
        self.peak = max(self.peak, self.used)
        return True

    def give(self, n: int) -> None:
        self.used -= n


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Stager:
    """Device → host copies without pinning every value: a fixed pinned ring (allocated once)
    receives asynchronous copies behind CUDA events; once an event has passed, the bytes move on to
    ordinary (pageable) host memory.  Pinning each value separately costs more than the copy itself
    (cudaHostAlloc is slow), and a pageable copy would stall the model on every record."""

    def __init__(self, size: int = 256 << 20):
        self.size = size
        self.ring: torch.Tensor | None = None
        self.head = 0
        self.pending: collections.deque = collections.deque()  # (event, start, nbytes, destination view)

    def copy(self, src: torch.Tensor) -> torch.Tensor:
        if self.ring is None:
            self.ring = torch.empty(self.size, dtype=torch.uint8, pin_memory=True)
        dest = torch.empty(src.shape, dtype=src.dtype)
        s = src.contiguous().reshape(-1).view(torch.uint8)
        d = dest.reshape(-1).view(torch.uint8)
        for lo in range(0, s.numel(), self.size):
            piece = s[lo:lo + self.size]
            n = piece.numel()
            if self.head + n > self.size:
                self.head = 0
            self._wait_for(self.head, n)
            self.ring[self.head:self.head + n].copy_(piece, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
            self.pending.append((ev, self.head, n, d[lo:lo + n]))
            self.head += n
        self.poll()
        return dest

    def _wait_for(self, start: int, n: int) -> None:
        # finish every pending copy that overlaps [start, start + n)
        while any(p[1] < start + n and start < p[1] + p[2] for p in self.pending):
            self._finish(self.pending.popleft(), block=True)

    def _finish(self, item, block: bool) -> None:
        ev, start, n, dest = item
        if block:
            ev.synchronize()
        dest.copy_(self.ring[start:start + n])

    def poll(self) -> None:
        while self.pending and self.pending[0][0].query():
            self._finish(self.pending.popleft(), block=False)

    def flush(self) -> None:
        while self.pending:
            self._finish(self.pending.popleft(), block=True)


@dataclass
class _Slot:
    tier: str  # "device" | "host" | "disk"
    value: torch.Tensor | None  # device / host tiers
    nbytes: int
    path: str = ""
    shape: tuple = ()
    dtype: Any = None
    device: str = "cpu"


class TieredStore:
    """Values by key, each in the first tier with room: device, pinned host, disk.

    Device-to-host copies are asynchronous (pinned memory on the current stream), so keeping a
    value in the host tier does not wait for the GPU; a CPU tensor's "device" tier is host memory.
    Used as a capture sink (``owns_values``), it keeps every record's value under its index."""

    owns_values = True

    def __init__(self, device_budget: Budget, host_budget: Budget | None = None, spill_dir: str | None = None,
                 meta: Any = None):
        self.device_budget = device_budget
        self.host_budget = host_budget if host_budget is not None else Budget(0)
        self._spill_root = spill_dir
        self._spill: str | None = None
        self.slots: dict[int, _Slot] = {}
        self.meta = meta  # a metadata-only CaptureWriter (crash insurance), or None
        self.tiers = collections.Counter()
        self.spilled_bytes = 0
        self._stager: _Stager | None = None

    # -- capture sink protocol
    def add(self, rec: Record, tensor: torch.Tensor) -> None:
        self.put(rec.index, tensor)
        if self.meta is not None:
            self.meta.add(rec)

    def update(self, rec: Record, tensor: torch.Tensor | None = None) -> None:
        if self.meta is not None:
            self.meta.update(rec)

    def set_error(self, err) -> None:
        if self.meta is not None:
            self.meta.set_error(err)

    def close(self) -> None:
        if self.meta is not None:
            self.meta.close()

    # -- values
    def put(self, key: int, tensor: torch.Tensor) -> None:
        self.drop(key)
        t = tensor.detach()
        n = _nbytes(t)
        if self.device_budget.take(n):
            self.slots[key] = _Slot("device", t.clone(), n)
        elif t.is_cuda and self.host_budget.take(n):
            if self._stager is None:
                self._stager = _Stager()
            # stream-ordered: later in-place writes to `t` come after the copy
            self.slots[key] = _Slot("host", self._stager.copy(t), n)
        else:
            from safetensors.torch import save_file

            if self._spill is None:
                self._spill = tempfile.mkdtemp(prefix="diffkit-spill-", dir=self._spill_root)
            path = os.path.join(self._spill, f"{key}.safetensors")
            save_file({"v": t.to("cpu").contiguous()}, path)
            self.slots[key] = _Slot("disk", None, n, path, tuple(t.shape), t.dtype, str(t.device))
            self.spilled_bytes += n
        self.tiers[self.slots[key].tier] += 1

    def get(self, key: int, device: torch.device | str | None = None) -> torch.Tensor | None:
        s = self.slots.get(key)
        if s is None:
            return None
        if s.tier == "host" and self._stager is not None:
            self._stager.flush()  # its bytes may still be on their way through the pinned ring
        if s.tier == "disk":
            from safetensors import safe_open

            with safe_open(s.path, framework="pt") as fh:
                v = fh.get_tensor("v")
        else:
            v = s.value
        return v.to(device, non_blocking=True) if device is not None and v.device != torch.device(device) else v

    def __contains__(self, key: int) -> bool:
        return key in self.slots

    def drop(self, key: int) -> None:
        s = self.slots.pop(key, None)
        if s is None:
            return
        if s.tier == "device":
            self.device_budget.give(s.nbytes)
        elif s.tier == "host":
            self.host_budget.give(s.nbytes)
        elif s.path:
            try:
                os.remove(s.path)
            except OSError:
                pass

    def clear(self) -> None:
        if self._stager is not None:
            self._stager.flush()
        for k in list(self.slots):
            self.drop(k)
        if self._spill is not None:
            shutil.rmtree(self._spill, ignore_errors=True)
            self._spill = None


class FileStore:
    """A reference capture directory read lazily, one value at a time, through the TieredStore
    interface (the candidate's process of an isolated diff reads the reference's records this way)."""

    def __init__(self, capture):
        self.capture = capture  # store.CaptureFile
        self.metas = {int(m["index"]): m for m in capture.index["records"]}
        self.slots = {i: None for i, m in self.metas.items() if "key" in m}
        self.tiers = collections.Counter({"file": len(self.slots)})
        self.spilled_bytes = 0

    def get(self, key: int, device: torch.device | str | None = None) -> torch.Tensor | None:
        if key not in self.slots:
            return None
        v = self.capture._value(self.metas[key])
        return v.to(device) if device is not None and v.device != torch.device(device) else v

    def __contains__(self, key: int) -> bool:
        return key in self.slots

    def clear(self) -> None:
        pass


@dataclass
class _Pending:
    cand: int
    ref: int
    transform: tuple
    stats: PendingStats
    weak: bool = False  # checked for value agreement when its metrics arrive (no sync at pairing time)
    values: tuple | None = None  # (ref, cand) until measured, when a statistic other than elementwise is judged


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
    owns_values = True

    def __post_init__(self):
        self.names = names_index(self.ref.records)
        self.paired: set[int] = set()
        self.pairs: dict[int, tuple] = {}  # candidate index -> (reference index, transform[, relative error])
        self.ref_flow = Dataflow.of(self.ref.records)
        self.flow = Dataflow.of([])  # the candidate's, record by record
        self._by_inputs: dict | None = None  # reference records by the records they consumed
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
        ri = name_partner(rec, self.ref.records, self.names, self.paired)  # as align's name pass pairs
        r = self.ref.records[ri] if ri is not None else None
        if r is not None and not (same_layout(rec, r) or _refines(tuple(rec.shape), tuple(r.shape))
                                  or _refines(tuple(r.shape), tuple(rec.shape))):
            ri = r = None  # a name on a permuted tensor: align's dataflow pass decides first (a plain
            # reshape, [b*s, d] for [b, s, d], is measured now: a crashing child keeps its numbers)
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
                self.keep.put(rec.index, tensor)  # align by dataflow/order/value afterwards
                self.unmatched.append(rec.index)
            return
        refv = self.ref_store.get(ri, tensor.device)
        if refv is None:
            return
        transform: tuple = ()
        if tuple(r.shape) != tuple(tensor.shape):
            # as align does: the layout closest in value
            layout = best_layout(tensor.detach(), refv)
            transform = layout.transform
            if weak and layout.rel_err > NAME_MATCH_REL_ERR:
                self.keep.put(rec.index, tensor)  # align by value afterwards
                self.unmatched.append(rec.index)
                return
            weak = False
        self.paired.add(ri)
        self.pairs[rec.index] = (ri, transform, None, via)
        if weak or self.first is None or len(self.diverged) < self.keep_diverged:
            self.keep.put(rec.index, tensor)  # provisional: dropped once its metrics say it is not needed
        a, t = tolerances(self.atol, self.rtol, r.dtype)
        cv = to_ref_layout(tensor.detach(), tuple(r.shape), transform)
        self.queue.append(_Pending(rec.index, ri, transform, measure_async(refv, cv, a, t), weak,
                                   (refv, cv) if self.stat != "elementwise" else None))
        self.compared_bytes += 2 * _nbytes(tensor)
        self.drain(block=self.stop_at_first)

    def update(self, rec: Record, tensor: torch.Tensor | None = None) -> None:
        if self.meta is not None:
            self.meta.update(rec)
        if rec.is_output and tensor is not None and rec.index not in self.keep:
            self.keep.put(rec.index, tensor)

    def set_error(self, err) -> None:
        if self.meta is not None:
            self.meta.set_error(err)

    def close(self) -> None:
        if self.meta is not None:
            self.meta.close()

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
        if flow.derived[i]:
            return None
        ins = frozenset(self._partner(j) for j in flow.inputs[i] if not flow.derived[j])
        if not ins or None in ins:
            return None
        if self._by_inputs is None:
            self._by_inputs = {}
            for r in self.ref.records:
                if r.kind != "input" and not rf.derived[r.index]:
                    key = frozenset(j for j in rf.inputs[r.index] if not rf.derived[j])
                    self._by_inputs.setdefault(key, []).append(r.index)
        params = _stage_params(flow, i)
        exact, partial = [], []
        for ri in self._by_inputs.get(ins, ()):
            r = self.ref.records[ri]
            if ri in self.paired or not same_layout(rec, r):
                continue
            rp = _stage_params(rf, ri)
            if rp == params:
                exact.append(ri)
            elif params & rp and (params <= rp or rp <= params):
                partial.append(ri)
        found = exact or partial
        return found[0] if len(found) == 1 else None

    # -- resolution
    def drain(self, block: bool = False) -> None:
        """Collect the metrics that have arrived (all of them when `block`); decide what to keep."""
        while self.queue and (block or self.queue[0].stats.done()):
            p = self.queue.popleft()
            st = p.stats.result()
            if p.values is not None:
                apply_stat(st, p.values[0], p.values[1], self.stat)
                p.values = None
            if p.weak and p.stats.rel_l2 > NAME_MATCH_REL_ERR:
                # the reused name pointed at a different tensor: unpair, let value alignment place it
                self.paired.discard(p.ref)
                self.pairs.pop(p.cand, None)
                self.unmatched.append(p.cand)
                continue
            self.stats[(p.ref, p.cand, p.transform)] = st
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
    from .measure import Worst

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
