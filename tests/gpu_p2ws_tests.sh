#!/usr/bin/env bash
# The Gluon pass-2 GPU test cases (tests/test_gpu_pass2_gluon.py), each in its own pytest process, all at once, so an
# illegal memory access in one case cannot fail the others (a CUDA error poisons its whole process):
#   bash tests/gpu_p2ws_tests.sh OUT_DIR [SECONDS]      (from the checkout root on an sm_90 GPU; default cap 40 s)
# $P2WS_TEST_EXCLUDE: a grep -E pattern of test ids left out (default: the options GPU-tested in earlier sessions).
# Prints one line per case (PASS / FAIL and the error's last line); logs in OUT_DIR/p2ws_case_<i>.log.
set -u
OUT=${1:?usage: gpu_p2ws_tests.sh OUT_DIR [SECONDS]   (OUT_DIR --list: print the selected test ids and exit)}
T=${2:-40}
# (a plain assignment: single quotes inside ${VAR:-...} would be removed by the shell, so the ids would not match)
DEFAULT_EXCLUDE="B1H2S4000|B1H2S2900|'groups': 3|'kb_poly': True|'thread_arrive': True}|'poly': 1[12]|'poly': 20}|'poly': 10, 'ksplit'"
EXCLUDE=${P2WS_TEST_EXCLUDE:-$DEFAULT_EXCLUDE}
mapfile -t IDS < <(python3 -m pytest -q -m gpu tests/test_gpu_pass2_gluon.py --collect-only -p no:cacheprovider 2>/dev/null \
    | grep "::" | grep -Ev "$EXCLUDE")
if [ "$OUT" = --list ]; then
    printf '%s\n' "${IDS[@]}"
    exit 0
fi
mkdir -p "$OUT"
pids=()
for i in "${!IDS[@]}"; do
    timeout "$T" python3 -m pytest -q -m gpu "${IDS[$i]}" -p no:cacheprovider > "$OUT/p2ws_case_$i.log" 2>&1 &
    pids+=($!)
done
for i in "${!IDS[@]}"; do
    wait "${pids[$i]}"
    rc=$?
    if [ "$rc" = 0 ]; then
        echo "PASS ${IDS[$i]#*::}"
    else
        echo "FAIL(rc=$rc) ${IDS[$i]#*::}: $(grep -E '^E ' "$OUT/p2ws_case_$i.log" | head -1 | cut -c1-200)"
    fi
done
