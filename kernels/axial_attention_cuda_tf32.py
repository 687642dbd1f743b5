"""Broken on purpose (CUDA only): the output projection runs through TF32 tensor cores where float32 is expected."""
import os
import runpy

_base = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "axial_attention_cuda.py"))

DIFFKIT_EXPECT = {"reference": "axial_attention.py", "stage": "row_attn.out_proj", "kind": "precision", "device": "cuda"}


class _Row(_base["RowAttentionNew"]):
    TF32_OUT = True


class ModelNew(_base["ModelNew"]):
    ROW = _Row
