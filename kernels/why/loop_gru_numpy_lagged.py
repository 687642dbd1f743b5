"""A GRU stepped in numpy, one step per loop iteration: each step hands `x[t]` and the previous state to
numpy and takes the new state back with `torch.as_tensor`.  Bug: the `z * h` carry term reads a state kept
one step too long (`carry` is updated after the state it should follow), so step 0 is right and step 1 on
are wrong.  The first wrong stage is step 1's state, not the stacked states (issue 44)."""
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

DIFFKIT_EXPECT = {"reference": "why_loop_gru.py", "stage": "cell#2", "kind": None, "what_if": None}


def _sig(a):
    return 0.5 * (1.0 + np.tanh(0.5 * a))


class ModelNew(nn.Module):
    def __init__(self, d_in, d_h, d_out):
        super().__init__()
        self.cell = nn.GRUCell(d_in, d_h)
        self.head = nn.Linear(d_h, d_out)

    def forward(self, x, h0):
        wi, wh = self.cell.weight_ih.detach().cpu().numpy(), self.cell.weight_hh.detach().cpu().numpy()
        bi, bh = self.cell.bias_ih.detach().cpu().numpy(), self.cell.bias_hh.detach().cpu().numpy()
        state = h0
        carry = h0.detach().numpy()
        states = []
        for t in range(x.shape[0]):
            hp = state.detach().numpy()
            gi = x[t].detach().numpy() @ wi.T + bi
            gh = hp @ wh.T + bh
            r, z, n = np.split(gi, 3, axis=1), np.split(gh, 3, axis=1), None
            reset, update = _sig(r[0] + z[0]), _sig(r[1] + z[1])
            n = np.tanh(r[2] + reset * z[2])
            h_new = (1.0 - update) * n + update * carry
            state = torch.as_tensor(h_new)
            states.append(state)
            carry = hp  # the state this step read, not the one it made: one step late from step 1 on
        return F.linear(torch.stack(states), self.head.weight, self.head.bias)
