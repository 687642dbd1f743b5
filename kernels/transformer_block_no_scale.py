"""Broken on purpose: the attention-scores kernel forgets the 1/sqrt(head_dim) factor."""
import os
import runpy

_base = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "transformer_block_cpp.py"))
_k = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_ops.py"))

DIFFKIT_EXPECT = {"reference": "transformer_block.py", "stage": "forward:scores", "kind": "scale"}


class ModelNew(_base["ModelNew"]):
    BUG_SCORES = _k["NO_SCALE"]
