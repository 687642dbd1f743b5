"""Capture's folding (`capture(fold=sizes)`, see `diffkit.capture`): a call site that keeps producing results of
sizes no record of the other side has makes records for its first `FOLD_AFTER` calls only; its later results
are folded: no record and no value, only their lineage (the records and parameters they were computed from),
carried on to what reads them.  Writes into existing memory are judged against the other side's writes; a
buffer filled by folded writes is `pending`, recorded once, as it is then, when a recorded call next reads it.

`_Folding` is one of the parts `capture._State` is made of (see `capture_values`)."""
from __future__ import annotations

import collections
import sys
import weakref
from typing import Any

import torch
import torch.utils._pytree as pytree

from . import naming
from .options import FOLD_AFTER
from .records import Ref
from .tensorargs import _ATOMS, _span, _storage_key, _tensors


_EMPTY: frozenset = frozenset()


def _union(sets: list[frozenset]) -> frozenset:
    """The union of `sets`, reusing the largest where the others add nothing to it."""
    n = len(sets)
    if n == 0:
        return _EMPTY
    if n == 1:
        return sets[0]
    if n == 2:
        a, b = sets
        if a is b or b <= a:  # (consecutive folded ops share one lineage object)
            return a
        return b if a <= b else a | b
    big = max(sets, key=len)
    for x in sets:
        if x is not big and not x <= big:
            return big.union(*sets)
    return big


class _Folding:
    """Folding results that cannot pair, and recording the buffers folded writes filled (a part of
    `capture._State`).

    Uses of the other parts: `param_of`, `param_ids`, `param_sets`, `derived`, `ref_of`, `_folded_lineage`,
    `storage_owner`, `storage_writes` (`_Dataflow`); `add`, `op_name`, `scope`, `trace` (`_State`)."""

    def _init_folding(self, fold: frozenset | None, fold_writes: frozenset | None) -> None:
        # folding (module docstring): the sizes a record may pair with, the unpairable results made per
        # call site so far, and the lineage of folded tensors, (inputs, params) by tensor id (with a
        # weak reference to tell a reused id) and by storage (views made where capture was quiet)
        self.fold = fold
        # the sizes a write may pair with: the other side's records written in place (a partly filled
        # buffer pairs only with another; the filled one is recorded when next read, `pending`)
        self.fold_writes = fold if fold_writes is None else fold_writes
        # buffers of a pairable size filled by folded writes, recorded once, as they are then, when a
        # recorded call reads or writes that memory (`_flush`), so the filled buffer can still pair:
        # storage -> [(weakref of the buffer, site, scope, op, `site_key`, (first, last) element it spans)]
        self.pending: dict[int, list[tuple]] = {}
        self.flushed: dict[tuple, int] = {}  # flushes per call site: past FOLD_AFTER its buffers stay folded
        # stores into part of a buffer (`out[t] = h`) whose size no write of the other side has, per call
        # site: none is recorded (a part-filled buffer holds nothing the other side has); they fill a
        # pending buffer from the first (`partial_store`)
        self.part_stores: dict[tuple, int] = {}
        # the buffers pended last, held so that one nothing reads before the forward returns (a last
        # layer's output the model does not return) is still alive to be recorded then (`flush_remaining`)
        self.pending_hold: collections.deque = collections.deque(maxlen=FOLD_AFTER)
        self.filled: set[int] = set()  # the records of pending buffers (results, for `_pend`, not writes)
        # the view a call site made last, (storage, offset, shape, strides): the same view made again (a
        # loop taking `bufs[layer]` each step to write into) is folded, as are the times it was (`views_again`)
        self.last_view: dict[tuple, tuple] = {}  # site -> (weakref of the view's base, storage, offset, shape, strides)
        self.views_again: dict[tuple, int] = {}
        self.unpairable: dict[tuple, int] = {}
        self.lineage: dict[int, tuple[Any, frozenset, frozenset]] = {}
        self.lineage_storage: dict[int, tuple[Any, frozenset, frozenset]] = {}  # (weakref of the written tensor, …)
        self.folded_writes: dict[int, int] = {}  # storage -> records made before the last folded write into it

    def non_param_tensors(self, args: tuple) -> list[tuple[tuple, torch.Tensor]]:
        """A kernel's tensor arguments other than parameters, by position: what it may have written."""
        return [((i,), a) for i, a in enumerate(args) if isinstance(a, torch.Tensor) and self.param_of(a) is None]

    def may_fold(self, args: tuple) -> bool:
        """Whether an extension call given `args` (one that writes into them) is one folding may take
        (no tensor argument other than a parameter has a size a write on the other side has, and its
        call site is past FOLD_AFTER): then the copies that find what it wrote are not made."""
        if self.fold is None:
            return False
        f = naming.user_frame(sys._getframe(2))
        if f is None or self.unpairable.get(self.site_key(f), 0) < FOLD_AFTER:
            return False
        return all(a.numel() not in self.fold_writes for _, a in self.non_param_tensors(args))

    def foldable(self, tensors: list[tuple[tuple, torch.Tensor]], frame: Any, write: bool = False) -> bool:
        """Whether this call's results are folded: none of them has a size the other side's records
        have (`write`, the call wrote into them in place: the other side's writes), and its call site
        has made FOLD_AFTER such results already."""
        if self.fold is None or not tensors or frame is None:
            return False
        sizes = self.fold_writes if write else self.fold
        for _, t in tensors:
            if t.numel() in sizes:
                return False
        key = self.site_key(frame)
        n = self.unpairable.get(key, 0) + 1
        self.unpairable[key] = n
        return n > FOLD_AFTER

    def same_view_again(self, tensors: list[tuple[tuple, torch.Tensor]], frame: Any) -> bool:
        """Whether this call's one result is a view of memory its call site viewed in exactly this way the
        last time (a record of it would only show that memory again, part written); counted per site.
        Asked only of a result of a size that may pair (the others fold by `foldable`)."""
        if frame is None or len(tensors) != 1:
            return False
        t = tensors[0][1]
        if t._base is None or t.numel() not in self.fold:
            return False
        key = self.site_key(frame)
        # the same buffer, alive: a fresh result at the address of the last one, freed since (a call whose
        # result is a view of new memory, `F.linear` with a bias on a 3-D input, in a loop whose values
        # are not kept, as a streaming diff's) is new memory, whatever its address
        sig = (_storage_key(t), t.storage_offset(), tuple(t.shape), t.stride())
        last = self.last_view.get(key)
        if last is not None and last[1:] == sig and last[0]() is t._base:
            self.views_again[key] = self.views_again.get(key, 0) + 1
            return True
        try:
            self.last_view[key] = (weakref.ref(t._base), *sig)
        except TypeError:
            self.last_view.pop(key, None)
        return False

    @staticmethod
    def site_key(frame: Any) -> tuple[str, int, str, int]:
        """A call site as a dictionary key: (file, first line and name of its function, line).  Not the
        code object: its hash is computed from its whole body each time it is asked for (these keys are
        made for every op), and code compiled again (a step function exec'd each iteration, a helper file
        run once per layer) is still the same site."""
        code = frame.f_code
        return code.co_filename, code.co_firstlineno, code.co_name, frame.f_lineno

    def folded_sites(self) -> dict[str, int]:
        """Results folded, by call site "file:line" (`Trace.folded`)."""
        out: dict[str, int] = {}
        for (file, _, _, line), n in self.unpairable.items():
            if n > FOLD_AFTER:
                site = f"{file}:{line}"
                out[site] = out.get(site, 0) + n - FOLD_AFTER
        for counts in (self.views_again, self.part_stores):
            for (file, _, _, line), n in counts.items():
                site = f"{file}:{line}"
                out[site] = out.get(site, 0) + n
        return out

    def lineage_of(self, obj: Any, extra: tuple[str, ...] = ()) -> tuple[frozenset, frozenset]:
        """The records and parameters the tensors in `obj` come from (a folded tensor by its lineage).
        Runs once per folded call: a folded argument is one dictionary lookup, and lineages are
        shared, not copied, where the arguments add nothing to one of them."""
        ins: list[frozenset] = []
        prm: list[frozenset] = [frozenset(extra)] if extra else []
        add = self._lineage_of_tensor
        lineage = self.lineage
        if type(obj) is tuple and len(obj) == 2 and type(obj[0]) is tuple and type(obj[1]) is dict:
            todo = [*obj[0], *obj[1].values()]  # a call's (args, kwargs), unwrapped here (the usual case)
        else:
            todo = [obj]
        while todo:
            o = todo.pop()
            t = type(o)
            if not (t is torch.Tensor or t is torch.nn.Parameter):
                if t is tuple or t is list:
                    todo.extend(o)
                    continue
                if t is dict:
                    todo.extend(o.values())
                    continue
                if t in _ATOMS:
                    continue
                if not isinstance(o, torch.Tensor):
                    todo.extend(x for x in pytree.tree_leaves(o) if isinstance(x, torch.Tensor))
                    continue
            hit = lineage.get(id(o))
            if hit is not None and hit[0]() is o:  # a folded tensor (the common case, inline)
                if hit[1]:
                    ins.append(hit[1])
                if hit[2]:
                    prm.append(hit[2])
            else:
                add(o, ins, prm)
        return _union(ins), _union(prm)

    def _lineage_of_tensor(self, o: torch.Tensor, ins: list[frozenset], prm: list[frozenset]) -> None:
        """`lineage_of` for one tensor that is not a folded one (`lineage_of` takes those itself): the
        parameter it is, the record holding it, or what it comes from (`_origin`'s answer, as sets)."""
        name = self.param_of(o)
        if name is not None:
            one = self.param_sets.get(name)
            if one is None:
                one = self.param_sets[name] = frozenset((name,))
            prm.append(one)
            return
        exact = self.ref_of(o)
        if exact is not None:
            records = frozenset((exact.index,))
        else:
            found, got = self._folded_lineage(o)
            if got is None:
                records = frozenset(found)
            else:
                records = got[0].union(found) if found else got[0]
                prm.append(got[1])
        ins.append(records)
        derived = self.derived
        if derived:
            prm.extend(frozenset(derived[i]) for i in records if i in derived)

    def fold_into(self, tensors: list[tuple[tuple, torch.Tensor]], lineage: tuple[frozenset, frozenset],
                  in_place: bool = False, frame: Any = None, op: str = "", known: bool = True) -> None:
        """Give folded results their lineage.  `in_place`: the call wrote into them (their memory may
        be read through other views later: the lineage is noted by storage too, and adds to theirs;
        the buffer written, when the other side has a record of its size, is `pending` from `frame`,
        the call site, made by `op`).  `known=False`: a kernel's arguments, any of which it may have
        written; one whose memory only ever held a record's result, never a write, is taken as read."""
        for _, t in tensors:
            if id(t) in self.param_ids:
                continue  # a parameter written in place stays a parameter
            if not in_place and self.ref_of(t) is not None:
                continue  # a record holds exactly this tensor (a module handing back what an op inside made)
            if in_place:
                hit = self.lineage.get(id(t))
                if hit is not None and hit[0]() is t:
                    lineage = (hit[1] | lineage[0], hit[2] | lineage[1])
                key = _storage_key(t)
                if key is not None:
                    old = self.lineage_storage.get(key)
                    if old is not None and old[0]() is not None:
                        lineage = (old[1] | lineage[0], old[2] | lineage[1])
                    whole = t if t._base is None else t._base  # a view's write fills its base (which outlives it)
                    try:
                        self.lineage_storage[key] = (weakref.ref(whole), *lineage)
                    except TypeError:
                        pass
                    self.folded_writes[key] = len(self.trace.records)
                    if frame is not None:
                        self._pend(key, t, frame, op, known)
            try:
                self.lineage[id(t)] = (weakref.ref(t), *lineage)
            except TypeError:
                pass

    def _pend(self, key: int, t: torch.Tensor, frame: Any, op: str, known: bool) -> None:
        """Note the buffer a folded write filled (`pending`): the written tensor's base where that has a
        size the other side's records have, else the tensor itself where it has (a layer's slot of a
        buffer for all layers); neither, nothing."""
        base = t._base
        whole = base if base is not None and base.numel() in self.fold else t if t.numel() in self.fold else None
        if whole is None:
            return
        if not known and key in self.storage_owner and all(w in self.filled for w in self.storage_writes.get(key, ())):
            return  # a kernel's input: this memory held records' results (a filled buffer's too), no other write
        at = self.site_key(frame)
        if self.flushed.get(at, 0) >= FOLD_AFTER:  # (a loop reading back what it wrote)
            return
        old = self.pending.get(key, ())
        if not known and any(e[0]() is whole for e in old):
            return  # filled by known writes already: a kernel given part of it may only read it
        entries = [e for e in old if e[0]() is not None and e[0]() is not whole]
        try:
            entries.append((weakref.ref(whole), naming.site_of(frame), self.scope, op, at, _span(whole)))
        except TypeError:
            return
        self.pending[key] = entries[-FOLD_AFTER:]
        if not self.pending_hold or self.pending_hold[-1] is not whole:
            self.pending_hold.append(whole)

    def partial_store(self, fname: str, args: tuple, kwargs: dict) -> torch.Tensor | None:
        """The tensor a call writes into, where the call writes only part of a buffer that no write of
        the other side matches in size: `y[i] = v` with fewer values than `y` (broadcast or indexed), or
        an in-place op, ``copy_`` or ``out=`` into a view smaller than its base.  None otherwise (the
        call is then judged like any other, `foldable`)."""
        if self.fold is None:
            return None
        if fname == "__setitem__":
            if len(args) < 3 or not isinstance(args[0], torch.Tensor):
                return None
            t, v = args[0], args[2]
            n = v.numel() if isinstance(v, torch.Tensor) else 1
            if n >= t.numel() or t.numel() in self.fold_writes:
                return None
            return t
        t = kwargs.get("out") if kwargs else None
        if not isinstance(t, torch.Tensor):
            t = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if t is None or t._base is None or t.numel() >= t._base.numel():
            return None
        if t.numel() in self.fold_writes or t._base.numel() in self.fold_writes:
            return None
        if fname not in ("copy_", "fill_", "zero_") and t.numel() in self.fold:
            return None  # an in-place op computing a result the other side may have (`q.mul_(s)` for `q * s`)
        return t

    def store_part(self, fname: str, args: tuple, kwargs: dict, frame: Any, op: str) -> bool:
        """Fold a store into part of a buffer (`partial_store`) at once: its lineage goes to the buffer,
        which is `pending` (recorded when next read, or when the capture ends).  Returns whether it was."""
        t = self.partial_store(fname, args, kwargs)
        if t is None:
            return False
        key = self.site_key(frame)
        self.part_stores[key] = self.part_stores.get(key, 0) + 1
        if self.pending:  # a filled buffer the store reads (not the memory it writes) is read now
            dst = _storage_key(t)
            for _, a in _tensors((args[1:], {k: v for k, v in (kwargs or {}).items() if k != "out"})):
                k = _storage_key(a)
                if k != dst and k in self.pending:
                    self._flush(a)
        self.fold_into([((), t)], self.lineage_of((args, kwargs)), in_place=True, frame=frame, op=op)
        return True

    def flush_remaining(self) -> None:
        """The forward has returned: record the pending buffers no recorded call read (a last layer's
        filled output, say).  One the model returns as it is is recorded too: the output record then
        stands for the same record (`add`), which keeps what the buffer was computed from."""
        for key in list(self.pending):
            for entry in self.pending.pop(key):
                if entry[0]() is not None:
                    self._record_pending(entry)
            self._drop_pending(key)
        self.pending_hold.clear()

    def flush_before_write(self, args: Any, kwargs: Any, fname: str = "") -> None:
        """A call about to write into memory holding a pending buffer: record the buffer first, unless
        the call is a store its loop folds (its site is past FOLD_AFTER) or a store into part of it
        (`partial_store`: it goes on filling the buffer)."""
        f = naming.user_frame(sys._getframe(1))
        if f is not None and self.unpairable.get(self.site_key(f), 0) >= FOLD_AFTER:
            return
        if self.partial_store(fname, args, kwargs or {}) is not None:
            return
        for _, t in _tensors((args, kwargs)):
            if _storage_key(t) in self.pending:
                self._flush(t)

    def _flush(self, t: torch.Tensor) -> None:
        """Record the buffers folded writes filled in the memory `t` spans (`pending`), as they are now:
        a recorded call is about to read it (or to write into it)."""
        key = _storage_key(t)
        entries = self.pending.get(key)
        if not entries:
            return
        lo, hi = _span(t)
        keep = []
        for entry in entries:
            if entry[0]() is None:
                continue
            if entry[5][1] < lo or hi < entry[5][0]:
                keep.append(entry)  # another part of this memory (another layer's slot)
            else:
                self._record_pending(entry)
        if keep:
            self.pending[key] = keep
        else:
            self._drop_pending(key)

    def _drop_pending(self, key: int) -> None:
        """Every pending buffer in this memory is recorded: the records now stand for what the folded
        writes put there (its folded lineage and writes are forgotten)."""
        self.pending.pop(key, None)
        self.lineage_storage.pop(key, None)
        self.folded_writes.pop(key, None)

    def _record_pending(self, entry: tuple) -> None:
        """One pending buffer's record (a write, named after the site of the stores that filled it)."""
        target = entry[0]()
        if target is None:
            return
        ins, prm = self.lineage_of(target)
        site, scope, op = entry[1], entry[2], entry[3]
        self.flushed[entry[4]] = self.flushed.get(entry[4], 0) + 1
        label = naming.store_label(site)
        rec = self.add(name=self.op_name(scope, site.function, label), rebound=label in site.rebound, kind="write",
                       label=label, scope=scope, function=site.function, file=site.file, line=site.line, op=op,
                       tensor=target, inputs=tuple(Ref(i) for i in sorted(ins)), params=tuple(sorted(prm)))
        if rec is not None:
            self.filled.add(rec.index)
        self._unhold(target)

    def _unhold(self, t: torch.Tensor) -> None:
        """Stop holding a buffer (`pending_hold`): it was recorded (the record keeps its own copy) or a
        record holds it."""
        if any(x is t for x in self.pending_hold):
            kept = [x for x in self.pending_hold if x is not t]
            self.pending_hold.clear()
            self.pending_hold.extend(kept)
