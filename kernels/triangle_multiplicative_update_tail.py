"""Broken on purpose: the gated projection for a runs in tiles of 32 rows and skips the last partial tile (144 rows = 4 tiles + 16 rows unwritten)."""
import os
import runpy

_base = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "triangle_multiplicative_update_cpp.py"))
_k = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_ops.py"))

DIFFKIT_EXPECT = {"reference": "triangle_multiplicative_update.py", "stage": "forward:a", "kind": "unwritten_region"}


class ModelNew(_base["ModelNew"]):
    BUG_GATED = _k["SKIP_TAIL"]
