"""conv1 written as F.conv2d over a tensor padded by hand: the padding goes on the top and left
only (2 rows / 2 columns there, none at the bottom / right), so the output is the right one moved
one row down and one column right, its last row and column cropped away."""
import torch
import torch.nn as nn
import torch.nn.functional as F

DIFFKIT_EXPECT = {"reference": "why_diag_conv_relu.py", "stage": "conv1", "kind": "boundary", "what_if": None}


def same_conv(x, weight, bias):
    k = weight.shape[-1]
    total = k - 1
    # (left, right, top, bottom): all the padding on the leading side
    padded = F.pad(x, (total, 0, total, 0))
    return F.conv2d(padded, weight, bias)


class ModelNew(nn.Module):
    def __init__(self, cin, cmid, cout):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cmid, 3, padding=1)
        self.conv2 = nn.Conv2d(cmid, cout, 3, padding=1)

    def forward(self, x):
        h = same_conv(x, self.conv1.weight, self.conv1.bias)
        return self.conv2(h.clamp_min(0))
