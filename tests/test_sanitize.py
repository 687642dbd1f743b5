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


# ----------------------------------------------------------------------------- compute-sanitizer failing on its own
INTERNAL = """========= COMPUTE-SANITIZER
========= Error: Race reported between Write access at 0x100 in /tmp/ext/cuda.cu:120:tile_kernel(const float *, float *, int)
=========     and Read access at 0x1f0 in /tmp/ext/cuda.cu:123:tile_kernel(const float *, float *, int) [1024 hazards]
=========
========= Internal Sanitizer Error: The Sanitizer failed to handle a hardware exception.
=========
========= Target application returned an error
========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)
"""

# a stand-in for compute-sanitizer: writes LOG_TEXT to its --log-file, then runs the command it wraps
FAKE_SANITIZER = '''#!{python}
import os, sys
args = sys.argv[1:]
with open(args[args.index("--log-file") + 1], "w") as fh:
    fh.write(os.environ["FAKE_SANITIZER_LOG"])
cmd = args[args.index({python!r}):]
os.execv(cmd[0], cmd)
'''

# on its second trial, a CUDA error (what a process left in a state the sanitizer broke raises), or its process ends
BROKEN_AFTER = '''import os
import sys

import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls > 1 and os.environ.get("HOW") != "none":  # (the first trial's forward: captured, run twice)
            if os.environ.get("HOW") == "exit":
                print("RuntimeError: CUDA error: an illegal memory access was encountered", file=sys.stderr)
                sys.stderr.flush()
                os._exit(1)
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return x * 2 + 1
'''
REF_2X1 = '''import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        return x * 2 + 1


def get_inputs():
    return [torch.randn(4, 8)]


def get_init_inputs():
    return []
'''


# the error caught in the child's trial, or the process ends; or no error at all
@pytest.mark.parametrize("how", ["raise", "exit", "none"])
@pytest.mark.parametrize("log", ["internal", "plain"])
def test_a_crash_after_the_sanitizer_s_own_failure_is_not_pinned_on_the_candidate(tmp_path, monkeypatch, log, how):
    """compute-sanitizer that fails on its own ("Internal Sanitizer Error") leaves the process it watches broken:
    the error that ends it is said to follow the sanitizer's failure, with the reports from before it kept."""
    import json
    import stat
    import sys

    from diffkit import sanitize
    from diffkit.cli import main

    fake = tmp_path / "compute-sanitizer"
    fake.write_text(FAKE_SANITIZER.format(python=sys.executable))
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setattr(sanitize, "find_tool", lambda: str(fake))
    monkeypatch.setattr(sanitize, "tool_version", lambda exe: (2025, 1))
    monkeypatch.setenv("FAKE_SANITIZER_LOG", INTERNAL if log == "internal" else RACECHECK)
    monkeypatch.setenv("HOW", how)
    (tmp_path / "ref.py").write_text(REF_2X1)
    (tmp_path / "cand.py").write_text(BROKEN_AFTER)
    out = tmp_path / "r.json"
    with pytest.raises(SystemExit) as e:
        main.main(args=["diff", str(tmp_path / "ref.py"), str(tmp_path / "cand.py"), "--json", str(out), "--no-report",
                        "--sanitize", "racecheck", "--timeout", "120", "--trials", "2"], standalone_mode=True)
    data = json.loads(out.read_text())
    assert any("tile_kernel" in w for w in data["warnings"])  # the race it reported before failing is kept
    if how == "none":  # it went on to the answer: the race fails the diff, the sanitizer's failure is a warning
        assert e.value.code == 1 and data["verdict"] == "diverged" and data["error"] is None
        said = [w for w in data["warnings"] if "failed on its own" in w]
        assert bool(said) == (log == "internal") and all("its reports may be incomplete" in w for w in said)
        return
    assert e.value.code == 2 and data["verdict"] == "error", data["error"]
    message = data["error"]["message"]
    assert "illegal memory access" in message  # the process's own end, as it was
    if log == "internal":
        assert "after compute-sanitizer racecheck failed on its own" in message and \
            "failed to handle a hardware exception" in message and "diff without --sanitize" in message
        assert not any("failed on its own" in w for w in data["warnings"])  # said once, with the error
    else:  # a plain crash stays the candidate's
        assert "sanitizer" not in message


def test_internal_failure_is_read_from_the_log():
    from diffkit.sanitize import internal_failure

    assert internal_failure(INTERNAL) == "The Sanitizer failed to handle a hardware exception"
    assert internal_failure(RACECHECK) is None and internal_failure(MEMCHECK) is None
    assert len(parse(INTERNAL, "racecheck")) == 1  # (not a report of its own)
