"""Loading KernelBench-style files: a reference (`Model`) and a candidate (`ModelNew`).

Both files run as source, as KernelBench runs them: seed 42 before ``get_init_inputs()``,
again before ``Model(*init)`` and again before ``ModelNew(*init)``.  Then every reference
parameter and buffer whose qualified name and shape match is copied into the candidate, and
what matched, differed, or had no counterpart is reported: silently different weights are the
most common false alarm.
"""
from __future__ import annotations

import hashlib
import os
import re
import sys
import traceback
import types
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from .capture import _install_extension_import_hook, path_key
from .errors import DiffkitError

KERNELBENCH_SEED = 42


@dataclass
class WeightReport:
    """What copying reference weights into the candidate found, by qualified name."""

    copied: list[str] = field(default_factory=list)  # same name and shape, values differed: copied
    identical: list[str] = field(default_factory=list)  # same name and shape, already equal
    shape_mismatch: list[tuple[str, tuple, tuple]] = field(default_factory=list)  # (name, ref, cand)
    ref_only: list[str] = field(default_factory=list)
    cand_only: list[str] = field(default_factory=list)

    @property
    def matched(self) -> list[str]:
        return self.identical + self.copied

    def summary(self) -> str:
        parts = [f"{len(self.matched)} matched by name ({len(self.copied)} copied from the reference)"]
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
                   ref_only=list(d.get("ref_only", [])), cand_only=list(d.get("cand_only", [])))

    def to_dict(self) -> dict:
        return {"copied": self.copied, "identical": self.identical,
                "shape_mismatch": [[n, list(a), list(b)] for n, a, b in self.shape_mismatch],
                "ref_only": self.ref_only, "cand_only": self.cand_only}


@dataclass
class LoadedPair:
    """Both models, built and with weights synchronised, and one clone of the inputs for each side."""

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

    def fresh_inputs(self) -> tuple[list[Any], list[Any]]:
        """A new clone of the inputs for each side (the originals are kept untouched)."""
        return _clone(self.ref_inputs), _clone(self.cand_inputs)


def _clone(obj: Any) -> Any:
    return pytree.tree_map(lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v, obj)


def _move(obj: Any, device: str | torch.device) -> Any:
    return pytree.tree_map(lambda v: v.to(device) if isinstance(v, torch.Tensor) else v, obj)


_BUILD_ERROR = re.compile(r"Error building extension '([^']+)'")


def _first_compiler_errors(text: str, limit: int = 8) -> str:
    lines = text.splitlines()
    errs = [ln.strip() for ln in lines if re.search(r"\berror\b", ln, re.I) and "ninja: build stopped" not in ln
            and not ln.lstrip().startswith("FAILED:")]
    picked: list[str] = []
    for ln in errs:
        if ln not in picked:
            picked.append(ln)
        if len(picked) >= limit:
            break
    return "\n".join(picked) if picked else "\n".join(lines[:limit])


def _user_location(tb, path: str) -> str:
    frames = traceback.extract_tb(tb)
    mine = [f for f in frames if os.path.abspath(f.filename) == os.path.abspath(path)]
    f = mine[-1] if mine else (frames[-1] if frames else None)
    return f"{f.filename}:{f.lineno}" if f else path


def exec_file(path: str, side: str) -> types.ModuleType:
    """Run a KernelBench file as source and return it as a module (errors say side, phase, where)."""
    if not os.path.exists(path):
        raise DiffkitError(side, "read", f"file not found: {path}", path)
    try:
        with open(path, encoding="utf-8") as fh:
            source = fh.read()
    except (OSError, UnicodeDecodeError) as e:
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
    except Exception as e:
        text = str(e)
        m = _BUILD_ERROR.search(text)
        if m or "CalledProcessError" in type(e).__name__ or "ninja" in text[:2000] and "error" in text.lower():
            ext = m.group(1) if m else "extension"
            raise DiffkitError(side, "build", f"extension '{ext}' failed to build:\n{_first_compiler_errors(text)}",
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
            raise DiffkitError(side, "build", f"extension failed to build:\n{_first_compiler_errors(text)}",
                               _user_location(e.__traceback__, path), text[-6000:]) from e
        first = text.strip().splitlines()[0] if text.strip() else ""
        raise DiffkitError(side, phase, f"{type(e).__name__}: {first}", _user_location(e.__traceback__, path),
                           traceback.format_exc()[-6000:]) from e


def sync_weights(ref: torch.nn.Module | dict[str, torch.Tensor], cand: torch.nn.Module) -> WeightReport:
    """Copy each reference parameter/buffer (a model, or tensors by qualified name as a capture keeps
    them) into the candidate one of the same name and shape."""
    report = WeightReport()
    if isinstance(ref, torch.nn.Module):
        rstate = dict(ref.named_parameters())
        rstate.update(dict(ref.named_buffers()))
    else:
        rstate = dict(ref)
    cstate = dict(cand.named_parameters())
    cstate.update(dict(cand.named_buffers()))
    with torch.no_grad():
        for name, c in cstate.items():
            r = rstate.get(name)
            if r is None:
                report.cand_only.append(name)
            elif tuple(r.shape) != tuple(c.shape):
                report.shape_mismatch.append((name, tuple(r.shape), tuple(c.shape)))
            else:
                same = r.dtype == c.dtype and r.device == c.device and torch.equal(r, c)
                if not same:
                    c.copy_(r.to(device=c.device, dtype=c.dtype))
                    report.copied.append(name)
                else:
                    report.identical.append(name)
    report.ref_only = [n for n in rstate if n not in cstate]
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
                "device": self.device(), "training": self.model.training}


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
    """The inverse of `encode_values`; `tensors` maps input record names to their values."""
    leaves = []
    for leaf in enc["leaves"]:
        if "tensor" in leaf:
            t = (tensors or {}).get(leaf["tensor"])
            if t is None:
                raise KeyError(f"the capture holds no value for {leaf['tensor']}")
            leaves.append(t)
        else:
            leaves.append(leaf["value"])
    return pytree.tree_unflatten(leaves, pytree.treespec_loads(enc["spec"]))


def _init_inputs(module: types.ModuleType, path: str, side: str) -> list[Any]:
    get_init = getattr(module, "get_init_inputs", None) or (lambda: [])
    torch.manual_seed(KERNELBENCH_SEED)
    init = _call(side, "init", path, get_init)
    return list(init) if isinstance(init, (list, tuple)) else [init]


def _construct(cls, init: list[Any], side: str, path: str, name: str) -> torch.nn.Module:
    torch.manual_seed(KERNELBENCH_SEED)
    model = _call(side, "init", path, cls, *init)
    if not isinstance(model, torch.nn.Module):
        raise DiffkitError(side, "init", f"{name}(...) returned {type(model).__name__}, not an nn.Module", path)
    return model


def _inputs(module: types.ModuleType, path: str, seed: int, side: str) -> list[Any]:
    get_inputs = _need(module, "get_inputs", side, path)
    torch.manual_seed(seed)
    inputs = _call(side, "inputs", path, get_inputs)
    return list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]


def _candidate_class(module: types.ModuleType, path: str, name: str = "ModelNew"):
    cls = getattr(module, name, None)
    if cls is None and name == "ModelNew":
        cls = getattr(module, "Model", None)
    if cls is None:
        raise DiffkitError("candidate", "import", f"{path} defines no `{name}`", path)
    return cls


def load_reference(path: str, *, seed: int = KERNELBENCH_SEED, device: str | None = None, train: bool = False,
                   class_name: str | None = "Model", inputs_from: str | None = None,
                   side: str = "reference") -> ModelSide:
    """Build one model from its file as KernelBench does (seed 42 before get_init_inputs() and before
    construction; `seed` before get_inputs()).  `inputs_from`: take get_inputs()/get_init_inputs()
    from that file instead (a candidate file captured on its own)."""
    module = exec_file(path, side)
    if class_name is None:  # whichever the file defines
        class_name = "ModelNew" if hasattr(module, "ModelNew") else "Model"
    src = exec_file(inputs_from, "reference") if inputs_from else module
    cls = _need(module, class_name, side, path) if class_name != "ModelNew" else _candidate_class(module, path)
    init = _init_inputs(src, inputs_from or path, side)
    model = _construct(cls, init, side, path, class_name)
    inputs = _inputs(src, inputs_from or path, seed, side)
    if device:
        model = model.to(device)
        inputs = _move(inputs, device)
    model.train(train)
    return ModelSide(model, inputs, init, path, class_name, seed, module, inputs_from or path)


def load_candidate_for_capture(cand_path: str, capture: Any, *, seed: int = KERNELBENCH_SEED,
                               device: str | None = None, train: bool = False,
                               sync: bool = True) -> tuple[ModelSide, WeightReport]:
    """Build the candidate against a captured reference: its init inputs and forward inputs are the
    capture's, and (with `sync`) the reference's parameters are copied into it by name."""
    info = getattr(capture, "info", None) or {}
    module = exec_file(cand_path, "candidate")
    cls = _candidate_class(module, cand_path)
    if info.get("init_inputs") is not None:
        init = decode_values(info["init_inputs"])
    elif info.get("inputs_source") and os.path.exists(info["inputs_source"]):
        init = _init_inputs(exec_file(info["inputs_source"], "reference"), info["inputs_source"], "reference")
    else:
        raise DiffkitError("reference", "read", "the capture does not say how the model was constructed (no init "
                           "inputs, and its source file is not here): capture it again with this diffkit",
                           getattr(capture, "path", ""))
    model = _construct(cls, init, "candidate", cand_path, "ModelNew")
    records = {r.name: r.value for r in capture.records() if r.kind == "input"}
    try:
        inputs = decode_values(info["inputs"], records) if info.get("inputs") else             [records[n] for n in sorted(records, key=lambda n: int(re.findall(r"\d+", n)[0]))]
    except (KeyError, ValueError, IndexError) as e:
        raise DiffkitError("reference", "read", f"the capture's inputs cannot be rebuilt: {e}",
                           getattr(capture, "path", "")) from e
    dev = device or info.get("device") or "cpu"
    if dev != "cpu" or device:
        model = model.to(dev)
        inputs = _move(inputs, dev)
    params = capture.parameters() if hasattr(capture, "parameters") else {}
    weights = sync_weights(params, model) if sync and params else WeightReport()
    model.train(train)
    return ModelSide(model, _clone(inputs), init, cand_path, "ModelNew", seed, module,
                     info.get("inputs_source", "")), weights


def load_pair(ref_path: str, cand_path: str, *, seed: int = KERNELBENCH_SEED, device: str | None = None,
              train: bool = False, sync: bool = True, cand_class: str = "ModelNew") -> LoadedPair:
    """Build both models the way KernelBench does and give each side its own copy of the inputs.

    `seed` seeds ``get_inputs()`` (model construction always uses KernelBench's 42).  Models are
    put in ``eval()`` unless `train`.  `device` moves models and inputs ("cpu", "cuda").
    """
    ref_mod = exec_file(ref_path, "reference")
    cand_mod = exec_file(cand_path, "candidate")
    Model = _need(ref_mod, "Model", "reference", ref_path)
    _need(ref_mod, "get_inputs", "reference", ref_path)
    ModelNew = _candidate_class(cand_mod, cand_path, cand_class)
    init = _init_inputs(ref_mod, ref_path, "reference")
    ref = _construct(Model, init, "reference", ref_path, "Model")
    cand = _construct(ModelNew, init, "candidate", cand_path, "ModelNew")
    inputs = _inputs(ref_mod, ref_path, seed, "reference")
    if device:
        ref = ref.to(device)
        cand = cand.to(device)
        inputs = _move(inputs, device)
    weights = sync_weights(ref, cand) if sync else WeightReport()
    ref.train(train)
    cand.train(train)
    return LoadedPair(ref=ref, cand=cand, ref_inputs=_clone(inputs), cand_inputs=_clone(inputs),
                      init_inputs=init, weights=weights, ref_path=ref_path, cand_path=cand_path,
                      ref_module=ref_mod, cand_module=cand_mod, seed=seed)
