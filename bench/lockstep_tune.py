"""Time the lockstep streaming diff of the 24-block transformer (CUDA, 40G) for several values of
pipeline.LOCKSTEP_LOW_WATER given on the command line (bench only): the values take turns, REPEAT rounds
(default 2), then each one's median.  A value past the budget in bytes (e.g. 10**12) makes the low water
0: the reference runs on as soon as its next record fits (one round trip per record, as before round 15)."""
import statistics
import os
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/bench/", 1)[0])
os.environ.update(DIFFKIT_DEPTH="24", DIFFKIT_BATCH="4", DIFFKIT_SEQ="2048", DIFFKIT_DIM="1024", DIFFKIT_HEADS="16")
import diffkit  # noqa: E402
from diffkit import pipeline  # noqa: E402
pair = diffkit.load_pair("references/deep_transformer.py", "kernels/deep_transformer_fused.py", device="cuda")
ref, cand, ri, ci = pair.ref, pair.cand, pair.ref_inputs, pair.cand_inputs
def plain():
    with torch.no_grad(): ref(*ri); cand(*ci)
    torch.cuda.synchronize()
def st():
    r = diffkit.compare(ref, cand, ri, cand_inputs=ci, health=False, rerun=False, streaming=True, max_memory=40 << 30)
    torch.cuda.synchronize(); return r
plain(); st()
t = time.perf_counter(); plain(); p = time.perf_counter() - t
print("plain", round(p, 3))
times: dict = {}
for _ in range(int(os.environ.get("REPEAT", 2))):
    for lw in [int(a) for a in sys.argv[1:]]:
        pipeline.LOCKSTEP_LOW_WATER = lw
        t = time.perf_counter(); r = st(); s = time.perf_counter() - t
        times.setdefault(lw, []).append(s)
        print("low_water 1/%d" % lw, round(s, 3), round(s / p, 2), r.verdict, r.meta["lockstep"], r.meta["reference_tiers"], flush=True)
for lw, ts in times.items():
    print("low_water 1/%d: median %.3f s (%.2fx two plain forwards), runs %s" % (
        lw, statistics.median(ts), statistics.median(ts) / p, [round(x, 3) for x in ts]))
if os.environ.get("PROFILE"):
    import cProfile
    import pstats
    pr = cProfile.Profile()
    pr.enable()
    st()
    pr.disable()
    ps = pstats.Stats(pr)
    ps.sort_stats("tottime").print_stats(18)
    ps.sort_stats("cumulative").print_stats(30)
