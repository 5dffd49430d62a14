"""Before the first step: can this sampler call pay off with MC-Sparse? If not it runs dense, and says why once.

MC-Sparse saves time only when (1) a fast sparse kernel runs on the model's device (the torch reference is slower
than dense attention: a CUDA torch without Triton, as on Windows, or a GPU below sm_80; a CPU), (2) the attention
calls are long enough (``min_tokens``), and (3) the schedule has enough reuse steps to pay for its anchors (a 2+2
step distilled run does not). The caller (``lifecycle.outer_sample_wrapper``) turns a reason into a dense run.
Asking for ``backend="torch"`` by name skips checks (1) and (3): the reference is then run because it was asked for
(testing the machinery, e.g. at a density that keeps every key); (2) is the user's own threshold and always applies.
"""

from __future__ import annotations

import torch

from ..config import HEAD_DIMS
from ..memory import DEFAULT_KERNEL_EFFICIENCY, expected_speedup

MIN_ATTENTION_SPEEDUP = 1.05
"""The schedule's attention-only speedup (anchor, reuse and dense steps at the paper's costs, ``memory``) below
which a sampler call stays dense: the anchors would cost about what the reuse steps save."""


def dense_reason(config, *, num_steps: int, layers: int, requested_backend: str, min_tokens: int,
                 device: torch.device | None = None, dtype: torch.dtype | None = None, head_dim: int | None = None,
                 tokens: int | None = None) -> str | None:
    """Why this sampler call should run dense (None: it can pay off). Unknown facts (None) are not held against it.

    Args:
        config: the run's ``MCSparseConfig``. num_steps: steps of the sampler call. layers: marked blocks (>= 1).
        requested_backend: the node's backend input. min_tokens: the node's min tokens input.
        device, dtype, head_dim: where and how the model's attention runs. tokens: latent tokens per attention call.
    """
    if tokens is not None and tokens < min_tokens:
        return f"{tokens} latent tokens per attention call, fewer than min tokens ({min_tokens}): too short to pay off"
    if requested_backend == "torch":
        return None
    speed = expected_speedup(config, num_steps=num_steps, num_layers=max(1, layers, config.warmup_layers + 1),
                             attention_share=0.999, kernel_efficiency=DEFAULT_KERNEL_EFFICIENCY)
    if speed.speedup < MIN_ATTENTION_SPEEDUP:
        reuse = speed.steps.get("reuse", 0) // max(1, layers)
        return (f"{num_steps} steps leave too few reuse steps (about {reuse}) to pay for the anchor steps (attention "
                f"{speed.speedup:.2f}x at density {config.density:g}); MC-Sparse needs more steps or fewer anchors")
    if device is not None:
        return _slow_backend_reason(device, dtype, head_dim, requested_backend)
    return None


def _slow_backend_reason(device: torch.device, dtype, head_dim, requested: str) -> str | None:
    from ... import kernels

    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        dtype = torch.bfloat16
    probe = torch.empty((1, 1, 1, head_dim if head_dim in HEAD_DIMS else HEAD_DIMS[-1]), dtype=dtype, device=device)
    best, why = kernels.registry.candidates("sparse_attention", probe, requested)[0]
    if best.name != "torch":
        return None
    refusals = [c for c in why.split("; ")[1:] if ": does not implement " not in c]
    return (f"no fast sparse kernel on {device} ({'; '.join(refusals) or 'only the torch reference'}): the torch "
            "reference would make this run slower than dense attention")
