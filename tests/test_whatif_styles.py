"""What-if on candidates written unlike the bundled twins: a NumPy implementation (nothing torch
can see between input and output), a reference that runs one code path in a loop, other names.
Each fix to the search (the same mistake at every call of one code line; the last partial tile of
rows of a [rows, features] view; a weight's memory read in another shape) must hold here too."""
import os
import textwrap

import pytest

import diffkit

REF = '''
import torch
import torch.nn as nn


class Model(nn.Module):
    """A residual MLP tower: the same code line runs every layer."""

    def __init__(self, width, depth):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, 2 * width)

    def forward(self, tokens):
        h = tokens
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        return self.head(h)


def get_inputs():
    return [torch.randn(3, 7, 24)]


def get_init_inputs():
    return [24, 3]
'''

CAND = '''
import numpy as np
import torch
import torch.nn as nn

MISTAKE = {mistake!r}


def _dense(a, w, b, tile=None):
    y = a @ w.T
    if b is not None:
        y = y + b
    if tile:  # rows processed in tiles; the last partial tile is never written
        rows = y.reshape(-1, y.shape[-1])
        rows[rows.shape[0] - rows.shape[0] % tile:] = 0.0
    return y


class ModelNew(nn.Module):
    def __init__(self, width, depth):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, 2 * width)

    def forward(self, tokens):
        with torch.no_grad():
            x = tokens.detach().cpu().numpy().astype(np.float64)
            ps = [(l.weight.detach().numpy().astype(np.float64), l.bias.detach().numpy().astype(np.float64))
                  for l in self.layers]
            for i, (w, b) in enumerate(ps):
                x = x + np.tanh(_dense(x, w, None if MISTAKE == "no_bias_everywhere" else b))
            hw = self.head.weight.detach().numpy().astype(np.float64)
            hb = self.head.bias.detach().numpy().astype(np.float64)
            if MISTAKE == "head_memory_as_transposed":
                hw = hw.reshape(hw.shape[1], hw.shape[0]).T  # x @ W.view(in, out)
            out = _dense(x, hw, hb, tile=16 if MISTAKE == "head_tail_tile" else None)
        return torch.from_numpy(out.astype(np.float32))
'''


@pytest.mark.parametrize("mistake,kind,stages", [
    ("no_bias_everywhere", "drop_bias", {"layers.0", "layers.1", "layers.2"}),
    ("head_tail_tile", "unwritten_tail", {"head", "output"}),
    ("head_memory_as_transposed", "transposed_weight", {"head", "output"}),
])
def test_a_numpy_candidate_is_explained(tmp_path, mistake, kind, stages):
    ref = tmp_path / "tower.py"
    ref.write_text(textwrap.dedent(REF))
    cand = tmp_path / f"tower_{mistake}.py"
    cand.write_text(textwrap.dedent(CAND.format(mistake=mistake)))
    r = diffkit.diff_files(str(ref), str(cand), trials=1)
    assert r.verdict == "diverged", r.summary_line()
    assert r.what_if, r.meta.get("what_if")
    best = r.what_if[0]
    names = {n for m in best["mutations"] for n in [m["stage"], *m["aliases"]]}
    assert best["explains"] and best["kind"] == kind, [(w["kind"], w["stage"], w["max_abs_after"])
                                                       for w in r.what_if[:4]]
    assert stages <= names if mistake == "no_bias_everywhere" else names & stages, names
