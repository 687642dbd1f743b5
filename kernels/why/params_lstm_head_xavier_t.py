"""The head keeps its bias from a throwaway nn.Linear (`head_bias`) but stores its weight transposed, as a
[hidden, out] parameter for ``h @ W``, re-initialised with Xavier: other values than the reference's
fc.weight, in another shape, under another name."""
import torch
import torch.nn as nn

DIFFKIT_EXPECT = {"reference": "why_params_lstm.py", "stage": "fc", "kind": "other_weights", "what_if": None}


class ModelNew(nn.Module):
    def __init__(self, input_size, hidden_size, output_size):
        super().__init__()
        self.lstm = nn.LSTM(input_size, hidden_size, batch_first=True)
        template = nn.Linear(hidden_size, output_size)
        self.head_bias = nn.Parameter(template.bias.detach().clone())
        self.head_w = nn.Parameter(torch.empty(hidden_size, output_size))
        nn.init.xavier_uniform_(self.head_w)

    def forward(self, x):
        seq, _ = self.lstm(x)
        return seq[:, -1, :] @ self.head_w + self.head_bias
