"""The flash-attn-4 backend (``flash_attn.cute``, flash-attn-4 4.0.0b36 on nvidia-cutlass-dsl 4.8.1): dense pass 1
with LSE, and token-sparse attention through FA4's paged-KV route with one-token pages (docs/kernels.md, sec. 0.1).

Importing this package imports ``flash_attn.cute``; without it (or with a broken CuTeDSL stack) the import error
is recorded by ``kernels/_optional.py`` as the backend's unavailable reason. Registers
``Backend(name="flash_attn4", priority=30)``: on sm90+ it is the fastest dense kernel measured on the H200
(669 / 649 TFLOP/s at the Wan2.1 shapes, docs/kernels-benchmark.md). FA4 compiles each kernel variant on its first call
(seconds); ``FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1`` keeps them on disk.

Sparse mapping: K and V ``[B, H, S, D]`` are seen in place as page pools of one-token pages ``(rows, 1, 1, D)``
(``kv_pages``); each (b, h, group) is one FA4 batch entry whose page table holds its selected tokens' page ids and
whose ``seqused_k`` is its count of valid slots (the -1 slots are trailing, by the kv_idx convention), both written
by one Triton launch from kv_idx; the group's C queries are gathered to ``(B*H*G, C, 1, D)`` by one launch, and one
launch scatters FA4's output back to the original query order with the residual added (kernels/triton/
paged_route.py). FA4 puts batch entries on grid.z (at most 65535), so larger calls run in chunks.
"""

from __future__ import annotations

import math

import torch
from flash_attn.cute import flash_attn_func
from flash_attn.cute.interface import _flash_attn_fwd  # the varlen entry without autograd; takes out= / lse=

from ..registry import Backend, register
from ..triton import paged_route

__all__ = ["dense_attention", "kv_pages", "refuse", "sparse_attention"]

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


def kv_pages(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int, int]]:
    """K and V ``[B, H, S, D]`` as FA4 page pools of one-token pages ``(rows, 1, 1, D)`` and the page strides.

    Without a copy when k and v have the same strides, unit stride on D, every other stride a multiple of D, 16-byte
    aligned storage and an int32 largest page id (``[B, H, S, D]`` contiguous tensors and the model's ``[B, S, H*D]``
    views alike): the pool is the storage from the tensor's first element seen as rows of D. Otherwise contiguous
    copies. Returns (k pool, v pool, (page_b, page_h, page_s)): token t of (b, h) is page b*page_b + h*page_h +
    t*page_s of both pools."""
    B, H, S, D = k.shape
    st = k.stride()
    if (st == v.stride() and st[3] == 1 and all(x >= 0 and x % D == 0 for x in st[:3])
            and k.data_ptr() % 16 == 0 and v.data_ptr() % 16 == 0):
        pb, ph, ps = (x // D for x in st[:3])
        rows = (B - 1) * pb + (H - 1) * ph + (S - 1) * ps + 1
        if rows < 2**31:
            def pool(x):
                return torch.as_strided(x, (rows, 1, 1, D), (D, D, D, 1), x.storage_offset())
            return pool(k), pool(v), (pb, ph, ps)
    if B * H * S >= 2**31:
        raise ValueError(f"flash_attn4 paged route: {B * H * S} K/V rows do not fit int32 page ids")
    kc = k.contiguous().reshape(B * H * S, 1, 1, D)
    vc = v.contiguous().reshape(B * H * S, 1, 1, D)
    return kc, vc, (H * S, S, 1)


def sparse_attention(q, k, v, perm, kv_idx, *, scale=None, return_lse=False, out=None, residual=None, **tuning):
    """Token-sparse attention through FA4's paged KV with one-token pages; contract of
    ``kernels.reference.sparse_attention`` (kv_idx's -1 slots must be trailing in each group, as select_kv makes them).

    Per call: one Triton launch writes the page table and each group's valid count (``seqused_k``) from kv_idx
    (int32, no host sync), one gathers the queries to group order, FA4 runs (one launch per 65535 groups), one
    scatters its output to ``out`` by strides with the residual added in fp32 (kernels/triton/paged_route.py). K and
    V are read in place (``kv_pages``). ``tuning``: FA4's ``tile_mn``, ``mma_pv_is_rs``, ``intra_wg_overlap``,
    ``num_splits`` (benchmarks; defaults FA4's).

    Returns: ``out`` (a new ``[B, H, S, D]`` in q's dtype when None), original query order, or (out, LSE fp32
    ``[B, H, S]``).
    """
    B, H, S, D = q.shape
    G = kv_idx.shape[2]
    C = perm.shape[-1] // G
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if residual is not None:
        residual.check(q)
        residual.check_groups(perm)
    k_pool, v_pool, strides = kv_pages(k, v)
    table, used = paged_route.page_table(kv_idx, strides)
    q_groups = paged_route.gather_queries(q, perm, C)
    o_groups = torch.empty_like(q_groups)
    lse_groups = torch.empty(B * H * G, 1, C, dtype=torch.float32, device=q.device) if return_lse else None
    for n0 in range(0, B * H * G, _MAX_BATCH):
        n1 = min(B * H * G, n0 + _MAX_BATCH)
        _flash_attn_fwd(
            q_groups[n0:n1], k_pool, v_pool, seqused_k=used[n0:n1], page_table=table[n0:n1], softmax_scale=scale,
            return_lse=return_lse, out=o_groups[n0:n1], lse=None if lse_groups is None else lse_groups[n0:n1],
            **tuning,
        )
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    return paged_route.scatter_output(o_groups, lse_groups, perm, out, residual)


register(
    Backend(
        name="flash_attn4",
        priority=30,
        ops={"dense_attention": dense_attention, "sparse_attention": sparse_attention},
        refuse=refuse,
    )
)
