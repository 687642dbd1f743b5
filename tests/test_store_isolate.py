"""Capture files (round trip, truncation, tampering) and the isolated child process (crash, hang)."""
import json
import os
import subprocess
import sys
import time

import pytest
import torch

import diffkit
from diffkit import DiffkitError
from diffkit.compare import run_captured
from diffkit.store import CaptureFile, load_trace, save_trace

from conftest import KERNELS, REFS, ROOT, run_cli


def _trace():
    mod = diffkit.load.exec_file(os.path.join(REFS, "transformer_block.py"), "reference")
    torch.manual_seed(42)
    model = mod.Model(*mod.get_init_inputs()).eval()
    return run_captured(model, mod.get_inputs())


def test_round_trip_is_exact(tmp_path):
    trace = _trace()
    save_trace(trace, str(tmp_path / "run.dkt"), shard_bytes=20_000)  # several shards
    assert len([f for f in os.listdir(tmp_path / "run.dkt") if f.endswith(".safetensors")]) > 1
    back = load_trace(str(tmp_path / "run.dkt"))
    assert [r.name for r in back] == [r.name for r in trace]
    for a, b in zip(trace, back):
        assert (a.kind, a.scope, a.label, a.op, a.shape, a.dtype, a.aliases, a.is_output, a.line) == \
               (b.kind, b.scope, b.label, b.op, b.shape, b.dtype, b.aliases, b.is_output, b.line)
        assert torch.equal(a.value, b.value)
    # lazily, one record at a time
    it = CaptureFile.open(str(tmp_path / "run.dkt")).records()
    first = next(it)
    assert first.name == "input[0]" and first.value is not None
    result = diffkit.compare_traces(trace, back)
    assert result.verdict == "match" and all(s.stats.max_abs == 0 for s in result.compared)


def _broken(tmp_path, edit):
    path = tmp_path / "run.dkt"
    save_trace(_trace(), str(path), shard_bytes=20_000)
    edit(path)
    with pytest.raises(DiffkitError) as e:
        load_trace(str(path))
    return str(e.value)


def test_truncated_shard(tmp_path):
    def cut(path):
        shard = sorted(p for p in os.listdir(path) if p.startswith("shard-"))[1]
        data = (path / shard).read_bytes()
        (path / shard).write_bytes(data[: len(data) // 2])
    msg = _broken(tmp_path, cut)
    assert "truncated or corrupt" in msg and "shard-00001" in msg


def test_truncated_index(tmp_path):
    def cut(path):
        text = (path / "index.json").read_text()
        (path / "index.json").write_text(text[: len(text) // 3])
    assert "not valid JSON" in _broken(tmp_path, cut)


def test_tampered_index(tmp_path):
    def shape(path):
        idx = json.loads((path / "index.json").read_text())
        idx["records"][3]["shape"] = [1, 2, 3]
        (path / "index.json").write_text(json.dumps(idx))
    assert "do not belong together" in _broken(tmp_path, shape)


def test_path_escape_and_missing_shard(tmp_path):
    def escape(path):
        idx = json.loads((path / "index.json").read_text())
        idx["records"][2]["shard"] = "../../etc/passwd"
        (path / "index.json").write_text(json.dumps(idx))
    assert "points outside the capture" in _broken(tmp_path, escape)


def test_missing_shard(tmp_path):
    def drop(path):
        os.remove(path / "shard-00000.safetensors")
    assert "is missing" in _broken(tmp_path, drop)


def test_not_a_capture(tmp_path):
    (tmp_path / "index.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(DiffkitError, match="not a diffkit capture"):
        load_trace(str(tmp_path))


# run_cli(..., env=TWO_PROCESSES): straight to a child process per side (else, with no GPU in play, one child runs
# both sides first, and answers a file that does not load by itself)
TWO_PROCESSES = {"DIFFKIT_TWO_PROCESSES": "1"}


def test_capture_command_and_diff_of_two_captures(tmp_path, ops):
    ref = run_cli("capture", os.path.join(REFS, "transformer_block.py"), "-o", str(tmp_path / "ref.dkt"))
    assert ref.returncode == 0, ref.stdout + ref.stderr
    cand = run_cli("capture", os.path.join(KERNELS, "transformer_block_no_scale.py"), "--side", "cand", "--inputs-from",
                   os.path.join(REFS, "transformer_block.py"), "-o", str(tmp_path / "cand.dkt"))
    assert cand.returncode == 0, cand.stdout + cand.stderr
    out = run_cli("diff", str(tmp_path / "ref.dkt"), str(tmp_path / "cand.dkt"), "--no-report")
    assert out.returncode == 1 and "forward:scores" in out.stdout.strip().splitlines()[-1]


CRASH = """
import ctypes, os, runpy
_base = runpy.run_path({kernels!r} + "/transformer_block_cpp.py")
ops = _base["ops"]
class ModelNew(_base["ModelNew"]):
    def forward(self, x):
        b, s, dim = x.shape
        y = ops.layernorm(x.reshape(b * s, dim), self.ln1.weight, self.ln1.bias, self.ln1.eps, 0)
        {action}
        return y
"""


@pytest.mark.parametrize("action,why", [("ctypes.string_at(0)", "SIGSEGV"),
                                        ("import time; time.sleep(600)", "did not finish within")])
def test_crash_or_hang_in_the_child_keeps_what_was_captured(tmp_path, action, why, ops):
    cand = tmp_path / "cand.py"
    cand.write_text(CRASH.format(kernels=KERNELS, action=action))
    # (a hang is waited for twice: in the one child, then in the candidate's own child to say it repeats)
    out = run_cli("diff", os.path.join(REFS, "transformer_block.py"), str(cand), "--timeout", "20", "--json",
                  str(tmp_path / "r.json"), "--no-report")
    assert out.returncode == 2, out.stdout + out.stderr
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["verdict"] == "error" and data["error"]["side"] == "candidate" and why in data["error"]["message"]
    assert "forward:y" in data["error"]["stage"]  # the last stage captured before it
    ok = [s for s in data["stages"] if s["status"] == "ok"]
    assert any(s["ref_name"] == "ln1" for s in ok)


def test_streaming_child_crash_keeps_its_measured_stages(tmp_path, ops):
    """With --max-memory the child keeps no values on disk; what it measured before dying comes back
    through its stats journal, so the parent still reports those stages as compared."""
    cand = tmp_path / "cand.py"
    cand.write_text(CRASH.format(kernels=KERNELS, action="ctypes.string_at(0)"))
    out = run_cli("diff", os.path.join(REFS, "transformer_block.py"), str(cand), "--timeout", "60", "--max-memory",
                  "64K", "--json", str(tmp_path / "r.json"), "--no-report")
    assert out.returncode == 2, out.stdout + out.stderr
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["verdict"] == "error" and "SIGSEGV" in data["error"]["message"]
    ok = [s for s in data["stages"] if s["status"] == "ok"]
    assert any(s["ref_name"] == "ln1" and s["max_abs"] is not None for s in ok)


def test_streaming_flags_on_the_command_line(tmp_path):
    out = run_cli("diff", os.path.join(REFS, "axial_attention.py"),
                  os.path.join(KERNELS, "axial_attention_missing_bias.py"), "--max-memory", "64K", "--stop-at-first",
                  "--json", str(tmp_path / "r.json"), "--no-report")
    assert out.returncode == 1, out.stdout + out.stderr
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["meta"]["mode"] == "streaming" and data["meta"]["stopped"]
    assert data["first_divergence"]["ref_name"] == "row_attn.out_proj"
    bad = run_cli("diff", os.path.join(REFS, "axial_attention.py"), os.path.join(KERNELS, "axial_attention_cpp.py"),
                  "--max-memory", "lots", "--no-report")
    assert bad.returncode == 2 and "--max-memory" in bad.stderr + bad.stdout




FLAKY = """
import ctypes, os, runpy
import torch
_ref = runpy.run_path({refs!r} + "/transformer_block.py")
get_inputs, get_init_inputs = _ref["get_inputs"], _ref["get_init_inputs"]
FLAG = {flag!r}

print("candidate module ran")


class ModelNew(_ref["Model"]):
    def forward(self, x):
        normed = self.ln1(x)
        mixed = self.qkv(normed)
        if {always} or not os.path.exists(FLAG):  # the first process to get here crashes
            open(FLAG, "w").close()
            ctypes.string_at(0)
        return super().forward(x)
"""


@pytest.mark.parametrize("always", [True, False])
def test_a_crashing_candidate_is_run_again_for_its_values(tmp_path, always):
    """With no GPU in play one child runs both sides first; after its crash the diff runs again with a child
    per side.  The candidate child keeps names and shapes only; after its crash a second run captures the
    values (and writes no answer of its own), so the stages before the crash are still compared.  A crash
    that does not repeat is still the answer (an error, named as the first child saw it, in the model's file),
    with every stage of the diff that ran clean."""
    cand = tmp_path / "cand.py"
    cand.write_text(FLAKY.format(refs=REFS, flag=str(tmp_path / "crashed"), always=always))
    out = run_cli("diff", os.path.join(REFS, "transformer_block.py"), str(cand), "--json", str(tmp_path / "r.json"),
                  "--no-report")
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stdout.count("diffkit: ERROR") == 1  # the second run printed nothing:
    assert out.stdout.count("candidate module ran") == 1  # not even the candidate's own output
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["verdict"] == "error" and "SIGSEGV" in data["error"]["message"]
    measured = {s["ref_name"]: s for s in data["stages"] if s["max_abs"] is not None}
    assert measured["ln1"]["status"] == "ok" and measured["qkv"]["status"] == "ok"
    assert data["meta"]["processes"] == "a child process per side"
    if always:  # the candidate's own process crashed as well: its second run recaptured the stages before it
        assert "run a second time" in data["error"]["traceback"]
        assert "output" not in measured and "does not repeat" not in data["error"]["message"]
    else:  # the first child's crash, in the candidate's file; the diff after it ran to the end
        assert data["error"]["side"] == "candidate" and "cand.py:" in data["error"]["stage"]
        assert "does not repeat" in data["error"]["message"] and measured["output"]["status"] == "ok"


def test_uninsured_capture_file_keeps_names_only(tmp_path):
    mod = diffkit.load.exec_file(os.path.join(REFS, "transformer_block.py"), "reference")
    model = mod.Model(*mod.get_init_inputs())
    trace = run_captured(model, mod.get_inputs(), stream_to=str(tmp_path / "c.dkt"), stream_values=False)
    cap = CaptureFile.open(str(tmp_path / "c.dkt"))
    assert [r.name for r in cap.records(values=False)] == [r.name for r in trace.records]
    assert all(r.value is None for r in cap.records()) and cap.parameters() == {}
    assert all(r.value is not None for r in trace.records)  # the run itself keeps its values


SLOW_REF = """
import time
import torch
_ref = __import__("runpy").run_path({refs!r} + "/transformer_block.py")
get_inputs, get_init_inputs = _ref["get_inputs"], _ref["get_init_inputs"]

class Model(_ref["Model"]):
    def forward(self, x):
        time.sleep(1.5)
        with open({log!r}, "a") as fh:
            fh.write("ref-forward-done %r\\n" % time.time())
        return super().forward(x)
"""

COUNTED_CAND = """
import time
with open({log!r}, "a") as fh:
    fh.write("cand-file-run %r\\n" % time.time())
_ref = __import__("runpy").run_path({refs!r} + "/transformer_block.py")
ModelNew = _ref["Model"]
"""


def test_candidate_file_runs_while_the_reference_is_captured(tmp_path):
    """The candidate's process runs its file (builds, imports) beside the reference's process, once,
    and the diff is the same as ever."""
    log = str(tmp_path / "log")
    ref, cand = tmp_path / "ref.py", tmp_path / "cand.py"
    ref.write_text(SLOW_REF.format(refs=REFS, log=log))
    cand.write_text(COUNTED_CAND.format(refs=REFS, log=log))
    out = run_cli("diff", str(ref), str(cand), "--trials", "1", "--no-report")
    assert out.returncode == 0, out.stdout + out.stderr
    events = [line.split() for line in open(log).read().splitlines()]
    runs = [float(t) for name, t in events if name == "cand-file-run"]
    ref_done = [float(t) for name, t in events if name == "ref-forward-done"]
    assert len(runs) == 1  # run ahead, then taken by the load: not run a second time
    assert runs[0] < ref_done[0]  # while the reference's capture was still running


def test_a_failing_reference_stops_the_waiting_candidate(tmp_path):
    """The candidate's process, started beside the reference's, is stopped when the reference fails:
    one answer (the reference's error), no candidate output after it."""
    log = str(tmp_path / "log")
    ref, cand = tmp_path / "ref.py", tmp_path / "cand.py"
    ref.write_text("import torch\nraise RuntimeError('this reference is broken')\n")
    cand.write_text(COUNTED_CAND.format(refs=REFS, log=log))
    for two in (False, True):
        out = run_cli("diff", str(ref), str(cand), "--no-report", env=TWO_PROCESSES if two else None)
        assert out.returncode == 2, out.stdout + out.stderr
        assert out.stdout.count("diffkit:") == 1 and "this reference is broken" in out.stdout
    # (with no GPU in play the one child running both sides answers the reference's error before the candidate's
    # file is run at all)
    assert not os.path.exists(log) or open(log).read().count("cand-file-run") <= 1


BUILT_CAND = """
import time
_ref = __import__("runpy").run_path({refs!r} + "/transformer_block.py")


class ModelNew(_ref["Model"]):
    def __init__(self, *args):
        with open({log!r}, "a") as fh:
            fh.write("cand-built %r\\n" % time.time())
        if {broken!r}:
            raise ValueError("this candidate cannot take these dims")
        super().__init__(*args)
"""


def _diff_built_ahead(tmp_path, broken: bool):
    """`diffkit diff` of SLOW_REF and BUILT_CAND: (the process's result, the log file, the candidate's path)."""
    log = str(tmp_path / "log")
    ref, cand = tmp_path / "ref.py", tmp_path / "cand.py"
    ref.write_text(SLOW_REF.format(refs=REFS, log=log))
    cand.write_text(BUILT_CAND.format(refs=REFS, log=log, broken=broken))
    out = run_cli("diff", str(ref), str(cand), "--trials", "1", "--no-report", "--json", str(tmp_path / "r.json"))
    return out, log, cand


def test_the_candidate_is_built_while_the_reference_is_captured(tmp_path):
    """With no GPU in play the candidate's process also builds its model beside the reference's (from the
    init inputs the reference's process publishes, seeded as KernelBench seeds them), once: same weights,
    same diff."""
    out, log, _ = _diff_built_ahead(tmp_path, broken=False)
    assert out.returncode == 0, out.stdout + out.stderr
    events = [line.split() for line in open(log).read().splitlines()]
    built = [float(t) for name, t in events if name == "cand-built"]
    ref_done = [float(t) for name, t in events if name == "ref-forward-done"]
    assert len(built) == 1 and built[0] < ref_done[0]
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["verdict"] == "match" and data["weights"]["identical"] and not data["weights"]["differ"]


def test_a_candidate_constructor_failing_ahead_is_reported_as_its_init_error(tmp_path):
    """A constructor that raises while the reference is still being captured: the same answer as when
    it raised after (the candidate's init error, where it was raised), one answer, exit 2."""
    out, log, cand = _diff_built_ahead(tmp_path, broken=True)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stdout.count("diffkit: ERROR") == 1, out.stdout
    err = json.loads((tmp_path / "r.json").read_text())["error"]
    assert err["side"] == "candidate" and err["phase"] == "init"
    assert "cannot take these dims" in err["message"] and err["stage"].startswith(str(cand) + ":")
    assert open(log).read().count("cand-built") == 1


def test_a_candidate_built_ahead_from_other_init_inputs_is_built_again(tmp_path):
    """The model built ahead is taken only when the capture says the reference was built from the same
    init inputs; it is taken once, and a constructor's error is raised by the load that takes it."""
    from diffkit.compare import capture_reference
    from diffkit.load import build_candidate_ahead, encode_values, load_candidate_for_capture, prepare_candidate

    ref, cand = tmp_path / "ref.py", tmp_path / "cand.py"
    ref.write_text(EXIT_CAND.replace("ModelNew", "Model") + "\n\ndef get_init_inputs():\n    return [8]\n\n\n"
                   "def get_inputs():\n    return [torch.randn(4, 8)]\n")
    published = []
    capture_reference(str(ref), str(tmp_path / "ref.dkt"), on_init=published.append)
    assert published == [[8]]  # told once the reference is built (as its constructor left them)
    cap = CaptureFile.open(str(tmp_path / "ref.dkt"))
    cand.write_text(EXIT_CAND)
    key = os.path.abspath(cand)
    for n, fresh in ((8, False), (16, True)):
        prepare_candidate(str(cand))
        build_candidate_ahead(str(cand), encode_values([n]))
        ahead = diffkit.load._BUILT[key][1]
        assert ahead.lin.in_features == n
        side, _ = load_candidate_for_capture(str(cand), cap)
        assert (side.model is not ahead) == fresh
        assert side.model.lin.in_features == 8 and side.init_inputs == [8]
        assert key not in diffkit.load._BUILT  # taken (or dropped) once
    cand.write_text(EXIT_CAND.replace("super().__init__()", "raise ValueError('no such width')"))
    prepare_candidate(str(cand))
    build_candidate_ahead(str(cand), encode_values([8]))
    with pytest.raises(DiffkitError) as e:
        load_candidate_for_capture(str(cand), cap)
    assert e.value.side == "candidate" and e.value.phase == "init" and "no such width" in e.value.message


NORMALISING_REF = """
import time
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, n, cfg):
        super().__init__()
        cfg["scale"] = float(cfg["scale"])  # its constructor normalises the config it is given, in place
        self.lin = nn.Linear(n, 16)
        self.scale = nn.Parameter(torch.tensor(cfg["scale"]))

    def forward(self, x):
        time.sleep(1)
        return self.lin(x) * self.scale


def get_inputs():
    return [torch.randn(4, 8)]


def get_init_inputs():
    return [8, {"scale": 2}]
"""

CHDIR_CAND = """
import os
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self, n, cfg):
        super().__init__()
        os.chdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets"))  # its tables live there
        self.lin = nn.Linear(n, 16)
        self.scale = nn.Parameter(torch.tensor(float(cfg["scale"])))

    def forward(self, x):
        return self.lin(x) * self.scale
"""


@pytest.mark.parametrize("cand", ["same", "chdir"])
def test_a_candidate_built_ahead_is_built_as_the_capture_says(tmp_path, cand):
    """The candidate is built from the init inputs as the reference's constructor left them (it turns an
    int into a float in place: built from the int, this candidate's constructor would fail), and a
    constructor that changes directory does not lose a candidate given by a relative path: the answer an
    isolated diff gives is the in-process one."""
    (tmp_path / "ref.py").write_text(NORMALISING_REF)
    text = NORMALISING_REF.replace("class Model(", "class ModelNew(").replace(
        "        cfg[\"scale\"] = float(cfg[\"scale\"])  # its constructor normalises the config it is given, in place\n",
        "").replace("        time.sleep(1)\n", "")
    (tmp_path / "cand.py").write_text(text if cand == "same" else CHDIR_CAND)
    (tmp_path / "assets").mkdir()
    got = {}
    for mode in ("isolated", "--no-isolate"):
        out = subprocess.run([sys.executable, os.path.join(ROOT, "cli.py"), "diff", "ref.py", "cand.py", "--trials",
                              "1", "--no-report", "--json", str(tmp_path / f"{mode}.json")]
                             + ([mode] if mode.startswith("--") else []),
                             capture_output=True, text=True, cwd=tmp_path, timeout=600)
        assert out.returncode == 0, out.stdout + out.stderr
        got[mode] = json.loads((tmp_path / f"{mode}.json").read_text())["verdict"]
    assert got == {"isolated": "match", "--no-isolate": "match"}


def test_auto_tolerance_asks_for_one_process(tmp_path):
    """--tolerance auto re-runs the reference in float64 beside the candidate: an isolated diff, a captured
    reference or a streaming diff says so as a usage error (it was an internal error from the child)."""
    ref, cand = os.path.join(REFS, "transformer_block.py"), os.path.join(KERNELS, "transformer_block_no_scale.py")
    out = run_cli("diff", ref, cand, "--tolerance", "auto", "--no-report")
    assert out.returncode == 2 and "--no-isolate" in out.stderr and "INTERNAL" not in out.stdout + out.stderr
    out = run_cli("diff", ref, cand, "--tolerance", "auto", "--no-report", "--no-isolate", "--max-memory", "1M")
    assert out.returncode == 2 and "--max-memory" in out.stderr


LOCKING_CAND = """
import os, time
with open({log!r}, "a") as fh:
    fh.write("locked\\n")
fd = os.open({lock!r}, os.O_CREAT | os.O_EXCL)  # as torch's extension build takes its lock file
try:
    time.sleep(60)  # (building)
finally:
    os.close(fd)
    os.remove({lock!r})
"""


def test_a_candidate_stopped_while_it_builds_releases_its_lock(tmp_path):
    """The reference fails while the candidate's file is still running (building an extension under a lock
    file, say): the candidate's process is stopped through Python (SIGTERM raises `Terminated` in the
    children too), so the lock is released (a lock left behind would hold up every later build of that
    extension), and the answer does not wait for it."""
    log, lock = str(tmp_path / "log"), str(tmp_path / "lock")
    ref, cand = tmp_path / "ref.py", tmp_path / "cand.py"
    ref.write_text("import time\ntime.sleep(1.5)\nraise RuntimeError('this reference is broken')\n")
    cand.write_text(LOCKING_CAND.format(log=log, lock=lock))
    out = run_cli("diff", str(ref), str(cand), "--no-report", timeout=50, env=TWO_PROCESSES)
    assert out.returncode == 2 and "this reference is broken" in out.stdout, out.stdout + out.stderr
    assert open(log).read() == "locked\n" and not os.path.exists(lock)


EXIT_CRASH = """
import atexit, os, signal, sys
import torch
import torch.nn as nn

if sys.argv[1:] == ["child", "reference"]:  # the reference's own process only: it dies at interpreter exit
    atexit.register(lambda: os.kill(os.getpid(), signal.SIGABRT))


class Model(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.lin = nn.Linear(n, n)

    def forward(self, x):
        return torch.tanh(self.lin(x))


def get_init_inputs():
    return [16]


def get_inputs():
    return [torch.randn(4, 16)]
"""

EXIT_CAND = """
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.lin = nn.Linear(n, n)

    def forward(self, x):
        return torch.tanh(x @ self.lin.weight.t() + self.lin.bias)
"""


def test_a_reference_process_dying_after_its_capture_is_complete_still_gives_one_answer(tmp_path, monkeypatch):
    """The reference's process aborts at interpreter exit, after it wrote a complete capture and said so:
    the candidate's answer stands (one answer, exit 0), not a crash report and a second candidate run."""
    ref, cand = tmp_path / "ref.py", tmp_path / "cand.py"
    ref.write_text(EXIT_CRASH)
    cand.write_text(EXIT_CAND)
    monkeypatch.setenv("DIFFKIT_NO_FORK", "1")  # fresh interpreters: atexit handlers run as the process ends
    out = run_cli("diff", str(ref), str(cand), "--trials", "1", "--no-report", "--json", str(tmp_path / "r.json"),
                  "--timeout", "120")
    assert out.returncode == 0, out.stdout + out.stderr
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["verdict"] == "match" and data.get("error") is None
    assert out.stdout.count("diffkit: MATCH") == 1, out.stdout


SLOW_EXIT_CAND = """
import atexit, os, sys, time
import torch

_marker = os.environ.get("EXITED_MARKER")


def _at_exit():  # its answer is given: what is left is this process's own exit
    if sys.argv[1:] != ["child", "candidate"] or not _marker:
        return
    how = {how!r}
    if how == "slow":  # (a big model's memory given back, an interpreter torn down)
        time.sleep(4)
    elif how == "crash":  # at once: within moments of writing its answer
        os.abort()
    elif how == "hang":
        while True:
            time.sleep(1)
    with open(_marker, "w") as fh:
        fh.write("exited")


atexit.register(_at_exit)


class ModelNew(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        torch.manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(n, n))

    def forward(self, x):
        return torch.sigmoid(x.matmul(self.w))
"""

SLOW_EXIT_REF = """
import torch


class Model(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        torch.manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(n, n))

    def forward(self, x):
        return torch.sigmoid(x @ self.w)


def get_init_inputs():
    return [12]


def get_inputs():
    return [torch.randn(3, 12)]
"""


def _running(text: str) -> list[int]:
    """Processes (not zombies) whose command line contains `text`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmd = fh.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/stat") as fh:
                state = fh.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text in cmd and state != "Z":
            found.append(int(pid))
    return found


def _still_running(text: str) -> list:
    """`_running(text)` once the processes have had up to 10 s to end."""
    for _ in range(100):
        left = _running(text)
        if not left:
            break
        time.sleep(0.1)
    return left


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
@pytest.mark.parametrize("how", ["slow", "crash", "hang"])
def test_the_answer_does_not_wait_for_the_candidate_process_to_exit(tmp_path, monkeypatch, how):
    """With no GPU in play, an isolated diff returns once its candidate's process has written its answer:
    that process is stopped then, not waited for, whatever is left of its exit (slow, a crash at once, a
    hang); one answer, its exit code, no crash report, no second run, and no process of it left behind."""
    ref, cand = tmp_path / "ref.py", tmp_path / "cand.py"
    ref.write_text(SLOW_EXIT_REF)
    cand.write_text(SLOW_EXIT_CAND.replace("{how!r}", repr(how)))
    marker = tmp_path / "exited"
    monkeypatch.setenv("DIFFKIT_NO_FORK", "1")  # fresh interpreters: atexit handlers run as the process ends
    monkeypatch.setenv("EXITED_MARKER", str(marker))
    log = tmp_path / "stdout"
    with open(log, "w") as fh:  # (not a pipe: a pipe stays open, and read, until every process holding it exits)
        out = subprocess.run([sys.executable, os.path.join(ROOT, "cli.py"), "diff", str(ref), str(cand), "--trials",
                              "1", "--no-report", "--json", str(tmp_path / "r.json"), "--device", "cpu",
                              "--timeout", "120"],
                             stdout=fh, stderr=subprocess.PIPE, text=True, cwd=ROOT, timeout=300)
    text = log.read_text()
    assert out.returncode == 0, text + out.stderr
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["verdict"] == "match" and data.get("error") is None
    assert text.count("diffkit: MATCH") == 1, text
    assert "second time" not in out.stderr + text
    left = _still_running(str(cand))
    assert not left, f"processes of the diff left running: {left}"
    assert not marker.exists()  # (stopped before the rest of its exit ran: nothing waited for it)


REAPED_DRIVER = """
import ctypes, os, subprocess, sys
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans of what it runs come to it
subprocess.run([sys.executable, {inner!r}], check=True)
zombies = 0
while True:
    try:
        pid, _ = os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
        break
    if pid == 0:  # (still running: wait for it to end, then count it)
        pid, _ = os.waitpid(-1, 0)
    zombies += 1
print("ORPHANS", zombies)
"""

REAPED_INNER = """
import sys, threading, time
sys.path.insert(0, {root!r})
import diffkit.cli as cli
import diffkit.processes as processes

for cls in (processes._Forked, __import__("subprocess").Popen):
    def slow(self, timeout=None, _orig=cls.wait):
        if threading.current_thread().name == "diffkit-reap":
            time.sleep(1.0)  # a killed candidate whose memory takes a while to go back
        return _orig(self, timeout) if timeout is not None else _orig(self)
    cls.wait = slow
try:
    cli.main.main(args=["diff", {ref!r}, {cand!r}, "--trials", "1", "--no-report", "--device", "cpu"],
                  standalone_mode=False)
except SystemExit:
    pass
"""


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_a_reference_process_hanging_at_exit_does_not_hold_the_diff(tmp_path, monkeypatch):
    """With no GPU in play, the reference's process that hangs as it exits, after saying its capture is
    complete, is stopped then: the diff answers at once, not after --timeout, and leaves no process behind."""
    ref, cand = tmp_path / "ref.py", tmp_path / "cand.py"
    ref.write_text("import atexit, sys, time\n"
                   "if sys.argv[1:] == ['child', 'reference']:\n"
                   "    atexit.register(lambda: [time.sleep(1) for _ in iter(int, 1)])\n" + SLOW_EXIT_REF)
    cand.write_text(SLOW_EXIT_CAND.replace("{how!r}", repr("slow")))
    monkeypatch.setenv("DIFFKIT_NO_FORK", "1")  # fresh interpreters: atexit handlers run as the process ends
    started = time.monotonic()
    out = run_cli("diff", str(ref), str(cand), "--trials", "1", "--no-report", "--device", "cpu", "--timeout", "100")
    took = time.monotonic() - started
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("diffkit: MATCH") == 1, out.stdout
    assert took < 50, f"the diff waited {took:.0f} s for its reference's process to exit"
    left = _still_running(str(ref))
    assert not left, f"processes of the diff left running: {left}"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_CHILD_SUBREAPER is Linux's")
def test_an_answered_candidate_process_is_reaped_before_diffkit_exits(tmp_path):
    """The candidate's process stopped once it answered is reaped by diffkit before diffkit's own process
    exits, however long it takes to end: none is left to whoever adopts orphans (a container's first process
    that never reaps would collect a zombie per diff)."""
    ref, cand = tmp_path / "ref.py", tmp_path / "cand.py"
    ref.write_text(SLOW_EXIT_REF)
    cand.write_text(SLOW_EXIT_CAND.replace("{how!r}", repr("slow")))
    inner, driver = tmp_path / "inner.py", tmp_path / "driver.py"
    inner.write_text(REAPED_INNER.format(root=ROOT, ref=str(ref), cand=str(cand)))
    driver.write_text(REAPED_DRIVER.format(inner=str(inner)))
    out = subprocess.run([sys.executable, str(driver)], capture_output=True, text=True, cwd=str(tmp_path),
                         timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "diffkit: MATCH" in out.stdout, out.stdout
    assert "ORPHANS 0" in out.stdout, out.stdout + out.stderr


@pytest.mark.parametrize("isolate", [True, False])
def test_a_reader_that_stops_reading_costs_no_file_and_no_verdict(tmp_path, isolate):
    """`diffkit diff … --json r.json | head -1`: the reader closes the pipe before the answer is printed; the
    files asked for are written all the same and the exit code is the verdict's, not an internal error."""
    ref, cand = tmp_path / "ref.py", tmp_path / "cand.py"
    ref.write_text(SLOW_EXIT_REF)
    cand.write_text(SLOW_EXIT_CAND.replace("{how!r}", repr("slow")).replace("x.matmul(self.w)", "x.matmul(self.w) + 1"))
    args = [sys.executable, os.path.join(ROOT, "cli.py"), "diff", str(ref), str(cand), "--trials", "1", "--no-report",
            "--full", "--json", str(tmp_path / "r.json"), "--csv", str(tmp_path / "r.csv"), "--device", "cpu"]
    proc = subprocess.Popen(args + ([] if isolate else ["--no-isolate"]), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=ROOT)
    proc.stdout.close()  # (before anything is printed)
    err = proc.stderr.read().decode(errors="replace")
    code = proc.wait(timeout=300)
    assert code == 1, err
    assert "INTERNAL ERROR" not in err and "Traceback" not in err, err
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["verdict"] == "diverged"
    assert (tmp_path / "r.csv").read_text().count("\n") > 1


@pytest.mark.parametrize("kind", ["zeros", "random", "inplace"])
def test_a_reference_capture_is_written_through_and_keeps_its_health_checks(tmp_path, kind):
    """The reference's process keeps no captured value (each is written as it is recorded): the file holds
    every value as it was when recorded (an in-place change after it does not leak in), and the health checks
    that read values (an all-zero output; a random reference found by a second run) still work."""
    from diffkit.compare import capture_reference

    body = {"zeros": "return self.lin(x) * 0",
            "random": "return torch.nn.functional.dropout(self.lin(x), 0.5)",
            "inplace": "y = self.lin(x)\n        z = torch.relu(y)\n        y.mul_(3)\n        return z + y"}[kind]
    src = tmp_path / "ref.py"
    src.write_text("import torch, torch.nn as nn\n"
                   "class Model(nn.Module):\n"
                   "    def __init__(self):\n        super().__init__(); self.lin = nn.Linear(16, 16)\n"
                   f"    def forward(self, x):\n        {body}\n"
                   "def get_inputs():\n    return [torch.randn(8, 16)]\n"
                   "def get_init_inputs():\n    return []\n")
    out = str(tmp_path / "ref.dkt")
    trace = capture_reference(str(src), out, diffkit.Options(trials=1))
    if kind != "random":  # (a second run compares every record: then they are read back, mapped)
        assert all(r.value is None for r in trace.records if not r.is_output)  # nothing held in the process
    f = CaptureFile.open(out)
    health = f.info.get("health") or []
    back = f.load()
    if kind == "zeros":
        assert any("all zeros" in h for h in health), health
    elif kind == "random":
        assert any("reference is random" in h for h in health), health
    else:
        lin = next(r for r in back.records if r.name == "lin")
        relu = next(r for r in back.records if r.value is not None and r.op and "relu" in r.op)
        assert torch.equal(torch.relu(lin.value), relu.value)  # lin as recorded, before the in-place * 3
        assert torch.allclose(back.output.value, relu.value + 3 * lin.value)


@pytest.mark.cuda
def test_device_values_written_through_a_pinned_buffer_read_back_exactly(tmp_path, monkeypatch):
    # an isolated diff's reference process writes each device value as it is recorded, a piece at a time
    # through one pinned host buffer (here 4 KiB, so most values take several pieces)
    from diffkit import store, store_io
    from diffkit.capture import Record

    monkeypatch.setattr(store_io, "PINNED_STAGE_BYTES", 4096)
    torch.manual_seed(0)
    values = [torch.randn(37, 53, device="cuda").t(),  # laid out otherwise
              torch.randn(3, 1000, device="cuda", dtype=torch.float16)[:, ::3],
              torch.arange(5000, device="cuda"),  # int64, 40 000 bytes
              torch.randn(64, device="cuda") > 0,  # bool
              torch.tensor(2.5, device="cuda"),  # 0-d
              torch.empty(0, 4, device="cuda")]
    w = store.CaptureWriter(str(tmp_path / "cap"), shard_bytes=0, write_through=True)
    for i, v in enumerate(values):
        rec = Record(index=i, name=f"v{i}", kind="op", scope="", label=f"v{i}", function="f", file="", line=0, op="",
                     shape=tuple(v.shape), dtype=v.dtype, device=str(v.device), value=None)
        w.add(rec, v)
    w.close()
    assert w._scratch[1] is not None and w._scratch[1].is_pinned()
    back = CaptureFile.open(str(tmp_path / "cap")).load()
    for v, rec in zip(values, back.records):
        assert rec.value.dtype == v.dtype and tuple(rec.value.shape) == tuple(v.shape)
        assert torch.equal(rec.value, v.cpu()), rec.name


def test_pinned_write_through_pieces_and_its_fallback(monkeypatch):
    # the device path's logic on the CPU (pinned memory faked): bytes written piece by piece equal the tensor's,
    # the buffer grows as values need it up to the cap, and where pinned memory cannot be had nothing is written
    import io

    from diffkit import store_io

    real_empty = torch.empty
    monkeypatch.setattr(store_io, "PINNED_STAGE_BYTES", 4096)
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: real_empty(*a, **k))
    torch.manual_seed(1)
    scratch = [None]
    for v in [torch.tensor(2.5), torch.randn(37, 53).t(), torch.randn(3, 1000, dtype=torch.float16)[:, ::3],
              torch.arange(5000), torch.randn(64) > 0]:
        buf = io.BytesIO()
        assert store_io._write_through_pinned(buf, v, scratch)
        assert buf.getvalue() == v.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        assert scratch[1].numel() <= 4096
    assert scratch[1].numel() == 4096  # grown to the cap by the larger values

    def refuse(*a, pin_memory=False, **k):
        if pin_memory:
            raise RuntimeError("no pinned memory")
        return real_empty(*a, **k)

    monkeypatch.setattr(torch, "empty", refuse)
    scratch, buf = [None], io.BytesIO()
    assert not store_io._write_through_pinned(buf, torch.randn(10), scratch) and buf.getvalue() == b""
    assert scratch[1] is False and not store_io._write_through_pinned(buf, torch.randn(10), scratch)


# The GPU hand-over's protocol (diffkit.handoff), run on this machine's CPU: a driver process makes the
# isolated diff take the GPU path (its children are forked from it, so they inherit the changes) and logs what
# the reference's process did with its values and what the candidate's process received
HANDOVER_DRIVER = """
import os, sys
from diffkit import cli, handoff, processes, sources

LOG = os.environ["HANDOVER_LOG"]
def log(line):
    with open(LOG, "a") as fh:
        fh.write(line + "\\n")

processes._host_only = lambda device=None: False   # as with a GPU in play
os.environ["DIFFKIT_TWO_PROCESSES"] = "1"    # a child per side from the start (the hand-over is theirs)
processes._can_fork = lambda device=None: True      # (forked: the children keep these changes)
handoff.on_gpu = lambda model, inputs: True  # the reference's values stay in its process

real_serve, real_receive, real_dump = handoff.Holder.serve, handoff.receive, handoff.Holder.dump
def serve(self, parent=None):
    log("held %d" % sum(r.value is not None for r in self.trace.records))
    how = real_serve(self, parent)
    log(how)
    return how
def receive(path, *a, **k):
    got = real_receive(path, *a, **k)
    log("received %s" % (len(got.records) if got is not None else "none"))
    return got
def dump(self):
    shards = [f for f in os.listdir(self.capture_dir) if f.startswith("shard")]
    log("shards before dump %d" % len(shards))
    real_dump(self)
handoff.Holder.serve, handoff.receive, handoff.Holder.dump = serve, receive, dump
sources.receive = receive  # (where the candidate's side calls it)
if os.environ.get("HANDOVER_REFUSE"):  # the handles cannot be opened in the candidate's process
    def refuse(item):
        raise RuntimeError("pidfd_getfd: Operation not permitted")
    handoff._rebuild = refuse
if os.environ.get("HANDOVER_PUBLISH_FAIL"):  # no handle can be made in the reference's process
    def no_handle(t):
        raise RuntimeError("CUDA IPC is not supported here")
    handoff._reduce = no_handle
if os.environ.get("HANDOVER_DUMP_FAIL"):  # no room left to write the held values out
    from diffkit import store
    real_add = store.CaptureWriter.add
    def add(self, rec, tensor=None):
        if self.shard_bytes > 0 and rec.value is not None:  # (the dump's writer; the others write through)
            raise OSError(28, "No space left on device")
        return real_add(self, rec, tensor)
    store.CaptureWriter.add = add
sys.argv = ["diffkit", "diff", *sys.argv[1:]]
cli.main()
"""


def _handover(tmp_path, ref, cand, refuse=False, *extra, dump_fails=False, publish_fails=False):
    driver = tmp_path / "driver.py"
    driver.write_text(HANDOVER_DRIVER)
    log = tmp_path / "handover.log"
    env = dict(os.environ, HANDOVER_LOG=str(log), PYTHONPATH=ROOT, **({"HANDOVER_REFUSE": "1"} if refuse else {}),
               **({"HANDOVER_DUMP_FAIL": "1"} if dump_fails else {}),
               **({"HANDOVER_PUBLISH_FAIL": "1"} if publish_fails else {}))
    env.pop("DIFFKIT_NO_FORK", None)
    out = subprocess.run([sys.executable, str(driver), ref, cand, "--json", str(tmp_path / "r.json"), "--no-report",
                          "--trials", "2", "--timeout", "120", *extra], capture_output=True, text=True, cwd=ROOT,
                         env=env, timeout=600)
    lines = log.read_text().splitlines() if log.exists() else []
    data = json.loads((tmp_path / "r.json").read_text()) if (tmp_path / "r.json").exists() else {}
    return out, lines, data


def test_handed_over_values_give_the_diff_of_one_process(tmp_path, ops):
    """The reference's process keeps its values and is released once the candidate has read them: the answer is
    the one process's answer, and no value was written to its capture."""
    ref, cand = os.path.join(REFS, "transformer_block.py"), os.path.join(KERNELS, "transformer_block_no_scale.py")
    out, log, data = _handover(tmp_path, ref, cand)
    assert out.returncode == 1, out.stdout + out.stderr
    held = int(next(ln for ln in log if ln.startswith("held")).split()[1])
    assert held > 10 and f"received {held}" in log and "released" in log and "dumped" not in log, log
    one = run_cli("diff", ref, cand, "--no-isolate", "--trials", "2", "--json", str(tmp_path / "one.json"),
                  "--no-report")
    expect = json.loads((tmp_path / "one.json").read_text())
    assert data["first_divergence"]["ref_name"] == expect["first_divergence"]["ref_name"] == "forward:scores"
    assert [(s["ref_name"], s["status"], s["max_abs"]) for s in data["stages"]] == \
        [(s["ref_name"], s["status"], s["max_abs"]) for s in expect["stages"]]


def test_a_crashing_candidate_has_the_held_values_written_out(tmp_path, ops):
    """The candidate's process crashes: the holding process is asked to write its values into its capture, and
    the crash report compares the stages captured before the crash against them."""
    cand = tmp_path / "cand.py"
    cand.write_text(CRASH.format(kernels=KERNELS, action="ctypes.string_at(0)"))
    out, log, data = _handover(tmp_path, os.path.join(REFS, "transformer_block.py"), str(cand))
    assert out.returncode == 2, out.stdout + out.stderr
    assert "shards before dump 0" in log and "dumped" in log and "released" not in log, log
    assert data["verdict"] == "error" and "SIGSEGV" in data["error"]["message"]
    ok = [s for s in data["stages"] if s["status"] == "ok"]
    assert any(s["ref_name"] == "ln1" and s["max_abs"] is not None for s in ok), data["stages"][:3]


def test_handles_that_cannot_be_opened_are_read_from_files_instead(tmp_path, ops):
    """The candidate's process cannot open the handles (IPC not allowed here): it asks the holding process to
    write its values out, says so, and diffs against the files: the same answer."""
    ref, cand = os.path.join(REFS, "transformer_block.py"), os.path.join(KERNELS, "transformer_block_no_scale.py")
    out, log, data = _handover(tmp_path, ref, cand, refuse=True)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "received none" in log and "dumped" in log, log
    assert "could not be opened" in out.stderr and "Operation not permitted" in out.stderr
    assert data["first_divergence"]["ref_name"] == "forward:scores"
    assert all(s["max_abs"] is not None for s in data["stages"] if s["status"] in ("ok", "diverged"))


def test_held_values_that_cannot_be_written_out_leave_the_crash_the_candidate_s(tmp_path, ops):
    """The candidate crashes and the holding process cannot write its values (no room left): its capture stays
    complete with names and shapes, and the answer is still the candidate's crash, not the reference's."""
    cand = tmp_path / "cand.py"
    cand.write_text(CRASH.format(kernels=KERNELS, action="ctypes.string_at(0)"))
    out, log, data = _handover(tmp_path, os.path.join(REFS, "transformer_block.py"), str(cand), dump_fails=True)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "shards before dump 0" in log, log
    assert data["verdict"] == "error" and data["error"]["side"] == "candidate", data["error"]
    assert "SIGSEGV" in data["error"]["message"]
    assert any(s["ref_name"] == "ln1" for s in data["stages"])  # (named, though its values were lost)


def test_a_zombie_holder_counts_as_gone():
    """A holding process that died is a zombie until the diff collects it: a waiting candidate must not
    take it for alive (and wait out its whole limit)."""
    from diffkit.handoff import _alive

    pid = os.fork()
    if pid == 0:
        os._exit(0)
    try:
        import time
        for _ in range(200):  # (until it has exited; it is not collected)
            if not _alive(pid):
                break
            time.sleep(0.01)
        assert not _alive(pid)
        assert _alive(os.getpid())
    finally:
        os.waitpid(pid, 0)


LATE_SEGFAULT_REF = """
import ctypes, torch, torch.nn as nn


class Model(nn.Module):
    def __init__(self, k):
        super().__init__()
        self.mix = nn.Linear(k, k)
        self.seen = 0

    def forward(self, x):
        self.seen += 1
        if self.seen == 3:  # the third forward: a later trial
            ctypes.string_at(0)
        return self.mix(x).relu()


def get_inputs():
    return [torch.randn(5, 7)]


def get_init_inputs():
    return [7]
"""


def test_a_reference_crashing_on_a_later_trial_is_reported_as_the_reference(tmp_path):
    """Trial 1's capture is complete when the reference's process dies on a later trial: the crash is the
    reference's, not blamed on the candidate."""
    ref, cand = tmp_path / "ref.py", tmp_path / "cand.py"
    ref.write_text(LATE_SEGFAULT_REF)
    cand.write_text(LATE_SEGFAULT_REF.replace("class Model", "class ModelNew").replace("if self.seen == 3", "if 0"))
    out = run_cli("diff", str(ref), str(cand), "--json", str(tmp_path / "r.json"), "--no-report", "--timeout", "120")
    assert out.returncode == 2, out.stdout + out.stderr
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["error"]["side"] == "reference" and "SIGSEGV" in data["error"]["message"], data["error"]


def test_values_that_cannot_be_handed_over_are_written_to_the_capture(tmp_path, ops):
    """The reference's process cannot make handles (no IPC here): it writes its values into its capture at once
    and holds nothing; the answer is the same, and the reason is on stderr."""
    ref, cand = os.path.join(REFS, "transformer_block.py"), os.path.join(KERNELS, "transformer_block_no_scale.py")
    out, log, data = _handover(tmp_path, ref, cand, publish_fails=True)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "cannot be handed over" in out.stderr and "CUDA IPC is not supported here" in out.stderr
    assert "shards before dump 0" in log and not any(ln.startswith("held") for ln in log), log
    assert "received none" in log  # (no handles published: the files are read)
    assert data["first_divergence"]["ref_name"] == "forward:scores"
    assert "reference_values" not in data["meta"]


def test_a_model_that_returns_its_input_is_diffed_from_its_capture(tmp_path):
    # the input record became the output record (its input name an alias): the capture's inputs, and each
    # later trial's, are rebuilt from it; a candidate off on trial 4 only is caught there
    (tmp_path / "ref.py").write_text(
        "import torch\nclass Model(torch.nn.Module):\n    def forward(self, x):\n        return x\n"
        "def get_inputs():\n    return [torch.randn(3, 5)]\ndef get_init_inputs():\n    return []\n")
    (tmp_path / "cand.py").write_text(
        "import torch\nclass ModelNew(torch.nn.Module):\n    def forward(self, x):  # off under trial 4's seed\n"
        "        return x + 1e-3 if torch.initial_seed() == 839703249 else x.clone()\n")
    out = run_cli("diff", str(tmp_path / "ref.py"), str(tmp_path / "cand.py"), "--no-report", "--json",
                  str(tmp_path / "r.json"))
    data = json.loads((tmp_path / "r.json").read_text())
    assert out.returncode == 1 and data["verdict"] == "diverged", out.stdout[-1500:] + out.stderr[-1500:]
    assert [t["allclose"] for t in data["trials"]] == [True, True, True, False, True], data["trials"]


@pytest.mark.parametrize("how", ["__import__('os')._exit(3)", "__import__('ctypes').string_at(0)"])
def test_a_candidate_process_that_dies_on_a_later_trial_is_reported_on_that_trial(tmp_path, how):
    # the trials judged before it stay, and the one it died in is named with its seed
    (tmp_path / "ref.py").write_text(
        "import torch\nclass Model(torch.nn.Module):\n    def forward(self, x):\n        return torch.sin(x)\n"
        "def get_inputs():\n    return [torch.randn(6)]\ndef get_init_inputs():\n    return []\n")
    (tmp_path / "cand.py").write_text(
        "import torch\nclass ModelNew(torch.nn.Module):\n    def forward(self, x):\n"
        f"        if torch.initial_seed() == 2197670066:\n            {how}\n        return x.sin()\n")
    out = run_cli("diff", str(tmp_path / "ref.py"), str(tmp_path / "cand.py"), "--no-report", "--json",
                  str(tmp_path / "r.json"))
    data = json.loads((tmp_path / "r.json").read_text())
    assert out.returncode == 2 and data["verdict"] == "error", out.stdout[-1500:]
    assert [(t["trial"], t["allclose"]) for t in data["trials"]] == [(1, True), (2, True), (3, False)], data["trials"]
    assert data["trials"][2]["seed"] == 2197670066 and data["trials"][2]["error"]
    assert "on trial 3 (seed 2197670066)" in data["error"]["message"]


# ----------------------------------------------------------------------------- --no-isolate keeps to --timeout
HANG_REF = '''import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        return torch.tanh(x) * 3


def get_inputs():
    return [torch.randn(4, 6)]


def get_init_inputs():
    return []
'''
HANG_CAND = '''import re
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, x):
        y = torch.tanh(x)
        if {python_loop}:
            while float(y.sum()) > -1e30:  # waits for a convergence that never comes
                y = y * 1.0
        else:  # C code that keeps the interpreter's lock: no Python runs until it returns
            re.match(r"(a+)+$", "a" * 64 + "b")
        return y * 3
'''


@pytest.mark.parametrize("python_loop", [True, False], ids=["python-loop", "holds-the-interpreter-lock"])
def test_no_isolate_stops_a_hanging_forward_at_the_timeout(tmp_path, python_loop):
    """--no-isolate: a forward that never returns is stopped at --timeout with an answer naming the side and its
    line (Python that runs), or ended by the kernel (SIGALRM) a grace period later (C code holding the lock)."""
    import signal

    from diffkit.roles import DEADLINE_GRACE_S

    (tmp_path / "ref.py").write_text(HANG_REF)
    (tmp_path / "cand.py").write_text(HANG_CAND.format(python_loop=python_loop))
    out = tmp_path / "r.json"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "cli.py"), "diff", str(tmp_path / "ref.py"),
                           str(tmp_path / "cand.py"), "--no-isolate", "--timeout", "3", "--json", str(out),
                           "--no-report"], capture_output=True, text=True, timeout=120)
    took = time.monotonic() - t0
    if python_loop:
        data = json.loads(out.read_text())
        assert proc.returncode == 2 and data["verdict"] == "error", proc.stdout[-2000:] + proc.stderr[-2000:]
        assert data["error"]["side"] == "candidate" and data["error"]["stage"] in ("cand.py:10 in forward",
                                                                                 "cand.py:11 in forward")  # the loop
        assert "did not finish within 3 s" in data["error"]["message"] and took < 3 + 30
    else:
        assert proc.returncode == -signal.SIGALRM and took < 3 + DEADLINE_GRACE_S + 30, (proc.returncode, took)


def test_an_in_process_diff_within_its_timeout_leaves_no_timer_behind(tmp_path):
    """The deadline of a --no-isolate diff run from Python ends with it: no alarm set, SIGALRM's handler as before,
    no watchdog thread left."""
    import signal
    import threading

    from diffkit.cli import main

    (tmp_path / "ref.py").write_text(HANG_REF)
    (tmp_path / "cand.py").write_text(HANG_REF.replace("class Model(", "class ModelNew("))
    def diff(limit="60"):
        with pytest.raises(SystemExit) as e:
            main.main(args=["diff", str(tmp_path / "ref.py"), str(tmp_path / "cand.py"), "--no-isolate", "--timeout",
                            limit, "--no-report", "--trials", "1"], standalone_mode=True)
        return e.value.code

    before = signal.getsignal(signal.SIGALRM)
    try:
        assert diff() == 0
        assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0) and signal.getsignal(signal.SIGALRM) == before
        mine = lambda signum, frame: None  # noqa: E731
        signal.signal(signal.SIGALRM, mine)
        signal.setitimer(signal.ITIMER_REAL, 100)  # a host's own alarm (pytest-timeout's, say): left as it was
        assert diff() == 0
        assert 90 < signal.getitimer(signal.ITIMER_REAL)[0] <= 100 and signal.getsignal(signal.SIGALRM) is mine
        signal.setitimer(signal.ITIMER_REAL, 0)
        assert diff("inf") == 0 and diff("nan") == 0 and diff("1e12") == 0  # (never: as before, no overflow)
        time.sleep(0.05)
        assert not any(t.name == "diffkit-deadline" and t.is_alive() for t in threading.enumerate())
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)


def test_the_answer_is_written_once_by_whoever_claims_it_first():
    """A --no-isolate deadline and the diff itself never both write the answer: the first claim wins; the same
    thread may write again (as before); another thread may not."""
    import threading

    from diffkit.outputs import Outputs as _Outputs

    out = _Outputs(None, None, None, True, None, None, None, False, False)
    assert out.claim() and out.claim()  # (this thread, twice)
    other = []
    t = threading.Thread(target=lambda: other.append(out.claim()))
    t.start()
    t.join()
    assert other == [False]


RAISES_LATER_REF = '''import torch
from torch import nn


class Model(nn.Module):
    def forward(self, x):
        peak = float(x.max())
        if peak > 2.5:  # only some trials' inputs reach it
            raise ValueError(f"out of range: {peak:.3f}")
        return torch.log1p(x.abs())


def get_inputs():
    return [torch.randn(50)]


def get_init_inputs():
    return []
'''


@pytest.mark.parametrize("mode", [[], ["--no-isolate"]], ids=["isolated", "in-process"])
def test_a_reference_raising_on_a_later_trial_is_placed_at_its_line(tmp_path, mode):
    """The reference raising on a later trial (its forward uncaptured there): the error names that trial and the
    line of the reference's file that raised, not '?'."""
    (tmp_path / "ref.py").write_text(RAISES_LATER_REF)
    (tmp_path / "cand.py").write_text(RAISES_LATER_REF.replace("class Model(", "class ModelNew(").replace(
        "raise ValueError", "pass  # raise ValueError"))
    out = run_cli("diff", str(tmp_path / "ref.py"), str(tmp_path / "cand.py"), "--no-report", "--json",
                  str(tmp_path / "r.json"), *mode)
    data = json.loads((tmp_path / "r.json").read_text())
    assert out.returncode == 2 and data["error"]["side"] == "reference", out.stdout[-1500:] + out.stderr[-1500:]
    k = next(t["trial"] for t in data["trials"] if t.get("error"))
    assert k > 1 and data["error"]["stage"] == f"trial {k}'s forward"
    assert data["error"]["message"].endswith("(at ref.py:9 in forward)"), data["error"]["message"]
    assert "ERROR in reference (forward) at trial" in out.stdout
