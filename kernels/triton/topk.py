"""Exact per-row top-K by radix selection on the bit patterns of the group sums, written as the KV selection.

One program per row (one query group of one head): it finds the K-th largest value by a most-significant-digit
radix select over the value's bit pattern (8-bit digits: 2 passes for float16 sums, 4 for float32), each pass a
masked ``tl.histogram`` of the digit over the row's entries that still match the digits found so far; then one
compaction pass in ascending token order writes every index whose value is above the threshold, and the first
``need`` indices whose value equals it (the tie rule of ``kernels.reference.topk``: lower token index first), at
the position given by a running prefix count, so the row comes out sorted with no sort at all. Slots K..K_alloc-1
are written -1. No global sort, no host sync, no [rows, Sk] temporaries.

Bit patterns: non-negative floats order like their bits read as integers; negative values and -0.0 get key 0
(rank as +0.0, as the reference). Cost per row: (passes + 1) reads of the row (float16: 3 x 2 B x Sk).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024  # entries per chunk of the row sweep


@triton.jit
def _keys(SUMS_ROW, offs, SK, KEY_BITS: tl.constexpr):
    """Order-preserving int32 keys of the row's entries at ``offs`` (-1 past Sk); negatives -> 0."""
    ok = offs < SK
    if KEY_BITS == 16:
        x = tl.load(SUMS_ROW + offs, mask=ok, other=0.0).to(tl.int16, bitcast=True).to(tl.int32)
    else:
        x = tl.load(SUMS_ROW + offs, mask=ok, other=0.0).to(tl.int32, bitcast=True)
    x = tl.where(x < 0, 0, x)  # sign bit set: a negative value or -0.0 (int16 sign-extends to int32 < 0)
    return tl.where(ok, x, -1)


@triton.jit
def _radix_topk_rows(
    SUMS, OUT,
    SK, num_keys, width, inner,
    stride_so, stride_si, stride_oo, stride_oi,
    KEY_BITS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    outer = (row // inner).to(tl.int64)
    row_in = (row % inner).to(tl.int64)
    src = SUMS + outer * stride_so + row_in * stride_si
    dst = OUT + outer * stride_oo + row_in * stride_oi
    offs0 = tl.arange(0, BLOCK)
    bins = tl.arange(0, 256)

    zero = tl.program_id(0) * 0  # int32 scalar tensor (num_keys may be specialised to a constexpr 1)
    prefix = zero  # the digits of the K-th largest key found so far, in place
    need = num_keys  # how many of the entries matching the prefix are still to be kept
    for p in tl.static_range(KEY_BITS // 8):
        shift = KEY_BITS - 8 * (p + 1)
        hist = tl.zeros([256], dtype=tl.int32)
        for c0 in range(0, SK, BLOCK):
            key = _keys(src, c0 + offs0, SK, KEY_BITS)
            if p == 0:
                match = key >= 0
            else:
                match = (key >= 0) & ((key >> (shift + 8)) == (prefix >> (shift + 8)))
            hist += tl.histogram((key >> shift) & 255, 256, mask=match)
        # count_ge[b]: matching entries whose digit is >= b; the K-th largest lies in the highest bin with
        # count_ge >= need
        incl = tl.cumsum(hist, 0)
        total = tl.sum(hist, 0)
        count_ge = total - incl + hist
        digit = tl.sum((count_ge >= need).to(tl.int32), 0) - 1
        count_gt = tl.sum(tl.where(bins == digit, total - incl, 0), 0)
        need -= count_gt
        prefix = prefix | (digit << shift)

    # compaction: ascending token order; keep key > T, and the first `need` entries with key == T
    kept = zero
    ties = zero
    for c0 in range(0, SK, BLOCK):
        offs = c0 + offs0
        key = _keys(src, offs, SK, KEY_BITS)
        eq = (key == prefix).to(tl.int32)
        tie_rank = tl.cumsum(eq, 0) - eq + ties
        sel = ((key > prefix) | ((eq > 0) & (tie_rank < need))).to(tl.int32)
        pos = tl.cumsum(sel, 0) - sel + kept
        tl.store(dst + pos, offs, mask=sel > 0)
        kept += tl.sum(sel, 0)
        ties += tl.sum(eq, 0)
    for c0 in range(num_keys, width, BLOCK):
        offs = c0 + offs0
        tl.store(dst + offs, tl.full([BLOCK], -1, tl.int32), mask=offs < width)


def top_k_rows(sums: torch.Tensor, num_keys: int, width: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's K largest entries as sorted int32 indices with -1 padding; ``kernels.reference.topk.top_k_rows``'s
    contract (ties: lower index first; negatives and -0.0 rank as +0.0; no NaN).

    Args:
        sums: ``[..., Sk]`` float16 or float32 (copied when its rows are not one or two strided levels).
        num_keys: K in [1, Sk]. width: K_alloc >= K.
        out: optional int32 ``[..., width]``, written in place: a contiguous last dim, and the leading dims after
            the first mergeable into one (e.g. a head slice ``[B, h, G, K_alloc]`` of the whole selection).
    Returns:
        ``out`` (or a new tensor): int32 ``[..., width]``.
    Raises:
        TypeError: sums not float16/float32. ValueError: K or width out of range, or a bad ``out``.
    """
    if sums.dtype not in (torch.float16, torch.float32):
        raise TypeError(f"sums must be float16 or float32, got {sums.dtype}")
    sk = sums.shape[-1]
    if not 1 <= num_keys <= sk or width < num_keys:
        raise ValueError(f"num_keys must be in [1, {sk}] and width >= num_keys, got {num_keys}, {width}")
    lead = sums.shape[:-1]
    if out is None:
        out = torch.empty(*lead, width, dtype=torch.int32, device=sums.device)
    elif out.dtype != torch.int32 or tuple(out.shape) != (*lead, width):
        raise ValueError(f"out must be int32 {(*lead, width)}, got {out.dtype} {tuple(out.shape)}")
    if out.stride(-1) != 1:
        raise ValueError("out must have a contiguous last dim")
    two = (1, -1) if len(lead) < 2 else (lead[0], -1)
    try:
        src = sums.view(*two, sk) if sums.stride(-1) == 1 else None
    except RuntimeError:
        src = None
    if src is None:
        src = sums.contiguous().view(*two, sk)
    dst = out.view(*two, width)  # a view, never a copy: raises when the dims after the first cannot merge
    n = src.shape[0] * src.shape[1]
    if n:
        _radix_topk_rows[(n,)](
            src, dst, sk, num_keys, width, src.shape[1], src.stride(0), src.stride(1), dst.stride(0), dst.stride(1),
            KEY_BITS=16 if sums.dtype == torch.float16 else 32, BLOCK=_BLOCK, num_warps=4,
        )
    return out
