"""A forward's inputs as KernelBench hands them over (diffkit.inputs): every copy diffkit makes, and the inputs an
isolated diff's candidate process rebuilds from the reference's capture, keep one tensor at two places as one,
shared memory as shared, and each tensor's strides."""
import json
import os
import subprocess
import sys

import pytest
import torch

from diffkit.inputs import copy_inputs, layout_matters

from conftest import ROOT


def test_copies_keep_identity_shared_memory_and_strides():
    base = torch.randn(6, 4)
    wide = torch.randn(5, 1).expand(5, 7)
    flipped = torch.randn(3, 8).t()
    inputs = [base, base, base[2:4], {"w": wide, "f": flipped}, 3, "tag"]
    got = copy_inputs(inputs)
    assert got[0] is got[1] and got[0] is not base and torch.equal(got[0], base)
    assert got[2].untyped_storage().data_ptr() == got[0].untyped_storage().data_ptr()  # still a view of it
    got[0].mul_(2)  # a write through one is seen through the others, and not in the originals
    assert torch.equal(got[2], 2 * base[2:4]) and torch.equal(got[1], 2 * base)
    assert got[3]["w"].stride() == (1, 0) and torch.equal(got[3]["w"], wide)
    assert got[3]["f"].stride() == flipped.stride() and not got[3]["f"].is_contiguous()
    assert got[4:] == [3, "tag"]
    conj = torch.randn(3, dtype=torch.complex64).conj()  # a lazy conjugate: copied by value
    assert torch.equal(copy_inputs([conj])[0], conj)


def test_layout_matters_only_where_values_alone_do_not_rebuild_the_inputs():
    x = torch.randn(4, 4)
    assert not layout_matters([x, torch.randn(3), 2.0, None])
    assert layout_matters([x, x]) and layout_matters([x, x[1]]) and layout_matters([x.t()])
    assert layout_matters([torch.randn(4, 1).expand(4, 4)]) and layout_matters([x[:, :2]])


REF = '''import torch
from torch import nn


class Model(nn.Module):
    """Scales its first input in place, then adds the second (KernelBench gives the very objects get_inputs made)."""

    def forward(self, lhs, rhs, grid):
        lhs.mul_(3.0)
        return lhs + rhs + grid[0].sum()


def get_inputs():
    shared = torch.randn(6, 5)
    return [shared, shared, torch.randn(5, 3).t()]


def get_init_inputs():
    return []
'''

# right only when lhs and rhs are one tensor (as get_inputs made them): after the reference they both hold 3x
TRUSTS_ALIASING = '''import torch
from torch import nn


def _undo(t):
    t.div_(3.0)  # (rhs follows: one tensor)
    return t


class ModelNew(nn.Module):
    def forward(self, lhs, rhs, grid):
        x = _undo(lhs)
        return 3.0 * x + 3.0 * rhs + grid[0].sum()
'''

# reads the transposed input's memory in order, as if it were laid out row by row
READS_MEMORY = '''import torch
from torch import nn


class ModelNew(nn.Module):
    def forward(self, lhs, rhs, grid):
        rows, cols = grid.shape
        raw = torch.as_strided(grid, (rows, cols), (cols, 1))  # what a kernel given the data pointer reads
        return lhs + rhs + raw[0].sum()
'''


@pytest.mark.parametrize("isolate", [True, False], ids=["isolated", "in-process"])
@pytest.mark.parametrize("cand,verdict", [(TRUSTS_ALIASING, "match"), (READS_MEMORY, "diverged")],
                         ids=["aliasing", "raw-memory"])
def test_candidates_see_the_input_objects_kernelbench_gives_them(tmp_path, isolate, cand, verdict):
    """KernelBench's answer: the first candidate passes (its inputs are one tensor, changed by the reference), the
    second fails (a transposed input's memory is not in its logical order); both ways of running the diff agree."""
    (tmp_path / "ref.py").write_text(REF)
    (tmp_path / "cand.py").write_text(cand)
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "cli.py"), "diff", str(tmp_path / "ref.py"),
                           str(tmp_path / "cand.py"), "--json", str(out), "--no-report",
                           *([] if isolate else ["--no-isolate"])], capture_output=True, text=True, timeout=600)
    data = json.loads(out.read_text())
    assert data["verdict"] == verdict, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert proc.returncode == {"match": 0, "diverged": 1}[verdict]
