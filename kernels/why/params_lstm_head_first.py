"""The head's parameters re-declared (`fc_weight` from a throwaway nn.Linear, a transposed copy
stored as the parameter) but the throwaway Linear is built *before* the LSTM: with the same seed the
random stream is consumed in another order, so every weight holds other values than the reference's."""
import torch
import torch.nn as nn

DIFFKIT_EXPECT = {"reference": "why_params_lstm.py", "stage": "lstm[0]", "kind": "other_weights", "what_if": None}


class ModelNew(nn.Module):
    def __init__(self, input_size, hidden_size, output_size):
        super().__init__()
        head = nn.Linear(hidden_size, output_size)
        self.fc_weight_t = nn.Parameter(head.weight.detach().t().contiguous())
        self.fc_bias = nn.Parameter(head.bias.detach().clone())
        self.lstm = nn.LSTM(input_size, hidden_size, batch_first=True)

    def forward(self, x):
        seq, _ = self.lstm(x)
        return torch.addmm(self.fc_bias, seq[:, -1, :], self.fc_weight_t)
