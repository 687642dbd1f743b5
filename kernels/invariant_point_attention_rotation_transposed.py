"""Broken on purpose: the frame kernel applies R^T instead of R when moving query points to the global frame."""
import os
import runpy

_base = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "invariant_point_attention_cpp.py"))
_k = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_ops.py"))

DIFFKIT_EXPECT = {"reference": "invariant_point_attention.py", "stage": "to_global:global_pts", "kind": None}


class ModelNew(_base["ModelNew"]):
    BUG_FRAME = _k["TRANSPOSED_W"]
