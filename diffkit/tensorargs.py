"""What capture reads off a call: the tensors in its arguments and results (with their positions), the memory
each lives in, whether the call may write into its arguments, and the name it is recorded under.  These run
for every argument of every op a capture sees: plain containers are walked directly, and what a function's
name says is looked up once per name."""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from .records import Record


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


_Module = torch.nn.Module
_OWN_WALK = ("named_parameters", "named_buffers", "_named_members")
_LazyMixin = torch.nn.parameter.UninitializedTensorMixin  # (what `is_lazy` asks)
_HOLDS: dict[type, bool] = {}  # a member's class: whether it holds values (a tensor, not a lazy placeholder)


def parameters_of(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """`materialized(model.named_parameters())`."""
    return _members(model, "_parameters")


def buffers_of(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """`materialized(model.named_buffers())`."""
    return _members(model, "_buffers")


def _members(model: torch.nn.Module, table: str) -> list[tuple[str, torch.Tensor]]:
    """`named_parameters()` (`table` "_parameters") or `named_buffers()` ("_buffers"), materialized, the same
    names in the same order, from one walk over `named_modules()` with tensors told apart by identity (a
    tensor's own hash goes through torch's function dispatch: most of what `named_parameters()` costs,
    ~0.1 ms for 150 parameters, and a diff asks for them some thirty times).  A model whose class walks its
    members its own way (an override of `named_parameters`, `named_buffers` or `_named_members`) is asked."""
    cls = type(model)
    if any(getattr(cls, f, None) is not getattr(_Module, f) for f in _OWN_WALK):
        return materialized(model.named_parameters() if table == "_parameters" else model.named_buffers())
    seen: set[int] = set()
    out: list[tuple[str, torch.Tensor]] = []
    for prefix, module in model.named_modules():
        for k, v in getattr(module, table).items():
            if v is None or id(v) in seen:
                continue
            seen.add(id(v))
            held = _HOLDS.get(type(v))
            if held is None:
                held = _HOLDS[type(v)] = issubclass(type(v), torch.Tensor) and not issubclass(type(v), _LazyMixin)
            if held:
                out.append((f"{prefix}.{k}" if prefix else k, v))
    return out


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


_FUNC_NAMES: dict[Any, str] = {}  # torch's functions are few and live as long as torch: each named once


def _func_name(func: Callable) -> str:
    try:
        return _FUNC_NAMES[func]
    except KeyError:
        name = _FUNC_NAMES[func] = _name_of_func(func)
        return name
    except TypeError:  # (not hashable)
        return _name_of_func(func)


def _name_of_func(func: Callable) -> str:
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
