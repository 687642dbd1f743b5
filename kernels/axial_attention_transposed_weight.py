"""Broken on purpose: the fused LayerNorm+QKV kernel reads the [3D, D] weight as if it were [D, 3D]."""
import os
import runpy

_base = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "axial_attention_cpp.py"))
_k = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_ops.py"))

DIFFKIT_EXPECT = {"reference": "axial_attention.py", "stage": "row_attn.qkv_proj", "kind": "transposed_weight"}


class _Row(_base["RowAttentionNew"]):
    BUG_QKV = _k["TRANSPOSED_W"]


class ModelNew(_base["ModelNew"]):
    ROW = _Row
