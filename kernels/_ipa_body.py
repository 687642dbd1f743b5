"""The candidate body shared by the C++ (CPU) and CUDA builds of invariant point attention.

Run with `runpy.run_path(this file, init_globals={"ops": <extension>})`: the forward calls the
kernels through the module-global `ops`, whichever build it is."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class ModelNew(nn.Module):
    BUG_FRAME = 0
    BUG_LOGITS = 0
    CRASH_INVERSE = False

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

    def forward(self, s, z, rot, trans):
        bsz, n, _ = s.shape
        h, c, pq, pv = self.heads, self.c_hidden, self.n_qk, self.n_v
        q = self.linear_q(s).view(bsz, n, h, c)
        k, v = self.linear_kv(s).view(bsz, n, h, 2 * c).split(c, dim=-1)
        q_local = self.linear_q_points(s).view(bsz, n, h * pq, 3)
        q_pts = ops.frame_apply(rot, trans, q_local, False, self.BUG_FRAME)
        kv_local = self.linear_kv_points(s).view(bsz, n, h * (pq + pv), 3)
        kv_pts = ops.frame_apply(rot, trans, kv_local, False, self.BUG_FRAME).view(bsz, n, h, pq + pv, 3)
        k_pts, v_pts = kv_pts.split([pq, pv], dim=3)
        pair_bias = self.linear_b(z)
        gamma = F.softplus(self.head_weights)
        logits = ops.ipa_logits(q.contiguous(), k.contiguous(), q_pts.view(bsz, n, h, pq, 3),
                                k_pts.contiguous(), pair_bias.contiguous(), gamma,
                                math.sqrt(1.0 / (3 * c)), math.sqrt(1.0 / 3),
                                math.sqrt(1.0 / (3 * (pq * 9.0 / 2))), self.BUG_LOGITS)
        attn = torch.softmax(logits, dim=-1)
        o = torch.einsum("bhij,bjhc->bihc", attn, v)
        o_pts = torch.einsum("bhij,bjhpx->bihpx", attn, v_pts)
        if self.CRASH_INVERSE:  # forgets to flatten heads and points: the kernel rejects the shape
            o_pts = ops.frame_apply(rot, trans, o_pts, True, 0)
        else:
            o_pts = ops.frame_apply(rot, trans, o_pts.reshape(bsz, n, h * pv, 3).contiguous(), True, 0)
        o_norm = torch.sqrt((o_pts ** 2).sum(-1) + 1e-8)
        o_pair = torch.einsum("bhij,bijc->bihc", attn, z)
        feats = torch.cat([o.reshape(bsz, n, -1), o_pts.reshape(bsz, n, -1), o_norm.reshape(bsz, n, -1),
                           o_pair.reshape(bsz, n, -1)], dim=-1)
        return self.linear_out(feats)
