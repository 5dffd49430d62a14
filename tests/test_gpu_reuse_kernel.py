"""The reuse-path Triton kernels compiled for the GPU (issue 14): against the float64 torch reference, and the
compiled sparse kernel's register spills (must be 0 at the default config); the packed-exponential (inline PTX) and
lazy-rescale paths likewise. Marked ``gpu``; skipped without CUDA.

Run: python3 -m pytest -q tests/test_gpu_reuse_kernel.py (about 1 minute on an H200, mostly compiles).
"""

from __future__ import annotations

import importlib

import pytest
import torch
from comfyui_mc_sparse_pack import kernels
from comfyui_mc_sparse_pack.kernels import reference, registry

from .test_reuse_op import make_residual

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _tsa():
    return importlib.import_module("comfyui_mc_sparse_pack.kernels.triton.sparse_attention")


def _native(gen, B, S, H, D):
    base = torch.randn(B, S, H * D, generator=gen, device="cuda").to(torch.bfloat16)
    return base.view(B, S, H, D).transpose(1, 2)


def _inputs(gen, B, H, S, C, K, k_alloc):
    G = -(-S // C)
    perm = torch.full((B, H, G * C), -1, dtype=torch.int32, device="cuda")
    perm[..., :S] = torch.argsort(torch.rand(B, H, S, generator=gen, device="cuda"), -1).to(torch.int32)
    keys = torch.rand(B, H, G, S, generator=gen, device="cuda").topk(K, -1).indices.sort(-1).values
    idx = torch.full((B, H, G, k_alloc), -1, dtype=torch.int32, device="cuda")
    idx[..., :K] = keys.to(torch.int32)
    return perm, idx


@pytest.mark.parametrize("kind", [None, "plain", "fp8_row", "int4_row", "int4_group"])
@pytest.mark.parametrize(("S", "K"), [(4000, 1000), (3000 + 8, 777)], ids=["S4000", "S3008-ragged"])
def test_native_out_residual_vs_float64(kind, S, K):
    """B = 2 (CFG branches in one launch), D = 128, C = 128: native [B, S, H*D] views in, an out view of a NaN-filled
    buffer written in full, O = sparse + R and LSE against the float64 reference on the GPU."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    B, H, D, C = 2, 3, 128, 128
    q, k, v = (_native(gen, B, S, H, D) for _ in range(3))
    perm, idx = _inputs(gen, B, H, S, C, K, -(-K // 128) * 128)
    res = None
    if kind is not None:
        res = make_residual(torch.randn(B, H, S, D, generator=gen, device="cuda") * 0.05, kind, perm, idx.shape[2])
    base = torch.full((B, S, H * D), float("nan"), dtype=torch.bfloat16, device="cuda")
    out = base.view(B, S, H, D).transpose(1, 2)
    with registry.recording(registry.Record()) as record:
        got, lse = kernels.sparse_attention(q, k, v, perm, idx, out=out, residual=res, return_lse=True, backend="triton")
    assert got is out and record.choices["sparse_attention"].backend == "triton"
    ref, ref_lse = reference.sparse_attention(q.double(), k.double(), v.double(), perm, idx, return_lse=True)
    if res is not None:
        ref = ref + res.dequantize(torch.float64, perm)
    assert not base.isnan().any()
    err = float((got.double() - ref).norm() / ref.norm())
    assert err < 6e-3, err
    assert float((lse.double() - ref_lse.double()).abs().max()) < 1e-3


# packed exponentials (kernels/triton/fastexp.py mode 1: inline ex2.approx.f16x2) and lazy rescale, every residual
# kind, both dtypes, ragged K: (exp, lazy, kind, dtype, S, K)
# (and on the bench's BLOCK_N 64 tile: Q in registers, the next tile's QK^T first; --quick's 5 stages / short prologue)
QREG = dict(q_regs=True, block_n=64, maxnreg=0)
PIPE = dict(q_regs=True, pipeline_qk=True, block_n=64, maxnreg=0)
PACKED = [("f16x2", False, None, torch.bfloat16, 4000, 1000, {}),
          ("f16x2", True, "plain", torch.bfloat16, 3008, 777, {}),
          ("f16x2", True, "fp8_row", torch.float16, 4000, 1000, {}),
          ("f16x2", False, "int4_row", torch.float16, 3008, 777, {}),
          ("f16x2", True, None, torch.float16, 3008, 777, {}),
          ("fp32", True, "int4_row", torch.bfloat16, 4000, 1000, {}),
          ("fp32", True, "plain", torch.bfloat16, 3008, 777, QREG),
          ("f16x2", True, "fp8_row", torch.float16, 4000, 1000, QREG),
          ("fp32", True, "int4_row", torch.bfloat16, 3008, 777, PIPE),
          ("fp32", True, None, torch.float16, 4000, 1000, dict(pipeline_qk=True, block_n=32, maxnreg=0)),
          ("fp32", True, "plain", torch.bfloat16, 3008, 777, dict(fast_prologue=True, num_stages=5)),
          ("fp32", True, "int4_row", torch.float16, 4000, 1000, dict(fast_prologue=True)),
          ("fp32", True, "fp8_row", torch.bfloat16, 4000, 1000, dict(num_stages=5)),
          ("fp32", True, "int4_group", torch.bfloat16, 3008, 777, {}),
          ("f16x2", True, "int4_group", torch.float16, 4000, 1000, QREG)]


@pytest.mark.parametrize(("exp", "lazy", "kind", "dtype", "S", "K", "tile"), PACKED,
                         ids=[f"{e}-{'lazy' if z else 'eager'}-{k}-{str(d)[6:]}-S{s}-{'-'.join(sorted(t)) or 'default'}"
                              for e, z, k, d, s, _, t in PACKED])
def test_packed_exp_lazy_rescale_vs_float64(exp, lazy, kind, dtype, S, K, tile):
    """Native views, an out view of a NaN-filled buffer written in full, O = sparse + R and LSE against float64; the
    same call with fp32 exponentials, eager rescale beside it: prints both errors (max / mean abs, rel L2). Bounds:
    O rel L2 < 6e-3 (bf16 rounding of P and O), LSE < 4e-3 for fp16 exponentials (argument rounded to fp16), 1e-3
    otherwise."""
    gen = torch.Generator(device="cuda").manual_seed(17)
    B, H, D, C = 2, 3, 128, 128
    q, k, v = (_native(gen, B, S, H, D).to(dtype) for _ in range(3))
    perm, idx = _inputs(gen, B, H, S, C, K, -(-K // 128) * 128)
    res = None
    if kind is not None:
        res = make_residual(torch.randn(B, H, S, D, generator=gen, device="cuda") * 0.05, kind, perm, idx.shape[2])
    ref, ref_lse = reference.sparse_attention(q.double(), k.double(), v.double(), perm, idx, return_lse=True)
    if res is not None:
        ref = ref + res.dequantize(torch.float64, perm)
    errs = {}
    tested = dict(exp=exp, lazy_rescale=lazy) | tile
    for name, kw in (("tested", tested), ("fp32 eager", dict(exp="fp32", lazy_rescale=False))):
        base = torch.full((B, S, H * D), float("nan"), dtype=dtype, device="cuda")
        out = base.view(B, S, H, D).transpose(1, 2)
        got, lse = _tsa().sparse_attention(q, k, v, perm, idx, out=out, residual=res, return_lse=True, **kw)
        assert got is out and not base.isnan().any()
        d = got.double() - ref
        errs[name] = dict(rel_l2=float(d.norm() / ref.norm()), max_abs=float(d.abs().max()),
                          mean_abs=float(d.abs().mean()), lse_max=float((lse.double() - ref_lse).abs().max()))
    print(f"{exp} lazy={lazy} {tile} {kind} {dtype}: {errs}")
    assert errs["tested"]["rel_l2"] < 6e-3, errs
    assert errs["tested"]["lse_max"] < (4e-3 if exp == "f16x2" else 1e-3), errs


def test_packed_path_compiles_the_ptx_without_spills():
    """exp="f16x2" on this GPU (sm_75+) compiles ex2.approx.f16x2 into the kernel (the dispatch did not fall back),
    eager and lazy (two kernels at least; the test above compiles more), with no register spills at the default tile."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (_native(gen, 1, 512, 2, 128) for _ in range(3))
    perm, idx = _inputs(gen, 1, 2, 512, 128, 100, 128)
    for lazy in (False, True):
        _tsa().sparse_attention(q, k, v, perm, idx, exp="f16x2", lazy_rescale=lazy)
    packed = [ck for ck in _tsa().compiled_kernels() if "ex2.approx.f16x2" in ck.asm["ptx"]]
    print("packed kernels (num_warps, n_regs, n_spills):", [(ck.metadata.num_warps, ck.n_regs, ck.n_spills) for ck in packed])
    assert len(packed) >= 2, "exp='f16x2' did not compile the packed PTX (eager and lazy)"
    assert all(ck.n_spills == 0 for ck in packed)


def test_default_config_compiles_without_spills():
    """Every default-config variant of the sparse kernel compiled in this process (the test above compiles all residual
    kinds, with LSE) has n_spills == 0 (triton's loaded-kernel metadata)."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (_native(gen, 1, 512, 2, 128) for _ in range(3))
    perm, idx = _inputs(gen, 1, 2, 512, 128, 100, 128)
    _tsa().sparse_attention(q, k, v, perm, idx)  # the Triton kernel itself (the op runs the Gluon kernel on sm_90)
    cfg = _tsa().config(128, torch.cuda.get_device_capability())
    seen = [(ck.metadata.num_warps, ck.n_regs, ck.n_spills) for ck in _tsa().compiled_kernels()
            if ck.metadata.num_warps == cfg["num_warps"]]
    print(f"default config {cfg}: (num_warps, n_regs, n_spills) {seen}")
    assert seen, "no default-config kernel was compiled"
    assert all(s == 0 for _, _, s in seen), f"register spills at the default config {cfg}: {seen}"


@pytest.mark.parametrize("variant", ["bits", "bytes"])
@pytest.mark.parametrize(("S", "K"), [(75600, 18900), (32760 + 3, 5000)], ids=["S75600", "S32763-ragged"])
def test_decode_bitmask_gpu_bit_exact(S, K, variant, monkeypatch):
    """The decode kernel (each variant) on the GPU equals the reference bit for bit, into half of a stacked CFG buffer."""
    import importlib

    from comfyui_mc_sparse_pack.comfyui_mc_sparse import encoding

    monkeypatch.setattr(importlib.import_module("comfyui_mc_sparse_pack.kernels.triton.bitmask"), "VARIANT", variant)

    gen = torch.Generator(device="cuda").manual_seed(11)
    rows, width = 40, -(-K // 128) * 128
    keys = torch.rand(1, 2, rows, S, generator=gen, device="cuda").topk(K, -1).indices.sort(-1).values
    idx = torch.full((1, 2, rows, width), -1, dtype=torch.int32, device="cuda")
    idx[..., :K] = keys.to(torch.int32)
    enc = encoding.encode_selection(idx, S, K, "bitmask")
    stacked = torch.full((2, 1, 2, rows, width), 5, dtype=torch.int32, device="cuda")
    with registry.recording(registry.Record()) as record:
        kernels.decode_bitmask(enc.data, num_tokens=S, out=stacked[1])
    assert record.choices["decode_bitmask"].backend == "triton"
    assert torch.equal(stacked[1], idx) and (stacked[0] == 5).all()
    assert torch.equal(kernels.decode_bitmask(enc.data, num_tokens=S, width=width, backend="torch"), idx)
