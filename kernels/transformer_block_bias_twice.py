"""Broken on purpose: the output projection adds its bias twice (once in the kernel, once after)."""
import os
import runpy

_base = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "transformer_block_cpp.py"))

DIFFKIT_EXPECT = {"reference": "transformer_block.py", "stage": "proj", "kind": "offset"}


class ModelNew(_base["ModelNew"]):
    PROJ_BIAS_TWICE = True
