"""Torch reference of the per-group top-K that turns pass-2 group sums into the KV selection (MC-Sparse sec. 3.3).

The rule every backend follows: a group keeps its K keys of largest group sum; among keys whose sums are equal,
the lower token index wins. Negative values and -0.0 rank as +0.0 (group sums are probability sums, >= 0); NaN is
not allowed. The kept indices are written in ascending order, then -1 up to the row width K_alloc.
"""

from __future__ import annotations

import torch


def top_k_rows(sums: torch.Tensor, num_keys: int, width: int) -> torch.Tensor:
    """Each row's ``num_keys`` largest entries (ties: lower index first), as sorted int32 indices with -1 padding.

    Args:
        sums: ``[..., Sk]`` float16 / bfloat16 / float32 / float64 group sums (>= 0; negatives count as 0).
        num_keys: K in [1, Sk]. width: K_alloc >= K, the output row width.
    Returns:
        int32 ``[..., width]``: ascending indices of the kept keys, then ``width - K`` entries of -1.
    Raises:
        ValueError: K outside [1, Sk] or width < K.
    """
    sk = sums.shape[-1]
    if not 1 <= num_keys <= sk or width < num_keys:
        raise ValueError(f"num_keys must be in [1, {sk}] and width >= num_keys, got {num_keys}, {width}")
    vals = sums.clamp_min(0)  # -0.0 and negatives rank as +0.0
    # stable descending sort: equal values keep ascending index order, so the lower index wins a tie
    order = torch.sort(vals, dim=-1, descending=True, stable=True).indices[..., :num_keys]
    out = torch.full((*sums.shape[:-1], width), -1, dtype=torch.int32, device=sums.device)
    out[..., :num_keys] = torch.sort(order, dim=-1).values.to(torch.int32)
    return out
