"""Linear + BatchNorm1d + softmax with C++ kernels, normalising with the batch's statistics as the
reference does in training mode (and keeping the running statistics up to date like nn.BatchNorm1d)."""
import os
import runpy

import torch
import torch.nn as nn

_k = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_ops.py"))
ops = _k["load"]()


class ModelNew(nn.Module):
    USE_RUNNING_STATS = False  # the broken variant normalises with the running statistics

    def __init__(self, in_features, out_features, bn_eps=1e-5, bn_momentum=0.1):
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features)
        self.bn = nn.BatchNorm1d(out_features, eps=bn_eps, momentum=bn_momentum)

    def forward(self, x):
        y = ops.linear(x.contiguous(), self.gemm.weight, self.gemm.bias, 0, 0)
        bn = self.bn
        if self.USE_RUNNING_STATS or not bn.training:
            mean, var = bn.running_mean, bn.running_var
        else:
            mean, var = y.mean(0), y.var(0, unbiased=False)
            with torch.no_grad():
                n = y.shape[0]
                bn.running_mean.mul_(1 - bn.momentum).add_(bn.momentum * mean)
                bn.running_var.mul_(1 - bn.momentum).add_(bn.momentum * var * n / max(n - 1, 1))
                bn.num_batches_tracked.add_(1)
        normed = (y - mean) * torch.rsqrt(var + bn.eps) * bn.weight + bn.bias
        return ops.softmax_lastdim(normed.contiguous(), 0)
