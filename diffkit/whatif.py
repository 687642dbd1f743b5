"""What-if runs: which one kernel mistake, planted in the reference, reproduces the candidate?

When the candidate's divergent record covers several reference stages (a fused kernel: nothing
between its input and its output can be compared), localisation by capture cannot see inside it.
The reference can still answer the writer's question: run it again with one plausible mistake
planted at one of those stages, and see whether it then agrees with the candidate.

A mistake is a `Variant`: a catalogue `kind`, the reference record (`site`) it replaces, and how
(`apply(call, out)`: the live call that made the record and its result, to the value the mistaken
kernel would have produced).  It is planted through the capture machinery (`capture._State.mutator`):
the record's tensor is overwritten in place as it is recorded, so the rest of the forward reads it;
the user's source is never edited.  `catalogue(site, ...)` lists the variants that apply to a
record; `search(...)` runs them (one forward each, stopped at the divergent stage) and ranks them by
how closely the mutated reference reproduces the candidate there.

The catalogue (`KINDS`): drop_bias, extra_bias, running_stats, batch_stats, unbiased_variance,
biased_variance, epsilon, reduce_axis, scale, transposed_weight, transposed_operand,
swapped_operands, tanh_gelu, erf_gelu, low_precision, unwritten_tail, clamp, sign_flip,
unstable_softmax.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from .capture import Record, StopCapture, Trace
from .measure import Stats, measure_async

KINDS = ("drop_bias", "extra_bias", "running_stats", "batch_stats", "unbiased_variance", "biased_variance",
         "epsilon", "reduce_axis", "scale", "transposed_weight", "transposed_operand", "swapped_operands",
         "tanh_gelu", "erf_gelu", "low_precision", "unwritten_tail", "clamp", "sign_flip", "unstable_softmax")
# the order variants are tried in, and which of two equally good explanations is named first: the
# mistakes kernel writers make most often (from the seeds and the field notes) come first
PRIOR = {k: i for i, k in enumerate(("drop_bias", "scale", "transposed_weight", "swapped_operands",
                                     "transposed_operand", "reduce_axis", "unbiased_variance", "running_stats",
                                     "batch_stats", "biased_variance", "tanh_gelu", "erf_gelu", "unwritten_tail",
                                     "sign_flip", "extra_bias", "unstable_softmax", "low_precision", "epsilon",
                                     "clamp"))}
assert set(PRIOR) == set(KINDS)

DEFAULT_BUDGET = 1000  # forwards of the reference a search may spend
EPSILONS = (1e-5, 1e-6, 1e-12, 1e-8, 1e-3)
TAIL_BLOCKS = (8, 16, 32, 64, 128, 256)

Call = tuple  # (kind "op"|"module", function or module, args, kwargs)


@dataclass
class Variant:
    """One planted mistake: `kind` (catalogue name) at reference record `site` (named `stage`)."""

    kind: str
    site: int
    stage: str
    detail: str  # what the mistaken kernel does, in words ("normalises with its running statistics")
    apply: Callable[[Call, torch.Tensor], torch.Tensor]  # (the live call, its result) -> the mistaken result
    before: Callable[[torch.nn.Module, tuple], None] | None = None  # sees each module call before it runs
    fn: Any = None  # the function or module that made the site's record (a run out of step is caught by it)
    aliases: tuple = ()  # the site record's other names


@dataclass
class WhatIf:
    """How close one variant (or two at once) brings the reference to the candidate at the divergent stage."""

    variants: list[Variant]
    stats: Stats  # the candidate against the mutated reference (NaN where both hold NaN agrees here)
    rel_l2: float  # ||c - r'|| / ||r'||
    same_code: bool = False  # one mistake made at every call of the same code (a kernel used twice)

    @property
    def explains(self) -> bool:
        return self.stats.mismatches == 0

    @property
    def mistakes(self) -> int:
        """How many different mistakes it plants (the same one at every call of a kernel counts once)."""
        return 1 if self.same_code else len(self.variants)

    def to_dict(self, before: Stats) -> dict:
        v = self.variants
        if self.same_code:
            kind = v[0].kind
            where = ", ".join(x.stage for x in v)
            detail = f"{v[0].detail.replace(f'`{v[0].stage}`', 'the same code')} (at every call: {where})"
        else:
            kind, detail = "+".join(dict.fromkeys(x.kind for x in v)), "; ".join(x.detail for x in v)
        return {"kind": kind, "stage": ", ".join(x.stage for x in v), "same_code": self.same_code,
                "detail": detail, "max_abs_before": before.max_abs,
                "max_abs_after": self.stats.max_abs, "explains": self.explains,
                "mismatches_after": self.stats.mismatches, "rel_l2_after": self.rel_l2,
                "mutations": [{"kind": x.kind, "stage": x.stage, "detail": x.detail, "aliases": list(x.aliases)}
                              for x in v]}


# ------------------------------------------------------------------------------------------ sites
_LAYOUT = {"reshape", "view", "permute", "transpose", "unbind", "chunk", "split", "contiguous", "expand",
           "__getitem__", "getitem", "squeeze", "unsqueeze", "flatten", "unflatten", "t", "narrow", "select",
           "view_as", "reshape_as", "expand_as", "movedim", "swapaxes", "split_with_sizes", "clone", "detach",
           "to", "float", "half", "double", "type", "cat", "stack", "repeat", "tile", "flip", "roll", "pad",
           "dim", "size", "numel", "masked_fill", "zeros_like", "ones_like", "empty_like", "full_like"}


def _name(fn: Any) -> str:
    """A module's class name; a function's name, lower case without a trailing `_` (dunders as they are)."""
    if isinstance(fn, torch.nn.Module):
        return type(fn).__name__
    name = getattr(fn, "__name__", "")
    return name if name.startswith("__") else (name or str(fn)).lower().rstrip("_")


def _call_of(rec: Record) -> tuple | None:
    """(kind, function or module, argument template) of the call that made a record, or None."""
    if rec.call is None:
        return None
    (kind, fn, tmpl), _pos = rec.call
    if kind not in ("op", "module"):
        return None
    return kind, fn, tmpl


def is_site(rec: Record) -> bool:
    """Whether a record computes something a kernel could get wrong (not a view or a copy)."""
    c = _call_of(rec)
    if c is None or rec.kind not in ("op", "module") or not rec.dtype.is_floating_point:
        return False
    name = _name(c[1])
    return name not in _LAYOUT and name.strip("_") not in _LAYOUT


def _args(call: Call) -> tuple[tuple, dict]:
    _, _, args, kwargs = call
    return tuple(args), dict(kwargs)


def _arg(call: Call, i: int, key: str, default: Any = None) -> Any:
    args, kwargs = _args(call)
    if key in kwargs:
        return kwargs[key]
    return args[i] if len(args) > i else default


def _tmpl_args(tmpl: Any) -> tuple[tuple, dict]:
    try:
        args, kwargs = tmpl
        return tuple(args), dict(kwargs or {})
    except (TypeError, ValueError):
        return (), {}


def _static_arg(tmpl: Any, i: int, key: str, default: Any = None) -> Any:
    args, kwargs = _tmpl_args(tmpl)
    if key in kwargs:
        return kwargs[key]
    return args[i] if len(args) > i else default


# ------------------------------------------------------------------------------------------ helpers
def _bias_view(b: torch.Tensor, out: torch.Tensor, channel_dim: int) -> torch.Tensor:
    shape = [1] * out.dim()
    shape[channel_dim] = b.numel()
    return b.reshape(shape)


def _redo(call: Call, replace: dict[int | str, Any] | None = None, fn: Callable | None = None) -> torch.Tensor:
    """Call the op again with some arguments replaced (positions or keywords)."""
    kind, f, args, kwargs = call
    args, kwargs = list(args), dict(kwargs)
    for k, v in (replace or {}).items():
        if isinstance(k, int):
            args[k] = v
        else:
            kwargs[k] = v
    return (fn or f)(*args, **kwargs)


def _cast_tensors(obj: Any, dtype: torch.dtype) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast_tensors(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: _cast_tensors(v, dtype) for k, v in obj.items()}
    return obj


def _tf32(t: torch.Tensor) -> torch.Tensor:
    """float32 values rounded to TF32's 10-bit mantissa (round to nearest), as tensor cores read them."""
    if t.dtype != torch.float32:
        return t
    bits = t.contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32).reshape(t.shape)


def _map_float(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj) if obj.is_floating_point() else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_float(o, fn) for o in obj)
    if isinstance(obj, dict):
        return {k: _map_float(v, fn) for k, v in obj.items()}
    return obj


_BN_MODULES = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d)
_LINEAR_OPS = {"linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "einsum", "__matmul__", "__rmatmul__",
               "tensordot"}
_REDUCE_OPS = {"mean", "sum", "amax", "amin", "norm", "logsumexp", "prod", "std", "var"}


def _dims_of(x: torch.Tensor) -> list[int]:
    return [d for d in range(x.dim()) if x.shape[d] > 1]


def _module_forward(m: torch.nn.Module, x: torch.Tensor, **change) -> torch.Tensor:
    """A LayerNorm / BatchNorm / Linear / Conv module's forward by its functional form, some
    settings changed (eps, training, weight …), without touching the module."""
    if isinstance(m, torch.nn.LayerNorm):
        return F.layer_norm(x, m.normalized_shape, change.get("weight", m.weight), change.get("bias", m.bias),
                            change.get("eps", m.eps))
    if isinstance(m, _BN_MODULES):
        training = change.get("training", m.training or m.running_mean is None)
        rm = change.get("running_mean", None if training else m.running_mean)
        rv = change.get("running_var", None if training else m.running_var)
        return F.batch_norm(x, rm, rv, m.weight, m.bias, training, 0.0, change.get("eps", m.eps))
    if isinstance(m, torch.nn.Linear):
        return F.linear(x, change.get("weight", m.weight), change.get("bias", m.bias))
    if isinstance(m, (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)):
        return m._conv_forward(x, change.get("weight", m.weight), change.get("bias", m.bias))
    if isinstance(m, torch.nn.GroupNorm):
        return F.group_norm(x, m.num_groups, m.weight, m.bias, change.get("eps", m.eps))
    raise TypeError(type(m).__name__)


def _layer_norm_unbiased(x: torch.Tensor, shape: Sequence[int], w, b, eps: float) -> torch.Tensor:
    dims = tuple(range(x.dim() - len(shape), x.dim()))
    mean = x.mean(dims, keepdim=True)
    var = x.var(dims, keepdim=True, correction=1)
    y = (x - mean) / torch.sqrt(var + eps)
    if w is not None:
        y = y * w
    if b is not None:
        y = y + b
    return y


def _group_norm_unbiased(x: torch.Tensor, groups: int, w, b, eps: float) -> torch.Tensor:
    g = x.reshape(x.shape[0], groups, -1)
    y = ((g - g.mean(-1, keepdim=True)) / torch.sqrt(g.var(-1, keepdim=True, correction=1) + eps)).reshape(x.shape)
    if w is not None:
        y = y * _bias_view(w, y, 1)
    if b is not None:
        y = y + _bias_view(b, y, 1)
    return y


# ------------------------------------------------------------------------------------------ catalogue
def catalogue(rec: Record, model: torch.nn.Module | None, constants: Sequence[float] = (),
              shapes: dict[int, tuple] | None = None) -> list[Variant]:
    """Every variant of the catalogue that applies to reference record `rec`.  `constants`: scalar
    settings of the model (temperatures, scales, sizes) a missing or extra factor may come from;
    `shapes`: the shapes of the trace's records by index (what an op's inputs looked like)."""
    shapes = shapes or {}
    c = _call_of(rec)
    if c is None or not is_site(rec):
        return []
    kind, fn, tmpl = c
    name = _name(fn)
    out: list[Variant] = []
    site, stage = rec.index, rec.name

    def add(k: str, detail: str, apply, before=None):
        out.append(Variant(k, site, stage, detail, apply, before, fn, tuple(rec.aliases)))

    shape = tuple(rec.shape)
    # --- bias
    if kind == "module" and isinstance(fn, (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)) \
            and fn.bias is not None:
        ch = -1 if isinstance(fn, torch.nn.Linear) else 1
        add("drop_bias", f"`{stage}` computed without its bias",
            lambda call, o, m=fn, ch=ch: o - _bias_view(m.bias, o, ch if ch >= 0 else o.dim() - 1))
        add("extra_bias", f"`{stage}` adds its bias twice",
            lambda call, o, m=fn, ch=ch: o + _bias_view(m.bias, o, ch if ch >= 0 else o.dim() - 1))
    if kind == "op" and name in ("linear", "addmm", "baddbmm", "addmv"):
        pos, key = (2, "bias") if name == "linear" else (0, "input")
        b = _static_arg(tmpl, pos, key)
        if isinstance(b, torch.Tensor):
            add("drop_bias", f"`{stage}` computed without its bias",
                lambda call, o, pos=pos, key=key: o - _arg(call, pos, key))
            add("extra_bias", f"`{stage}` adds its bias twice",
                lambda call, o, pos=pos, key=key: o + _arg(call, pos, key))
    if kind == "op" and name in ("add", "__add__", "__radd__") and any(p.endswith("bias") for p in rec.params):
        args, _ = _tmpl_args(tmpl)
        for i, a in enumerate(args[:2]):
            if isinstance(a, torch.Tensor) and a.dim() == 1 and shape and a.numel() == shape[-1]:
                add("drop_bias", f"`{stage}` computed without its bias", lambda call, o, i=i: o - _args(call)[0][i])
                add("extra_bias", f"`{stage}` adds its bias twice", lambda call, o, i=i: o + _args(call)[0][i])
                break
    # --- normalisation
    if kind == "module" and isinstance(fn, _BN_MODULES):
        if fn.training and fn.running_mean is not None:
            held: dict = {}

            def snap(m, args, bn=fn, held=held):
                if m is bn:
                    held["stats"] = (bn.running_mean.detach().clone(), bn.running_var.detach().clone())

            add("running_stats", f"`{stage}` normalises with its running statistics instead of the batch's",
                lambda call, o, m=fn, held=held: _module_forward(m, _args(call)[0][0], training=False,
                                                                  running_mean=held["stats"][0],
                                                                  running_var=held["stats"][1]), snap)
        if not fn.training:
            add("batch_stats", f"`{stage}` normalises with the batch's statistics instead of its running ones",
                lambda call, o, m=fn: _module_forward(m, _args(call)[0][0], training=True))
        if fn.training or fn.running_mean is None:
            def bn_unbiased(call, o, m=fn):
                x = _args(call)[0][0]
                dims = [0] + list(range(2, x.dim()))
                mean = x.mean(dims, keepdim=True)
                var = x.var(dims, keepdim=True, correction=1)
                y = (x - mean) / torch.sqrt(var + m.eps)
                if m.weight is not None:
                    y = y * _bias_view(m.weight, y, 1) + _bias_view(m.bias, y, 1)
                return y
            add("unbiased_variance", f"`{stage}` divides the batch variance by N-1", bn_unbiased)
    if kind == "module" and isinstance(fn, torch.nn.LayerNorm):
        add("unbiased_variance", f"`{stage}` divides the variance by N-1",
            lambda call, o, m=fn: _layer_norm_unbiased(_args(call)[0][0], m.normalized_shape, m.weight, m.bias,
                                                       m.eps))
    if kind == "module" and isinstance(fn, torch.nn.GroupNorm):
        add("unbiased_variance", f"`{stage}` divides each group's variance by N-1",
            lambda call, o, m=fn: _group_norm_unbiased(_args(call)[0][0], m.num_groups, m.weight, m.bias, m.eps))
    if kind == "op" and name == "group_norm":
        add("unbiased_variance", f"`{stage}` divides each group's variance by N-1",
            lambda call, o: _group_norm_unbiased(_arg(call, 0, "input"), _arg(call, 1, "num_groups"),
                                                 _arg(call, 2, "weight"), _arg(call, 3, "bias"),
                                                 _arg(call, 4, "eps", 1e-5)))
    if kind == "module" and isinstance(fn, _BN_MODULES + (torch.nn.LayerNorm, torch.nn.GroupNorm)):
        for eps in EPSILONS:
            if not math.isclose(eps, fn.eps):
                add("epsilon", f"`{stage}` uses eps={eps:g} (not {fn.eps:g})",
                    lambda call, o, m=fn, eps=eps: _module_forward(m, _args(call)[0][0], eps=eps))
    if kind == "op" and name == "layer_norm":
        cur = _static_arg(tmpl, 4, "eps", 1e-5)
        add("unbiased_variance", f"`{stage}` divides the variance by N-1",
            lambda call, o: _layer_norm_unbiased(_arg(call, 0, "input"), _arg(call, 1, "normalized_shape"),
                                                 _arg(call, 2, "weight"), _arg(call, 3, "bias"),
                                                 _arg(call, 4, "eps", 1e-5)))
        for eps in EPSILONS:
            if not math.isclose(eps, float(cur)):
                add("epsilon", f"`{stage}` uses eps={eps:g} (not {float(cur):g})",
                    lambda call, o, eps=eps: _redo(call, {"eps": eps} if "eps" in call[3] else {4: eps}))
    if kind == "op" and name in ("var", "std"):
        corr = _static_arg(tmpl, 99, "correction", None)
        unb = _static_arg(tmpl, 99, "unbiased", None)
        unbiased_now = not (corr == 0 or unb is False)

        def corrected(call, o, unbiased_now=unbiased_now, sq=name == "std"):
            n = _args(call)[0][0].numel() / max(1, o.numel())
            if n <= 1:
                raise _NotApplicable()
            f = (n - 1) / n if unbiased_now else n / (n - 1)
            return o * (math.sqrt(f) if sq else f)
        add("biased_variance" if unbiased_now else "unbiased_variance",
            f"`{stage}` divides by {'N' if unbiased_now else 'N-1'}, not {'N-1' if unbiased_now else 'N'}", corrected)
    if kind == "op" and name in ("add", "__add__", "__radd__"):
        args, _ = _tmpl_args(tmpl)
        small = [a for a in args[:2] if isinstance(a, float) and 0 < a <= 1e-2]
        if small:
            cur = small[0]
            for eps in EPSILONS:
                if not math.isclose(eps, cur):
                    add("epsilon", f"`{stage}` adds eps={eps:g} (not {cur:g})",
                        lambda call, o, cur=cur, eps=eps: o - cur + eps)
    # --- reductions over another axis
    soft = (kind == "module" and isinstance(fn, (torch.nn.Softmax, torch.nn.LogSoftmax))) or \
           (kind == "op" and name in ("softmax", "log_softmax"))
    if soft:
        cur = fn.dim if kind == "module" else _static_arg(tmpl, 1, "dim")
        log = (kind == "module" and isinstance(fn, torch.nn.LogSoftmax)) or name == "log_softmax"
        if isinstance(cur, int):
            cur %= len(shape)
            for d in range(len(shape)):
                if d != cur and shape[d] > 1:
                    add("reduce_axis", f"`{stage}` normalised over axis {d} (not {cur})",
                        lambda call, o, d=d, log=log: (F.log_softmax if log else F.softmax)(
                            _args(call)[0][0], dim=d))
            add("unstable_softmax", f"`{stage}` without subtracting the row maximum (exp overflows)",
                lambda call, o, d=cur, log=log: _unstable(_args(call)[0][0], d, log))
    if kind == "op" and name in _REDUCE_OPS and rec.inputs:
        cur = _static_arg(tmpl, 1, "dim")
        x_shape = shapes.get(rec.inputs[0].index)
        if isinstance(cur, int) and x_shape:
            cur %= len(x_shape)
            for d in range(len(x_shape)):
                if d != cur and x_shape[d] == x_shape[cur]:
                    add("reduce_axis", f"`{stage}` reduced over axis {d} (not {cur})",
                        lambda call, o, d=d: _redo(call, {"dim": d} if "dim" in call[3] else {1: d}))
    # --- GELU
    gelu = (kind == "module" and isinstance(fn, torch.nn.GELU)) or (kind == "op" and name == "gelu")
    if gelu:
        approx = fn.approximate if kind == "module" else _static_arg(tmpl, 1, "approximate", "none")
        if approx == "none":
            add("tanh_gelu", f"`{stage}` uses the tanh approximation of GELU",
                lambda call, o: F.gelu(_args(call)[0][0], approximate="tanh"))
        else:
            add("erf_gelu", f"`{stage}` uses the exact (erf) GELU, not the tanh approximation",
                lambda call, o: F.gelu(_args(call)[0][0], approximate="none"))
    # --- weights and operands
    lin_w = None
    if kind == "module" and isinstance(fn, torch.nn.Linear):
        lin_w = fn.weight
    elif kind == "op" and name == "linear":
        w = _static_arg(tmpl, 1, "weight")
        lin_w = w if isinstance(w, torch.Tensor) else None
    if lin_w is not None and lin_w.dim() == 2:
        o_, i_ = lin_w.shape
        if o_ % i_ == 0 and i_ > 1:
            k = o_ // i_

            def transposed(w, k=k, i_=i_):
                return w.reshape(k, i_, i_).transpose(1, 2).reshape(k * i_, i_)
            words = "transposed" if k == 1 else f"transposed block by block ({k} square blocks)"
            if kind == "module":
                add("transposed_weight", f"`{stage}` uses its weight {words}",
                    lambda call, o, m=fn: _module_forward(m, _args(call)[0][0], weight=transposed(m.weight)))
            else:
                add("transposed_weight", f"`{stage}` uses its weight {words}",
                    lambda call, o: _redo(call, {"weight": transposed(_arg(call, 1, "weight"))} if "weight" in call[3]
                                          else {1: transposed(_arg(call, 1, "weight"))}))
    if lin_w is not None and lin_w.dim() == 2 and lin_w.shape[0] != lin_w.shape[1]:
        o_, i_ = lin_w.shape

        def reread(w, o_=o_, i_=i_):
            return w.reshape(i_, o_).t()  # x @ W.view(i, o): the memory of W read in the transposed shape
        words = f"reads its [{o_}, {i_}] weight's memory as an [{i_}, {o_}] matrix (x @ W.view({i_}, {o_}))"
        if kind == "module":
            add("transposed_weight", f"`{stage}` {words}",
                lambda call, o, m=fn: _module_forward(m, _args(call)[0][0], weight=reread(m.weight)))
        else:
            add("transposed_weight", f"`{stage}` {words}",
                lambda call, o: _redo(call, {"weight": reread(_arg(call, 1, "weight"))} if "weight" in call[3]
                                      else {1: reread(_arg(call, 1, "weight"))}))
    if kind == "op" and name in ("matmul", "__matmul__", "bmm", "einsum", "__rmatmul__"):
        first = 1 if name == "einsum" else 0
        for j in (0, 1):
            add("transposed_operand", f"`{stage}` reads operand {j + 1} transposed (last two axes)",
                lambda call, o, j=j, first=first: _transpose_operand(call, first + j))
        if name == "einsum":
            add("swapped_operands", f"`{stage}` with its two operands swapped",
                lambda call, o: _swap_einsum(call))
        elif len(shape) >= 2 and shape[-1] == shape[-2]:
            add("swapped_operands", f"`{stage}` with its operands' roles swapped (result[j, i] for [i, j])",
                lambda call, o: o.transpose(-1, -2).contiguous())
    # --- factors
    factors = _factors(rec, tmpl, name, kind, constants, [shapes[r.index] for r in rec.inputs if r.index in shapes])
    for f, why in factors:
        add("scale", f"`{stage}` multiplied by {f:.6g} ({why})", lambda call, o, f=f: o * f)
    # --- precision
    lowp = kind == "module" and isinstance(fn, (torch.nn.Linear, torch.nn.LayerNorm, torch.nn.Conv1d,
                                                torch.nn.Conv2d, torch.nn.Conv3d)) or \
        (kind == "op" and (name in _LINEAR_OPS or name in ("softmax", "log_softmax", "layer_norm", "gelu", "silu",
                                                           "sigmoid", "tanh", "exp", "sum", "mean")))
    if lowp and rec.dtype == torch.float32:
        for dt, label in ((torch.float16, "float16"), (torch.bfloat16, "bfloat16")):
            add("low_precision", f"`{stage}` computed in {label}", lambda call, o, dt=dt: _in_dtype(call, dt))
        if kind == "module" and isinstance(fn, (torch.nn.Linear,)) or name in _LINEAR_OPS:
            add("low_precision", f"`{stage}` computed in TF32 (inputs rounded to a 10-bit mantissa)",
                lambda call, o: _in_tf32(call))
    if rec.dtype == torch.float32:
        for dt, label in ((torch.bfloat16, "bfloat16"), (torch.float16, "float16")):
            add("low_precision", f"`{stage}` stored in {label}", lambda call, o, dt=dt: o.to(dt).to(o.dtype))
        if kind == "op" and name in ("einsum", "matmul", "__matmul__", "bmm", "mm") or \
                kind == "module" and isinstance(fn, torch.nn.Linear):
            for dt, label in ((torch.bfloat16, "bfloat16"), (torch.float16, "float16")):
                add("low_precision", f"`{stage}` accumulated in {label} (a running sum rounded at every step)",
                    lambda call, o, dt=dt: _accumulated(call, dt))
    # --- tails
    for d in range(len(shape) - 1, -1, -1):
        n = shape[d]
        starts = sorted({n - n % b for b in TAIL_BLOCKS if n > b and n % b}, reverse=True)
        for start in starts:
            add("unwritten_tail", f"`{stage}` leaves axis {d} from {start} on ({n - start} of {n}) unwritten (zero)",
                lambda call, o, d=d, start=start: _zero_tail(o, d, start))
    if len(shape) > 2:
        # the leading axes flattened into rows of a matrix (a kernel tiling [rows, features])
        rows = math.prod(shape[:-1])
        for start in sorted({rows - rows % b for b in TAIL_BLOCKS if rows > b and rows % b}, reverse=True):
            add("unwritten_tail", f"`{stage}` leaves rows {start}..{rows - 1} of its [{rows}, {shape[-1]}] matrix "
                                  f"view unwritten (zero)",
                lambda call, o, start=start: _zero_row_tail(o, start))
    numel = math.prod(shape)
    if len(shape) > 1:
        for start in sorted({numel - numel % b for b in TAIL_BLOCKS if numel > b and numel % b}, reverse=True):
            add("unwritten_tail", f"`{stage}` leaves its last {numel - start} elements (flat) unwritten (zero)",
                lambda call, o, start=start: _zero_flat_tail(o, start))
    # --- sign, saturation
    add("sign_flip", f"`{stage}` negated", lambda call, o: -o)
    add("clamp", f"`{stage}` clamped at 0 (a stray ReLU)", lambda call, o: o.clamp_min(0))
    if rec.dtype == torch.float32:
        add("clamp", f"`{stage}` saturated to float16's range (±65504)", lambda call, o: o.clamp(-65504.0, 65504.0))
    return out


class _NotApplicable(StopCapture):
    """A variant that turns out, on the live call, not to apply: the forward stops there."""


def _unstable(x: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
    e = torch.exp(x)
    y = e / e.sum(dim, keepdim=True)
    return torch.log(y) if log else y


def _transpose_operand(call: Call, i: int) -> torch.Tensor:
    kind, fn, args, kwargs = call
    args = list(args)
    if i >= len(args) or not isinstance(args[i], torch.Tensor) or args[i].dim() < 2 or \
            args[i].shape[-1] != args[i].shape[-2]:
        raise _NotApplicable()
    args[i] = args[i].transpose(-1, -2)
    return fn(*args, **kwargs)


def _swap_einsum(call: Call) -> torch.Tensor:
    kind, fn, args, kwargs = call
    if len(args) != 3 or not all(isinstance(a, torch.Tensor) for a in args[1:]) or args[1].shape != args[2].shape:
        raise _NotApplicable()
    return fn(args[0], args[2], args[1], **kwargs)


def _zero_tail(o: torch.Tensor, d: int, start: int) -> torch.Tensor:
    y = o.clone()
    y.narrow(d, start, o.shape[d] - start).zero_()
    return y


def _zero_row_tail(o: torch.Tensor, start: int) -> torch.Tensor:
    y = o.contiguous().clone()
    y.view(-1, o.shape[-1])[start:].zero_()
    return y.reshape(o.shape)


def _zero_flat_tail(o: torch.Tensor, start: int) -> torch.Tensor:
    y = o.contiguous().clone()
    y.view(-1)[start:].zero_()
    return y.reshape(o.shape)


MAX_ACCUMULATION_STEPS = 4096


def _accumulated(call: Call, dt: torch.dtype) -> torch.Tensor:
    """A contraction whose running sum is kept in `dt`: products in float32, added one reduction
    step at a time, the sum rounded to `dt` after every step (a kernel with a half accumulator)."""
    kind, fn, args, kwargs = call
    if kind == "module":
        x, w, b = _args(call)[0][0], fn.weight, fn.bias
        eq, ops = "...k,nk->...n", [x, w]
    elif _name(fn) == "einsum":
        eq, ops = args[0], list(args[1:])
        if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
            ops = list(ops[0])
        b = None
    else:
        a_, b_ = args[0], args[1]
        if a_.dim() < 2 or b_.dim() < 2:
            raise _NotApplicable()
        eq, ops, b = "...ik,...kj->...ij", [a_, b_], None
    if len(ops) != 2 or "->" not in eq:
        raise _NotApplicable()
    lhs, out_sub = eq.replace(" ", "").split("->")
    subs = lhs.split(",")
    summed = [c for c in dict.fromkeys(subs[0] + subs[1]) if c not in out_sub and c != "."]
    if len(summed) != 1:
        raise _NotApplicable()
    k = summed[0]
    dims = [sub.replace("...", "").index(k) - len(sub.replace("...", "")) for sub in subs]
    n = ops[0].shape[dims[0]]
    if n > MAX_ACCUMULATION_STEPS or ops[1].shape[dims[1]] != n:
        raise _NotApplicable()
    step_eq = ",".join(sub.replace(k, "") for sub in subs) + "->" + out_sub
    acc = None
    for i in range(n):
        part = torch.einsum(step_eq, ops[0].select(dims[0], i), ops[1].select(dims[1], i)).float()
        acc = part.to(dt) if acc is None else (acc.float() + part).to(dt)
    y = acc.float()
    if b is not None:
        y = y + b
    return y


def _in_dtype(call: Call, dt: torch.dtype) -> torch.Tensor:
    kind, fn, args, kwargs = call
    if kind == "module":
        m = fn
        change = {k: getattr(m, k).to(dt) for k in ("weight", "bias") if getattr(m, k, None) is not None}
        return _module_forward(m, _args(call)[0][0].to(dt), **change)
    return fn(*_cast_tensors(args, dt), **_cast_tensors(kwargs, dt))


def _in_tf32(call: Call) -> torch.Tensor:
    kind, fn, args, kwargs = call
    if kind == "module":
        m = fn
        change = {"weight": _tf32(m.weight)}
        return _module_forward(m, _tf32(_args(call)[0][0]), **change)
    return fn(*_map_float(args, _tf32), **_map_float(kwargs, _tf32))


def _factors(rec: Record, tmpl: Any, name: str, kind: str, constants: Sequence[float],
             input_shapes: Sequence[tuple] = ()) -> list[tuple[float, str]]:
    """Candidate wrong factors for a record: the scalar the op itself applies (left out: its inverse),
    1/√n and √n and n for the record's axes, the model's own constants, 2 and 1/2."""
    got: list[tuple[float, str]] = []
    args, kwargs = _tmpl_args(tmpl)
    scalars = [a for a in list(args) + list(kwargs.values()) if isinstance(a, (int, float)) and not isinstance(a, bool)]
    if kind == "op" and name in ("mul", "__mul__", "__rmul__", "div", "__truediv__", "true_divide", "__rtruediv__"):
        for v in scalars:
            if v not in (0, 1, -1):
                inv = name in ("div", "__truediv__", "true_divide")
                got.append((float(v) if inv else 1.0 / float(v), f"the factor {float(v):.4g} left out"))
                got.append((1.0 / float(v) if inv else float(v), f"the factor {float(v):.4g} applied twice"))
    # 1/sqrt(n) for the sizes the op contracts or normalises over (attention's 1/sqrt(d)): the last
    # axis of its inputs and of its result
    sizes = {rec.shape[-1]} if rec.shape else set()
    sizes |= {sh[-1] for sh in input_shapes if sh}
    for n in sorted(x for x in sizes if x > 1):
        got += [(1 / math.sqrt(n), f"an extra 1/sqrt({n})"), (math.sqrt(n), f"a missing 1/sqrt({n})")]
    if name in ("mean", "sum") and input_shapes and input_shapes[0]:
        n = math.prod(input_shapes[0]) // max(1, math.prod(rec.shape))
        if n > 1:
            got += [(float(n), f"a sum instead of a mean over {n}"), (1.0 / n, f"a mean instead of a sum over {n}")]
    for v in constants:
        if v not in (0, 1, -1) and math.isfinite(v):
            got += [(float(v), f"the model's constant {v:.4g}"), (1 / float(v), f"1/the model's constant {v:.4g}")]
    got += [(2.0, "a factor of 2"), (0.5, "a factor of 1/2")]
    seen: list[float] = []
    out = []
    for f, why in got:
        if abs(f - 1) < 1e-9 or any(math.isclose(f, s, rel_tol=1e-6) for s in seen):
            continue
        seen.append(f)
        out.append((f, why))
    return out


def model_constants(model: torch.nn.Module | None) -> list[float]:
    """Scalar settings held by the model's modules (temperature, scale, head size …), not flags."""
    vals: list[float] = []
    if model is None:
        return vals
    for m in model.modules():
        for k, v in vars(m).items():
            if k.startswith("_") or isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            if k in ("training", "in_features", "out_features", "num_features", "momentum", "eps", "p"):
                continue
            if v not in vals and abs(v) not in (0, 1):
                vals.append(float(v))
    return vals[:12]


# ------------------------------------------------------------------------------------------ running
class _Mutator:
    """Planted in capture: replaces the value of the records at chosen indices, in place."""

    def __init__(self, variants: Sequence[Variant]):
        self.by_site = {v.site: v for v in variants}
        self.planted = 0

    def before_module(self, module: torch.nn.Module, args: tuple) -> None:
        for v in self.by_site.values():
            if v.before is not None:
                v.before(module, args)

    def plant(self, index: int, call: tuple, tensor: torch.Tensor, shared: bool = False) -> None:
        v = self.by_site.get(index)
        if v is None:
            return
        if shared:  # the result is memory the model or the call's arguments hold: writing it would change them
            raise _NotApplicable("the stage's result shares memory with a parameter or an argument")
        if v.fn is not None and call[1] is not v.fn:
            raise _NotApplicable("the run does not make the same records as the captured one")
        with torch.no_grad():
            try:
                new = v.apply(call, tensor)
            except StopCapture:
                raise
            except Exception as e:  # the mistake cannot be made on this call (shapes, dtypes)
                raise _NotApplicable(str(e)) from None
            if not isinstance(new, torch.Tensor) or tuple(new.shape) != tuple(tensor.shape):
                raise _NotApplicable()
            tensor.copy_(new.to(tensor.dtype))
        self.planted += 1


class _Grab:
    """A capture sink that keeps the value of one record and stops the forward there."""

    owns_values = True

    def __init__(self, index: int):
        self.index = index
        self.value: torch.Tensor | None = None

    def add(self, rec: Record, tensor: torch.Tensor | None = None) -> None:
        if rec.index == self.index and tensor is not None:
            self.value = tensor.detach().clone()
            raise StopCapture("what-if: reached the divergent stage")

    def update(self, rec: Record, tensor: torch.Tensor | None = None) -> None:
        pass

    def set_error(self, error: Any) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class Search:
    """A what-if search's inputs: the live reference, how to run it, and what the candidate gave."""

    model: torch.nn.Module
    inputs: Sequence[Any]
    run: Callable[[torch.nn.Module, Sequence[Any], Any], None]  # one forward of the model with a sink
    target: int  # the reference record the candidate's divergent value is compared with
    cand_value: torch.Tensor  # the candidate's value there, in the reference's layout
    atol: float
    rtol: float
    window: list[int]  # the reference records the candidate's record covers (sites to plant at)
    budget: int = DEFAULT_BUDGET
    seconds_budget: float = math.inf  # wall time the search may spend: past it no further variant is tried
    progress: Callable[[int, int], None] | None = None
    forwards: int = 0
    seconds: float = 0.0
    tried: int = 0
    left: int = 0  # variants within the forward budget not tried for want of time (`seconds_budget`)
    results: list[WhatIf] = field(default_factory=list)


def _evaluate(s: Search, variants: Sequence[Variant], same_code: bool = False) -> WhatIf | None:
    mut = _Mutator(variants)
    grab = _Grab(s.target)
    try:
        s.run(s.model, s.inputs, grab, mut)
    finally:
        s.forwards += 1
    if grab.value is None or mut.planted < len(variants) or tuple(grab.value.shape) != tuple(s.cand_value.shape):
        return None
    mutated, cand = grab.value, s.cand_value.to(grab.value.device)
    if mutated.is_floating_point() and cand.is_floating_point():
        # reproducing the candidate includes its NaNs: a NaN on both sides agrees here
        both = torch.isnan(mutated) & torch.isnan(cand)
        if bool(both.any()):
            mutated, cand = mutated.masked_fill(both, 0.0), cand.masked_fill(both, 0.0)
    pending = measure_async(mutated, cand, s.atol, s.rtol)
    st = pending.result()
    rel = pending.rel_l2 if math.isfinite(pending.rel_l2) else math.inf
    if (st.ref_nan or st.ref_inf) and not (st.cand_nan or st.cand_inf):
        rel = math.inf
    return WhatIf(list(variants), st, rel, same_code)


def rank_key(w: WhatIf) -> tuple:
    """Best first: those within tolerance (by the order of magnitude of their error), then by how
    close they come; among equals the later stage (where the mistake shows first as itself) and the
    commoner mistake."""
    err = w.stats.max_abs if math.isfinite(w.stats.max_abs) else math.inf
    mag = math.floor(math.log10(err)) if 0 < err < math.inf else (-400 if err == 0 else 400)
    site = max(v.site for v in w.variants)
    prior = sum(PRIOR[v.kind] for v in w.variants)
    if w.explains:
        return (0, w.mistakes, mag, -site, prior)
    return (1, round(w.rel_l2, 4) if math.isfinite(w.rel_l2) else math.inf, w.mistakes, -site, prior)


def search(s: Search, model_consts: Sequence[float] = (), records: Sequence[Record] = (), pairs: int = 4) -> list[WhatIf]:
    """Try every variant at every site of the window (within the budget of forwards); when none
    reproduces the candidate within tolerance, try the best `pairs` two at a time.  Returns the
    results best first (`rank_key`)."""
    t0 = time.perf_counter()
    variants: list[Variant] = []
    by_index = {r.index: r for r in records}
    shapes = {r.index: tuple(r.shape) for r in records}
    for i in s.window:
        rec = by_index.get(i)
        if rec is not None:
            variants += catalogue(rec, s.model, model_consts, shapes)
    # a fair share of the budget for every kind at every site: the first variant of each (site, kind)
    # first, commoner mistakes and later sites first among those, then the second variants, and so on
    nth: dict[tuple, int] = {}
    order = []
    for v in variants:
        key = (v.site, v.kind)
        order.append((nth.get(key, 0), PRIOR[v.kind], -v.site))
        nth[key] = nth.get(key, 0) + 1
    variants = [v for _, v in sorted(zip(order, variants), key=lambda x: x[0])]
    baseline = _evaluate(s, [])  # the reference as it is: how far the candidate is without a mistake planted
    before = baseline.rel_l2 if baseline is not None else math.inf
    total = min(len(variants), s.budget)
    results: list[WhatIf] = []
    closer: set[int] = set()  # variants (by id) that bring the reference closer to the candidate
    for k, v in enumerate(variants[:s.budget]):
        if k and time.perf_counter() - t0 > s.seconds_budget:
            s.left = total - k
            break
        s.tried += 1
        w = _evaluate(s, [v])
        if w is not None:
            results.append(w)
            if w.rel_l2 < before:
                closer.add(id(v))
        if s.progress is not None:
            s.progress(k + 1, total)
    # the same mistake at every call of the same code (a kernel the candidate uses for several stages),
    # for mistakes that brought the reference closer at one of those calls
    groups: dict[tuple, list[Variant]] = {}
    for v in variants:
        rec = by_index[v.site]
        groups.setdefault((rec.file, rec.line, rec.op, v.kind, v.detail.replace(f"`{v.stage}`", "``")), []).append(v)
    for g in groups.values():
        if len({v.site for v in g}) > 1 and any(id(v) in closer for v in g) and s.forwards < 2 * s.budget \
                and time.perf_counter() - t0 <= s.seconds_budget:
            s.tried += 1
            w = _evaluate(s, g, same_code=True)
            if w is not None:
                results.append(w)
    results.sort(key=rank_key)
    if results and not results[0].explains and pairs > 1:
        top: list[WhatIf] = []
        for w in results:
            if len(w.variants) == 1 and all(w.variants[0].site != t.variants[0].site for t in top):
                top.append(w)
            if len(top) == pairs:
                break
        for a in range(len(top)):
            for b in range(a + 1, len(top)):
                if s.forwards >= s.budget + pairs * pairs or time.perf_counter() - t0 > s.seconds_budget:
                    break
                w = _evaluate(s, [top[a].variants[0], top[b].variants[0]])
                if w is not None:
                    results.append(w)
        results.sort(key=rank_key)
    s.results = results
    s.seconds = time.perf_counter() - t0
    return results


def window(stages: Sequence[Any], ref: Trace, fd: Any) -> list[int]:
    """The reference records a divergent candidate record covers: those after the reference record
    of the last stage before it that agrees (the whole model when none does), up to its own."""
    last = -1
    for s in stages:
        if s is fd:
            break
        if s.status == "ok" and s.ref is not None and s.cand is not None:
            last = max(last, s.ref.index)
    end = fd.ref.index
    return [r.index for r in ref.records if last < r.index <= end and is_site(r)]
