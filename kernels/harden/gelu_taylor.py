"""Broken on purpose: GELU through a degree-19 Maclaurin series of erf (Horner form, coefficients
from NumPy), accurate to ~1e-9 for |x| < 1.5, which the benchmark's inputs in [-1, 1] never leave; far
off (and soon inf) beyond |x| ~ 4."""
import math

import numpy as np
import torch
import torch.nn as nn

DIFFKIT_EXPECT = {"reference": "hk_gelu_small_range.py", "harden": "inputs", "stage": "act"}

# erf(z) = 2/sqrt(pi) * sum_n (-1)^n z^(2n+1) / (n! (2n+1)), as a polynomial in u = z^2 times z
_COEF = np.array([(-1) ** n * 2 / math.sqrt(math.pi) / (math.factorial(n) * (2 * n + 1)) for n in range(10)])


def _erf_series(z):
    u = z * z
    acc = torch.full_like(z, float(_COEF[-1]))
    for c in _COEF[-2::-1]:
        acc = acc * u + float(c)
    return acc * z


class ModelNew(nn.Module):
    def __init__(self, a, b):
        super().__init__()
        self.w = nn.Linear(a, b)

    def forward(self, x):
        h = self.w(x)
        return 0.5 * h * (1.0 + _erf_series(h * (1.0 / math.sqrt(2.0))))
