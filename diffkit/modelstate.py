"""A model's state around its runs, and what one run of a trial found: the pieces the pipeline and the
trial protocol (diffkit.trials) share.

- its buffers (`snapshot_state`, `restore_state`), plain attributes (`attribute_state`, `restore_attributes`)
  and the parameters a forward writes into (`parameter_marks`, `ParameterGuard`, `parameter_sums`), so that
  diffkit's extra runs (a second run, replays, health checks) leave each model as its captured forward did;
- two runs' values compared bit for bit (`bitwise_difference`, `difference_words`);
- `Trial`: one KernelBench trial's outcome (`pipeline` records trial 1's, `trials` the later ones).

(Split from diffkit.trials, which re-exports these names; layer 8: it imports capture and result only.)
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch
import torch.utils._pytree as pytree

from .capture import buffers_of, parameters_of, path_key
from .measure import _unravel
from .result import _num

MAX_SHOWN = 4  # differing element indices named in a nondeterminism finding


def seed_all(seed: int) -> None:
    """KernelBench's set_seed: the CPU generator and every CUDA device's."""
    torch.manual_seed(seed)


# ----------------------------------------------------------------------------------- trial outcomes
@dataclass
class Trial:
    """One trial: its number (1-based), the seed before ``get_inputs()`` and what KernelBench's rule
    said of the candidate's output (`allclose`: both of the candidate's runs within tolerance).

    max_abs / mean_abs: the output's largest and mean |error| (the failing run's, if one failed)
    shape_mismatch:     [reference shape, candidate shape] of the first output tensor that differs
    dtype_mismatch:     [reference dtype, candidate dtype] (torch.allclose refuses mixed dtypes)
    error, error_side:  a side that raised on this trial's inputs
    nondeterministic:   the candidate's two runs differ bitwise: {"elements", "numel", "max_abs", "at",
                        "where"} (where: the output tensor or stage)
    failed_run:         1 or 2: which of the candidate's runs was out of tolerance first
    captured:           this trial was diffed stage by stage (trial 1, and the first failing one)
    kernelbench:        torch.allclose's own answer where it differs from `allclose` (a --stat other than
                        elementwise, --tolerance auto judged the trial); None where they agree
    """

    trial: int
    seed: int | None
    max_abs: float | None = None
    mean_abs: float | None = None
    allclose: bool = False
    shape_mismatch: list | None = None
    dtype_mismatch: list | None = None
    error: str = ""
    error_side: str = ""
    nondeterministic: dict | None = None
    failed_run: int | None = None
    captured: bool = False
    kernelbench: bool | None = None

    @property
    def failed(self) -> bool:
        return not self.allclose

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["max_abs"], d["mean_abs"] = _num(self.max_abs), _num(self.mean_abs)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Trial":
        kw = {f.name: d[f.name] for f in fields(cls) if f.name in d}
        return cls(**kw)


def bitwise_difference(a: torch.Tensor, b: torch.Tensor) -> dict | None:
    """None when `a` and `b` hold the same bits; else how many elements differ, where the first few
    are, and the largest difference.  Beyond the flags of which elements differ (a byte an element), its
    memory is bounded by BITWISE_CHUNK elements whatever the size (a run-to-run difference in every element
    of a 2 GB output is no reason to run out of device memory)."""
    if tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
        return {"elements": max(a.numel(), b.numel()), "numel": max(a.numel(), b.numel()), "max_abs": float("inf"),
                "at": [], "shape": [list(a.shape), list(b.shape)]}
    a, b = a.detach().contiguous(), b.detach().to(a.device).contiguous()
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    if a.is_floating_point():
        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        mask = a.view(ints) != b.view(ints)
    else:
        mask = a != b
    if a.dim() and mask.dim() > a.dim():  # complex viewed as real: one flag per element
        mask = mask.any(-1)
    n = int(mask.sum())
    if n == 0:
        return None
    at = _first_set(mask, MAX_SHOWN) if mask.dim() else [[]]
    fa, fb, most = a.reshape(-1), b.reshape(-1), 0.0
    for i in range(0, fa.numel(), BITWISE_CHUNK):
        d = (fa[i:i + BITWISE_CHUNK].double() - fb[i:i + BITWISE_CHUNK].double()).abs()
        if a.is_floating_point():
            d = torch.nan_to_num(d, nan=float("inf"))
        most = max(most, float(d.max()))
    return {"elements": n, "numel": mask.numel(), "max_abs": most, "at": at, **_spans(mask)}


BITWISE_CHUNK = 1 << 24  # elements a bitwise comparison works on at once (float64 differences: 128 MB)


def _first_set(mask: torch.Tensor, k: int) -> list[list[int]]:
    """The indices of the first `k` set elements of a contiguous boolean `mask`, in row-major order."""
    flat, found = mask.reshape(-1), []
    for i in range(0, flat.numel(), BITWISE_CHUNK):
        found += (flat[i:i + BITWISE_CHUNK].nonzero().flatten()[:k - len(found)] + i).tolist()
        if len(found) >= k:
            break
    return [list(_unravel(f, tuple(mask.shape))) for f in found]


def _spans(mask: torch.Tensor) -> dict:
    """Where the differing elements lie: "span", [first, last] index along each axis, and "row_span", the
    same over the rows of the [rows, last axis] view (whether a run-to-run difference stays inside one
    block of the output: memory a kernel never wrote)."""
    if mask.dim() == 0:
        return {}
    span = []
    for d in range(mask.dim()):
        along = mask.movedim(d, 0).reshape(mask.shape[d], -1).any(dim=1).nonzero().flatten()
        span.append([int(along.min()), int(along.max())])
    rows = mask.reshape(-1, mask.shape[-1]).any(dim=1).nonzero().flatten()
    return {"span": span, "row_span": [int(rows.min()), int(rows.max())]}


def difference_words(d: dict) -> str:
    """A bitwise difference in words: "37 of 4096 elements differ (first at [0, 3], …), max 0.42"."""
    if d.get("shape"):
        return f"the two runs returned other shapes ({d['shape'][0]} and {d['shape'][1]})"
    at = d.get("at") or []
    where = (" (first at " + ", ".join(str(x) for x in at) + (", …" if d["elements"] > len(at) else "") + ")") \
        if at and at != [[]] else ""
    return f"{d['elements']} of {d['numel']} elements differ{where}, max difference {d['max_abs']:.3g}"


def output_leaves(out: Any) -> dict[str, torch.Tensor]:
    """The tensors of a forward's result by path, named as capture names them: ``output`` for a lone
    tensor (bare or inside a structure), ``output[0]``, ``output[1][key]`` … for several."""
    if isinstance(out, torch.Tensor):
        return {"output": out}
    flat = [(path, v) for path, v in pytree.tree_flatten_with_path(out)[0] if isinstance(v, torch.Tensor)]
    if len(flat) == 1:  # capture names a lone tensor "output" wherever it sits
        return {"output": flat[0][1]}
    return {"output[" + "][".join(str(path_key(k)) for k in path) + "]": v for path, v in flat}


def snapshot_state(model: torch.nn.Module | None) -> dict[str, torch.Tensor]:
    """Copies of a model's buffers (BatchNorm's running statistics, counters …): an extra run
    restores them afterwards so the trials see the state KernelBench's single run per trial leaves."""
    if model is None:
        return {}
    return {n: b.detach().clone() for n, b in buffers_of(model)}


def attribute_state(model: torch.nn.Module | None) -> dict[str, Any]:
    """A model's plain Python attributes (numbers, strings, None) by qualified name: state a forward may
    keep between calls (a call counter, a cached flag) that no buffer holds and no restore puts back."""
    if model is None:
        return {}
    out: dict[str, Any] = {}
    for mname, m in model.named_modules():
        if type(m).__module__.startswith("torch."):
            continue  # torch's own modules: configuration (a lazy module's sizes, set by its first call), not state
        for k, v in vars(m).items():
            if k in _MODULE_OWN or k.startswith("__") or not isinstance(v, (bool, int, float, str, type(None))):
                continue  # (a private `_folded` flag counts; nn.Module's own bookkeeping does not)
            out[f"{mname}.{k}" if mname else k] = v
    return out


_MODULE_OWN = frozenset(vars(torch.nn.Module())) | {"training"}
_MISSING = object()


def parameter_marks(model: torch.nn.Module | None) -> dict[str, tuple]:
    """What shows, at no cost, that a parameter was written: its version counter (an in-place write moves
    it), its address and shape (`.data` given another tensor), by qualified name.  Not seen: a write through
    a `.data` alias, or by a kernel handed the pointer (`parameter_sums` sees those, at the cost of a read)."""
    if model is None:
        return {}
    out = {}
    for n, p in parameters_of(model):
        try:
            out[n] = (p._version, p.data_ptr(), tuple(p.shape))
        except (RuntimeError, AttributeError, NotImplementedError):  # (inference tensors keep no version)
            continue
    return out


class ParameterGuard:
    """The parameters a run of `model` writes into (`parameter_marks` before and after it): their values from
    before the run where they can be had (cloned beforehand for the parameters `known` to be written, handed
    in by a capture that saw the writes, or the tensor `.data` held before it was given another), so that a
    second run can start from the same state (`restore_before`), and their values as the run left them, put
    back after diffkit's extra runs (`put_back`): each trial's first run sees what KernelBench's single run
    per trial would."""

    def __init__(self, model: torch.nn.Module | None, known: Any = ()):
        self.model = model
        self.marks = parameter_marks(model)
        params = dict(parameters_of(model)) if model is not None else {}
        self.known = set(known)  # parameters known to be written (trial 1's capture saw the writes)
        self.pre = {n: params[n].detach().clone() for n in self.known if n in params}
        self.held = {n: p.data for n, p in params.items()}  # (costs nothing: what `.data =` would drop)
        self.kept: dict[str, torch.Tensor] = {}

    def after_run(self, before: dict[str, torch.Tensor] | None = None) -> list[str]:
        """Call once the watched run is over: the parameters it wrote, their values kept (`before`: values
        from before the run a capture kept); those it left as they were are not named."""
        if self.model is None:
            return []
        for n, v in (before or {}).items():
            self.pre.setdefault(n, v)
        now = parameter_marks(self.model)
        params = dict(parameters_of(self.model))
        names = [n for n, m in now.items() if (n in self.marks and self.marks[n] != m) or n in self.known
                 or n in (before or {})]
        self.kept = {n: params[n].detach().clone() for n in names}
        for n in names:  # `.data` given another tensor: the one it held is what it was
            if n not in self.pre and self.marks.get(n, (None, None))[1:] != now[n][1:] and n in self.held:
                self.pre[n] = self.held[n]
        return [n for n in names if n not in self.pre or not _same_values(self.pre[n], self.kept[n])]

    def restore_before(self) -> bool:
        """Put the parameters the run wrote back to their values from before it: whether all of them could
        be (a second run then starts from the first's state; where not, it starts from what the first left)."""
        restore_parameters(self.model, {n: self.pre[n] for n in self.kept if n in self.pre})
        return all(n in self.pre for n in self.kept)

    def put_back(self) -> None:
        restore_parameters(self.model, self.kept)

    def moved_since(self, name: str) -> bool:
        """Whether parameter `name` now holds other values than the watched run left (True when not kept)."""
        v = self.kept.get(name)
        p = dict(parameters_of(self.model)).get(name) if self.model is not None else None
        return v is None or p is None or not _same_values(v, p.detach())


def all_parameters(model: torch.nn.Module | None) -> dict[str, torch.Tensor]:
    """A copy of every parameter's values by qualified name."""
    if model is None:
        return {}
    return {n: p.detach().clone() for n, p in parameters_of(model)}


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shapes, dtypes and values (NaN where the other holds NaN counts as equal)."""
    if tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
        return False
    b = b.to(a.device)
    if torch.equal(a, b):
        return True
    return bool(a.is_floating_point() and ((a == b) | (a.isnan() & b.isnan())).all())


def restore_parameters(model: torch.nn.Module | None, kept: dict[str, torch.Tensor]) -> None:
    """Put the parameters in `kept` (by qualified name) back to those values (one whose `.data` was given
    a tensor of another shape or kind since gets a copy of the kept one as its `.data`)."""
    if kept and model is not None:
        _put_back(parameters_of(model), kept, replace=True)


def _put_back(named: list[tuple[str, torch.Tensor]], kept: dict[str, torch.Tensor], replace: bool = False) -> None:
    with torch.no_grad():
        for n, t in named:
            v = kept.get(n)
            if v is None:
                continue
            if tuple(t.shape) == tuple(v.shape) and not (replace and (t.dtype, t.device) != (v.dtype, v.device)):
                t.copy_(v)
            elif replace:
                t.data = v.clone()


_SAME_SIZE_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_SUM_CHUNK = 1 << 20


def parameter_sums(model: torch.nn.Module | None) -> dict[str, int]:
    """A checksum of each parameter's bits by qualified name (its elements read as integers of their size,
    each weighted by its position, summed with wrap-around): moves with any write, the ones no version
    counter sees included (through `.data`, or a kernel handed the parameter's pointer), a permutation of
    its values too.  One reduction per parameter, one read per device; run only where a rerun differed."""
    if model is None:
        return {}
    by_device: dict[Any, tuple[list[str], list[torch.Tensor]]] = {}
    for n, p in parameters_of(model):
        t = p.detach()
        as_int = _SAME_SIZE_INT.get(t.element_size())
        if t.numel() == 0 or t.is_meta or t.is_complex() or as_int is None:
            continue
        try:
            flat = t.reshape(-1).view(as_int)
            total = torch.zeros((), dtype=torch.int64, device=t.device)
            for lo in range(0, flat.numel(), _SUM_CHUNK):  # (temporaries of one chunk at a time)
                part = flat[lo:lo + _SUM_CHUNK].to(torch.int64)
                total += (part * (torch.arange(lo, lo + part.numel(), device=t.device) % 65521 + 1)).sum()
        except (RuntimeError, TypeError):
            continue
        names, sums = by_device.setdefault(t.device, ([], []))
        names.append(n)
        sums.append(total)
    out: dict[str, int] = {}
    for names, sums in by_device.values():
        out.update(zip(names, torch.stack(sums).tolist()))
    return out


WRITTEN_PARAMETER = " (a parameter, written in place)"


def written_parameters(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """Words for the parameters a forward wrote into (`parameter_marks` or `parameter_sums` before and
    after it)."""
    return [n + WRITTEN_PARAMETER for n, v in after.items() if n in before and before[n] != v]


def restore_attributes(model: torch.nn.Module | None, snap: dict[str, Any]) -> None:
    """Put a model's plain attributes back to an `attribute_state` (those that differ; those made since go)."""
    if model is None:
        return
    modules = dict(model.named_modules())
    for qual in set(attribute_state(model)) - set(snap):  # made since (a flag set by the first call): gone again
        mname, _, attr = qual.rpartition(".")
        try:
            delattr(modules[mname], attr)
        except (KeyError, AttributeError):
            pass
    for qual, v in snap.items():
        mname, _, attr = qual.rpartition(".")
        m = modules.get(mname)
        if m is None:
            continue
        now = vars(m).get(attr, _MISSING)
        if now is v or (isinstance(now, (bool, int, float, str, type(None))) and now == v):
            continue
        setattr(m, attr, v)  # (whatever it holds now, an array or a tensor made since included, or nothing)


def to_first_state(model: torch.nn.Module, buffers: dict, attrs: dict | None, guard: ParameterGuard | None) -> bool:
    """Put a model back to the state its first run started from (before a second run of the same trial):
    buffers (`snapshot_state`), plain attributes (`attribute_state`), and the parameters that run wrote where
    their values from before it are known -- whether all of them were (`attrs` None: left as they are)."""
    restore_state(model, buffers)
    if attrs is not None:
        restore_attributes(model, attrs)
    return guard.restore_before() if guard is not None else True


def to_where_it_left(model: torch.nn.Module, buffers: dict | None, guard: ParameterGuard | None, whole: dict,
                     attrs: dict | None) -> None:
    """Put a model back to the state its first run left (after diffkit's extra runs of the same trial): its
    buffers (`buffers`; None: left as they are), the parameters it wrote (`guard`), every parameter where its
    attributes moved (`whole`: a run from its first state may have repeated a one-time step) and its plain
    attributes (None where they were not recorded: left as they are, not all removed)."""
    if buffers is not None:
        restore_state(model, buffers)
    if guard is not None:
        guard.put_back()
    restore_parameters(model, whole)
    if attrs is not None:
        restore_attributes(model, attrs)


def changed_attributes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """Words for the attributes whose values differ between two `attribute_state`s: "calls (0 → 1)"."""
    return [f"{n} ({before[n]!r:.20} → {after[n]!r:.20})" if n in before else f"{n} (made: {after[n]!r:.20})"
            for n in after if n not in before or (before[n] != after[n] and not (before[n] != before[n]
                                                                                and after[n] != after[n]))]


def restore_state(model: torch.nn.Module | None, snap: dict[str, torch.Tensor]) -> None:
    """Put a model's buffers back to a `snapshot_state` (those of the same shape)."""
    if model is not None and snap:
        _put_back(buffers_of(model), snap)


# ----------------------------------------------------------------------------------- a side's state around its run
@dataclass
class SideState:
    """One live model's state around its captured forward (the pipeline records it; its extra runs -- the
    health check, the second run, replays, what-if runs -- start from it and put it back).

    before, after:             its buffers before and after the forward (`snapshot_state`)
    attrs_before, attrs_after: its plain attributes before and after (`attribute_state`)
    attributes:                words for what the forward changed of its own state: attributes
                               (`changed_attributes`), then parameters it wrote (+ WRITTEN_PARAMETER)
    parameters:                the ParameterGuard of the run (the values it wrote, put back after the reruns)
    stateful:                  {"parameters", "attributes"} when it changed either, else None
    whole:                     every parameter as the first run left it, kept for the candidate's second run
                               when its attributes moved (else empty)"""

    before: dict
    after: dict
    attrs_before: dict
    attrs_after: dict
    attributes: list[str]
    parameters: ParameterGuard
    stateful: dict | None = None
    whole: dict = field(default_factory=dict)


@dataclass
class Sides:
    """Both sides' `SideState` (None for a side that is no live model, or not run yet)."""

    ref: SideState | None = None
    cand: SideState | None = None
