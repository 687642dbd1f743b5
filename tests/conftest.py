import ast
import os
import re
import runpy
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REFS = os.path.join(ROOT, "references")
KERNELS = os.path.join(ROOT, "kernels")
sys.path.insert(0, ROOT)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


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
