"""Capture overhead on the transformer-block reference: records per forward, µs per record,
ratio to a plain forward.  Prints a table; `--json PATH` writes the figures.

    python bench/capture_overhead.py [--dim 32 --seq 12 --batch 2] [--repeat 50]
"""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import diffkit  # noqa: E402
from diffkit.load import exec_file  # noqa: E402


def timed(fn, repeat):
    fn()  # warm up
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t0) / repeat


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=12)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    mod = exec_file(os.path.join(os.path.dirname(__file__), "..", "references", "transformer_block.py"), "reference")
    torch.manual_seed(42)
    model = mod.Model(args.dim, args.heads, 4).eval()
    x = torch.randn(args.batch, args.seq, args.dim)
    rows = []

    def plain():
        with torch.no_grad():
            model(x)

    def captured(snapshot):
        def run():
            with torch.no_grad(), diffkit.capture(model, inputs=(x,), snapshot=snapshot):
                model(x)
        return run

    with torch.no_grad(), diffkit.capture(model, inputs=(x,)) as trace:
        model(x)
    n = len(trace)
    t_plain = timed(plain, args.repeat)
    for label, fn in [("metadata only", captured(False)), ("with snapshots", captured(True))]:
        t = timed(fn, args.repeat)
        rows.append({"mode": label, "records": n, "forward_ms": t * 1e3, "plain_ms": t_plain * 1e3,
                     "ratio": t / t_plain, "us_per_record": (t - t_plain) / n * 1e6})
    print(f"transformer block B={args.batch} S={args.seq} D={args.dim}, one thread, torch {torch.__version__}")
    print(f"{'mode':<16} {'records':>7} {'plain ms':>9} {'capture ms':>10} {'ratio':>6} {'µs/record':>10}")
    for r in rows:
        print(f"{r['mode']:<16} {r['records']:>7} {r['plain_ms']:>9.3f} {r['forward_ms']:>10.3f} {r['ratio']:>6.2f} "
              f"{r['us_per_record']:>10.1f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)


if __name__ == "__main__":
    main()
