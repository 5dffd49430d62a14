"""kernels/triton/counts.py under the Triton interpreter (CPU): each group's valid-slot count against the count the
inputs were built with."""

from __future__ import annotations

import pytest
import torch
from comfyui_mc_sparse_pack.kernels.triton.counts import valid_counts


def test_valid_counts_finds_the_first_minus_one():
    gen = torch.Generator().manual_seed(3)
    B, H, G, K = 1, 3, 5, 384
    counts = torch.randint(1, K + 1, (B, H, G), generator=gen)
    counts.view(-1)[0], counts.view(-1)[1], counts.view(-1)[2] = 1, K, 128  # one slot, a full row, a tile boundary
    slots = torch.arange(K)
    keys = torch.randint(0, 10_000, (B, H, G, K), generator=gen, dtype=torch.int32).sort(-1).values
    kv_idx = torch.where(slots < counts[..., None], keys, torch.full_like(keys, -1))
    assert torch.equal(valid_counts(kv_idx), counts.view(-1).to(torch.int32))


@pytest.mark.parametrize("K", [1, 129])
def test_valid_counts_token_zero_and_odd_widths(K):
    """Token 0 is a valid index (an attention sink is often selected): rows starting at 0, and K_alloc 1 / 129."""
    gen = torch.Generator().manual_seed(7 + K)
    rows = 6
    counts = torch.randint(1, K + 1, (rows,), generator=gen)
    counts[:2] = torch.tensor([1, K])
    keys = torch.arange(K, dtype=torch.int32).expand(rows, K) * 3  # every row's first index is token 0
    kv_idx = torch.where(torch.arange(K) < counts[:, None], keys, torch.full_like(keys, -1)).view(1, 2, 3, K)
    assert torch.equal(valid_counts(kv_idx), counts.to(torch.int32))


@pytest.mark.parametrize("K", [31, 32, 33, 1024, 1025, 3328, 37888])
def test_valid_counts_at_every_search_level(K):
    """Widths around the search's fan-out (32 probes per level: 1, 2, 3 and 4 levels) with counts at the level
    boundaries (1, 31, 32, 33, a multiple of 32 and of 1024, K - 1, K) and random ones; one row with no valid slot."""
    from comfyui_mc_sparse_pack.kernels.triton.counts import levels

    gen = torch.Generator().manual_seed(K)
    want = [c for c in (1, 31, 32, 33, 64, 1023, 1024, 1025, K - 1, K) if 1 <= c <= K]
    want += torch.randint(1, K + 1, (6,), generator=gen).tolist() + [0]
    counts = torch.tensor(want)
    kv_idx = torch.where(torch.arange(K) < counts[:, None], torch.arange(K, dtype=torch.int32) * 2,
                         torch.full((K,), -1, dtype=torch.int32)).view(1, 1, len(want), K)
    assert torch.equal(valid_counts(kv_idx), counts.to(torch.int32)), levels(K)


def test_pdl_without_gdc_launches_plainly(monkeypatch):
    """A Triton without programmatic dependent launch (no gdc_wait): valid_counts(pdl=True) counts as a plain launch
    (here under the interpreter, which has no such launch either) instead of failing the CuTeDSL op."""
    from comfyui_mc_sparse_pack.kernels.triton import counts as mod

    monkeypatch.setattr(mod, "gdc_wait", None)
    kv_idx = torch.tensor([[0, 5, 9, -1], [2, -1, -1, -1]], dtype=torch.int32).view(1, 1, 2, 4)
    assert mod.valid_counts(kv_idx, pdl=True).tolist() == [3, 1]
