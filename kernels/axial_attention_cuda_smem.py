"""Broken on purpose (CUDA only): the fused LayerNorm+QKV kernel keeps the row in a fixed 64-float shared buffer; at dim 256 rows overflow it."""
import os
import runpy

_base = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "axial_attention_cuda.py"))

DIFFKIT_EXPECT = {"reference": "axial_attention_large.py", "stage": "row_attn.qkv_proj", "kind": None, "device": "cuda"}


class _Row(_base["RowAttentionNew"]):
    BUG_QKV = _base["SMEM"]


class ModelNew(_base["ModelNew"]):
    ROW = _Row
