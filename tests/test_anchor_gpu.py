"""The anchor step's new kernels on a CUDA GPU (compiled Triton, real sizes) against their references.

Skipped on CPU machines (the interpreter versions run in tests/test_anchor_kernels.py). Run:
``python -m pytest -q -m gpu tests/test_anchor_gpu.py`` (about 30 s on an H200, compiles included).
"""

from __future__ import annotations

import math

import pytest
import torch
from comfyui_mc_sparse_pack import kernels
from comfyui_mc_sparse_pack.comfyui_mc_sparse.attention import anchor_attention
from comfyui_mc_sparse_pack.comfyui_mc_sparse.config import MCSparseConfig
from comfyui_mc_sparse_pack.kernels import reference
from comfyui_mc_sparse_pack.kernels.reference.pddp import within_group_variance
from comfyui_mc_sparse_pack.kernels.reference.topk import top_k_rows as ref_top_k_rows

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
]
SEED = 20261201


@pytest.fixture
def cuda_gen():
    print(f"seed {SEED}")
    return torch.Generator(device="cuda").manual_seed(SEED)


@pytest.mark.parametrize("method", ["radix", "bracket"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("S", [32760, 4099])
def test_select_top_k_on_gpu_equals_the_reference(cuda_gen, dtype, method, S):
    """Long rows (S = 32760: not a multiple of 16; 4099: unaligned rows; 75600 in the real-sums test below) with ties
    at the threshold (200 levels) and a row of distinct values: exactly the reference top-K, every slot written."""
    from comfyui_mc_sparse_pack.kernels.triton import topk

    sums = (torch.randint(0, 200, (1, 3, 64, S), device="cuda", generator=cuda_gen).to(dtype) / 64)
    sums[0, 1, 5] = torch.rand(S, device="cuda", generator=cuda_gen).to(dtype)
    for k, width in ((S // 4, -(-S // 4 // 128) * 128), (1, 128), (S, -(-S // 128) * 128)):
        out = torch.full((1, 3, 64, width), -7, dtype=torch.int32, device="cuda")
        topk.top_k_rows(sums, k, width, out=out, method=method)
        assert torch.equal(out, ref_top_k_rows(sums, k, width))


def test_select_sample_top_k_on_real_group_sums(cuda_gen):
    """Wan2.1-14B 720p row length (75600), the float16 group sums pass 2 computes for one head: the bracket method
    equals the radix method and the reference at every density, and rarely needs the radix fallback."""
    from comfyui_mc_sparse_pack.kernels.triton import selection, topk

    S, D, C = 75600, 128, 128
    q, k = (torch.randn(1, 1, S, D, device="cuda", generator=cuda_gen).to(torch.bfloat16) for _ in range(2))
    _, lse = kernels.dense_attention(q, k, k, return_lse=True)
    perm = kernels.pddp_groups(q, C, backend="triton")
    sums = selection.group_prob_sums(q, k, lse, perm, group_size=C).half()
    for s in (0.1, 0.15, 0.25, 0.5):
        kk = int(s * S)
        width = -(-kk // 128) * 128
        got, fell_back = topk.top_k_rows(sums, kk, width, return_fallbacks=True, method="bracket")
        assert torch.equal(got, ref_top_k_rows(sums, kk, width))
        assert torch.equal(got, topk.top_k_rows(sums, kk, width, method="radix"))
        print(f"s={s} bracket: fallback rows {float(fell_back.float().mean()):.4f}")
        assert float(fell_back.float().mean()) < 0.01


@pytest.mark.parametrize("pair,exp,extra", [(False, "f16x2", {}), (True, "fp32", {"pipelined": False}),
                                            (True, "f16x2", {}), (True, "fp32", {"pipelined": True})])
def test_select_pass2_variants_on_gpu_against_float64(cuda_gen, pair, exp, extra):
    """Pass 2 with two groups per program (also staggered) and/or the packed f16x2 exponentials
    (inline PTX on the GPU): group sums
    within 5e-3 (f16x2; 1e-4 for fp32) relative L2 of float64 per group, odd group count and ragged S, every entry
    written; select_kv on them is exactly the top-K of its float16 sums and keeps >= 99.5 % of the float64 top-K's
    probability mass."""
    from comfyui_mc_sparse_pack.kernels.triton import selection

    S, D, C, H, kq = 5000, 128, 128, 2, 1234  # G = 40 (even); S = 4900 below gives 39 (odd)
    for S in (5000, 4900):
        q, k = (torch.randn(1, H, S, D, device="cuda", generator=cuda_gen).to(torch.bfloat16) for _ in range(2))
        _, lse = kernels.dense_attention(q, k, k, return_lse=True)
        perm = kernels.pddp_groups(q, C, backend="triton")
        G = perm.shape[-1] // C
        out = torch.full((1, H, G, S), float("nan"), device="cuda")
        selection.group_prob_sums(q, k, lse, perm, group_size=C, out=out, pair=pair, exp=exp, fp8=False, **extra)
        ref = reference.group_prob_sums(q.double(), k.double(), lse.double(), perm, group_size=C)
        assert not out.isnan().any()
        rel = (out.double() - ref).norm(dim=-1) / ref.norm(dim=-1)
        assert float(rel.max()) < (5e-3 if exp == "f16x2" else 1e-4), float(rel.max())
        idx = selection.select_kv(q, k, lse, perm, kq, group_size=C, kv_tile=128, pair=pair, exp=exp, fp8=False,
                                  **extra)
        assert torch.equal(idx, ref_top_k_rows(out.half(), kq, idx.shape[-1]))
        kept = ref.gather(-1, idx[..., :kq].long()).sum(-1)
        assert bool((kept >= 0.995 * ref.topk(kq, -1).values.sum(-1)).all())


@pytest.mark.parametrize("extra", [{}, {"poly": 1}, {"poly": 2}, {"pipelined": False}, {"block_n": 128, "num_warps": 8}])
def test_select_fp8_pass2_on_gpu_is_exact_on_its_operands(cuda_gen, extra):
    """Float8 pass 2 compiled (wgmma e4m3 on sm_90): the group sums of its own smoothed float8 operands
    (``fp8_operands``, dequantised, in float64) within 5e-4 relative L2 per group (H200, round 1: 5e-5 - 1.4e-4 without
    polynomial exponentials, where the interpreter gives <= 2e-5: Hopper's float8 wgmma accumulates with fewer bits),
    keys with a shared component, odd group count and ragged S, every entry written; select_kv with fp8 is exactly
    the top-K of its float16 sums and keeps >= 99.5 % of the float64 top-K's probability mass."""
    from comfyui_mc_sparse_pack.kernels.triton import pass2_dispatch, selection

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 products need sm_89+")
    D, C, H, kq = 128, 128, 2, 1234
    for S in (5000, 4900):
        q = (torch.randn(1, H, S, D, device="cuda", generator=cuda_gen)
             + torch.randn(1, H, 1, D, device="cuda", generator=cuda_gen)).to(torch.bfloat16)
        k = (torch.randn(1, H, S, D, device="cuda", generator=cuda_gen)
             + 2 * torch.randn(1, H, 1, D, device="cuda", generator=cuda_gen)).to(torch.bfloat16)
        _, lse = kernels.dense_attention(q, k, k, return_lse=True)
        perm = kernels.pddp_groups(q, C, backend="triton")
        G = perm.shape[-1] // C
        out = torch.full((1, H, G, S), float("nan"), device="cuda")
        selection.group_prob_sums(q, k, lse, perm, group_size=C, out=out, fp8=True, **extra)
        assert not out.isnan().any()
        # the operands group_prob_sums made: with qf = 1 where the CuTeDSL kernel's unit_qf form is on
        unit = pass2_dispatch.cute_wanted() and pass2_dispatch.cute_unit_qf()
        q8, k8, qf, lse_s, kb = selection.fp8_operands(q, k, lse, D**-0.5, unit_qf=unit)
        (mq, qs), (mk, ks) = selection.fp8_stats(q), selection.fp8_stats(k)
        for x, m, sc in ((q, mq, qs), (k, mk, ks)):  # the compiled statistics pass against torch
            assert torch.allclose(m.double(), x.double().mean(2), rtol=1e-5, atol=1e-5)
            amax = (x.float() - m[:, :, None]).abs().amax((-2, -1))  # scale: a power of two, amax / scale in (224, 448]
            assert bool((torch.frexp(sc)[0] == 0.5).all()) and bool(((amax / sc > 224) & (amax / sc <= 448)).all())
        # dequantised: q8 . k8 x qf / log2(e) is the logit (natural units) for either kind of operands
        deq = reference.group_prob_sums(q8.double(), k8.double() * (qf.double() / (D**-0.5 * math.log2(math.e)))[
            ..., None, None], lse_s.double(), perm, group_size=C)
        deq = deq * torch.exp2(kb.double())[:, :, None, :]
        rel = (out.double() - deq).norm(dim=-1) / deq.norm(dim=-1)
        assert float(rel.max()) < 5e-4, float(rel.max())  # H200: 5e-5 - 1.4e-4 (e4m3 MMA's reduced-precision sums)
        idx = selection.select_kv(q, k, lse, perm, kq, group_size=C, kv_tile=128, fp8=True, **extra)
        assert torch.equal(idx, ref_top_k_rows(out.half(), kq, idx.shape[-1]))
        ref = reference.group_prob_sums(q.double(), k.double(), lse.double(), perm, group_size=C)
        kept = ref.gather(-1, idx[..., :kq].long()).sum(-1)
        assert bool((kept >= 0.995 * ref.topk(kq, -1).values.sum(-1)).all())


def test_select_kv_on_gpu_is_the_top_k_of_its_sums(cuda_gen):
    """Triton select_kv at a ragged S: the exact top-K of its float16 group sums; >= 99.5 % of the float32 top-K mass."""
    S, D, C, H = 5000, 128, 128, 2
    q, k = (torch.randn(1, H, S, D, device="cuda", generator=cuda_gen).to(torch.bfloat16) for _ in range(2))
    _, lse = kernels.dense_attention(q, k, k, return_lse=True)
    perm = kernels.pddp_groups(q, C, backend="triton")
    kq = 1234
    idx = kernels.select_kv(q, k, lse, perm, kq, group_size=C, kv_tile=128, backend="triton")
    sums16 = kernels.group_prob_sums(q, k, lse, perm, group_size=C, backend="triton").half()
    assert torch.equal(idx, ref_top_k_rows(sums16, kq, idx.shape[-1]))
    exact = reference.group_prob_sums(q.float(), k.float(), lse, perm, group_size=C)
    best = exact.topk(kq, -1).values.sum(-1)
    kept = exact.gather(-1, idx[..., :kq].long()).sum(-1)
    assert bool((kept >= 0.995 * best).all())


@pytest.mark.parametrize("variant", ["default", "s256 i8 w8", "compact s64 sq8 w4", "compact s64 i4 sort3",
                                     "compact s64 i4 sort16", "compact s64 i4 sub8 w4"])
def test_grouping_on_gpu_contract_and_quality(cuda_gen, variant, monkeypatch):
    """Triton PDDP at the 1.3B 480p token count on structured queries: contract, and mean within-group variance
    within 5 % of the torch reference's; the default through the op, the benchmark's variants (repeated squaring,
    int8 copy, warps, subtree programs of up to 8 / 16 groups, one-round sort splits) through ``grouping.pddp_groups``."""
    from comfyui_mc_sparse_pack.kernels.triton import grouping

    grid, D, C, H = (21, 30, 52), 128, 128, 2
    pos = torch.stack(torch.meshgrid(*(torch.arange(n, device="cuda", dtype=torch.float32) for n in grid),
                                     indexing="ij"), -1).reshape(-1, 3) / torch.tensor(grid, device="cuda")
    q = torch.stack([torch.sin(pos @ (torch.randn(3, D, device="cuda", generator=cuda_gen) * 6.0))
                     + pos @ torch.randn(3, D, device="cuda", generator=cuda_gen)
                     + 0.3 * torch.randn(pos.shape[0], D, device="cuda", generator=cuda_gen) for _ in range(H)])
    q = q.unsqueeze(0).to(torch.bfloat16)
    S = q.shape[2]
    if variant == "default":
        perm = kernels.pddp_groups(q, C, backend="triton")
    else:
        words = variant.split()
        samples = int(next(w for w in words if w.startswith("s") and w[1:].isdigit())[1:])
        sq = next((int(w[2:]) for w in words if w.startswith("sq")), None)
        iters = next((int(w[1:]) for w in words if w.startswith("i") and w[1:].isdigit()), None)
        monkeypatch.setattr(grouping, "POWER_ITERS_MAX", 16)
        monkeypatch.setattr(grouping, "SUBTREE", next((int(w[3:]) for w in words if w.startswith("sub")), 2))
        monkeypatch.setattr(grouping, "SORTSPLIT", next((int(w[4:]) for w in words if w.startswith("sort")), 0))
        monkeypatch.setattr(grouping, "SQUARE", sq is not None)
        monkeypatch.setattr(grouping, "COMPACT", "compact" in words)
        monkeypatch.setattr(grouping, "_DIR_WARPS", next((int(w[1:]) for w in words if w.startswith("w")), None))
        perm = grouping.pddp_groups(q, C, samples=samples, power_iters=sq or iters or 8)
    assert (perm[..., S:] == -1).all()
    assert torch.equal(torch.sort(perm[..., :S], -1).values, torch.arange(S, device="cuda", dtype=torch.int32).expand(1, H, S))
    ratio = within_group_variance(q, perm, C).sum() / within_group_variance(q, reference.pddp_groups(q, C), C).sum()
    assert float(ratio) <= 1.05


def test_grouping_cuda_graph_path_equals_eager(cuda_gen, monkeypatch):
    """The CUDA-graph path (second call of a shape on: capture, then replays with q copied in) returns exactly the
    eager tree's groups, for fresh q each call and a strided q view."""
    from comfyui_mc_sparse_pack.kernels.triton import grouping

    B, S, H, D, C = 1, 5000, 3, 128, 128
    monkeypatch.setattr(grouping, "_GRAPHS", {})
    qs = [torch.randn(B, S, H * D, device="cuda", generator=cuda_gen).to(torch.bfloat16).view(B, S, H, D)
          .transpose(1, 2) for _ in range(4)]
    got = [grouping.pddp_groups(q, C) for q in qs]
    assert any(isinstance(e, tuple) for e in grouping._GRAPHS.values())  # captured
    monkeypatch.setattr(grouping, "GRAPH", False)
    for q, perm in zip(qs, got):
        assert torch.equal(perm, grouping.pddp_groups(q, C))


def test_anchor_on_gpu_residual_restores_dense(cuda_gen):
    """anchor_attention on the default GPU kernels: the output is the dense one and sparse + R reproduces it."""
    S, D, H = 3000, 128, 2
    q, k, v = (torch.randn(1, H, S, D, device="cuda", generator=cuda_gen).to(torch.bfloat16) for _ in range(3))
    cfg = MCSparseConfig(density=0.25, group_size=128, kv_tile=128)
    out, entry = anchor_attention(q, k, v, cfg)
    dense = reference.dense_attention(q.float(), k.float(), v.float())
    assert float((out.float() - dense).norm() / dense.norm()) < 1e-2
    sparse = kernels.sparse_attention(q, k, v, entry.perm, entry.kv_idx)
    residual = entry.residual if isinstance(entry.residual, torch.Tensor) else entry.residual.dequantize(torch.float32, entry.perm)
    assert float((sparse.float() + residual.float() - out.float()).abs().max()) < 2e-2


def test_anchor_finite_check_beside_pass_1(cuda_gen, monkeypatch):
    """attention.FINITE_BESIDE (the finite check on a side stream, pass 1 queued before the host waits for it): the
    same output, groups, selection and residual as the check in line; a NaN or inf in q, k, v or extra_kv (as strided
    [B, H, S, D] views of [B, S, H*D], ComfyUI's layout) still raises NonFiniteInputError naming it."""
    from comfyui_mc_sparse_pack.comfyui_mc_sparse import attention

    cfg = MCSparseConfig(density=0.15, group_size=128, kv_tile=64)
    B, S, H, D = 1, 32760, 12, 128
    q, k, v = (torch.randn(B, S, H * D, device="cuda", generator=cuda_gen).to(torch.bfloat16)
               .view(B, S, H, D).transpose(1, 2) for _ in range(3))
    monkeypatch.setattr(attention, "FINITE_BESIDE", False)
    want = anchor_attention(q, k, v, cfg)
    monkeypatch.setattr(attention, "FINITE_BESIDE", True)
    got = anchor_attention(q, k, v, cfg)
    assert torch.equal(got[0], want[0])
    for name in ("perm", "kv_idx", "residual"):
        assert torch.equal(getattr(got[1], name), getattr(want[1], name)), name
    x = torch.randn(B, H, 77, D, device="cuda", generator=cuda_gen).to(torch.bfloat16)
    for which, bad in (("q", float("nan")), ("v", float("inf")), ("extra_kv v", float("-inf"))):
        tensors = {"q": q.clone(), "k": k, "v": v.clone(), "extra_kv k": x, "extra_kv v": x.clone()}
        tensors[which][0, 3, 1000 % tensors[which].shape[2], 5] = bad
        with pytest.raises(attention.NonFiniteInputError, match=f"{which} must be finite"):
            anchor_attention(tensors["q"], tensors["k"], tensors["v"], cfg,
                             extra_kv=(tensors["extra_kv k"], tensors["extra_kv v"]))


@pytest.mark.parametrize("pack", ["bytes", "words"])
def test_anchor_entry_encodes_without_host_sync(cuda_gen, pack, monkeypatch):
    """Encoding an anchor's entry (bitmask selection either way, bf16 residual) makes no device-to-host sync."""
    from comfyui_mc_sparse_pack.comfyui_mc_sparse import encoding
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.cache import encode_entry

    monkeypatch.setattr(encoding, "PACK_BITS", pack)

    q, k, v = (torch.randn(1, 2, 3000, 128, device="cuda", generator=cuda_gen).to(torch.bfloat16) for _ in range(3))
    _, entry = anchor_attention(q, k, v, MCSparseConfig(density=0.25, group_size=128, kv_tile=128), check_finite=False)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        stored = encode_entry(entry, index_encoding="bitmask", residual_dtype="bfloat16")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(stored.decode(q.device).kv_idx, entry.kv_idx)


@pytest.mark.parametrize("fp8", [False, True])
def test_select_pass2_histogram_on_gpu(cuda_gen, fp8):
    """The compiled pair kernel's first-digit histogram (the sums' layout replicates each key over a quad of threads:
    each key must count once) equals the histogram of the top 8 bits of the float16 sums it stored, and select_kv
    with it (radix top-K skipping its first pass) equals select_kv without it."""
    from comfyui_mc_sparse_pack.kernels.triton import selection

    if fp8 and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 products need sm_89+")
    S, D, C, H, kq = 4900, 128, 128, 2, 1234
    q, k = (torch.randn(1, H, S, D, device="cuda", generator=cuda_gen).to(torch.bfloat16) for _ in range(2))
    _, lse = kernels.dense_attention(q, k, k, return_lse=True)
    perm = kernels.pddp_groups(q, C, backend="triton")
    G = perm.shape[-1] // C
    sums = torch.empty(1, H, G, S, dtype=torch.float16, device="cuda")
    hist = torch.full((1, H, G, 128), -7, dtype=torch.int32, device="cuda")
    selection.group_prob_sums(q, k, lse, perm, group_size=C, out=sums, hist=hist, fp8=fp8, pair=True)
    key = sums.view(torch.int16).to(torch.int32).clamp_min(0) >> 8
    want = torch.nn.functional.one_hot(key.long(), 128).sum(-2).to(torch.int32)
    assert torch.equal(hist, want), int((hist - want).abs().max())
    with_hist = selection.select_kv(q, k, lse, perm, kq, group_size=C, kv_tile=128, fp8=fp8, topk_hist=True)
    without = selection.select_kv(q, k, lse, perm, kq, group_size=C, kv_tile=128, fp8=fp8, topk_hist=False,
                                  topk_method="radix")
    assert torch.equal(with_hist, without)
