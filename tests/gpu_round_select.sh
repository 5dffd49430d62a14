#!/usr/bin/env bash
# One GPU round for select_kv's operand pass and top-K (issue 15), from the checkout root on an H200:
#   bash tests/gpu_round_select.sh "$OUT" <commit>
# 1. tests/test_anchor_gpu.py's top-K cases and the float8 operand pass (compiled kernels against the reference / float64; log in
#    $OUT/select_gpu_tests.log), capped at 40 s;
# 2. tests/bench_anchor.py --only select --quick --rep 100: select_kv's parts side by side (operand pass, pass-2
#    kernel, top-K, total; back to back and isolated), the top-K methods and tunings, pass 2 + top-K at s = 0.1 /
#    0.15 / 0.25 / 0.5 at 1.3B 480p and 14B 720p; writes $OUT/bench_anchor.json, $OUT/bench.log and
#    $OUT/scoreboard.json (pass2_topk_over_dense_max), capped at 78 s (the whole script stays under 120 s). Expected ~35 + ~70 s.
set -u
OUT=${1:?usage: gpu_round_select.sh OUT_DIR [commit]}
COMMIT=${2:-}
mkdir -p "$OUT"
timeout 40 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/test_anchor_gpu.py \
    -k "top_k or real_group or (is_exact_on_its_operands and extra0)" > "$OUT/select_gpu_tests.log" 2>&1
echo "select gpu tests: rc=$?"
grep -E "passed|failed|error|Error|fallback rows" "$OUT/select_gpu_tests.log" | tail -30
timeout 78 python3 tests/bench_anchor.py --only select --quick --rep 100 --out "$OUT" ${COMMIT:+--commit "$COMMIT"} \
    > "$OUT/bench.log" 2>&1
echo "bench: rc=$?"
grep -E "parts|top-K alone|pass 2 \+ top-K|operands|FAILED|Error|summary" "$OUT/bench.log" | tail -40
