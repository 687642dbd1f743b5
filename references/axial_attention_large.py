"""Axial attention at a realistic GPU size: B=4, a 64×64 grid, dim 256, 8 heads.

The model is the one in axial_attention.py; only the sizes differ."""
import os
import runpy

_base = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "axial_attention.py"))
Model = _base["Model"]

batch, height, width, dim, heads = 4, 64, 64, 256, 8


def get_inputs():
    import torch

    return [torch.randn(batch, height, width, dim)]


def get_init_inputs():
    return [dim, heads]
