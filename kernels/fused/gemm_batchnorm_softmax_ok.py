"""Correct fused candidate for references/gemm_batchnorm_softmax.py: Linear, BatchNorm1d and softmax are one
call, `ext.gemm_batchnorm_softmax(...)` (kernels/fused/fused_ops.cpp) with no planted mistake (bug 0), so
diffkit sees only input -> output and the output matches."""
import os
import runpy

import torch.nn as nn

_ops = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_ops.py"))
ext = _ops["load"]()
BUG = _ops["GEMM_BN"]["ok"]

DIFFKIT_EXPECT = {"reference": "gemm_batchnorm_softmax.py", "verdict": "match", "what_if": None}


class ModelNew(nn.Module):
    def __init__(self, in_features, out_features, bn_eps=1e-5, bn_momentum=0.1):
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features)
        self.bn = nn.BatchNorm1d(out_features, eps=bn_eps, momentum=bn_momentum)

    def forward(self, x):
        bn = self.bn
        return ext.gemm_batchnorm_softmax(x, self.gemm.weight, self.gemm.bias, bn.weight, bn.bias, bn.running_mean,
                                          bn.running_var, bn.num_batches_tracked, bn.eps, bn.momentum, bn.training,
                                          BUG)
