#!/usr/bin/env bash
# One H200 round of the CuTeDSL kernel (issue 16): GPU tests, then the benchmark of the op and of the option sets
# whose GPU tests passed (one that fails or hangs its test is not timed). Not collected by pytest.
# Usage: bash tests/gpu_round_cute.sh OUT COMMIT [ROUNDS]   (writes OUT/tests.log, OUT/bc.json, OUT/scoreboard.json)
set -u
OUT=$1
COMMIT=$2
ROUNDS=${3:-4}
mkdir -p "$OUT"
# the op (default since round s7r2: persistent + overlap + hide_epi + split_tail) in every dtype / head dim with the
# LSE (192 and 144 groups: the last round split, the 144 ragged), more / fewer groups than SMs, split_tail on 138 /
# 140 groups; hide_epi alone (fp16 D 64 LSE, bf16 D 128) and with l2_ahead on grids of 1-500 CTAs (~7 compiles)
timeout -k 3 52 python3 -m pytest -q -rA -p no:cacheprovider tests/test_gpu_cutedsl.py \
  -k '(vs_float64 and (S3008 or S4000)) or groups_vs_sms or split_tail or (overlap_grids and (hide or l2ahead))' \
  > "$OUT/tests.log" 2>&1
grep -E "^(PASSED|FAILED|ERROR)|passed|failed|Timeout" "$OUT/tests.log" | tail -n 14
passed() { grep -q "^PASSED tests/test_gpu_cutedsl.py::$1" "$OUT/tests.log"; }
OPS="persistent,overlap"  # the previous default, beside the op
passed "test_cutedsl_overlap_grids\[hide-bf16-d128\]" && passed "test_cutedsl_overlap_grids\[hide-fp16-d64-lse\]" \
  && OPS="$OPS;persistent,overlap,hide_epi"
passed "test_cutedsl_overlap_grids\[split-l2ahead-bf16-d128\]" \
  && OPS="$OPS;persistent,overlap,hide_epi,split_tail,l2_ahead"
echo "op rows: op (default); op with $OPS"
timeout -k 3 55 python3 tests/bench_cutedsl.py --out "$OUT/bc.json" --commit "$COMMIT" --rounds "$ROUNDS" \
  --no-compile-times --op-rows options --op-options "$OPS" --variants ""
