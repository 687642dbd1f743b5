"""Row softmax at KernelBench's own size (level 1, 23_Softmax: 16 rows of 16384); the model is the
one in row_softmax.py."""
import os
import runpy

_base = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "row_softmax.py"))
Model = _base["Model"]

batch_size, dim = 16, 16384


def get_inputs():
    import torch

    return [torch.randn(batch_size, dim)]


def get_init_inputs():
    return []
