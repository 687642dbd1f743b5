"""compute-sanitizer reports: parsed from its text log and attached to the stage that launched the kernel.
(The real tool runs in tests/test_gpu.py; these check the parsing and the kernel→stage bridge.)"""
import os

import pytest

import diffkit
from diffkit.sanitize import attach, parse

from conftest import KERNELS, REFS

MEMCHECK = """========= COMPUTE-SANITIZER
========= Invalid __global__ read of size 4 bytes
=========     at attention_scores_kernel(const float *, const float *, float *, int)+0x1b0 in /tmp/ext/cuda.cu:41
=========     by thread (5,0,0) in block (2,0,0)
=========     Address 0x7f0000001000 is out of bounds
=========     Saved host backtrace up to driver entry point at kernel launch time
=========     Host Frame: [0x2dfbef] in libcuda.so.1
=========     Host Frame:attention_scores(at::Tensor, at::Tensor, double, long) [0x1234] in diffkit_cpu_ops.so
=========
========= ERROR SUMMARY: 1 error
"""

RACECHECK = """========= COMPUTE-SANITIZER
========= Error: Race reported between Write access at 0x100 in /tmp/ext/cuda.cu:120:tile_kernel(const float *, float *, int)
=========     and Read access at 0x1f0 in /tmp/ext/cuda.cu:123:tile_kernel(const float *, float *, int) [1024 hazards]
=========
========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)
"""


def test_parse_memcheck_and_racecheck():
    (m,) = parse(MEMCHECK, "memcheck")
    assert m.message == "Invalid __global__ read of size 4 bytes" and m.kernel == "attention_scores_kernel"
    assert (m.thread, m.block) == ("5,0,0", "2,0,0") and m.address.startswith("0x7f0000001000")
    assert m.source.endswith("cuda.cu:41") and m.host == ["attention_scores"]
    (r,) = parse(RACECHECK, "racecheck")
    assert r.kernel == "tile_kernel" and r.source.endswith("cuda.cu:120") and r.message.startswith("Error: Race")


@pytest.fixture(scope="module")
def result():
    return diffkit.diff_files(os.path.join(REFS, "transformer_block.py"), os.path.join(KERNELS, "transformer_block_cpp.py"))


def test_attach_to_launching_stage(result):
    assert result.verdict == "match"
    n = attach(result, parse(MEMCHECK, "memcheck"), launchers={})
    stage = next(s for s in result.stages if s.cand is not None and s.cand.op.endswith(".attention_scores"))
    assert n == 1 and stage.diagnosis[0].kind == "memory_error"
    assert "thread 5,0,0" in stage.diagnosis[0].detail and "attention_scores_kernel" in stage.diagnosis[0].detail
    from diffkit.pipeline import judge

    assert judge(result) == "diverged"  # a sanitizer error fails the diff even when the output matched


def test_unmatched_report_becomes_warning_and_launcher_map_used(result):
    before = len(result.warnings)
    assert attach(result, parse(RACECHECK, "racecheck"), launchers={}) == 0
    assert len(result.warnings) > before and "tile_kernel" in result.warnings[-1] + result.warnings[0]
    # the kernel→host-function map (read from the extension's CUDA source) bridges a kernel name
    assert attach(result, parse(RACECHECK, "racecheck"), launchers={"tile_kernel": "softmax_lastdim"}) == 1
