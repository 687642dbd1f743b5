"""Triangle multiplicative update, outgoing edges (AlphaFold 2, algorithm 11).

z: [B, N, N, C].  a, b = gated projections of LN(z); x_ij = sum_k a_ik * b_jk;
out = sigmoid(g(LN(z))) * Linear(LN(x)).
"""
import torch
import torch.nn as nn


class Model(nn.Module):
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
        z_norm = self.norm_in(z)
        a = torch.sigmoid(self.gate_a(z_norm)) * self.proj_a(z_norm)
        b = torch.sigmoid(self.gate_b(z_norm)) * self.proj_b(z_norm)
        x = torch.einsum("bikc,bjkc->bijc", a, b)
        x = self.proj_out(self.norm_out(x))
        g = torch.sigmoid(self.gate_out(z_norm))
        return g * x


batch, n_res, c_z, c_hidden = 1, 12, 16, 16


def get_inputs():
    return [torch.randn(batch, n_res, n_res, c_z)]


def get_init_inputs():
    return [c_z, c_hidden]
