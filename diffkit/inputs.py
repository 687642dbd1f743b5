"""A forward's inputs as KernelBench hands them over: copies that keep what the objects were.

KernelBench calls `get_inputs()` once per trial and gives the very objects it returned to both models. A
copy made for a diff must keep what a model can tell about them: the same tensor at two places is one
tensor (`[x, x]`: a write through one is seen through the other), tensors that share memory (views, an
`expand`) still share it, and each keeps its sizes, strides and offset (a transposed or expanded input stays
so: a kernel that reads memory in order, or a `.view()` that needs contiguous strides, behaves as it would
there).

Also how capture names them (`input_name`), which of them a forward changed in place (`changed_inputs`, bit
for bit: `same_bits`), and the inputs with those changes applied, as the candidate is handed them
(`input_values`).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from .tensorargs import path_key

__all__ = ["copy_inputs", "layout", "as_made", "rebuild", "input_name", "input_names", "input_values", "changed_inputs",
           "same_bits", "read_spec", "build_from_spec"]


def _plain(t: torch.Tensor) -> bool:
    """A strided tensor of torch's own whose memory can be copied as it lies (no subclass, no lazy
    conjugate or negation bit, not quantized, sparse or nested, with real memory)."""
    return (type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout == torch.strided and not t.is_quantized
            and not t.is_nested and not t.is_conj() and not t.is_neg() and t.device.type != "meta"
            and not t._is_zerotensor())


def copy_inputs(obj: Any) -> Any:
    """A copy of every tensor in the nested structure `obj` (other leaves shared, as KernelBench shares
    them): one copy per tensor object wherever it appears, one copy of each memory the tensors share, each
    tensor rebuilt on it with its own sizes, strides and offset.  A tensor that cannot be copied so is cloned
    as before (torch's `clone`: dense, its strides kept where they are not overlapping)."""
    by_id: dict[int, torch.Tensor] = {}
    memory: dict[tuple, torch.UntypedStorage] = {}

    def one(v: Any) -> Any:
        if not isinstance(v, torch.Tensor):
            return v
        got = by_id.get(id(v))
        if got is not None:
            return got
        t = v.detach()
        c = None
        if _plain(t):
            try:
                st = t.untyped_storage()
                key = (t.device, st.data_ptr(), st.nbytes())
                copy = memory.get(key)
                if copy is None:
                    copy = memory[key] = st.clone()
                c = torch.empty(0, dtype=t.dtype, device=t.device).set_(copy, t.storage_offset(), t.size(), t.stride())
            except (RuntimeError, NotImplementedError, TypeError):
                c = None
        if c is None:
            c = t.clone()
        by_id[id(v)] = c
        return c

    return pytree.tree_map(one, obj)


def layout(obj: Any) -> list | None:
    """What a copy of `obj`'s values alone (each tensor dense and apart) would lose, as a model can tell it, per
    tensor leaf in order: [its strides, its storage offset, the first leaf sharing its memory, the first leaf that is
    the same object]; None when nothing would be lost (every tensor contiguous, whole and apart)."""
    out: list = []
    by_id: dict[int, int] = {}
    by_memory: dict[tuple, int] = {}
    matters = False
    for i, v in enumerate(t for t in pytree.tree_leaves(obj) if isinstance(t, torch.Tensor)):
        same = by_id.setdefault(id(v), i)
        if not _plain(v):
            out.append([list(v.stride()) if v.layout == torch.strided else None, 0, i, same])
            matters = matters or same != i
            continue
        nbytes = v.untyped_storage().nbytes()
        key = (str(v.device), v.untyped_storage().data_ptr())
        shared = by_memory.setdefault(key, i) if v.numel() and nbytes else i
        out.append([list(v.stride()), v.storage_offset(), shared, same])
        if same != i or shared != i or not v.is_contiguous() or v.storage_offset() \
                or nbytes != v.numel() * v.element_size():
            matters = True
    return out if matters else None


def as_made(captured: Any, made: Any, want: list | None = None) -> Any:
    """`made` (the inputs `get_inputs()` gives again under the same seed) when it holds exactly the captured
    values in the same structure (non-tensor leaves equal too) and, given `want` (the `layout` the captured
    inputs had when they were made), is laid out so; else `captured`: the objects as they were, or their values as
    stored."""
    a, spec_a = pytree.tree_flatten(captured)
    b, spec_b = pytree.tree_flatten(made)
    if spec_a != spec_b or len(a) != len(b):
        return captured
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return captured
        try:
            if isinstance(x, torch.Tensor):
                same = same_bits(x.detach(), y.detach())
            else:
                same = type(x) is type(y) and bool(x == y)
        except Exception:  # (a leaf that cannot be compared: not taken as the same)
            return captured
        if not same:
            return captured
    if want is not None and layout(made) != want:
        return captured
    return made


def rebuild(captured: Any, want: list | None) -> Any:
    """The captured inputs (their values, dense and apart) laid out again as `want` (their `layout` when made) says:
    the same object at each place it was, leaves that shared memory on one shared copy, each with its strides and
    offset (memory no leaf covers is zero).  `captured` as it is where `want` does not fit it."""
    if not want:
        return captured
    leaves, spec = pytree.tree_flatten(captured)
    tensors = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
    if len(tensors) != len(want):
        return captured
    try:
        vals = [leaves[i] for i in tensors]
        groups: dict[int, list[int]] = {}
        for j, (stride, offset, shared, same) in enumerate(want):
            if same == j and stride is not None:
                groups.setdefault(shared, []).append(j)
        out: list[torch.Tensor | None] = [None] * len(vals)
        for members in groups.values():
            v0 = vals[members[0]]
            need = max(want[j][1] + 1 + sum((n - 1) * s for n, s in zip(vals[j].shape, want[j][0]))
                       if vals[j].numel() else 0 for j in members)
            if need > max(16 * sum(vals[j].numel() for j in members), 1 << 24):
                return captured  # (a layout, read from a capture, asking for far more memory than its values fill)
            flat = torch.zeros(max(need, 0), dtype=v0.dtype, device=v0.device)
            for j in members:
                if vals[j].dtype != v0.dtype:
                    return captured  # (memory viewed as two dtypes: not rebuilt)
                t = flat.as_strided(tuple(vals[j].shape), tuple(want[j][0]), want[j][1])
                if t.numel():
                    where = torch.arange(flat.numel(), device=flat.device).as_strided(t.shape, t.stride(),
                                                                                    want[j][1])
                    flat.index_put_((where.reshape(-1),), vals[j].reshape(-1).to(flat.dtype))
                out[j] = t
        for j, (stride, offset, shared, same) in enumerate(want):
            if same != j:
                out[j] = out[same]
            elif out[j] is None:
                out[j] = vals[j]
    except (RuntimeError, IndexError, TypeError, ValueError):
        return captured
    for i, t in zip(tensors, out):
        leaves[i] = t
    return pytree.tree_unflatten(leaves, spec)


def input_name(pos: tuple) -> str:
    """The record name of the forward's input tensor at position `pos` of its arguments (`_tensors`)."""
    return f"input[{']['.join(map(str, pos))}]"


def input_names(kind: str, name: str, aliases: Any) -> list[str]:
    """The `input_name`s a record (or a capture file's entry for one) answers to: its own name for an input
    record, and any input name among its aliases (an input the forward returns as it is becomes the output
    record, its input name an alias)."""
    own = [name] if kind == "input" else []
    return own + [a for a in aliases or () if isinstance(a, str) and a.startswith("input[")]


def input_values(inputs: Any, values: dict[str, torch.Tensor]) -> Any:
    """`inputs` (a forward's nested arguments) with the tensors named in `values` (by `input_name`)
    replaced by a copy of those values: the reference's inputs as its forward left them, for the candidate."""
    if not values:
        return inputs
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


# ----------------------------------------------------------------------------- a structure stored as data

# the containers a stored structure (torch's `treespec_dumps` JSON, as `load.encode_values` writes it) may hold; read
# here, never by torch's `treespec_loads`, which imports any module a stored enum or defaultdict names
SPEC_TYPES = ("builtins.list", "builtins.tuple", "builtins.dict", "collections.OrderedDict", "torch.Size")
MAX_SPEC_DEPTH = 64
MAX_SPEC_NODES = 1 << 20


def read_spec(text: Any) -> tuple[Any, int]:
    """A stored structure (``[1, {"type", "context", "children_spec"}]``) read as data: its tree of nodes
    ``(type, keys, children)`` (type None: a leaf) and its number of leaves.  Only `SPEC_TYPES` are taken; a
    dict's keys must be JSON scalars.  Raises ValueError saying what is wrong."""
    import json

    if not isinstance(text, str):
        raise ValueError(f"the spec must be a string, not {type(text).__name__}")
    try:
        top = json.loads(text)
    except RecursionError:
        raise ValueError("the spec nests too deep") from None
    except ValueError as e:
        raise ValueError(f"the spec is not valid JSON ({str(e)[:100]})") from None
    if not (isinstance(top, list) and len(top) == 2 and top[0] == 1 and not isinstance(top[0], bool)):
        raise ValueError("the spec must be [1, {type, context, children_spec}] (pytree protocol 1)")
    root: list = [None, None, []]
    stack, leaves, nodes = [(top[1], root, 1)], 0, 0
    while stack:
        schema, node, depth = stack.pop()
        nodes += 1
        if depth > MAX_SPEC_DEPTH or nodes > MAX_SPEC_NODES:
            raise ValueError(f"the spec nests deeper than {MAX_SPEC_DEPTH} or holds more than {MAX_SPEC_NODES} nodes")
        if not isinstance(schema, dict) or set(schema) != {"type", "context", "children_spec"}:
            raise ValueError("a spec node must be an object of type, context and children_spec")
        typ, ctx, children = schema["type"], schema["context"], schema["children_spec"]
        if not isinstance(children, list):
            raise ValueError("a spec node's children_spec must be a list")
        if typ is None:
            if ctx is not None or children:
                raise ValueError("a leaf of the spec has a context or children")
            leaves += 1
            continue
        if typ not in SPEC_TYPES:
            raise ValueError(f"the spec holds a {str(typ)[:60]!r}; a stored structure holds only "
                             f"{', '.join(SPEC_TYPES)}")
        keys = _spec_keys(typ, ctx, len(children))
        node[0], node[1] = typ, keys
        for child in children:
            sub: list = [None, None, []]
            node[2].append(sub)
            stack.append((child, sub, depth + 1))
    return root, leaves


def _spec_keys(typ: str, ctx: Any, n: int) -> list | None:
    """A spec node's context: a dict's keys (JSON scalars, one per child), else "null"."""
    import json

    try:
        keys = json.loads(ctx) if isinstance(ctx, str) else ...
    except (ValueError, RecursionError):
        keys = ...
    if typ in ("builtins.dict", "collections.OrderedDict"):
        if not isinstance(keys, list) or len(keys) != n or \
                not all(k is None or isinstance(k, (str, int, float, bool)) for k in keys):
            raise ValueError(f"a {typ} node's context must list its {n} keys (strings or numbers)")
        return keys
    if keys is not None:
        raise ValueError(f"a {typ} node's context must be null")
    return None


def build_from_spec(node: Any, leaves: list) -> Any:
    """The structure `read_spec` read, with `leaves` in its leaf places (in order)."""
    it = iter(leaves)

    def one(n: list, depth: int) -> Any:
        typ, keys, children = n
        if typ is None:
            return next(it)
        items = [one(c, depth + 1) for c in children]
        if typ == "builtins.list":
            return items
        if typ == "builtins.tuple":
            return tuple(items)
        if typ == "torch.Size":
            return torch.Size(items)
        if typ == "collections.OrderedDict":
            import collections

            return collections.OrderedDict(zip(keys, items))
        return dict(zip(keys, items))

    return one(node, 0)
