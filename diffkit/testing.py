"""`assert_models_close`: like ``torch.testing.assert_close``, but it names the stage that broke."""
from __future__ import annotations

from typing import Any, Sequence

import torch

from .compare import compare
from .describe import assertion_message


def assert_models_close(ref: torch.nn.Module, cand: torch.nn.Module, inputs: Sequence[Any],
                        atol: float | None = None, rtol: float | None = None, strict: bool = False, **settings):
    """Raise ``AssertionError`` naming the first diverging stage, with its numbers, unless the
    candidate's output matches the reference's.  Returns the `Result` when it passes."""
    result = compare(ref, cand, inputs, atol, rtol, strict=strict, **settings)
    if result.verdict == "match":
        return result
    raise AssertionError(assertion_message(result))
