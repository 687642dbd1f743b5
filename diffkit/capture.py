"""Capture: the ordered record of every intermediate tensor one forward produced.

Three mechanisms are combined (see shared/design/capture.md for what each can see):

* global module forward pre/post hooks give the module scope stack and every module's output;
* a ``TorchFunctionMode`` sees torch functions, tensor methods and operators written in user
  code (it stays quiet inside ``torch.nn`` modules, whose output the module record covers);
* functions of C++/CUDA extensions (``load_inline`` / ``load``) are wrapped for the duration of
  the capture, whether they were built before or during it.

``tap(name, tensor)`` names a tensor explicitly.  Every record holds the value the tensor had when
it was produced, so later in-place writes do not change what was captured.  A torch op's output is
not copied when it is made: the record holds the tensor itself and copies it only when something is
about to write into its memory (an in-place op or ``out=`` seen by the function mode, an extension
or Triton kernel given a tensor on that memory) or, when the capture ends, if anything besides the
capture still holds that memory (a buffer the model keeps, the returned output, a list the user
kept).  An intermediate the forward dropped is therefore never copied.  Kernel outputs (extension
and Triton) are copied at once: raw writes into memory a kernel keeps are invisible to PyTorch.

Every record also keeps its dataflow: `Record.inputs`, the earlier records its call's tensor
arguments came from (a tensor itself; a view made where capture was quiet maps to its base's or its
storage's record; an in-place write makes a new record whose input is the old one, and later readers
of that storage, views included, read the write too), and `Record.params`, the model parameters and
buffers the call read (an argument that is one, or a view of one, or a record made from parameters
alone).  A ``torch.nn`` module's record reads all its parameters and buffers, its submodules'
included (capture does not look inside it); a user module's output is normally a record made inside
it, which keeps what its own call read; only where nothing inside was recorded does the module's
record stand for all it holds.  These are dictionary lookups per argument (by id, `_base` and storage
address): no walk over the tensors alive.

Folding (`capture(fold=sizes)`): a diff captures the candidate after the reference and passes the
element counts of the reference's records.  A call site (file and line) that keeps producing tensors
of sizes none of those records has -- a per-step loop whose intermediates cannot pair with anything
-- makes records for its first `FOLD_AFTER` calls only; its later results are folded: no record, no
value, only their lineage (the records and parameters they were computed from) is carried on, so a
later record reading them still has the dataflow it had.  `Trace.folded` counts them by call site.
A write into existing memory (``out[t] = h``, an in-place op, a kernel writing its argument) is
judged against the sizes of the other side's writes (`fold_writes`): a buffer the size of the
output, filled one step at a time, holds nothing the reference has until it is full, so its stores
fold too; the buffer is recorded once, as it is then, when a recorded call next reads it (`pending`)
-- the filled buffer still pairs (a layer's output with the reference's layer).  A view a call site
made the last time too (the same memory, offset, shape and strides: ``bufs[layer]`` taken each step
to store into) is folded at once, whatever its size.

The parts: `records` (what a capture makes), `tensorargs` (what is read off a call), `capture_values` (values
held and copied), `capture_flow` (dataflow), `capture_fold` (folding), `capture_kernels` (extension and Triton
calls); this module installs the hooks and the torch function mode, names and adds the records.
"""
from __future__ import annotations

import sys
import traceback as _tb
import types
import warnings
import weakref
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

from . import naming
from .capture_flow import _Dataflow
from .capture_fold import _Folding
from .capture_kernels import _ExtensionPatch, _TritonPatch, _install_extension_import_hook, register_extension
from .capture_values import _Values, own_copy
from .inputs import changed_inputs, input_name
from .records import CaptureError, Record, Ref, StopCapture, Trace
from .tensorargs import _func_name, _may_write, _storage_key, _tensors, _version

# defined in the parts, imported from here by other modules (kept importable from diffkit.capture)
from .inputs import input_names, input_values  # noqa: F401
from .options import FOLD_AFTER  # noqa: F401
from .tensorargs import buffers_of, parameters_of, path_key, written_in_place  # noqa: F401

__all__ = ["Record", "Trace", "CaptureError", "Ref", "StopCapture", "capture", "tap", "register_extension"]


# --------------------------------------------------------------------------- state
_ACTIVE: list["_State"] = []


_CONTAINERS = (torch.nn.Sequential, torch.nn.ModuleList, torch.nn.ModuleDict)
_SKIP_FUNCS = {"__get__", "__set__", "__repr__", "__format__", "__bool__", "__len__", "__iter__",
               "__contains__", "__hash__", "__reduce_ex__", "__deepcopy__"}


# allocations hold no computed value (a kernel fills them later): no record, so the kernel's
# write, named after the same variable, is the record that pairs with the reference
_ALLOC_FUNCS = {"empty", "empty_like", "new_empty", "empty_strided"}


def rng_state() -> dict[str, torch.Tensor]:
    """The random generators' states by name: the CPU's, and each CUDA device's once CUDA is in use."""
    out = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, st in enumerate(torch.cuda.get_rng_state_all()):
            out[f"cuda:{i}"] = st
    return out


def set_rng_state(states: dict[str, torch.Tensor]) -> None:
    """Put the generators back as `rng_state` found them (the devices named that this process has)."""
    cpu = states.get("cpu")
    if isinstance(cpu, torch.Tensor):
        torch.set_rng_state(cpu.to("cpu", torch.uint8))
    for name, st in states.items():
        if name.startswith("cuda:") and torch.cuda.is_available():
            i = int(name.split(":")[1])
            if i < torch.cuda.device_count():
                torch.cuda.set_rng_state(st.to("cpu", torch.uint8), i)


class _State(_Values, _Dataflow, _Folding):
    """One capture's state: the records made so far (`trace`), the module scope stack, and the parts it is
    made of, which share this object's attributes: values held and copied (`_Values`), dataflow (`_Dataflow`),
    folding (`_Folding`).  This class names and adds the records (`add`) and handles what the hooks, the torch
    function mode and the kernel wrappers report (`on_op`, `on_ext`, `on_writes`)."""

    def __init__(self, model: torch.nn.Module | None, snapshot: bool, only: Callable[[str], bool] | None,
                 sink: Any = None, fold: frozenset | None = None, fold_writes: frozenset | None = None):
        self.model = model
        self._init_folding(fold, fold_writes)
        self.sink = sink  # a store.CaptureWriter streaming records to disk, or None
        self.snapshot = snapshot
        self.only = only
        self.trace = Trace()
        self.paths: dict[int, str] = {}
        if model is not None:
            for path, m in model.named_modules(remove_duplicate=True):
                self.paths.setdefault(id(m), path)
        self.stack: list[tuple[str, bool, Any]] = []  # (path, opaque, call-site)
        self.opaque = 0
        self.busy = False
        self.calls: dict[str, int] = {}
        self.used: dict[str, int] = {}
        self._init_values(model)
        self._init_dataflow(model)
        self.allocated: dict[int, Any] = {}  # storage pointer -> weakref of the empty()/new_empty() result there
        # a what-if run (diffkit.whatif): the mistake planted at one record; `current_call` is the live
        # call whose result is being recorded, (kind, function or module, args, kwargs)
        self.mutator: Any = None
        self.current_call: tuple | None = None
        self.returns_none: dict[str, bool] = {}
        self.error_scope: str | None = None
        self.failing_call: str | None = None
        self.warned = False

    # -- naming helpers
    @property
    def scope(self) -> str:
        return self.stack[-1][0] if self.stack else ""

    def unique(self, name: str) -> str:
        n = self.used.get(name, 0) + 1
        self.used[name] = n
        return name if n == 1 else f"{name}#{n}"

    def add(self, *, name: str, kind: str, label: str, function: str, file: str, line: int, op: str,
            tensor: torch.Tensor, scope: str | None = None, is_output: bool = False,
            call: Any = None, inputs: tuple[Ref, ...] = (), rebound: bool = False,
            aliases: list[str] | None = None, params: tuple[str, ...] = (),
            value: torch.Tensor | None = None) -> Record | None:
        """A new record of `tensor` (or another name for the record already holding it, unchanged).  `value`: a
        copy of `tensor` to hand a sink that keeps the values instead of `tensor` itself (an input's, `own_copy`)."""
        if self.only is not None and not self.only(name):
            return None
        # the same tensor, unchanged since it was recorded: give the record another name instead
        hit = self.tracked.get(id(tensor))
        unchanged = hit is not None and hit[0]() is tensor and hit[2] == _version(tensor) and not (
            self.folded_writes and self.folded_writes.get(_storage_key(tensor), -1) > hit[1])
        if self.mutator is not None and self.current_call is not None and kind in ("op", "module") and not (
                unchanged and kind == "module"):
            # a what-if run: this record's value is replaced (in place, so the rest of the forward reads it);
            # never where that memory is a parameter's, a buffer's or one of the call's own arguments
            key = _storage_key(tensor)
            shared = key is None or key in self.param_storage or any(
                _storage_key(t) == key for _, t in _tensors((self.current_call[2], self.current_call[3])))
            self.mutator.plant(len(self.trace.records), self.current_call, tensor, shared)
        if unchanged and kind in ("module", "tap"):
            rec = self.trace.records[hit[1]]
            if rec.shape == tuple(tensor.shape):
                new = self.unique(name)
                # a tap's name wins, and so does a submodule's when the model returns its output as it is
                # (`fc2`, the name the user wrote, with `output` an alias); else the module path names it
                keeps = rec.kind == "tap" or (is_output and name == "output" and rec.kind == "module")
                if not keeps:
                    rec.aliases.append(rec.name)
                    rec.name = new
                    rec.kind = kind
                else:
                    rec.aliases.append(new)
                rec.aliases += [a for a in aliases or () if a not in rec.aliases and a != rec.name]
                rec.is_output = rec.is_output or is_output
                rec.rebound = rec.rebound or rebound
                if self.sink is not None:
                    if getattr(self.sink, "owns_values", False):
                        self.sink.update(rec, tensor)
                    else:
                        self.sink.update(rec)
                return rec
        owns = getattr(self.sink, "owns_values", False)  # the sink keeps the value (streaming)
        rec = Record(
            index=len(self.trace.records), name=self.unique(name), kind=kind,
            scope=self.scope if scope is None else scope, label=label, function=function, file=file,
            line=line, op=op, shape=tuple(tensor.shape), dtype=tensor.dtype, device=str(tensor.device),
            value=None, is_output=is_output,
            call=call, inputs=inputs, rebound=rebound, params=tuple(params),
        )
        rec.aliases += [a for a in aliases or () if a != rec.name]
        if self.snapshot and not owns:
            self.keep(rec, tensor, kind)
        self.trace.records.append(rec)
        if self.lineage:
            self.lineage.pop(id(tensor), None)  # recorded now: its record is where its value comes from
        if self.lineage_storage and kind != "write" and getattr(tensor, "_base", None) is None:
            self.lineage_storage.pop(_storage_key(tensor), None)  # new memory under an old address
        # written in place: the tensor was recorded before and has changed since (a kernel's raw write
        # does not bump the version, so a write record or an extension handing back its argument counts)
        in_place = kind == "write" or (hit is not None and hit[0]() is tensor
                                       and (hit[2] != _version(tensor) or kind == "ext"))
        self.track(tensor, rec.index)
        key = _storage_key(tensor)
        if key is not None:
            entries = self.pending.get(key) if self.pending else None
            if entries:
                if kind != "write" and getattr(tensor, "_base", None) is None:
                    del self.pending[key]  # new memory under an old address (or this record holds the buffer)
                    self._unhold(tensor)
                else:  # a buffer recorded as it is now needs no record later
                    left = [e for e in entries if e[0]() is not None and e[0]() is not tensor]
                    if left:
                        self.pending[key] = left
                    else:
                        del self.pending[key]
            self.storage_owner[key] = (weakref.ref(tensor), rec.index)
            if in_place:
                self.storage_writes.setdefault(key, []).append(rec.index)
        if params and all(r.index in self.derived for r in inputs):
            self.derived[rec.index] = tuple(params)  # made from parameters alone (W.t(), W * scale)
        if self.sink is not None:
            if owns:
                self.sink.add(rec, tensor if value is None else value)
            else:
                self.sink.add(rec)
        return rec

    def site(self):
        f = naming.user_frame(sys._getframe(2))
        if f is None:
            return naming.UNKNOWN_SITE
        return naming.site_of(f)

    def op_name(self, scope: str, function: str, label: str) -> str:
        prefix = f"{scope}.{function}" if scope else function
        return f"{prefix}:{label}"

    # -- torch function mode
    def on_op(self, func, args, kwargs, out, fname: str | None = None, writes: bool | None = None) -> None:
        """A torch function call returned `out`: record its results, or fold them.  `fname` and `writes`
        (`_may_write`'s answer), when the mode has found them already."""
        if fname is None:
            fname = getattr(func, "__name__", "")
        if fname in _ALLOC_FUNCS:
            if isinstance(out, torch.Tensor):
                key = _storage_key(out)
                if self.storage_owner:
                    # new memory, maybe under a freed record's address: no record's result lives here now
                    self.storage_owner.pop(key, None)
                if key is not None:
                    try:
                        self.allocated[key] = weakref.ref(out)  # (an out-parameter a kernel may fill, `on_writes`)
                    except TypeError:
                        pass
            return
        if fname in _SKIP_FUNCS:
            return
        if self.copy_of(fname, args, kwargs, out):  # a copy of an input or a whole parameter is that (capture_flow)
            return
        if out is None and fname == "__setitem__" and args and isinstance(args[0], torch.Tensor):
            f = naming.user_frame(sys._getframe(2)) if self.fold is not None else None
            if f is not None and self.store_part(fname, args, kwargs, f, "Tensor.__setitem__"):
                return
            if f is not None and self.foldable([((), args[0])], f, write=True):
                self.fold_into([((), args[0])], self.lineage_of((args, kwargs)), in_place=True, frame=f,
                               op="Tensor.__setitem__")
                return
            site = self.site()
            # `y[0] = v` runs as a store to the subscript: name the record by the tensor written, `y`
            label = naming.store_label(site)
            target = args[0]
            _, refs, params = self.template((args, kwargs))  # the tensor written into, and what was stored
            self.add(name=self.op_name(self.scope, site.function, label), rebound=label in site.rebound, kind="write", label=label,
                     function=site.function, file=site.file, line=site.line, op="Tensor.__setitem__",
                     tensor=target, inputs=refs, params=params)
            return
        found = _tensors(out)
        if not found:
            self.note_export(fname, args, out)  # values handed to numpy (capture_flow)
            return
        if self.fold is not None:
            f = naming.user_frame(sys._getframe(2))
            if writes is None:
                writes = _may_write(fname, kwargs, args)
            if writes and f is not None and self.store_part(fname, args, kwargs, f, _func_name(func)):
                return
            if self.foldable(found, f, write=writes) or (not writes and self.same_view_again(found, f)):
                self.fold_into(found, self.lineage_of((args, kwargs)), in_place=writes, frame=f if writes else None,
                               op=_func_name(func) if writes else "")
                return
        site = self.site()
        # a view of the buffer (`out[t]`, to write into) reads none of its values: no flush for it
        tmpl, refs, params = self.template((args, kwargs), flush=not all(t._base is not None for _, t in found))
        call = ("op", func, tmpl)
        op = _func_name(func)
        self.current_call = ("op", func, args, kwargs) if self.mutator is not None else None
        for i, (pos, t) in enumerate(found):
            label = site.label(i, len(found))
            self.add(name=self.op_name(self.scope, site.function, label), rebound=label in site.rebound, kind="op", label=label,
                     function=site.function, file=site.file, line=site.line, op=op, tensor=t,
                     call=(call, pos), inputs=refs, params=params)

    # -- extension functions
    def on_ext(self, qualname: str, fn, args, kwargs, out, before: list[tuple[int, torch.Tensor]] | None) -> None:
        if self.fold is not None:
            found = _tensors(out) if out is not None else self.non_param_tensors(args)
            # a kernel writing in place: it returned nothing, or handed back an argument
            writes = out is None or any(t is a for _, t in found for a in args)
            f = naming.user_frame(sys._getframe(1))
            if self.foldable(found, f, write=writes):
                self.fold_into(found, self.lineage_of((args, kwargs)), in_place=writes, frame=f if writes else None,
                               op=f"ext:{qualname}", known=out is not None)
                return
        site = self.site()
        tmpl, refs, params = self.template((args, kwargs))
        call = ("ext", fn, tmpl)
        short = qualname.rsplit(".", 1)[-1]
        found = _tensors(out)
        if found:
            for i, (pos, t) in enumerate(found):
                label = site.label(i, len(found)) if site.labels else f"{short}" + (f"[{i}]" if len(found) > 1 else "")
                self.add(name=self.op_name(self.scope, site.function, label), rebound=label in site.rebound, kind="ext", label=label,
                         function=site.function, file=site.file, line=site.line, op=f"ext:{qualname}",
                         tensor=t, call=(call, pos), inputs=refs, params=params)
            return
        if out is not None:
            return
        # returned None: the kernel wrote into one or more of its tensor arguments
        self.on_writes(site, f"ext:{qualname}", args, before, call, refs, params)

    def _allocated(self, t: torch.Tensor) -> bool:
        """Whether `t`'s memory came from an empty()-style allocation still alive (an output buffer)."""
        hit = self.allocated.get(_storage_key(t))
        return hit is not None and hit() is not None

    def on_writes(self, site, op: str, args, before: list[tuple[int, torch.Tensor]] | None, call: Any,
                  inputs: tuple[Ref, ...] = (), params: tuple[str, ...] = ()) -> None:
        """A kernel that returns nothing: record the tensor arguments whose contents it changed (by
        `before`, copies taken before the call), else its last tensor argument, each named by the
        argument's source text at the call site."""
        written: list[int] = []
        if before is not None:
            written = [i for i, old in before if not _same(old, args[i])]
        if not written:
            # nothing visibly changed (the kernel stored what the memory held already: memory reused from an
            # identical earlier run, say): an argument whose memory came from empty() is the one it filled,
            # else its last tensor argument
            tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
            fresh = [i for i in tensors if self._allocated(args[i])]
            written = (fresh or tensors)[-1:]
        for i in written:
            label = site.args[i] if i < len(site.args) else f"arg{i}"
            self.add(name=self.op_name(self.scope, site.function, label), rebound=label in site.rebound, kind="write",
                     label=label, function=site.function, file=site.file, line=site.line, op=op, tensor=args[i],
                     call=(call, ("arg", i)), inputs=inputs, params=params)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        return bool(torch.equal(a, b)) if a.shape == b.shape else False
    except RuntimeError:
        return False


class _Mode(TorchFunctionMode):
    def __init__(self, state: _State):
        super().__init__()
        self.state = state

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        st = self.state
        name = writes = None
        if (st.lazy or st.pending or st.param_tensor) and not st.busy:
            name = getattr(func, "__name__", "")
            writes = _may_write(name, kwargs, args)
            if writes:
                if st.param_tensor:
                    st.note_param_write(args, kwargs)
                st.before_write(args, kwargs, name)
            elif name in _UNVERSIONED_WRITERS and st.lazy:
                st.before_write(args[1:], kwargs, name)  # (its running statistics: whatever tensors they are)
        out = func(*args, **kwargs)
        if st.busy or st.opaque:
            return out
        st.busy = True
        try:
            st.on_op(func, args, kwargs, out, name, writes)
        except StopCapture:
            raise
        except Exception as e:  # never break the user's model because naming failed
            if not st.warned:
                st.warned = True
                warnings.warn(f"diffkit: could not record {func!r}: {e}")
        finally:
            st.busy = False
        return out


# functions that update tensor arguments other than their input from C++ without moving their version
# (batch norm's running statistics in training mode): records held in that memory are copied first
_UNVERSIONED_WRITERS = frozenset({"batch_norm"})


def _is_opaque(module: torch.nn.Module) -> bool:
    cls = type(module)
    return cls.__module__.startswith("torch.") and not isinstance(module, _CONTAINERS)


def _pre_hook(module, args):
    if not _ACTIVE:
        return None
    st = _ACTIVE[-1]
    if st.busy:
        return None
    path = st.paths.get(id(module))
    if path is None:
        path = (st.scope + "." if st.scope else "") + type(module).__name__
    opaque = _is_opaque(module)
    if st.lazy:
        # a module may update its own buffers unseen (a batch norm's running statistics, also where it is no
        # submodule of the model, held in a plain list): records held in their memory are copied first
        st.copy_held(tuple(module.buffers(recurse=False)))
    site = None
    if not st.opaque and module is not st.model:  # the model itself is called by the harness, not user code
        f = naming.user_frame(sys._getframe(1))
        # while folding, the frame: its site is read only if the call is recorded (`_post_hook`)
        site = (f if st.fold is not None else naming.site_of(f)) if f is not None else None
    st.stack.append((path, opaque, (site, args)))
    if opaque:
        st.opaque += 1
    if st.mutator is not None:
        st.mutator.before_module(module, args)
    return None


def _post_hook(module, args, *rest):
    # Called as hook(module, args, output), or hook(module, args, None) when forward raised.
    if not _ACTIVE:
        return None
    st = _ACTIVE[-1]
    if st.busy or not st.stack:
        return None
    output = rest[0] if rest else None
    path = st.paths.get(id(module))
    # pop to this module's frame (robust to a frame left behind by an exception)
    while st.stack:
        top_path, opaque, (site, margs) = st.stack.pop()
        if opaque:
            st.opaque -= 1
        if path is None or top_path == path:
            break
    if output is None and sys.exc_info()[0] is not None and st.error_scope is None:
        st.error_scope = top_path
    if output is None and module is st.model and not st.opaque:
        st.trace.output_form = "NoneType"  # (what the forward returned, for the error that follows)
    if st.opaque or output is None:
        return None
    st.busy = True
    mode = _own_mode_off(st)  # (its own calls below skip the mode: put back in `finally`)
    try:
        is_root = module is st.model
        if is_root:
            st.trace.output_form = "tensor" if isinstance(output, torch.Tensor) else type(output).__name__
            st.trace.output_others = other_leaves(output)
            odd = next((t.layout for _, t in _tensors(output) if t.layout != torch.strided), None)
            if odd is not None:  # a sparse (or other non-dense) output: nothing KernelBench's allclose can compare
                st.trace.output_form = f"tensor of layout {odd}"
                return None
        n = st.calls.get(top_path, 0) + 1
        st.calls[top_path] = n
        base = "output" if is_root else (top_path if n == 1 else f"{top_path}#{n}")
        found = _tensors(output)
        if is_root and st.pending:
            st.flush_remaining()
        if isinstance(site, types.FrameType):
            if not is_root and st.foldable(found, site):
                st.fold_into(found, st.lineage_of((margs, {}), st.params_of_module(module)))
                return None
            site = naming.site_of(site)
        parent = st.scope
        # (what it read through folded results stands where the records it would have read stood)
        through_folded: list[str] = []
        tmpl, refs, _ = st.template((margs, {}), through_folded)
        call = ("module", module, tmpl)
        # a torch.nn module is one call to capture: it reads all its parameters and buffers; a user
        # module's output is usually a record made inside it (which keeps what its own call read),
        # and only when nothing inside was recorded does the new record stand for the whole module
        params = st.params_of_module(module) if not is_root else ()
        params += tuple(n for n in through_folded if n not in params)
        st.current_call = ("module", module, margs, {}) if st.mutator is not None else None
        for i, (pos, t) in enumerate(found):
            name = base if len(found) == 1 else f"{base}[{']['.join(map(str, pos))}]"
            label = top_path.rsplit(".", 1)[-1] if top_path else "output"
            if site is not None and site.labels:
                label = site.label(i, len(found))
            aliases = []
            if site is not None and site.labels and not is_root:
                # also known by the variable it was assigned to, like any other tensor made there; set
                # before the record reaches a sink (a capture file writes what it is given)
                aliases.append(st.unique(st.op_name(parent, site.function, label)))
            st.add(name=name, kind="module", rebound=bool(site and label in site.rebound), label=label,
                   function=site.function if site else "", file=site.file if site else "",
                   line=site.line if site else 0,
                   op=f"{type(module).__module__.replace('torch.nn.modules.', 'nn.').split('.')[0]}.{type(module).__name__}"
                   if type(module).__module__.startswith("torch.nn") else type(module).__name__,
                   tensor=t, scope=parent, is_output=is_root, call=(call, pos), inputs=refs, aliases=aliases,
                   params=params)
    finally:
        if mode is not None:
            torch._C._push_on_torch_function_stack(mode)
        st.busy = False
    return None


def _own_mode_off(st: _State) -> "_Mode | None":
    """Take the torch function mode of capture state `st` off this thread's stack where it is on top (put it back
    with `torch._C._push_on_torch_function_stack`): a hook's own tensor calls (shapes, versions, addresses of every
    argument and output) then skip the Python dispatch into a mode that ignores them anyway (`st.busy`)."""
    n = torch._C._len_torch_function_stack()
    if n:
        top = torch._C._get_function_stack_at(n - 1)
        if isinstance(top, _Mode) and top.state is st:
            return torch._C._pop_torch_function_stack()
    return None


OTHER_LEAVES = 32  # the most non-tensor output leaves kept (their text at most 80 characters each)


def other_leaves(output: Any) -> dict[str, str]:
    """The leaves of a returned structure that are not tensors, by path ("[1]", "['count']"), as short text: what
    two outputs must also agree on (``return y, 3`` against ``return y, 4``)."""
    if isinstance(output, torch.Tensor):
        return {}
    try:
        leaves, _ = pytree.tree_flatten_with_path(output)
    except Exception:  # (a structure pytree cannot walk: nothing said about it)
        return {}
    out: dict[str, str] = {}
    for path, leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            continue
        text = repr(leaf) if isinstance(leaf, (bool, int, float, str, type(None))) else f"<{type(leaf).__name__}>"
        out[pytree.keystr(path)] = text[:80]
        if len(out) >= OTHER_LEAVES:
            break
    return out


def tap(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Name `tensor` explicitly for capture; returns it unchanged (free when nothing is captured)."""
    if _ACTIVE:
        st = _ACTIVE[-1]
        if not st.busy and isinstance(tensor, torch.Tensor):
            st.busy = True
            try:
                f = naming.user_frame(sys._getframe(1))
                site = naming.site_of(f) if f is not None else naming.UNKNOWN_SITE
                # (any str: one UTF-8 cannot hold, a lone surrogate, is kept as its escape, printable everywhere)
                name = str(name).encode("utf-8", "backslashreplace").decode("utf-8")
                st.add(name=f"tap:{name}", kind="tap", label=name, function=site.function, file=site.file,
                       line=site.line, op="tap", tensor=tensor)
            finally:
                st.busy = False
    return tensor


# the file an isolated diff's child notes its kernel calls in ("": none); see set_breadcrumb
_BREADCRUMB = ""


def set_breadcrumb(path: str) -> None:
    """Where `_launch` notes the kernel call that is starting ("": nowhere): set from its job by an isolated
    diff's child that is a fresh interpreter (diffkit.roles)."""
    global _BREADCRUMB
    _BREADCRUMB = path


def _leave_breadcrumb(what: str, st: "_State") -> None:
    """In an isolated child, note which kernel call (`ext:…`, `triton:…`) is starting, so a crash
    inside it can be named."""
    text = ""
    if what:
        f = naming.user_frame(sys._getframe(2))
        where = f"{f.f_code.co_filename}:{f.f_lineno}" if f is not None else "?"
        text = f"inside {what} (scope {st.scope or '<model>'}) called at {where}"
    try:
        with open(_BREADCRUMB, "w", encoding="utf-8") as fh:
            fh.write(text)
    except OSError:
        pass


def _launch(st: "_State", what: str, fn: Callable, args, kwargs) -> Any:
    """Call a kernel (`what`: ``ext:…`` / ``triton:…``), leaving a breadcrumb while it runs and
    naming it as the failing call if it raises."""
    if _BREADCRUMB:
        _leave_breadcrumb(what, st)
    try:
        out = fn(*args, **kwargs)
    except BaseException:
        if st.failing_call is None:
            st.failing_call = what
        raise
    if _BREADCRUMB:
        _leave_breadcrumb("", st)  # it returned: a later crash is not inside it
    return out



class capture:
    """``with diffkit.capture(model) as trace: model(*inputs)`` — records one forward.

    `snapshot=False` records metadata only (no clones; whether the forward changed its inputs is then
    not known).  `only` filters records by name
    (a callable taking the name).  `fold`: the element counts records may pair with (the other
    side's); results of other sizes from a call site past FOLD_AFTER of them are folded (module
    docstring).  `fold_writes`: the sizes of the other side's records written in place, against
    which a write into memory is judged (default: `fold`).  The trace stays usable when the forward raises: the
    exception propagates, ``trace.error`` says where it happened.
    """

    def __init__(self, model: torch.nn.Module | None = None, *, snapshot: bool = True,
                 only: Callable[[str], bool] | None = None, inputs: tuple = (), sink: Any = None,
                 fold: frozenset | None = None, fold_writes: frozenset | None = None):
        self.state = _State(model, snapshot, only, sink, fold, fold_writes)
        # each input as it came (name, the tensor the forward gets, a copy): whether the forward changed it
        # (released when the capture ends: `t` is the forward's, the copy the record's or the trace's)
        self._given: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        owns = getattr(sink, "owns_values", False)
        for i, (pos, t) in enumerate(_tensors(list(inputs))):
            # the model's inputs open the trace, so a candidate's copy of an input pairs with it; a sink that keeps
            # the values gets the capture's copy, marked its own (a streaming store keeps it without another)
            given = own_copy(t) if snapshot and owns else None
            rec = self.state.add(name=input_name(pos), kind="input", label=f"input{list(pos)}",
                                 function="", file="", line=0, op="input", tensor=t, scope="", value=given)
            if not snapshot:  # (metadata only: no copy, and no telling whether the forward changed it)
                copy = t
            elif given is not None:
                copy = given
            elif rec is not None and rec.value is not None:
                copy = rec.value  # the input record's own copy, taken as it was recorded: no second one
            else:
                copy = t.detach().clone()
            if not owns:  # (a sink that owns the values keeps it: the trace holds no second copy)
                self.state.trace.inputs.append(copy)
            if snapshot:
                self._given.append((input_name(pos), t, copy))
        self._rng_before = rng_state()  # (after any seeding: what the forward draws from)
        self._handles: list[Any] = []
        self._mode: _Mode | None = None
        self._patch = _ExtensionPatch(self.state, _launch)
        self._triton = _TritonPatch(self.state, _launch, _ACTIVE)
        self.active = False  # between __enter__ and __exit__ (a streaming diff switches sides only then)

    def __enter__(self) -> Trace:
        _install_extension_import_hook()
        naming.refresh()
        self.resume()
        self._mode = _Mode(self.state)
        self._mode.__enter__()
        self.active = True
        return self.state.trace

    def resume(self) -> None:
        """Install what records this capture's forward: the global module hooks, the extension and
        Triton launch wrappers, and this state as the active one."""
        reg = torch.nn.modules.module
        self._handles = [
            reg.register_module_forward_pre_hook(_pre_hook),
            reg.register_module_forward_hook(_post_hook, always_call=True),
        ]
        self._patch.install(self.state.model)
        self._triton.install()
        _ACTIVE.append(self.state)

    def suspend(self) -> None:
        """Take out what `resume` installed, mid-forward: a streaming diff runs the reference on a
        thread of its own and hands control back and forth between the two captures at record
        boundaries, so that only the running side's hooks and wrappers are installed (the torch
        function mode is per thread and stays)."""
        if _ACTIVE and _ACTIVE[-1] is self.state:
            _ACTIVE.pop()
        for h in self._handles:
            h.remove()
        self._handles = []
        self._patch.remove()
        self._triton.remove()

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.active = False
        try:
            if self._mode is not None:
                self._mode.__exit__(None, None, None)
        finally:
            self.suspend()
        self.state.trace.folded = self.state.folded_sites()
        try:
            self.state.seal()
        except Exception as e:  # (out of memory copying a value): keep no value rather than a wrong one
            for key in list(self.state.lazy):
                for rec, _ in self.state.lazy.pop(key):
                    rec.value = None
            warnings.warn(f"diffkit: could not keep the captured values ({type(e).__name__}: {e}); those records "
                          f"are not compared")
        if isinstance(exc, StopCapture):
            self.state.trace.stopped = str(exc) or "stopped"
        elif exc is not None:
            self.state.trace.error = _describe_error(exc, tb, self.state.error_scope or self.state.scope,
                                                     self.state.failing_call)
        trace = self.state.trace
        try:  # what the forward left besides its records (never in the way of its own error or the sink's close)
            # (let go of here: a sink may keep this capture, and these are whole copies of the inputs)
            given, self._given = self._given, []
            trace.inputs_left = changed_inputs(given)
            trace.rng_after = rng_state()
            trace.drew_random = set(self._rng_before) != set(trace.rng_after) or any(
                not torch.equal(v, trace.rng_after[k]) for k, v in self._rng_before.items())
            if self.state.sink is not None:
                if trace.inputs_left and hasattr(self.state.sink, "add_inputs_left"):
                    self.state.sink.add_inputs_left(trace.inputs_left)
                if hasattr(self.state.sink, "add_rng_after"):
                    self.state.sink.add_rng_after(trace.rng_after)
        except Exception as e:
            warnings.warn(f"diffkit: could not keep the inputs or generator states the forward left "
                          f"({type(e).__name__}: {e})")
        if self.state.sink is not None:
            self.state.sink.set_error(self.state.trace.error)
            if hasattr(self.state.sink, "output_form"):  # (a capture file keeps it)
                self.state.sink.output_form = self.state.trace.output_form
                self.state.sink.output_others = self.state.trace.output_others
            self.state.sink.close()
        return False


def _describe_error(exc: BaseException, tb, scope: str, call: str | None = None) -> CaptureError:
    frames = _tb.extract_tb(tb)
    user = [f for f in frames if not naming.is_internal_file(f.filename)]
    where = user[-1] if user else (frames[-1] if frames else None)
    try:
        said = str(exc).strip()
    except Exception:  # an exception whose message itself raises
        said = ""
    try:
        text = "".join(_tb.format_exception(type(exc), exc, tb))
    except Exception:
        text = "".join(_tb.format_list(frames)) + f"{type(exc).__name__}: <its message could not be made>\n"
    msg = said.splitlines()[0] if said else type(exc).__name__
    return CaptureError(
        type=type(exc).__name__, message=msg[:500], scope=scope, call=call or "",
        function=where.name if where else "?", file=where.filename if where else "",
        line=where.lineno or 0 if where else 0, traceback=text[-8000:],
    )
