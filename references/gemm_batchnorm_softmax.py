"""Linear, BatchNorm1d, softmax over the features (KernelBench level-2 style).

KernelBench never calls eval(): in its trials BatchNorm normalises with the batch's own statistics."""
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, in_features, out_features, bn_eps=1e-5, bn_momentum=0.1):
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features)
        self.bn = nn.BatchNorm1d(out_features, eps=bn_eps, momentum=bn_momentum)

    def forward(self, x):
        x = self.gemm(x)
        x = self.bn(x)
        return torch.softmax(x, dim=1)


batch_size, in_features, out_features = 64, 32, 48


def get_inputs():
    return [torch.randn(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features]
