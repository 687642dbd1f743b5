"""A battery of broken and hostile candidate files (issue 45): each ends with exit 2 and a sentence that says what
and where (or with the right verdict), never a traceback or diffkit's own exit 3, and never a hang."""
import json
import os

import pytest

from conftest import REFS, ROOT, run_cli

GELU = open(os.path.join(REFS, "gelu.py"), encoding="utf-8").read()
HEAD = "import torch, torch.nn as nn\n"


def _model(body: str, init: str = "") -> str:
    return HEAD + "class ModelNew(nn.Module):\n    def __init__(self):\n        super().__init__()\n" + \
        (init or "        pass\n") + "    def forward(self, x):\n" + body


CANDIDATES = {
    # the file itself
    "empty file": ("", "defines no `ModelNew`"),
    "only comments": ("# nothing here\n", "defines no `ModelNew`"),
    "binary bytes": (b"\x00\x01\xff\xfe" * 64, "cannot read"),
    "bad utf-8": (b"x = '\xff\xfe'\n", "cannot read"),
    "syntax error": ("class ModelNew(:\n", "syntax error"),
    "tab/space mix": ("class ModelNew:\n\tdef f(self):\n        pass\n", "syntax error"),
    "raises at import": ("raise RuntimeError('no GPU here')\n", "no GPU here"),
    "sys.exit at import": ("import sys\nsys.exit(0)\n", "exit"),
    "ModelNew is not a class": ("ModelNew = 3\n", "`ModelNew` in"),
    "ModelNew not a Module": ("class ModelNew:\n    def __init__(self):\n        pass\n", "not an nn.Module"),
    "no super().__init__()": (HEAD + "class ModelNew(nn.Module):\n    def __init__(self):\n        self.k = 2\n"
                              "    def forward(self, x):\n        return x\n", "super().__init__()"),
    "wrong constructor arity": (HEAD + "class ModelNew(nn.Module):\n    def __init__(self, a, b, c):\n"
                                "        super().__init__()\n    def forward(self, x):\n        return x\n", "init"),
    "constructor raises": (_model("        return x\n", "        raise ValueError('bad config')\n"), "bad config"),
    # the forward
    "forward raises": (_model("        raise RuntimeError('kernel launch failed')\n"), "kernel launch failed"),
    "forward returns None": (_model("        torch.nn.functional.gelu(x)\n"), "returned None"),
    "forward returns a string": (_model("        return 'done'\n"), "not a tensor"),
    "forward returns sparse": (_model("        return torch.nn.functional.gelu(x).to_sparse()\n"), "layout"),
    "forward returns int tensor": (_model("        return torch.nn.functional.gelu(x).long()\n"), None),
    "forward returns wrong shape": (_model("        return torch.nn.functional.gelu(x)[:, :3]\n"), None),
    "forward returns a tuple": (_model("        return (torch.nn.functional.gelu(x),)\n"), None),
    "forward takes no input": (HEAD + "class ModelNew(nn.Module):\n    def forward(self):\n"
                               "        return torch.zeros(4, 256)\n", "forward"),
    "forward sys.exit": (_model("        import sys\n        sys.exit(0)\n"), "SystemExit"),
    "forward os._exit": (_model("        import os\n        os._exit(0)\n"), "exit"),
    "forward NaN": (_model("        return torch.nn.functional.gelu(x) * float('nan')\n"), None),
    "forward inf": (_model("        return torch.nn.functional.gelu(x) + float('inf')\n"), None),
    "forward empty tensor": (_model("        return torch.empty(0)\n"), None),
    "forward recursion": (_model("        return self.forward(x)\n"), "RecursionError"),
}


def _write(path, content):
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)


@pytest.mark.parametrize("name", list(CANDIDATES))
def test_a_broken_candidate_gets_a_sentence(tmp_path, name):
    content, words = CANDIDATES[name]
    ref = tmp_path / "ref.py"
    ref.write_text(GELU)
    cand = tmp_path / "cand.py"
    _write(cand, content)
    proc = run_cli("diff", ref, cand, "--no-report", "--trials", "1", "--timeout", "120", cwd=tmp_path, timeout=300)
    text = proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "INTERNAL ERROR" not in text, text[-3000:]
    assert proc.returncode in (1, 2), (proc.returncode, text[-2000:])
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert last.startswith("diffkit: "), text[-2000:]
    if words is not None:
        assert proc.returncode == 2 and words in last, last


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "folder", "dangling link"])
def test_a_path_that_is_no_source_file_is_refused_at_once(tmp_path, kind):
    ref = tmp_path / "ref.py"
    ref.write_text(GELU)
    cand = tmp_path / "cand.py"
    if kind == "fifo":
        os.mkfifo(cand)
    elif kind == "dev_zero":
        cand = "/dev/zero"
    elif kind == "folder":
        cand.mkdir()
    else:
        os.symlink(tmp_path / "gone.py", cand)
    proc = run_cli("diff", ref, cand, "--no-report", cwd=tmp_path, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    assert "not a regular file" in proc.stdout or "file not found" in proc.stdout, proc.stdout


@pytest.mark.parametrize("how", ["sys.exit(0)", "os._exit(0)", "sys.exit()"])
@pytest.mark.parametrize("where", ["import", "forward"])
@pytest.mark.parametrize("command", ["diff --no-isolate", "diff", "capture"])
def test_a_model_that_ends_the_process_never_reads_as_success(tmp_path, how, where, command):
    """sys.exit / os._exit in a candidate's file or forward, run in diffkit's own process (--no-isolate, `diffkit
    capture`) or in a child: exit 2 and a sentence, never 0 (a match, a saved capture)."""
    ref = tmp_path / "ref.py"
    ref.write_text(GELU)
    cand = tmp_path / "cand.py"
    stmt = f"import os, sys\n{how}\n" if where == "import" else ""
    body = f"        import os, sys\n        {how}\n" if where == "forward" else "        return x\n"
    cand.write_text(stmt + _model(body))
    if command == "capture":
        args = ["capture", cand, "--side", "cand", "--inputs-from", ref, "-o", tmp_path / "c.dkt"]
    else:
        args = ["diff", ref, cand, "--no-report", "--trials", "1", *command.split()[1:]]
    proc = run_cli(*args, cwd=tmp_path, timeout=300)
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-1500:], proc.stderr[-1500:])
    # (a capture that stopped mid-forward prints what it captured and what the forward raised)
    said = "diffkit: ERROR" in proc.stdout or (command == "capture" and "raised SystemExit" in proc.stdout)
    assert "Traceback" not in proc.stderr and said, proc.stdout[-1500:]


def test_a_thread_the_model_leaves_running_does_not_keep_no_isolate_from_exiting(tmp_path):
    """A forward that starts a thread (not a daemon) and leaves it running: in diffkit's own process the answer is
    written and the process ends with the diff's code (said on stderr), instead of waiting for the thread forever."""
    ref = tmp_path / "ref.py"
    ref.write_text(GELU)
    cand = tmp_path / "cand.py"
    cand.write_text("import threading\nimport time\n" + _model(
        "        threading.Thread(target=time.sleep, args=(3600,), name='prefetcher').start()\n"
        "        return torch.nn.functional.gelu(x)\n"))
    proc = run_cli("diff", ref, cand, "--no-report", "--trials", "1", "--no-isolate", cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, (proc.stdout[-1500:], proc.stderr[-1500:])
    assert "diffkit: MATCH" in proc.stdout
    assert "left 2 thread(s) running ('prefetcher'" in proc.stderr  # (the forward runs twice: the rerun check)


def test_a_tap_name_utf8_cannot_hold_is_kept_as_its_escape(tmp_path):
    """diffkit.tap with a lone surrogate in its name: the diff answers and writes every file, the name kept as its
    escape (\\ud800), no internal error."""
    ref = tmp_path / "ref.py"
    ref.write_text(GELU)
    cand = tmp_path / "cand.py"
    cand.write_text("import diffkit\n" + _model(
        "        y = torch.nn.functional.gelu(x)\n        diffkit.tap('bad\\ud800name', y)\n        return y * 1.5\n"))
    out = tmp_path / "rep"
    proc = run_cli("diff", ref, cand, "--trials", "1", "--report-dir", out, "--json", tmp_path / "r.json",
                   cwd=tmp_path, timeout=120)
    assert proc.returncode == 1, (proc.stdout[-1500:], proc.stderr[-1500:])
    assert "tap:bad\\ud800name" in proc.stdout and "INTERNAL" not in proc.stderr
    for name in ("index.html", "stages.csv"):
        assert "bad\\ud800name" in (out / name).read_text(encoding="utf-8"), name
    for name in ("summary.md", "junit.xml"):  # (written, and readable as UTF-8)
        (out / name).read_text(encoding="utf-8")
    stages = json.loads((out / "result.json").read_text(encoding="utf-8"))["stages"]
    assert any(s.get("cand_name") == "tap:bad\\ud800name" for s in stages)


def _gelu_pair(tmp_path, forward_head: str = ""):
    ref = tmp_path / "ref.py"
    ref.write_text(GELU)
    cand = tmp_path / "cand.py"
    cand.write_text("import os\n" + _model(forward_head + "        return torch.nn.functional.gelu(x)\n"))
    return ref, cand


@pytest.mark.parametrize("closed", [">&-", ">&- 2>&-"])
def test_a_caller_with_standard_output_closed_still_gets_its_files_and_exit_code(tmp_path, closed):
    import subprocess
    import sys

    ref, cand = _gelu_pair(tmp_path)
    out = tmp_path / "r.json"
    cmd = f"{sys.executable} {os.path.join(ROOT, 'cli.py')} diff {ref} {cand} --no-report --trials 1 --json {out}"
    proc = subprocess.run(["bash", "-c", f"{cmd} {closed}"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and json.loads(out.read_text())["verdict"] == "match", proc.stderr[-1500:]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("isolate", [[], ["--no-isolate"]])
def test_a_model_that_closes_standard_output_is_still_answered(tmp_path, isolate):
    """The candidate's forward closes file descriptor 1: the answer cannot be printed, but the diff ends with its own
    exit code, writes its files and says why nothing was printed; no internal error."""
    ref, cand = _gelu_pair(tmp_path, "        try:\n            os.close(1)\n        except OSError:\n            pass\n")
    out = tmp_path / "r.json"
    proc = run_cli("diff", ref, cand, "--no-report", "--trials", "1", "--json", out, *isolate, cwd=tmp_path,
                   timeout=120)
    assert proc.returncode == 0, (proc.stdout[-1500:], proc.stderr[-1500:])
    assert json.loads(out.read_text())["verdict"] == "match"
    assert "standard output was closed" in proc.stderr and "INTERNAL" not in proc.stderr


@pytest.mark.parametrize("isolate", [[], ["--no-isolate"]])
def test_a_reference_that_changes_folder_at_import_does_not_lose_the_candidate(tmp_path, isolate):
    """Relative paths on the command line name the files the user meant, even when the reference's file changes
    the current folder as it is run (KernelBench reads both sources before running either)."""
    (tmp_path / "ref.py").write_text("import os\nos.chdir('/')\n" + GELU)
    (tmp_path / "cand.py").write_text(_model("        return torch.nn.functional.gelu(x)\n"))
    proc = run_cli("diff", "ref.py", "cand.py", "--no-report", "--trials", "1", *isolate, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0 and "diffkit: MATCH" in proc.stdout, (proc.stdout[-1500:], proc.stderr[-1500:])


TUPLE_REF = '''import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        return torch.tanh(x), {LEAF}


def get_inputs():
    return [torch.randn(4, 8)]


def get_init_inputs():
    return []
'''
TUPLE_CAND = '''import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, inp):
        return torch.tanh(inp), {LEAF}
'''


@pytest.mark.parametrize("ref_leaf,cand_leaf,verdict", [("3", "4", "diverged"), ("3", "3", "match"),
                                                        ("'mean'", "'sum'", "diverged"), ("0.1 + 0.2", "0.3", "match"),
                                                        ("None", "0", "diverged")])
@pytest.mark.parametrize("how", [[], ["--no-isolate"], ["TWO"]])
def test_an_outputs_leaves_that_are_not_tensors_are_compared_too(tmp_path, ref_leaf, cand_leaf, verdict, how):
    """`return y, 3` against `return y, 4` is no match (it read as one before); floats within tolerance are."""
    (tmp_path / "ref.py").write_text(TUPLE_REF.replace("{LEAF}", ref_leaf))
    (tmp_path / "cand.py").write_text(TUPLE_CAND.replace("{LEAF}", cand_leaf))
    env = {"DIFFKIT_TWO_PROCESSES": "1"} if how == ["TWO"] else None
    flags = [] if how == ["TWO"] else how
    out = tmp_path / "r.json"
    proc = run_cli("diff", "ref.py", "cand.py", "--no-report", "--trials", "1", "--json", out, *flags, cwd=tmp_path,
                   env=env, timeout=120)
    got = json.loads(out.read_text())
    assert got["verdict"] == verdict, (proc.stdout[-1500:], proc.stderr[-800:])
    if verdict == "diverged":
        assert "at output[1]" in proc.stdout
