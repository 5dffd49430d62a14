"""The CuTeDSL backend's ``sparse_attention`` op: group-order regroup (Triton) around the compiled kernel.

Importing this module imports nvidia-cutlass-dsl and flash-attn-4 (``compile.py``, ``sparse_fwd_sm90.py``).
"""

from __future__ import annotations

import math

import torch

from ..triton import regroup
from . import compile as _compile
from .rules import DTYPE_NAMES, call_refusal

__all__ = ["sparse_attention"]


def sparse_attention(q, k, v, perm, kv_idx, *, scale=None, return_lse=False, out=None, residual=None):
    """Token-sparse attention on the CuTeDSL kernel; contract of ``kernels.sparse_attention``.

    Extra requirements (``rules.call_refusal``; a RuntimeError makes the registry fall back for the rest of the run):
    group size C = 128; k and v with unit stride on D and 16-byte aligned rows; at most 65535 groups per batch element.
    Returns: ``out`` (or a new ``[B, H, S, D]`` tensor) in the original query order, or (out, LSE fp32 ``[B, H, S]``).
    Raises: RuntimeError for every failure, including the ValueError / TypeError that the compiled kernel's argument
    checks (TVM-FFI) and the DSL raise: the public op has validated the inputs, so those are this backend's failures,
    and the registry treats ValueError / TypeError as the caller's error (it would lose the run instead of falling back).
    """
    why = call_refusal(q, k, v, perm, kv_idx)
    if why:
        raise RuntimeError(f"the CuTeDSL kernel {why}")
    try:
        return _run(q, k, v, perm, kv_idx, scale, return_lse, out, residual)
    except (ValueError, TypeError) as err:
        raise RuntimeError(f"the CuTeDSL kernel failed: {type(err).__name__}: {err}") from err


def _run(q, k, v, perm, kv_idx, scale, return_lse, out, residual):
    B, H, S, D = q.shape
    G, k_alloc = kv_idx.shape[2], kv_idx.shape[3]
    C = perm.shape[-1] // G
    k_rows, v_rows = k.transpose(1, 2), v.transpose(1, 2)  # [B, S, H, D] views: the model's own layout
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    fn = _compile.compiled(DTYPE_NAMES[q.dtype], D, return_lse)
    q_groups = regroup.gather_groups(q, perm, C)  # [B*H*G, C, D]
    counts = regroup.valid_counts(kv_idx)
    o_groups = torch.empty_like(q_groups)
    lse_groups = torch.empty(B * H * G, 1, C, dtype=torch.float32, device=q.device) if return_lse else None
    idx_rows = kv_idx.reshape(B * H * G, k_alloc).contiguous()  # the kernel reads index rows with unit stride
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
