"""The result object every surface reads: CLI table, JSON, CSV, reports and notebooks.

A `Result` holds one `Stage` per row in execution order (candidate order, with reference-only
stages placed after the stage they followed), the verdict, the first divergence and, if a side
failed, the error.  Nothing here computes metrics; it only arranges and serialises them.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from .capture import Record
from .measure import Stats

STATUSES = ("ok", "diverged", "after-divergence", "unmatched")
STAGE_COLUMNS = ["index", "ref_name", "cand_name", "paired_by", "ref_shape", "cand_shape", "dtype", "max_abs",
                 "mean_abs", "max_rel", "mismatch_fraction", "cosine", "status", "local_max_abs"]


@dataclass
class Finding:
    """One diagnosis of what is wrong with a stage."""

    kind: str
    detail: str
    confidence: float

    def to_dict(self) -> dict:
        return {"kind": self.kind, "detail": self.detail, "confidence": round(self.confidence, 3)}


@dataclass
class Stage:
    """One row: a candidate record, its reference counterpart (either may be missing), the metrics."""

    index: int
    ref: Record | None
    cand: Record | None
    paired_by: str = ""
    transform: str = ""
    stats: Stats | None = None
    status: str = "unmatched"
    note: str = ""
    diagnosis: list[Finding] = field(default_factory=list)
    pair_transform: tuple = ()  # the alignment's raw transform (candidate -> reference layout)
    local: Stats | None = None  # the stage re-run alone on the reference's inputs
    inherited_max_abs: float | None = None  # largest error among the stage's inputs in the full run
    replay_note: str = ""  # why the stage could not be re-run, when it could not
    auto: dict | None = None  # --tolerance auto: {"ref_rmse", "cand_rmse", "bound", "ok"} against float64

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
        return str(rec.dtype).replace("torch.", "") if rec else None

    @property
    def failed(self) -> bool:
        return self.status in ("diverged", "after-divergence")

    def matches(self, name: str) -> bool:
        return any(r is not None and (name == r.name or name in r.aliases) for r in (self.ref, self.cand))

    def to_dict(self) -> dict:
        s = self.stats
        return {
            "index": self.index, "ref_name": self.ref_name, "cand_name": self.cand_name,
            "paired_by": self.paired_by, "transform": self.transform,
            "ref_shape": self.ref_shape, "cand_shape": self.cand_shape, "dtype": self.dtype,
            "max_abs": _num(s.max_abs) if s else None, "mean_abs": _num(s.mean_abs) if s else None,
            "max_rel": _num(s.max_rel) if s else None,
            "mismatch_fraction": _num(s.mismatch_fraction) if s else None,
            "cosine": _num(s.cosine) if s else None, "status": self.status,
            "atol": s.atol if s else None, "rtol": s.rtol if s else None,
            "nan_inf": {"ref_nan": s.ref_nan, "ref_inf": s.ref_inf, "cand_nan": s.cand_nan, "cand_inf": s.cand_inf}
            if s else None,
            "worst": s.worst.to_dict() if s and s.worst else None,
            "ref_where": self.ref.where if self.ref else None, "cand_where": self.cand.where if self.cand else None,
            "ref_op": self.ref.op if self.ref else None, "cand_op": self.cand.op if self.cand else None,
            "note": self.note,
            "local_max_abs": _num(self.local.max_abs) if self.local else None,
            "inherited_max_abs": _num(self.inherited_max_abs),
            "replay": self.replay_note or None,
            "auto": self.auto,
            "diagnosis": [f.to_dict() for f in self.diagnosis],
        }

    def divergence_dict(self) -> dict:
        s = self.stats
        return {
            "index": self.index, "ref_name": self.ref_name, "cand_name": self.cand_name,
            "shape": self.ref_shape or self.cand_shape, "cand_shape": self.cand_shape,
            "max_abs": _num(s.max_abs) if s else None, "mean_abs": _num(s.mean_abs) if s else None,
            "mismatch_fraction": _num(s.mismatch_fraction) if s else None,
            "worst": s.worst.to_dict() if s and s.worst else None,
            "ref_where": self.ref.where if self.ref else None, "cand_where": self.cand.where if self.cand else None,
            "note": self.note,
            "diagnosis": [f.to_dict() for f in self.diagnosis],
            "local_max_abs": _num(self.local.max_abs) if self.local else None,
            "inherited_max_abs": _num(self.inherited_max_abs),
            "replay": self.replay_note or None,
        }

    def _repr_html_(self) -> str:
        from .render import stage_html

        return stage_html(self)

    def heatmap(self):
        """reference | candidate | |difference| heatmaps (a matplotlib Figure)."""
        from .plots import heatmap

        return heatmap(self)


def _num(x: float | None) -> float | None:
    if x is None:
        return None
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None if math.isnan(x) else (1e308 if x > 0 else -1e308)
    return x


@dataclass
class ErrorInfo:
    side: str
    phase: str
    message: str
    stage: str = ""
    traceback: str = ""

    def to_dict(self) -> dict:
        return {"side": self.side, "phase": self.phase, "message": self.message, "stage": self.stage,
                "traceback": self.traceback}


@dataclass
class Result:
    """What diffkit found.  `verdict` is "match", "diverged" or "error"."""

    verdict: str
    stages: list[Stage]
    first_divergence: Stage | None
    error: ErrorInfo | None
    output: Stats | None
    atol: float | None
    rtol: float | None
    strict: bool = False
    warnings: list[str] = field(default_factory=list)
    weights: Any = None  # load.WeightReport when the models came from files
    ref_path: str = ""
    cand_path: str = ""
    meta: dict = field(default_factory=dict)
    output_shape_mismatch: tuple | None = None
    root_cause: Stage | None = None  # the earliest stage that introduces the error (see rootcause.py)
    health: list[str] = field(default_factory=list)  # warnings about the reference itself
    tolerance_mode: str = "fixed"  # "fixed" | "auto"
    fixed_verdict: str | None = None  # with --tolerance auto: what the fixed tolerance said

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

    def tolerance(self) -> dict:
        if self.atol is not None and self.rtol is not None:
            return {"atol": self.atol, "rtol": self.rtol, "by_dtype": False}
        out = self.output
        return {"atol": self.atol if self.atol is not None else (out.atol if out else 1e-4),
                "rtol": self.rtol if self.rtol is not None else (out.rtol if out else 1e-4), "by_dtype": True}

    # ----------------------------------------------------------------- text
    def summary_line(self) -> str:
        tol = self.tolerance()
        tol_s = f"atol={tol['atol']:g} rtol={tol['rtol']:g}"
        n = len(self.compared)
        if self.verdict == "error" and self.error:
            e = self.error
            head = f"diffkit: ERROR in {e.side} ({e.phase}) at {e.stage or '?'}: {e.message}"
            fd = self.first_divergence
            tail = (f"; earlier, first divergence at stage {fd.index} {fd.ref_name or fd.cand_name}"
                    if fd else f"; {n} stages compared before it, all within tolerance" if n else "")
            return head + tail
        fd = self.first_divergence
        if self.verdict == "diverged" and self.output_shape_mismatch and (fd is None or fd.cand and fd.cand.is_output):
            r, c = self.output_shape_mismatch
            return f"diffkit: DIVERGED: output shape mismatch: expected {list(r)}, got {list(c)}"
        if fd is not None and self.verdict == "diverged":
            s = fd.stats
            names = fd.ref_name if fd.ref_name == fd.cand_name else f"{fd.ref_name} (candidate: {fd.cand_name})"
            worst = f" worst at {list(s.worst.index)}: ref {s.worst.ref:.6g} vs cand {s.worst.cand:.6g}" if s and s.worst else ""
            before = sum(1 for x in self.stages[: fd.index] if x.status == "ok")
            rc = self.root_cause
            kind = f"; looks like {fd.diagnosis[0].kind}" if fd.diagnosis else ""
            if rc is not None and rc is not fd:
                kind += (f"; root cause: stage {rc.index} {rc.ref_name} introduces the error "
                         f"(local max_abs={rc.local.max_abs:.3g})" + (f", {rc.diagnosis[0].kind}" if rc.diagnosis else ""))
            elif rc is fd and fd.local is not None:
                kind += "; this stage introduces the error (wrong on the reference's own inputs)"
            return (f"diffkit: DIVERGED at stage {fd.index} {names}: max_abs={s.max_abs:.3g} mean_abs={s.mean_abs:.3g} "
                    f"({100 * s.mismatch_fraction:.1f}% of {s.numel} elements out of {tol_s});{worst}; "
                    f"{before} earlier stages match{kind}")
        warn = f" ({len(self.diverged_stages)} intermediate stages out of tolerance: see warnings)" if self.diverged_stages else ""
        out = self.output
        o = f" output max_abs={out.max_abs:.3g}" if out else ""
        return f"diffkit: MATCH: {n} stages compared within {tol_s};{o}{warn}"

    # ----------------------------------------------------------------- data
    def to_dict(self) -> dict:
        out = self.output
        return {
            "verdict": self.verdict,
            "tolerance": self.tolerance(),
            "first_divergence": self.first_divergence.divergence_dict() if self.first_divergence else None,
            "root_cause": self.root_cause.divergence_dict() if self.root_cause else None,
            "tolerance_mode": self.tolerance_mode,
            "fixed_verdict": self.fixed_verdict,
            "reference_health": self.health,
            "error": self.error.to_dict() if self.error else None,
            "stages": [s.to_dict() for s in self.stages],
            "output": {"max_abs": _num(out.max_abs), "mean_abs": _num(out.mean_abs), "allclose": out.ok,
                       "shape_mismatch": [list(x) for x in self.output_shape_mismatch] if self.output_shape_mismatch else None}
            if out else ({"max_abs": None, "mean_abs": None, "allclose": False,
                          "shape_mismatch": [list(x) for x in self.output_shape_mismatch]}
                         if self.output_shape_mismatch else None),
            "warnings": self.warnings,
            "strict": self.strict,
            "weights": self.weights.to_dict() if self.weights is not None else None,
            "reference": self.ref_path, "candidate": self.cand_path,
            "summary": self.summary_line(),
            "meta": self.meta,
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False, default=str)

    def to_frame(self):
        import pandas as pd

        rows = []
        for s in self.stages:
            d = s.to_dict()
            rows.append({k: d[k] for k in STAGE_COLUMNS} | {"transform": d["transform"]})
        return pd.DataFrame(rows, columns=STAGE_COLUMNS + ["transform"])

    def to_csv(self, path: str | None = None) -> str:
        text = self.to_frame().to_csv(index=False)
        if path:
            with open(path, "w", encoding="utf-8") as fh:
                fh.write(text)
        return text

    def __repr__(self) -> str:
        return f"<diffkit.Result {self.verdict}: {self.summary_line()}>"

    def _repr_html_(self) -> str:
        from .render import result_html

        return result_html(self)

    def plot(self):
        """Max and mean |error| per stage, log scale, tolerance and first divergence marked (a Figure)."""
        from .plots import error_profile

        return error_profile(self)

    def write_report(self, directory: str | None = None) -> dict:
        """index.html, stages.csv, result.json, summary.md and junit.xml in `directory`."""
        from .report import write_report

        return write_report(self, directory)
