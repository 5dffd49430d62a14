"""Exact per-row top-K of the group sums, written as the KV selection (sorted indices, -1 padding).

One program per row (one query group of one head). Two ways to find the row's threshold T (the K-th largest key)
and ``need`` (how many entries equal to T are kept), then one shared compaction pass in ascending token order that
writes every index whose key is above T and the first ``need`` indices whose key equals it (the tie rule of
``kernels.reference.topk``: lower token index first) at the position given by a running prefix count, so the row
comes out sorted with no sort at all; slots K..K_alloc-1 are written -1. No global sort, no host sync.

- "radix": most-significant-digit radix select over the key's bit pattern (8-bit digits: 2 passes for float16
  sums, 4 for float32), each pass a masked ``tl.histogram`` over the whole row. Exact, but a 256-bin
  ``tl.histogram`` costs ~2 warp instructions per entry (ballots and popcounts), so it is instruction-bound
  (~19 ms for the 23 640 rows of 75 600 sums at Wan2.1-14B 720p on an H200, 4x what its bytes need).
- "bracket" (the default): one key per ceil(Sk / 1024) of the row (<= 1024 samples, in registers; a scrambled offset
  in each stratum) brackets the K-th largest key between two sample order statistics at its expected sample rank
  +-(5 sigma + 2) (binomial sigma, ``bracket_plan``); one sweep counts the keys above the bracket and copies the
  keys inside it (int16 keys) to a per-row scratch; if the counts prove the K-th key is inside (above < K <= above
  + inside, nothing dropped), T is found among the copies by radix select (at most two 256-bin histogram passes over
  them, ``_cand_threshold``; in pass 2's epilogue by default a bit search counting the copies, ``FusedRows.cand_count``
  / ``_cand_threshold_count``: ~17x fewer instructions per copy than a histogram pass, H200 round s7r1: the fused
  top-K's share of select_kv 0.052 -> 0.028 of dense at 1.3B 480p), else the row is flagged and a second launch (``_radix_topk_rows``, flagged rows only)
  writes it by radix select: exact on both paths (the check is a proof, the sample only decides the speed). The same
  row routine runs as pass 2's epilogue (``FusedRows``). Both sweeps run on [rows, 8] tiles (one 16-byte load per
  tile row), each tile row held by one thread, so key decode, compares and prefix sums stay in the thread and one
  scan of the row totals crosses threads per step; the compaction takes slot and tie rank from one packed prefix sum;
  whole tiles load unmasked and the next tile's load is issued before this tile's work. Offline SASS (sm_90): ~0.6 /
  0.75 warp instructions per key for the count / compaction sweeps against ~2 per histogram pass and ~2 for the
  radix compaction. (An earlier "sample" method, the same bracket on 1D 2048-key chunks scanned across 8 warps,
  measured 1.18 / 18.4 ms at 1.3B / 14B against the bracket's 0.52 / 6.0 ms, and was removed.)

Keys: non-negative floats order like their bits read as integers; negative values and -0.0 get key 0 (rank as
+0.0, as the reference). The selection rule: MC-Sparse sec. 3.3 (top-K per query group); measurements: docs/kernels.md.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import triton
import triton.language as tl

_BLOCK = 1024  # entries per chunk of the row sweep (radix method)
_Z = 5.0  # bracket half-width in binomial standard deviations (a miss only costs the radix fallback)
# the separate top-K's (``top_k_rows``) bracket half-width when not given: fewer sigmas hold fewer candidates (the
# threshold's counting passes over them were ~40 % of a 1.3B 480p row's instructions at s = 0.5, offline SASS) and
# miss more rows (each then written by the radix launch). H200 rounds s12r2 / s12r3 (tests/bench_select_race.py, 1.3B
# 480p, / flash-attn-4 dense, s = 0.1 / 0.15 / 0.25 / 0.5): 4 sigmas 0.5047 / 0.5237 / 0.5063 / 0.5080 against 0.5049 /
# 0.5064 / 0.5189 / 0.5143, then 0.4888 / 0.5066 / 0.4889 / 0.4873 against 0.4867 / 0.4892 / 0.4858 / 0.4967; 3 sigmas
# 0.5169 / 0.5023 / 0.5073 / 0.5220 (s12r2): inside the spread or worse, 5 kept
_SEPARATE_Z = _Z
# the separate top-K's method when ``top_k_rows`` is not given one: "seg" (``topk_seg``: the bracket with per-warp row
# quarters, candidate slots and scans; float16 rows that are 16-byte aligned with Sk a multiple of 8, else "bracket")
# or "bracket" (``_bracket_topk_rows``, the default until session 13). H200 round s13r2 (main b2b7ec4, 1.3B 480p, /
# flash-attn-4 dense): the top-K alone 0.0444 / 0.0377 of dense against 0.0494 / 0.0404 at s = 0.5 / 0.1
# (tests/bench_topk_race.py); select_kv 0.4897 / 0.4876 / 0.4909 / 0.4956 against 0.4897 / 0.4951 / 0.4917 / 0.5109
# at s = 0.1 / 0.15 / 0.25 / 0.5 (tests/bench_select_race.py). (Round s13r1's form with per-thread slots: 0.076 /
# 0.051 alone, every copy its own sector.)
_SEPARATE_METHOD = "seg"
# the "seg" form's launch when ``top_k_rows`` is not given num_warps / maxnreg: warps per row (row quarters) and the
# register cap on CUDA (offline sm_90 at 1.3B 480p: 56 registers under a cap of 64, 47 under 48, no spill either way)
_SEG_WARPS = 4  # (round s13r2, the top-K alone at s = 0.5 / 0.1: 8 warps at 48 registers 0.0430 / 0.0386, 4 warps
_SEG_MAXNREG = 64  # at 48 0.0447 / 0.0374, the loads two steps ahead 0.0437 / 0.0381, the count sweep from each
# row part's end 0.0441 / 0.0372: inside the spread; that last one lost in select_kv, round s13r3: 0.4959 / 0.5074 /
# 0.4937 / 0.5321 against 0.4875 / 0.4923 / 0.4949 / 0.5006, removed; so was the selection stored L2 evict-first,
# round s13r4: 0.4948 / 0.5127 / 0.4967 / 0.5041 against 0.4943 / 0.4947 / 0.4963 / 0.5013)
# bracket method: one sample per ceil(Sk / _BRACKET_MAX_SAMPLES) keys by default, as many as the sample registers hold
# (until session 8: one per 128-byte line but >= 512 samples, 520 at 1.3B 480p, whose registers already held 1024).
# H200 round s8r2 (main 176160c, 1.3B 480p, flash-attn-4 dense, tests/_timing.race): one sample per 32 keys (1023)
# against per 63 (520): select_kv 0.5686 / 0.5614 / 0.5713 / 0.5689 against 0.5659 / 0.5785 / 0.5722 / 0.5668 (s =
# 0.1 / 0.15 / 0.25 / 0.5; max 0.5713 vs 0.5785), the pass-2 kernel + fused top-K 0.5348 vs 0.5373, the separate
# top-K (two bits per counting pass) 0.0447 vs 0.0473 (s = 0.25); same selection (GPU-checked). 14B 720p (75600 keys)
# samples one per 74 either way.
_BRACKET_MAX_SAMPLES = 1024  # (a power of two: the sample is held in registers, [NS] with NS = 2^k >= n_samp)
# bracket launch defaults: 4 warps per row, one 16-byte row of keys per thread per sweep step (1024-key steps), 64
# registers (8 programs, 32 warps per SM). H200 round s11r2 (main a2b0472, tests/bench_topk_race.py, 1.3B 480p, the
# CuTeDSL pass 2's sums, / flash-attn-4 dense 8.73-8.77 ms, s = 0.1 / 0.25 / 0.5): the top-K alone 0.0407 / 0.0426 /
# 0.0501 against 0.0421 / 0.0444 / 0.0512 for the previous 2 warps at 72 registers (14 programs per SM); after pass 2
# 0.5197 / 0.5200 / 0.5293 against 0.5218 / 0.5215 / 0.5296. Slower there: 2 warps at 64 registers 0.0418-0.0511, at
# 80 0.0425-0.0488, one warp per row 0.0425-0.0564 (64 registers 0.0425-0.0589), the compaction on lane-major tiles
# (whole-sector stores, ~400 instead of ~236 instructions per 8-key step) 0.0607-0.0676. Earlier (bench_anchor at
# 904c5fd, s = 0.25, before the counting threshold): 2 x 1 5.98 ms at 14B 720p / 0.520 ms at 1.3B 480p against 7.79 /
# 0.55 for 1 warp x 2 rows, 7.42 / 0.60 for 1 x 1, 6.49 / 0.58 for 2 x 2, 6.56 / 0.54 for 4 x 1 (radix 17.6 / 1.43 ms)
_BRACKET_WARPS = 4
_BRACKET_ROWS_PER_THREAD = 1  # tile rows (16-byte vectors) per thread per sweep step
# registers per thread of the bracket kernel (its radix fallback runs in a second launch): 64 at 4 warps (offline sm_90
# at 1.3B: 28 bytes spilled outside the sweeps) = 8 programs, 32 warps per SM (round s11r2 above; before it 72 at 2
# warps: 14 programs, 28 warps; the fallback inlined held 140 registers, 7 programs)
_BRACKET_MAXNREG = 64
# candidate slots per row with ``FusedRows.cand_count``: a multiple of the fused epilogue's sweep step (4 warps x up to
# 4 tile rows per thread x 8 float16 keys), which ``_cand_threshold_count`` pads its copies to
_CAND_COUNT_MIN_CAP = 4096
HIST_BINS = tl.constexpr(128)  # bins of a first-digit histogram given by pass 2: the top 8 key bits of sums >= 0


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
def _radix_threshold(src, SK, num_keys, KEY_BITS: tl.constexpr, BLOCK: tl.constexpr, hist_row=None,
                     HAS_HIST: tl.constexpr = False):
    """(T, need): the K-th largest key T of the row by MSD radix select (8-bit digits, ``tl.histogram`` per pass),
    and how many of the entries equal to T are kept (K minus the entries above T). HAS_HIST: the first digit's
    histogram is read from ``hist_row`` (int32, ``HIST_BINS`` bins: pass 2 counted it) instead of a pass over the row
    (unless its counts do not add up to Sk: then the pass runs)."""
    offs0 = tl.arange(0, BLOCK)
    bins = tl.arange(0, 256)
    zero = tl.program_id(0) * 0  # int32 scalar tensor (num_keys may be specialised to a constexpr 1)
    prefix = zero  # the digits of the K-th largest key found so far, in place
    need = zero + num_keys  # how many of the entries matching the prefix are still to be kept
    for p in tl.static_range(KEY_BITS // 8):
        shift = KEY_BITS - 8 * (p + 1)
        hist = tl.zeros([256], dtype=tl.int32)
        counted = zero > 0
        if HAS_HIST and p == 0:
            hist = tl.load(hist_row + bins, mask=bins < HIST_BINS, other=0)
            counted = tl.sum(hist, 0) == SK  # a histogram that does not count every key once is recounted
        if not counted:
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
    return prefix, need


@triton.jit
def _add6(a0, a1, a2, a3, a4, a5, b0, b1, b2, b3, b4, b5):
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3, a4 + b4, a5 + b5


@triton.jit
def _add2(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _kth_bit(vals, k1, k2, t1, t2, S: tl.constexpr):
    """One step of ``_kth_largest2`` with one bit per step: bit S of t1 and t2 (one trial each)."""
    a = t1 | (1 << S)
    b = t2 | (1 << S)
    na, nb = tl.reduce(((vals >= a).to(tl.int32), (vals >= b).to(tl.int32)), 0, _add2)
    return tl.where(na >= k1, a, t1), tl.where(nb >= k2, b, t2)


@triton.jit
def _kth_step(vals, k1, k2, t1, t2, HI: tl.constexpr):
    """One step of ``_kth_largest2`` with two bits per step: bits [HI - 2, HI) of t1 and t2 (bit 0 alone when HI ==
    1)."""
    S: tl.constexpr = HI - 2 if HI >= 2 else 0
    M2: tl.constexpr = 2 if HI >= 2 else 1  # one bit: the three trials coincide
    M3: tl.constexpr = 3 if HI >= 2 else 1
    a1 = t1 | (1 << S)
    a2 = t1 | (M2 << S)
    a3 = t1 | (M3 << S)
    b1 = t2 | (1 << S)
    b2 = t2 | (M2 << S)
    b3 = t2 | (M3 << S)
    na1, na2, na3, nb1, nb2, nb3 = tl.reduce(
        ((vals >= a1).to(tl.int32), (vals >= a2).to(tl.int32), (vals >= a3).to(tl.int32),
         (vals >= b1).to(tl.int32), (vals >= b2).to(tl.int32), (vals >= b3).to(tl.int32)), 0, _add6)
    t1 = tl.where(na3 >= k1, a3, tl.where(na2 >= k1, a2, tl.where(na1 >= k1, a1, t1)))
    t2 = tl.where(nb3 >= k2, b3, tl.where(nb2 >= k2, b2, tl.where(nb1 >= k2, b1, t2)))
    return t1, t2


@triton.jit
def _kth_largest2(vals, k1, k2, top, BITS: tl.constexpr, TWO_BITS: tl.constexpr):
    """(t1, t2): for kk = k1 and k2, the largest t in [0, top] with at least kk entries of ``vals`` (int32, invalid
    entries -1) >= t: 0 when even 0 has fewer, ``top`` when kk <= 0 (top < 2^BITS). The bits of t from the top, both
    searches' counts in one block-wide reduction per step: TWO_BITS, two bits per step (three trial values per search:
    ceil(BITS / 2) reductions; 6 compares per entry held at once, for 8 or fewer entries per thread), else one
    (BITS reductions; a bisection per search took ~2 x BITS in all)."""
    t1 = top * 0
    t2 = t1
    if TWO_BITS:
        for i in tl.static_range((BITS + 1) // 2):
            t1, t2 = _kth_step(vals, k1, k2, t1, t2, BITS - 2 * i)
    else:
        for i in tl.static_range(BITS):
            t1, t2 = _kth_bit(vals, k1, k2, t1, t2, BITS - 1 - i)
    return tl.minimum(t1, top), tl.minimum(t2, top)


@triton.jit
def _compact(src, dst, SK, num_keys, width, prefix, need, KEY_BITS: tl.constexpr, BLOCK: tl.constexpr):
    """Write the row's selection: in ascending token order every index whose key is > T, and the first ``need``
    whose key == T (ties: lower index first), at positions given by a running prefix count; then -1 up to width."""
    offs0 = tl.arange(0, BLOCK)
    kept = tl.program_id(0) * 0
    ties = kept
    for c0 in range(0, SK, BLOCK):
        offs = c0 + offs0
        key = _keys(src, offs, SK, KEY_BITS)
        eq = (key == prefix).to(tl.int32)
        tie_rank = tl.cumsum(eq, 0) - eq + ties
        sel = ((key > prefix) | ((eq > 0) & (tie_rank < need))).to(tl.int32)
        pos = tl.cumsum(sel, 0) - sel + kept
        tl.store(dst + pos, offs, mask=(sel > 0) & (pos < num_keys))  # never past K, whatever the threshold
        kept += tl.sum(sel, 0)
        ties += tl.sum(eq, 0)
    for c0 in range(num_keys, width, BLOCK):
        offs = c0 + offs0
        tl.store(dst + offs, tl.full([BLOCK], -1, tl.int32), mask=offs < width)


@triton.jit
def _radix_topk_rows(
    SUMS, OUT, HIST, FLAGS,
    SK, num_keys, width, inner,
    stride_so, stride_si, stride_oo, stride_oi,
    KEY_BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_HIST: tl.constexpr,  # HIST: int32 [rows, HIST_BINS], the first digit's histogram of each row
    ONLY_FLAGGED: tl.constexpr = False,  # only rows with FLAGS[row] != 0 (int8 [rows])
):
    """One program per row: radix threshold (KEY_BITS // 8 histogram passes over the row, the first one read from
    HIST when given), then compaction. ONLY_FLAGGED: the bracket method's fallback, only the rows whose int8 flag
    FLAGS[row] is nonzero (the others return at once)."""
    row = tl.program_id(0)
    run = True
    if ONLY_FLAGGED:
        run = tl.load(FLAGS + row) != 0
    if run:
        outer = (row // inner).to(tl.int64)
        row_in = (row % inner).to(tl.int64)
        src = SUMS + outer * stride_so + row_in * stride_si
        dst = OUT + outer * stride_oo + row_in * stride_oi
        hist_row = HIST + row.to(tl.int64) * HIST_BINS
        prefix, need = _radix_threshold(src, SK, num_keys, KEY_BITS, BLOCK, hist_row, HAS_HIST)
        _compact(src, dst, SK, num_keys, width, prefix, need, KEY_BITS, BLOCK)


@triton.jit
def _tile_offsets(ROWS: tl.constexpr, VEC: tl.constexpr):
    """[ROWS, VEC] offsets r * VEC + v of one sweep step: each tile row is VEC consecutive keys (one 16-byte load),
    held by one thread, so sums and prefix sums along a row stay in the thread and only the ROWS row totals are
    scanned across the warp(s)."""
    return tl.arange(0, ROWS)[:, None] * VEC + tl.arange(0, VEC)[None, :]


@triton.jit
def _excl_scan(x2, base):
    """Exclusive prefix sums of the int32 tile ``x2`` ([ROWS, VEC]) in row-major order, plus ``base``: in-thread along
    the row, one scan of the ROWS row totals across threads. Returns (prefix [ROWS, VEC], total scalar)."""
    row = tl.sum(x2, 1)
    start = tl.cumsum(row, 0) - row + base
    return start[:, None] + tl.cumsum(x2, 1) - x2, tl.sum(row, 0)


@triton.jit
def _load_tile(src, offs, SK, MASKED: tl.constexpr):
    """The raw sums at ``offs``; MASKED False: every offset is < Sk (a whole tile: no mask, 16-byte loads)."""
    if MASKED:
        return tl.load(src + offs, mask=offs < SK, other=0.0)
    return tl.load(src + offs)


@triton.jit
def _raw_keys(x, offs, SK, KEY_BITS: tl.constexpr, MASKED: tl.constexpr):
    """``_keys`` of already loaded sums ``x`` (-1 past Sk when MASKED)."""
    if KEY_BITS == 16:
        key = x.to(tl.int16, bitcast=True).to(tl.int32)
    else:
        key = x.to(tl.int32, bitcast=True)
    key = tl.where(key < 0, 0, key)
    if MASKED:
        key = tl.where(offs < SK, key, -1)
    return key


@triton.jit
def _compact_step(key, dst, offs, num_keys, prefix, need, n_gt, n_eq):
    """One tile of ``_compact_tiles``. A key's slot is (keys > T before it) + min(keys == T before it, need), and a key
    == T is kept while fewer than ``need`` came before it, so one prefix sum of (key > T) + (key == T) << 16 (a tile
    holds < 2^16 keys) gives both counts; returns the running (n_gt, n_eq)."""
    gt = (key > prefix).to(tl.int32)
    eq = (key == prefix).to(tl.int32)
    before, total = _excl_scan(gt + (eq << 16), 0)
    gt_b = n_gt + (before & 0xFFFF)
    eq_b = n_eq + (before >> 16)
    pos = gt_b + tl.minimum(eq_b, need)
    sel = (gt > 0) | ((eq > 0) & (eq_b < need))
    tl.store(dst + pos, offs, mask=sel & (pos < num_keys))  # never past K, whatever the threshold
    return n_gt + (total & 0xFFFF), n_eq + (total >> 16)


@triton.jit
def _compact_tiles(src, dst, SK, num_keys, width, prefix, need, KEY_BITS: tl.constexpr, ROWS: tl.constexpr,
                   VEC: tl.constexpr, PREFETCH: tl.constexpr):
    """``_compact`` on [ROWS, VEC] tiles (``_excl_scan``): in ascending token order every index whose key is > T and
    the first ``need`` whose key == T, at positions from the running prefix count (never past K); then -1 to width.
    Whole tiles load unmasked (``src`` 16-byte aligned by the caller; PREFETCH: the next tile's load issued before
    this tile's work), the last partial tile masked. ROWS * VEC < 2^16 (``_compact_step``'s packed counts)."""
    tile = _tile_offsets(ROWS, VEC)
    step: tl.constexpr = ROWS * VEC
    tl.static_assert(step < 65536)
    n_gt = tl.program_id(0) * 0
    n_eq = n_gt
    n_full = SK // step
    if PREFETCH:
        x = _load_tile(src, tile, SK, True)  # tile 0 (whole when the loop runs)
        for i in range(0, n_full):
            x_next = _load_tile(src, tl.minimum(i + 1, n_full - 1) * step + tile, SK, False)
            offs = i * step + tile
            n_gt, n_eq = _compact_step(_raw_keys(x, offs, SK, KEY_BITS, False), dst, offs, num_keys, prefix, need,
                                       n_gt, n_eq)
            x = x_next
    else:
        for i in range(0, n_full):
            offs = i * step + tile
            n_gt, n_eq = _compact_step(_raw_keys(_load_tile(src, offs, SK, False), offs, SK, KEY_BITS, False), dst,
                                       offs, num_keys, prefix, need, n_gt, n_eq)
    offs = n_full * step + tile
    n_gt, n_eq = _compact_step(_raw_keys(_load_tile(src, offs, SK, True), offs, SK, KEY_BITS, True), dst, offs,
                               num_keys, prefix, need, n_gt, n_eq)
    offs1 = tl.arange(0, step)
    for c0 in range(num_keys, width, step):
        fill = c0 + offs1
        tl.store(dst + fill, tl.full([step], -1, tl.int32), mask=fill < width)


@triton.jit
def _count_step(key, cand_row, lo, hi, above_rows, n_cand, cap):
    """One tile of the bracket sweep (``key``: its keys): per-row counts of keys above ``hi`` added to
    ``above_rows``, keys in [lo, hi] copied to ``cand_row`` (the first ``cap``); returns (above_rows, n_cand)."""
    above_rows += tl.sum((key > hi).to(tl.int32), 1)
    inside = ((key >= lo) & (key <= hi)).to(tl.int32)
    slot, n_in = _excl_scan(inside, n_cand)
    tl.store(cand_row + slot, key.to(cand_row.dtype.element_ty), mask=(inside > 0) & (slot < cap))
    return above_rows, n_cand + n_in


@triton.jit
def _top_bin(h, kk, bins):
    """(b, kk - above): the highest bin b of the histogram ``h`` ([NB] int32, ``bins`` its arange) whose count with
    the bins above it reaches ``kk`` (1 <= kk <= sum(h)), i.e. the bin of the kk-th largest entry, and kk minus the
    entries in the bins above b (its rank inside bin b)."""
    incl = tl.cumsum(h, 0)
    ge = tl.sum(h, 0) - incl + h  # entries in bins >= b
    b = tl.sum((ge >= kk).to(tl.int32), 0) - 1  # ge is non-increasing and ge[0] >= kk
    return b, kk - tl.sum(tl.where(bins > b, h, 0), 0)


@triton.jit
def _cand_threshold(cand_row, n_cand, kk, lo, hi, STEP: tl.constexpr):
    """(T, need) from the bracket's copies: T the kk-th largest of the ``n_cand`` keys at ``cand_row`` (every one in
    [lo, hi], 1 <= kk <= n_cand) and need = kk minus the copies above T, by MSD radix select on d = key - lo: 8-bit
    digits from the top of hi - lo's bit length, one 256-bin ``tl.histogram`` pass over the copies per digit (the
    copies whose higher digits match the prefix found): 1 pass when hi - lo < 256, 2 for any 16-bit key range (a
    bisection took ~log2(hi - lo) passes, each a dependent chain of loads)."""
    offs0 = tl.arange(0, STEP)
    bins = tl.arange(0, 256)
    rng = hi - lo
    top = lo * 0  # the bit length of hi - lo: d >> top == 0 for every copy
    for i in tl.static_range(32):
        top = tl.where((rng >> i) > 0, i + 1, top)
    t = lo * 0  # the digits of T - lo found so far, in place
    for _ in range((top + 7) // 8):
        low = tl.maximum(top - 8, 0)
        digit_mask = (1 << (top - low)) - 1
        h = tl.zeros([256], dtype=tl.int32)
        for c0 in range(0, n_cand, STEP):
            offs = c0 + offs0
            ok = offs < n_cand
            d = tl.load(cand_row + offs, mask=ok, other=0).to(tl.int32) - lo
            h += tl.histogram((d >> low) & digit_mask, 256, mask=ok & ((d >> top) == (t >> top)))
        b, kk = _top_bin(h, kk, bins)
        t += b << low
        top = low
    return lo + t, kk


@triton.jit
def _count_ge_pairs(words, n_cand, t, STEP: tl.constexpr):
    """How many of the int16 copies at ``words`` (int32 view, pairs; slots [0, n_cand) rounded up to STEP, the padding
    0) are >= t, for 1 <= t <= 0x7FFF and copies in [0, 0x7C01]: per word (x | 0x80008000) - t * 0x10001 keeps each
    half's borrow inside it (0x8000 + a - t > 0), and bit 15 / 31 is set exactly where that half's a >= t; the two
    half-counts are accumulated packed (each <= the chunk count) and split after the sum."""
    offs = tl.arange(0, STEP // 2)
    t2 = t * 0x10001
    cnt = tl.zeros([STEP // 2], dtype=tl.int32)
    for c0 in range(0, n_cand, STEP):
        w = tl.load(words + c0 // 2 + offs)
        cnt += ((w | -2147450880) - t2 >> 15) & 0x10001  # (-2147450880: 0x80008000 as int32)
    tot = tl.sum(cnt, 0)
    return (tot & 0xFFFF) + (tot >> 16)


@triton.jit
def _cand_threshold_count(cand_row, n_cand, kk, lo, hi, STEP: tl.constexpr, BITS: tl.constexpr = 1):
    """``_cand_threshold``'s (T, need) by a bit search instead of histograms: for each bit of d = key - lo from the top
    of hi - lo's bit length down, the copies with d >= (bits found | this bit) are counted (per-element counters over
    the STEP-key chunks, one block-wide sum per bit) and the bit kept when at least kk are; then one more count of the
    copies above T gives need. The slots from n_cand up to the next multiple of STEP are written -1 first (the row's
    scratch must hold them: its size a multiple of STEP), so every chunk loads whole and unmasked (16-byte loads).
    ~log2(hi - lo) passes of a compare and an add per copy, against two 256-bin ``tl.histogram`` passes (ballots per
    bin bit: ~80 SASS instructions per copy and pass at sm_90) per copy. BITS 2: two bits per pass (three trials
    counted in one sweep of the copies, packed into one int64 counter per element, 21 bits each): half the dependent
    passes over the copies. BITS 3: one bit per pass on pairs of int16 copies at once (``_count_ge_pairs``; int16
    copies only; the padding then 0, which no trial >= 1 and no ``> thr`` counts): the same (T, need)."""
    offs0 = tl.arange(0, STEP)
    pad = n_cand + offs0
    tl.store(cand_row + pad, tl.full([STEP], 0 if BITS == 3 else -1, cand_row.dtype.element_ty),
             mask=pad < (n_cand + STEP - 1) // STEP * STEP)
    tl.debug_barrier()  # the copies and the padding, stored by every thread, are read by others
    rng = hi - lo
    top = lo * 0  # the bit length of hi - lo
    for i in tl.static_range(32):
        top = tl.where((rng >> i) > 0, i + 1, top)
    thr = lo  # lo + the bits of T - lo found so far
    if BITS == 2:
        # top rounded up to even: a trial past hi counts no copy (< kk), so the extra top bit stays 0
        top2 = top + (top & 1)
        for i in range(0, top2, 2):
            b = top2 - 2 - i
            t1 = thr + (1 << b)
            t2 = thr + (2 << b)
            t3 = thr + (3 << b)
            cnt = tl.zeros([STEP], dtype=tl.int64)
            for c0 in range(0, n_cand, STEP):
                key = tl.load(cand_row + c0 + offs0).to(tl.int32)  # copies >= 0, padding -1
                cnt += ((key >= t1).to(tl.int64) + ((key >= t2).to(tl.int64) << 21)
                        + ((key >= t3).to(tl.int64) << 42))
            tot = tl.sum(cnt, 0)
            c1 = (tot & 0x1FFFFF).to(tl.int32)
            c2 = ((tot >> 21) & 0x1FFFFF).to(tl.int32)
            c3 = (tot >> 42).to(tl.int32)
            thr = tl.where(c3 >= kk, t3, tl.where(c2 >= kk, t2, tl.where(c1 >= kk, t1, thr)))
    elif BITS == 3:
        tl.static_assert(cand_row.dtype.element_ty == tl.int16, "BITS 3: int16 copies")
        words = cand_row.to(tl.pointer_type(tl.int32))
        for i in range(0, top):
            trial = thr + (1 << (top - 1 - i))
            thr = tl.where(_count_ge_pairs(words, n_cand, trial, STEP) >= kk, trial, thr)
    else:
        tl.static_assert(BITS == 1, "BITS must be 1, 2 or 3")
        for i in range(0, top):
            trial = thr + (1 << (top - 1 - i))
            cnt = tl.zeros([STEP], dtype=tl.int32)
            for c0 in range(0, n_cand, STEP):
                key = tl.load(cand_row + c0 + offs0).to(tl.int32)  # copies >= 0, padding -1
                cnt += (key >= trial).to(tl.int32)
            thr = tl.where(tl.sum(cnt, 0) >= kk, trial, thr)
    if BITS == 3:
        above = _count_ge_pairs(cand_row.to(tl.pointer_type(tl.int32)), n_cand, thr + 1, STEP)
    else:
        cnt = tl.zeros([STEP], dtype=tl.int32)
        for c0 in range(0, n_cand, STEP):
            key = tl.load(cand_row + c0 + offs0).to(tl.int32)
            cnt += (key > thr).to(tl.int32)
        above = tl.sum(cnt, 0)
    return thr, kk - above


@triton.jit
def _bracket_topk_rows(
    SUMS, OUT, CAND, FELL_BACK,
    SK, num_keys, width, inner,
    stride_so, stride_si, stride_oo, stride_oi,
    stride_samp, n_samp, hi_rank, lo_rank,
    KEY_BITS: tl.constexpr,
    ALIGN: tl.constexpr,  # the row strides (in keys) are multiples of ALIGN (passed divided by it)
    ROWS: tl.constexpr,
    VEC: tl.constexpr,  # keys per tile row: 16 bytes
    NS: tl.constexpr,  # sample slots (power of two >= n_samp)
    CAP: tl.constexpr,  # candidate slots per row in CAND
    PREFETCH: tl.constexpr,  # each sweep issues the next tile's load before this tile's work
    CAND_COUNT: tl.constexpr = 0,  # the threshold among the copies by counting, 1 or 2 bits per pass (0: histograms;
    # CAP a multiple of ROWS * VEC)
):
    """The bracket method on [ROWS, VEC] tiles (``_tile_offsets``), one program per row: a stratified sample of
    n_samp keys (one per ``stride_samp`` positions, a scrambled offset in each) brackets the K-th largest key between
    two sample order statistics; one sweep counts the keys above the bracket (per-thread counters, reduced once) and
    copies the keys inside it to CAND (at most CAP); radix select over the copies (``_cand_threshold``) gives the
    threshold,
    then ``_compact_tiles`` writes the row. A bracket the counts disprove (or that overflows CAP) leaves the row
    unwritten with FELL_BACK[row] = 1: ``_radix_topk_rows`` (ONLY_FLAGGED, the next launch) writes it, so the result
    is exact either way. (The radix passes are not inlined here: they held the kernel at 140 registers, 7 programs
    of 2 warps per SM; without them 72 fit with no spill.)"""
    row = tl.program_id(0)
    outer = (row // inner).to(tl.int64)
    row_in = (row % inner).to(tl.int64)
    _bracket_row(SUMS + outer * (stride_so * ALIGN) + row_in * (stride_si * ALIGN),
                 OUT + outer * stride_oo + row_in * stride_oi, CAND + row.to(tl.int64) * CAP, FELL_BACK + row,
                 SK, num_keys, width, stride_samp, n_samp, hi_rank, lo_rank, KEY_BITS, ROWS, VEC, NS, CAP, PREFETCH,
                 False, CAND_COUNT)


@triton.jit
def _bracket_bounds(src, SK, stride_samp, n_samp, hi_rank, lo_rank, KEY_BITS: tl.constexpr, NS: tl.constexpr,
                    SAMPLE_TWO_BITS: tl.constexpr):
    """(lo, hi): the bracket of the row at ``src`` (Sk keys): the keys of ranks lo_rank and hi_rank (1 = largest) in a
    stratified sample of n_samp keys, one per ``stride_samp`` positions at a scrambled offset (``sample_positions``);
    hi_rank <= 0: hi = one above +inf's key (no key above the bracket); lo_rank > n_samp: lo = 0 (every key inside).
    SAMPLE_TWO_BITS: ``_kth_largest2`` two bits per reduction."""
    top = tl.program_id(0) * 0 + (0x7C01 if KEY_BITS == 16 else 0x7F800001)  # one above +inf's key: above every key
    j = tl.arange(0, NS)
    pos = j * stride_samp + (j * 97 + (j >> 3) * 13) % stride_samp
    samp = tl.where(j < n_samp, _keys(src, pos, SK, KEY_BITS), -1)
    hi, lo = _kth_largest2(samp, hi_rank, lo_rank, top, KEY_BITS - 1, SAMPLE_TWO_BITS)
    return lo, hi


@triton.jit
def _bracket_row(src, dst, cand_row, flag, SK, num_keys, width, stride_samp, n_samp, hi_rank, lo_rank,
                 KEY_BITS: tl.constexpr, ROWS: tl.constexpr, VEC: tl.constexpr, NS: tl.constexpr, cap,
                 PREFETCH: tl.constexpr, SAMPLE_TWO_BITS: tl.constexpr = False, CAND_COUNT: tl.constexpr = False):
    """The bracket method for one row of Sk keys at ``src`` (16-byte aligned when Sk >= ROWS * VEC: whole tiles load
    unmasked) into the selection row ``dst`` (``width`` slots), with the candidate scratch ``cand_row`` (``cap`` slots)
    and the row's int8 fallback flag at ``flag`` (written 1 when the row is left to the radix launch, else 0);
    ``_bracket_topk_rows`` per program, or pass 2's epilogue (``selection._group_prob_sums_pair`` TOPK). The threshold
    among the copies: ``_cand_threshold`` (radix select). SAMPLE_TWO_BITS: the bracket's two sample order statistics
    two bits per reduction (``_kth_largest2``; for NS / threads <= 8: the fused epilogue's 4 warps). CAND_COUNT: the
    threshold among the copies by ``_cand_threshold_count`` (bit search by counting; 2: two bits per pass) instead."""
    zero = tl.program_id(0) * 0
    lo, hi = _bracket_bounds(src, SK, stride_samp, n_samp, hi_rank, lo_rank, KEY_BITS, NS, SAMPLE_TWO_BITS)

    tile = _tile_offsets(ROWS, VEC)
    step: tl.constexpr = ROWS * VEC
    above_rows = tl.zeros([ROWS], dtype=tl.int32)
    n_cand = zero
    n_full = SK // step
    if PREFETCH:
        x = _load_tile(src, tile, SK, True)
        for i in range(0, n_full):
            x_next = _load_tile(src, tl.minimum(i + 1, n_full - 1) * step + tile, SK, False)
            above_rows, n_cand = _count_step(_raw_keys(x, tile, SK, KEY_BITS, False), cand_row, lo, hi, above_rows,
                                             n_cand, cap)
            x = x_next
    else:
        for i in range(0, n_full):
            x = _load_tile(src, i * step + tile, SK, False)
            above_rows, n_cand = _count_step(_raw_keys(x, tile, SK, KEY_BITS, False), cand_row, lo, hi, above_rows,
                                             n_cand, cap)
    offs = n_full * step + tile
    above_rows, n_cand = _count_step(_raw_keys(_load_tile(src, offs, SK, True), offs, SK, KEY_BITS, True), cand_row,
                                     lo, hi, above_rows, n_cand, cap)
    above = tl.sum(above_rows, 0)

    hit = (above < num_keys) & (above + n_cand >= num_keys) & (n_cand <= cap)
    tl.store(flag, (1 - hit.to(tl.int32)).to(tl.int8))
    if hit:
        # the threshold is the (num_keys - above)-th largest copy (every copy is >= lo, n_cand >= that)
        if CAND_COUNT:
            prefix, need = _cand_threshold_count(cand_row, n_cand, num_keys - above, lo, hi, ROWS * VEC, CAND_COUNT)
        else:
            prefix, need = _cand_threshold(cand_row, n_cand, num_keys - above, lo, hi, ROWS * VEC // 2)
        _compact_tiles(src, dst, SK, num_keys, width, prefix, need, KEY_BITS, ROWS, VEC, PREFETCH)


def bracket_plan(sk: int, num_keys: int, key_bytes: int, *, stride: int | None = None, cap: int | None = None,
                 z: float = _Z) -> tuple[int, int, int, int, int]:
    """(stride, n_samp, hi_rank, lo_rank, cap) of the "bracket" method for rows of ``sk`` keys of ``key_bytes``
    bytes: one sample per ``stride`` keys (default: as many samples as fit ``_BRACKET_MAX_SAMPLES``, i.e. one per
    ceil(sk / 1024) keys; a given stride is raised to that too); the sample ranks (1 =
    largest) whose keys bracket the K-th largest key: about K * n_samp / sk of the samples lie above it, with a
    binomial spread sigma, and the bracket is that rank -/+ (z * sigma + 2) (hi_rank may be <= 0: no upper bound;
    lo_rank > n_samp: no lower bound); the candidate slots per row: the power of two >= 1.3 x the keys the bracket
    is expected to hold (its sample ranks x stride), at least 256 (``cap`` overrides it)."""
    stride = max(stride or 1, -(-sk // _BRACKET_MAX_SAMPLES))
    n_samp = sk // stride
    p = num_keys / sk
    rank = num_keys * n_samp / sk
    margin = math.ceil(z * math.sqrt(n_samp * p * (1.0 - p))) + 2
    hi_rank, lo_rank = math.floor(rank) - margin, math.ceil(rank) + margin
    if cap is None:
        cap = max(256, triton.next_power_of_2(math.ceil(1.3 * (lo_rank - max(hi_rank, 0)) * stride)))
    return stride, n_samp, hi_rank, lo_rank, cap


def sample_positions(sk: int, stride: int) -> torch.Tensor:
    """The positions the bracket method samples in a row of ``sk`` keys at one sample per ``stride`` keys (int64
    [sk // stride]; the kernel computes the same ones): j * stride + a scrambled offset in [0, stride)."""
    j = torch.arange(sk // stride)
    return j * stride + (j * 97 + (j >> 3) * 13) % stride


def top_k_rows(sums: torch.Tensor, num_keys: int, width: int, *, out: torch.Tensor | None = None,
               method: str | None = None, cap: int | None = None, block: int | None = None,
               num_warps: int | None = None, return_fallbacks: bool = False, hist: torch.Tensor | None = None,
               sample_stride: int | None = None, prefetch: bool = True, maxnreg: int | None = None,
               cand_count: int = 0, z: float | None = None):
    """Each row's K largest entries as sorted int32 indices with -1 padding; ``kernels.reference.topk.top_k_rows``'s
    contract (ties: lower index first; negatives and -0.0 rank as +0.0; no NaN).

    Args:
        sums: ``[..., Sk]`` float16 or float32 (copied when its rows are not one or two strided levels).
        num_keys: K in [1, Sk]. width: K_alloc >= K.
        out: optional int32 ``[..., width]``, written in place: a contiguous last dim, and the leading dims after
            the first mergeable into one (e.g. a head slice ``[B, h, G, K_alloc]`` of the whole selection).
        method: "bracket" (sample bracket + radix select among the candidates on [rows, 16-byte] tiles, radix fallback
            per row, ``_bracket_topk_rows``), "seg" (the same bracket with per-warp candidate slots and warp-local
            scans, ``topk_seg``; float16 rows 16-byte aligned with Sk a multiple of 8, else "bracket"; the threshold
            always by counting, ``cand_count`` ignored) or "radix" (histogram passes only); None: ``_SEPARATE_METHOD``
            (H200: the bracket 2.4-3x faster than radix at 32760 and 75600 keys, docs/kernels.md). All are exact and
            give identical results.
        cap: the bracket method's candidate slots per row (a power of two; default ``bracket_plan``'s; a scratch of
            rows x cap int16 keys for float16 sums, int32 for float32, per call); "seg": per warp (at least 256;
            default ``topk_seg.seg_plan``'s; a scratch of rows x warps x cap int16 keys).
        block, num_warps: keys per sweep step (bracket) or chunk size (radix), and warps per row (tuning; "seg":
            ``_SEG_WARPS`` when None).
        sample_stride: the bracket method's keys per sample (None: ``bracket_plan``'s); z: its bracket half-width in
            binomial sigmas (None: ``_SEPARATE_Z``; any z gives the same result); prefetch: its sweeps issue
            the next tile's load before this tile's work; maxnreg: the bracket kernel's register cap per thread on
            CUDA (None: ``_BRACKET_MAXNREG``, "seg" ``_SEG_MAXNREG``; 0: none).
        cand_count: the bracket method's threshold among its candidates by counting (``_cand_threshold_count``, as
            ``FusedRows.cand_count``; True or 1: one bit per pass over the copies, 2: two) instead of radix histograms
            (0 / False); the candidate slots per row are then rounded up to a multiple of the sweep step (its
            padding). Same result.
        return_fallbacks: also return int8 ``[rows]``, 1 where the bracket method fell back to the radix threshold.
        hist: optional int32 ``[..., HIST_BINS]`` contiguous: each row's histogram of its keys' top 8 bits (pass 2
            counts it while writing the sums, ``selection.group_prob_sums(hist=...)``); the radix method then skips
            its first pass (a row whose counts do not add up to Sk is recounted). Ignored by the other methods.
    Returns:
        ``out`` (or a new tensor): int32 ``[..., width]``; with ``return_fallbacks``, (out, fallbacks).
    Raises:
        TypeError: sums not float16/float32. ValueError: K or width out of range, a bad ``out`` or ``hist``, an unknown
        method, cap not a power of two >= 16.
    """
    if method is None:
        method = _SEPARATE_METHOD
    if method not in ("radix", "bracket", "seg"):
        raise ValueError(f"method must be 'radix', 'bracket' or 'seg', got {method!r}")
    if cap is not None and (cap & (cap - 1) or cap < 16):
        raise ValueError(f"cap must be a power of two >= 16, got {cap}")
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
    # every row's flag written by the bracket method; radix leaves its zeros
    fell_back = (torch.zeros if method == "radix" else torch.empty)(n, dtype=torch.int8, device=sums.device)
    key_bits = 16 if sums.dtype == torch.float16 else 32
    rows = (src, dst, sk, num_keys, width, src.shape[1], src.stride(0), src.stride(1), dst.stride(0), dst.stride(1))
    if hist is not None and (hist.dtype != torch.int32 or tuple(hist.shape) != (*lead, HIST_BINS.value)
                             or not hist.is_contiguous()):
        raise ValueError(f"hist must be contiguous int32 {(*lead, HIST_BINS.value)}, got {hist.dtype} {tuple(hist.shape)}")
    if n and method == "radix":
        _radix_topk_rows[(n,)](rows[0], rows[1], fell_back if hist is None else hist, fell_back, *rows[2:],
                               KEY_BITS=key_bits, BLOCK=block or _BLOCK, HAS_HIST=hist is not None,
                               num_warps=num_warps or 4)
    elif n:
        stride, n_samp, hi_rank, lo_rank, cap_b = bracket_plan(sk, num_keys, key_bits // 8, stride=sample_stride,
                                                               cap=cap, z=_SEPARATE_Z if z is None else float(z))
        vec = 128 // key_bits  # keys per 16-byte load
        align = vec if src.stride(0) % vec == 0 and src.stride(1) % vec == 0 else 1
        if method == "seg" and key_bits == 16 and align == vec and sk % vec == 0:
            from . import topk_seg

            warps = num_warps or _SEG_WARPS
            steps, slots = topk_seg.seg_plan(sk, (lo_rank - max(hi_rank, 0)) * stride, warps)
            slots = max(cap, 256) if cap else slots  # (whole 256-copy chunks per warp)
            cand = torch.empty(n, warps * slots, dtype=torch.int16, device=sums.device)
            regs = _SEG_MAXNREG if maxnreg is None else maxnreg
            topk_seg._seg_topk_rows[(n,)](
                src, dst, cand, fell_back, sk, num_keys, width, src.shape[1], src.stride(0) // vec,
                src.stride(1) // vec, dst.stride(0), dst.stride(1), stride, n_samp, hi_rank, lo_rank, steps, W=warps,
                VEC=vec, NS=triton.next_power_of_2(n_samp), CAPW=slots,
                PREFETCH=prefetch,
                num_warps=warps,
                **(dict(maxnreg=regs) if regs and sums.device.type == "cuda" else {}))
        else:
            warps = num_warps or _BRACKET_WARPS
            tile_rows = (block // vec) if block else 32 * warps * _BRACKET_ROWS_PER_THREAD
            if cand_count:  # whole sweep steps of copies (``_cand_threshold_count`` pads to them)
                step = tile_rows * vec
                cap_b = -(-max(cap_b, step) // step) * step
            cand = torch.empty(n, cap_b, dtype=torch.int16 if key_bits == 16 else torch.int32, device=sums.device)
            regs = _BRACKET_MAXNREG if maxnreg is None else maxnreg
            launch = dict(maxnreg=regs) if regs and sums.device.type == "cuda" else {}
            _bracket_topk_rows[(n,)](
                src, dst, cand, fell_back, sk, num_keys, width, src.shape[1], src.stride(0) // align,
                src.stride(1) // align, dst.stride(0), dst.stride(1), stride, n_samp, hi_rank, lo_rank,
                KEY_BITS=key_bits, ALIGN=align, ROWS=tile_rows, VEC=vec, NS=triton.next_power_of_2(n_samp), CAP=cap_b,
                PREFETCH=prefetch, CAND_COUNT=int(cand_count), num_warps=warps, **launch)
        # the rows whose bracket missed (flagged): radix threshold + compaction; every other program returns at once
        _radix_topk_rows[(n,)](*rows[:2], fell_back, fell_back, *rows[2:], KEY_BITS=key_bits, BLOCK=_BLOCK,
                               HAS_HIST=False, ONLY_FLAGGED=True, num_warps=4)
    return (out, fell_back) if return_fallbacks else out


@dataclasses.dataclass
class FusedRows:
    """The top-K as the epilogue of pass 2 (``selection.group_prob_sums(select=...)``): each pair program, once its
    two groups' float16 sums are stored, runs the bracket method (``_bracket_row``) on them (still in L2) and writes
    their selection rows; the rows it leaves (a disproved bracket) are flagged, and ``finish`` writes them with the
    radix method (one launch; unflagged programs return at once). The result equals ``top_k_rows(sums, ...)``.

    Fields: out, int32 ``[B, h, G, width]`` (the selection of the head chunk, contiguous last dim); num_keys, width;
    plan, ``bracket_plan``'s (stride, n_samp, hi_rank, lo_rank, cap); cand, the candidate scratch (int16
    ``[>= B*h*G, cap]``); flags, int8 ``[>= B*h*G]``; done: set by pass 2 when its kernel ran the top-K (the Gluon
    pass-2 kernel does not: then the caller runs ``top_k_rows``); rows_per_thread: 16-byte tile rows each thread
    holds per sweep step (a power of two; tuning: fewer, longer steps); cand_count: the threshold among the bracket's
    copies by counting bit by bit (``_cand_threshold_count``) instead of radix histograms (where the candidate slots
    per row are a multiple of the epilogue's 16-byte tile, ``plan[4]``; else the histograms); complete: set with
    ``done`` by a pass-2 kernel that wrote every row of ``out`` exactly (the CuTeDSL kernel's fused top-K,
    ``pass2_dispatch.try_cute_select``): ``finish`` has nothing to do."""
    out: torch.Tensor
    num_keys: int
    width: int
    plan: tuple[int, int, int, int, int]
    cand: torch.Tensor
    flags: torch.Tensor
    done: bool = False
    rows_per_thread: int = 1
    cand_count: int = 0
    complete: bool = False

    @classmethod
    def allocate(cls, rows: int, sk: int, num_keys: int, width: int, device, *, z: float = _Z,
                 cand_count: int = 0, stride: int | None = None) -> "FusedRows":
        """A plan for float16 sums of ``rows`` rows of ``sk`` keys (``out`` set per head chunk by ``for_chunk``;
        ``z``: the bracket's half-width in binomial sigmas and ``stride`` its keys per sample (None: the default),
        ``bracket_plan``; ``cand_count``: the field, with at least
        ``_CAND_COUNT_MIN_CAP`` candidate slots). Raises torch.cuda.OutOfMemoryError for the candidate scratch (rows x
        cap int16)."""
        plan = bracket_plan(sk, num_keys, 2, z=z, stride=stride)
        if cand_count and plan[4] < _CAND_COUNT_MIN_CAP:
            plan = (*plan[:4], _CAND_COUNT_MIN_CAP)
        return cls(torch.empty(0, dtype=torch.int32, device=device), num_keys, width, plan,
                   torch.empty(rows, plan[4], dtype=torch.int16, device=device),
                   torch.empty(rows, dtype=torch.int8, device=device), cand_count=int(cand_count))

    def for_chunk(self, out: torch.Tensor) -> "FusedRows":
        """This plan (same scratch) for the head chunk's selection ``out`` ([B, h, G, width]), ``done`` cleared."""
        return dataclasses.replace(self, out=out, done=False, complete=False)

    def finish(self, sums: torch.Tensor) -> torch.Tensor:
        """After pass 2 ran the fused top-K on ``sums`` ([B, h, G, Sk] float16, contiguous rows): the radix method on
        the flagged rows (none when ``complete``); returns ``out``."""
        if self.complete:
            return self.out
        B = sums.shape[0]
        sk = sums.shape[-1]
        src = sums.view(B, -1, sk)
        dst = self.out.view(B, -1, self.width)
        n = src.shape[0] * src.shape[1]
        _radix_topk_rows[(n,)](src, dst, self.flags, self.flags, sk, self.num_keys, self.width, src.shape[1],
                               src.stride(0), src.stride(1), dst.stride(0), dst.stride(1), KEY_BITS=16, BLOCK=_BLOCK,
                               HAS_HIST=False, ONLY_FLAGGED=True, num_warps=4)
        return self.out
