"""The diff's metric passes timed alone (`bench/speed.py`'s `_metric_passes`), with the CUDA metric kernel's batching
varied: DIRECT_MIN (pairs at least this large get a launch of their own, tensors passed directly; larger than any
pair: every pair read through the address table, one launch a batch) and BATCH_PAIRS.

    python bench/metric_passes.py --model gpu_mid --direct-min 1048576,268435456 --repeat 5
"""
import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from speed import MODELS, _metric_passes  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpu_mid")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--direct-min", default="", help="comma-separated; default: the module's own")
    ap.add_argument("--batch-pairs", default="")
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    for k, v in MODELS[a.model]["env"].items():
        os.environ[k] = str(v)
    import torch

    import diffkit
    from diffkit import measure, metrics_kernel

    spec = MODELS[a.model]
    pair = diffkit.load_pair(os.path.join(ROOT, spec["ref"]), os.path.join(ROOT, spec["cand"]), device=a.device)
    ref, cand, ri, ci = pair.ref, pair.cand, pair.ref_inputs, pair.cand_inputs
    kw = dict(health=False, rerun=False)
    diffkit.compare(ref, cand, ri, cand_inputs=ci, **kw)  # compile, first touch
    rows = []
    for dm in [int(x) for x in a.direct_min.split(",")] if a.direct_min else [metrics_kernel.DIRECT_MIN]:
        for bp in [int(x) for x in a.batch_pairs.split(",")] if a.batch_pairs else [measure.BATCH_PAIRS]:
            metrics_kernel.DIRECT_MIN, measure.BATCH_PAIRS = dm, bp
            _metric_passes(diffkit, ref, cand, ri, ci, kw, a.device)  # (a new launch configuration compiled)
            got = [_metric_passes(diffkit, ref, cand, ri, ci, kw, a.device) for _ in range(a.repeat)]
            secs = statistics.median(g["metric_pass_seconds"] for g in got)
            row = dict(direct_min=dm, batch_pairs=bp, seconds=secs, pairs=got[0]["metric_pass_pairs"],
                       bytes=got[0]["metric_pass_bytes"], copy_bandwidth=got[0].get("copy_bandwidth"))
            rows.append(row)
            bw = row["bytes"] / secs
            print(f"direct_min {dm:>14d} batch_pairs {bp:4d}: {row['pairs']} pairs {row['bytes'] / 1e9:.2f} GB in "
                  f"{secs * 1e3:.1f} ms = {bw / 1e9:.0f} GB/s" + (
                      f" = {100 * bw / row['copy_bandwidth']:.0f}% of copy" if row["copy_bandwidth"] else ""), flush=True)
    print("RESULT " + json.dumps(rows))
    del torch


if __name__ == "__main__":
    main()
