"""An isolated diff's reference values handed to the candidate's process on the GPU, not through files.

On a GPU the reference's process keeps its captured values where they were computed and publishes
CUDA IPC handles to them (torch.multiprocessing's tensor reductions) in ``handoff.pkl`` inside its
capture directory, whose records it writes as names and shapes only.  It then stays alive, holding the
values, until it is told what to do with them (`Holder.serve`: by its parent, diffkit.processes):

    release          the candidate's process has finished with them: exit
    dump             write every value (and the parameters) into the capture directory, then exit: the
                     candidate's process crashed and its parent diffs the files, or the candidate's
                     process could not open the handles (then it reads the files too: it asks through
                     `on_dump_request`'s function, which its parent passes on to the holder)

The candidate's process (`receive`) opens the handles as device tensors in its own process: nothing is
copied off the device and nothing is written to disk.  `receive` only ever reads a handoff this diff's
own reference process wrote (a capture opened as trusted), since it unpickles it.
"""
from __future__ import annotations

import os
import pickle
import shutil
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .store import CaptureWriter, write_after_forward

HANDOFF_FILE = "handoff.pkl"  # the handles (written whole or not at all)
POLL_S = 0.005


def on_gpu(model: torch.nn.Module, inputs: Any) -> bool:
    """Does a forward of `model` on `inputs` compute on a CUDA device (its parameters, buffers or inputs)?"""
    from torch.utils import _pytree as pytree

    for t in list(model.parameters()) + list(model.buffers()) + pytree.tree_leaves(list(inputs)):
        if isinstance(t, torch.Tensor):
            return t.device.type == "cuda"
    return False


def _reduce(t: torch.Tensor) -> tuple[str, Any]:
    """A value as the handoff carries it: ("ipc", (rebuild, args)) for a plain CUDA tensor, else ("value", a
    host copy) (a stray host scalar in a GPU model, a sparse tensor: small, carried by value)."""
    from torch.multiprocessing.reductions import reduce_tensor

    t = t.detach()
    if t.device.type == "cuda" and t.layout == torch.strided and not t.is_quantized and type(t) is torch.Tensor:
        return "ipc", reduce_tensor(t)
    return "value", t.to("cpu").clone()


def _rebuild(item: tuple[str, Any]) -> torch.Tensor:
    how, what = item
    if how == "ipc":
        fn, args = what
        return fn(*args)
    return what


def _room_for_the_candidate(trace, params: dict[str, torch.Tensor]) -> None:
    """Raise unless the device the values are held on has room left for the candidate's side of the diff:
    its model and a capture of its own as large as the one held (with the values held there, an isolated
    diff needs about what a diff in one process needs; through files, the candidate has the device alone)."""
    held: dict = {}
    for t in [r.value for r in trace.records if isinstance(r.value, torch.Tensor)] + list(params.values()):
        if isinstance(t, torch.Tensor) and t.device.type == "cuda":
            held[t.device] = held.get(t.device, 0) + t.numel() * t.element_size()
    for dev, need in held.items():
        free, _ = torch.cuda.mem_get_info(dev)
        if free < need * ROOM_FACTOR:
            raise RuntimeError(f"{dev} has {free / 2**30:.1f} GiB free beside the {need / 2**30:.1f} GiB held; the "
                               f"candidate's side needs about as much again")


ROOM_FACTOR = 1.25  # the device memory left free, against what is held, below which values go through files


@dataclass
class Holder:
    """The reference process's side: what it keeps on the device, published for the candidate's process
    (`hand_over`), then kept until it is released or asked to write it out (`serve`)."""

    capture_dir: str
    # the names in the capture directory that its dump keeps (a compiled pattern: the later trials' captures,
    # trials.TRIAL_DIR); None keeps none
    keep: Any = None
    trace: Any = None
    params: dict = field(default_factory=dict)
    info: dict = field(default_factory=dict)
    dumped: str | None = None  # once `dump` ran: "ok", or why the values could not be written

    @property
    def holding(self) -> bool:
        return self.trace is not None

    def hand_over(self, trace, params: dict[str, torch.Tensor], info: dict) -> None:
        """Publish handles to the values of `trace`'s records and to `params` (the model's parameters and
        buffers), and keep all three for `serve`.  Where no handle can be made (IPC not supported here,
        PyTorch's shared-memory helper missing …) the values are written into the capture at once
        instead, as without a hand-over, and nothing is held."""
        self.trace, self.params, self.info = trace, params, info
        try:
            records = {r.index: _reduce(r.value) for r in trace.records if isinstance(r.value, torch.Tensor)}
            parameters = {n: _reduce(t) for n, t in params.items() if isinstance(t, torch.Tensor)}
            if torch.cuda.is_initialized():
                torch.cuda.synchronize()  # every value computed before another process reads it
                # what the forwards left cached and nothing holds goes back to the device (the candidate needs it)
                torch.cuda.empty_cache()
                _room_for_the_candidate(trace, params)
            data = pickle.dumps({"pid": os.getpid(), "records": records, "parameters": parameters},
                                protocol=pickle.HIGHEST_PROTOCOL)
            tmp = os.path.join(self.capture_dir, HANDOFF_FILE + ".tmp")
            with open(tmp, "wb") as fh:
                fh.write(data)
            os.replace(tmp, os.path.join(self.capture_dir, HANDOFF_FILE))
        except Exception as e:
            sys.stderr.write(f"diffkit: the reference's values cannot be handed over on the device here "
                             f"({type(e).__name__}: {str(e).strip()[:200]}); they are written to its capture\n")
            self.dump()
            self.trace = None  # (not holding)

    def serve(self, requests: Callable[[float], str | None]) -> str:
        """Hold the values until released ("released"), asked to write them out ("dumped"), or the
        process that started this one is gone ("orphaned"): `requests(timeout)` says which ("release",
        "dump", "orphaned"), or None when nothing was asked within `timeout` seconds."""
        while True:
            asked = requests(POLL_S)
            if asked == "dump":
                self.dump()
                return "dumped"
            if asked == "release":
                return "released"
            if asked == "orphaned":
                return "orphaned"

    def dump(self) -> None:
        """Write every held value and parameter into the capture directory, retire the handles, then say
        so (`dumped`: "ok", or why the values could not be written).  The capture is written
        beside the directory and put in its place once complete (its later trials moved over): if writing
        it fails (no room left), the directory stays as it was, complete, with names and shapes."""
        try:
            os.unlink(os.path.join(self.capture_dir, HANDOFF_FILE))  # later readers read the files
        except FileNotFoundError:
            pass
        where = self.capture_dir.rstrip(os.sep)
        new, old = where + ".values", where + ".names"
        outcome = "ok"
        try:
            shutil.rmtree(new, ignore_errors=True)
            writer = CaptureWriter(new)
            writer.set_info(self.info)
            try:
                writer.add_parameters(self.params)
            except ValueError:  # a parameter that cannot be saved: the records still are
                pass
            for rec in self.trace.records:
                writer.add(rec)
            write_after_forward(writer, self.trace.inputs_left, self.trace.rng_after)
            writer.set_error(self.trace.error)
            writer.output_form = self.trace.output_form
            writer.output_others = self.trace.output_others
            writer.close()
            os.rename(where, old)
            os.rename(new, where)
            for name in os.listdir(old):
                if self.keep is not None and self.keep.fullmatch(name):
                    os.rename(os.path.join(old, name), os.path.join(where, name))
            shutil.rmtree(old, ignore_errors=True)
        except (OSError, RuntimeError, ValueError) as e:
            outcome = f"the values could not be written: {e}"
            shutil.rmtree(new, ignore_errors=True)
            if not os.path.isdir(where) and os.path.isdir(old):
                os.rename(old, where)
        self.dumped = outcome


@dataclass
class Handed:
    """The candidate's side: the reference's values opened from their handles, by record index, and its
    parameters by qualified name (device tensors in the reference's process's memory: read, never written)."""

    records: dict[int, torch.Tensor]
    parameters: dict[str, torch.Tensor]


def _alive(pid: int) -> bool:
    """Is process `pid` running (not gone, and not a zombie its parent has yet to collect)?"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            return fh.read().rpartition(")")[2].split()[:1] != ["Z"]
    except OSError:  # (no /proc here)
        return True


def receive(capture_dir: str, wait_s: float = 600.0) -> Handed | None:
    """The values the reference's process handed over for the capture in `capture_dir`; None when it
    handed none over, or when they cannot be opened here (then the holding process is asked to write
    them into the capture, and this returns once it has, so the capture's files hold them)."""
    path = os.path.join(capture_dir, HANDOFF_FILE)
    try:
        with open(path, "rb") as fh:
            data = pickle.load(fh)
    except FileNotFoundError:
        return None
    try:
        records = {int(i): _rebuild(x) for i, x in data["records"].items()}
        parameters = {str(n): _rebuild(x) for n, x in data["parameters"].items()}
        return Handed(records, parameters)
    except Exception as e:  # (the handles cannot be opened here: IPC not allowed, another device …)
        sys.stderr.write(f"diffkit: the reference's values could not be opened on the device here ({type(e).__name__}: "
                         f"{str(e).strip()[:200]}); its process writes them out instead\n")
        request_dump(capture_dir, data.get("pid"), wait_s)
        return None


# how the candidate's process asks the holder to write its values out (set by that process's role,
# diffkit.roles: through its parent); none set: nothing can be asked
_DUMP_REQUEST: list = []


def on_dump_request(ask: Callable[[float], bool] | None) -> None:
    """`ask(wait_s)`: have the holding process write its values into the capture; True once it has."""
    _DUMP_REQUEST[:] = [ask] if ask is not None else []


def request_dump(capture_dir: str, pid: int | None, wait_s: float) -> bool:
    """Ask the holding process (`pid`) to write its values into the capture; wait until it has (True),
    it is gone, or `wait_s` seconds have passed (False)."""
    if not _DUMP_REQUEST or (pid is not None and not _alive(pid)):
        return False
    return _DUMP_REQUEST[0](wait_s)
