"""Capture's values: a record holds the value its tensor had when it was produced (see `diffkit.capture`).

A torch op's output (and a ``torch.nn`` module's) is held without a copy, on its own memory, and copied only when
something the capture sees is about to write into that memory, or when the capture ends if anything besides the
capture still holds it (`seal`); kernel outputs, writes, taps and inputs are copied when recorded.  A version
counter that moved unseen means the value is gone: the record then keeps none rather than a wrong one.

`_Values` is one of the parts `capture._State` is made of (with `capture_flow._Dataflow` and
`capture_fold._Folding`): they share one object's state (`busy`, `trace`, `lazy` …)."""
from __future__ import annotations

import warnings
from typing import Any

import torch

from .records import Record
from .tensorargs import _map_tensors, _storage_key, buffers_of


def _snapshot(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone()


# the attribute marking a copy the capture made of an input: nothing else holds or writes it, so a sink that keeps
# values (a streaming store) may keep that tensor as it is rather than copy it once more
_OWN = "_diffkit_own_copy"


def own_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` marked as the capture's own (`is_own_copy`)."""
    c = _snapshot(t)
    setattr(c, _OWN, True)
    return c


def is_own_copy(t: torch.Tensor) -> bool:
    """Whether `t` is a copy `own_copy` made (the tensor object itself: a view or `detach()` of it is not)."""
    return getattr(t, _OWN, False) is True


# records made by torch (an op, or a torch.nn module's output) are held without a copy until written;
# kernel outputs, writes, taps and inputs are copied when recorded
_LAZY_KINDS = ("op", "module")


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A new tensor object on `t`'s memory (a holder `_holders` counts apart from `t` itself), made
    without a trip through the torch function mode capture has installed."""
    with torch._C.DisableTorchFunction():
        return t.detach()


def _holders(t: torch.Tensor) -> int | None:
    """How many tensors (views included) hold `t`'s memory, or None when that cannot be told."""
    try:
        # the storage object made here holds one reference of its own
        return torch._C._storage_Use_Count(t.untyped_storage()._cdata) - 1
    except (AttributeError, RuntimeError, NotImplementedError, TypeError):
        return None


class _Values:
    """Values held without a copy, and copied before they change (a part of `capture._State`).

    Uses of the other parts: `param_of`, `param_tensor`, `copies`, `before_copy_written` (`_Dataflow`);
    `pending`, `pending_hold`, `flush_before_write` (`_Folding`); `snapshot`, `trace` (`_State`)."""

    def _init_values(self, model: torch.nn.Module | None) -> None:
        # records holding a torch op's output itself, not a copy yet: storage pointer -> [(record, version)]
        self.lazy: dict[int, list[tuple[Record, int]]] = {}
        self.lost: list[str] = []  # records whose memory was written where capture could not see it
        # buffers' memory: a forward may update it from C++ without moving its version (batch norm's running
        # statistics in training mode), so a record there is copied as it is made (`keep`, `hold`)
        self.buffer_storage: set[int] = set()
        if model is not None:
            self.buffer_storage = {k for k in (_storage_key(t) for _, t in buffers_of(model))
                                   if k is not None}

    def _lazy_key(self, tensor: torch.Tensor) -> tuple[int, int] | None:
        """(storage, version) under which `tensor` can be held without a copy (`keep`, `hold`), or None:
        a tensor subclass or one without storage; a buffer's memory (C++ updates running statistics
        unseen, unversioned); an inference-mode tensor (it keeps no version)."""
        key = _storage_key(tensor)
        if key is None or type(tensor) not in (torch.Tensor, torch.nn.Parameter) or key in self.buffer_storage:
            return None
        try:
            return key, tensor._version
        except (RuntimeError, AttributeError, NotImplementedError):
            return None

    def keep(self, rec: Record, tensor: torch.Tensor, kind: str) -> None:
        """Give a new record of this `kind` its value: a copy, or (`_LAZY_KINDS`) the tensor itself, held."""
        held = self._lazy_key(tensor) if kind in _LAZY_KINDS else None
        if held is None:
            rec.value = _snapshot(tensor)
            return
        rec.value = _alias(tensor)
        self.lazy.setdefault(held[0], []).append((rec, held[1]))

    def hold(self, holder: Any, tensor: torch.Tensor) -> bool:
        """Keep `tensor` in `holder.value` without copying it (a streaming store's slot: `holder` has
        `value` and `name`), copied as a record's own value is (`keep`) before anything this capture sees
        writes into its memory, and at its end if something else still holds that memory.  False where
        that cannot be promised (the caller copies now)."""
        held = self._lazy_key(tensor) if self.snapshot else None
        if held is None:
            return False
        try:
            whole = tensor.untyped_storage().nbytes() <= tensor.numel() * tensor.element_size()
        except (RuntimeError, NotImplementedError):
            return False
        if not whole:
            return False  # a view of part of its memory would keep all of it (a budget counts the view's bytes)
        holder.value = _alias(tensor)
        self.lazy.setdefault(held[0], []).append((holder, held[1]))
        return True

    def _copy(self, key: int) -> None:
        """Copy the values of the records held on storage `key` (about to be written, or shared)."""
        for rec, version in self.lazy.pop(key, ()):
            if rec.value is None:
                continue
            if rec.value._version != version:
                # written by something the capture did not see (the version counter says so): the value
                # it had is gone, so the record keeps none rather than a wrong one
                self.lost.append(rec.name)
                rec.value = None
            else:
                rec.value = rec.value.clone()

    def note_param_write(self, args: Any, kwargs: Any) -> None:
        """A call is about to write into its first argument (or `out=`): when that is a parameter's memory,
        keep the parameter as it was before the forward's first write into it (`Trace.params_written`)."""
        target = kwargs.get("out") if kwargs and "out" in kwargs else (args[0] if args else None)
        name = self.param_of(target) if isinstance(target, torch.Tensor) else None
        p = self.param_tensor.get(name) if name is not None else None
        if p is None or name in self.trace.params_written:
            return
        self.busy = True  # (the copy is diffkit's own op)
        try:
            self.trace.params_written[name] = p.detach().clone()
        finally:
            self.busy = False

    def before_write(self, args: Any, kwargs: Any = None, fname: str = "") -> None:
        """Called before a call that may write into its tensor arguments: copy what records hold there
        (and record a pending buffer there first, `flush_before_write`)."""
        if self.busy:
            return
        if self.copies:
            self.before_copy_written(args, kwargs)  # (an input's copy: a write into that input's memory)
        if self.pending:
            self.busy = True
            try:
                self.flush_before_write(args, kwargs, fname)
            finally:
                self.busy = False
        self.copy_held((args, kwargs))

    def copy_held(self, tensors: Any) -> None:
        """Copy the values records hold in the memory of the tensors in `tensors` (about to be written)."""
        if not self.lazy:
            return
        self.busy = True  # the copies are diffkit's own ops, not the model's
        try:
            def check(t: torch.Tensor) -> torch.Tensor:
                key = _storage_key(t)
                if key in self.lazy:
                    self._copy(key)
                return t

            _map_tensors(check, tensors)
        finally:
            self.busy = False

    def seal(self) -> None:
        """The capture ends: copy every value whose memory something else still holds (or may write)."""
        self.pending_hold.clear()
        for key in list(self.lazy):
            held = self.lazy[key]
            if not held:
                continue
            mine = sum(1 for rec, _ in held if rec.value is not None)
            holders = _holders(held[0][0].value) if held[0][0].value is not None else None
            if holders is None or holders > mine or any(rec.value is not None and rec.value._version != v
                                                        for rec, v in held):
                self._copy(key)
        self.lazy.clear()
        if self.lost:
            warnings.warn(f"diffkit: {len(self.lost)} captured value(s) were overwritten in place by code capture "
                          f"could not see and are not compared: {', '.join(self.lost[:5])}")
