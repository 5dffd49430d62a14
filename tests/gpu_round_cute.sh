#!/usr/bin/env bash
# One H200 round of the CuTeDSL kernel (issue 16): GPU tests, then the op's benchmark (method of record) beside
# candidate option sets. Not collected by pytest.
# Usage: bash tests/gpu_round_cute.sh OUT COMMIT [ROUNDS]   (writes OUT/tests.log, OUT/bc.json, OUT/scoreboard.json)
set -u
OUT=$1
COMMIT=$2
ROUNDS=${3:-6}
DEF="persistent,overlap,hide_epi,split_tail"  # the op's default (rules.STAGED_OPTIONS)
CAND="$DEF,pdl,v3"
mkdir -p "$OUT"
# the candidate options (pdl: the op's launches as programmatic dependent launches; v3: 3 V stages) through the op
# against float64: bf16 D 128 / fp16 D 64 with the LSE, ragged, 138-192 groups (last rounds split), more / fewer
# groups than SMs; split_tail with the default and the candidate (138 / 140 groups); the pdl chain (three op calls
# queued without a sync, each reading what the launch before it wrote); the residual path's kernel (register
# epilogue, persistent + overlap: its consumer loop shares the K / V pipeline states code) with a plain residual on
# grids of 1-500 CTAs; ~6 compiles
MC_SPARSE_CUTEDSL_OPTIONS=$CAND timeout -k 3 44 python3 -m pytest -q -rA -p no:cacheprovider tests/test_gpu_cutedsl.py \
  -k '(vs_float64 and (S3008-ragged-128-bf16 or S3008-ragged-64-fp16)) or groups_vs_sms or split_tail or pdl_chain or (overlap_residual and plain)' \
  > "$OUT/tests.log" 2>&1
grep -E "^(PASSED|FAILED|ERROR)|passed|failed|Timeout" "$OUT/tests.log" | tail -n 14
if grep -qE "^(FAILED|ERROR)" "$OUT/tests.log" || ! grep -q " passed" "$OUT/tests.log"; then
  ROWS=""; echo "candidates NOT timed (their GPU tests did not all pass)"
else
  ROWS="$DEF,pdl;$DEF,v3;$CAND"
fi
echo "op rows: op (default $DEF); op with: $ROWS"
timeout -k 3 62 python3 tests/bench_cutedsl.py --out "$OUT/bc.json" --commit "$COMMIT" --rounds "$ROUNDS" \
  --no-compile-times --op-rows options --op-options "$ROWS" --variants ""
