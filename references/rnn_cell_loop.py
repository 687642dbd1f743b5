"""An RNN cell stepped in a Python loop over a long sequence (the reference itself is a loop: every
step's concatenation, cell and head are records of their own).

The long-trace benchmark's reference (bench/speed.py `rnn3000`): 3000 steps make ~15 000 reference
records.  Size from the environment: DIFFKIT_RNN_STEPS (3000), DIFFKIT_RNN_BATCH (8),
DIFFKIT_RNN_INPUT (64), DIFFKIT_RNN_HIDDEN (128), DIFFKIT_RNN_OUTPUT (32)."""
import os

import torch
import torch.nn as nn

STEPS = int(os.environ.get("DIFFKIT_RNN_STEPS", 3000))
BATCH = int(os.environ.get("DIFFKIT_RNN_BATCH", 8))
INPUT = int(os.environ.get("DIFFKIT_RNN_INPUT", 64))
HIDDEN = int(os.environ.get("DIFFKIT_RNN_HIDDEN", 128))
OUTPUT = int(os.environ.get("DIFFKIT_RNN_OUTPUT", 32))


class Model(nn.Module):
    def __init__(self, input_size, hidden_size, output_size):
        super().__init__()
        self.hidden_size = hidden_size
        self.i2h = nn.Linear(input_size + hidden_size, hidden_size)
        self.h2o = nn.Linear(hidden_size, output_size)
        self.tanh = nn.Tanh()

    def forward(self, x):
        hidden = torch.zeros(x.size(1), self.hidden_size, device=x.device)
        outputs = []
        for t in range(x.size(0)):
            hidden = self.tanh(self.i2h(torch.cat((x[t], hidden), dim=1)))
            outputs.append(self.h2o(hidden))
        return torch.stack(outputs)


def get_inputs():
    return [torch.randn(STEPS, BATCH, INPUT)]


def get_init_inputs():
    return [INPUT, HIDDEN, OUTPUT]
