"""`diffkit diff --harden` on its proving ground (issue 43), through the CLI exactly as a user runs it.

kernels/harden/ holds candidates that pass KernelBench's check at default settings (verdict `match`) and are
wrong in a way only another setting shows, written unlike the bundled ones; their references are
references/hk_*.py.  Each declares
    DIFFKIT_EXPECT = {"reference": "hk_x.py", "harden": "init" | "inputs" | "shape", "stage": "<reference stage>"}
(the setting kind that must break it and the first wrong stage there, named as `diffkit capture REF` names it),
or {"reference": …, "finding": "input_independent", "input": "<name>", "index": i} (the reference ignores that
input), or {"reference": …, "harden": None} (correct: `robust`).

Then every correct candidate of kernels/, kernels/corpus/ and kernels/fused/ must be `robust` (no false alarm),
with one KernelBench trial to keep it cheap; the GPU ones are marked `cuda` (skipped without a GPU).  The one
exception is a true finding, not a false alarm (SHAPE_BOUND): a candidate correct at the benchmark's sizes
that assumes one of them; it must break under `shape` only, and say why.
"""
import json
import os

import pytest

from conftest import KERNELS, REFS, candidates, expectation, run_cli

HARDEN = os.path.join(KERNELS, "harden")
BREAKS = ("diverged", "error")

# Correct at the benchmark's sizes, not at others: what --harden must find (under `shape` only), and why.
SHAPE_BOUND = {
    "kernels/row_softmax_fused.py": "views each row as 16 equal blocks (e.view(B, 16, -1)): dim must be a multiple "
                                    "of 16",
}


def _harden_cases():
    out = []
    for name in sorted(os.listdir(HARDEN)):
        if name.endswith(".py") and not name.startswith("_"):
            exp = expectation(os.path.join(HARDEN, name))
            assert exp is not None, f"{name} declares no DIFFKIT_EXPECT"
            out.append(pytest.param(name, exp, id=name[:-3]))
    return out


def _diff(ref, cand, tmp_path, *extra):
    """`python cli.py diff REF CAND --harden --no-report --json F EXTRA…` from the repository root."""
    out = tmp_path / "result.json"
    args = ["diff", ref, cand, "--harden", "--no-report", "--json", str(out), *extra]
    proc = run_cli(*args, timeout=900)
    log = f"$ python cli.py {' '.join(map(str, args))}\n{proc.stdout[-6000:]}\n{proc.stderr[-4000:]}"
    assert out.exists(), f"no result.json (exit {proc.returncode})\n{log}"
    return proc.returncode, json.loads(out.read_text()), log


def _names(data, entry):
    """The names a setting's first divergence answers to: its ref_name and cand_name, plus the aliases of the
    reference record of the default run's stage of that name (the output's aliases include the module that
    made it, e.g. `act`)."""
    names = {entry.get("ref_name"), entry.get("cand_name")}
    for row in data.get("stages") or []:
        if row.get("ref_name") and row.get("ref_name") == entry.get("ref_name"):
            names.update((row.get("ref") or {}).get("aliases") or [])
    return {n for n in names if n}


def _describe(settings):
    return "\n".join(f"  {s['kind']:<9} {s['name']}: {s['verdict']} max_abs={s.get('max_abs')} "
                     f"first={(s.get('first_divergence') or {}).get('ref_name')} "
                     f"error={s.get('error')} note={s.get('note')}" for s in settings)


@pytest.mark.parametrize("name,exp", _harden_cases())
def test_harden_proving_ground(name, exp, tmp_path):
    rc, data, log = _diff(os.path.join(REFS, exp["reference"]), os.path.join(HARDEN, name), tmp_path)
    assert data["verdict"] == "match", f"KernelBench's verdict must stay match at default settings\n{log}"
    h = data.get("harden")
    assert h is not None, f"result.json has no harden object\n{log}"
    settings = h["settings"]
    assert settings, f"no setting ran\n{log}"
    table = _describe(settings)
    breaking = [s for s in settings if s["verdict"] in BREAKS]

    if "finding" in exp:
        found = [f for f in h["findings"] if f["kind"] == exp["finding"]]
        assert found, f"no {exp['finding']} finding: {h['findings']}\n{table}\n{log}"
        wanted = (exp["input"], f"inputs[{exp['index']}]", f"input {exp['index']}")
        assert any(w in f["detail"] for f in found for w in wanted), \
            f"the finding does not name the input ({wanted}): {found}"
        return

    if exp["harden"] is None:
        assert h["verdict"] == "robust", f"a correct candidate is not robust:\n{table}\n{log}"
        assert not breaking and rc == 0, f"{table}\n{log}"
        return

    assert h["verdict"] == "breaks", f"--harden missed it:\n{table}\n{log}"
    assert rc == 1, f"--harden with a breaking setting exits 1 (got {rc})\n{log}"
    kinds = {s["kind"] for s in breaking}
    assert kinds == {exp["harden"]}, f"expected only {exp['harden']} settings to break it, got {sorted(kinds)}\n{table}"
    for s in breaking:
        assert s["first_divergence"] is not None or s["error"], f"a breaking setting says neither where nor why: {s}"
        if s["first_divergence"] is not None:
            names = _names(data, s["first_divergence"])
            assert exp["stage"] in names, \
                f"{s['name']}: expected first wrong stage {exp['stage']}, got {sorted(names)}\n{table}"
    assert any(s["first_divergence"] is not None for s in breaking), f"no breaking setting names a stage\n{table}"


def _correct_everywhere():
    """(id, reference, candidate, on_gpu) for every correct candidate of kernels/, kernels/corpus/, kernels/fused/."""
    out = []
    for device in ("cpu", "cuda"):
        for name, ref, cand, exp in candidates(device):
            if exp is None:
                out.append((f"kernels/{name}", ref, cand, device == "cuda"))
    for folder in ("corpus", "fused"):
        root = os.path.join(KERNELS, folder)
        for name in sorted(os.listdir(root)):
            if not name.endswith(".py") or name.startswith("_"):
                continue
            exp = expectation(os.path.join(root, name)) or {}
            if exp.get("verdict") != "match":
                continue
            gpu = exp.get("device") == "cuda" or "_cuda" in name or "_triton" in name
            out.append((f"{folder}/{name}", os.path.join(REFS, exp["reference"]), os.path.join(root, name), gpu))
    return [pytest.param(r, c, g, i, id=i, marks=[pytest.mark.cuda] if g else []) for i, r, c, g in out]


@pytest.mark.parametrize("ref,cand,gpu,key", _correct_everywhere())
def test_correct_candidates_are_robust(ref, cand, gpu, key, tmp_path):
    rc, data, log = _diff(ref, cand, tmp_path, "--trials", "1", *(["--device", "cuda"] if gpu else []))
    assert data["verdict"] == "match", log
    h = data["harden"]
    table = _describe(h["settings"])
    if key in SHAPE_BOUND:  # a true finding: it breaks, under shape only, and the setting says so plainly
        breaking = [s for s in h["settings"] if s["verdict"] in BREAKS]
        assert h["verdict"] == "breaks" and rc == 1, f"{SHAPE_BOUND[key]}, yet:\n{table}\n{log}"
        assert {s["kind"] for s in breaking} == {"shape"}, f"{SHAPE_BOUND[key]}; only shape may break it:\n{table}"
        assert all(s["error"] or s["first_divergence"] for s in breaking), table
        return
    assert h["verdict"] == "robust", f"a correct candidate is not robust:\n{table}\n{log}"
    assert rc == 0, log
