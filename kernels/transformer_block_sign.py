"""Broken on purpose: the attention-scores kernel is launched with a negated scale (-1/sqrt(d))."""
import math
import os
import runpy

_base = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "transformer_block_cpp.py"))
ops = _base["ops"]

DIFFKIT_EXPECT = {"reference": "transformer_block.py", "stage": "forward:scores", "kind": "sign"}


class ModelNew(_base["ModelNew"]):
    SCORE_SCALE_SIGN = -1.0
