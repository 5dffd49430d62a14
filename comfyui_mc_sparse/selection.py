"""How many KV tokens a query group keeps (MC-Sparse sec. 3.3: K from density, rounded to the KV tile)."""

from __future__ import annotations

import math


def keys_for_density(density: float, num_tokens: int, kv_tile: int) -> int:
    """K, the KV tokens each query group keeps: ceil(density * S) rounded up to ``kv_tile``, at most S.

    Args:
        density: s in (0, 1]. num_tokens: S >= 1 (the KV length). kv_tile: >= 1.
    Returns:
        int K in [1, S]. The index rows are ``ceil(K / kv_tile) * kv_tile`` wide; the extra slots (only
        when K = S is not a multiple of the tile) are masked, never duplicated.
    Raises:
        ValueError: an argument is out of range.
    """
    if not 0.0 < density <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {density}")
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    if kv_tile < 1:
        raise ValueError(f"kv_tile must be >= 1, got {kv_tile}")
    k = math.ceil(density * num_tokens - 1e-9)
    return min(num_tokens, max(1, -(-k // kv_tile) * kv_tile))
