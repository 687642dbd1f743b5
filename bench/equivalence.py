"""Before/after check of a change that must keep behaviour: every bundled candidate diffed through the CLI by two
trees of diffkit, their answers compared.

    python bench/equivalence.py record --tree /path/to/old/clone --out before.json [CANDIDATES...]
    python bench/equivalence.py record --tree . --out after.json
    python bench/equivalence.py compare before.json after.json

`record` runs `python -m diffkit.cli diff REF CAND --no-report --json F` from inside the tree (so that tree's
package is the one imported) for each candidate (default: kernels/*.py, kernels/corpus/*.py, kernels/fused/*.py,
the CPU ones: CUDA/Triton files are skipped without a GPU), with the reference named by the candidate's
DIFFKIT_EXPECT or the longest reference file name that prefixes the candidate's.  `compare` prints one line per
candidate: "same", "numbers" (only the errors differ: a race or an unwritten region reads other values each run),
or "DIFFERENT" with the fields that differ; exits 1 if any differs.
"""
import argparse
import ast
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def reference_of(cand: str) -> str | None:
    refs = {os.path.basename(p)[:-3]: p for p in glob.glob(os.path.join(ROOT, "references", "*.py"))}
    try:
        tree = ast.parse(open(cand, encoding="utf-8").read())
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "DIFFKIT_EXPECT" for t in node.targets):
                named = ast.literal_eval(node.value).get("reference")
                if named:
                    return os.path.join(ROOT, "references", named)
    except (SyntaxError, ValueError, OSError):
        pass
    stem = os.path.basename(cand)[:-3]
    best = max((r for r in refs if stem.startswith(r)), key=len, default=None)
    return refs.get(best)


def needs_gpu(path: str) -> bool:
    text = open(path, encoding="utf-8").read()
    name = os.path.basename(path)
    return "cuda" in name or "triton" in name or "import triton" in text or "cuda_sources" in text


def answer(d: dict) -> dict:
    """What a user reads off a result, without timings: split into fields so a difference names them."""
    fd, rc, err = d.get("first_divergence"), d.get("root_cause"), d.get("error")
    diag = lambda s: sorted(x.get("kind", "") for x in (s or {}).get("diagnosis", []) or [])  # noqa: E731
    return {
        "verdict": d.get("verdict"),
        "first_divergence": fd and (fd.get("ref_name"), fd.get("cand_name")),
        "root_cause": rc and rc.get("ref_name"),
        "diagnosis": (diag(fd), diag(rc)),
        "what_if": [(w.get("kind"), w.get("stage")) for w in (d.get("what_if") or [])[:3]],
        "findings": sorted(f.get("kind", "") for f in d.get("findings", [])),
        "error": err and (err.get("side"), err.get("phase")),
        "stages": [(s["ref_name"], s["cand_name"], s["paired_by"], s["status"]) for s in d.get("stages", [])],
        "trials": [(t.get("trial"), t.get("seed"), t.get("allclose")) for t in d.get("trials", [])],
        "numbers": [(s["max_abs"], s["mean_abs"]) for s in d.get("stages", [])],
    }


def record(args) -> int:
    cands = args.candidates or sorted(glob.glob(os.path.join(ROOT, "kernels", "*.py")) +
                                      glob.glob(os.path.join(ROOT, "kernels", "corpus", "*.py")) +
                                      glob.glob(os.path.join(ROOT, "kernels", "fused", "*.py")))
    cands = [c for c in cands if not os.path.basename(c).startswith("_")]
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for cand in cands:
            name = os.path.relpath(os.path.abspath(cand), ROOT)
            ref = reference_of(cand)
            if ref is None:
                continue
            if not args.gpu and needs_gpu(cand):
                continue
            f = os.path.join(tmp, "r.json")
            if os.path.exists(f):
                os.remove(f)
            cmd = [sys.executable, "-m", "diffkit.cli", "diff", os.path.abspath(ref), os.path.abspath(cand),
                   "--no-report", "--json", f, *args.extra]
            t0 = time.perf_counter()
            p = subprocess.run(cmd, cwd=os.path.abspath(args.tree), capture_output=True, text=True)
            took = time.perf_counter() - t0
            try:
                d = json.load(open(f, encoding="utf-8"))
            except (OSError, ValueError):
                d = {"verdict": None}
            out[name] = {"rc": p.returncode, "seconds": round(took, 2), "answer": answer(d),
                         "tail": (p.stdout + p.stderr)[-600:] if d.get("verdict") is None else ""}
            print(f"{took:6.1f}s rc={p.returncode} {d.get('verdict')!s:9} {name}", flush=True)
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(out, fh, indent=1)
    return 0


def compare(args) -> int:
    a, b = json.load(open(args.before)), json.load(open(args.after))
    bad = 0
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            print(f"MISSING  {name} ({'after' if name in a else 'before'} has no answer)")
            bad += 1
            continue
        x, y = a[name], b[name]
        fields = [k for k in x["answer"] if k != "numbers" and x["answer"][k] != y["answer"].get(k)]
        if x["rc"] != y["rc"]:
            fields.insert(0, "rc")
        if fields:
            bad += 1
            print(f"DIFFERENT {name}: " + "; ".join(f"{k}: {x['answer'].get(k, x.get(k))!r} -> "
                                                    f"{y['answer'].get(k, y.get(k))!r}"[:400] for k in fields))
        elif x["answer"]["numbers"] != y["answer"]["numbers"]:
            print(f"numbers   {name}")
        else:
            print(f"same      {name}  ({x['seconds']:.1f}s -> {y['seconds']:.1f}s)")
    print(f"{len(set(a) | set(b))} candidates, {bad} differ")
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("--tree", default=ROOT)
    r.add_argument("--out", required=True)
    r.add_argument("--gpu", action="store_true", help="also the CUDA/Triton candidates")
    r.add_argument("--extra", nargs="*", default=[], help="more flags for every diff")
    r.add_argument("candidates", nargs="*")
    c = sub.add_parser("compare")
    c.add_argument("before")
    c.add_argument("after")
    args = ap.parse_args()
    return record(args) if args.cmd == "record" else compare(args)


if __name__ == "__main__":
    sys.exit(main())
