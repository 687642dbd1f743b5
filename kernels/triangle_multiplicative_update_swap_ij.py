"""Broken on purpose: the triangle kernel writes out[j][i] instead of out[i][j]."""
import os
import runpy

_base = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "triangle_multiplicative_update_cpp.py"))
_k = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_ops.py"))

DIFFKIT_EXPECT = {"reference": "triangle_multiplicative_update.py", "stage": "forward:x", "kind": "permutation"}


class ModelNew(_base["ModelNew"]):
    BUG_TRIANGLE = _k["SWAP_IJ"]
