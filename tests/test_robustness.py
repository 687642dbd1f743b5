"""diffkit never crashes on the bugs it exists to find: generated output pairs of every kind go
through the CLI (both isolation modes) and the exit code is what ``torch.allclose(equal_nan=False)``
on every leaf says; flags are validated; signals leave nothing behind; sources are read as Python
reads them."""
import json
import glob
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import diffkit

from conftest import ROOT, run_cli

REF = """
import torch, torch.nn as nn
OUT = torch.load({path!r}, weights_only=True)
class Model(nn.Module):
    def forward(self, x):
        return OUT
def get_inputs():
    return [torch.zeros(1)]
def get_init_inputs():
    return []
"""
CAND = REF.replace("class Model(", "class ModelNew(")

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.int32, torch.bool]
SHAPES = [(), (0,), (3,), (2, 3), (0, 4), (2, 1, 3)]


def _leaf(draw, dtype, shape):
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 31 - 1)))
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype == torch.int32:
        return torch.randint(-50, 50, shape, generator=g, dtype=torch.int32)
    t = torch.randn(shape, generator=g, dtype=torch.float64)
    if dtype.is_complex:
        t = torch.complex(t, torch.randn(shape, generator=g, dtype=torch.float64))
    t = t.to(dtype)
    if t.numel() and draw(st.booleans()):  # NaN / Inf at a random place
        flat = t.reshape(-1)
        flat[draw(st.integers(0, flat.numel() - 1))] = draw(st.sampled_from([float("nan"), float("inf"), -float("inf")]))
    return t


def _perturb(draw, ref):
    kind = draw(st.sampled_from(["same", "noise", "off", "nan", "shape"]))
    c = ref.clone()
    if kind == "shape":
        return torch.cat([c.reshape(-1), c.reshape(-1)[:1]]) if c.numel() else torch.zeros(1, dtype=c.dtype)
    if c.numel() == 0 or kind == "same":
        return c
    if c.dtype == torch.bool:
        flat = c.reshape(-1)
        flat[0] = ~flat[0]
        return c
    if c.dtype == torch.int32:
        return c + (kind != "noise")
    flat = c.reshape(-1)
    i = draw(st.integers(0, flat.numel() - 1))
    if kind == "noise":  # well inside the dtype's tolerance
        flat[i] = flat[i] * (1 + 1e-6) if c.dtype in (torch.float32, torch.float64, torch.complex64) else flat[i]
    elif kind == "off":
        flat[i] = flat[i] + 1.5
    else:
        flat[i] = float("nan")
    return c


@st.composite
def output_pairs(draw):
    n = draw(st.integers(1, 3))
    dtypes = [draw(st.sampled_from(DTYPES)) for _ in range(n)]
    refs = [_leaf(draw, d, draw(st.sampled_from(SHAPES))) for d in dtypes]
    cands = [_perturb(draw, r) for r in refs]
    nest = draw(st.sampled_from(["plain", "tuple", "dict", "nested"]))
    if nest == "plain" or n == 1 and nest != "nested":
        pack = (lambda xs: xs[0]) if n == 1 else tuple
    elif nest == "tuple":
        pack = tuple
    elif nest == "dict":
        pack = lambda xs: {f"k{i}": x for i, x in enumerate(xs)}  # noqa: E731
    else:
        pack = lambda xs: (xs[0], {"rest": list(xs[1:])})  # noqa: E731
    ref, cand = pack(refs), pack(cands)
    if draw(st.integers(0, 9)) == 0:  # now and then another structure altogether
        cand = (cand, cands[0])
    return ref, cand


def _leaves(obj, path=""):
    if isinstance(obj, torch.Tensor):
        return {path: obj}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj)
    out = {}
    for k, v in items:
        out.update(_leaves(v, f"{path}[{k}]"))
    return out


def _kernelbench_passes(ref, cand) -> bool:
    """torch.allclose(equal_nan=False) on every leaf, with KernelBench's per-dtype tolerance."""
    r, c = _leaves(ref), _leaves(cand)
    if set(r) != set(c):
        return False
    for k in r:
        a, b = c[k], r[k]
        if a.shape != b.shape:
            return False
        if b.dtype == torch.bool or not (b.is_floating_point() or b.is_complex()):
            if not torch.equal(a, b):
                return False
            continue
        tol = 1e-2 if b.dtype in (torch.float16, torch.bfloat16) else 1e-4
        if not torch.allclose(a.to(torch.complex128 if b.is_complex() else torch.float64),
                              b.to(torch.complex128 if b.is_complex() else torch.float64), atol=tol, rtol=tol,
                              equal_nan=False):
            return False
    return True


def _strict_json(text: str):
    def no_constant(name):
        raise ValueError(f"non-standard JSON constant {name}")
    return json.loads(text, parse_constant=no_constant)


def _run(ref_out, cand_out, isolate: bool):
    with tempfile.TemporaryDirectory() as d:
        for side, out, tmpl in (("ref", ref_out, REF), ("cand", cand_out, CAND)):
            torch.save(out, os.path.join(d, f"{side}.pt"))
            with open(os.path.join(d, f"{side}.py"), "w") as fh:
                fh.write(tmpl.format(path=os.path.join(d, f"{side}.pt")))
        args = [sys.executable, os.path.join(ROOT, "cli.py"), "diff", os.path.join(d, "ref.py"),
                os.path.join(d, "cand.py"), "--json", os.path.join(d, "r.json"), "--report-dir", os.path.join(d, "rep")]
        proc = subprocess.run(args + ([] if isolate else ["--no-isolate"]), capture_output=True, text=True, cwd=d)
        data = _strict_json(open(os.path.join(d, "r.json")).read()) if os.path.exists(os.path.join(d, "r.json")) else None
        for name in ("result.json",):
            _strict_json(open(os.path.join(d, "rep", name)).read())
        return proc, data


@pytest.mark.slow
@pytest.mark.parametrize("isolate", [False, True], ids=["in-process", "isolated"])
@settings(max_examples=10, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(pair=output_pairs())
def test_generated_outputs_give_kernelbench_exit_codes(isolate, pair):
    ref, cand = pair
    proc, data = _run(ref, cand, isolate)
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out, out[-3000:]
    expected = 0 if _kernelbench_passes(ref, cand) else 1
    assert proc.returncode == expected, (expected, out[-3000:])
    assert data is not None and data["verdict"] == {0: "match", 1: "diverged"}[expected]


def _empty(dtype=torch.float16):
    return torch.tensor([], dtype=dtype)


@pytest.mark.parametrize("isolate", [False, True], ids=["in-process", "isolated"])
@pytest.mark.parametrize("ref,cand", [
    # pair by their place in the structure even when no element count agrees: a shape mismatch
    ((_empty(), _empty()), (torch.zeros(1, dtype=torch.float16), torch.zeros(1, dtype=torch.float16))),
    # empty complex tensors nested one level deeper on one side: a structure mismatch
    ((_empty(), _empty(), _empty(torch.complex64)), ((_empty(), _empty(), _empty(torch.complex64)), _empty())),
], ids=["shapes", "structure"])
def test_structured_outputs_that_differ_are_a_divergence(isolate, ref, cand):
    """Found by the generated-outputs test: neither a missing output nor an internal error."""
    proc, data = _run(ref, cand, isolate)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert data["verdict"] == "diverged" and data["error"] is None


@pytest.fixture()
def files(tmp_path):
    ref = tmp_path / "ref.py"
    ref.write_text("import torch, torch.nn as nn\nclass Model(nn.Module):\n    def forward(self, x):\n"
                   "        return x * 2\ndef get_inputs():\n    return [torch.ones(3)]\n")
    return tmp_path, ref


@pytest.mark.parametrize("flag", [["--atol", "nan"], ["--atol", "-1"], ["--rtol", "inf"], ["--max-memory", "inf"],
                                  ["--max-memory", "-3G"], ["--timeout", "-1"], ["--max-memory", "lots"]])
def test_bad_flags_are_usage_errors(files, flag):
    tmp, ref = files
    proc = run_cli("diff", str(ref), str(ref), "--no-report", *flag)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "Error" in proc.stderr, proc.stderr[-800:]


def test_unwritable_json_is_a_clear_error(files):
    tmp, ref = files
    cand = tmp / "cand.py"
    cand.write_text(ref.read_text().replace("class Model(", "class ModelNew("))
    proc = run_cli("diff", str(ref), str(cand), "--no-report", "--no-isolate", "--json", "/proc/no/such/dir/r.json")
    assert proc.returncode == 2 and "Traceback" not in proc.stdout + proc.stderr
    assert "could not write" in proc.stderr


def test_sys_exit_in_forward_is_an_error_of_that_side(files):
    tmp, ref = files
    cand = tmp / "cand.py"
    cand.write_text("import sys, torch, torch.nn as nn\nclass ModelNew(nn.Module):\n    def forward(self, x):\n"
                    "        sys.exit(0)\n")
    proc = run_cli("diff", str(ref), str(cand), "--no-report", "--no-isolate")
    assert proc.returncode == 2 and "SystemExit" in proc.stdout, proc.stdout[-800:]


def test_source_with_a_pep263_coding_line_is_read(files):
    tmp, ref = files
    cand = tmp / "cand.py"
    cand.write_bytes("# -*- coding: latin-1 -*-\n# café\nimport torch, torch.nn as nn\n"
                     "class ModelNew(nn.Module):\n    def forward(self, x):\n        return x * 2\n".encode("latin-1"))
    proc = run_cli("diff", str(ref), str(cand), "--no-report", "--no-isolate")
    assert proc.returncode == 0, proc.stdout[-800:] + proc.stderr[-800:]


@pytest.mark.parametrize("planted", ["diffkit.pipeline.judge", "diffkit.result.Result.to_json"])
def test_internal_error_exits_3_and_says_it_is_diffkits_fault(files, planted):
    tmp, ref = files
    cand = tmp / "cand.py"
    cand.write_text(ref.read_text().replace("class Model(", "class ModelNew("))
    # a bug planted in diffkit itself (not in the user's files): the verdict, or writing the answer once the
    # diff is done (in an isolated diff's candidate process that once read as the candidate crashing)
    owner, name = planted.rsplit(".", 1)
    sitecustom = tmp / "plant"
    sitecustom.mkdir()
    (sitecustom / "sitecustomize.py").write_text(
        "import importlib\n"
        f"mod, cls, _ = {owner!r}.partition('.Result')\n"
        "target = importlib.import_module(mod)\n"
        "target = getattr(target, 'Result') if cls else target\n"
        "def boom(*a, **k):\n    raise ZeroDivisionError('planted')\n"
        f"setattr(target, {name!r}, boom)\n")
    env = dict(os.environ, PYTHONPATH=str(sitecustom) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for mode in (["--no-isolate"], []):
        proc = run_cli("diff", str(ref), str(cand), "--no-report", "--json", str(tmp / "r.json"), *mode, env=env)
        assert proc.returncode == 3, (mode, proc.stdout[-800:], proc.stderr[-800:])
        assert "bug in diffkit" in proc.stderr and "ERROR in candidate" not in proc.stdout, proc.stdout[-800:]


@pytest.mark.parametrize("flags", [("--json", "a.json", "--csv", "a.json"), ("--junit", "x", "--markdown", "./x"),
                                   ("--json", "r/out", "--html", "r/../r/out")])
def test_two_files_asked_at_one_path_is_a_usage_error(files, flags):
    """The second would overwrite the first without a word: refused before anything runs, nothing written."""
    tmp, ref = files
    proc = run_cli("diff", str(ref), str(ref), "--no-report", *flags, cwd=tmp)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    assert "both name" in proc.stderr and flags[0] in proc.stderr and flags[2] in proc.stderr, proc.stderr
    assert not (tmp / flags[1]).exists()


@pytest.mark.parametrize("which", ["reference", "candidate"])
def test_a_path_that_is_not_there_makes_no_report_folder(files, which):
    """A typo: exit 2 with the sentence, --json still written (the answer), but no reports/<name>/ for a diff
    that never ran."""
    tmp, ref = files
    args = ["typo_ref.py", str(ref)] if which == "reference" else [str(ref), "typo_cand.py"]
    proc = run_cli("diff", *args, "--json", "r.json", cwd=tmp)
    assert proc.returncode == 2 and f"{which} read failed" in proc.stdout and "file not found" in proc.stdout
    assert json.loads((tmp / "r.json").read_text())["error"]["side"] == which
    assert not (tmp / "reports").exists(), list((tmp / "reports").rglob("*"))
    assert "report:" not in proc.stderr


def _descendants(pid: int) -> set[int]:
    """The processes below `pid` (from /proc's children lists)."""
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        for task in glob.glob(f"/proc/{p}/task/*/children"):
            try:
                kids = {int(k) for k in open(task).read().split()}
            except OSError:
                continue
            todo += list(kids - found)
            found |= kids
    return found


def _temp_dirs(*roots) -> set[str]:
    return {os.path.join(r, n) for r in roots if os.path.isdir(r) for n in os.listdir(r) if n.startswith("diffkit-")}


@pytest.mark.parametrize("two,sig", [(False, signal.SIGTERM), (True, signal.SIGTERM), (False, signal.SIGHUP)],
                         ids=["one-child", "a-child-per-side", "sighup"])
def test_sigterm_stops_the_children_and_removes_temp_dirs(files, two, sig):
    """SIGTERM while the candidate's forward spins: the CLI exits 128+15, no process it started is left, and
    the temporary folders it made (the hand-over's, on /dev/shm where it can) are gone."""
    tmp, ref = files
    started = tmp / "started"
    cand = tmp / "cand.py"
    cand.write_text("import torch, torch.nn as nn\nclass ModelNew(nn.Module):\n    def forward(self, x):\n"
                    f"        open({str(started)!r}, 'w').close()\n        while True:\n            pass\n")
    env = dict(os.environ, TMPDIR=str(tmp))
    if two:
        env["DIFFKIT_TWO_PROCESSES"] = "1"
    roots = (str(tmp), "/dev/shm")
    before = _temp_dirs(*roots)
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "cli.py"), "diff", str(ref), str(cand), "--no-report"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    deadline = time.time() + 120
    while time.time() < deadline and not started.exists() and proc.poll() is None:
        time.sleep(0.1)
    assert started.exists(), proc.communicate()
    kids = _descendants(proc.pid)
    # (this diff's own: named after its process, other tests' diffs share /dev/shm)
    made = {d for d in _temp_dirs(*roots) - before if os.path.basename(d).startswith(f"diffkit-{proc.pid}-")}
    assert made, _temp_dirs(*roots) - before
    assert kids  # (the forward runs in a child process)
    proc.send_signal(sig)
    proc.wait(timeout=30)
    assert proc.returncode == 128 + sig
    deadline = time.time() + 10
    while time.time() < deadline and any(os.path.exists(f"/proc/{k}") for k in kids):
        time.sleep(0.1)
    left = [k for k in kids if os.path.exists(f"/proc/{k}") and "Z" not in open(f"/proc/{k}/stat").read().split()[2]]
    assert not left, f"children still running: {left}"
    assert not [d for d in made if os.path.exists(d)], made


class _TanhSum(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4) * 0.3)

    def forward(self, x):
        return torch.tanh(x @ self.w).sum(0)


class _RowsInPlace(_TanhSum):
    """Rows written into a buffer one by one, through a sparse intermediate, with an in-place add."""

    def forward(self, x):
        out = torch.zeros(x.shape[0], 4)
        for i in range(x.shape[0]):
            row = torch.tanh(x[i] @ self.w).to_sparse()
            out[i] = row.to_dense()
            out[i].add_(0.0)
        return out.sum(0)


@pytest.mark.parametrize("inference", [False, True])
def test_in_place_writes_and_a_sparse_intermediate_under_inference_mode(inference):
    """Inference-mode tensors keep no version counter, and a sparse value has no quantiles: neither
    stops the diff (both once raised)."""
    torch.manual_seed(0)
    ref = _TanhSum()
    torch.manual_seed(0)
    cand = _RowsInPlace()
    x = torch.randn(20, 4)
    with torch.inference_mode(inference):
        res = diffkit.compare(ref, cand, [x])
    assert res.verdict == "match", res.summary


def test_a_meta_tensor_output_is_the_candidates_error_not_an_internal_one():
    import torch

    import diffkit
    from diffkit.errors import DiffkitError

    class Ref(torch.nn.Module):
        def forward(self, x):
            return x * 2

    class Shapeless(torch.nn.Module):
        def forward(self, x):
            return torch.empty(x.shape, device="meta")

    with pytest.raises(DiffkitError, match="meta device") as info:
        diffkit.compare(Ref(), Shapeless(), [torch.randn(3, 4)])
    assert info.value.side == "candidate"


def test_an_exception_whose_message_raises_is_still_reported_where_it_was_raised():
    import inspect

    import torch

    import diffkit

    class Unprintable(Exception):
        def __str__(self):
            raise RuntimeError("no message")

    class Ref(torch.nn.Module):
        def forward(self, x):
            return x + 1

    class Cand(torch.nn.Module):
        def forward(self, x):
            raise Unprintable()

    r = diffkit.compare(Ref(), Cand(), [torch.randn(2)])
    assert r.verdict == "error" and r.error.side == "candidate" and "Unprintable" in r.error.message
    assert f":{inspect.getsourcelines(Cand.forward)[1] + 1}" in r.error.stage, r.error.stage


@pytest.mark.parametrize("value,words", [(None, "returned None"), (3, "returned an int"), (2.5, "returned a float")])
def test_a_forward_that_returns_no_tensor_says_what_it_returned(value, words):
    import torch

    import diffkit

    class Ref(torch.nn.Module):
        def forward(self, x):
            return x.exp()

    class Cand(torch.nn.Module):
        def forward(self, x):
            x.exp()
            return value

    r = diffkit.compare(Ref(), Cand(), [torch.randn(3)])
    assert r.verdict == "error" and r.error.side == "candidate" and words in r.error.message, r.error.message
