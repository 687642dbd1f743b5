"""Where a streaming diff keeps the reference's values (`TieredStore`): each in the first memory tier with room
under its budget (`Budget`): on the tensor's device, then (for CUDA tensors) pinned host memory, then disk.

Device-to-host copies go through a fixed pinned ring (`_Stager`); the disk tier is written on a thread of its
own (`_Spiller`), and a write that failed is raised where that value is wanted.  An op's result kept on the
device is held without a copy while its capture runs (`_Held`, capture's copy-on-write).  `FileStore` reads a
capture directory through the same interface (an isolated diff's candidate process)."""
from __future__ import annotations

import collections
import itertools
import math
import os
import queue
import shutil
import tempfile
import threading
from dataclasses import dataclass
from typing import Any

import torch

from .capture_values import is_own_copy
from .records import Record

__all__ = ["Budget", "TieredStore", "FileStore", "default_budget", "default_host_budget", "models_budget",
           "own_bytes", "parse_size", "MODELS_BUDGET_FLOOR"]

# a GPU streaming diff with no --max-memory keeps at least this much of captured values on the device (see
# models_budget): below it, the reference's thread would wait on the candidate at every record of a small model
MODELS_BUDGET_FLOOR = 1 << 30


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


def models_budget(device: str, tensors, cap: int | None = None) -> int:
    """A GPU streaming diff's budget when none is given: what the models themselves hold on the device (their
    parameters, buffers and inputs: `tensors`, each storage counted once), at least MODELS_BUDGET_FLOOR and at
    most a quarter of what is free (`default_budget`; with `cap`, --device-memory, of what the cap leaves this
    process).  The diff then takes about twice what the models' own forwards take (issue 46: a user's evaluator
    fits the card, so the diff does), whatever the card's size, and diffs side by side on one card share it.
    Off a GPU: `default_budget`."""
    card = default_budget(device)
    if not device.startswith("cuda"):
        return card
    if cap:
        card = min(card, max(0, cap - torch.cuda.memory_reserved(torch.device(device))) // 4)
    return min(card, max(own_bytes(tensors, "cuda"), MODELS_BUDGET_FLOOR))


def own_bytes(tensors, device_type: str) -> int:
    """Bytes of the storages behind `tensors` that live on devices of `device_type`, each storage counted once
    (a parameter tied to another, views of one buffer)."""
    seen, own = set(), 0
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.device.type != device_type:
            continue
        try:
            key, size = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
        except (RuntimeError, NotImplementedError):  # (a tensor without storage: a subclass, a fake)
            key, size = id(t), _nbytes(t)
        if key not in seen:
            seen.add(key)
            own += size
    return own


def default_host_budget() -> int:
    """For a GPU diff: half the host's available memory for pinned copies before anything goes to disk."""
    return _available_host() // 2


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
                 meta: Any = None, lockstep: Any = None):
        self.device_budget = device_budget
        # the reference's store in a lockstep diff (a stream.Lockstep): a full budget waits for the candidate
        self.lockstep = lockstep
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
    def _device_value(self, t: torch.Tensor, rec: Record | None, own: bool = False) -> "torch.Tensor | _Held":
        """What the device tier keeps of `t`: the tensor itself where it is a copy nobody else writes (`own`: an
        input as the capture copied it), or copied only before the running forward writes into it (capture's
        copy-on-write) where the capture can promise that (an op's or a module's result, `rec`, while the
        capture `bind_capture` gave runs); else a copy now."""
        if own:
            return t
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
        own = is_own_copy(tensor)
        t = tensor.detach()
        n = _nbytes(t)
        b = self.device_budget
        if self.lockstep is not None and b.used + n > b.limit and n <= b.limit:
            self.lockstep.wait_for_room(n)
        if b.take(n):
            self.slots[key] = _Slot("device", self._device_value(t, rec, own), n)
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
        if device is None or v.device == torch.device(device):
            return v
        # to a device without waiting (stream-ordered); to the host a plain copy, done when it returns (a
        # non-blocking one would land in pinned memory, slow to allocate at GB sizes, and be read before it arrived)
        return v.to(device, non_blocking=torch.device(device).type != "cpu")

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
