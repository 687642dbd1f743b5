#!/usr/bin/env bash
# Everything GPU-side, in named parts: `bash bench/gpu.sh PART [PART ...]`, from the repository root or anywhere.
# Each part fits one 10-minute device call (the tool library's `run`, which runs this on a GPU machine from the repo
# root with $OUT set); JSON and logs go under $OUT (default /tmp), what a part measures is printed.
# docs/performance.md says which target each part measures and its figure now.
#
#   tests     the CUDA-marked tests (pytest -m cuda), five pytest processes side by side, T s each (default 470);
#             the two CUDA extensions are built once first (bench/gpu_run.py build). Log: $OUT/cuda_tests.log
#   speed     bench/speed.py --preset h200: the 24-block transformer (B4 S2048 D1024 float32): plain, compare (full
#             capture, its metric passes timed alone), stream (40G), metrics (1 GiB pair). NEEDS AN H200: the full
#             capture peaks at ~108 GB beyond the models (on an H100 `compare` reads "error"). $OUT/speed_h200.json
#   stream    the streaming diff of the same transformer at 40G (fits an H100): speed.py h200:plain,h200:stream;
#             PROFILE=1 adds bench/lockstep_profile.py (both threads under cProfile, syncs, device busy time)
#   mid       the same transformer at 12 blocks, B4 S1024 D1024 (fits an H100): plain, compare (with its metric
#             passes), stream (MID_STREAM, default 4G), default, the CLI in one process (--no-isolate), isolated,
#             five trials; fresh processes for the CLI modes, as a user runs them. $OUT/speed_mid.json
#   metrics   the metric kernel: tests/test_metrics.py -m cuda, bench/metrics_kernel_tune.py (the kernel alone over
#             its knobs), bench/direct_vs_table.py (a launch per pair against the address table), speed.py
#             h200:metrics (a 1 GiB float32 pair through measure_many, against a device copy)
#   host      bench/host_overhead.py: how fast this box's host runs diffkit's own Python (tiny forwards)
#   axial     bench/gpu_run.py timing: the axial-attention CUDA candidate at B4 64x64 dim 256 (issue 6's figure)
#   sanitizer bench/gpu_run.py sanitizer: the raw compute-sanitizer logs of the memcheck and racecheck cases
#   scale     bench/scale.py --preset h200 --dtype float32 --max-memory 40G: plain / stream / full / by-hand, each
#             in its own process, with device peak and host RSS (NEEDS AN H200 for `full`). $OUT/scale_h200.json
#   profile   where an isolated `diffkit diff` of the `mid` transformer spends its time: every Python process and
#             thread sampled through bench/prof_site (the forked child too), then every process's main thread on one
#             clock (bench/prof_site/timeline.py); PROFILE_ARGS (default "--trials 1 --no-report"), PROFILE_LINES,
#             DIFFKIT_SAMPLE_WRITE_S (how often a process writes its samples). Files: $OUT/prof/<pid>.samples.txt
#   equiv     bench/equivalence.py record --gpu over the CUDA/Triton candidates: $OUT/equiv_cuda.json; with
#             BEFORE=FILE (a record of another tree, carried), compared with it
#   ab        OLD=TREE: bench/ab_stream.py TREE . -- the streaming diff with another tree's diffkit and this one's,
#             in turns (ROUNDS, default 3)
#   wall      bench/gpu_wall.py: `diffkit diff` (five trials, one trial, children forked) against a KernelBench-style
#             baseline (bench/kb_baseline.py), wall time and the card's peak memory, for the `mid` transformer and
#             KernelBench level 2 problem 19 at full size (bench/models/). MODELS (default mid,l2_19). $OUT/wall.json
#   passes    the metric passes of the mid transformer: tests/test_metrics.py -m cuda, bench/metric_passes.py (first
#             and later batch sizes swept; with OLD=TREE the same from that tree), --host-profile (the host's side by
#             function), bench/compare_profile.py (a compare's device time and host functions), the streaming diff at
#             PASSES_STREAM budgets (default "4G 12G": evictions and recoveries printed)
#   sync      where an in-process compare of the mid transformer makes the host wait for the device, and each of its
#             steps' host time (bench/sync_sites.py; tiny12, the same 12 blocks at toy size: the host's cost alone),
#             tests/test_metrics.py -m cuda, bench/nan_pairs.py (candidates full of NaN: the passes' worst case; with
#             OLD=TREE the same from that tree), the mid compare (speed.py; with OLD=TREE, that tree's too)
#   memory    problem 19 at full size: three diffs side by side on the card, then capped with --device-memory 24G
#             against uncapped (the same answer in each)
#   all       tests speed stream mid metrics host axial (more than one call's worth: run parts one call at a time)
#
# Knobs: OUT, MODELS (wall), T (tests' limit per process), REPEAT (speed/stream/mid repeats), SPEED_ONLY (speed.py --only for
# `speed`), PROFILE, PROFILE_ARGS (the profiled diff's options, default "--trials 1 --no-report"), BEFORE, OLD (ab, passes), ROUNDS, PASSES_STREAM.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp}
mkdir -p "$OUT"
[ $# -gt 0 ] || { sed -n "2,/^set -u/p" "$0" | sed "\$d"; exit 2; }
parts=("$@")
[ "${parts[*]}" = all ] && parts=(tests speed stream mid metrics host axial)
for p in "${parts[@]}"; do
  grep -q "^part_$p()" "$0" || { echo "unknown part: $p (see: bash bench/gpu.sh)"; exit 2; }
done
export PYTHONUNBUFFERED=1

python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
python -c "import triton; print('triton', triton.__version__)" 2>/dev/null || echo "triton: not installed"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader 2>/dev/null
lscpu 2>/dev/null | grep -E "Model name|^CPU\(s\)" | head -2
# diffkit's child processes import the installed package (not the current folder): install this tree if needed
if command -v nvidia-smi >/dev/null && ! (cd / && python -c "import diffkit" 2>/dev/null); then
  python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 \
    && echo "diffkit installed from this tree (editable)" || echo "warning: diffkit is not importable outside this tree"
fi

speed() {  # speed.py with a limit; its last lines are the summary
  local limit=$1; shift
  timeout "$limit" python bench/speed.py "$@" 2>&1 | grep -v Warning | tail -"${TAIL:-16}"
}

part_tests() {
  python bench/gpu_run.py build 2>&1 | tail -1
  local T=${T:-470} i=0
  run() { i=$((i + 1)); ( timeout "$T" python -m pytest -q -m cuda -p no:cacheprovider -rf "$@" > "$OUT/cuda_$i.log" 2>&1 ) & }
  run tests/test_gpu.py -k "cuda_candidate and axial"
  run tests/test_gpu.py -k "cuda_candidate and (invariant or row_softmax)"
  run tests/test_gpu.py -k "cuda_candidate and not axial and not invariant and not row_softmax"
  run tests/ --ignore=tests/test_fused.py -k "not cuda_candidate" --continue-on-collection-errors
  run tests/test_fused.py
  wait
  : > "$OUT/cuda_tests.log"
  for f in $(seq 1 $i); do
    { echo "== group $f"; cat "$OUT/cuda_$f.log"; } >> "$OUT/cuda_tests.log"
    echo "== group $f: $(grep -E "passed|failed|error" "$OUT/cuda_$f.log" | tail -1)"
    grep -E "^(FAILED|ERROR)" "$OUT/cuda_$f.log" | head -8
    rm -f "$OUT/cuda_$f.log"
  done
}

part_speed() {
  speed "${SPEED_S:-500}" --preset h200 --repeat "${REPEAT:-5}" \
    --only "${SPEED_ONLY:-h200:plain,h200:compare,h200:stream,h200:metrics}" --json "$OUT/speed_h200.json"
}

part_stream() {
  speed "${STREAM_S:-300}" --preset h200 --repeat "${REPEAT:-5}" --only h200:plain,h200:stream --json "$OUT/speed_stream.json"
  if [ "${PROFILE:-0}" = 1 ]; then
    timeout 200 python bench/lockstep_profile.py > "$OUT/lockstep_profile.txt" 2>&1
    tail -5 "$OUT/lockstep_profile.txt"
  fi
}

part_mid() {
  # (--max-memory: the streaming diff's budget, about a third of what the full capture compares, as 40G is of the
  # 24-block model's; the other modes do not read it)
  local only=gpu_mid:plain,gpu_mid:compare,gpu_mid:stream,gpu_mid:default
  only+=,gpu_mid:cli_inproc,gpu_mid:isolated,gpu_mid:default_cli
  speed "${MID_S:-400}" --preset h200 --repeat "${REPEAT:-3}" --max-memory "${MID_STREAM:-4G}" --only "$only" \
    --json "$OUT/speed_mid.json"
}

part_metrics() {
  timeout 200 python -m pytest -q -m cuda -p no:cacheprovider -rf tests/test_metrics.py 2>&1 | tail -3
  timeout 120 python bench/metrics_kernel_tune.py 2>&1 | grep -v Warning | tail -16
  timeout 90 python bench/direct_vs_table.py 2>&1 | grep -v Warning | tail -8
  TAIL=4 speed 120 --preset h200 --repeat 5 --only h200:metrics
}

part_passes() {  # the metric passes of the mid transformer, and what `compare` spends beyond its forwards
  timeout 110 python -m pytest -q -m cuda -n 8 -p no:cacheprovider -rf tests/test_metrics.py 2>&1 | tail -3
  timeout 90 python bench/metric_passes.py --model gpu_mid --repeat 7 --first-pairs 8,16,32 --batch-pairs 32,64 \
    2>&1 | grep -v Warning | grep -v RESULT
  if [ -d "${OLD:-}/bench" ]; then
    echo "-- the same from $OLD"
    timeout 60 python "$OLD/bench/metric_passes.py" --model gpu_mid --repeat 7 2>&1 | grep -v Warning | grep -v RESULT
  fi
  timeout 60 python bench/metric_passes.py --model gpu_mid --host-profile 20 2>&1 | grep -v Warning | head -40
  timeout 60 python bench/compare_profile.py --model gpu_mid --lines 25 2>&1 | grep -v Warning | head -60
  for m in ${PASSES_STREAM:-4G 12G}; do
    TAIL=2 speed 60 --preset h200 --repeat 3 --max-memory "$m" --only gpu_mid:plain,gpu_mid:stream
  done
}

part_wall() {
  timeout 560 python bench/gpu_wall.py --models "${MODELS:-mid,l2_19}" --repeat "${REPEAT:-2}" --json "$OUT/wall.json" \
    2>&1 | grep -v Warning
}

part_memory() {  # (each run builds the candidate's extension first: a warm-up baseline)
  timeout 280 python bench/gpu_wall.py --models l2_19 --side-by-side 3 2>&1 | grep -v Warning
  timeout 280 python bench/gpu_wall.py --models l2_19 --device-memory 24G 2>&1 | grep -v Warning
}

part_sync() {  # where a GPU compare waits on the device, its steps' host time; the all-NaN worst case of the passes
  timeout 120 python -m pytest -q -m cuda -n 8 -p no:cacheprovider -rf tests/test_metrics.py 2>&1 | tail -3
  timeout 70 python bench/sync_sites.py --model gpu_mid 2>&1 | grep -v Warning
  timeout 40 python bench/sync_sites.py --model tiny12 2>&1 | grep -v Warning
  timeout 45 python bench/nan_pairs.py 2>&1 | grep -v Warning
  if [ -d "${OLD:-}/diffkit" ]; then timeout 45 python bench/nan_pairs.py --tree "$OLD" 2>&1 | grep -v Warning; fi
  TAIL=3 speed 70 --preset h200 --repeat 5 --only gpu_mid:plain,gpu_mid:compare
  if [ -f "${OLD:-}/bench/speed.py" ]; then  # (the same from OLD's tree, in the same call: host speed moves between calls)
    echo "-- the same from $OLD"
    timeout 70 python "$OLD/bench/speed.py" --preset h200 --repeat 5 --only gpu_mid:plain,gpu_mid:compare 2>&1 \
      | grep -v Warning | tail -3
  fi
}

part_host() { timeout 120 python bench/host_overhead.py --repeat 5 2>&1 | grep -v Warning; }
part_axial() { timeout 300 python bench/gpu_run.py timing 2>&1 | grep -v Warning | head -12; }
part_sanitizer() { timeout 560 python bench/gpu_run.py sanitizer 2>&1 | grep -v Warning; }

part_scale() {
  timeout 560 python bench/scale.py --preset h200 --dtype float32 --max-memory 40G --repeat 1 \
    --json "$OUT/scale_h200.json" 2>&1 | grep -v Warning | tail -12
}

part_profile() {
  local dir=$OUT/prof root=$PWD
  mkdir -p "$dir"
  # every process of the diff sampled (all threads; the forked child too): bench/prof_site, DIFFKIT_SAMPLE_DIR
  (cd /tmp && env DIFFKIT_DEPTH=12 DIFFKIT_BATCH=4 DIFFKIT_SEQ=1024 DIFFKIT_DIM=1024 DIFFKIT_HEADS=16 \
    PYTHONPATH="$root/bench/prof_site:$root" DIFFKIT_SAMPLE_DIR="$dir" \
    timeout 300 python -m diffkit.cli diff "$root/references/deep_transformer.py" "$root/kernels/deep_transformer_fused.py" \
    ${PROFILE_ARGS:---trials 1 --no-report} --device cuda 2>&1 | tail -2)
  for f in "$dir"/*.samples.txt; do echo "== $f"; head -"${PROFILE_LINES:-45}" "$f"; done
  echo "== every process's main thread on one clock (s from the first start; pid, seconds, what)"
  python bench/prof_site/timeline.py "$dir"
}

part_equiv() {
  local cands=(kernels/fused/axial_attention_cuda_ok.py kernels/fused/axial_attention_cuda_tail.py
               kernels/axial_attention_cuda.py kernels/axial_attention_cuda_race.py kernels/fused/swiglu_mlp_cuda_tail.py
               kernels/row_softmax_cuda.py kernels/invariant_point_attention_crash.py kernels/transformer_block_triton.py
               kernels/transformer_block_triton_tail.py kernels/triangle_multiplicative_update_cuda_tail.py)
  timeout 560 python bench/equivalence.py record --gpu --tree . --out "$OUT/equiv_cuda.json" "${cands[@]}" 2>&1 | tail -14
  if [ -n "${BEFORE:-}" ]; then python bench/equivalence.py compare "$BEFORE" "$OUT/equiv_cuda.json"; fi
}

part_ab() {
  [ -d "${OLD:-}/diffkit" ] || { echo "ab: set OLD to a tree holding another diffkit/ (carried)"; return 1; }
  ROUNDS=${ROUNDS:-3} timeout 400 python bench/ab_stream.py "$OLD" . 2>&1 | grep -v Warning
}

status=0
for p in "${parts[@]}"; do
  echo; echo "######## $p ($(date -u +%H:%M:%S))"
  T0=$(date +%s)
  "part_$p" || status=1
  echo "######## $p took $(( $(date +%s) - T0 )) s"
done
exit $status
