"""Linear -> InstanceNorm2d over a 1x1xF view -> residual add -> multiply (KernelBench level 2's
28_BMM_InstanceNorm_Sum_ResidualAdd_Multiply, at CPU-sized shapes).  The InstanceNorm sees its input as one
channel of a 1 x F map, so it normalises each row over its F features; a kernel writer who reads "1x1" and
leaves the norm out is wrong (issue 44)."""
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, in_features, out_features, eps=1e-5, momentum=0.1):
        super().__init__()
        self.bmm = nn.Linear(in_features, out_features)
        self.instance_norm = nn.InstanceNorm2d(out_features, eps=eps, momentum=momentum)

    def forward(self, x, y):
        x = self.bmm(x)
        x = self.instance_norm(x.unsqueeze(1).unsqueeze(1)).squeeze(1).squeeze(1)
        x = x + y
        x = x * y
        return x


batch_size = 6
in_features = 12
out_features = 16


def get_inputs():
    return [torch.randn(batch_size, in_features), torch.randn(batch_size, out_features)]


def get_init_inputs():
    return [in_features, out_features]
