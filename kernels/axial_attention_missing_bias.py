"""Broken on purpose: the output projection kernel is launched without its bias (as in the first seed)."""
import os
import runpy

_base = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "axial_attention_cpp.py"))

DIFFKIT_EXPECT = {"reference": "axial_attention.py", "stage": "row_attn.out_proj", "kind": "missing_bias"}


class _Row(_base["RowAttentionNew"]):
    OUT_BIAS = False


class _Col(_base["ColumnAttentionNew"]):
    OUT_BIAS = False


class ModelNew(_base["ModelNew"]):
    ROW = _Row
    COL = _Col
