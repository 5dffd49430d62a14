"""The timing method of record for every kernel ratio on the scoreboard (efficiency vs dense, pass 2 / dense).

Sustained interleaved timing: each sample is back-to-back calls of one function for about ``target_ms`` of GPU time,
the functions in a new random order each round, several rounds, the median per function. A model run never leaves
the GPU idle between attention calls (they sit between GEMMs at full power), so idle gaps before a timed call (a
sleep, an L2 clear) let the clocks boost and flatter short calls: on the H200 of 2026-12-01 flash-attn-4 dense at
Wan2.1-1.3B 480p took 9.8-10.2 ms this way and 8.7-8.9 ms with 1 ms GPU sleeps before each call, in the same machine
session. Ratios taken with different methods are not comparable; a benchmark may print a gapped figure beside this one.
"""
from __future__ import annotations

import random
import statistics

import torch


def race(fns: dict, rounds: int, target_ms: float) -> dict:
    """Median ms per call of each fn (name -> zero-argument callable on the current CUDA stream), timed interleaved:
    ``rounds`` rounds, each running every fn back to back for about ``target_ms`` (CUDA events), so a clock or
    thermal drift hits every fn alike. The order is shuffled each round (fixed seed): a kernel timed right after a
    full-power one runs at lower clocks (H200, 2026-12-01: the row after flash-attn-4 dense ran 2-4 % slow), and a
    rotated cyclic order would keep every row's predecessor."""
    ev = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
    est, times = {}, {k: [] for k in fns}
    for k, fn in fns.items():
        fn()
        a, b = ev(), ev()
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        est[k] = max(a.elapsed_time(b), 1e-3)
    reps = {k: max(1, round(target_ms / est[k])) for k in fns}
    order, rng = list(fns), random.Random(0)
    for _ in range(rounds):
        rng.shuffle(order)
        for k in order:
            fn = fns[k]
            a, b = ev(), ev()
            a.record()
            for _ in range(reps[k]):
                fn()
            b.record()
            torch.cuda.synchronize()
            times[k].append(a.elapsed_time(b) / reps[k])
    return {k: statistics.median(v) for k, v in times.items()}
