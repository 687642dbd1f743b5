"""The streaming benchmarks' shared set-up (bench only): the 24-block transformer (B4 S2048 D1024, CUDA) as
`bench/speed.py --preset h200` builds it, two plain forwards, the lockstep streaming diff with a 40G budget."""
import os
import time

import torch

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.update(DIFFKIT_DEPTH="24", DIFFKIT_BATCH="4", DIFFKIT_SEQ="2048", DIFFKIT_DIM="1024", DIFFKIT_HEADS="16")


class StreamPair:
    """`diffkit` as imported by the caller (it may come from another tree: `bench/ab_stream.py`)."""

    def __init__(self, diffkit):
        self.diffkit = diffkit
        pair = diffkit.load_pair(os.path.join(HERE, "references/deep_transformer.py"),
                                 os.path.join(HERE, "kernels/deep_transformer_fused.py"), device="cuda")
        self.ref, self.cand, self.ri, self.ci = pair.ref, pair.cand, pair.ref_inputs, pair.cand_inputs

    def plain(self):
        with torch.no_grad():
            self.ref(*self.ri)
            self.cand(*self.ci)
        torch.cuda.synchronize()

    def stream(self):
        r = self.diffkit.compare(self.ref, self.cand, self.ri, cand_inputs=self.ci, health=False, rerun=False,
                                 streaming=True, max_memory=40 << 30)
        torch.cuda.synchronize()
        return r


def timed(f) -> float:
    t = time.perf_counter()
    f()
    return time.perf_counter() - t
