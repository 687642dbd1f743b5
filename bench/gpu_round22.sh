#!/usr/bin/env bash
# Round 22's GPU calls.
#   PART=speed  bench/speed.py's H200 set (the 24-block transformer, B4 S2048 D1024; the full capture needs an
#               H200): plain, compare (now with the diff's metric passes timed alone), metrics; JSON in $OUT
#   PART=tests  the CUDA tests, five pytest processes side by side (bench/gpu_round17_tests.sh), T s at most each:
#               the extension importer is now wrapped when a model imports cpp_extension (capture.py)
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp}
PART=${PART:-speed}
nvidia-smi --query-gpu=name --format=csv,noheader
if [ "$PART" = tests ]; then
  T=${T:-470} bash bench/gpu_round17_tests.sh
  exit 0
fi
timeout ${SPEED_S:-400} python bench/speed.py --preset h200 --repeat ${REPEAT:-5} \
  --only h200:plain,h200:compare,h200:metrics --json $OUT/h200_speed_round22.json 2>&1 | tail -6
