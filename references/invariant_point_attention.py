"""Invariant point attention (AlphaFold 2, algorithm 22), without the masking.

Inputs: single representation s [B, N, C_s], pair representation z [B, N, N, C_z], and one rigid
frame per residue (rotations R [B, N, 3, 3], translations t [B, N, 3]).
Query/key/value points are predicted in each residue's local frame and moved to the global frame
(x_global = R x_local + t); logits combine the scalar q.k term, the pair bias and the squared
distance between query and key points (weighted per head by softplus(gamma)); outputs are the
attended scalars, the attended points moved back to the local frame (R^T (x - t)), their norms,
and the attended pair features, concatenated and projected.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self, c_s, c_z, heads, c_hidden, n_qk_points, n_v_points):
        super().__init__()
        self.heads, self.c_hidden = heads, c_hidden
        self.n_qk, self.n_v = n_qk_points, n_v_points
        self.linear_q = nn.Linear(c_s, heads * c_hidden)
        self.linear_kv = nn.Linear(c_s, 2 * heads * c_hidden)
        self.linear_q_points = nn.Linear(c_s, heads * n_qk_points * 3)
        self.linear_kv_points = nn.Linear(c_s, heads * (n_qk_points + n_v_points) * 3)
        self.linear_b = nn.Linear(c_z, heads)
        self.head_weights = nn.Parameter(torch.randn(heads) * 0.5)
        self.linear_out = nn.Linear(heads * (c_z + c_hidden + n_v_points * 4), c_s)

    def to_global(self, pts, rot, trans):
        # pts [B, N, H, P, 3] in each residue's frame -> global frame
        rotated = torch.einsum("bnij,bnhpj->bnhpi", rot, pts)
        global_pts = rotated + trans[:, :, None, None, :]
        return global_pts

    def to_local(self, pts, rot, trans):
        centered = pts - trans[:, :, None, None, :]
        local_pts = torch.einsum("bnji,bnhpj->bnhpi", rot, centered)
        return local_pts

    def forward(self, s, z, rot, trans):
        bsz, n, _ = s.shape
        h, c = self.heads, self.c_hidden
        q = self.linear_q(s).view(bsz, n, h, c)
        kv = self.linear_kv(s).view(bsz, n, h, 2 * c)
        k, v = torch.split(kv, c, dim=-1)
        q_pts = self.linear_q_points(s).view(bsz, n, h, self.n_qk, 3)
        q_pts = self.to_global(q_pts, rot, trans)
        kv_pts = self.linear_kv_points(s).view(bsz, n, h, self.n_qk + self.n_v, 3)
        kv_pts = self.to_global(kv_pts, rot, trans)
        k_pts, v_pts = torch.split(kv_pts, [self.n_qk, self.n_v], dim=3)
        pair_bias = self.linear_b(z)
        w_s = math.sqrt(1.0 / (3 * c))
        w_b = math.sqrt(1.0 / 3)
        w_p = math.sqrt(1.0 / (3 * (self.n_qk * 9.0 / 2)))
        gamma = F.softplus(self.head_weights)
        scalar = torch.einsum("bihc,bjhc->bhij", q, k)
        dist = ((q_pts[:, :, None] - k_pts[:, None, :]) ** 2).sum(dim=(-1, -2))
        logits = w_s * scalar + w_b * pair_bias.permute(0, 3, 1, 2) - 0.5 * w_p * gamma.view(1, h, 1, 1) * dist.permute(0, 3, 1, 2)
        attn = torch.softmax(logits, dim=-1)
        o = torch.einsum("bhij,bjhc->bihc", attn, v)
        o_pts = torch.einsum("bhij,bjhpx->bihpx", attn, v_pts)
        o_pts = self.to_local(o_pts, rot, trans)
        o_norm = torch.sqrt((o_pts ** 2).sum(-1) + 1e-8)
        o_pair = torch.einsum("bhij,bijc->bihc", attn, z)
        feats = torch.cat([o.reshape(bsz, n, -1), o_pts.reshape(bsz, n, -1), o_norm.reshape(bsz, n, -1),
                           o_pair.reshape(bsz, n, -1)], dim=-1)
        return self.linear_out(feats)


batch, n_res, c_s, c_z, heads, c_hidden, n_qk, n_v = 1, 10, 32, 8, 4, 8, 4, 4


def _random_rotations(shape):
    quat = torch.randn(*shape, 4)
    quat = quat / quat.norm(dim=-1, keepdim=True)
    w, x, y, z = quat.unbind(-1)
    return torch.stack([
        1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y),
        2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x),
        2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y),
    ], dim=-1).view(*shape, 3, 3)


def get_inputs():
    s = torch.randn(batch, n_res, c_s)
    z = torch.randn(batch, n_res, n_res, c_z)
    rot = _random_rotations((batch, n_res))
    trans = torch.randn(batch, n_res, 3) * 3.0
    return [s, z, rot, trans]


def get_init_inputs():
    return [c_s, c_z, heads, c_hidden, n_qk, n_v]
