"""Each query group's count of valid ``kv_idx`` slots (the slots before its first -1), for kernels that take the
count as a number (the CuTeDSL sparse kernel, kernels/cutedsl: the count bounds its key-tile loop and masks the last
tile). One launch, one program per group, no host synchronisation.

Layout: kv_idx int32 ``[B, H, G, K_alloc]``, each row sorted with trailing -1 (kernels.sparse_attention's contract).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _valid_counts(KV_IDX, COUNTS, K_ALLOC, STEPS: tl.constexpr):
    """Binary search for the first -1 of one row (validity is monotone along a row): STEPS >= log2(K_ALLOC) + 1."""
    row = tl.program_id(0).to(tl.int64)
    base = KV_IDX + row * K_ALLOC
    lo = 0  # slots before lo are valid
    hi = K_ALLOC  # slots from hi on are -1
    for _ in range(STEPS):
        mid = (lo + hi) // 2
        ok = tl.load(base + tl.minimum(mid, K_ALLOC - 1)) >= 0
        live = lo < hi
        hi = tl.where(live & ok, hi, tl.where(live, mid, hi))
        lo = tl.where(live & ok, mid + 1, lo)
    tl.store(COUNTS + row, lo)


def valid_counts(kv_idx: torch.Tensor) -> torch.Tensor:
    """int32 ``[B*H*G]``: each group's number of slots before its first -1 (kv_idx ``[B, H, G, K_alloc]``)."""
    kv = kv_idx.contiguous()
    rows = kv.shape[0] * kv.shape[1] * kv.shape[2]
    counts = torch.empty(rows, dtype=torch.int32, device=kv.device)
    _valid_counts[(rows,)](kv, counts, kv.shape[3], STEPS=max(1, kv.shape[3]).bit_length() + 1)
    return counts
