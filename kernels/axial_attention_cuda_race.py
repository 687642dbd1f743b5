"""Broken on purpose (CUDA only): the fused LayerNorm+QKV kernel lacks the __syncthreads() between writing the
normalised row to shared memory and reading it.  The output is wrong on every trial; whether two runs on the same
inputs differ depends on how the card schedules the warps (they did on an H100 in earlier rounds, the diff then
said `nondeterministic`; on an H200 in round 17 both runs gave the same wrong values), so the race itself is shown
by `--sanitize racecheck`, which is how this candidate is diffed."""
import os
import runpy

_base = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "axial_attention_cuda.py"))

DIFFKIT_EXPECT = {"reference": "axial_attention.py", "stage": "row_attn.qkv_proj", "kind": "race", "device": "cuda",
                  "sanitize": "racecheck"}


class _Row(_base["RowAttentionNew"]):
    BUG_QKV = _base["RACE"]


class ModelNew(_base["ModelNew"]):
    ROW = _Row
