"""Broken on purpose: the softmax output picks up run-dependent garbage, the way a kernel with a
missing __syncthreads() or an uninitialised shared-memory read does (a CPU stand-in for a race:
each run adds different noise)."""
import os
import runpy

import torch

_base = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "transformer_block_cpp.py"))

DIFFKIT_EXPECT = {"reference": "transformer_block.py", "stage": "forward:attn", "kind": "nondeterministic"}


class ModelNew(_base["ModelNew"]):
    RACY_SOFTMAX = True
