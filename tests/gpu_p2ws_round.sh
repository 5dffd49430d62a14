#!/usr/bin/env bash
# p2ws's Gluon pass-2 round (issue 15), from the checkout root on an H200:  bash tests/gpu_p2ws_round.sh OUT_DIR [commit]
# (1) tests/gpu_p2ws_tests.sh: every Gluon GPU test case in its own process, all at once (cap $T_TEST s, default 35);
# (2) tests/bench_select_race.py --race2-only at 1.3B: each Gluon variant ($P2WS_VARIANTS) compiled and checked in
#     its own child process first, then raced beside flash-attn-4 dense (tests/_timing.race, the method of record)
#     with p2ops's pass-2 parts (cap $T_BENCH s, default 70). Logs: OUT_DIR/p2ws_case_*.log, p2ws_child_*.log, bench.log.
set -u
OUT=${1:?usage: gpu_p2ws_round.sh OUT_DIR [commit]}
COMMIT=${2:-}
T_TEST=${T_TEST:-35}
T_BENCH=${T_BENCH:-70}
P2WS_VARIANTS=${P2WS_VARIANTS:-gluon ws kb pow2,gluon ws sum mma,gluon ws sum mma defer}
mkdir -p "$OUT"
bash tests/gpu_p2ws_tests.sh "$OUT" "$T_TEST"
timeout "$T_BENCH" python3 tests/bench_select_race.py --out "$OUT" --shapes 1.3b ${COMMIT:+--commit "$COMMIT"} \
    --race2-only --p2ws-variants "$P2WS_VARIANTS" --budget $((T_BENCH - 10)) > "$OUT/bench.log" 2>&1
echo "bench: rc=$?"
grep -E "children|RACE|FAILED|Error|done" "$OUT/bench.log" | tail -12
for f in "$OUT"/p2ws_child_*.log; do tail -1 "$f"; done
