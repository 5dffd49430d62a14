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
