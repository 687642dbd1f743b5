"""Correct: the whole MLP computed in float64 from float64 copies of the parameters, cast back to the
input's dtype at the end."""
import torch
import torch.nn as nn

DIFFKIT_EXPECT = {"reference": "hk_tanh_mlp.py", "harden": None}


class ModelNew(nn.Module):
    def __init__(self, i, h, o):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(i, h), nn.Linear(h, o)])

    def forward(self, x):
        a, b = self.layers
        z = x.double()
        z = torch.tanh(z @ a.weight.double().t() + a.bias.double())
        z = z @ b.weight.double().t() + b.bias.double()
        return z.to(x.dtype)
