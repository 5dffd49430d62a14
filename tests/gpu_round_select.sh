#!/usr/bin/env bash
# One GPU round for select_kv's operand pass and top-K (issue 15), from the checkout root on an H200:
#   bash tests/gpu_round_select.sh "$OUT" <commit> [shapes]     (shapes: 1.3b,14b (default), or one of them)
# 1. tests/test_anchor_gpu.py's top-K cases, the real-sums check and the float8 operand test's default case
#    (compiled kernels against the reference / float64; log in $OUT/select_gpu_tests.log), capped at $T_TESTS s;
# 2. tests/bench_anchor.py --only select --quick --rep 100: select_kv's parts side by side (operand pass, pass-2
#    kernel, top-K, total; back to back and isolated), radix vs bracket top-K and the bracket tunings, pass 2 + top-K
#    at s = 0.1 / 0.15 / 0.25 / 0.5; writes $OUT/bench_anchor.json (after each shape), $OUT/bench.log and
#    $OUT/scoreboard.json (pass2_topk_over_dense_max, both shapes only), capped at $T_BENCH s.
# Measured (round 2, 29599c7, fresh H200): the tests need ~60 s of compiles (7 of 15 done at 40 s), the bench ~40 s
# for 1.3B and ~60 s for 14B after ~15 s of start-up; within a 120 s budget run one shape per call.
set -u
OUT=${1:?usage: gpu_round_select.sh OUT_DIR [commit] [shapes]}
COMMIT=${2:-}
SHAPES=${3:-1.3b,14b}
T_TESTS=${T_TESTS:-60}
T_BENCH=${T_BENCH:-110}
mkdir -p "$OUT"
timeout "$T_TESTS" python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/test_anchor_gpu.py \
    -k "top_k or real_group or (is_exact_on_its_operands and extra0)" > "$OUT/select_gpu_tests.log" 2>&1
echo "select gpu tests: rc=$?"
grep -E "passed|failed|error|Error|fallback rows" "$OUT/select_gpu_tests.log" | tail -30
timeout "$T_BENCH" python3 tests/bench_anchor.py --only select --quick --rep 100 --shapes "$SHAPES" --out "$OUT" \
    ${COMMIT:+--commit "$COMMIT"} > "$OUT/bench.log" 2>&1
echo "bench: rc=$?"
grep -E "parts|top-K alone|pass 2 \+ top-K|operands|FAILED|Error|summary" "$OUT/bench.log" | tail -40
