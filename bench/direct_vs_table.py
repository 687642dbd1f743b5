"""The CUDA metric kernel's two ways to read a pair, timed: a launch of its own (tensors passed directly) or through
the batch's address table (one launch for the batch), for batches of equal pairs of several sizes.

    python bench/direct_vs_table.py
"""
import statistics
import sys
import time
import os

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

from diffkit import metrics_kernel as K  # noqa: E402


def timed(pairs, direct_min, repeat=7):
    K.DIRECT_MIN = direct_min
    K.packed_batch(pairs, 1e-4, 1e-4)
    torch.cuda.synchronize()
    ts = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        K.packed_batch(pairs, 1e-4, 1e-4).cpu()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main():
    budget = 8 << 30  # bytes of pairs a batch
    for n in (1 << 18, 1 << 20, 1 << 22, 1 << 24, 1 << 26, 1 << 28):
        count = max(1, min(256, budget // (8 * n)))
        base = torch.randn(count, n, device="cuda")
        pairs = [(base[i], base[i] + 1e-6) for i in range(count)]
        pairs = [(r, c.contiguous()) for r, c in pairs]
        b = 2 * 4 * n * count
        d, t = timed(pairs, 1), timed(pairs, 1 << 62)
        print(f"{count:4d} pairs of {n:>10d}: direct {d * 1e3:7.2f} ms = {b / d / 1e9:6.0f} GB/s   table {t * 1e3:7.2f} ms "
              f"= {b / t / 1e9:6.0f} GB/s", flush=True)
        del base, pairs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
