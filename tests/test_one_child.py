"""An isolated diff with no GPU in play: one child process runs both sides first, and answers only when its diff ran
clean; anything else runs the diff again with a child per side (diffkit.processes.isolated)."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

REF = """
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, width, depth):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        x = self.norm(x)
        for layer in self.layers:
            x = torch.relu(layer(x)) + x
        return x.mean(dim=1)


def get_init_inputs():
    return [24, 3]


def get_inputs():
    return [torch.randn(5, 7, 24)]
"""

# written unlike the reference: one weight stack, an explicit einsum, its own normalisation; {bug} picks a mistake
CAND = """
import os
import torch
import torch.nn as nn
import torch.nn.functional as F

print("candidate file ran", os.environ.get("DIFFKIT_BOTH_SIDES"))
FLAG = {flag!r}
if {bug!r} == "patch":  # a model that changes torch itself: in one process the reference would run it too
    _relu = torch.relu
    torch.relu = lambda t: _relu(t) + 0.01 * t.clamp(max=0)
if {bug!r} == "float64":
    torch.set_default_dtype(torch.float64)


class ModelNew(nn.Module):
    def __init__(self, width, depth):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        mu = x.mean(-1, keepdim=True)
        var = (x - mu).pow(2).mean(-1, keepdim=True)
        h = (x - mu) * torch.rsqrt(var + self.norm.eps) * self.norm.weight + self.norm.bias
        for i, lin in enumerate(self.layers):
            if {bug!r} == "hang_once" and not os.path.exists(FLAG):
                open(FLAG, "w").close()
                import time
                time.sleep(600)
            if {bug!r} == "raise" or ({bug!r} == "raise_once" and not os.path.exists(FLAG)):
                open(FLAG, "w").close()
                raise RuntimeError("kernel launch failed: bad grid")
            z = torch.einsum("bsi,oi->bso", h, lin.weight)
            if not ({bug!r} == "no_bias" and i == 1):
                z = z + lin.bias
            h = F.relu(z) + h
        return h.sum(dim=1) / h.shape[1]
"""


def _diff(tmp_path, bug, *extra, two=False, env_extra=None, encoding="utf-8"):
    ref, cand = tmp_path / "ref.py", tmp_path / f"cand_{bug}.py"
    ref.write_text(REF)
    cand.write_text(CAND.format(bug=bug, flag=str(tmp_path / f"flag_{bug}_{two}")))
    out_json = tmp_path / f"{bug}_{two}.json"
    env = dict(os.environ, **(env_extra or {}))
    env.pop("DIFFKIT_TWO_PROCESSES", None)
    if two:
        env["DIFFKIT_TWO_PROCESSES"] = "1"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "cli.py"), "diff", str(ref), str(cand), "--no-report",
                        "--json", str(out_json), "--device", "cpu", *extra], capture_output=True, encoding=encoding,
                       cwd=str(tmp_path), env=env, timeout=600)
    return p, json.loads(out_json.read_text())


def _answer(d):
    """What a user reads off a result, without timings and where it ran."""
    stages = [(s["ref_name"], s["cand_name"], s["status"], s["max_abs"], s["mean_abs"], s["paired_by"])
              for s in d["stages"]]
    fd = d["first_divergence"]
    trials = [(t.get("trial"), t.get("seed"), t.get("allclose"), t.get("max_abs")) for t in d["trials"]]
    return (d["verdict"], fd and fd["ref_name"], d["root_cause"] and d["root_cause"].get("ref_name"), stages, trials,
            sorted(f["kind"] for f in d["findings"]), d["error"] and (d["error"]["side"], d["error"]["phase"]))


@pytest.mark.parametrize("bug", ["none", "no_bias"])
def test_a_clean_diff_runs_in_one_child_and_answers_as_a_child_per_side_does(tmp_path, bug):
    one, d1 = _diff(tmp_path, bug)
    two, d2 = _diff(tmp_path, bug, two=True)
    assert one.returncode == two.returncode == (0 if bug == "none" else 1), one.stdout + one.stderr
    assert d1["meta"]["processes"] == "one child process, both sides"
    assert d2["meta"]["processes"] == "a child process per side"
    assert _answer(d1) == _answer(d2)
    if bug == "no_bias":
        assert d1["first_divergence"]["ref_name"] == "layers.1"
    # what the child printed comes out once, its own file's output before the answer
    assert one.stdout.count("candidate file ran") == 1 and one.stdout.count("diffkit: ") == 1
    assert one.stdout.index("candidate file ran") < one.stdout.index("diffkit: ")
    assert one.stdout.splitlines()[-1] == two.stdout.splitlines()[-1]
    assert "candidate file ran None" in one.stdout  # (what the models start does not inherit the child's variables)


def test_what_the_child_printed_comes_out_as_it_was_written(tmp_path):
    """Its output is copied byte for byte, in the encoding it was printed in (not decoded and encoded again)."""
    latin = {"PYTHONIOENCODING": "latin-1:replace"}
    one, _ = _diff(tmp_path, "no_bias", env_extra=latin, encoding="latin-1")
    two, _ = _diff(tmp_path, "no_bias", two=True, env_extra=latin, encoding="latin-1")
    assert one.returncode == two.returncode == 1
    assert one.stdout == two.stdout and "5×7×24" in one.stdout


@pytest.mark.parametrize("bug", ["patch", "float64"])
def test_a_model_that_changes_torch_itself_is_diffed_a_child_per_side(tmp_path, bug):
    """A candidate that swaps a torch function or the default dtype would change the reference's forward in
    the same process: the one child's answer is not taken, and the answer is a child per side's."""
    one, d1 = _diff(tmp_path, bug)
    two, d2 = _diff(tmp_path, bug, two=True)
    assert one.returncode == two.returncode and one.returncode in (1, 2), one.stdout[-2000:]
    assert d1["meta"]["processes"] == "a child process per side"
    assert _answer(d1) == _answer(d2)


def test_a_failing_candidate_is_answered_by_a_child_per_side(tmp_path):
    one, d1 = _diff(tmp_path, "raise")
    two, d2 = _diff(tmp_path, "raise", two=True)
    assert one.returncode == two.returncode == 2
    assert d1["meta"]["processes"] == d2["meta"]["processes"] == "a child process per side"
    assert _answer(d1) == _answer(d2) and d1["error"]["message"] == d2["error"]["message"]
    assert "bad grid" in d1["error"]["message"]
    # the first child printed nothing of its own: the candidate's line comes from the diff that answered
    assert one.stdout.count("candidate file ran") == two.stdout.count("candidate file ran")
    assert one.stdout.count("diffkit: ERROR") == 1


def test_a_failure_that_does_not_repeat_is_still_the_answer(tmp_path):
    """The first child's candidate raises once; the diff with a child per side after it runs clean: the
    answer is an error naming the first failure, with every stage of the clean diff."""
    one, d = _diff(tmp_path, "raise_once")
    assert one.returncode == 2, one.stdout + one.stderr
    assert d["verdict"] == "error" and d["error"]["side"] == "candidate"
    assert "bad grid" in d["error"]["message"] and "does not repeat" in d["error"]["message"]
    assert d["meta"]["processes"] == "a child process per side"
    assert {s["status"] for s in d["stages"] if s["max_abs"] is not None} == {"ok"}
    assert any(s["ref_name"] == "output" and s["status"] == "ok" for s in d["stages"])
    assert "does not repeat" in one.stdout.splitlines()[-1] and "the output among them" in one.stdout.splitlines()[-1]


def test_a_hang_that_does_not_repeat_is_said(tmp_path):
    """The one child hangs once (its --timeout is both sides' together): the diff a child per side runs clean,
    and its answer says that the first ran out of time."""
    one, d = _diff(tmp_path, "hang_once", "--timeout", "6")
    assert one.returncode == 0, one.stdout[-2000:] + one.stderr[-2000:]
    assert d["meta"]["processes"] == "a child process per side"
    assert any("did not finish within 6 s" in w and "does not repeat" in w for w in d["warnings"]), d["warnings"]


def test_the_answer_reaches_a_stand_in_for_standard_output(tmp_path):
    """`diffkit.cli.main` called in a process whose standard output is a StringIO (a notebook's capture): the
    one child's answer reaches it."""
    ref, cand = tmp_path / "ref.py", tmp_path / "cand.py"
    ref.write_text(REF)
    cand.write_text(CAND.format(bug="no_bias", flag=str(tmp_path / "flag")))
    script = (f"import io, sys\nfrom diffkit.cli import main\nbuf, real = io.StringIO(), sys.stdout\nsys.stdout = buf\n"
              f"try:\n    main.main(args=['diff', {str(ref)!r}, {str(cand)!r}, '--no-report', '--trials', '1', "
              f"'--device', 'cpu'], standalone_mode=False)\nexcept SystemExit as e:\n    code = e.code\n"
              f"sys.stdout = real\nprint('CODE', code)\nprint(buf.getvalue())\n")
    env = dict(os.environ)
    env.pop("DIFFKIT_TWO_PROCESSES", None)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert "CODE 1" in p.stdout, p.stdout[-2000:] + p.stderr[-2000:]
    assert "diffkit: DIVERGED at stage" in p.stdout and "candidate file ran" in p.stdout


def test_a_crash_of_the_one_child_is_put_on_the_side_whose_file_it_was_in(tmp_path):
    """From the stack faulthandler printed (innermost model file), under a kernel call's breadcrumb when there is
    one; one file holding both models names neither side."""
    from diffkit.processes import what_failed

    def _what_failed(_, *rest):  # (the breadcrumb the one child left, as the isolated diff reads it)
        crumb = (tmp_path / "breadcrumb").read_text() if (tmp_path / "breadcrumb").exists() else ""
        return what_failed(None, crumb, *rest)

    stack = ('Fatal Python error: Segmentation fault\n\nCurrent thread 0x1 (most recent call first):\n'
             '  File "/lib/helper.py", line 3 in launch\n  File "/m/cand.py", line 17 in forward\n'
             '  File "/m/ref.py", line 9 in forward\n')
    got = _what_failed(str(tmp_path), -11, "was killed by SIGSEGV", stack, "/m/ref.py", "/m/cand.py", 600)
    assert (got["side"], got["stage"]) == ("candidate", "cand.py:17 in forward") and "SIGSEGV" in got["message"]
    (tmp_path / "breadcrumb").write_text("inside ext:gemm (scope blocks.0) called at /lib/helper.py:3")
    got = _what_failed(str(tmp_path), -11, "was killed by SIGSEGV", stack, "/m/ref.py", "/m/cand.py", 600)
    assert (got["side"], got["stage"]) == ("candidate", "inside ext:gemm (scope blocks.0) called at /lib/helper.py:3")
    assert _what_failed(str(tmp_path), -11, "was killed by SIGSEGV", stack, "/m/cand.py", "/m/cand.py", 600)["side"] == ""
    assert "one of the models" in _what_failed(str(tmp_path), 7, None, "", "/m/ref.py", "/m/cand.py", 600)["message"]
    assert _what_failed(str(tmp_path), 3, None, "", "/m/ref.py", "/m/cand.py", 600) is None  # diffkit's own fault
    hung = _what_failed(str(tmp_path), -9, "did not finish within 5 s and was stopped", "", "/m/ref.py", "/m/cand.py", 5)
    assert hung["warning"] and "5 s" in hung["message"]


def _as_if_on_a_gpu(tmp_path, bug, env_extra=None):
    """The isolated diff's parent as it runs with a GPU in play (`_host_only` says no), its child on this CPU."""
    ref, cand = tmp_path / "ref.py", tmp_path / f"cand_{bug}.py"
    ref.write_text(REF)
    cand.write_text(CAND.format(bug=bug, flag=str(tmp_path / f"flag_gpu_{bug}")))
    out = tmp_path / f"gpu_{bug}.json"
    script = ("import diffkit.processes as P\nP._host_only = lambda device: False\nfrom diffkit.cli import main\n"
              f"main.main(args=['diff', {str(ref)!r}, {str(cand)!r}, '--no-report', '--json', {str(out)!r}])\n")
    env = dict(os.environ, **(env_extra or {}))
    env.pop("DIFFKIT_TWO_PROCESSES", None)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=str(tmp_path), env=env,
                       timeout=600)
    return p, json.loads(out.read_text())


@pytest.mark.parametrize("bug", ["none", "no_bias"])
def test_with_a_gpu_in_play_one_child_runs_both_sides_first(tmp_path, bug):
    """Issue 46: on a CUDA build the isolated diff runs one child for both sides first too (there it streams once
    its models are on the GPU: tests/test_gpu.py; here the models run on this CPU, whole); DIFFKIT_GPU_PER_SIDE=1
    runs a child per side at once.  The answers agree, and agree with the CPU's own diff."""
    one, d1 = _as_if_on_a_gpu(tmp_path, bug)
    two, d2 = _as_if_on_a_gpu(tmp_path, bug, {"DIFFKIT_GPU_PER_SIDE": "1"})
    cpu, d3 = _diff(tmp_path, bug)
    assert one.returncode == two.returncode == cpu.returncode == (0 if bug == "none" else 1), one.stdout + one.stderr
    assert d1["meta"]["processes"] == "one child process, both sides"
    assert d2["meta"]["processes"] == "a child process per side"
    assert all(d["meta"].get("mode") != "streaming" for d in (d1, d2, d3))  # (models on a CPU: no streaming)
    assert _answer(d1) == _answer(d2) == _answer(d3)
