"""The what-if benchmark (issue 16): forwards and seconds a search spends, and what it names.

    python bench/whatif.py                 # the fused transformer block and triangle update candidates
    python bench/whatif.py --json out.json

For each fused broken candidate (kernels/fused/: the whole model in one extension call) it runs the
diff as a user would (one trial, in this process) and prints how many what-if forwards of the
reference the search ran, how long it took, the variant ranked first and whether it is the planted one.
"""
import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

CASES = ["transformer_block_no_scale.py", "transformer_block_mlp_bias.py", "transformer_block_softmax_axis.py",
         "transformer_block_unbiased_var.py", "triangle_multiplicative_update_swap_ij.py",
         "triangle_multiplicative_update_tail.py", "triangle_multiplicative_update_bf16_sum.py"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--budget", type=int, default=1000)
    a = ap.parse_args()
    import diffkit
    from test_whatif import _expect

    rows = []
    print(f"{'candidate':45s} {'forwards':>8s} {'search s':>9s} {'diff s':>7s}  first-ranked (planted?)")
    for name in CASES:
        path = os.path.join(ROOT, "kernels", "fused", name)
        if not os.path.exists(path):
            continue
        exp = _expect(path)
        t0 = time.perf_counter()
        r = diffkit.diff_files(os.path.join(ROOT, "references", exp["reference"]), path, trials=1,
                               explain_budget=a.budget)
        total = time.perf_counter() - t0
        info = r.meta.get("what_if") or {}
        best = r.what_if[0] if r.what_if else {}
        want = exp.get("what_if") or {}
        names = {n for m in best.get("mutations", []) for n in [m["stage"], *m["aliases"]]}
        hit = bool(best) and best.get("kind") == want.get("kind") and want.get("stage") in names
        rows.append(dict(candidate=name, forwards=info.get("forwards"), search_seconds=info.get("seconds"),
                         diff_seconds=total, best=best, planted=want, ranked_first=hit))
        print(f"{name:45s} {info.get('forwards', 0):8d} {info.get('seconds', 0):9.2f} {total:7.2f}  "
              f"{best.get('kind')} at {best.get('stage')} ({'yes' if hit else 'NO'}; "
              f"max error {best.get('max_abs_after', float('nan')):.3g}, was {best.get('max_abs_before', float('nan')):.3g})")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1, default=str)


if __name__ == "__main__":
    main()
