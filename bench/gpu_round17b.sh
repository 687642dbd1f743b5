#!/usr/bin/env bash
# The last GPU call of round 17, on an H200 (the full capture needs ~108 GB):
#   0. CUDA tests: the axial race candidate now diffed under --sanitize racecheck (its two runs agreed on the H200),
#      the metric kernel's and the streaming diff's (the batch's address table is built in one tensor now);
#   1. (AB=1) bench/ab_stream.py .ab_old . : the streaming diff of the 24-block transformer (40G) with the diffkit of
#      the round's start (.ab_old: `git archive e46c440 diffkit`) and this tree's, in turns;
#   2. bench/speed.py's H200 set again (plain, compare, stream, metrics), JSON in $OUT.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp}
python -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
timeout 200 python -m pytest -q -m cuda -p no:cacheprovider -rf tests/test_metrics.py tests/test_stream.py \
  "tests/test_gpu.py::test_cuda_candidate[axial_attention_cuda_race.py]" > $OUT/cuda_b.log 2>&1
grep -E "passed|failed|FAILED|Error" $OUT/cuda_b.log | tail -6
if [ "${AB:-0}" = 1 ] && [ -d .ab_old/diffkit ]; then
  ROUNDS=${ROUNDS:-2} timeout ${AB_S:-150} python bench/ab_stream.py .ab_old . 2>&1 | grep -v Warning
fi
timeout ${SPEED_S:-230} python bench/speed.py --preset h200 --repeat ${REPEAT:-5} \
  --only h200:plain,h200:compare,h200:stream,h200:metrics --json $OUT/h200_speed_round17b.json 2>&1 | tail -7
