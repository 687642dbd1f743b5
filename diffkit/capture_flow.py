"""Capture's dataflow: for each record, the earlier records its call's tensor arguments came from
(`Record.inputs`) and the model parameters and buffers it read (`Record.params`); see `diffkit.capture`.

Dictionary lookups per argument, by tensor id (with a weak reference to tell a reused id), by `_base` and by
storage address: the record holding exactly a tensor (`ref_of`), the records a view made where capture was quiet
comes from (`sources`), in-place writes into that memory after them, the parameter a tensor is or views
(`param_of`), and through folded results their lineage (`_folded_lineage`, kept by `capture_fold._Folding`).

Copies and numpy (`copy_of`, `note_export`, `_imported`): a value-keeping copy (``.detach()``, ``.cpu()``,
``.contiguous()``, ``.clone()``, a ``.to()`` that keeps the dtype) of a model input or of a whole parameter is
no computation: it makes no record, and reads of it are reads of that input or parameter (so is a record's
``.detach()`` or ``.cpu()`` on its own memory; an in-place write into such a copy is one into what it copies,
`before_copy_written`).  A tensor handed to
numpy (``.numpy()``, ``np.asarray(t)``, ``.tolist()``) is noted as exported; a tensor made from a numpy array
(``torch.tensor(a)``, ``torch.as_tensor(a)``; ``torch.from_numpy(a)``, which capture does not see, when a
recorded call first reads it) comes from what was exported since the last such import (the same set again
for a second import with nothing exported in between): what went out to numpy is what came back.

`_Dataflow` is one of the parts `capture._State` is made of (see `capture_values`)."""
from __future__ import annotations

import sys
import weakref
from typing import Any

import numpy as np
import torch

from . import naming
from .records import Ref
from .tensorargs import _map_tensors, _storage_key, _version, buffers_of, parameters_of


# calls whose result holds its argument's values unchanged (a copy, or the tensor itself): of an input or a
# whole parameter, no record (`copy_of`)
COPY_FUNCS = frozenset({"detach", "cpu", "contiguous", "clone", "to", "cuda", "float", "type_as"})
# calls that hand a tensor's values out of torch, to numpy or Python (`note_export`)
EXPORT_FUNCS = frozenset({"numpy", "__array__", "tolist"})


def _has_array(obj: Any, depth: int = 2) -> bool:
    """Whether a call's arguments hold a numpy array, directly or in a list, tuple or dict (a numpy scalar
    is a constant, like a Python number)."""
    if isinstance(obj, np.ndarray):
        return True
    if depth <= 0:
        return False
    if isinstance(obj, (list, tuple)):
        return any(_has_array(o, depth - 1) for o in obj)
    if isinstance(obj, dict):
        return any(_has_array(o, depth - 1) for o in obj.values())
    return False


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one shape are the same elements of the same memory."""
    try:
        return a.device == b.device and a.data_ptr() == b.data_ptr() and a.stride() == b.stride()
    except RuntimeError:
        return False


class _Dataflow:
    """Where each tensor argument's value comes from (a part of `capture._State`).

    Uses of the other parts: `lineage`, `lineage_storage`, `folded_writes`, `pending`, `_flush` (`_Folding`)."""

    def _init_dataflow(self, model: torch.nn.Module | None) -> None:
        self.tracked: dict[int, tuple[Any, int, int]] = {}  # id(tensor) -> (weakref, record index, version)
        # dataflow through memory: the latest record holding each storage (a view made where capture
        # was quiet still maps to it) and the records that wrote into a storage in place
        self.storage_owner: dict[int, tuple[Any, int]] = {}  # storage pointer -> (weakref, record index)
        self.storage_writes: dict[int, list[int]] = {}  # storage pointer -> record indices, in order
        self.param_ids: dict[int, str] = {}  # id(parameter or buffer) -> qualified name
        self.param_storage: dict[int, list[tuple[int, int, str]]] = {}  # storage pointer -> (start, end, name)
        self.module_params: dict[int, tuple[str, ...]] = {}  # id(module) -> what a call of it reads (cached)
        self.derived: dict[int, tuple[str, ...]] = {}  # record index -> params, for records made from parameters only
        self.param_sets: dict[str, frozenset] = {}  # a parameter's name as a one-name lineage (`_lineage_of_tensor`)
        self.param_tensor: dict[str, torch.Tensor] = {}  # a parameter (not a buffer) by qualified name
        self.param_whole: dict[str, torch.Tensor] = {}  # a parameter or buffer by qualified name (`_whole_param`)
        # value-keeping copies of inputs and whole parameters: id(copy) -> (weakref, record index or name, version)
        self.copies: dict[int, tuple[Any, int | str, int]] = {}
        # what went out to numpy since the last import (record indices, parameters), and what the last import read
        self.exported: tuple[dict[int, None], dict[str, None]] = ({}, {})
        self.last_import: tuple[tuple[int, ...], tuple[str, ...]] | None = None
        if model is not None:
            self.param_tensor = dict(parameters_of(model))
            named = list(self.param_tensor.items()) + buffers_of(model)
            for name, t in named:
                self.param_ids.setdefault(id(t), name)
                self.param_whole.setdefault(name, t)
                key = _storage_key(t)
                if key is not None:
                    start = t.data_ptr()
                    self.param_storage.setdefault(key, []).append((start, start + t.numel() * t.element_size(), name))

    def track(self, t: torch.Tensor, index: int) -> None:
        try:
            self.tracked[id(t)] = (weakref.ref(t), index, _version(t))
        except TypeError:
            pass

    def _hit(self, t: torch.Tensor) -> tuple[Any, int, int] | None:
        """`t`'s entry in `tracked`, else (a copy of an input, `copy_of`) in `copies`."""
        hit = self.tracked.get(id(t))
        if (hit is None or hit[0]() is not t) and self.copies:
            alt = self.copies.get(id(t))
            if alt is not None and isinstance(alt[1], int) and alt[0]() is t:
                return alt  # type: ignore[return-value]
        return hit

    def ref_of(self, t: torch.Tensor) -> Ref | None:
        """The record holding exactly `t`'s current value (the tensor itself, unchanged since)."""
        hit = self._hit(t)
        if hit is None or hit[0]() is not t or hit[2] != _version(t) or self._later_writes(t, hit[1]):
            return None
        if self.folded_writes and self.folded_writes.get(_storage_key(t), -1) > hit[1]:
            return None  # a folded write (a kernel's raw write bumps no version) came after the record
        return Ref(hit[1])

    def _later_writes(self, t: torch.Tensor, index: int) -> list[int]:
        """Records after `index` that wrote into `t`'s storage in place (a view's write included)."""
        if not self.storage_writes:
            return []
        writes = self.storage_writes.get(_storage_key(t))
        return [w for w in writes if w > index] if writes else []

    def param_of(self, t: torch.Tensor) -> str | None:
        """The qualified name of the parameter or buffer `t` is, or is a view of (w.t(), w[:k], w.data)."""
        if not self.param_ids:
            return None
        name = self.param_ids.get(id(t))
        if name is not None:
            return name
        if self.copies:
            alt = self.copies.get(id(t))
            if alt is not None and isinstance(alt[1], str) and alt[0]() is t:
                return alt[1]
        base = t._base
        if base is not None:
            name = self.param_ids.get(id(base))
            if name is not None:
                return name
        spans = self.param_storage.get(_storage_key(t))
        if spans:
            if len(spans) == 1:
                return spans[0][2]
            at = t.data_ptr()
            return next((n for lo, hi, n in spans if lo <= at < hi), spans[0][2])
        return None

    def sources(self, t: torch.Tensor) -> list[int]:
        """The records `t`'s value comes from: its own record, or (for a view made where capture was
        quiet) its base's or its storage's, plus every later in-place write into that storage."""
        hit = self._hit(t)
        if hit is not None and hit[0]() is t:
            return [hit[1], *self._later_writes(t, hit[1])]
        base = t._base
        if base is not None:
            hit = self.tracked.get(id(base))
            if hit is not None and hit[0]() is base:
                return [hit[1], *self._later_writes(base, hit[1])]
        owner = self.storage_owner.get(_storage_key(t))
        if owner is not None and owner[0]() is not None:
            return [owner[1], *self._later_writes(t, owner[1])]
        return []

    def _origin(self, t: torch.Tensor) -> tuple[str | None, Ref | None, list[int], list[str]]:
        """Where a tensor argument's value comes from, as (parameter name, exact record, records,
        parameters read through folded results): the parameter or buffer it is (or is a view of), else
        the record holding exactly it, else the records it comes from (`_folded_sources`)."""
        name = self.param_of(t)
        if name is not None:
            return name, None, [], []
        exact = self.ref_of(t)
        if exact is not None:
            return None, exact, [exact.index], []
        via: list[str] = []
        return None, None, self._folded_sources(t, via), via

    def template(self, obj: Any, folded: list[str] | None = None,
                 flush: bool = True) -> tuple[Any, tuple[Ref, ...], tuple[str, ...]]:
        """Call arguments as a replayable template, and what the call read.

        Returns (template, inputs, params): in the template a tensor holding exactly a record's value
        becomes that record's `Ref` (others, parameters included, stay as they are); `inputs` are the
        records the tensor arguments' values come from (views and in-place writes followed), in
        argument order; `params` the model parameters and buffers read, directly, through a view, or
        through a record made from parameters alone (``W = self.w.t()``).  `folded`, when given,
        receives the parameters read through folded results (part of `params` too).  A buffer folded
        writes filled is recorded first (`_flush`), unless `flush` is off (the call reads no values)."""
        inputs: list[int] = []
        params: list[str] = []

        def add_param(n: str) -> None:
            if n not in params:
                params.append(n)

        def read(o):
            if not isinstance(o, torch.Tensor):
                return o
            if flush and self.pending:
                self._flush(o)
            if self.copies:
                self._written_copy(o)
            name, exact, found, via = self._origin(o)
            if name is None and exact is None and not found and not via and flush:
                got = self._record_import(o)  # (made from a numpy array where capture could not see it)
                if got is not None:
                    exact, found = got, [got.index]
            if name is not None:
                add_param(name)
                return o
            for n in via:
                add_param(n)
                if folded is not None and n not in folded:
                    folded.append(n)
            for i in found:
                if i not in inputs:
                    inputs.append(i)
                for n in self.derived.get(i, ()):
                    add_param(n)
            return exact if exact is not None else o

        tmpl = _map_tensors(read, obj)
        # a tensor made from a numpy array: from what went out to numpy (the walk over the arguments only once
        # something went out: `_imported` has nothing to give before)
        if flush and self._went_out() and _has_array(obj):
            got = self._imported()
            if got is not None:
                inputs.extend(i for i in got[0] if i not in inputs)
                for n in got[1]:
                    add_param(n)
        return tmpl, tuple(Ref(i) for i in inputs), tuple(params)

    # -- copies and numpy
    def copy_of(self, fname: str, args: Any, kwargs: Any, out: Any) -> bool:
        """A call that copies a model input or a whole parameter, keeping its values (`COPY_FUNCS`, same
        dtype and shape): no record, only a note that `out` is that input or parameter (`copies`).  True
        when it was taken so."""
        if fname not in COPY_FUNCS or not args or not isinstance(out, torch.Tensor):
            return False
        src = args[0]
        if not isinstance(src, torch.Tensor) or out.dtype != src.dtype or out.shape != src.shape:
            return False
        what: int | str | None = self._whole_param(src)
        if what is None:
            exact = self.ref_of(src)
            if exact is None:
                return False
            # an input's copy, or a record's on its own memory (``.detach()``, ``.cpu()`` where it is already)
            if self.trace.records[exact.index].kind != "input" and not _same_memory(out, src):
                return False
            what = exact.index
        if out is not src:
            try:
                self.copies[id(out)] = (weakref.ref(out), what, _version(out))
            except TypeError:
                return False
        return True

    def before_copy_written(self, args: Any, kwargs: Any) -> None:
        """A call is about to write into its first argument (or `out=`): where that is an input's copy
        (`copies`), it becomes a tracked tensor of that input's record, so the write is recorded as one into
        that memory (an input's ``.detach()`` shares it)."""
        target = kwargs.get("out") if kwargs and "out" in kwargs else (args[0] if args else None)
        if isinstance(target, torch.Tensor):
            self._written_copy(target, force=True)

    def _written_copy(self, t: torch.Tensor, force: bool = False) -> None:
        """An input's copy (`copies`) written in place since it was made (or about to be, `force`): tracked
        from now on as a tensor of that input's record, so the write is recorded as one into its memory."""
        alt = self.copies.get(id(t))
        if alt is not None and isinstance(alt[1], int) and alt[0]() is t and (force or alt[2] != _version(t)):
            del self.copies[id(t)]
            self.tracked[id(t)] = alt  # type: ignore[assignment]

    def _whole_param(self, t: torch.Tensor) -> str | None:
        """The parameter or buffer `t` is whole (itself, ``.data``, a copy of one, or a view of all of it as it
        is laid out), else None."""
        name = self.param_of(t)
        if name is None:
            return None
        p = self.param_whole.get(name)
        if p is None:
            return None
        if id(t) == id(p) or (self.copies.get(id(t), (None, None))[1] == name):
            return name
        try:
            same = t.data_ptr() == p.data_ptr() and t.shape == p.shape and t.stride() == p.stride()
        except RuntimeError:
            same = False
        return name if same else None

    def note_export(self, fname: str, args: Any, out: Any) -> None:
        """A call handed a tensor's values out of torch (`EXPORT_FUNCS`): what it comes from is exported."""
        if fname not in EXPORT_FUNCS or not args or not isinstance(args[0], torch.Tensor) \
                or isinstance(out, torch.Tensor):
            return
        _, refs, params = self.template(((args[0],), {}))
        ins, prm = self.exported
        for r in refs:
            ins[r.index] = None
        for n in params:
            prm[n] = None

    def _went_out(self) -> bool:
        """Whether values went out to numpy in this forward (else no tensor can have come back from there)."""
        return self.last_import is not None or bool(self.exported[0] or self.exported[1])

    def _imported(self) -> tuple[tuple[int, ...], tuple[str, ...]] | None:
        """What a tensor made from a numpy array comes from: what was exported since the last import, else
        what the last import came from (a second result of the same numpy code), else None; records and
        parameters each on their own."""
        ins, prm = self.exported
        if ins or prm:
            last = self.last_import or ((), ())
            # records and parameters each: what went out since, else what went out before (weights handed to
            # numpy once, then a loop importing one step at a time)
            self.last_import = (tuple(ins) or last[0], tuple(prm) or last[1])
            self.exported = ({}, {})
        return self.last_import

    def _record_import(self, t: torch.Tensor) -> Ref | None:
        """A call reads a tensor capture knows nothing of while values went out to numpy in this forward
        (made from a numpy array by ``torch.from_numpy``, which capture does not see): record it, as made
        from what went out (`_imported`)."""
        if not self._went_out():
            return None
        if getattr(t, "_base", None) is not None or self._allocated(t):
            return None
        got = self._imported()
        if got is None:
            return None
        f = naming.user_frame(sys._getframe(1))
        site = naming.site_of(f) if f is not None else naming.UNKNOWN_SITE
        rec = self.add(name=self.op_name(self.scope, site.function, "from numpy"), kind="ext", label="from numpy",
                       function=site.function, file=site.file, line=site.line, op="numpy", tensor=t,
                       inputs=tuple(Ref(i) for i in got[0]), params=got[1])
        return Ref(rec.index) if rec is not None else None

    def _folded_sources(self, t: torch.Tensor, params: list[str]) -> list[int]:
        """`sources`, with a folded tensor's lineage taking the place of a record (a view made where
        capture was quiet by its base's; a folded in-place write into its memory added), its
        parameters added to `params`."""
        found, got = self._folded_lineage(t)
        if got is None:
            return found
        for n in sorted(got[1]):
            if n not in params:
                params.append(n)
        return sorted(set(found) | got[0])

    def _folded_lineage(self, t: torch.Tensor) -> tuple[list[int], tuple[frozenset, frozenset] | None]:
        """`_folded_sources` in parts: the records `t` comes from directly (`sources`; with a folded
        lineage of its own, only the recorded writes into its memory since), and the folded lineage,
        (records, parameters), that adds to them (its own, and that of folded writes into its memory),
        or None."""
        got = None
        if self.lineage:
            for x in (t, t._base):
                hit = self.lineage.get(id(x)) if x is not None else None
                if hit is not None and hit[0]() is x:
                    got = hit[1:]
                    break
        found = self.sources(t) if got is None else self._later_writes(t, -1)
        if self.lineage_storage:
            hit = self.lineage_storage.get(_storage_key(t))
            if hit is not None and hit[0]() is not None:  # the written tensor still holds that memory
                got = hit[1:] if got is None else (got[0] | hit[1], got[1] | hit[2])
        return found, got

    def params_of_module(self, module: torch.nn.Module) -> tuple[str, ...]:
        """What a call of `module` reads: every parameter and buffer of the model inside it (its
        submodules' included), by the model's own qualified names (cached per module)."""
        hit = self.module_params.get(id(module))
        if hit is None:
            tensors = list(module.parameters()) + list(module.buffers())
            hit = tuple(dict.fromkeys(self.param_ids[id(t)] for t in tensors if id(t) in self.param_ids))
            self.module_params[id(module)] = hit
        return hit
