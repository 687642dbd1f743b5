#!/usr/bin/env bash
# The second GPU call of round 17, on an H200 (the full capture needs ~108 GB):
#   1. bench/ab_stream.py .ab_old . : the streaming diff of the 24-block transformer (40G) with the diffkit of the
#      round's start (.ab_old: `git archive e46c440 diffkit`) and this tree's, in turns, each a process of its own;
#   2. bench/speed.py's H200 set again (plain, compare, stream, metrics), JSON in $OUT;
#   0. first, the metric kernel's and the streaming diff's CUDA tests (the batch's address table is built in one
#      tensor since the first call).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp}
python -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
timeout 120 python -m pytest -q -m cuda -p no:cacheprovider -rf tests/test_metrics.py tests/test_stream.py 2>&1 | tail -4
if [ -d .ab_old/diffkit ]; then
  ROUNDS=${ROUNDS:-3} timeout ${AB_S:-190} python bench/ab_stream.py .ab_old . 2>&1 | grep -v Warning
fi
timeout ${SPEED_S:-230} python bench/speed.py --preset h200 --repeat ${REPEAT:-5} \
  --only h200:plain,h200:compare,h200:stream,h200:metrics --json $OUT/h200_speed_round17b.json 2>&1 | tail -7
