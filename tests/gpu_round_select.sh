#!/usr/bin/env bash
# The select_kv GPU round for issue 15 (p2ops + p2ws, one command), from the checkout root on an H200:
#   bash tests/gpu_round_select.sh "$OUT" <commit> [shapes]     (shapes: 1.3b,14b (default), or one of them)
# tests/bench_select_race.py (its docstring says what each line measures): GPU checks first (lines "CHECKS"), then
# race 1 per shape (flash-attn-4 dense, select_kv defaults (on sm_90: the top-K fused into pass 2, one query group per
# program) and its RACE1_ROWS (+ select_kv(gluon=True) with $P2WS_GLUON_ROW), at s = 0.1 / 0.15 / 0.25 / 0.5;
# tests/_timing.race, the method of record, $ROUNDS rounds (default 3)) -> $OUT/scoreboard.json
# (pass2_topk_over_dense_max), then race 2 per
# shape at s = 0.25 (operand pass, the pass-2 kernel with and without its fused top-K epilogue and its variants, the
# host enqueue time of select_kv), last race 2b at 1.3B (the tests/bench_pass2_exp.py variants named in
# $P2WS_VARIANTS, checked in child processes first) until --budget. Logs: $OUT/bench.log, $OUT/bench_select_race.json.
# Hard cap $T_BENCH s (default 85). Before it, when $CUTE_TEST is set: p2cute's GPU tests of the CuTeDSL pass 2
# (python -m pytest -q -m gpu tests/test_gpu_cutedsl_pass2.py, -k "$CUTE_TEST" unless it is "1"; hard cap $T_TEST s,
# default 25; log $OUT/cute_gpu_tests.log); when $P2WS_TEST is set: p2ws's GPU tests ("isolated":
# tests/gpu_p2ws_tests.sh, one process per case; else python -m pytest -q -m gpu tests/test_gpu_pass2_gluon.py -k
# "$P2WS_TEST"; hard cap $T_TEST s, default 25). The two caps together stay within the round's cap.
# $CUTE_VARIANTS: p2cute's CuTeDSL pass-2 launch variants (tests/bench_cutedsl_pass2.py syntax, comma-separated),
# compiled in child processes at the start, checked and raced alone in race 2 at 1.3B. RACE2_FIRST=1: race 2 at 1.3B
# before the race 1s (else after them: the scoreboard figures first). OLD_METHOD=1: after each shape's race 1, dense + the
# defaults row again without the race's lead-in calls (MC_SPARSE_RACE_LEAD_IN=0, 3 rounds). RACE1_ONLY=1:
# checks and race 1 only (e.g. one shape: RACE1_ONLY=1 T_BENCH=60 bash tests/gpu_round_select.sh $OUT <commit> 14b).
# NO_TRITON_ROW=1: race 1 without the "triton" row beside the CuTeDSL default (its compiles are not precompiled).
# ROWS_14B="a,b": only these RACE1_ROWS at 14B (set and empty: the defaults alone there).
set -u
OUT=${1:?usage: gpu_round_select.sh OUT_DIR [commit] [shapes]}
COMMIT=${2:-}
SHAPES=${3:-1.3b,14b}
T_BENCH=${T_BENCH:-85}
T_TEST=${T_TEST:-25}
P2WS_VARIANTS=${P2WS_VARIANTS:-}
P2WS_TEST=${P2WS_TEST:-}
CUTE_TEST=${CUTE_TEST:-}
mkdir -p "$OUT"
if [ -n "$CUTE_TEST" ] && [ -f tests/test_gpu_cutedsl_pass2.py ]; then
    K_ARGS=()
    [ "$CUTE_TEST" != 1 ] && K_ARGS=(-k "$CUTE_TEST")
    timeout "$T_TEST" python3 -m pytest -q -m gpu tests/test_gpu_cutedsl_pass2.py "${K_ARGS[@]}" -p no:cacheprovider \
        > "$OUT/cute_gpu_tests.log" 2>&1
    echo "cute gpu tests: rc=$?"
    tail -3 "$OUT/cute_gpu_tests.log"
fi
if [ "$P2WS_TEST" = isolated ]; then  # p2ws: each Gluon GPU test case in its own process, all at once
    bash tests/gpu_p2ws_tests.sh "$OUT" "$T_TEST"
elif [ -n "$P2WS_TEST" ]; then
    timeout "$T_TEST" python3 -m pytest -q -m gpu tests/test_gpu_pass2_gluon.py -k "$P2WS_TEST" -p no:cacheprovider \
        > "$OUT/p2ws_gpu_tests.log" 2>&1
    echo "p2ws gpu tests: rc=$?"
    tail -3 "$OUT/p2ws_gpu_tests.log"
fi
timeout "$T_BENCH" python3 tests/bench_select_race.py --out "$OUT" --shapes "$SHAPES" ${COMMIT:+--commit "$COMMIT"} \
    --p2ws-variants "$P2WS_VARIANTS" ${P2WS_GLUON_ROW:+--p2ws-gluon-row} ${RACE1_ONLY:+--race1-only} \
    ${NO_TRITON_ROW:+--no-triton-row} ${ROWS_14B+--rows-14b "$ROWS_14B"} \
    ${ROUNDS:+--rounds "$ROUNDS"} \
    --cute-variants "${CUTE_VARIANTS:-}" \
    ${RACE2_FIRST:+--race2-first} ${OLD_METHOD:+--old-method} \
    --budget $((T_BENCH - 10)) \
    > "$OUT/bench.log" 2>&1
echo "bench: rc=$?"
grep -E "CHECK|RACE|FAILED|Error|skipped|children|done|OFF" "$OUT/bench.log" | tail -30
