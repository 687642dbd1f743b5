"""What each record was computed from: one side's dataflow graph (`Dataflow`), the covers of its records
(`covers`, `cover_of`), the map between the two models' parameters (`param_map`, `map_params_by_use`),
and the questions of dataflow and names the alignment passes ask.  Part of `diffkit.align`."""
from __future__ import annotations

import functools
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass

import torch

from .align_layout import layout_of_equal, record_numel
from .align_tuning import LAYOUT_CHAIN_DEPTH
from .capture import Record


# torch calls whose output holds their input's values in another layout (or a copy of them)
LAYOUT_OPS = frozenset({"view", "reshape", "permute", "transpose", "contiguous", "flatten", "unflatten", "squeeze",
                        "unsqueeze", "t", "clone", "movedim", "moveaxis", "swapaxes", "swapdims", "view_as",
                        "reshape_as", "detach", "to", "float", "as_strided", "expand_as"})


def is_layout_op(rec: Record) -> bool:
    """Whether a record is a torch call that only re-lays out (or copies) its input."""
    return rec.kind == "op" and rec.op.rsplit(".", 1)[-1] in LAYOUT_OPS


# the layout ops that change the order of the elements (a reshape of their result is no plain reshape)
REORDERING_OPS = frozenset({"permute", "transpose", "t", "movedim", "moveaxis", "swapaxes", "swapdims", "as_strided"})


def reorders(records: Sequence[Record], flow: Dataflow, i: int) -> bool:
    """Whether record `i` is its producer's value with the elements in another order: a chain of
    layout ops (``x.permute(...).reshape(...)``) of which one reorders."""
    for _ in range(LAYOUT_CHAIN_DEPTH):
        rec = records[i]
        if not is_layout_op(rec) or len(flow.inputs[i]) != 1:
            return False
        if rec.op.rsplit(".", 1)[-1] in REORDERING_OPS:
            return True
        i = flow.inputs[i][0]
    return False


@dataclass
class Dataflow:
    """One side's dataflow graph, as the capture recorded it.

    inputs:    per record, the earlier records its producing call consumed
    params:    per record, the parameters and buffers that call read (a candidate's under the
               reference's names, see `param_map`)
    derived:   per record, whether it was made from parameters alone (``W.t()``, ``W * s``): weight
               preparation, not a stage of the computation
    consumers: per record, the records that consumed it
    ancestors: per record, a bitset (int) of every record upstream of it
    known:     whether the capture recorded any dataflow (capture files written before it did not)
    """

    inputs: list[tuple[int, ...]]
    params: list[frozenset]
    derived: list[bool]
    consumers: list[list[int]]
    ancestors: list[int]
    known: bool

    @classmethod
    def of(cls, records: Sequence[Record], rename: dict[str, str] | None = None) -> Dataflow:
        flow = cls([], [], [], [], [], False)
        for r in records:
            flow.append(r, rename)
        return flow

    def readers(self) -> dict[str, list[int]]:
        """The records that read each parameter (built once, again only after records were added)."""
        cached = getattr(self, "_readers", None)
        if cached is None or cached[0] != len(self.params):
            by: dict[str, list[int]] = {}
            for j, ps in enumerate(self.params):
                for n in ps:
                    by.setdefault(n, []).append(j)
            cached = self._readers = (len(self.params), by)
        return cached[1]

    def append(self, r: Record, rename: dict[str, str] | None = None) -> None:
        """Add the next record (a streaming diff builds the candidate's graph as records are made)."""
        pos = len(self.inputs)
        # only earlier records can be inputs (a damaged capture file cannot make a cycle)
        ins = tuple(dict.fromkeys(j for j in (getattr(x, "index", x) for x in r.inputs)
                                  if isinstance(j, int) and 0 <= j < pos))
        ps = frozenset((rename or {}).get(n, n) for n in (getattr(r, "params", ()) or ()))
        bits = 0
        for j in ins:
            bits |= self.ancestors[j] | (1 << j)
            self.consumers[j].append(pos)
        self.inputs.append(ins)
        self.params.append(ps)
        self.derived.append(bool(ps) and all(self.derived[j] for j in ins))
        self.ancestors.append(bits)
        self.consumers.append([])
        self.known = self.known or bool(ins) or bool(ps)


Cover = tuple[frozenset, frozenset]  # (anchors: reference indices of the paired records upstream, params read)


def covers(flow: Dataflow, anchor: Callable[[int], int | None]) -> list[Cover]:
    """Per record, what it was computed from: the paired records reached going upstream through
    unpaired ones (`anchor` gives a paired record's reference index, None for an unpaired one), and
    the parameters read by it and by those unpaired records on the way."""
    out: list[Cover] = []
    empty: frozenset = frozenset()
    for i, ins in enumerate(flow.inputs):
        anchors: set | frozenset = empty
        params = flow.params[i]
        for j in ins:
            a = anchor(j)
            if a is not None:
                anchors = anchors | {a}
            else:
                aj, pj = out[j]
                if aj:
                    anchors = anchors | aj
                if pj:
                    params = params | pj
        out.append((frozenset(anchors), frozenset(params)))
    return out


def cover_of(flow: Dataflow, i: int, anchor: Callable[[int], int | None], memo: dict[int, Cover]) -> Cover:
    """`covers` for one record, walking up only as far as the paired records (`memo` holds what was
    walked already, valid while no pair changes)."""
    hit = memo.get(i)
    if hit is not None:
        return hit
    stack = [i]
    while stack:
        j = stack[-1]
        if j in memo:
            stack.pop()
            continue
        todo = [k for k in flow.inputs[j] if anchor(k) is None and k not in memo]
        if todo:
            stack.extend(todo)
            continue
        stack.pop()
        ins = flow.inputs[j]
        if len(ins) == 1 and anchor(ins[0]) is None:
            up = memo[ins[0]]
            if flow.params[j] <= up[1]:  # one input, nothing read of its own: its cover, the same objects
                memo[j] = up
                continue
        anchors: set = set()
        params = flow.params[j]
        for k in ins:
            a = anchor(k)
            if a is not None:
                anchors.add(a)
            else:
                ak, pk = memo[k]
                anchors |= ak
                params = params | pk
        memo[j] = (frozenset(anchors), frozenset(params))
    return memo[i]


def _stage_params(flow: Dataflow, i: int) -> frozenset:
    """The parameters a record's own call read, weight preparation feeding it included."""
    return flow.params[i].union(*(flow.params[j] for j in flow.inputs[i] if flow.derived[j]))


def _reads_elsewhere(flow: Dataflow, i: int, names: frozenset) -> bool:
    """Whether a record other than `i` and those upstream of it reads one of `names` (later on, or in
    a record made after the fact: a filled buffer recorded when the forward returned)."""
    readers = flow.readers()
    up = flow.ancestors[i]
    return any(j != i and not (up >> j) & 1 for n in names for j in readers.get(n, ()))


def _forget_downstream(memo: dict[int, Cover], flow: Dataflow, k: int, anchored: Callable[[int], bool]) -> list[int]:
    """Drop (and return) the covers that change now that `k` is an anchor (paired): those of its
    consumers, and on through consumers not anchored themselves (a cover walks up to the anchors
    and no further); `k`'s own is unchanged.  (A record whose cover is not held has none held
    downstream of it either: each was computed from the one above.)"""
    gone = []
    stack = list(flow.consumers[k])
    while stack:
        j = stack.pop()
        if memo.pop(j, None) is None:
            continue
        gone.append(j)
        if not anchored(j):
            stack.extend(flow.consumers[j])
    return gone


def param_map(ref_params: dict[str, torch.Tensor] | None, cand_params: dict[str, torch.Tensor] | None) -> dict[str, str]:
    """The reference name of each candidate parameter or buffer: the same name where the reference has
    one of that shape; else, in creation order, a reference one of identical shape and values that no
    name claimed (a candidate that renamed a module but built it from the same seed), or of its values
    in another layout (`layout_of_equal`: a weight stored transposed); else the one left of its shape on
    each side (a renamed module created in another order holds other values,
    but plays the same part; `map_params_by_use` pairs shapes of which there are several)."""
    if not cand_params:
        return {}
    ref_params = ref_params or {}
    out: dict[str, str] = {}
    left: list[str] = []
    for n, t in cand_params.items():
        r = ref_params.get(n)
        if r is not None and tuple(r.shape) == tuple(t.shape):
            out[n] = n
        else:
            left.append(n)
    if not left:
        return out
    free: dict[tuple, list[str]] = {}
    for n, r in ref_params.items():
        if n not in out.values() and n not in cand_params:
            free.setdefault((tuple(r.shape), r.dtype), []).append(n)
    for n in left:
        t = cand_params[n]
        pool = free.get((tuple(t.shape), t.dtype), [])
        for k, rn in enumerate(pool):
            r = ref_params[rn]
            try:
                same = bool(torch.equal(r.detach().to(t.device), t.detach()))
            except RuntimeError:
                same = False
            if same:
                out[n] = rn
                del pool[k]
                break
    for n in left:  # the same values in another layout (a weight stored transposed for ``x @ W``)
        if n in out:
            continue
        t = cand_params[n]
        hit = next(((key, rn) for key, pool in free.items() for rn in pool
                    if layout_of_equal(ref_params[rn], t) is not None), None)
        if hit is not None:
            out[n] = hit[1]
            free[hit[0]].remove(hit[1])
    unmatched: dict[tuple, list[str]] = {}
    for n in left:
        if n not in out:
            t = cand_params[n]
            unmatched.setdefault((tuple(t.shape), t.dtype), []).append(n)
    for key, names in unmatched.items():
        pool = free.get(key, [])
        if len(pool) == 1 and len(names) == 1:
            out[names[0]] = pool[0]
            del pool[0]
    _pair_other_shape(out, ref_params, cand_params, left, free)
    return out


def _pair_other_shape(out: dict[str, str], ref_params: dict[str, torch.Tensor], cand_params: dict[str, torch.Tensor],
                      left: list[str], free: dict[tuple, list[str]]) -> None:
    """The last of `param_map`'s steps: a candidate parameter still unpaired, stored in another shape than any
    reference one left (a transposed copy, a weight flattened or folded to 2-D) and holding other values,
    pairs with the reference one left of its element count where exactly one is left on each side."""
    by_numel: dict[tuple, tuple[list, list]] = {}
    for key, pool in free.items():
        for rn in pool:
            by_numel.setdefault((ref_params[rn].numel(), key[1]), ([], []))[0].append(rn)
    for n in left:
        if n not in out:
            t = cand_params[n]
            by_numel.setdefault((t.numel(), t.dtype), ([], []))[1].append(n)
    for (numel, _), (rs, cs) in by_numel.items():
        if len(rs) == 1 and len(cs) == 1 and numel > 1 and tuple(ref_params[rs[0]].shape) != tuple(
                cand_params[cs[0]].shape):
            out[cs[0]] = rs[0]


# a folded copy is looked for along axes of at most this many slices
FOLD_MAX_SLICES = 4096


def folded_in(r: torch.Tensor, c: torch.Tensor) -> str | None:
    """Where a larger candidate parameter `c` holds all of reference parameter `r`'s values as one block along
    one of its axes (a bias folded into its weight as an extra column, q/k/v weights stacked into one), in
    words ("folded in along axis 1 at 16..16"); None otherwise."""
    if c.numel() <= r.numel() or r.dtype != c.dtype or r.numel() < 1:
        return None
    rr = r if r.dim() == c.dim() else r.unsqueeze(-1) if r.dim() + 1 == c.dim() else None
    if rr is None:
        return None
    rr = rr.detach().to(c.device)
    for d in range(c.dim()):
        if c.shape[d] > FOLD_MAX_SLICES or any(rr.shape[k] != c.shape[k] for k in range(c.dim()) if k != d):
            continue
        w = rr.shape[d]
        for s in range(c.shape[d] - w + 1):
            if torch.equal(c.detach().narrow(d, s, w), rr):
                return f"folded in along axis {d} at {s}..{s + w - 1}"
    return None


def in_ref_layout(r: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, str] | None:
    """A paired candidate parameter `c` brought into its reference counterpart `r`'s shape, and how it is
    stored: "" (as the reference), "transposed" (its last two axes swapped), "reshaped"; None when their
    element counts differ."""
    if tuple(c.shape) == tuple(r.shape):
        return c, ""
    if c.numel() != r.numel():
        return None
    if r.dim() >= 2 and c.dim() >= 2 and tuple(c.transpose(-1, -2).shape) == tuple(r.shape):
        return c.transpose(-1, -2), "transposed"
    return c.reshape(r.shape), "reshaped"


def map_params_by_use(mapping: dict[str, str], ref_records: Sequence[Record], cand_records: Sequence[Record],
                      ref_params: dict[str, torch.Tensor] | None,
                      cand_params: dict[str, torch.Tensor] | None) -> dict[str, str]:
    """`param_map`'s answer extended: the parameters still without a counterpart pair shape by shape in
    the order the two forwards first read them, where each side read as many of that shape (a
    candidate that creates its parameters in another order, under other names, still reads them in
    the order its computation needs them)."""
    ref_params, cand_params = ref_params or {}, cand_params or {}
    taken = set(mapping.values())

    def first_reads(records: Sequence[Record], free: set) -> list[str]:
        order: list[str] = []
        for r in records:
            for n in getattr(r, "params", ()) or ():
                if n in free:
                    free.discard(n)
                    order.append(n)
        return order

    r_order = first_reads(ref_records, {n for n in ref_params if n not in taken and n not in cand_params})
    c_order = first_reads(cand_records, {n for n in cand_params if n not in mapping})
    groups: dict[tuple, tuple[list, list]] = {}
    for n in r_order:
        groups.setdefault((tuple(ref_params[n].shape), ref_params[n].dtype), ([], []))[0].append(n)
    for n in c_order:
        groups.setdefault((tuple(cand_params[n].shape), cand_params[n].dtype), ([], []))[1].append(n)
    out = dict(mapping)
    for rs, cs in groups.values():
        if len(rs) == len(cs):
            out.update(zip(cs, rs))
    return _pair_by_creation(out, ref_params, cand_params)


def _pair_by_creation(mapping: dict[str, str], ref_params: dict[str, torch.Tensor],
                      cand_params: dict[str, torch.Tensor]) -> dict[str, str]:
    """The parameters still unpaired after values and use, shape by shape in the order the two models create
    them (their named order), where each side has as many of that shape left: re-declared copies of several
    layers whose values differ and whose reads the capture did not see (a kernel given them all at once)."""
    taken = set(mapping.values())
    groups: dict[tuple, tuple[list, list]] = {}
    for n, t in ref_params.items():
        if n not in taken and n not in cand_params:
            groups.setdefault((tuple(t.shape), t.dtype), ([], []))[0].append(n)
    for n, t in cand_params.items():
        if n not in mapping:
            groups.setdefault((tuple(t.shape), t.dtype), ([], []))[1].append(n)
    out = dict(mapping)
    for rs, cs in groups.values():
        if rs and len(rs) == len(cs):
            out.update(zip(cs, rs))
    return out


def compatible(c_cover: Cover, r_cover: Cover, c_ancestors: int, r_ancestors: int,
               ref_partner: Callable[[int], int | None]) -> bool:
    """Whether pairing a candidate and a reference record contradicts neither side's dataflow: every
    paired record upstream of the candidate has its counterpart upstream of the reference record, and
    the reverse (`ref_partner` gives a reference record's candidate counterpart)."""
    for a in c_cover[0]:
        if not (r_ancestors >> a) & 1:
            return False
    for a in r_cover[0]:
        ci = ref_partner(a)
        if ci is not None and not (c_ancestors >> ci) & 1:
            return False
    return True


def rebound_pair_agrees(c: Record, r: Record, c_flow: Dataflow, r_flow: Dataflow,
                        partner: Callable[[int], int | None]) -> bool | None:
    """Whether a name pair on a reused variable is confirmed by dataflow: both records consumed
    counterpart records (weight preparation aside; `partner` gives a candidate record's reference
    counterpart) and read the same parameters.  None when neither side recorded dataflow (then the
    values have to decide)."""
    if not (c_flow.known and r_flow.known):
        return None
    c_in = {partner(j) for j in c_flow.inputs[c.index] if not c_flow.derived[j]}
    r_in = {j for j in r_flow.inputs[r.index] if not r_flow.derived[j]}
    c_params = c_flow.params[c.index].union(*(c_flow.params[j] for j in c_flow.inputs[c.index] if c_flow.derived[j]))
    r_params = r_flow.params[r.index].union(*(r_flow.params[j] for j in r_flow.inputs[r.index] if r_flow.derived[j]))
    if None in c_in:  # an input with no counterpart (an unpaired reshape, say): dataflow cannot tell
        return None
    return c_in == r_in and c_params == r_params


def reused_name(c: Record, r: Record) -> bool:
    """Whether a name pair needs its values to agree as well.

    A variable assigned more than once (`q = f(q)`) names several tensors, and a helper's result
    bound to it leaves no record of its own, so its name alone does not say which tensor it is."""
    return c.rebound or r.rebound


def names_index(records: Sequence[Record]) -> dict[str, list[int]]:
    """Record indices under each name and alias, in capture order."""
    index: dict[str, list[int]] = {}
    for r in records:
        for n in r.names():
            index.setdefault(n, []).append(r.index)
    return index


def name_partner(rec: Record, ref: Sequence[Record], index: dict[str, list[int]], taken: Container[int]) -> int | None:
    """The reference record `rec` pairs with by name: under the first of its names (aliases after)
    that has one, the first reference record not `taken` with `rec`'s element count."""
    numel = record_numel(rec)
    return next((ri for n in rec.names() for ri in index.get(n, ())
                 if ri not in taken and record_numel(ref[ri]) == numel), None)


def torch_op(rec: Record) -> str:
    """The torch function or module class that made a record ('' for extension and Triton calls,
    whose names their authors chose): ``F.softmax``, ``Tensor.softmax`` and ``torch.softmax`` alike."""
    return _torch_op(rec.kind, rec.op)


@functools.lru_cache(maxsize=8192)
def _torch_op(kind: str, op: str) -> str:
    if kind not in ("op", "module") or op.startswith(("ext:", "triton:")):
        return ""
    return op.rsplit(".", 1)[-1].lower().rstrip("_")


def same_op(c: Record, r: Record) -> bool:
    """Both records made by the same torch function or module class."""
    a = torch_op(c)
    return bool(a) and a == torch_op(r)
