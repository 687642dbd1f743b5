"""The candidate body shared by the C++ (CPU) and CUDA builds of triangle multiplicative update.

Run with `runpy.run_path(this file, init_globals={"ops": <extension>})`: the forward calls the
kernels through the module-global `ops`, whichever build it is."""

import torch
import torch.nn as nn


class ModelNew(nn.Module):
    BUG_GATED = 0
    GATED_TILE = 32
    BUG_TRIANGLE = 0

    def __init__(self, c_z, c_hidden):
        super().__init__()
        self.norm_in = nn.LayerNorm(c_z)
        self.proj_a = nn.Linear(c_z, c_hidden)
        self.gate_a = nn.Linear(c_z, c_hidden)
        self.proj_b = nn.Linear(c_z, c_hidden)
        self.gate_b = nn.Linear(c_z, c_hidden)
        self.norm_out = nn.LayerNorm(c_hidden)
        self.proj_out = nn.Linear(c_hidden, c_z)
        self.gate_out = nn.Linear(c_z, c_z)

    def forward(self, z):
        bsz, n, _, c_z = z.shape
        z_norm = ops.layernorm(z.reshape(-1, c_z).contiguous(), self.norm_in.weight, self.norm_in.bias,
                               self.norm_in.eps, 0)
        a = ops.gated_linear(z_norm, self.proj_a.weight, self.proj_a.bias, self.gate_a.weight, self.gate_a.bias,
                             self.BUG_GATED, self.GATED_TILE)
        b = ops.gated_linear(z_norm, self.proj_b.weight, self.proj_b.bias, self.gate_b.weight, self.gate_b.bias,
                             0, self.GATED_TILE)
        c_h = a.shape[-1]
        x = ops.triangle_outgoing(a.view(bsz, n, n, c_h), b.view(bsz, n, n, c_h), self.BUG_TRIANGLE)
        x = ops.layernorm(x.view(-1, c_h), self.norm_out.weight, self.norm_out.bias, self.norm_out.eps, 0)
        x = ops.linear(x, self.proj_out.weight, self.proj_out.bias, 0, 0)
        g = torch.sigmoid(ops.linear(z_norm, self.gate_out.weight, self.gate_out.bias, 0, 0))
        return (g * x).view(bsz, n, n, c_z)
