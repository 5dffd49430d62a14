"""Each query group's count of valid ``kv_idx`` slots (the slots before its first -1), for kernels that take the
count as a number (the CuTeDSL sparse kernel, kernels/cutedsl: the count bounds its key-tile loop and masks the last
tile). One launch, one program per group (3 dependent loads up to 32768 slots), no host synchronisation.

Layout: kv_idx int32 ``[B, H, G, K_alloc]``, each row sorted with trailing -1 (kernels.sparse_attention's contract).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
try:  # programmatic dependent launch; a Triton without it launches "pdl" calls plainly
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def _valid_counts(KV_IDX, COUNTS, K_ALLOC, LEVELS: tl.constexpr, FAN: tl.constexpr, PDL: tl.constexpr):
    """A FAN-ary search for the first -1 of one row (validity is monotone along a row): each level loads FAN probes
    of the current segment at once (one dependent load per level instead of one per halving: LEVELS >= log_FAN
    K_ALLOC, 3 levels up to 32768 slots), keeps the segment after the last valid probe; the last level probes every
    slot of a segment of at most FAN. PDL: launched as a programmatic dependent launch (sm_90): wait for the kernel
    before (its writes visible), then let the next one launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    base = KV_IDX + row * K_ALLOC
    j = tl.arange(0, FAN)
    nonempty = tl.load(base) >= 0  # issued with the first level's probes (it is probe 0), not after the last
    start = 0  # slots before start are valid
    span = K_ALLOC  # the count lies in [start, start + span]
    for _ in tl.static_range(LEVELS):
        seg = (span + FAN - 1) // FAN
        inside = j * seg < span
        ok = inside & (tl.load(base + start + j * seg, mask=inside, other=-1) >= 0)
        n = tl.sum(ok.to(tl.int32), 0)
        start = start + tl.maximum(n - 1, 0) * seg  # the last valid probe (slot 0 when none is valid)
        span = tl.minimum(seg, K_ALLOC - start)
    # the last level ran with seg == 1: start is then the last valid slot, or 0 when slot 0 is invalid
    tl.store(COUNTS + row, tl.where(nonempty, start + 1, 0))


FAN = 32


def levels(k_alloc: int) -> int:
    """Search levels for rows of ``k_alloc`` slots: the least L with FAN**L >= k_alloc (at least 1)."""
    n, width = 1, FAN
    while width < k_alloc:
        n, width = n + 1, width * FAN
    return n


def valid_counts(kv_idx: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """int32 ``[B*H*G]``: each group's number of slots before its first -1 (kv_idx ``[B, H, G, K_alloc]``).
    ``pdl``: launch as a programmatic dependent launch (CUDA sm_90+ only; the kernel waits for the one before it)."""
    kv = kv_idx.contiguous()
    rows = kv.shape[0] * kv.shape[1] * kv.shape[2]
    counts = torch.empty(rows, dtype=torch.int32, device=kv.device)
    pdl = pdl and gdc_wait is not None
    extra = {"launch_pdl": True} if pdl else {}
    _valid_counts[(rows,)](kv, counts, kv.shape[3], LEVELS=levels(kv.shape[3]), FAN=FAN, PDL=pdl, num_warps=1,
                           **extra)
    return counts
