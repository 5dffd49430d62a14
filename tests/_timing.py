"""The timing method of record for every kernel ratio on the scoreboard (efficiency vs dense, pass 2 / dense).

Sustained interleaved timing: each sample is back-to-back calls of one function for about ``target_ms`` of GPU time,
the functions in a new random order each round, several rounds, the median per function. A model run never leaves
the GPU idle between attention calls (they sit between GEMMs at full power), so idle gaps before a timed call (a
sleep, an L2 clear) let the clocks boost and flatter short calls: on the H200 of 2026-12-01 flash-attn-4 dense at
Wan2.1-1.3B 480p took 9.8-10.2 ms this way and 8.7-8.9 ms with 1 ms GPU sleeps before each call, in the same machine
session. Ratios taken with different methods are not comparable; a benchmark may print a gapped figure beside this one.

Lead-in (session 9, 2026-12-01): each sample starts with untimed calls of the same function (about a quarter of
``target_ms``, at least one call). Without them a sample began on an idle GPU right after the previous function's
sample: the first call's host launch time (0.3-0.8 ms for the sparse op, 20 ms samples) and the previous function's
power state (the row after flash-attn-4 dense ran 2-4 % slow) fell inside the timed region. In a model run the host
is ahead of the GPU and the call follows the model's own work, which the lead-in stands for.
``MC_SPARSE_RACE_LEAD_IN=0`` times the way sessions 5-8 did (the scoreboard's figures up to commit a50914c).

Order and warm-up (session 13, opt-in: ``race(order="balanced", warm_up=True)``; bench_cutedsl uses both in its rounds):
the seeded shuffle runs the same order sequence in every race of the same row count, so a row's predecessor repeats
at every point of a benchmark; a balanced (Williams) order gives every row every position and predecessor equally
often. The race's first sample starts on a GPU idle since the caller's setup and ran 0.2-12 % fast at 1.3B; the
warm-up runs an untimed sample first. ``samples=`` returns every timed sample with its place (tests/race_spread.py).
"""
from __future__ import annotations

import os
import random
import statistics

import torch


def race(fns: dict, rounds: int, target_ms: float, from_idle: dict | None = None, samples: dict | None = None,
         order: str = "random", warm_up: bool = False) -> dict:
    """Median ms per call of each fn (name -> zero-argument callable on the current CUDA stream), timed interleaved:
    ``rounds`` rounds, each running every fn back to back for about ``target_ms`` (CUDA events), so a clock or
    thermal drift hits every fn alike. The order is shuffled each round (fixed seed). Each sample is led in by
    untimed calls of the same fn (see the module docstring; ``MC_SPARSE_RACE_LEAD_IN=0`` turns that off).

    ``from_idle``: a dict to fill with each fn's median ms per lead-in call (the calls that start on an idle GPU,
    right after another fn's sample: what a sample without lead-in mostly measured); left empty without lead-in.

    ``samples``: a dict to fill with each fn's timed samples, a list of ``(round, position, predecessor, ms per call)``
    in time order (position 0 .. len(fns) - 1 within the round; predecessor the fn run just before, None for the
    race's first sample without ``warm_up``): where a row's spread comes from (its place in the order, the row
    before it, drift).

    ``order``: "random" (each round shuffled, seed 0: every race of the same row count runs the same sequence of
    orders) or "balanced" (``balanced_orders``: over len(fns) rounds, or 2 len(fns) for an odd count, each fn at
    each position and right after each other fn equally often).

    ``warm_up``: before the first round, the first fn of its order runs untimed for about ``target_ms``: otherwise
    the race's first sample starts on a GPU idle since the caller's setup, and runs fast (session 13: at 1.3B the
    first sample of each point 1-12 % below its row's median, always the same row at every point of a race)."""
    lead_in = os.environ.get("MC_SPARSE_RACE_LEAD_IN", "1") != "0"
    ev = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
    est, times, idle = {}, {k: [] for k in fns}, {k: [] for k in fns}
    for k, fn in fns.items():
        fn()
        a, b = ev(), ev()
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        est[k] = max(a.elapsed_time(b), 1e-3)
    reps = {k: max(1, round(target_ms / est[k])) for k in fns}
    leads = {k: max(1, round(target_ms / 4 / est[k])) if lead_in else 0 for k in fns}
    if order not in ("random", "balanced"):
        raise ValueError(f"order must be 'random' or 'balanced', got {order!r}")
    plan = balanced_orders(list(fns), rounds) if order == "balanced" else _shuffled_orders(list(fns), rounds)
    prev = None
    if samples is not None:
        samples.update({k: [] for k in fns})
    if warm_up and plan:
        prev = plan[0][0]
        for _ in range(reps[prev]):
            fns[prev]()
        torch.cuda.synchronize()
    for rnd in range(rounds):
        for pos, k in enumerate(plan[rnd]):
            fn = fns[k]
            a0, a, b = ev(), ev(), ev()
            a0.record()
            for _ in range(leads[k]):
                fn()
            a.record()
            for _ in range(reps[k]):
                fn()
            b.record()
            torch.cuda.synchronize()
            times[k].append(a.elapsed_time(b) / reps[k])
            if samples is not None:
                samples[k].append((rnd, pos, prev, times[k][-1]))
            prev = k
            if leads[k]:
                idle[k].append(a0.elapsed_time(a) / leads[k])
    if from_idle is not None:
        from_idle.update({k: statistics.median(v) for k, v in idle.items() if v})
    return {k: statistics.median(v) for k, v in times.items()}


def _shuffled_orders(names: list, rounds: int) -> list:
    """``rounds`` orders of ``names``: the list shuffled in place once per round (``random.Random(0)``)."""
    rng, out = random.Random(0), []
    for _ in range(rounds):
        rng.shuffle(names)
        out.append(list(names))
    return out


def balanced_orders(names: list, rounds: int) -> list:
    """``rounds`` orders of ``names`` from a Williams design (a Latin square balanced for the row before each row):
    with n names, over n rounds (n even) or 2n rounds (n odd; the second n reversed) every name takes every position
    and follows every other name equally often within the rounds; the names' assignment to the design shuffled once
    (seed 0). Beyond those rounds the design repeats."""
    n = len(names)
    names = list(names)
    random.Random(0).shuffle(names)
    base = [0] + [(i + 1) // 2 if i % 2 else n - i // 2 for i in range(1, n)]  # 0, 1, n-1, 2, n-2, ...
    period = n if n % 2 == 0 else 2 * n
    out = []
    for r in range(rounds):
        row = [names[(b + r) % n] for b in base]
        out.append(row[::-1] if (r % period) >= n else row)
    return out
