"""A bidirectional LSTM (nn.LSTM, batch first) and a Linear head on every step's features (issue 44: the
candidates in kernels/why/loop_bilstm_*.py run the recurrence in numpy and hand the features back to torch
for the head)."""
import torch
import torch.nn as nn

BATCH, STEPS, INPUT, HIDDEN, OUTPUT = 3, 7, 10, 12, 5


class Model(nn.Module):
    def __init__(self, input_size, hidden_size, output_size):
        super().__init__()
        self.lstm = nn.LSTM(input_size, hidden_size, batch_first=True, bidirectional=True)
        self.fc = nn.Linear(2 * hidden_size, output_size)

    def forward(self, x):
        feats, _ = self.lstm(x)
        return self.fc(feats)


def get_inputs():
    return [torch.randn(BATCH, STEPS, INPUT)]


def get_init_inputs():
    return [INPUT, HIDDEN, OUTPUT]
