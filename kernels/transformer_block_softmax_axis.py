"""Broken on purpose: the softmax kernel normalises over queries instead of keys."""
import os
import runpy

_base = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "transformer_block_cpp.py"))
_k = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_ops.py"))

DIFFKIT_EXPECT = {"reference": "transformer_block.py", "stage": "forward:attn", "kind": "wrong_reduction_axis"}


class ModelNew(_base["ModelNew"]):
    BUG_SOFTMAX = _k["WRONG_AXIS"]
