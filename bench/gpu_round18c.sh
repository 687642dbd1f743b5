#!/usr/bin/env bash
# Round 18, last GPU call: bench/gpu_round18b.sh (where racecheck's own failure comes from), then the CUDA tests of
# the sanitizer (the axial race candidate, now passing when compute-sanitizer's failure is named) and of the inputs.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp}
bash bench/gpu_round18b.sh
timeout ${TESTS_S:-280} python -m pytest -q -m cuda -p no:cacheprovider -rf -x \
  "tests/test_gpu.py::test_cuda_candidate[axial_attention_cuda_race.py]" \
  tests/test_gpu.py::test_sanitize_racecheck_attaches_race_to_the_triangle_stage > $OUT/cuda_c.log 2>&1
echo "== cuda tests rc $?"; grep -E "passed|failed|FAILED|Error" $OUT/cuda_c.log | tail -6
