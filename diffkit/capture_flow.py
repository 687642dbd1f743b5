"""Capture's dataflow: for each record, the earlier records its call's tensor arguments came from
(`Record.inputs`) and the model parameters and buffers it read (`Record.params`); see `diffkit.capture`.

Dictionary lookups per argument, by tensor id (with a weak reference to tell a reused id), by `_base` and by
storage address: the record holding exactly a tensor (`ref_of`), the records a view made where capture was quiet
comes from (`sources`), in-place writes into that memory after them, the parameter a tensor is or views
(`param_of`), and through folded results their lineage (`_folded_lineage`, kept by `capture_fold._Folding`).

`_Dataflow` is one of the parts `capture._State` is made of (see `capture_values`)."""
from __future__ import annotations

import weakref
from typing import Any

import torch

from .records import Ref
from .tensorargs import _map_tensors, _storage_key, _version, materialized


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
        if model is not None:
            self.param_tensor = dict(materialized(model.named_parameters()))
            named = list(self.param_tensor.items()) + materialized(model.named_buffers())
            for name, t in named:
                self.param_ids.setdefault(id(t), name)
                key = _storage_key(t)
                if key is not None:
                    start = t.data_ptr()
                    self.param_storage.setdefault(key, []).append((start, start + t.numel() * t.element_size(), name))

    def track(self, t: torch.Tensor, index: int) -> None:
        try:
            self.tracked[id(t)] = (weakref.ref(t), index, _version(t))
        except TypeError:
            pass

    def ref_of(self, t: torch.Tensor) -> Ref | None:
        """The record holding exactly `t`'s current value (the tensor itself, unchanged since)."""
        hit = self.tracked.get(id(t))
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
        hit = self.tracked.get(id(t))
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
            name, exact, found, via = self._origin(o)
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
        return tmpl, tuple(Ref(i) for i in inputs), tuple(params)

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
