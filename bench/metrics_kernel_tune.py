"""Time the Triton metric kernels alone on a CUDA device, over their tuning knobs (bench only)."""
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/bench/", 1)[0])
from diffkit import metrics_kernel as K  # noqa: E402


def timed(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    best = 1e9
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


n = (1 << 30) // 4
r = torch.randn(n, device="cuda")
c = r + 1e-6 * torch.randn(n, device="cuda")
copy = timed(lambda: c.copy_(r))
print(f"copy 1 GiB: {copy * 1e3:.2f} ms = {2 * 4 * n / copy / 1e9:.0f} GB/s", flush=True)
print(f"sum of both: {timed(lambda: (r.sum(), c.sum())) * 1e3:.2f} ms", flush=True)
for block, tiles, warps, s64 in [(512, 32, 8, True), (512, 32, 8, False), (256, 64, 8, True), (256, 64, 4, True),
                                  (1024, 16, 16, True), (1024, 16, 8, True), (256, 16, 8, True), (128, 128, 4, True),
                                  (512, 8, 8, True), (256, 64, 8, False)]:
    K.BLOCK, K.TILE_BLOCKS, K.TILE, K.NUM_WARPS, K.LANE_SUMS_64 = block, tiles, block * tiles, warps, s64
    try:
        t = timed(lambda: K.packed_batch([(r, c)], 1e-4, 1e-4))
        print(f"BLOCK {block:5d} tiles {tiles:3d} warps {warps} sums64 {s64!s:5}: {t * 1e3:7.2f} ms "
              f"{2 * 4 * n / t / 1e9:6.0f} GB/s", flush=True)
    except Exception as e:
        print(f"BLOCK {block} tiles {tiles} warps {warps} sums64 {s64}: {type(e).__name__}: {str(e)[:200]}", flush=True)
K.BLOCK, K.TILE_BLOCKS, K.TILE, K.NUM_WARPS, K.LANE_SUMS_64 = 512, 32, 512 * 32, 8, True
for n_small in (1024, 1 << 20, 1 << 24):
    print(f"one pair of {n_small} elements: {timed(lambda: K.packed_batch([(r[:n_small], c[:n_small])], 1e-4, 1e-4)) * 1e3:.3f} ms",
          flush=True)
small = [(torch.randn(1000 + 37 * i, device="cuda"), torch.randn(1000 + 37 * i, device="cuda")) for i in range(400)]
print(f"400 small pairs, one batch: {timed(lambda: K.packed_batch(small, 1e-4, 1e-4)) * 1e3:.2f} ms", flush=True)
