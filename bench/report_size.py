"""How long a report takes and how large it is for a model with big activations.

    python bench/report_size.py [--side 1024] [--batch 8]
"""
import argparse
import os
import sys
import tempfile
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import diffkit  # noqa: E402
from diffkit.report import write_report  # noqa: E402


class Ref(nn.Module):
    def forward(self, x):
        h = torch.tanh(x)
        g = h * 2.0 + 1.0
        return torch.sigmoid(g)


class Cand(nn.Module):
    def forward(self, x):
        h = torch.tanh(x)
        g = h * 2.0 + 1.0
        g[..., -7:, :] = 0.0  # an unwritten tail
        return torch.sigmoid(g)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--side", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    x = torch.randn(args.batch, args.side, args.side)
    t0 = time.perf_counter()
    result = diffkit.compare(Ref(), Cand(), [x])
    t1 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        paths = write_report(result, d)
        t2 = time.perf_counter()
        sizes = {k: os.path.getsize(p) for k, p in paths.items()}
    mb = x.numel() * 4 / 2 ** 20
    print(f"activation {args.batch}×{args.side}×{args.side} float32 = {mb:.0f} MiB per tensor, "
          f"{len(result.stages)} stages, verdict {result.verdict}")
    print(f"compare {t1 - t0:.2f} s; report {t2 - t1:.2f} s; sizes: "
          + ", ".join(f"{k} {v / 1024:.0f} KiB" for k, v in sizes.items()))


if __name__ == "__main__":
    main()
