"""Does the isolated diff's one child running both sides answer as a child per side does?

    python bench/one_child_equiv.py kernels/fused/*.py                 # CPU candidates
    python bench/one_child_equiv.py --device cuda kernels/fused/*cuda*.py

Each candidate is diffed twice through the CLI, as a user runs it (`diffkit diff REF CAND --no-report --json`):
once as it is (one child for the whole diff, a child per side only if that one fails) and once with
DIFFKIT_TWO_PROCESSES=1 (a child per side from the start).  The reference is the candidate's DIFFKIT_EXPECT
"reference" when it names one, else the reference whose file name is the longest prefix of the candidate's.
Prints, per candidate, both wall times and whether the answers agree (verdict, first divergence, root cause,
every stage's pairing, status and error, the trials, the findings, the error's side and phase): "same", or
"numbers" when only the errors differ (a race, an unwritten region: each run reads other values), else
"DIFFERENT"; exits 1 if any is.  --json FILE keeps every answer.
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


def answer(d: dict, numbers: bool = True) -> tuple:
    """What a user reads off a result, without timings and the processes it ran in (`numbers`: with every
    stage's and trial's errors; without them, what stays put when a candidate computes otherwise each run)."""
    stages = [(s["ref_name"], s["cand_name"], s["paired_by"], s["status"]) + ((s["max_abs"], s["mean_abs"])
                                                                              if numbers else ())
              for s in d.get("stages", [])]
    fd, rc, err = d.get("first_divergence"), d.get("root_cause"), d.get("error")
    trials = [(t.get("trial"), t.get("seed"), t.get("allclose")) + ((t.get("max_abs"),) if numbers else ())
              for t in d.get("trials", [])]
    return (d.get("verdict"), fd and fd.get("ref_name"), rc and rc.get("ref_name"), stages, trials,
            sorted(f.get("kind", "") for f in d.get("findings", [])), err and (err.get("side"), err.get("phase")))


def diff_once(ref: str, cand: str, device: str | None, two: bool, tmp: str) -> tuple[dict, float, int]:
    out = os.path.join(tmp, "r.json")
    if os.path.exists(out):
        os.remove(out)
    env = dict(os.environ)
    env.pop("DIFFKIT_TWO_PROCESSES", None)
    if two:
        env["DIFFKIT_TWO_PROCESSES"] = "1"
    cmd = [sys.executable, "-m", "diffkit.cli", "diff", ref, cand, "--no-report", "--json", out]
    if device:
        cmd += ["--device", device]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    took = time.perf_counter() - t0
    try:
        d = json.load(open(out, encoding="utf-8"))
    except (OSError, ValueError):
        d = {"verdict": None, "stdout": p.stdout[-2000:], "stderr": p.stderr[-2000:]}
    return d, took, p.returncode


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("candidates", nargs="+")
    ap.add_argument("--device", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    differ, rows = 0, []
    with tempfile.TemporaryDirectory() as tmp:
        for cand in args.candidates:
            name = os.path.basename(cand)
            if name.startswith("_"):
                continue
            ref = reference_of(os.path.abspath(cand))
            if ref is None:
                print(f"{cand}: no reference found, skipped")
                continue
            one, t1, c1 = diff_once(ref, os.path.abspath(cand), args.device, False, tmp)
            two, t2, c2 = diff_once(ref, os.path.abspath(cand), args.device, True, tmp)
            same = answer(one) == answer(two) and c1 == c2
            # (a race or an unwritten region reads other values each run: the same answer, other numbers)
            alike = same or (answer(one, False) == answer(two, False) and c1 == c2)
            differ += not alike
            word = "same     " if same else "numbers  " if alike else "DIFFERENT"
            print(f"{word} {os.path.relpath(cand, ROOT):60s} {one.get('verdict')!s:9s} "
                  f"exit {c1}/{c2}  one child {t1:6.2f} s ({(one.get('meta') or {}).get('processes')})  "
                  f"a child per side {t2:6.2f} s", flush=True)
            rows.append({"candidate": os.path.relpath(cand, ROOT), "same": same, "alike": alike, "seconds_one": t1, "seconds_two": t2,
                         "exit": [c1, c2], "one": one, "two": two})
    print(f"{len(rows)} candidates, {differ} answered differently, "
          f"{sum(r['alike'] and not r['same'] for r in rows)} with the same answer in other numbers")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(rows, fh)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
