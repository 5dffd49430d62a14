"""The residual epilogue of every GPU sparse kernel, to the ulp (H200; marked ``gpu``, skipped where a kernel cannot run).

With v = 0 the sparse part is exactly 0 (P V = 0, then / l), so the output is the residual R itself, dequantised in
fp32 in the kernel's epilogue and rounded once to fp16: within half an fp16 ulp (2^-11 relative) of the float64 brute
force of the documented format (kernels/residual.py; tests/test_reuse_op.py's ``brute_residual``), element by element,
every element of a NaN-poisoned native ``[B, S, H*D]`` out view written. The kernels' own GPU tests bound sparse + R
by a relative norm (6e-3), which a wrong scale of R inside it passes (on the CPU: the Triton epilogue's fp8_row scale
x255 instead of x256; tests/test_triton_reuse.py's CPU twin of this test catches that one).

Kernels: the CuTeDSL op (its register epilogue, every residual form it compiles: plain bf16 / fp16 / fp32, fp8_row,
int4_row, int4_group), the Gluon kernel through the op (``MC_SPARSE_GLUON=1``) and each of the auto mode's schedules
called directly on 7 programs (the last, partial round split or launched apart, merged with the residual), the Triton
kernel through the op (``MC_SPARSE_GLUON=0``).
Run: python3 -m pytest -q tests/test_gpu_residual_exact.py (cold: ~1-2 minutes on an H200, mostly compiles).
"""

from __future__ import annotations

import importlib

import pytest
import torch
from comfyui_mc_sparse_pack import kernels
from comfyui_mc_sparse_pack.kernels import Residual, registry

from .test_gpu_reuse_kernel import _inputs
from .test_reuse_op import brute_residual, make_residual

_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _SM90, reason="needs an sm_90 (Hopper) CUDA GPU")]

B, H, S, D, C, K = 2, 3, 3008, 128, 128, 777  # ragged S and K; 144 groups (more than the H200's 132 SMs)


def _case(kind: str, seed: int):
    """q, k (fp16 native views), v = 0, perm, kv_idx (ragged counts), the residual, a NaN-poisoned out view of a
    [B, S, H*D + 8] buffer and the buffer."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k = (torch.randn(B, S, H * D, generator=gen, device="cuda").half().view(B, S, H, D).transpose(1, 2)
            for _ in range(2))
    v = torch.zeros_like(q)
    perm, idx = _inputs(gen, B, H, S, C, K, -(-K // 128) * 128)
    counts = torch.randint(1, K + 1, idx.shape[:3], generator=gen, device="cuda")
    idx = torch.where(torch.arange(idx.shape[-1], device="cuda") < counts[..., None], idx, -1)
    r = torch.randn(B, H, S, D, generator=gen, device="cuda") * 4
    if kind.startswith("plain_"):
        res = Residual(r.to(getattr(torch, kind.removeprefix("plain_"))))
    else:
        res = make_residual(r, kind, perm, idx.shape[2])
    buf = torch.full((B, S, H * D + 8), float("nan"), dtype=torch.float16, device="cuda")
    return q, k, v, perm, idx, res, buf[..., :H * D].view(B, S, H, D).transpose(1, 2), buf


def _assert_is_r(out, buf, res, perm):
    assert not out.isnan().any(), "some output element was not written"
    assert buf[..., H * D:].isnan().all(), "written past the out view"
    ref = brute_residual(res, perm)
    err = (out.double() - ref).abs() - 2.0**-11 * ref.abs()
    worst = float(err.max())
    print(f"{res.kind}: max |out - R| beyond half an fp16 ulp: {worst:.2e}")
    assert worst <= 1e-6, worst


def _through_op(kind: str, backend: str, seed: int):
    q, k, v, perm, idx, res, out, buf = _case(kind, seed)
    with registry.recording(registry.Record()) as record:
        got = kernels.sparse_attention(q, k, v, perm, idx, out=out, residual=res, backend=backend)
    assert got is out
    assert record.choices["sparse_attention"].backend == backend and not record.failures, record.failures
    _assert_is_r(out, buf, res, perm)
    return record


def _cutedsl_reason() -> str | None:
    b = {x.name: x for x in registry.backends()}.get("cutedsl")
    return None if b is not None and not b.unavailable_reason else "the cutedsl backend is unavailable"


@pytest.mark.skipif(_cutedsl_reason() is not None, reason=str(_cutedsl_reason()))
@pytest.mark.parametrize("kind", ["plain_bfloat16", "plain_float16", "plain_float32", "fp8_row", "int4_row",
                                  "int4_group"])
def test_cutedsl_residual_is_exact(kind):
    _through_op(kind, "cutedsl", seed=3)


@pytest.mark.parametrize("gluon", ["1", "0"], ids=["gluon", "triton-kernel"])
@pytest.mark.parametrize("kind", ["plain_bfloat16", "fp8_row", "int4_row", "int4_group"])
def test_triton_backend_residual_is_exact(monkeypatch, kind, gluon):
    """backend="triton": the Gluon kernel (MC_SPARSE_GLUON=1; the dispatch must not have fallen back) or the Triton
    kernel (0)."""
    monkeypatch.setenv("MC_SPARSE_GLUON", gluon)
    dispatch = importlib.import_module("comfyui_mc_sparse_pack.kernels.triton.sparse_dispatch")
    dispatch.reset()
    _through_op(kind, "triton", seed=5)
    assert dispatch.fallback_reason() is None


@pytest.mark.parametrize("schedule", range(len(importlib.import_module(
    "comfyui_mc_sparse_pack.kernels.triton.sparse_dispatch").AUTO_SCHEDULES)))
@pytest.mark.parametrize("kind", ["fp8_row", "int4_group"])
def test_gluon_auto_schedules_residual_is_exact(kind, schedule):
    """Each schedule of the auto mode, called directly on 7 programs: 144 items make 20 full rounds and a partial
    one of 4, which these schedules split into key parts or launch apart (merged with the residual)."""
    dispatch = importlib.import_module("comfyui_mc_sparse_pack.kernels.triton.sparse_dispatch")
    g90 = importlib.import_module("comfyui_mc_sparse_pack.kernels.triton.sparse_attention_sm90")
    q, k, v, perm, idx, res, out, buf = _case(kind, seed=11 + schedule)
    tuning = dispatch.GLUON_SCHEDULES[dispatch.AUTO_SCHEDULES[schedule]]
    assert g90.sparse_attention(q, k, v, perm, idx, out=out, residual=res, num_sms=7, **tuning) is out
    _assert_is_r(out, buf, res, perm)
