"""conv1 computed in numpy with explicit loops over the kernel's taps; the window of output (i, j)
starts at input (i, j) of an image zero-padded by two at the bottom and right only (instead of one on
every side), so the result is the right one moved up one row and left one column.  Back into torch
for the ReLU and conv2."""
import numpy as np
import torch
import torch.nn as nn

DIFFKIT_EXPECT = {"reference": "why_diag_conv_relu.py", "stage": "conv1", "kind": "boundary", "what_if": None}


def conv_taps(img, w, b):
    n, c, h, wd = img.shape
    o, _, kh, kw = w.shape
    padded = np.zeros((n, c, h + kh - 1, wd + kw - 1), dtype=np.float64)
    padded[:, :, :h, :wd] = img
    out = np.zeros((n, o, h, wd), dtype=np.float64)
    for di in range(kh):
        for dj in range(kw):
            patch = padded[:, :, di:di + h, dj:dj + wd]
            out += np.einsum("nchw,oc->nohw", patch, w[:, :, di, dj])
    return out + b[None, :, None, None]


class ModelNew(nn.Module):
    def __init__(self, cin, cmid, cout):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cmid, 3, padding=1)
        self.conv2 = nn.Conv2d(cmid, cout, 3, padding=1)

    def forward(self, x):
        with torch.no_grad():
            y = conv_taps(x.numpy().astype(np.float64), self.conv1.weight.numpy().astype(np.float64),
                          self.conv1.bias.numpy().astype(np.float64))
        h = torch.from_numpy(y.astype(np.float32))
        return self.conv2(torch.relu(h))
