"""Candidate for references/deep_transformer.py: each block's attention through PyTorch's fused
scaled_dot_product_attention and its MLP through F.linear calls.

DIFFKIT_BUG_BLOCK=k (unset: none) makes block k forget fc2's bias -- the scale test's known
first divergence (`blocks.k.forward:x#2`, missing_bias)."""
import os
import runpy

import torch
import torch.nn as nn
import torch.nn.functional as F

_ref = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "references", "deep_transformer.py"))
BUG_BLOCK = int(os.environ.get("DIFFKIT_BUG_BLOCK", "-1"))


class FusedBlock(_ref["Block"]):
    buggy = False

    def forward(self, x):
        b, s, dim = x.shape
        h = self.heads
        y = F.layer_norm(x, (dim,), self.ln1.weight, self.ln1.bias, self.ln1.eps)
        q, k, v = F.linear(y, self.qkv.weight, self.qkv.bias).view(b, s, 3, h, dim // h).permute(2, 0, 3, 1, 4)
        ctx = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, dim)
        x = x + F.linear(ctx, self.proj.weight, self.proj.bias)
        hidden = F.gelu(F.linear(F.layer_norm(x, (dim,), self.ln2.weight, self.ln2.bias, self.ln2.eps),
                                 self.fc1.weight, self.fc1.bias))
        x = x + F.linear(hidden, self.fc2.weight, None if self.buggy else self.fc2.bias)
        return x


class ModelNew(_ref["Model"]):
    def __init__(self, depth, dim, heads, dtype):
        # the reference's parameters, drawn in the reference's order (KernelBench copies no weights: the
        # shared construction seed is what makes them equal)
        nn.Module.__init__(self)
        self.blocks = nn.ModuleList([FusedBlock(dim, heads) for _ in range(depth)]).to(getattr(torch, dtype))
        for i, blk in enumerate(self.blocks):
            blk.buggy = i == BUG_BLOCK


get_inputs, get_init_inputs = _ref["get_inputs"], _ref["get_init_inputs"]
