"""A bidirectional LSTM in numpy with einsum gates, written as one loop over time that steps both directions
at once; parameters handed over with `np.asarray`, the features handed back with `torch.tensor`.  Correct
(issue 44)."""
import numpy as np
import torch
import torch.nn as nn

DIFFKIT_EXPECT = {"reference": "why_loop_bilstm.py", "verdict": "match", "what_if": None}


class ModelNew(nn.Module):
    def __init__(self, n_in, n_hidden, n_out):
        super().__init__()
        self.rnn = nn.LSTM(n_in, n_hidden, batch_first=True, bidirectional=True)
        self.proj = nn.Linear(2 * n_hidden, n_out)

    def forward(self, x):
        a = np.asarray(x.detach())
        w = [np.asarray(t.detach()) for t in self.rnn.parameters()]
        (wi_f, wh_f, bi_f, bh_f), (wi_b, wh_b, bi_b, bh_b) = w[:4], w[4:]
        nb, nt, _ = a.shape
        hd = wh_f.shape[1]
        state = {d: (np.zeros((nb, hd), np.float32), np.zeros((nb, hd), np.float32)) for d in "fb"}
        out = np.zeros((nb, nt, 2 * hd), np.float32)
        for s in range(nt):
            for d, t, wi, wh, b, lo in (("f", s, wi_f, wh_f, bi_f + bh_f, 0),
                                        ("b", nt - 1 - s, wi_b, wh_b, bi_b + bh_b, hd)):
                h, c = state[d]
                z = np.einsum("bi,gi->bg", a[:, t], wi) + np.einsum("bh,gh->bg", h, wh) + b
                ig, fg, cg, og = np.split(z, 4, axis=1)
                c = c / (1 + np.exp(-fg)) + np.tanh(cg) / (1 + np.exp(-ig))
                h = np.tanh(c) / (1 + np.exp(-og))
                state[d] = (h, c)
                out[:, t, lo:lo + hd] = h
        return self.proj(torch.tensor(out))
