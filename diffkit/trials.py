"""Trials: KernelBench's correctness protocol, trial by trial, with the candidate run twice each time.

KernelBench draws one seed per trial from its own seed (``torch.manual_seed(42)``, then one
``torch.randint(0, 2**32 - 1, (1,))`` per trial), seeds each trial's ``get_inputs()`` with it, runs
the same two model objects on those inputs and passes a trial when ``torch.allclose`` accepts the
output.  diffkit runs the same trials:

- trial 1 is diffed in full (every stage captured, root cause, diagnosis: `pipeline.run`);
- every later trial compares outputs only, KernelBench's way;
- the first trial that fails is captured in full and becomes the result reported ("diverges on
  trial 3 of 5, seed …"); the others stay in ``result.trials``;
- on every trial the candidate runs twice on the same inputs (its buffers restored in between):
  any bitwise difference between the two runs is a ``nondeterministic`` finding, and a trial fails
  when either run is out of tolerance -- a race that another GPU's scheduling would expose.

Either side is live (`LiveReference`, `LiveCandidate`: the model, and the reference file's
``get_inputs()``) or a capture (`CapturedTrials`): `capture_reference` captures trial 1 in the
capture directory itself and every later trial, in full, in ``trial-K.dkt`` inside it, so a
candidate process runs the trials -- and diffs a failing one stage by stage -- without the
reference model, and two captures are diffed trial by trial without re-running anything.
"""
from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass, field, fields
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from .capture import input_values, materialized, rng_state, set_rng_state
from .errors import DiffkitError
from .inputs import copy_inputs
from .measure import ask_kernelbench, measure
from .options import Options, Tolerance

__all__ = ["KERNELBENCH_SEED", "KERNELBENCH_TRIALS", "trial_seeds", "seed_all", "Trial", "bitwise_difference",
           "output_leaves", "snapshot_state", "restore_state", "LiveReference", "LiveCandidate", "CapturedTrials",
           "run_trials", "write_trials"]

KERNELBENCH_SEED = 42  # KernelBench's seed_num: construction and the trial seeds come from it
KERNELBENCH_TRIALS = 5  # num_correct_trials in KernelBench's drivers
TRIAL_SEED_HIGH = 2 ** 32 - 1  # torch.randint's exclusive upper bound in KernelBench's seed draw
TRIAL_DIR = re.compile(r"trial-([0-9]{1,6})\.dkt")
MAX_SHOWN = 4  # differing element indices named in a nondeterminism finding


def trial_seeds(n: int, seed: int = KERNELBENCH_SEED) -> list[int]:
    """KernelBench's per-trial input seeds: ``torch.manual_seed(seed)``, then one
    ``torch.randint(0, 2**32 - 1, (1,)).item()`` per trial (drawn from a generator of its own, which
    gives the same numbers without disturbing the global one)."""
    gen = torch.Generator().manual_seed(seed)
    return [int(torch.randint(0, TRIAL_SEED_HIGH, (1,), generator=gen).item()) for _ in range(n)]


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

    @property
    def failed(self) -> bool:
        return not self.allclose

    def to_dict(self) -> dict:
        from .result import _num

        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["max_abs"], d["mean_abs"] = _num(self.max_abs), _num(self.mean_abs)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Trial":
        kw = {f.name: d[f.name] for f in fields(cls) if f.name in d}
        return cls(**kw)


def bitwise_difference(a: torch.Tensor, b: torch.Tensor) -> dict | None:
    """None when `a` and `b` hold the same bits; else how many elements differ, where the first few
    are, and the largest difference."""
    if tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
        return {"elements": max(a.numel(), b.numel()), "numel": max(a.numel(), b.numel()), "max_abs": float("inf"),
                "at": [], "shape": [list(a.shape), list(b.shape)]}
    a, b = a.detach(), b.detach().to(a.device)
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    if a.is_floating_point():
        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        mask = a.contiguous().view(ints) != b.contiguous().view(ints)
    else:
        mask = a != b
    if a.dim() and mask.dim() > a.dim():  # complex viewed as real: one flag per element
        mask = mask.any(-1)
    n = int(mask.sum())
    if n == 0:
        return None
    at = [list(map(int, ix)) for ix in mask.nonzero()[:MAX_SHOWN].tolist()] if mask.dim() else [[]]
    diff = torch.nan_to_num((a.double() - b.double()).abs(), nan=float("inf")) if a.is_floating_point() else \
        (a.double() - b.double()).abs()
    return {"elements": n, "numel": mask.numel(), "max_abs": float(diff.max()) if diff.numel() else 0.0, "at": at}


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
    from .capture import path_key

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
    return {n: b.detach().clone() for n, b in materialized(model.named_buffers())}


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
    for n, p in materialized(model.named_parameters()):
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
        params = dict(materialized(model.named_parameters())) if model is not None else {}
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
        params = dict(materialized(self.model.named_parameters()))
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
        p = dict(materialized(self.model.named_parameters())).get(name) if self.model is not None else None
        return v is None or p is None or not _same_values(v, p.detach())


def all_parameters(model: torch.nn.Module | None) -> dict[str, torch.Tensor]:
    """A copy of every parameter's values by qualified name."""
    if model is None:
        return {}
    return {n: p.detach().clone() for n, p in materialized(model.named_parameters())}


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
        _put_back(materialized(model.named_parameters()), kept, replace=True)


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
    for n, p in materialized(model.named_parameters()):
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
        _put_back(materialized(model.named_buffers()), snap)


def forward(model: torch.nn.Module, inputs: list, no_grad: bool = True,
            left: dict | None = None) -> tuple[Any, str]:
    """One plain forward (no capture, as KernelBench runs it) on a copy of `inputs`: (output, "") or
    (None, what it raised).  `left`, when given, receives the input tensors the forward changed in place,
    by input record name, as it left them (`capture.changed_inputs`)."""
    import contextlib

    from .capture import _tensors, changed_inputs, input_name

    args = copy_inputs(list(inputs))
    given = [(input_name(pos), t, inputs_t) for (pos, t), (_, inputs_t) in
             zip(_tensors(args), _tensors(list(inputs)))] if left is not None else []
    try:
        try:
            with torch.no_grad() if no_grad else contextlib.nullcontext():
                out = model(*args)
        finally:
            if left is not None:
                left.update(changed_inputs(given))
        if any(isinstance(t, torch.Tensor) and t.is_cuda for t in pytree.tree_leaves(out)):
            torch.cuda.synchronize()
        return out, ""
    except (Exception, SystemExit) as e:  # the model's own failure (sys.exit too), reported as this trial's error
        try:
            text = str(e).strip()
        except Exception:  # (an exception whose message cannot be made)
            text = ""
        first = text.splitlines()[0] if text else ""
        where = raised_at(e)
        return None, f"{type(e).__name__}: {first}"[:480] + (f" (at {where})" if where else "")


def raised_at(e: BaseException) -> str:
    """Where in the user's code `e` was raised: the innermost frame of its traceback outside torch, diffkit, Python's
    own library and installed packages ("ref.py:8 in forward"); "" when there is none."""
    import sysconfig
    import traceback

    skip = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (torch, pytree) if m.__file__)
    skip += (os.path.dirname(os.path.abspath(__file__)) + os.sep, sysconfig.get_paths()["stdlib"] + os.sep)
    try:
        frames = traceback.extract_tb(e.__traceback__)
    except Exception:
        return ""
    for fr in reversed(frames):
        path = os.path.abspath(fr.filename) if fr.filename and not fr.filename.startswith("<") else ""
        installed = f"{os.sep}site-packages{os.sep}" in path or f"{os.sep}dist-packages{os.sep}" in path
        if path and not path.startswith(skip) and not installed:
            return f"{os.path.basename(path)}:{fr.lineno} in {fr.name}"
    return ""


def check_output(trial: Trial, ref: dict[str, torch.Tensor], cand: dict[str, torch.Tensor],
                 tolerance: Tolerance) -> bool:
    """KernelBench's rule on one run's output, into `trial` (numbers of the first failing run, or of
    the passing one); True when it passes."""
    if set(ref) != set(cand):
        trial.shape_mismatch = trial.shape_mismatch or [sorted(ref), sorted(cand)]
        return False
    worst, total, count, ok = 0.0, 0.0, 0, True
    for key, r in ref.items():
        c = cand[key]
        if tuple(r.shape) != tuple(c.shape):
            trial.shape_mismatch = trial.shape_mismatch or [list(r.shape), list(c.shape)]
            ok = False
            continue
        if r.dtype != c.dtype:  # torch.allclose raises on mixed dtypes, which fails the trial
            trial.dtype_mismatch = trial.dtype_mismatch or [str(r.dtype).replace("torch.", ""),
                                                            str(c.dtype).replace("torch.", "")]
            ok = False
        r = r.to(c.device)
        st = measure(r, c, *tolerance.for_dtype(r.dtype), tolerance.stat)
        ask_kernelbench(st, r, c)  # KernelBench's own call decides (see measure.kernelbench_allclose)
        ok = ok and st.ok
        worst = max(worst, st.max_abs) if st.max_abs == st.max_abs else float("nan")
        total += st.mean_abs * st.numel
        count += st.numel
    trial.max_abs, trial.mean_abs = worst, (total / count if count else 0.0)
    return ok


def _first_difference(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> tuple[str, dict] | None:
    """The first output leaf (and how) two runs' outputs differ bitwise in, or None."""
    for key in first:
        d = bitwise_difference(first[key], second[key]) if key in second else None
        if d is not None:
            return key, d
    return None


def check_candidate(model: torch.nn.Module, inputs: list, ref: dict[str, torch.Tensor], trial: Trial,
                    options: Options, rng: dict | None = None, guard: ParameterGuard | None = None) -> Trial:
    """Run the candidate on one trial's inputs (twice with `options.rerun`, its buffers restored
    between the runs so both start from the same state) and judge its output(s) against `ref`.
    `rng`: the random generators' states its first run starts from (where the reference's forward left
    them, as KernelBench seeds a trial once); without it, the trial's seed."""
    before = snapshot_state(model)
    if guard is None:
        guard = ParameterGuard(model)
    attrs = attribute_state(model) if options.rerun else {}
    if rng:
        set_rng_state(rng)
    else:
        seed_all(trial.seed)
    out, err = forward(model, inputs, options.no_grad)
    if err:
        trial.error, trial.error_side, trial.failed_run = err, "candidate", 1
        return trial
    first = output_leaves(out)
    ok = check_output(trial, ref, first, options.tolerance)
    trial.failed_run = None if ok else 1
    if options.rerun:
        after = snapshot_state(model)
        wrote = guard.after_run()
        attrs_after = attribute_state(model)
        # the second run starts from the first's state: buffers, plain attributes, and the parameters the first
        # wrote (where their values from before it can be had): a forward that changes its own state repeats
        # itself, and a difference is a race, an uninitialised read or randomness
        # (attributes put back may make the second run repeat a one-time step, a fold into the weights guarded by
        # a flag: every parameter as the first run left it is kept then, whoever writes it, a kernel included)
        whole = all_parameters(model) if attrs != attrs_after else {}
        same_state = to_first_state(model, before, attrs, guard)
        out2, err2 = forward(model, inputs, options.no_grad)
        # (parameters written for the first time on this trial, values from before unknown: the second run
        # started from what the first left, another computation KernelBench never makes; it fails no trial)
        changes_state = not same_state and any(guard.moved_since(n) for n in wrote)
        to_where_it_left(model, after, guard, whole, attrs_after)
        second = None if err2 else output_leaves(out2)
        if second is not None and (whole or wrote) and _first_difference(first, second) is not None:
            # the state put back may be one the model is never in (weights unfolded, the flag that guards the
            # fold kept): run once more from where the first run left it (buffers put back); the same output
            # then says the difference was the state, not a race
            restore_state(model, before)
            out3, err3 = forward(model, inputs, options.no_grad)
            to_where_it_left(model, after, guard, whole, attrs_after)
            if not err3 and _first_difference(first, output_leaves(out3)) is None:
                second = output_leaves(out3)
        if err2:
            trial.error, trial.error_side = f"its second run on the same inputs raised {err2}", "candidate"
            trial.failed_run = trial.failed_run or 2
            ok = False
        else:
            found = _first_difference(first, second)
            if found is not None:
                key, d = found
                trial.nondeterministic = {**d, "where": key, **({"stateful": True} if changes_state else {})}
            if trial.nondeterministic is not None and not changes_state:
                again = Trial(trial.trial, trial.seed)
                if not check_output(again, ref, second, options.tolerance) and ok:
                    trial.failed_run, trial.max_abs, trial.mean_abs = 2, again.max_abs, again.mean_abs
                    trial.shape_mismatch, trial.dtype_mismatch = again.shape_mismatch, again.dtype_mismatch
                    ok = False
    trial.allclose = ok
    return trial


# ----------------------------------------------------------------------------------- the two sides
@dataclass
class LiveReference:
    """The reference model in this process: each trial's inputs from its file's ``get_inputs()``."""

    model: torch.nn.Module
    make_inputs: Callable[[int], list]
    seeds: list[int]
    no_grad: bool = True
    _before: dict = field(default_factory=dict, repr=False)

    _left: dict = field(default_factory=dict, repr=False)
    _rng: dict = field(default_factory=dict, repr=False)

    def inputs(self, k: int) -> list:
        return self.make_inputs(self.seeds[k - 1])

    def output(self, k: int, inputs: list) -> tuple[dict[str, torch.Tensor] | None, str]:
        self._before[k] = snapshot_state(self.model)
        seed_all(self.seeds[k - 1])
        self._left[k] = {}
        out, err = forward(self.model, inputs, self.no_grad, left=self._left[k])
        self._rng[k] = rng_state()
        return (None, err) if err else ({n: v.detach() for n, v in output_leaves(out).items()}, "")

    def rng_after(self, k: int) -> dict:
        """The random generators' states trial `k`'s forward left (where the candidate's starts)."""
        return self._rng.pop(k, {})

    def candidate_inputs(self, k: int, inputs: list) -> list:
        """Trial `k`'s inputs as the candidate gets them: as the reference's forward left them (KernelBench
        passes both models the same tensors)."""
        return input_values(list(inputs), self._left.pop(k, {}))

    def source(self, k: int, inputs: list):
        from .pipeline import ModelSource

        if k in self._before:  # the full diff starts from the state this trial's run started from
            restore_state(self.model, self._before.pop(k))
        return ModelSource(self.model, inputs, seed=self.seeds[k - 1])


@dataclass
class LiveCandidate:
    """The candidate model in this process, run twice on each trial's inputs.  A trial diffed in full
    starts from the state its run started from: buffers, and the parameters of a forward seen writing
    into its own (on trial 1, or `parameter_marks` moved since this was made)."""

    model: torch.nn.Module
    options: Options
    written: tuple = ()  # the parameters trial 1's diff saw its forward write into (`learn`)
    _before: dict = field(default_factory=dict, repr=False)
    _params_before: dict = field(default_factory=dict, repr=False)
    _marks: dict = field(default_factory=dict, repr=False)
    _guard: tuple | None = field(default=None, repr=False)  # (trial, the ParameterGuard of its run)
    _attrs: tuple | None = field(default=None, repr=False)  # (trial, its attributes before its run)
    _after_attrs: dict = field(default_factory=dict, repr=False)  # (the attributes its run left)

    def __post_init__(self) -> None:
        self._marks = parameter_marks(self.model)

    def learn(self, first: Any) -> None:
        """What trial 1's diff (a Result) saw the forward change of its own state."""
        seen = (getattr(first, "meta", None) or {}).get("stateful") or {}
        self.written = tuple(seen.get("parameters", ()))

    def _writes_parameters(self) -> bool:
        if self.written:
            return True
        now = parameter_marks(self.model)  # (a lazy module's parameters, made by the first forward, aside)
        return any(now.get(n, m) != m for n, m in self._marks.items())

    def check(self, k: int, inputs: list, ref: dict[str, torch.Tensor], trial: Trial, rng: dict | None = None) -> Trial:
        self._before[k] = snapshot_state(self.model)
        self._params_before.clear()  # (only the trial being run can be the one diffed in full next)
        if self._writes_parameters():
            self._params_before[k] = all_parameters(self.model)
        self._attrs = (k, attribute_state(self.model))
        self._guard = (k, ParameterGuard(self.model, self.written))
        return check_candidate(self.model, inputs, ref, trial, self.options, rng=rng, guard=self._guard[1])

    def source(self, k: int, inputs: list, seed: int | None):
        from .pipeline import ModelSource

        if k in self._before:
            restore_state(self.model, self._before.pop(k))
        restore_parameters(self.model, self._params_before.pop(k, {}))
        if self._attrs and self._attrs[0] == k:
            self._after_attrs = attribute_state(self.model)
            restore_attributes(self.model, self._attrs[1])
        return ModelSource(self.model, inputs, seed=seed)

    def notes(self, k: int) -> list[str]:
        """What a full diff of trial `k` should say of the state it started from."""
        guard = self._guard[1] if self._guard and self._guard[0] == k else None
        if guard is None or not guard.kept or k in self._params_before:
            return []
        return [f"the candidate's forward wrote into its own parameters first on trial {k} "
                f"({', '.join(list(guard.kept)[:3])}): the full diff of that trial started from the weights its run "
                f"left, not from those it started with"]

    def after_full(self, k: int) -> None:
        """A full diff of trial `k` ran the candidate again: its parameters back to what trial `k`'s run left."""
        if self._guard and self._guard[0] == k:
            self._guard[1].put_back()
        restore_attributes(self.model, self._after_attrs)


def _trial_dir(capture_path: str, name: Any) -> str | None:
    """The directory of a stored trial, if `name` is a plain trial directory name inside the
    capture and really is a directory there (not a link): a capture may come from a stranger."""
    if not isinstance(name, str) or not TRIAL_DIR.fullmatch(name):
        return None
    path = os.path.join(capture_path, name)
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return path if stat.S_ISDIR(st.st_mode) else None


@dataclass
class CapturedTrials:
    """A side captured by `capture_reference`: trial 1 in the capture itself, every later trial in
    full in ``trial-K.dkt`` inside it (see the module doc).  Serves as the reference of a diff, or
    as the candidate of a diff between two captures."""

    path: str
    info: dict
    device: str = "cpu"
    tolerance: Tolerance = field(default_factory=Tolerance)  # judging its outputs as a captured candidate
    # trial 1's pipeline.CaptureSource when the caller has opened the capture already (its index read once,
    # its values mapped when it is this diff's own handoff)
    first: Any = None
    notes: list = field(default_factory=list)  # what the result should say about how trials were read
    _opened: Any = field(default=None, repr=False)  # (trial, its CaptureFile): the trial being run, opened once

    @property
    def entries(self) -> list[dict]:
        got = self.info.get("trials")
        if not isinstance(got, list) or not got:
            seed = self.info.get("input_seed", self.info.get("seed"))
            return [{"trial": 1, "seed": seed if isinstance(seed, int) else None}]
        return [e for e in got if isinstance(e, dict)]

    @property
    def seeds(self) -> list[int | None]:
        return [e.get("seed") if isinstance(e.get("seed"), int) else None for e in self.entries]

    def _where(self, k: int) -> str:
        if k == 1:
            return self.path
        where = _trial_dir(self.path, self.entries[k - 1].get("capture"))
        if where is None:
            raise DiffkitError("reference", "read", f"the capture lists trial {k} but holds no trial-{k}.dkt "
                               f"directory for it (its process stopped before it?)", self.path)
        return where

    def _capture(self, k: int):
        """Trial `k`'s capture file: trial 1's as the caller opened it (if it did), a later one opened once
        for the trial being run (its inputs, output, inputs left and generator states are read from it)."""
        from .store import CaptureFile

        if k == 1 and self.first is not None:
            return self.first.file
        if self._opened is None or self._opened[0] != k:
            self._opened = (k, CaptureFile.open(self._where(k)))
        return self._opened[1]

    def _load(self, k: int) -> tuple[list, dict[str, torch.Tensor], str]:
        from .capture import input_names
        from .load import decode_values

        where = self._where(k)
        cap = self._capture(k)
        inputs_values, outputs = {}, {}
        # the values of the inputs and outputs only (trial 1 is the whole capture)
        for r in cap.records(values=lambda m: m.get("kind") == "input" or bool(m.get("is_output"))):
            if r.value is None:
                continue
            if cap.mapped:  # a view of the mapped file, shared with trial 1's records: theirs to keep
                r.value = r.value.clone()
            for n in input_names(r.kind, r.name, r.aliases):
                inputs_values[n] = r.value
            if r.is_output:
                outputs[r.name.split("#")[0]] = r.value
        enc = cap.info.get("inputs")
        try:
            inputs = decode_values(enc, inputs_values) if isinstance(enc, dict) else list(inputs_values.values())
        except (KeyError, ValueError, IndexError, TypeError) as e:
            raise DiffkitError("reference", "read", f"trial {k}'s inputs cannot be rebuilt: {e}", where) from e
        err = cap.index.get("error") or {}
        error = f"{err.get('type', 'Error')}: {err.get('message', '')}" if err else ""
        move = (lambda v: v.to(self.device) if isinstance(v, torch.Tensor) else v)
        return pytree.tree_map(move, inputs), {n: v.to(self.device) for n, v in outputs.items()}, error

    def inputs(self, k: int) -> list:
        """Trial `k`'s inputs, laid out as the reference's were (`load.inputs_as_made`)."""
        from .load import inputs_as_made

        seeds = self.seeds
        return inputs_as_made(self._load(k)[0], self.info, seeds[k - 1] if 0 < k <= len(seeds) else None)

    def candidate_inputs(self, k: int, inputs: list) -> list:
        """Trial `k`'s inputs as the candidate gets them: as the reference's forward left them (stored with
        the trial when it changed any)."""
        return input_values(list(inputs), self._capture(k).inputs_left())

    def output(self, k: int, inputs: list) -> tuple[dict[str, torch.Tensor] | None, str]:
        _, out, err = self._load(k)
        return (None, err) if err else (out, "")

    def rng_after(self, k: int) -> dict:
        """The random generators' states trial `k`'s forward left, as stored with it (empty when not)."""
        try:
            return self._capture(k).rng_after()
        except DiffkitError:
            return {}

    def check(self, k: int, inputs: list, ref: dict[str, torch.Tensor], trial: Trial, rng: dict | None = None) -> Trial:
        """As a captured candidate: its stored output of trial `k` against the reference's."""
        out, err = self.output(k, inputs)
        if err:
            trial.error, trial.error_side, trial.failed_run = err, "candidate", 1
            return trial
        trial.allclose = check_output(trial, ref, out, self.tolerance)
        trial.failed_run = None if trial.allclose else 1
        return trial

    def source(self, k: int, inputs: list, seed: int | None = None):
        from .pipeline import CaptureSource

        if k == 1 and self.first is not None:
            return self.first
        if k > 1 and self.entries[k - 1].get("outputs_only"):
            live = self._rerun(k, inputs)
            if live is not None:
                return live
            self.notes.append(f"trial {k}'s reference could not be rebuilt from its capture here: its stages are "
                              f"not compared, only its output")
        return CaptureSource(self._where(k), device=self.device)

    def _rerun(self, k: int, inputs: list):
        """Trial `k` of an outputs-only capture as a live reference: the model rebuilt from the capture
        (its source, init inputs and trial 1's parameters), its buffers as they were before trial `k`, run
        on trial `k`'s inputs; None when it cannot be rebuilt, or when it does not give the output trial
        `k` stored (then only that output is compared)."""
        from .load import load_reference_for_capture, sync_weights
        from .pipeline import ModelSource
        from .store import CaptureFile

        try:
            root = self.first.file if self.first is not None else CaptureFile.open(self.path)
            side = load_reference_for_capture(root, device=self.device)
            if side is None:
                return None
            before = CaptureFile.open(self._where(k)).parameters()  # (its buffers)
            if before:
                sync_weights(before, side.model)
            stored = self._load(k)[1]
        except Exception:  # (a reference that cannot be rebuilt here)
            return None
        state = snapshot_state(side.model)
        seed_all(self.seeds[k - 1])
        out, err = forward(side.model, inputs)
        restore_state(side.model, state)
        again = output_leaves(out) if not err else {}
        if set(again) != set(stored) or not all(
                again[n].shape == stored[n].shape and torch.allclose(again[n].to(stored[n].dtype), stored[n],
                                                                     rtol=1e-5, atol=1e-6, equal_nan=True)
                for n in stored):
            return None
        return ModelSource(side.model, inputs, seed=self.seeds[k - 1])


# ----------------------------------------------------------------------------------- writing
def write_trials(capture_path: str, model: torch.nn.Module, make_inputs: Callable[[int], list], seeds: list[int],
                 no_grad: bool = True, only=None, info: dict | None = None, outputs_only: bool = False) -> list[dict]:
    """Run the model on trials 2… and capture each one in full as ``trial-K.dkt`` inside the capture
    directory (records, parameters, its inputs); returns the entries for the capture's
    ``info["trials"]``.  `outputs_only` (an isolated diff's own capture, read by a process that can
    rebuild the reference): each trial is a plain forward, and ``trial-K.dkt`` holds its inputs, its
    output and the model's buffers before it; a trial diffed stage by stage is run again from those
    (`CapturedTrials.source`)."""
    from .load import encode_values
    from .pipeline import clone_inputs, run_captured

    entries = [{"trial": 1, "seed": seeds[0]}]
    for k, seed in enumerate(seeds[1:], start=2):
        name = f"trial-{k}.dkt"
        inputs = make_inputs(seed)
        sub = {**(info or {}), "trial": k, "seed": seed, "inputs": encode_values(inputs, tensors=True)}
        entry = {"trial": k, "seed": seed, "capture": name}
        if outputs_only:
            err = _write_outputs_only(os.path.join(capture_path, name), model, inputs, seed, no_grad, sub)
            entry["outputs_only"] = True
            if err:
                entry["error"] = err
        else:
            seed_all(seed)
            trace = run_captured(model, clone_inputs(list(inputs)), no_grad=no_grad, only=only,
                                 stream_to=os.path.join(capture_path, name), info=sub)
            if trace.error is not None:
                entry["error"] = f"{trace.error.type}: {trace.error.message}"
        entries.append(entry)
    return entries


def _write_outputs_only(path: str, model: torch.nn.Module, inputs: list, seed: int, no_grad: bool, info: dict) -> str:
    """One later trial as KernelBench runs it (seeded, one plain forward), stored as a capture of its inputs
    and output only, with the model's buffers before the forward as its parameters; what it raised, or ""."""
    from .capture import CaptureError, Record, _tensors, input_name
    from .store import CaptureWriter, write_after_forward

    writer = CaptureWriter(path, shard_bytes=0)
    writer.set_info({**info, "outputs_only": True})
    writer.add_parameters({n: b.detach() for n, b in materialized(model.named_buffers())})
    seed_all(seed)
    left: dict = {}
    out, err = forward(model, inputs, no_grad, left=left)
    try:
        write_after_forward(writer, left, rng_state())
    except ValueError:  # (an input that cannot be saved: the candidate gets the inputs as they came)
        pass
    leaves = [(input_name(pos), "input", t) for pos, t in _tensors(list(inputs))]
    if not err:
        leaves += [(n, "output", t) for n, t in output_leaves(out).items()]
    for i, (n, kind, t) in enumerate(leaves):
        t = t.detach()
        writer.add(Record(index=i, name=n, kind="input" if kind == "input" else "op", scope="", label=n, function="",
                          file="", line=0, op=kind, shape=tuple(t.shape), dtype=t.dtype, device=str(t.device), value=t,
                          is_output=kind == "output"))
    if err:
        kind, _, message = err.partition(": ")
        writer.set_error(CaptureError(kind, message, "", "", "", 0, ""))
    writer.close()
    return err


# ----------------------------------------------------------------------------------- the driver
def first_trial(result) -> Trial:
    """The outcome `pipeline.run` recorded for its own run (trial 1, or a lone `compare`)."""
    got = result.trials[0] if result.trials else {"trial": 1, "seed": None}
    return Trial.from_dict(got)


TRIALS_JOURNAL = "trials.jsonl"  # an isolated diff's candidate process: the trial it runs, each one's outcome


class _TrialJournal:
    """Where an isolated diff's candidate process is in KernelBench's trials, one JSON line per event
    (``{"running": K, "seed": S}`` before trial K, the Trial's dict once judged), so that the parent can
    say on which trial the process crashed or hung and keep the trials judged before (`read_trials_journal`).
    Writes nothing without a directory (an in-process diff)."""

    def __init__(self, directory: str | None):
        self.path = os.path.join(directory, TRIALS_JOURNAL) if directory else None

    def _line(self, obj: dict) -> None:
        if self.path is None:
            return
        try:
            with open(self.path, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(obj) + "\n")
        except (OSError, TypeError, ValueError):
            pass

    def running(self, k: int, seed: int | None) -> None:
        self._line({"running": k, "seed": seed})

    def finished(self, trial: Trial) -> None:
        self._line(trial.to_dict())


def read_trials_journal(directory: str) -> tuple[list[dict], tuple[int, int | None] | None]:
    """The trials an isolated diff's candidate process judged (dicts, in order) and the one it was running
    when it stopped ((trial, seed)), or None when it had judged every trial it began."""
    done: dict[int, dict] = {}
    running: tuple[int, int | None] | None = None
    try:
        with open(os.path.join(directory, TRIALS_JOURNAL), encoding="utf-8") as fh:
            for line in fh:
                try:
                    obj = json.loads(line)
                except ValueError:
                    continue
                if not isinstance(obj, dict):
                    continue
                if isinstance(obj.get("running"), int):
                    running = (obj["running"], obj.get("seed"))
                elif isinstance(obj.get("trial"), int):
                    done[obj["trial"]] = obj
    except OSError:
        return [], None
    if running is not None and running[0] in done:
        running = None
    return [done[k] for k in sorted(done)], running


def run_trials(reference, candidate, first_inputs: list, options: Options, evidence=None):
    """KernelBench's trials: `reference` (a LiveReference or CapturedTrials) against `candidate`
    (a LiveCandidate, or CapturedTrials for two captures): trial 1 diffed in full, later trials by
    their outputs, the first failing one then diffed in full; returns the judged Result of the
    trial reported."""
    from .pipeline import judge, run
    from .result import ErrorInfo

    if isinstance(candidate, CapturedTrials):
        candidate.tolerance = options.tolerance
    seeds = reference.seeds
    n = min(options.trials, len(seeds))
    if isinstance(candidate, CapturedTrials) and candidate.seeds[:n] != seeds[:n]:
        n = 1  # captured with other seeds or trials: only the first one pairs up
    journal = _TrialJournal(options.stream_dir)
    journal.running(1, seeds[0])
    reported = run(reference.source(1, first_inputs), candidate.source(1, first_inputs, seeds[0]), options)
    if isinstance(candidate, LiveCandidate):
        candidate.learn(reported)
    outcomes = [first_trial(reported)]
    outcomes[0].trial, outcomes[0].seed, outcomes[0].captured = 1, seeds[0], True
    journal.finished(outcomes[0])
    reported_trial = 1
    stop = reported.error is not None or bool(reported.meta.get("stopped")) or outcomes[0].error
    if options.trials > n and not stop:  # (a trial 1 that raised ends the trials: none were stored after it)
        have = "the captures pair up on" if isinstance(candidate, CapturedTrials) else "the reference capture holds"
        reported.warnings.append(f"{have} {n} trial(s); {options.trials} were asked: capture again with "
                                 f"--trials {options.trials}")
    for k in range(2, n + 1):
        if stop:
            break
        trial = Trial(k, seeds[k - 1])
        journal.running(k, trial.seed)
        try:
            inputs = reference.inputs(k)
            ref_out, ref_err = reference.output(k, inputs)
        except DiffkitError as e:
            reported.warnings.append(f"trial {k} was not run: {e.message}")
            break
        if ref_err:
            trial.error, trial.error_side = ref_err, "reference"
            outcomes.append(trial)
            reported.error = reported.error or ErrorInfo("reference", "forward",
                                                         f"on trial {k} (seed {trial.seed}) the reference raised "
                                                         f"{ref_err}", f"trial {k}'s forward")
            break
        try:
            candidate.check(k, reference.candidate_inputs(k, inputs), ref_out, trial, rng=reference.rng_after(k))
        except DiffkitError as e:
            reported.warnings.append(f"trial {k} was not run: {e.message}")
            break
        outcomes.append(trial)
        journal.finished(trial)
        if trial.failed and all(not o.failed for o in outcomes[:-1]):
            # (no crash insurance of its own: the isolated child's capture file stays trial 1's, which a
            # second run after a failure recaptures first)
            said = candidate.notes(k) if isinstance(candidate, LiveCandidate) else []  # (before `source` takes the state)
            full = run(reference.source(k, inputs), candidate.source(k, inputs, trial.seed),
                       options.replace(stream_dir=None))
            full.warnings += getattr(reference, "notes", []) + said
            if isinstance(candidate, LiveCandidate):
                candidate.after_full(k)
            trial.captured = True
            if trial.error and full.error is None:
                full.error = ErrorInfo("candidate", "forward", f"on trial {k} (seed {trial.seed}) the candidate "
                                       f"raised {trial.error}", "")
            full.warnings = [w for w in reported.warnings if "--trials" in w] + full.warnings
            reported, reported_trial = full, k
        if trial.error:
            break  # KernelBench stops at a runtime error
    _trial_notes(reported, outcomes)
    reported.trials = [o.to_dict() for o in outcomes]
    reported.meta["trials"] = {"asked": options.trials, "run": len(outcomes), "reported": reported_trial,
                               "failed": sum(o.failed for o in outcomes), "seed": options.seed}
    if evidence is not None:
        evidence(reported)
    reported.verdict = judge(reported)
    return reported


def _trial_notes(result, outcomes: list[Trial]) -> None:
    """One finding (and, when those trials passed, a warning) for the later trials whose two runs of
    the candidate differ bitwise (trial 1's are the pipeline's, on its stages)."""
    from .result import Finding

    racy = [o for o in outcomes[1:] if o.nondeterministic is not None]
    if not racy:
        return
    first = racy[0].nondeterministic
    which = ", ".join(f"{o.trial} (seed {o.seed})" for o in racy[:4]) + (" …" if len(racy) > 4 else "")
    # the forward was seen changing the model's own state: the later trials' runs differ for that reason
    # (a trial's second run could not start from its first's state: its forward wrote parameters it had not before)
    stateful = any(o.nondeterministic.get("stateful") for o in racy)
    words = (f"on trial{'s' if len(racy) > 1 else ''} {which} running the candidate twice on the same inputs gives "
             f"different values in {first.get('where', 'the output')}: {difference_words(first)}"
             + (f" (trial {racy[0].trial}; the others alike)" if len(racy) > 1 else "")
             + (" -- its forward changes its own state" if stateful
                else " -- a race, an uninitialised read or randomness"))
    result.findings.append(Finding("stateful" if stateful else "nondeterministic", words, 0.9))
    if all(o.allclose for o in racy):
        result.warnings.append(words + "; both runs are within tolerance there")
