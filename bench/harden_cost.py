"""What `--harden` costs: the wall time of a plain `diffkit diff` and of `diffkit diff --harden` on a small
problem, each in fresh processes, both with --no-report, and their ratio (issue 43: on the CPU a --harden
diff of a small problem should cost at most a few times a plain diff).

    python bench/harden_cost.py [--ref REF --cand CAND] [--repeat N] [-- EXTRA DIFF FLAGS]

Default pair: references/hk_tanh_mlp.py against kernels/harden/tanh_mlp_float64.py (a correct candidate, so
the matrix runs every setting to the end).  Each mode runs once unmeasured (to warm caches: extension builds,
the metric kernel) and then REPEAT times; the median is reported, with the matrix's own time from
result.json's harden.seconds.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLI = os.path.join(ROOT, "cli.py")


def run_once(ref: str, cand: str, harden: bool, extra: list[str]) -> tuple[float, int, dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, CLI, "diff", ref, cand, "--no-report", "--json", out, *extra]
        cmd += ["--harden"] if harden else []
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        wall = time.perf_counter() - t0
        data = json.load(open(out)) if os.path.exists(out) else {}
        if not data:
            sys.stderr.write(proc.stdout[-2000:] + proc.stderr[-2000:])
        return wall, proc.returncode, data


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref", default=os.path.join(ROOT, "references", "hk_tanh_mlp.py"))
    ap.add_argument("--cand", default=os.path.join(ROOT, "kernels", "harden", "tanh_mlp_float64.py"))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("extra", nargs="*", help="further flags for both diffs (after --)")
    a = ap.parse_args()
    times: dict[bool, list[float]] = {False: [], True: []}
    last: dict[bool, tuple[int, dict]] = {}
    for harden in (False, True):
        run_once(a.ref, a.cand, harden, a.extra)  # warm-up, not measured
    for _ in range(a.repeat):
        for harden in (False, True):  # interleaved, so that load on the machine hits both alike
            wall, rc, data = run_once(a.ref, a.cand, harden, a.extra)
            times[harden].append(wall)
            last[harden] = (rc, data)
    plain, hard = statistics.median(times[False]), statistics.median(times[True])
    rc_h, data_h = last[True]
    h = data_h.get("harden") or {}
    print(f"pair: {os.path.relpath(a.ref, ROOT)} vs {os.path.relpath(a.cand, ROOT)} ({a.repeat} runs each, median)")
    print(f"plain diff       : {plain:7.2f} s  (exit {last[False][0]}, verdict {last[False][1].get('verdict')})")
    matrix = h.get("seconds", float("nan"))
    print(f"diff --harden    : {hard:7.2f} s  (exit {rc_h}, verdict {data_h.get('verdict')}, "
          f"harden {h.get('verdict')}, {len(h.get('settings') or [])} settings, matrix {matrix:.2f} s)")
    print(f"ratio            : {hard / plain:7.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
