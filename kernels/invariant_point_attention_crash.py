"""Broken on purpose: the inverse frame transform is called with un-flattened [B,N,H,P,3] points; the kernel raises mid-forward."""
import os
import runpy

_base = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "invariant_point_attention_cpp.py"))
_k = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_ops.py"))

DIFFKIT_EXPECT = {"reference": "invariant_point_attention.py", "stage": None, "kind": "crash",
                  "verdict": "error", "raises_in": "frame_apply",
                  "raises_at": "_ipa_body.py"}


class ModelNew(_base["ModelNew"]):
    CRASH_INVERSE = True
