"""The head re-declared from a throwaway nn.Linear (`fc_weight`, `fc_bias`) and fused into one numpy
expression with the last step's selection, which forgets the bias."""
import numpy as np
import torch
import torch.nn as nn

DIFFKIT_EXPECT = {"reference": "why_params_lstm.py", "stage": "fc", "kind": "missing_bias", "what_if": None}


class ModelNew(nn.Module):
    def __init__(self, input_size, hidden_size, output_size):
        super().__init__()
        self.lstm = nn.LSTM(input_size, hidden_size, batch_first=True)
        fc = nn.Linear(hidden_size, output_size)
        self.fc_weight = nn.Parameter(fc.weight.detach().clone())
        self.fc_bias = nn.Parameter(fc.bias.detach().clone())

    def forward(self, x):
        seq, _ = self.lstm(x)
        h = seq.detach().numpy()
        return torch.from_numpy(np.einsum("bh,oh->bo", h[:, -1, :], self.fc_weight.detach().numpy()))
