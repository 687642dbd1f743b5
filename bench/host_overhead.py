"""The diff's host-side cost per record, on this machine's CPU (bench only): the 24-block transformer at a size
where the forwards take next to nothing (B1 S16 D64, 504 stages), so what is timed is diffkit's own Python
(capture, online pairing, metrics' bookkeeping, alignment).  Run on a GPU box it says how fast that box's host
is against this project's 2-core machine (the streaming diff on a fast GPU is bound by it).

    python bench/host_overhead.py [--repeat 7]
"""
import argparse
import os
import statistics
import sys
import time

os.environ.update(DIFFKIT_DEPTH="24", DIFFKIT_BATCH="1", DIFFKIT_SEQ="16", DIFFKIT_DIM="64", DIFFKIT_HEADS="4")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import torch  # noqa: E402

import diffkit  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(min(torch.get_num_threads(), 2))  # the forwards are tiny: threads only add noise
    pair = diffkit.load_pair(os.path.join(ROOT, "references/deep_transformer.py"),
                             os.path.join(ROOT, "kernels/deep_transformer_fused.py"), device="cpu")
    ref, cand, ri, ci = pair.ref, pair.cand, pair.ref_inputs, pair.cand_inputs

    def plain():
        with torch.no_grad():
            ref(*ri), cand(*ci)

    def memory():
        return diffkit.compare(ref, cand, ri, cand_inputs=ci, health=False, rerun=False)

    def streaming():
        return diffkit.compare(ref, cand, ri, cand_inputs=ci, health=False, rerun=False, streaming=True,
                               max_memory=1 << 30)

    def python_loop():  # the interpreter's own speed, for comparing machines
        d = {}
        for i in range(300_000):
            d[i & 1023] = d.get(i & 1023, 0) + i

    stages = None
    for name, f in (("python loop", python_loop), ("plain forwards", plain), ("compare", memory),
                    ("compare streaming", streaming)):
        r = f()
        if r is not None:
            stages = len(r.stages)
        times = []
        for _ in range(args.repeat):
            t = time.perf_counter()
            f()
            times.append(time.perf_counter() - t)
        print(f"{name:18s} median {statistics.median(times) * 1e3:7.1f} ms  (min {min(times) * 1e3:.1f}, "
              f"max {max(times) * 1e3:.1f})" + (f"  {stages} stages" if name.startswith("compare") else ""), flush=True)


if __name__ == "__main__":
    main()
