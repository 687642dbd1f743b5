"""Broken on purpose (CUDA only): the fused LayerNorm+QKV kernel lacks the __syncthreads() between writing the normalised row to shared memory and reading it."""
import os
import runpy

_base = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "axial_attention_cuda.py"))

DIFFKIT_EXPECT = {"reference": "axial_attention.py", "stage": "row_attn.qkv_proj", "kind": "nondeterministic", "device": "cuda"}


class _Row(_base["RowAttentionNew"]):
    BUG_QKV = _base["RACE"]


class ModelNew(_base["ModelNew"]):
    ROW = _Row
