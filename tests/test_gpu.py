"""GPU: every CUDA candidate through `diffkit diff --device cuda` (skipped without a GPU)."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, candidates

CASES = candidates("cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("name,ref,cand,exp", CASES, ids=[c[0] for c in CASES])
def test_cuda_candidate(name, ref, cand, exp, tmp_path):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "cli.py"), "diff", ref, cand, "--device", "cuda",
                          "--json", str(tmp_path / "r.json"), "--no-report", "--timeout", "300"],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    print(out.stdout[-3000:])
    data = json.loads((tmp_path / "r.json").read_text())
    if exp is None:
        assert out.returncode == 0 and data["verdict"] == "match", out.stdout[-2000:]
        return
    if data["verdict"] == "error":
        assert exp.get("kind") is None, data["error"]  # only the overflow may crash the kernel
        return
    fd = data["first_divergence"]
    assert fd is not None and exp["stage"] in (fd["ref_name"], fd["cand_name"]), fd
    if exp.get("kind"):
        kinds = [f["kind"] for f in (data["root_cause"] or fd)["diagnosis"]]
        assert exp["kind"] in kinds, kinds
