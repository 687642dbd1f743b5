"""Options: everything that configures a diff, built once (from the CLI or a Python call) and passed
down as one object.  Nothing else carries tolerances, budgets or filters around as loose arguments.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

# KernelBench's tolerances by the reference's dtype: defined once, in measure (the lower layer)
from .measure import FLOAT32_TOLERANCE, HALF_TOLERANCE, STATS, default_tolerance  # noqa: F401

TOLERANCE_MODES = ("fixed", "auto")


@dataclass(frozen=True)
class Tolerance:
    """How far a candidate value may be from the reference's.

    atol, rtol: elementwise ``|c - r| <= atol + rtol * |r|``; None takes KernelBench's default for the
                reference tensor's dtype.  Given one alone, the other takes the same value.
    mode:       "fixed" judges by atol/rtol; "auto" judges each stage against a float64 run of the
                reference (TorchDynamo's same() rule, see pipeline.apply_auto_tolerance).
    stat:       which statistic of the error must stay within tolerance (see measure.STATS):
                "elementwise" (every element, torch.allclose's rule: the default, KernelBench's), or
                "max" / "mean" / "median": stat(|c - r|) <= atol + rtol * stat(|r|).
    """

    atol: float | None = None
    rtol: float | None = None
    mode: str = "fixed"
    stat: str = "elementwise"

    def __post_init__(self):
        if self.mode not in TOLERANCE_MODES:
            raise ValueError(f"tolerance mode must be one of {', '.join(TOLERANCE_MODES)}, not {self.mode!r}")
        if self.stat not in STATS:
            raise ValueError(f"stat must be one of {', '.join(STATS)}, not {self.stat!r}")
        for name in ("atol", "rtol"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0):
                raise ValueError(f"{name} must be a finite number >= 0, not {v!r}")
        if self.atol is not None and self.rtol is None:
            object.__setattr__(self, "rtol", self.atol)
        if self.rtol is not None and self.atol is None:
            object.__setattr__(self, "atol", self.rtol)

    def for_dtype(self, dtype: torch.dtype) -> tuple[float, float]:
        """The (atol, rtol) a pair whose reference has `dtype` is judged by."""
        d = default_tolerance(dtype)
        return (self.atol if self.atol is not None else d, self.rtol if self.rtol is not None else d)

    @property
    def by_dtype(self) -> bool:
        return self.atol is None

    def to_dict(self) -> dict:
        return {"atol": self.atol, "rtol": self.rtol, "mode": self.mode, "stat": self.stat}


# folding (see diffkit.capture): a call site's results of unpairable sizes are recorded this many times,
# then folded into lineage
FOLD_AFTER = 8


@dataclass(frozen=True)
class Options:
    """One diff's configuration.

    tolerance:     see `Tolerance`.
    strict:        intermediate stages out of tolerance make the verdict "diverged" even when the
                   output passes (default: they are warnings, as KernelBench judges the output only).
    device:        run both models there ("cpu", "cuda"); None keeps where they are built.
    seed:          KernelBench's seed: each trial's input seed is drawn from it (see diffkit.trials);
                   model construction always uses KernelBench's 42.
    trials:        how many trials, each on fresh inputs (KernelBench's drivers run 5).
    eval:          put both models in eval() (default: as constructed, like KernelBench: BatchNorm
                   normalises with batch statistics, dropout is live).
    sync_weights:  copy reference parameters/buffers into the candidate by qualified name (default:
                   nothing is copied; KernelBench relies on the shared construction seed).
    reinit_zero:   give all-zero reference weight matrices random values (copied to the candidate).
    health:        run the reference twice to warn when it is random or degenerate.
    rerun:         run the candidate twice on every trial's inputs: any bitwise difference is a
                   `nondeterministic` finding (a race, an uninitialised read, randomness).
    no_grad:       run the forwards under torch.no_grad().
    streaming:     the bounded-memory two-pass diff (None: on when a budget, filter or stop is asked).
    max_memory:    bytes of captured values held on the device (CPU: in memory) when streaming.
    host_memory:   bytes of pinned host memory for a GPU streaming diff before values go to disk.
    device_memory: bytes of the GPU this diff's processes may take (torch's per-process memory fraction): the
                   diff runs as it would on a card of that size (None: what is free on the card).  A diff whose
                   captured values do not fit streams, then keeps them on the host (diffkit.device_memory).
    only:          comma-separated globs on record names; only those are captured (streaming).
    stop_at_first: end the candidate's forward at its first divergent record (streaming).
    lockstep:      streaming with a live reference: run its forward on a thread of its own, ahead of
                   the candidate's by what the budget holds, evicting values once measured (False:
                   the reference first, whole, what does not fit going to host memory and disk).
    gpu_streaming: stream when the candidate runs on a GPU and no mode was asked (`streaming` None): what an
                   isolated diff's one child does (diffkit.processes), its captured values on the device held to
                   what the models themselves take there (tiers.models_budget).
    stream_dir:    where an isolated child writes its crash insurance (capture journals, stats).
    insured:       with stream_dir, the live candidate's capture there keeps every record's value and
                   the model's parameters (False: names and shapes only; an isolated diff runs the
                   candidate again with values kept when this run crashes or hangs).
    explain:       what-if runs of the reference (diffkit.whatif) on a divergence: True always, False
                   never, None (default) when the divergent candidate record covers more than one
                   reference stage (a fused kernel).
    explain_budget: forwards of the reference a what-if search may spend.
    explain_seconds: seconds a what-if search may spend (it stops trying variants past them and says so;
                   0: no limit).
    trusted_capture: the reference capture was written by this diff (an isolated diff's own child):
                   what-if runs may rebuild the reference from the file it names without --explain.
    fold:          capture the candidate after the reference and fold its unpairable loop results
                   (a call site's results of sizes no reference record has, past capture.FOLD_AFTER
                   of them) into lineage instead of records (False: record every result).
    harden:        after KernelBench's verdict (unchanged), diff again under a matrix of settings applied
                   identically to both models (diffkit.harden): random constant parameters, another
                   construction seed, scaled/shifted/heavy-tailed inputs, other size constants, TF32.
    """

    tolerance: Tolerance = field(default_factory=Tolerance)
    strict: bool = False
    device: str | None = None
    seed: int = 42
    trials: int = 5
    eval: bool = False
    sync_weights: bool = False
    reinit_zero: bool = False
    health: bool = True
    rerun: bool = True
    no_grad: bool = True
    streaming: bool | None = None
    max_memory: int | None = None
    host_memory: int | None = None
    device_memory: int | None = None
    only: str | None = None
    stop_at_first: bool = False
    lockstep: bool = True
    gpu_streaming: bool = False
    stream_dir: str | None = None
    insured: bool = True
    explain: bool | None = None
    explain_budget: int = 1000
    explain_seconds: float = 60.0
    trusted_capture: bool = False
    fold: bool = True
    harden: bool = False

    def __post_init__(self):
        if not isinstance(self.harden, bool):
            raise ValueError(f"harden must be True or False, not {self.harden!r}")
        if isinstance(self.trials, bool) or not isinstance(self.trials, int) or self.trials < 1:
            raise ValueError(f"trials must be a whole number >= 1, not {self.trials!r}")
        if isinstance(self.explain_budget, bool) or not isinstance(self.explain_budget, int) or self.explain_budget < 0:
            raise ValueError(f"explain_budget must be a whole number >= 0, not {self.explain_budget!r}")
        if isinstance(self.explain_seconds, bool) or not isinstance(self.explain_seconds, (int, float)) \
                or not self.explain_seconds >= 0:
            raise ValueError(f"explain_seconds must be a number of seconds >= 0, not {self.explain_seconds!r}")
        for name in ("max_memory", "host_memory", "device_memory"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 0):
                raise ValueError(f"{name} must be a whole number of bytes >= 0, not {v!r}")

    @property
    def is_streaming(self) -> bool:
        if self.streaming is not None:
            return self.streaming
        return self.max_memory is not None or bool(self.only) or self.stop_at_first

    def replace(self, **changes) -> "Options":
        return dataclasses.replace(self, **changes)

    @classmethod
    def build(cls, *, atol: float | None = None, rtol: float | None = None, tolerance: str | Tolerance = "fixed",
              stat: str = "elementwise", **rest) -> "Options":
        """Options from keyword arguments as the Python API takes them (atol, rtol, tolerance mode,
        stat …)."""
        tol = tolerance if isinstance(tolerance, Tolerance) else Tolerance(atol, rtol, tolerance, stat)
        return cls(tolerance=tol, **rest)
