"""Broken on purpose: the logits kernel reads the pair bias [B,N,N,H] as if it were [B,H,N,N] (a stride bug)."""
import os
import runpy

_base = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "invariant_point_attention_cpp.py"))
_k = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_ops.py"))

DIFFKIT_EXPECT = {"reference": "invariant_point_attention.py", "stage": "forward:logits", "kind": None}


class ModelNew(_base["ModelNew"]):
    BUG_LOGITS = _k["BIAS_LAYOUT"]
