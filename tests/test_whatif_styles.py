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


GROUPED_REF = '''
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, channels, groups):
        super().__init__()
        self.norm = nn.GroupNorm(groups, channels)
        self.act = nn.SiLU()

    def forward(self, img):
        return self.act(self.norm(img))


def get_inputs():
    return [torch.randn(2, 8, 5, 5) * 2 + 1]


def get_init_inputs():
    return [8, 4]
'''

# group statistics by hand; Tensor.var's default is the unbiased estimator, where GroupNorm's is biased
GROUPED_BY_HAND = '''
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self, channels, groups):
        super().__init__()
        self.norm = nn.GroupNorm(groups, channels)
        self.groups = groups

    def forward(self, img):
        n, c, h, w = img.shape
        g = img.view(n, self.groups, -1)
        z = (g - g.mean(dim=2, keepdim=True)) * torch.rsqrt(g.var(dim=2, keepdim=True) + self.norm.eps)
        z = z.view(n, c, h, w) * self.norm.weight.view(1, c, 1, 1) + self.norm.bias.view(1, c, 1, 1)
        return z * torch.sigmoid(z)
'''


def test_group_statistics_with_the_unbiased_variance_are_explained(tmp_path):
    ref, cand = tmp_path / "grouped.py", tmp_path / "grouped_by_hand.py"
    ref.write_text(GROUPED_REF)
    cand.write_text(GROUPED_BY_HAND)
    r = diffkit.diff_files(str(ref), str(cand), trials=1, explain=True)
    assert r.verdict == "diverged", r.summary_line()
    fd = r.first_divergence  # the hand-written statistics, once the affine step is done: the module's output
    assert fd.ref_name == "norm" and "sigmoid" not in fd.cand.op, fd.cand_name
    assert fd.diagnosis and "variance divided by d−1" in fd.diagnosis[0].detail and "d = 50" in \
        fd.diagnosis[0].detail, fd.diagnosis
    assert r.what_if and r.what_if[0]["explains"] and r.what_if[0]["kind"] == "unbiased_variance", \
        [(w["kind"], w["stage"], w["max_abs_after"]) for w in r.what_if[:4]]
