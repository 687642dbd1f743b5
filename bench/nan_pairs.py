"""The metric passes' worst case for re-measuring marked tiles: candidates full of NaN (or Inf), against clean ones,
through `measure.measure_many` on the GPU. Every tile of an all-NaN candidate is marked for the exact second pass, so
this times that pass at its largest.

    python bench/nan_pairs.py                       # this tree's diffkit
    python bench/nan_pairs.py --tree OLD_CHECKOUT   # another tree's diffkit, the same pairs

Prints, per case, the median time of one `measure_many` call over the pairs (results fetched) and the bytes read
per second; the first pair's stats are checked against torch's counts (the candidate's NaNs and infinities, and
mismatches as `torch.isclose` counts them) so a fast wrong answer shows.
"""
import argparse
import os
import statistics
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ap.add_argument("--pairs", type=int, default=24, help="pairs per call")
    ap.add_argument("--numel", type=int, default=4 << 20, help="elements per pair (float32)")
    ap.add_argument("--repeat", type=int, default=7)
    a = ap.parse_args()
    sys.path.insert(0, os.path.abspath(a.tree))
    import torch

    from diffkit import measure

    g = torch.Generator(device="cuda").manual_seed(0)
    refs = [torch.randn(a.numel, device="cuda", generator=g) for _ in range(a.pairs)]
    cases = {
        "clean": [r + 1e-7 for r in refs],
        "all NaN": [torch.full_like(r, float("nan")) for r in refs],
        "NaN every 4096th": [_every(r, 4096, float("nan")) for r in refs],
        "all +Inf": [torch.full_like(r, float("inf")) for r in refs],
        "half NaN, one pair": [_half_nan(refs[0])] + [r.clone() for r in refs[1:]],
    }
    nbytes = 2 * a.pairs * a.numel * 4
    print(f"diffkit from {a.tree}; {a.pairs} pairs x {a.numel} float32 = {nbytes / 1e9:.2f} GB read a call")
    for name, cands in cases.items():
        items = [(r, c, 1e-2, 1e-2) for r, c in zip(refs, cands)]
        first = [p.result() for p in measure.measure_many(items)]  # compile, first touch
        times = []
        for _ in range(a.repeat):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            got = [p.result() for p in measure.measure_many(items)]
            times.append(time.perf_counter() - t0)
        s = statistics.median(times)
        want = _torch_counts(refs[0], cands[0], 1e-2, 1e-2)
        have = [(st.cand_nan, st.cand_inf, st.mismatches) for st in (first[0], got[0])]
        ok = all(h == want for h in have)
        print(f"  {name:<20s} {s * 1e3:8.2f} ms  {nbytes / s / 1e9:6.0f} GB/s  first pair (NaN, Inf, mismatches): "
              f"{have[1]} (torch {want}) {'ok' if ok else 'WRONG'}", flush=True)


def _torch_counts(r, c, atol, rtol):
    """The candidate's NaN and infinity counts and the mismatches as torch.isclose counts them (NaN never close)."""
    import torch

    return (int(torch.isnan(c).sum()), int(torch.isinf(c).sum()),
            int((~torch.isclose(c, r, rtol=rtol, atol=atol)).sum()))


def _every(r, step, value):
    c = r.clone()
    c[::step] = value
    return c


def _half_nan(r):
    c = r.clone()
    c[: r.numel() // 2] = float("nan")
    return c


if __name__ == "__main__":
    main()
