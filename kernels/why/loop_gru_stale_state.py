"""A GRU written out by hand, one step per loop iteration.  Bug: the hidden state fed to step t is read
from a list with an off-by-one index, `hist[max(t - 1, 0)]`, so step 0 gets h0 (right) and step 1 gets h0
again instead of step 0's state: right at step 0, wrong from step 1 on.  The first wrong stage is step 1's
hidden state, not the stacked states (issue 44)."""
import torch
import torch.nn as nn

DIFFKIT_EXPECT = {"reference": "why_loop_gru.py", "stage": "cell#2", "kind": None, "what_if": None}


class ModelNew(nn.Module):
    def __init__(self, input_size, hidden_size, output_size):
        super().__init__()
        self.cell = nn.GRUCell(input_size, hidden_size)
        self.head = nn.Linear(hidden_size, output_size)

    def _step(self, xt, hp):
        gi = torch.addmm(self.cell.bias_ih, xt, self.cell.weight_ih.t())
        gh = torch.addmm(self.cell.bias_hh, hp, self.cell.weight_hh.t())
        i_r, i_z, i_n = gi.chunk(3, dim=1)
        h_r, h_z, h_n = gh.chunk(3, dim=1)
        reset = torch.sigmoid(i_r + h_r)
        update = torch.sigmoid(i_z + h_z)
        cand = torch.tanh(i_n + reset * h_n)
        return (1 - update) * cand + update * hp

    def forward(self, x, h0):
        hist = [h0]
        for t in range(x.shape[0]):
            hist.append(self._step(x[t], hist[max(t - 1, 0)]))
        return self.head(torch.stack(hist[1:], dim=0))
