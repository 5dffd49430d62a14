#!/usr/bin/env bash
# One H200 round of the CuTeDSL kernel (issue 16): GPU tests, then the benchmark of the op and of the kernel variants
# whose GPU tests passed (a variant that fails or hangs its test is not timed). Not collected by pytest.
# Usage: bash tests/gpu_round_cute.sh OUT COMMIT [ROUNDS]   (writes OUT/tests.log, OUT/bc.json, OUT/scoreboard.json)
set -u
OUT=$1
COMMIT=$2
ROUNDS=${3:-4}
mkdir -p "$OUT"
# the op (staged epilogue: persistent + overlap; its kernel's SASS unchanged since round s6r2) at D 128 in both dtypes,
# more / fewer groups than SMs; the new options on persistent grids of 1-500 CTAs (compiles ~5 s each)
timeout -k 3 50 python3 -m pytest -q -rA -p no:cacheprovider tests/test_gpu_cutedsl.py \
  -k '(vs_float64 and ragged-kalloc704 and 128) or groups_vs_sms or (overlap_grids and (hide or tma))' \
  > "$OUT/tests.log" 2>&1
grep -E "^(PASSED|FAILED|ERROR)|passed|failed|Timeout" "$OUT/tests.log" | tail -n 14
passed() { grep -q "^PASSED tests/test_gpu_cutedsl.py::$1" "$OUT/tests.log"; }
ROWS=""  # the op with "hide_epi" (bench_cutedsl.OP_OTHER_OPTIONS) beside the default, if its GPU tests passed
V=""
if passed "test_cutedsl_overlap_grids\[hide-bf16-d128\]" && passed "test_cutedsl_overlap_grids\[hide-fp16-d64-lse\]"
then
  ROWS="options"
  passed "test_cutedsl_overlap_grids\[hide-tmaq-bf16-d128\]" && V="hide tma_q"
  passed "test_cutedsl_overlap_grids\[hide-tmah-bf16-d128\]" && V="${V:+$V,}hide tma_h"
fi
echo "op rows: op${ROWS:+, op + $ROWS}; variants timed: ${V:-none}"
timeout -k 3 57 python3 tests/bench_cutedsl.py --out "$OUT/bc.json" --commit "$COMMIT" --rounds "$ROUNDS" \
  --no-compile-times --op-rows "$ROWS" --variants "$V"
