"""The LSTM kept; the head re-declared as two parameters copied from a throwaway nn.Linear built in
__init__ (`fc_weight`, `fc_bias`), applied in numpy: correct."""
import numpy as np
import torch
import torch.nn as nn

DIFFKIT_EXPECT = {"reference": "why_params_lstm.py", "verdict": "match", "what_if": None}


class ModelNew(nn.Module):
    def __init__(self, input_size, hidden_size, output_size):
        super().__init__()
        self.lstm = nn.LSTM(input_size, hidden_size, batch_first=True)
        fc = nn.Linear(hidden_size, output_size)
        self.fc_weight = nn.Parameter(fc.weight.detach().clone())
        self.fc_bias = nn.Parameter(fc.bias.detach().clone())

    def forward(self, x):
        seq, _ = self.lstm(x)
        last = seq[:, -1].detach().numpy()
        y = last @ self.fc_weight.detach().numpy().T + self.fc_bias.detach().numpy()
        return torch.from_numpy(y)
