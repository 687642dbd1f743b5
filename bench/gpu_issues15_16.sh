#!/usr/bin/env bash
# GPU checks for issues 15-16 in one call (device time is scarce): the Triton metric kernel against
# the exact path, the H200 speed figures, and the fused CUDA candidates' what-if ranking.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp}
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0))"
python -c "import rich, jinja2, click, safetensors; print('deps ok')" || echo "missing deps"
timeout 150 python -m pytest -q -x -m cuda -p no:cacheprovider tests/test_metrics.py 2>&1 | tail -15
timeout 200 python bench/speed.py --preset h200 --repeat 1 --only h200:plain,h200:compare,h200:metrics \
  --json "$OUT/h200_speed.json" 2>&1 | tail -8
timeout 150 python -m pytest -q -m cuda -p no:cacheprovider -rA tests/test_whatif.py 2>&1 | tail -25
timeout 120 python bench/speed.py --preset h200 --repeat 1 --only h200:stream --json "$OUT/h200_stream.json" 2>&1 | tail -4
