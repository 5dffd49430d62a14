#!/usr/bin/env bash
# One H200 round of the CuTeDSL kernel (issue 16): GPU tests, then the benchmark of the op and of the kernel variants
# whose GPU tests passed (a variant that fails or hangs its test is not timed). Not collected by pytest.
# Usage: bash tests/gpu_round_cute.sh OUT COMMIT [ROUNDS]   (writes OUT/tests.log, OUT/bc.json, OUT/scoreboard.json)
set -u
OUT=$1
COMMIT=$2
ROUNDS=${3:-5}
mkdir -p "$OUT"
timeout -k 5 60 python3 -m pytest -q -rA tests/test_gpu_cutedsl.py \
  -k 'vs_float64 or groups_vs_sms or overlap_grids' > "$OUT/tests.log" 2>&1
tail -n 40 "$OUT/tests.log" | grep -E "passed|failed|PASSED .*overlap|FAILED|Timeout|error" | tail -n 12
passed() { grep -q "PASSED tests/test_gpu_cutedsl.py::test_cutedsl_overlap_grids\[$1\]" "$OUT/tests.log"; }
V="evict smem persistent"
passed bf16-d128-lse && V="$V,evict smem overlap"
passed bf16-d128-lse-phased && V="$V,evict smem overlap phased"
passed bf16-d128-lse-pstore && V="$V,evict smem overlap pstore"
echo "variants timed: $V"
python3 tests/bench_cutedsl.py --out "$OUT/bc.json" --commit "$COMMIT" --rounds "$ROUNDS" \
  --op-rows "counts + kernel" --variants "$V"
