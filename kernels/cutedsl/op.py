"""The CuTeDSL backend's ``sparse_attention`` op, in three variants (``variant=``, default ``VARIANT`` or
``$MC_SPARSE_CUTEDSL_VARIANT``) timed side by side by tests/bench_cutedsl.py:

- "regroup": group-order regroup (Triton) around the kernel of ``sparse_fwd_sm90.py`` (three extra launches);
- "fused": the kernel of ``fused_fwd_sm90.py`` gathers the queries and scatters the output + residual + LSE itself,
  one CTA per group (one Triton launch counts the valid slots);
- "persistent": the fused kernel with one CTA per SM looping over the groups;
- "fused_kahead" / "persistent_kahead": the same with the producer issuing each key tile's K before the previous
  tile's V (the consumers' order).

Importing this module imports nvidia-cutlass-dsl and flash-attn-4 (``compile.py``).
"""

from __future__ import annotations

import math
import os

import torch

from ..triton import regroup
from . import compile as _compile
from .rules import DTYPE_NAMES, VARIANTS, call_refusal

__all__ = ["sparse_attention", "VARIANTS"]
VARIANT = "regroup"  # until the fused variants are measured on the H200
_sms: dict = {}


def default_variant() -> str:
    """``$MC_SPARSE_CUTEDSL_VARIANT`` or ``VARIANT``. Raises ValueError for a name not in ``VARIANTS``."""
    name = os.environ.get("MC_SPARSE_CUTEDSL_VARIANT", VARIANT).strip()
    if name not in VARIANTS:
        raise ValueError(f"MC_SPARSE_CUTEDSL_VARIANT must be one of {VARIANTS}, got {name!r}")
    return name


def sparse_attention(q, k, v, perm, kv_idx, *, scale=None, return_lse=False, out=None, residual=None, variant=None):
    """Token-sparse attention on the CuTeDSL kernel; contract of ``kernels.sparse_attention``.

    ``variant``: one of ``VARIANTS`` (module docstring); None: ``default_variant()``.
    Extra requirements (``rules.call_refusal``; a RuntimeError makes the registry fall back for the rest of the run):
    group size C = 128; k and v with unit stride on D and 16-byte aligned rows; "regroup": at most 65535 groups per
    batch element; the fused variants: q like k, ``out`` with unit stride on D and 4-byte aligned rows, the residual
    with unit stride on its last dim and its scale and the LSE with unit stride on S.
    Returns: ``out`` (or a new ``[B, H, S, D]`` tensor) in the original query order, or (out, LSE fp32 ``[B, H, S]``).
    Raises: RuntimeError for every failure, including the ValueError / TypeError that the compiled kernel's argument
    checks (TVM-FFI) and the DSL raise: the public op has validated the inputs, so those are this backend's failures,
    and the registry treats ValueError / TypeError as the caller's error (it would lose the run instead of falling back).
    """
    try:
        variant = variant or default_variant()
    except ValueError as err:
        raise RuntimeError(str(err)) from err
    why = call_refusal(q, k, v, perm, kv_idx, variant=variant, out=out, residual=residual)
    if why:
        raise RuntimeError(f"the CuTeDSL kernel {why}")
    try:
        if variant == "regroup":
            return _run(q, k, v, perm, kv_idx, scale, return_lse, out, residual)
        return _run_fused(q, k, v, perm, kv_idx, scale, return_lse, out, residual, variant.startswith("persistent"),
                          variant.endswith("_kahead"))
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


def _run_fused(q, k, v, perm, kv_idx, scale, return_lse, out, residual, persistent, k_ahead):
    B, H, S, D = q.shape
    G, k_alloc = kv_idx.shape[2], kv_idx.shape[3]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    res_name, *res_args = _residual_args(residual)
    fn = _compile.compiled_fused(DTYPE_NAMES[q.dtype], D, return_lse, res_name, k_ahead=k_ahead)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(B, H, S, dtype=torch.float32, device=q.device) if return_lse else None
    counts = regroup.valid_counts(kv_idx)
    n = B * H * G
    ctas = _sm_count(q.device) if persistent else n
    _compile.launch_fused(
        fn, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), out.transpose(1, 2), lse,
        perm.contiguous().view(n, perm.shape[-1] // G), kv_idx.reshape(n, k_alloc).contiguous(), counts, *res_args,
        scale, ctas,
    )
    return (out, lse) if return_lse else out


def _residual_args(residual):
    """(compile key of ``compile.RESIDUALS``, data as ``(B, S, H, D or D//2)``, scale, coef as uint8, mean) of a
    Residual, None for the tensors its kind has not."""
    if residual is None:
        return "none", None, None, None, None
    if residual.kind == "plain":
        return (f"plain_{str(residual.data.dtype).removeprefix('torch.')}", residual.data.transpose(1, 2), None, None,
                None)
    coef = None if residual.coef is None else residual.coef.view(torch.uint8)
    return residual.kind, residual.data.view(torch.uint8).transpose(1, 2), residual.scale, coef, residual.mean


def _sm_count(device) -> int:
    """SM count of a CUDA device (the persistent grid), cached per device index."""
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _sms:
        _sms[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return _sms[i]
