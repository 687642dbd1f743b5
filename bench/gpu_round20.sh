#!/usr/bin/env bash
# Round 20's GPU call: the CUDA tests after this round's alignment changes (rivals found lazily in the dataflow
# pass, reference fingerprints computed as scored, the value pass's screen) and the CPU metric kernel's float32
# lanes (not used on a GPU, but the CUDA tests of test_metrics compare both paths): five pytest processes side by
# side, as round 17's (bench/gpu_round17_tests.sh), T seconds at most each.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp}
T=${T:-470} bash bench/gpu_round17_tests.sh
