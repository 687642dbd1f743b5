"""`--harden`: after KernelBench's verdict (which it never changes), the diff again under a matrix of settings,
each applied identically to both models, and which of them break the candidate and where.

    init       parameters constant at construction (norm weights and biases, zero biases …) drawn at random, the
               same values in both models by the diff's pairing of parameters (align.param_map: candidates
               rename them); and another construction seed for both
    inputs     each float input of get_inputs() by itself scaled x0.01, x10, x100, shifted by +3, heavy-tailed
    shape      each module-level int constant the reference's get_inputs/get_init_inputs read, changed to a
               prime above it, set in both files' namespaces before both models are built again
    precision  TF32 on / off for matmul and cuDNN (CUDA only, where it changes the reference)

plus a finding when the reference's output does not depend on one of its inputs (`input_independent`).

Both files are loaded (and their extensions built) once; each setting runs one trial: both forwards, their
outputs compared by KernelBench's fixed tolerance; a setting out of it is diffed in full (pipeline.run) under
the `--tolerance auto` rule (the reference's own float64 noise floor at that setting), which decides: a setting
breaks the candidate only when it fails that rule too (`judged_by` says which rule judged it).  A setting that
makes the reference itself fail or non-finite is "skipped", with a note.
"""
from __future__ import annotations

import ast
import contextlib
import inspect
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from .align import layout_of_equal, param_map
from .errors import DiffkitError
from .inputs import copy_inputs
from .load import KERNELBENCH_SEED, exec_file, sync_weights
from .modelstate import all_parameters, output_leaves, restore_parameters, restore_state, seed_all, snapshot_state
from .options import Options, Tolerance
from .pipeline import run
from .result import Finding, Harden, HardenSetting, Result
from .runner import named_tensors
from .sources import ModelSource
from .trials import forward, trial_seeds

__all__ = ["harden", "harden_models", "size_constants", "INPUT_CHANGES", "OTHER_SEED"]

OTHER_SEED = 7  # the other construction seed (KernelBench's is 42)
SPREAD = 0.5  # a constant parameter c is redrawn as c + SPREAD * max(|c|, 1) * N(0, 1)
HEAVY_CLIP = 1e3  # heavy-tailed inputs: a Cauchy draw clipped to +-HEAVY_CLIP


def _heavy(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    u = torch.rand(t.shape, generator=gen, dtype=torch.float64)
    return torch.tan(math.pi * (u - 0.5)).clamp(-HEAVY_CLIP, HEAVY_CLIP).to(device=t.device, dtype=t.dtype)


# each float input changed by itself: (words, how)
INPUT_CHANGES: list[tuple[str, Callable[[torch.Tensor, torch.Generator], torch.Tensor]]] = [
    ("x 0.01", lambda t, g: t * 0.01),
    ("x 10", lambda t, g: t * 10),
    ("x 100", lambda t, g: t * 100),
    ("+ 3", lambda t, g: t + 3),
    ("heavy-tailed (Cauchy, clipped to 1e3)", _heavy),
]


@dataclass
class _Pair:
    """The two models of a harden run, the trial-1 inputs, and (from files) what rebuilds them."""

    ref: torch.nn.Module
    cand: torch.nn.Module
    inputs: list
    seed: int  # the inputs' seed (KernelBench's trial 1)
    options: Options
    ref_mod: Any = None  # the files run as modules (None: live models, no rebuild)
    cand_mod: Any = None
    ref_path: str = ""
    cand_path: str = ""
    names: list = field(default_factory=list)  # the forward's parameter names, by input position

    def device(self) -> str:
        for p in self.ref.parameters():
            return str(p.device)
        for t in pytree.tree_leaves(self.inputs):
            if isinstance(t, torch.Tensor):
                return str(t.device)
        return "cpu"

    def input_words(self, i: int) -> str:
        return f"`{self.names[i]}` (input {i})" if i < len(self.names) else f"input {i}"


# ----------------------------------------------------------------------------- entry points
def harden(ref_path: str, cand_path: str, options: Options, result: Result, *,
           modules: tuple | None = None) -> Harden:
    """The matrix for two KernelBench files (REF's `Model`, CAND's `ModelNew`), both loaded once here
    (`modules`: the two files as the diff ran them, reused: no extension is loaded again).  `result` is the
    diff's, whose verdict the matrix never changes."""
    start = time.perf_counter()
    seed = trial_seeds(1, options.seed)[0]
    try:
        ref_mod, cand_mod = modules or (exec_file(ref_path, "reference"), exec_file(cand_path, "candidate"))
        ref, cand, inputs = _build(ref_mod, cand_mod, ref_path, cand_path, options, KERNELBENCH_SEED, seed)
    except DiffkitError as e:
        return Harden("robust", [], [Finding("harden_not_run", f"--harden could not load the pair: {e.message}",
                                             1.0)], time.perf_counter() - start)
    pair = _Pair(ref, cand, inputs, seed, options, ref_mod, cand_mod, ref_path, cand_path, _forward_names(ref))
    return _matrix(pair, start)


def harden_models(ref: torch.nn.Module, cand: torch.nn.Module, inputs: list, options: Options) -> Harden:
    """The matrix for two live models (`diffkit.compare(..., harden=True)`): no file, so no shape setting and
    no other construction seed."""
    pair = _Pair(ref, cand, list(inputs), options.seed, options, names=_forward_names(ref))
    return _matrix(pair, time.perf_counter())


def _matrix(pair: _Pair, start: float) -> Harden:
    settings: list[HardenSetting] = []
    kept = (snapshot_state(pair.ref), snapshot_state(pair.cand))
    try:
        findings = _reference_findings(pair)
        for kind, name, setting in _settings(pair):
            t0 = time.perf_counter()
            try:
                s = setting()
            except DiffkitError as e:  # (a side that could not be built or run at this setting)
                s = HardenSetting("", "", "error" if e.side == "candidate" else "skipped")
                s.error, s.note = (e.message, "") if e.side == "candidate" else (None, e.message)
            except Exception as e:  # diffkit's own failure at this setting: said, never blamed on the candidate
                s = HardenSetting("", "", "skipped", note=f"diffkit could not run this setting: {type(e).__name__}: "
                                                          f"{str(e).strip()[:300]}")
            finally:
                restore_state(pair.ref, kept[0])
                restore_state(pair.cand, kept[1])
            s.kind, s.name, s.seconds = kind, s.name or name, time.perf_counter() - t0
            settings.append(s)
    finally:
        restore_state(pair.ref, kept[0])
        restore_state(pair.cand, kept[1])
    verdict = "breaks" if any(s.breaks for s in settings) else "robust"
    return Harden(verdict, settings, findings, time.perf_counter() - start)


def _settings(pair: _Pair) -> list[tuple[str, str, Callable[[], HardenSetting]]]:
    out = list(_init_settings(pair)) + list(_input_settings(pair)) + list(_shape_settings(pair))
    return out + list(_precision_settings(pair))


# ----------------------------------------------------------------------------- building
def _forward_names(model: torch.nn.Module) -> list[str]:
    try:
        return [p.name for p in inspect.signature(model.forward).parameters.values()
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return []


def _call(side: str, phase: str, fn, *args):
    try:
        return fn(*args)
    except DiffkitError:
        raise
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise DiffkitError(side, phase, f"{type(e).__name__}: {first}"[:480]) from e


def _build(ref_mod, cand_mod, ref_path: str, cand_path: str, options: Options, construct_seed: int,
           input_seed: int) -> tuple[torch.nn.Module, torch.nn.Module, list]:
    """Both models as KernelBench builds them (`construct_seed` before get_init_inputs() and before each
    constructor), from the reference's get_init_inputs/get_inputs; on the diff's device, in its mode."""
    for mod, attr, side, path in ((ref_mod, "Model", "reference", ref_path), (cand_mod, "ModelNew", "candidate",
                                                                              cand_path)):
        if getattr(mod, attr, None) is None:
            raise DiffkitError(side, "import", f"{path} defines no `{attr}`", path)
    torch.manual_seed(construct_seed)
    init = list(_call("reference", "init", getattr(ref_mod, "get_init_inputs", None) or (lambda: [])))
    torch.manual_seed(construct_seed)
    ref = _call("reference", "init", ref_mod.Model, *init)
    torch.manual_seed(construct_seed)
    cand = _call("candidate", "init", cand_mod.ModelNew, *init)
    torch.manual_seed(input_seed)
    inputs = list(_call("reference", "inputs", ref_mod.get_inputs))
    if options.device:
        ref, cand = ref.to(options.device), cand.to(options.device)
        inputs = pytree.tree_map(lambda v: v.to(options.device) if isinstance(v, torch.Tensor) else v, inputs)
    if options.sync_weights:
        sync_weights(ref, cand)
    if options.eval:
        ref.eval()
        cand.eval()
    return ref, cand, inputs


# ----------------------------------------------------------------------------- one setting: a trial, judged
def _run(model: torch.nn.Module, inputs: list, seed: int, no_grad: bool) -> tuple[dict | None, str]:
    seed_all(seed)
    out, err = forward(model, inputs, no_grad)
    if err:
        return None, err
    return {n: v.detach() for n, v in output_leaves(out).items()}, ""


def _finite(leaves: dict) -> bool:
    return all(bool(torch.isfinite(v).all()) for v in leaves.values() if v.is_floating_point() or v.is_complex())


def _errors(ref: dict, cand: dict, tol: Tolerance) -> tuple[float, float, bool]:
    """(max |c - r|, mean |c - r|, within KernelBench's elementwise tolerance) over every output tensor."""
    worst, total, count, ok = 0.0, 0.0, 0, True
    for n, r in ref.items():
        c = cand[n].to(device=r.device)
        if r.is_floating_point():
            atol, rtol = tol.for_dtype(r.dtype)
            ok = ok and bool(torch.allclose(c.to(r.dtype), r, atol=atol, rtol=rtol))
        else:
            ok = ok and bool(torch.equal(c.to(r.dtype), r))
        d = (c.double() - r.double()).abs()
        d = torch.where(torch.isnan(d), torch.full_like(d, math.inf), d)
        if d.numel():
            worst, total, count = max(worst, float(d.max())), total + float(d.sum()), count + d.numel()
    return worst, (total / count if count else 0.0), ok


def _shape_words(ref: dict, cand: dict) -> str | None:
    if set(ref) != set(cand):
        return f"the candidate returns {sorted(cand)} where the reference returns {sorted(ref)}"
    for n, r in ref.items():
        if tuple(r.shape) != tuple(cand[n].shape):
            where = "" if n == "output" else f" {n}"
            return (f"the candidate's output{where} has shape {list(cand[n].shape)} where the reference's has "
                    f"{list(r.shape)}")
    return None


def _auto_options(options: Options) -> Options:
    t = options.tolerance
    return options.replace(trials=1, tolerance=Tolerance(t.atol, t.rtol, "auto", t.stat), health=False, rerun=False,
                           explain=False, streaming=False, max_memory=None, only=None, stop_at_first=False,
                           stream_dir=None, harden=False)


def judge_setting(ref: torch.nn.Module, cand: torch.nn.Module, inputs: list, seed: int,
                  options: Options) -> HardenSetting:
    """One trial of both models on `inputs`: the outputs by KernelBench's tolerance; out of it, the full diff
    under the float64 noise-floor rule, which decides."""
    s = HardenSetting(kind="", name="", verdict="match")
    kept = (snapshot_state(ref), snapshot_state(cand))
    ref_out, err = _run(ref, inputs, seed, options.no_grad)
    if err:
        s.verdict, s.note = "skipped", f"the reference itself raises here: {err}"
        return s
    if not _finite(ref_out):
        s.verdict, s.note = "skipped", "the reference's own output is not finite here"
        return s
    cand_out, err = _run(cand, inputs, seed, options.no_grad)
    if err:
        s.verdict, s.error = "error", f"the candidate raised {err}"
        return s
    s.error = _shape_words(ref_out, cand_out)
    if s.error:
        s.verdict = "error"
        return s
    s.max_abs, s.mean_abs, ok = _errors(ref_out, cand_out, options.tolerance)
    if ok:
        return s
    restore_state(ref, kept[0])  # (the full diff starts where this trial's forwards did)
    restore_state(cand, kept[1])
    full = run(ModelSource(ref, copy_inputs(inputs), seed=seed), ModelSource(cand, copy_inputs(inputs), seed=seed),
               _auto_options(options))
    s.judged_by = "auto"
    if full.verdict == "error":
        s.verdict = "error"
        s.error = full.error.message if full.error is not None else "the full diff could not compare the outputs"
        return s
    s.verdict = full.verdict
    if full.verdict == "match":
        s.note = (f"out of KernelBench's tolerance (max |c - r| {s.max_abs:.3g}) but within the reference's own "
                  f"float64 noise floor here")
        return s
    fd, rc = full.first_divergence, full.root_cause
    s.first_divergence = fd.divergence_dict() if fd is not None else None
    s.root_cause = rc.divergence_dict() if rc is not None else None
    return s


# ----------------------------------------------------------------------------- init
def constant_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The floating-point parameters whose elements are all equal (as constructed: ones, zeros, a constant)."""
    out = {}
    for n, p in model.named_parameters():
        if p.is_floating_point() and p.numel() >= 1 and not p.is_meta:
            flat = p.detach().reshape(-1)
            if bool((flat == flat[0]).all()) and bool(torch.isfinite(flat[0])):
                out[n] = p
    return out


def _owner_words(model: torch.nn.Module, names: list[str]) -> str:
    """"GroupNorm weight and bias, Linear bias" for parameters by qualified name."""
    modules = dict(model.named_modules())
    by_type: dict[str, list[str]] = {}
    for n in names:
        owner, _, attr = n.rpartition(".")
        kind = type(modules.get(owner, model)).__name__
        if attr not in by_type.setdefault(kind, []):
            by_type[kind].append(attr)
    return ", ".join(f"{k} {' and '.join(v)}" for k, v in by_type.items())


def _init_settings(pair: _Pair):
    consts = constant_parameters(pair.ref)
    if consts:
        yield "init", f"random {_owner_words(pair.ref, list(consts))} (constant at construction)", \
            lambda: _random_constants(pair, consts)
    if pair.ref_mod is not None:
        yield "init", f"construction seed {OTHER_SEED} (KernelBench's is {KERNELBENCH_SEED})", lambda: _rebuilt(pair)


def _random_constants(pair: _Pair, consts: dict[str, torch.Tensor]) -> HardenSetting:
    """The constant parameters redrawn; each candidate parameter or buffer paired with one of them (as the diff
    pairs parameters: by name, else by equal values, else by shape) gets the same values, in its layout."""
    gen = torch.Generator().manual_seed(pair.seed)
    rstate, cstate = named_tensors(pair.ref), named_tensors(pair.cand)
    paired = param_map(rstate, cstate)  # candidate name -> reference name (on the values as constructed)
    kept = (all_parameters(pair.ref), all_parameters(pair.cand), snapshot_state(pair.cand))
    new = {}
    for n, p in consts.items():
        c = float(p.detach().reshape(-1)[0])
        draw = c + SPREAD * max(abs(c), 1.0) * torch.randn(p.shape, generator=gen, dtype=torch.float64)
        new[n] = draw.to(device=p.device, dtype=p.dtype)
    try:
        with torch.no_grad():
            for cn, rn in paired.items():
                if rn in new:
                    _copy_paired(rstate[rn], cstate[cn], new[rn])
            for n, p in consts.items():
                p.copy_(new[n])
        s = judge_setting(pair.ref, pair.cand, pair.inputs, pair.seed, pair.options)
        missing = [n for n in consts if n not in paired.values()]
        if s.breaks and missing:
            listed = ", ".join(missing[:4]) + (" …" if len(missing) > 4 else "")
            s.note = (f"the candidate holds no counterpart of {listed}: it uses the values the reference is built with, written in, or folded into another "
                      f"tensor at construction (which keeps the values it was built with)")
        return s
    finally:
        restore_parameters(pair.ref, kept[0])
        restore_parameters(pair.cand, kept[1])
        restore_state(pair.cand, kept[2])


def _copy_paired(r_old: torch.Tensor, c: torch.Tensor, value: torch.Tensor) -> None:
    how = layout_of_equal(r_old, c)
    if how == "transposed":
        value = value.transpose(-1, -2)
    elif how == "reshaped" or (how is None and value.numel() == c.numel() and tuple(value.shape) != tuple(c.shape)):
        value = value.reshape(c.shape)
    if tuple(value.shape) == tuple(c.shape):
        c.copy_(value.to(device=c.device, dtype=c.dtype))


@contextlib.contextmanager
def _constants_set(pair: _Pair, constants: dict[str, int]):
    """Module-level constants set in both files' namespaces (the candidate's where it has the name), then put back."""
    saved = []
    for mod in (pair.ref_mod, pair.cand_mod):
        for k, v in constants.items():
            if k in vars(mod) or mod is pair.ref_mod:
                saved.append((mod, k, k in vars(mod), vars(mod).get(k)))
                setattr(mod, k, v)
    try:
        yield
    finally:
        for mod, k, had, v in reversed(saved):
            if had:
                setattr(mod, k, v)
            else:
                delattr(mod, k)


def _rebuilt(pair: _Pair, constants: dict[str, int] | None = None) -> HardenSetting:
    """Both models built again (another construction seed, or size constants changed in both files' namespaces),
    then one trial on the reference's get_inputs() there."""
    constants = constants or {}
    seed = KERNELBENCH_SEED if constants else OTHER_SEED
    with _constants_set(pair, constants):
        try:
            ref, cand, inputs = _build(pair.ref_mod, pair.cand_mod, pair.ref_path, pair.cand_path, pair.options, seed,
                                       pair.seed)
        except DiffkitError as e:
            if e.side == "candidate":
                return HardenSetting("", "", "error", error=f"the candidate fails to build here: {e.message}")
            return HardenSetting("", "", "skipped", note=f"the reference itself fails here: {e.message}")
        return judge_setting(ref, cand, inputs, pair.seed, pair.options)


# ----------------------------------------------------------------------------- inputs
def _input_settings(pair: _Pair):
    for i, x in enumerate(pair.inputs):
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            for words, how in INPUT_CHANGES:
                yield "inputs", f"{pair.input_words(i)} {words}", \
                    lambda i=i, how=how: _changed_input(pair, i, how)


def _changed_input(pair: _Pair, i: int, how) -> HardenSetting:
    gen = torch.Generator().manual_seed(pair.seed + i)
    inputs = list(pair.inputs)
    inputs[i] = how(inputs[i].detach().clone(), gen)
    return judge_setting(pair.ref, pair.cand, inputs, pair.seed, pair.options)


# ----------------------------------------------------------------------------- shape
def size_constants(path: str) -> dict[str, int]:
    """The module-level int constants of the file at `path` that its get_inputs/get_init_inputs read (directly, or
    through module-level functions they call)."""
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), filename=path)
    consts: dict[str, int] = {}
    functions: dict[str, set[str]] = {}  # module-level function -> the names its body reads
    for node in tree.body:
        if isinstance(node, ast.Assign) or isinstance(node, ast.AnnAssign) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                pairs = zip(t.elts, node.value.elts) if isinstance(t, ast.Tuple) and \
                    isinstance(node.value, ast.Tuple) and len(t.elts) == len(node.value.elts) else [(t, node.value)]
                for name, value in pairs:
                    if isinstance(name, ast.Name) and isinstance(value, ast.Constant) and \
                            type(value.value) is int:
                        consts[name.id] = value.value
                    elif isinstance(name, ast.Name):
                        consts.pop(name.id, None)  # (assigned something else later)
        elif isinstance(node, ast.FunctionDef):
            functions[node.name] = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)
                                    and isinstance(n.ctx, ast.Load)}
    read: set[str] = set()
    todo = [f for f in ("get_inputs", "get_init_inputs") if f in functions]
    seen = set(todo)
    while todo:
        names = functions[todo.pop()]
        read |= names
        for f in names & set(functions) - seen:
            seen.add(f)
            todo.append(f)
    return {k: v for k, v in consts.items() if k in read}


def next_size(v: int) -> int:
    """The first prime above `v` (a size no common tile divides); v + 1 below 2."""
    if v < 2:
        return v + 1
    n = v + 1
    while any(n % d == 0 for d in range(2, int(math.isqrt(n)) + 1)):
        n += 1
    return n


def _shape_settings(pair: _Pair):
    if pair.ref_mod is None:
        return
    for name, value in size_constants(pair.ref_path).items():
        now = vars(pair.ref_mod).get(name, value)
        if type(now) is not int:
            continue
        yield "shape", f"{name} {now} -> {next_size(now)}", lambda name=name, now=now: _other_size(pair, name, now)


def size_candidates(v: int) -> list[int]:
    """The values tried for a size constant `v`, best first: the prime above it, then v+1 … v+8 (multiples of 8
    last), for a reference whose sizes constrain each other (a width its number of heads must divide)."""
    first = next_size(v)
    near = [v + k for k in range(1, 9) if v + k != first]
    return [first] + [n for n in near if n % 8] + [n for n in near if not n % 8]


def _other_size(pair: _Pair, name: str, now: int) -> HardenSetting:
    """The first size (`size_candidates`) at which the reference builds and runs, both models there."""
    tried = []
    for new in size_candidates(now):
        s = _rebuilt(pair, {name: new})
        if s.verdict != "skipped":
            s.name = f"{name} {now} -> {new}"
            return s
        tried.append(new)
        note = s.note
    s.note = f"the reference itself fails at {name} = {', '.join(map(str, tried))}: {note}"
    return s


# ----------------------------------------------------------------------------- precision
def _tf32() -> tuple[bool, bool]:
    return torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32


def _set_tf32(flags: tuple[bool, bool]) -> None:
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags


def _precision_settings(pair: _Pair):
    if not pair.device().startswith("cuda"):
        yield "precision", "TF32 on/off", lambda: HardenSetting(
            "", "", "skipped", note="TF32 is a CUDA setting: this diff runs on the CPU")
        return
    for on in (True, False):
        yield "precision", f"TF32 {'on' if on else 'off'} (matmul and cuDNN)", lambda on=on: _tf32_setting(pair, on)


def _tf32_setting(pair: _Pair, on: bool) -> HardenSetting:
    before = _tf32()
    try:
        base, _ = _run(pair.ref, pair.inputs, pair.seed, pair.options.no_grad)
        _set_tf32((on, on))
        there, _ = _run(pair.ref, pair.inputs, pair.seed, pair.options.no_grad)
        if base is not None and there is not None and set(base) == set(there) and \
                all(torch.equal(base[n], there[n]) for n in base):
            return HardenSetting("", "", "skipped", note=f"TF32 {'on' if on else 'off'} does not change the "
                                                         f"reference's output")
        return judge_setting(pair.ref, pair.cand, pair.inputs, pair.seed, pair.options)
    finally:
        _set_tf32(before)


# ----------------------------------------------------------------------------- the reference itself
def _same(a: dict | None, b: dict | None) -> bool:
    return a is not None and b is not None and set(a) == set(b) and all(
        tuple(a[n].shape) == tuple(b[n].shape) and torch.equal(a[n], b[n]) for n in a)


def _reference_findings(pair: _Pair) -> list[Finding]:
    """`input_independent` for each input whose values the reference's output does not depend on: unchanged when
    the input's elements are shuffled (the same values, redrawn in other places) and when it is zeroed."""
    base, err = _run(pair.ref, pair.inputs, pair.seed, pair.options.no_grad)
    if err or base is None or not _finite(base):
        return []
    out = []
    for i, x in enumerate(pair.inputs):
        if not isinstance(x, torch.Tensor) or x.numel() < 2:
            continue
        gen = torch.Generator().manual_seed(pair.seed + 1000 + i)
        flat = x.detach().reshape(-1)
        shuffled = flat[torch.randperm(flat.numel(), generator=gen).to(flat.device)]
        if torch.equal(shuffled, flat):
            continue  # (all elements equal: shuffling redraws nothing)
        same = True
        for changed in (shuffled.reshape(x.shape).clone(), torch.zeros_like(x)):
            inputs = list(pair.inputs)
            inputs[i] = changed
            if not _same(base, _run(pair.ref, inputs, pair.seed, pair.options.no_grad)[0]):
                same = False
                break
        if same:
            words = pair.input_words(i)
            out.append(Finding("input_independent", f"the reference's output does not depend on {words}: any "
                                                    f"candidate that computes the right function of the parameters "
                                                    f"passes", 1.0))
    return out
