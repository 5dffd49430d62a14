"""The CuTeDSL backend: our warp-specialised token-sparse attention kernel for Hopper (``sparse_fwd_sm90.py``).

Optional: it needs ``nvidia-cutlass-dsl`` (4.8.1) and ``flash-attn-4`` (4.0.0b36, whose sm90 consumer warpgroups,
pipelines and epilogue the kernel uses as a library); README "Optional: the Hopper kernel" says how to install them.
Without them this import fails and ``kernels/_optional.py`` records the reason: the pack runs on Triton.

Registers ``Backend(name="cutedsl", priority=40)`` for ``sparse_attention`` only, preferred over Triton where it runs:
a CUDA device of compute capability 9.x (sm_90: wgmma, setmaxnreg), fp16/bf16, head dim 64 or 128, group size
C = 128 (one query tile per group), at most 65535 groups per batch element (grid.z). A failure at compile or run
time makes the registry fall back to Triton for the rest of the run, with the reason in the run summary.

One call: the group's query rows are gathered to group order and the valid slots counted (two small Triton launches,
``kernels/triton/regroup.py``), the kernel runs on the model's own K/V (``[B, S, H, D]`` with unit stride on D, read
by index: no copies), and the output rows go back to the original query order with the residual added in fp32
(one Triton launch). Compiled kernels persist on disk (``compile.py``).
"""

from __future__ import annotations

import math

import torch

from ..registry import Backend, register
from ..triton import regroup
from . import compile as _compile

__all__ = ["refuse", "sparse_attention"]

_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
_MAX_GROUPS = 65535  # CUDA grid.z: one CTA per (head, group) of a batch element


def refuse(op: str, q: torch.Tensor, requested: bool) -> str | None:
    """Why this backend cannot run ``op`` on ``q`` (None when it can)."""
    if op != "sparse_attention":
        return f"implements sparse_attention only, not {op}"
    if q.device.type != "cuda":
        return f"runs on CUDA devices, got {q.device.type}"
    if q.dtype not in _DTYPES:
        return f"runs float16/bfloat16 only, got {q.dtype}"
    major, minor = torch.cuda.get_device_capability(q.device)
    if major != 9:
        return f"is built for sm_90 (Hopper), got compute capability {major}.{minor}"
    if q.shape[-1] not in (64, 128):
        return f"runs head dim 64 or 128, got {q.shape[-1]}"
    return None


def sparse_attention(q, k, v, perm, kv_idx, *, scale=None, return_lse=False, out=None, residual=None):
    """Token-sparse attention on the CuTeDSL kernel; contract of ``kernels.sparse_attention``.

    Extra requirements (checked here; a RuntimeError makes the registry fall back): group size C = 128; k and v
    with unit stride on D and 16-byte aligned rows; at most 65535 groups per batch element.
    Returns: ``out`` (or a new ``[B, H, S, D]`` tensor) in the original query order, or (out, LSE fp32 ``[B, H, S]``).
    """
    B, H, S, D = q.shape
    G, k_alloc = kv_idx.shape[2], kv_idx.shape[3]
    C = perm.shape[-1] // G
    if C != 128:
        raise RuntimeError(f"the CuTeDSL kernel needs group size 128 (one query tile), got {C}")
    if H * G > _MAX_GROUPS:
        raise RuntimeError(f"the CuTeDSL kernel runs at most {_MAX_GROUPS} groups per batch element, got {H * G}")
    k_rows, v_rows = k.transpose(1, 2), v.transpose(1, 2)  # [B, S, H, D] views: the model's own layout
    for name, t in (("k", k_rows), ("v", v_rows)):
        if t.stride(-1) != 1 or t.data_ptr() % 16 or any(s % 8 for s in t.stride()[:-1]):
            raise RuntimeError(f"the CuTeDSL kernel reads {name} rows by 16-byte copies: unit stride on D and "
                               f"16-byte aligned rows needed, got strides {tuple(t.stride())}")
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    fn = _compile.compiled(_DTYPES[q.dtype], D, return_lse)
    q_groups = regroup.gather_groups(q, perm, C)  # [B*H*G, C, D]
    counts = regroup.valid_counts(kv_idx)
    o_groups = torch.empty_like(q_groups)
    lse_groups = torch.empty(B * H * G, 1, C, dtype=torch.float32, device=q.device) if return_lse else None
    idx_rows = kv_idx.reshape(B * H * G, k_alloc)
    per_b = H * G
    for b in range(B):  # grid.z holds one batch element's groups
        sl = slice(b * per_b, (b + 1) * per_b)
        _compile.launch(
            fn, q_groups[sl].unsqueeze(2), k_rows[b:b + 1], v_rows[b:b + 1], o_groups[sl].unsqueeze(2),
            None if lse_groups is None else lse_groups[sl], scale, counts[sl], idx_rows[sl],
        )
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(B, H, S, dtype=torch.float32, device=q.device) if return_lse else None
    regroup.scatter_groups(o_groups, perm, out, lse_groups=None if lse is None else lse_groups.view(B * H * G, C),
                           lse=lse, residual=residual)
    return (out, lse) if return_lse else out


register(Backend(name="cutedsl", priority=40, ops={"sparse_attention": sparse_attention}, refuse=refuse))
