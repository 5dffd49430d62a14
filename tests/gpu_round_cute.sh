#!/usr/bin/env bash
# One H200 round of the CuTeDSL kernel (issue 16): GPU tests, then the benchmark of the op and of the kernel variants
# whose GPU tests passed (a variant that fails or hangs its test is not timed). Not collected by pytest.
# Usage: bash tests/gpu_round_cute.sh OUT COMMIT [ROUNDS]   (writes OUT/tests.log, OUT/bc.json, OUT/scoreboard.json)
set -u
OUT=$1
COMMIT=$2
ROUNDS=${3:-4}
mkdir -p "$OUT"
# the op (staged epilogue: persistent + overlap) in every dtype / head dim / LSE form; the "hide_epi" kernel on grids
timeout -k 3 45 python3 -m pytest -q -rA -p no:cacheprovider tests/test_gpu_cutedsl.py \
  -k 'vs_float64 or groups_vs_sms or overlap_grids' > "$OUT/tests.log" 2>&1
grep -E "^(PASSED|FAILED|ERROR)|passed|failed|Timeout" "$OUT/tests.log" | grep -v "vs_float64" | tail -n 12
grep -cE "^PASSED.*vs_float64" "$OUT/tests.log" | sed 's/^/op vs float64 passed: /'
passed() { grep -q "^PASSED tests/test_gpu_cutedsl.py::$1" "$OUT/tests.log"; }
ROWS=""  # the op with "hide_epi" (bench_cutedsl.OP_OTHER_OPTIONS) beside the default, if its GPU tests passed
V="evict smem overlap"  # the op's kernel launched directly
if passed "test_cutedsl_overlap_grids\[hide-bf16-d128-lse\]" && passed "test_cutedsl_overlap_grids\[hide-fp16-d64\]"
then
  ROWS="options"
  V="$V,evict smem hide"
fi
echo "op rows: op${ROWS:+, op + $ROWS}; variants timed: $V"
timeout -k 3 62 python3 tests/bench_cutedsl.py --out "$OUT/bc.json" --commit "$COMMIT" --rounds "$ROUNDS" \
  --no-compile-times --op-rows "$ROWS" --variants "$V"
