"""Linear scores -> softmax over the classes -> weighted by a value projection."""
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, dim, classes):
        super().__init__()
        self.score = nn.Linear(dim, classes)
        self.value = nn.Linear(dim, classes)

    def forward(self, x):
        logits = self.score(x)
        probs = torch.softmax(logits, dim=-1)
        return probs * self.value(x)


batch_size, dim, classes = 8, 64, 40


def get_inputs():
    return [torch.randn(batch_size, dim)]


def get_init_inputs():
    return [dim, classes]
