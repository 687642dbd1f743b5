"""The what-if catalogue: the kernel mistakes `diffkit.whatif` plants in the reference, and where.

A record is a site (`is_site`) when it computes something a kernel could get wrong.  The catalogue
(`MUTATIONS`) is a table: each entry names a mistake's kind, the sites it applies to, what the mistaken
kernel does in words, and how its result is computed from the live call; `catalogue(rec, ...)` walks the
table for one record and lists its `Variant`s, in the table's order.

The kinds (`KINDS`): drop_bias, extra_bias, running_stats, batch_stats, unbiased_variance,
biased_variance, epsilon, reduce_axis, scale, transposed_weight, transposed_operand,
swapped_operands, tanh_gelu, erf_gelu, low_precision, unwritten_tail, clamp, sign_flip,
unstable_softmax.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from .capture import Record, StopCapture

KINDS = ("drop_bias", "extra_bias", "running_stats", "batch_stats", "unbiased_variance", "biased_variance",
         "epsilon", "reduce_axis", "scale", "transposed_weight", "transposed_operand", "swapped_operands",
         "tanh_gelu", "erf_gelu", "low_precision", "unwritten_tail", "clamp", "sign_flip", "unstable_softmax")

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
@dataclass
class Site:
    """A reference record the catalogue may plant a mistake at, with the call that made it."""

    rec: Record
    kind: str  # "op" | "module"
    fn: Any  # the function or module that made the record
    tmpl: Any  # the call's argument template (tensors, scalars) as captured
    name: str  # `_name(fn)`
    constants: Sequence[float]  # the model's scalar settings (`model_constants`)
    shapes: dict[int, tuple]  # the shapes of the trace's records by index

    @property
    def stage(self) -> str:
        return self.rec.name

    @property
    def shape(self) -> tuple:
        return tuple(self.rec.shape)

    @property
    def float32(self) -> bool:
        return self.rec.dtype == torch.float32

    def module(self, *classes: type) -> bool:
        """Made by a module of one of `classes`."""
        return self.kind == "module" and isinstance(self.fn, classes)

    def op(self, *names: str) -> bool:
        """Made by a torch function of one of `names`."""
        return self.kind == "op" and self.name in names

    def arg(self, i: int, key: str, default: Any = None) -> Any:
        """The call's argument at position `i` or keyword `key`, as captured."""
        return _static_arg(self.tmpl, i, key, default)


Apply = Callable[[Call, torch.Tensor], torch.Tensor]  # (the live call, its result) -> the mistaken result


def _once(s: Site) -> Sequence[dict]:
    return ({},)


@dataclass(frozen=True)
class Mutation:
    """One entry of the catalogue: the mistake `kind`, planted at each site `when` holds for, once for every
    setting `each` gives (keyword arguments for `text` and `make`; one plain planting by default).  `text`
    (formatted with the stage's name and the setting) says what the mistaken kernel does; `make(site,
    **setting)` gives the function computing the mistaken result, or that function and a hook that sees each
    module call before it runs (`Variant.before`)."""

    kind: str
    when: Callable[[Site], bool]
    text: str
    make: Callable[..., Apply | tuple[Apply, Callable]]
    each: Callable[[Site], Iterable[dict]] = _once


def catalogue(rec: Record, model: torch.nn.Module | None, constants: Sequence[float] = (),
              shapes: dict[int, tuple] | None = None) -> list[Variant]:
    """Every variant of the catalogue (`MUTATIONS`, in order) that applies to reference record `rec`.
    `constants`: scalar settings of the model (temperatures, scales, sizes) a missing or extra factor may
    come from; `shapes`: the shapes of the trace's records by index (what an op's inputs looked like)."""
    c = _call_of(rec)
    if c is None or not is_site(rec):
        return []
    kind, fn, tmpl = c
    s = Site(rec, kind, fn, tmpl, _name(fn), constants, shapes or {})
    out: list[Variant] = []
    for m in MUTATIONS:
        if not m.when(s):
            continue
        for setting in m.each(s):
            made = m.make(s, **setting)
            apply, before = made if isinstance(made, tuple) else (made, None)
            out.append(Variant(m.kind, rec.index, s.stage, m.text.format(stage=s.stage, **setting), apply, before, fn,
                               tuple(rec.aliases)))
    return out


# --- bias
def _bias_term(s: Site) -> Callable[[Call, torch.Tensor], torch.Tensor] | None:
    """How the bias a site adds is read from the live call, in its result's broadcast (None: it adds none)."""
    if s.module(torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d) and s.fn.bias is not None:
        ch = -1 if isinstance(s.fn, torch.nn.Linear) else 1
        return lambda call, o, m=s.fn: _bias_view(m.bias, o, ch if ch >= 0 else o.dim() - 1)
    if s.op("linear", "addmm", "baddbmm", "addmv"):
        pos, key = (2, "bias") if s.name == "linear" else (0, "input")
        return (lambda call, o: _arg(call, pos, key)) if isinstance(s.arg(pos, key), torch.Tensor) else None
    if s.op("add", "__add__", "__radd__") and any(p.endswith("bias") for p in s.rec.params):
        args, _ = _tmpl_args(s.tmpl)
        for i, a in enumerate(args[:2]):
            if isinstance(a, torch.Tensor) and a.dim() == 1 and s.shape and a.numel() == s.shape[-1]:
                return lambda call, o: _args(call)[0][i]
    return None


def _drop_bias(s: Site) -> Apply:
    bias = _bias_term(s)
    return lambda call, o: o - bias(call, o)


def _extra_bias(s: Site) -> Apply:
    bias = _bias_term(s)
    return lambda call, o: o + bias(call, o)


# --- normalisation
_NORM_MODULES = _BN_MODULES + (torch.nn.LayerNorm, torch.nn.GroupNorm)


def _running_stats(s: Site) -> tuple[Apply, Callable]:
    """A training BatchNorm normalising with its running statistics, as they were before the call updated them
    (the hook keeps them)."""
    bn, held = s.fn, {}

    def snap(m, args):
        if m is bn:
            held["stats"] = (bn.running_mean.detach().clone(), bn.running_var.detach().clone())

    def apply(call, o):
        return _module_forward(bn, _args(call)[0][0], training=False, running_mean=held["stats"][0],
                               running_var=held["stats"][1])

    return apply, snap


def _bn_unbiased(s: Site) -> Apply:
    m = s.fn

    def apply(call, o):
        x = _args(call)[0][0]
        dims = [0] + list(range(2, x.dim()))
        mean = x.mean(dims, keepdim=True)
        var = x.var(dims, keepdim=True, correction=1)
        y = (x - mean) / torch.sqrt(var + m.eps)
        if m.weight is not None:
            y = y * _bias_view(m.weight, y, 1) + _bias_view(m.bias, y, 1)
        return y

    return apply


def _bn_training(s: Site) -> bool:
    return s.module(*_BN_MODULES) and s.fn.training and s.fn.running_mean is not None


def _bn_batch_stats(s: Site) -> bool:
    return s.module(*_BN_MODULES) and (s.fn.training or s.fn.running_mean is None)


def _other_epsilons(cur: float) -> list[dict]:
    return [{"eps": eps, "cur": cur} for eps in EPSILONS if not math.isclose(eps, cur)]


def _layer_norm_eps(s: Site) -> list[dict]:
    return _other_epsilons(float(s.arg(4, "eps", 1e-5)))


def _unbiased_now(s: Site) -> bool:
    """Whether a var / std call divides by N-1 (its default)."""
    return not (s.arg(99, "correction", None) == 0 or s.arg(99, "unbiased", None) is False)


def _corrected(s: Site) -> Apply:
    """A var / std result with the other divisor (N for N-1, or N-1 for N)."""
    unbiased_now, sq = _unbiased_now(s), s.name == "std"

    def apply(call, o):
        n = _args(call)[0][0].numel() / max(1, o.numel())
        if n <= 1:
            raise _NotApplicable()
        f = (n - 1) / n if unbiased_now else n / (n - 1)
        return o * (math.sqrt(f) if sq else f)

    return apply


def _small_addend(s: Site) -> float | None:
    """The small float constant an addition adds (an epsilon), if any."""
    args, _ = _tmpl_args(s.tmpl)
    small = [a for a in args[:2] if isinstance(a, float) and 0 < a <= 1e-2]
    return small[0] if small else None


# --- reductions over another axis
def _softmax_axis(s: Site) -> int | None:
    """The axis a softmax (or log-softmax) normalises over, None for other sites."""
    if not (s.module(torch.nn.Softmax, torch.nn.LogSoftmax) or s.op("softmax", "log_softmax")):
        return None
    cur = s.fn.dim if s.kind == "module" else s.arg(1, "dim")
    return cur % len(s.shape) if isinstance(cur, int) else None


def _log_softmax(s: Site) -> bool:
    return s.module(torch.nn.LogSoftmax) or s.name == "log_softmax"


def _other_softmax_axes(s: Site) -> list[dict]:
    cur = _softmax_axis(s)
    return [{"d": d, "cur": cur} for d in range(len(s.shape)) if d != cur and s.shape[d] > 1]


def _other_reduce_axes(s: Site) -> list[dict]:
    """The other axes of a reduction's input of the size of the one it reduces over."""
    cur = s.arg(1, "dim")
    x_shape = s.shapes.get(s.rec.inputs[0].index)
    if not (isinstance(cur, int) and x_shape):
        return []
    cur %= len(x_shape)
    return [{"d": d, "cur": cur} for d in range(len(x_shape)) if d != cur and x_shape[d] == x_shape[cur]]


# --- GELU
def _is_gelu(s: Site) -> bool:
    return s.module(torch.nn.GELU) or s.op("gelu")


def _gelu_approximation(s: Site) -> Any:
    """A GELU's approximation ("none": the exact one)."""
    return s.fn.approximate if s.kind == "module" else s.arg(1, "approximate", "none")


# --- weights and operands
def _linear_weight(s: Site) -> torch.Tensor | None:
    """A linear layer's weight matrix (None for other sites)."""
    w = s.fn.weight if s.module(torch.nn.Linear) else s.arg(1, "weight") if s.op("linear") else None
    return w if isinstance(w, torch.Tensor) and w.dim() == 2 else None


def _with_weight(s: Site, change: Callable[[torch.Tensor], torch.Tensor]) -> Apply:
    """The linear layer's call again, its weight changed."""
    if s.kind == "module":
        return lambda call, o, m=s.fn: _module_forward(m, _args(call)[0][0], weight=change(m.weight))
    return lambda call, o: _redo(call, {"weight": change(_arg(call, 1, "weight"))} if "weight" in call[3]
                                 else {1: change(_arg(call, 1, "weight"))})


def _square_blocks(s: Site) -> list[dict]:
    """A weight of k square blocks: transposed block by block."""
    w = _linear_weight(s)
    if w is None or not (w.shape[0] % w.shape[1] == 0 and w.shape[1] > 1):
        return []
    k, i = w.shape[0] // w.shape[1], w.shape[1]
    return [{"k": k, "i": i, "words": "transposed" if k == 1 else f"transposed block by block ({k} square blocks)"}]


def _transposed_blocks(s: Site, k: int, i: int, words: str) -> Apply:
    return _with_weight(s, lambda w: w.reshape(k, i, i).transpose(1, 2).reshape(k * i, i))


def _oblong(s: Site) -> list[dict]:
    """A weight that is not square: its memory read in the transposed shape."""
    w = _linear_weight(s)
    if w is None or w.shape[0] == w.shape[1]:
        return []
    o, i = w.shape
    return [{"o": o, "i": i}]


def _reread(s: Site, o: int, i: int) -> Apply:
    # x @ W.view(i, o): the memory of W read in the transposed shape
    return _with_weight(s, lambda w: w.reshape(i, o).t())


_MATMULS = ("matmul", "__matmul__", "bmm", "einsum", "__rmatmul__")


def _operands(s: Site) -> list[dict]:
    return [{"j": j, "n": j + 1} for j in (0, 1)]


def _transposed_operand(s: Site, j: int, n: int) -> Apply:
    first = 1 if s.name == "einsum" else 0
    return lambda call, o: _transpose_operand(call, first + j)


def _square_product(s: Site) -> bool:
    return s.op(*_MATMULS) and s.name != "einsum" and len(s.shape) >= 2 and s.shape[-1] == s.shape[-2]


# --- factors
def _scales(s: Site) -> list[dict]:
    input_shapes = [s.shapes[r.index] for r in s.rec.inputs if r.index in s.shapes]
    return [{"f": f, "why": why} for f, why in _factors(s.rec, s.tmpl, s.name, s.kind, s.constants, input_shapes)]


# --- precision
_PRECISE_OPS = ("softmax", "log_softmax", "layer_norm", "gelu", "silu", "sigmoid", "tanh", "exp", "sum", "mean")
_FP16_THEN_BF16 = ({"dt": torch.float16, "label": "float16"}, {"dt": torch.bfloat16, "label": "bfloat16"})
_BF16_THEN_FP16 = _FP16_THEN_BF16[::-1]


def _computed_low(s: Site) -> bool:
    """A float32 stage a kernel may compute in a lower precision."""
    lowp = s.module(torch.nn.Linear, torch.nn.LayerNorm, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d) or \
        (s.kind == "op" and (s.name in _LINEAR_OPS or s.name in _PRECISE_OPS))
    return lowp and s.float32


def _accumulates(s: Site) -> bool:
    return s.float32 and (s.op("einsum", "matmul", "__matmul__", "bmm", "mm") or s.module(torch.nn.Linear))


# --- tails
def _axis_tails(s: Site) -> list[dict]:
    out = []
    for d in range(len(s.shape) - 1, -1, -1):
        n = s.shape[d]
        for start in sorted({n - n % b for b in TAIL_BLOCKS if n > b and n % b}, reverse=True):
            out.append({"d": d, "start": start, "left": n - start, "n": n})
    return out


def _row_tails(s: Site) -> list[dict]:
    """The leading axes flattened into rows of a matrix (a kernel tiling [rows, features])."""
    rows = math.prod(s.shape[:-1])
    return [{"start": start, "last": rows - 1, "rows": rows, "cols": s.shape[-1]}
            for start in sorted({rows - rows % b for b in TAIL_BLOCKS if rows > b and rows % b}, reverse=True)]


def _flat_tails(s: Site) -> list[dict]:
    numel = math.prod(s.shape)
    return [{"start": start, "left": numel - start}
            for start in sorted({numel - numel % b for b in TAIL_BLOCKS if numel > b and numel % b}, reverse=True)]


def _first_input(call: Call) -> torch.Tensor:
    return _args(call)[0][0]


def _always(s: Site) -> bool:
    return True


# The catalogue, in the order its variants are listed for a site.  Each entry: the mistake's kind, the sites it
# applies to, what the mistaken kernel does in words, and how its result is computed.
MUTATIONS: tuple[Mutation, ...] = (
    # --- bias
    Mutation("drop_bias", lambda s: _bias_term(s) is not None, "`{stage}` computed without its bias", _drop_bias),
    Mutation("extra_bias", lambda s: _bias_term(s) is not None, "`{stage}` adds its bias twice", _extra_bias),
    # --- normalisation
    Mutation("running_stats", _bn_training, "`{stage}` normalises with its running statistics instead of the batch's",
             _running_stats),
    Mutation("batch_stats", lambda s: s.module(*_BN_MODULES) and not s.fn.training,
             "`{stage}` normalises with the batch's statistics instead of its running ones",
             lambda s: lambda call, o, m=s.fn: _module_forward(m, _first_input(call), training=True)),
    Mutation("unbiased_variance", _bn_batch_stats, "`{stage}` divides the batch variance by N-1", _bn_unbiased),
    Mutation("unbiased_variance", lambda s: s.module(torch.nn.LayerNorm), "`{stage}` divides the variance by N-1",
             lambda s: lambda call, o, m=s.fn: _layer_norm_unbiased(_first_input(call), m.normalized_shape, m.weight,
                                                                    m.bias, m.eps)),
    Mutation("unbiased_variance", lambda s: s.module(torch.nn.GroupNorm),
             "`{stage}` divides each group's variance by N-1",
             lambda s: lambda call, o, m=s.fn: _group_norm_unbiased(_first_input(call), m.num_groups, m.weight, m.bias,
                                                                    m.eps)),
    Mutation("unbiased_variance", lambda s: s.op("group_norm"), "`{stage}` divides each group's variance by N-1",
             lambda s: lambda call, o: _group_norm_unbiased(_arg(call, 0, "input"), _arg(call, 1, "num_groups"),
                                                            _arg(call, 2, "weight"), _arg(call, 3, "bias"),
                                                            _arg(call, 4, "eps", 1e-5))),
    Mutation("epsilon", lambda s: s.module(*_NORM_MODULES), "`{stage}` uses eps={eps:g} (not {cur:g})",
             lambda s, eps, cur: lambda call, o, m=s.fn: _module_forward(m, _first_input(call), eps=eps),
             lambda s: _other_epsilons(s.fn.eps)),
    Mutation("unbiased_variance", lambda s: s.op("layer_norm"), "`{stage}` divides the variance by N-1",
             lambda s: lambda call, o: _layer_norm_unbiased(_arg(call, 0, "input"), _arg(call, 1, "normalized_shape"),
                                                            _arg(call, 2, "weight"), _arg(call, 3, "bias"),
                                                            _arg(call, 4, "eps", 1e-5))),
    Mutation("epsilon", lambda s: s.op("layer_norm"), "`{stage}` uses eps={eps:g} (not {cur:g})",
             lambda s, eps, cur: lambda call, o: _redo(call, {"eps": eps} if "eps" in call[3] else {4: eps}),
             _layer_norm_eps),
    Mutation("biased_variance", lambda s: s.op("var", "std") and _unbiased_now(s), "`{stage}` divides by N, not N-1",
             _corrected),
    Mutation("unbiased_variance", lambda s: s.op("var", "std") and not _unbiased_now(s),
             "`{stage}` divides by N-1, not N", _corrected),
    Mutation("epsilon", lambda s: s.op("add", "__add__", "__radd__") and _small_addend(s) is not None,
             "`{stage}` adds eps={eps:g} (not {cur:g})", lambda s, eps, cur: lambda call, o: o - cur + eps,
             lambda s: _other_epsilons(_small_addend(s))),
    # --- reductions over another axis
    Mutation("reduce_axis", lambda s: _softmax_axis(s) is not None, "`{stage}` normalised over axis {d} (not {cur})",
             lambda s, d, cur: lambda call, o, log=_log_softmax(s): (F.log_softmax if log else F.softmax)(
                 _first_input(call), dim=d), _other_softmax_axes),
    Mutation("unstable_softmax", lambda s: _softmax_axis(s) is not None,
             "`{stage}` without subtracting the row maximum (exp overflows)",
             lambda s: lambda call, o, d=_softmax_axis(s), log=_log_softmax(s): _unstable(_first_input(call), d, log)),
    Mutation("reduce_axis", lambda s: s.op(*_REDUCE_OPS) and bool(s.rec.inputs),
             "`{stage}` reduced over axis {d} (not {cur})",
             lambda s, d, cur: lambda call, o: _redo(call, {"dim": d} if "dim" in call[3] else {1: d}),
             _other_reduce_axes),
    # --- GELU
    Mutation("tanh_gelu", lambda s: _is_gelu(s) and _gelu_approximation(s) == "none",
             "`{stage}` uses the tanh approximation of GELU",
             lambda s: lambda call, o: F.gelu(_first_input(call), approximate="tanh")),
    Mutation("erf_gelu", lambda s: _is_gelu(s) and _gelu_approximation(s) != "none",
             "`{stage}` uses the exact (erf) GELU, not the tanh approximation",
             lambda s: lambda call, o: F.gelu(_first_input(call), approximate="none")),
    # --- weights and operands
    Mutation("transposed_weight", _always, "`{stage}` uses its weight {words}", _transposed_blocks, _square_blocks),
    Mutation("transposed_weight", _always,
             "`{stage}` reads its [{o}, {i}] weight's memory as an [{i}, {o}] matrix (x @ W.view({i}, {o}))",
             _reread, _oblong),
    Mutation("transposed_operand", lambda s: s.op(*_MATMULS), "`{stage}` reads operand {n} transposed (last two axes)",
             _transposed_operand, _operands),
    Mutation("swapped_operands", lambda s: s.op("einsum"), "`{stage}` with its two operands swapped",
             lambda s: lambda call, o: _swap_einsum(call)),
    Mutation("swapped_operands", _square_product,
             "`{stage}` with its operands' roles swapped (result[j, i] for [i, j])",
             lambda s: lambda call, o: o.transpose(-1, -2).contiguous()),
    # --- factors
    Mutation("scale", _always, "`{stage}` multiplied by {f:.6g} ({why})", lambda s, f, why: lambda call, o: o * f,
             _scales),
    # --- precision
    Mutation("low_precision", _computed_low, "`{stage}` computed in {label}",
             lambda s, dt, label: lambda call, o: _in_dtype(call, dt), lambda s: _FP16_THEN_BF16),
    Mutation("low_precision", lambda s: _computed_low(s) and (s.module(torch.nn.Linear) or s.name in _LINEAR_OPS),
             "`{stage}` computed in TF32 (inputs rounded to a 10-bit mantissa)",
             lambda s: lambda call, o: _in_tf32(call)),
    Mutation("low_precision", lambda s: s.float32, "`{stage}` stored in {label}",
             lambda s, dt, label: lambda call, o: o.to(dt).to(o.dtype), lambda s: _BF16_THEN_FP16),
    Mutation("low_precision", _accumulates, "`{stage}` accumulated in {label} (a running sum rounded at every step)",
             lambda s, dt, label: lambda call, o: _accumulated(call, dt), lambda s: _BF16_THEN_FP16),
    # --- tails
    Mutation("unwritten_tail", _always, "`{stage}` leaves axis {d} from {start} on ({left} of {n}) unwritten (zero)",
             lambda s, d, start, left, n: lambda call, o: _zero_tail(o, d, start), _axis_tails),
    Mutation("unwritten_tail", lambda s: len(s.shape) > 2,
             "`{stage}` leaves rows {start}..{last} of its [{rows}, {cols}] matrix view unwritten (zero)",
             lambda s, start, last, rows, cols: lambda call, o: _zero_row_tail(o, start), _row_tails),
    Mutation("unwritten_tail", lambda s: len(s.shape) > 1,
             "`{stage}` leaves its last {left} elements (flat) unwritten (zero)",
             lambda s, start, left: lambda call, o: _zero_flat_tail(o, start), _flat_tails),
    # --- sign, saturation
    Mutation("sign_flip", _always, "`{stage}` negated", lambda s: lambda call, o: -o),
    Mutation("clamp", _always, "`{stage}` clamped at 0 (a stray ReLU)", lambda s: lambda call, o: o.clamp_min(0)),
    Mutation("clamp", lambda s: s.float32, "`{stage}` saturated to float16's range (±65504)",
             lambda s: lambda call, o: o.clamp(-65504.0, 65504.0)),
)


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
