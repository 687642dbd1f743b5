import ast
import os
import re
import runpy
import subprocess
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REFS = os.path.join(ROOT, "references")
KERNELS = os.path.join(ROOT, "kernels")
CLI = os.path.join(ROOT, "cli.py")
sys.path.insert(0, ROOT)


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (the default, see pyproject.toml): a worker per CPU this process may use (its affinity mask and
    cgroup quota), not per physical core as xdist's psutil-based guess does (a 2-vCPU machine of one
    hyper-threaded core would get one worker). PYTEST_XDIST_AUTO_NUM_WORKERS still overrides it."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS", "").isdigit():
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        with open("/sys/fs/cgroup/cpu.max", encoding="ascii") as fh:
            quota, period = fh.read().split()
        if quota != "max":
            cpus = min(cpus, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return max(1, cpus)


@pytest.hookimpl(tryfirst=True)  # (before xdist's worker reads the xdist_group marks)
def pytest_collection_modifyitems(config, items):
    skip = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if skip is not None and "cuda" in item.keywords:
            item.add_marker(skip)
        # Under xdist (--dist loadgroup), the tests that share a module- or class-scoped fixture run on one worker,
        # in their order: the fixture is made once, as in a run without xdist, and a test that reads what an
        # earlier one left in it (test_sanitize's `result`) sees it.
        defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
        if any(d and d[-1].scope in ("module", "class") for d in defs.values()) and \
                item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(f"fixtures of {item.nodeid.split('::')[0]}"))


_DIFFS = {}


def diff_once(ref, cand):
    """`diffkit.diff_files(ref, cand)` with the default options but no wall-time limit on the what-if search,
    run once per (ref, cand) in this process.

    Several files ask the same question of the same pair and only read the answer: test_diff (first divergence),
    test_rootcause (root cause and diagnosis), test_pipeline (the in-process surface), test_protocol (KernelBench's
    verdict) on kernels/; test_fused and test_whatif (the what-if search, the costliest part) on kernels/fused/. They share one Result; their
    parameters carry `same_pair(cand)`, so that under xdist they run on the same worker."""
    if (ref, cand) not in _DIFFS:
        import diffkit

        # (no wall-time limit on the what-if search: its forward budget bounds it, and what it finds must not
        # depend on how loaded the machine is; the time limit has tests of its own in test_whatif)
        _DIFFS[ref, cand] = diffkit.diff_files(ref, cand, explain_seconds=0)
    return _DIFFS[ref, cand]


def same_pair(cand):
    """The xdist group of the tests that read `diff_once(..., cand)`."""
    return pytest.mark.xdist_group(f"diff of {os.path.relpath(cand, ROOT)}")


_ZYGOTE: dict = {}
_FAST_ENV = ("DIFFKIT_", "TMPDIR")  # variables a forked run may be given (read at the call, not at import)


def _zygote():
    """The worker's tests/cli_zygote.py process (started on first use; it ends when this process does)."""
    z = _ZYGOTE.get("proc")
    if z is None or z.poll() is not None:
        r, w = os.pipe()
        z = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "cli_zygote.py"), str(w)], cwd=ROOT,
                             stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, pass_fds=(w,))
        os.close(w)
        _ZYGOTE.update(proc=z, replies=os.fdopen(r, "rb", buffering=0), pending=b"")
    return z


def _reply(timeout: float | None) -> str | None:
    """The zygote's next answer line, None past `timeout` seconds."""
    import select

    fh, deadline = _ZYGOTE["replies"], None if timeout is None else time.monotonic() + timeout
    while b"\n" not in _ZYGOTE["pending"]:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not select.select([fh], [], [], left)[0]:
            return None
        chunk = os.read(fh.fileno(), 4096)
        if not chunk:
            raise RuntimeError("the CLI zygote (tests/cli_zygote.py) died")
        _ZYGOTE["pending"] += chunk
    line, _ZYGOTE["pending"] = _ZYGOTE["pending"].split(b"\n", 1)
    return line.decode()


def _forked_cli(args, cwd, env, timeout) -> subprocess.CompletedProcess:
    import json
    import signal
    import tempfile

    with tempfile.TemporaryDirectory(prefix="run-cli-") as d:
        out, err = os.path.join(d, "out"), os.path.join(d, "err")
        z = _zygote()
        z.stdin.write((json.dumps({"args": args, "cwd": str(cwd), "env": env, "out": out, "err": err}) + "\n")
                      .encode())
        z.stdin.flush()
        pid = int(_reply(60).split()[1])
        line = _reply(timeout)
        if line is None:
            os.kill(pid, signal.SIGKILL)
            _reply(None)
        texts = [open(p, encoding="utf-8", errors="replace").read() for p in (out, err)]
        cmd = [sys.executable, CLI, *args]
        if line is None:
            raise subprocess.TimeoutExpired(cmd, timeout, texts[0], texts[1])
        code = os.waitstatus_to_exitcode(int(line.split()[1]))
        return subprocess.CompletedProcess(cmd, code, texts[0], texts[1])


def run_cli(*args, cwd=ROOT, env=None, timeout=600, fresh=False, **kw) -> subprocess.CompletedProcess:
    """`python cli.py ARGS` (= `diffkit ARGS`) in a process of its own, its output captured as text.

    cwd: the repository root unless given. env: variables set (or replaced) over the current environment,
    read at the call (a monkeypatched variable reaches the child). timeout: seconds before
    subprocess.TimeoutExpired (a hung child fails its test rather than the whole run).

    The process is forked from tests/cli_zygote.py, which has imported torch and the CLI already (1.5-2 s a
    run saved); `fresh=True`, other keyword arguments (they go to subprocess.run) or variables other than
    DIFFKIT_* and TMPDIR in `env` (PYTHONPATH, torch's own: read at import) start a new interpreter instead."""
    args = [str(a) for a in args]
    if not fresh and not kw and all(k.startswith(_FAST_ENV) for k in env or ()) and hasattr(os, "fork"):
        return _forked_cli(args, cwd, {**os.environ, **(env or {})}, timeout)
    return subprocess.run([sys.executable, CLI, *args], capture_output=True, text=True, cwd=cwd,
                          env=None if env is None else {**os.environ, **env}, timeout=timeout, **kw)


def check_what_if(result, exp: dict) -> None:
    """A broken fused candidate's Result names its planted mistake first (`exp`: its DIFFKIT_EXPECT): the best what-if
    reproduces the candidate, is of the planted kind, and plants it at the planted stage (alone, or made again
    wherever the fused kernel repeats the same code; at that stage or at a record inside that module)."""
    assert result.verdict == "diverged", result.summary_line()
    want = exp["what_if"]
    assert result.what_if, result.meta.get("what_if")
    best = result.what_if[0]
    top = [(w["kind"], w["stage"], w["max_abs_after"]) for w in result.what_if[:4]]
    assert best["explains"], top
    names = {n for m in best["mutations"] for n in [m["stage"], *m["aliases"]]}
    assert best["kind"] == want["kind"], top
    assert any(n == want["stage"] or n.startswith(want["stage"] + ".") for n in names), top
    assert best["max_abs_after"] <= best["max_abs_before"]


def expectation(path):
    """The DIFFKIT_EXPECT dict a broken candidate declares (read without running the file)."""
    for node in ast.parse(open(path, encoding="utf-8").read()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "DIFFKIT_EXPECT":
            return ast.literal_eval(node.value)
    return None


def candidates(device="cpu"):
    """(name, reference, candidate, expectation) for every candidate in kernels/ that runs on `device`
    (GPU candidates are the files named *_cuda* or *_triton*)."""
    out = []
    for name in sorted(os.listdir(KERNELS)):
        if not name.endswith(".py") or name in ("cpu_ops.py", "cuda_ops.py") or name.startswith("_"):
            continue
        if ("_cuda" in name or "_triton" in name) != (device == "cuda"):
            continue
        path = os.path.join(KERNELS, name)
        exp = expectation(path)
        ref = exp["reference"] if exp else re.sub(r"_(cpp|cuda|fused|triton)\.py$", ".py", name)
        out.append((name, os.path.join(REFS, ref), path, exp))
    return out


@pytest.fixture(scope="session")
def ops():
    return runpy.run_path(os.path.join(KERNELS, "cpu_ops.py"))["load"]()
