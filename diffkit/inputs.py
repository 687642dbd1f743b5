"""A forward's inputs as KernelBench hands them over: copies that keep what the objects were.

KernelBench calls `get_inputs()` once per trial and gives the very objects it returned to both models. A
copy made for a diff must keep what a model can tell about them: the same tensor at two places is one
tensor (`[x, x]`: a write through one is seen through the other), tensors that share memory (views, an
`expand`) still share it, and each keeps its sizes, strides and offset (a transposed or expanded input stays
so: a kernel that reads memory in order, or a `.view()` that needs contiguous strides, behaves as it would
there).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

__all__ = ["copy_inputs"]


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


def layout_matters(obj: Any) -> bool:
    """Whether a copy of `obj`'s values alone (each tensor dense and apart) would differ from the objects
    themselves as a model can tell: a tensor at two places, tensors sharing memory, or one laid out otherwise
    than contiguously (transposed, expanded, a slice with gaps)."""
    seen: set[int] = set()
    memory: set[tuple] = set()
    for v in pytree.tree_leaves(obj):
        if not isinstance(v, torch.Tensor):
            continue
        if id(v) in seen:
            return True
        seen.add(id(v))
        if not _plain(v):
            continue
        if not v.is_contiguous() or v.storage_offset() or v.untyped_storage().nbytes() != v.numel() * v.element_size():
            return True
        key = (v.device, v.untyped_storage().data_ptr())
        if v.numel() and key in memory:
            return True
        memory.add(key)
    return False


def as_made(captured: Any, made: Any) -> Any:
    """`made` (the inputs `get_inputs()` gives again under the same seed) when it holds exactly the captured
    values in the same structure, else `captured`: the objects as they were, or their values as stored."""
    from .capture import same_bits

    a, spec_a = pytree.tree_flatten(captured)
    b, spec_b = pytree.tree_flatten(made)
    if spec_a != spec_b or len(a) != len(b):
        return captured
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return captured
        if isinstance(x, torch.Tensor):
            try:
                if not same_bits(x.detach(), y.detach()):
                    return captured
            except RuntimeError:
                return captured
    return made
