"""The scale benchmark (issue 7): a deep transformer and its candidate, four ways.

    python bench/scale.py --preset cpu                  # 24 blocks, B2 S256 D256, float32
    python bench/scale.py --preset h200 --dtype float32 # 24 blocks, B4 S2048 D1024 (and bfloat16)
    python bench/scale.py --preset h200 --dtype bfloat16 --json out.json

Each mode runs in its own process (peak host memory, VmHWM, is per process):
  plain  two plain forwards (reference, candidate)
  stream diffkit.compare(streaming=True) with --max-memory (default budget when not given)
  full   diffkit.compare in memory (every intermediate of both sides kept)
  naive  what users write by hand: forward hooks that clone every module output to the CPU, then
         torch.testing.assert_close per module name present in both
Both diffkit modes run without the reference health check and the rerun (each is one more forward).
Reported: wall time (median of --repeat), ratio to two plain forwards, peak device memory above
the loaded models, peak host RSS, bytes compared per second, and the device's copy bandwidth
(a clone of a 1 GiB buffer: bytes read + written per second) measured in the same process.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from stream_memory import peak_rss  # noqa: E402  (VmHWM, not ru_maxrss: see there)
REF = os.path.join(ROOT, "references", "deep_transformer.py")
CAND = os.path.join(ROOT, "kernels", "deep_transformer_fused.py")
PRESETS = {"cpu": dict(DIFFKIT_DEPTH=24, DIFFKIT_BATCH=2, DIFFKIT_SEQ=256, DIFFKIT_DIM=256, DIFFKIT_HEADS=4),
           "h200": dict(DIFFKIT_DEPTH=24, DIFFKIT_BATCH=4, DIFFKIT_SEQ=2048, DIFFKIT_DIM=1024, DIFFKIT_HEADS=16),
           "tiny": dict(DIFFKIT_DEPTH=24, DIFFKIT_BATCH=2, DIFFKIT_SEQ=32, DIFFKIT_DIM=64, DIFFKIT_HEADS=4)}


def _sync(dev):
    import torch

    if dev == "cuda":
        torch.cuda.synchronize()


def _copy_bandwidth(dev) -> float:
    import torch

    n = (1 << 30) // 4 if dev == "cuda" else (256 << 20) // 4
    x = torch.empty(n, device=dev)
    y = torch.empty_like(x)
    y.copy_(x)
    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(5):
        y.copy_(x)
    _sync(dev)
    return 2 * 4 * n * 5 / (time.perf_counter() - t0)


def naive(ref, cand, ref_in, cand_in):
    """The hand-written baseline: hooks clone every module output to the CPU (a copy on the CPU too: a later
    in-place op must not change what was kept), then assert_close."""
    import torch

    outs = []
    for model, inputs in ((ref, ref_in), (cand, cand_in)):
        got, hooks = {}, []
        for name, m in model.named_modules():
            def hook(mod, args, out, name=name):
                if isinstance(out, torch.Tensor):
                    got[name] = out.detach().to("cpu", copy=True)
            hooks.append(m.register_forward_hook(hook))
        with torch.no_grad():
            model(*inputs)
        for h in hooks:
            h.remove()
        outs.append(got)
    bad = 0
    naive.compared = [0, 0]  # modules and elements (a side) it compared: those of one name and shape on both sides
    for name in outs[0]:
        if name in outs[1] and outs[0][name].shape == outs[1][name].shape:
            naive.compared[0] += 1
            naive.compared[1] += outs[0][name].numel()
            try:
                torch.testing.assert_close(outs[1][name], outs[0][name])
            except AssertionError:
                bad += 1
    return bad


def child(mode, dev, repeat, max_memory):
    import torch

    import diffkit
    from diffkit.stream import parse_size

    pair = diffkit.load_pair(REF, CAND, device=dev)
    ref, cand, ri, ci = pair.ref, pair.cand, pair.ref_inputs, pair.cand_inputs
    with torch.no_grad():
        ref(*ri), cand(*ci)  # warm up
    _sync(dev)
    bw = _copy_bandwidth(dev)
    if dev == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base_dev = torch.cuda.memory_allocated()
    host_before = peak_rss()
    times, info = [], {}
    for _ in range(repeat):
        t0 = time.perf_counter()
        if mode == "plain":
            with torch.no_grad():
                ref(*ri), cand(*ci)
        elif mode == "naive":
            info["naive_mismatching_modules"] = naive(ref, cand, ri, ci)
        else:
            kw = dict(streaming=True, max_memory=parse_size(max_memory)) if mode == "stream" else {}
            prof = None
            if os.environ.get("SCALE_PROFILE"):
                import cProfile

                prof = cProfile.Profile()
                prof.enable()
            r = diffkit.compare(ref, cand, ri, cand_inputs=ci, health=False, rerun=False, **kw)
            if prof is not None:
                import io
                import pstats

                prof.disable()
                buf = io.StringIO()
                pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(14)
                sys.stderr.write(buf.getvalue()[-3500:])
            fd = r.first_divergence
            info.update(verdict=r.verdict, stages=len(r.stages), first=fd.ref_name if fd else None,
                        compared_bytes=sum(2 * s.stats.numel * torch.empty((), dtype=getattr(torch, s.ref.dtype)).element_size()
                                           for s in r.stages if s.stats is not None),
                        **{k: r.meta[k] for k in ("peak_device_bytes", "spilled_bytes", "max_memory") if k in r.meta})
            del r
        _sync(dev)
        times.append(time.perf_counter() - t0)
    out = dict(mode=mode, device=dev, seconds=statistics.median(times), all_seconds=times, copy_bandwidth=bw,
               host_peak_rss=peak_rss(), host_rss_before=host_before,
               **info)
    if dev == "cuda":
        out["device_peak_extra"] = torch.cuda.max_memory_allocated() - base_dev
        out["device_name"] = torch.cuda.get_device_name(0)
    if "compared_bytes" in out:
        out["compare_bytes_per_s"] = out["compared_bytes"] / out["seconds"]
    print("RESULT " + json.dumps(out))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default=None)
    ap.add_argument("--modes", default="plain,stream,full,naive")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--max-memory", default=None)
    ap.add_argument("--bug-block", type=int, default=-1, help="inject the candidate's missing bias in this block")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    dev = args.device or ("cuda" if args.preset == "h200" else "cpu")
    if args.child:
        child(args.child, dev, args.repeat, args.max_memory)
        return
    env = dict(os.environ, DIFFKIT_DTYPE=args.dtype, DIFFKIT_BUG_BLOCK=str(args.bug_block),
               **{k: str(v) for k, v in PRESETS[args.preset].items()})
    rows = []
    for mode in args.modes.split(","):
        cmd = [sys.executable, os.path.abspath(__file__), "--preset", args.preset, "--dtype", args.dtype, "--device", dev,
               "--repeat", str(args.repeat if mode != "full" else max(1, args.repeat - 1)), "--child", mode]
        if args.max_memory:
            cmd += ["--max-memory", args.max_memory]
        t0 = time.perf_counter()
        p = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if os.environ.get("SCALE_PROFILE"):
            print(p.stderr[-3500:])
        line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            rows.append(dict(mode=mode, error=(p.stderr or p.stdout)[-1500:]))
            print(f"{mode}: failed after {time.perf_counter() - t0:.0f} s\n{rows[-1]['error']}")
            continue
        rows.append(json.loads(line[7:]))
        r = rows[-1]
        print(f"{mode}: {r['seconds']:.3f} s (all {[round(x, 3) for x in r['all_seconds']]}), host peak RSS "
              f"{r['host_peak_rss'] / 2**30:.2f} GiB" + (f", device peak above models {r['device_peak_extra'] / 2**30:.2f} GiB"
                                                      if "device_peak_extra" in r else "")
              + f"; process wall {time.perf_counter() - t0:.0f} s", flush=True)
    plain = next((r["seconds"] for r in rows if r.get("mode") == "plain" and "seconds" in r), None)
    size = PRESETS[args.preset]
    print(f"\ndeep transformer: {size['DIFFKIT_DEPTH']} blocks, batch {size['DIFFKIT_BATCH']}, seq {size['DIFFKIT_SEQ']}, "
          f"dim {size['DIFFKIT_DIM']}, {args.dtype}, device {dev}")
    print(f"{'mode':<8} {'seconds':>9} {'× plain':>8} {'dev peak+':>10} {'host RSS':>9} {'cmp GB/s':>9} {'copy GB/s':>9}  verdict")
    for r in rows:
        if "seconds" not in r:
            print(f"{r['mode']:<8} failed")
            continue
        ratio = r["seconds"] / plain if plain else float("nan")
        dpk = f"{r['device_peak_extra'] / 2**30:.2f}G" if "device_peak_extra" in r else "-"
        cmp_ = f"{r['compare_bytes_per_s'] / 1e9:.2f}" if "compare_bytes_per_s" in r else "-"
        print(f"{r['mode']:<8} {r['seconds']:>9.3f} {ratio:>8.2f} {dpk:>10} {r['host_peak_rss'] / 2**30:>8.2f}G "
              f"{cmp_:>9} {r['copy_bandwidth'] / 1e9:>9.1f}  {r.get('verdict', '')} {r.get('first') or ''}"
              + (f" ({r['naive_mismatching_modules']} modules mismatching)" if "naive_mismatching_modules" in r else ""))
        r["ratio_to_plain"] = ratio
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(preset=args.preset, dtype=args.dtype, size=size, rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
