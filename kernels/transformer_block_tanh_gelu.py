"""Broken on purpose: the fused Linear+GELU kernel uses the tanh approximation of GELU."""
import os
import runpy

_base = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "transformer_block_cpp.py"))
_k = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_ops.py"))

DIFFKIT_EXPECT = {"reference": "transformer_block.py", "stage": "forward:hidden", "kind": "approximation"}


class ModelNew(_base["ModelNew"]):
    BUG_GELU = _k["TANH_GELU"]
