"""Broken on purpose: the BatchNorm step normalises with the running statistics, as eval() mode
would.  KernelBench runs the models as constructed (training mode), where the reference uses the
batch's statistics: this candidate fails every trial, and passes only under `--eval`."""
import os
import runpy

_base = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "gemm_batchnorm_softmax_cpp.py"))

DIFFKIT_EXPECT = {"reference": "gemm_batchnorm_softmax.py", "stage": "bn", "kind": None}


class ModelNew(_base["ModelNew"]):
    USE_RUNNING_STATS = True
