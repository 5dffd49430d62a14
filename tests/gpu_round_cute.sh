#!/usr/bin/env bash
# One H200 round of the CuTeDSL kernel (issue 16): GPU tests, then the benchmark of the op and of the kernel variants
# whose GPU tests passed (a variant that fails or hangs its test is not timed). Not collected by pytest.
# Usage: bash tests/gpu_round_cute.sh OUT COMMIT [ROUNDS]   (writes OUT/tests.log, OUT/bc.json, OUT/scoreboard.json)
set -u
OUT=$1
COMMIT=$2
ROUNDS=${3:-3}
mkdir -p "$OUT"
# the op (staged epilogue: persistent + overlap; its kernel's instructions unchanged since round s6r2) at D 128 bf16,
# more / fewer groups than SMs; the new options: hide_epi / tma_q / tma_h on persistent grids of 1-500 CTAs, the op
# with split_tail (+ hide_epi) on 138 / 140 groups (compiles ~5 s each)
timeout -k 3 50 python3 -m pytest -q -rA -p no:cacheprovider tests/test_gpu_cutedsl.py \
  -k '(vs_float64 and ragged-kalloc704 and 128-bf16) or groups_vs_sms or split_tail or (overlap_grids and (hide-bf16 or hide-tma))' \
  > "$OUT/tests.log" 2>&1
grep -E "^(PASSED|FAILED|ERROR)|passed|failed|Timeout" "$OUT/tests.log" | tail -n 14
passed() { grep -q "^PASSED tests/test_gpu_cutedsl.py::$1" "$OUT/tests.log"; }
ROWS=""  # the op with candidate option sets beside the default, each only if its GPU tests passed
OPS=""
V=""
if passed "test_cutedsl_overlap_grids\[hide-bf16-d128\]"; then
  ROWS="options"
  OPS="persistent,overlap,hide_epi"
  V="evict smem hide"
  passed "test_cutedsl_split_tail\[138-groups-ragged-lse\]" && passed "test_cutedsl_split_tail\[140-groups\]" \
    && OPS="$OPS;persistent,overlap,hide_epi,split_tail"
  passed "test_cutedsl_overlap_grids\[hide-tmaq-bf16-d128\]" && V="$V,hide tma_q"
  passed "test_cutedsl_overlap_grids\[hide-tmah-bf16-d128\]" && V="$V,hide tma_h"
fi
echo "op rows: op${OPS:+; op with $OPS}; kernel rows: ${V:-none}"
timeout -k 3 57 python3 tests/bench_cutedsl.py --out "$OUT/bc.json" --commit "$COMMIT" --rounds "$ROUNDS" \
  --no-compile-times --op-rows "$ROWS" --op-options "$OPS" --variants "$V"
