"""Broken on purpose (CUDA only): the softmax kernel's read-then-overwrite race.  Every thread reads
the row maximum from the shared array red[0], and thread 0 then overwrites red[0] (it becomes the
row-sum accumulator) with no __syncthreads() in between: a warp that reads after the overwrite takes
the accumulator for the maximum.  Whether a run is wrong depends on how the warps are scheduled --
diffkit's trials (each running the candidate twice) and --sanitize racecheck find it."""
import os
import runpy

_base = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "row_softmax_cuda.py"))

DIFFKIT_EXPECT = {"reference": "row_softmax_large.py", "stage": "output", "kind": "nondeterministic",
                  "device": "cuda"}


class ModelNew(_base["ModelNew"]):
    BUG = 1
