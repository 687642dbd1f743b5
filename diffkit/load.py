"""Loading KernelBench-style files: a reference (`Model`) and a candidate (`ModelNew`).

Both files run as source and both models are built exactly as KernelBench builds them: seed 42
before ``get_init_inputs()``, again before ``Model(*init)`` and again before ``ModelNew(*init)``;
the models are left as constructed (training mode: no ``.eval()`` unless asked) and nothing is
copied between them -- the shared seed is what gives a candidate that repeats the reference's
``__init__`` the same weights.  What the construction produced is then compared by qualified
name (`compare_weights`): parameters and buffers that differ are reported with what the
difference looks like (a constant shift, a scale, a permutation, a transposition), since
silently different weights are the most common false alarm.  `sync_weights` (``--sync-weights``)
copies the reference's values instead.
"""
from __future__ import annotations

import hashlib
import os
import re
import sys
import tokenize
import traceback
import types
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from . import progress
from .align import layout_of_equal, map_params_by_use, param_map
from .align_graph import folded_in, in_ref_layout
from .capture import (_install_extension_import_hook, buffers_of, input_names, parameters_of, path_key, rng_state,
                      set_rng_state)
from .errors import DiffkitError
from .inputs import as_made, build_from_spec, copy_inputs, layout, read_spec, rebuild

KERNELBENCH_SEED = 42


@dataclass
class WeightReport:
    """What the two models' parameters and buffers look like side by side, by qualified name.

    identical:      same name and shape, equal values
    differ:         same name and shape, other values: {"name", "shape", "looks_like"} (left as they are
                    unless `synced`)
    copied:         with --sync-weights: the names whose reference values were copied into the candidate
    shape_mismatch: (name, reference shape, candidate shape)
    ref_only / cand_only: names with no counterpart
    synced:         whether reference values were copied into the candidate
    renamed:        [candidate name, reference name] of parameters with equal values under another name
    relaid:         [candidate name, reference name, how] of parameters holding a reference one's values in
                    another layout (a weight stored transposed for ``x @ W``)
    differ also holds parameters that no name pairs, the one of its shape on each side (with a "reference"
    key: the reference's name); `order` says when the two sides create them in another order
    """

    copied: list[str] = field(default_factory=list)
    identical: list[str] = field(default_factory=list)
    shape_mismatch: list[tuple[str, tuple, tuple]] = field(default_factory=list)  # (name, ref, cand)
    ref_only: list[str] = field(default_factory=list)
    cand_only: list[str] = field(default_factory=list)
    differ: list[dict] = field(default_factory=list)
    synced: bool = False
    renamed: list[list[str]] = field(default_factory=list)  # [candidate name, reference name]: equal values
    relaid: list[list[str]] = field(default_factory=list)  # [candidate, reference, "transposed" | "reshaped"]
    order: str = ""  # where the two sides create parameters of these shapes in another order, in words

    @property
    def matched(self) -> list[str]:
        return self.identical + self.copied

    def difference_words(self, limit: int = 4) -> str:
        """The differing tensors in words: "conv.bias (constant shift by -0.5), …"."""
        words = [f"{d['name']}" + (f" vs {d['reference']}" if d.get("reference") else "") + f" ({d['looks_like']})"
                 for d in self.differ[:limit]]
        return ", ".join(words) + (f" and {len(self.differ) - limit} more" if len(self.differ) > limit else "")

    def summary(self) -> str:
        if self.synced:
            parts = [f"{len(self.matched)} matched by name ({len(self.copied)} copied from the reference)"]
        else:
            parts = [f"{len(self.identical)} equal by name"]
            if self.renamed:
                parts.append(f"{len(self.renamed)} equal under another name: "
                             + ", ".join(f"{c} = {r}" for c, r in self.renamed[:4]) + (" …" if len(self.renamed) > 4 else ""))
            if self.relaid:
                parts.append(f"{len(self.relaid)} equal in another layout: "
                             + ", ".join(f"{c} = {r} {how}" for c, r, how in self.relaid[:4])
                             + (" …" if len(self.relaid) > 4 else ""))
            if self.order:
                parts.append(self.order)
            if self.differ:
                parts.append(f"{len(self.differ)} differ from the reference's after construction (nothing "
                             f"copied, as KernelBench copies nothing): {self.difference_words()}")
        if self.shape_mismatch:
            parts.append(f"{len(self.shape_mismatch)} same name but other shape: "
                         + ", ".join(f"{n} {list(a)} vs {list(b)}" for n, a, b in self.shape_mismatch[:4]))
        if self.ref_only:
            parts.append(f"{len(self.ref_only)} only in reference: " + ", ".join(self.ref_only[:6])
                         + (" …" if len(self.ref_only) > 6 else ""))
        if self.cand_only:
            parts.append(f"{len(self.cand_only)} only in candidate: " + ", ".join(self.cand_only[:6])
                         + (" …" if len(self.cand_only) > 6 else ""))
        return "; ".join(parts)

    @classmethod
    def from_dict(cls, d: dict) -> "WeightReport":
        return cls(copied=list(d.get("copied", [])), identical=list(d.get("identical", [])),
                   shape_mismatch=[(n, tuple(a), tuple(b)) for n, a, b in d.get("shape_mismatch", [])],
                   ref_only=list(d.get("ref_only", [])), cand_only=list(d.get("cand_only", [])),
                   differ=[dict(x) for x in d.get("differ", []) if isinstance(x, dict)],
                   synced=bool(d.get("synced", False)),
                   renamed=[list(x) for x in d.get("renamed", []) if isinstance(x, (list, tuple)) and len(x) == 2],
                   relaid=[list(x) for x in d.get("relaid", []) if isinstance(x, (list, tuple)) and len(x) == 3],
                   order=str(d.get("order", "") or ""))

    def to_dict(self) -> dict:
        return {"copied": self.copied, "identical": self.identical,
                "shape_mismatch": [[n, list(a), list(b)] for n, a, b in self.shape_mismatch],
                "ref_only": self.ref_only, "cand_only": self.cand_only, "differ": self.differ,
                "synced": self.synced, "renamed": self.renamed, "relaid": self.relaid, "order": self.order}


# how close two tensors must be for a difference to read as a pure shift / scale / reordering
# (relative to the reference's magnitude: float32 rounding of a folded constant is ~1e-7)
_LOOKS_REL = 1e-5
_MAX_PERMUTE_ROWS = 4096  # rows matched one to one when looking for a permutation


def _close(a: torch.Tensor, b: torch.Tensor, scale: float) -> bool:
    return a.shape == b.shape and bool(((a - b).abs() <= _LOOKS_REL * max(scale, 1e-12)).all())


def _row_permutation(r: torch.Tensor, c: torch.Tensor, dim: int, scale: float) -> list[int] | None:
    """The order of reference slices along `dim` that gives the candidate, if it is a reordering."""
    n = r.shape[dim]
    if n < 2 or n > _MAX_PERMUTE_ROWS:
        return None
    rr = r.movedim(dim, 0).reshape(n, -1)
    cc = c.movedim(dim, 0).reshape(n, -1)
    dist = torch.cdist(cc, rr)
    best = dist.argmin(dim=1)
    if len(set(best.tolist())) != n or not bool((dist.min(dim=1).values <= _LOOKS_REL * max(scale, 1e-12)
                                                 * max(1, rr.shape[1]) ** 0.5).all()):
        return None
    order = best.tolist()
    return None if order == list(range(n)) else order


def describe_difference(ref: torch.Tensor, cand: torch.Tensor) -> str:
    """What a candidate tensor of the reference's shape looks like next to it, in words: a constant
    shift, a scale, a transposition, a permutation along one axis, zeros, or just other values."""
    r = ref.detach().to("cpu", torch.float64)
    c = cand.detach().to("cpu", torch.float64)
    if not (r.is_floating_point() and r.numel()):
        return f"{int((r != c).sum())} of {r.numel()} elements differ"
    fin = torch.isfinite(r) & torch.isfinite(c)
    if not bool(fin.all()):
        return f"non-finite values differ ({int((~fin).sum())} elements)"
    scale = float(r.abs().max())
    d = c - r
    if bool((c == 0).all()):
        return "all zeros in the candidate"
    shift = float(d.flatten()[0])
    if _close(d, torch.full_like(d, shift), scale):
        return f"constant shift by {shift:+.6g} (candidate = reference {'+' if shift >= 0 else '-'} {abs(shift):.6g})"
    nz = r.abs() > _LOOKS_REL * max(scale, 1e-12)
    if bool(nz.any()):
        k = float((c[nz] / r[nz]).median())
        if _close(c, k * r, scale * max(1.0, abs(k))):
            return f"scaled by {k:.6g}"
    if r.dim() >= 2:
        import itertools

        if r.dim() <= 4:
            for perm in itertools.permutations(range(r.dim())):
                if list(perm) != list(range(r.dim())) and tuple(r.permute(*perm).shape) == tuple(r.shape) \
                        and _close(c, r.permute(*perm), scale):
                    return "transposed" if r.dim() == 2 else f"axes permuted ({', '.join(map(str, perm))})"
    for dim in range(r.dim()):
        order = _row_permutation(r, c, dim, scale)
        if order is not None:
            moved = sum(1 for i, j in enumerate(order) if i != j)
            return (f"permuted along dim {dim} ({moved} of {len(order)} slices moved, candidate[i] = reference"
                    f"[{order[0]}, {order[1]}, …][i])")
    corr = float(torch.corrcoef(torch.stack([r.flatten(), c.flatten()]))[0, 1]) if r.numel() > 1 else float("nan")
    words = f"other values (max |difference| {float(d.abs().max()):.3g}, correlation {corr:.3f})"
    if abs(corr) < 0.2 and abs(float(c.std()) - float(r.std())) <= 0.5 * float(r.std()):
        words += ": looks like another random draw (parameters created in another order, or another init)"
    return words


def compare_weights(ref: torch.nn.Module | dict[str, torch.Tensor], cand: torch.nn.Module) -> WeightReport:
    """The candidate's parameters and buffers next to the reference's (a model, or tensors by
    qualified name as a capture keeps them), by name; nothing is changed."""
    report = WeightReport()
    rstate = _named_state(ref)
    cstate = _named_state(cand)
    with torch.no_grad():
        for name, c in cstate.items():
            r = rstate.get(name)
            if r is None:
                report.cand_only.append(name)
            elif tuple(r.shape) != tuple(c.shape):
                report.shape_mismatch.append((name, tuple(r.shape), tuple(c.shape)))
            elif r.dtype == c.dtype and torch.equal(r.to(c.device), c):
                report.identical.append(name)
            else:
                report.differ.append({"name": name, "shape": list(c.shape), "looks_like": describe_difference(r, c)})
    report.ref_only = [n for n in rstate if n not in cstate]
    _pair_unnamed(report, rstate, cstate)
    return report


def _pair_unnamed(report: WeightReport, rstate: dict, cstate: dict) -> None:
    """The parameters no name pairs, paired as `align.param_map` pairs them for the diff: one holding a
    reference one's values under another name is `renamed`, in another layout `relaid`; the one of a
    shape on each side differ if their values do.  When the two sides create their parameters in
    another order of shapes, `order` says so: seeded construction hands each parameter the random
    numbers of its turn, so another order draws other values."""
    ref_left, cand_left = list(report.ref_only), list(report.cand_only)
    if not ref_left or not cand_left:
        return
    with torch.no_grad():
        ref_left_state, cand_left_state = {n: rstate[n] for n in ref_left}, {n: cstate[n] for n in cand_left}
        paired = map_params_by_use(param_map(ref_left_state, cand_left_state), (), (), ref_left_state, cand_left_state)
        for cn in list(cand_left):
            rn = paired.get(cn)
            if rn is None:
                continue
            how = layout_of_equal(rstate[rn], cstate[cn])
            if how == "":
                report.renamed.append([cn, rn])
            elif how:
                report.relaid.append([cn, rn, how])
            else:  # (a copy stored in another shape is compared in the reference's)
                view, stored = in_ref_layout(rstate[rn], cstate[cn]) or (cstate[cn], "")
                report.differ.append({"name": cn, "reference": rn, "shape": list(cstate[cn].shape),
                                      "looks_like": describe_difference(rstate[rn], view)
                                      + (f" (stored {stored})" if stored else "")})
            cand_left.remove(cn)
            ref_left.remove(rn)
        for cn in list(cand_left):  # reference parameters folded into a larger one (a bias as an extra column)
            held = [(rn, how) for rn in ref_left for how in [folded_in(rstate[rn], cstate[cn])] if how]
            for rn, how in held:
                report.relaid.append([cn, rn, how])
                ref_left.remove(rn)
            if held:
                cand_left.remove(cn)
    report.ref_only = [n for n in report.ref_only if n in ref_left]
    report.cand_only = [n for n in report.cand_only if n in cand_left]
    made = list(cstate)
    report.differ.sort(key=lambda d: made.index(d["name"]) if d["name"] in cstate else -1)
    # the order in which each side creates its parameters, as shapes (named_parameters keeps creation order),
    # when what differs looks like other random draws
    r_names = [n for n in rstate if n not in report.identical]
    c_names = [n for n in cstate if n not in report.identical]
    r_shapes = [tuple(rstate[n].shape) for n in r_names]
    c_shapes = [tuple(cstate[n].shape) for n in c_names]
    drawn = any(d.get("reference") and "random draw" in d.get("looks_like", "") for d in report.differ)
    if sorted(r_shapes) == sorted(c_shapes) and r_shapes != c_shapes and drawn and not report.relaid:
        k = next(i for i, (a, b) in enumerate(zip(r_shapes, c_shapes)) if a != b)
        rn, cn = r_names[k], c_names[k]
        report.order = (f"the candidate creates its parameters in another order: its parameter {k + 1} is {cn} "
                        f"{list(c_shapes[k])}, the reference's is {rn} {list(r_shapes[k])}; KernelBench seeds once "
                        f"before each constructor, so each draws the random numbers of its turn and they differ")


def _named_state(obj: torch.nn.Module | dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if isinstance(obj, torch.nn.Module):
        state = dict(parameters_of(obj))
        state.update(dict(buffers_of(obj)))
        return state
    return dict(obj)


@dataclass
class LoadedPair:
    """Both models as KernelBench builds them, the weight comparison, and one clone of the first
    inputs for each side (`inputs_for` makes any other trial's)."""

    ref: torch.nn.Module
    cand: torch.nn.Module
    ref_inputs: list[Any]
    cand_inputs: list[Any]
    init_inputs: list[Any]
    weights: WeightReport
    ref_path: str
    cand_path: str
    ref_module: types.ModuleType
    cand_module: types.ModuleType
    seed: int
    device: str | None = None

    def inputs_for(self, seed: int) -> list[Any]:
        """The reference's ``get_inputs()`` under `seed` (a KernelBench trial's inputs), on the device."""
        inputs = _inputs(self.ref_module, self.ref_path, seed, "reference")
        return _move(inputs, self.device) if self.device else inputs


def _move(obj: Any, device: str | torch.device) -> Any:
    return pytree.tree_map(lambda v: v.to(device) if isinstance(v, torch.Tensor) else v, obj)


_BUILD_ERROR = re.compile(r"Error building extension '([^']+)'")


def _first_compiler_errors(text: str, limit: int = 8, source: str | None = None) -> str:
    """The compiler's error lines; each that points into a generated source file (load_inline writes
    main.cpp, cuda.cu) gets the line of `source` (the user's file) that holds the same code, where one does."""
    lines = text.splitlines()
    errs = [ln.strip() for ln in lines if re.search(r"\berror\b", ln, re.I) and "ninja: build stopped" not in ln
            and not ln.lstrip().startswith("FAILED:")]
    picked: list[str] = []
    for ln in errs:
        if ln not in picked:
            picked.append(ln)
        if len(picked) >= limit:
            break
    if source:
        picked = [ln + _in_user_file(ln, source) for ln in picked]
    return "\n".join(picked) if picked else "\n".join(lines[:limit])


_COMPILER_AT = re.compile(r"^(/[^\s:]+\.(?:cpp|cu|cc|cxx|cuh|h|hpp))[:(](\d+)")


def _in_user_file(line: str, source: str) -> str:
    """" (cand.py:14)" when the generated file and line a compiler error names holds code that appears on
    exactly one line of the user's file `source`; "" otherwise."""
    m = _COMPILER_AT.match(line)
    if not m:
        return ""
    try:
        with open(m.group(1), encoding="utf-8", errors="replace") as fh:
            code = fh.read().splitlines()[int(m.group(2)) - 1].strip()
        with open(source, encoding="utf-8", errors="replace") as fh:
            mine = fh.read().splitlines()
    except (OSError, IndexError, ValueError):
        return ""
    if len(code) < 8:  # ("}" or "return x;" could be anywhere)
        return ""
    hits = [i for i, text in enumerate(mine, 1) if text.strip() == code]
    return f" (that is {os.path.basename(source)}:{hits[0]}: {code[:120]})" if len(hits) == 1 else ""


def _user_location(tb, path: str, fn: Any = None) -> str:
    """Where in the user's file `path` an exception was raised: its last frame there; else, when it never
    got there (a constructor called with the wrong arguments), where `fn` is defined in it; else the file."""
    frames = traceback.extract_tb(tb)
    mine = [f for f in frames if os.path.abspath(f.filename) == os.path.abspath(path)]
    if mine:
        return f"{mine[-1].filename}:{mine[-1].lineno}"
    target = getattr(fn, "__init__", None) if isinstance(fn, type) else fn
    code = getattr(target, "__code__", None)
    if code is not None and os.path.abspath(code.co_filename) == os.path.abspath(path):
        return f"{code.co_filename}:{code.co_firstlineno}"
    return path


MAX_SOURCE_BYTES = 64 * 2**20  # a model file larger than this is not source (weights, a dump, a device)


def exec_file(path: str, side: str) -> types.ModuleType:
    """Run a KernelBench file as source and return it as a module (errors say side, phase, where)."""
    if not os.path.exists(path):
        raise DiffkitError(side, "read", f"file not found: {path}", path)
    if not os.path.isfile(path):  # a folder, a FIFO, /dev/zero: read as source it would hang or never end
        raise DiffkitError(side, "read", f"{path} is not a regular file (a KernelBench file is Python source)", path)
    if os.path.getsize(path) > MAX_SOURCE_BYTES:
        raise DiffkitError(side, "read", f"{path} is {os.path.getsize(path) / 2**20:.0f} MiB: too large to be a "
                           f"KernelBench source file (limit {MAX_SOURCE_BYTES // 2**20} MiB)", path)
    try:
        with tokenize.open(path) as fh:  # the encoding Python itself would use (PEP 263 coding line)
            source = fh.read()
    except (OSError, UnicodeDecodeError, SyntaxError) as e:
        raise DiffkitError(side, "read", f"cannot read {path}: {e}", path) from e
    try:
        code = compile(source, os.path.abspath(path), "exec")
    except SyntaxError as e:
        where = f"{path}:{e.lineno}" + (f":{e.offset}" if e.offset else "")
        raise DiffkitError(side, "parse", f"syntax error: {e.msg}", where,
                           (e.text or "").rstrip()) from e
    digest = hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:10]
    name = f"diffkit_{side}_{re.sub(r'[^0-9A-Za-z_]', '_', os.path.splitext(os.path.basename(path))[0])}_{digest}"
    module = types.ModuleType(name)
    module.__file__ = os.path.abspath(path)
    sys.modules[name] = module  # dataclasses, pickling and inspect need it
    _install_extension_import_hook()
    try:
        exec(code, module.__dict__)
    except SystemExit as e:  # a file that ends the process at import: said, never taken for diffkit's own exit
        raise DiffkitError(side, "import", f"the file called sys.exit({e.code!r}) at import: a KernelBench file "
                           f"defines its models and returns", _user_location(e.__traceback__, path)) from None
    except Exception as e:
        text = str(e)
        m = _BUILD_ERROR.search(text)
        if m or "CalledProcessError" in type(e).__name__ or "ninja" in text[:2000] and "error" in text.lower():
            ext = m.group(1) if m else "extension"
            raise DiffkitError(side, "build", f"extension '{ext}' failed to build:\n"
                               f"{_first_compiler_errors(text, source=os.path.abspath(path))}",
                               _user_location(e.__traceback__, path), text[-6000:]) from e
        raise DiffkitError(side, "import", f"{type(e).__name__}: {text.strip().splitlines()[0] if text.strip() else ''}",
                           _user_location(e.__traceback__, path), traceback.format_exc()[-6000:]) from e
    return module


def _need(module: types.ModuleType, attr: str, side: str, path: str) -> Any:
    obj = getattr(module, attr, None)
    if obj is None:
        raise DiffkitError(side, "import", f"{path} defines no `{attr}`", path)
    return obj


def _call(side: str, phase: str, path: str, fn, *args) -> Any:
    try:
        return fn(*args)
    except DiffkitError:
        raise
    except Exception as e:
        text = str(e)
        if _BUILD_ERROR.search(text):
            raise DiffkitError(side, "build", f"extension failed to build:\n"
                               f"{_first_compiler_errors(text, source=os.path.abspath(path))}",
                               _user_location(e.__traceback__, path), text[-6000:]) from e
        first = text.strip().splitlines()[0] if text.strip() else ""
        raise DiffkitError(side, phase, f"{type(e).__name__}: {first}", _user_location(e.__traceback__, path, fn),
                           traceback.format_exc()[-6000:]) from e


def sync_weights(ref: torch.nn.Module | dict[str, torch.Tensor], cand: torch.nn.Module) -> WeightReport:
    """Copy each reference parameter/buffer (a model, or tensors by qualified name as a capture keeps
    them) into the candidate one of the same name and shape (``--sync-weights``; KernelBench copies
    nothing).  The report says what differed before the copy."""
    report = compare_weights(ref, cand)
    rstate, cstate = _named_state(ref), _named_state(cand)
    with torch.no_grad():
        for d in report.differ:
            c = cstate[d["name"]]
            c.copy_(rstate[d["name"]].to(device=c.device, dtype=c.dtype))
            report.copied.append(d["name"])
    report.synced = True
    return report


@dataclass
class ModelSide:
    """One side built from its file: the model, its forward's inputs, and how it was made."""

    model: torch.nn.Module
    inputs: list[Any]
    init_inputs: list[Any]
    path: str
    class_name: str
    seed: int
    module: types.ModuleType | None = None
    inputs_source: str = ""  # the file get_inputs()/get_init_inputs() came from
    inputs_module: types.ModuleType | None = None  # that file, run (for other trials' inputs)
    eval_mode: bool = False

    def inputs_for(self, seed: int) -> list[Any]:
        """``get_inputs()`` under `seed` (a KernelBench trial's inputs), on this side's device."""
        src = self.inputs_module or self.module
        if src is None:
            raise DiffkitError("reference", "inputs", "this side was not built from a file: no get_inputs()",
                               self.path)
        inputs = _inputs(src, self.inputs_source or self.path, seed, "reference")
        dev = self.device()
        return _move(inputs, dev) if dev != "cpu" else inputs

    def device(self) -> str:
        for p in self.model.parameters():
            return str(p.device)
        for t in pytree.tree_leaves(self.inputs):
            if isinstance(t, torch.Tensor):
                return str(t.device)
        return "cpu"

    def info(self) -> dict:
        """What a capture of this side keeps so a candidate can later run against it."""
        return {"source": os.path.abspath(self.path), "class": self.class_name, "seed": self.seed,
                "inputs_source": os.path.abspath(self.inputs_source or self.path),
                "init_inputs": encode_values(self.init_inputs), "inputs": encode_values(self.inputs, tensors=True),
                # what the inputs' values alone do not rebuild (one tensor twice, shared memory, strides): a reader
                # gets it back from get_inputs() or lays the values out again (`inputs_as_made`)
                "inputs_layout": layout(self.inputs),
                "device": self.device(), "training": self.model.training, "eval": self.eval_mode}


def encode_values(values: list[Any], tensors: bool = False) -> dict | None:
    """A JSON description of a nested list of call arguments: its structure (pytree spec) and its
    leaves; tensors (when `tensors`) refer to the capture's input records by name.  None when a
    leaf cannot be written as JSON."""
    import json

    flat, spec = pytree.tree_flatten_with_path(list(values))
    leaves = []
    for path, v in flat:
        if isinstance(v, torch.Tensor):
            if not tensors:
                return None
            leaves.append({"tensor": "input[" + "][".join(str(path_key(k)) for k in path) + "]"})
            continue
        try:
            json.dumps(v, allow_nan=False)
        except (TypeError, ValueError):
            return None
        leaves.append({"value": v})
    try:
        return {"spec": pytree.treespec_dumps(spec), "leaves": leaves}
    except Exception:
        return None


def decode_values(enc: dict, tensors: dict[str, torch.Tensor] | None = None) -> list[Any]:
    """The inverse of `encode_values`; `tensors` maps input record names to their values.  Read as data (the
    structure by `inputs.read_spec`, never torch's `treespec_loads`, which imports modules a spec names);
    raises ValueError/KeyError saying what does not fit."""
    if isinstance(enc, list):  # (arguments stored as plain JSON values: taken as they are)
        import copy

        return copy.deepcopy(enc)
    if not isinstance(enc, dict) or not isinstance(enc.get("leaves"), list):
        raise ValueError("the stored values must be an object with a spec and a list of leaves")
    node, count = read_spec(enc.get("spec"))
    if count != len(enc["leaves"]):
        raise ValueError(f"the spec has {count} leaves, the list of leaves {len(enc['leaves'])}")
    leaves = []
    for leaf in enc["leaves"]:
        if not isinstance(leaf, dict):
            raise ValueError("a stored leaf must be an object")
        if "tensor" in leaf:
            t = (tensors or {}).get(leaf["tensor"]) if isinstance(leaf["tensor"], str) else None
            if t is None:
                raise KeyError(f"the capture holds no value for {str(leaf['tensor'])[:80]}")
            leaves.append(t)
        else:
            leaves.append(leaf.get("value"))
    return build_from_spec(node, leaves)


def _unpacked(value: Any, what: str, call: str, side: str, phase: str, path: str) -> list[Any]:
    """What KernelBench's `call(*value)` passes: a list or tuple as it is, any other iterable item by item
    (a tensor: its rows, one argument each); anything else cannot be unpacked, and KernelBench fails."""
    if isinstance(value, (list, tuple)):
        return list(value)
    try:
        return list(value)
    except TypeError:
        raise DiffkitError(side, phase, f"{what} returned {type(value).__name__} {value!r:.60}, not a list: KernelBench "
                           f"calls {call}, which cannot unpack it", path) from None


def _init_inputs(module: types.ModuleType, path: str, side: str) -> list[Any]:
    # (KernelBench's own references always define it; a file without one builds its model with no arguments)
    get_init = getattr(module, "get_init_inputs", None) or (lambda: [])
    torch.manual_seed(KERNELBENCH_SEED)
    init = _call(side, "init", path, get_init)
    return _unpacked(init, "get_init_inputs()", "Model(*get_init_inputs())", side, "init", path)


def _construct(cls, init: list[Any], side: str, path: str, name: str) -> torch.nn.Module:
    torch.manual_seed(KERNELBENCH_SEED)
    model = _call(side, "init", path, cls, *init)
    if not isinstance(model, torch.nn.Module):
        raise DiffkitError(side, "init", f"{name}(...) returned {type(model).__name__}, not an nn.Module", path)
    if "_parameters" not in vars(model):  # (nn.Module.__init__ never ran: every use of the model would raise)
        raise DiffkitError(side, "init", f"{name}.__init__ does not call super().__init__(): the object is not "
                           f"set up as an nn.Module (no parameters, buffers or submodules can be registered)",
                           _user_location(None, path, cls))
    return model


def _inputs(module: types.ModuleType, path: str, seed: int, side: str) -> list[Any]:
    get_inputs = _need(module, "get_inputs", side, path)
    torch.manual_seed(seed)
    inputs = _call(side, "inputs", path, get_inputs)
    return _unpacked(inputs, "get_inputs()", "model(*get_inputs())", side, "inputs", path)


def _candidate_class(module: types.ModuleType, path: str, name: str = "ModelNew"):
    cls = getattr(module, name, None)
    if cls is None:
        has = " (it defines `Model`: KernelBench builds the candidate from `ModelNew` and fails a file without one)" \
            if name == "ModelNew" and getattr(module, "Model", None) is not None else ""
        raise DiffkitError("candidate", "import", f"{path} defines no `{name}`{has}", path)
    if not isinstance(cls, type):
        raise DiffkitError("candidate", "import", f"`{name}` in {path} is a {type(cls).__name__}, not a class "
                           f"(KernelBench builds the candidate as `{name}(*get_init_inputs())`)", path)
    return cls


def load_reference(path: str, *, seed: int = KERNELBENCH_SEED, device: str | None = None, eval_mode: bool = False,
                   class_name: str | None = "Model", inputs_from: str | None = None,
                   side: str = "reference", on_init: Callable[[list], None] | None = None) -> ModelSide:
    """Build one model from its file as KernelBench does (seed 42 before get_init_inputs() and before
    construction; `seed` before get_inputs(); left as constructed unless `eval_mode`).
    `inputs_from`: take get_inputs()/get_init_inputs() from that file instead (a candidate file
    captured on its own).  `on_init` is given the init inputs once the model is built (as its
    constructor left them: what `info()` records)."""
    module = exec_file(path, side)
    if class_name is None:  # whichever the file defines
        class_name = "ModelNew" if hasattr(module, "ModelNew") else "Model"
    src = exec_file(inputs_from, "reference") if inputs_from else module
    cls = _need(module, class_name, side, path) if class_name != "ModelNew" else _candidate_class(module, path)
    init = _init_inputs(src, inputs_from or path, side)
    model = _construct(cls, init, side, path, class_name)
    if on_init is not None:
        on_init(init)
    inputs = _inputs(src, inputs_from or path, seed, side)
    if device:
        model = model.to(device)
        inputs = _move(inputs, device)
    if eval_mode:
        model.eval()
    return ModelSide(model, inputs, init, path, class_name, seed, module, inputs_from or path, src, eval_mode)


# candidate files run ahead of their diff (`prepare_candidate`): absolute path -> module, or the error it raised
_PREPARED: dict[str, Any] = {}
_PREPARED_IN: list[str] = []  # the working directory the first of them was run in


def _prepared_key(cand_path: str) -> str:
    """A candidate path as `prepare_candidate` resolved it: against the working directory it ran in (code
    run since, a constructor built ahead say, may have changed directory)."""
    return os.path.normpath(os.path.join(_PREPARED_IN[0], cand_path)) if _PREPARED_IN else os.path.abspath(cand_path)


def prepare_candidate(cand_path: str) -> None:
    """Run a candidate file now (its extensions built or loaded, its imports done) for a later
    `load_candidate_for_capture` of the same path in this process, which takes the module (or raises
    the error it raised) instead of running the file again.  An isolated diff's candidate process does
    this while the reference process is still capturing."""
    if not _PREPARED_IN:
        _PREPARED_IN.append(os.getcwd())
    key = _prepared_key(cand_path)
    try:
        _PREPARED[key] = exec_file(cand_path, "candidate")
    except Exception as e:  # raised where it would have been, by the load that takes it
        _PREPARED[key] = e


# candidates built ahead (`build_candidate_ahead`): absolute path -> (init inputs encoded, model or error)
_BUILT: dict[str, tuple[dict, Any]] = {}


def build_candidate_ahead(cand_path: str, init_inputs: dict | None) -> None:
    """Build a candidate `prepare_candidate` ran, now, from the init inputs its reference is built from
    (`encode_values`'s form, as a capture keeps them): a later `load_candidate_for_capture` whose capture
    says the same takes this model (or raises the error building it raised) instead of building another.
    An isolated diff's candidate process does this while the reference is captured, told the init
    inputs by the reference's process."""
    key = _prepared_key(cand_path)
    module = _PREPARED.get(key)
    if init_inputs is None or module is None or isinstance(module, BaseException):
        return
    try:
        init = decode_values(init_inputs)
    except Exception:  # the load reads them from the capture, and says what is wrong there
        return
    try:
        model: Any = _construct(_candidate_class(module, cand_path), init, "candidate", cand_path, "ModelNew")
    except Exception as e:  # raised by the load that takes it
        model = e
    _BUILT[key] = (init_inputs, model)


def _built_ahead(cand_path: str, info: dict) -> Any:
    """The candidate `build_candidate_ahead` built, when it was built from the init inputs a capture
    (`info`) says the reference was built from; else None."""
    import json

    got = _BUILT.pop(_prepared_key(cand_path), None)
    if got is None or info.get("init_inputs") is None:
        return None
    # compared as JSON text: 2, 2.0 and True (0.0 and -0.0) are equal to Python, not to a constructor
    if json.dumps(got[0], sort_keys=True) != json.dumps(info["init_inputs"], sort_keys=True):
        return None
    return got[1]


def _candidate_module(cand_path: str) -> types.ModuleType:
    got = _PREPARED.pop(_prepared_key(cand_path), None)
    if got is None:
        return exec_file(cand_path, "candidate")
    if isinstance(got, BaseException):
        raise got
    return got


def load_candidate_for_capture(cand_path: str, capture: Any, *, seed: int = KERNELBENCH_SEED,
                               device: str | None = None, eval_mode: bool = False,
                               sync: bool = False) -> tuple[ModelSide, WeightReport]:
    """Build the candidate against a captured reference as KernelBench would: its init inputs and
    forward inputs are the capture's; its parameters are compared by name with the reference's
    (copied into it only with `sync`)."""
    info = getattr(capture, "info", None) or {}
    where = os.path.join(getattr(capture, "path", ""), "index.json")
    module = _candidate_module(cand_path)
    cls = _candidate_class(module, cand_path)
    if info.get("init_inputs") is None:  # (never from running a file the capture names: a capture is data)
        raise DiffkitError("reference", "read", f"{where}: field 'info.init_inputs' is missing or null, so the capture "
                           f"does not say what the model was constructed from (get_init_inputs() gave arguments "
                           f"that cannot be stored, or another tool wrote it): capture the reference again with "
                           f"this diffkit, or diff the reference's .py file", where)
    try:
        init = decode_values(info["init_inputs"])
    except (KeyError, ValueError, TypeError) as e:
        raise DiffkitError("reference", "read", f"{where}: field 'info.init_inputs' cannot be read: {e}",
                           where) from None
    dev = device or info.get("device") or "cpu"
    _usable_device(dev, device, where)
    model = _built_ahead(cand_path, info)
    if isinstance(model, BaseException):
        raise model
    if model is None:
        model = _construct(cls, init, "candidate", cand_path, "ModelNew")
    try:
        inputs = _capture_inputs(capture, info)
    except (KeyError, ValueError, IndexError) as e:
        raise DiffkitError("reference", "read", f"the capture's inputs cannot be rebuilt: {e}",
                           getattr(capture, "path", "")) from e
    inputs = inputs_as_made(inputs, info, info.get("input_seed"), trusted=bool(getattr(capture, "trusted", False)))
    if dev != "cpu" or device:
        model = model.to(dev)
        inputs = _move(inputs, dev)
    params = capture.parameters() if hasattr(capture, "parameters") else {}
    weights = (sync_weights(params, model) if sync else compare_weights(params, model)) if params else WeightReport()
    if eval_mode:
        model.eval()
    return ModelSide(model, copy_inputs(inputs), init, cand_path, "ModelNew", seed, module, eval_mode=eval_mode), weights


def _usable_device(dev: str, asked: str | None, where: str) -> None:
    """The device a captured reference ran on (`info.device`, unless --device says otherwise), when it is not
    here: a sentence saying so, not torch's error from moving the model there."""
    try:
        d = torch.device(dev)
    except (RuntimeError, TypeError, ValueError):
        d = None
    field_words = f"--device {dev!r}" if asked else f"field 'info.device' is {dev!r}"
    if d is None or d.type not in ("cpu", "cuda"):
        raise DiffkitError("reference", "read", f"{where}: {field_words}, a device diffkit does not run on "
                           f"(cpu or cuda): diff with --device cpu", where)
    if d.type == "cuda" and (not torch.cuda.is_available() or (d.index or 0) >= torch.cuda.device_count()):
        have = f"{torch.cuda.device_count()} CUDA device(s)" if torch.cuda.is_available() else "no CUDA device"
        raise DiffkitError("reference", "read", f"{where}: {field_words}: the reference was captured there, and this "
                           f"machine has {have}; diff on a machine that has it, or on the CPU with --device cpu",
                           where)


_MADE_BY: dict[tuple, types.ModuleType] = {}  # reference files run to make inputs again, by path and file state


def inputs_as_made(captured: list[Any], info: dict, seed: Any, trusted: bool = False) -> list[Any]:
    """A captured reference's inputs (their stored values) for the candidate's forward.  Where the reference's
    inputs were objects their values alone do not rebuild (one tensor at two places, tensors sharing memory, a
    transposed or expanded one: the capture's `inputs_layout`), the stored values are laid out again as the capture
    says (`inputs.rebuild`).  Only for a capture this very diff wrote (`trusted`: an isolated diff's own hand-off)
    is the reference file it names run again, its get_inputs() under the trial's `seed`, and what it makes used when
    it holds exactly the stored values, laid out as they were: a capture from anywhere else is data, and nothing
    it names is run."""
    want = info.get("inputs_layout") if isinstance(info.get("inputs_layout"), list) else None
    if not want:
        return captured
    source = info.get("inputs_source")
    if not trusted or not isinstance(seed, int) or not isinstance(source, str) or not source.endswith(".py") \
            or not os.path.isfile(source):
        return rebuild(captured, want)
    state = rng_state()
    try:
        st = os.stat(source)
        key = (os.path.realpath(source), st.st_mtime_ns, st.st_size)
        module = _MADE_BY.get(key) or _MADE_BY.setdefault(key, exec_file(source, "reference"))
        made = _inputs(module, source, seed, "reference")
        devices = [t.device for t in pytree.tree_leaves(captured) if isinstance(t, torch.Tensor)]
        if devices:
            made = _move(made, devices[0])  # (where the stored values are, as a live side's inputs_for does)
    except Exception:  # the file does not run again here: its stored values, laid out as they were
        return rebuild(captured, want)
    finally:
        set_rng_state(state)
    again = as_made(captured, made, want)
    return rebuild(captured, want) if again is captured else again


def _capture_inputs(capture: Any, info: dict) -> list[Any]:
    """The forward's inputs a capture holds (its input records' values, in the structure `info`
    recorded); raises KeyError/ValueError/IndexError when they cannot be rebuilt."""
    holds = lambda m: bool(input_names(m.get("kind"), m.get("name"), m.get("aliases")))  # noqa: E731
    records = {n: r.value for r in capture.records(values=holds) for n in input_names(r.kind, r.name, r.aliases)}
    if info.get("inputs"):
        return decode_values(info["inputs"], records)
    return [records[n] for n in sorted(records, key=lambda n: int(re.findall(r"\d+", n)[0]))]


def load_reference_for_capture(capture: Any, *, device: str | None = None) -> ModelSide | None:
    """The captured side rebuilt live from the capture's own record of how it was made (its source
    file, class, init inputs and inputs), with the capture's parameters and buffers loaded into it so
    it computes exactly what was captured; None when the capture does not say enough or its source
    file is gone (what-if runs of the reference need it live)."""
    info = getattr(capture, "info", None) or {}
    if getattr(capture, "mapped", False) and not getattr(capture, "trusted", False):
        return None  # (flagged as this diff's own hand-off, but not one: a capture given by the user, run as data)
    source, cls_name = info.get("source"), info.get("class") or "Model"
    if not source or not os.path.exists(source) or info.get("init_inputs") is None:
        return None
    module = exec_file(source, "reference")
    cls = _need(module, cls_name, "reference", source) if cls_name != "ModelNew" else _candidate_class(module, source)
    init = decode_values(info["init_inputs"])
    model = _construct(cls, init, "reference", source, cls_name)
    try:
        inputs = _capture_inputs(capture, info)
    except (KeyError, ValueError, IndexError):
        return None
    params = capture.parameters() if hasattr(capture, "parameters") else {}
    if params:
        sync_weights(params, model)  # exactly the captured values, whatever the construction drew
    dev = device or info.get("device") or "cpu"
    if dev != "cpu" or device:
        model = model.to(dev)
        inputs = _move(inputs, dev)
    if info.get("eval") or info.get("training") is False:
        model.eval()
    return ModelSide(model, copy_inputs(inputs), init, source, cls_name,
                     int(info.get("seed", info.get("input_seed", KERNELBENCH_SEED))), module, source,
                     eval_mode=bool(info.get("eval")))


def _same_folder(folder: str) -> bool:
    try:
        return os.getcwd() == folder
    except OSError:  # (the current folder was removed)
        return False


def load_pair(ref_path: str, cand_path: str, *, seed: int = KERNELBENCH_SEED, device: str | None = None,
              eval_mode: bool = False, sync: bool = False, cand_class: str = "ModelNew") -> LoadedPair:
    """Build both models the way KernelBench does and give each side its own copy of the inputs.

    `seed` seeds ``get_inputs()`` (model construction always uses KernelBench's 42).  The models are
    left as constructed (training mode), as KernelBench leaves them, unless `eval_mode`; nothing is
    copied between them unless `sync` (the weight report says what differs either way).  `device`
    moves models and inputs ("cpu", "cuda").
    """
    here, cand_file = os.getcwd(), os.path.abspath(cand_path)  # (before the reference runs: it may change folder)
    progress.say("running the reference's file")
    ref_mod = exec_file(ref_path, "reference")
    progress.say("running the candidate's file (building its extensions)")
    # a reference that changed the current folder at import: the candidate is still the file the user named
    cand_mod = exec_file(cand_path if _same_folder(here) else cand_file, "candidate")
    Model = _need(ref_mod, "Model", "reference", ref_path)
    _need(ref_mod, "get_inputs", "reference", ref_path)
    ModelNew = _candidate_class(cand_mod, cand_path, cand_class)
    init = _init_inputs(ref_mod, ref_path, "reference")
    progress.say("building both models (seeded as KernelBench does)")
    ref = _construct(Model, init, "reference", ref_path, "Model")
    cand = _construct(ModelNew, init, "candidate", cand_path, "ModelNew")
    inputs = _inputs(ref_mod, ref_path, seed, "reference")
    if device:
        ref = ref.to(device)
        cand = cand.to(device)
        inputs = _move(inputs, device)
    weights = sync_weights(ref, cand) if sync else compare_weights(ref, cand)
    if eval_mode:
        ref.eval()
        cand.eval()
    return LoadedPair(ref=ref, cand=cand, ref_inputs=copy_inputs(inputs), cand_inputs=copy_inputs(inputs),
                      init_inputs=init, weights=weights, ref_path=ref_path, cand_path=cand_path,
                      ref_module=ref_mod, cand_module=cand_mod, seed=seed, device=device)
