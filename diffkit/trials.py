"""Trials: KernelBench's correctness protocol, trial by trial, with the candidate run twice each time.

KernelBench draws one seed per trial from its own seed (``torch.manual_seed(42)``, then one
``torch.randint(0, 2**32 - 1, (1,))`` per trial), seeds each trial's ``get_inputs()`` with it, runs
the same two model objects on those inputs and passes a trial when ``torch.allclose`` accepts the
output.  diffkit runs the same trials:

- trial 1 is diffed in full (every stage captured, root cause, diagnosis: `pipeline.diff`);
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
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from . import progress
from .capture import (CaptureError, Record, _tensors, changed_inputs, input_name, input_names, input_values,
                      buffers_of, rng_state, set_rng_state)
from .errors import DiffkitError
from .inputs import copy_inputs
from .load import decode_values, encode_values, inputs_as_made, load_reference_for_capture, sync_weights
from .measure import ask_kernelbench, measure
from .modelstate import (ParameterGuard, Trial, all_parameters, attribute_state, bitwise_difference, difference_words,
                         output_leaves, parameter_marks, restore_attributes, restore_parameters, restore_state, seed_all,
                         snapshot_state, to_first_state, to_where_it_left)
from .options import Options, Tolerance
from .pipeline import CaptureSource, ModelSource, diff, settle
from .result import ErrorInfo, Finding
from .sources import written_by_this_diff
from .runner import clone_inputs, run_captured
from .store import CaptureFile, CaptureWriter, write_after_forward

__all__ = ["KERNELBENCH_SEED", "KERNELBENCH_TRIALS", "trial_seeds", "seed_all", "Trial", "bitwise_difference",
           "output_leaves", "snapshot_state", "restore_state", "LiveReference", "LiveCandidate", "CapturedTrials",
           "run_trials", "write_trials"]

KERNELBENCH_SEED = 42  # KernelBench's seed_num: construction and the trial seeds come from it
KERNELBENCH_TRIALS = 5  # num_correct_trials in KernelBench's drivers
TRIAL_SEED_HIGH = 2 ** 32 - 1  # torch.randint's exclusive upper bound in KernelBench's seed draw
TRIAL_DIR = re.compile(r"trial-([0-9]{1,6})\.dkt")


def trial_seeds(n: int, seed: int = KERNELBENCH_SEED) -> list[int]:
    """KernelBench's per-trial input seeds: ``torch.manual_seed(seed)``, then one
    ``torch.randint(0, 2**32 - 1, (1,)).item()`` per trial (drawn from a generator of its own, which
    gives the same numbers without disturbing the global one)."""
    gen = torch.Generator().manual_seed(seed)
    return [int(torch.randint(0, TRIAL_SEED_HIGH, (1,), generator=gen).item()) for _ in range(n)]


def forward(model: torch.nn.Module, inputs: list, no_grad: bool = True,
            left: dict | None = None) -> tuple[Any, str]:
    """One plain forward (no capture, as KernelBench runs it) on a copy of `inputs`: (output, "") or
    (None, what it raised).  `left`, when given, receives the input tensors the forward changed in place,
    by input record name, as it left them (`capture.changed_inputs`)."""
    import contextlib

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
    worst, total, count, ok, kb = 0.0, 0.0, 0, True, True
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
        ok, kb = ok and st.ok, kb and ok and st.allclose
        worst = max(worst, st.max_abs) if st.max_abs == st.max_abs else float("nan")
        total += st.mean_abs * st.numel
        count += st.numel
    trial.max_abs, trial.mean_abs = worst, (total / count if count else 0.0)
    trial.kernelbench = kb if kb != ok else None  # (the rule in force is not KernelBench's: say what allclose says)
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
    return _trial_dir_or_why(capture_path, name)[0]


def _trial_dir_or_why(capture_path: str, name: Any) -> tuple[str | None, str]:
    """(the directory of a stored trial, "") as `_trial_dir` takes it, else (None, why not, in words)."""
    if not isinstance(name, str) or not TRIAL_DIR.fullmatch(name):
        return None, f"{name!r:.80} is not a trial directory name inside the capture (trial-K.dkt)"
    path = os.path.join(capture_path, name)
    try:
        st = os.lstat(path)
    except OSError:
        return None, f"{path} is missing (its process stopped before it?)"
    if stat.S_ISLNK(st.st_mode):
        return None, f"{path} is a symbolic link; a capture's trials must be directories inside it, so it is not followed"
    if not stat.S_ISDIR(st.st_mode):
        return None, f"{path} is not a directory"
    return path, ""


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
    # written by this very diff (Options.trusted_capture; else as trial 1's CaptureSource says): only then is the
    # reference file it names run again (its get_inputs(), an outputs-only trial rebuilt); any other capture is data
    trusted_capture: bool = False
    _opened: Any = field(default=None, repr=False)  # (trial, its CaptureFile): the trial being run, opened once

    def __post_init__(self):
        # every trial the capture lists is there, a directory inside it, and its index reads (each field checked by
        # CaptureFile.open): a capture that cannot give its trials is an error before anything runs, not a trial
        # skipped later
        for k in range(2, len(self.entries) + 1):
            CaptureFile.open(self._where(k))

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
        where, why = _trial_dir_or_why(self.path, self.entries[k - 1].get("capture"))
        if where is None:
            idx = os.path.join(self.path, "index.json")
            raise DiffkitError("reference", "read", f"{idx}: field 'info.trials[{k - 1}].capture' lists trial {k}, "
                               f"but {why}", self.path)
        return where

    def _capture(self, k: int):
        """Trial `k`'s capture file: trial 1's as the caller opened it (if it did), a later one opened once
        for the trial being run (its inputs, output, inputs left and generator states are read from it)."""
        if k == 1 and self.first is not None:
            return self.first.file
        if self._opened is None or self._opened[0] != k:
            self._opened = (k, CaptureFile.open(self._where(k)))
        return self._opened[1]

    def _load(self, k: int) -> tuple[list, dict[str, torch.Tensor], str]:
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
        seeds = self.seeds
        return inputs_as_made(self._load(k)[0], self.info, seeds[k - 1] if 0 < k <= len(seeds) else None,
                              trusted=self.trusted)

    @property
    def trusted(self) -> bool:
        """Written by this very diff (`CaptureFile.trusted`): only then is the reference file it names run again."""
        if self.first is not None:
            return bool(getattr(self.first.file, "trusted", False))
        return self.trusted_capture and written_by_this_diff(self.path)

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
        if not self.trusted:  # (a capture from elsewhere is data: the file it names is not run)
            return None
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
    writer = CaptureWriter(path, shard_bytes=0)
    writer.set_info({**info, "outputs_only": True})
    writer.add_parameters({n: b.detach() for n, b in buffers_of(model)})
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
    """The outcome `pipeline.diff` recorded for its own run (trial 1, or a lone `compare`)."""
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
    trial reported.  The protocol wraps the pipeline: `pipeline.diff` for each trial diffed in full (not
    judged), the later trials and `evidence` added to the result reported, which `pipeline.settle` judges once."""
    if isinstance(candidate, CapturedTrials):
        candidate.tolerance = options.tolerance
    seeds = reference.seeds
    n = min(options.trials, len(seeds))
    if isinstance(candidate, CapturedTrials) and candidate.seeds[:n] != seeds[:n]:
        n = 1  # captured with other seeds or trials: only the first one pairs up
    journal = _TrialJournal(options.stream_dir)
    journal.running(1, seeds[0])
    progress.say(f"trial 1 of {n}: capturing and comparing every stage")
    reported = diff(reference.source(1, first_inputs), candidate.source(1, first_inputs, seeds[0]), options)
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
    if n > 1 and not stop and torch.cuda.is_initialized():
        # what trial 1's diff freed goes back to the card: the later trials' forwards and comparisons then take
        # their memory from it, not beside torch's cache of trial 1's blocks (issue 46: the diff's peak as the
        # card sees it; a CUDA error left behind surfaces in the trial's own forward, as before)
        try:
            torch.cuda.empty_cache()
        except RuntimeError:
            pass
    for k in range(2, n + 1):
        if stop:
            break
        trial = Trial(k, seeds[k - 1])
        journal.running(k, trial.seed)
        progress.say(f"trial {k} of {n}: outputs compared")
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
            progress.say(f"trial {k} of {n} fails: comparing every stage")
            full = diff(reference.source(k, inputs), candidate.source(k, inputs, trial.seed),
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
    return settle(reported)


def _trial_notes(result, outcomes: list[Trial]) -> None:
    """One finding (and, when those trials passed, a warning) for the later trials whose two runs of
    the candidate differ bitwise (trial 1's are the pipeline's, on its stages)."""
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
