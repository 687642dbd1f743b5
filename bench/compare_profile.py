"""Where an in-process `diffkit.compare` of a GPU model spends its time beyond the two plain forwards (bench only):
the wall times of plain forwards and of the diff, the device's busy time in the diff (torch's profiler: kernels and
copies, the largest by total time), and the host's time by function (cProfile of the calling thread, where the diff
runs its capture and alignment).

    python bench/compare_profile.py --model gpu_mid            # the 12-block transformer, B4 S1024 D1024 (an H100)
"""
import argparse
import cProfile
import collections
import os
import pstats
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from speed import load_model  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpu_mid")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--lines", type=int, default=30)
    ap.add_argument("--callers", default="", help="comma-separated function names: who calls each, under cProfile")
    ap.add_argument("--no-device-profile", action="store_true", help="skip torch's profiler (host functions only)")
    a = ap.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile

    diffkit, ref, cand, ri, ci = load_model(a.model, a.device)

    def sync():
        if a.device == "cuda":
            torch.cuda.synchronize()

    def plain():
        with torch.no_grad():
            ref(*ri)
            cand(*ci)
        sync()

    def diff():
        diffkit.compare(ref, cand, ri, cand_inputs=ci, health=False, rerun=False)
        sync()

    def timed(fn):
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    plain(), diff()
    p = statistics.median(timed(plain) for _ in range(a.repeat))
    d = statistics.median(timed(diff) for _ in range(a.repeat))
    print(f"plain {p * 1e3:.1f} ms, compare {d * 1e3:.1f} ms = {d / p:.2f}x", flush=True)
    if not a.no_device_profile:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t = timed(diff)
        dev = collections.defaultdict(lambda: [0, 0.0])
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total:
                dev[e.name[:70]][0] += 1
                dev[e.name[:70]][1] += e.device_time_total / 1e6
        busy = sum(v[1] for v in dev.values())
        print(f"under the profiler: {t * 1e3:.1f} ms, the device busy {busy * 1e3:.1f} ms")
        for name, (n, s) in sorted(dev.items(), key=lambda kv: -kv[1][1])[:15]:
            print(f"  {s * 1e3:8.2f} ms {n:5d}x  {name}")
    prof_c = cProfile.Profile()
    prof_c.enable()
    diff()
    prof_c.disable()
    st = pstats.Stats(prof_c)
    st.sort_stats("cumulative").print_stats(a.lines)
    st.sort_stats("tottime").print_stats(a.lines)
    for name in filter(None, a.callers.split(",")):
        st.print_callers(name)


if __name__ == "__main__":
    main()
