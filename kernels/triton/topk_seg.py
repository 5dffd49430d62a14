"""The separate top-K's "seg" form: ``topk``'s bracket method with no cross-warp scan in its sweeps (issue 15).

One program per row of float16 sums (16-byte aligned rows, Sk a multiple of 8), W warps. The row is cut into W
contiguous quarters, warp w sweeping quarter w in steps of 256 keys (32 lanes x one 16-byte vector of 8 keys each;
``_seg_offsets``), so every scan in the sweeps runs inside one thread or across the lanes of one warp:

- bracket: the same sample and order statistics as ``topk._bracket_row`` (``topk._bracket_bounds``: lo <= T <= hi);
- count sweep: each thread counts its keys above hi and copies its keys inside [lo, hi] into its own ``PT`` candidate
  slots (an in-thread prefix sum gives the slot: no scan across threads at all, where ``topk._count_step`` scans the
  whole block per step with 5 barriers); a thread with more than PT copies, or a bracket the counts disprove, flags
  the row for ``topk._radix_topk_rows`` (exact either way, as ``topk``);
- threshold: T = the (K - above)-th largest copy by a bit search counting each thread's own copies (``_seg_threshold``,
  one block-wide sum per bit, as ``topk._cand_threshold_count``), then per thread its copies > T and == T;
- compaction: from those per-thread counts each warp's first slot and first tie rank follow once per row (keys > T
  before its quarter, keys == T before it); then warp w writes its quarter in token order with per-step scans across
  its own lanes only (shuffles, no barrier; ``topk._compact_step``'s packed counts per step).

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
def _seg_load(src, vidx, v, n_vec, VEC: tl.constexpr):
    """The keys of vectors ``vidx`` ([32, W, 1]; -1 past the row's ``n_vec`` vectors, whose loads are clamped to the
    last vector: whole 16-byte loads, no mask) as int32 ``_raw_keys``."""
    x = _load_tile(src, tl.minimum(vidx, n_vec - 1) * VEC + v, 0, False)
    return tl.where(vidx < n_vec, _raw_keys(x, v, 0, 16, False), -1)


@triton.jit
def _seg_count(words, trial, n_chunks, VEC: tl.constexpr):
    """Per thread ([32, W]): how many of its copies are >= ``trial`` (1 <= trial <= 0x7FFF): ``words`` its slots as
    int32 pairs ([32, W, VEC // 2] pointers of its first vector), ``n_chunks`` vectors of them, padded with 0 (no
    trial counts it); per pair (x | 0x80008000) - trial * 0x10001 keeps each half's borrow inside it (copies in
    [0, 0x7C01]) and bit 15 / 31 is set exactly where that half is >= trial (``topk._count_ge_pairs``), the two half
    counts accumulated packed (each <= the slots per thread) and split after the loop."""
    t2 = trial * 0x10001
    cnt = tl.zeros(words.shape, dtype=tl.int32)
    for j in range(0, n_chunks):
        w = tl.load(words + j * (VEC // 2))
        cnt += ((w | -2147450880) - t2 >> 15) & 0x10001  # (-2147450880: 0x80008000 as int32)
    cnt = tl.sum(cnt, 2)
    return (cnt & 0xFFFF) + (cnt >> 16)


@triton.jit
def _seg_threshold(copies, n_t, kk, lo, hi, v, VEC: tl.constexpr):
    """(T, per-thread copies > T, per-thread copies == T): T the kk-th largest of all threads' copies (``copies``: each
    thread's slots, [32, W, 1] pointers; every copy in [lo, hi], 1 <= kk <= their count), bit by bit from the top of
    hi - lo's bit length (a trial bit kept when at least kk copies are >= it: one block-wide sum per bit). Each
    thread's slots are first padded with 0 up to the block's most vectors per thread, so every pass loads whole
    vectors unmasked."""
    n_chunks = tl.max(tl.max((n_t + VEC - 1) // VEC, 1), 0)
    end = n_t[:, :, None]
    part = end + v  # the rest of each thread's last vector, then whole vectors
    tl.store(copies + part, tl.zeros(part.shape, dtype=tl.int16), mask=part < (end + VEC - 1) // VEC * VEC)
    for j in range(0, n_chunks):
        tl.store(copies + j * VEC + v, tl.zeros(part.shape, dtype=tl.int16), mask=j * VEC >= (end + VEC - 1) // VEC * VEC)
    tl.debug_barrier()
    words = copies.to(tl.pointer_type(tl.int32)) + tl.arange(0, VEC // 2)[None, None, :]
    rng = hi - lo
    top = lo * 0  # the bit length of hi - lo
    for i in tl.static_range(32):
        top = tl.where((rng >> i) > 0, i + 1, top)
    thr = lo
    for i in range(0, top):
        trial = thr + (1 << (top - 1 - i))
        thr = tl.where(tl.sum(tl.sum(_seg_count(words, trial, n_chunks, VEC), 1), 0) >= kk, trial, thr)
    gt = _seg_count(words, thr + 1, n_chunks, VEC)
    ge = n_t if thr == 0 else _seg_count(words, thr, n_chunks, VEC)  # (every copy >= 0; the padding too)
    return thr, gt, ge - gt


@triton.jit
def _excl(x, axis: tl.constexpr):
    """Exclusive prefix sums of ``x`` along ``axis``."""
    return tl.cumsum(x, axis) - x


@triton.jit
def _seg_compact_step(key, dst, tok, num_keys, thr, need, gt_run, eq_run):
    """One step of the compaction (``key`` [32, W, VEC], token indices ``tok``): per key, its slot = keys > T before
    it + min(keys == T before it, need), kept when > T or == T with fewer than ``need`` before it; the counts before
    the step per warp in ``gt_run`` / ``eq_run`` ([1, W, 1]); within the step one packed in-thread prefix and one
    scan across the warp's lanes (a step holds 256 keys per warp: 16-bit halves suffice). Returns the new runs."""
    gt = (key > thr).to(tl.int32)
    eq = (key == thr).to(tl.int32)
    x = gt + (eq << 16)
    lane_tot = tl.sum(x, 2)  # [32, W]
    # (scanned as [W, 32]: Triton 3.6 scans in its default layout, which for [W, 32] puts a warp's 32 threads on dim
    # 1, the same threads that hold them here; scanned as [32, W] it would cross warps through shared memory)
    before = _excl(x, 2) + tl.trans(_excl(tl.trans(lane_tot), 1))[:, :, None]
    gt_b = gt_run + (before & 0xFFFF)
    eq_b = eq_run + (before >> 16)
    pos = gt_b + tl.minimum(eq_b, need)
    sel = (gt > 0) | ((eq > 0) & (eq_b < need))
    tl.store(dst + pos, tok, mask=sel & (pos < num_keys))  # never past K, whatever the threshold
    tot = tl.sum(lane_tot, 0)[None, :, None]  # [1, W, 1]
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
    PT: tl.constexpr,  # candidate slots per thread (a multiple of VEC)
    PREFETCH: tl.constexpr,  # the sweeps issue the next step's load before this step's work
    REVERSE: tl.constexpr = False,  # the count sweep from each quarter's last step down (its order does not matter):
    # the compaction then starts on the keys read last, the likeliest still in L2
):
    """One program per row (module docstring). SUMS rows 16-byte aligned (strides passed in vectors), SK a multiple
    of VEC; CAND int16 [rows, W * 32 * PT]; FELL_BACK int8 [rows] (1: the row is left to the radix launch)."""
    row = tl.program_id(0)
    outer = (row // inner).to(tl.int64)
    row_in = (row % inner).to(tl.int64)
    src = SUMS + outer * (stride_so * VEC) + row_in * (stride_si * VEC)
    dst = OUT + outer * stride_oo + row_in * stride_oi
    lo, hi = _bracket_bounds(src, SK, stride_samp, n_samp, hi_rank, lo_rank, 16, NS, False)
    vbase, v = _seg_offsets(W, VEC, steps_per_warp)
    n_vec = SK // VEC
    tid = tl.arange(0, LANES)[:, None, None] + tl.arange(0, W)[None, :, None] * LANES
    copies = CAND + row.to(tl.int64) * (W * LANES * PT) + tid * PT  # [32, W, 1]: each thread's slots

    above_t = tl.zeros([LANES, W], dtype=tl.int32)
    n_t = tl.zeros([LANES, W], dtype=tl.int32)
    last = steps_per_warp - 1
    key = _seg_load(src, vbase + (last * LANES if REVERSE else 0), v, n_vec, VEC)
    for i in range(0, steps_per_warp):
        if PREFETCH:
            nxt = tl.maximum(last - 1 - i, 0) if REVERSE else tl.minimum(i + 1, last)
            key_next = _seg_load(src, vbase + nxt * LANES, v, n_vec, VEC)
        else:
            key = _seg_load(src, vbase + ((last - i) if REVERSE else i) * LANES, v, n_vec, VEC)
        above_t += tl.sum((key > hi).to(tl.int32), 2)
        inside = ((key >= lo) & (key <= hi)).to(tl.int32)
        slot = _excl(inside, 2) + n_t[:, :, None]
        tl.store(copies + slot, key.to(tl.int16), mask=(inside > 0) & (slot < PT))
        n_t += tl.sum(inside, 2)
        if PREFETCH:
            key = key_next
    above = tl.sum(tl.sum(above_t, 1), 0)
    n_cand = tl.sum(tl.sum(n_t, 1), 0)
    fits = tl.max(tl.max(n_t, 1), 0) <= PT
    hit = (above < num_keys) & (above + n_cand >= num_keys) & fits
    tl.store(FELL_BACK + row, (1 - hit.to(tl.int32)).to(tl.int8))
    if hit:
        thr, gt_c, eq_c = _seg_threshold(copies, n_t, num_keys - above, lo, hi, v, VEC)
        gt_t = above_t + gt_c  # per thread: keys > T (above hi, or copies above T), keys == T (all copies)
        gt_w = tl.sum(gt_t, 0)  # [W]
        eq_w = tl.sum(eq_c, 0)
        need = num_keys - tl.sum(gt_w, 0)
        gt_run = _excl(gt_w, 0)[None, :, None]  # keys > T / == T before each warp's quarter
        eq_run = _excl(eq_w, 0)[None, :, None]
        tok_base = vbase * VEC + v
        key = _seg_load(src, vbase, v, n_vec, VEC)
        for i in range(0, steps_per_warp):
            if PREFETCH:
                key_next = _seg_load(src, vbase + tl.minimum(i + 1, steps_per_warp - 1) * LANES, v, n_vec, VEC)
            else:
                key = _seg_load(src, vbase + i * LANES, v, n_vec, VEC)
            gt_run, eq_run = _seg_compact_step(key, dst, tok_base + i * (LANES * VEC), num_keys, thr, need, gt_run,
                                               eq_run)
            if PREFETCH:
                key = key_next
        offs1 = tl.arange(0, W * LANES * VEC)
        for c0 in range(num_keys, width, W * LANES * VEC):
            fill = c0 + offs1
            tl.store(dst + fill, tl.full([W * LANES * VEC], -1, tl.int32), mask=fill < width)


def seg_plan(sk: int, expected: int, warps: int) -> tuple[int, int]:
    """(steps per warp, candidate slots per thread) for rows of ``sk`` keys whose bracket is expected to hold
    ``expected`` keys (``topk.bracket_plan``'s sample ranks x stride): the row cut into ``warps`` quarters of whole
    256-key steps; per thread twice its share + 32, rounded up to a power of two >= 64."""
    steps = -(-sk // (warps * LANES.value * 8))
    per = 2 * -(-expected // (warps * LANES.value)) + 32
    return steps, max(64, triton.next_power_of_2(per))
