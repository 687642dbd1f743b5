"""Correct but nondeterministic, like a kernel that accumulates each row's sum with atomicAdd: the
partial sums of 16 column blocks are added in an order that changes from call to call, so two runs
on the same inputs can differ in the last bits (far inside tolerance).  diffkit passes it, as
KernelBench does, and warns that it is nondeterministic."""
import torch
import torch.nn as nn

BLOCKS = 16


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        e = torch.exp(x - x.max(dim=1, keepdim=True).values)
        partial = e.view(e.shape[0], BLOCKS, -1).sum(dim=2)
        total = torch.zeros(e.shape[0], 1, dtype=e.dtype)
        for b in torch.randperm(BLOCKS).tolist():  # the order the "atomics" land in this time
            total = total + partial[:, b:b + 1]
        return e / total
