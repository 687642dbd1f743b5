"""Broken on purpose: the first LayerNorm divides the variance by K-1 (unbiased) instead of K."""
import os
import runpy

_base = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "transformer_block_cpp.py"))
_k = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_ops.py"))

DIFFKIT_EXPECT = {"reference": "transformer_block.py", "stage": "ln1", "kind": "scale"}


class ModelNew(_base["ModelNew"]):
    BUG_LN1 = _k["UNBIASED_VAR"]
