"""Where a race's spread comes from, from the samples ``tests/bench_cutedsl.py`` keeps (issue 16; no GPU; not collected
by pytest).

Reads one or more bench_cutedsl JSON files (``samples``: per point and row, ``(round, position, predecessor, ms)``,
``tests/_timing.race``) and prints, per point: each row's efficiency as the race computes it (the baseline's median ms
x s / the row's median ms) and as the median of per-round ratios (the baseline's sample of the same round over the
row's), each row's sample spread (the largest and smallest sample over its median, in %), and over all points and
rows: the mean deviation of a sample from its row's median by its position in the round and by the row before it, and
the differences between rows that time the same call (``cutedsl op`` and ``cutedsl op (again)``) under both estimates.

Usage: python tests/race_spread.py OUT/bc.json [more.json ...]
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict

SAME = ("cutedsl op", "cutedsl op (again)")  # two rows of one call: their difference is the race's own spread


def point_rows(base: str, s: float, samples: dict) -> dict:
    """{row: (efficiency from the medians, median of the per-round efficiencies, spread: (min, max) sample / median
    - 1)} of the point's rows other than the baseline and the counts launch."""
    by_round = {rnd: ms for rnd, _, _, ms in samples[base]}
    med_base = statistics.median(by_round.values())
    out = {}
    for row, v in samples.items():
        if row.startswith(("dense", "counts")):
            continue
        ms = [m for *_, m in v]
        med = statistics.median(ms)
        paired = statistics.median(by_round[rnd] * s / m for rnd, _, _, m in v)
        out[row] = (med_base * s / med, paired, (min(ms) / med - 1, max(ms) / med - 1))
    return out


def deviations(samples: dict) -> tuple[dict, dict]:
    """Each sample's ms over its row's median - 1, averaged by position and by predecessor (lists per key)."""
    by_pos, by_prev = defaultdict(list), defaultdict(list)
    for row, v in samples.items():
        med = statistics.median(m for *_, m in v)
        for _, pos, prev, m in v:
            by_pos[pos].append(m / med - 1)
            by_prev[prev].append(m / med - 1)
    return by_pos, by_prev


def main(paths: list[str]) -> None:
    all_pos, all_prev, same = defaultdict(list), defaultdict(list), []
    for path in paths:
        rep = json.loads(open(path).read())
        for shape, sh in rep["shapes"].items():
            base = sh["baseline"]
            for s_key, pt in sh["densities"].items():
                smp = pt.get("samples")
                if not smp:
                    print(f"{path} {shape} s={s_key}: no samples (a bench before session 13)")
                    continue
                s = float(s_key)
                rows = point_rows(base, s, smp)
                dense = [m for *_, m in smp[base]]
                print(f"{shape} s={s_key}: {base} {min(dense):.3f}-{max(dense):.3f} ms; "
                      + "; ".join(f"{r}: eff {a:.3f} / paired {b:.3f}, samples {lo * 100:+.1f}..{hi * 100:+.1f} %"
                                  for r, (a, b, (lo, hi)) in rows.items()))
                if all(r in rows for r in SAME):
                    same.append((shape, s_key, rows[SAME[0]][0] - rows[SAME[1]][0],
                                 rows[SAME[0]][1] - rows[SAME[1]][1]))
                pos, prev = deviations(smp)
                for k, v in pos.items():
                    all_pos[k] += v
                for k, v in prev.items():
                    all_prev[k] += v
    mean = lambda v: sum(v) / len(v) * 100  # noqa: E731
    print("sample - row median, mean by position in the round: "
          + ", ".join(f"{k}: {mean(v):+.2f} % ({len(v)})" for k, v in sorted(all_pos.items())))
    print("... by the row timed before it: "
          + ", ".join(f"{k}: {mean(v):+.2f} % ({len(v)})" for k, v in sorted(all_prev.items(), key=lambda x: str(x[0]))))
    if same:
        print(f"{SAME[0]} - {SAME[1]} (the same call): from the medians "
              + " ".join(f"{d:+.3f}" for *_, d, _ in same) + f" (max |d| {max(abs(d) for *_, d, _ in same):.3f}); "
              + "paired " + " ".join(f"{d:+.3f}" for *_, d in same)
              + f" (max |d| {max(abs(d) for *_, d in same):.3f})")


if __name__ == "__main__":
    main(sys.argv[1:])
