#!/usr/bin/env bash
# GPU checks of round 11, one call (rounds 9-10 changed capture's per-op path, the isolated reference child's
# write-through and the candidate built ahead; none of it had run on a GPU):
#   1. every CUDA-marked test;
#   2. bench/speed.py --preset h200: the 24-block transformer (plain, compare, stream, metrics), JSON in $OUT;
#   3. the half-size transformer: two plain forwards, the CLI in one process and isolated (cold processes).
# `PART=1|2|3 bash bench/gpu_round11.sh` runs one part.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp}
PART=${PART:-all}
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
if [ "$PART" = all ] || [ "$PART" = 1 ]; then
  timeout ${TEST_LIMIT:-330} python -m pytest -q -m cuda -p no:cacheprovider tests/ 2>&1 | tee $OUT/cuda_tests.log | tail -8
fi
if [ "$PART" = all ] || [ "$PART" = 2 ]; then
  timeout 150 python bench/speed.py --preset h200 --repeat 3 --only h200:plain,h200:compare,h200:stream,h200:metrics \
    --json $OUT/h200_speed_round11.json 2>&1 | tail -6
fi
if [ "$PART" = all ] || [ "$PART" = 3 ]; then
  timeout 150 python bench/speed.py --preset h200 --repeat 1 --only gpu_mid:plain,gpu_mid:compare,gpu_mid:cli_inproc,gpu_mid:isolated \
    --json $OUT/gpu_mid_round11.json 2>&1 | tail -6
fi
if [ "$PART" = 4 ]; then  # where the isolated diff's children spend their time (cProfile per process)
  mkdir -p $OUT/prof
  cd /tmp && env DIFFKIT_DEPTH=12 DIFFKIT_BATCH=4 DIFFKIT_SEQ=1024 DIFFKIT_DIM=1024 DIFFKIT_HEADS=16 \
    PYTHONPATH=$OLDPWD/bench/prof_site:$OLDPWD DIFFKIT_PROFILE_DIR=$OUT/prof \
    python -m diffkit.cli diff $OLDPWD/references/deep_transformer.py $OLDPWD/kernels/deep_transformer_fused.py \
    --trials 1 --no-report --device cuda 2>&1 | tail -2
  cd $OLDPWD
fi
