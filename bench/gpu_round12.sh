#!/usr/bin/env bash
# GPU checks of round 12 (the reference's values handed over as CUDA IPC handles), one call per part:
#   1. every CUDA-marked test (test_suite.py left out: the device has no junitparser, and none of it is CUDA);
#   2. the half-size transformer: plain forwards, the CLI in one process, isolated (hand-over) and isolated
#      through files (DIFFKIT_NO_HANDOVER=1), cold processes, JSON in $OUT;
#   3. where the isolated diff's processes spend their time, with the hand-over (cProfile per process).
# `PART=1|2|3 bash bench/gpu_round12.sh` runs one part.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp}
PART=${PART:-all}
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
if [ "$PART" = combo ]; then  # one call: the hand-over's own tests, the benchmark, then the other CUDA tests
  T0=$(date +%s)
  timeout 200 python -m pytest -q -m cuda -p no:cacheprovider tests/test_gpu.py tests/test_store_isolate.py \
    -k "handed_over or crash_after_the_hand_over or pinned" 2>&1 | tee $OUT/cuda_handover.log | tail -6
  timeout 240 python bench/speed.py --preset h200 --repeat 1 \
    --only gpu_mid:plain,gpu_mid:cli_inproc,gpu_mid:isolated,gpu_mid:isolated_files,gpu_mid:default_cli \
    --json $OUT/gpu_mid_round12.json 2>&1 | tail -8
  LEFT=$(( ${BUDGET:-570} - ($(date +%s) - T0) ))
  echo "cuda tests get ${LEFT} s"
  timeout $LEFT python -m pytest -q -m cuda -p no:cacheprovider tests/ --ignore=tests/test_suite.py \
    -k "not handed_over and not crash_after_the_hand_over and not pinned and not sanitize" 2>&1 \
    | tee $OUT/cuda_tests.log | tail -8
fi
if [ "$PART" = all ] || [ "$PART" = 1 ]; then
  timeout ${TEST_LIMIT:-540} python -m pytest -q -m cuda -p no:cacheprovider tests/ --ignore=tests/test_suite.py \
    ${TESTS_K:+-k "$TESTS_K"} 2>&1 | tee $OUT/cuda_tests.log | tail -12
fi
if [ "$PART" = all ] || [ "$PART" = 2 ]; then
  timeout 400 python bench/speed.py --preset h200 --repeat ${REPEAT:-1} \
    --only gpu_mid:plain,gpu_mid:cli_inproc,gpu_mid:isolated,gpu_mid:isolated_files,gpu_mid:default_cli \
    --json $OUT/gpu_mid_round12.json 2>&1 | tail -8
fi
if [ "$PART" = all ] || [ "$PART" = 3 ]; then
  mkdir -p $OUT/prof
  cd /tmp && env DIFFKIT_DEPTH=12 DIFFKIT_BATCH=4 DIFFKIT_SEQ=1024 DIFFKIT_DIM=1024 DIFFKIT_HEADS=16 \
    PYTHONPATH=$OLDPWD/bench/prof_site:$OLDPWD DIFFKIT_PROFILE_DIR=$OUT/prof \
    python -m diffkit.cli diff $OLDPWD/references/deep_transformer.py $OLDPWD/kernels/deep_transformer_fused.py \
    --trials 1 --no-report --device cuda --json $OUT/prof/r.json 2>&1 | tail -2
  cd $OLDPWD
  python - "$OUT/prof" <<'PY'
import glob, os, pstats, sys
d = sys.argv[1]
for txt in sorted(glob.glob(os.path.join(d, "*.txt"))):
    lines = open(txt).read().splitlines()
    start, end = float(lines[1].split()[1]), float(lines[2].split()[1])
    print(f"== {lines[0][-90:]}  {end - start:.2f} s")
    pstats.Stats(txt[:-4] + ".prof").sort_stats("cumulative").print_stats(14)
PY
fi
