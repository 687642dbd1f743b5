"""One forward under capture, as every run of the diff makes it (the captured forwards, the reference's
health check, the candidate's second run, what-if runs): `run_captured`, and the capture directory that
streams its records (`capture_writer`).

(Split from diffkit.pipeline, which re-exports these names; layer 9: it imports capture, inputs and store.)
"""
from __future__ import annotations

import contextlib
import gc
from typing import Any, Sequence

import torch

from .capture import StopCapture, Trace, buffers_of, capture, parameters_of
from .inputs import copy_inputs
from .store import CaptureWriter

__all__ = ["clone_inputs", "named_tensors", "collector_quiet", "run_captured", "capture_writer"]

# a fresh copy of a forward's inputs for each run, keeping what KernelBench's objects are (diffkit.inputs)
clone_inputs = copy_inputs


def named_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A model's parameters and buffers by qualified name (what diagnosis checks errors against)."""
    out = {n: p.detach() for n, p in parameters_of(model)}
    out.update({n: b.detach() for n, b in buffers_of(model)})
    return out


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
    writer = CaptureWriter(path, shard_bytes=0, values=values, write_through=write_through)
    if info is not None:
        writer.set_info(info)
    if values:
        writer.add_parameters(named_tensors(model))
    return writer
