"""Broken on purpose (CUDA only): the logits kernel accumulates q.k and the point distances in half
precision where float32 is expected."""
import os
import runpy

_here = os.path.dirname(os.path.abspath(__file__))
_base = runpy.run_path(os.path.join(_here, "invariant_point_attention_cuda.py"))
_k = runpy.run_path(os.path.join(_here, "cuda_ops.py"))

DIFFKIT_EXPECT = {"reference": "invariant_point_attention.py", "stage": "forward:logits", "kind": "precision",
                  "device": "cuda"}


class ModelNew(_base["ModelNew"]):
    BUG_LOGITS = _k["HALF_ACC"]
