"""Linear and sigmoid fused into one numpy routine that walks the weight's flat buffer as if it were stored
[in_features, out_features] (element (k, n) at k*out + n) -- the layout of a weight kept for ``x @ W`` --
while nn.Linear stores it [out_features, in_features]."""
import numpy as np
import torch
import torch.nn as nn

DIFFKIT_EXPECT = {"reference": "hk_linear_sigmoid.py", "stage": "output", "kind": "transposed_weight",
                  "what_if": None}


def dense_sigmoid(x, flat_w, bias, k, n):
    w_kn = np.lib.stride_tricks.as_strided(flat_w, shape=(k, n), strides=(n * flat_w.itemsize, flat_w.itemsize))
    z = x @ w_kn + bias
    return 1.0 / (1.0 + np.exp(-z))


class ModelNew(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.fc = nn.Linear(in_features, out_features)

    def forward(self, x):
        w = self.fc.weight.detach().contiguous().numpy().ravel()
        y = dense_sigmoid(x.detach().numpy(), w, self.fc.bias.detach().numpy(), *self.fc.weight.shape[::-1])
        return torch.from_numpy(y.astype(np.float32))
