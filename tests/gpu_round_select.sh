#!/usr/bin/env bash
# The select_kv GPU round for issue 15 (p2ops + p2ws, one command), from the checkout root on an H200:
#   bash tests/gpu_round_select.sh "$OUT" <commit> [shapes]     (shapes: 1.3b,14b (default), or one of them)
# tests/bench_select_race.py: GPU checks first (lines "CHECKS"), then race 1 per shape (flash-attn-4 dense, select_kv
# defaults, with the top-K fused into pass 2, and fused with one query group per program, at s = 0.1 / 0.15 / 0.25 /
# 0.5; tests/_timing.race, the method of record) -> $OUT/scoreboard.json (pass2_topk_over_dense_max), then race 2 per
# shape at s = 0.25 (operand pass, separate top-K, the pass-2 kernel with and without its fused top-K epilogue, the
# host enqueue time of select_kv; at 1.3B the tests/bench_pass2_exp.py variants named in $P2WS_VARIANTS) until
# --budget. Logs: $OUT/bench.log, $OUT/bench_select_race.json. Hard cap $T_BENCH s (default 105).
set -u
OUT=${1:?usage: gpu_round_select.sh OUT_DIR [commit] [shapes]}
COMMIT=${2:-}
SHAPES=${3:-1.3b,14b}
T_BENCH=${T_BENCH:-105}
P2WS_VARIANTS=${P2WS_VARIANTS:-}
mkdir -p "$OUT"
timeout "$T_BENCH" python3 tests/bench_select_race.py --out "$OUT" --shapes "$SHAPES" ${COMMIT:+--commit "$COMMIT"} \
    --p2ws-variants "$P2WS_VARIANTS" --budget $((T_BENCH - 20)) > "$OUT/bench.log" 2>&1
echo "bench: rc=$?"
grep -E "CHECK|RACE|FAILED|Error|done" "$OUT/bench.log" | tail -30
