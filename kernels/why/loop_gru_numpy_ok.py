"""A GRU stepped in numpy, correct: the whole recurrence in one numpy loop over `np.asarray` copies, every
step's state handed back to torch with `torch.from_numpy` and concatenated (issue 44)."""
import numpy as np
import torch
import torch.nn as nn

DIFFKIT_EXPECT = {"reference": "why_loop_gru.py", "verdict": "match", "what_if": None}


class ModelNew(nn.Module):
    def __init__(self, d_in, d_h, d_out):
        super().__init__()
        self.cell = nn.GRUCell(d_in, d_h)
        self.head = nn.Linear(d_h, d_out)

    def forward(self, x, h0):
        wi, wh, bi, bh = (np.asarray(p.detach()) for p in self.cell.parameters())
        xs, h = np.asarray(x.detach()), np.asarray(h0.detach())
        hs = []
        for xt in xs:
            a, b = xt @ wi.T + bi, h @ wh.T + bh
            d = h.shape[1]
            r = 1 / (1 + np.exp(-(a[:, :d] + b[:, :d])))
            z = 1 / (1 + np.exp(-(a[:, d:2 * d] + b[:, d:2 * d])))
            n = np.tanh(a[:, 2 * d:] + r * b[:, 2 * d:])
            h = (1 - z) * n + z * h
            hs.append(torch.from_numpy(h[None]))
        return self.head(torch.cat(hs, dim=0))
