"""Broken on purpose (CUDA only): the triangle contraction reads its shared-memory tile of `a`
without the __syncthreads() after staging it, so warps may read entries other warps have not written
yet.  On an H200 at this size the warps happen to finish their stores first and the output matches
-- the race shows only under `--sanitize racecheck`, which is how this candidate is diffed."""
import os
import runpy

_here = os.path.dirname(os.path.abspath(__file__))
_base = runpy.run_path(os.path.join(_here, "triangle_multiplicative_update_cuda.py"))
_k = runpy.run_path(os.path.join(_here, "cuda_ops.py"))

DIFFKIT_EXPECT = {"reference": "triangle_multiplicative_update.py", "stage": "forward:x", "kind": "race",
                  "device": "cuda", "sanitize": "racecheck"}


class ModelNew(_base["ModelNew"]):
    BUG_TRIANGLE = _k["RACE"]
