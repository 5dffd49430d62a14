"""The SDPA backend: dense attention (pass 1, with LSE) on PyTorch's own fused CUDA kernels.

Registers ``Backend(name="cuda_sdpa", priority=25)``: above the Triton backend (which has no dense kernel) and below
flash-attn-4 (faster on Hopper when installed). Two torch ops, chosen by device:

- compute capability >= 9.0 (Hopper, Blackwell): cuDNN, ``torch.ops.aten._scaled_dot_product_cudnn_attention``
  (torch 2.11 schema: ``(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0., is_causal=False,
  return_debug_mask=False, *, scale=None) -> (output, logsumexp, ...)``); on the H200, torch 2.11 + cu130 it ran
  608-620 TFLOP/s at the Wan2.1 shapes (docs/kernels-benchmark.md), like SDPA's default pick;
- 8.x: the FA2-class flash op, ``torch.ops.aten._scaled_dot_product_flash_attention`` (same outputs).
Both return the LSE in fp32, natural log, scale applied; it is reshaped to ``[B, H, S]``. Without LSE,
``torch.nn.functional.scaled_dot_product_attention`` picks its own kernel. Correctness of the cuDNN LSE at S not a
multiple of 128 (pytorch #169849) was checked against the float32 reference on the H200 (docs/kernels.md); torch
older than 2.10 gets the flash op instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..registry import Backend, register

__all__ = ["dense_attention", "refuse"]

_DTYPES = (torch.float16, torch.bfloat16)
_TORCH = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])


def refuse(op: str, q: torch.Tensor, requested: bool) -> str | None:
    """Why this backend cannot run ``op`` on ``q`` (None when it can)."""
    if q.device.type != "cuda":
        return f"runs on CUDA devices, got {q.device.type}"
    if q.dtype not in _DTYPES:
        return f"runs float16/bfloat16 only, got {q.dtype}"
    d = q.shape[-1]
    if d % 8 or d > 256:
        return f"head dim must be a multiple of 8 and at most 256, got {d}"
    major, _ = torch.cuda.get_device_capability(q.device)
    if major < 8:
        return f"needs compute capability >= 8.0, got {major}.x"
    return None


def _use_cudnn(q: torch.Tensor) -> bool:
    # cuDNN < 9.15 (torch < 2.10) gave wrong results for S % 128 != 0 (pytorch #169849, #171627)
    return torch.cuda.get_device_capability(q.device)[0] >= 9 and _TORCH >= (2, 10)


def dense_attention(q, k, v, *, scale=None, return_lse=False):
    """Dense attention on torch's fused kernels; same contract as ``kernels.reference.dense_attention``.

    Args: q ``[B, H, S, D]``, k, v ``[B, H, Sk, D]`` fp16/bf16 on CUDA; scale (None = 1/sqrt(D)); return_lse.
    Returns: O ``[B, H, S, D]`` (q's dtype), or (O, LSE fp32 ``[B, H, S]``, natural log).
    """
    if not return_lse:
        return F.scaled_dot_product_attention(q, k, v, scale=scale)
    B, H, S, _ = q.shape
    if _use_cudnn(q):
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, False, False, scale=scale)[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)[:2]
    return out, lse.reshape(B, H, S).float()


register(Backend(name="cuda_sdpa", priority=25, ops={"dense_attention": dense_attention}, refuse=refuse))
