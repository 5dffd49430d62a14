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
# the candidate (pdl: the op's launches as programmatic dependent launches; v3: 3 V stages) through the op against
# float64 where round s8r1 did not reach: the chain of three op calls queued without a sync (each reading what the
# launch before it wrote; LSE), 140 groups without the LSE (8 groups split in 16 parts), and bf16 D 128 ragged with
# the LSE (s8r1 passed it, with fp16 D 64, groups vs SMs and the 138-group split); 2 compiles on a cold machine
MC_SPARSE_CUTEDSL_OPTIONS=$CAND timeout -k 3 38 python3 -m pytest -v -p no:cacheprovider tests/test_gpu_cutedsl.py \
  -k 'pdl_chain or (split_tail and 140 and pdl) or (vs_float64 and S3008-ragged-128-bf16)' > "$OUT/tests.log" 2>&1
grep -E "PASSED|FAILED|ERROR|passed|failed|Timeout" "$OUT/tests.log" | tail -n 6
if grep -qE "FAILED|ERROR" "$OUT/tests.log" || ! grep -q " 3 passed" "$OUT/tests.log"; then
  ROWS=""; echo "candidates NOT timed (their GPU tests did not all pass)"
else
  ROWS="$CAND;$DEF,v3"
fi
echo "op rows: op (default $DEF); op with: $ROWS"
timeout -k 3 66 python3 tests/bench_cutedsl.py --out "$OUT/bc.json" --commit "$COMMIT" --rounds "$ROUNDS" \
  --no-compile-times --op-rows options --op-options "$ROWS" --variants ""
