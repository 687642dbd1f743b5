"""Host and device cost of one metric-kernel call on a small pair (bench only): with and without the
finite-first pass's re-measuring launch."""
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/bench/", 1)[0])
from diffkit import metrics_kernel as K  # noqa: E402
from diffkit import measure as M  # noqa: E402

r = torch.randn(1024, device="cuda")
c = r + 1e-6
for fast in (True, False, True):
    K.FAST = fast
    K.packed_batch([(r, c)], 1e-4, 1e-4)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(200):
        K.packed_batch([(r, c)], 1e-4, 1e-4)
    host = (time.perf_counter() - t) / 200
    torch.cuda.synchronize()
    tot = (time.perf_counter() - t) / 200
    t = time.perf_counter()
    for _ in range(200):
        M.measure_async(r, c, 1e-4, 1e-4).result()
    res = (time.perf_counter() - t) / 200
    print(f"FAST {fast}: packed_batch host {host * 1e6:.0f} us, with the device {tot * 1e6:.0f} us; "
          f"measure_async().result() {res * 1e6:.0f} us", flush=True)
K.FAST = True
import cProfile, pstats  # noqa: E402
pr = cProfile.Profile()
pr.enable()
for _ in range(200):
    K.packed_batch([(r, c)], 1e-4, 1e-4)
pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(14)
