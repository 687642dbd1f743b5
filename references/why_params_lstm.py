"""A one-layer LSTM over a sequence, its last step through a Linear head (KernelBench level-3 style,
small)."""
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, input_size, hidden_size, output_size):
        super().__init__()
        self.lstm = nn.LSTM(input_size, hidden_size, batch_first=True)
        self.fc = nn.Linear(hidden_size, output_size)

    def forward(self, x):
        out, _ = self.lstm(x)
        return self.fc(out[:, -1, :])


def get_inputs():
    return [torch.randn(4, 6, 10)]


def get_init_inputs():
    return [10, 16, 5]
