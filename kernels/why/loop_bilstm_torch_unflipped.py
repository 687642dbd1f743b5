"""A bidirectional LSTM written out in torch, both directions stepped in one Python loop over time, the
parameters read under names of its own (`w_x`, `w_h`, `bias`: the reference's weights packed per direction).
Bug: the backward direction's step outputs are collected in the order they were made (last time step first)
and concatenated with the forward ones without being put back in time order.  The first wrong stage is the
features the head reads (the reference's LSTM output), not the head (issue 44)."""
import torch
import torch.nn as nn

DIFFKIT_EXPECT = {"reference": "why_loop_bilstm.py", "stage": "lstm[0]", "kind": None, "what_if": None}


class ModelNew(nn.Module):
    def __init__(self, input_size, hidden_size, output_size):
        super().__init__()
        lstm = nn.LSTM(input_size, hidden_size, batch_first=True, bidirectional=True)
        self.w_x = nn.ParameterList([lstm.weight_ih_l0, lstm.weight_ih_l0_reverse])
        self.w_h = nn.ParameterList([lstm.weight_hh_l0, lstm.weight_hh_l0_reverse])
        self.bias = nn.ParameterList([lstm.bias_ih_l0, lstm.bias_hh_l0, lstm.bias_ih_l0_reverse,
                                      lstm.bias_hh_l0_reverse])
        self.out = nn.Linear(2 * hidden_size, output_size)
        self.hidden = hidden_size

    def _cell(self, d, xt, h, c):
        z = xt @ self.w_x[d].t() + h @ self.w_h[d].t() + self.bias[2 * d] + self.bias[2 * d + 1]
        i, f, g, o = z.split(self.hidden, dim=-1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(c), c

    def forward(self, x):
        n, steps = x.shape[0], x.shape[1]
        hf = cf = hb = cb = x.new_zeros(n, self.hidden)
        fwd, bwd = [], []
        for s in range(steps):
            hf, cf = self._cell(0, x[:, s], hf, cf)
            hb, cb = self._cell(1, x[:, steps - 1 - s], hb, cb)
            fwd.append(hf)
            bwd.append(hb)  # made last-step-first; never reversed
        feats = torch.cat([torch.stack(fwd, dim=1), torch.stack(bwd, dim=1)], dim=-1)
        return self.out(feats)
