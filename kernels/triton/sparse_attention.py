"""Triton token-sparse attention forward (MC-Sparse, arXiv 2610.06801, sec. 3.1).

Tile scheme: one program per (query block of one group, batch*head); grid axis 0 walks the groups of one head
back to back, so the head's K/V (16.8 MB at Wan2.1-1.3B 480p, 38.7 MB at 14B 720p) stays in the H200's L2 while its
groups gather from it. BLOCK_M = C rounded up to a power of two (>= 16, <= 128; larger groups take several programs).
The program gathers its C query rows through ``perm`` once, then sweeps the group's ``kv_idx`` row BLOCK_N slots at a
time: it gathers BLOCK_N K and V rows by index (each row D contiguous elements), computes the scores with ``tl.dot``,
runs an online softmax in base 2 (scale * log2(e) folded into one multiply) and accumulates P @ V in fp32. With
trailing -1 slots (the convention) the program first finds its group's valid count (``_valid_count``), runs the
full tiles with no mask at all and gives only the last partial tile a -inf score bias; K/V row offsets are int32
when they cannot overflow (both measured on the H200: docs/kernels-benchmark.md). Padded query slots (-1 in
``perm``) are neither read nor written. The output rows are scattered back to the original query order; the optional LSE is fp32, natural log.

Expected agreement with ``kernels.reference.sparse_attention``: within bf16/fp16 rounding of P before the P @ V
product (relative error ~2e-3 for bf16 inputs against a float64 reference), not bitwise.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..residual import finish_unfused

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


@triton.jit
def _attn_tile(acc, m_i, l_i, q, k_base, v_base, idx_base, n0, n_valid, SK, sm_scale_log2,
               stride_ks, stride_kd, stride_vs, stride_vd,
               HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, MASK_FROM_COUNT: tl.constexpr,
               ROW64: tl.constexpr, CACHE: tl.constexpr):
    """One BLOCK_N-slot tile of a group's KV: gather K/V rows by index, online softmax (base 2), acc += P @ V.

    MASKED=False is the hot path: every slot of the tile is valid (n0 + BLOCK_N <= n_valid), so there is no mask and
    the score update is one FMA per element (the running max is finite after the first tile). MASKED=True handles
    the group's last partial tile (or every tile when masking by the loaded -1 indices)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    slots = n0 + offs_n
    if MASKED:
        kv = tl.load(idx_base + slots, mask=slots < n_valid, other=-1)  # [BLOCK_N] int32, -1 = masked
        kv_ok = (kv >= 0) & (kv < SK)
    else:
        kv = tl.load(idx_base + slots)
        kv_ok = kv < SK
    kv_rows = tl.where(kv_ok, kv, 0)  # out-of-range indices read row 0 (never out of bounds)
    if ROW64:
        kv_rows = kv_rows.to(tl.int64)
    k = tl.load(k_base + kv_rows[:, None] * stride_ks + offs_d[None, :] * stride_kd, cache_modifier=CACHE)
    qk = tl.dot(q, tl.trans(k))  # [BLOCK_M, BLOCK_N] fp32
    if MASKED:
        if MASK_FROM_COUNT:
            bias = tl.where(slots < n_valid, 0.0, float("-inf"))
        else:
            bias = tl.where(kv_ok, 0.0, float("-inf"))
        qk = qk * sm_scale_log2 + bias[None, :]
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw only masked slots: no inf - inf
        p = tl.math.exp2(qk - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1) * sm_scale_log2)
        p = tl.math.exp2(qk * sm_scale_log2 - m_new[:, None])  # one FMA + exp2 per score
        alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    v = tl.load(v_base + kv_rows[:, None] * stride_vs + offs_d[None, :] * stride_vd, cache_modifier=CACHE)
    acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, m_new, l_i


@triton.jit
def _valid_count(idx_base, K_ALLOC, PROBES: tl.constexpr):
    """Number of slots before the first -1 of one group's ``kv_idx`` row (the -1 slots are trailing).

    Two levels instead of a pass over the row: PROBES evenly spaced slots locate the chunk holding the boundary
    (validity is monotone along the row), then that chunk (K_ALLOC / PROBES slots) is counted PROBES at a time."""
    j = tl.arange(0, PROBES)
    step = tl.cdiv(K_ALLOC, PROBES)
    pos = j * step
    probe = tl.load(idx_base + pos, mask=pos < K_ALLOC, other=-1)
    n_ok = tl.sum((probe >= 0).to(tl.int32))  # probes 0..n_ok-1 valid, the rest not
    lo = tl.maximum(n_ok - 1, 0) * step  # every slot before lo is valid, every slot from lo + step on is not
    count = lo
    for off in range(0, step, PROBES):
        p2 = lo + off + j
        v2 = tl.load(idx_base + p2, mask=(p2 < K_ALLOC) & (p2 < lo + step), other=-1)
        count += tl.sum((v2 >= 0).to(tl.int32))
    return count


@triton.jit
def _sparse_attn_fwd(
    Q, K, V, PERM, KV_IDX, OUT, LSE,
    sm_scale_log2,  # softmax scale * log2(e)
    H, S, SK, n_slots,  # n_slots: G*C entries of perm per (b, h); SK: KV length
    K_ALLOC, C,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_ob, stride_oh, stride_os, stride_od,
    M_BLOCKS: tl.constexpr,  # programs per group: ceil(C / BLOCK_M)
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    RETURN_LSE: tl.constexpr,
    MASK_FROM_COUNT: tl.constexpr,  # trailing -1 slots: unmasked full tiles + one masked tail tile
    ROW64: tl.constexpr,  # int64 K/V row offsets (needed when Sk * row stride >= 2^31)
    CACHE: tl.constexpr,  # cache modifier of the K/V gathers ("" or ".cg")
    PERMUTE_Q: tl.constexpr,  # False: group g reads/writes query rows g*C.. directly (benchmark baseline only)
):
    pid_m = tl.program_id(0)  # group * M_BLOCKS + block inside the group
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    group = pid_m // M_BLOCKS
    row0 = (pid_m % M_BLOCKS) * BLOCK_M

    offs_m = row0 + tl.arange(0, BLOCK_M)  # [BLOCK_M] rows inside the group
    offs_d = tl.arange(0, HEAD_DIM)

    # query indices of this block; rows past C or past the padded tail read -1
    if PERMUTE_Q:
        perm_base = PERM + bh.to(tl.int64) * n_slots + group.to(tl.int64) * C
        q_idx = tl.load(perm_base + offs_m, mask=offs_m < C, other=-1)  # [BLOCK_M] int32
    else:
        q_idx = tl.where(offs_m < C, group * C + offs_m, -1)
    q_valid = (q_idx >= 0) & (q_idx < S)
    q_rows = tl.where(q_valid, q_idx, 0).to(tl.int64)

    q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    q = tl.load(
        q_base + q_rows[:, None] * stride_qs + offs_d[None, :] * stride_qd,
        mask=q_valid[:, None],
        other=0.0,
    )  # [BLOCK_M, D]

    k_base = K + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + h.to(tl.int64) * stride_vh
    idx_base = KV_IDX + (bh.to(tl.int64) * (n_slots // C) + group) * K_ALLOC

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    if MASK_FROM_COUNT:
        n_valid = _valid_count(idx_base, K_ALLOC, 128)
        n_full = (n_valid // BLOCK_N) * BLOCK_N
        for n0 in range(0, n_full, BLOCK_N):  # hot loop: full tiles, no masks
            acc, m_i, l_i = _attn_tile(acc, m_i, l_i, q, k_base, v_base, idx_base, n0, n_valid, SK, sm_scale_log2,
                                       stride_ks, stride_kd, stride_vs, stride_vd, HEAD_DIM, BLOCK_N, False, True,
                                       ROW64, CACHE)
        if n_full < n_valid:
            acc, m_i, l_i = _attn_tile(acc, m_i, l_i, q, k_base, v_base, idx_base, n_full, n_valid, SK,
                                       sm_scale_log2, stride_ks, stride_kd, stride_vs, stride_vd, HEAD_DIM, BLOCK_N,
                                       True, True, ROW64, CACHE)
    else:
        for n0 in range(0, K_ALLOC, BLOCK_N):
            acc, m_i, l_i = _attn_tile(acc, m_i, l_i, q, k_base, v_base, idx_base, n0, K_ALLOC, SK, sm_scale_log2,
                                       stride_ks, stride_kd, stride_vs, stride_vd, HEAD_DIM, BLOCK_N, True, False,
                                       ROW64, CACHE)

    out = acc / l_i[:, None]
    o_base = OUT + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
    tl.store(
        o_base + q_rows[:, None] * stride_os + offs_d[None, :] * stride_od,
        out.to(OUT.dtype.element_ty),
        mask=q_valid[:, None],
    )
    if RETURN_LSE:
        lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453  # natural log
        tl.store(LSE + bh.to(tl.int64) * S + q_rows, lse, mask=q_valid)


def _config(head_dim: int, block_m: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages): BN 64, 4 warps, 3 stages: 0.770 of cuDNN at 14B, s = 0.25 on the H200; 4 stages
    0.771, BN 128 / 8 warps 0.740, 8 warps with BN 64 0.647 (docs/kernels-benchmark.md)."""
    return (64, 4, 3)


def sparse_attention(q, k, v, perm, kv_idx, *, scale=None, return_lse=False, out=None, residual=None, block_n=None, num_warps=None,
                     num_stages=None, mask_from_count=True, cache="", block_m=None, row64=None, permute_q=True):
    """Token-sparse attention on the Triton kernel; same contract as ``kernels.reference.sparse_attention``.

    Args:
        q, k, v: ``[B, H, S, D]`` / ``[B, H, Sk, D]``, fp16 or bf16, any strides (unit stride on D is fastest);
            D a power of two in [16, 256].
        perm: int32 ``[B, H, G*C]`` query groups, -1 padding at the tail.
        kv_idx: int32 ``[B, H, G, K_alloc]`` each group's KV token indices, -1 = masked slot. Any K_alloc.
        scale: softmax scale; None means 1/sqrt(D).
        return_lse: also return the fp32 row log-sum-exp ``[B, H, S]`` (natural log, scale applied).
        mask_from_count: the -1 slots are trailing (the kv_idx convention): each program finds its group's valid
            count (two vector probes of its kv_idx row), runs the full tiles unmasked and masks only the last partial
            tile. False masks slots holding -1 wherever they are (every tile masked, slower).
        block_n, num_warps, num_stages, block_m, cache: tuning overrides (benchmarks).
        row64: int64 K/V row offsets; None picks int64 only when (Sk - 1) * row stride could overflow int32 (the
            base pointers of each (b, h) are always 64-bit).
        permute_q: False makes group g read and write query rows g*C..g*C+C-1 directly, ignoring perm: a
            benchmark baseline that measures what the gather/scatter through perm costs; not the op's contract.
    Returns:
        O ``[B, H, S, D]`` in q's dtype, original query order (queries absent from ``perm`` are left
        uninitialised, as the contract says every query appears once), or (O, LSE).
    Raises:
        ValueError: a group width C = G*C / G that does not divide ``perm``'s width.
    """
    B, H, S, D = q.shape
    G, k_alloc = kv_idx.shape[2], kv_idx.shape[3]
    n_slots = perm.shape[-1]
    if n_slots % G:
        raise ValueError(f"perm width must be a multiple of kv_idx's G = {G}, got {n_slots}")
    C = n_slots // G
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    block_m = block_m or min(128, max(16, triton.next_power_of_2(C)))
    m_blocks = triton.cdiv(C, block_m)
    bn, warps, stages = _config(D, block_m)
    bn = block_n or bn
    warps = num_warps or warps
    stages = num_stages or stages
    if row64 is None:
        sk = k.shape[2]
        reach = max((sk - 1) * abs(k.stride(2)) + (D - 1) * abs(k.stride(3)),
                    (sk - 1) * abs(v.stride(2)) + (D - 1) * abs(v.stride(3)))
        row64 = reach >= 2**31
    perm = perm.contiguous()
    kv_idx = kv_idx.contiguous()
    target = out
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(B, H, S, dtype=torch.float32, device=q.device) if return_lse else out  # dummy when unused
    grid = (G * m_blocks, B * H)
    _sparse_attn_fwd[grid](
        q, k, v, perm, kv_idx, out, lse,
        scale * _LOG2E,
        H, S, k.shape[2], n_slots, k_alloc, C,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        M_BLOCKS=m_blocks, HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=bn, RETURN_LSE=return_lse,
        MASK_FROM_COUNT=mask_from_count, ROW64=bool(row64), CACHE=cache, PERMUTE_Q=permute_q,
        num_warps=warps, num_stages=stages,
    )
    out = finish_unfused(out, target, residual)
    return (out, lse) if return_lse else out
