#!/usr/bin/env bash
# One H200 round of the CuTeDSL kernel (issue 16): GPU tests of the candidate options, then the op's benchmark (method
# of record, the scoreboard's cutedsl_sparse_eff_min) with the candidates beside it; with OLD=1 (round s9r1) also a
# short pass timed the sessions 5-8 way (MC_SPARSE_RACE_LEAD_IN=0, 3 rounds, the op row only). Not collected by pytest.
# Usage: bash tests/gpu_round_cute.sh OUT COMMIT [ROUNDS]
#   (writes OUT/tests.log, OUT/bc.json, OUT/scoreboard.json; OUT/old/bc_old.json with OLD=1)
set -u
OUT=$1
COMMIT=$2
ROUNDS=${3:-6}
DEF="persistent,overlap,hide_epi,split_tail,pdl,v3"  # the op's default since round s8r2 (rules.STAGED_OPTIONS)
AHEAD="$DEF,q_ahead,cnt_ahead,idx_ahead"  # candidate: the next item's queries, count, first index entries ahead
QA="$DEF,q_ahead,cnt_ahead"  # the same without idx_ahead (checked by the bench before it is timed)
mkdir -p "$OUT"
# the candidate through the op against float64: split last rounds (138 groups ragged LSE, 140 groups of 24 tiles),
# overlap grids of 1-500 CTAs (fp16 D 64, no split), the chain of three op calls queued without a sync; 3 compiles
timeout -k 3 45 python3 -m pytest -v -p no:cacheprovider tests/test_gpu_cutedsl.py \
  -k '(split_tail and ahead) or (overlap_grids and ahead) or (pdl_chain and ahead and not res)' > "$OUT/tests.log" 2>&1
grep -E "PASSED|FAILED|ERROR|passed|failed|Timeout" "$OUT/tests.log" | tail -n 10
# all selected tests passed: the summary line starts with "N passed" (a failure or error comes first in it; a cut run
# has no summary line)
if grep -qE "FAILED|ERROR" "$OUT/tests.log" || ! grep -qE "^=+ [0-9]+ passed" "$OUT/tests.log"; then
  ROWS=""
  echo "the candidates' GPU tests did not all pass: candidates NOT timed"
else
  ROWS="$AHEAD;$QA"
fi
echo "op rows: op (default $DEF); op with: $ROWS"
timeout -k 3 70 python3 tests/bench_cutedsl.py --out "$OUT/bc.json" --commit "$COMMIT" --rounds "$ROUNDS" \
  --no-compile-times --op-rows options --op-options "$ROWS" --variants ""
if [ "${OLD:-0}" = 1 ]; then  # the op row timed the sessions 5-8 way (no lead-in), beside the figures above
  MC_SPARSE_RACE_LEAD_IN=0 timeout -k 3 30 python3 tests/bench_cutedsl.py --out "$OUT/old/bc_old.json" \
    --commit "$COMMIT" --rounds 3 --no-compile-times --op-rows "" --variants "" --scoreboard "$OUT/old/board.json" \
    | grep -E "^(1.3b|14b) s=|eff_min"
fi
