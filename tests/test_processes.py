"""diffkit's child processes (diffkit.processes): they run this diffkit whatever the current folder holds."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

REF = """import torch
from torch import nn


class Model(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.lin = nn.Linear(n, n)

    def forward(self, x):
        return torch.tanh(self.lin(x))


def get_init_inputs():
    return [8]


def get_inputs():
    return [torch.randn(3, 8)]
"""

CAND = """import torch
from torch import nn


class ModelNew(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.lin = nn.Linear(n, n)

    def forward(self, x):
        return torch.tanh(x @ self.lin.weight.t() + self.lin.bias)
"""

STUB = "raise ImportError('the folder named diffkit in the current directory was imported')\n"

# the `diffkit` console script as installed (`from diffkit.cli import main`), with this checkout's package: the
# script's own folder, not the current one, is first on its sys.path
CONSOLE = f"import sys; sys.path[0] = {ROOT!r}; from diffkit.cli import main; sys.exit(main())"


@pytest.fixture
def folder(tmp_path):
    """A folder holding a pair (pair/ref.py, pair/cand.py) and a folder named diffkit whose modules raise."""
    (tmp_path / "diffkit").mkdir()
    for name in ("__init__.py", "cli.py", "processes.py"):
        (tmp_path / "diffkit" / name).write_text(STUB)
    (tmp_path / "pair").mkdir()
    (tmp_path / "pair" / "ref.py").write_text(REF)
    (tmp_path / "pair" / "cand.py").write_text(CAND)
    return tmp_path


def _diffkit(folder, *args, **env):
    full = dict(os.environ, **env)
    for k in list(full):
        if k.startswith("DIFFKIT_") and k not in env:
            full.pop(k)
    return subprocess.run([sys.executable, "-c", CONSOLE, *args], cwd=str(folder), capture_output=True, text=True,
                          env=full, timeout=600)


@pytest.mark.parametrize("fork", [True, False], ids=["default", "no-fork"])
def test_diff_from_a_folder_holding_a_diffkit_folder(folder, fork):
    out = _diffkit(folder, "diff", "pair/ref.py", "pair/cand.py", "--trials", "1", "--no-report",
                   **({} if fork else {"DIFFKIT_NO_FORK": "1"}))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "diffkit: MATCH" in out.stdout and "the folder named diffkit" not in out.stdout + out.stderr


def test_suite_from_a_folder_holding_a_diffkit_folder(folder):
    out = _diffkit(folder, "suite", "pair", "--report-dir", "reports", "--trials", "1")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "1 match, 0 diverged, 0 error" in out.stdout, out.stdout
    log = (folder / "reports" / "pair" / "diff.log").read_text() if (folder / "reports" / "pair" / "diff.log").exists() \
        else ""
    assert "the folder named diffkit" not in log
