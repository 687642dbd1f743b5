"""A deep bidirectional GRU over a long sequence (KernelBench level 3 style: nn.GRU, h0 given).

The recurrent benchmark's reference: one opaque nn.GRU call.  Size from the environment:
DIFFKIT_GRU_LAYERS (6), DIFFKIT_GRU_SEQ (512), DIFFKIT_GRU_BATCH (4), DIFFKIT_GRU_INPUT (32),
DIFFKIT_GRU_HIDDEN (32)."""
import os

import torch
import torch.nn as nn

LAYERS = int(os.environ.get("DIFFKIT_GRU_LAYERS", 6))
SEQ = int(os.environ.get("DIFFKIT_GRU_SEQ", 512))
BATCH = int(os.environ.get("DIFFKIT_GRU_BATCH", 4))
INPUT = int(os.environ.get("DIFFKIT_GRU_INPUT", 32))
HIDDEN = int(os.environ.get("DIFFKIT_GRU_HIDDEN", 32))


class Model(nn.Module):
    def __init__(self, input_size, hidden_size, num_layers):
        super().__init__()
        self.gru = nn.GRU(input_size, hidden_size, num_layers, bidirectional=True)

    def forward(self, x, h0):
        out, _ = self.gru(x, h0)
        return out


def get_inputs():
    return [torch.randn(SEQ, BATCH, INPUT), torch.randn(2 * LAYERS, BATCH, HIDDEN)]


def get_init_inputs():
    return [INPUT, HIDDEN, LAYERS]
