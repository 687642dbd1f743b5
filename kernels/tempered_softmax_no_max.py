"""Broken on purpose: the softmax kernel exponentiates the raw logits (no max subtraction); logits of a few hundred overflow to inf and give NaN."""
import os
import runpy

import torch

_base = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "tempered_softmax_cpp.py"))
_k = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_ops.py"))

DIFFKIT_EXPECT = {"reference": "tempered_softmax.py", "stage": "forward:weights", "kind": "nan_inf"}


class ModelNew(_base["ModelNew"]):
    BUG_SOFTMAX = _k["NO_MAX_SUB"]
