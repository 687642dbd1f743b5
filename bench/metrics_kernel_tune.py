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
shipped = (K.BLOCK, K.TILE_BLOCKS, K.NUM_WARPS, K.LANE_SUMS_64, K.FAST)
K.FAST = False
ref_vec = K.packed_batch([(r, c)], 1e-4, 1e-4).cpu()
for block, tiles, warps, s64, fast in [
        (128, 128, 4, True, False), (128, 128, 4, False, True), (256, 64, 4, False, True),
        (256, 64, 2, False, True), (256, 128, 2, False, True), (256, 32, 2, False, True), (512, 32, 2, False, True),
        (512, 32, 4, False, True), (128, 128, 1, False, True), (128, 256, 1, False, True), (1024, 16, 4, False, True)]:
    K.BLOCK, K.TILE_BLOCKS, K.TILE, K.NUM_WARPS, K.LANE_SUMS_64, K.FAST = block, tiles, block * tiles, warps, s64, fast
    try:
        t = timed(lambda: K.packed_batch([(r, c)], 1e-4, 1e-4))
        got = K.packed_batch([(r, c)], 1e-4, 1e-4).cpu()
        same = f"{float(((got - ref_vec).abs() / ref_vec.abs().clamp_min(1e-300)).max()):.1e}"  # largest rel. change
        print(f"BLOCK {block:5d} tiles {tiles:3d} warps {warps} sums64 {s64!s:5} fast {fast!s:5}: "
              f"{t * 1e3:7.2f} ms {2 * 4 * n / t / 1e9:6.0f} GB/s  same={same}", flush=True)
    except Exception as e:
        print(f"BLOCK {block} tiles {tiles} warps {warps} sums64 {s64} fast {fast}: "
              f"{type(e).__name__}: {str(e)[:300]}", flush=True)
K.BLOCK, K.TILE_BLOCKS, K.NUM_WARPS, K.LANE_SUMS_64, K.FAST = shipped
K.TILE = K.BLOCK * K.TILE_BLOCKS
for n_small in (1024, 1 << 20, 1 << 24):
    print(f"one pair of {n_small} elements: {timed(lambda: K.packed_batch([(r[:n_small], c[:n_small])], 1e-4, 1e-4)) * 1e3:.3f} ms",
          flush=True)
small = [(torch.randn(1000 + 37 * i, device="cuda"), torch.randn(1000 + 37 * i, device="cuda")) for i in range(400)]
nan_c = c.clone()
nan_c[12345] = float("nan")  # one tile measured again by the full rules
print(f"1 GiB pair with one NaN: {timed(lambda: K.packed_batch([(r, nan_c)], 1e-4, 1e-4)) * 1e3:.2f} ms", flush=True)
print(f"400 small pairs, one batch: {timed(lambda: K.packed_batch(small, 1e-4, 1e-4)) * 1e3:.2f} ms", flush=True)
from diffkit.measure import measure_many  # noqa: E402

measure_many([(r, c, 1e-4, 1e-4)])[0].result()
t = timed(lambda: measure_many([(r, c, 1e-4, 1e-4)])[0].result())
print(f"1 GiB pair through measure_many, result on the host: {t * 1e3:.2f} ms {2 * 4 * n / t / 1e9:.0f} GB/s "
      f"({2 * 4 * n / t / (2 * 4 * n / copy) * 100:.0f} % of the copy)", flush=True)
