#!/usr/bin/env bash
# Round 19's GPU call: round 18's last call (bench/gpu_round18c.sh: where racecheck's own failure comes from, the
# sanitizer's CUDA tests) and the input copies on CUDA tensors (diffkit.inputs: identity, shared memory, strides).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp}
nvidia-smi --query-gpu=name --format=csv,noheader
python - <<'PY'
import torch
from diffkit.inputs import copy_inputs, layout
x = torch.randn(6, 8, device="cuda"); t = x.t(); v = x[2:]
got = copy_inputs([x, t, v, x])
print("cuda copies: same object kept", got[0] is got[3], "| shared memory", got[0].untyped_storage().data_ptr() == got[1].untyped_storage().data_ptr() == got[2].untyped_storage().data_ptr(),
      "| strides", [g.stride() for g in got] == [a.stride() for a in (x, t, v, x)], "| values", all(torch.equal(g, a) for g, a in zip(got, (x, t, v, x))),
      "| not the originals' memory", got[0].data_ptr() != x.data_ptr(), "| layout", layout([x, t, v, x]))
PY
bash bench/gpu_round18c.sh
