"""The result every surface reads: CLI text, JSON, CSV, HTML/Markdown/JUnit reports, notebooks, pytest.

A `Result` is plain data: one `Stage` per row in execution order (candidate order, with
reference-only stages placed after the stage they followed), the verdict, the first divergence, the
root cause and, if a side failed, the error.  Stages name their records by `RecordInfo` (metadata
only); tensor values are reached through a `Values` store that the pipeline attaches and that is
never serialised, so ``Result.from_dict(result.to_dict())`` gives the same result back.  Nothing here
computes metrics or sets the verdict (pipeline.judge does); it only arranges and serialises them.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from typing import Any, Callable

import torch

from . import plots
from .describe import headline
from .load import WeightReport
from .measure import FLOAT32_TOLERANCE, Stats, Worst
from .render import result_html, stage_html, stages_csv
from .safefiles import write_text

STATUSES = ("ok", "diverged", "after-divergence", "unmatched")
VERDICTS = ("match", "diverged", "error")
STAGE_COLUMNS = ["index", "ref_name", "cand_name", "paired_by", "ref_shape", "cand_shape", "dtype", "max_abs",
                 "mean_abs", "max_rel", "mismatch_fraction", "cosine", "status", "local_max_abs"]


def _num(x: float | None) -> float | None:
    """A float for strict JSON: NaN becomes None, ±Inf the largest double."""
    if x is None:
        return None
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None if math.isnan(x) else (1e308 if x > 0 else -1e308)
    return x


def json_safe(obj: Any) -> Any:
    """`obj` (dicts, lists, tuples, scalars) with every float made strict-JSON-safe by `_num`: a finding's
    data or a what-if's numbers may hold NaN or ±Inf (a reference masked with -inf) as well as the
    fields written through `_num` already."""
    if isinstance(obj, float):
        return _num(obj)
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def _unnum(x: Any) -> float:
    return float("nan") if x is None else float(x)


def stats_to_dict(s: Stats | None) -> dict | None:
    """Every field of a Stats, JSON-safe."""
    if s is None:
        return None
    return {"numel": s.numel, "max_abs": _num(s.max_abs), "mean_abs": _num(s.mean_abs), "max_rel": _num(s.max_rel),
            "mismatches": s.mismatches, "cosine": _num(s.cosine), "ref_nan": s.ref_nan, "ref_inf": s.ref_inf,
            "cand_nan": s.cand_nan, "cand_inf": s.cand_inf, "atol": s.atol, "rtol": s.rtol,
            "stat": s.stat, "stat_error": _num(s.stat_error) if s.stat_error is not None else None,
            "stat_bound": _num(s.stat_bound) if s.stat_bound is not None else None, "ok": s.ok,
            "kernelbench": s.kernelbench,
            "worst": None if s.worst is None else {"index": list(s.worst.index), "ref": _num(s.worst.ref),
                                                   "cand": _num(s.worst.cand), "abs_err": _num(s.worst.abs_err)}}


def stats_from_dict(d: dict | None) -> Stats | None:
    if d is None:
        return None
    w = d.get("worst")
    worst = None if w is None else Worst(tuple(int(i) for i in w["index"]), _unnum(w["ref"]), _unnum(w["cand"]),
                                         _unnum(w["abs_err"]))
    stat = d.get("stat") or "elementwise"
    return Stats(int(d["numel"]), _unnum(d["max_abs"]), _unnum(d["mean_abs"]), _unnum(d["max_rel"]),
                 int(d["mismatches"]), _unnum(d["cosine"]), int(d["ref_nan"]), int(d["ref_inf"]),
                 int(d["cand_nan"]), int(d["cand_inf"]), worst, float(d["atol"]), float(d["rtol"]),
                 stat=stat if isinstance(stat, str) else "elementwise",
                 stat_error=None if d.get("stat_error") is None else _unnum(d["stat_error"]),
                 stat_bound=None if d.get("stat_bound") is None else _unnum(d["stat_bound"]),
                 kernelbench=d.get("kernelbench") if isinstance(d.get("kernelbench"), bool) else None)


@dataclass
class Finding:
    """One diagnosis of what is wrong with a stage: its kind, a sentence of numbers, a confidence in (0, 1]."""

    kind: str
    detail: str
    confidence: float

    def to_dict(self) -> dict:
        return {"kind": self.kind, "detail": self.detail, "confidence": round(self.confidence, 3)}

    @classmethod
    def from_dict(cls, d: dict) -> "Finding":
        return cls(str(d["kind"]), str(d["detail"]), float(d["confidence"]))


@dataclass(frozen=True)
class RecordInfo:
    """What a stage shows of a captured record: its identity and where it was made, no value.

    index:     position in its side's trace (the key of its value in `Values`)
    name:      unique in the trace (``module.path``, ``scope.function:label``, ``tap:NAME``, ``output``)
    kind:      "input" | "module" | "op" | "ext" | "write" | "tap"
    op:        what produced it (``nn.Linear``, ``F.softmax``, ``ext:mod.fn``, ``triton:kernel``)
    inputs:    indices of the records its producing call consumed
    params:    qualified names of the module parameters and buffers that call read
    """

    index: int
    name: str
    kind: str
    op: str
    shape: tuple[int, ...]
    dtype: str
    scope: str = ""
    label: str = ""
    function: str = ""
    file: str = ""
    line: int = 0
    device: str = "cpu"
    aliases: tuple[str, ...] = ()
    is_output: bool = False
    inputs: tuple[int, ...] = ()
    params: tuple[str, ...] = ()

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}" if self.file else ""

    def names(self) -> list[str]:
        return [self.name, *self.aliases]

    @classmethod
    def of(cls, rec: Any) -> "RecordInfo":
        """From a capture.Record."""
        return cls(index=rec.index, name=rec.name, kind=rec.kind, op=rec.op, shape=tuple(rec.shape),
                   dtype=str(rec.dtype).replace("torch.", ""), scope=rec.scope, label=rec.label,
                   function=rec.function, file=rec.file, line=rec.line, device=rec.device,
                   aliases=tuple(rec.aliases), is_output=rec.is_output,
                   inputs=tuple(getattr(r, "index", r) for r in rec.inputs),
                   params=tuple(getattr(rec, "params", ()) or ()))

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        for k in ("shape", "aliases", "inputs", "params"):
            d[k] = list(d[k])
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "RecordInfo":
        kw = {f.name: d[f.name] for f in fields(cls) if f.name in d}
        for k in ("shape", "aliases", "inputs", "params"):
            if k in kw:
                kw[k] = tuple(kw[k])
        return cls(**kw)


class Values:
    """Where a result's tensor values are kept (the run's traces, a capture file …), by record index.

    Not part of the result's data: a result read back from JSON has none, and its stages say so."""

    def __init__(self, ref: Callable[[int], torch.Tensor | None], cand: Callable[[int], torch.Tensor | None]):
        self._ref, self._cand = ref, cand

    @classmethod
    def of_traces(cls, ref_trace: Any, cand_trace: Any) -> "Values":
        def getter(trace):
            return lambda i: trace.records[i].value if 0 <= i < len(trace.records) else None
        return cls(getter(ref_trace), getter(cand_trace))

    def ref(self, index: int) -> torch.Tensor | None:
        return self._ref(index)

    def cand(self, index: int) -> torch.Tensor | None:
        return self._cand(index)


@dataclass
class Stage:
    """One row: a candidate record, its reference counterpart (either may be missing), the metrics.

    paired_by:        the alignment pass that made the pair ("name", "order", "value", …)
    confidence:       how sure that pass was, in (0, 1]
    transform:        the candidate → reference layout change, in words ("reshape", "permute(…)+reshape")
    pair_transform:   the same, as align.to_ref_layout takes it
    stats:            the pair's metrics against the tolerance (None: not compared)
    status:           "ok" | "diverged" | "after-divergence" | "unmatched"
    local:            the stage re-run alone on the reference's inputs (rootcause.py), or None
    inherited_max_abs: the largest error among the stage's inputs in the full run
    replay_note:      why it could not be re-run, when it could not
    auto:             --tolerance auto: {"ref_rmse", "cand_rmse", "bound", "ok"} against float64
    """

    index: int
    ref: RecordInfo | None
    cand: RecordInfo | None
    paired_by: str = ""
    confidence: float = 0.0
    transform: str = ""
    pair_transform: tuple = ()
    stats: Stats | None = None
    status: str = "unmatched"
    note: str = ""
    diagnosis: list[Finding] = field(default_factory=list)
    local: Stats | None = None
    inherited_max_abs: float | None = None
    replay_note: str = ""
    auto: dict | None = None
    values: Values | None = field(default=None, repr=False, compare=False)

    @property
    def ref_name(self) -> str | None:
        return self.ref.name if self.ref else None

    @property
    def cand_name(self) -> str | None:
        return self.cand.name if self.cand else None

    @property
    def name(self) -> str:
        return self.cand_name or self.ref_name or "?"

    @property
    def ref_shape(self) -> list[int] | None:
        return list(self.ref.shape) if self.ref else None

    @property
    def cand_shape(self) -> list[int] | None:
        return list(self.cand.shape) if self.cand else None

    @property
    def dtype(self) -> str | None:
        rec = self.ref or self.cand
        return rec.dtype if rec else None

    @property
    def failed(self) -> bool:
        return self.status in ("diverged", "after-divergence")

    @property
    def passed(self) -> bool | None:
        """Whether the rule in force accepts this stage (the float64 rule under --tolerance auto)."""
        if self.auto is not None:
            return bool(self.auto["ok"])
        return None if self.stats is None else self.stats.ok

    @property
    def ref_value(self) -> torch.Tensor | None:
        """The reference value, when the run's values are still reachable."""
        return self.values.ref(self.ref.index) if self.values is not None and self.ref is not None else None

    @property
    def cand_value(self) -> torch.Tensor | None:
        """The candidate value in the candidate's own layout, when reachable."""
        return self.values.cand(self.cand.index) if self.values is not None and self.cand is not None else None

    def matches(self, name: str) -> bool:
        return any(r is not None and (name == r.name or name in r.aliases) for r in (self.ref, self.cand))

    def to_dict(self) -> dict:
        s = self.stats
        return {
            "index": self.index, "ref_name": self.ref_name, "cand_name": self.cand_name,
            "paired_by": self.paired_by, "confidence": round(self.confidence, 3), "transform": self.transform,
            "pair_transform": _jsonable(self.pair_transform),
            "ref_shape": self.ref_shape, "cand_shape": self.cand_shape, "dtype": self.dtype,
            "max_abs": _num(s.max_abs) if s else None, "mean_abs": _num(s.mean_abs) if s else None,
            "max_rel": _num(s.max_rel) if s else None,
            "mismatch_fraction": _num(s.mismatch_fraction) if s else None,
            "cosine": _num(s.cosine) if s else None, "status": self.status, "passed": self.passed,
            "atol": s.atol if s else None, "rtol": s.rtol if s else None,
            "nan_inf": {"ref_nan": s.ref_nan, "ref_inf": s.ref_inf, "cand_nan": s.cand_nan, "cand_inf": s.cand_inf}
            if s else None,
            "worst": stats_to_dict(s)["worst"] if s else None,
            "ref_where": self.ref.where if self.ref else None, "cand_where": self.cand.where if self.cand else None,
            "ref_op": self.ref.op if self.ref else None, "cand_op": self.cand.op if self.cand else None,
            "note": self.note,
            "local_max_abs": _num(self.local.max_abs) if self.local else None,
            "inherited_max_abs": _num(self.inherited_max_abs),
            "replay": self.replay_note or None,
            "auto": self.auto,
            "diagnosis": [f.to_dict() for f in self.diagnosis],
            "ref": self.ref.to_dict() if self.ref else None,
            "cand": self.cand.to_dict() if self.cand else None,
            "stats": stats_to_dict(s),
            "local": stats_to_dict(self.local),
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Stage":
        return cls(index=int(d["index"]), ref=RecordInfo.from_dict(d["ref"]) if d.get("ref") else None,
                   cand=RecordInfo.from_dict(d["cand"]) if d.get("cand") else None,
                   paired_by=d.get("paired_by") or "", confidence=float(d.get("confidence") or 0.0),
                   transform=d.get("transform") or "", pair_transform=_untuple(d.get("pair_transform") or []),
                   stats=stats_from_dict(d.get("stats")), status=d["status"], note=d.get("note") or "",
                   diagnosis=[Finding.from_dict(f) for f in d.get("diagnosis") or []],
                   local=stats_from_dict(d.get("local")),
                   inherited_max_abs=None if d.get("inherited_max_abs") is None else float(d["inherited_max_abs"]),
                   replay_note=d.get("replay") or "", auto=d.get("auto"))

    def divergence_dict(self) -> dict:
        s = self.stats
        return {
            "index": self.index, "ref_name": self.ref_name, "cand_name": self.cand_name,
            "shape": self.ref_shape or self.cand_shape, "cand_shape": self.cand_shape,
            "max_abs": _num(s.max_abs) if s else None, "mean_abs": _num(s.mean_abs) if s else None,
            "mismatch_fraction": _num(s.mismatch_fraction) if s else None,
            "worst": stats_to_dict(s)["worst"] if s else None,
            "ref_where": self.ref.where if self.ref else None, "cand_where": self.cand.where if self.cand else None,
            "note": self.note,
            "diagnosis": [f.to_dict() for f in self.diagnosis],
            "local_max_abs": _num(self.local.max_abs) if self.local else None,
            "inherited_max_abs": _num(self.inherited_max_abs),
            "replay": self.replay_note or None,
        }

    def _repr_html_(self) -> str:
        return stage_html(self)

    def heatmap(self):
        """reference | candidate | |difference| heatmaps (a matplotlib Figure)."""
        return plots.heatmap(self)


def _jsonable(t: Any) -> Any:
    if isinstance(t, (tuple, list)):
        return [_jsonable(v) for v in t]
    return t


def _untuple(t: Any) -> Any:
    if isinstance(t, list):
        return tuple(_untuple(v) for v in t)
    return t


@dataclass
class ErrorInfo:
    """A side that failed: which, in which phase, the message, where, and the traceback."""

    side: str
    phase: str
    message: str
    stage: str = ""
    traceback: str = ""

    def to_dict(self) -> dict:
        return {"side": self.side, "phase": self.phase, "message": self.message, "stage": self.stage,
                "traceback": self.traceback}

    @classmethod
    def from_dict(cls, d: dict) -> "ErrorInfo":
        return cls(str(d.get("side", "")), str(d.get("phase", "")), str(d.get("message", "")),
                   str(d.get("stage") or ""), str(d.get("traceback") or ""))


@dataclass
class HardenSetting:
    """One setting of the `--harden` matrix, applied identically to both models, and what the diff said there.

    kind:             "init" | "inputs" | "shape" | "precision"
    name:             the setting in words ("GroupNorm affine parameters drawn at random", "inputs[0] x 100",
                      "batch_size 16 -> 17")
    verdict:          "match" | "diverged" | "error" (the candidate raised or returned another shape there) |
                      "skipped" (the setting makes the reference itself non-finite or meaningless: `note` says why)
    judged_by:        the rule that judged it: "fixed" (KernelBench's tolerance) or "auto" (the reference's own
                      float64 noise floor at this setting)
    first_divergence, root_cause: the stages' `divergence_dict()` where the setting diverges
    error:            the candidate's failure at this setting, in a sentence
    """

    kind: str
    name: str
    verdict: str
    max_abs: float | None = None
    mean_abs: float | None = None
    judged_by: str = "fixed"
    first_divergence: dict | None = None
    root_cause: dict | None = None
    error: str | None = None
    note: str = ""
    seconds: float = 0.0

    @property
    def breaks(self) -> bool:
        return self.verdict in ("diverged", "error")

    def to_dict(self) -> dict:
        return {"kind": self.kind, "name": self.name, "verdict": self.verdict, "max_abs": _num(self.max_abs),
                "mean_abs": _num(self.mean_abs), "judged_by": self.judged_by,
                "first_divergence": self.first_divergence, "root_cause": self.root_cause, "error": self.error,
                "note": self.note, "seconds": round(self.seconds, 3)}

    @classmethod
    def from_dict(cls, d: dict) -> "HardenSetting":
        return cls(kind=str(d["kind"]), name=str(d["name"]), verdict=str(d["verdict"]),
                   max_abs=_unnum(d["max_abs"]) if d.get("max_abs") is not None else None,
                   mean_abs=_unnum(d["mean_abs"]) if d.get("mean_abs") is not None else None,
                   judged_by=str(d.get("judged_by") or "fixed"), first_divergence=d.get("first_divergence"),
                   root_cause=d.get("root_cause"), error=d.get("error"), note=str(d.get("note") or ""),
                   seconds=float(d.get("seconds") or 0.0))


@dataclass
class Harden:
    """What `--harden` found beside KernelBench's verdict (which it never changes): "robust" when no setting
    breaks the candidate, else "breaks"; findings about the problem itself (e.g. `input_independent`: the
    reference's output does not depend on one of its inputs); how long the matrix took."""

    verdict: str
    settings: list[HardenSetting] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def breaking(self) -> list[HardenSetting]:
        return [s for s in self.settings if s.breaks]

    def to_dict(self) -> dict:
        return {"verdict": self.verdict, "settings": [s.to_dict() for s in self.settings],
                "findings": [f.to_dict() for f in self.findings], "seconds": round(self.seconds, 3)}

    @classmethod
    def from_dict(cls, d: dict) -> "Harden":
        return cls(verdict=str(d["verdict"]), settings=[HardenSetting.from_dict(s) for s in d.get("settings") or []],
                   findings=[Finding.from_dict(f) for f in d.get("findings") or []],
                   seconds=float(d.get("seconds") or 0.0))


@dataclass
class Result:
    """What diffkit found.  `verdict` is "match", "diverged" or "error" (set by pipeline.judge only).

    stages:               every row, in execution order
    first_divergence:     the earliest stage out of tolerance (one of `stages`), or None
    root_cause:           the earliest stage that introduces the error (see rootcause.py), or None
    error:                the side that failed to build, run or return an output, or None
    output:               the final output's metrics (None when it could not be compared)
    atol, rtol:           the tolerance asked for (None: KernelBench's per-dtype default)
    warnings:             things the user should know that did not decide the verdict
    health:               warnings about the reference itself (random, constant, zero weights)
    weights:              load.WeightReport: what the weight step found by qualified name
    meta:                 how the diff ran (mode, record counts, memory, seed …)
    output_shape_mismatch: (reference shape, candidate shape) when the outputs' shapes differ
    output_structure:     (reference, candidate) described in words when their nesting or leaf count differs
    tolerance_mode:       "fixed" | "auto"; fixed_verdict: with auto, what the fixed rule said
    trials:               KernelBench's trials, one dict each: trial, seed, max_abs, mean_abs, allclose, … (see
                          trials.Trial); the stages are those of the trial reported (the first failing one)
    harden:               `--harden`'s matrix of settings (see Harden), or None when not asked
    what_if:              what-if runs of the reference (diffkit.whatif), best first: {"kind", "stage", "detail",
                          "max_abs_before", "max_abs_after", "explains", "mismatches_after", "rel_l2_after",
                          "mutations"}; empty when none ran (`meta["what_if"]` says why or how the search went)
    """

    verdict: str
    stages: list[Stage]
    first_divergence: Stage | None
    error: ErrorInfo | None
    output: Stats | None
    atol: float | None
    rtol: float | None
    strict: bool = False
    warnings: list[str] = field(default_factory=list)
    weights: Any = None
    ref_path: str = ""
    cand_path: str = ""
    meta: dict = field(default_factory=dict)
    output_shape_mismatch: tuple | None = None
    root_cause: Stage | None = None
    health: list[str] = field(default_factory=list)
    tolerance_mode: str = "fixed"
    fixed_verdict: str | None = None
    output_structure: tuple[str, str] | None = None  # (reference, candidate) when the outputs nest differently
    findings: list[Finding] = field(default_factory=list)  # about the run as a whole (output shape/structure …)
    trials: list[dict] = field(default_factory=list)  # KernelBench's trials: trials.Trial.to_dict() each
    what_if: list[dict] = field(default_factory=list)  # what-if runs, best first (see above)
    harden: Harden | None = None  # `--harden`: the settings matrix, beside the verdict (None: not asked)

    # ----------------------------------------------------------------- access
    def stage(self, name: str) -> Stage:
        for s in self.stages:
            if s.matches(name):
                return s
        raise KeyError(f"no stage named {name!r}")

    @property
    def compared(self) -> list[Stage]:
        return [s for s in self.stages if s.stats is not None]

    @property
    def diverged_stages(self) -> list[Stage]:
        return [s for s in self.stages if s.failed]

    @property
    def output_stages(self) -> list[Stage]:
        """The stages pairing the two models' outputs (one per tensor of a nested output)."""
        return [s for s in self.stages if s.cand is not None and s.cand.is_output and s.ref is not None
                and s.ref.is_output]

    @property
    def output_stage(self) -> Stage | None:
        """The output pair that decides: the first failing one, else the last."""
        outs = self.output_stages
        return next((s for s in outs if s.failed or s.stats is None), outs[-1] if outs else None)

    def tolerance(self) -> dict:
        out = self.output
        stat = getattr(out, "stat", None) or self.meta.get("stat") or "elementwise"
        if self.atol is not None and self.rtol is not None:
            return {"atol": self.atol, "rtol": self.rtol, "by_dtype": False, "stat": stat}
        return {"atol": self.atol if self.atol is not None else (out.atol if out else FLOAT32_TOLERANCE),
                "rtol": self.rtol if self.rtol is not None else (out.rtol if out else FLOAT32_TOLERANCE),
                "by_dtype": True, "stat": stat}

    # ----------------------------------------------------------------- text
    def summary_line(self) -> str:
        return headline(self)

    # ----------------------------------------------------------------- data
    def to_dict(self) -> dict:
        out = self.output
        ostage = self.output_stage
        shape_mm = [list(x) for x in self.output_shape_mismatch] if self.output_shape_mismatch else None
        return {
            "verdict": self.verdict,
            "tolerance": self.tolerance(),
            "atol": self.atol, "rtol": self.rtol,
            "first_divergence": self.first_divergence.divergence_dict() if self.first_divergence else None,
            "root_cause": self.root_cause.divergence_dict() if self.root_cause else None,
            "tolerance_mode": self.tolerance_mode,
            "fixed_verdict": self.fixed_verdict,
            "reference_health": self.health,
            "error": self.error.to_dict() if self.error else None,
            "stages": [s.to_dict() for s in self.stages],
            # allclose: KernelBench's torch.allclose whatever the rule in force; passed: the rule in force's
            "output": {"max_abs": _num(out.max_abs), "mean_abs": _num(out.mean_abs), "allclose": out.allclose,
                       "passed": ostage.passed if ostage is not None else out.ok, "shape_mismatch": shape_mm,
                       "structure_mismatch": list(self.output_structure) if self.output_structure else None,
                       "stats": stats_to_dict(out)}
            if out else ({"max_abs": None, "mean_abs": None, "allclose": False, "passed": False,
                          "shape_mismatch": shape_mm,
                          "structure_mismatch": list(self.output_structure) if self.output_structure else None,
                          "stats": None} if shape_mm or self.output_structure else None),
            "findings": [f.to_dict() for f in self.findings],
            "trials": self.trials,
            "what_if": self.what_if,
            "warnings": self.warnings,
            "strict": self.strict,
            "weights": self.weights.to_dict() if self.weights is not None else None,
            "reference": self.ref_path, "candidate": self.cand_path,
            "summary": self.summary_line(),
            "meta": self.meta,
            **({"harden": self.harden.to_dict()} if self.harden is not None else {}),
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Result":
        """A result read back from `to_dict` / result.json (without tensor values)."""
        stages = [Stage.from_dict(s) for s in d.get("stages") or []]
        by_index = {s.index: s for s in stages}

        def stage_at(x):
            return None if not x else by_index.get(int(x["index"]))
        out = d.get("output") or {}
        return cls(verdict=d["verdict"], stages=stages, first_divergence=stage_at(d.get("first_divergence")),
                   error=ErrorInfo.from_dict(d["error"]) if d.get("error") else None,
                   output=stats_from_dict(out.get("stats")), atol=d.get("atol"), rtol=d.get("rtol"),
                   strict=bool(d.get("strict")), warnings=list(d.get("warnings") or []),
                   weights=WeightReport.from_dict(d["weights"]) if d.get("weights") else None,
                   ref_path=d.get("reference") or "", cand_path=d.get("candidate") or "", meta=dict(d.get("meta") or {}),
                   output_shape_mismatch=tuple(tuple(x) for x in out["shape_mismatch"])
                   if out.get("shape_mismatch") else None,
                   root_cause=stage_at(d.get("root_cause")), health=list(d.get("reference_health") or []),
                   tolerance_mode=d.get("tolerance_mode") or "fixed", fixed_verdict=d.get("fixed_verdict"),
                   output_structure=tuple(out["structure_mismatch"]) if out.get("structure_mismatch") else None,
                   findings=[Finding.from_dict(f) for f in d.get("findings") or []],
                   trials=[dict(t) for t in d.get("trials") or [] if isinstance(t, dict)],
                   what_if=[dict(w) for w in d.get("what_if") or [] if isinstance(w, dict)],
                   harden=Harden.from_dict(d["harden"]) if isinstance(d.get("harden"), dict) else None)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(json_safe(self.to_dict()), indent=indent, allow_nan=False, default=str)

    @classmethod
    def from_json(cls, text: str) -> "Result":
        return cls.from_dict(json.loads(text))

    def to_frame(self):
        import pandas as pd

        rows = []
        for s in self.stages:
            d = s.to_dict()
            rows.append({k: d[k] for k in STAGE_COLUMNS} | {"transform": d["transform"]})
        return pd.DataFrame(rows, columns=STAGE_COLUMNS + ["transform"])

    def to_csv(self, path: str | None = None) -> str:
        text = stages_csv(self)
        if path:
            write_text(path, text)
        return text

    def __repr__(self) -> str:
        return f"<diffkit.Result {self.verdict}: {self.summary_line()}>"

    def _repr_html_(self) -> str:
        return result_html(self)

    def plot(self):
        """Max and mean |error| per stage, log scale, tolerance and first divergence marked (a Figure)."""
        return plots.error_profile(self)
