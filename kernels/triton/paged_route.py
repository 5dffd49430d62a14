"""The three small launches around flash-attn-4's paged-KV kernel in the ``flash_attn4`` sparse route
(kernels/flash_attn4/__init__.py; docs/kernels.md, "flash_attn4 sparse"): the page table, the query gather and the
output scatter. Kept here (Triton only, no flash-attn import) so the CPU tests run them under the interpreter.

Mapping (one FA4 batch entry per query group ``n = (b*H + h)*G + g``, one-token pages): the K/V "page pool" is the
model's K/V storage seen as rows of D elements, so the page of token ``t`` of (b, h) is
``b*page_b + h*page_h + t*page_s`` (the K/V strides divided by D; ``[B, H, S, D]`` contiguous: ``(H*S, S, 1)``;
a ``[B, S, H*D]`` view: ``(S*H, 1, H)``). Everything is int32 (the caller checks the largest page id fits), nothing
leaves the device, and each launch is one pass over its data:

- ``page_table``: kv_idx int32 ``[B, H, G, K_alloc]`` (sorted, trailing -1) -> table int32 ``[B*H*G, K_alloc]`` and
  each group's valid count int32 ``[B*H*G]`` (FA4's ``seqused_k``); a -1 slot gets the (b, h) row's page 0 (FA4
  reads no page past ``seqused_k``; any in-pool value would do);
- ``gather_queries``: q ``[B, H, S, D]`` (any strides) -> ``[B*H*G, C, 1, D]`` contiguous in group order (perm's
  -1 slots as zero rows);
- ``scatter_output``: FA4's ``[B*H*G, C, 1, D]`` output (+ its LSE ``[B*H*G, 1, C]``) -> ``out`` ``[B, H, S, D]``
  (any strides) in the original query order, the residual (every ``kernels.Residual`` kind) added in fp32 before
  the rounding, by the Triton sparse kernel's own epilogue (``sparse_attention._store_half``).

Torch references of the three are beside them (``*_reference``); the tests compare them under the interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .sparse_attention import _store_half, residual_args

_BLOCK_K = 1024  # table slots per step


@triton.jit
def _page_table_fwd(KV_IDX, TABLE, USED, H, G, K_ALLOC, page_b, page_h, page_s, BLOCK_K: tl.constexpr):
    row = tl.program_id(0)  # (b*H + h)*G + g
    bh = row // G
    base = (bh // H) * page_b + (bh % H) * page_h  # int32: the caller checks the largest page id
    src = KV_IDX + row.to(tl.int64) * K_ALLOC
    dst = TABLE + row.to(tl.int64) * K_ALLOC
    offs = tl.arange(0, BLOCK_K)
    count = tl.zeros((), dtype=tl.int32)
    for k0 in range(0, K_ALLOC, BLOCK_K):
        live = k0 + offs < K_ALLOC
        idx = tl.load(src + k0 + offs, mask=live, other=-1)
        ok = idx >= 0
        tl.store(dst + k0 + offs, tl.where(ok, base + idx * page_s, base), mask=live)
        count += tl.sum(ok.to(tl.int32), 0)
    tl.store(USED + row, count)


@triton.jit
def _group_rows(PERM, bh, group, n_slots, C, S, offs_m):
    """(valid, row) of the queries at slots ``group*C + offs_m`` of perm's (b, h) row (-1, past C or >= S: invalid)."""
    q_idx = tl.load(PERM + bh.to(tl.int64) * n_slots + group * C + offs_m, mask=offs_m < C, other=-1)
    valid = (q_idx >= 0) & (q_idx < S)
    return valid, tl.where(valid, q_idx, 0)


@triton.jit
def _gather_queries_fwd(Q, PERM, QG, H, S, n_slots, C, stride_qb, stride_qh, stride_qs, stride_qd,
                        M_BLOCKS: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    pid = tl.program_id(0)  # group * M_BLOCKS + block inside the group
    bh = tl.program_id(1)
    group = pid // M_BLOCKS
    offs_m = (pid % M_BLOCKS) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    valid, rows = _group_rows(PERM, bh, group, n_slots, C, S, offs_m)
    src = Q + (bh // H).to(tl.int64) * stride_qb + (bh % H).to(tl.int64) * stride_qh
    x = tl.load(src + rows.to(tl.int64)[:, None] * stride_qs + offs_d[None, :] * stride_qd, mask=valid[:, None],
                other=0.0)
    dst = QG + (bh.to(tl.int64) * (n_slots // C) + group) * C * HEAD_DIM
    tl.store(dst + offs_m[:, None] * HEAD_DIM + offs_d[None, :], x, mask=(offs_m < C)[:, None])


@triton.jit
def _scatter_output_fwd(
    OG, LSE_G, PERM, OUT, LSE, RES, RES_SCALE, RES_COEF, RES_MEAN, H, S, n_slots, C,
    stride_ob, stride_oh, stride_os, stride_od,
    stride_rb, stride_rh, stride_rs, stride_rd, stride_cb, stride_ch, stride_cs, stride_eb, stride_eh, stride_es,
    stride_mb, stride_mh, stride_mg, stride_md,
    M_BLOCKS: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, RETURN_LSE: tl.constexpr,
    RES_KIND: tl.constexpr,
):
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    group = pid // M_BLOCKS
    offs_m = (pid % M_BLOCKS) * BLOCK_M + tl.arange(0, BLOCK_M)
    valid, rows = _group_rows(PERM, bh, group, n_slots, C, S, offs_m)
    n = bh.to(tl.int64) * (n_slots // C) + group
    if RETURN_LSE:
        lse = tl.load(LSE_G + n * C + offs_m, mask=valid, other=0.0)
        tl.store(LSE + bh.to(tl.int64) * S + rows, lse, mask=valid)
    rows = rows.to(tl.int64)
    src = OG + n * C * HEAD_DIM + offs_m[:, None] * HEAD_DIM
    for half in tl.static_range(2):  # two column halves: half the live registers (the sparse kernel's epilogue)
        offs_d = half * (HEAD_DIM // 2) + tl.arange(0, HEAD_DIM // 2)
        o = tl.load(src + offs_d[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
        _store_half(o, half * (HEAD_DIM // 2), OUT, b, h, rows, valid, stride_ob, stride_oh, stride_os, stride_od,
                    RES, RES_SCALE, RES_COEF, RES_MEAN, group, stride_rb, stride_rh, stride_rs, stride_rd,
                    stride_cb, stride_ch, stride_cs, stride_eb, stride_eh, stride_es, stride_mb, stride_mh, stride_mg,
                    stride_md, HEAD_DIM // 2, RES_KIND)


def _blocks(C: int) -> tuple[int, int]:
    block_m = min(128, max(16, triton.next_power_of_2(C)))
    return block_m, triton.cdiv(C, block_m)


def page_table(kv_idx: torch.Tensor, page_strides: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """FA4's page table and ``seqused_k`` from a selection, one launch.

    Args:
        kv_idx: int32 ``[B, H, G, K_alloc]``, each row's valid indices first (sorted), then -1.
        page_strides: (page_b, page_h, page_s): the page id of token t of (b, h) is b*page_b + h*page_h + t*page_s;
            the caller guarantees every page id of a valid index fits int32.
    Returns:
        (table int32 ``[B*H*G, K_alloc]``, used int32 ``[B*H*G]``): a -1 slot holds the (b, h) row's page of token 0.
    """
    B, H, G, k_alloc = kv_idx.shape
    kv = kv_idx.contiguous()
    rows = B * H * G
    table = torch.empty(rows, k_alloc, dtype=torch.int32, device=kv.device)
    used = torch.empty(rows, dtype=torch.int32, device=kv.device)
    if rows:
        _page_table_fwd[(rows,)](kv, table, used, H, G, k_alloc, *page_strides, BLOCK_K=_BLOCK_K, num_warps=4)
    return table, used


def page_table_reference(kv_idx, page_strides):
    """``page_table`` in torch (int64 arithmetic, then int32)."""
    B, H, G, k_alloc = kv_idx.shape
    pb, ph, ps = page_strides
    base = (torch.arange(B, device=kv_idx.device).view(B, 1, 1, 1) * pb
            + torch.arange(H, device=kv_idx.device).view(1, H, 1, 1) * ph)
    idx = kv_idx.long()
    table = torch.where(idx >= 0, base + idx * ps, base.expand_as(idx))
    return table.to(torch.int32).reshape(B * H * G, k_alloc), (idx >= 0).sum(-1).to(torch.int32).reshape(-1)


def gather_queries(q: torch.Tensor, perm: torch.Tensor, C: int) -> torch.Tensor:
    """Queries in group order, one launch: q ``[B, H, S, D]`` (any strides; D a power of two), perm int32
    ``[B, H, G*C]`` (-1 padding) -> ``[B*H*G, C, 1, D]`` contiguous in q's dtype, perm's -1 slots as zero rows."""
    B, H, S, D = q.shape
    n_slots = perm.shape[-1]
    G = n_slots // C
    perm = perm.contiguous()
    qg = torch.empty(B * H * G, C, 1, D, dtype=q.dtype, device=q.device)
    block_m, m_blocks = _blocks(C)
    if qg.numel():
        _gather_queries_fwd[(G * m_blocks, B * H)](q, perm, qg, H, S, n_slots, C, *q.stride(), M_BLOCKS=m_blocks,
                                                   BLOCK_M=block_m, HEAD_DIM=D, num_warps=4)
    return qg


def gather_queries_reference(q, perm, C):
    """``gather_queries`` in torch."""
    B, H, S, D = q.shape
    slots = perm.long()
    rows = torch.gather(q, 2, slots.clamp_min(0).unsqueeze(-1).expand(-1, -1, -1, D))
    rows = torch.where((slots >= 0).unsqueeze(-1), rows, torch.zeros((), dtype=q.dtype, device=q.device))
    return rows.reshape(-1, C, 1, D).contiguous()


def scatter_output(o_groups, lse_groups, perm, out, residual=None):
    """FA4's group-order output back to the query order (+ residual), one launch.

    Args:
        o_groups: ``[B*H*G, C, 1, D]`` contiguous (fp16/bf16/fp32); lse_groups: fp32 ``[B*H*G, 1, C]`` contiguous or
            None; perm int32 ``[B, H, G*C]``; out ``[B, H, S, D]`` any strides (written where perm names a query);
            residual: a ``kernels.Residual`` or None (checked by the caller).
    Returns:
        ``out``, or (out, LSE fp32 ``[B, H, S]``) when lse_groups is given.
    """
    B, H, S, D = out.shape
    n_slots = perm.shape[-1]
    C = o_groups.shape[1]
    G = n_slots // C
    perm = perm.contiguous()
    lse = None if lse_groups is None else torch.empty(B, H, S, dtype=torch.float32, device=out.device)
    kind, res_ptrs, res_strides = residual_args(residual, out)
    block_m, m_blocks = _blocks(C)
    if o_groups.numel():
        _scatter_output_fwd[(G * m_blocks, B * H)](
            o_groups, o_groups if lse_groups is None else lse_groups, perm, out, out if lse is None else lse,
            *res_ptrs, H, S, n_slots, C, *out.stride(), *res_strides,
            M_BLOCKS=m_blocks, BLOCK_M=block_m, HEAD_DIM=D, RETURN_LSE=lse is not None, RES_KIND=kind, num_warps=4)
    return out if lse is None else (out, lse)


def scatter_output_reference(o_groups, lse_groups, perm, out, residual=None):
    """``scatter_output`` in torch (float64 residual sum, then out's dtype)."""
    B, H, S, D = out.shape
    C = o_groups.shape[1]
    dest = perm[:, :, :S].long()  # the -1 padding slots are the last G*C - S entries (perm's contract)
    full = torch.zeros(B, H, S, D, dtype=torch.float64, device=out.device)
    full.scatter_(2, dest.unsqueeze(-1).expand(-1, -1, -1, D), o_groups.reshape(B, H, -1, D)[:, :, :S].double())
    if residual is not None:
        full += residual.dequantize(torch.float64, perm)
    out.copy_(full.to(out.dtype))
    if lse_groups is None:
        return out
    lse = torch.empty(B, H, S, dtype=torch.float32, device=out.device)
    lse.scatter_(2, dest, lse_groups.reshape(B, H, -1)[:, :, :S])
    return out, lse
