"""Triton pass 2 of exact selection: group sums of exact probabilities, then top-K (MC-Sparse sec. 3.3).

``sums[b, h, g, j] = sum over the C queries i of group g of exp(q_i . k_j * scale - LSE_i)``.

Tile scheme: one program per (group, batch*head), groups of one head back to back (L2 reuse of the head's K).
The program gathers its group's query rows (BLOCK_M = C rounded up to a power of two, at most 128; larger groups
are handled in chunks of 128 rows inside the key loop) and their LSE once, then sweeps all Sk keys densely in
BLOCK_N tiles: ``s^T = K_tile @ Q^T`` ([BLOCK_N, BLOCK_M], fp32 accumulate), ``p = exp2(s * scale*log2(e) -
LSE*log2(e))``, and the group sum is a row sum of ``p^T`` (in-thread and intra-warp, no shared-memory round trip).
Keys are read un-permuted, so the K loads are plain contiguous tiles. Padded query slots get LSE = +inf, so they
add exactly 0; key positions past Sk are masked on load and never stored.

``select_kv`` runs this kernel on chunks of heads (bounded scratch: ``_SCRATCH_BYTES``, sums stored in float16)
and keeps each group's top-K with the bracket method of ``topk`` (sample bracket + radix select, radix fallback;
exact): on sm_90+ run by the pair kernel itself after its key sweep (``topk_fused``, ``topk.FusedRows``), elsewhere
by ``topk.top_k_rows``; either writes the sorted, -1-padded selection rows directly (ties: the lower token index wins; no global sort, no host
sync). ``pair=True`` runs two query groups per program (each K tile loaded once for both); ``exp="f16x2"`` takes
the exponentials from ``fastexp`` (packed half precision); ``fp8=True`` (the default on sm_90+, ``fp8_default``)
takes QK^T in float8_e4m3 on smoothed copies of q and k (``fp8_operands``): approximate sums, measured to keep
>= 0.9997 of the exact selection's probability mass (docs/kernels.md, "select_kv").

Expected agreement with ``kernels.reference.group_prob_sums``: relative error ~1e-3 for bf16/fp16 inputs against
a float64 reference (the QK^T product is exact in fp32 accumulation; the error is exp2's and the inputs'), not
bitwise; the selected sets then agree except where group sums tie within that error.
"""

from __future__ import annotations

import logging
import math
import os

import torch
import triton
import triton.language as tl

from . import fastexp, pass2_dispatch
from .topk import HIST_BINS, FusedRows, _bracket_row, top_k_rows

log = logging.getLogger(__name__)
_RADIX_FAILED: list[str] = []  # the radix top-K's first error in this process (then torch.topk answers)
_BRACKET_OOM: list[bool] = []  # set once the bracket top-K ran out of memory (logged once; radix answers such calls)

_LOG2E = 1.4426950408889634
_SCRATCH_BYTES = 1 << 30  # fp32 group-sum scratch per head chunk in select_kv: 1 GiB (14B 720p: 5 heads)


@triton.jit
def _exp2_fma(x):
    """2^x on the FMA/ALU pipes (no MUFU), relative error < 5e-5 for x in [-125, 0.5]; smaller x gives ~0."""
    x = tl.maximum(x, -125.0)
    t = x + 12582912.0  # 1.5 * 2^23: the add rounds x to an integer n held in t's low mantissa bits
    f = x - (t - 12582912.0)  # [-0.5, 0.5]
    p = 0.009618129 * f + 0.05550411  # Taylor series of 2^f to degree 4 (error ~4e-5 on |f| <= 0.5)
    p = p * f + 0.2402265
    p = p * f + 0.6931472
    p = p * f + 1.0
    # 2^n * p: add n to p's exponent field; t's bits are 0x4B400000 + n, and 0x4B400000 << 23 wraps to 0
    return (p.to(tl.int32, bitcast=True) + (t.to(tl.int32, bitcast=True) << 23)).to(tl.float32, bitcast=True)


@triton.jit
def _group_prob_sums_fwd(
    Q, K, LSE, PERM, SUMS,
    sm_scale_log2,  # softmax scale * log2(e)
    H, S, SK, n_slots, C,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_lb, stride_lh, stride_ls,
    stride_sb, stride_sh, stride_sg, stride_sn,
    M_CHUNKS: tl.constexpr,  # ceil(C / BLOCK_M)
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EXP_MODE: tl.constexpr,  # fastexp mode: 0 fp32 ex2, 1 packed ex2.approx.f16x2 (CUDA), 2 its emulation
    POLY: tl.constexpr,  # every other key tile's exp2 on the FMA pipe (polynomial), the rest on MUFU
):
    group = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)

    perm_base = PERM + bh.to(tl.int64) * n_slots + group.to(tl.int64) * C
    q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    l_base = LSE + b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh
    k_base = K + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh
    s_base = SUMS + b.to(tl.int64) * stride_sb + h.to(tl.int64) * stride_sh + group.to(tl.int64) * stride_sg

    # first (often only) chunk of the group's queries, kept for the whole key sweep
    q_idx = tl.load(perm_base + offs_m, mask=offs_m < C, other=-1)  # [BLOCK_M]
    q_valid = (q_idx >= 0) & (q_idx < S)
    q_rows = tl.where(q_valid, q_idx, 0).to(tl.int64)
    q = tl.load(q_base + q_rows[:, None] * stride_qs + offs_d[None, :] * stride_qd, mask=q_valid[:, None], other=0.0)
    # LSE in base 2; padded slots +inf so exp2(s - inf) = 0
    lse2 = tl.load(l_base + q_rows * stride_ls, mask=q_valid, other=float("inf")) * 1.4426950408889634

    for n0 in range(0, SK, BLOCK_N):
        keys = n0 + offs_n
        use_poly = POLY and ((n0 // BLOCK_N) % 2 == 1)
        k_ok = keys < SK
        k = tl.load(k_base + keys.to(tl.int64)[:, None] * stride_ks + offs_d[None, :] * stride_kd,
                    mask=k_ok[:, None], other=0.0)  # [BLOCK_N, D]
        st = tl.dot(k, tl.trans(q))  # [BLOCK_N, BLOCK_M] fp32
        x = st * sm_scale_log2 - lse2[None, :]  # log2 of the exact probability, <= ~0
        if use_poly:
            col = tl.sum(_exp2_fma(x), 1)
        else:
            col = tl.sum(fastexp.exp2(x, EXP_MODE).to(tl.float32), 1)  # [BLOCK_N]
        for mc in tl.static_range(1, M_CHUNKS):  # groups wider than 128 queries: further chunks, gathered again
            offs_c = mc * BLOCK_M + offs_m
            c_idx = tl.load(perm_base + offs_c, mask=offs_c < C, other=-1)
            c_valid = (c_idx >= 0) & (c_idx < S)
            c_rows = tl.where(c_valid, c_idx, 0).to(tl.int64)
            qc = tl.load(q_base + c_rows[:, None] * stride_qs + offs_d[None, :] * stride_qd,
                         mask=c_valid[:, None], other=0.0)
            lc = tl.load(l_base + c_rows * stride_ls, mask=c_valid, other=float("inf")) * 1.4426950408889634
            pc = tl.math.exp2(tl.dot(k, tl.trans(qc)) * sm_scale_log2 - lc[None, :])
            col += tl.sum(pc, 1)
        tl.store(s_base + keys.to(tl.int64) * stride_sn, col.to(SUMS.dtype.element_ty), mask=k_ok)


# Degree-3 minimax polynomial of 2^f on [-0.5, 0.5] (relative error 7.5e-5, fp32 Horner evaluation included;
# fitted by iteratively reweighted least squares on 4001 Chebyshev nodes: tests/test_pass2_poly3.py checks the bound)
_P3_C0 = tl.constexpr(0.9999280571937561)
_P3_C1 = tl.constexpr(0.6932609677314758)
_P3_C2 = tl.constexpr(0.2426111400127411)
_P3_C3 = tl.constexpr(0.0551716685295105)


@triton.jit
def _exp2_poly3(x):
    """2^x on the FMA/ALU pipes (no MUFU): 8 instructions (FMNMX, 3 FADD, 3 FFMA, LEA; offline SASS), relative error
    < 7.6e-5 for x in [-125, 127]; x < -125 gives 2^-125 (absolute error < 2^-125 where ``ex2.approx.ftz`` gives
    0 or a value below 2^-125). The clamp keeps 2^n a normal number: n = round(x) >= -125."""
    x = tl.maximum(x, -125.0)
    t = x + 12582912.0  # 1.5 * 2^23: the add rounds x to the integer n held in t's low mantissa bits
    f = x - (t - 12582912.0)  # [-0.5, 0.5]
    p = _P3_C3 * f + _P3_C2
    p = p * f + _P3_C1
    p = p * f + _P3_C0
    # 2^n * p: n added to p's exponent field; t's bits are 0x4B400000 + n and 0x4B400000 << 23 wraps to 0
    return (p.to(tl.int32, bitcast=True) + (t.to(tl.int32, bitcast=True) << 23)).to(tl.float32, bitcast=True)


@triton.jit
def _mufu_exp2(x, EXP_MODE: tl.constexpr):
    """2^x on MUFU (``fastexp`` mode EXP_MODE) as fp32; EXP_MODE 3: x itself (no exponential: a timing floor for
    the benchmark, not a probability)."""
    if EXP_MODE == 3:
        return x
    else:
        return fastexp.exp2(x, EXP_MODE).to(tl.float32)


@triton.jit
def _mixed_sums(x, EXP_MODE: tl.constexpr, EIGHTHS: tl.constexpr, tile, PARITY: tl.constexpr):
    """Row sums of 2^x ([BLOCK_N, BLOCK_M] -> fp32 [BLOCK_N]) with EIGHTHS / 8 of the exponentials on the FMA pipe
    (``_exp2_poly3``), the rest on MUFU (``_mufu_exp2``): EIGHTHS 4 the odd columns of every key tile, 2 the odd
    columns of the key tiles whose index ``tile`` has parity PARITY, 0 none. The odd columns are the second of each
    column pair a thread holds in the wgmma accumulator, so the split moves no data (offline SASS); the two parts
    are added elementwise before the one row reduction."""
    if EIGHTHS == 4:
        even, odd = tl.split(tl.reshape(x, [x.shape[0], x.shape[1] // 2, 2]))
        col = tl.sum(_mufu_exp2(even, EXP_MODE) + _exp2_poly3(odd), 1)
    elif EIGHTHS == 2:
        if tile % 2 == PARITY:
            even, odd = tl.split(tl.reshape(x, [x.shape[0], x.shape[1] // 2, 2]))
            col = tl.sum(_mufu_exp2(even, EXP_MODE) + _exp2_poly3(odd), 1)
        else:
            col = tl.sum(_mufu_exp2(x, EXP_MODE), 1)
    else:
        tl.static_assert(EIGHTHS == 0, "EIGHTHS must be 0, 2 or 4")
        col = tl.sum(_mufu_exp2(x, EXP_MODE), 1)
    return col


@triton.jit
def _row_sums(x, EXP_MODE: tl.constexpr, POLY: tl.constexpr, EIGHTHS: tl.constexpr = 0, tile=0):
    """Row sums of 2^x for a [BLOCK_N, BLOCK_M] tile (fp32 [BLOCK_N]): POLY 0 all exponentials on MUFU (``fastexp``
    mode EXP_MODE) except EIGHTHS / 8 of them on the degree-3 polynomial (``_mixed_sums``, group 1's parity: odd
    key tiles ``tile``), 1 the odd columns on
    the FMA pipe (``_exp2_fma``; the accumulator holds column pairs in one thread, so the split moves no data), 2
    all on the FMA pipe."""
    if POLY == 2:
        col = tl.sum(_exp2_fma(x), 1)
    elif POLY == 1:
        even, odd = tl.split(tl.reshape(x, [x.shape[0], x.shape[1] // 2, 2]))
        col = tl.sum(_mufu_exp2(even, EXP_MODE), 1) + tl.sum(_exp2_fma(odd), 1)
    else:
        col = _mixed_sums(x, EXP_MODE, EIGHTHS, tile, 1)
    return col


@triton.jit
def _digit_hist(col, mask, KEY_BITS: tl.constexpr):
    """int32 [HIST_BINS] histogram of the top 8 bits of the order keys of ``col`` (stored sums, fp16 or fp32 by
    KEY_BITS; negative values count as key 0, as ``topk._keys``) where ``mask``: the top-K's first radix digit."""
    if KEY_BITS == 16:
        key = col.to(tl.int16, bitcast=True).to(tl.int32)
    else:
        key = col.to(tl.int32, bitcast=True)
    key = tl.where(key < 0, 0, key)
    return tl.histogram(key >> (KEY_BITS - 8), HIST_BINS, mask=mask)


@triton.jit
def _key_scaled(col, kb_base, keys, SK, FP8: tl.constexpr, KB_POW2: tl.constexpr = False):
    """``col`` ([BLOCK_N] group sums of the keys ``keys``) times 2^KB[key] (FP8's per-key smoothing term; keys
    outside [0, Sk) x 1), or ``col`` itself without FP8. KB_POW2: the KB buffer holds 2^KB (no exponential here)."""
    if FP8:
        if KB_POW2:
            col = col * tl.load(kb_base + keys, mask=(keys >= 0) & (keys < SK), other=1.0)
        else:
            col = col * tl.math.exp2(tl.load(kb_base + keys, mask=(keys >= 0) & (keys < SK), other=0.0))
    return col


# (the fused top-K's per-density integers are not specialised: one compile serves every density)
@triton.jit(do_not_specialize=["num_keys", "stride_samp", "n_samp", "hi_rank", "lo_rank"])
def _group_prob_sums_pair(
    Q, K, LSE, PERM, SUMS, QF, KB, HIST,
    sm_scale_log2,
    H, S, SK, n_slots, C, G,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_lb, stride_lh, stride_ls,
    stride_sb, stride_sh, stride_sg, stride_sn,
    SEL, CAND, FLAGS,  # TOPK: the selection [B, H, G, width] (int32), candidate scratch, fallback flags (topk.FusedRows)
    num_keys, width, t_sb, t_sh, t_sg, stride_ob, stride_oh, stride_og, stride_samp, n_samp, hi_rank, lo_rank, t_cap,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EXP_MODE: tl.constexpr,
    STAGGER: tl.constexpr,  # group 1 runs half a step behind group 0 (see below)
    FP8: tl.constexpr,  # Q, K are float8_e4m3 copies; QF holds each head's factor (see below)
    POLY: tl.constexpr,  # group 1's exponentials on the FMA pipe: 0 none, 1 its odd columns, 2 all (``_row_sums``)
    P3_G0: tl.constexpr,  # eighths (0, 2, 4) of group 0's / 1's exponentials on the degree-3 polynomial (``_mixed_sums``)
    P3_G1: tl.constexpr,
    KEY_BITS: tl.constexpr,  # 16 for float16 SUMS, 32 for float32
    WITH_HIST: tl.constexpr,  # count each group's first-digit histogram into HIST (int32 [B, H, G, HIST_BINS])
    KB_POW2: tl.constexpr = False,  # FP8: KB holds 2^KB (precomputed; no MUFU per key here)
    ONE_GROUP: tl.constexpr = False,  # one query group per program (unstaggered, no histogram): fewer registers
    TOPK: tl.constexpr = False,  # then each group's top-K (``topk._bracket_row``) from the sums just stored
    T_ALIGN: tl.constexpr = 1,  # the sums' b / h / g strides are t_sb / t_sh / t_sg times T_ALIGN (16-byte rows)
    T_ROWS: tl.constexpr = 128,  # top-K tile rows (16-byte vectors) per sweep step
    T_NS: tl.constexpr = 1024,  # top-K sample slots (a power of two >= n_samp)
    T_TWO_BITS: tl.constexpr = False,  # its sample order statistics two bits per reduction (T_NS <= 8 per thread)
    T_CAND_COUNT: tl.constexpr = 0,  # the top-K's threshold among its candidates by counting (FusedRows.cand_count)
):
    """``_group_prob_sums_fwd`` for C <= BLOCK_M with two query groups per program (groups 2i and 2i+1 of one
    head): each K tile is loaded once for both groups' QK^T products (half the K traffic from L2), and the two
    products are independent, so one group's exponentials can overlap the other's MMA. A missing second group
    (odd G) has no valid query: its products are computed on zeros and never stored.

    FP8: Q / K are the smoothed float8_e4m3 copies of ``fp8_operands``, LSE its shifted LSE, and the log2 probability
    is ``(q8 . k8) * QF[b * H + h] - LSE[q] * log2(e) + KB[b, h, key]``, QF (fp32, [B * H]) = the head's q scale x
    k scale x softmax scale x log2(e): one FMA per score with a scalar factor, as in bf16 (where the factor is
    ``sm_scale_log2``); the per-key term KB (fp32, [B, H, Sk] contiguous) multiplies each key's sum (2^KB, one
    exponential per key and group). A per-query factor would hold 64 more registers per thread (ptxas: 255 and
    spills; tests/ptxas_select.py).
    POLY > 0: POLY / 4 of the exponentials (group 1's odd query columns, or all of group 1's) on the FMA pipe.
    WITH_HIST: each group's histogram of the top 8 bits of its stored sums (``_digit_hist``), so the radix top-K
    skips its first pass over the row (one histogram of BLOCK_N entries per tile, against BLOCK_N x BLOCK_M
    exponentials).
    TOPK: after its key sweep the program selects each of its groups' K keys from the float16 sums it stored (still
    in L2; ``topk._bracket_row``: sample bracket, candidate radix select, compaction into SEL, FLAGS[row] = 1 where the
    bracket missed and ``topk.FusedRows.finish`` must write the row), so the selection needs no launch and no sweep of
    the sums from DRAM of its own, and its integer work runs beside other programs' exponentials."""
    pair = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    if ONE_GROUP:
        tl.static_assert(not (STAGGER or WITH_HIST), "ONE_GROUP: unstaggered, no histogram")
        g0 = pair
        has_g1 = False
    else:
        g0 = pair * 2
        has_g1 = g0 + 1 < G
    perm_base = PERM + bh.to(tl.int64) * n_slots + g0.to(tl.int64) * C
    q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    l_base = LSE + b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh
    k_base = K + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh
    s_base = SUMS + b.to(tl.int64) * stride_sb + h.to(tl.int64) * stride_sh + g0.to(tl.int64) * stride_sg

    i0 = tl.load(perm_base + offs_m, mask=offs_m < C, other=-1)
    v0 = (i0 >= 0) & (i0 < S)
    r0 = tl.where(v0, i0, 0).to(tl.int64)
    q0 = tl.load(q_base + r0[:, None] * stride_qs + offs_d[None, :] * stride_qd, mask=v0[:, None], other=0.0)
    l0 = tl.load(l_base + r0 * stride_ls, mask=v0, other=float("inf")) * 1.4426950408889634
    if not ONE_GROUP:
        i1 = tl.load(perm_base + C + offs_m, mask=(offs_m < C) & has_g1, other=-1)
        v1 = (i1 >= 0) & (i1 < S)
        r1 = tl.where(v1, i1, 0).to(tl.int64)
        q1 = tl.load(q_base + r1[:, None] * stride_qs + offs_d[None, :] * stride_qd, mask=v1[:, None], other=0.0)
        l1 = tl.load(l_base + r1 * stride_ls, mask=v1, other=float("inf")) * 1.4426950408889634
    if FP8:
        f = tl.load(QF + bh)  # the head's q scale x k scale x softmax scale x log2(e)
    else:
        f = sm_scale_log2
    kb_base = KB + bh.to(tl.int64) * SK

    if STAGGER:
        # software pipeline across the two groups: per key tile, group 0's QK^T is issued before group 1's
        # exponentials of the previous tile, and group 1's QK^T before group 0's exponentials of this tile, so the
        # MUFU work can overlap an MMA in flight; group 1 lags half a step (its last tile is finished after the loop)
        s1 = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # "tile -1": computed on, never stored
        h0 = tl.zeros([HIST_BINS], dtype=tl.int32)
        h1 = tl.zeros([HIST_BINS], dtype=tl.int32)
        for n0 in range(0, SK, BLOCK_N):
            keys = n0 + offs_n
            k_ok = keys < SK
            k = tl.load(k_base + keys.to(tl.int64)[:, None] * stride_ks + offs_d[None, :] * stride_kd,
                        mask=k_ok[:, None], other=0.0)
            s0 = tl.dot(k, tl.trans(q0))
            prev = keys - BLOCK_N
            col1 = _key_scaled(_row_sums(s1 * f - l1[None, :], EXP_MODE, POLY, P3_G1, n0 // BLOCK_N - 1), kb_base, prev,
                               SK, FP8, KB_POW2)
            c1 = col1.to(SUMS.dtype.element_ty)
            tl.store(s_base + stride_sg + prev.to(tl.int64) * stride_sn, c1, mask=(prev >= 0) & has_g1)
            if WITH_HIST:
                h1 += _digit_hist(c1, prev >= 0, KEY_BITS)
            s1 = tl.dot(k, tl.trans(q1))
            col0 = _key_scaled(_mixed_sums(s0 * f - l0[None, :], EXP_MODE, P3_G0, n0 // BLOCK_N, 0), kb_base, keys,
                               SK, FP8, KB_POW2)
            c0 = col0.to(SUMS.dtype.element_ty)
            tl.store(s_base + keys.to(tl.int64) * stride_sn, c0, mask=k_ok)
            if WITH_HIST:
                h0 += _digit_hist(c0, k_ok, KEY_BITS)
        last_tile = (SK - 1) // BLOCK_N
        last = last_tile * BLOCK_N + offs_n
        col1 = _key_scaled(_row_sums(s1 * f - l1[None, :], EXP_MODE, POLY, P3_G1, last_tile), kb_base, last, SK, FP8,
                           KB_POW2)
        c1 = col1.to(SUMS.dtype.element_ty)
        tl.store(s_base + stride_sg + last.to(tl.int64) * stride_sn, c1, mask=(last < SK) & has_g1)
        if WITH_HIST:
            h1 += _digit_hist(c1, last < SK, KEY_BITS)
    else:
        h0 = tl.zeros([HIST_BINS], dtype=tl.int32)
        h1 = tl.zeros([HIST_BINS], dtype=tl.int32)
        for n0 in range(0, SK, BLOCK_N):
            keys = n0 + offs_n
            k_ok = keys < SK
            k = tl.load(k_base + keys.to(tl.int64)[:, None] * stride_ks + offs_d[None, :] * stride_kd,
                        mask=k_ok[:, None], other=0.0)
            x0 = tl.dot(k, tl.trans(q0)) * f - l0[None, :]
            col0 = _key_scaled(_mixed_sums(x0, EXP_MODE, P3_G0, n0 // BLOCK_N, 0), kb_base, keys, SK, FP8, KB_POW2)
            dst = s_base + keys.to(tl.int64) * stride_sn
            c0 = col0.to(SUMS.dtype.element_ty)
            tl.store(dst, c0, mask=k_ok)
            if not ONE_GROUP:
                x1 = tl.dot(k, tl.trans(q1)) * f - l1[None, :]
                col1 = _key_scaled(_row_sums(x1, EXP_MODE, POLY, P3_G1, n0 // BLOCK_N), kb_base, keys, SK, FP8, KB_POW2)
                c1 = col1.to(SUMS.dtype.element_ty)
                tl.store(dst + stride_sg, c1, mask=k_ok & has_g1)
            if WITH_HIST:
                h0 += _digit_hist(c0, k_ok, KEY_BITS)
                h1 += _digit_hist(c1, k_ok, KEY_BITS)
    if WITH_HIST:
        bins = tl.arange(0, HIST_BINS)
        h_base = HIST + (bh.to(tl.int64) * G + g0) * HIST_BINS
        tl.store(h_base + bins, h0)
        tl.store(h_base + HIST_BINS + bins, h1, mask=(bins >= 0) & has_g1)
    if TOPK:
        tl.debug_barrier()  # the sums stored above by every thread of the program are read back by others
        src = SUMS + (b.to(tl.int64) * t_sb + h.to(tl.int64) * t_sh + g0.to(tl.int64) * t_sg) * T_ALIGN
        dst = SEL + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh + g0.to(tl.int64) * stride_og
        row = bh.to(tl.int64) * G + g0
        _bracket_row(src, dst, CAND + row * t_cap, FLAGS + row, SK, num_keys, width, stride_samp, n_samp, hi_rank,
                     lo_rank, KEY_BITS, T_ROWS, 128 // KEY_BITS, T_NS, t_cap, True, T_TWO_BITS, T_CAND_COUNT)
        if has_g1:
            _bracket_row(src + t_sg * T_ALIGN, dst + stride_og, CAND + (row + 1) * t_cap, FLAGS + row + 1, SK,
                         num_keys, width, stride_samp, n_samp, hi_rank, lo_rank, KEY_BITS, T_ROWS, 128 // KEY_BITS,
                         T_NS, t_cap, True, T_TWO_BITS, T_CAND_COUNT)


@triton.jit
def _quantize_rows(X, OUT, MEAN, OTHER_MEAN, SCALE, IN_ROW, OUT_ROW, blk, b, h, bh, S,
                   stride_xb, stride_xh, stride_xs, stride_xd, stride_rb, stride_rh, stride_rs, row_mul,
                   HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, IS_Q: tl.constexpr, POW2: tl.constexpr = False):
    """Rows [blk * BLOCK_S, +BLOCK_S) of head (b, h) of q (IS_Q) or k ([B, H, S, D] by strides): OUT (float8_e4m3,
    contiguous [B, H, S, D]) = (x - MEAN[bh]) / SCALE[bh] rounded to nearest even (SCALE is a power of two: the
    quotient is exact, taken as a product by 1 / SCALE), and a per-row term t = x . OTHER_MEAN[bh] (q: x . mean(k))
    or (x - MEAN[bh]) . OTHER_MEAN[bh] (k: (k - mean(k)) . mean(q)) written as OUT_ROW[bh * S + row] = IN_ROW[row] +
    row_mul * t for q (IN_ROW: the LSE by its strides), and clamp(row_mul * t, -100, 100) for k (IN_ROW unused;
    POW2: 2 to that power). MEAN / OTHER_MEAN: fp32 [B * H, D]; SCALE: fp32 [B * H]. Returns the OUT_ROW values
    stored ([BLOCK_S] fp32) and which rows exist (rows < S)."""
    rows = blk * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = rows < S
    x = tl.load(X + b.to(tl.int64) * stride_xb + h.to(tl.int64) * stride_xh + rows.to(tl.int64)[:, None] * stride_xs
                + offs_d[None, :] * stride_xd, mask=ok[:, None], other=0.0).to(tl.float32)
    mean = tl.load(MEAN + bh * HEAD_DIM + offs_d)
    other = tl.load(OTHER_MEAN + bh * HEAD_DIM + offs_d)
    xc = x - mean[None, :]
    out_rows = bh.to(tl.int64) * S + rows
    if IS_Q:
        t = tl.sum(x * other[None, :], 1)
        lse = tl.load(IN_ROW + b.to(tl.int64) * stride_rb + h.to(tl.int64) * stride_rh + rows.to(tl.int64) * stride_rs,
                      mask=ok, other=0.0)
        row_val = lse + row_mul * t
    else:
        t = tl.sum(xc * other[None, :], 1)
        kb = tl.minimum(tl.maximum(row_mul * t, -100.0), 100.0)
        if POW2:
            kb = tl.math.exp2(kb)
        row_val = kb
    tl.store(OUT_ROW + out_rows, row_val, mask=ok)
    inv = tl.div_rn(1.0, tl.load(SCALE + bh))  # exact when SCALE is a power of two (not with unit_qf)
    y = xc * inv
    tl.store(OUT + out_rows[:, None] * HEAD_DIM + offs_d[None, :], y.to(tl.float8e4nv), mask=ok[:, None])
    return row_val, ok


@triton.jit
def _fp8_quantize(
    Q, K, Q8, K8, MQ, MK, QS, KS, LSE, LSE_S, KB,
    H, S, SK, nbq,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_lb, stride_lh, stride_ls,
    lse_mul, kb_mul,
    UPART,  # UNIT_CHECK: fp32 [B*H, programs of axis 0, 4]: each row block's min, max, NaN count of LSE_S / KB
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    KB_POW2: tl.constexpr = False,
    UNIT_CHECK: tl.constexpr = False,
):
    """q's and k's float8 copies in one launch: programs [0, nbq) of axis 0 take q's row blocks (``_quantize_rows``
    with IS_Q: Q8, LSE_S = LSE + lse_mul * q . mean_k), the rest k's (K8, KB = clamp(kb_mul * (k - mean_k) . mean_q),
    or 2^that with KB_POW2); axis 1 is b * H + h. UNIT_CHECK: also each row block's min /
    max / NaN count of the values it wrote to LSE_S or KB, at UPART[bh, pid] (``_unit_qf_final`` reduces them)."""
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    if pid < nbq:
        vals, ok = _quantize_rows(Q, Q8, MQ, MK, QS, LSE, LSE_S, pid, b, h, bh, S, stride_qb, stride_qh, stride_qs,
                                  stride_qd, stride_lb, stride_lh, stride_ls, lse_mul, HEAD_DIM, BLOCK_S, True)
    else:
        vals, ok = _quantize_rows(K, K8, MK, MQ, KS, LSE, KB, pid - nbq, b, h, bh, SK, stride_kb, stride_kh,
                                  stride_ks, stride_kd, stride_lb, stride_lh, stride_ls, kb_mul, HEAD_DIM, BLOCK_S,
                                  False, KB_POW2)
    if UNIT_CHECK:
        use = ok & (vals == vals)
        four = tl.arange(0, 4)
        part = tl.where(four == 0, tl.min(tl.where(use, vals, float("inf")), 0),
                        tl.where(four == 1, tl.max(tl.where(use, vals, float("-inf")), 0),
                                 tl.sum((ok & (vals != vals)).to(tl.float32), 0)))
        tl.store(UPART + (bh.to(tl.int64) * tl.num_programs(0) + pid) * 4 + four, part)


@triton.jit
def _unit_qf_final(UPART, QF, OUT, nbq, nblocks, BLOCK: tl.constexpr):
    """One program per head bh: ``_fp8_quantize``'s UNIT_CHECK partials of the head (UPART[bh, 0:nbq]: lse_s's row
    blocks, [nbq:nblocks]: 2^kb's; each min, max, NaN count) reduced (BLOCK blocks per step), OUT[bh] =
    ``_unit_sign`` of QF[bh] and those ranges: ``unit_qf_factors``' output without reading lse_s / 2^kb again."""
    bh = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    lmin = tl.full((BLOCK,), float("inf"), tl.float32)
    lmax = tl.full((BLOCK,), float("-inf"), tl.float32)
    kmin = lmin
    kmax = lmax
    bad = tl.zeros((BLOCK,), tl.float32)
    for b0 in range(0, nblocks, BLOCK):
        blk = b0 + offs
        ok = blk < nblocks
        row = UPART + (bh * nblocks + blk) * 4
        mn = tl.load(row, mask=ok, other=float("inf"))
        mx = tl.load(row + 1, mask=ok, other=float("-inf"))
        bad += tl.load(row + 2, mask=ok, other=0.0)
        is_q = blk < nbq
        lmin = tl.minimum(lmin, tl.where(is_q, mn, float("inf")))
        lmax = tl.maximum(lmax, tl.where(is_q, mx, float("-inf")))
        kmin = tl.minimum(kmin, tl.where(is_q, float("inf"), mn))
        kmax = tl.maximum(kmax, tl.where(is_q, float("-inf"), mx))
    tl.store(OUT + bh, _unit_sign(tl.load(QF + bh), tl.min(lmin, 0), tl.max(lmax, 0), tl.min(kmin, 0),
                                  tl.max(kmax, 0), tl.sum(bad, 0)))


@triton.jit
def _column_stats(base, stride_s, stride_d, r0, r1, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr):
    """(sum, max, min) per column (fp32 [HEAD_DIM] each) of rows [r0, r1) of one head (``base`` by strides; r1 > r0):
    accumulated elementwise in registers over BLOCK_S-row tiles and reduced across rows once."""
    offs_d = tl.arange(0, HEAD_DIM)
    offs_s = tl.arange(0, BLOCK_S)
    acc = tl.zeros([BLOCK_S, HEAD_DIM], dtype=tl.float32)
    hi = tl.full([BLOCK_S, HEAD_DIM], float("-inf"), tl.float32)
    lo = tl.full([BLOCK_S, HEAD_DIM], float("inf"), tl.float32)
    n_full = tl.maximum(r1 - r0, 0) // BLOCK_S
    for i in range(0, n_full):  # whole tiles: no masks
        rows = r0 + i * BLOCK_S + offs_s
        x = tl.load(base + rows.to(tl.int64)[:, None] * stride_s + offs_d[None, :] * stride_d).to(tl.float32)
        acc += x
        hi = tl.maximum(hi, x)
        lo = tl.minimum(lo, x)
    rows = r0 + n_full * BLOCK_S + offs_s  # the last partial tile (maybe empty): rows past r1 read row r1 - 1
    ok = rows < r1  # again (max / min unchanged) and add 0 (r1 > r0: every split has a row)
    rows = tl.minimum(rows, r1 - 1)
    x = tl.load(base + rows.to(tl.int64)[:, None] * stride_s + offs_d[None, :] * stride_d).to(tl.float32)
    acc += tl.where(ok[:, None], x, 0.0)
    hi = tl.maximum(hi, x)
    lo = tl.minimum(lo, x)
    return tl.sum(acc, 0), tl.max(hi, 0), tl.min(lo, 0)


@triton.jit
def _fp8_partial_stats(
    X0, X1, PART,
    H, S0, S1, rows0, rows1, n0, n1,
    stride_0b, stride_0h, stride_0s, stride_0d,
    stride_1b, stride_1h, stride_1s, stride_1d,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Column sums, maxima and minima of two tensors' heads in one launch: program (p, b * H + h) with p < n0 takes
    rows [p * rows0, (p + 1) * rows0) of X0's head (b, h), else rows [(p - n0) * rows1, ...) of X1's; writes fp32
    [3, HEAD_DIM] at PART[((b * H + h) * (n0 + n1) + p) * 3 * HEAD_DIM] (sum, max, min; no split is empty)."""
    p = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    if p < n0:
        r0 = p * rows0
        col_sum, col_max, col_min = _column_stats(
            X0 + b.to(tl.int64) * stride_0b + h.to(tl.int64) * stride_0h, stride_0s, stride_0d, r0,
            tl.minimum(r0 + rows0, S0), HEAD_DIM, BLOCK_S)
    else:
        r0 = (p - n0) * rows1
        col_sum, col_max, col_min = _column_stats(
            X1 + b.to(tl.int64) * stride_1b + h.to(tl.int64) * stride_1h, stride_1s, stride_1d, r0,
            tl.minimum(r0 + rows1, S1), HEAD_DIM, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    out = PART + (bh.to(tl.int64) * (n0 + n1) + p) * (3 * HEAD_DIM) + offs_d
    tl.store(out, col_sum)
    tl.store(out + HEAD_DIM, col_max)
    tl.store(out + 2 * HEAD_DIM, col_min)


@triton.jit
def _pow2_scale(amax):
    """The float8 scale of a head whose largest |x - mean| is ``amax`` (fp32 scalar >= 0): the power of two 2^e with
    amax / 2^e in (224, 448] (448: e4m3's largest finite value), so quantising is an exact product and nothing
    saturates; 1 when amax < 2^-111 (nothing to resolve; 0 included)."""
    bits = amax.to(tl.int32, bitcast=True)
    expo = (bits >> 23) & 255
    e = expo - tl.where((bits & 0x7FFFFF) <= 0x600000, 8, 7)  # mantissa 1.f <= 1.75: 1.f * 2^8 <= 448
    e = tl.where(expo >= 16, e, 127)
    return (e << 23).to(tl.float32, bitcast=True)


@triton.jit
def _head_stats(base, ok, S, MEAN_OUT, SCALE_OUT, HEAD_DIM: tl.constexpr):
    """One tensor's head statistics from its ``_fp8_partial_stats`` splits at ``base`` ([NP, HEAD_DIM] pointers to
    each split's column sums; maxima and minima HEAD_DIM and 2 * HEAD_DIM further; splits with ``ok`` false are
    ignored): stores the column means over the S rows (fp32 [HEAD_DIM]) at MEAN_OUT and the float8 scale
    (``_pow2_scale`` of the largest |x - mean|) at SCALE_OUT, and returns the scale."""
    ok = ok[:, None]
    mean = tl.div_rn(tl.sum(tl.load(base, mask=ok, other=0.0), 0), S.to(tl.float32))
    hi = tl.max(tl.load(base + HEAD_DIM, mask=ok, other=float("-inf")), 0)
    lo = tl.min(tl.load(base + 2 * HEAD_DIM, mask=ok, other=float("inf")), 0)
    scale = _pow2_scale(tl.max(tl.maximum(hi - mean, mean - lo), 0))
    tl.store(MEAN_OUT, mean)
    tl.store(SCALE_OUT, scale)
    return scale


@triton.jit
def _fp8_stats_final(
    PART, M0, M1, SC0, SC1, QF,
    S0, S1, n0, n1, qf_mul,
    HEAD_DIM: tl.constexpr,
    NP: tl.constexpr,  # power of two >= max(n0, n1)
    TWO: tl.constexpr,  # the second tensor's statistics too (and QF)
    UNIT: tl.constexpr = False,  # (with TWO) QF = 1 where the scales can take qf_mul (``fp8_operands(unit_qf=True)``)
):
    """One program per head b * H + h: reduces ``_fp8_partial_stats``' splits to each tensor's mean (M0 / M1, fp32
    [B * H, HEAD_DIM]) and float8 scale (SC0 / SC1, fp32 [B * H], ``_pow2_scale`` of max over columns of
    max(max - mean, mean - min)); with TWO also QF[bh] = SC0 * SC1 * qf_mul. UNIT: where that QF is <= 1 and
    t = sqrt(1 / QF) <= UNIT_MAX_T, both scales grow by t (SC1 exactly 1 / (SC0 qf_mul)) and QF = 1: the products of
    the float8 copies are the scores in qf_mul's units, each copy's amax at 224-448 / t."""
    bh = tl.program_id(0)
    sp = tl.arange(0, NP)
    offs_d = tl.arange(0, HEAD_DIM)
    base = PART + bh.to(tl.int64) * (n0 + n1) * (3 * HEAD_DIM) + sp[:, None] * (3 * HEAD_DIM) + offs_d[None, :]
    sc0 = _head_stats(base, sp < n0, S0, M0 + bh * HEAD_DIM + offs_d, SC0 + bh, HEAD_DIM)
    if TWO:
        sc1 = _head_stats(base + n0 * (3 * HEAD_DIM), sp < n1, S1, M1 + bh * HEAD_DIM + offs_d, SC1 + bh, HEAD_DIM)
        qf = sc0 * sc1 * qf_mul
        if UNIT:
            t = tl.sqrt_rn(tl.div_rn(1.0, qf))
            ok = (qf <= 1.0) & (t <= UNIT_MAX_T)
            sc0u = sc0 * t
            tl.store(SC0 + bh, tl.where(ok, sc0u, sc0))
            tl.store(SC1 + bh, tl.where(ok, tl.div_rn(1.0, sc0u * qf_mul), sc1))
            qf = tl.where(ok, 1.0, qf)
        tl.store(QF + bh, qf)


# fp8_operands(unit_qf=True): the largest factor t by which both float8 scales may grow to make qf 1 (the copies'
# amax then >= 224 / t: with 1024 at least ~0.2, far above e4m3's subnormals (2^-6) for the elements that carry the
# products; beyond it the head keeps its power-of-two scales and qf != 1)
UNIT_MAX_T = tl.constexpr(1024.0)
_STATS_BLOCK_S = 32  # rows per register tile of the statistics pass (4 warps: 32 fp32 accumulators x 3 per thread)
# statistics programs per tensor: 264 (q's and k's together 528 = one wave of 4 programs per H200 SM; 128 registers).
# H200 round s11r2 (main a2b0472, tests/bench_topk_race.py, 1.3B 480p, / flash-attn-4 dense): the operand pass 0.0179 /
# 0.0178 / 0.0191 of dense against 0.0204 / 0.0215 / 0.0249 for 528 (two waves; three races); 1056 0.0213-0.0245, 32-
# or 128-row quantising programs 0.0201-0.0221, 8 quantising warps 0.0216-0.0227 (4 kept)
_STATS_PROGRAMS = 264
_QUANT_BLOCK_S = 64  # rows per program of the quantising pass
_QUANT_WARPS = 4  # warps per program of the quantising pass
# its register cap on CUDA with UNIT_CHECK: 96 = 5 programs of 4 warps per SM, as the plain launch takes uncapped
# (offline sm_90, 1.3B 480p: 104 with UNIT_CHECK uncapped, 96 capped without spill; the plain launch capped at 96
# spills 16 bytes, so it runs uncapped)
_QUANT_MAXNREG = 96


def _stat_splits(heads: int, rows: int, programs: int = _STATS_PROGRAMS) -> tuple[int, int]:
    """(splits per head, rows per split) of the statistics pass for one tensor: a function of its own shape (and the
    ``programs`` tuning) only, so the same tensor always gets the same summation order (``fp8_stats`` alone ==
    inside ``fp8_operands``). At most ``programs`` programs (splits rounded down: Wan2.1-14B 720p's 40 heads take 6
    splits, 480 programs for q and k together, one wave at 4 per SM instead of a second wave of 32 with 7; 1.3B 480p's
    12 heads 22, as rounded up)."""
    n = max(1, min(programs // heads, -(-rows // _STATS_BLOCK_S)))
    per = -(-rows // n)
    return -(-rows // per), per


def fp8_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, scale) of ``x`` ``[B, H, S, D]`` (any strides) per head: mean fp32 ``[B, H, D]`` over the S rows, and the
    float8 scale fp32 ``[B, H]``: the power of two 2^e with amax|x - mean| / 2^e in (224, 448] (448: e4m3's largest
    finite value; a power of two makes quantising an exact product), 1 when amax < 2^-111. Two Triton launches
    (column sums / max / min per split of the rows, accumulated in registers, ~4 programs per SM; one program per
    head reduces the splits); ``fp8_operands`` runs the same passes for q and k together."""
    B, H, S, D = x.shape
    n, per = _stat_splits(B * H, S)
    part = torch.empty(B * H, n, 3, D, dtype=torch.float32, device=x.device)
    _fp8_partial_stats[(n, B * H)](x, x, part, H, S, S, per, per, n, 0, *x.stride(), *x.stride(), HEAD_DIM=D,
                                   BLOCK_S=_STATS_BLOCK_S, num_warps=4)
    mean = torch.empty(B, H, D, dtype=torch.float32, device=x.device)
    scale = torch.empty(B, H, dtype=torch.float32, device=x.device)
    _fp8_stats_final[(B * H,)](part, mean, mean, scale, scale, scale, S, S, n, 0, 1.0, HEAD_DIM=D,
                               NP=triton.next_power_of_2(n), TWO=False, num_warps=4)
    return mean, scale


# unit_qf's range condition per head (log2 units; b = -lse_s log2(e) the queries' biases, kb the keys' factors'
# exponents): the CuTeDSL pass 2's fast form's 2^score stays finite when min b + min kb > UNIT_LO (a score is at most
# -b - kb plus the float8 error), and the terms it flushes (score < -126) weigh at most 2^(-126 + max b + max kb) <
# 2^-46 in a sum when max b + max kb < UNIT_HI (the default form flushes below 2^-126 of its own)
UNIT_LO = tl.constexpr(-112.0)
UNIT_HI = tl.constexpr(80.0)
_UNIT_BLOCK = 1024
_UNIT_FINAL_BLOCK = 1024  # row blocks' partials per step of ``_unit_qf_final`` (1.3B 480p: 1024 blocks, one step)


@triton.jit
def _row_min_max_nan(PTR, N, BLOCK: tl.constexpr):
    """Per-lane running min / max of the float32 row PTR[0:N] and a per-lane count of its NaNs (BLOCK lanes)."""
    offs = tl.arange(0, BLOCK)
    vmin = tl.full((BLOCK,), float("inf"), tl.float32)
    vmax = tl.full((BLOCK,), float("-inf"), tl.float32)
    bad = tl.zeros((BLOCK,), tl.int32)
    for s0 in range(0, N, BLOCK):
        ok = s0 + offs < N
        x = tl.load(PTR + s0 + offs, mask=ok, other=1.0)
        vmin = tl.where(ok, tl.minimum(vmin, x), vmin)
        vmax = tl.where(ok, tl.maximum(vmax, x), vmax)
        bad += (ok & (x != x)).to(tl.int32)
    return vmin, vmax, bad


@triton.jit
def _unit_qf_factors(QF, LSE_S, KB2, OUT, S, SK, BLOCK: tl.constexpr):
    """One program per head: OUT[bh] = 1 if QF[bh] == 1 and min b + min kb > UNIT_LO and max b + max kb < UNIT_HI
    (b = -LSE_S log2(e) over the S rows, kb = log2 KB2 over the SK keys; a NaN anywhere fails), else -QF[bh]."""
    bh = tl.program_id(0).to(tl.int64)
    lmin, lmax, lbad = _row_min_max_nan(LSE_S + bh * S, S, BLOCK)
    kmin, kmax, kbad = _row_min_max_nan(KB2 + bh * SK, SK, BLOCK)
    tl.store(OUT + bh, _unit_sign(tl.load(QF + bh), tl.min(lmin, 0), tl.max(lmax, 0), tl.min(kmin, 0),
                                  tl.max(kmax, 0), tl.sum(lbad + kbad, 0)))


@triton.jit
def _unit_sign(qf, lmin, lmax, kmin, kmax, bad):
    """A head's factor for the CuTeDSL pass 2's unit_qf form: qf if qf == 1 and min b + min kb > UNIT_LO and max b +
    max kb < UNIT_HI (b = -lse_s log2(e), its min / max from lse_s's ``lmax`` / ``lmin``; kb = log2 of the keys'
    factors 2^kb, min / max ``kmin`` / ``kmax``) and no NaN (``bad`` = their count), else -qf."""
    lo = tl.log2(kmin) - lmax * 1.4426950408889634
    hi = tl.log2(kmax) - lmin * 1.4426950408889634
    fast = (qf == 1.0) & (lo > UNIT_LO) & (hi < UNIT_HI) & (bad == 0)
    return tl.where(fast, qf, -qf)


def unit_qf_factors(qf: torch.Tensor, lse_s: torch.Tensor, kb2: torch.Tensor) -> torch.Tensor:
    """``qf`` as the CuTeDSL pass 2's ``unit_qf`` form reads it: fp32 ``[B*H]``, 1 where the head's qf is exactly 1
    (``fp8_operands(unit_qf=True)``) and its ranges pass (``UNIT_LO`` / ``UNIT_HI`` from the min / max of its lse_s
    and 2^kb; a NaN fails), else -qf (that head takes the default form). qf fp32 ``[B, H]``, lse_s fp32 ``[B, H, S]``,
    kb2 fp32 ``[B, H, Sk]`` (2^kb, ``kb_pow2=True``). One launch, one program per head; no sync."""
    bh = qf.numel()
    lse_s = lse_s.reshape(bh, -1).contiguous()
    kb2 = kb2.reshape(bh, -1).contiguous()
    out = torch.empty(bh, dtype=torch.float32, device=qf.device)
    _unit_qf_factors[(bh,)](qf.reshape(bh).float().contiguous(), lse_s, kb2, out, lse_s.shape[1], kb2.shape[1],
                            BLOCK=_UNIT_BLOCK, num_warps=4)
    return out


def fp8_operands(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, scale: float, *, stats_programs: int | None = None,
                 quant_block: int | None = None, quant_warps: int | None = None, kb_pow2: bool = False,
                 unit_qf: bool = False, unit_signs: bool = False):
    """The float8 operands of pass 2's FP8 mode, smoothed: (q8, k8, qf, lse_s, kb).

    The products are taken on mean-free rows (q' = q - mean_q, k' = k - mean_k per head, SageAttention's smoothing of
    K, extended to Q): ``q . k = q' . k' + q . mean_k + mean_q . k'``; the per-query term moves into the LSE, the
    per-key term into a factor on each key's group sum, so float8's relative error applies only to q' . k'. On the
    synthetic workload (tests/measure_fp8_selection.py) this cut the mass lost to the selection at s = 0.1 from
    ~1e-3 (plain float8) to ~1e-4 of the exact top-K's.

    Args:
        q: ``[B, H, S, D]``, k: ``[B, H, Sk, D]``, fp16 / bf16 / fp32, any strides; lse: fp32 ``[B, H, S]`` (natural
        log, any strides); scale: the softmax scale. stats_programs, quant_block, quant_warps: launch tuning (the
        statistics programs per tensor, default ``_STATS_PROGRAMS``; rows per program and warps of the quantising
        pass, default ``_QUANT_BLOCK_S``, ``_QUANT_WARPS``); the results do not depend on the quantising pass's tuning.
        kb_pow2: return 2^kb in place of kb (what the Triton pair kernel reads with KB_POW2: no exponential per key
        and group there; H200: pass-2 kernel 0.445 against 0.455 of dense at 1.3B 480p, tests/bench_pass2_exp.py
        round s5r1). unit_qf: the scales of each head chosen so that qf is exactly 1 where that keeps both copies'
        amax >= 224 / ``UNIT_MAX_T`` (both scales grow by the same factor; no longer powers of two: the quotient is
        taken as a product by the float32 reciprocal before the rounding); other heads as without it. What the CuTeDSL
        pass 2's ``unit_qf`` form reads (its scores come out of the wgmma in log2 units). unit_signs (with kb_pow2):
        also return ``unit_qf_factors(qf, lse_s, kb)`` as a sixth tensor, from the min / max / NaN count of each row
        block the quantising launch writes (``_fp8_quantize``'s UNIT_CHECK) reduced per head by one more small
        launch (``_unit_qf_final``): unit_qf_factors reads lse_s and 2^kb again in 64 dependent 4 KiB steps per head
        (H200 s12r1 timeline, 1.3B 480p: 53 us, as long as the quantising pass).
    Returns:
        q8, k8: float8_e4m3fn ``[B, H, S, D]`` / ``[B, H, Sk, D]``, contiguous: (x - mean) / head scale (``fp8_stats``:
        a power of two, so the quotient is exact) rounded to nearest even (e4m3 is a float format: one scale per head
        keeps each element's 3-bit relative precision down to amax * 2^-14);
        qf: fp32 ``[B, H]``: q's scale x k's scale x ``scale`` x log2(e): ``(q8 . k8) * qf`` = ``q' . k' * scale *
        log2(e)`` up to the float8 roundings;
        lse_s: fp32 ``[B, H, S]``: ``lse - scale * q . mean_k`` (natural log);
        kb: fp32 ``[B, H, Sk]``: ``scale * log2(e) * mean_q . k'``, clamped to [-100, 100] (a mean query alone giving a
        key a logit beyond +-69 is outside what this is built for): the group sum of key j is 2^kb[j] x the sum over
        the group of 2^(q8 . k8 * qf - lse_s * log2(e));
        with unit_signs, qf_unit: fp32 ``[B * H]``, ``unit_qf_factors``' output (equal to it).
    Raises: ValueError for unit_signs without kb_pow2.
    Cost: three Triton launches (four with unit_signs) for q and k together: the statistics (one read of each,
    ``fp8_stats``' passes), the
    per-head reduction, the quantising pass (a second read; 1 byte written per element and 4 per row): about 2.5x
    the bytes of q and k. Source: docs/kernels.md ("select_kv"); e4m3: torch.float8_e4m3fn (OCP FP8, max 448).
    """
    B, H, S, D = q.shape
    SK = k.shape[2]
    dev = q.device
    if unit_signs and not kb_pow2:
        raise ValueError("unit_signs needs kb_pow2=True (the check reads 2^kb, as unit_qf_factors)")
    programs = stats_programs or _STATS_PROGRAMS
    nq, per_q = _stat_splits(B * H, S, programs)
    nk, per_k = _stat_splits(B * H, SK, programs)
    part = torch.empty(B * H, nq + nk, 3, D, dtype=torch.float32, device=dev)
    _fp8_partial_stats[(nq + nk, B * H)](q, k, part, H, S, SK, per_q, per_k, nq, nk, *q.stride(), *k.stride(),
                                         HEAD_DIM=D, BLOCK_S=_STATS_BLOCK_S, num_warps=4)
    mq = torch.empty(B * H, D, dtype=torch.float32, device=dev)
    mk = torch.empty(B * H, D, dtype=torch.float32, device=dev)
    stats = torch.empty(4, B, H, dtype=torch.float32, device=dev)  # q scale, k scale, qf, qf_unit (unit_signs)
    _fp8_stats_final[(B * H,)](part, mq, mk, stats[0], stats[1], stats[2], S, SK, nq, nk, scale * _LOG2E,
                               HEAD_DIM=D, NP=triton.next_power_of_2(max(nq, nk)), TWO=True, UNIT=bool(unit_qf),
                               num_warps=4)
    q8 = torch.empty(B, H, S, D, dtype=torch.float8_e4m3fn, device=dev)
    k8 = torch.empty(B, H, SK, D, dtype=torch.float8_e4m3fn, device=dev)
    lse_s = torch.empty(B, H, S, dtype=torch.float32, device=dev)
    kb = torch.empty(B, H, SK, dtype=torch.float32, device=dev)
    bs = quant_block or _QUANT_BLOCK_S
    nbq = triton.cdiv(S, bs)
    nblocks = nbq + triton.cdiv(SK, bs)
    upart = torch.empty(B * H, nblocks, 4, dtype=torch.float32, device=dev) if unit_signs else stats
    _fp8_quantize[(nblocks, B * H)](
        q, k, q8, k8, mq, mk, stats[0], stats[1], lse, lse_s, kb, H, S, SK, nbq, *q.stride(), *k.stride(),
        *lse.stride(), -scale, scale * _LOG2E, upart, HEAD_DIM=D, BLOCK_S=bs,
        KB_POW2=bool(kb_pow2), UNIT_CHECK=bool(unit_signs),
        num_warps=quant_warps or _QUANT_WARPS,
        **({"maxnreg": _QUANT_MAXNREG} if unit_signs and dev.type == "cuda" else {}))
    if unit_signs:
        _unit_qf_final[(B * H,)](upart, stats[2], stats[3], nbq, nblocks, BLOCK=_UNIT_FINAL_BLOCK, num_warps=4)
        return q8, k8, stats[2], lse_s, kb, stats[3].reshape(B * H)
    return q8, k8, stats[2], lse_s, kb


def _fused_topk_args(select, out, num_warps, placeholder):
    """The pair kernel's TOPK arguments (runtime args, constexprs) for ``select`` (a ``topk.FusedRows`` or None)."""
    if select is None:
        return (placeholder,) * 3 + (0,) * 13, {}
    if out.dtype != torch.float16 or out.stride(-1) != 1:
        raise ValueError("the fused top-K needs float16 sums with a contiguous last dim")
    stride, n_samp, hi_rank, lo_rank, cap = select.plan
    sel = select.out
    B, H, G, _ = out.shape
    if tuple(sel.shape) != (B, H, G, select.width) or sel.dtype != torch.int32 or sel.stride(-1) != 1:
        raise ValueError(f"select.out must be int32 {(B, H, G, select.width)} with a contiguous last dim")
    if select.cand.shape[0] < B * H * G or select.flags.shape[0] < B * H * G:
        raise ValueError("select's scratch holds fewer rows than the chunk")
    sb, sh, sg = out.stride(0), out.stride(1), out.stride(2)
    align = 8 if sb % 8 == 0 and sh % 8 == 0 and sg % 8 == 0 else 1
    args = (sel, select.cand, select.flags, select.num_keys, select.width, sb // align, sh // align, sg // align,
            sel.stride(0), sel.stride(1), sel.stride(2), stride, n_samp, hi_rank, lo_rank, cap)
    meta = dict(TOPK=True, T_ALIGN=align, T_ROWS=32 * num_warps * select.rows_per_thread,
                T_NS=triton.next_power_of_2(n_samp),
                T_TWO_BITS=triton.next_power_of_2(n_samp) <= 8 * 32 * num_warps,
                T_CAND_COUNT=int(select.cand_count) if cap % (32 * num_warps * select.rows_per_thread * 8) == 0 else 0)
    return args, meta


def _capability(device: torch.device) -> tuple[int, int] | None:
    """The CUDA compute capability the kernels compile for; None on the Triton interpreter (no inline PTX)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return torch.cuda.get_device_capability(device)


def _config(head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages), tuned on an H200 at D = 128, C = 128 (docs/kernels.md)."""
    return (64, 4, 3)


# The default pass-2 kernel for C <= 128 on sm_90+ (and the interpreter): two query groups per program, staggered by
# half a step. H200, D = C = 128, bf16, bench_anchor --only select at ff921ff: pass 2 alone 0.522 / 0.497 of cuDNN
# dense (1.3B 480p / 14B 720p) against 0.538 / 0.533 for one group per program (plain pair 0.546 / 0.532, f16x2
# exponentials 0.610 / 0.571). Below sm_90 (not measured; 97 KiB of shared memory at D = 128, near sm_86/89's 99 KiB)
# one group per program stays the default, and for C <= 64 too (measured at C = 128 only).
_PAIR_MIN_CAPABILITY = (9, 0)
# float8 QK^T (wgmma / mma e4m3): sm_89+; the default on sm_90+ (measured there only). H200, bench_anchor --only select
# at 82bf982, vs flash-attn-4 dense: pass 2 alone 0.487 / 0.603 (14B 720p / 1.3B 480p, unstaggered, operand pass
# included) against 0.608 / 0.625 for bf16; pass 2 + top-K 0.565 / 0.627-0.635 against 0.712-0.725; kept mass of its
# selection on the synthetic DiT workload >= 0.99974 of the exact one's (s = 0.1-0.5, docs/kernels.md).
_FP8_MIN_CAPABILITY = (8, 9)
_FP8_DEFAULT_MIN_CAPABILITY = (9, 0)
_FP8_DEFAULT = True
# select_kv: pass 2 counts the radix top-K's first-digit histogram (topk_hist). Off: H200 final round, the top-K alone
# 17.6 -> 11.7 ms at 14B but pass 2 0.494 -> 0.601 of dense (shared-memory atomics + barriers in the loop).
_TOPK_HIST_DEFAULT = False
# select_kv: the top-K run by the pair pass-2 kernel after its key sweep (topk_fused), the default on sm_90+ (the
# measured GPU; the interpreter and older GPUs run the separate top-K). H200 round 2 of 2026-12-01 (fd5c72f,
# tests/bench_select_race.py, tests/_timing.race vs flash-attn-4 dense, s = 0.1 / 0.15 / 0.25 / 0.5): fused 0.600 /
# 0.594 / 0.588 / 0.591 against 0.605 / 0.610 / 0.604 / 0.612 separate at 1.3B 480p, 0.509 / 0.504 / 0.506 / 0.508
# against 0.571 / 0.512 / 0.515 / 0.520 at 14B 720p: better at every point; selection identical (GPU-checked)
_TOPK_FUSED_DEFAULT = True
# select_kv's fused top-K: the threshold among the bracket's candidates by counting (topk_count, FusedRows.cand_count)
# instead of two radix histogram passes. H200 round s7r1 (main 8dd7ca2, tests/bench_select_race.py, 1.3B 480p,
# flash-attn-4 dense 8.83 ms): race 2 at s = 0.25, the one-group pass-2 kernel alone 0.5116 of dense, + fused top-K
# 0.5637, + fused top-K counting 0.5393 (the top-K's share 0.052 -> 0.028); race 1 (select_kv) 0.580 / 0.570 / 0.564
# / 0.569 against 0.574 / 0.574 / 0.576 / 0.582 (s = 0.1 / 0.15 / 0.25 / 0.5); selection identical (GPU-checked). The
# bracket at 3 sigma instead of 5 was slower (0.2 % of rows fell back: 0.5549 with counting, 0.5656 without)
_TOPK_COUNT_DEFAULT = True
_TOPK_FUSED_MIN_CAPABILITY = (9, 0)
# select_kv's separate top-K (after a pass-2 kernel without the fused epilogue: the CuTeDSL or Gluon kernel, GPUs below
# sm_90, the interpreter): the bracket's threshold among its candidates by counting (``topk.top_k_rows(cand_count=)``).
# On: H200 round s9r2 (tests/bench_select_race.py, 1.3B 480p, / flash-attn-4 dense): the separate top-K alone 0.0445
# counting one bit per pass, 0.0453 two bits; select_kv with the CuTeDSL pass 2 + counting 0.549-0.558 (race 1, the
# route of CUTE_DEFAULT); rounds s8r1 / s8r2: counting 0.629-0.656 against histograms 0.641-0.657 (race 1, CuTeDSL pass
# 2 + separate top-K); the same selection either way. 3 (one bit per pass on int16 pairs, ``topk._count_ge_pairs``):
# round s12r3 (main 9399d9e, 1.3B, race 1) 0.4940 / 0.4867 / 0.4854 / 0.4888 against the default's 0.4867 / 0.4892 /
# 0.4858 / 0.4967 (s = 0.1 / 0.15 / 0.25 / 0.5): better at 3 of 4; the final round s12final (main 78da7ed, row
# "swar cnt") 0.4915 / 0.5062 / 0.4972 / 0.5433 against 0.4954 / 0.5026 / 0.4949 / 0.5055: not adopted
_TOPK_SEPARATE_COUNT_DEFAULT = True
# group_prob_sums / select_kv: the float8 pair kernel with one query group per program (one_group; 119 registers, 4
# programs per SM instead of 3). H200 round s5r2 (tests/bench_select_race.py race 2, sustained interleaved, 1.3B 480p,
# all heads): pass-2 kernel 0.5139 of flash-attn-4 dense against 0.5272 for two groups per program (14B 720p not
# timed). With the fused top-K too since H200 round s6r1 (bench_select_race race 1, method of record, s = 0.1 / 0.15 /
# 0.25 / 0.5): select_kv 0.569 / 0.565 / 0.576 / 0.575 of flash-attn-4 dense at 1.3B 480p and 0.471 / 0.471 / 0.471 /
# 0.478 at 14B 720p, against 0.589 / 0.590 / 0.596 / 0.593 and 0.485 / 0.486 / 0.490 / 0.497 with two groups per
# program: better at every point (selection identical, GPU-checked).
_ONE_GROUP_DEFAULT = True
# the float8 pair kernel with the fused top-K: ptxas gives it 170 registers uncapped (2 programs of 4 warps per SM)
# against the plain kernel's 166 (3 programs); capped at 168 it keeps 3, no spill, its key loop 554 instead of 532
# SASS instructions per tile pair (tests/ptxas_select.py), under a loop bound 2:1 by MUFU over issue. With one_group
# the cap is 128 (4 programs per SM as without the top-K: ptxas 119 without, 122 uncapped / 119 capped with it, 0
# spills; capped at 168 it would take 139 and lose a program)
_TOPK_FUSED_MAXNREG = 168
# the CuTeDSL pass 2's unit_qf check from the quantising launch's per-block min / max / NaN counts and one small
# per-head reduction (``fp8_operands(unit_signs=True)``) instead of ``unit_qf_factors`` reading lse_s / 2^kb again:
# the same factors (CPU test; GPU-checked bit for bit in each round's "CHECKS unit fold"). H200 round s12r2 (main
# 3a6585e, tests/bench_select_race.py race 1, 1.3B 480p, / flash-attn-4 dense 9.010 ms, s = 0.1 / 0.15 / 0.25 / 0.5):
# select_kv 0.5025 / 0.5005 / 0.4980 / 0.5052 against 0.5049 / 0.5064 / 0.5189 / 0.5143 without it (better at 4/4);
# timeline (tests/bench_select_timeline.py): the check 4.3 us (``_unit_qf_final``) instead of 54 us
# (``unit_qf_factors``: 12 programs of 64 dependent 4 KiB loads). Round s12r1's first form (scalar atomics per
# quantising program, the head's last block deciding) was inside the spread: its acq_rel atomics and 104 registers
# slowed the quantising pass
_UNIT_SIGNS = True
# The one-group kernel's loop, variants measured slower (the kernel alone / flash-attn-4 dense at 1.3B 480p, round
# s7r1 default 0.5226: row sums as two partial sums per thread 0.5450, on the tensor cores 0.5761, a quarter of the
# exponentials on the degree-3 polynomial 0.5997, 4 stages 0.5524; round s7r2 default 0.5058: the sums stored by
# inline PTX from the wgmma registers 0.5148, 2 stages 0.5506, 8 warps on 128-key tiles 0.5601); removed.


def fp8_default(capability: tuple[int, int] | None) -> bool:
    """Whether pass 2 takes its QK^T in float8 when the caller does not say: ``MC_SPARSE_PASS2_FP8`` = "1" forces it
    wherever it can run (sm_89+ and the interpreter, capability None), "0" turns it off (any other value is a
    ValueError); unset: ``_FP8_DEFAULT`` on sm_90+ (the measured GPUs), off on sm_89 and under the interpreter (the
    CPU tests' default path stays the exact bf16 one; the float8 path has its own tests)."""
    env = os.environ.get("MC_SPARSE_PASS2_FP8")
    if env not in (None, "", "0", "1"):
        raise ValueError(f"MC_SPARSE_PASS2_FP8 must be 0 or 1, got {env!r}")
    if env == "1":
        return capability is None or tuple(capability) >= _FP8_MIN_CAPABILITY
    if env == "0":
        return False
    return _FP8_DEFAULT and capability is not None and tuple(capability) >= _FP8_DEFAULT_MIN_CAPABILITY


def group_prob_sums(q, k, lse, perm, *, group_size, scale=None, out=None, block_n=None, num_warps=None,
                    num_stages=None, exp="fp32", poly=0, pipelined=None, fp8=None, pair=None, hist=None, gluon=None,
                    poly3=(0, 0), select=None, one_group=None, cute=None):
    """Pass 2 on the Triton kernel; same contract as ``kernels.reference.group_prob_sums``.

    Args:
        q, k: ``[B, H, S, D]`` / ``[B, H, Sk, D]``, fp16 or bf16, any strides; lse: fp32 ``[B, H, S]`` (natural log);
        perm: int32 ``[B, H, G*C]``; group_size: C (any C >= 1); scale: None means 1/sqrt(D).
        out: optional ``[B, H, G, Sk]`` buffer to write into (any strides), fp32, or fp16 for select_kv's
        scratch; block_n, num_warps, num_stages: tuning overrides; exp: "fp32", "f16x2" (packed half-precision
        exp2 of ``fastexp``: fp16 argument and result, ~1e-3 relative; fp32 where the PTX cannot run) or
        "f16_emulated" (its roundings in plain Triton, for tests); pair: two query groups per program (C <= 128),
        pipelined: with pair, the two groups staggered by half a step so one's exponentials overlap the other's MMA
        (ignored without pair); None / None: the staggered pair kernel for 64 < C <= 128 on sm_90+ (and the
        interpreter; unstaggered with fp8), else one group per program; poly: exponentials on the FMA pipe (polynomial, ~4e-5 relative):
        with the pair kernel poly / 4 of them (1: group 1's odd query columns, 2 or True: all of group 1's), with one
        group per program every other key tile for any nonzero value; fp8: QK^T on float8_e4m3 copies of q and k
        (``fp8_operands``; twice the bf16 MMA rate on sm_89+), APPROXIMATE sums (~1e-2 relative) for ranking; forces
        the pair kernel; ignored (bf16/fp16 products) for C > 128, D not a multiple of 32 and below sm_89; None:
        ``fp8_default``.
        hist: optional contiguous int32 ``[B, H, G, topk.HIST_BINS]``, written with each group's histogram of the top
        8 bits of its stored sums (``topk.top_k_rows(hist=...)``: the radix top-K's first pass); the one-group kernel
        does not count it and writes zeros (the top-K then counts itself).
        gluon: the float8 path on the warp-specialised sm_90 Gluon kernel (``selection_sm90``; same sums) where it
        runs, else (or on its failure, remembered) the Triton kernel: ``pass2_dispatch``; None: its default.
        one_group: the pair kernel with ONE query group per program (unstaggered; no hist, no poly): 119
        registers instead of 166 (offline), so 4 programs per SM instead of 3, each key tile read once per group;
        None: ``_ONE_GROUP_DEFAULT`` where it applies (float8, unstaggered, no hist / poly; with or without select).
        poly3: (g0, g1), eighths (0, 2 or 4) of each of the pair kernel's two groups' exponentials taken by the
        degree-3 polynomial on the FMA pipe (``_exp2_poly3``: relative error < 7.6e-5) instead of MUFU (4: the odd
        query columns of every key tile; 2: of every other key tile, group 0's even tiles, group 1's odd); pair kernel
        only (the Triton one: a nonzero value skips the Gluon kernel). ``exp="none"``: no exponential at all (the
        sums are sums of log2 probabilities: a timing floor for the benchmark, pair kernel only).
        select: optional ``topk.FusedRows``: the pair kernel also writes each group's top-K of the float16 sums into
        ``select.out`` and sets ``select.done`` (then the caller runs ``select.finish(out)``); other kernels leave it
        unset (the caller runs ``topk.top_k_rows``). Needs float16 ``out``.
        cute: the float8 path on the CuTeDSL sm_90 kernel (``kernels/cutedsl/pass2_sm90.py``; the same sums up to the
        order of fp32 additions) where it runs, tried before the Gluon kernel; on its refusal or failure (remembered)
        the Gluon / Triton kernel: ``pass2_dispatch``; None: its default. With ``select`` it is first tried with
        its own fused top-K into ``select.out`` (``pass2_dispatch.try_cute_select``; then ``select.done`` and
        ``select.complete`` are set), else without it (``select`` left unset: the caller's separate top-K).
    Returns:
        fp32 ``[B, H, G, Sk]``, each entry in [0, C].
    Raises:
        TypeError: lse not float32. ValueError: lse, out or hist of the wrong shape, poly out of range.
    """
    B, H, S, D = q.shape
    C = group_size
    n_slots = perm.shape[-1]
    G = n_slots // C
    SK = k.shape[2]
    if lse.dtype != torch.float32:
        raise TypeError(f"lse must be float32, got {lse.dtype}")
    if tuple(lse.shape) != (B, H, S):
        raise ValueError(f"lse must be [B, H, S] = {(B, H, S)}, got {tuple(lse.shape)}")
    if out is None:
        out = torch.empty(B, H, G, SK, dtype=torch.float32, device=q.device)
    elif out.dtype not in (torch.float32, torch.float16) or tuple(out.shape) != (B, H, G, SK):
        raise ValueError(f"out must be float32/16 [B, H, G, Sk] = {(B, H, G, SK)}, got {out.dtype} {tuple(out.shape)}")
    poly = 2 if poly is True else int(poly)
    if not 0 <= poly <= 2:
        raise ValueError(f"poly must be a bool or 0, 1, 2, got {poly}")
    poly3 = tuple(int(e) for e in poly3)
    if len(poly3) != 2 or any(e not in (0, 2, 4) for e in poly3) or (poly and poly3[1]):
        raise ValueError(f"poly3 must be two of 0, 2, 4 (and poly3[1] = 0 with poly), got {poly3}")
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    block_m = min(128, max(16, triton.next_power_of_2(C)))
    bn, warps, stages = _config(D)
    cap = _capability(q.device)
    exp_mode = 3 if exp == "none" else fastexp.mode_for(exp, cap)
    fp8 = fp8_default(cap) if fp8 is None else bool(fp8)
    # else bf16/fp16 products: groups wider than one tile, before sm_89, a head dim the e4m3 MMA cannot take (K % 32)
    fp8 = fp8 and C <= block_m and D % 32 == 0 and (cap is None or cap >= _FP8_MIN_CAPABILITY)
    if fp8:
        pair = True
    elif pair is None:
        pair = (cap is None or cap >= _PAIR_MIN_CAPABILITY) and block_m == 128
    if pipelined is None:  # float8: unstaggered (H200: 0.487 / 0.603 of dense against 0.514 / 0.611 staggered)
        pipelined = bool(pair) and not fp8
    pipelined = bool(pipelined)
    perm = perm.contiguous()
    if hist is not None:
        if hist.dtype != torch.int32 or tuple(hist.shape) != (B, H, G, HIST_BINS.value) or not hist.is_contiguous():
            raise ValueError(f"hist must be contiguous int32 {(B, H, G, HIST_BINS.value)}, got {hist.dtype} "
                             f"{tuple(hist.shape)}")
        if not (pair and C <= block_m):
            hist.zero_()  # not counted by the one-group kernel: the top-K's check sees 0 != Sk and counts itself
    one_group_asked = bool(one_group)  # an explicit one_group=True is the Triton kernel's option (no Gluon)
    if one_group is None:
        one_group = (_ONE_GROUP_DEFAULT and fp8 and not pipelined and hist is None and not poly
                     and not any(poly3))
    if one_group and (hist is not None or pipelined or poly or poly3[1]):
        raise ValueError("one_group: unstaggered, without hist / poly / poly3[1]")
    if (exp_mode == 3 or any(poly3) or one_group) and not (pair and C <= block_m):
        raise ValueError("exp='none' and poly3 need the pair kernel (C <= 128, pair not False)")
    if pair and C <= block_m:
        qf = kb = lse  # placeholders, not read without FP8
        pow2 = False  # the Triton kernel reads 2^KB (KB_POW2) where the Gluon kernel will not be tried
        if fp8:
            # 2^KB precomputed unless only the Gluon kernel will be tried, with a config that reads KB itself (the
            # CuTeDSL kernel reads 2^KB)
            want_cute = pass2_dispatch.cute_wanted(cute)
            gluon_pow2 = pass2_dispatch.gluon_kb_pow2(D)
            pow2 = want_cute or not pass2_dispatch.gluon_mode(gluon) or gluon_pow2
            unit = want_cute and pass2_dispatch.cute_unit_qf()  # qf = 1 operands for the kernel's unit_qf form
            ops = fp8_operands(q, k, lse, scale, kb_pow2=pow2, unit_qf=unit, unit_signs=unit and _UNIT_SIGNS)
            q, k, qf, lse, kb = ops[:5]
            if len(ops) > 5:  # the form's factors made by the quantising launch (no check launch in the kernel's call)
                unit = ops[5]
            tuned = one_group_asked or any(x is not None for x in (block_n, num_warps, num_stages))
            only_triton = pass2_dispatch.triton_only(hist=hist, poly=poly or any(poly3), exp_mode=exp_mode, tuned=tuned)
            if want_cute and select is not None and pass2_dispatch.try_cute_select(
                    q, k, qf, lse, kb, perm, out, group_size=C, sel=select.out, num_keys=select.num_keys,
                    requested=cute, only_triton=only_triton, unit_qf=unit):
                select.done = select.complete = True  # (every selection row written by the kernel)
                return out
            if want_cute and pass2_dispatch.try_cute(q, k, qf, lse, kb, perm, out, group_size=C, requested=cute,
                                                     only_triton=only_triton, unit_qf=unit):
                return out
            if pow2 and not gluon_pow2 and only_triton is None:
                only_triton = "the float8 operands hold 2^KB (made for the CuTeDSL kernel); this Gluon config reads KB"
            if pass2_dispatch.try_gluon(q, k, qf, lse, kb, perm, out, group_size=C, requested=gluon,
                                        only_triton=only_triton):
                return out
        warps_ = num_warps or warps
        sel_args, sel_meta = _fused_topk_args(select, out, warps_, lse)
        _group_prob_sums_pair[(G if one_group else triton.cdiv(G, 2), B * H)](
            q, k, lse, perm, out, qf, kb, qf if hist is None else hist, scale * _LOG2E, H, S, SK, n_slots, C, G,
            *q.stride(), *k.stride(), *lse.stride(), *out.stride(), *sel_args,
            HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n or bn, EXP_MODE=exp_mode, STAGGER=pipelined, FP8=fp8,
            POLY=poly, P3_G0=poly3[0], P3_G1=poly3[1], KEY_BITS=16 if out.dtype == torch.float16 else 32,
            WITH_HIST=hist is not None, KB_POW2=pow2, ONE_GROUP=bool(one_group), **sel_meta, num_warps=warps_,
            num_stages=num_stages or stages,
            **({"maxnreg": 128 if one_group else _TOPK_FUSED_MAXNREG} if select is not None and fp8 and cap is not None
               else {}),
        )
        if select is not None:
            select.done = True
        return out
    _group_prob_sums_fwd[(G, B * H)](
        q, k, lse, perm, out,
        scale * _LOG2E,
        H, S, SK, n_slots, C,
        *q.stride(), *k.stride(), *lse.stride(), *out.stride(),
        M_CHUNKS=triton.cdiv(C, block_m), HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n or bn, EXP_MODE=exp_mode,
        POLY=poly > 0,
        num_warps=num_warps or warps, num_stages=num_stages or stages,
    )
    return out


def head_chunk(B: int, H: int, G: int, SK: int) -> int:
    """Heads per pass-2 launch in ``select_kv``: as many as keep the float16 group-sum scratch (B x heads x G x Sk)
    under ``_SCRATCH_BYTES``, at least one."""
    return max(1, min(H, _SCRATCH_BYTES // (B * G * SK * 2)))


def select_kv(q, k, lse, perm, num_keys, *, group_size, kv_tile, scale=None, heads_per_chunk=None, poly=0,
              block_n=None, num_warps=None, num_stages=None, pipelined=None, fp8=None, exp="fp32", pair=None,
              topk_method=None, topk_hist=None, gluon=None, topk_fused=None, one_group=None,
              poly3=(0, 0), topk_count=None, topk_z=None, cute=None, topk_stride=None):
    """Pass 2 + top-K on the Triton kernel; same contract as ``kernels.reference.select_kv``.

    Heads are processed in chunks so the group-sum scratch stays under ``_SCRATCH_BYTES`` (1 GiB). The sums are
    kept in fp16 there (values in [0, C], relative precision 2^-11: enough to rank; halves the top-K traffic): at
    Wan2.1-14B 720p one head's sums are 591 x 75600 x 2 B = 89 MB. ``topk.top_k_rows`` then writes each group's
    row of the selection in place: the K largest float16 sums (ties: lower token index first), ascending, then -1.
    ``heads_per_chunk`` overrides the chunk size; ``block_n``, ``num_warps``, ``num_stages``, ``pipelined``,
    ``exp``, ``pair``, ``poly``, ``fp8``, ``gluon``, ``one_group``, ``poly3`` tune pass 2 (see
    ``group_prob_sums``; the defaults are
    its defaults: the staggered two-group kernel, float8 products per ``fp8_default``); ``topk_method`` picks
    ``topk.top_k_rows``'s
    method (None: its default by row length, or "radix" with ``topk_hist``); ``topk_hist``: pass 2 counts each
    group's first radix digit while it writes the sums, and the radix top-K skips that pass (None:
    ``_TOPK_HIST_DEFAULT``); ``topk_fused``: the pair kernel runs the bracket top-K on its own groups' sums after
    its key sweep (``topk.FusedRows``; same selection; None: ``_TOPK_FUSED_DEFAULT`` on sm_90+; ignored with ``topk_method``,
    ``topk_hist`` or when another pass-2 kernel runs); ``topk_count``: that top-K's threshold among its candidates
    by counting (``FusedRows.cand_count``: True / 1 one bit per pass over the copies, 2 two bits, False / 0 radix
    histograms; same selection; None: ``_TOPK_COUNT_DEFAULT``); ``topk_z``: that top-K's
    bracket half-width in binomial sigmas and ``topk_stride`` its keys per sample (``topk.bracket_plan``; same
    selection; None: its defaults, the separate top-K's ``topk._SEPARATE_Z``; the separate top-K takes both too);
    ``cute``: pass 2
    on the CuTeDSL sm_90 kernel where it runs (``group_prob_sums``; None: ``pass2_dispatch.CUTE_DEFAULT``), with its
    own fused top-K where the module has one, ``topk_fused`` is on and the module's policy takes the call
    (``pass2_dispatch.try_cute_select``), else then the separate top-K (``topk.top_k_rows``: ``topk._SEPARATE_METHOD``,
    "seg" since session 13, whose threshold always counts; the bracket method counts among its candidates when
    ``topk_count``, None: ``_TOPK_SEPARATE_COUNT_DEFAULT``).

    Returns:
        int32 ``[B, H, G, ceil(K / kv_tile) * kv_tile]``: each group's K indices sorted ascending, -1 after them.
    """
    B, H, S, _ = q.shape
    C = group_size
    G = perm.shape[-1] // C
    SK = k.shape[2]
    k_alloc = -(-num_keys // kv_tile) * kv_tile
    out = torch.empty((B, H, G, k_alloc), dtype=torch.int32, device=q.device)  # every slot written by top_k_rows
    hc = heads_per_chunk or head_chunk(B, H, G, SK)
    scratch = torch.empty(B, hc, G, SK, dtype=torch.float16, device=q.device)
    use_hist = _TOPK_HIST_DEFAULT if topk_hist is None else bool(topk_hist)
    hist_buf = torch.empty(B * hc * G * HIST_BINS.value, dtype=torch.int32, device=q.device) if use_hist else None
    fused = None
    if topk_fused is None:
        cap = _capability(q.device)
        topk_fused = _TOPK_FUSED_DEFAULT and cap is not None and tuple(cap) >= _TOPK_FUSED_MIN_CAPABILITY
    if topk_fused and not use_hist and topk_method is None:
        try:
            fused = FusedRows.allocate(B * hc * G, SK, num_keys, k_alloc, q.device,
                                       cand_count=int(_TOPK_COUNT_DEFAULT if topk_count is None else topk_count),
                                       **({} if topk_z is None else dict(z=float(topk_z))), stride=topk_stride)
        except torch.cuda.OutOfMemoryError:
            fused = None  # the unfused top-K (its own out-of-memory handling)
    for h0 in range(0, H, hc):
        h1 = min(H, h0 + hc)
        hist = None if hist_buf is None else hist_buf[: B * (h1 - h0) * G * HIST_BINS.value].view(
            B, h1 - h0, G, HIST_BINS.value)
        select = None if fused is None else fused.for_chunk(out[:, h0:h1])
        sums = group_prob_sums(
            q[:, h0:h1], k[:, h0:h1], lse[:, h0:h1], perm[:, h0:h1], group_size=C, scale=scale,
            out=scratch[:, : h1 - h0], poly=poly, block_n=block_n, num_warps=num_warps, num_stages=num_stages,
            pipelined=pipelined, fp8=fp8, exp=exp, pair=pair, hist=hist, gluon=gluon, select=select,
            one_group=one_group, poly3=poly3, cute=cute,
        )
        if select is not None and select.done:
            select.finish(sums)
        else:
            _top_k(sums, num_keys, k_alloc, out[:, h0:h1], topk_method or ("radix" if use_hist else None), hist,
                   topk_z, cand_count=int(_TOPK_SEPARATE_COUNT_DEFAULT if topk_count is None else topk_count),
                   sample_stride=topk_stride)
    return out


def _top_k(sums, num_keys, k_alloc, out, method=None, hist=None, z=None, cand_count=0, sample_stride=None):
    """The Triton top-K; if it cannot run here (a compiler or resource failure), ``torch.topk`` + sort instead, so
    the selection stays fast (ties then as torch.topk breaks them); the error is logged once per process. Out of
    memory in the bracket method (its per-call candidate scratch, rows x cap int16: ~230 MB for a 14B 720p head
    chunk) retries that call with the radix method (no scratch; same result), logged once; out of memory there is
    raised (the caller's out-of-memory handling), and neither disables the Triton top-K."""
    if not _RADIX_FAILED:
        try:
            return top_k_rows(sums, num_keys, k_alloc, out=out, method=method, hist=hist, z=z, cand_count=cand_count,
                              sample_stride=sample_stride)
        except (ValueError, TypeError):
            raise
        except torch.cuda.OutOfMemoryError:
            if method == "radix" or hist is not None:
                raise
            if not _BRACKET_OOM:
                _BRACKET_OOM.append(True)
                log.warning("MC-Sparse: out of memory for the bracket top-K's candidate scratch; using the radix "
                            "top-K for such calls")
            return top_k_rows(sums, num_keys, k_alloc, out=out, method="radix")
        except Exception as err:  # noqa: BLE001 (any compile/launch failure: keep the run fast, say why once)
            _RADIX_FAILED.append(f"{type(err).__name__}: {err}")
            log.warning("MC-Sparse: Triton top-K failed (%s); using torch.topk for the selection", _RADIX_FAILED[0])
    top = torch.topk(sums, num_keys, dim=-1, sorted=False).indices
    out[..., :num_keys] = torch.sort(top, dim=-1).values.to(torch.int32)
    out[..., num_keys:] = -1
    return out
