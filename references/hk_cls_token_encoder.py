"""A small vision-transformer head with KernelBench 28_VisionTransformer's flaw: the encoder runs with
batch_first=False on (B, N+1, D) tokens, so it attends across the batch, and the class-token output
x[:, 0] (batch element 0 of the sequence dimension, i.e. every image's class token) depends only on the
parameters, not on the image."""
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, patch_dim, dim, heads, mlp_dim, num_classes):
        super().__init__()
        self.patch_to_embedding = nn.Linear(patch_dim, dim)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim))
        self.transformer = nn.TransformerEncoderLayer(d_model=dim, nhead=heads, dim_feedforward=mlp_dim,
                                                      dropout=0.0)
        self.mlp_head = nn.Linear(dim, num_classes)

    def forward(self, patches):
        x = self.patch_to_embedding(patches)
        cls_tokens = self.cls_token.expand(x.shape[0], -1, -1)
        x = torch.cat((cls_tokens, x), dim=1)
        x = self.transformer(x)
        return self.mlp_head(x[:, 0])


batch_size, num_patches, patch_dim, dim, heads, mlp_dim, num_classes = 4, 9, 12, 32, 4, 64, 10


def get_inputs():
    return [torch.randn(batch_size, num_patches, patch_dim)]


def get_init_inputs():
    return [patch_dim, dim, heads, mlp_dim, num_classes]
