"""The flash-attn-4 backend (``flash_attn.cute``, flash-attn-4 4.0.0b36 on nvidia-cutlass-dsl 4.8.1): dense pass 1
with LSE, and token-sparse attention through FA4's paged-KV route with one-token pages (docs/kernels.md, sec. 0.1).

Importing this package imports ``flash_attn.cute``; without it (or with a broken CuTeDSL stack) the import error
is recorded by ``kernels/_optional.py`` as the backend's unavailable reason. Registers
``Backend(name="flash_attn4", priority=30)``: on sm90+ it is the fastest dense kernel measured on the H200
(669 / 649 TFLOP/s at the Wan2.1 shapes, docs/kernels-benchmark.md). FA4 compiles each kernel variant on its first call
(seconds); ``FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1`` keeps them on disk.

Sparse mapping: K and V ``[B, H, S, D]`` (contiguous) are viewed as ``B*H*S`` pages of one token
``(pages, 1, 1, D)``; each (b, h, group) is one FA4 batch entry whose page table holds
``(b*H + h)*S + kv_idx`` and whose ``seqused_k`` is its count of valid slots (the -1 slots are trailing, by the
kv_idx convention); the group's C queries are gathered to ``(B*H*G, C, 1, D)``, and the output is scattered back to
the original query order. FA4 puts batch entries on grid.z (at most 65535), so larger calls run in chunks.
"""

from __future__ import annotations

import math

import torch
from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

from ..registry import Backend, register
from ..residual import finish_unfused

__all__ = ["dense_attention", "refuse", "sparse_attention"]

_DTYPES = (torch.float16, torch.bfloat16)
_MAX_BATCH = 65535  # CUDA grid.z limit: FA4's sm90 non-causal scheduler puts batch entries there


def refuse(op: str, q: torch.Tensor, requested: bool) -> str | None:
    """Why this backend cannot run ``op`` on ``q`` (None when it can)."""
    if q.device.type != "cuda":
        return f"runs on CUDA devices, got {q.device.type}"
    if q.dtype not in _DTYPES:
        return f"runs float16/bfloat16 only, got {q.dtype}"
    major, _ = torch.cuda.get_device_capability(q.device)
    if major < 9:
        return f"needs compute capability >= 9.0 (Hopper or newer), got {major}.x"
    d = q.shape[-1]
    if op == "sparse_attention" and d not in (64, 128):
        return f"paged-KV route runs head dim 64 or 128, got {d}"
    if d % 8 or d > 256:
        return f"head dim must be a multiple of 8 and at most 256, got {d}"
    return None


def dense_attention(q, k, v, *, scale=None, return_lse=False):
    """Dense attention on FA4; same contract as ``kernels.reference.dense_attention``.

    Args: q ``[B, H, S, D]``, k, v ``[B, H, Sk, D]``, fp16/bf16 on sm90+; scale (None = 1/sqrt(D)); return_lse.
    Returns: O ``[B, H, S, D]`` (a transposed view of FA4's ``[B, S, H, D]`` output), or (O, LSE fp32 ``[B, H, S]``).
    """
    out, lse = flash_attn_func(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale, return_lse=return_lse
    )
    out = out.transpose(1, 2)
    return (out, lse) if return_lse else out


def sparse_attention(q, k, v, perm, kv_idx, *, scale=None, return_lse=False, out=None, residual=None):
    """Token-sparse attention through FA4's paged KV with one-token pages; contract of
    ``kernels.reference.sparse_attention`` (kv_idx's -1 slots must be trailing in each group, as select_kv makes them).

    Returns: O ``[B, H, S, D]`` in q's dtype, original query order, or (O, LSE fp32 ``[B, H, S]``).
    """
    B, H, S, D = q.shape
    G, k_alloc = kv_idx.shape[2], kv_idx.shape[3]
    C = perm.shape[-1] // G
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    k_pages = k.contiguous().reshape(B * H * S, 1, 1, D)  # one token per page
    v_pages = v.contiguous().reshape(B * H * S, 1, 1, D)
    row0 = (torch.arange(B * H, device=q.device, dtype=torch.int32) * S).view(B, H, 1, 1)
    valid = kv_idx >= 0
    table = torch.where(valid, kv_idx + row0, row0).reshape(B * H * G, k_alloc)  # -1 -> any valid page (unused)
    used = valid.sum(-1, dtype=torch.int32).reshape(B * H * G)
    slots = perm.reshape(B, H, G * C).long()
    q_rows = torch.gather(q, 2, slots.clamp_min(0).unsqueeze(-1).expand(-1, -1, -1, D))  # [B, H, G*C, D]
    q_groups = q_rows.reshape(B * H * G, C, 1, D)
    out_g = torch.empty_like(q_groups)
    lse_g = torch.empty(B * H * G, 1, C, dtype=torch.float32, device=q.device)
    for n0 in range(0, B * H * G, _MAX_BATCH):
        n1 = min(B * H * G, n0 + _MAX_BATCH)
        o, lse = flash_attn_varlen_func(
            q_groups[n0:n1], k_pages, v_pages, seqused_k=used[n0:n1], page_table=table[n0:n1],
            softmax_scale=scale, return_lse=True,
        )
        out_g[n0:n1] = o
        lse_g[n0:n1] = lse
    dest = perm[:, :, :S].long()  # the -1 padding slots are the last G*C - S entries
    o = torch.empty_like(q, memory_format=torch.contiguous_format)
    o.scatter_(2, dest.unsqueeze(-1).expand(-1, -1, -1, D), out_g.reshape(B, H, G * C, D)[:, :, :S])
    out = finish_unfused(o, out, residual, perm)
    if not return_lse:
        return out
    lse_out = torch.empty(B, H, S, dtype=torch.float32, device=q.device)
    lse_out.scatter_(2, dest, lse_g.reshape(B, H, G * C)[:, :, :S])
    return out, lse_out


register(
    Backend(
        name="flash_attn4",
        priority=30,
        ops={"dense_attention": dense_attention, "sparse_attention": sparse_attention},
        refuse=refuse,
    )
)
