"""The separate top-K of float16 group sums in four launches over row CHUNKS ("split"): the selection of
``topk.top_k_rows`` (sorted int32 indices, ties to the lower index, -1 padding; exact), with each row's sweeps cut
into chunks run by their own programs, so a launch has rows x chunks short programs in flight instead of one
latency-bound program walking each row twice.

1. ``_split_bracket`` (one program per row): the bracket [lo, hi] of the row's K-th largest key from its stratified
   sample (``topk._bracket_row``'s sample, positions and ranks: ``topk.bracket_plan``); zeroes the row's
   candidate counter.
2. ``_split_count`` (one program per row and chunk): counts the chunk's keys above hi, and appends the keys in
   [lo, hi], packed with their chunk number (key | chunk << 16), to the row's candidate scratch (one atomic add on
   the row's counter per sweep step reserves the slots; their order does not matter).
3. ``_split_threshold`` (one program per row): loads the row's copies once into registers, finds the threshold T
   (the K-th largest key) by a bit search (``topk._cand_threshold_regs``' steps) and, per chunk, where its selected
   indices start (keys above T in the chunks before it, plus the ties to T kept there: the first ``need`` ties in
   index order) and how many of its ties are kept. A bracket the counts disprove, or more copies than the scratch
   holds, flags the row.
4. ``_split_compact`` (one program per row and chunk): writes the chunk's selected indices in ascending order from
   its start (``topk._compact_step``), the last chunk also the -1 padding. Flagged rows are skipped, and written
   after by ``topk._radix_topk_rows`` (ONLY_FLAGGED), so the result is exact either way.

Source of the rule: MC-Sparse sec. 3.3 (top-K per query group); kernels/reference/topk.py (the contract).
"""

from __future__ import annotations

import triton
import triton.language as tl
import torch

from .topk import (_BLOCK, _add3, _compact_step, _kth_largest2, _keys, _load_tile, _radix_topk_rows, _raw_keys, _row_src,
                   _tile_offsets, bracket_plan)

_CHUNKS = 8  # chunks per row (each a whole number of sweep steps)
_WARPS = 2  # warps of the count and compaction programs (one 16-byte tile row per thread per step)
_THRESHOLD_WARPS = 8  # warps of the threshold program (its copies: cap / (32 x warps) registers per thread)


@triton.jit
def _split_bracket(SUMS, BRACKET, CNT, SK, inner, stride_so, stride_si, stride_samp, n_samp, hi_rank, lo_rank,
                   ALIGN: tl.constexpr, NS: tl.constexpr, TWO_BITS: tl.constexpr):
    """Row r's bracket (BRACKET[r] = (lo, hi), int32 keys) from its sample; CNT[r] = 0."""
    row = tl.program_id(0)
    src = _row_src(SUMS, row, inner, stride_so, stride_si, ALIGN)
    j = tl.arange(0, NS)
    pos = j * stride_samp + (j * 97 + (j >> 3) * 13) % stride_samp
    samp = tl.where(j < n_samp, _keys(src, pos, SK, 16), -1)
    # hi_rank <= 0: hi = one above +inf's key (no key above it); lo_rank > n_samp: lo = 0 (every key inside)
    hi, lo = _kth_largest2(samp, hi_rank, lo_rank, tl.program_id(0) * 0 + 0x7C01, 15, TWO_BITS)
    tl.store(BRACKET + 2 * row, lo)
    tl.store(BRACKET + 2 * row + 1, hi)
    tl.store(CNT + row, 0)


@triton.jit
def _split_count(SUMS, BRACKET, CNT, ABOVE, CAND, SK, chunk, inner, stride_so, stride_si, cap,
                 ALIGN: tl.constexpr, ROWS: tl.constexpr, NCH: tl.constexpr):
    """Chunk c (axis 0) of row r (axis 1): ABOVE[r, c] = its keys > hi; its keys in [lo, hi] appended to CAND[r]
    (int32 key | c << 16; slots from the row's counter CNT[r], at most ``cap`` stored)."""
    c = tl.program_id(0)
    row = tl.program_id(1)
    src = _row_src(SUMS, row, inner, stride_so, stride_si, ALIGN)
    lo = tl.load(BRACKET + 2 * row)
    hi = tl.load(BRACKET + 2 * row + 1)
    cand_row = CAND + row.to(tl.int64) * cap
    tile = _tile_offsets(ROWS, 8)
    step: tl.constexpr = ROWS * 8
    above = tl.zeros([ROWS], dtype=tl.int32)
    start = c * chunk
    for c0 in range(start, tl.minimum(start + chunk, SK), step):
        offs = c0 + tile
        key = _raw_keys(_load_tile(src, offs, SK, True), offs, SK, 16, True)
        above += tl.sum((key > hi).to(tl.int32), 1)
        inside = ((key >= lo) & (key <= hi)).to(tl.int32)
        row_n = tl.sum(inside, 1)
        slot = (tl.cumsum(row_n, 0) - row_n)[:, None] + tl.cumsum(inside, 1) - inside
        base = tl.atomic_add(CNT + row, tl.sum(row_n, 0))
        slot += base
        tl.store(cand_row + slot, key | (c << 16), mask=(inside > 0) & (slot < cap))
    tl.store(ABOVE + row * NCH + c, tl.sum(above, 0))


@triton.jit
def _split_threshold(CNT, ABOVE, CAND, META, FLAGS, BRACKET, num_keys, cap, CAP: tl.constexpr, NCH: tl.constexpr):
    """Row r: T and per chunk (start, ties kept) into META[r] ([NCH + 1, 2] int32: row NCH holds (T, 0)), FLAGS[r]
    = 0; or FLAGS[r] = 1 when the bracket is disproved or the copies overflowed the scratch."""
    row = tl.program_id(0)
    n_cand = tl.load(CNT + row)
    chs = tl.arange(0, NCH)
    above_c = tl.load(ABOVE + row * NCH + chs)
    above = tl.sum(above_c, 0)
    hit = (above < num_keys) & (above + n_cand >= num_keys) & (n_cand <= cap)
    tl.store(FLAGS + row, (1 - hit.to(tl.int32)).to(tl.int8))
    if hit:
        offs = tl.arange(0, CAP)
        packed = tl.load(CAND + row.to(tl.int64) * cap + offs, mask=offs < n_cand, other=-1)
        key = tl.where(packed >= 0, packed & 0xFFFF, -1)
        ch = packed >> 16
        kk = num_keys - above
        lo = tl.load(BRACKET + 2 * row)
        rng = tl.load(BRACKET + 2 * row + 1) - lo
        top = lo * 0  # the bit length of hi - lo
        for i in tl.static_range(32):
            top = tl.where((rng >> i) > 0, i + 1, top)
        top2 = top + (top & 1)
        thr = lo
        for i in range(0, top2, 2):
            b = top2 - 2 - i
            t1 = thr + (1 << b)
            t2 = thr + (2 << b)
            t3 = thr + (3 << b)
            c1, c2, c3 = tl.reduce(((key >= t1).to(tl.int32), (key >= t2).to(tl.int32), (key >= t3).to(tl.int32)),
                                   0, _add3)
            thr = tl.where(c3 >= kk, t3, tl.where(c2 >= kk, t2, tl.where(c1 >= kk, t1, thr)))
        gt = tl.histogram(tl.where(key > thr, ch, 0), NCH, mask=key > thr)
        eq = tl.histogram(tl.where(key == thr, ch, 0), NCH, mask=key == thr)
        need = kk - tl.sum(gt, 0)
        ties = tl.minimum(tl.maximum(need - (tl.cumsum(eq, 0) - eq), 0), eq)  # the first ``need`` ties, chunk order
        sel = above_c + gt + ties
        start = tl.cumsum(sel, 0) - sel
        meta = META + row.to(tl.int64) * (2 * NCH + 2)
        tl.store(meta + 2 * chs, start)
        tl.store(meta + 2 * chs + 1, ties)
        tl.store(meta + 2 * NCH, thr)


@triton.jit
def _split_compact(SUMS, OUT, META, FLAGS, SK, chunk, num_keys, width, inner, stride_so, stride_si, stride_oo,
                   stride_oi, ALIGN: tl.constexpr, ROWS: tl.constexpr, NCH: tl.constexpr):
    """Chunk c (axis 0) of row r (axis 1), unless FLAGS[r]: its selected indices from its start in ascending order,
    the last chunk also -1 from num_keys to width."""
    c = tl.program_id(0)
    row = tl.program_id(1)
    if tl.load(FLAGS + row) == 0:
        src = _row_src(SUMS, row, inner, stride_so, stride_si, ALIGN)
        dst = _row_src(OUT, row, inner, stride_oo, stride_oi, 1)
        meta = META + row.to(tl.int64) * (2 * NCH + 2)
        n_gt = tl.load(meta + 2 * c)
        ties = tl.load(meta + 2 * c + 1)
        thr = tl.load(meta + 2 * NCH)
        n_eq = n_gt * 0
        tile = _tile_offsets(ROWS, 8)
        step: tl.constexpr = ROWS * 8
        start = c * chunk
        for c0 in range(start, tl.minimum(start + chunk, SK), step):
            offs = c0 + tile
            key = _raw_keys(_load_tile(src, offs, SK, True), offs, SK, 16, True)
            n_gt, n_eq = _compact_step(key, dst, offs, num_keys, thr, ties, n_gt, n_eq)
        if c == NCH - 1:
            fill = tl.arange(0, step)
            for f0 in range(num_keys, width, step):
                tl.store(dst + f0 + fill, tl.full([step], -1, tl.int32), mask=f0 + fill < width)


def top_k_rows_split(sums: torch.Tensor, num_keys: int, width: int, *, out: torch.Tensor, chunks: int = _CHUNKS,
                     num_warps: int = _WARPS, threshold_warps: int = _THRESHOLD_WARPS, cap: int | None = None,
                     sample_stride: int | None = None, return_fallbacks: bool = False):
    """``topk.top_k_rows``' selection of float16 ``sums`` ``[..., Sk]`` (rows: one or two strided levels, contiguous
    last dim, 16-byte aligned rows) into ``out`` (int32 ``[..., width]``, contiguous last dim), by the four chunked
    launches of this module and the radix launch for flagged rows. ``cap``: candidate slots per row (a power of two;
    default ``topk.bracket_plan``'s); ``sample_stride``: keys per sample (``bracket_plan``); ``return_fallbacks``: also the int8 ``[rows]`` flags (1: written by the radix
    launch). Raises ValueError: not float16, K or width out of range, bad ``out``, a row layout it cannot index."""
    if sums.dtype != torch.float16:
        raise ValueError(f"sums must be float16, got {sums.dtype}")
    sk = sums.shape[-1]
    if not 1 <= num_keys <= sk or width < num_keys:
        raise ValueError(f"num_keys must be in [1, {sk}] and width >= num_keys, got {num_keys}, {width}")
    lead = sums.shape[:-1]
    if out.dtype != torch.int32 or tuple(out.shape) != (*lead, width) or out.stride(-1) != 1:
        raise ValueError(f"out must be int32 {(*lead, width)} with a contiguous last dim")
    two = (1, -1) if len(lead) < 2 else (lead[0], -1)
    if sums.stride(-1) != 1:
        raise ValueError("sums must have a contiguous last dim")
    src = sums.view(*two, sk)
    dst = out.view(*two, width)
    n = src.shape[0] * src.shape[1]
    if n == 0:
        return (out, torch.zeros(0, dtype=torch.int8, device=sums.device)) if return_fallbacks else out
    align = 8 if src.stride(0) % 8 == 0 and src.stride(1) % 8 == 0 else 1
    stride, n_samp, hi_rank, lo_rank, cap_b = bracket_plan(sk, num_keys, 2, cap=cap, stride=sample_stride)
    rows = 32 * num_warps
    step = rows * 8
    nch = triton.next_power_of_2(max(1, min(chunks, -(-sk // step))))
    chunk = -(-(-(-sk // nch)) // step) * step  # whole sweep steps per chunk
    dev = sums.device
    bracket = torch.empty(n, 2, dtype=torch.int32, device=dev)
    cnt = torch.empty(n, dtype=torch.int32, device=dev)
    above = torch.empty(n, nch, dtype=torch.int32, device=dev)
    cand = torch.empty(n, cap_b, dtype=torch.int32, device=dev)
    meta = torch.empty(n, 2 * nch + 2, dtype=torch.int32, device=dev)
    flags = torch.empty(n, dtype=torch.int8, device=dev)
    ns = triton.next_power_of_2(n_samp)
    strides = (src.shape[1], src.stride(0) // align, src.stride(1) // align)
    _split_bracket[(n,)](src, bracket, cnt, sk, *strides, stride, n_samp, hi_rank, lo_rank, ALIGN=align, NS=ns,
                         TWO_BITS=ns <= 8 * 32 * threshold_warps, num_warps=threshold_warps)
    _split_count[(nch, n)](src, bracket, cnt, above, cand, sk, chunk, *strides, cap_b, ALIGN=align, ROWS=rows,
                           NCH=nch, num_warps=num_warps)
    _split_threshold[(n,)](cnt, above, cand, meta, flags, bracket, num_keys, cap_b, CAP=cap_b, NCH=nch,
                           num_warps=threshold_warps)
    _split_compact[(nch, n)](src, dst, meta, flags, sk, chunk, num_keys, width, *strides, dst.stride(0),
                             dst.stride(1), ALIGN=align, ROWS=rows, NCH=nch, num_warps=num_warps)
    _radix_topk_rows[(n,)](src, dst, flags, flags, sk, num_keys, width, src.shape[1], src.stride(0), src.stride(1),
                           dst.stride(0), dst.stride(1), KEY_BITS=16, BLOCK=_BLOCK, HAS_HIST=False, ONLY_FLAGGED=True,
                           num_warps=4)
    return (out, flags) if return_fallbacks else out
