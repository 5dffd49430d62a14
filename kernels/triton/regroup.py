"""Moving rows between the model's query order and query-group order, for kernels that work on whole groups.

A group-order kernel (the CuTeDSL sparse kernel, kernels/cutedsl) reads the C queries of group g of (b, h) as rows
``g*C .. g*C+C-1`` of one ``(B*H*G, C, D)`` block and writes its output and LSE in that order. These Triton kernels
gather the query rows into that block (``gather_groups``), scatter the output rows back to the original order
while adding the cached residual (``scatter_groups``, the residual dequantised in registers exactly as the Triton
sparse kernel's epilogue does: ``kernels/triton/sparse_attention.py::_store_half``), and count each group's valid
``kv_idx`` slots (``valid_counts``). One launch each, no host synchronisation.

Layouts: q / out ``[B, H, S, D]`` any strides (views of ComfyUI's ``[B, S, H*D]``); perm int32 ``[B, H, G*C]`` with
-1 in the padded tail; kv_idx int32 ``[B, H, G, K_alloc]`` sorted with trailing -1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .sparse_attention import _store_half, residual_args


@triton.jit
def _gather_groups(Q, PERM, QG, H, S, n_slots, C,
                   stride_qb, stride_qh, stride_qs, stride_qd,
                   HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    """Group block ``(group, b*h)``: row r of QG's group = q[b, h, perm[b, h, g*C + r]] (zeros for -1 slots)."""
    g = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    slot = g * C + offs_m
    rows = tl.load(PERM + bh * n_slots + slot, mask=offs_m < C, other=-1)
    ok = (rows >= 0) & (rows < S)
    src = Q + b * stride_qb + h * stride_qh + tl.where(ok, rows, 0).to(tl.int64)[:, None] * stride_qs
    x = tl.load(src + offs_d[None, :] * stride_qd, mask=ok[:, None], other=0.0)
    dst = QG + (bh * n_slots + slot.to(tl.int64))[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(dst, x, mask=(offs_m < C)[:, None])


@triton.jit
def _scatter_groups(OG, LSEG, PERM, OUT, LSE, RES, RES_SCALE, RES_COEF, RES_MEAN, H, S, n_slots, C,
                    stride_ob, stride_oh, stride_os, stride_od,
                    stride_rb, stride_rh, stride_rs, stride_rd,
                    stride_cb, stride_ch, stride_cs,
                    stride_eb, stride_eh, stride_es,
                    stride_mb, stride_mh, stride_mg, stride_md,
                    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, RES_KIND: tl.constexpr, WITH_LSE: tl.constexpr):
    g = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_m = tl.arange(0, BLOCK_M)
    slot = g * C + offs_m
    rows = tl.load(PERM + bh.to(tl.int64) * n_slots + slot, mask=offs_m < C, other=-1)
    ok = (rows >= 0) & (rows < S) & (offs_m < C)
    q_rows = tl.where(ok, rows, 0).to(tl.int64)
    src = (bh.to(tl.int64) * n_slots + slot.to(tl.int64))
    offs_d = tl.arange(0, HEAD_DIM)
    o = tl.load(OG + src[:, None] * HEAD_DIM + offs_d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    if WITH_LSE:
        lse = tl.load(LSEG + src, mask=ok, other=0.0)
        tl.store(LSE + bh.to(tl.int64) * S + q_rows, lse, mask=ok)
    halves = tl.split(tl.permute(tl.reshape(o, [BLOCK_M, 2, HEAD_DIM // 2]), (0, 2, 1)))
    _store_half(halves[0], 0, OUT, b, h, q_rows, ok, stride_ob, stride_oh, stride_os, stride_od,
                RES, RES_SCALE, RES_COEF, RES_MEAN, g, stride_rb, stride_rh, stride_rs, stride_rd,
                stride_cb, stride_ch, stride_cs, stride_eb, stride_eh, stride_es, stride_mb, stride_mh, stride_mg,
                stride_md, HEAD_DIM // 2, RES_KIND)
    _store_half(halves[1], HEAD_DIM // 2, OUT, b, h, q_rows, ok, stride_ob, stride_oh, stride_os, stride_od,
                RES, RES_SCALE, RES_COEF, RES_MEAN, g, stride_rb, stride_rh, stride_rs, stride_rd,
                stride_cb, stride_ch, stride_cs, stride_eb, stride_eh, stride_es, stride_mb, stride_mh, stride_mg,
                stride_md, HEAD_DIM // 2, RES_KIND)


@triton.jit
def _valid_counts(KV_IDX, COUNTS, K_ALLOC, STEPS: tl.constexpr):
    """Binary search for the first -1 of one row (validity is monotone along a row): STEPS >= log2(K_ALLOC) + 1."""
    row = tl.program_id(0).to(tl.int64)
    base = KV_IDX + row * K_ALLOC
    lo = 0  # slots before lo are valid
    hi = K_ALLOC  # slots from hi on are -1
    for _ in range(STEPS):
        mid = (lo + hi) // 2
        ok = tl.load(base + tl.minimum(mid, K_ALLOC - 1)) >= 0
        live = lo < hi
        hi = tl.where(live & ok, hi, tl.where(live, mid, hi))
        lo = tl.where(live & ok, mid + 1, lo)
    tl.store(COUNTS + row, lo)


def gather_groups(q: torch.Tensor, perm: torch.Tensor, group_size: int) -> torch.Tensor:
    """q ``[B, H, S, D]`` (any strides) -> contiguous ``[B*H*G, C, D]`` in group order (zeros in padded slots).

    Raises: ValueError when perm is not int32 ``[B, H, G*C]`` or C > 128."""
    B, H, S, D = q.shape
    _check(perm, q, group_size)
    n_slots = perm.shape[-1]
    qg = torch.empty(B * H * n_slots, D, dtype=q.dtype, device=q.device)
    _gather_groups[(n_slots // group_size, B * H)](
        q, perm.contiguous(), qg, H, S, n_slots, group_size, *q.stride(), HEAD_DIM=D, BLOCK_M=_block_m(group_size))
    return qg.view(B * H * (n_slots // group_size), group_size, D)


def scatter_groups(o_groups: torch.Tensor, perm: torch.Tensor, out: torch.Tensor, *, lse_groups=None, lse=None,
                   residual=None) -> None:
    """Group-order rows ``[B*H*G, C, D]`` -> ``out[b, h, perm[...]]`` ``[B, H, S, D]`` (any strides) + residual.

    Args: lse_groups fp32 ``[B*H*G, C]`` and lse fp32 ``[B, H, S]`` (contiguous) to scatter the LSE too; residual a
    ``kernels.Residual`` (plain / fp8_row / int4_row / int4_group: each program is one group, so it reads the
    group's mean row once) added in fp32 before rounding. Rows of padded slots are skipped.
    Raises: ValueError when o_groups is not contiguous ``[B*H*G, C, D]``, or lse / lse_groups not contiguous fp32 of
    those shapes (the kernel reads and writes them by flat offsets), or perm as in ``gather_groups``."""
    B, H, S, D = out.shape
    C = o_groups.shape[-2]
    _check(perm, out, C)
    n_slots = perm.shape[-1]
    if tuple(o_groups.shape) != (B * H * (n_slots // C), C, D) or not o_groups.is_contiguous():
        raise ValueError(f"o_groups must be contiguous [B*H*G, C, D] = {(B * H * (n_slots // C), C, D)}, got "
                         f"{tuple(o_groups.shape)} with strides {o_groups.stride()}")
    for name, t, shape in (("lse", lse, (B, H, S)), ("lse_groups", lse_groups, (B * H * (n_slots // C), C))):
        if lse is not None and (t is None or t.dtype != torch.float32 or tuple(t.shape) != shape
                                or not t.is_contiguous()):
            raise ValueError(f"{name} must be contiguous float32 {shape} (lse and lse_groups come together), got "
                             f"{None if t is None else (t.dtype, tuple(t.shape), t.stride())}")
    if residual is not None and residual.mean is not None and residual.mean.shape[2] != n_slots // C:
        raise ValueError(f"int4_group residual mean must have G = {n_slots // C} rows per head (perm's width / C), "
                         f"got {tuple(residual.mean.shape)}")
    kind, res_ptrs, res_strides = residual_args(residual, out)
    with_lse = lse is not None
    _scatter_groups[(n_slots // C, B * H)](
        o_groups, lse_groups if with_lse else o_groups, perm.contiguous(), out, lse if with_lse else out, *res_ptrs,
        H, S, n_slots, C, *out.stride(), *res_strides,
        HEAD_DIM=D, BLOCK_M=_block_m(C), RES_KIND=kind, WITH_LSE=with_lse)


def valid_counts(kv_idx: torch.Tensor) -> torch.Tensor:
    """int32 ``[B*H*G]``: each group's number of slots before its first -1 (kv_idx ``[B, H, G, K_alloc]``)."""
    kv = kv_idx.contiguous()
    rows = kv.shape[0] * kv.shape[1] * kv.shape[2]
    counts = torch.empty(rows, dtype=torch.int32, device=kv.device)
    _valid_counts[(rows,)](kv, counts, kv.shape[3], STEPS=max(1, kv.shape[3]).bit_length() + 1)
    return counts


def _block_m(c: int) -> int:
    return max(16, triton.next_power_of_2(c))


def _check(perm, q, group_size):
    B, H, S, _ = q.shape
    if group_size > 128 or group_size < 1:
        raise ValueError(f"group size must be in [1, 128], got {group_size}")
    width = -(-S // group_size) * group_size
    if perm.dtype != torch.int32 or tuple(perm.shape) != (B, H, width):
        raise ValueError(f"perm must be int32 [B, H, ceil(S/C)*C] = {(B, H, width)}, got {perm.dtype} {tuple(perm.shape)}")
