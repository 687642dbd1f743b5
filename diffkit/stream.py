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
import math
import itertools
import os
import queue
import random
import shutil
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .align import NAME_MATCH_REL_ERR, RESHAPE, Dataflow, Layout, _stage_params, best_layout, name_partner, \
    permuted_or_plain, _refines, rebound_pair_agrees, record_numel, reorders, reused_name, \
    same_layout, to_ref_layout
from .capture import Record, StopCapture, Trace
from .measure import PendingStats, Stats, apply_stat, measure_async, tolerances

# A lockstep candidate that has gone this many records without freeing room for the parked reference
# evicts values align or the report will ask for too (recovered afterwards by one re-run), rather than
# leave the reference parked until the candidate ends and its remaining values go to host memory.
STALL_RECORDS = 32

__all__ = ["Budget", "Lockstep", "Pick", "TieredStore", "StreamComparer", "default_budget", "name_filter", "parse_size"]


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


class _Spiller:
    """The disk tier's writes, on a thread of their own: a value is copied a piece at a time into a
    small ring of reused staging buffers (pinned for a device value, the copy behind a CUDA event) and
    written to its file from there, so the forward that made it waits neither for the disk nor, on a
    GPU, for the copy off the device.  A file holds one value's bytes in logical order, raw (read back
    only by this process: the slot keeps shape, dtype and strides).  A value is readable once its
    file is complete (`read` waits for it); reading one whose write failed raises that failure."""

    PIECE = 8 << 20  # bytes per staging buffer
    BUFFERS = 4  # staging buffers: at most this many pieces wait for the disk at once

    def __init__(self, directory: str):
        self.dir = directory
        self.jobs: queue.Queue = queue.Queue()
        self.free: queue.Queue = queue.Queue()
        self.buffers: list[torch.Tensor] = []
        self.complete: dict[str, threading.Event] = {}  # path -> set once its file is written (or failed)
        self.unwanted: set[str] = set()  # dropped while still being written: removed once written
        self.error: BaseException | None = None  # the last write's failure
        self.failed: set[str] = set()  # files whose writing failed (incomplete)
        self.producing = threading.Lock()  # one value's pieces stay together in the queue
        self.files = threading.Lock()  # `complete` and `unwanted`, shared with the writer
        self.names = itertools.count()
        self.thread: threading.Thread | None = None

    def _start(self, pinned: bool) -> None:
        self.buffers = [torch.empty(self.PIECE, dtype=torch.uint8, pin_memory=pinned) for _ in range(self.BUFFERS)]
        for i in range(self.BUFFERS):
            self.free.put(i)
        self.thread = threading.Thread(target=self._run, name="diffkit-spill", daemon=True)
        self.thread.start()

    def _raise(self, path: str) -> None:
        if path in self.failed:
            raise OSError(f"could not write a value spilled to {self.dir}: {self.error}") from self.error

    def write(self, key: int, t: torch.Tensor) -> str:
        """Start writing `t`'s values (a snapshot as of now, in stream order on a GPU); its file's path."""
        path = os.path.join(self.dir, f"{key}-{next(self.names)}.bin")
        with self.producing:
            if self.thread is None:
                self._start(t.is_cuda and torch.cuda.is_available())
            src = t.resolve_conj().resolve_neg()
            src = src if src.is_contiguous() else src.contiguous()
            flat = src.reshape(-1).view(torch.uint8) if src.numel() else torch.empty(0, dtype=torch.uint8)
            with self.files:
                self.complete[path] = threading.Event()
            self.jobs.put(("open", path, None, 0, None))
            try:
                for lo in range(0, flat.numel(), self.PIECE):
                    piece = flat[lo:lo + self.PIECE]
                    i = self.free.get()  # (waits while every buffer is on its way to the disk)
                    try:
                        self.buffers[i][:piece.numel()].copy_(piece, non_blocking=piece.is_cuda)
                        ev = None
                        if piece.is_cuda:
                            ev = torch.cuda.Event()
                            ev.record()
                    except BaseException:
                        self.free.put(i)
                        raise
                    self.jobs.put(("piece", path, i, piece.numel(), ev))
            except BaseException:
                self.failed.add(path)  # (its file stays incomplete: a read of it raises)
                raise
            finally:
                self.jobs.put(("close", path, None, 0, None))
        return path

    def _run(self) -> None:
        fds: dict[str, int] = {}
        while True:
            job = self.jobs.get()
            if job is None:
                return
            kind, path, i, n, ev = job
            try:
                if kind == "open":
                    fds[path] = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                elif kind == "piece":
                    if ev is not None:
                        ev.synchronize()
                    fd = fds.get(path)
                    if fd is not None:
                        view = memoryview(self.buffers[i].numpy())[:n]
                        while view:
                            view = view[os.write(fd, view):]
                else:
                    fd = fds.pop(path, None)
                    if fd is not None:
                        os.close(fd)
            except BaseException as e:  # (kept for the caller; the writes after it go on, for the buffers)
                self.error = e
                self.failed.add(path)
                fd = fds.pop(path, None)
                if fd is not None:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
            finally:
                if kind == "piece":
                    self.free.put(i)
                elif kind == "close":
                    with self.files:
                        self.complete[path].set()
                        if path in self.unwanted:
                            self.unwanted.discard(path)
                            self.complete.pop(path, None)
                            self.failed.discard(path)
                            self._remove(path)

    def read(self, path: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """A spilled value, in logical order, in host memory (waits for its file to be complete)."""
        with self.files:
            done = self.complete.get(path)
        if done is not None:
            done.wait()
        self._raise(path)
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if not nbytes:
            return torch.empty(shape, dtype=dtype)
        raw = torch.from_file(path, shared=False, size=nbytes, dtype=torch.uint8)
        return raw.view(dtype).reshape(shape)

    def discard(self, path: str) -> None:
        """Remove a value's file (once it has been written, if it is still being written)."""
        with self.files:
            done = self.complete.get(path)
            if done is not None and not done.is_set():
                self.unwanted.add(path)
                return
            self.complete.pop(path, None)
            self.failed.discard(path)
        self._remove(path)

    @staticmethod
    def _remove(path: str) -> None:
        try:
            os.remove(path)
        except OSError:
            pass

    def close(self) -> None:
        """Finish every write and stop the writer (its files stay)."""
        if self.thread is not None:
            self.jobs.put(None)
            self.thread.join()
            self.thread = None


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


class _Held:
    """A device-tier value kept without a copy while a capture runs: the capture copies it into `value`
    before its forward writes into that memory (or sets None if something it could not see did),
    `_State.hold`; `name` is the record's, for capture's warning about such values.  `version`: the
    value's version counter when it was set (a write the capture did not see moves it: `current`)."""
    __slots__ = ("_value", "version", "name")

    def __init__(self, name: str):
        self._value: torch.Tensor | None = None
        self.version: int | None = None
        self.name = name

    @property
    def value(self) -> torch.Tensor | None:
        return self._value

    @value.setter
    def value(self, v: torch.Tensor | None) -> None:
        self._value, self.version = v, (v._version if v is not None else None)

    def current(self) -> torch.Tensor | None:
        """The value, or None where it has been written over since (it is lost, as capture then says)."""
        v = self._value
        return v if v is not None and v._version == self.version else None


@dataclass
class _Slot:
    tier: str  # "device" | "host" | "disk"
    value: "torch.Tensor | _Held | None"  # device / host tiers
    nbytes: int
    path: str = ""
    shape: tuple = ()
    dtype: Any = None
    device: str = "cpu"
    stride: tuple | None = None  # host / disk tiers hold the values in logical order: the strides to give back


def _reordered_strides(t: torch.Tensor) -> tuple | None:
    """A tensor's strides when it is a permutation of a contiguous one (a transposed view): what a
    copy in logical order must be given back, since a kernel may read its input through its strides
    (a replay must see the layout the run saw); None for a contiguous tensor, or one whose elements
    overlap or leave gaps (a copy of that is contiguous, as `clone` makes it)."""
    if t.is_contiguous():
        return None
    expect = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expect:
            return None
        expect *= size
    return tuple(t.stride())


class TieredStore:
    """Values by key, each in the first tier with room: device, pinned host, disk.

    Device-to-host copies are asynchronous (pinned memory on the current stream), so keeping a
    value in the host tier does not wait for the GPU; a CPU tensor's "device" tier is host memory.
    Used as a capture sink (``owns_values``), it keeps every record's value under its index."""

    owns_values = True

    def __init__(self, device_budget: Budget, host_budget: Budget | None = None, spill_dir: str | None = None,
                 meta: Any = None, lockstep: Lockstep | None = None):
        self.device_budget = device_budget
        self.lockstep = lockstep  # the reference's store in a lockstep diff: a full budget waits for the candidate
        self.delivered = 0  # records whose values were added so far (as a capture sink)
        self.renamed: list[int] = []  # records updated after they were added (their names may have changed)
        self.host_budget = host_budget if host_budget is not None else Budget(0)
        self._spill_root = spill_dir
        self._spill: str | None = None
        self._spiller: _Spiller | None = None  # the disk tier's writer (with `_spill`)
        self.slots: dict[int, _Slot] = {}
        self.meta = meta  # a metadata-only CaptureWriter (crash insurance), or None
        self.tiers = collections.Counter()
        self.capture: Any = None  # the capture whose records are being put (`bind_capture`), while it runs
        self.spilled_bytes = 0
        self._stager: _Stager | None = None

    # -- capture sink protocol
    def add(self, rec: Record, tensor: torch.Tensor) -> None:
        self.put(rec.index, tensor, rec)
        self.delivered = rec.index + 1  # (a record is in its trace before its value is here)
        if self.meta is not None:
            self.meta.add(rec)

    def update(self, rec: Record, tensor: torch.Tensor | None = None) -> None:
        self.renamed.append(rec.index)  # (its names may have changed: a comparer's index is updated)
        if self.meta is not None:
            self.meta.update(rec)

    def set_error(self, err) -> None:
        if self.meta is not None:
            self.meta.set_error(err)

    def close(self) -> None:
        if self.meta is not None:
            self.meta.close()

    def bind_capture(self, cap) -> None:
        self.capture = cap
        if self.lockstep is not None:
            self.lockstep.caps["ref"] = cap

    # -- values
    def _device_value(self, t: torch.Tensor, rec: Record | None) -> "torch.Tensor | _Held":
        """What the device tier keeps of `t`: the tensor itself, copied only before the running forward
        writes into it (capture's copy-on-write), where the capture can promise that (an op's or a
        module's result, `rec`, while the capture `bind_capture` gave runs); else a copy now."""
        cap = self.capture
        if rec is not None and rec.kind in ("op", "module") and cap is not None and cap.active:
            held = _Held(rec.name)
            if cap.state.hold(held, t):
                return held
        return t.clone()

    def put(self, key: int, tensor: torch.Tensor, rec: Record | None = None) -> None:
        """Keep `tensor` under `key` in the first tier with room (`rec`: the record it is the value of,
        as it was just made by the capture bound to this store)."""
        self.drop(key)
        t = tensor.detach()
        n = _nbytes(t)
        b = self.device_budget
        if self.lockstep is not None and b.used + n > b.limit and n <= b.limit:
            self.lockstep.wait_for_room(n)
        if b.take(n):
            self.slots[key] = _Slot("device", self._device_value(t, rec), n)
        elif t.is_cuda and self.host_budget.take(n):
            if self._stager is None:
                self._stager = _Stager()
            # stream-ordered: later in-place writes to `t` come after the copy
            self.slots[key] = _Slot("host", self._stager.copy(t), n, stride=_reordered_strides(t))
        else:
            if self._spill is None:
                self._spill = tempfile.mkdtemp(prefix="diffkit-spill-", dir=self._spill_root)
                self._spiller = _Spiller(self._spill)
            path = self._spiller.write(key, t)  # (written on the spiller's thread)
            self.slots[key] = _Slot("disk", None, n, path, tuple(t.shape), t.dtype, str(t.device),
                                    _reordered_strides(t))
            self.spilled_bytes += n
        self.tiers[self.slots[key].tier] += 1

    def get(self, key: int, device: torch.device | str | None = None) -> torch.Tensor | None:
        s = self.slots.get(key)
        if s is None:
            return None
        if s.tier == "host" and self._stager is not None:
            self._stager.flush()  # its bytes may still be on their way through the pinned ring
        if s.tier == "disk":
            v = self._spiller.read(s.path, s.shape, s.dtype)
        else:
            v = s.value.current() if isinstance(s.value, _Held) else s.value
            if v is None:
                return None  # written in place where its capture could not see (capture warns)
        if s.stride is not None:
            v = torch.empty_strided(v.shape, s.stride, dtype=v.dtype, device=v.device).copy_(v)
        return v.to(device, non_blocking=True) if device is not None and v.device != torch.device(device) else v

    def __contains__(self, key: int) -> bool:
        return key in self.slots

    def drop(self, key: int) -> None:
        s = self.slots.pop(key, None)
        if s is None:
            return
        if isinstance(s.value, _Held):
            s.value.value = None  # (the capture's copy-on-write list still has the holder: the memory goes now)
        if s.tier == "device":
            self.device_budget.give(s.nbytes)
        elif s.tier == "host":
            self.host_budget.give(s.nbytes)
        elif s.path:
            self._spiller.discard(s.path)

    def clear(self) -> None:
        if self._stager is not None:
            self._stager.flush()
        for k in list(self.slots):
            self.drop(k)
        if self._spill is not None:
            self._spiller.close()
            shutil.rmtree(self._spill, ignore_errors=True)
            self._spill = None
            self._spiller = None


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
