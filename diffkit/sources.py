"""The two sides of a diff as the pipeline takes them: a live model and its inputs (`ModelSource`), a capture
directory (`CaptureSource`), or a trace already in memory (`TraceSource`).

(Split from diffkit.pipeline, which re-exports these names; layer 9: it imports capture, handoff, store and
runner.)
"""
from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.utils._pytree as pytree

from .capture import Trace
from .handoff import receive
from .runner import named_tensors
from .store import CaptureFile

__all__ = ["ModelSource", "CaptureSource", "TraceSource", "Source"]


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
    # written by this very diff (an isolated diff's own hand-off; `mapped` implies it): the reference file it names
    # may be run again (its get_inputs(), a trial rebuilt).  Any other capture is data: nothing it names is run
    trusted: bool = False
    _file: Any = field(default=None, repr=False)

    @property
    def file(self):
        if self._file is None:
            handed = None
            # (the flags say "this diff's own capture"; the directory must say so too: a capture given by the user
            # is data, and never has a hand-off unpickled or the files it names run)
            own = (self.mapped or self.trusted) and written_by_this_diff(self.path)
            if self.mapped and own:  # this diff's own handoff: its values may still be on the reference's GPU
                handed = receive(self.path)  # (before the index is read: a failure there rewrites it)
            self._file = CaptureFile.open(self.path)
            self._file.mapped = self.mapped
            self._file.trusted = own
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


_OWN_DIR = re.compile(r"diffkit-([0-9]+)-.+")


def written_by_this_diff(path: str) -> bool:
    """Whether capture `path` is an isolated diff's own hand-off, written by the reference's process of the diff
    this process is part of: ``ref.dkt`` in that diff's private folder (``diffkit-PID-…``, PID the diffkit
    process this one descends from, made by this user with no access for others).  Only such a capture may
    have the reference file it names run again, or a hand-off read; any other is data."""
    real = os.path.realpath(path)
    folder = os.path.dirname(real)
    m = _OWN_DIR.fullmatch(os.path.basename(folder))
    if os.path.basename(real) != "ref.dkt" or m is None:
        return False
    try:
        st = os.lstat(folder)
    except OSError:
        return False
    if not stat.S_ISDIR(st.st_mode) or st.st_mode & 0o077 or (hasattr(os, "getuid") and st.st_uid != os.getuid()):
        return False
    return int(m.group(1)) in _ancestors()


def _ancestors(depth: int = 4) -> set[int]:
    """This process's parent and the processes above it (as far as /proc tells, `depth` of them): the diffkit
    process that started it, directly or through a wrapper (compute-sanitizer)."""
    pids, pid = set(), os.getppid()
    for _ in range(depth):
        if pid <= 1:
            break
        pids.add(pid)
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
                pid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return pids


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
