"""kernels/triton/regroup.py under the Triton interpreter (CPU): query rows to group order and back, the residual
added on the way back (every stored format), the LSE, and each group's valid-slot count, against torch / float64
references; outputs poisoned with NaN first, so every element the kernels must write is checked."""

from __future__ import annotations

import pytest
import torch
from comfyui_mc_sparse_pack.kernels.triton import regroup

from .test_reuse_op import brute_residual, make_residual


def _native(gen, B, S, H, D, dtype=torch.bfloat16):
    return torch.randn(B, S, H * D, generator=gen).to(dtype).view(B, S, H, D).transpose(1, 2)


def _perm(gen, B, H, S, C):
    G = -(-S // C)
    perm = torch.full((B, H, G * C), -1, dtype=torch.int32)
    perm[..., :S] = torch.argsort(torch.rand(B, H, S, generator=gen), -1).to(torch.int32)
    return perm


@pytest.mark.parametrize(("S", "C", "D"), [(300, 128, 64), (257, 64, 128)])
def test_gather_groups_is_the_permuted_rows(S, C, D):
    gen = torch.Generator().manual_seed(S + C)
    B, H = 2, 3
    q = _native(gen, B, S, H, D)
    perm = _perm(gen, B, H, S, C)
    got = regroup.gather_groups(q, perm, C)
    G = perm.shape[-1] // C
    assert got.shape == (B * H * G, C, D) and got.is_contiguous()
    want = torch.gather(q, 2, perm.long().clamp_min(0)[..., None].expand(-1, -1, -1, D)) * (perm >= 0)[..., None]
    assert torch.equal(got.view(B, H, G * C, D), want)


@pytest.mark.parametrize("kind", [None, "plain", "fp8_row", "int4_row", "int4_group"])
def test_scatter_groups_restores_order_adds_residual_and_lse(kind):
    gen = torch.Generator().manual_seed(17)
    B, H, S, D, C = 2, 2, 300, 64, 128
    G = -(-S // C)
    perm = _perm(gen, B, H, S, C)
    o_groups = torch.randn(B * H * G, C, D, generator=gen).to(torch.bfloat16)
    lse_groups = torch.randn(B * H * G, C, generator=gen)
    res = None if kind is None else make_residual(torch.randn(B, H, S, D, generator=gen) * 0.1, kind, perm, G)
    base = torch.full((B, S, H * D), float("nan"), dtype=torch.bfloat16)
    out = base.view(B, S, H, D).transpose(1, 2)  # a strided view, as the reuse path hands over
    lse = torch.full((B, H, S), float("nan"))
    regroup.scatter_groups(o_groups, perm, out, lse_groups=lse_groups, lse=lse, residual=res)
    assert not base.isnan().any() and not lse.isnan().any()
    rows = o_groups.view(B, H, G * C, D)[:, :, :S].double()
    dest = perm[:, :, :S].long()
    want = torch.empty(B, H, S, D, dtype=torch.float64).scatter_(2, dest[..., None].expand(-1, -1, -1, D), rows)
    size = want.abs()
    if res is not None:
        r = brute_residual(res, perm)
        want, size = want + r, size + r.abs()
    assert bool(((out.double() - want).abs() <= size * 2**-7 + 1e-6).all())  # one bf16 ulp (the interpreter truncates)
    want_lse = torch.empty(B, H, S, dtype=torch.float32).scatter_(2, dest, lse_groups.view(B, H, G * C)[:, :, :S])
    assert torch.equal(lse, want_lse)


def test_scatter_groups_without_lse_writes_only_the_output():
    """No LSE asked for: the output rows land in place (NaN-poisoned buffer), and nothing else in the buffer (the
    padding columns between heads) is touched: a kernel that still stored the LSE would write it through the output
    pointer."""
    gen = torch.Generator().manual_seed(29)
    B, H, S, D, C = 2, 2, 300, 64, 128
    G = -(-S // C)
    perm = _perm(gen, B, H, S, C)
    o_groups = torch.randn(B * H * G, C, D, generator=gen).to(torch.bfloat16)
    base = torch.full((B, S, H, D + 8), float("nan"), dtype=torch.bfloat16)  # 8 pad columns per head row
    out = base[..., :D].transpose(1, 2)
    regroup.scatter_groups(o_groups, perm, out)
    assert not out.isnan().any() and base[..., D:].isnan().all()
    rows = o_groups.view(B, H, G * C, D)[:, :, :S]
    dest = perm[:, :, :S].long()
    want = torch.empty(B, H, S, D, dtype=torch.bfloat16).scatter_(2, dest[..., None].expand(-1, -1, -1, D), rows)
    assert torch.equal(out, want)


def test_scatter_groups_refuses_layouts_it_would_misread():
    """o_groups / lse / lse_groups are read and written by flat offsets: a strided or misshapen one is a clear
    error, not silently wrong rows."""
    B, H, S, D, C = 1, 2, 300, 64, 128
    perm = torch.zeros(B, H, 384, dtype=torch.int32)
    out = torch.empty(B, H, S, D, dtype=torch.bfloat16)
    og = torch.empty(B * H * 3, C, 2 * D, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="o_groups must be contiguous"):
        regroup.scatter_groups(og[..., :D], perm, out)
    og = og[..., :D].contiguous()
    lse_g = torch.empty(B * H * 3, C)
    for lse_groups, lse in ((None, torch.empty(B, H, S)), (lse_g, torch.empty(B, H, S, dtype=torch.bfloat16)),
                            (lse_g, torch.empty(B, H, 2 * S)[..., :S]), (lse_g[:, :64], torch.empty(B, H, S))):
        with pytest.raises(ValueError, match="must be contiguous float32"):
            regroup.scatter_groups(og, perm, out, lse_groups=lse_groups, lse=lse)
    bad = make_residual(torch.zeros(B, H, S, D), "int4_group", torch.zeros(B, H, 4 * 96, dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="mean must have G = 3 rows"):  # 4 mean rows for 3 groups of C = 128
        regroup.scatter_groups(og, perm, out, residual=bad)


def test_valid_counts_finds_the_first_minus_one():
    gen = torch.Generator().manual_seed(3)
    B, H, G, K = 1, 3, 5, 384
    counts = torch.randint(1, K + 1, (B, H, G), generator=gen)
    counts.view(-1)[0], counts.view(-1)[1], counts.view(-1)[2] = 1, K, 128  # one slot, a full row, a tile boundary
    slots = torch.arange(K)
    keys = torch.randint(0, 10_000, (B, H, G, K), generator=gen, dtype=torch.int32).sort(-1).values
    kv_idx = torch.where(slots < counts[..., None], keys, torch.full_like(keys, -1))
    assert torch.equal(regroup.valid_counts(kv_idx), counts.view(-1).to(torch.int32))


@pytest.mark.parametrize("K", [1, 129])
def test_valid_counts_token_zero_and_odd_widths(K):
    """Token 0 is a valid index (an attention sink is often selected): rows starting at 0, and K_alloc 1 / 129."""
    gen = torch.Generator().manual_seed(7 + K)
    rows = 6
    counts = torch.randint(1, K + 1, (rows,), generator=gen)
    counts[:2] = torch.tensor([1, K])
    keys = torch.arange(K, dtype=torch.int32).expand(rows, K) * 3  # every row's first index is token 0
    kv_idx = torch.where(torch.arange(K) < counts[:, None], keys, torch.full_like(keys, -1)).view(1, 2, 3, K)
    assert torch.equal(regroup.valid_counts(kv_idx), counts.to(torch.int32))


def test_malformed_perm_is_a_clear_error():
    q = torch.zeros(1, 2, 300, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="perm must be int32"):
        regroup.gather_groups(q, torch.zeros(1, 2, 300, dtype=torch.int32), 128)
    for c in (0, 129):  # one program holds a group's rows: at most 128 (BLOCK_M)
        with pytest.raises(ValueError, match="group size must be in"):
            regroup.gather_groups(q, torch.zeros(1, 2, 387, dtype=torch.int32), c)
