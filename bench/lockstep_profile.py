"""Where the lockstep streaming diff of the 24-block transformer (CUDA, 40G) spends its time (bench
only): cProfile of the candidate's (main) thread and of the reference's thread, the synchronising
calls by source line, and the device's busy time (torch.profiler's kernel time) against the wall time."""
import collections
import cProfile
import io
import os
import pstats
import sys
import time
import warnings

import torch

sys.path.insert(0, __file__.rsplit("/bench/", 1)[0])
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from stream_pair import StreamPair, timed  # noqa: E402  (sets the model's size in the environment)
import diffkit  # noqa: E402
from diffkit import stream  # noqa: E402

bench = StreamPair(diffkit)
plain, st = bench.plain, bench.stream
plain(), st()
print("plain", [round(timed(plain), 3) for _ in range(3)], "stream", [round(timed(st), 3) for _ in range(3)], flush=True)

# both threads under cProfile
profs = {}
start = stream.Lockstep.start


def start_profiled(self, run_reference):
    def body():
        pr = profs["ref"] = cProfile.Profile()
        pr.enable()
        try:
            return run_reference()
        finally:
            pr.disable()
    return start(self, body)


stream.Lockstep.start = start_profiled  # (one profiler at a time in a process: the reference's thread first)
st()
stream.Lockstep.start = start
main = profs["cand"] = cProfile.Profile()
main.enable()
st()
main.disable()
for side, pr in profs.items():
    s = io.StringIO()
    ps = pstats.Stats(pr, stream=s)
    ps.sort_stats("tottime").print_stats(16)
    ps.sort_stats("cumulative").print_stats(26)
    print(f"===== {side} thread\n" + "\n".join(line[:170] for line in s.getvalue().splitlines() if line.strip()))

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode(1)
    st()
    torch.cuda.set_sync_debug_mode(0)
where = collections.Counter(f"{os.path.basename(w.filename)}:{w.lineno}" for w in caught if "synchroniz" in str(w.message))
print("synchronising calls:", sum(where.values()), where.most_common(12))

from torch.profiler import ProfilerActivity, profile  # noqa: E402

for name, f in (("plain", plain), ("stream", st)):
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        f()
        wall = time.perf_counter() - t
    ka = prof.key_averages()
    dev = sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) for e in ka) / 1e6
    print(f"{name}: wall {wall:.3f} s under the profiler, device busy {dev:.3f} s")
    if name == "stream":
        print(ka.table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=60))
