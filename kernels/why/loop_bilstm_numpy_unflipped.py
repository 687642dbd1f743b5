"""A bidirectional LSTM in numpy: the backward direction runs over the reversed sequence, but its outputs
are never flipped back to the forward time order before being concatenated with the forward direction's.
The features come back into torch (`torch.from_numpy`) for the Linear head: that is where the error first
shows, not at the head (issue 44)."""
import numpy as np
import torch
import torch.nn as nn

DIFFKIT_EXPECT = {"reference": "why_loop_bilstm.py", "stage": "lstm[0]", "kind": None, "what_if": None}


def _sigmoid(a):
    return 1.0 / (1.0 + np.exp(-a))


def _direction(xs, w_ih, w_hh, b):
    n = w_hh.shape[1]
    h = np.zeros((xs.shape[0], n), dtype=xs.dtype)
    c = np.zeros_like(h)
    outs = []
    for t in range(xs.shape[1]):
        g = xs[:, t] @ w_ih.T + h @ w_hh.T + b
        i, f, gg, o = _sigmoid(g[:, :n]), _sigmoid(g[:, n:2 * n]), np.tanh(g[:, 2 * n:3 * n]), _sigmoid(g[:, 3 * n:])
        c = f * c + i * gg
        h = o * np.tanh(c)
        outs.append(h)
    return np.stack(outs, axis=1)


class ModelNew(nn.Module):
    def __init__(self, input_size, hidden_size, output_size):
        super().__init__()
        self.lstm = nn.LSTM(input_size, hidden_size, batch_first=True, bidirectional=True)
        self.fc = nn.Linear(2 * hidden_size, output_size)

    def forward(self, x):
        xs = x.detach().cpu().numpy()
        p = {name: t.detach().cpu().numpy() for name, t in self.lstm.named_parameters()}
        fwd = _direction(xs, p["weight_ih_l0"], p["weight_hh_l0"], p["bias_ih_l0"] + p["bias_hh_l0"])
        bwd = _direction(xs[:, ::-1], p["weight_ih_l0_reverse"], p["weight_hh_l0_reverse"],
                         p["bias_ih_l0_reverse"] + p["bias_hh_l0_reverse"])
        both = np.concatenate([fwd, bwd], axis=-1)  # bwd is still in reversed time order
        return self.fc(torch.from_numpy(np.ascontiguousarray(both)))
