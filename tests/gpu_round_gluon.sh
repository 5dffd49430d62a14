#!/usr/bin/env bash
# One GPU round for the sm_90 Gluon sparse kernel (issue 14), from the checkout root on an H200:
#   bash tests/gpu_round_gluon.sh "$OUT" <commit> [final]
# 1. tests/test_gpu_gluon_sparse.py (correctness vs float64; log in $OUT/gluon_gpu_tests.log), under a timeout: an
#    mbarrier deadlock ends there (rc 124) and the benchmark is skipped; "final": the default path's cases only;
# 2. tests/bench_kernels.py --reuse --gluon: the op as users get it (the dispatch's auto mode: on its first call per
#    shape it times the Gluon and the Triton kernel and keeps the faster; the bench's JSON lists the choices) beside
#    the Triton kernel's default config and the Gluon tunings (final: 3 of them), both shapes, s = 0.1/0.15/0.25/0.5;
#    writes $OUT/bench_reuse.json and $OUT/scoreboard.json (triton_sparse_eff_min; a Gluon result with
#    rel_l2 > 2e-2 is excluded from it; with --gluon the figure is the op's). Expected: full ~1.2 + ~2 min (cap 5 + 4
#    min); final ~50 + ~65 s (cap 75 + 105 s).
set -u
OUT=${1:?usage: gpu_round_gluon.sh OUT_DIR [commit] [final]}
COMMIT=${2:-}
MODE=${3:-full}
mkdir -p "$OUT"
SELECT=()
CONFIGS=()
T_TESTS=300
T_BENCH=240
if [ "$MODE" = final ]; then  # ~120 s: the default path's cases (int4_group included), the auto mode's schedules and
    # the new options (l2_hints, 3 stages, 8 producer threads per row); 6 tunings
    SELECT=(-k "(S4000 or C192 or tunings and pingpong or l2-hints or dispatches or auto_mode) and not overlap")
    CONFIGS=(--gluon-configs "gluon plain,gluon pingpong,gluon pingpong persistent,gluon pingpong persistent l2,gluon pingpong 3 stages,gluon pingpong persistent rt8")
    T_TESTS=75
    T_BENCH=105
fi
timeout $T_TESTS python3 -m pytest -q -s -p no:cacheprovider tests/test_gpu_gluon_sparse.py "${SELECT[@]}" \
    > "$OUT/gluon_gpu_tests.log" 2>&1
rc=$?
grep -E "rel_l2|passed|failed|error|Error" "$OUT/gluon_gpu_tests.log" | tail -40
echo "gluon gpu tests: rc=$rc"
if [ "$rc" -eq 124 ]; then
    echo "timed out (deadlock?): benchmark skipped"
    exit 124
fi
timeout $T_BENCH python3 tests/bench_kernels.py --out "$OUT/bench_reuse.json" --reuse --gluon --rep 40 "${CONFIGS[@]}" \
    ${COMMIT:+--commit "$COMMIT"} > "$OUT/bench.log" 2>&1
echo "bench: rc=$?"
grep -E "op / Triton|efficiency|config gluon|scoreboard|sparse op on|Error" "$OUT/bench.log" | tail -50
