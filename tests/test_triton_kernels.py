"""The Triton kernels against the torch reference in float64, under TRITON_INTERPRET=1 on CPU (conftest sets it).

Tolerances: the kernels take fp16/bf16 inputs and accumulate in fp32; the reference gets the same (rounded) inputs
in float64, so the remaining error is the kernel's own: P rounded to the input dtype before P @ V (relative 2^-8
for bf16, 2^-11 for fp16) and exp2 in fp32. Bars are a few times those roundings.
"""

from __future__ import annotations

import pytest
import torch
from comfyui_mc_sparse_pack import kernels
from comfyui_mc_sparse_pack.kernels import reference, registry

from ._triton_interp import patch_interpreter

triton_backend = next(b for b in registry.backends() if b.name == "triton")
pytestmark = pytest.mark.skipif(
    bool(triton_backend.unavailable_reason), reason=f"triton backend unavailable: {triton_backend.unavailable_reason}"
)
patch_interpreter()

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (S, D, C, num_keys, kv_tile): ragged S (not a multiple of C), K not a multiple of the kernels' 64-slot tile
CASES = [(100, 32, 16, 37, 16), (70, 64, 32, 20, 8), (45, 16, 24, 45, 64)]
IDS = [f"S{s}-D{d}-C{c}-K{k}-tile{t}" for s, d, c, k, t in CASES]
BOUND = {torch.float16: 4e-3, torch.bfloat16: 2e-2}


def _inputs(gen, S, D, dtype, B=1, H=2):
    q, k, v = (torch.randn(B, H, S, D, generator=gen).to(dtype).to(DEVICE) for _ in range(3))
    return q, k, v


def _random_groups(gen, B, H, S, C):
    """A random permutation per (b, h) as query groups, -1 padded to G*C."""
    G = -(-S // C)
    perm = torch.full((B, H, G * C), -1, dtype=torch.int32)
    for b in range(B):
        for h in range(H):
            perm[b, h, :S] = torch.randperm(S, generator=gen).to(torch.int32)
    return perm.to(DEVICE)


def _random_kv_idx(gen, B, H, G, S, K, kv_tile):
    k_alloc = -(-K // kv_tile) * kv_tile
    idx = torch.full((B, H, G, k_alloc), -1, dtype=torch.int32)
    for b in range(B):
        for h in range(H):
            for g in range(G):
                idx[b, h, g, :K] = torch.sort(torch.randperm(S, generator=gen)[:K]).values.to(torch.int32)
    return idx.to(DEVICE)


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize(("S", "D", "C", "K", "kv_tile"), CASES, ids=IDS)
def test_sparse_attention_matches_reference(gen, monkeypatch, dtype, S, D, C, K, kv_tile):
    """O and LSE match the float64 reference; every output element is written (NaN-poisoned buffers)."""
    q, k, v = _inputs(gen, S, D, dtype)
    perm = _random_groups(gen, 1, 2, S, C)
    idx = _random_kv_idx(gen, 1, 2, perm.shape[-1] // C, S, K, kv_tile)
    real_empty, real_empty_like = torch.empty, torch.empty_like
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: real_empty(*a, **kw).fill_(float("nan")))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: real_empty_like(*a, **kw).fill_(float("nan")))
    with registry.recording(registry.Record()) as record:
        out, lse = kernels.sparse_attention(q, k, v, perm, idx, return_lse=True, backend="triton")
    monkeypatch.undo()
    assert record.choices["sparse_attention"].backend == "triton"
    ref_o, ref_lse = reference.sparse_attention(q.double(), k.double(), v.double(), perm, idx, return_lse=True)
    assert not out.isnan().any() and not lse.isnan().any()
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert _rel(out, ref_o) < BOUND[dtype]
    assert (lse.double() - ref_lse.double()).abs().max() < 1e-4


def test_sparse_attention_strided_inputs_and_no_lse(gen):
    """A [B, H, S, D] view of a [B, S, H, D] tensor (the adapter's layout) gives the contiguous result."""
    S, D, C, K = 50, 32, 16, 20
    base = torch.randn(1, S, 2, D, generator=gen).half()
    q = base.transpose(1, 2)
    k, v = torch.randn(1, 2, S, D, generator=gen).half(), torch.randn(1, 2, S, D, generator=gen).half()
    perm = _random_groups(gen, 1, 2, S, C)
    idx = _random_kv_idx(gen, 1, 2, perm.shape[-1] // C, S, K, 16)
    a = kernels.sparse_attention(q, k, v, perm, idx, backend="triton")
    b = kernels.sparse_attention(q.contiguous(), k, v, perm, idx, backend="triton")
    assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize(("S", "D", "C", "K", "kv_tile"), CASES[:2], ids=IDS[:2])
def test_group_prob_sums_matches_reference(gen, monkeypatch, dtype, S, D, C, K, kv_tile):
    """Pass 2 sums equal the float64 reference's within fp32 exp2 error; all entries written."""
    q, k, _ = _inputs(gen, S, D, dtype)
    perm = _random_groups(gen, 1, 2, S, C)
    _, lse = reference.dense_attention(q.double(), k.double(), k.double(), return_lse=True)
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: real_empty(*a, **kw).fill_(float("nan")))
    sums = kernels.group_prob_sums(q, k, lse, perm, group_size=C, backend="triton")
    monkeypatch.undo()
    ref = reference.group_prob_sums(q.double(), k.double(), lse, perm, group_size=C)
    assert sums.dtype == torch.float32 and not sums.isnan().any()
    assert _rel(sums, ref) < 1e-5


def test_group_prob_sums_polynomial_exp2(gen):
    """The FMA-pipe exp2 used for every other key tile (poly=True) keeps the sums within 1e-4."""
    from comfyui_mc_sparse_pack.kernels.triton import selection

    S, D, C = 300, 32, 32
    q, k, _ = _inputs(gen, S, D, torch.bfloat16)
    perm = _random_groups(gen, 1, 2, S, C)
    _, lse = reference.dense_attention(q.double(), k.double(), k.double(), return_lse=True)
    sums = selection.group_prob_sums(q, k, lse, perm, group_size=C, poly=True)
    ref = reference.group_prob_sums(q.double(), k.double(), lse, perm, group_size=C)
    assert _rel(sums, ref) < 1e-4


def test_sparse_attention_masks_minus_one_anywhere(gen):
    """mask_from_count=False masks -1 slots wherever they sit (not only trailing), as the reference does."""
    from comfyui_mc_sparse_pack.kernels.triton import sparse_attention as tsa

    S, D, C, K = 60, 32, 16, 24
    q, k, v = _inputs(gen, S, D, torch.float16)
    perm = _random_groups(gen, 1, 2, S, C)
    idx = _random_kv_idx(gen, 1, 2, perm.shape[-1] // C, S, K, 8)
    idx[..., 3] = -1  # a hole in the middle of every group
    out = tsa(q, k, v, perm, idx, mask_from_count=False)
    ref = reference.sparse_attention(q.double(), k.double(), v.double(), perm, idx)
    assert _rel(out, ref) < BOUND[torch.float16]


def test_group_prob_sums_groups_wider_than_a_tile(gen):
    """C = 200 > 128 runs the kernel's chunk loop over the group's queries."""
    S, D, C = 300, 16, 200
    q, k, _ = _inputs(gen, S, D, torch.float16, H=1)
    perm = _random_groups(gen, 1, 1, S, C)
    _, lse = reference.dense_attention(q.double(), k.double(), k.double(), return_lse=True)
    sums = kernels.group_prob_sums(q, k, lse, perm, group_size=C, backend="triton")
    ref = reference.group_prob_sums(q.double(), k.double(), lse, perm, group_size=C)
    assert _rel(sums, ref) < 1e-5


@pytest.mark.parametrize(("S", "D", "C", "K", "kv_tile"), CASES[:2], ids=IDS[:2])
def test_select_kv_matches_reference_selection(gen, S, D, C, K, kv_tile):
    """select_kv keeps the reference's top-K tokens (sorted, -1 padded) up to ties within fp32 error."""
    q, k, _ = _inputs(gen, S, D, torch.bfloat16)
    perm = _random_groups(gen, 1, 2, S, C)
    _, lse = reference.dense_attention(q.double(), k.double(), k.double(), return_lse=True)
    got = kernels.select_kv(q, k, lse, perm, K, group_size=C, kv_tile=kv_tile, backend="triton")
    ref = reference.select_kv(q.double(), k.double(), lse, perm, K, group_size=C, kv_tile=kv_tile)
    assert got.shape == ref.shape and got.dtype == torch.int32
    assert (got[..., K:] == -1).all()
    assert (got[..., :K].diff(dim=-1) > 0).all()  # sorted ascending, distinct
    sums = reference.group_prob_sums(q.double(), k.double(), lse, perm, group_size=C)
    kth = torch.topk(sums, K, dim=-1).values[..., -1:]  # the K-th largest sum per group
    picked = torch.gather(sums, -1, got[..., :K].long())
    # every pick is in the top K, up to ties within the fp16 rounding of select_kv's scratch sums (2^-11)
    assert (picked >= kth * (1 - 2e-3)).all()


def test_select_kv_chunks_heads(gen):
    """Chunking heads (bounded scratch) gives the same selection as one chunk."""
    S, D, C, K = 64, 16, 16, 10
    q, k, _ = _inputs(gen, S, D, torch.float16, H=3)
    perm = _random_groups(gen, 1, 3, S, C)
    _, lse = reference.dense_attention(q.double(), k.double(), k.double(), return_lse=True)
    from comfyui_mc_sparse_pack.kernels.triton import selection

    one = selection.select_kv(q, k, lse, perm, K, group_size=C, kv_tile=8)
    per_head = selection.select_kv(q, k, lse, perm, K, group_size=C, kv_tile=8, heads_per_chunk=1)
    assert torch.equal(one, per_head)


def test_refusals_are_reasons():
    """The Triton backend refuses what it cannot run, with a reason, and auto dispatch skips it on CPU."""
    from comfyui_mc_sparse_pack.kernels.triton import refuse

    q = torch.zeros(1, 1, 4, 32, dtype=torch.float16)
    assert "float16/bfloat16" in refuse("sparse_attention", q.float(), True)
    assert "power of two" in refuse("sparse_attention", torch.zeros(1, 1, 4, 48, dtype=torch.float16), True)
    assert "requested" in refuse("sparse_attention", q, False)
    names = [b.name for b, _ in registry.candidates("sparse_attention", q)]
    assert "triton" not in names and names[-1] == "torch"


@pytest.mark.parametrize(("K", "k_alloc"), [(64, 64), (128, 192), (16437, 16500)], ids=["full-tiles", "tail-tiles", "long"])
def test_sparse_attention_valid_count_paths(gen, K, k_alloc):
    """The in-kernel valid count (two-level probe of the trailing -1 slots) and the unmasked full-tile loop: K a
    multiple of the 64-slot tile (no masked tail), a -1 tail longer than one tile, and K_alloc > 128 * 128 (the
    probe's second level loops). Indices may repeat here (the kernel and the reference both count repeats)."""
    S, D, C = 40, 16, 16
    q, k, v = _inputs(gen, S, D, torch.bfloat16, H=1)
    perm = _random_groups(gen, 1, 1, S, C)
    G = perm.shape[-1] // C
    idx = torch.full((1, 1, G, k_alloc), -1, dtype=torch.int32)
    idx[..., :K] = torch.sort(torch.randint(0, S, (1, 1, G, K), generator=gen), dim=-1).values.to(torch.int32)
    out, lse = kernels.sparse_attention(q, k, v, perm, idx.to(DEVICE), return_lse=True, backend="triton")
    ref_o, ref_lse = reference.sparse_attention(q.double(), k.double(), v.double(), perm, idx.to(DEVICE), return_lse=True)
    assert _rel(out, ref_o) < BOUND[torch.bfloat16]
    assert (lse.double() - ref_lse.double()).abs().max() < 1e-4


@pytest.mark.parametrize(("S", "C"), [(1000, 64), (333, 16), (128, 128), (50, 64), (700, 100)])
def test_pddp_groups_gpu_path_contract(gen, S, C):
    """The GPU PDDP op: every query once, exactly C per group, -1 only in the last G*C - S slots, int32."""
    from comfyui_mc_sparse_pack.kernels.torch_gpu import pddp

    q = torch.randn(2, 3, S, 32, generator=gen).to(torch.bfloat16)
    perm = pddp.pddp_groups(q, C)
    G = -(-S // C)
    assert perm.dtype == torch.int32 and perm.shape == (2, 3, G * C)
    assert (perm[..., S:] == -1).all()
    assert torch.equal(torch.sort(perm[..., :S], dim=-1).values, torch.arange(S, dtype=torch.int32).expand(2, 3, S))


def test_pddp_groups_gpu_path_splits_like_reference(gen):
    """On a clearly anisotropic input (one axis with 10x the spread) the first split is the reference's (up to the
    arbitrary sign of the direction and queries whose projections tie within bf16 rounding), it runs along that
    axis, and the final groups agree with the reference's for almost every query."""
    from comfyui_mc_sparse_pack.kernels.torch_gpu import pddp

    S, C, D = 1000, 64, 32
    scale = torch.ones(D)
    scale[5] = 10.0
    scale[9] = 4.0
    q = (torch.randn(1, 2, S, D, generator=gen) * scale).to(torch.bfloat16)
    got = pddp.pddp_groups(q, C)
    ref = reference.pddp_groups(q, C)
    G = -(-S // C)
    left = -(-G // 2) * C

    for h in range(2):
        first = set(got[0, h, :left].tolist())
        ref_first = set(ref[0, h, :left].tolist())
        ref_right = set(range(S)) - ref_first
        assert max(len(first & ref_first), len(first & ref_right)) / left > 0.98
        order = torch.argsort(q[0, h, :, 5].float())
        low, high = set(order[:left].tolist()), set(order[-left:].tolist())
        assert max(len(first & low), len(first & high)) / left > 0.9
        same = sum(len(set(got[0, h, g * C:(g + 1) * C].tolist()) & set(ref[0, h, g * C:(g + 1) * C].tolist()))
                   for g in range(G))
        assert same / S > 0.9
