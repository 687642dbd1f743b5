"""A forward's inputs as KernelBench hands them over (diffkit.inputs): every copy diffkit makes, and the inputs an
isolated diff's candidate process rebuilds from the reference's capture, keep one tensor at two places as one,
shared memory as shared, and each tensor's strides."""
import json

import pytest
import torch

from diffkit.inputs import copy_inputs, layout

from conftest import run_cli


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


def test_a_layout_is_kept_only_where_values_alone_do_not_rebuild_the_inputs():
    x = torch.randn(4, 4)
    assert layout([x, torch.randn(3), 2.0, None]) is None
    assert all(layout(inputs) is not None for inputs in ([x, x], [x, x[1]], [x.t()], [torch.randn(4, 1).expand(4, 4)],
                                                          [x[:, :2]]))


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
    proc = run_cli("diff", str(tmp_path / "ref.py"), str(tmp_path / "cand.py"), "--json", str(out), "--no-report",
                   *([] if isolate else ["--no-isolate"]))
    data = json.loads(out.read_text())
    assert data["verdict"] == verdict, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert proc.returncode == {"match": 0, "diverged": 1}[verdict]


def test_made_again_only_when_every_leaf_and_the_layout_are_as_captured():
    from diffkit.inputs import as_made, layout

    x = torch.randn(3, 3)
    captured = [x.clone(), x.clone(), 7]
    made = [x, x, 7]
    want = layout(made)
    assert as_made(captured, made, want) is made
    assert as_made(captured, [x, x, 8], want) is captured  # a non-tensor leaf that differs (an unseeded draw)
    apart = [x, x.clone(), 7]  # the same values, no longer one tensor (the file changed since the capture)
    assert as_made(captured, apart, want) is captured
    assert layout([x, torch.randn(2)]) is None and layout([x, x])[1][3] == 0  # (the second leaf is the first)


RANDOM_LEAF_REF = '''import random
import torch
from torch import nn


class Model(nn.Module):
    def forward(self, a, b, k):
        return a * k + b


def get_inputs():
    x = torch.randn(4, 4)
    return [x, x, random.randint(1, 1000)]  # (KernelBench seeds no Python generator)


def get_init_inputs():
    return []
'''


def test_an_unseeded_non_tensor_input_is_not_made_again(tmp_path):
    """get_inputs() run again in the candidate's process gives another Python integer: the stored inputs are used,
    and the isolated diff agrees with the in-process one (both models got the same objects)."""
    (tmp_path / "ref.py").write_text(RANDOM_LEAF_REF)
    (tmp_path / "cand.py").write_text(RANDOM_LEAF_REF.replace("class Model(", "class ModelNew("))
    out = tmp_path / "r.json"
    proc = run_cli("diff", str(tmp_path / "ref.py"), str(tmp_path / "cand.py"), "--json", str(out), "--no-report",
                   "--trials", "2")
    assert proc.returncode == 0 and json.loads(out.read_text())["verdict"] == "match", proc.stdout[-2000:]


def test_a_capture_s_inputs_do_not_follow_its_source_file_afterwards(tmp_path):
    """The reference file changed after its capture (same values, its inputs no longer one tensor): the candidate
    still gets the captured inputs as they were made, not as the file makes them now."""
    ref = tmp_path / "ref.py"
    ref.write_text(REF)
    cap = tmp_path / "run.dkt"
    run_cli("capture", str(ref), "-o", str(cap), check=True)
    ref.write_text(REF.replace("return [shared, shared,", "return [shared, shared.clone(),"))
    (tmp_path / "cand.py").write_text(TRUSTS_ALIASING)
    out = tmp_path / "r.json"
    proc = run_cli("diff", str(cap), str(tmp_path / "cand.py"), "--json", str(out), "--no-report")
    assert json.loads(out.read_text())["verdict"] == "match", proc.stdout[-2000:] + proc.stderr[-2000:]
