"""The separate top-K's "seg" form: ``topk``'s bracket method with no cross-warp scan in its sweeps (issue 15).

One program per row of float16 sums (16-byte aligned rows, Sk a multiple of 8), W warps. The row is cut into W
contiguous quarters, warp w sweeping quarter w in steps of 256 keys (32 lanes x one 16-byte vector of 8 keys each;
``_seg_offsets``), so every scan in the sweeps runs inside one thread or across the lanes of one warp:

- bracket: the same sample and order statistics as ``topk._bracket_row`` (``topk._bracket_bounds``: lo <= T <= hi);
- count sweep: each warp counts its keys above hi and copies its keys inside [lo, hi] into its own ``CAPW``
  candidate slots in token order (``_warp_scan``: shuffles within the warp, where ``topk._count_step`` scans the
  whole block per step with 5 barriers; the lanes' copies stay contiguous: coalesced stores); a warp with more than
  CAPW copies, or a bracket the counts disprove, flags the row for ``topk._radix_topk_rows`` (exact either way, as
  ``topk``). (Session 13's first form gave each thread its own slots, no scan at all: every copy then took its own
  sector, and the threshold's loads 32 sectors per warp; H200 round s13r1: the top-K alone 0.076 of dense against
  the bracket method's 0.049 at 1.3B 480p s = 0.5; this form 0.044 in round s13r2.)
- threshold: T = the (K - above)-th largest copy by a bit search counting each warp's copies in 512-byte chunks
  (``_seg_threshold``, int16 pairs per 32-bit word as ``topk._count_ge_pairs``, one block-wide sum per bit), then per
  warp its copies > T and == T;
- compaction: from those per-warp counts each warp's first slot and first tie rank follow once per row (keys > T
  before its quarter, keys == T before it); then warp w writes its quarter in token order with per-step scans across
  its own lanes only (``_warp_scan``; ``topk._compact_step``'s packed counts per step).

Same contract and result as ``topk.top_k_rows`` (ties: lower token index first; negatives and -0.0 rank as +0.0).
Offline sm_90 SASS per 8-key step and thread: docs/kernels.md (session 13, p2ops). Launched by
``topk.top_k_rows(method="seg")``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .topk import _bracket_bounds, _load_tile, _raw_keys

LANES = tl.constexpr(32)  # lanes per warp: one 16-byte vector per lane per step


@triton.jit
def _seg_offsets(W: tl.constexpr, VEC: tl.constexpr, steps_per_warp):
    """(vector index [32, W, 1] of step 0, key index within a vector [1, 1, VEC]): warp w's lane l reads vector
    w * steps_per_warp * 32 + i * 32 + l at step i. Lanes on dim 0, warps on dim 1, a vector in one thread: the
    loads' layout (Triton 3.6 orders the dims of equal contiguity by index: dim 0 gets the 32 threads of a warp, dim 1
    the warps), so reductions and scans along dim 0 stay inside a warp (offline SASS: no barrier in the sweeps)."""
    lane = tl.arange(0, LANES)[:, None, None]
    w = tl.arange(0, W)[None, :, None]
    return w * (steps_per_warp * LANES) + lane, tl.arange(0, VEC)[None, None, :]


@triton.jit
def _seg_keys(src, vbase, i, last, v, n_vec, key, VEC: tl.constexpr, PREFETCH: tl.constexpr):
    """(the keys of step i, the keys to carry into step i + 1) of a sweep over each warp's quarter (``last`` its last
    step): PREFETCH, ``key`` holds step i's and step i + 1's load is issued now (clamped to the last step); else step
    i's is loaded now."""
    if PREFETCH:
        return key, _seg_load(src, vbase + tl.minimum(i + 1, last) * LANES, v, n_vec, VEC)
    key = _seg_load(src, vbase + i * LANES, v, n_vec, VEC)
    return key, key


@triton.jit
def _seg_load(src, vidx, v, n_vec, VEC: tl.constexpr):
    """The keys of vectors ``vidx`` ([32, W, 1]; -1 past the row's ``n_vec`` vectors, whose loads are clamped to the
    last vector: whole 16-byte loads, no mask) as int32 ``_raw_keys``."""
    x = _load_tile(src, tl.minimum(vidx, n_vec - 1) * VEC + v, 0, False)
    return tl.where(vidx < n_vec, _raw_keys(x, v, 0, 16, False), -1)


@triton.jit
def _excl(x, axis: tl.constexpr):
    """Exclusive prefix sums of ``x`` along ``axis``."""
    return tl.cumsum(x, axis) - x


@triton.jit
def _warp_scan(x):
    """(exclusive prefix sums of ``x`` ([32, W, VEC] int32) in token order within each warp's step: in-thread along
    dim 2, across the warp's lanes along dim 0; each warp's step total [1, W, 1]). The lane scan runs on the
    transposed [W, 32] totals: Triton 3.6 scans in its default layout, which for [W, 32] puts a warp's 32 threads on
    dim 1, the same threads that hold them here (scanned as [32, W] it crossed warps through shared memory)."""
    lane_tot = tl.sum(x, 2)  # [32, W]
    before = _excl(x, 2) + tl.trans(_excl(tl.trans(lane_tot), 1))[:, :, None]
    return before, tl.sum(lane_tot, 0)[None, :, None]


@triton.jit
def _seg_count(words, trial, n_chunks, CHUNK: tl.constexpr):
    """Per warp ([W]): how many of its copies are >= ``trial`` (1 <= trial <= 0x7FFF): ``words`` its slots as int32
    pairs ([32, W, VEC // 2] pointers of each lane's first vector), ``n_chunks`` chunks of ``CHUNK`` copies (32 lanes
    x one 16-byte vector: one coalesced 512-byte load per warp), padded with 0 (no trial counts it); per pair (x |
    0x80008000) - trial * 0x10001 keeps each half's borrow inside it (copies in [0, 0x7C01]) and bit 15 / 31 is set
    exactly where that half is >= trial (``topk._count_ge_pairs``), the two half counts accumulated packed (each <=
    the slots per thread) and split after the loop."""
    t2 = trial * 0x10001
    cnt = tl.zeros(words.shape, dtype=tl.int32)
    for j in range(0, n_chunks):
        w = tl.load(words + j * (CHUNK // 2))
        cnt += ((w | -2147450880) - t2 >> 15) & 0x10001  # (-2147450880: 0x80008000 as int32)
    cnt = tl.sum(cnt, 2)
    return tl.sum((cnt & 0xFFFF) + (cnt >> 16), 0)


@triton.jit
def _seg_threshold(copies, n_w, kk, lo, hi, VEC: tl.constexpr):
    """(T, per-warp copies > T, per-warp copies == T; [W]): T the kk-th largest of all warps' copies (``copies``: each
    warp's slots, [1, W, 1] pointers, its ``n_w`` copies first ([1, W, 1]); every copy in [lo, hi], 1 <= kk <= their
    count), bit by bit from the top of hi - lo's bit length (a trial bit kept when at least kk copies are >= it: one
    block-wide sum per bit). Each warp's slots are first padded with 0 up to the block's most chunks per warp, so
    every pass loads whole chunks unmasked."""
    CHUNK: tl.constexpr = LANES * VEC
    lane8 = tl.arange(0, LANES)[:, None, None] * VEC  # [32, 1, 1]
    v = tl.arange(0, VEC)[None, None, :]
    n_chunks = tl.max(tl.max(tl.max((n_w + CHUNK - 1) // CHUNK, 2), 1), 0)
    whole = (n_w + VEC - 1) // VEC * VEC  # the zeros: the rest of each warp's last vector (lane 0), whole vectors
    part = n_w + v + lane8 * 0  # ([32, W, VEC]: stored by lane 0)
    tl.store(copies + part, tl.zeros([LANES, n_w.shape[1], VEC], dtype=tl.int16), mask=(part < whole) & (lane8 == 0))
    for j in range(0, n_chunks):
        at = j * CHUNK + lane8
        tl.store(copies + at + v, tl.zeros([LANES, n_w.shape[1], VEC], dtype=tl.int16), mask=at >= whole)
    tl.debug_barrier()
    words = (copies + lane8).to(tl.pointer_type(tl.int32)) + tl.arange(0, VEC // 2)[None, None, :]
    rng = hi - lo
    top = lo * 0  # the bit length of hi - lo
    for i in tl.static_range(32):
        top = tl.where((rng >> i) > 0, i + 1, top)
    thr = lo
    for i in range(0, top):
        trial = thr + (1 << (top - 1 - i))
        thr = tl.where(tl.sum(_seg_count(words, trial, n_chunks, CHUNK), 0) >= kk, trial, thr)
    gt = _seg_count(words, thr + 1, n_chunks, CHUNK)
    if thr == 0:  # every copy is >= 0 (the padding too)
        ge = tl.sum(tl.sum(n_w, 2), 0)
    else:
        ge = _seg_count(words, thr, n_chunks, CHUNK)
    return thr, gt, ge - gt


@triton.jit
def _seg_compact_step(key, dst, tok, num_keys, thr, need, gt_run, eq_run):
    """One step of the compaction (``key`` [32, W, VEC], token indices ``tok``): per key, its slot = keys > T before
    it + min(keys == T before it, need), kept when > T or == T with fewer than ``need`` before it; the counts before
    the step per warp in ``gt_run`` / ``eq_run`` ([1, W, 1]); within the step one packed ``_warp_scan`` (a step holds
    256 keys per warp: 16-bit halves suffice). Returns the new runs."""
    gt = (key > thr).to(tl.int32)
    eq = (key == thr).to(tl.int32)
    before, tot = _warp_scan(gt + (eq << 16))
    gt_b = gt_run + (before & 0xFFFF)
    eq_b = eq_run + (before >> 16)
    pos = gt_b + tl.minimum(eq_b, need)
    sel = (gt > 0) | ((eq > 0) & (eq_b < need))
    tl.store(dst + pos, tok, mask=sel & (pos < num_keys))  # never past K, whatever the threshold
    return gt_run + (tot & 0xFFFF), eq_run + (tot >> 16)


@triton.jit
def _seg_topk_rows(
    SUMS, OUT, CAND, FELL_BACK,
    SK, num_keys, width, inner,
    stride_so, stride_si, stride_oo, stride_oi,
    stride_samp, n_samp, hi_rank, lo_rank, steps_per_warp,
    W: tl.constexpr,  # warps per row (= num_warps): row quarters
    VEC: tl.constexpr,  # keys per 16-byte vector (8: float16)
    NS: tl.constexpr,  # sample slots (power of two >= n_samp)
    CAPW: tl.constexpr,  # candidate slots per warp (a multiple of 32 x VEC)
    PREFETCH: tl.constexpr,  # the sweeps issue the next step's load before this step's work
):
    """One program per row (module docstring). SUMS rows 16-byte aligned (strides passed in vectors), SK a multiple
    of VEC; CAND int16 [rows, W * CAPW]; FELL_BACK int8 [rows] (1: the row is left to the radix launch)."""
    row = tl.program_id(0)
    outer = (row // inner).to(tl.int64)
    row_in = (row % inner).to(tl.int64)
    src = SUMS + outer * (stride_so * VEC) + row_in * (stride_si * VEC)
    dst = OUT + outer * stride_oo + row_in * stride_oi
    lo, hi = _bracket_bounds(src, SK, stride_samp, n_samp, hi_rank, lo_rank, 16, NS, False)
    vbase, v = _seg_offsets(W, VEC, steps_per_warp)
    n_vec = SK // VEC
    copies = CAND + row.to(tl.int64) * (W * CAPW) + tl.arange(0, W)[None, :, None] * CAPW  # [1, W, 1]: each warp's

    above_t = tl.zeros([LANES, W], dtype=tl.int32)
    n_w = tl.zeros([1, W, 1], dtype=tl.int32)
    last = steps_per_warp - 1
    key = _seg_load(src, vbase, v, n_vec, VEC)
    for i in range(0, steps_per_warp):
        key, key1 = _seg_keys(src, vbase, i, last, v, n_vec, key, VEC, PREFETCH)
        above_t += tl.sum((key > hi).to(tl.int32), 2)
        inside = ((key >= lo) & (key <= hi)).to(tl.int32)
        before, tot = _warp_scan(inside)
        slot = n_w + before
        tl.store(copies + slot, key.to(tl.int16), mask=(inside > 0) & (slot < CAPW))
        n_w += tot
        key = key1
    above = tl.sum(tl.sum(above_t, 1), 0)
    n_cand = tl.sum(tl.sum(tl.sum(n_w, 2), 1), 0)
    fits = tl.max(tl.max(tl.max(n_w, 2), 1), 0) <= CAPW
    hit = (above < num_keys) & (above + n_cand >= num_keys) & fits
    tl.store(FELL_BACK + row, (1 - hit.to(tl.int32)).to(tl.int8))
    if hit:
        thr, gt_c, eq_c = _seg_threshold(copies, n_w, num_keys - above, lo, hi, VEC)
        gt_w = tl.sum(above_t, 0) + gt_c  # per warp: keys > T (above hi, or copies above T), keys == T (copies)
        need = num_keys - tl.sum(gt_w, 0)
        gt_run = _excl(gt_w, 0)[None, :, None]  # keys > T / == T before each warp's quarter
        eq_run = _excl(eq_c, 0)[None, :, None]
        tok_base = vbase * VEC + v
        key = _seg_load(src, vbase, v, n_vec, VEC)
        for i in range(0, steps_per_warp):
            key, key1 = _seg_keys(src, vbase, i, last, v, n_vec, key, VEC, PREFETCH)
            gt_run, eq_run = _seg_compact_step(key, dst, tok_base + i * (LANES * VEC), num_keys, thr, need, gt_run,
                                               eq_run)
            key = key1
        offs1 = tl.arange(0, W * LANES * VEC)
        for c0 in range(num_keys, width, W * LANES * VEC):
            fill = c0 + offs1
            tl.store(dst + fill, tl.full([W * LANES * VEC], -1, tl.int32), mask=fill < width)


def seg_plan(sk: int, expected: int, warps: int) -> tuple[int, int]:
    """(steps per warp, candidate slots per warp) for rows of ``sk`` keys whose bracket is expected to hold
    ``expected`` keys (``topk.bracket_plan``'s sample ranks x stride): the row cut into ``warps`` quarters of whole
    256-key steps; per warp the power of two >= twice its share, at least 512."""
    steps = -(-sk // (warps * LANES.value * 8))
    return steps, max(512, triton.next_power_of_2(2 * -(-expected // warps)))
