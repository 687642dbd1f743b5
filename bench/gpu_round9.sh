#!/usr/bin/env bash
# GPU checks of round 9 (one call): every CUDA-marked test (capture's argument walk, the written-through
# reference capture of an isolated diff, the native CPU kernel beside the Triton one), then the metric kernel
# through measure_many. Part 2: bench/speed.py --preset h200 (plain, compare, stream, naive, metrics).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp}
python -c "import torch; from diffkit import host_kernel as h; print('torch', torch.__version__, 'native CPU kernel:', h.available(), h.why() or '')"
timeout 480 python -m pytest -q -m cuda -p no:cacheprovider tests/ 2>&1 | tail -6
