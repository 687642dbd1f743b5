"""Broken on purpose: in the gated projection for a, the last partial tile (rows 128..143 of 144, tile 32) reads its inputs from the tile's first rows instead of its own."""
import os
import runpy

import torch

_base = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "triangle_multiplicative_update_cpp.py"))
_k = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_ops.py"))

DIFFKIT_EXPECT = {"reference": "triangle_multiplicative_update.py", "stage": "forward:a", "kind": "boundary"}


class ModelNew(_base["ModelNew"]):
    BUG_GATED = _k["TAIL_ROWS"]
