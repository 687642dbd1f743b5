"""A/B of the streaming diff of the 24-block transformer (CUDA, 40G), diffkit imported from the folder
given (bench only): `python bench/ab_stream.py OLD_ROOT NEW_ROOT ...` runs each in its own process,
in turns, REPEAT rounds; prints each run's plain and streaming medians."""
import os
import statistics
import subprocess
import sys
import time

if len(sys.argv) > 2 or sys.argv[1:] == []:
    for _ in range(int(os.environ.get("ROUNDS", 2))):
        for root in sys.argv[1:]:
            subprocess.run([sys.executable, __file__, root], check=False)
    sys.exit(0)
root = os.path.abspath(sys.argv[1])
sys.path.insert(0, root)
os.environ.update(DIFFKIT_DEPTH="24", DIFFKIT_BATCH="4", DIFFKIT_SEQ="2048", DIFFKIT_DIM="1024", DIFFKIT_HEADS="16")
import torch  # noqa: E402
import diffkit  # noqa: E402

here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pair = diffkit.load_pair(os.path.join(here, "references/deep_transformer.py"),
                         os.path.join(here, "kernels/deep_transformer_fused.py"), device="cuda")
ref, cand, ri, ci = pair.ref, pair.cand, pair.ref_inputs, pair.cand_inputs


def plain():
    with torch.no_grad():
        ref(*ri)
        cand(*ci)
    torch.cuda.synchronize()


def st():
    r = diffkit.compare(ref, cand, ri, cand_inputs=ci, health=False, rerun=False, streaming=True, max_memory=40 << 30)
    torch.cuda.synchronize()
    return r


def timed(f):
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


plain(), st()
p = [timed(plain) for _ in range(3)]
s = [timed(st) for _ in range(int(os.environ.get("REPEAT", 5)))]
r = st()
print(f"{sys.argv[1]}: plain {statistics.median(p):.3f} s, stream {statistics.median(s):.3f} s "
      f"({statistics.median(s) / statistics.median(p):.2f}x) runs {[round(x, 3) for x in s]} {r.verdict} "
      f"{r.meta.get('lockstep')} {diffkit.__file__}", flush=True)
