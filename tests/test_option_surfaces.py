"""Every option honoured on every surface (issue 45): the same option, given to `diffkit.diff_files`, to the
pytest fixture, to `diffkit diff` (isolated and --no-isolate) and to `diffkit suite`, changes the answer the same
way.  Each option has a pair whose answer shows it (a verdict it changes, or what the result's meta records).
`diffkit.compare` (models, not files) is walked through the options that apply to a pair of models."""
import json
import os

import pytest
import torch
import torch.nn as nn

import diffkit
from conftest import run_cli
from diffkit.pytest_plugin import DiffkitFixture

REF = '''import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        return torch.tanh(self.lin(x))


def get_inputs():
    return [torch.randn(4, 16)]


def get_init_inputs():
    return []
'''
CAND = {
    "same": '''import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, inp):
        return torch.tanh(self.lin(inp))
''',
    # off by one part in a thousand: beyond KernelBench's 1e-4, within 1e-2
    "scaled": '''import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, inp):
        return torch.tanh(self.lin(inp)) * 1.001
''',
    # an extra parameter made first: the seeded draws give the linear layer other values
    "other_init": '''import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.unused = nn.Parameter(torch.randn(5))
        self.lin = nn.Linear(16, 16)

    def forward(self, inp):
        return torch.tanh(self.lin(inp))
''',
}
# option: (the candidate, Python keywords, command-line flags, what the answer shows)
OPTIONS = {
    "trials": ("same", dict(trials=2), ["--trials", "2"], lambda d: d["meta"]["trials"]["run"] == 2),
    "seed": ("same", dict(seed=7), ["--seed", "7"], lambda d: d["meta"]["seed"] == 7),
    "tolerance": ("scaled", dict(atol=1e-2, rtol=1e-2), ["--atol", "1e-2", "--rtol", "1e-2"],
                  lambda d: d["verdict"] == "match" and d["atol"] == 1e-2),
    "sync_weights": ("other_init", dict(sync_weights=True), ["--sync-weights"],
                     lambda d: d["verdict"] == "match" and d["meta"]["protocol"]["sync_weights"] is True),
    "stat": ("same", dict(stat="max"), ["--stat", "max"], lambda d: d["meta"]["stat"] == "max"),
    "eval": ("same", dict(eval=True), ["--eval"], lambda d: d["meta"]["protocol"]["eval"] is True),
    "streaming": ("same", dict(max_memory=1 << 20), ["--max-memory", "1M"],
                  lambda d: d["meta"].get("mode") == "streaming"),
}
# without the option, the answer does not show it (each check can fail)
WITHOUT = {"tolerance": lambda d: d["verdict"] == "diverged", "sync_weights": lambda d: d["verdict"] == "diverged"}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("pairs")
    (root / "ref.py").write_text(REF)
    for name, text in CAND.items():
        (root / f"cand_{name}.py").write_text(text)
    return root


def _json(result) -> dict:
    return json.loads(result.to_json())


def _diff_files(files, cand, kwargs):
    return _json(diffkit.diff_files(str(files / "ref.py"), str(files / f"cand_{cand}.py"), **kwargs))


def _fixture(files, cand, kwargs, tmp_path):
    fixture = DiffkitFixture("test_option_surfaces", str(tmp_path / "reports"), lambda *a: None)
    return _json(fixture.compare(str(files / "ref.py"), str(files / f"cand_{cand}.py"), report=False, **kwargs))


def _cli(files, cand, flags, tmp_path, isolate=True):
    out = tmp_path / "r.json"
    proc = run_cli("diff", files / "ref.py", files / f"cand_{cand}.py", "--no-report", "--json", out, *flags,
                   *([] if isolate else ["--no-isolate"]), cwd=tmp_path, timeout=300)
    assert proc.returncode in (0, 1), (proc.stdout[-1500:], proc.stderr[-1500:])
    return json.loads(out.read_text())


def _suite(files, cand, flags, tmp_path):
    pair = tmp_path / "problems" / "p"
    pair.mkdir(parents=True)
    (pair / "ref.py").write_text(REF)
    (pair / "cand.py").write_text(CAND[cand])
    out = tmp_path / "suite"
    proc = run_cli("suite", tmp_path / "problems", "--report-dir", out, *flags, cwd=tmp_path, timeout=300)
    assert proc.returncode in (0, 1), (proc.stdout[-1500:], proc.stderr[-1500:])
    return json.loads((out / "p" / "result.json").read_text())


SURFACES = ["diff_files", "fixture", "cli", "cli --no-isolate", "suite"]


def _answer(surface, files, cand, kwargs, flags, tmp_path):
    if surface == "diff_files":
        return _diff_files(files, cand, kwargs)
    if surface == "fixture":
        return _fixture(files, cand, kwargs, tmp_path)
    if surface == "suite":
        return _suite(files, cand, flags, tmp_path)
    return _cli(files, cand, flags, tmp_path, isolate=surface == "cli")


@pytest.mark.parametrize("surface", SURFACES)
@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_each_option_through_each_surface(files, tmp_path, option, surface):
    cand, kwargs, flags, shows = OPTIONS[option]
    got = _answer(surface, files, cand, kwargs, flags, tmp_path)
    assert shows(got), (option, surface, got["verdict"], got["meta"])


@pytest.mark.parametrize("option", sorted(WITHOUT))
def test_without_the_option_the_answer_differs(files, tmp_path, option):
    cand = OPTIONS[option][0]
    got = _answer("diff_files", files, cand, {}, [], tmp_path)
    assert WITHOUT[option](got) and not OPTIONS[option][3](got)


class _Ref(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class _Scaled(_Ref):
    def forward(self, x):
        return torch.tanh(self.lin(x)) * 1.001


@pytest.mark.parametrize("option", ["tolerance", "sync_weights", "stat", "streaming", "eval"])
def test_compare_on_models_honours_the_options_that_apply_to_models(option):
    torch.manual_seed(0)
    ref = _Ref()
    cand = _Scaled() if option == "tolerance" else _Ref()  # (another draw: other weights unless synced)
    if option not in ("sync_weights",):
        cand.load_state_dict(ref.state_dict())
    kwargs = OPTIONS[option][1]
    got = _json(diffkit.compare(ref, cand, [torch.randn(4, 16)], **kwargs))
    if option in ("sync_weights", "tolerance"):
        assert got["verdict"] == "match", got["verdict"]
    elif option == "stat":
        assert got["meta"]["stat"] == "max"
    elif option == "streaming":
        assert got["meta"].get("mode") == "streaming"
    else:
        assert got["meta"]["protocol"]["eval"] is True
        assert ref.training and cand.training  # (the caller's models are given back in the mode they came in)


class _Dropped(_Ref):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(torch.tanh(self.lin(x)))


def test_compare_with_eval_turns_dropout_off_for_the_diff():
    torch.manual_seed(0)
    ref, cand = _Dropped(), _Dropped()
    cand.load_state_dict(ref.state_dict())
    x = [torch.randn(64, 16)]
    assert diffkit.compare(ref, cand, x, health=False, rerun=False).verdict == "diverged"  # live dropout differs
    assert diffkit.compare(ref, cand, x, eval=True).verdict == "match"
    assert ref.training and cand.training
