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

Two softmax options (launch tuning ``exp`` / ``lazy_rescale``, defaults per architecture in ``config``): the
exponentials through ``fastexp.exp2`` (fp32 MUFU; or packed ``ex2.approx.f16x2`` on CUDA, where ptxas on sm_80-sm_90
still issues one MUFU.EX2.F16 per element: it saves no MUFU work there and measured 3-8 % slower on the H200),
and the lazy rescale (FA4; on by default on sm_90): a row's running max moves only when the tile's max exceeds it by
more than RESCALE_LOG2 (8, log2 units), and the BLOCK_M x D accumulator is multiplied only when some row's max moved
(a block-uniform branch); O / l and the LSE use the same stale max, so the result is exact, with P <= 2^8 before
normalisation.

Expected agreement with ``kernels.reference.sparse_attention``: within bf16/fp16 rounding of P before the P @ V
product (relative error ~2e-3 for bf16 inputs against a float64 reference), not bitwise.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import fastexp

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453
# LAZY_RESCALE threshold in log2 units: P <= 2^8 before normalisation (fp16 holds 65504), O and l rescaled only when
# some row's max grows by more (FA4's "conditional rescaling"; exact, since the final O / l and the LSE use the same m)
RESCALE_LOG2 = tl.constexpr(8.0)


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
def _valid_count_tail_first(idx_base, K_ALLOC, PROBES: tl.constexpr):
    """``_valid_count`` with one round trip in the common case: the last PROBES slots are read first; when the first
    of them is valid (fewer than PROBES trailing -1 slots, e.g. K_alloc = K rounded up to a multiple of 128) the
    count is known from them, else the two-level search runs."""
    j = tl.arange(0, PROBES)
    tail0 = tl.maximum(K_ALLOC - PROBES, 0)
    pos = tail0 + j
    v = tl.load(idx_base + pos, mask=pos < K_ALLOC, other=-1)
    ok = v >= 0
    n_tail = tl.sum(ok.to(tl.int32))
    first_ok = tl.sum(tl.where(j == 0, ok, False).to(tl.int32))
    count = tail0 + n_tail
    if (first_ok == 0) & (tail0 > 0):
        count = _valid_count(idx_base, K_ALLOC, PROBES)
    return count


@triton.jit
def _kv_tile(idx_base, n0, n_end, kv_first, SK, offs_n, ROW64: tl.constexpr):
    """(K/V row of each slot, slot < n_end, index valid) for the BLOCK_N slots from n0 of one group's kv_idx row:
    slots past n_end read ``kv_first``, out-of-range indices row 0 (in bounds; their scores are masked or unused)."""
    slots = n0 + offs_n
    live = slots < n_end
    kv = tl.load(idx_base + slots, mask=live, other=kv_first)  # [BLOCK_N] int32
    col_ok = (kv >= 0) & (kv < SK)
    kv_rows = tl.where(col_ok, kv, 0)
    if ROW64:
        kv_rows = kv_rows.to(tl.int64)
    return kv_rows, live, col_ok


@triton.jit
def _query_rows(PERM, bh, group, n_slots, C, S, offs_m, PERMUTE_Q: tl.constexpr, ROW64: tl.constexpr):
    """(valid, row) of the block's queries: rows ``perm[b, h, group*C + offs_m]`` (or ``group*C + offs_m`` without
    PERMUTE_Q); slots past C, -1 padding and rows >= S are invalid and read row 0."""
    if PERMUTE_Q:
        perm_base = PERM + bh.to(tl.int64) * n_slots + group.to(tl.int64) * C
        q_idx = tl.load(perm_base + offs_m, mask=offs_m < C, other=-1)  # [BLOCK_M] int32
    else:
        q_idx = tl.where(offs_m < C, group * C + offs_m, -1)
    q_valid = (q_idx >= 0) & (q_idx < S)
    q_rows = tl.where(q_valid, q_idx, 0)
    if ROW64:
        q_rows = q_rows.to(tl.int64)
    return q_valid, q_rows


@triton.jit
def _e4m3_to_f32_div256(byte):
    """float8_e4m3fn bit patterns (uint8) -> fp32 value / 256, exactly, in registers on any architecture.

    Moving e4m3's sign and its 7 exponent/mantissa bits into an fp16's (s eeee mmm -> s 0eeee mmm0000000) gives
    2^-8 times the value, normals and subnormals alike (the caller folds the 256 into its row scale). The NaN
    pattern (0x7f/0xff) is not special-cased (the cache clamps residuals to +-448 before storing)."""
    b = byte.to(tl.int16)
    bits = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _sparse_attn_fwd(
    Q, K, V, PERM, KV_IDX, OUT, LSE, RES, RES_SCALE, RES_COEF, RES_MEAN,
    sm_scale_log2,  # softmax scale * log2(e)
    one,  # 1.0 (Q_REGS)
    H, S, SK, n_slots,  # n_slots: G*C entries of perm per (b, h); SK: KV length
    K_ALLOC, C,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_ob, stride_oh, stride_os, stride_od,
    stride_rb, stride_rh, stride_rs, stride_rd,
    stride_cb, stride_ch, stride_cs,  # residual scale [B, H, S]
    stride_eb, stride_eh, stride_es,  # residual coef [B, H, S] (int4_group)
    stride_mb, stride_mh, stride_mg, stride_md,  # residual group mean rows [B, H, G, D] (int4_group)
    M_BLOCKS: tl.constexpr,  # programs per group: ceil(C / BLOCK_M)
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    RETURN_LSE: tl.constexpr,
    RES_KIND: tl.constexpr,  # 0 none, 1 plain, 2 fp8_row (uint8 bit patterns), 3 int4_row, 4 int4_group
    MASK_FROM_COUNT: tl.constexpr,  # trailing -1 slots: loop to the group's valid count, mask by slot < count
    ROW64: tl.constexpr,  # int64 row offsets (needed when a (b, h) slice of q/k/v/out/residual spans >= 2^31 elements)
    CACHE: tl.constexpr,  # cache modifier of the K/V gathers ("" or ".cg")
    PERMUTE_Q: tl.constexpr,  # False: group g reads/writes query rows g*C.. directly (benchmark baseline only)
    EXP_MODE: tl.constexpr,  # fastexp.exp2's MODE: 0 fp32 exp2, 1 packed ex2.approx.f16x2 (CUDA), 2 its emulation
    LAZY_RESCALE: tl.constexpr,  # move a row's running max only when it grows by > RESCALE_LOG2 (FA4); see below
    Q_REGS: tl.constexpr,  # sm_90: Q as the register operand of the QK^T wgmma (not re-read from shared memory)
    PIPELINE_QK: tl.constexpr,  # issue tile n+1's QK^T before tile n's softmax (FA3's intra-warpgroup overlap)
    FAST_PROLOGUE: tl.constexpr,  # valid count from the row's last 128 slots first; s_first from tile 0's product
):
    pid_m = tl.program_id(0)  # group * M_BLOCKS + block inside the group
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    group = pid_m // M_BLOCKS
    row0 = (pid_m % M_BLOCKS) * BLOCK_M

    offs_m = row0 + tl.arange(0, BLOCK_M)  # [BLOCK_M] rows inside the group
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)

    # query indices of this block; rows past C or past the padded tail read -1
    q_valid, q_rows = _query_rows(PERM, bh, group, n_slots, C, S, offs_m, PERMUTE_Q, ROW64)

    q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    q = tl.load(q_base + q_rows[:, None] * stride_qs + offs_d[None, :] * stride_qd, mask=q_valid[:, None], other=0.0)
    if Q_REGS:  # times a runtime 1.0 (exact): a computed q stays in registers as the wgmma's A operand, so each tile's
        q = (q.to(tl.float32) * one).to(q.dtype)  # QK^T reads only K from shared memory (Triton 3.6 on sm_90)

    k_base = K + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + h.to(tl.int64) * stride_vh
    idx_base = KV_IDX + (bh.to(tl.int64) * (n_slots // C) + group) * K_ALLOC

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    if MASK_FROM_COUNT:
        if FAST_PROLOGUE:
            n_end = _valid_count_tail_first(idx_base, K_ALLOC, 128)
        else:
            n_end = _valid_count(idx_base, K_ALLOC, 128)
        # The tail slots of the group's last tile repeat the group's first key: its score is a real one, so the running
        # max stays exact and the scores need no mask; their V rows load as zeros (the load's mask: no work per
        # score), and their n_pad weights are taken out of l after the loop with this key's score, computed here.
        kv_first = tl.load(idx_base)
        kv_first = tl.where((kv_first >= 0) & (kv_first < SK), kv_first, 0)
        if FAST_PROLOGUE:  # the score is taken from tile 0's product (its slot 0) in the loop
            s_first = tl.zeros([BLOCK_M], dtype=tl.float32)
        else:
            k_first = tl.load(k_base + kv_first.to(tl.int64) * stride_ks + offs_d * stride_kd).to(tl.float32)
            s_first = tl.sum(q.to(tl.float32) * k_first[None, :], 1) * sm_scale_log2  # [BLOCK_M], base-2 units
    else:
        n_end = K_ALLOC
        kv_first = -1
    # One tile body for every tile (for MASK_FROM_COUNT, full tiles and the last one alike: no per-score mask).
    # The first tile holds at least one valid slot (the contract), so the running max is finite from there on.
    if PIPELINE_QK:  # tile 0's scores before the loop; each iteration issues the next tile's QK^T first
        kv_rows_nx, live_nx, col_ok_nx = _kv_tile(idx_base, 0, n_end, kv_first, SK, offs_n, ROW64)
        k = tl.load(k_base + kv_rows_nx[:, None] * stride_ks + offs_d[None, :] * stride_kd, cache_modifier=CACHE)
        qk_nx = tl.dot(q, tl.trans(k))
    for n0 in range(0, n_end, BLOCK_N):
        if PIPELINE_QK:  # this tile's scores came from the previous iteration; tile n0 + BLOCK_N's product (past the
            qk, kv_rows, live, col_ok = qk_nx, kv_rows_nx, live_nx, col_ok_nx  # end: all slots repeat kv_first,
            kv_rows_nx, live_nx, col_ok_nx = _kv_tile(idx_base, n0 + BLOCK_N, n_end, kv_first, SK, offs_n, ROW64)
            k = tl.load(k_base + kv_rows_nx[:, None] * stride_ks + offs_d[None, :] * stride_kd,  # never used)
                        cache_modifier=CACHE)
            qk_nx = tl.dot(q, tl.trans(k))  # asynchronous: overlaps this tile's softmax
        else:
            kv_rows, live, col_ok = _kv_tile(idx_base, n0, n_end, kv_first, SK, offs_n, ROW64)
            k = tl.load(k_base + kv_rows[:, None] * stride_ks + offs_d[None, :] * stride_kd, cache_modifier=CACHE)
            qk = tl.dot(q, tl.trans(k))  # [BLOCK_M, BLOCK_N] fp32
        if not MASK_FROM_COUNT:  # -1 anywhere: mask those scores; a tile may be all masked before any valid slot
            qk = tl.where(col_ok[None, :], qk, float("-inf"))
        if FAST_PROLOGUE and MASK_FROM_COUNT:
            if n0 == 0:  # slot 0 = kv_first: the pad slots' score, as the same product computes it
                s_first = tl.sum(tl.where(offs_n[None, :] == 0, qk, 0.0), 1) * sm_scale_log2
        m_tile = tl.max(qk, 1) * sm_scale_log2
        if LAZY_RESCALE:  # a stale max is exact (O and l share it); scores stay <= 2^RESCALE_LOG2 (fits fp16)
            m_new = tl.where(m_tile > m_i + RESCALE_LOG2, m_tile, m_i)
        else:
            m_new = tl.maximum(m_i, m_tile)
        if not MASK_FROM_COUNT:
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = fastexp.exp2(qk * sm_scale_log2 - m_new[:, None], EXP_MODE)  # one FMA + exp2 per score
        alpha = tl.math.exp2(m_i - m_new)
        if EXP_MODE == 0:
            l_i = l_i * alpha + tl.sum(p, 1)
        else:  # fp16 P: summed in fp32
            l_i = l_i * alpha + tl.sum(p.to(tl.float32), 1)
        if LAZY_RESCALE:  # block-uniform branch: skip the BLOCK_M x D multiply when no row's max moved
            if tl.sum((m_new != m_i).to(tl.int32), 0) > 0:
                acc = acc * alpha[:, None]
        else:
            acc = acc * alpha[:, None]
        v = tl.load(v_base + kv_rows[:, None] * stride_vs + offs_d[None, :] * stride_vd, mask=live[:, None],
                    other=0.0, cache_modifier=CACHE)
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    if MASK_FROM_COUNT:
        n_pad = tl.cdiv(n_end, BLOCK_N) * BLOCK_N - n_end
        l_i = l_i - n_pad.to(tl.float32) * tl.math.exp2(s_first - m_i)

    out = acc / l_i[:, None]
    # the rows again (L1/L2 hits), so their 64-bit offsets are not kept in registers through the loop
    q_valid, q_rows = _query_rows(PERM, bh, group, n_slots, C, S, offs_m, PERMUTE_Q, ROW64)
    if RETURN_LSE:
        lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453  # natural log
        tl.store(LSE + bh.to(tl.int64) * S + q_rows, lse, mask=q_valid)
    # epilogue in two column halves (halves the live registers: out, R and their row addresses)
    halves = tl.split(tl.permute(tl.reshape(out, [BLOCK_M, 2, HEAD_DIM // 2]), (0, 2, 1)))
    _store_half(halves[0], 0, OUT, b, h, q_rows, q_valid, stride_ob, stride_oh, stride_os, stride_od,
                RES, RES_SCALE, RES_COEF, RES_MEAN, group, stride_rb, stride_rh, stride_rs, stride_rd,
                stride_cb, stride_ch, stride_cs, stride_eb, stride_eh, stride_es, stride_mb, stride_mh, stride_mg,
                stride_md, HEAD_DIM // 2, RES_KIND)
    _store_half(halves[1], HEAD_DIM // 2, OUT, b, h, q_rows, q_valid, stride_ob, stride_oh, stride_os, stride_od,
                RES, RES_SCALE, RES_COEF, RES_MEAN, group, stride_rb, stride_rh, stride_rs, stride_rd,
                stride_cb, stride_ch, stride_cs, stride_eb, stride_eh, stride_es, stride_mb, stride_mh, stride_mg,
                stride_md, HEAD_DIM // 2, RES_KIND)


@triton.jit
def _store_half(out, col0, OUT, b, h, q_rows, q_valid, stride_ob, stride_oh, stride_os, stride_od,
                RES, RES_SCALE, RES_COEF, RES_MEAN, group, stride_rb, stride_rh, stride_rs, stride_rd,
                stride_cb, stride_ch, stride_cs, stride_eb, stride_eh, stride_es, stride_mb, stride_mh, stride_mg,
                stride_md, WIDTH: tl.constexpr, RES_KIND: tl.constexpr):
    """Columns col0 .. col0 + WIDTH of the output rows: + residual (original query order, dequantised here), store.

    ``group`` is the query group all these rows belong to (int4_group reads that group's mean row once)."""
    offs_d = col0 + tl.arange(0, WIDTH)
    if RES_KIND != 0:
        r_base = RES + b.to(tl.int64) * stride_rb + h.to(tl.int64) * stride_rh + q_rows[:, None] * stride_rs
        if RES_KIND >= 3:  # int4_row / int4_group: byte j holds element 2j in its low nibble, 2j + 1 in its high one
            offs_j = col0 // 2 + tl.arange(0, WIDTH // 2)
            byte = tl.load(r_base + offs_j[None, :] * stride_rd, mask=q_valid[:, None], other=0x88).to(tl.int32)
            r = tl.reshape(tl.join((byte & 0xF) - 8, (byte >> 4) - 8), [out.shape[0], WIDTH]).to(tl.float32)
        else:
            r = tl.load(r_base + offs_d[None, :] * stride_rd, mask=q_valid[:, None], other=0)
            r = _e4m3_to_f32_div256(r) if RES_KIND == 2 else r.to(tl.float32)
        if RES_KIND >= 2:
            c_base = RES_SCALE + b.to(tl.int64) * stride_cb + h.to(tl.int64) * stride_ch
            row_scale = tl.load(c_base + q_rows * stride_cs, mask=q_valid, other=0.0).to(tl.float32)  # bf16 for kind 4
            if RES_KIND == 2:
                row_scale = row_scale * 256.0
            r = r * row_scale[:, None]
        if RES_KIND == 4:  # int4_group: + coef (e4m3 bits) x the group's mean row (bf16)
            e_base = RES_COEF + b.to(tl.int64) * stride_eb + h.to(tl.int64) * stride_eh
            coef = _e4m3_to_f32_div256(tl.load(e_base + q_rows * stride_es, mask=q_valid, other=0)) * 256.0
            m_base = RES_MEAN + b.to(tl.int64) * stride_mb + h.to(tl.int64) * stride_mh + group.to(tl.int64) * stride_mg
            mean = tl.load(m_base + offs_d * stride_md).to(tl.float32)  # [WIDTH], once per program
            r = r + coef[:, None] * mean[None, :]
        out = out + r
    o_base = OUT + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
    tl.store(o_base + q_rows[:, None] * stride_os + offs_d[None, :] * stride_od, out.to(OUT.dtype.element_ty),
             mask=q_valid[:, None])


_RES_KINDS = {None: 0, "plain": 1, "fp8_row": 2, "int4_row": 3, "int4_group": 4}


def residual_args(residual, dummy: torch.Tensor) -> tuple[int, tuple, tuple]:
    """(RES_KIND, the 4 residual pointers, their 14 strides) of a ``kernels.Residual`` or None, as ``_store_half``
    takes them (fp8 data and coef as uint8 bits; unused pointers are ``dummy``, unused strides 0)."""
    kind = _RES_KINDS[None if residual is None else residual.kind]
    if residual is None:
        return kind, (dummy,) * 4, (0,) * 14
    data = residual.data.view(torch.uint8) if kind == 2 else residual.data  # fp8 read as bits: any architecture
    scale = residual.scale if residual.scale is not None else dummy
    coef = residual.coef.view(torch.uint8) if residual.coef is not None else dummy
    mean = residual.mean if residual.mean is not None else dummy
    strides = (*data.stride(), *(residual.scale.stride() if residual.scale is not None else (0, 0, 0)),
               *(residual.coef.stride() if residual.coef is not None else (0, 0, 0)),
               *(residual.mean.stride() if residual.mean is not None else (0, 0, 0, 0)))
    return kind, (data, scale, coef, mean), strides


def config(head_dim: int, capability: tuple[int, int] | None) -> dict:
    """Default launch config (block_n, num_warps, num_stages, maxnreg) on a CUDA capability (None: the interpreter).

    Every default compiles without register spills at D = 128, BLOCK_M = 128 for every residual kind
    (``tests/ptxas_report.py`` compiles the kernel offline for sm_80 / sm_89 / sm_90 and prints registers, spills and
    shared memory; the GPU benchmark prints the loaded kernel's ``n_regs`` / ``n_spills``) and fits the architecture's
    shared memory (sm_86 / sm_89: 99 KiB per block). sm_90 (H100/H200): BLOCK_N 128, 8 warps, lazy rescale, fp32
    exponentials: the fastest spill-free config at the worst point of 18 timed side by side on the H200
    (docs/kernels-benchmark.md, "Softmax options"): min efficiency 0.709 vs 0.683 for the previous default (BLOCK_N
    32, 8 warps capped at 128 registers: two programs per SM), 14B 720p 0.750-0.807; the lazy rescale takes 6-11 %
    off BLOCK_N 128's time. Measured slower and kept as options only: ``exp`` "f16x2" (packed exponentials,
    kernels/triton/fastexp.py: +3-8 % time; ptxas issues one MUFU.EX2.F16 per element on sm_80-sm_90), ``q_regs`` (Q
    held in registers for the QK^T wgmma: +4-22 %), ``pipeline_qk`` (tile n+1's QK^T issued before tile n's softmax:
    Triton 3.6 still waits for it before the P @ V product; one more score tile in registers). ``lazy_rescale``: see
    the module docstring. ``tests/bench_kernels.py --reuse`` times the combinations side by side."""
    major, minor = capability or (9, 0)
    softmax = dict(exp="fp32", q_regs=False, pipeline_qk=False, fast_prologue=False)
    if (major, minor) == (9, 0):  # H100/H200: 207-216 registers (one program per SM), 161 KiB shared
        return dict(block_n=128, num_warps=8, num_stages=3, maxnreg=None, lazy_rescale=True, **softmax)
    if major >= 9:  # other sm_9x+ (unmeasured; sm_120 has 99 KiB shared): the previous sm_90 tile
        return dict(block_n=32, num_warps=8, num_stages=3, maxnreg=128, lazy_rescale=False, **softmax)
    # sm_80-89: ~200 registers, 64 KiB shared
    return dict(block_n=32, num_warps=8, num_stages=3, maxnreg=None, lazy_rescale=False, **softmax)


def group_shape(perm, kv_idx):
    """(G, K_alloc, G*C, C) of a launch from ``perm`` int32 [B, H, G*C] and ``kv_idx`` int32 [B, H, G, K_alloc].

    Raises:
        ValueError: ``perm``'s width is not a multiple of G."""
    G, k_alloc = kv_idx.shape[2], kv_idx.shape[3]
    n_slots = perm.shape[-1]
    if n_slots % G:
        raise ValueError(f"perm width must be a multiple of kv_idx's G = {G}, got {n_slots}")
    return G, k_alloc, n_slots, n_slots // G


def needs_row64(q, k, v, out, residual):
    """True when some (b, h) slice of q / k / v / out / the residual's data reaches past 2^31 elements (the kernels'
    row offsets are int32 otherwise). All are [B, H, S, D]-shaped views (the residual's last dim may be D/2)."""
    views = [q, k, v, out] + ([] if residual is None else [residual.data])
    reach = max(sum((n - 1) * abs(st) for n, st in zip(t.shape[2:], t.stride()[2:])) for t in views if t is not None)
    return reach >= 2**31


def launch_args(q, k, v, perm, kv_idx, *, scale=None, return_lse=False, out=None, residual=None, block_n=None,
                num_warps=None, num_stages=None, mask_from_count=True, cache="", block_m=None, row64=None,
                permute_q=True, maxnreg=None, exp=None, lazy_rescale=None, q_regs=None,
                pipeline_qk=None, fast_prologue=None, capability=None):
    """(grid, positional args, meta) of one launch, and (out, lse); shared by the op and ``tests/ptxas_report.py``.

    ``exp`` (None: the config's) goes through ``fastexp.mode_for``: "f16x2" runs fp32 exponentials under the
    interpreter (capability None) and below sm_75."""
    B, H, S, D = q.shape
    G, k_alloc, n_slots, C = group_shape(perm, kv_idx)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    block_m = block_m or min(128, max(16, triton.next_power_of_2(C)))
    m_blocks = triton.cdiv(C, block_m)
    cfg = config(D, capability)
    bn, warps, stages = block_n or cfg["block_n"], num_warps or cfg["num_warps"], num_stages or cfg["num_stages"]
    maxnreg = cfg["maxnreg"] if maxnreg is None else maxnreg  # 0 lifts the cap
    exp_mode = fastexp.mode_for(cfg["exp"] if exp is None else exp, capability)
    lazy_rescale = cfg["lazy_rescale"] if lazy_rescale is None else bool(lazy_rescale)
    q_regs = cfg["q_regs"] if q_regs is None else bool(q_regs)
    pipeline_qk = cfg["pipeline_qk"] if pipeline_qk is None else bool(pipeline_qk)
    fast_prologue = cfg["fast_prologue"] if fast_prologue is None else bool(fast_prologue)
    if row64 is None:
        row64 = needs_row64(q, k, v, out, residual)
    perm = perm.contiguous()  # no-ops for the cache's arrays (always contiguous)
    kv_idx = kv_idx.contiguous()
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(B, H, S, dtype=torch.float32, device=q.device) if return_lse else out  # dummy when unused
    kind, res_ptrs, res_strides = residual_args(residual, out)
    grid = (G * m_blocks, B * H)
    args = (q, k, v, perm, kv_idx, out, lse, *res_ptrs, scale * _LOG2E, 1.0, H, S, k.shape[2], n_slots, k_alloc, C,
            *q.stride(), *k.stride(), *v.stride(), *out.stride(), *res_strides)
    meta = dict(M_BLOCKS=m_blocks, HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=bn, RETURN_LSE=return_lse, RES_KIND=kind,
                MASK_FROM_COUNT=mask_from_count, ROW64=bool(row64), CACHE=cache, PERMUTE_Q=permute_q,
                EXP_MODE=exp_mode, LAZY_RESCALE=lazy_rescale, Q_REGS=bool(q_regs), PIPELINE_QK=bool(pipeline_qk),
                FAST_PROLOGUE=bool(fast_prologue), num_warps=warps, num_stages=stages)
    if maxnreg:
        meta["maxnreg"] = maxnreg
    return grid, args, meta, (out, lse)


def sparse_attention(q, k, v, perm, kv_idx, *, scale=None, return_lse=False, out=None, residual=None, **tuning):
    """Token-sparse attention on the Triton kernel; contract of ``kernels.sparse_attention`` (the formats are defined below).

    Args:
        q, k, v: ``[B, H, S, D]`` / ``[B, H, Sk, D]``, fp16 or bf16, any strides (read in place; unit stride on D is
            fastest), D a power of two in [16, 256].
        perm: int32 ``[B, H, G*C]`` query groups, -1 padding at the tail.
        kv_idx: int32 ``[B, H, G, K_alloc]`` each group's KV token indices, -1 = masked slot. Any K_alloc.
        scale: softmax scale; None means 1/sqrt(D).
        return_lse: also return the fp32 row log-sum-exp ``[B, H, S]`` (natural log, scale applied).
        out: ``[B, H, S, D]`` in q's dtype, any strides: the kernel stores through them (None: a new contiguous one).
        residual: ``kernels.Residual`` added in fp32 in the epilogue, read by strides, dequantised in registers.
        tuning: ``mask_from_count`` (default True: the -1 slots are trailing, each program loops to its group's valid
            count; False masks -1 anywhere), ``block_n``, ``num_warps``, ``num_stages``, ``block_m``, ``cache``,
            ``row64`` (None: int64 row offsets only when some (b, h) slice of q/k/v/out/residual spans >= 2^31
            elements; the (b, h) base offsets are always 64-bit),
            ``permute_q`` (False ignores perm: a benchmark baseline, not the contract), ``exp`` ("fp32", "f16x2":
            packed half-precision exponentials, fp32 under the interpreter and below sm_75; "f16_emulated": their
            roundings in plain Triton, for tests), ``lazy_rescale`` (bool), ``q_regs`` (bool), ``pipeline_qk``
            (bool: tile n+1's QK^T issued before tile n's softmax; one extra, unused product per program),
            ``fast_prologue`` (bool: the valid count from the row's last 128 slots first, one dependent load instead
            of two, and the pad slots' score from tile 0's product instead of a separate K-row load and dot). With
            fp16 exponentials the LSE is within 4e-3 (the argument is rounded to fp16), O within the bf16/fp16
            rounding of P as before.
    Returns:
        ``out`` (original query order; queries absent from ``perm`` are left as they were), or (out, LSE).
    Raises:
        ValueError: a group width C = G*C / G that does not divide ``perm``'s width.
    """
    cap = torch.cuda.get_device_capability(q.device) if q.device.type == "cuda" else None
    grid, args, meta, (out, lse) = launch_args(q, k, v, perm, kv_idx, scale=scale, return_lse=return_lse, out=out,
                                               residual=residual, capability=cap, **tuning)
    _sparse_attn_fwd[grid](*args, **meta)
    return (out, lse) if return_lse else out


def compiled_kernels() -> list:
    """Every compiled variant of the sparse kernel in this process (triton ``CompiledKernel``, loaded), so the GPU
    benchmark and test can read ``n_regs`` / ``n_spills`` / ``metadata.num_warps`` (triton 3.x internals)."""
    out = []
    for caches in getattr(_sparse_attn_fwd, "device_caches", {}).values():  # none under the interpreter
        for ck in caches[0].values():
            ck._init_handles()
            out.append(ck)
    return out
