"""Pass 2's float8 operands in ONE persistent launch (``selection.fp8_operands(persistent=True)``): the same outputs as
the three-launch path (statistics, per-head reduction, quantising pass), with each head's data read from DRAM once.

The three-launch path reads q and k twice (the statistics pass over all heads, then the quantising pass; at Wan2.1-1.3B
480p the 200 MB of q and k are 4x the H200's L2, so the second read comes from DRAM again): ~500 MB of traffic and
two dependent launch gaps (0.0205-0.027 of flash-attn-4 dense at 1.3B 480p, docs/kernels.md). Here a grid of a few
programs per SM takes work items in a fixed order from one atomic ticket counter (``_schedule``):

- a statistics item: column sums / maxima / minima of ``split_rows`` rows of q or k of one head
  (``selection._column_stats``) into its slot of PART; the item that completes a head (an arrival counter per head)
  reduces the head's slots (``_reduce_head``: the means, the power-of-two scales, qf) and sets the head's ready flag;
- a quantising item: ``quant_rows`` rows of q or k of one head (``selection._quantize_rows``: the float8 copy and the
  per-row term, lse_s or 2^kb), which first waits for its head's ready flag.

The order puts a head's quantising items ``skew`` heads after its statistics items (interleaved with the statistics
of the head ``skew`` further on), so they re-read the head while it is still in L2 and rarely wait. No deadlock: a
program waits only in a quantising item, whose head's statistics items all hold smaller tickets, i.e. were taken by
programs already running that never wait. Under the Triton interpreter the programs run one after another: the first
takes every ticket in order, so every wait is already satisfied.

Results: the same formulas as ``selection.fp8_operands`` (docstring there); the statistics are summed in another
order (splits of ``split_rows`` rows, reduced in chunks), so the means may differ from ``fp8_stats``' in the last
bits (and a scale at a power-of-two edge by one binade); q8 / k8 are exactly the float8 rounding of (x - mean) /
scale with this launch's own mean and scale (``stats`` returns them). Source: docs/kernels.md ("select_kv").
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .selection import _pow2_scale, _quantize_rows

SPLIT_ROWS = 256  # rows per statistics item (64 KB of bf16 rows at D = 128)
QUANT_ROWS = 64  # rows per quantising item (one register tile: 16 KB of bf16 loads in flight per program; 128 rows
# spill 36 bytes at 8 warps and 128 registers, offline sm_90a)
PROGRAMS_PER_SM = 2  # persistent programs per SM
NUM_WARPS = 8  # warps per program, at most MAXNREG registers per thread (offline sm_90a: 126, no spill; uncapped 190,
MAXNREG = 128  # one program per SM; 4 warps: 168 without spills, 3 programs per SM)
SKEW = 1  # heads between a head's statistics and its quantising items
_QUANT_MULTIPLE = 16  # quant_rows: a power of two, at least this
_RCHUNK = 32  # statistics slots reduced per step in ``_reduce_head``
_BLOCK_S = 32  # rows per register tile of a statistics item
EVICT_HINTS = False  # L2 eviction hints (statistics rows evict-last, quantised rows / copies evict-first): not measured
STATS_UNROLL = 2  # statistics tiles loaded before they are added (bytes in flight per program: 2 x 8 KB)


@triton.jit
def _tile_stats(base, rows, r1, offs_d, stride_s, stride_d, acc, hi, lo, EVICT: tl.constexpr):
    """``acc`` / ``hi`` / ``lo`` updated with the row tile ``rows`` (rows >= r1 masked: 0 to the sum, -inf / +inf to the
    max / min); EVICT: the rows marked evict-last in L2 (the quantising item re-reads them)."""
    ok = (rows < r1)[:, None]
    x = tl.load(base + rows.to(tl.int64)[:, None] * stride_s + offs_d[None, :] * stride_d, mask=ok, other=0.0,
                eviction_policy="evict_last" if EVICT else "")
    x = x.to(tl.float32)
    return acc + x, tl.maximum(hi, tl.where(ok, x, float("-inf"))), tl.minimum(lo, tl.where(ok, x, float("inf")))


@triton.jit
def _column_stats_unrolled(base, stride_s, stride_d, r0, r1, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
                           UNROLL: tl.constexpr, EVICT: tl.constexpr):
    """(sum, max, min) per column (fp32 [HEAD_DIM] each) of rows [r0, r1) of one head (``base`` by strides; r1 > r0),
    as ``selection._column_stats`` but with UNROLL (1 or 2) row tiles per step, the second tile's load issued before
    the first is added (more loads in flight)."""
    offs_d = tl.arange(0, HEAD_DIM)
    offs_s = tl.arange(0, BLOCK_S)
    acc = tl.zeros([BLOCK_S, HEAD_DIM], dtype=tl.float32)
    hi = tl.full([BLOCK_S, HEAD_DIM], float("-inf"), tl.float32)
    lo = tl.full([BLOCK_S, HEAD_DIM], float("inf"), tl.float32)
    tl.static_assert(UNROLL == 1 or UNROLL == 2, "UNROLL: 1 or 2")
    for s0 in range(r0, r1, BLOCK_S * UNROLL):
        if UNROLL == 2:
            rows1 = s0 + BLOCK_S + offs_s
            ok1 = (rows1 < r1)[:, None]
            x1 = tl.load(base + rows1.to(tl.int64)[:, None] * stride_s + offs_d[None, :] * stride_d, mask=ok1,
                         other=0.0, eviction_policy="evict_last" if EVICT else "")
            acc, hi, lo = _tile_stats(base, s0 + offs_s, r1, offs_d, stride_s, stride_d, acc, hi, lo, EVICT)
            x1 = x1.to(tl.float32)
            acc += x1
            hi = tl.maximum(hi, tl.where(ok1, x1, float("-inf")))
            lo = tl.minimum(lo, tl.where(ok1, x1, float("inf")))
        else:
            acc, hi, lo = _tile_stats(base, s0 + offs_s, r1, offs_d, stride_s, stride_d, acc, hi, lo, EVICT)
    return tl.sum(acc, 0), tl.max(hi, 0), tl.min(lo, 0)


@triton.jit
def _reduce_tensor(base, n, S, MEAN_OUT, HEAD_DIM: tl.constexpr, RCHUNK: tl.constexpr):
    """Mean (stored at MEAN_OUT, fp32 [HEAD_DIM]) and float8 scale (returned) of one tensor's head from its ``n``
    statistics slots at ``base`` ([n, 3, HEAD_DIM] fp32: sums, maxima, minima), reduced RCHUNK slots at a time."""
    offs_d = tl.arange(0, HEAD_DIM)
    sp = tl.arange(0, RCHUNK)
    acc = tl.zeros([RCHUNK, HEAD_DIM], dtype=tl.float32)
    hi = tl.full([RCHUNK, HEAD_DIM], float("-inf"), tl.float32)
    lo = tl.full([RCHUNK, HEAD_DIM], float("inf"), tl.float32)
    for c0 in range(0, n, RCHUNK):
        ok = (c0 + sp < n)[:, None]
        ptr = base + (c0 + sp)[:, None] * (3 * HEAD_DIM) + offs_d[None, :]
        acc += tl.load(ptr, mask=ok, other=0.0, cache_modifier=".cg")
        hi = tl.maximum(hi, tl.load(ptr + HEAD_DIM, mask=ok, other=float("-inf"), cache_modifier=".cg"))
        lo = tl.minimum(lo, tl.load(ptr + 2 * HEAD_DIM, mask=ok, other=float("inf"), cache_modifier=".cg"))
    mean = tl.div_rn(tl.sum(acc, 0), S.to(tl.float32))
    scale = _pow2_scale(tl.max(tl.maximum(tl.max(hi, 0) - mean, mean - tl.min(lo, 0)), 0))
    tl.store(MEAN_OUT + offs_d, mean)
    return scale


@triton.jit
def _fp8_operands_persistent(
    Q, K, Q8, K8, LSE, LSE_S, KB, PART, MQ, MK, STATS, SYNC, ITEMS,
    H, BH, S, SK, n_items, nq, nk,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_lb, stride_lh, stride_ls,
    lse_mul, kb_mul, qf_mul,
    HEAD_DIM: tl.constexpr,
    SPLIT: tl.constexpr,  # rows per statistics item
    QROWS: tl.constexpr,  # rows per quantising item (one register tile)
    BLOCK_S: tl.constexpr,
    UNROLL: tl.constexpr,
    EVICT: tl.constexpr,  # L2 hints: statistics rows evict-last, quantised rows and float8 copies evict-first
    RCHUNK: tl.constexpr,
    KB_POW2: tl.constexpr,
):
    """Persistent programs taking ``ITEMS`` (int32 codes bh * 65536 + idx: idx < nq + nk a statistics item, else a
    quantising item idx - nq - nk) in ticket order (SYNC[0]); SYNC[1 + bh]: the head's statistics arrivals,
    SYNC[1 + BH + bh]: its ready flag; PART: fp32 [BH, nq + nk, 3, HEAD_DIM]; MQ / MK: fp32 [BH, HEAD_DIM]; STATS:
    fp32 [3, BH] (q scale, k scale, qf). See the module docstring."""
    ns = nq + nk
    nbq = tl.cdiv(S, QROWS)
    t = tl.atomic_add(SYNC, 1)
    while t < n_items:
        code = tl.load(ITEMS + t)
        bh = code // 65536
        idx = code % 65536
        b = bh // H
        h = bh % H
        if idx < ns:  # statistics of rows [r0, r0 + SPLIT) of q (idx < nq) or k
            if idx < nq:
                r0 = idx * SPLIT
                col_sum, col_max, col_min = _column_stats_unrolled(
                    Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh, stride_qs, stride_qd, r0,
                    tl.minimum(r0 + SPLIT, S), HEAD_DIM, BLOCK_S, UNROLL, EVICT)
            else:
                r0 = (idx - nq) * SPLIT
                col_sum, col_max, col_min = _column_stats_unrolled(
                    K + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh, stride_ks, stride_kd, r0,
                    tl.minimum(r0 + SPLIT, SK), HEAD_DIM, BLOCK_S, UNROLL, EVICT)
            offs_d = tl.arange(0, HEAD_DIM)
            slot = PART + (bh.to(tl.int64) * ns + idx) * (3 * HEAD_DIM) + offs_d
            tl.store(slot, col_sum)
            tl.store(slot + HEAD_DIM, col_max)
            tl.store(slot + 2 * HEAD_DIM, col_min)
            tl.debug_barrier()  # every thread's slot stores issued before the arrival (release: visible with it)
            arrived = tl.atomic_add(SYNC + 1 + bh, 1, sem="acq_rel", scope="gpu")
            if arrived == ns - 1:  # the head's last statistics item: reduce, publish, set the ready flag
                head = PART + bh.to(tl.int64) * ns * (3 * HEAD_DIM)
                sq = _reduce_tensor(head, nq, S, MQ + bh * HEAD_DIM, HEAD_DIM, RCHUNK)
                sk = _reduce_tensor(head + nq * (3 * HEAD_DIM), nk, SK, MK + bh * HEAD_DIM, HEAD_DIM, RCHUNK)
                tl.store(STATS + bh, sq)
                tl.store(STATS + BH + bh, sk)
                tl.store(STATS + 2 * BH + bh, sq * sk * qf_mul)
                tl.debug_barrier()
                tl.atomic_xchg(SYNC + 1 + BH + bh, 1, sem="release", scope="gpu")
        else:  # quantising: QROWS rows of q (j < nbq) or k, once the head's statistics are ready
            ready = tl.atomic_add(SYNC + 1 + BH + bh, 0, sem="acquire", scope="gpu")
            while ready == 0:
                ready = tl.atomic_add(SYNC + 1 + BH + bh, 0, sem="acquire", scope="gpu")
            j = idx - ns
            if j < nbq:
                _quantize_rows(Q, Q8, MQ, MK, STATS, LSE, LSE_S, j, b, h, bh, S, stride_qb, stride_qh, stride_qs,
                               stride_qd, stride_lb, stride_lh, stride_ls, lse_mul, HEAD_DIM, QROWS, True, False, True, EVICT)
            else:
                _quantize_rows(K, K8, MK, MQ, STATS + BH, LSE, KB, j - nbq, b, h, bh, SK, stride_kb, stride_kh,
                               stride_ks, stride_kd, stride_lb, stride_lh, stride_ls, kb_mul, HEAD_DIM, QROWS, False,
                               KB_POW2, True, EVICT)
        t = tl.atomic_add(SYNC, 1)


@functools.lru_cache(maxsize=64)
def _schedule_host(bh: int, ns: int, nb: int, skew: int) -> tuple[int, ...]:
    """The item codes in ticket order: head h's ``ns`` statistics items at step h, its ``nb`` quantising items at step
    h + skew (skew >= 1), the two kinds of one step interleaved evenly (item n of a step is a quantising one where
    floor(n * quantising / all) rises)."""
    order = []
    for step in range(bh + skew):
        stats = [step * 65536 + i for i in range(ns)] if step < bh else []
        h = step - skew
        quant = [h * 65536 + ns + j for j in range(nb)] if h >= 0 else []
        total = len(stats) + len(quant)
        for n in range(total):
            before, after = n * len(quant) // total, (n + 1) * len(quant) // total
            order.append(quant[before] if after > before else stats[n - before])
    return tuple(order)


_SCHEDULES: dict = {}


def _schedule(bh: int, ns: int, nb: int, skew: int, device) -> torch.Tensor:
    """``_schedule_host``'s codes as an int32 tensor on ``device`` (cached per shape and device)."""
    key = (bh, ns, nb, skew, str(device))
    sched = _SCHEDULES.get(key)
    if sched is None:
        if len(_SCHEDULES) > 64:
            _SCHEDULES.clear()
        sched = _SCHEDULES[key] = torch.tensor(_schedule_host(bh, ns, nb, skew), dtype=torch.int32, device=device)
    return sched


def _programs(device, n_items: int, per_sm: int) -> int:
    if device.type != "cuda":
        return min(n_items, 3)  # (the interpreter: programs run one after another anyway)
    return max(1, min(n_items, per_sm * torch.cuda.get_device_properties(device).multi_processor_count))


def refusal(q: torch.Tensor, k: torch.Tensor, *, split_rows: int = SPLIT_ROWS, quant_rows: int = QUANT_ROWS,
            skew: int = SKEW) -> str | None:
    """Why the persistent launch cannot take these shapes or tuning (None: it can): the item codes hold a head index
    below 2^15 and an item index below 2^16; quant_rows a power of two >= 16; skew >= 1."""
    B, H, S, D = q.shape
    SK = k.shape[2]
    ns = -(-S // split_rows) + -(-SK // split_rows)
    nb = -(-S // quant_rows) + -(-SK // quant_rows)
    if B * H >= 1 << 15 or ns + nb >= 1 << 16 or skew < 1:
        return f"too many heads ({B * H}) or rows per head ({S}, {SK}) for the item codes, or skew {skew} < 1"
    if quant_rows < _QUANT_MULTIPLE or quant_rows & (quant_rows - 1):
        return f"quant_rows must be a power of two >= {_QUANT_MULTIPLE}, got {quant_rows}"
    return None


def fp8_operands_persistent(q, k, lse, scale, *, kb_pow2=False, split_rows=SPLIT_ROWS, quant_rows=QUANT_ROWS,
                            programs_per_sm=PROGRAMS_PER_SM, skew=SKEW, num_warps=NUM_WARPS, maxnreg=MAXNREG,
                            unroll=STATS_UNROLL, evict=EVICT_HINTS, stats=None):
    """``selection.fp8_operands``' outputs (q8, k8, qf, lse_s, kb; same shapes, dtypes and formulas) in one
    persistent launch (module docstring). split_rows / quant_rows: rows per statistics / quantising item;
    programs_per_sm, skew, num_warps, maxnreg (CUDA; 0: uncapped), unroll (statistics tiles in flight), evict (L2
    eviction hints): launch tuning. ``stats``: a dict filled with this launch's mq, mk (fp32 [B, H,
    D]) and q / k scales (fp32 [B, H]). Raises ValueError where ``refusal`` says why."""
    why = refusal(q, k, split_rows=split_rows, quant_rows=quant_rows, skew=skew)
    if why is not None:
        raise ValueError(why)
    B, H, S, D = q.shape
    SK = k.shape[2]
    dev = q.device
    BH = B * H
    nq, nk = -(-S // split_rows), -(-SK // split_rows)
    nb = -(-S // quant_rows) + -(-SK // quant_rows)
    items = _schedule(BH, nq + nk, nb, skew, dev)
    part = torch.empty(BH, nq + nk, 3, D, dtype=torch.float32, device=dev)
    mq = torch.empty(B, H, D, dtype=torch.float32, device=dev)
    mk = torch.empty(B, H, D, dtype=torch.float32, device=dev)
    st = torch.empty(3, B, H, dtype=torch.float32, device=dev)  # q scale, k scale, qf
    sync = torch.zeros(1 + 2 * BH, dtype=torch.int32, device=dev)
    q8 = torch.empty(B, H, S, D, dtype=torch.float8_e4m3fn, device=dev)
    k8 = torch.empty(B, H, SK, D, dtype=torch.float8_e4m3fn, device=dev)
    lse_s = torch.empty(B, H, S, dtype=torch.float32, device=dev)
    kb = torch.empty(B, H, SK, dtype=torch.float32, device=dev)
    log2e = 1.4426950408889634
    _fp8_operands_persistent[(_programs(dev, len(items), programs_per_sm),)](
        q, k, q8, k8, lse, lse_s, kb, part, mq, mk, st, sync, items, H, BH, S, SK, len(items), nq, nk,
        *q.stride(), *k.stride(), *lse.stride(), -scale, scale * log2e, scale * log2e,
        HEAD_DIM=D, SPLIT=split_rows, QROWS=quant_rows, BLOCK_S=_BLOCK_S, UNROLL=unroll, EVICT=bool(evict), RCHUNK=_RCHUNK,
        KB_POW2=bool(kb_pow2), num_warps=num_warps, **(dict(maxnreg=maxnreg) if maxnreg and dev.type == "cuda" else {}))
    if stats is not None:
        stats.update(mq=mq, mk=mk, q_scale=st[0], k_scale=st[1])
    return q8, k8, st[2], lse_s, kb
