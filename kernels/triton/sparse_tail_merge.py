"""Merge of the split work items of the sm_90 Gluon sparse kernel (``sparse_attention_sm90``'s ``split_tail``).

A persistent launch walks its work items (one query group's 128 rows each) in rounds of one item per program; when
the item count is not a multiple of the program count, the last round runs on a few SMs while the others idle
(Wan2.1-1.3B 480p: 3072 items on 132 SMs, the 24th round 36 items). With ``split_tail`` the kernel splits each item
of that round into ``n_parts`` key ranges, one program each, and every part stores its rows' unnormalised O (fp32),
running max (log2 units, softmax scale included) and row sum into a workspace. This kernel combines the parts of
each split item as the online softmax would have (the flash-decoding merge: the common max, each part rescaled by
2^(m_part - m)), normalises, adds the residual and writes the rows through ``perm`` into ``out`` by strides, and the
LSE (natural log) -- the Gluon kernel's epilogue, with the Triton kernel's residual code (``_store_half``).
Runs on any device Triton runs on, the interpreter included (tests/test_sparse_tail_merge.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .sparse_attention import _store_half, residual_args

_LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _merge_parts(WS_O, WS_ML, PERM, OUT, LSE, RES, RES_SCALE, RES_COEF, RES_MEAN,
                 n_full, n_parts, H, S, C, n_slots,
                 stride_ob, stride_oh, stride_os, stride_od,
                 stride_rb, stride_rh, stride_rs, stride_rd, stride_cb, stride_ch, stride_cs,
                 stride_eb, stride_eh, stride_es, stride_mb, stride_mh, stride_mg, stride_md,
                 M_BLOCKS: tl.constexpr, D: tl.constexpr, RETURN_LSE: tl.constexpr, RES_KIND: tl.constexpr,
                 ROW64: tl.constexpr):
    j = tl.program_id(0)  # the j-th split item: work item n_full + j, workspace slots j * n_parts ..
    w = n_full + j
    g_mb = (n_slots // C) * M_BLOCKS  # work items per (b, h), as the Gluon kernel's _work_item
    bh = w // g_mb
    pid_m = w % g_mb
    group = pid_m // M_BLOCKS
    row0 = (pid_m % M_BLOCKS) * 128
    b = bh // H
    h = bh % H
    offs_m = tl.arange(0, 128)
    offs_d = tl.arange(0, D)
    rows = row0 + offs_m
    q_idx = tl.load(PERM + bh.to(tl.int64) * n_slots + group.to(tl.int64) * C + rows, mask=rows < C, other=-1)
    slot0 = j.to(tl.int64) * n_parts
    m = tl.full([128], float("-inf"), tl.float32)
    for p in range(n_parts):
        m = tl.maximum(m, tl.load(WS_ML + ((slot0 + p) * 128 + offs_m) * 2))
    l_sum = tl.zeros([128], tl.float32)
    o = tl.zeros([128, D], tl.float32)
    for p in range(n_parts):
        base = (slot0 + p) * 128 + offs_m
        m_p = tl.load(WS_ML + base * 2)
        f = tl.where(m_p == float("-inf"), 0.0, tl.exp2(m_p - m))  # an empty part (max -inf, sum 0) weighs nothing
        l_sum += tl.load(WS_ML + base * 2 + 1) * f
        o += tl.load(WS_O + base[:, None] * D + offs_d[None, :]) * f[:, None]
    out = o / l_sum[:, None]
    q_valid = (q_idx >= 0) & (q_idx < S)
    q_rows = tl.where(q_valid, q_idx, 0)
    if ROW64:
        q_rows = q_rows.to(tl.int64)
    if RETURN_LSE:
        tl.store(LSE + bh.to(tl.int64) * S + q_rows, (m + tl.log2(l_sum)) * _LN2, mask=q_valid)
    _store_half(out, 0, OUT, b, h, q_rows, q_valid, stride_ob, stride_oh, stride_os, stride_od,
                RES, RES_SCALE, RES_COEF, RES_MEAN, group, stride_rb, stride_rh, stride_rs, stride_rd,
                stride_cb, stride_ch, stride_cs, stride_eb, stride_eh, stride_es, stride_mb, stride_mh, stride_mg,
                stride_md, D, RES_KIND)


def merge_args(ws_o, ws_ml, n_full, n_tail, n_parts, perm, out, lse, residual, H, S, C, n_slots, m_blocks, row64):
    """(grid, positional args, meta) of the merge launch (``merge``; the offline compile in tests/ptxas_gluon.py)."""
    kind, res_ptrs, res_strides = residual_args(residual, out)
    args = (ws_o, ws_ml, perm, out, lse if lse is not None else out, *res_ptrs, n_full, n_parts, H, S, C, n_slots,
            *out.stride(), *res_strides)
    meta = dict(M_BLOCKS=m_blocks, D=ws_o.shape[-1], RETURN_LSE=lse is not None, RES_KIND=kind, ROW64=row64,
                num_warps=8)
    return (n_tail,), args, meta


def merge(ws_o, ws_ml, n_full, n_tail, n_parts, perm, out, lse, residual, H, S, C, n_slots, m_blocks, row64):
    """Write the rows of the split work items n_full .. n_full + n_tail - 1 (``sparse_attention_sm90.launch_args``'s
    ``tail``): combine each item's ``n_parts`` workspace slots, normalise, + residual, store through ``perm``.

    Args:
        ws_o: fp32 ``[n_tail * n_parts, 128, D]`` unnormalised O of each part (item j's parts at j * n_parts ..).
        ws_ml: fp32 ``[n_tail * n_parts, 128, 2]``: each part's running max (log2 units, scale included; -inf for
            an empty part) and row sum (0 for an empty part).
        perm: int32 ``[B, H, G*C]`` contiguous; out: ``[B, H, S, D]`` view (any strides); lse: fp32 ``[B, H, S]``
            contiguous or None; residual: a ``kernels.Residual`` or None; the rest: the launch's shape numbers.
    """
    grid, args, meta = merge_args(ws_o, ws_ml, n_full, n_tail, n_parts, perm, out, lse, residual, H, S, C, n_slots,
                                  m_blocks, row64)
    _merge_parts[grid](*args, **meta)
