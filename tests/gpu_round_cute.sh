#!/usr/bin/env bash
# One H200 round of the CuTeDSL kernel (issue 16): GPU tests of the op, then the op's benchmark (method of record)
# beside the previous default. Not collected by pytest.
# Usage: bash tests/gpu_round_cute.sh OUT COMMIT [ROUNDS]   (writes OUT/tests.log, OUT/bc.json, OUT/scoreboard.json)
set -u
OUT=$1
COMMIT=$2
ROUNDS=${3:-5}
mkdir -p "$OUT"
# the op (default since round s7r2: persistent + overlap + hide_epi + split_tail) against float64 in every dtype /
# head dim with the LSE (192 and 144 groups: the last round split, the 144 ragged), more / fewer groups than SMs,
# split_tail on 138 / 140 groups (~6 compiles)
timeout -k 3 50 python3 -m pytest -q -rA -p no:cacheprovider tests/test_gpu_cutedsl.py \
  -k '(vs_float64 and (S3008 or S4000)) or groups_vs_sms or split_tail' > "$OUT/tests.log" 2>&1
grep -E "^(PASSED|FAILED|ERROR)|passed|failed|Timeout" "$OUT/tests.log" | tail -n 14
echo "op rows: op (default); op with the previous default persistent,overlap"
timeout -k 3 57 python3 tests/bench_cutedsl.py --out "$OUT/bc.json" --commit "$COMMIT" --rounds "$ROUNDS" \
  --no-compile-times --op-rows options --op-options "persistent,overlap" --variants ""
