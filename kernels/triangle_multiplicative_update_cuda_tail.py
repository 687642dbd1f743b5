"""Broken on purpose (CUDA only): the gated projection for a launches M / 32 row tiles, so the last
partial tile (144 rows = 4 tiles + 16 rows) is never written."""
import os
import runpy

_here = os.path.dirname(os.path.abspath(__file__))
_base = runpy.run_path(os.path.join(_here, "triangle_multiplicative_update_cuda.py"))
_k = runpy.run_path(os.path.join(_here, "cuda_ops.py"))

DIFFKIT_EXPECT = {"reference": "triangle_multiplicative_update.py", "stage": "forward:a", "kind": "unwritten_region",
                  "device": "cuda"}


class ModelNew(_base["ModelNew"]):
    BUG_GATED = _k["SKIP_TAIL"]
