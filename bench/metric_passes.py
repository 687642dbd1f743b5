"""The diff's metric passes timed alone (`bench/speed.py`'s `_metric_passes`), with the CUDA metric kernel's batching
varied: DIRECT_MIN (pairs at least this large get a launch of their own, tensors passed directly; larger than any
pair: every pair read through the address table, one launch a batch) and BATCH_PAIRS.

    python bench/metric_passes.py --model gpu_mid --direct-min 1048576,268435456 --repeat 5
    python bench/metric_passes.py --model gpu_mid --profile    # where one diff's metric passes spend their time

`--profile`: one diff's `measure_many` calls under torch's profiler: host time until the last launch returned,
until the results were on the host, the device's time in each kernel (and copies), the pairs by size and how many
needed a contiguous copy first.  `--calls`: the same without the profiler (which slows the host's side), so
host times as a diff pays them, and no device times.
"""
import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from speed import _metric_passes, load_model, measure_many_wrapped  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpu_mid")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--direct-min", default="", help="comma-separated; default: the module's own")
    ap.add_argument("--batch-pairs", default="")
    ap.add_argument("--first-pairs", default="", help="comma-separated FIRST_BATCH_PAIRS; default: the module's own")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="one diff's metric passes under torch's profiler")
    ap.add_argument("--calls", action="store_true", help="as --profile, without the profiler (host times as a diff "
                    "pays them; no device times)")
    ap.add_argument("--host-profile", type=int, default=0, metavar="N", help="the diff's pairs through measure_many N "
                    "times under cProfile (results fetched each time): where the host's time per call goes")
    a = ap.parse_args()
    diffkit, ref, cand, ri, ci = load_model(a.model, a.device)
    from diffkit import measure, metrics_kernel

    kw = dict(health=False, rerun=False)
    diffkit.compare(ref, cand, ri, cand_inputs=ci, **kw)  # compile, first touch
    if a.host_profile:
        _host_profile(diffkit, ref, cand, ri, ci, kw, a.host_profile)
        return
    if a.profile or a.calls:
        _profile(diffkit, ref, cand, ri, ci, kw, profiler=a.profile)
        return
    rows = []
    for dm in [int(x) for x in a.direct_min.split(",")] if a.direct_min else [metrics_kernel.DIRECT_MIN]:
        for bp, fp in [(int(x), int(y)) for x in (a.batch_pairs.split(",") if a.batch_pairs else [measure.BATCH_PAIRS])
                       for y in (a.first_pairs.split(",") if a.first_pairs else [getattr(measure, "FIRST_BATCH_PAIRS",
                                                                                        measure.BATCH_PAIRS)])]:
            metrics_kernel.DIRECT_MIN, measure.BATCH_PAIRS, measure.FIRST_BATCH_PAIRS = dm, bp, fp
            _metric_passes(diffkit, ref, cand, ri, ci, kw, a.device)  # (a new launch configuration compiled)
            got = [_metric_passes(diffkit, ref, cand, ri, ci, kw, a.device) for _ in range(a.repeat)]
            secs = statistics.median(g["metric_pass_seconds"] for g in got)
            row = dict(direct_min=dm, batch_pairs=bp, first_pairs=fp, seconds=secs, pairs=got[0]["metric_pass_pairs"],
                       bytes=got[0]["metric_pass_bytes"], copy_bandwidth=got[0].get("copy_bandwidth"))
            rows.append(row)
            bw = row["bytes"] / secs
            print(f"direct_min {dm:>14d} batch_pairs {bp:4d} first {fp:3d}: {row['pairs']} pairs "
                  f"{row['bytes'] / 1e9:.2f} GB in {secs * 1e3:.1f} ms = {bw / 1e9:.0f} GB/s" + (
                      f" = {100 * bw / row['copy_bandwidth']:.0f}% of copy" if row["copy_bandwidth"] else ""), flush=True)
    print("RESULT " + json.dumps(rows))


def _host_profile(diffkit, ref, cand, ri, ci, kw, times: int) -> None:
    """One diff's `measure_many` items, kept, then measured `times` times over under cProfile (the host's side: the
    device is synchronised after each call, so its time shows as the wait for the results)."""
    import cProfile
    import pstats
    import time

    import torch

    kept = []

    def keep(orig):
        def measure_many(items):
            kept.append(list(items))
            return orig(items)
        return measure_many

    with measure_many_wrapped(keep):
        diffkit.compare(ref, cand, ri, cand_inputs=ci, **kw)
    from diffkit import measure

    def once():
        for items in kept:
            for p in measure.measure_many(items):
                p.result()
        torch.cuda.synchronize()

    once()
    t0 = time.perf_counter()
    for _ in range(times):
        once()
    per = (time.perf_counter() - t0) / times
    nbytes = sum(r.numel() * r.element_size() + c.numel() * c.element_size() for items in kept for r, c, _, _ in items)
    print(f"{len(kept)} calls, {sum(map(len, kept))} pairs, {nbytes / 1e9:.2f} GB: {per * 1e3:.2f} ms a pass "
          f"= {nbytes / per / 1e9:.0f} GB/s (no profiler)")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(times):
        once()
    prof.disable()
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(25)


def _profile(diffkit, ref, cand, ri, ci, kw, profiler=True) -> None:
    import collections
    import contextlib
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile

    calls = []

    def timed(orig):
        def measure_many(items):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            sizes = collections.Counter()
            copies = strided = 0
            for r, c, _, _ in items:
                sizes[1 << max(0, (r.numel() - 1).bit_length())] += 1
                copies += (not r.is_contiguous()) + (not c.is_contiguous())
                if not (r.is_contiguous() and c.is_contiguous()):
                    strided += r.numel() * r.element_size() + c.numel() * c.element_size()
            with (profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) if profiler
                  else contextlib.nullcontext()) as prof:
                t0 = time.perf_counter()
                pending = orig(items)
                t1 = time.perf_counter()
                for p in pending:
                    p.result()
                t2 = time.perf_counter()
            dev = collections.defaultdict(lambda: [0, 0.0])
            for e in prof.events() if profiler else ():
                if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total:
                    dev[e.name[:60]][0] += 1
                    dev[e.name[:60]][1] += e.device_time_total / 1e6
            nbytes = sum(r.numel() * r.element_size() + c.numel() * c.element_size() for r, c, _, _ in items)
            calls.append(dict(pairs=len(items), bytes=nbytes, launched=t1 - t0, done=t2 - t0, copies=copies,
                              strided_bytes=strided,
                              sizes=dict(sorted(sizes.items())), device=dict(dev)))
            return pending
        return measure_many

    with measure_many_wrapped(timed):
        diffkit.compare(ref, cand, ri, cand_inputs=ci, **kw)  # (kernels compiled: the caller ran one diff before)
    total = [sum(c[k] for c in calls) for k in ("bytes", "launched", "done", "strided_bytes")]
    for c in calls:
        if not c["pairs"]:
            continue
        print(f"measure_many: {c['pairs']} pairs, {c['bytes'] / 1e9:.2f} GB ({c['copies']} sides not contiguous); "
              f"launches returned after {c['launched'] * 1e3:.2f} ms, results on the host after "
              f"{c['done'] * 1e3:.2f} ms = {c['bytes'] / c['done'] / 1e9:.0f} GB/s")
        print("  pairs by elements (up to): " + ", ".join(f"{k}: {v}" for k, v in c["sizes"].items()))
        busy = sum(t for _, t in c["device"].values())
        rate = f" = {c['bytes'] / busy / 1e9:.0f} GB/s while busy" if busy else ""
        if c["device"]:
            print(f"  device busy {busy * 1e3:.2f} ms{rate}")
        for name, (n, t) in sorted(c["device"].items(), key=lambda kv: -kv[1][1])[:8]:
            print(f"    {t * 1e3:8.3f} ms  {n:4d}x  {name}")
    print(f"{len(calls)} calls, {total[0] / 1e9:.2f} GB: launches returned after {total[1] * 1e3:.2f} ms in all, "
          f"results on the host after {total[2] * 1e3:.2f} ms = {total[0] / max(total[2], 1e-9) / 1e9:.0f} GB/s"
          + (" (under the profiler)" if profiler else "")
          + f"; pairs with a side not contiguous: {total[3] / max(total[0], 1):.0%} of the bytes")
    print("RESULT " + json.dumps(calls))


if __name__ == "__main__":
    main()
