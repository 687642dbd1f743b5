"""`assert_models_close`: like ``torch.testing.assert_close``, but it names the stage that broke."""
from __future__ import annotations

from typing import Any, Sequence

import torch

from .compare import compare


def assert_models_close(ref: torch.nn.Module, cand: torch.nn.Module, inputs: Sequence[Any],
                        atol: float | None = None, rtol: float | None = None, strict: bool = False):
    """Raise ``AssertionError`` naming the first diverging stage, with its numbers, unless the
    candidate's output matches the reference's.  Returns the `Result` when it passes."""
    result = compare(ref, cand, inputs, atol, rtol, strict=strict)
    if result.verdict == "match":
        return result
    lines = [result.summary_line()]
    fd = result.first_divergence
    if fd is not None and fd.stats is not None:
        s = fd.stats
        lines.append(f"First diverging stage {fd.index}: reference {fd.ref_name!r} ({fd.ref.where if fd.ref else ''}), "
                     f"candidate {fd.cand_name!r} ({fd.cand.where if fd.cand else ''})")
        lines.append(f"Mismatched elements: {s.mismatches} / {s.numel} ({100 * s.mismatch_fraction:.1f}%)")
        lines.append(f"Greatest absolute difference: {s.max_abs:.6g} (up to {s.atol:g} allowed)")
        lines.append(f"Greatest relative difference: {s.max_rel:.6g} (up to {s.rtol:g} allowed)")
        if s.worst:
            lines.append(f"Worst element at index {tuple(s.worst.index)}: reference {s.worst.ref:.6g}, candidate {s.worst.cand:.6g}")
        for f in fd.diagnosis:
            lines.append(f"Diagnosis ({f.kind}): {f.detail}")
    if result.error is not None:
        lines.append(f"The {result.error.side} raised: {result.error.message} at {result.error.stage}")
    raise AssertionError("\n".join(lines))
