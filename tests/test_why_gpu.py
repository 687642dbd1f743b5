"""Issue 44 on the GPU: a tiled CUDA GEMM that reads B with its strides swapped gets the diagnosis its CPU twins
(kernels/why/diag_gemm_loop_bt.py) get; the same kernel reading B as stored matches with no finding."""
import os

import pytest

import diffkit

from conftest import KERNELS, REFS, expectation

WHY = os.path.join(KERNELS, "why")
CASES = [n for n in sorted(os.listdir(WHY)) if n.endswith(".py") and (expectation(os.path.join(WHY, n)) or {})
         .get("device") == "cuda"]


@pytest.mark.cuda
@pytest.mark.parametrize("name", CASES)
def test_why_cuda_gemm(name):
    exp = expectation(os.path.join(WHY, name))
    result = diffkit.diff_files(os.path.join(REFS, exp["reference"]), os.path.join(WHY, name), device="cuda")
    assert result.error is None, result.error
    if exp.get("verdict") == "match":
        assert result.verdict == "match", result.summary_line()
        assert not result.first_divergence and not result.what_if
        return
    fd = result.first_divergence
    assert result.verdict == "diverged" and fd is not None and fd.matches(exp["stage"]), result.summary_line()
    assert fd.diagnosis and fd.diagnosis[0].kind == exp["kind"], [(f.kind, f.detail) for f in fd.diagnosis]
