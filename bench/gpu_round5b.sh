#!/usr/bin/env bash
# GPU checks of round 5 after the streaming changes, in one call: every H200 mode of bench/speed.py in one
# run (JSON under $OUT), the lockstep stream's remaining synchronising calls, the CUDA metric and stream tests.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp}
timeout 100 python -m pytest -q -m cuda -p no:cacheprovider tests/test_metrics.py tests/test_stream.py 2>&1 | tail -2
timeout 330 python bench/speed.py --preset h200 --repeat 3 --json "$OUT/h200_speed_round5.json" 2>&1 | tail -14
timeout 150 python bench/lockstep_sync.py 2>&1 | sed -n 1,12p
