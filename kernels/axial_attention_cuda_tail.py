"""Broken on purpose (CUDA only): the output projection's grid covers M // 16 tiles: the last partial tile (120 rows = 7×16 + 8) is never written."""
import os
import runpy

_base = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "axial_attention_cuda.py"))

DIFFKIT_EXPECT = {"reference": "axial_attention.py", "stage": "row_attn.out_proj", "kind": "unwritten_region", "device": "cuda"}


class _Row(_base["RowAttentionNew"]):
    BUG_OUT = _base["TAIL"]


class ModelNew(_base["ModelNew"]):
    ROW = _Row
