"""examples/ci/github-actions.yml (issue 45): its install line installs what a package index does not hold from
a source pip can reach, and its suite step, run as written over a folder of problems, gives the exit code and
files the later steps read (summary.md for the job summary, the reports folder for the artifact)."""
import os
import re
import shutil
import subprocess
import sys

from conftest import REFS, ROOT

WORKFLOW = os.path.join(ROOT, "examples", "ci", "github-actions.yml")


def _step(text: str, name: str) -> str:
    """The `run: |` block of the step called `name`, dedented."""
    m = re.search(rf"- name: {re.escape(name)}\n(?:.*\n)*?\s+run: \|\n((?:\s{{10}}.*\n|\n)+)", text)
    assert m, f"no step {name!r} with a run block in {WORKFLOW}"
    return "\n".join(line[10:] for line in m.group(1).splitlines())


def test_install_line_names_a_source_pip_can_reach():
    text = open(WORKFLOW, encoding="utf-8").read()
    install = _step(text, "Install diffkit")
    lines = [ln for ln in install.splitlines() if ln.strip().startswith("pip install") and "torch" not in ln]
    assert lines, install
    for ln in lines:
        target = ln.split("pip install", 1)[1].strip().strip('"')
        # a bare `diffkit` (or `diffkit==…`) asks a package index, which holds no such package
        assert not re.fullmatch(r"diffkit(\[.*\])?([<>=!~].*)?", target), ln
        assert "git+" in target or target.startswith((".", "/")), ln
    source = re.search(r"DIFFKIT_SOURCE: (\S+)", text)
    assert source and source.group(1).startswith("https://"), "the workflow says where DIFFKIT_SOURCE points"


def test_the_suite_step_runs_as_written(tmp_path):
    text = open(WORKFLOW, encoding="utf-8").read()
    suite = _step(text, "diffkit suite")
    problems = tmp_path / "kernels-dir"
    gelu = open(os.path.join(REFS, "gelu.py"), encoding="utf-8").read()
    for name, cand in (("ok", gelu), ("tanh", gelu.replace("F.gelu(x)", "F.gelu(x, approximate='tanh')"))):
        d = problems / name
        d.mkdir(parents=True)
        shutil.copy(os.path.join(REFS, "gelu.py"), d / "ref.py")
        (d / "cand.py").write_text(cand.replace("class Model(", "class ModelNew("))
    bindir = tmp_path / "bin"
    bindir.mkdir()
    shim = bindir / "diffkit"  # the console script pip would install
    shim.write_text(f"#!/bin/sh\nexec {sys.executable} {os.path.join(ROOT, 'cli.py')} \"$@\"\n")
    shim.chmod(0o755)
    out = tmp_path / "github_output"
    env = dict(os.environ, PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}", GITHUB_OUTPUT=str(out))
    proc = subprocess.run(["bash", "-c", suite], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]  # (set +e: the step itself passes)
    assert out.read_text().strip() == "code=1", proc.stdout[-2000:] + proc.stderr[-2000:]  # one pair diverged
    reports = tmp_path / "reports" / "suite"
    assert (reports / "summary.md").exists() and (reports / "index.html").exists()
    assert "tanh" in (reports / "summary.md").read_text()
