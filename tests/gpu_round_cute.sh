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
LAZY="$AHEAD,lazy_rescale"  # + the running max raised only past a threshold, O's rescale skipped per warp
mkdir -p "$OUT"
# the candidates through the op against float64 (4 compiles on a cold machine): AHEAD: overlap grids of 1-500 CTAs
# (fp16 D 64, no split), split last rounds (138 groups ragged LSE, 140 groups of 24 tiles), the chain of three op calls
# queued without a sync; LAZY: the chain, keys ramped so rows rescale mid-walk (bf16, 138 groups, LSE)
timeout -k 3 45 python3 -m pytest -v -p no:cacheprovider tests/test_gpu_cutedsl.py \
  -k '(split_tail and ahead) or (overlap_grids and ahead) or (pdl_chain and (ahead or lazy) and not res) or (lazy_rescale_ramp and bf16)' \
  > "$OUT/tests.log" 2>&1
grep -E "PASSED|FAILED|ERROR|passed|failed|Timeout" "$OUT/tests.log" | tail -n 10
passed() { for t in "$@"; do grep -qF "::$t PASSED" "$OUT/tests.log" || return 1; done; }
ROWS=""
if passed "test_cutedsl_overlap_grids[ahead-fp16-d64]" "test_cutedsl_split_tail[138-groups-ragged-lse-split-pdl-v3-ahead]" \
    "test_cutedsl_split_tail[140-groups-split-pdl-v3-ahead]" "test_cutedsl_pdl_chain[pdl-v3-ahead]"; then
  ROWS="$AHEAD"
  if passed "test_cutedsl_pdl_chain[pdl-v3-early-lazy]" "test_cutedsl_lazy_rescale_ramp[bf16]"; then
    ROWS="$AHEAD;$LAZY"
  fi
fi
echo "op rows: op (default $DEF); op with: ${ROWS:-(none: a GPU test of the candidates did not pass)}"
timeout -k 3 70 python3 tests/bench_cutedsl.py --out "$OUT/bc.json" --commit "$COMMIT" --rounds "$ROUNDS" \
  --no-compile-times --op-rows options --op-options "$ROWS" --variants ""
if [ "${OLD:-0}" = 1 ]; then  # the op row timed the sessions 5-8 way (no lead-in), beside the figures above
  MC_SPARSE_RACE_LEAD_IN=0 timeout -k 3 30 python3 tests/bench_cutedsl.py --out "$OUT/old/bc_old.json" \
    --commit "$COMMIT" --rounds 3 --no-compile-times --op-rows "" --variants "" --scoreboard "$OUT/old/board.json" \
    | grep -E "^(1.3b|14b) s=|eff_min"
fi
