#!/usr/bin/env bash
# GPU checks of round 6 in one call: the CUDA tests that touch capture and the metrics (the folded-op path and
# the host measure changed this round), then every H200 mode of bench/speed.py (JSON under $OUT).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp}
timeout 200 python -m pytest -q -m cuda -p no:cacheprovider tests/test_metrics.py tests/test_stream.py tests/test_gpu.py 2>&1 | tail -4
timeout 330 python bench/speed.py --preset h200 --repeat 3 --json "$OUT/h200_speed_round6.json" 2>&1 | tail -14
