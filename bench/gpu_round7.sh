#!/usr/bin/env bash
# GPU checks of round 7, part 1 (one call): the CUDA tests touching capture, folding and the metrics, then
# the recurrent candidates in the step-by-step styles through the CLI on the H200 at the benchmark's size
# (6 layers, 512 steps), timed, next to two plain forwards.  Part 2 is bench/speed.py --preset h200.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp}
timeout 330 python -m pytest -q -m cuda -p no:cacheprovider tests/test_metrics.py tests/test_stream.py tests/test_gpu.py \
  tests/test_fold.py 2>&1 | tail -6
export DIFFKIT_GRU_LAYERS=6 DIFFKIT_GRU_SEQ=512
python - <<'PY'
import time, torch, diffkit
for cand in ("kernels/bench/gru_bidirectional_triton_steps.py", "kernels/bench/gru_bidirectional_slab.py"):
    p = diffkit.load_pair("references/gru_bidirectional.py", cand, device="cuda")
    with torch.no_grad():
        p.ref(*p.ref_inputs); p.cand(*p.cand_inputs); torch.cuda.synchronize()
        t0 = time.perf_counter(); p.ref(*p.ref_inputs); p.cand(*p.cand_inputs); torch.cuda.synchronize()
    print(f"plain two forwards {cand}: {time.perf_counter() - t0:.3f} s")
PY
for c in gru_bidirectional_triton_steps gru_bidirectional_slab; do
  TIMEFORMAT="cli $c: %R s"
  time (timeout 200 python cli.py diff references/gru_bidirectional.py kernels/bench/$c.py --device cuda --no-report \
    --json "$OUT/gru_$c.json" 2>&1 | tail -2)
done
