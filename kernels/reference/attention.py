"""Torch reference of the MC-Sparse attention ops: the algorithm, not any kernel's arithmetic.

Runs on any device and dtype; computes in float32 (float64 when given float64) and returns q's dtype.
Work is chunked over queries or query groups so no [S, S] score matrix exists at once beyond
``_CHUNK_ELEMENTS`` scores. Sources: MC-Sparse (arXiv 2610.06801) sec. 3.3 (exact two-pass selection),
sec. 3.1 (token-level KV gather). Expected agreement of a fused kernel with these functions: within the
input dtype's rounding (relative L2 error ~1e-3 for bf16 inputs), not bitwise.

Conventions (docs/architecture.md): q, k, v ``[B, H, S, D]``; ``perm`` int32 ``[B, H, G*C]`` with -1
padding in the last group; ``kv_idx`` int32 ``[B, H, G, K_alloc]`` sorted, -1 = masked slot; LSE fp32
``[B, H, S]`` in natural log.
"""

from __future__ import annotations

import math

import torch

from .topk import top_k_rows

_CHUNK_ELEMENTS = 1 << 24  # scores per chunk: 64 MiB of fp32, keeps CPU memory bounded at any S


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _gather_rows(x: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``x`` [B, H, S, D] at ``idx`` [B, H, ...] (-1 = none) -> ([B, H, ..., D], valid mask)."""
    valid = idx >= 0
    flat = idx.clamp_min(0).long().reshape(idx.shape[0], idx.shape[1], -1)  # [B, H, N]
    rows = torch.gather(x, 2, flat.unsqueeze(-1).expand(-1, -1, -1, x.shape[-1]))
    return rows.reshape(*idx.shape, x.shape[-1]), valid


def dense_attention(q, k, v, *, scale=None, return_lse=False):
    """Dense softmax attention; pass 1 of exact selection when ``return_lse``.

    Args:
        q, k, v: ``[B, H, S, D]`` (k, v may have another length Sk), same dtype.
        scale: softmax scale; None means 1/sqrt(D).
        return_lse: also return the fp32 row log-sum-exp ``[B, H, S]`` (natural log, scale applied).
    Returns:
        O ``[B, H, S, D]`` in q's dtype, or (O, LSE).
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    acc = _acc_dtype(q)
    B, H, S, D = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(B, H, S, dtype=torch.float32, device=q.device)
    kf, vf = k.to(acc), v.to(acc)
    step = max(1, _CHUNK_ELEMENTS // max(1, B * H * k.shape[2]))
    for s0 in range(0, S, step):
        qs = q[:, :, s0 : s0 + step].to(acc)
        scores = torch.matmul(qs, kf.transpose(-1, -2)) * scale  # [B, H, s, Sk]
        row_lse = torch.logsumexp(scores, dim=-1)  # [B, H, s]
        p = torch.exp(scores - row_lse.unsqueeze(-1))
        out[:, :, s0 : s0 + step] = torch.matmul(p, vf).to(q.dtype)
        lse[:, :, s0 : s0 + step] = row_lse.float()
    return (out, lse) if return_lse else out


def group_prob_sums(q, k, lse, perm, *, group_size, scale=None):
    """Pass 2: exact attention probabilities summed over each query group.

    ``sums[b, h, g, j] = sum over queries i of group g of exp(q_i . k_j * scale - LSE_i)``; padding
    query slots (-1) contribute nothing.

    Args:
        q, k: ``[B, H, S, D]``; lse: fp32 ``[B, H, S]`` from ``dense_attention(..., return_lse=True)``;
        perm: int32 ``[B, H, G*C]`` query groups; group_size: C.
    Returns:
        fp32 ``[B, H, G, Sk]`` (each entry in [0, C]).
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    acc = _acc_dtype(q)
    B, H, S, D = q.shape
    C = group_size
    G = perm.shape[-1] // C
    groups = perm.reshape(B, H, G, C)
    sums = torch.empty(B, H, G, k.shape[2], dtype=torch.float32, device=q.device)
    kf = k.to(acc)
    step = max(1, _CHUNK_ELEMENTS // max(1, B * H * C * k.shape[2]))
    for g0 in range(0, G, step):
        idx = groups[:, :, g0 : g0 + step]  # [B, H, g, C]
        qg, valid = _gather_rows(q, idx)  # [B, H, g, C, D]
        lg = torch.gather(lse, 2, idx.clamp_min(0).long().reshape(B, H, -1)).reshape(idx.shape)
        scores = torch.matmul(qg.to(acc), kf.unsqueeze(2).transpose(-1, -2)) * scale  # [B, H, g, C, Sk]
        p = torch.exp(scores - lg.to(acc).unsqueeze(-1)) * valid.unsqueeze(-1)
        sums[:, :, g0 : g0 + step] = p.sum(dim=3).float()
    return sums


def select_kv(q, k, lse, perm, num_keys, *, group_size, kv_tile, scale=None):
    """Pass 2 + top-K: each query group's ``num_keys`` KV tokens of largest summed exact probability.

    Args:
        q, k, lse, perm, group_size: as in ``group_prob_sums``.
        num_keys: K, tokens kept per group, 1 <= K <= Sk.
        kv_tile: the width of the returned index rows is K rounded up to a multiple of this.
    Returns:
        int32 ``[B, H, G, K_alloc]``: indices sorted ascending, slots past K set to -1. Ties: the lower token
        index wins, as on every backend (``topk.top_k_rows``; before, ``torch.topk`` broke them arbitrarily).
    """
    B, H, S, _ = q.shape
    C = group_size
    G = perm.shape[-1] // C
    k_alloc = -(-num_keys // kv_tile) * kv_tile
    out = torch.full((B, H, G, k_alloc), -1, dtype=torch.int32, device=q.device)
    step = max(1, _CHUNK_ELEMENTS // max(1, B * H * C * k.shape[2]))
    for g0 in range(0, G, step):
        sub = perm[..., g0 * C : (g0 + step) * C]
        sums = group_prob_sums(q, k, lse, sub.contiguous(), group_size=C, scale=scale)  # [B, H, g, Sk]
        out[:, :, g0 : g0 + sums.shape[2]] = top_k_rows(sums, num_keys, k_alloc)
    return out


def sparse_attention(q, k, v, perm, kv_idx, *, scale=None, return_lse=False, out=None, residual=None):
    """Token-sparse attention: each query group attends to its own gathered KV tokens.

    Args:
        q, k, v: ``[B, H, S, D]`` (any strides); perm: int32 ``[B, H, G*C]``; kv_idx: int32 ``[B, H, G, K_alloc]``
        (-1 slots masked; a group whose slots are all -1 is an error upstream, not handled here).
        scale: None means 1/sqrt(D). return_lse: also return fp32 ``[B, H, S]``.
        out: optional ``[B, H, S, D]`` tensor in q's dtype (any strides, e.g. a view of a ``[B, S, H*D]`` buffer),
            written in place and returned.
        residual: optional ``kernels.Residual``; R is added in the accumulation precision before rounding.
    Returns:
        O ``[B, H, S, D]`` in q's dtype in the original query order (every query written once; ``out`` itself
        when given), or (O, LSE). The LSE is the sparse part's (the residual does not change it).
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    acc = _acc_dtype(q)
    B, H, S, D = q.shape
    G, K = kv_idx.shape[2], kv_idx.shape[3]
    C = perm.shape[-1] // G
    groups = perm.reshape(B, H, G, C)
    out_sorted = torch.empty(B, H, G, C, D, dtype=acc, device=q.device)
    lse_sorted = torch.empty(B, H, G, C, dtype=acc, device=q.device)
    step = max(1, _CHUNK_ELEMENTS // max(1, B * H * K * max(C, 2 * D)))  # scores [g, C, K] and gathered K, V [g, K, D]
    for g0 in range(0, G, step):
        qg, _ = _gather_rows(q, groups[:, :, g0 : g0 + step])  # [B, H, g, C, D]
        kg, kvalid = _gather_rows(k, kv_idx[:, :, g0 : g0 + step])  # [B, H, g, K, D]
        vg, _ = _gather_rows(v, kv_idx[:, :, g0 : g0 + step])
        scores = torch.matmul(qg.to(acc), kg.to(acc).transpose(-1, -2)) * scale  # [B, H, g, C, K]
        scores = scores.masked_fill(~kvalid.unsqueeze(-2), float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)
        p = torch.exp(scores - row_lse.unsqueeze(-1))
        out_sorted[:, :, g0 : g0 + step] = torch.matmul(p, vg.to(acc))
        lse_sorted[:, :, g0 : g0 + step] = row_lse
    dest = perm[:, :, :S].long()  # padding slots are the last G*C - S entries of perm
    full = torch.empty(B, H, S, D, dtype=acc, device=q.device)
    full.scatter_(2, dest.unsqueeze(-1).expand(-1, -1, -1, D), out_sorted.reshape(B, H, G * C, D)[:, :, :S])
    if residual is not None:
        full += residual.dequantize(acc, perm)
    if out is None:
        out = torch.empty_like(q)
    out.copy_(full)
    lse = torch.empty(B, H, S, dtype=torch.float32, device=q.device)
    lse.scatter_(2, dest, lse_sorted.reshape(B, H, G * C)[:, :, :S].float())
    return (out, lse) if return_lse else out
