#!/usr/bin/env bash
# GPU checks of round 15 (lockstep streaming hands control over per batch of records), one call:
#   1. the lockstep diff of the 24-block transformer (40G) with the old pacing (low water 0) and the new
#      (1/8, 1/4 of the budget), interleaved, REPEAT rounds;
#   2. bench/speed.py's H200 set (plain, compare, stream, metrics), JSON in $OUT;
#   3. the CUDA tests not run since round 13 (lockstep, corpus, fused), four pytest processes side by side
#      (each builds its own extensions), until the budget's end.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp}
T0=$(date +%s)
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
REPEAT=${REPEAT:-4} timeout 200 python bench/lockstep_tune.py 1000000000000 8 4 2>&1 | tail -16
timeout 220 python bench/speed.py --preset h200 --repeat 5 --only h200:plain,h200:compare,h200:stream,h200:metrics \
  --json $OUT/h200_speed_round15.json 2>&1 | tail -10
LEFT=$(( ${BUDGET:-570} - ($(date +%s) - T0) ))
echo "cuda tests get ${LEFT} s"
i=0
for sel in "tests/test_stream.py tests/test_corpus.py" "tests/test_fused.py -k 'axial'" \
           "tests/test_fused.py -k 'invariant or swiglu'" "tests/test_fused.py -k 'transformer or triangle'"; do
  i=$((i + 1))
  ( eval timeout $LEFT python -m pytest -q -m cuda -p no:cacheprovider -rf $sel > $OUT/cuda_$i.log 2>&1 ) &
done
wait
for f in $OUT/cuda_*.log; do echo "== $f"; tail -6 $f; done
