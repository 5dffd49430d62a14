#!/usr/bin/env bash
# One GPU round for select_kv's operand pass and top-K (issue 15), from the checkout root on an H200:
#   bash tests/gpu_round_select.sh "$OUT" <commit> [shapes]     (shapes: 1.3b,14b (default), or one of them)
# 1. tests/test_anchor_gpu.py's bracket top-K cases (float16 / float32 sums, 32760 and 4099 keys, ties; compiled
#    kernels against the reference; log in $OUT/select_gpu_tests.log), capped at $T_TESTS s;
# 2. tests/bench_anchor.py --only select --quick --rep 100: GPU checks first (select_kv == brute-force top-K of its
#    sums; the top-K fused into pass 2 == the separate one; both fallback paths forced, == brute force: lines with
#    "CHECKS"), then select_kv's parts side by side (operand pass, pass-2 kernel, top-K, total; back to back and
#    isolated; fused and separate top-K), radix vs bracket top-K and the bracket tunings, pass 2 + top-K at
#    s = 0.1 / 0.15 / 0.25 / 0.5 (defaults, fused, separate); writes $OUT/bench_anchor.json (after each shape),
#    $OUT/bench.log and $OUT/scoreboard.json (pass2_topk_over_dense_max, both shapes only), capped at $T_BENCH s.
# Round 2 (29599c7): ~15 s start-up, 1.3B ~40 s, 14B ~60 s after it (compiles dominate: the 14B shape recompiles).
set -u
OUT=${1:?usage: gpu_round_select.sh OUT_DIR [commit] [shapes]}
COMMIT=${2:-}
SHAPES=${3:-1.3b,14b}
T_TESTS=${T_TESTS:-25}
T_BENCH=${T_BENCH:-95}
mkdir -p "$OUT"
timeout "$T_TESTS" python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/test_anchor_gpu.py \
    -k "top_k_on_gpu and bracket" > "$OUT/select_gpu_tests.log" 2>&1
echo "select gpu tests: rc=$?"
grep -E "passed|failed|error|Error" "$OUT/select_gpu_tests.log" | tail -20
timeout "$T_BENCH" python3 tests/bench_anchor.py --only select --quick --rep 100 --shapes "$SHAPES" --out "$OUT" \
    ${COMMIT:+--commit "$COMMIT"} > "$OUT/bench.log" 2>&1
echo "bench: rc=$?"
grep -E "CHECK|parts|top-K alone|pass 2 \+ top-K|operands|FAILED|Error|summary" "$OUT/bench.log" | tail -50
