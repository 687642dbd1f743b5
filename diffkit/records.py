"""The records of a capture: what one forward produced, in order (`Trace`, `Record`), the error it raised
(`CaptureError`), a record standing in a replayable call (`Ref`), and the exception a sink raises to end a
forward early (`StopCapture`).  Plain data: `diffkit.capture` makes them, the store writes and reads them."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

__all__ = ["Record", "Trace", "CaptureError", "Ref", "StopCapture"]


class StopCapture(BaseException):
    """Raised by a sink to end the forward early (``--stop-at-first``); not an error of the model.

    A BaseException, so the model's own ``except Exception`` blocks do not swallow it."""


@dataclass(frozen=True)
class Ref:
    """Placeholder for a tensor argument in a replayable call: the record with this index."""

    index: int


@dataclass
class Record:
    """One captured tensor.

    `name` is unique within a trace: ``module.path`` for a module output, ``scope.function:label``
    for a tensor made in user code, ``tap:NAME`` for a tap, ``output`` for the model's result.
    Repeats of a name get ``#2``, ``#3`` ….
    """

    index: int
    name: str
    kind: str  # "input" | "module" | "op" | "ext" | "write" | "tap"
    scope: str  # module path of the enclosing module ('' for the model itself)
    label: str  # assigned variable, module attribute or expression text
    function: str
    file: str
    line: int
    op: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: str
    value: torch.Tensor | None
    aliases: list[str] = field(default_factory=list)
    is_output: bool = False
    rebound: bool = False  # the label is a variable assigned more than once in its function
    inputs: tuple[Ref, ...] = ()  # records whose tensors the producing call consumed (views and in-place too)
    call: Any = None  # how to re-run the producing call (used by the root-cause replay)
    params: tuple[str, ...] = ()  # qualified names of the model parameters and buffers the producing call read

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}" if self.file else ""

    def names(self) -> list[str]:
        return [self.name, *self.aliases]

    def __repr__(self) -> str:
        shape = "×".join(map(str, self.shape)) or "scalar"
        return f"Record({self.index}: {self.name} [{self.kind} {self.op}] {shape} {str(self.dtype).replace('torch.', '')})"


@dataclass
class CaptureError:
    """Where a forward raised: the exception and the place (module scope, function, source line)."""

    type: str
    message: str
    scope: str
    function: str
    file: str
    line: int
    traceback: str
    call: str = ""  # the extension/kernel call that raised, when known

    @property
    def stage(self) -> str:
        scope = self.scope or "<model>"
        call = f" calling {self.call}" if self.call else ""
        return f"{scope} in {self.function}(){call} at {self.file}:{self.line}"


@dataclass
class Trace:
    """The ordered records of one forward, plus the model's inputs and, if it raised, the error."""

    records: list[Record] = field(default_factory=list)
    inputs: list[torch.Tensor] = field(default_factory=list)  # as they came (none kept where a sink owns the values)
    error: CaptureError | None = None
    stopped: str = ""  # why the forward was ended early on purpose (StopCapture), if it was
    # results folded into lineage instead of recorded (see the module docstring), by call site "file:line"
    folded: dict = field(default_factory=dict)
    # what the forward returned at the top: "tensor", or its container's type ("tuple", "list", "dict" …);
    # "" when not known (a forward that raised, a capture written before this was kept)
    output_form: str = ""
    # the returned structure's leaves that are not tensors (a count, a flag, a string), by path ("[1]", "['n']"), as
    # short text; None when not known (a capture written before this was kept)
    output_others: dict | None = None
    # the input tensors the forward changed in place, by input record name, as it left them (KernelBench
    # hands the candidate the reference's inputs as the reference's forward left them)
    inputs_left: dict = field(default_factory=dict)
    # the random generators' states as the forward left them, by name ("cpu", "cuda:0" …): KernelBench seeds a
    # trial once, so the candidate's forward draws where the reference's stopped
    rng_after: dict = field(default_factory=dict)
    drew_random: bool = False  # whether the generators moved while it was captured (the forward drew numbers)
    # the parameters the forward wrote into through calls the capture saw (`w.mul_(…)`, `w.data.copy_(…)`,
    # `out=w`), by qualified name, each as it was before the first such write (a kernel handed the pointer
    # is not seen)
    params_written: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[Record]:
        return iter(self.records)

    def __getitem__(self, key: int | str) -> Record:
        if isinstance(key, int):
            return self.records[key]
        for r in self.records:
            if key == r.name or key in r.aliases:
                return r
        raise KeyError(f"no record named {key!r}; names: {', '.join(r.name for r in self.records[:20])}")

    def names(self) -> list[str]:
        return [r.name for r in self.records]

    @property
    def output(self) -> Record | None:
        for r in reversed(self.records):
            if r.is_output:
                return r
        return None

    def format(self, limit: int | None = None) -> str:
        rows = [f"{'#':>4}  {'name':<44} {'kind':<6} {'op':<28} {'shape':<18} where"]
        for r in self.records[:limit]:
            shape = "×".join(map(str, r.shape)) or "scalar"
            where = f"{r.file.rsplit('/', 1)[-1]}:{r.line}" if r.file else ""
            rows.append(f"{r.index:>4}  {r.name[:44]:<44} {r.kind:<6} {r.op[:28]:<28} {shape:<18} {where}")
        if limit is not None and len(self.records) > limit:
            rows.append(f"      … {len(self.records) - limit} more")
        if self.error:
            rows.append(f"raised {self.error.type}: {self.error.message} — {self.error.stage}")
        return "\n".join(rows)
