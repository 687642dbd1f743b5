#!/usr/bin/env bash
# The CUDA tests of round 17 (the tree since round 16's state work, b26673d onwards, had not run on a GPU):
# five pytest processes side by side (each builds its own extensions), T seconds at most each.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp}
T=${T:-480}
python -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
run() { local log=$1; shift; ( timeout $T python -m pytest -q -m cuda -p no:cacheprovider -rf "$@" > $OUT/$log 2>&1 ) & }
run cuda_1.log tests/test_gpu.py -k "cuda_candidate and axial"
run cuda_2.log tests/test_gpu.py -k "cuda_candidate and (invariant or row_softmax)"
run cuda_3.log tests/test_gpu.py -k "cuda_candidate and (transformer_block or triangle)"
run cuda_4.log tests/test_gpu.py tests/test_stream.py tests/test_corpus.py tests/test_metrics.py -k "not cuda_candidate"
run cuda_5.log tests/test_whatif.py tests/test_store_isolate.py tests/test_fused.py tests/test_protocol.py tests/test_pipeline.py
wait
for f in $OUT/cuda_*.log; do echo "== $f"; grep -E "passed|failed|error|FAILED|ERROR" $f | tail -8; done
