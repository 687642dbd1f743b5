import ast
import os
import re
import runpy
import subprocess
import sys

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
    """`diffkit.diff_files(ref, cand)` with the default options, run once per (ref, cand) in this process.

    Several files ask the same question of the same pair and only read the answer: test_diff (first divergence),
    test_rootcause (root cause and diagnosis), test_pipeline (the in-process surface), test_protocol (KernelBench's
    verdict) on kernels/; test_fused and test_whatif (the what-if search, the costliest part) on kernels/fused/. They share one Result; their
    parameters carry `same_pair(cand)`, so that under xdist they run on the same worker."""
    if (ref, cand) not in _DIFFS:
        import diffkit

        _DIFFS[ref, cand] = diffkit.diff_files(ref, cand)
    return _DIFFS[ref, cand]


def same_pair(cand):
    """The xdist group of the tests that read `diff_once(..., cand)`."""
    return pytest.mark.xdist_group(f"diff of {os.path.relpath(cand, ROOT)}")


def run_cli(*args, cwd=ROOT, env=None, timeout=600, **kw) -> subprocess.CompletedProcess:
    """`python cli.py ARGS` (= `diffkit ARGS`) in a fresh interpreter, its output captured as text.

    cwd: the repository root unless given. env: variables set (or replaced) over the current environment,
    read at the call (a monkeypatched variable reaches the child). timeout: seconds before
    subprocess.TimeoutExpired (a hung child fails its test rather than the whole run). Other keyword arguments
    go to subprocess.run."""
    return subprocess.run([sys.executable, CLI, *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          env=None if env is None else {**os.environ, **env}, timeout=timeout, **kw)


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
