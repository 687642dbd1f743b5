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

from .capture import _install_extension_import_hook
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
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone(v) for v in obj)
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    return obj


def _move(obj: Any, device: str | torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_move(v, device) for v in obj)
    if isinstance(obj, dict):
        return {k: _move(v, device) for k, v in obj.items()}
    return obj


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


def sync_weights(ref: torch.nn.Module, cand: torch.nn.Module) -> WeightReport:
    """Copy each reference parameter/buffer into the candidate one of the same name and shape."""
    report = WeightReport()
    rstate = dict(ref.named_parameters())
    rstate.update(dict(ref.named_buffers()))
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
                    c.copy_(r)
                    report.copied.append(name)
                else:
                    report.identical.append(name)
    report.ref_only = [n for n in rstate if n not in cstate]
    return report


def load_pair(ref_path: str, cand_path: str, *, seed: int = KERNELBENCH_SEED, device: str | None = None,
              train: bool = False, sync: bool = True, cand_class: str = "ModelNew") -> LoadedPair:
    """Build both models the way KernelBench does and give each side its own copy of the inputs.

    `seed` seeds ``get_inputs()`` (model construction always uses KernelBench's 42).  Models are
    put in ``eval()`` unless `train`.  `device` moves models and inputs ("cpu", "cuda").
    """
    ref_mod = exec_file(ref_path, "reference")
    cand_mod = exec_file(cand_path, "candidate")
    Model = _need(ref_mod, "Model", "reference", ref_path)
    get_inputs = _need(ref_mod, "get_inputs", "reference", ref_path)
    get_init = getattr(ref_mod, "get_init_inputs", None) or (lambda: [])
    ModelNew = getattr(cand_mod, cand_class, None)
    if ModelNew is None and cand_class == "ModelNew":
        ModelNew = getattr(cand_mod, "Model", None)
    if ModelNew is None:
        raise DiffkitError("candidate", "import", f"{cand_path} defines no `{cand_class}`", cand_path)

    torch.manual_seed(KERNELBENCH_SEED)
    init = _call("reference", "init", ref_path, get_init)
    init = list(init) if isinstance(init, (list, tuple)) else [init]
    torch.manual_seed(KERNELBENCH_SEED)
    ref = _call("reference", "init", ref_path, Model, *init)
    torch.manual_seed(KERNELBENCH_SEED)
    cand = _call("candidate", "init", cand_path, ModelNew, *init)
    if not isinstance(ref, torch.nn.Module):
        raise DiffkitError("reference", "init", f"Model(...) returned {type(ref).__name__}, not an nn.Module", ref_path)
    if not isinstance(cand, torch.nn.Module):
        raise DiffkitError("candidate", "init", f"ModelNew(...) returned {type(cand).__name__}, not an nn.Module", cand_path)

    torch.manual_seed(seed)
    inputs = _call("reference", "inputs", ref_path, get_inputs)
    inputs = list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]
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
