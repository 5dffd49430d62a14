"""MC-Sparse GPU kernels behind one interface (docs/architecture.md, "Kernel ops").

Each op validates its inputs, then runs on the best backend that accepts the call (``registry``):
Triton and flash-attn-4 where present, the torch reference (``kernels/reference``) anywhere. Optional GPU
libraries that are missing or broken never break this import: their backend is registered as unavailable
with the reason. Pass ``backend="torch"`` (or another name) to force one; ``registry.report()`` lists them.

Tensor conventions: q, k, v ``[B, H, S, D]`` (fp16, bf16, fp32 or fp64); ``perm`` int32 ``[B, H, G*C]``;
``kv_idx`` int32 ``[B, H, G, K_alloc]`` sorted with -1 padding; LSE fp32 ``[B, H, S]``.
"""

from __future__ import annotations

import math

import torch

from . import reference, registry
from .registry import Backend, NoCapableBackendError

registry.register(
    Backend(
        name="torch",
        priority=0,
        ops={
            "dense_attention": reference.dense_attention,
            "group_prob_sums": reference.group_prob_sums,
            "select_kv": reference.select_kv,
            "sparse_attention": reference.sparse_attention,
            "pddp_groups": reference.pddp_groups,
        },
    )
)

from . import _optional  # noqa: E402  (registers the GPU backends, or their unavailable reasons)

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

__all__ = [
    "Backend",
    "NoCapableBackendError",
    "dense_attention",
    "group_prob_sums",
    "pddp_groups",
    "registry",
    "select_kv",
    "sparse_attention",
]


def _check_qkv(q, k, v=None):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, H, S, D], got shape {tuple(t.shape)}")
        if t.dtype not in _FLOATS:
            raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
        if t.dtype != q.dtype or t.device != q.device:
            raise TypeError(f"{name} must match q's dtype and device ({q.dtype}, {q.device}), got {t.dtype}, {t.device}")
    if k.shape[2] < 1:
        raise ValueError(f"k must hold at least one key (Sk >= 1), got shape {tuple(k.shape)}")
    if k.shape[:2] != q.shape[:2] or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k must be [B, H, Sk, D] with q's B, H, D {tuple(q.shape)}, got {tuple(k.shape)}")
    if v is not None and v.shape != k.shape:
        raise ValueError(f"v must have k's shape [B, H, Sk, D] {tuple(k.shape)}, got {tuple(v.shape)}")


def _check_perm(perm, q, group_size):
    B, H, S, _ = q.shape
    width = -(-S // group_size) * group_size
    if perm.dtype != torch.int32 or tuple(perm.shape) != (B, H, width):
        raise ValueError(f"perm must be int32 [B, H, ceil(S/C)*C] = {(B, H, width)}, got {perm.dtype} {tuple(perm.shape)}")


def _scale(q, scale):
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def dense_attention(q, k, v, *, scale=None, return_lse=False, backend="auto"):
    """Dense attention, optionally with the fp32 row LSE (pass 1 of exact selection).

    Args: q ``[B, H, S, D]``, k and v ``[B, H, Sk, D]``; scale (None = 1/sqrt(D)); return_lse.
    Returns: O ``[B, H, S, D]`` in q's dtype, or (O, LSE fp32 ``[B, H, S]``, natural log).
    Raises: TypeError/ValueError on malformed inputs; NoCapableBackendError.
    """
    _check_qkv(q, k, v)
    return registry.call("dense_attention", q, k, v, scale=_scale(q, scale), return_lse=return_lse, backend=backend)


def group_prob_sums(q, k, lse, perm, *, group_size, scale=None, backend="auto"):
    """Pass 2: exact probabilities summed over each query group -> fp32 ``[B, H, G, Sk]``.

    See ``kernels.reference.attention.group_prob_sums`` for the definition.
    """
    _check_qkv(q, k)
    _check_perm(perm, q, group_size)
    return registry.call("group_prob_sums", q, k, lse, perm, group_size=group_size, scale=_scale(q, scale), backend=backend)


def select_kv(q, k, lse, perm, num_keys, *, group_size, kv_tile, scale=None, backend="auto"):
    """Pass 2 + top-K: int32 ``[B, H, G, ceil(K/kv_tile)*kv_tile]`` sorted indices, -1 padding.

    Raises: ValueError when num_keys is outside [1, Sk] or kv_tile < 1.
    """
    _check_qkv(q, k)
    _check_perm(perm, q, group_size)
    if not 1 <= num_keys <= k.shape[2]:
        raise ValueError(f"num_keys must be in [1, {k.shape[2]}] (the KV length), got {num_keys}")
    if kv_tile < 1:
        raise ValueError(f"kv_tile must be >= 1, got {kv_tile}")
    return registry.call(
        "select_kv", q, k, lse, perm, num_keys, group_size=group_size, kv_tile=kv_tile, scale=_scale(q, scale), backend=backend
    )


def sparse_attention(q, k, v, perm, kv_idx, *, scale=None, return_lse=False, backend="auto"):
    """Token-sparse attention over each group's gathered KV tokens, output in the original query order.

    Args: q, k, v ``[B, H, S, D]``; perm int32 ``[B, H, G*C]``; kv_idx int32 ``[B, H, G, K_alloc]``.
    perm and kv_idx must come from ``pddp_groups`` and ``select_kv`` (or keep their contract: each query once,
    indices in [0, Sk) sorted with trailing -1, at least one per group): their values are not checked here,
    since that would cost a device sync on every reuse step.
    Returns: O ``[B, H, S, D]`` (q's dtype), or (O, LSE fp32 ``[B, H, S]``).
    """
    _check_qkv(q, k, v)
    if kv_idx.dtype != torch.int32 or kv_idx.dim() != 4 or kv_idx.shape[:2] != q.shape[:2]:
        raise ValueError(f"kv_idx must be int32 [B, H, G, K], got {kv_idx.dtype} {tuple(kv_idx.shape)}")
    G = kv_idx.shape[2]
    if perm.shape[-1] % G:
        raise ValueError(f"perm width {perm.shape[-1]} must be G*C for kv_idx's G = {G}")
    _check_perm(perm, q, perm.shape[-1] // G)
    return registry.call(
        "sparse_attention", q, k, v, perm, kv_idx, scale=_scale(q, scale), return_lse=return_lse, backend=backend
    )


def pddp_groups(q, group_size, *, power_iters=8, backend="auto"):
    """Fast PDDP query groups: int32 ``[B, H, ceil(S/C)*C]`` (see ``kernels.reference.pddp``)."""
    _check_qkv(q, q)
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    return registry.call("pddp_groups", q, group_size, power_iters=power_iters, backend=backend)
