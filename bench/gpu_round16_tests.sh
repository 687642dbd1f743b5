#!/usr/bin/env bash
# The CUDA tests after round 16's changes (lazy modules, names re-read from edited files, parameters written in
# the forward), four pytest processes side by side (each builds its own extensions), T seconds at most.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp}
T=${T:-330}
python -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
run() { local log=$1; shift; ( timeout $T python -m pytest -q -m cuda -p no:cacheprovider -rf "$@" > $OUT/$log 2>&1 ) & }
run cuda_1.log tests/test_gpu.py -k "streaming or handed or crash_after or not_held or spilled or triton"
run cuda_2.log tests/test_stream.py tests/test_corpus.py tests/test_metrics.py
run cuda_3.log tests/test_whatif.py tests/test_store_isolate.py tests/test_fused.py -k "axial or swiglu or whatif or store or hand"
run cuda_4.log tests/test_gpu.py -k "cuda_candidate"
wait
for f in $OUT/cuda_*.log; do echo "== $f"; tail -8 $f; done
