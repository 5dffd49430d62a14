"""The GPU grouping backend: Fast PDDP as plain torch ops on the GPU without host syncs (``pddp.py``).

It needs no Triton (only torch), so it is its own backend: a CUDA torch without Triton (Windows) still groups
queries on the GPU. Importing this package registers ``Backend(name="torch_gpu", priority=15)`` with the
registry; it implements ``pddp_groups`` only. Devices: CUDA with compute capability >= 8.0 (bf16 batched
matmuls with fp32 output); CPU tensors only when requested by name (tests).
"""

from __future__ import annotations

import torch

from ..registry import Backend, register
from .pddp import pddp_groups

__all__ = ["pddp_groups", "refuse"]


def refuse(op: str, q: torch.Tensor, requested: bool) -> str | None:
    """Why this backend cannot run ``op`` on ``q`` (None when it can); see the module docstring."""
    if q.device.type == "cuda":
        major, _ = torch.cuda.get_device_capability(q.device)
        return None if major >= 8 else f"needs compute capability >= 8.0, got {major}.x"
    if q.device.type == "cpu":
        return None if requested else "CPU tensors run here only when backend='torch_gpu' is requested (testing)"
    return f"runs on CUDA devices, got {q.device.type}"


register(Backend(name="torch_gpu", priority=15, ops={"pddp_groups": pddp_groups}, refuse=refuse))
