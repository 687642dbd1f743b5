#!/usr/bin/env bash
# Round 21's GPU calls: the isolated diff's one child running both sides (diffkit.cli._isolated), on a GPU.
#   PART=tests   the CUDA tests, five pytest processes side by side (bench/gpu_round17_tests.sh), T s at most each
#   PART=equiv   bench/one_child_equiv.py on the CUDA candidates (one child vs a child per side: same answers?), then
#                bench/speed.py's gpu_mid diffs both ways (DIFFKIT_TWO_PROCESSES=1: a child per side from the start)
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp}
PART=${PART:-equiv}
nvidia-smi --query-gpu=name --format=csv,noheader
if [ "$PART" = tests ]; then
  T=${T:-470} bash bench/gpu_round17_tests.sh
  exit 0
fi
timeout ${EQ_T:-330} python bench/one_child_equiv.py --device cuda --json $OUT/equiv_cuda.json \
  kernels/fused/axial_attention_cuda_ok.py kernels/fused/axial_attention_cuda_tail.py kernels/axial_attention_cuda.py \
  kernels/axial_attention_cuda_race.py kernels/fused/swiglu_mlp_cuda_tail.py kernels/row_softmax_cuda.py \
  kernels/invariant_point_attention_crash.py kernels/transformer_block_triton.py kernels/transformer_block_triton_tail.py \
  kernels/triangle_multiplicative_update_cuda_tail.py
python bench/speed.py --preset h200 --only gpu_mid:plain,gpu_mid:isolated,gpu_mid:cli_inproc --repeat 3 --json $OUT/speed_one.json 2>&1 | tail -5
DIFFKIT_TWO_PROCESSES=1 python bench/speed.py --preset h200 --only gpu_mid:plain,gpu_mid:isolated --repeat 3 --json $OUT/speed_two.json 2>&1 | tail -4
