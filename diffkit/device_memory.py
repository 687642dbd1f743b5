"""What a diff may use of its GPU (issue 46): the memory free on the card when the diff starts and what other
processes hold there, not the card's size; a cap the user sets (`--device-memory SIZE`: this process behaves as if
the card had SIZE); running out of it recognised wherever it happens; and the steps a diff takes when its captured
values do not fit (`Ladder`): every value on the device, then streaming under a budget taken from what is free at
that moment, then every captured value on the host.  When even the last does not fit, the models' own forwards need
more than the card has free: that ends the diff with a sentence naming what was free and what the diff asked for
(exit 2, the user's card and not diffkit's bug).

(The lowest layer: it imports only diffkit.errors and torch.)
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from .errors import DiffkitError

__all__ = ["DeviceRoom", "OutOfDeviceMemory", "CardFull", "Ladder", "cap_process", "is_out_of_memory",
           "trace_ran_out", "users_error", "gb"]

# the words CUDA, cuBLAS, cuDNN and torch's allocator use when an allocation fails (a raised RuntimeError of an
# extension says the same); matched lower-case
OOM_WORDS = ("out of memory", "cublas_status_alloc_failed", "cudnn_status_alloc_failed", "cudaerrormemoryallocation",
             "outofmemoryerror")
STREAM_FRACTION = 4  # a streaming retry keeps at most a quarter of what is free then for captured values


def gb(n: int | float | None) -> str:
    return "?" if n is None else f"{n / 1e9:.1f} GB"


def is_out_of_memory(e: BaseException | None) -> bool:
    """Whether an exception (or the text of one a forward raised) is a failed device allocation."""
    if e is None:
        return False
    if isinstance(e, torch.cuda.OutOfMemoryError):
        return True
    return isinstance(e, (RuntimeError, MemoryError)) and _says_out_of_memory(f"{type(e).__name__}: {e}")


def _says_out_of_memory(text: str) -> bool:
    text = text.lower()
    return any(w in text for w in OOM_WORDS)


def trace_ran_out(trace) -> bool:
    """Whether a captured forward ended because the device ran out of memory (its error is kept, not raised)."""
    err = getattr(trace, "error", None)
    if err is None:
        return False
    return err.type == "OutOfMemoryError" or _says_out_of_memory(f"{err.type}: {err.message}")


class CardFull(DiffkitError):
    """The user's error that ends a diff whose device ran out of memory where it could not adapt (exit 2).  An
    isolated diff's one child that ends so runs again a child per side, each in a process of its own (under
    --device-memory, each with its own cap), and that diff's answer is the answer: not a failure that did not
    repeat."""


class OutOfDeviceMemory(Exception):
    """Raised inside a diff when its device ran out of memory; `Ladder` decides what the diff does next."""

    def __init__(self, where: str):
        self.where = where
        super().__init__(where)


def _cuda(device: str | torch.device | None) -> torch.device | None:
    try:
        dev = torch.device(device) if device is not None else None
    except (RuntimeError, TypeError):
        return None
    if dev is None or dev.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())


def cap_process(device: str | torch.device | None, cap: int | None) -> None:
    """Let this process's allocator take at most `cap` bytes of `device` (torch's per-process memory fraction):
    the diff then runs as it would on a card of that size.  Nothing on a CPU."""
    dev = _cuda(device)
    if dev is None or not cap:
        return
    total = torch.cuda.get_device_properties(dev).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), dev)


@dataclass
class DeviceRoom:
    """The card as the diff found it: its size, what was free, what this process held (torch's reserved
    memory), what other processes held, and this process's cap."""

    device: str
    total: int
    free: int
    own: int
    cap: int | None = None

    @classmethod
    def now(cls, device: str | torch.device | None, cap: int | None = None) -> "DeviceRoom | None":
        dev = _cuda(device)
        if dev is None:
            return None
        free, total = torch.cuda.mem_get_info(dev)
        return cls(str(dev), total, free, torch.cuda.memory_reserved(dev), cap)

    @property
    def others(self) -> int:
        return max(0, self.total - self.free - self.own)

    @property
    def available(self) -> int:
        """What this process can still take: what is free on the card, and no more than its cap allows."""
        if self.cap:
            return max(0, min(self.free, self.cap - self.own))
        return self.free

    def words(self) -> str:
        cap = f", capped at {gb(self.cap)} for this diff" if self.cap else ""
        return (f"{self.device} has {gb(self.total)}: {gb(self.free)} free, {gb(self.others)} held by other "
                f"processes, {gb(self.own)} by this one{cap}")

    def to_dict(self) -> dict:
        return {"device": self.device, "total": self.total, "free": self.free, "others": self.others,
                "own": self.own, "cap": self.cap}


@dataclass
class Ladder:
    """The steps a diff on a GPU takes as its device runs out of memory.  `start` is the mode asked for; each
    `next` gives the options of the next step, after the last it raises the user's error."""

    device: str
    cap: int | None
    at_start: DeviceRoom
    steps: list[str] = field(default_factory=list)  # what each attempt was, in words

    @classmethod
    def start(cls, device: str | None, cap: int | None) -> "Ladder | None":
        room = DeviceRoom.now(device, cap)
        return None if room is None else cls(room.device, cap, room)

    def next(self, options, ran_out: OutOfDeviceMemory):
        """The options to try next, having run out of memory at `ran_out.where` under `options`."""
        streaming = options.is_streaming
        if not streaming:
            tried = "every captured value on the device"
        elif options.max_memory is None:
            tried = "streaming with the models' own size of captured values on the device"
        elif options.max_memory:
            tried = f"streaming with {gb(options.max_memory)} of captured values on the device"
        else:
            tried = "streaming"
        self.steps.append(f"{tried}: ran out ({ran_out.where})")
        room = DeviceRoom.now(self.device, self.cap)
        if not streaming:
            budget = room.available // STREAM_FRACTION
            return options.replace(streaming=True, max_memory=budget, lockstep=True)
        if options.max_memory != 0:  # (None: the budget the models' size gave)
            return options.replace(streaming=True, max_memory=0, lockstep=False)
        raise CardFull(
            "", "forward",
            f"the GPU ran out of memory even with every captured value kept on the host ({ran_out.where}): the "
            f"two models' own forwards need more than the card had free. When the diff started, "
            f"{self.at_start.words()}; now {room.words()}. Tried: {'; '.join(self.steps)}. Free memory on the card "
            f"(other processes hold {gb(room.others)}), or run on a card with more",
            where=ran_out.where)

    def meta(self, options) -> dict | None:
        """What the result's meta says about the device's memory: the card at the start, the most this process's
        allocator held (`peak_bytes`), and the steps taken when it ran out."""
        out = {"at_start": self.at_start.to_dict(),
               "peak_bytes": torch.cuda.max_memory_allocated(self.device) if torch.cuda.is_initialized() else None}
        if self.steps:
            out["adapted"] = self.steps
            out["ran_as"] = (f"streaming, {gb(options.max_memory)} of captured values on the device"
                             if options.max_memory else "streaming, every captured value on the host")
        return out


def _asked_for(e: BaseException) -> str:
    """What the failed allocation asked for, in torch's own words ("Tried to allocate 2.00 GiB"), or ""."""
    m = re.search(r"Tried to allocate [0-9.]+ ?[KMGT]?i?B", str(e))
    return m.group(0) if m else ""


def users_error(e: BaseException, device: str | None, cap: int | None) -> CardFull:
    """A device that ran out of memory outside the steps `Ladder` adapts (a later trial's forwards, writing the
    answer): the user's card, said as such (exit 2), with what was free and what was asked for."""
    room = DeviceRoom.now(device or "cuda", cap)
    asked = _asked_for(e)
    first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
    return CardFull(
        "", "forward",
        f"the GPU ran out of memory{f' ({asked})' if asked else ''}: "
        f"{room.words() if room is not None else 'no CUDA device could be asked what is free'}. The diff needs "
        f"the two models' forwards and, at most, their captured values on the card at once; free memory on the "
        f"card, give this diff a smaller budget for captured values (--max-memory), or run on a card with more "
        f"[{type(e).__name__}: {first}]")
