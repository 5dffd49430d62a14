"""The Triton backend's ``sparse_attention`` op: the sm_90 Gluon kernel where it runs and is faster, else the Triton
kernel.

Which kernel runs one call (the capability data are in ``sparse_attention_sm90``: ``CAPABILITIES``, ``DTYPES``,
``HEAD_DIMS``, ``refusal``):

- the Triton kernel (``sparse_attention.py``) everywhere the Gluon kernel refuses (not sm_90, dtype, head dim,
  unaligned rows; the interpreter included), when launch tuning is passed (tuning is the Triton kernel's), and
  with ``MC_SPARSE_GLUON=0``;
- the warp-specialised Gluon kernel (``sparse_attention_sm90.py``) with ``MC_SPARSE_GLUON=1``;
- otherwise ``GLUON_DEFAULT``: "auto" (the default) times the Gluon kernel's schedules named in ``AUTO_SCHEDULES``
  once per call shape (``_shape_key``: device, dtype, q / k shapes, groups, K_alloc, residual kind, LSE) on the first
  such call (CUDA events on the current stream, ``TIMING_REPS`` launches each, interleaved, after one warm launch;
  one host synchronisation per shape per process, on the first call: in a denoising run that is the first anchor
  step) and keeps the fastest for that shape (``choices``: a schedule name); the call's result is the chosen
  kernel's, launched last. A schedule that fails to compile or launch is left out for that shape (logged); when all
  fail, the Triton kernel runs (below). The Triton kernel is not a candidate: on the H200 it was the slowest at every
  measured point (2026-12-01 rounds: 0.50-0.63 of flash-attn-4 dense x s against the persistent pingpong schedules'
  0.65-0.82), and timing it cost a second compile (~8 s) per shape. While a CUDA graph is being captured nothing is
  timed and the Triton kernel runs. "on" (the first schedule) / "off" force one kernel.

A Gluon compile or launch failure (anything but out of memory) falls back to the Triton kernel for the same call,
is logged once, and is remembered as the registry remembers a failed backend: in the active ``registry.Record``
(key ``("triton.gluon_sm90", "sparse_attention")``, so the run summary shows the reason and the rest of that run
skips the Gluon kernel) and, without a record, for the process (``fallback_reason``).
"""

from __future__ import annotations

import logging
import os

import torch

from .. import registry
from . import sparse_attention as _triton_kernel

log = logging.getLogger(__name__)

GLUON_KEY = ("triton.gluon_sm90", "sparse_attention")
# "auto": per call shape, the faster of the two kernels measured once (a wrong result is not an exception, so the
# Gluon kernel's correctness rests on tests/test_gpu_gluon_sparse.py; its speed is measured where it runs)
GLUON_DEFAULT = "auto"
TIMING_REPS = 5
# The Gluon kernel's schedules (name -> launch options of sparse_attention_sm90); the first is what "on" runs. Each
# is checked against float64 on the GPU (tests/test_gpu_gluon_sparse.py).
# the producer's early query gathers and the consumers' per-thread arrives, no proxy fence: the base of the
# schedules below from q_regs on
_EARLY_Q = dict(pingpong=True, persistent=True, num_stages=3, thread_arrive=True, early_q=True, cp_async_fence=False)
_SUM_PARTIAL = "pingpong persistent 3 stages thread_arrive early_q no_fence q_regs skip_rescale sum_partial"
GLUON_SCHEDULES = {
    "plain": {},
    "pingpong": dict(pingpong=True),
    "pingpong persistent": dict(pingpong=True, persistent=True),
    "pingpong persistent 3 stages": dict(pingpong=True, persistent=True, num_stages=3),  # one Q slot, 224 KiB
    "pingpong persistent stage_out": dict(pingpong=True, persistent=True, stage_out=True),  # 16-byte output stores
    # + the consumers' per-thread arrives (no warpgroup bar.sync per stage release / turn)
    "pingpong persistent 3 stages thread_arrive": dict(pingpong=True, persistent=True, num_stages=3,
                                                       thread_arrive=True),
    # + each item's Q slot freed at its last QK^T and the next item's queries gathered right behind its first K/V
    # tile (early_q), no proxy fence between a stage's ready wait and its wgmma (no_fence: flash-attn-4's sm90
    # cp.async pipelines), and the queries as the QK^T's register operand (the Q slot freed at each item's start)
    "pingpong persistent 3 stages thread_arrive early_q no_fence q_regs": dict(_EARLY_Q, q_regs=True),
    # + each tile's kv_idx slots loaded two tiles ahead by the producer
    "pingpong persistent 3 stages thread_arrive early_q no_fence idx2": dict(_EARLY_Q, idx_ahead=2),
    # q_regs with the last, partial round of work items in a second launch split into key ranges (tail_launch: the
    # first launch keeps 224 / 56 and its schedule; the tail launch runs without residual / LSE, 216 / 72, merged by
    # kernels/triton/sparse_tail_merge.py). (chain, one pingpong block sequence across a program's items, measured no
    # faster in round s8r1 and was removed in session 9)
    "pingpong persistent 3 stages thread_arrive early_q no_fence q_regs tail_launch": dict(
        _EARLY_Q, q_regs=True, tail_launch=4),
    # + each warp skips its 64 accumulator multiplies per tile when none of its rows' running max moved (skip_rescale,
    # D = 128: a vote and a warp-uniform branch; the multiplies sat between the turn wait and the next P V)
    "pingpong persistent 3 stages thread_arrive early_q no_fence q_regs skip_rescale": dict(
        _EARLY_Q, q_regs=True, skip_rescale=True),
    # + the scores' row maxima as a tree (max_tree: a dependent chain of ~5 maxima instead of 32 before the shuffles)
    "pingpong persistent 3 stages thread_arrive early_q no_fence q_regs skip_rescale max_tree": dict(
        _EARLY_Q, q_regs=True, skip_rescale=True, max_tree=True),
    "pingpong persistent 3 stages thread_arrive early_q no_fence q_regs skip_rescale max_tree tail_launch": dict(
        _EARLY_Q, q_regs=True, skip_rescale=True, max_tree=True, tail_launch=4),
    # q_regs + skip_rescale + the row sums kept as each thread's partials over a group's tiles, finished once per
    # item (sum_partial: no shuffles per tile for them); with and without the tail launch (the auto mode s9r3-s10r2)
    "pingpong persistent 3 stages thread_arrive early_q no_fence q_regs skip_rescale sum_partial": dict(
        _EARLY_Q, q_regs=True, skip_rescale=True, sum_partial=True),
    "pingpong persistent 3 stages thread_arrive early_q no_fence q_regs skip_rescale sum_partial tail_launch": dict(
        _EARLY_Q, q_regs=True, skip_rescale=True, sum_partial=True, tail_launch=4),
    # + the running max kept per thread too, the row maxima's shuffles only when a warp's vote says a row's max may
    # move (max_vote; same values), + the pingpong turns on named barriers (named_turns: bar.sync / bar.arrive, as
    # flash-attn's sm90 warp scheduler barriers, instead of mbarrier waits and arrives), and both; each with and
    # without the tail launch (the auto mode since round s10final: all four)
    **{_SUM_PARTIAL + extra + tail: dict(_EARLY_Q, q_regs=True, skip_rescale=True, sum_partial=True, **opts,
                                         **({"tail_launch": 4} if tail else {}))
       for extra, opts in ((" max_vote", dict(max_vote=True)), (" named_turns", dict(named_turns=True)),
                           (" max_vote named_turns", dict(max_vote=True, named_turns=True)))
       for tail in ("", " tail_launch")},
    # the same with the row maxima as a tree too (max_tree: slower at 1.3B in round s9r1, without sum_partial)
    "pingpong persistent 3 stages thread_arrive early_q no_fence q_regs skip_rescale max_tree sum_partial": dict(
        _EARLY_Q, q_regs=True, skip_rescale=True, max_tree=True, sum_partial=True),
    "pingpong persistent 3 stages thread_arrive early_q no_fence q_regs skip_rescale max_tree sum_partial tail_launch":
        dict(_EARLY_Q, q_regs=True, skip_rescale=True, max_tree=True, sum_partial=True, tail_launch=4),
    # q_regs with the last, partial round of work items split into key ranges (split_tail; registers 216 / 72: at
    # 224 / 56 the split walk's producer spilled 5-6 local accesses per tile in its copy loop, offline SASS). The
    # producer at 8 threads per row and each item's first loads an item early (rt8, next_item) measured no faster in
    # round s7r1 and are bench rows only (tests/bench_kernels.py GLUON_CONFIGS)
    "pingpong persistent 3 stages thread_arrive early_q no_fence q_regs split": dict(
        _EARLY_Q, q_regs=True, split_tail=4, consumer_regs=216, producer_regs=72),
}
# What the auto mode times per shape. H200, 2026-12-01 13:42 (tests/_timing.race, vs flash-attn-4 dense with LSE x s,
# 1.3B 480p / 14B 720p, s = 0.1 / 0.15 / 0.25 / 0.5): pingpong persistent with the 3-deep ring and per-thread
# arrives 0.698 / 0.742 / 0.773 / 0.790 and 0.784 / 0.822 / 0.837 / 0.838, the best at every point (+5-12 % over the
# op as it was: the 2-stage ring, the 3-deep ring alone or the staged epilogue, 0.654 / 0.713 / 0.718 / 0.745 and
# 0.748 / 0.730 / 0.765 / 0.781). Round of 2026-12-01 15:25 (same method, s = 0.1 only for the variants): that
# schedule (the op) 1.398 / 24.87 ms at 1.3B / 14B; without the proxy fence and with the Q slot freed at each item's
# last QK^T (early_q no_fence) 1.325 / 23.63 ms (+5.5 / +5 %); + the queries in registers (q_regs) 1.330 / 23.28 ms;
# FA3's overlap with both 1.639 ms (-17 %). The auto mode times the q_regs schedule and early_q no_fence with the
# producer's indices two tiles ahead (idx2). Round 16:31 (the op = this auto mode; 14B cut after s = 0.15): the op
# 0.701 / 0.718 / 0.775 / 0.775 | 0.773 / 0.784, the previous first schedule 0.694 / 0.723 / 0.783 / 0.772 | 0.749 /
# 0.776, q_regs called directly 0.714 / 0.736 / 0.780 / 0.776 | 0.739 / 0.765 (docs/kernels.md). Round s7r1 (the op
# = this auto mode): 0.690 / 0.725 / 0.775 / 0.777 | 0.764 / 0.793 / 0.830 / 0.840 (dense 9.4-9.8 / 173-178 ms);
# the producer at 8 threads per row and each item's first loads an item early no faster. Round s7r2 tried both with
# the last, partial round of work items split into key ranges (split_tail: Wan2.1-1.3B 480p runs 3072 items on 132
# SMs, 23.3 rounds; 14B 720p 179.1): with registers 216 / 72 (its producer spills at 224 / 56) q_regs ran 0.56-0.65
# instead of 0.72-0.79 (both shapes, same race), and the split schedule failed to compile with an int4_group
# residual, so the auto mode keeps s7r1's pair (the op in s7r2: 0.708 / 0.734 / 0.767 /
# 0.788 | 0.722 / 0.821 / 0.842 / 0.825).
# Round s8r1 (chain: no faster at 1.3B, 0.702 / 0.725 / 0.757 / 0.773 beside the op's 0.700 / 0.728 / 0.765 /
# 0.779). Since round s8r2: q_regs with the last, partial round in a second, split launch (tail_launch: 1.3B 480p
# runs 23 whole rounds, then 36 items in 3 parts on 108 SMs instead of 36 whole items on 36), and q_regs as before.
# Round s8r2 (the op = this pair vs q_regs called directly, same race): 1.3B 0.708 / 0.737 / 0.768 / 0.792 vs 0.706 /
# 0.728 / 0.767 / 0.776; 14B 0.716 / 0.734 / 0.782 / 0.819 vs 0.751 / 0.766 / 0.786 / 0.800, where the tail launch's
# extra host time sits in every one-call sample: since then the tail launch splits only walks of at most
# sparse_attention_sm90.TAIL_MAX_ROUNDS whole rounds (1.3B 480p: 23; 14B 720p: 179, q_regs unchanged there).
# Round s9r1 (session 9, the lead-in timing): skip_rescale alone and with max_tree no faster at 1.3B. Round s9r2 (main
# b4160ca, same race, 1.3B s = 0.1 / 0.15 / 0.25 / 0.5 | 14B s = 0.1 / 0.15 before the cap): q_regs + skip_rescale +
# sum_partial called directly 0.752 / 0.762 / 0.801 / 0.817 | 0.788 / 0.825 against the op (this pair before it)
# 0.703 / 0.727 / 0.763 / 0.783 | 0.759 / 0.773: the auto mode's pair since round s9r3 is that schedule with and
# without the tail launch. PREVIOUS_AUTO_SCHEDULES (bench --gluon-auto previous: a round whose GPU checks of the new
# pair failed) is the pair of rounds s8r2-s9r2.
# Session 10 (the method of record, 1.3B 480p, s = 0.1 / 0.15 / 0.25 / 0.5, each + the tail launch, called directly
# beside the op = the pair above): round s10r1, + q_ahead (each item's queries gathered during the item before) 0.736
# / 0.771 / 0.808 / 0.822 against the op's 0.736 / 0.772 / 0.817 / 0.833 (removed); round s10r2, + max_vote 0.782 /
# 0.821 / 0.866 / 0.888, + named_turns 0.771 / 0.788 / 0.831 / 0.853, + idx2 0.745 / 0.780 / 0.814 / 0.842, + idx2 and
# an L2 prefetch of each next item's index row 0.747 / 0.779 / 0.821 / 0.833 (removed), against the op's 0.750 /
# 0.775 / 0.811 / 0.839 (14B not reached). Since round s10final the auto mode times max_vote and max_vote +
# named_turns, each with and without the tail launch, and keeps the fastest per shape; PREVIOUS_AUTO_SCHEDULES is
# the pair of rounds s9r3-s10r2. Round s10final (the op = this auto mode, beside the previous pair's first schedule
# called directly): 0.780 / 0.823 / 0.862 / 0.894 | 0.831 / 0.883 / 0.868 / 0.867 against 0.737 / 0.778 / 0.818 /
# 0.837 | 0.755 / 0.790 / 0.830 / 0.875 (1.3B | 14B); its own timings picked max_vote + named_turns at 5 of 8 points.
PREVIOUS_AUTO_SCHEDULES = (_SUM_PARTIAL + " tail_launch", _SUM_PARTIAL)
AUTO_SCHEDULES = (_SUM_PARTIAL + " max_vote named_turns tail_launch", _SUM_PARTIAL + " max_vote named_turns",
                  _SUM_PARTIAL + " max_vote tail_launch", _SUM_PARTIAL + " max_vote")
choices: dict[tuple, str] = {}  # shape key -> an AUTO_SCHEDULES name (auto mode); times in _times
_times: dict[tuple, dict[str, float]] = {}
_failures = registry.FailureMemo(GLUON_KEY)


def _gluon_module():
    from . import sparse_attention_sm90  # imported lazily: an import error is a fallback reason, not a broken backend

    return sparse_attention_sm90


def gluon_mode() -> str:
    """"on", "off" or "auto": ``MC_SPARSE_GLUON`` (1 / 0), else ``GLUON_DEFAULT``."""
    setting = os.environ.get("MC_SPARSE_GLUON", "")
    if setting in ("0", "1"):
        return "on" if setting == "1" else "off"
    return GLUON_DEFAULT if GLUON_DEFAULT in ("on", "off", "auto") else "off"


def gluon_refusal(q, k, v, residual=None) -> str | None:
    """Why the Gluon kernel is not tried for this call (None: it is, or it is timed against the Triton kernel)."""
    if gluon_mode() == "off":
        return "off (MC_SPARSE_GLUON=0)" if os.environ.get("MC_SPARSE_GLUON") == "0" else "off (GLUON_DEFAULT)"
    failed = fallback_reason()
    if failed is not None:
        return f"failed earlier ({failed})"
    try:
        mod = _gluon_module()
    except Exception as err:  # a Triton without Gluon's Hopper module
        return f"unavailable ({type(err).__name__}: {err})"
    return mod.refusal(q, k, v, residual)


def fallback_reason() -> str | None:
    """The Gluon failure this run (active record) or this process (no record) remembers, if any."""
    return _failures.reason()


def reset() -> None:
    """Forget a process-level Gluon failure and the auto mode's choices (tests; a new record starts clean itself)."""
    _failures.reset()
    choices.clear()
    _times.clear()


def _shape_key(q, k, perm, kv_idx, residual, return_lse) -> tuple:
    return (str(q.device), q.dtype, tuple(q.shape), k.shape[2], tuple(kv_idx.shape[2:]), perm.shape[-1],
            None if residual is None else residual.kind, bool(return_lse))


def _time_candidates(fns: dict, reps: int) -> dict[str, float]:
    """{name: median ms} of ``reps`` launches of each fn, interleaved (one launch of each per round, so a clock or
    cache drift during the timing weighs on every candidate alike) after one warm launch each; CUDA events on the
    current stream, one synchronisation."""
    for fn in fns.values():
        fn()
    events = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events[name].append((start, end))
    torch.cuda.synchronize()
    return {name: sorted(s.elapsed_time(e) for s, e in ev)[len(ev) // 2] for name, ev in events.items()}


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def sparse_attention(q, k, v, perm, kv_idx, *, scale=None, return_lse=False, out=None, residual=None, **tuning):
    """``kernels.sparse_attention`` on the Triton backend (contract: ``sparse_attention.sparse_attention``).

    Picks the kernel as the module docstring says; on a Gluon failure runs the Triton kernel (same arguments, same
    ``out``) and remembers the reason. Raises: what the Triton kernel raises; out of memory propagates.
    """
    kw = dict(scale=scale, return_lse=return_lse, out=out, residual=residual)

    def triton_call():
        return _triton_kernel.sparse_attention(q, k, v, perm, kv_idx, **kw, **tuning)

    if tuning or gluon_refusal(q, k, v, residual) is not None:
        return triton_call()
    gluon = _gluon_module()

    def gluon_call(name=next(iter(GLUON_SCHEDULES))):
        return gluon.sparse_attention(q, k, v, perm, kv_idx, **kw, **GLUON_SCHEDULES[name])

    if gluon_mode() == "on":
        try:
            return gluon_call()
        except Exception as err:
            return _fall_back(err, triton_call)
    if _capturing():
        return triton_call()
    key = _shape_key(q, k, perm, kv_idx, residual, return_lse)
    if key not in choices:
        working, first_err = [], None
        for name in AUTO_SCHEDULES:  # each compiled and launched once: a failure is caught here, not in the timing
            try:
                gluon_call(name)
                working.append(name)
            except Exception as err:
                if registry.is_out_of_memory(err):
                    raise
                first_err = first_err or err
                log.warning("MC-Sparse: Gluon sparse schedule %r failed for %s (%s: %s); left out", name, key,
                            type(err).__name__, str(err)[:300])
        if not working:
            return _fall_back(first_err, triton_call)
        times = _time_candidates({name: (lambda name=name: gluon_call(name)) for name in working}, TIMING_REPS)
        choices[key] = min(times, key=times.get)
        _times[key] = times
        log.info("MC-Sparse: sparse kernel for %s: %s -> %s", key,
                 ", ".join(f"{n} {t:.3f} ms" for n, t in times.items()), choices[key])
    try:
        return gluon_call(choices[key])
    except Exception as err:
        return _fall_back(err, triton_call)


def _fall_back(err, triton_call):
    """A Gluon failure: out of memory re-raised; else remembered for the run or the process
    (``registry.FailureMemo``), logged, and the Triton kernel run."""
    if registry.is_out_of_memory(err):
        raise err
    reason = f"{type(err).__name__}: {str(err)[:500]}"
    _failures.remember(reason)
    log.warning("MC-Sparse: the sm_90 Gluon sparse kernel failed (%s); using the Triton kernel", reason)
    return triton_call()
