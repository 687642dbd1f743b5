"""The square product in numpy through einsum with B's subscripts the wrong way round ('ik,jk'),
i.e. A @ B.T, then the scale: one opaque call for the whole model."""
import numpy as np
import torch
import torch.nn as nn

DIFFKIT_EXPECT = {"reference": "why_diag_square_mm.py", "stage": "output", "kind": "transposed_operand",
                  "what_if": None}


class ModelNew(nn.Module):
    def __init__(self, alpha):
        super().__init__()
        self.alpha = float(alpha)

    def forward(self, A, B):
        a, b = A.detach().numpy(), B.detach().numpy()
        return torch.from_numpy(np.einsum("ik,jk->ij", a, b) * np.float32(self.alpha))
