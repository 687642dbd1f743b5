"""Broken on purpose: a C++ (load_inline) kernel fuses the projection, tanh and gain, and leaves out the
projection's bias because the reference zero-fills it at construction."""
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

_SRC = r"""
#include <torch/extension.h>
torch::Tensor proj_nobias(torch::Tensor x, torch::Tensor w) {
    return torch::matmul(x.contiguous(), w.contiguous().t());
}
torch::Tensor tanh_gain(torch::Tensor h, torch::Tensor g) {
    return torch::tanh(h) * g;
}
"""
_ext = load_inline(name="diffkit_harden_zero_bias", cpp_sources=[_SRC], functions=["proj_nobias", "tanh_gain"],
                   extra_cflags=["-O1"])

DIFFKIT_EXPECT = {"reference": "hk_zero_bias_tanh.py", "harden": "init", "stage": "proj"}


class ModelNew(nn.Module):
    def __init__(self, n_in, n_out):
        super().__init__()
        self.dense = nn.Linear(n_in, n_out)
        nn.init.zeros_(self.dense.bias)   # "always zero: no need to add it"
        self.g = nn.Parameter(torch.randn(n_out))

    def forward(self, inp):
        pre = _ext.proj_nobias(inp, self.dense.weight)
        return _ext.tanh_gain(pre, self.g)
