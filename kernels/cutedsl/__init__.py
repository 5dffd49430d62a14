"""The CuTeDSL backend: our warp-specialised token-sparse attention kernel for Hopper (``sparse_fwd_sm90.py``).

Optional: it needs ``nvidia-cutlass-dsl`` (4.8.1), ``flash-attn-4`` (4.0.0b36, whose sm90 consumer warpgroups,
pipelines and epilogue the kernel uses as a library) and ``quack-kernels`` (0.6.5, its copy and fake-tensor helpers);
README "Optional: the Hopper kernel" says how to install them.
Without them this import fails and ``kernels/_optional.py`` records the reason: the pack runs on Triton.

Registers ``Backend(name="cutedsl", priority=40)`` for ``sparse_attention`` only, preferred over Triton where it runs:
a CUDA device of compute capability 9.x (sm_90: wgmma, setmaxnreg), fp16/bf16, head dim 64 or 128, group size
C = 128 (one query tile per group). A failure at compile or run time (the op raises RuntimeError for all of them,
``op.py``) makes the registry fall back to the next backend for the rest of the run, with the reason in the run
summary.

One call: the valid slots of each group's ``kv_idx`` row are counted (one small Triton launch,
``kernels/triton/counts.py``), then one kernel launch for every batch element gathers the group's query rows and
selected K/V rows from the model's own tensors (``[B, S, H, D]`` views with unit stride on D, read by index: no
copies) and writes each output row, + the residual added in fp32, and the LSE to the original query positions.
Compiled kernels persist on disk (``compile.py``).
"""

from __future__ import annotations

from ..registry import Backend, register
from .rules import refuse

try:
    from .op import sparse_attention
except Exception as err:  # no nvidia-cutlass-dsl / flash-attn-4, or a broken CUDA stack: the pack runs on Triton
    register(Backend(name="cutedsl", priority=40, unavailable_reason=f"{type(err).__name__}: {err}"))
else:
    register(Backend(name="cutedsl", priority=40, ops={"sparse_attention": sparse_attention}, refuse=refuse))

__all__ = ["refuse"]
