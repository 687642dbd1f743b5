"""A GRU cell stepped in a Python loop (nn.GRUCell), its hidden states stacked, then a Linear head on every
step (issue 44: the first wrong step of a loop; the candidates in kernels/why/loop_gru_*.py write the cell
out by hand)."""
import torch
import torch.nn as nn

STEPS, BATCH, INPUT, HIDDEN, OUTPUT = 6, 4, 12, 16, 8


class Model(nn.Module):
    def __init__(self, input_size, hidden_size, output_size):
        super().__init__()
        self.cell = nn.GRUCell(input_size, hidden_size)
        self.head = nn.Linear(hidden_size, output_size)

    def forward(self, x, h0):
        h = h0
        states = []
        for t in range(x.size(0)):
            h = self.cell(x[t], h)
            states.append(h)
        seq = torch.stack(states)
        return self.head(seq)


def get_inputs():
    return [torch.randn(STEPS, BATCH, INPUT), torch.randn(BATCH, HIDDEN)]


def get_init_inputs():
    return [INPUT, HIDDEN, OUTPUT]
