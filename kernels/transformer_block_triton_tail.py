"""Broken on purpose (GPU only): the Triton softmax's grid is n_rows // 5 programs of 5 rows, so the
last n_rows % 5 rows (1 of 96) of the attention weights are never written."""
import os
import runpy

_base = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "transformer_block_triton.py"))

DIFFKIT_EXPECT = {"reference": "transformer_block.py", "stage": "forward:attn", "kind": "unwritten_region",
                  "device": "cuda"}


class ModelNew(_base["ModelNew"]):
    ROWS_BUG = True

