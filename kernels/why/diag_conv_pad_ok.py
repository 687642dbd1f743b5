"""conv1 as F.conv2d over a tensor padded by hand on both sides: correct."""
import torch
import torch.nn as nn
import torch.nn.functional as F

DIFFKIT_EXPECT = {"reference": "why_diag_conv_relu.py", "verdict": "match", "what_if": None}


class ModelNew(nn.Module):
    def __init__(self, cin, cmid, cout):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cmid, 3, padding=1)
        self.conv2 = nn.Conv2d(cmid, cout, 3, padding=1)

    def forward(self, x):
        half = self.conv1.weight.shape[-1] // 2
        h = F.conv2d(F.pad(x, (half, half, half, half)), self.conv1.weight, self.conv1.bias)
        return self.conv2(torch.relu(h))
