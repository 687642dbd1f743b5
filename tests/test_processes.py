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


# ----------------------------------------------------------------------------- no protocol in the environment
# the variables a user sets for diffkit (diffkit only reads them)
USER_KNOBS = {"DIFFKIT_NO_FORK", "DIFFKIT_TWO_PROCESSES", "DIFFKIT_NO_HANDOVER", "DIFFKIT_SANITIZER_COPY",
              "DIFFKIT_CACHE", "DIFFKIT_NATIVE"}


def _env_uses(source: str) -> tuple[set[str], set[str]]:
    """The DIFFKIT_* environment variables a module sets (os.environ[K] = …, setdefault/update/putenv, an env
    dict built with them: dict(…, K=…), {K: …}) and those it reads (os.environ.get/pop, os.getenv, os.environ[K],
    K in os.environ); K a string or a module-level name bound to one."""
    import ast

    tree = ast.parse(source)
    names = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
             and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str) for t in n.targets
             if isinstance(t, ast.Name)}

    def key(node) -> str | None:
        value = node.value if isinstance(node, ast.Constant) else names.get(node.id) if isinstance(node, ast.Name) \
            else None
        return value if isinstance(value, str) and value.startswith("DIFFKIT_") else None

    sets, reads = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and key(node.slice):
            (sets if isinstance(node.ctx, ast.Store) else reads).add(key(node.slice))
        elif isinstance(node, ast.Call):
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            sets |= {k.arg for k in node.keywords if k.arg and k.arg.startswith("DIFFKIT_")}
            first = key(node.args[0]) if node.args else None
            if first and func in ("setdefault", "putenv"):
                sets.add(first)
            elif first and func in ("get", "pop", "getenv"):
                reads.add(first)
        elif isinstance(node, ast.Dict):
            sets |= {key(k) for k in node.keys if k is not None and key(k)}
        elif isinstance(node, ast.Compare) and key(node.left) and isinstance(node.ops[0], (ast.In, ast.NotIn)):
            reads.add(key(node.left))
    return sets, reads


def test_the_check_finds_a_variable_set_for_a_child_and_read_back():
    old = ('import os\nAFTER = "DIFFKIT_AFTER"\nenv = dict(os.environ, DIFFKIT_BREADCRUMB="b")\nenv[AFTER] = "x"\n'
           'crumb = os.environ.get("DIFFKIT_BREADCRUMB", "")\nafter = os.environ.get(AFTER)\n'
           'os.environ.get("DIFFKIT_NO_FORK")\n')
    sets, reads = _env_uses(old)
    assert sets & reads == {"DIFFKIT_BREADCRUMB", "DIFFKIT_AFTER"}


def test_no_diffkit_variable_is_both_set_and_read_by_diffkit():
    """diffkit's processes talk through their connection (diffkit.processes), not the environment: no DIFFKIT_*
    variable is both set by diffkit (for a child) and read by diffkit, except the knobs users set."""
    sets, reads = {}, {}
    package = os.path.join(ROOT, "diffkit")
    for name in sorted(os.listdir(package)):
        if name.endswith(".py"):
            with open(os.path.join(package, name), encoding="utf-8") as fh:
                s, r = _env_uses(fh.read())
            for var in s:
                sets.setdefault(var, []).append(name)
            for var in r:
                reads.setdefault(var, []).append(name)
    both = {var: (sets[var], reads[var]) for var in set(sets) & set(reads) - USER_KNOBS}
    assert not both, f"DIFFKIT_* variables set and read by diffkit (set in, read in): {both}"
