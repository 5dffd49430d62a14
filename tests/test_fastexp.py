"""kernels/triton/fastexp.py on the CPU: the dispatch rule (packed PTX only where it can run) and the two modes that
run under TRITON_INTERPRET=1 against torch (mode 1, the inline PTX, is checked on the GPU by
tests/test_gpu_reuse_kernel.py)."""

from __future__ import annotations

import importlib

import pytest
import torch
import triton
import triton.language as tl
from comfyui_mc_sparse_pack.kernels import registry

from ._triton_interp import patch_interpreter

triton_backend = next(b for b in registry.backends() if b.name == "triton")
pytestmark = pytest.mark.skipif(
    bool(triton_backend.unavailable_reason), reason=f"triton backend unavailable: {triton_backend.unavailable_reason}"
)
patch_interpreter()
fastexp = importlib.import_module("comfyui_mc_sparse_pack.kernels.triton.fastexp")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(("requested", "capability", "want"), [
    ("f16x2", None, 0), ("f16x2", (7, 0), 0), ("f16x2", (7, 5), 1), ("f16x2", (8, 0), 1), ("f16x2", (8, 9), 1),
    ("f16x2", (9, 0), 1), ("fp32", (9, 0), 0), ("fp32", None, 0), ("f16_emulated", None, 2), ("f16_emulated", (9, 0), 2),
])
def test_mode_for_falls_back_where_the_ptx_cannot_run(requested, capability, want):
    """The interpreter (capability None) and GPUs below sm_75 get fp32 exponentials for "f16x2"."""
    assert fastexp.mode_for(requested, capability) == want


def test_mode_for_rejects_unknown_names():
    with pytest.raises(ValueError, match="exp mode"):
        fastexp.mode_for("f16", (9, 0))


@triton.jit
def _exp2_kernel(X, Y, N, MODE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < N, other=0.0)
    tl.store(Y + offs, fastexp.exp2(x, MODE).to(tl.float32), mask=offs < N)


@pytest.mark.parametrize("mode", [0, 2] + ([1] if DEVICE == "cuda" else []))
def test_exp2_modes_against_torch(gen, mode):
    """Mode 0 = fp32 exp2; mode 2 = fp16(exp2(fp16(x))) exactly (the roundings of ex2.approx.f16x2), which stays
    within 2^-7 relative of the exact 2^x for x in [-8, 8] (the range the softmax feeds it: <= RESCALE_LOG2);
    mode 1 (GPU only) within 2^-7 too."""
    x = (torch.rand(1000, generator=gen) * 16 - 8).to(DEVICE)
    y = torch.full_like(x, float("nan"))
    _exp2_kernel[(triton.cdiv(x.numel(), 256),)](x, y, x.numel(), MODE=mode, BLOCK=256)
    exact = torch.exp2(x.double())
    if mode == 0:
        assert torch.allclose(y.double(), exact, rtol=1e-6, atol=0)
    elif mode == 2:
        assert torch.equal(y, torch.exp2(x.half().float()).half().float())
    rel = ((y.double() - exact) / exact).abs().max()
    assert rel < (1e-6 if mode == 0 else 2.0**-7), float(rel)
