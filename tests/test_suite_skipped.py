"""`skipped`: a pair that needs CUDA or Triton on a machine without them is skipped with the reason (what is
missing, what in its files needs it, the diff's own error), counted apart in every summary and on the
terminal, and leaves the exit code alone; any other error stays an error."""
import csv
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys

import junitparser
import pytest
import torch

from conftest import ROOT

from diffkit import suite as suite_mod
from diffkit.suite import SuiteEntry, exit_code, junit_xml, summary_markdown

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the pairs that need CUDA run where CUDA is")

PY = [sys.executable, "-m", "diffkit.cli"]
REF = '''import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.w = nn.Parameter(torch.randn(n, n))

    def forward(self, x):
        return torch.tanh(x @ self.w)


def get_inputs():
    return [torch.randn(3, 8)]


def get_init_inputs():
    return [8]
'''
MATCH = '''import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self, size):
        super().__init__()
        self.w = nn.Parameter(torch.randn(size, size))

    def forward(self, inp):
        out = torch.empty(inp.shape[0], self.w.shape[1])
        for r in range(inp.shape[0]):
            out[r] = torch.tanh(inp[r] @ self.w)
        return out
'''
# moves its weight to the GPU in the constructor (a helper does it)
ON_GPU = '''import torch
import torch.nn as nn


def _to_gpu(t):
    return t.cuda()


class ModelNew(nn.Module):
    def __init__(self, size):
        super().__init__()
        self.w = nn.Parameter(_to_gpu(torch.randn(size, size)))

    def forward(self, inp):
        return torch.tanh(inp @ self.w)
'''
TRITON = '''import torch
import torch.nn as nn
import triton
import triton.language as tl


class ModelNew(nn.Module):
    def __init__(self, size):
        super().__init__()
        self.w = nn.Parameter(torch.randn(size, size))

    def forward(self, inp):
        return torch.tanh(inp @ self.w)
'''
# says "CUDA" in its error, but fails for its own reason: an error, not a skip
WRONG_SHAPE = '''import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self, size):
        super().__init__()
        self.w = nn.Parameter(torch.randn(size, size + 1))

    def forward(self, inp):
        raise ValueError("bad shape in the CUDA-style tiling: " + str(tuple(self.w.shape)))
'''


def _pair(root, name, cand):
    d = os.path.join(root, name)
    os.makedirs(d)
    for f, text in (("ref.py", REF), ("cand.py", cand)):
        with open(os.path.join(d, f), "w") as fh:
            fh.write(text)


def _suite(*args):
    return subprocess.run([*PY, "suite", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def _read(path):
    with open(path, encoding="utf-8") as fh:
        return fh.read()


def test_pairs_needing_cuda_or_triton_are_skipped_and_counted_apart(tmp_path):
    if importlib.util.find_spec("triton") is not None:  # (CI installs no Triton)
        pytest.skip("Triton is installed here: the pair that imports it runs (on the CPU) instead of being skipped")
    src, out = str(tmp_path / "in"), str(tmp_path / "out")
    _pair(src, "a_match", MATCH)
    _pair(src, "b_on_gpu", ON_GPU)
    _pair(src, "c_triton", TRITON)
    args = [src, "--report-dir", out, "--trials", "1", "--no-isolate", "--workers", "2"]
    proc = _suite(*args)
    assert proc.returncode == 0, proc.stdout + proc.stderr  # one match, two skipped: no error
    assert "1 match, 0 diverged, 0 error, 2 skipped" in proc.stdout
    assert "b_on_gpu: skipped" in proc.stdout and "c_triton: skipped" in proc.stdout
    rows = {r["name"]: r for r in json.loads(_read(os.path.join(out, "summary.json")))}
    assert {n: r["verdict"] for n, r in rows.items()} == {"a_match": "match", "b_on_gpu": "skipped",
                                                          "c_triton": "skipped"}
    gpu, tri = rows["b_on_gpu"]["skip_reason"], rows["c_triton"]["skip_reason"]
    assert gpu.startswith("needs CUDA, which this machine lacks") and "the candidate moves tensors with .cuda()" in gpu
    assert "not compiled with CUDA" in gpu  # the diff's own error
    assert tri.startswith("needs Triton") and "the candidate imports triton" in tri and "triton" in tri.split(": ")[-1]
    assert rows["b_on_gpu"]["error"] is None and rows["a_match"]["skip_reason"] is None

    csv_rows = {r["name"]: r for r in csv.DictReader(open(os.path.join(out, "summary.csv"), encoding="utf-8"))}
    assert csv_rows["c_triton"]["verdict"] == "skipped" and csv_rows["c_triton"]["skip_reason"] == tri

    xml = junitparser.JUnitXml.fromfile(os.path.join(out, "junit.xml"))
    cases = {c.name: c for s in xml for c in s}
    assert {type(r).__name__ for r in cases["b_on_gpu"].result} == {"Skipped"}
    assert next(iter(cases["b_on_gpu"].result)).message == gpu
    assert not cases["a_match"].result
    ts = next(iter(xml))
    assert (ts.tests, ts.failures, ts.errors, ts.skipped) == (3, 0, 0, 2)

    md = _read(os.path.join(out, "summary.md"))
    assert md.startswith("## diffkit suite: 1 match, 0 diverged, 0 error, 2 skipped (3 pairs)")
    html = _read(os.path.join(out, "index.html"))
    assert "2 skipped</span>" in html and "moves tensors with .cuda()" in html

    # --resume takes a skipped pair's answer back as it is
    again = _suite(*args, "--resume")
    assert again.returncode == 0 and again.stdout.count("resumed: skipped") == 2, again.stdout + again.stderr


def test_other_errors_stay_errors_and_make_the_exit_code_2(tmp_path):
    src, out = str(tmp_path / "in"), str(tmp_path / "out")
    _pair(src, "a_on_gpu", ON_GPU)
    _pair(src, "b_wrong", WRONG_SHAPE)
    proc = _suite(src, "--report-dir", out, "--trials", "1", "--no-isolate", "--workers", "2")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    rows = {r["name"]: r for r in json.loads(_read(os.path.join(out, "summary.json")))}
    assert rows["a_on_gpu"]["verdict"] == "skipped"
    assert rows["b_wrong"]["verdict"] == "error" and "bad shape" in rows["b_wrong"]["error"]
    assert "0 match, 0 diverged, 1 error, 1 skipped" in proc.stdout


def test_a_machine_with_cuda_does_not_skip(monkeypatch, tmp_path):
    """The skip rests on the diff's error AND this machine lacking the thing: where CUDA is, the same error is
    the candidate's own."""
    cand = tmp_path / "cand.py"
    cand.write_text(ON_GPU)
    e = SuiteEntry("p", str(tmp_path / "ref.py"), str(cand), verdict="error",
                   error="candidate failed (init): AssertionError: Torch not compiled with CUDA enabled")
    assert "needs CUDA" in suite_mod.unavailable_reason(e, "")
    monkeypatch.setattr(suite_mod, "machine_has", lambda thing: True)
    assert suite_mod.unavailable_reason(e, "") is None
    # an error that says nothing of CUDA is never a skip, whatever the files hold
    monkeypatch.setattr(suite_mod, "machine_has", lambda thing: False)
    assert suite_mod.unavailable_reason(dataclasses.replace(e, error="RuntimeError: shape mismatch"), "") is None


def test_a_cuda_build_that_fails_in_its_own_words_is_skipped_where_cuda_is_missing(monkeypatch, tmp_path):
    """A candidate that builds CUDA sources and fails to import on a CPU machine with an error that names no missing
    CUDA (seen when two pairs build the same extension at once: the second finds no .so) cannot be judged here."""
    cand = tmp_path / "cand.py"
    cand.write_text("from torch.utils.cpp_extension import load_inline\n"
                    "ops = load_inline(name='x', cpp_sources=[''], cuda_sources=['__global__ void k() {}'])\n")
    e = SuiteEntry("p", str(tmp_path / "ref.py"), str(cand), verdict="error",
                   error="candidate failed (import) at cand.py:2: ImportError: /root/.cache/torch_extensions/x/x.so: "
                         "cannot open shared object file: No such file or directory")
    monkeypatch.setattr(suite_mod, "machine_has", lambda thing: False)
    why = suite_mod.unavailable_reason(e, "")
    assert why.startswith("needs CUDA, which this machine lacks (the candidate builds a CUDA extension")
    assert "cannot open shared object file" in why
    # the same failure in its forward, or a file that builds no CUDA, stays an error; and where CUDA is, too
    assert suite_mod.unavailable_reason(dataclasses.replace(e, error=e.error.replace("(import)", "(forward)")), "") \
        is None
    plain = tmp_path / "plain.py"
    plain.write_text("import torch\n")
    assert suite_mod.unavailable_reason(dataclasses.replace(e, cand=str(plain)), "") is None
    monkeypatch.setattr(suite_mod, "machine_has", lambda thing: True)
    assert suite_mod.unavailable_reason(e, "") is None


def test_the_writers_and_the_exit_code_count_skipped_apart():
    skipped = SuiteEntry("s", "r.py", "c.py", verdict="skipped", skip_reason="needs CUDA", headline="diffkit: SKIPPED")
    diverged = SuiteEntry("d", "r.py", "c.py", verdict="diverged", first_divergence="stage 1 fc")
    assert exit_code([skipped]) == 0 and exit_code([skipped, diverged]) == 1
    assert exit_code([skipped, SuiteEntry("e", "r.py", "c.py", verdict="error", error="boom")]) == 2
    assert summary_markdown([skipped, diverged]).startswith("## diffkit suite: 0 match, 1 diverged, 0 error, 1 skipped")
    assert '<skipped message="needs CUDA">' in junit_xml([skipped, diverged])
    assert 'skipped="1"' in junit_xml([skipped, diverged])
