#!/usr/bin/env bash
# GPU checks of round 5 in one call (device time is scarce): the metric kernels (finite-first pass and
# a separate re-measuring launch) against the exact path, with float64 and float32 lane sums; the
# variants' speed; the lockstep streaming diff of the 24-block transformer at 40G; the CUDA stream tests.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp}
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout 150 python -m pytest -q -m cuda -p no:cacheprovider tests/test_metrics.py 2>&1 | tail -2
timeout 120 python - <<'PY' 2>&1 | tail -2
import pytest
from diffkit import metrics_kernel as K
K.BLOCK, K.TILE_BLOCKS, K.NUM_WARPS, K.LANE_SUMS_64 = 256, 64, 4, False
K.TILE = K.BLOCK * K.TILE_BLOCKS
print("float32 lane sums, 256x4x64:", pytest.main(["-q", "-m", "cuda", "-p", "no:cacheprovider", "tests/test_metrics.py"]))
PY
timeout 120 python bench/metrics_kernel_tune.py 2>&1 | tail -20
timeout 150 python bench/lockstep_tune.py 8 8 2>&1 | tail -5
timeout 120 python -m pytest -q -p no:cacheprovider tests/test_stream.py -m cuda 2>&1 | tail -2
