#!/usr/bin/env bash
# GPU checks of round 8, part 1 (one call): the CUDA tests touching capture, folding and the metrics (the
# metric kernel now launches large pairs before building its table; capture records a filled buffer when the
# forward returns), the metric kernels' interpreter tests, then the kernel alone over its knobs.
# Part 2: bench/speed.py --preset h200 (plain, compare, stream, metrics).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp}
timeout 300 python -m pytest -q -p no:cacheprovider tests/test_metrics.py 2>&1 | tail -3
timeout 300 python -m pytest -q -m cuda -p no:cacheprovider tests/test_stream.py tests/test_gpu.py tests/test_fold.py 2>&1 | tail -4
timeout 150 python bench/metrics_kernel_tune.py 2>&1 | tail -22
