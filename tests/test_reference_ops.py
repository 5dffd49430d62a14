"""The torch reference ops against brute force in float64: grouping, exact selection, sparse attention."""

import math

import pytest
import torch
from comfyui_mc_sparse_pack import kernels
from comfyui_mc_sparse_pack.kernels.reference import pddp


def _qkv(gen, B, H, S, D, dtype=torch.float32):
    return [torch.randn(B, H, S, D, generator=gen).to(dtype) for _ in range(3)]


def _dense64(q, k, v):
    s = q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1])
    p = torch.softmax(s, -1)
    return p @ v.double(), torch.logsumexp(s, -1), p


@pytest.mark.parametrize("S,C", [(256, 64), (300, 64), (257, 128), (5, 64), (64, 64)])
def test_groups_partition_queries_exactly_c_per_group(gen, S, C):
    """Every query lands in exactly one group; every group but the ragged last one holds exactly C."""
    q = torch.randn(2, 3, S, 64, generator=gen)
    perm = kernels.pddp_groups(q, C)
    G = -(-S // C)
    assert perm.dtype == torch.int32 and perm.shape == (2, 3, G * C)
    for b in range(2):
        for h in range(3):
            row = perm[b, h]
            assert torch.equal(torch.sort(row[:S]).values, torch.arange(S, dtype=torch.int32))
            assert (row[S:] == -1).all()


def test_power_iteration_matches_eigendecomposition(gen):
    """With an eigengap, the default power iteration finds the covariance's top eigenvector (up to sign)."""
    scales = torch.cat([torch.linspace(0.5, 2.0, 31, dtype=torch.float64), torch.tensor([4.0], dtype=torch.float64)])
    x = torch.randn(16, 2000, 32, generator=gen, dtype=torch.float64) * scales
    x = x @ torch.linalg.qr(torch.randn(32, 32, generator=gen, dtype=torch.float64)).Q  # a random principal axis
    x = x - x.mean(1, keepdim=True)
    cov = x.transpose(-1, -2) @ x
    v = pddp.principal_direction(cov, iters=8)
    top = torch.linalg.eigh(cov).eigenvectors[..., -1]
    assert torch.allclose((v * top).sum(-1).abs(), torch.ones(16, dtype=torch.float64), atol=1e-6)


def test_pddp_groups_are_contiguous_along_the_principal_direction(gen):
    """The first split separates queries by their projection on the principal direction (median cut)."""
    S, C = 256, 64
    q = torch.randn(1, 1, S, 16, generator=gen) * torch.linspace(0.1, 4.0, 16)
    perm = kernels.pddp_groups(q, C, power_iters=50).long()[0, 0]
    x = q[0, 0].double()
    xc = x - x.mean(0)
    v = pddp.principal_direction((xc.T @ xc)[None], 50)[0]
    proj = xc @ v
    left, right = proj[perm[: S // 2]], proj[perm[S // 2 :]]
    assert left.max() <= right.min() or right.max() <= left.min()


@pytest.mark.parametrize("S,C,density_keys", [(200, 64, 37), (256, 128, 100), (130, 64, 130)])
def test_selection_equals_brute_force_topk(gen, S, C, density_keys):
    """select_kv keeps, per group, the K tokens of largest float64 summed probability (ties aside)."""
    q, k, v = _qkv(gen, 1, 2, S, 64)
    _, lse, p = _dense64(q, k, v)
    perm = kernels.pddp_groups(q, C)
    idx = kernels.select_kv(q, k, lse.float(), perm, density_keys, group_size=C, kv_tile=16)
    G = -(-S // C)
    assert idx.shape[-1] == -(-density_keys // 16) * 16
    for h in range(2):
        for g in range(G):
            members = perm[0, h, g * C : (g + 1) * C]
            members = members[members >= 0].long()
            sums = p[0, h, members].sum(0)  # [S]
            chosen = idx[0, h, g]
            assert (chosen[density_keys:] == -1).all()
            chosen = chosen[:density_keys].long()
            assert torch.equal(chosen, torch.sort(chosen).values) and chosen.unique().numel() == density_keys
            kth = torch.topk(sums, density_keys).values[-1]
            assert sums[chosen].min() >= kth - 1e-5  # every kept token is in the top K (up to fp32 ties)


def test_reference_selection_breaks_ties_to_the_lower_index(gen):
    """The torch backend's select_kv follows the rule of every backend (``reference.topk``): among keys of equal group
    sum, the lower token index wins. Keys drawn from 3 distinct rows make exact ties in every group's sums, cut by K
    (mutation: the old ``torch.topk``, which picks among ties arbitrarily: most rows differ)."""
    from comfyui_mc_sparse_pack.kernels.reference.topk import top_k_rows

    B, H, S, C, D, K = 1, 2, 200, 64, 64, 90
    q = torch.randn(B, H, S, D, generator=gen)
    rows = torch.randn(B, H, 3, D, generator=gen)
    pick = torch.randint(0, 3, (S,), generator=gen)
    k = rows[:, :, pick].contiguous()
    _, lse = kernels.dense_attention(q, k, k, return_lse=True, backend="torch")
    perm = kernels.pddp_groups(q, C, backend="torch")
    idx = kernels.select_kv(q, k, lse, perm, K, group_size=C, kv_tile=16, backend="torch")
    sums = kernels.group_prob_sums(q, k, lse, perm, group_size=C, backend="torch")
    assert torch.equal(idx, top_k_rows(sums, K, idx.shape[-1]))
    ties = (sums.unsqueeze(-1) == sums.unsqueeze(-2)).sum(-1).gt(1).float().mean()
    assert ties > 0.5, ties  # most keys tie exactly with others


def test_group_prob_sums_match_float64(gen):
    """Pass 2 sums equal float64 sums of exact probabilities over each group's queries."""
    S, C = 150, 64
    q, k, v = _qkv(gen, 2, 2, S, 64)
    _, lse, p = _dense64(q, k, v)
    perm = kernels.pddp_groups(q, C)
    sums = kernels.group_prob_sums(q, k, lse.float(), perm, group_size=C)
    G = -(-S // C)
    groups = perm.reshape(2, 2, G, C).long()
    ref = torch.zeros(2, 2, G, S, dtype=torch.float64)
    for g in range(G):
        for j in range(C):
            idx = groups[:, :, g, j]
            ok = (idx >= 0).double()[..., None]
            ref[:, :, g] += torch.gather(p, 2, idx.clamp_min(0)[..., None, None].expand(-1, -1, 1, S))[:, :, 0] * ok
    assert torch.allclose(sums.double(), ref, atol=1e-4)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 1.5e-2)])
def test_sparse_attention_matches_masked_softmax(gen, dtype, tol):
    """Token-sparse attention equals softmax attention masked to each group's tokens, in query order."""
    B, H, S, C = 2, 2, 200, 64
    q, k, v = _qkv(gen, B, H, S, 64, dtype)
    _, lse, _ = _dense64(q, k, v)
    perm = kernels.pddp_groups(q, C)
    idx = kernels.select_kv(q, k, lse.float(), perm, 50, group_size=C, kv_tile=64)
    out, out_lse = kernels.sparse_attention(q, k, v, perm, idx, return_lse=True)
    mask = torch.zeros(B, H, S, S, dtype=torch.bool)
    G = idx.shape[2]
    for g in range(G):
        members = perm[:, :, g * C : (g + 1) * C].long()
        for b in range(B):
            for h in range(H):
                m = members[b, h][members[b, h] >= 0]
                kept = idx[b, h, g][idx[b, h, g] >= 0].long()
                mask[b, h, m[:, None], kept[None, :]] = True
    s = q.double() @ k.double().transpose(-1, -2) / 8.0
    s = s.masked_fill(~mask, float("-inf"))
    ref = torch.softmax(s, -1) @ v.double()
    assert torch.isfinite(out).all()
    err = (out.double() - ref).norm() / ref.norm()
    assert err < tol
    assert torch.allclose(out_lse.double(), torch.logsumexp(s, -1), atol=1e-3)


def test_sparse_attention_at_full_density_equals_dense(gen):
    """K = S: token-sparse attention is dense attention."""
    q, k, v = _qkv(gen, 1, 3, 190, 128)
    dense = kernels.dense_attention(q, k, v)
    perm = kernels.pddp_groups(q, 128)
    _, lse = kernels.dense_attention(q, k, v, return_lse=True)
    idx = kernels.select_kv(q, k, lse, perm, 190, group_size=128, kv_tile=64)
    assert (idx[..., 190:] == -1).all() and idx.shape[-1] == 192
    assert torch.allclose(kernels.sparse_attention(q, k, v, perm, idx), dense, atol=1e-5)


def test_dense_attention_lse_matches_float64(gen):
    """Pass 1 returns the dense output and the fp32 natural-log LSE."""
    q, k, v = _qkv(gen, 2, 2, 97, 64)
    ref, lse_ref, _ = _dense64(q, k, v)
    out, lse = kernels.dense_attention(q, k, v, return_lse=True)
    assert lse.dtype == torch.float32 and lse.shape == (2, 2, 97)
    assert torch.allclose(out.double(), ref, atol=1e-5) and torch.allclose(lse.double(), lse_ref, atol=1e-4)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda q: kernels.dense_attention(q[0], q[0], q[0][..., :32]), "v must have"),
        (lambda q: kernels.dense_attention(q[0].int(), q[0].int(), q[0].int()), "q must be float16"),
        (lambda q: kernels.dense_attention(q[0][0], q[0][0], q[0][0]), "4-D"),
        (lambda q: kernels.pddp_groups(q[0], 0), "group_size must be >= 1"),
        (lambda q: kernels.select_kv(q[0], q[0], q[1], q[2], 0, group_size=64, kv_tile=64), "num_keys must be in"),
        (lambda q: kernels.sparse_attention(q[0], q[0], q[0], q[2], q[2]), "kv_idx must be int32"),
        (lambda q: kernels.dense_attention(q[0], q[0], q[0], backend="nope"), "backend must be one of"),
    ],
)
def test_ops_reject_malformed_inputs(gen, call, match):
    """Malformed op inputs raise an error that names the input."""
    q = torch.randn(1, 2, 70, 64, generator=gen)
    lse = torch.randn(1, 2, 70, generator=gen)
    perm = kernels.pddp_groups(q, 64)
    with pytest.raises((ValueError, TypeError), match=match):
        call((q, lse, perm))


def test_chunked_reference_ops_equal_one_chunk(monkeypatch):
    """The torch reference bounds its memory by working in chunks of queries / query groups / bitmask rows (at real
    sizes: many chunks); every other test fits one chunk. With the chunk budgets cut so that each op runs in several
    uneven chunks, all five ops give the single-chunk results. Mutations: a chunk written to or read from
    the first chunk's rows, the last partial chunk dropped (float64: equal up to the products' summation order)."""
    from comfyui_mc_sparse_pack.kernels.reference import attention as ref_attn
    from comfyui_mc_sparse_pack.kernels.reference import bitmask as ref_bits

    gen = torch.Generator().manual_seed(41)
    B, H, S, D, C, K = 2, 2, 150, 16, 16, 24  # G = 10 groups, the last one padded
    q, k, v = (torch.randn(B, H, S, D, generator=gen, dtype=torch.float64) for _ in range(3))
    perm = torch.stack([torch.stack([torch.cat([torch.randperm(S, generator=gen), torch.full((10,), -1)])
                                     for _ in range(H)]) for _ in range(B)]).to(torch.int32)
    bits = torch.randint(0, 256, (B, H, 10, -(-S // 8)), generator=gen, dtype=torch.uint8)

    def run_all():
        out, lse = ref_attn.dense_attention(q, k, v, return_lse=True)
        sums = ref_attn.group_prob_sums(q, k, lse, perm, group_size=C)
        idx = ref_attn.select_kv(q, k, lse, perm, K, group_size=C, kv_tile=8)
        sparse, slse = ref_attn.sparse_attention(q, k, v, perm, idx, return_lse=True)
        decoded = ref_bits.decode_bitmask(bits, torch.empty(B, H, 10, S, dtype=torch.int32), num_tokens=S)
        return out, lse, sums, idx, sparse, slse, decoded

    whole = run_all()
    monkeypatch.setattr(ref_attn, "_CHUNK_ELEMENTS", 7 * B * H * S)  # 7 queries, under one group, per chunk
    monkeypatch.setattr(ref_bits, "_CHUNK_BITS", 3 * 8 * bits.shape[-1])  # 3 bitmask rows per chunk
    for want, got in zip(whole, run_all()):  # float64 / int32: equal up to the BLAS blocking of the products
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
