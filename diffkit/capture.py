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
"""
from __future__ import annotations

import collections
import os
import re
import sys
import traceback as _tb
import types
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

from . import naming
from .options import FOLD_AFTER

__all__ = ["Record", "Trace", "CaptureError", "Ref", "StopCapture", "capture", "tap", "register_extension"]


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
    inputs: list[torch.Tensor] = field(default_factory=list)
    error: CaptureError | None = None
    stopped: str = ""  # why the forward was ended early on purpose (StopCapture), if it was
    # results folded into lineage instead of recorded (see the module docstring), by call site "file:line"
    folded: dict = field(default_factory=dict)
    # what the forward returned at the top: "tensor", or its container's type ("tuple", "list", "dict" …);
    # "" when not known (a forward that raised, a capture written before this was kept)
    output_form: str = ""
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


# --------------------------------------------------------------------------- state
_ACTIVE: list["_State"] = []
_EXTENSIONS: "weakref.WeakSet[types.ModuleType]" = weakref.WeakSet()

_CONTAINERS = (torch.nn.Sequential, torch.nn.ModuleList, torch.nn.ModuleDict)
_SKIP_FUNCS = {"__get__", "__set__", "__repr__", "__format__", "__bool__", "__len__", "__iter__",
               "__contains__", "__hash__", "__reduce_ex__", "__deepcopy__"}


# allocations hold no computed value (a kernel fills them later): no record, so the kernel's
# write, named after the same variable, is the record that pairs with the reference
_ALLOC_FUNCS = {"empty", "empty_like", "new_empty", "empty_strided"}

_NOT_EXTENSIONS = {"torch", "numpy", "triton", "pandas", "matplotlib", "scipy"}


def register_extension(module: types.ModuleType) -> types.ModuleType:
    """Make an extension module known to capture (done automatically for load_inline/load)."""
    _EXTENSIONS.add(module)
    return module


_CPP_EXTENSION = "torch.utils.cpp_extension"


def _install_extension_import_hook() -> None:
    """Wrap cpp_extension's importer so every extension loaded from now on is registered: at once when
    cpp_extension is imported already, else the moment something imports it (`_ExtensionImportWatch`).
    Importing it brings setuptools along (~0.08 s): a diff of models with no extension never pays that."""
    ce = sys.modules.get(_CPP_EXTENSION)
    if ce is not None:
        _wrap_extension_importer(ce)
    elif not any(isinstance(f, _ExtensionImportWatch) for f in sys.meta_path):
        sys.meta_path.insert(0, _ExtensionImportWatch())


def _wrap_extension_importer(ce: types.ModuleType) -> None:
    original = getattr(ce, "_import_module_from_library", None)
    if original is None or getattr(original, "_diffkit", False):
        return

    def _import_module_from_library(*args, **kwargs):
        module = original(*args, **kwargs)
        try:
            register_extension(module)
        except TypeError:
            pass
        return module

    _import_module_from_library._diffkit = True  # type: ignore[attr-defined]
    ce._import_module_from_library = _import_module_from_library


class _ExtensionImportWatch:
    """A finder first on sys.meta_path that answers for torch.utils.cpp_extension only: the spec the finders
    after it give, its loader wrapped (`_WrappingLoader`) so that the module, once executed, gets its importer
    wrapped (`_wrap_extension_importer`).  It stays there (one string compared an import): a lookup that imports
    nothing (`importlib.util.find_spec`) or an import that fails leaves it for the next one, and no finder is
    removed while an import walks the list."""

    def find_spec(self, name, path, target=None):
        if name != _CPP_EXTENSION:
            return None
        for finder in list(sys.meta_path):
            if isinstance(finder, _ExtensionImportWatch):
                continue
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _WrappingLoader(spec.loader)
        return spec

    def invalidate_caches(self) -> None:
        pass


class _WrappingLoader:
    """A module's loader, its `exec_module` followed by `_wrap_extension_importer`; everything else the loader's
    own (source, code, resources)."""

    def __init__(self, inner) -> None:
        self._inner = inner

    def create_module(self, spec):
        create = getattr(self._inner, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module) -> None:
        self._inner.exec_module(module)
        _wrap_extension_importer(module)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _is_extension_function(obj: Any) -> bool:
    """A builtin function from a compiled module that is neither Python's nor torch's.

    load_inline/load modules are not put in sys.modules, so a function whose module is not
    importable by name, or is a compiled extension module, qualifies."""
    if not isinstance(obj, types.BuiltinFunctionType):
        return False
    modname = getattr(obj, "__module__", None)
    top = (modname or "").split(".")[0]
    if not modname or modname in sys.builtin_module_names or top in _NOT_EXTENSIONS or top == "builtins" \
            or top in getattr(sys, "stdlib_module_names", ()):
        return False
    mod = sys.modules.get(modname)
    return mod is None or _looks_like_extension(mod)


def _looks_like_extension(mod: Any) -> bool:
    if not isinstance(mod, types.ModuleType):
        return False
    if mod in _EXTENSIONS:
        return True
    f = getattr(mod, "__file__", None) or ""
    top = mod.__name__.split(".")[0]
    if not f.endswith((".so", ".pyd")) or top in _NOT_EXTENSIONS or top in getattr(sys, "stdlib_module_names", ()):
        return False
    return any(isinstance(v, types.BuiltinFunctionType) for v in vars(mod).values())


def input_name(pos: tuple) -> str:
    """The record name of the forward's input tensor at position `pos` of its arguments (`_tensors`)."""
    return f"input[{']['.join(map(str, pos))}]"


def input_names(kind: str, name: str, aliases: Any) -> list[str]:
    """The `input_name`s a record (or a capture file's entry for one) answers to: its own name for an input
    record, and any input name among its aliases (an input the forward returns as it is becomes the output
    record, its input name an alias)."""
    own = [name] if kind == "input" else []
    return own + [a for a in aliases or () if isinstance(a, str) and a.startswith("input[")]


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


def changed_inputs(given: list[tuple[str, torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Of a forward's inputs given as (name, the tensor it got, a copy taken before), those it changed in
    place, by name, as it left them (bit for bit: a NaN left as it was is no change)."""
    out: dict[str, torch.Tensor] = {}
    for name, live, before in given:
        try:
            changed = not same_bits(before, live.detach())
        except RuntimeError:  # (a tensor that cannot be read back here)
            continue
        if changed:
            out[name] = live.detach()
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors hold the same bits (a NaN equals itself), compared in place as integers of the
    same width: no float64 copies, no index lists."""
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    if a.is_floating_point():
        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        a, b = a.contiguous().view(ints), b.contiguous().view(ints)
    return bool(torch.equal(a, b))


def input_values(inputs: Any, values: dict[str, torch.Tensor]) -> Any:
    """`inputs` (a forward's nested arguments) with the tensors named in `values` (by `input_name`)
    replaced by a copy of those values: the reference's inputs as its forward left them, for the candidate."""
    if not values:
        return inputs
    from .inputs import copy_inputs

    # written into a copy of the inputs, so that one the reference changed through another (`[x, x]`, a view) and
    # the layout of each stay as they were; a value that cannot be written so (overlapping memory) replaces its input
    flat, spec = pytree.tree_flatten_with_path(copy_inputs(inputs))
    leaves = []
    for path, v in flat:
        name = input_name(tuple(path_key(k) for k in path)) if isinstance(v, torch.Tensor) else None
        got = values.get(name) if name is not None else None
        if got is not None and tuple(got.shape) == tuple(v.shape) and got.dtype == v.dtype:
            try:
                with torch.no_grad():
                    v.copy_(got.detach().to(v.device))
            except RuntimeError:
                v = got.detach().to(v.device).clone()
        leaves.append(v)
    return pytree.tree_unflatten(leaves, spec)


def _tensors(obj: Any) -> list[tuple[tuple, torch.Tensor]]:
    """Tensors inside (nested) tuples, lists and dicts, with their positions (indices and keys)."""
    if isinstance(obj, torch.Tensor):  # the common case, without a tree walk
        return [((), obj)]
    if obj is None or isinstance(obj, (int, float, bool, str)):
        return []
    t = type(obj)
    if (t is tuple or t is list) and all(type(o) is torch.Tensor for o in obj):
        return [((i,), o) for i, o in enumerate(obj)]  # chunk, split, unbind …: no tree walk
    if t is tuple or t is list or t is dict:  # a call's arguments, (x, [sizes], dim): walked directly
        out: list[tuple[tuple, torch.Tensor]] = []
        if _plain_tensors(obj, (), out):
            return out
    flat, _ = pytree.tree_flatten_with_path(obj)
    return [(tuple(path_key(k) for k in path), v) for path, v in flat if isinstance(v, torch.Tensor)]


def _plain_tensors(obj: Any, path: tuple, out: list) -> bool:
    """`_tensors` of plain tuples, lists and dicts of tensors and atoms (the positions pytree would give);
    False, with `out` unfinished, at any other container (named tuples, registered nodes: pytree's)."""
    t = type(obj)
    items = obj.items() if t is dict else enumerate(obj) if (t is tuple or t is list) else None
    if items is None:
        return False
    for k, o in items:
        if isinstance(o, torch.Tensor):
            out.append(((*path, k), o))
        elif type(o) in _ATOMS:
            continue
        elif not _plain_tensors(o, (*path, k), out):
            return False
    return True


_ATOMS = (int, float, bool, str, torch.dtype, torch.device, torch.Size, slice, type(None), type(Ellipsis))


def _map_tensors(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    """`pytree.tree_map(fn, obj)` applied to tensors only, with plain tuples, lists and dicts walked
    directly (a call's arguments, once per recorded op: the generic walk costs more than the rest
    of recording); other containers (named tuples, registered nodes) go through pytree."""
    t = type(obj)
    if t is tuple or t is list:
        out = []
        for o in obj:
            to = type(o)
            if to is torch.Tensor or to is torch.nn.Parameter:
                out.append(fn(o))
            elif to in _ATOMS:
                out.append(o)
            else:
                out.append(_map_tensors(fn, o))
        return tuple(out) if t is tuple else out
    if t is dict:
        return {k: _map_tensors(fn, v) for k, v in obj.items()}
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if t in _ATOMS:
        return obj
    return pytree.tree_map(lambda o: fn(o) if isinstance(o, torch.Tensor) else o, obj)


def path_key(k: Any) -> Any:
    """A pytree key-path entry as a plain index or key."""
    for attr in ("idx", "key", "name"):
        if hasattr(k, attr):
            return getattr(k, attr)
    return k


def materialized(named: Any) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of `named_parameters()` / `named_buffers()` that hold values: a lazy
    module's (`nn.LazyLinear`, `nn.LazyBatchNorm2d`) are placeholders with no shape and no data until its
    first forward, and any use of one raises."""
    return [(n, t) for n, t in named if isinstance(t, torch.Tensor) and not torch.nn.parameter.is_lazy(t)]


def _storage_key(t: torch.Tensor) -> int | None:
    """The address of the memory a tensor's elements live in (shared by all its views), or None
    (no memory: empty, sparse, nested or meta tensors, a lazy module's placeholders).  Computed from the
    tensor's own address and offset (a storage object costs more to make, and this runs for every argument
    of every op)."""
    try:
        key = t.data_ptr() - t.storage_offset() * t.element_size()
    except (RuntimeError, NotImplementedError, AttributeError, ValueError):
        try:
            key = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError, AttributeError, ValueError):
            return None
    return key or None


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


def _snapshot(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone()


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


# functions with an `inplace` flag (keyword or positional): F.relu(x, True), nn.ReLU(inplace=True) …
_INPLACE_FLAG = {"relu", "relu6", "elu", "selu", "celu", "leaky_relu", "hardtanh", "threshold", "rrelu", "silu",
                 "mish", "hardswish", "hardsigmoid", "dropout", "dropout1d", "dropout2d", "dropout3d",
                 "alpha_dropout", "feature_alpha_dropout"}


# what a function's name alone says about writing (`_may_write`): 0 no, 1 yes, 2 only with a True flag
_WRITES_BY_NAME: dict[str, int] = {}


def _writes_by_name(fname: str) -> int:
    hit = _WRITES_BY_NAME.get(fname)
    if hit is None:
        base = fname.split(".")[0]  # an operator overload's name: "add_.Tensor"
        if base.startswith("__"):
            hit = int(base == "__setitem__" or (base.startswith("__i") and base not in (
                "__index__", "__int__", "__invert__", "__iter__")))
        elif base.endswith("_"):
            hit = 1
        else:
            hit = 2 if base in _INPLACE_FLAG else 0
        _WRITES_BY_NAME[fname] = hit
    return hit


def _may_write(fname: str, kwargs: dict, args: tuple = ()) -> bool:
    """Whether a torch function of this name may write into one of its tensor arguments (what the
    name says is looked up once per name: this runs for every op a capture sees)."""
    if kwargs and ("out" in kwargs or kwargs.get("inplace") is True):
        return True
    hit = _writes_by_name(fname)
    if hit == 2:
        return any(a is True for a in args[1:])
    return hit == 1


def written_in_place(r: Record) -> bool:
    """Whether a record is a write into existing memory (`y[i] = v`, a kernel's write, an in-place op)."""
    return r.kind == "write" or (r.kind in ("op", "ext") and _writes_by_name(r.op.rsplit(".", 1)[-1]) == 1)


def _store_label(site) -> str:
    """The name a store `y[i] = v` is recorded under: the tensor written, `y`."""
    return site.labels[0] if site.labels else (re.match(r"[\w.]+", site.text) or [site.text])[0]


def _version(t: torch.Tensor) -> int:
    """A tensor's version counter (bumped by each in-place write); -1 for an inference-mode tensor,
    which keeps none (writes into it are then known only from the write records capture makes)."""
    try:
        return t._version
    except RuntimeError:
        return -1


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The first and last element of its storage a tensor reaches (by its offset, sizes and strides)."""
    lo = hi = t.storage_offset()
    for n, st in zip(t.shape, t.stride()):
        if n > 1:
            if st < 0:
                lo += (n - 1) * st
            else:
                hi += (n - 1) * st
    return lo, hi


def _func_name(func: Callable) -> str:
    packet = getattr(func, "overloadpacket", func)  # torch.ops.aten.addmm(.default): its packet's name
    if isinstance(packet, torch._ops.OpOverloadPacket):
        return f"torch.ops.{packet}"
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    mod = getattr(func, "__module__", None) or ""
    if name.startswith("TensorBase.") or name.startswith("Tensor."):
        return "Tensor." + name.split(".", 1)[1]
    if mod.startswith("torch.nn.functional"):
        return "F." + name
    if mod.startswith("torch") or mod == "" or mod is None:
        return "torch." + name if not name.startswith("torch") else name
    return f"{mod}.{name}"


class _State:
    def __init__(self, model: torch.nn.Module | None, snapshot: bool, only: Callable[[str], bool] | None,
                 sink: Any = None, fold: frozenset | None = None, fold_writes: frozenset | None = None):
        self.model = model
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
        self.tracked: dict[int, tuple[Any, int, int]] = {}  # id(tensor) -> (weakref, record index, version)
        # records holding a torch op's output itself, not a copy yet: storage pointer -> [(record, version)]
        self.lazy: dict[int, list[tuple[Record, int]]] = {}
        self.lost: list[str] = []  # records whose memory was written where capture could not see it
        # dataflow through memory: the latest record holding each storage (a view made where capture
        # was quiet still maps to it) and the records that wrote into a storage in place
        self.storage_owner: dict[int, tuple[Any, int]] = {}  # storage pointer -> (weakref, record index)
        self.allocated: dict[int, Any] = {}  # storage pointer -> weakref of the empty()/new_empty() result there
        self.storage_writes: dict[int, list[int]] = {}  # storage pointer -> record indices, in order
        self.param_ids: dict[int, str] = {}  # id(parameter or buffer) -> qualified name
        self.param_storage: dict[int, list[tuple[int, int, str]]] = {}  # storage pointer -> (start, end, name)
        # buffers' memory: a forward may update it from C++ without moving its version (batch norm's running
        # statistics in training mode), so a record there is copied as it is made (`keep`, `hold`)
        self.buffer_storage: set[int] = set()
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
            self.buffer_storage = {k for k in (_storage_key(t) for _, t in materialized(model.named_buffers()))
                                   if k is not None}
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

    # -- values held without a copy (see the module docstring)
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

    def keep(self, rec: Record, tensor: torch.Tensor) -> None:
        held = self._lazy_key(tensor)
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

    # -- folding (module docstring)
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
        label = _store_label(site)
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

    def params_of_module(self, module: torch.nn.Module) -> tuple[str, ...]:
        """What a call of `module` reads: every parameter and buffer of the model inside it (its
        submodules' included), by the model's own qualified names (cached per module)."""
        hit = self.module_params.get(id(module))
        if hit is None:
            tensors = list(module.parameters()) + list(module.buffers())
            hit = tuple(dict.fromkeys(self.param_ids[id(t)] for t in tensors if id(t) in self.param_ids))
            self.module_params[id(module)] = hit
        return hit

    def add(self, *, name: str, kind: str, label: str, function: str, file: str, line: int, op: str,
            tensor: torch.Tensor, scope: str | None = None, is_output: bool = False,
            call: Any = None, inputs: tuple[Ref, ...] = (), rebound: bool = False,
            aliases: list[str] | None = None, params: tuple[str, ...] = ()) -> Record | None:
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
                if rec.kind != "tap":  # a tap's name wins; else the module path names it
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
            if kind in _LAZY_KINDS:
                self.keep(rec, tensor)
            else:
                rec.value = _snapshot(tensor)
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
                self.sink.add(rec, tensor)
            else:
                self.sink.add(rec)
        return rec

    def site(self):
        f = naming.user_frame(sys._getframe(2))
        if f is None:
            return naming.Site("", 0, "?", (), "?")
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
            label = _store_label(site)
            target = args[0]
            _, refs, params = self.template((args, kwargs))  # the tensor written into, and what was stored
            self.add(name=self.op_name(self.scope, site.function, label), rebound=label in site.rebound, kind="write", label=label,
                     function=site.function, file=site.file, line=site.line, op="Tensor.__setitem__",
                     tensor=target, inputs=refs, params=params)
            return
        found = _tensors(out)
        if not found:
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
    try:
        is_root = module is st.model
        if is_root:
            st.trace.output_form = "tensor" if isinstance(output, torch.Tensor) else type(output).__name__
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
        st.busy = False
    return None


def tap(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Name `tensor` explicitly for capture; returns it unchanged (free when nothing is captured)."""
    if _ACTIVE:
        st = _ACTIVE[-1]
        if not st.busy and isinstance(tensor, torch.Tensor):
            st.busy = True
            try:
                f = naming.user_frame(sys._getframe(1))
                site = naming.site_of(f) if f is not None else naming.Site("", 0, "?", (), "?")
                st.add(name=f"tap:{name}", kind="tap", label=name, function=site.function, file=site.file,
                       line=site.line, op="tap", tensor=tensor)
            finally:
                st.busy = False
    return tensor


_BREADCRUMB = os.environ.get("DIFFKIT_BREADCRUMB", "")


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


class _ExtensionPatch:
    """Swap extension functions for recording wrappers for the duration of a capture."""

    def __init__(self, state: _State):
        self.state = state
        self.undo: list[tuple[dict, str, Any]] = []
        self.wrapped: dict[int, Callable] = {}
        self._scanned: tuple[list[dict], list[types.ModuleType]] | None = None

    def _wrap(self, fn, qualname: str):
        w = self.wrapped.get(id(fn))
        if w is not None:
            return w
        st = self.state

        def wrapper(*args, **kwargs):
            st.before_write(args, kwargs)  # a kernel may write into any tensor it is given
            if st.busy or st.opaque:
                return fn(*args, **kwargs)
            before = None
            if st.returns_none.get(qualname, True) and not st.may_fold(args):
                st.busy = True
                try:
                    before = [(i, a.detach().clone()) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
                finally:
                    st.busy = False
            out = _launch(st, f"ext:{qualname}", fn, args, kwargs)
            st.returns_none[qualname] = out is None
            st.busy = True
            try:
                st.on_ext(qualname, fn, args, kwargs, out, before)
            except Exception as e:
                if not st.warned:
                    st.warned = True
                    warnings.warn(f"diffkit: could not record extension call {qualname}: {e}")
            finally:
                st.busy = False
            return out

        wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
        wrapper.__name__ = getattr(fn, "__name__", "ext")
        wrapper._diffkit_qualname = qualname  # type: ignore[attr-defined]
        self.wrapped[id(fn)] = wrapper
        return wrapper

    def _set(self, namespace: dict, key: str, value: Any) -> None:
        self.undo.append((namespace, key, namespace[key]))
        namespace[key] = value

    def _model_scan(self, model: torch.nn.Module | None) -> tuple[list[dict], list[types.ModuleType]]:
        """The source namespaces of the model's forward methods and the modules its submodules hold:
        read once per capture (a capture suspended and resumed mid-forward installs again)."""
        if self._scanned is None:
            namespaces: list[dict] = []
            seen: set[int] = set()
            held: list[types.ModuleType] = []
            if model is not None:
                for m in model.modules():
                    for klass in type(m).__mro__:
                        fwd = klass.__dict__.get("forward")
                        g = getattr(fwd, "__globals__", None)
                        if g is not None and id(g) not in seen and not g.get("__name__", "").startswith("torch"):
                            seen.add(id(g))
                            namespaces.append(g)
                    for v in vars(m).values():
                        if isinstance(v, types.ModuleType):
                            held.append(v)
            self._scanned = (namespaces, held)
        return self._scanned

    def install(self, model: torch.nn.Module | None) -> None:
        namespaces, held = self._model_scan(model)
        modules: list[types.ModuleType] = list(_EXTENSIONS) + held
        for g in namespaces:
            for v in list(g.values()):
                if isinstance(v, types.ModuleType):
                    modules.append(v)
        done: set[int] = set()
        originals: dict[int, Callable] = {}
        for mod in modules:
            if id(mod) in done or not _looks_like_extension(mod):
                continue
            done.add(id(mod))
            ns = vars(mod)
            for key, fn in list(ns.items()):
                if key.startswith("_") or not isinstance(fn, types.BuiltinFunctionType):
                    continue
                originals[id(fn)] = fn
                self._set(ns, key, self._wrap(fn, f"{mod.__name__}.{key}"))
        # names bound with `from ext import fn`, in the model's source modules
        for g in namespaces:
            for key, v in list(g.items()):
                if isinstance(v, types.BuiltinFunctionType) and (id(v) in originals or _is_extension_function(v)):
                    self._set(g, key, self._wrap(v, f"{getattr(v, '__module__', None) or 'ext'}.{key}"))

    def remove(self) -> None:
        for ns, key, old in reversed(self.undo):
            ns[key] = old
        self.undo.clear()


class _TritonPatch:
    """Record user-launched Triton kernels: ``kernel[grid](...)`` is wrapped for the capture's duration.

    The wrapper sits on ``KernelInterface.__getitem__``, the user-facing launch: an autotuner or
    heuristics wrapper launches its inner kernel through ``run`` directly (benchmarking configs
    included), so each user launch is recorded once.  Triton kernels return nothing; the tensor
    arguments whose contents the launch changed are recorded (kind ``write``), each named by its
    argument's source text at the call site, like any variable assigned there."""

    def __init__(self, state: _State):
        self.state = state
        self.undo: Any = None

    def install(self) -> None:
        jit = sys.modules.get("triton.runtime.jit")
        ki = getattr(jit, "KernelInterface", None) if jit is not None else None
        if ki is None or "__getitem__" not in vars(ki):
            return
        original = vars(ki)["__getitem__"]
        st = self.state

        def __getitem__(kernel, grid):
            launch = original(kernel, grid)
            if st.busy or st.opaque or _ACTIVE[-1:] != [st]:
                return launch
            name = getattr(kernel, "__name__", None) or getattr(getattr(kernel, "fn", None), "__name__", "kernel")

            def run(*args, **kwargs):
                if st.busy:
                    return launch(*args, **kwargs)
                st.before_write(args, kwargs)  # a kernel may write into any tensor it is given
                st.busy = True  # also the re-entrancy guard: nested launches are the same user launch
                try:
                    tensors = [(i, a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
                    f = naming.user_frame(sys._getframe(1))
                    if st.fold is not None:
                        # folded: every tensor argument not a parameter may be what it wrote
                        written = st.non_param_tensors(args)
                        if st.foldable(written, f, write=True):
                            out = _launch(st, f"triton:{name}", launch, args, kwargs)
                            st.fold_into(written, st.lineage_of((args, kwargs)), in_place=True, frame=f,
                                         op=f"triton:{name}", known=False)
                            return out
                    before = [(i, a.detach().clone()) for i, a in tensors]
                    out = _launch(st, f"triton:{name}", launch, args, kwargs)
                    site = naming.site_of(f) if f is not None else naming.Site("", 0, "?", (), "?")
                    _, refs, params = st.template((args, kwargs))
                    st.on_writes(site, f"triton:{name}", args, before, ("triton", None, None), refs, params)
                    return out
                finally:
                    st.busy = False

            return run

        ki.__getitem__ = __getitem__
        self.undo = (ki, original)

    def remove(self) -> None:
        if self.undo is not None:
            ki, original = self.undo
            ki.__getitem__ = original
            self.undo = None


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
        self._given: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        for i, (pos, t) in enumerate(_tensors(list(inputs))):
            # the model's inputs open the trace, so a candidate's copy of an input pairs with it
            copy = t.detach().clone() if snapshot else t
            self.state.trace.inputs.append(copy)
            if snapshot:  # (metadata only: no copy, and no telling whether the forward changed it)
                self._given.append((input_name(pos), t, copy))
            self.state.add(name=input_name(pos), kind="input", label=f"input{list(pos)}",
                           function="", file="", line=0, op="input", tensor=t, scope="")
        self._rng_before = rng_state()  # (after any seeding: what the forward draws from)
        self._handles: list[Any] = []
        self._mode: _Mode | None = None
        self._patch = _ExtensionPatch(self.state)
        self._triton = _TritonPatch(self.state)
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
            trace.inputs_left = changed_inputs(self._given)
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
