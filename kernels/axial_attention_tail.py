"""Broken on purpose: the output projection runs in tiles of 16 rows and never writes the last,
partial tile (120 rows = 7 full tiles + 8 rows left unwritten)."""
import os
import runpy

_base = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "axial_attention_cpp.py"))
_k = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_ops.py"))

DIFFKIT_EXPECT = {"reference": "axial_attention.py", "stage": "row_attn.out_proj", "kind": "unwritten_region"}


class _Row(_base["RowAttentionNew"]):
    BUG_OUT = _k["SKIP_TAIL"]
    OUT_TILE = 16


class ModelNew(_base["ModelNew"]):
    ROW = _Row
