"""The Triton backend: token-sparse attention and selection pass 2 (+ top-K) as Triton kernels.

Importing this package registers ``Backend(name="triton", priority=20)`` with the kernel registry; an import
error (no triton, a broken toolchain) is caught by ``kernels/_optional.py`` and recorded as the unavailable
reason. Capabilities (checked by ``refuse`` before any launch):

- devices: CUDA with compute capability >= 8.0 (bf16 ``tl.dot``); CPU tensors only when the backend is requested
  by name and Triton's interpreter is on (``TRITON_INTERPRET=1`` before triton is imported: tests);
- dtypes: float16, bfloat16 (fp32 would run the products in TF32; the torch reference covers fp32/fp64);
- head dim: a power of two in [16, 256];
- any group size C, any K_alloc, any S (ragged tails masked).

Ops: ``sparse_attention`` (``sparse_dispatch.py``: on sm_90, fp16/bf16, D 64 or 128, the fastest of the
warp-specialised Gluon kernel's persistent schedules (``sparse_attention_sm90.py``), timed once per call shape; the
Triton kernel ``sparse_attention.py`` elsewhere and after a Gluon failure), ``group_prob_sums`` and ``select_kv``
(``selection.py``: pass 2, then the radix top-K of ``topk.py``), ``decode_bitmask`` (``bitmask.py``; any CUDA
device, the uint8 bitmask in place of q in ``refuse``), ``pddp_groups`` (``grouping.py``: Triton PDDP, directions
from a subsample, one projection pass per tree level through the permutation, no host syncs; the torch-ops grouping
is the separate backend ``kernels/torch_gpu``). Dense pass 1 is not here: it belongs to the SDPA and flash-attn-4
backends.
"""

from __future__ import annotations

import os

import torch
import triton  # noqa: F401  (an ImportError here marks the backend unavailable)

from ..registry import Backend, register
from .bitmask import decode_bitmask
from .grouping import pddp_groups
from .selection import group_prob_sums, select_kv
from .sparse_dispatch import sparse_attention

__all__ = ["decode_bitmask", "group_prob_sums", "pddp_groups", "refuse", "select_kv", "sparse_attention"]

_DTYPES = (torch.float16, torch.bfloat16)
# triton picks the interpreter when a kernel is decorated, i.e. when this package is imported
_INTERPRETER = os.environ.get("TRITON_INTERPRET", "0") == "1"


def refuse(op: str, q: torch.Tensor, requested: bool) -> str | None:
    """Why the Triton backend cannot run ``op`` on ``q`` (None when it can); see the module docstring.

    For ``decode_bitmask`` ``q`` is the uint8 bitmask: only the device rules apply."""
    if op == "decode_bitmask":
        return _device_refusal(q, requested)
    if q.dtype not in _DTYPES:
        return f"runs float16/bfloat16 only, got {q.dtype}"
    d = q.shape[-1]
    if d < 16 or d > 256 or d & (d - 1):
        return f"head dim must be a power of two in [16, 256], got {d}"
    return _device_refusal(q, requested)


def _device_refusal(q: torch.Tensor, requested: bool) -> str | None:
    if q.device.type == "cuda":
        if _INTERPRETER:
            return "TRITON_INTERPRET=1 is set: the interpreter runs CPU tensors only"
        major, _ = torch.cuda.get_device_capability(q.device)
        if major < 8:
            return f"needs compute capability >= 8.0, got {major}.x"
        return None
    if q.device.type == "cpu":
        if not requested:
            return "CPU tensors run on Triton's interpreter only when backend='triton' is requested (testing)"
        if not _INTERPRETER:
            return "CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 before importing the pack"
        return None
    return f"runs on CUDA devices, got {q.device.type}"


register(
    Backend(
        name="triton",
        priority=20,
        ops={
            "sparse_attention": sparse_attention, "group_prob_sums": group_prob_sums, "select_kv": select_kv,
            "decode_bitmask": decode_bitmask,
            "pddp_groups": pddp_groups,
        },
        refuse=refuse,
    )
)
