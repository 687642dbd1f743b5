"""Broken on purpose: the QKV projection result is stored in bfloat16 (a reduced-precision
intermediate buffer) before attention reads it back as float32.  The
first wrong tensor is the candidate's `qkv_lowp` (its reference counterpart is the QKV projection)."""
import os
import runpy

_base = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "transformer_block_cpp.py"))

DIFFKIT_EXPECT = {"reference": "transformer_block.py", "stage": "forward:qkv_lowp", "kind": "precision"}


class ModelNew(_base["ModelNew"]):
    QKV_STORAGE = "bfloat16"
