#!/usr/bin/env bash
# Round 18, second call: where compute-sanitizer racecheck's "Internal Sanitizer Error: The Sanitizer failed to handle
# a hardware exception" comes from (round 18's first call: the axial race candidate's process under racecheck, the
# failure in a cuBLASLt gemm+bias of the what-if search's reference reruns).
#   1. a bare F.linear with bias (the shapes that failed) under racecheck: no filter / diffkit's kernel filter;
#   2. the axial race diff under racecheck with --no-explain (no what-if reruns in the sanitized process);
#   3. a diverging candidate without a race (the unwritten tail) under racecheck, what-if on.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp}
SAN=$(python -c "from diffkit.sanitize import find_tool; print(find_tool())")
echo "sanitizer: $SAN"; $SAN --version | tail -1
cat > $OUT/lin.py <<'PY'
import torch, torch.nn.functional as F
torch.manual_seed(0)
x = torch.randn(120, 32, device="cuda"); w = torch.randn(96, 32, device="cuda"); b = torch.randn(96, device="cuda")
y = F.linear(x, w, b); torch.cuda.synchronize(); print("linear ok", float(y.abs().sum()))
z = x @ w.t(); torch.cuda.synchronize(); print("matmul ok", float(z.abs().sum()))
PY
for filt in none diffkit; do
  args=(); [ $filt = diffkit ] && args=(--kernel-name "regex=.*(linear_kernel|ln_linear_kernel).*")
  timeout 120 $SAN --tool racecheck "${args[@]}" python $OUT/lin.py > $OUT/lin_$filt.out 2>&1
  echo "== bare F.linear under racecheck, filter $filt: rc $?"; grep -E "ok|Internal|Error|SUMMARY" $OUT/lin_$filt.out | head -5
done
run() {  # name cand extra...
  local name=$1 cand=$2; shift 2
  timeout 280 python cli.py diff references/axial_attention.py $cand --device cuda --json $OUT/$name.json --no-report \
    --timeout 250 "$@" > $OUT/$name.out 2>&1
  echo "== $name rc $?"; tail -2 $OUT/$name.out
  python -c "
import json,sys; d=json.load(open('$OUT/$name.json')); e=d.get('error') or {}
fd=d.get('first_divergence') or {}
print('verdict', d['verdict'], '| first', fd.get('ref_name'), [f['kind'] for f in (d.get('root_cause') or fd).get('diagnosis', [])] if fd else None)
print('error', e.get('message', '')[:300]); print('warnings', [w[:160] for w in d.get('warnings', [])][:4])"
}
run race_noexplain kernels/axial_attention_cuda_race.py --sanitize racecheck --no-explain
run tail_racecheck kernels/axial_attention_cuda_tail.py --sanitize racecheck
