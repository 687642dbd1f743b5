"""Where the lockstep streaming diff of the 24-block transformer (CUDA, 40G) waits for the device
(bench only): synchronising calls by source line (torch's sync debug mode), then a torch.profiler
table of the host and device time."""
import collections
import os
import sys
import time
import warnings

import torch

sys.path.insert(0, __file__.rsplit("/bench/", 1)[0])
os.environ.update(DIFFKIT_DEPTH="24", DIFFKIT_BATCH="4", DIFFKIT_SEQ="2048", DIFFKIT_DIM="1024", DIFFKIT_HEADS="16")
import diffkit  # noqa: E402

pair = diffkit.load_pair("references/deep_transformer.py", "kernels/deep_transformer_fused.py", device="cuda")
ref, cand, ri, ci = pair.ref, pair.cand, pair.ref_inputs, pair.cand_inputs


def st():
    r = diffkit.compare(ref, cand, ri, cand_inputs=ci, health=False, rerun=False, streaming=True, max_memory=40 << 30)
    torch.cuda.synchronize()
    return r


st()
for _ in range(2):
    t = time.perf_counter()
    st()
    print("stream", round(time.perf_counter() - t, 3), flush=True)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode(1)
    st()
    torch.cuda.set_sync_debug_mode(0)
where = collections.Counter(f"{os.path.basename(w.filename)}:{w.lineno}" for w in caught
                            if "synchroniz" in str(w.message))
print("synchronising calls:", sum(where.values()))
for k, v in where.most_common(20):
    print(f"  {v:5d}  {k}")
from torch.profiler import ProfilerActivity, profile  # noqa: E402

with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    st()
ka = prof.key_averages()
print(ka.table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=50))
print(ka.table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=50))
