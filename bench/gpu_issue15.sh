#!/usr/bin/env bash
# GPU checks for issue 15 in one call (device time is scarce): the Triton metric kernels against the
# exact path, a profile of one full-capture compare of the 24-block transformer, and the H200 speed
# figures (bench/speed.py --preset h200), JSON under $OUT.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp}
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0))"
timeout 150 python bench/metrics_kernel_tune.py 2>&1 | tail -20
timeout 200 python -m pytest -q -x -m cuda -p no:cacheprovider tests/test_metrics.py 2>&1 | tail -6
DIFFKIT_DEPTH=24 DIFFKIT_BATCH=4 DIFFKIT_SEQ=2048 DIFFKIT_DIM=1024 DIFFKIT_HEADS=16 timeout 200 python - <<'PY' 2>&1 | tail -45
import cProfile, pstats, time, torch, diffkit
pair = diffkit.load_pair("references/deep_transformer.py", "kernels/deep_transformer_fused.py", device="cuda")
kw = dict(health=False, rerun=False)
diffkit.compare(pair.ref, pair.cand, pair.ref_inputs, cand_inputs=pair.cand_inputs, **kw)
torch.cuda.synchronize(); t = time.perf_counter()
diffkit.compare(pair.ref, pair.cand, pair.ref_inputs, cand_inputs=pair.cand_inputs, **kw)
torch.cuda.synchronize(); print("compare s", time.perf_counter() - t)
pr = cProfile.Profile(); pr.enable()
diffkit.compare(pair.ref, pair.cand, pair.ref_inputs, cand_inputs=pair.cand_inputs, **kw)
torch.cuda.synchronize(); pr.disable()
st = pstats.Stats(pr); st.sort_stats("cumulative").print_stats(22); st.sort_stats("tottime").print_stats(12)
PY
timeout 300 python bench/speed.py --preset h200 --repeat 2 --only h200:plain,h200:compare,h200:naive,h200:metrics \
  --json "$OUT/h200_speed.json" 2>&1 | tail -8
[ -n "${STREAM:-}" ] && timeout 150 python bench/speed.py --preset h200 --repeat 1 --only h200:plain,h200:stream --json "$OUT/h200_stream.json" 2>&1 | tail -4
