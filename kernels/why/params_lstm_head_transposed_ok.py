"""The head's weight kept as a transposed copy ([hidden, out], for ``h @ W``) of a throwaway
nn.Linear's, its bias as a renamed copy; the product through torch.addmm: correct."""
import torch
import torch.nn as nn

DIFFKIT_EXPECT = {"reference": "why_params_lstm.py", "verdict": "match", "what_if": None}


class ModelNew(nn.Module):
    def __init__(self, input_size, hidden_size, output_size):
        super().__init__()
        self.lstm = nn.LSTM(input_size, hidden_size, batch_first=True)
        lin = nn.Linear(hidden_size, output_size)
        self.w_t = nn.Parameter(lin.weight.detach().t().contiguous())
        self.b = nn.Parameter(lin.bias.detach().clone())

    def forward(self, x):
        seq, _ = self.lstm(x)
        return torch.addmm(self.b, seq[:, -1, :], self.w_t)
