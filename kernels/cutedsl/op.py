"""The CuTeDSL backend's ``sparse_attention`` op: one launch of the kernel of ``sparse_fwd_sm90.py`` (queries
gathered, output + residual + LSE scattered to the query order in-kernel, every batch element in one launch), after
one small Triton launch that counts each group's valid slots (``kernels/triton/counts.py``).

Importing this module imports nvidia-cutlass-dsl and flash-attn-4 (``compile.py``).
"""

from __future__ import annotations

import functools
import math

import torch

from ..triton.counts import valid_counts
from . import compile as _compile
from . import tail_merge
from .rules import DTYPE_NAMES, call_refusal, epilogue_for, launch_plan, split_parts

__all__ = ["sparse_attention"]


def sparse_attention(q, k, v, perm, kv_idx, *, scale=None, return_lse=False, out=None, residual=None):
    """Token-sparse attention on the CuTeDSL kernel; contract of ``kernels.sparse_attention``.

    Extra requirements (``rules.call_refusal``; a RuntimeError makes the registry fall back for the rest of the run):
    group size C = 128; q, k and v with unit stride on D and 16-byte aligned rows; ``out`` with unit stride on D and
    4-byte aligned rows; the residual with unit stride on its last dim (pairs of elements aligned), its scale / coef
    with unit stride on S.
    Returns: ``out`` (or a new ``[B, H, S, D]`` tensor) in the original query order, or (out, LSE fp32 ``[B, H, S]``).
    Raises: RuntimeError for every failure, including the ValueError / TypeError that the compiled kernel's argument
    checks (TVM-FFI) and the DSL raise: the public op has validated the inputs, so those are this backend's failures,
    and the registry treats ValueError / TypeError as the caller's error (it would lose the run instead of falling back).
    """
    why = call_refusal(q, k, v, perm, kv_idx, out=out, residual=residual)
    if why:
        raise RuntimeError(f"the CuTeDSL kernel {why}")
    try:
        return _run(q, k, v, perm, kv_idx, scale, return_lse, out, residual)
    except (ValueError, TypeError) as err:
        raise RuntimeError(f"the CuTeDSL kernel failed: {type(err).__name__}: {err}") from err


def _run(q, k, v, perm, kv_idx, scale, return_lse, out, residual):
    B, H, S, D = q.shape
    G, k_alloc = kv_idx.shape[2], kv_idx.shape[3]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    res_name, *res_args = _residual_args(residual)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    n = B * H * G
    epilogue = epilogue_for(res_name, out)
    options, num_ctas = launch_plan(epilogue, n, _sm_count(q.device))
    fn = _compile.compiled(DTYPE_NAMES[q.dtype], D, return_lse, res_name, epilogue=epilogue, options=options)
    lse = torch.empty(B, H, S, dtype=torch.float32, device=q.device) if return_lse else None
    # the three launches as programmatic dependent launches ("pdl" of sparse_fwd_sm90.OPTIONS; CUDA only)
    pdl = "pdl" in options and q.device.type == "cuda"
    counts = valid_counts(kv_idx, pdl=pdl)
    perm_rows = perm.contiguous().view(n, perm.shape[-1] // G)
    n_parts, ws = 1, (None, None)
    r = n % num_ctas  # groups of the persistent walk's last round
    if "split_tail" in options:  # the last round's groups in parts, into a workspace, merged after
        n_parts = split_parts(n, num_ctas)
        rows = 128 * (r * n_parts if n_parts > 1 else 1)
        ws = (torch.empty(rows, D, dtype=q.dtype, device=q.device),
              torch.empty(rows, dtype=torch.float32, device=q.device))
    _compile.launch(
        fn, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), out.transpose(1, 2), lse, perm_rows,
        kv_idx.reshape(n, k_alloc).contiguous(), counts, *res_args, scale, num_ctas, *ws, n_parts,
    )
    if n_parts > 1:
        tail_merge.merge(*ws, perm_rows, out.transpose(1, 2), lse, n - r, r, n_parts, G, pdl=pdl)
    return (out, lse) if return_lse else out


@functools.lru_cache(maxsize=None)
def _sm_count(device) -> int:
    """The device's SM count (a persistent grid's CTA count); 1 off CUDA (the CPU tests' fake launch)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


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

