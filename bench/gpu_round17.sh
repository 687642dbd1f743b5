#!/usr/bin/env bash
# GPU call of round 17, one call on an H200 (the full capture needs ~108 GB):
#   1. how fast this box's host is (bench/host_overhead.py: diffkit's own Python on tiny forwards, on the CPU);
#   2. the metric kernel's tuning knobs on this card (bench/metrics_kernel_tune.py);
#   3. where the streaming diff spends its time here (bench/lockstep_profile.py: both threads under cProfile,
#      synchronising calls, device busy time);
#   4. bench/speed.py's H200 set (plain, compare, stream, metrics), JSON in $OUT.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp}
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
lscpu | grep -E "Model name|^CPU\(s\)|MHz" | head -4
[ "${HOST:-1}" = 1 ] && timeout 90 python bench/host_overhead.py --repeat 5 2>&1 | grep -v Warning
[ "${TUNE:-1}" = 1 ] && timeout 100 python bench/metrics_kernel_tune.py 2>&1 | grep -v Warning
[ "${PROFILE:-1}" = 1 ] && timeout 170 python bench/lockstep_profile.py > $OUT/lockstep_profile.txt 2>&1; tail -3 $OUT/lockstep_profile.txt
timeout ${SPEED_S:-280} python bench/speed.py --preset h200 --repeat ${REPEAT:-5} \
  --only ${SPEED_ONLY:-h200:plain,h200:compare,h200:stream,h200:metrics} \
  --json $OUT/h200_speed_round17.json 2>&1 | tail -10
