#!/usr/bin/env bash
# GPU checks of round 16 (copy-on-write streaming stores, lockstep pacing, quiet collector), one call on an H200:
#   1. the streaming diff of the 24-block transformer (40G) with diffkit from .ab_old (9e88d45, before round 15's
#      changes) and from this tree, in turns (bench/ab_stream.py);
#   2. bench/speed.py's H200 set (plain, compare, stream, by-hand, metrics), JSON in $OUT.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp}
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
if [ -d .ab_old/diffkit ]; then
  ROUNDS=${ROUNDS:-3} timeout ${AB_S:-260} python bench/ab_stream.py .ab_old . 2>&1 | grep -v Warning
fi
timeout ${SPEED_S:-300} python bench/speed.py --preset h200 --repeat ${REPEAT:-7} \
  --only h200:plain,h200:compare,h200:stream,h200:naive,h200:metrics \
  --json $OUT/h200_speed_round16.json 2>&1 | tail -14
