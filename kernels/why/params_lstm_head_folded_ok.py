"""The head's bias folded into its weight as one extra column ([out, hidden + 1], taken from a throwaway
nn.Linear), applied to the last step with a column of ones appended: correct."""
import torch
import torch.nn as nn

DIFFKIT_EXPECT = {"reference": "why_params_lstm.py", "verdict": "match", "what_if": None}


class ModelNew(nn.Module):
    def __init__(self, input_size, hidden_size, output_size):
        super().__init__()
        self.lstm = nn.LSTM(input_size, hidden_size, batch_first=True)
        lin = nn.Linear(hidden_size, output_size)
        self.head = nn.Parameter(torch.cat([lin.weight.detach(), lin.bias.detach()[:, None]], dim=1))

    def forward(self, x):
        seq, _ = self.lstm(x)
        last = seq[:, -1, :]
        ones = torch.ones(last.shape[0], 1, dtype=last.dtype)
        return torch.cat([last, ones], dim=1) @ self.head.t()
