"""`--harden` (issue 43): the engine (diffkit.harden) and its wiring in the CLI, on small inline pairs.

Each pair passes KernelBench's protocol; the matrix then says whether a setting applied to both models breaks
the candidate: a correct one is robust (exit 0), one that ignores a LayerNorm weight breaks under `init` at the
norm stage, one with a hard-coded batch size breaks under `shape` (the error said), and a reference that ignores
its input gets an `input_independent` finding.  Without --harden nothing changes.
"""
import json

import pytest
import torch

from conftest import run_cli

import diffkit
from diffkit.harden import harden_models, next_size, size_candidates, size_constants
from diffkit.options import Options

REF = """
import torch
import torch.nn as nn

batch_size = 8
features = 32


class Model(nn.Module):
    def __init__(self, features):
        super().__init__()
        self.fc = nn.Linear(features, features)
        self.norm = nn.LayerNorm(features)
        self.out = nn.Linear(features, 4)

    def forward(self, x):
        return self.out(self.norm(self.fc(x)))


def get_inputs():
    return [torch.randn(batch_size, features)]


def get_init_inputs():
    return [features]
"""

HEAD = """
import torch
import torch.nn as nn
import torch.nn.functional as F


class ModelNew(nn.Module):
    def __init__(self, features):
        super().__init__()
        self.fc = nn.Linear(features, features)
        self.norm = nn.LayerNorm(features)
        self.out = nn.Linear(features, 4)

"""

CANDIDATES = {
    # right: the norm written out, in another order of operations
    "ok": """
    def forward(self, x):
        h = F.linear(x, self.fc.weight, self.fc.bias)
        mu = h.mean(-1, keepdim=True)
        var = ((h - mu) ** 2).mean(-1, keepdim=True)
        return self.out((h - mu) / torch.sqrt(var + 1e-5) * self.norm.weight + self.norm.bias)
""",
    # right, in float64 throughout (a large input scale moves it off float32's rounding, not off the function)
    "float64": """
    def forward(self, x):
        h = F.linear(x.double(), self.fc.weight.double(), self.fc.bias.double())
        h = F.layer_norm(h, h.shape[-1:], self.norm.weight.double(), self.norm.bias.double())
        return F.linear(h, self.out.weight.double(), self.out.bias.double()).float()
""",
    # wrong: the norm's weight (ones at construction) left out
    "no_weight": """
    def forward(self, x):
        h = self.fc(x)
        return self.out(F.layer_norm(h, h.shape[-1:]) + self.norm.bias)
""",
    # wrong: the batch size written in
    "batch8": """
    def forward(self, x):
        h = self.fc(x).reshape(8, -1)
        return self.out(self.norm(h))
""",
}

REF_IGNORES_INPUT = """
import torch
import torch.nn as nn

batch_size = 4
dim = 16


class Model(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.token = nn.Parameter(torch.randn(1, dim))
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return self.fc(self.token.expand(x.shape[0], -1))


def get_inputs():
    return [torch.randn(batch_size, dim)]


def get_init_inputs():
    return [dim]
"""

CAND_FOR_IGNORED = """
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.token = nn.Parameter(torch.randn(1, dim))
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return self.fc(self.token).expand(x.shape[0], -1)
"""


@pytest.fixture
def pair(tmp_path):
    def make(name):
        ref = tmp_path / "ref.py"
        ref.write_text(REF)
        cand = tmp_path / f"{name}.py"
        cand.write_text(HEAD + CANDIDATES[name])
        return str(ref), str(cand)
    return make


def _diff(tmp_path, ref, cand, *flags):
    out = tmp_path / "result.json"
    proc = run_cli("diff", ref, cand, "--no-report", "--json", out, *flags)
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    return proc, json.loads(out.read_text())


def _setting(data, kind):
    return [s for s in data["harden"]["settings"] if s["kind"] == kind]


def test_candidate_files_are_well_formed(pair):
    for name in CANDIDATES:
        _, cand = pair(name)
        compile(open(cand).read(), cand, "exec")


@pytest.mark.parametrize("name", ["ok", "float64"])
def test_a_correct_candidate_is_robust(tmp_path, pair, name):
    proc, data = _diff(tmp_path, *pair(name), "--harden")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert data["verdict"] == "match" and data["harden"]["verdict"] == "robust", data["harden"]
    kinds = {s["kind"] for s in data["harden"]["settings"]}
    assert kinds == {"init", "inputs", "shape", "precision"}
    assert [s["name"] for s in _setting(data, "shape")] == ["batch_size 8 -> 11", "features 32 -> 37"]
    assert _setting(data, "precision")[0]["verdict"] == "skipped"  # (TF32: CUDA only)
    lines = proc.stdout.strip().splitlines()
    assert lines[-1].startswith("diffkit --harden: passes KernelBench (5/5); robust under 9 settings ("), lines[-1]
    assert data["harden"]["seconds"] > 0


def test_a_candidate_ignoring_a_norm_weight_breaks_under_init_at_the_norm(tmp_path, pair):
    proc, data = _diff(tmp_path, *pair("no_weight"), "--harden")
    assert data["verdict"] == "match"  # KernelBench's verdict as it is
    assert proc.returncode == 1, proc.stdout
    assert data["harden"]["verdict"] == "breaks"
    init = _setting(data, "init")[0]
    assert init["name"].startswith("random LayerNorm weight and bias")
    assert init["verdict"] == "diverged" and init["judged_by"] == "auto"
    assert init["first_divergence"]["ref_name"] == "norm"
    assert [s["verdict"] for s in data["harden"]["settings"] if s is not init and s["verdict"] != "skipped"] == \
        ["match"] * 8
    assert "breaks with random LayerNorm weight and bias (constant at construction): first wrong stage `norm`" in \
        proc.stdout.strip().splitlines()[-1]


def test_a_hard_coded_batch_size_breaks_under_shape_with_the_error_said(tmp_path, pair):
    proc, data = _diff(tmp_path, *pair("batch8"), "--harden", "--no-isolate")
    assert data["verdict"] == "match" and proc.returncode == 1
    batch = next(s for s in _setting(data, "shape") if s["name"].startswith("batch_size"))
    assert batch["name"] == "batch_size 8 -> 11" and batch["verdict"] == "error"
    assert batch["error"].startswith("the candidate raised RuntimeError") and "batch8.py" in batch["error"]
    assert [s["verdict"] for s in data["harden"]["settings"] if s is not batch and s["verdict"] != "skipped"] == \
        ["match"] * 8
    assert "breaks with batch_size 8 -> 11: the candidate raised RuntimeError" in proc.stdout


def test_a_reference_that_ignores_its_input_is_a_finding(tmp_path):
    ref, cand = tmp_path / "ref.py", tmp_path / "cand.py"
    ref.write_text(REF_IGNORES_INPUT)
    cand.write_text(CAND_FOR_IGNORED)
    proc, data = _diff(tmp_path, ref, cand, "--harden")
    assert data["verdict"] == "match" and data["harden"]["verdict"] == "robust" and proc.returncode == 0
    assert data["harden"]["findings"] == [{
        "kind": "input_independent", "confidence": 1.0,
        "detail": "the reference's output does not depend on `x` (input 0): any candidate that computes the right "
                  "function of the parameters passes"}]
    assert "warning: the reference's output does not depend on `x` (input 0)" in proc.stdout


def test_without_harden_nothing_changes(tmp_path, pair):
    proc, data = _diff(tmp_path, *pair("no_weight"))
    assert proc.returncode == 0 and data["verdict"] == "match"
    assert "harden" not in data and "--harden" not in proc.stdout


def test_compare_with_harden_on_live_models():
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    cand = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    cand.load_state_dict(ref.state_dict())
    result = diffkit.compare(ref, cand, [torch.randn(4, 8)], harden=True)
    assert result.verdict == "match" and result.harden is not None and result.harden.verdict == "robust"
    assert {s.kind for s in result.harden.settings} == {"init", "inputs", "precision"}  # (no file: no shape)
    # (the norm without its affine parameters: the same at construction, not once they are drawn at random)
    plain = torch.nn.Sequential(ref[0], torch.nn.LayerNorm(8, elementwise_affine=False), ref[2])
    broken = harden_models(ref, plain, [torch.randn(4, 8)], Options())
    assert broken.verdict == "breaks" and broken.breaking[0].kind == "init"


def test_size_constants_are_the_ints_get_inputs_reads(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("a = 3\nb, c = 4, 5\nd: int = 6\nunused = 7\nname = 'x'\nflag = True\na2 = 2.0\n"
                    "e = 8\nf = 9\ndef _make():\n    return e\n"
                    "def get_inputs():\n    return [a, b, name, flag, a2, _make()]\n"
                    "def get_init_inputs():\n    return [d]\n")
    assert size_constants(str(path)) == {"a": 3, "b": 4, "d": 6, "e": 8}
    assert [next_size(v) for v in (0, 1, 2, 8, 16, 128, 1024)] == [1, 2, 3, 11, 17, 131, 1031]
    assert size_candidates(32) == [37, 33, 34, 35, 36, 38, 39, 40]


class _FoldedAtConstruction(torch.nn.Module):
    """LayerNorm then Linear, the norm's affine folded into the projection once, in the constructor."""

    def __init__(self, ref):
        super().__init__()
        norm, lin = ref[0], ref[1]
        self.eps = norm.eps
        self.register_buffer("w", (lin.weight * norm.weight).detach().clone())
        self.register_buffer("b", (lin.bias + lin.weight @ norm.bias).detach().clone())

    def forward(self, x):
        return torch.nn.functional.linear(torch.nn.functional.layer_norm(x, x.shape[-1:], eps=self.eps), self.w,
                                          self.b)


def test_a_setting_that_cannot_reach_folded_tensors_says_so():
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    h = harden_models(ref, _FoldedAtConstruction(ref), [torch.randn(4, 8)], Options())
    init = next(s for s in h.settings if s.kind == "init")
    assert init.breaks and init.note.startswith("the candidate holds no counterpart of 0.weight, 0.bias: ")
    assert "folded into another tensor at construction" in init.note
    assert all(not s.breaks for s in h.settings if s.kind != "init")
