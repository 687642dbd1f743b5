"""A GRU written out by hand with a while loop, the gates from one fused matmul per operand, the states
written into a preallocated tensor, the inputs taken through `.contiguous()`/`.detach()`.  Correct (issue 44:
the loop candidates' correct twin)."""
import torch
import torch.nn as nn
import torch.nn.functional as F

DIFFKIT_EXPECT = {"reference": "why_loop_gru.py", "verdict": "match", "what_if": None}


class ModelNew(nn.Module):
    def __init__(self, n_in, n_hidden, n_out):
        super().__init__()
        self.cell = nn.GRUCell(n_in, n_hidden)
        self.head = nn.Linear(n_hidden, n_out)

    def forward(self, x, h0):
        x, h0 = x.contiguous(), h0.detach()  # copies of the inputs: the inputs themselves
        w_ih, w_hh = self.cell.weight_ih, self.cell.weight_hh
        b_ih, b_hh = self.cell.bias_ih, self.cell.bias_hh
        n = w_hh.shape[1]
        out = x.new_zeros(x.shape[0], x.shape[1], n)
        h, t = h0, 0
        while t < x.shape[0]:
            a = F.linear(x[t], w_ih, b_ih)
            b = F.linear(h, w_hh, b_hh)
            r = torch.sigmoid(a[:, :n] + b[:, :n])
            z = torch.sigmoid(a[:, n:2 * n] + b[:, n:2 * n])
            g = torch.tanh(a[:, 2 * n:] + r * b[:, 2 * n:])
            h = g + z * (h - g)
            out[t] = h
            t += 1
        return self.head(out)
