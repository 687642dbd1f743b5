#!/usr/bin/env bash
# Round 18, one H100/H200 call: why the axial race candidate's process ends with an illegal memory access under
# --sanitize racecheck (round 17b): the whole error (the candidate's stderr), the sanitizer's raw log, and the same
# diff under memcheck (does a kernel really access out of bounds?).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp}
python -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
for tool in racecheck memcheck; do
  DIFFKIT_SANITIZER_COPY=$OUT/san_$tool.log timeout 280 python cli.py diff references/axial_attention.py \
    kernels/axial_attention_cuda_race.py --device cuda --json $OUT/race_$tool.json --no-report --timeout 250 \
    --sanitize $tool > $OUT/race_$tool.out 2>&1
  echo "== $tool rc $?"; tail -5 $OUT/race_$tool.out
  python - "$OUT/race_$tool.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print("verdict", d["verdict"]); e = d.get("error") or {}
print("error:", {k: (v if k != "details" else None) for k, v in e.items()})
print("details tail:\n", (e.get("details") or "")[-3500:])
print("trials:", [(t.get("trial"), t.get("allclose"), (t.get("error") or "")[:200]) for t in d.get("trials", [])])
print("second_run:", d["meta"].get("second_run"))
PY
done
