#!/usr/bin/env bash
# One H200 round of the CuTeDSL kernel (issue 16): GPU tests of candidate option sets through the op, then the op's
# benchmark (method of record, the scoreboard's cutedsl_sparse_eff_min) with each candidate that passed beside it.
# Not collected by pytest.
# Usage: CANDS="opts;opts" RES_CANDS="opts;opts" [TESTED="opts;opts"] [RES_TESTED="opts;opts"] \
#          bash tests/gpu_round_cute.sh OUT COMMIT [ROUNDS]
#        DEFAULT="opts" FALLBACK="opts" [ALSO="opts;opts"] bash tests/gpu_round_cute.sh OUT COMMIT [ROUNDS]   (the final
#        round, below)
#   CANDS: staged-epilogue option sets (the op's calls without a residual; $MC_SPARSE_CUTEDSL_OPTIONS), RES_CANDS:
#   register-epilogue ones (calls with a residual; $MC_SPARSE_CUTEDSL_RES_OPTIONS), each GPU-tested against float64
#   (test_cutedsl_env_candidate / test_cutedsl_env_res_candidate: 2 compiles per set) and timed only if every test
#   of its set passed; TESTED / RES_TESTED: staged / register-epilogue sets GPU-tested in an earlier round or only
#   measured (not candidates for a default this round), timed without their GPU tests (every timed row is still
#   checked against float32 at each point before its race); EXTRA_ROWS: more of bench_cutedsl's
#   --op-rows (e.g. "contiguous", "again"); ORDER: the race's order per round (bench_cutedsl --order: random, the
#   default, or balanced: then give ROUNDS = the race's row count, twice it if odd; ROUNDS may be per shape, "1.3b=18,14b=6"). Writes OUT/tests.log, OUT/bc.json,
#   OUT/scoreboard.json.
set -u
OUT=$1
COMMIT=$2
ROUNDS=${3:-6}
CANDS=${CANDS:-}
RES_CANDS=${RES_CANDS:-}
TEST_S=${TEST_S:-45}
BENCH_S=${BENCH_S:-60}
mkdir -p "$OUT"
if [ -n "${FALLBACK:-}" ]; then
  # the final round: the op's default (rules.STAGED_OPTIONS, named in DEFAULT) checked through the op against float64
  # (bf16 D 128 / fp16 D 64 ragged with the LSE, groups vs SMs, and test_cutedsl_env_candidate's five cases); if any
  # test fails the op is timed with FALLBACK (the previous, r2-measured default) instead, and says so; else FALLBACK
  # is timed beside it, and each ALSO set (GPU-tested in an earlier round, e.g. the parts of a combined default);
  # RES_TESTED: register-epilogue sets timed beside the op with a plain residual (not tested here); RES_ROW=1: the
  # op with a plain residual (its default, rules.REGISTERS_OPTIONS) timed even without RES_TESTED
  MC_SPARSE_CUTEDSL_TEST_OPTIONS="$DEFAULT" timeout -k 3 "$TEST_S" python3 -m pytest -v -p no:cacheprovider \
    tests/test_gpu_cutedsl.py -k '(vs_float64 and (S3008-ragged-128-bf16 or S3008-ragged-64-fp16)) or groups_vs_sms or env_candidate' \
    > "$OUT/tests.log" 2>&1
  grep -E "PASSED|FAILED|ERROR|passed|failed|Timeout" "$OUT/tests.log" | tail -n 10
  if grep -qE "FAILED|ERROR" "$OUT/tests.log" || ! grep -qE "^=+ 9 passed" "$OUT/tests.log"; then
    export MC_SPARSE_CUTEDSL_OPTIONS=$FALLBACK
    echo "the default's GPU tests did not all pass: the op timed with the previous default $FALLBACK"
    ROWS=""
  else
    ROWS=$FALLBACK${ALSO:+;$ALSO}
  fi
  RES_ON=${RES_TESTED:-${RES_ROW:-}}
  echo "op rows: op (default); op with: ${ROWS:-none}; residual rows: ${RES_ON:+op + plain residual (default), }${RES_TESTED:-none}"
  timeout -k 3 "$BENCH_S" python3 tests/bench_cutedsl.py --out "$OUT/bc.json" --commit "$COMMIT" --rounds "$ROUNDS" \
    --order "${ORDER:-random}" --no-compile-times --op-rows "options${RES_ON:+,residual}${EXTRA_ROWS:+,$EXTRA_ROWS}" --op-options "$ROWS" \
    --res-options "${RES_TESTED:-}" --variants ""
  echo "round script wall $SECONDS s"
  exit 0
fi
if [ -n "$CANDS$RES_CANDS" ]; then
  MC_SPARSE_CUTEDSL_TEST_OPTIONS="$CANDS" MC_SPARSE_CUTEDSL_TEST_RES_OPTIONS="$RES_CANDS" timeout -k 3 "$TEST_S" \
    python3 -m pytest -v -p no:cacheprovider tests/test_gpu_cutedsl.py -k 'env_candidate or env_res_candidate' \
    > "$OUT/tests.log" 2>&1
  grep -E "PASSED|FAILED|ERROR|passed|failed|Timeout" "$OUT/tests.log" | tail -n 14
  echo "GPU tests done at $SECONDS s"
fi
ok() {  # every test of candidate $2 of test $1 passed (cases $3...)
  local t=$1 c=$2; shift 2
  for case in "$@"; do grep -qF "::$t[$c-$case] PASSED" "$OUT/tests.log" || return 1; done
}
ROWS=${TESTED:-} RES_ROWS=${RES_TESTED:-}
i=0; IFS=';' read -ra SETS <<< "$CANDS"
for o in "${SETS[@]}"; do
  [ -n "$o" ] || continue
  if ok test_cutedsl_env_candidate "c$i" split-138-lse split-140 chain ramp grids; then ROWS="$ROWS${ROWS:+;}$o"
  else echo "candidate c$i ($o): a GPU test did not pass: not timed"; fi
  i=$((i + 1))
done
i=0; IFS=';' read -ra SETS <<< "$RES_CANDS"
for o in "${SETS[@]}"; do
  [ -n "$o" ] || continue
  if ok test_cutedsl_env_res_candidate "c$i" plain int4_group chain; then RES_ROWS="$RES_ROWS${RES_ROWS:+;}$o"
  else echo "residual candidate c$i ($o): a GPU test did not pass: not timed"; fi
  i=$((i + 1))
done
RES_ANY=$RES_CANDS${RES_TESTED:-}
echo "op rows: op (default); op with: ${ROWS:-none}; residual rows: ${RES_ANY:+op + plain residual (default), }${RES_ROWS:-none}"
timeout -k 3 "$BENCH_S" python3 tests/bench_cutedsl.py --out "$OUT/bc.json" --commit "$COMMIT" --rounds "$ROUNDS" \
  --order "${ORDER:-random}" --no-compile-times --op-rows "options${RES_ANY:+,residual}${EXTRA_ROWS:+,$EXTRA_ROWS}" --op-options "$ROWS" \
  --res-options "$RES_ROWS" \
  --variants ""
echo "round script wall $SECONDS s"
