"""Matches its reference for every image and is 'right' only because the reference is degenerate: the
reference's encoder (batch_first=False on (B, N+1, D)) makes the class-token output a function of the
parameters alone, so this candidate never reads the patches: it encodes the class token once and
repeats the logits for each image.  --harden must say the reference ignores its input."""
import torch
import torch.nn as nn

DIFFKIT_EXPECT = {"reference": "hk_cls_token_encoder.py", "finding": "input_independent", "input": "patches",
                  "index": 0}


class ModelNew(nn.Module):
    def __init__(self, patch_dim, dim, heads, mlp_dim, num_classes):
        super().__init__()
        self.embed = nn.Linear(patch_dim, dim)  # kept for the state dict; never needed
        self.cls = nn.Parameter(torch.randn(1, 1, dim))
        self.enc = nn.TransformerEncoderLayer(d_model=dim, nhead=heads, dim_feedforward=mlp_dim, dropout=0.0)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, patches):
        token = self.enc(self.cls)          # a sequence of identical tokens attends like one token
        logits = self.head(token[:, 0])
        return logits.expand(patches.shape[0], -1).contiguous()
