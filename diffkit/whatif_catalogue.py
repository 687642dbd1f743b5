"""The what-if catalogue: the kernel mistakes `diffkit.whatif` plants in the reference, and where.

A record is a site (`is_site`) when it computes something a kernel could get wrong.  The catalogue
(`MUTATIONS`) is a table: each entry names a mistake's kind, the sites it applies to, what the mistaken
kernel does in words, and how its result is computed from the live call; `catalogue(rec, ...)` walks the
table for one record and lists its `Variant`s, in the table's order.

The kinds (`KINDS`): drop_bias, extra_bias, running_stats, batch_stats, unbiased_variance,
biased_variance, epsilon, reduce_axis, scale, transposed_weight, transposed_operand,
swapped_operands, tanh_gelu, erf_gelu, low_precision, unwritten_tail, clamp, sign_flip,
unstable_softmax; and what a fused kernel decides for the stages it replaces: norm_axes (a norm's statistics
over other axes, a GroupNorm with other groups), block_stats (statistics per block of consecutive elements),
mixed_gelu (a norm's statistics from one GELU, its values from the other), activation (SiLU for sigmoid,
LeakyReLU for ReLU, an approximation), swapped_order (two elementwise steps the other way round),
bias_placement (a layer's bias added after the activation), skip_stage (a stage left out).
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from .capture import Record, StopCapture
from .records import Ref

KINDS = ("drop_bias", "extra_bias", "running_stats", "batch_stats", "unbiased_variance", "biased_variance",
         "epsilon", "reduce_axis", "scale", "transposed_weight", "transposed_operand", "swapped_operands",
         "tanh_gelu", "erf_gelu", "low_precision", "unwritten_tail", "clamp", "sign_flip", "unstable_softmax",
         "norm_axes", "block_stats", "mixed_gelu", "activation", "swapped_order", "bias_placement", "skip_stage")

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
    # sees every record the run makes before any is planted, (index, live call, result): a mistake that spans
    # two stages (two elementwise steps swapped) keeps what it needs of the earlier one
    watch: Callable[[int, Call, torch.Tensor], None] | None = None


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
_IN_MODULES = (torch.nn.InstanceNorm1d, torch.nn.InstanceNorm2d, torch.nn.InstanceNorm3d)
_CONVT_MODULES = (torch.nn.ConvTranspose1d, torch.nn.ConvTranspose2d, torch.nn.ConvTranspose3d)
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
    records: dict[int, Record] = field(default_factory=dict)  # the trace's records by index (what made an input)

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
    module call before it runs (`Variant.before`, None for none), and optionally a third, a hook that sees every
    record the run makes (`Variant.watch`)."""

    kind: str
    when: Callable[[Site], bool]
    text: str
    make: Callable[..., Apply | tuple[Apply, Callable]]
    each: Callable[[Site], Iterable[dict]] = _once


def catalogue(rec: Record, model: torch.nn.Module | None, constants: Sequence[float] = (),
              shapes: dict[int, tuple] | None = None, records: dict[int, Record] | None = None) -> list[Variant]:
    """Every variant of the catalogue (`MUTATIONS`, in order) that applies to reference record `rec`.
    `constants`: scalar settings of the model (temperatures, scales, sizes) a missing or extra factor may
    come from; `shapes`: the shapes of the trace's records by index (what an op's inputs looked like);
    `records`: the trace's records by index (which call made an input: two steps a kernel may swap)."""
    c = _call_of(rec)
    if c is None or not is_site(rec):
        return []
    kind, fn, tmpl = c
    s = Site(rec, kind, fn, tmpl, _name(fn), constants, shapes or {}, records or {})
    out: list[Variant] = []
    for m in MUTATIONS:
        if not m.when(s):
            continue
        for setting in m.each(s):
            made = m.make(s, **setting)
            apply, before, watch = (tuple(made) + (None,))[:3] if isinstance(made, tuple) else (made, None, None)
            out.append(Variant(m.kind, rec.index, s.stage, m.text.format(stage=s.stage, **setting), apply, before, fn,
                               tuple(rec.aliases), watch))
    return out


# --- bias
def _bias_term(s: Site) -> Callable[[Call, torch.Tensor], torch.Tensor] | None:
    """How the bias a site adds is read from the live call, in its result's broadcast (None: it adds none)."""
    if s.module(torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, *_CONVT_MODULES) and \
            s.fn.bias is not None:
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


# --- structure: the choices a fused kernel makes for the stages it replaces (issue 44)
@dataclass(frozen=True)
class _Norm:
    """A normalisation site: its family, the axes its statistics are taken over (GroupNorm: its groups
    instead), and how the live call gives (input, weight, bias, eps)."""

    family: str  # "layer" (affine over the trailing axes) | "group" | "instance" | "batch" (affine per channel)
    dims: tuple[int, ...]
    groups: int  # GroupNorm's number of groups (0 for the others)
    parts: Callable[[Call], tuple]


def _op_parts(call: Call) -> tuple:
    """(input, weight, bias, eps) of a layer_norm / group_norm call (the same positions)."""
    return _arg(call, 0, "input"), _arg(call, 2, "weight"), _arg(call, 3, "bias"), _arg(call, 4, "eps", 1e-5)


def _module_parts(call: Call) -> tuple:
    m = call[1]
    return _first_input(call), m.weight, m.bias, m.eps


def _norm_of(s: Site) -> _Norm | None:
    """The normalisation a site computes with statistics of its own input (None for other sites, and for
    norms that read running statistics)."""
    n = len(s.shape)
    spatial = tuple(range(2, n))
    if s.module(torch.nn.LayerNorm):
        k = len(s.fn.normalized_shape)
        return _Norm("layer", tuple(range(n - k, n)), 0, _module_parts)
    if s.op("layer_norm"):
        shape = s.arg(1, "normalized_shape")
        k = 1 if isinstance(shape, int) else len(shape or ())
        return _Norm("layer", tuple(range(n - k, n)), 0, _op_parts) if 0 < k <= n else None
    if s.module(torch.nn.GroupNorm) and n >= 2:
        return _Norm("group", (), s.fn.num_groups, _module_parts)
    if s.op("group_norm") and n >= 2 and isinstance(s.arg(1, "num_groups"), int):
        return _Norm("group", (), s.arg(1, "num_groups"), _op_parts)
    if s.module(*_IN_MODULES) and n >= 3 and (s.fn.training or not s.fn.track_running_stats):
        return _Norm("instance", spatial, 0, _module_parts)
    if s.op("instance_norm") and n >= 3 and s.arg(5, "use_input_stats", True):
        return _Norm("instance", spatial, 0, lambda call: (_arg(call, 0, "input"), _arg(call, 3, "weight"),
                                                           _arg(call, 4, "bias"), _arg(call, 7, "eps", 1e-5)))
    if _bn_batch_stats(s) and n >= 2:
        return _Norm("batch", (0,) + spatial, 0, _module_parts)
    if s.op("batch_norm") and n >= 2 and s.arg(5, "training", False):
        return _Norm("batch", (0,) + spatial, 0, lambda call: (_arg(call, 0, "input"), _arg(call, 3, "weight"),
                                                               _arg(call, 4, "bias"), _arg(call, 7, "eps", 1e-5)))
    return None


def _standardise(x: torch.Tensor, dims: tuple[int, ...], groups: int, eps: float, outside: bool = False,
                 stats_from: torch.Tensor | None = None) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) with the biased variance over `dims` (over each of `groups` channel groups
    when `groups`); `outside`: eps added to the standard deviation instead; `stats_from`: the statistics taken
    from that tensor (of x's shape) instead of x."""
    src = x if stats_from is None else stats_from
    if groups:
        xv, sv, dims = x.reshape(x.shape[0], groups, -1), src.reshape(x.shape[0], groups, -1), (2,)
    else:
        xv, sv = x, src
    mean = sv.mean(dims, keepdim=True)
    var = sv.var(dims, keepdim=True, correction=0)
    den = var.sqrt() + eps if outside else torch.sqrt(var + eps)
    return ((xv - mean) / den).reshape(x.shape)


def _affine(y: torch.Tensor, norm: _Norm, w: Any, b: Any) -> torch.Tensor:
    """The norm's weight and bias, placed as the reference places them."""
    if norm.family == "layer":
        return (y * w if w is not None else y) + (b if b is not None else 0)
    if w is not None:
        y = y * _bias_view(w, y, 1)
    return y + _bias_view(b, y, 1) if b is not None else y


def _axes_words(dims: Sequence[int], shape: tuple) -> str:
    letters = {4: "NCHW", 5: "NCDHW"}.get(len(shape))
    name = "·".join(letters[d] for d in dims) if letters else "axes " + ", ".join(map(str, dims))
    return f"{name} ({math.prod(shape[d] for d in dims)} values)"


def _other_norm_axes(s: Site) -> list[dict]:
    """Other sets of axes (other numbers of groups for a GroupNorm) a kernel may take the statistics over: the
    trailing axes, the channels, the batch, the spatial axes, everything."""
    norm, shape, n = _norm_of(s), s.shape, len(s.shape)
    if norm.groups:
        c, g = shape[1], norm.groups
        why = {c: ", one per channel: an InstanceNorm", 1: ", the whole sample"}
        return [{"dims": (), "groups": k, "over": f"{k} groups of {c // k} channel{'s' * (c > k)}{why.get(k, '')}",
                 "cur": f"{g} groups of {c // g}"} for k in range(1, c + 1) if c % k == 0 and k != g]

    def eff(d):
        return tuple(i for i in d if shape[i] > 1)
    pool = [tuple(range(n - j, n)) for j in range(1, n + 1)] + [(1,), (0,), (0,) + tuple(range(2, n)),
                                                                tuple(range(2, n))]
    seen, out = {eff(norm.dims)}, []
    for d in pool:
        if d and eff(d) and eff(d) not in seen:
            seen.add(eff(d))
            out.append({"dims": d, "groups": 0, "over": _axes_words(d, shape), "cur": _axes_words(norm.dims, shape)})
    return out


def _norm_axes(s: Site, dims: tuple, groups: int, **_: Any) -> Apply:
    norm = _norm_of(s)

    def apply(call, o):
        x, w, b, eps = norm.parts(call)
        return _affine(_standardise(x, dims, groups, eps), norm, w, b)

    return apply


def _row_length(s: Site, norm: _Norm) -> int:
    """How many consecutive elements each set of statistics covers (0: not consecutive, a BatchNorm's)."""
    if norm.family == "batch":
        return 0
    if norm.groups:
        return math.prod(s.shape[1:]) // norm.groups
    return math.prod(s.shape[d] for d in norm.dims)


BLOCKS = (1024, 512, 256, 128, 64, 32, 16, 8)  # elements a thread block may reduce over


def _blocks(s: Site) -> list[dict]:
    """Power-of-two blocks of consecutive elements smaller than each normalised set (a reduction left per
    thread block); not those whole channels or whole trailing rows make (other groups / axes say those)."""
    norm = _norm_of(s)
    length = _row_length(s, norm)
    whole = math.prod(s.shape[2:]) if norm.groups else s.shape[-1] if len(norm.dims) > 1 else 0
    return [{"b": b, "n": length} for b in BLOCKS
            if b < length and length % b == 0 and not (whole and b % whole == 0)]


def _block_stats(s: Site, b: int, n: int) -> Apply:
    norm = _norm_of(s)

    def apply(call, o):
        x, w, bias, eps = norm.parts(call)
        return _affine(_standardise(x.reshape(-1, b), (1,), 0, eps).reshape(x.shape), norm, w, bias)

    return apply


def _eps_outside(s: Site) -> Apply:
    norm = _norm_of(s)

    def apply(call, o):
        x, w, b, eps = norm.parts(call)
        return _affine(_standardise(x, norm.dims, norm.groups, eps, outside=True), norm, w, b)

    return apply


# a stage's input passed through: elementwise steps, activations, norms
_ACT_MODULES = (torch.nn.GELU, torch.nn.ReLU, torch.nn.SiLU, torch.nn.Sigmoid, torch.nn.Tanh, torch.nn.LeakyReLU,
                torch.nn.Hardswish, torch.nn.Hardsigmoid, torch.nn.ELU, torch.nn.SELU, torch.nn.CELU,
                torch.nn.Softplus, torch.nn.Mish, torch.nn.Hardtanh, torch.nn.ReLU6)
_ACT_OPS = {"gelu", "relu", "silu", "sigmoid", "tanh", "leaky_relu", "hardswish", "hardsigmoid", "elu", "selu",
            "celu", "softplus", "mish", "hardtanh", "relu6", "logsigmoid", "softsign", "tanhshrink"}
_BINARY_OPS = {"mul", "div", "add", "sub", "__mul__", "__rmul__", "__truediv__", "__add__", "__radd__", "__sub__",
               "true_divide", "multiply", "divide"}
_UNARY_OPS = _ACT_OPS | {"exp", "clamp", "clip", "square", "sqrt", "rsqrt", "abs", "neg", "__neg__", "log"}
_NORM_OPS = ("layer_norm", "group_norm", "instance_norm", "batch_norm", "softmax", "log_softmax")


def _first_ref(s: Site) -> int | None:
    """The position of the call's first argument that is a record of the trace."""
    args, _ = _tmpl_args(s.tmpl)
    return next((i for i, a in enumerate(args) if isinstance(a, Ref)), None)


def _ref_shape(s: Site, pos: int | None) -> tuple | None:
    args, _ = _tmpl_args(s.tmpl)
    return s.shapes.get(args[pos].index) if pos is not None else None


def _elementwise(s: Site) -> bool:
    """An elementwise step a kernel may apply in another order or leave out: an activation, a unary op, or a
    binary op of two tensors or of a tensor and a number (not a bias: drop_bias says that)."""
    if s.module(*_ACT_MODULES):
        return True
    if s.kind != "op" or not (s.name in _UNARY_OPS or s.name in _BINARY_OPS) or _bias_term(s) is not None:
        return False
    return s.name not in _BINARY_OPS or len(_tmpl_args(s.tmpl)[0]) == 2


def _skippable(s: Site) -> bool:
    """A stage that keeps its input's shape and that a kernel may leave out: an elementwise step of two tensors
    or of one, a norm, a softmax, an activation (a product with a number: `scale` says that)."""
    pos = _first_ref(s)
    if pos is None or _ref_shape(s, pos) != s.shape:
        return False
    if s.module(*_NORM_MODULES, *_IN_MODULES, torch.nn.Softmax, torch.nn.LogSoftmax) or s.op(*_NORM_OPS):
        return True
    if not _elementwise(s):
        return False
    args, _ = _tmpl_args(s.tmpl)
    return s.name not in _BINARY_OPS or all(isinstance(a, (Ref, torch.Tensor)) for a in args[:2])


def _skip(s: Site) -> Apply:
    pos = _first_ref(s)
    return lambda call, o: _args(call)[0][pos]


def _activation_of(s: Site) -> str | None:
    """Which activation a site computes ("silu", "sigmoid", "relu", "leaky_relu", "gelu", …), None for others."""
    if s.kind == "module":
        names = {torch.nn.SiLU: "silu", torch.nn.Sigmoid: "sigmoid", torch.nn.ReLU: "relu",
                 torch.nn.LeakyReLU: "leaky_relu", torch.nn.GELU: "gelu", torch.nn.Hardswish: "hardswish",
                 torch.nn.Hardsigmoid: "hardsigmoid"}
        return names.get(type(s.fn))
    return s.name if s.name in ("silu", "sigmoid", "relu", "leaky_relu", "gelu", "hardswish", "hardsigmoid") \
        else None


def _slope(s: Site) -> float:
    return float(s.fn.negative_slope if s.kind == "module" else s.arg(1, "negative_slope", 0.01))


def _activation_variants(s: Site) -> list[dict]:
    """The activations a kernel writer puts in the place of this one (a variant, an approximation)."""
    act = _activation_of(s)
    table = {
        "silu": [("sigmoid(x), not SiLU x·sigmoid(x)", torch.sigmoid),
                 ("hardswish, a piecewise approximation of SiLU", F.hardswish)],
        "sigmoid": [("x·sigmoid(x) (SiLU), not sigmoid(x)", F.silu),
                    ("hardsigmoid, a piecewise approximation of sigmoid", F.hardsigmoid)],
        "relu": [("LeakyReLU (slope 0.01), not ReLU", lambda x: F.leaky_relu(x, 0.01))],
        "gelu": [("x·sigmoid(1.702x), the sigmoid approximation of GELU", lambda x: x * torch.sigmoid(1.702 * x))],
        "hardswish": [("SiLU x·sigmoid(x), not hardswish", F.silu)],
        "hardsigmoid": [("sigmoid(x), not hardsigmoid", torch.sigmoid)],
    }
    out = [{"words": w, "f": f} for w, f in table.get(act, ())]
    if act == "leaky_relu":
        a = _slope(s)
        out.append({"words": f"ReLU, not LeakyReLU (slope {a:g})", "f": F.relu})
        out += [{"words": f"LeakyReLU with slope {b:g} (not {a:g})", "f": lambda x, b=b: F.leaky_relu(x, b)}
                for b in (0.01, 0.1, 0.2) if not math.isclose(a, b)]
    return out


def _activation(s: Site, words: str, f: Callable) -> Apply:
    pos = _first_ref(s) or 0
    return lambda call, o: f(_args(call)[0][pos])


def _call_with(call: Call, pos: int, value: torch.Tensor) -> torch.Tensor:
    """The call made again with argument `pos` replaced."""
    kind, fn, args, kwargs = call
    args = list(args)
    args[pos] = value
    return fn(*args, **kwargs)


def _producer(s: Site) -> tuple[Record, int, Site] | None:
    """The record a site reads first, the position of that record's own first record argument, and the site it
    is; None when the site reads no record that a call of this trace made."""
    pos = _first_ref(s)
    if pos is None:
        return None
    rec = s.records.get(_tmpl_args(s.tmpl)[0][pos].index)
    c = _call_of(rec) if rec is not None else None
    if c is None or not is_site(rec):
        return None
    prev = Site(rec, c[0], c[1], c[2], _name(c[1]), s.constants, s.shapes, s.records)
    ppos = _first_ref(prev)
    return (rec, ppos, prev) if ppos is not None else None


def _holding(index: int, pos: int) -> tuple[dict, Callable]:
    """A watch that keeps the live call of record `index` and a copy of its argument `pos`."""
    held: dict = {}

    def watch(i, call, tensor):
        if i == index:
            held["call"], held["x"] = call, _args(call)[0][pos].detach().clone()

    return held, watch


def _swappable(s: Site) -> list[dict]:
    """Two consecutive elementwise steps of one shape (this site reading the other's result)."""
    if not _elementwise(s) or _first_ref(s) is None:
        return []
    p = _producer(s)
    if p is None or not _elementwise(p[2]) or not (tuple(p[0].shape) == s.shape == _ref_shape(p[2], p[1])):
        return []
    return [{"prev": p[0].name, "a": p[0].index, "pa": p[1], "pb": _first_ref(s)}]


def _swapped(s: Site, prev: str, a: int, pa: int, pb: int) -> tuple:
    held, watch = _holding(a, pa)

    def apply(call, o):
        if "call" not in held:
            raise _NotApplicable("the step before was not made")
        return _call_with(held["call"], pa, _call_with(call, pb, held["x"]))

    return apply, None, watch


def _gelu_before_norm(s: Site) -> list[dict]:
    """A norm reading a GELU's result: a fused kernel may compute that GELU twice, two ways."""
    if _norm_of(s) is None:
        return []
    p = _producer(s)
    if p is None or not _is_gelu(p[2]) or tuple(p[0].shape) != s.shape or _ref_shape(p[2], p[1]) != s.shape:
        return []
    exact = _gelu_approximation(p[2]) == "none"
    words = ("the exact (erf) GELU", "the tanh-approximated GELU")
    return [{"prev": p[0].name, "a": p[0].index, "pa": p[1], "other": "tanh" if exact else "none",
             "stats": words[0 if exact else 1], "values": words[1 if exact else 0]}]


def _mixed_gelu(s: Site, prev: str, a: int, pa: int, other: str, stats: str, values: str) -> tuple:
    norm = _norm_of(s)
    held, watch = _holding(a, pa)

    def apply(call, o):
        if "x" not in held:
            raise _NotApplicable("the GELU was not made")
        g, w, b, eps = norm.parts(call)
        v = F.gelu(held["x"], approximate=other)
        return _affine(_standardise(v, norm.dims, norm.groups, eps, stats_from=g), norm, w, b)

    return apply, None, watch


def _biased_producer(s: Site) -> list[dict]:
    """An activation reading the result of a layer that adds a bias (Linear, Conv, ConvTranspose)."""
    if not (s.module(*_ACT_MODULES) or s.op(*_ACT_OPS)):
        return []
    p = _producer(s)
    if p is None or _first_ref(s) != 0 or tuple(p[0].shape) != s.shape:
        return []
    prev = p[2]
    if prev.module(torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, *_CONVT_MODULES) and \
            prev.fn.bias is not None:
        return [{"prev": p[0].name, "layer": prev.fn, "ch": -1 if isinstance(prev.fn, torch.nn.Linear) else 1}]
    return []


def _bias_after(s: Site, prev: str, layer: torch.nn.Module, ch: int) -> Apply:
    def apply(call, o):
        x = _first_input(call)
        bias = _bias_view(layer.bias, x, ch % x.dim())
        return _call_with(call, 0, x - bias) + bias

    return apply


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
    # --- structure (what a fused kernel replaced): the axes or blocks a norm's statistics cover, where its eps
    # goes, two GELUs in one kernel, another activation, two steps in the other order, a bias after the
    # activation, a stage left out
    Mutation("norm_axes", lambda s: _norm_of(s) is not None, "`{stage}` normalises over {over} (not {cur})",
             _norm_axes, _other_norm_axes),
    Mutation("block_stats", lambda s: _norm_of(s) is not None,
             "`{stage}` takes its statistics per block of {b} consecutive elements, not over all {n} it normalises "
             "together (a reduction left per thread block)", _block_stats, _blocks),
    Mutation("epsilon", lambda s: _norm_of(s) is not None,
             "`{stage}` adds eps to the standard deviation, outside the square root", _eps_outside),
    Mutation("mixed_gelu", lambda s: _norm_of(s) is not None,
             "`{stage}` normalises {values} of `{prev}`'s input with the statistics of {stats} (two GELUs in one "
             "kernel)", _mixed_gelu, _gelu_before_norm),
    Mutation("activation", lambda s: _activation_of(s) is not None, "`{stage}` computes {words}", _activation,
             _activation_variants),
    Mutation("swapped_order", _elementwise, "`{stage}` applied before `{prev}` (the two steps in the other order)",
             _swapped, _swappable),
    Mutation("bias_placement", _always, "`{prev}`'s bias added after `{stage}`, not before it", _bias_after,
             _biased_producer),
    Mutation("skip_stage", _skippable, "`{stage}` skipped (its input passed on unchanged)", _skip),
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
