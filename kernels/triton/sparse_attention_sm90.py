"""Warp-specialised token-sparse attention forward for Hopper (sm_90) in Gluon (Triton 3.6's explicit-layout dialect).

Same contract and arithmetic as ``sparse_attention.py`` (MC-Sparse, arXiv 2610.06801, sec. 3.1), with the work of
one program split over three partitions of 4 warps each (``gl.warp_specialize``), so the row gathers, the tensor-core
products and the softmax of one program overlap (Triton 3.6 does not warp-specialise a gathered-load loop itself):

- a producer warpgroup (few registers) gathers the group's K and V rows by index: each 128-key tile's ``kv_idx``
  slots are read, and every row (D contiguous elements) is copied with 16-byte ``cp.async`` into a
  ``NUM_STAGES``-deep shared-memory ring; ``cp.async.mbarrier.arrive`` signals a stage's K (then its V) ready, so the
  consumers wait on mbarriers, never on the copies. Slots past the group's valid count copy nothing (zero fill);
- two consumer warpgroups (64 of the program's 128 query rows each, the default partition and one worker) gather
  their Q rows through ``perm`` into shared memory once, then per tile: S = Q K^T (wgmma), release the K stage,
  online softmax in base 2 with the lazy rescale (max moves only by > ``RESCALE_LOG2``; exact), O += P V (wgmma, P
  from registers), release the V stage; only the last tile masks slots past the count. By default the two
  warpgroups run independently; ``pingpong`` makes them take turns issuing their products (FA3's inter-warpgroup
  schedule: one's softmax under the other's products). A stage's rows are written by ``cp.async``, which the PTX
  memory model counts as generic-proxy writes, and wgmma reads shared memory through the async proxy, so each
  consumer runs ``fence.proxy.async`` after observing a stage ready (mbarrier wait) and before its wgmma reads it
  (``cp_async_fence=False`` leaves it out, as flash-attn-4's sm90 forward and CUTLASS's cp.async GMMA mainloops do);

- the epilogue of each consumer: O / l, + the residual (plain / fp8_row / int4_row / int4_group, dequantised in registers,
  fp32), stored through ``perm`` into ``out``'s strides; optional LSE (fp32, natural log).

Work items (one group's 128 query rows) walk the groups of one (b, h) back to back. Default: one item per program.
``persistent``: one program per SM walks items pid, pid + programs, ...; the producer then also gathers each item's
Q rows (cp.async, 2 slots with their own mbarriers; with a 3-deep ring 1 slot, after the item's first tiles) and
runs ahead into the next item's Q and K/V tiles while the consumers run the epilogue (the ring's stage / phase
follow a tile counter kept across items; every partition counts each item's valid slots itself: the producer with
its other first loads in flight, the consumers from the tail loaded an item earlier; the epilogue's perm rows are
loaded before the mainloop).

Shared memory: Q 128 x D (x 2 slots persistent) + NUM_STAGES x (K + V) tiles of 128 x D (D = 128, 2 stages:
160 KiB; persistent 192 KiB). Registers: consumers
take ``CONSUMER_REGS`` each, the producer ``PRODUCER_REGS`` (``setmaxnreg``), under ``maxnreg`` for the whole CTA.

Runs on CUDA sm_90 only (wgmma, ``setmaxnreg``); not under Triton's interpreter (Gluon has no interpreter mode in
3.6). ``kernels/triton/__init__.py`` dispatches to it and falls back to the Triton kernel on any failure.
Agreement with ``kernels.reference.sparse_attention``: as the Triton kernel (P rounded to q's dtype before P V).
"""

from __future__ import annotations

import math

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from . import sparse_tail_merge
from .sparse_attention import group_shape, needs_row64, residual_args

_LOG2E = 1.4426950408889634

# What this kernel runs (checked by ``refusal`` before a launch); everything else goes to the Triton kernel.
CAPABILITIES = ((9, 0),)
DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIMS = (64, 128)
BLOCK_M = 128  # query rows per program (two consumer warpgroups of 64)
BLOCK_N = 128  # keys per tile
RESCALE_LOG2 = gl.constexpr(8.0)  # lazy rescale threshold, log2 units (as sparse_attention.RESCALE_LOG2)
# tail_launch splits the last, partial round only when the walk has at most this many whole rounds: its two extra
# launches cost ~0.3-0.45 ms of host time per call (round s8r2: the op 779 vs 310 us at 1.3B), which a sustained
# timing counts once per sample, while the idle share of the last round shrinks as 1 / rounds (1.3B 480p: 23 rounds,
# ~3 % of the kernel; 14B 720p: 179 rounds, ~0.5 %: there the op with the tail launch measured slower than q_regs)
TAIL_MAX_ROUNDS = 32
_DEFAULT_POLICY = gl.constexpr("")  # the K/V gathers' L2 eviction policy (Triton 3.6 drops one on cp.async anyway)


def config(head_dim: int) -> dict:
    """Launch config at ``head_dim``: pipeline depth, register split (12 warps: 2 consumer + 1 producer groups) and
    the consumers' schedule. Default: the plain schedule (QK^T, softmax, P V per tile), measured on the H200 (final
    round of the previous session, vs flash-attn-4 dense x s): 1.3B 0.690-0.767, 14B 0.761-0.808, faster than
    ``overlap`` (FA3's intra-warpgroup overlap: 0.654-0.704) at every point; ``overlap`` + ``pingpong`` +
    ``persistent`` + ``stage_out``: 1.3B 0.719-0.755, 14B 0.776-0.804. Registers 224 / 56 (consumers / producer):
    the producer issues each item's count, index and query loads together (232 / 40 spilled 32 bytes there)."""
    return dict(num_stages=2, consumer_regs=224, producer_regs=56, maxnreg=168, pipeline=False, persistent=False,
                overlap=False, pingpong=False, stage_out=False, l2_hints=False, row_threads=4, l2_prefetch=False,
                thread_arrive=False, early_q=False, cp_async_fence=True, q_regs=False, idx_ahead=1, next_item=False,
                split_tail=0, tail_launch=0, skip_rescale=False,
                max_tree=False, sum_partial=False, max_vote=False, named_turns=False)


def _l2_policies(l2_hints: bool) -> dict:
    """The kernel's L2 eviction policy for the data read or written once per call (indices, perm, Q rows, residual,
    output): with ``l2_hints`` evict_first (``.L2::cache_hint``), so these streams do not push the gathered K/V rows,
    which every group of their head reads, out of L2 (Wan2.1-14B 720p: 38.7 MB of K + V per head against the H200's
    50 MB L2; Triton 3.6 drops an eviction policy on cp.async, so K/V cannot be marked evict_last); without: the
    default policy everywhere."""
    return dict(STREAM="evict_first" if l2_hints else "")


def refusal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, residual=None) -> str | None:
    """Why this kernel cannot run the call (None when it can): device, capability, dtype, head dim, and Q/K/V rows
    that the 16-byte copies cannot read (unit stride on D, 16-byte aligned rows). Every residual kind runs
    (``residual`` is accepted for the dispatch's uniform call)."""
    if q.device.type != "cuda":
        return f"needs a CUDA device, got {q.device.type}"
    cap = torch.cuda.get_device_capability(q.device)
    if cap not in CAPABILITIES:
        return f"runs on sm_90 only, got sm_{cap[0]}{cap[1]}"
    if q.dtype not in DTYPES:
        return f"runs float16/bfloat16 only, got {q.dtype}"
    if q.shape[-1] not in HEAD_DIMS:
        return f"head dim must be one of {HEAD_DIMS}, got {q.shape[-1]}"
    for name, t in (("q", q), ("k", k), ("v", v)):  # rows copied by 16-byte cp.async (q: the persistent variant)
        if t.stride(-1) != 1 or any(st * t.element_size() % 16 for st in t.stride()[:3]) or t.data_ptr() % 16:
            return f"{name} rows must be 16-byte aligned with unit stride on D (strides {tuple(t.stride())})"
    return None


@gluon.jit
def _tail_probe(idx_base, K_ALLOC, valid, PROBES: gl.constexpr, num_warps: gl.constexpr, STREAM: gl.constexpr):
    """The last PROBES slots of one group's kv_idx row (int32, -1 past K_ALLOC or when not ``valid``): loaded here,
    counted by ``_count_from_tail`` once other loads are in flight (or an item later)."""
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    j = gl.arange(0, PROBES, layout=lay)
    tail0 = gl.maximum(K_ALLOC - PROBES, 0)
    return gl.load(idx_base + tail0 + j, mask=(tail0 + j < K_ALLOC) & valid, other=-1, eviction_policy=STREAM)


@gluon.jit
def _count_from_tail(tail, idx_base, K_ALLOC, PROBES: gl.constexpr, num_warps: gl.constexpr):
    """Slots before the first -1 of one group's kv_idx row (trailing -1) from its last PROBES slots (``_tail_probe``):
    no further load when fewer than PROBES slots are padding, else PROBES evenly spaced probes locate the boundary's
    chunk, which is then counted PROBES slots at a time."""
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    j = gl.arange(0, PROBES, layout=lay)
    tail0 = gl.maximum(K_ALLOC - PROBES, 0)
    ok = tail >= 0
    count = tail0 + gl.sum(ok.to(gl.int32), 0)
    first_ok = gl.sum(gl.where(j == 0, ok, False).to(gl.int32), 0)
    if (first_ok == 0) & (tail0 > 0):
        step = gl.cdiv(K_ALLOC, PROBES)
        pos = j * step
        probe = gl.load(idx_base + pos, mask=pos < K_ALLOC, other=-1)
        n_ok = gl.sum((probe >= 0).to(gl.int32), 0)
        lo = gl.maximum(n_ok - 1, 0) * step
        count = lo
        for off in range(0, step, PROBES):
            p2 = lo + off + j
            v2 = gl.load(idx_base + p2, mask=(p2 < K_ALLOC) & (p2 < lo + step), other=-1)
            count += gl.sum((v2 >= 0).to(gl.int32), 0)
    return count


@gluon.jit
def _work_item(w, H, G_MB, M_BLOCKS: gl.constexpr, n_slots, C, K_ALLOC):
    """Work item w -> (b, h, first query row inside the group, kv_idx row offset, perm offset); items walk the
    groups of one (b, h) back to back (L2 reuse of the head's K/V)."""
    bh = w // G_MB
    pid_m = w % G_MB
    group = pid_m // M_BLOCKS
    row0 = (pid_m % M_BLOCKS) * 128
    idx_off = (bh.to(gl.int64) * (n_slots // C) + group) * K_ALLOC
    perm_off = bh.to(gl.int64) * n_slots + group.to(gl.int64) * C
    return bh // H, bh % H, group, row0, idx_off, perm_off


@gluon.jit
def _sub_item(v, n_full, n_parts, SPLIT: gl.constexpr):
    """SPLIT: virtual work index v -> (work item, part, parts): indices below ``n_full`` are whole items; the items
    past them (the persistent launch's last, partial round) are split into ``n_parts`` key ranges each, so the
    last round keeps more programs busy (``_part_tiles``); without SPLIT (v, 0, 1)."""
    if SPLIT:
        in_tail = v >= n_full
        s = gl.maximum(v - n_full, 0)
        w = gl.where(in_tail, n_full + s // n_parts, v)
        part = gl.where(in_tail, s % n_parts, 0)
        parts = gl.where(in_tail, n_parts, 1)
    else:
        w = v
        part = 0
        parts = 1
    return w, part, parts


@gluon.jit
def _part_tiles(n_tiles, part, parts):
    """Key tiles [t_lo, t_hi) of part ``part`` of ``parts`` of an item with n_tiles tiles (ceil-sized parts; a part
    past the last tile is empty)."""
    per = gl.cdiv(n_tiles, parts)
    t_lo = gl.minimum(part * per, n_tiles)
    return t_lo, gl.minimum(t_lo + per, n_tiles)


@gluon.jit
def _gather_rows(dst, base, rows, ok, stride_s, stride_d, offs_d, EVICT: gl.constexpr):
    """16-byte cp.async copies of the given rows (D contiguous elements each) into ``dst``; rows not ok: zeros.
    EVICT: the copies' L2 eviction policy ("" default, "evict_first", "evict_last")."""
    ptr = base + rows[:, None] * stride_s + offs_d[None, :] * stride_d
    async_copy.async_copy_global_to_shared(dst, ptr, mask=ok[:, None], eviction_policy=EVICT)


@gluon.jit
def _prefetch_rows_l2(base, rows, stride_s, stride_d, HEAD_DIM: gl.constexpr, ROW_THREADS: gl.constexpr):
    """``prefetch.global.L2::evict_last`` of the given rows (D contiguous elements each; ``rows`` in the producer's row
    slice layout, ROW_THREADS threads per row): each thread prefetches the line holding its 1 / ROW_THREADS of each
    of its rows, so the rows are in L2 (and kept there, evict_last: every group of the head reads them) when the
    cp.async copies them. A hint: no effect on results."""
    lay: gl.constexpr = gl.BlockedLayout([1, 1], [32 // ROW_THREADS, ROW_THREADS], [4, 1], [1, 0])
    r = gl.convert_layout(rows, gl.SliceLayout(1, lay))
    col = gl.arange(0, ROW_THREADS, layout=gl.SliceLayout(0, lay)) * (HEAD_DIM // ROW_THREADS)
    ptr = base + r[:, None] * stride_s + col[None, :] * stride_d
    gl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptr],
                              dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _gather_q(dst, q_base, q_idx, S, stride_qs, stride_qd, offs_d, ROW64: gl.constexpr, STREAM: gl.constexpr):
    """cp.async of 64 query rows q_idx (perm entries; -1 or out of range: zeros) into one Q tile."""
    ok = (q_idx >= 0) & (q_idx < S)
    rows = gl.where(ok, q_idx, 0)
    if ROW64:
        rows = rows.to(gl.int64)
    _gather_rows(dst, q_base, rows, ok, stride_qs, stride_qd, offs_d, STREAM)


@gluon.jit
def _load_q_item(q_smem, q_ready, q_empty, i, q_base, q_idx_a, q_idx_b, S, stride_qs, stride_qd, offs_d,
                 Q_SLOTS: gl.constexpr, ROW64: gl.constexpr, STREAM: gl.constexpr):
    """PERSISTENT: item i's 128 query rows (perm entries q_idx_a, q_idx_b: two halves of 64) into its Q slot
    (i % Q_SLOTS) once the consumers have freed it; q_ready arrives when the copies land."""
    qs = i % Q_SLOTS
    mbarrier.wait(q_empty.index(qs), ((i // Q_SLOTS) & 1) ^ 1)
    _gather_q(q_smem.index(qs * 2), q_base, q_idx_a, S, stride_qs, stride_qd, offs_d, ROW64, STREAM)
    _gather_q(q_smem.index(qs * 2 + 1), q_base, q_idx_b, S, stride_qs, stride_qd, offs_d, ROW64, STREAM)
    async_copy.mbarrier_arrive(q_ready.index(qs), increment_count=False)


@gluon.jit
def _item_first_loads(KV_IDX, PERM, w, valid, H, G_MB, M_BLOCKS: gl.constexpr, n_slots, C, K_ALLOC,
                      BLOCK_N: gl.constexpr, IDX_AHEAD: gl.constexpr, STREAM: gl.constexpr):
    """NEXT_ITEM: work item w's first loads in compact layouts (one register per thread each): the count's tail,
    tile 0's (and with IDX_AHEAD >= 2 tile 1's) kv_idx slots, the perm entries of its two halves of 64 query rows;
    all masked off (tail and slots -1, perm -1) when not ``valid``. The producer issues them an item early and
    converts them to its copy layout when the item starts."""
    lin: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    _, _, _, row0, idx_off, perm_off = _work_item(w, H, G_MB, M_BLOCKS, n_slots, C, K_ALLOC)
    idx_base = KV_IDX + idx_off
    tail = _tail_probe(idx_base, K_ALLOC, valid, 128, 4, STREAM)
    offs_n = gl.arange(0, BLOCK_N, layout=lin)
    kv0 = gl.load(idx_base + offs_n, mask=(offs_n < K_ALLOC) & valid, other=-1, eviction_policy=STREAM)
    if IDX_AHEAD >= 2:
        kv1 = gl.load(idx_base + BLOCK_N + offs_n, mask=(BLOCK_N + offs_n < K_ALLOC) & valid, other=-1,
                      eviction_policy=STREAM)
    else:
        kv1 = kv0
    offs_m = gl.arange(0, 64, layout=lin)
    qa = gl.load(PERM + perm_off + row0 + offs_m, mask=(row0 + offs_m < C) & valid, other=-1,
                 eviction_policy=STREAM)
    qb = gl.load(PERM + perm_off + row0 + 64 + offs_m, mask=(row0 + 64 + offs_m < C) & valid, other=-1,
                 eviction_policy=STREAM)
    return tail, kv0, kv1, qa, qb


@gluon.jit
def _stamp(DIAG_PTR, i, w_step, n_work, k: gl.constexpr):
    """DIAG (a timing diagnostic): this SM's clock (``%clock``, 32 bits, as fp32 bits) into slot k of item i of this
    program: ``DIAG_PTR[(program * items + i) * 8 + k]`` (items = ceil(n_work / programs)), stored by one thread."""
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    o = gl.arange(0, 128, layout=lay)
    clk = gl.inline_asm_elementwise("mov.u32 $0, %clock;", "=r,r", [o], dtype=gl.int32, is_pure=False, pack=1)
    slot = (gl.program_id(0) * gl.cdiv(n_work, w_step) + i) * 8 + k
    gl.store(DIAG_PTR + slot + o * 0, clk.to(gl.float32, bitcast=True), mask=o == 0)


@gluon.jit
def _producer(Q, K, V, PERM, KV_IDX, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty,
              w0, n_work, w_step, H, G_MB, n_slots, C, K_ALLOC, S, SK, n_full, n_parts,
              stride_qb, stride_qh, stride_qs, stride_qd, stride_kb, stride_kh, stride_ks, stride_kd,
              stride_vb, stride_vh, stride_vs, stride_vd,
              M_BLOCKS: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
              ROW_THREADS: gl.constexpr, ROW64: gl.constexpr, PERSISTENT: gl.constexpr, Q_SLOTS: gl.constexpr,
              L2_PREFETCH: gl.constexpr, EARLY_Q: gl.constexpr, IDX_AHEAD: gl.constexpr, NEXT_ITEM: gl.constexpr,
              SPLIT: gl.constexpr, NO_COPY: gl.constexpr, STREAM: gl.constexpr, DIAG_PTR=None,
              DIAG: gl.constexpr = False):
    """Producer warpgroup: for each work item, (PERSISTENT: the group's Q rows through perm into the item's Q slot)
    then K then V rows of each key tile into the stage ring; the ring's stage and phase follow a tile counter kept
    across items. PERSISTENT with one Q slot (``Q_SLOTS`` 1: a 3-deep ring leaves room for one): the item's first
    min(tiles, NUM_STAGES) K/V tiles go out before its Q rows, so they do not wait behind the previous item's
    mainloop (which frees the slot). Each tile is ONE copy per operand (no chunks: chunk copies into one buffer get a warpgroup barrier
    between them). ROW_THREADS threads per row, 16 bytes each: 4 (default): each cp.async of a warp covers 8 rows x
    64 contiguous bytes, a thread's 4 rows take 4 row addresses; 8: 4 rows x 128 bytes (one whole 128-byte line per
    row and request), 8 row addresses per thread. Every 32-byte sector is read once; the copies bypass L1. The tile's
    indices are loaded once for K and V, one tile ahead. EARLY_Q (one Q slot): the consumers free the slot at their
    item's last QK^T, so the next item's queries go out right behind its tile 0 (before its tiles 1 ..), landing
    while the consumers still run the last tile's softmax, P V and the epilogue. IDX_AHEAD 2 (3): each tile's indices are
    loaded two (three) tiles ahead (that many index loads in flight: a tile's copies wait for an index load issued
    two (three) tiles earlier, not one: the producer's chain of dependent index loads is one round trip per two
    (three) tiles). NEXT_ITEM (PERSISTENT, IDX_AHEAD 1 or 2): each item's first loads (the count's tail, its first
    tiles' indices, its query rows' perm entries: ``_item_first_loads``) are issued when the previous item starts, so
    at an item boundary the copies go on without a round trip to memory (without: the producer waits for the tail
    and tile 0's indices before its first copy of every item, while the ring drains). SPLIT: ``n_work`` counts
    virtual work indices (``_sub_item``); a part of an item copies its key tiles only (``_part_tiles``; an empty
    part copies none but its queries). NO_COPY (a timing diagnostic, wrong results): the K/V copies are left out
    (the stages are signalled ready at once), so the kernel runs at its consumers' speed."""
    lay: gl.constexpr = gl.BlockedLayout([1, 8], [32 // ROW_THREADS, ROW_THREADS], [4, 1], [1, 0])
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, lay))
    offs_m = gl.arange(0, 64, layout=gl.SliceLayout(1, lay))
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, lay))
    c = 0  # tiles produced so far (all items)
    i = 0  # items so far
    if NEXT_ITEM:  # the first item's first loads (the loop issues each next item's)
        tail_n, kv0_n, kv1_n, qa_n, qb_n = _item_first_loads(KV_IDX, PERM, _sub_item(w0, n_full, n_parts, SPLIT)[0],
                                                             w0 < n_work, H, G_MB, M_BLOCKS, n_slots, C, K_ALLOC,
                                                             BLOCK_N, IDX_AHEAD, STREAM)
    for vw in range(w0, n_work, w_step):
        if DIAG:
            _stamp(DIAG_PTR, i, w_step, n_work, 5)
        w, part, parts = _sub_item(vw, n_full, n_parts, SPLIT)
        b, h, group, row0, idx_off, perm_off = _work_item(w, H, G_MB, M_BLOCKS, n_slots, C, K_ALLOC)
        idx_base = KV_IDX + idx_off
        if NEXT_ITEM:  # loaded an item ago: into the copy layout; then the next item's, in flight under this one
            tail = tail_n
            kv_next = gl.convert_layout(kv0_n, gl.SliceLayout(1, lay))
            if IDX_AHEAD >= 2:
                kv_next2 = gl.convert_layout(kv1_n, gl.SliceLayout(1, lay))
            q_idx_a = gl.convert_layout(qa_n, gl.SliceLayout(1, lay))
            q_idx_b = gl.convert_layout(qb_n, gl.SliceLayout(1, lay))
            tail_n, kv0_n, kv1_n, qa_n, qb_n = _item_first_loads(KV_IDX, PERM,
                                                                 _sub_item(vw + w_step, n_full, n_parts, SPLIT)[0],
                                                                 vw + w_step < n_work, H, G_MB, M_BLOCKS, n_slots, C,
                                                                 K_ALLOC, BLOCK_N, IDX_AHEAD, STREAM)
        else:
            # the item's independent loads first (one round trip for all): the count's tail, tile 0's indices
            # (slots past the count are -1 there: no count needed), the query rows (PERSISTENT)
            tail = _tail_probe(idx_base, K_ALLOC, True, 128, 4, STREAM)
            kv_next = gl.load(idx_base + offs_n, mask=offs_n < K_ALLOC, other=-1, eviction_policy=STREAM)  # tile 0's
            if IDX_AHEAD >= 2:  # and tile 1's
                kv_next2 = gl.load(idx_base + BLOCK_N + offs_n, mask=BLOCK_N + offs_n < K_ALLOC, other=-1,
                                   eviction_policy=STREAM)
            if IDX_AHEAD == 3:  # and tile 2's
                kv_next3 = gl.load(idx_base + 2 * BLOCK_N + offs_n, mask=2 * BLOCK_N + offs_n < K_ALLOC, other=-1,
                                   eviction_policy=STREAM)
            if PERSISTENT:
                rows_a = row0 + offs_m
                rows_b = row0 + 64 + offs_m
                q_idx_a = gl.load(PERM + perm_off + rows_a, mask=rows_a < C, other=-1, eviction_policy=STREAM)
                q_idx_b = gl.load(PERM + perm_off + rows_b, mask=rows_b < C, other=-1, eviction_policy=STREAM)
        n_end = _count_from_tail(tail, idx_base, K_ALLOC, 128, 4)
        if DIAG:
            _stamp(DIAG_PTR, i, w_step, n_work, 6)
        if PERSISTENT:
            q_base = Q + b.to(gl.int64) * stride_qb + h.to(gl.int64) * stride_qh
            if Q_SLOTS == 2:  # this item's queries first
                _load_q_item(q_smem, q_ready, q_empty, i, q_base, q_idx_a, q_idx_b, S, stride_qs, stride_qd, offs_d,
                             Q_SLOTS, ROW64, STREAM)
        n_tiles = gl.cdiv(n_end, BLOCK_N)
        if SPLIT:  # this part's key tiles; a later part loads its own first tiles' indices
            t_lo, t_hi = _part_tiles(n_tiles, part, parts)
            if t_lo > 0:
                first = t_lo * BLOCK_N + offs_n
                kv_next = gl.load(idx_base + first, mask=first < n_end, other=-1, eviction_policy=STREAM)
                if IDX_AHEAD >= 2:
                    kv_next2 = gl.load(idx_base + BLOCK_N + first, mask=BLOCK_N + first < n_end, other=-1,
                                       eviction_policy=STREAM)
        else:
            t_lo = 0
            t_hi = n_tiles
        if EARLY_Q:  # the consumers free the slot at their last QK^T: the queries right behind tile 0
            q_at = t_lo
        else:  # Q_SLOTS 1: the queries go out after this tile
            q_at = t_lo + gl.minimum(t_hi - t_lo, NUM_STAGES) - 1
        k_base = K + b.to(gl.int64) * stride_kb + h.to(gl.int64) * stride_kh
        v_base = V + b.to(gl.int64) * stride_vb + h.to(gl.int64) * stride_vh
        for t in range(t_lo, t_hi):
            s = c % NUM_STAGES
            ph = (c // NUM_STAGES) & 1
            slots = t * BLOCK_N + offs_n
            live = slots < n_end
            kv = gl.where((kv_next >= 0) & (kv_next < SK), kv_next, 0)
            if ROW64:
                kv = kv.to(gl.int64)
            if IDX_AHEAD == 3:  # tile t + 3's indices: three loads in flight
                nxt = slots + 3 * BLOCK_N
                kv_next = kv_next2
                kv_next2 = kv_next3
                kv_next3 = gl.load(idx_base + nxt, mask=nxt < n_end, other=0, eviction_policy=STREAM)
            elif IDX_AHEAD == 2:  # tile t + 2's indices: two loads in flight
                nxt = slots + 2 * BLOCK_N
                kv_next = kv_next2
                kv_next2 = gl.load(idx_base + nxt, mask=nxt < n_end, other=0, eviction_policy=STREAM)
            else:
                nxt = slots + BLOCK_N  # the next tile's indices, in flight while this tile's rows are copied
                kv_next = gl.load(idx_base + nxt, mask=nxt < n_end, other=0, eviction_policy=STREAM)
            if L2_PREFETCH:  # this tile's rows towards L2 while the ring slots are still busy
                _prefetch_rows_l2(k_base, kv, stride_ks, stride_kd, HEAD_DIM, ROW_THREADS)
                _prefetch_rows_l2(v_base, kv, stride_vs, stride_vd, HEAD_DIM, ROW_THREADS)
            mbarrier.wait(k_empty.index(s), ph ^ 1)
            if not NO_COPY:
                _gather_rows(k_smem.index(s), k_base, kv, live, stride_ks, stride_kd, offs_d, _DEFAULT_POLICY)
            async_copy.mbarrier_arrive(k_ready.index(s), increment_count=False)
            mbarrier.wait(v_empty.index(s), ph ^ 1)
            if not NO_COPY:
                _gather_rows(v_smem.index(s), v_base, kv, live, stride_vs, stride_vd, offs_d, _DEFAULT_POLICY)
            async_copy.mbarrier_arrive(v_ready.index(s), increment_count=False)
            if PERSISTENT and Q_SLOTS == 1:
                if t == q_at:
                    _load_q_item(q_smem, q_ready, q_empty, i, q_base, q_idx_a, q_idx_b, S, stride_qs, stride_qd,
                                 offs_d, Q_SLOTS, ROW64, STREAM)
            c += 1
        if SPLIT and PERSISTENT and Q_SLOTS == 1:  # an empty part: its queries all the same (the consumers wait)
            if t_hi == t_lo:
                _load_q_item(q_smem, q_ready, q_empty, i, q_base, q_idx_a, q_idx_b, S, stride_qs, stride_qd, offs_d,
                             Q_SLOTS, ROW64, STREAM)
        if DIAG:
            _stamp(DIAG_PTR, i, w_step, n_work, 7)
        i += 1
    async_copy.commit_group()  # no copy of this warpgroup outlives it
    async_copy.wait_group(0)


@gluon.jit
def _e4m3_to_f32_div256(byte):
    """float8_e4m3fn bit patterns (int32 0..255) -> fp32 value / 256, exactly (as sparse_attention's helper)."""
    bits = ((byte & 0x80) << 8) | ((byte & 0x7F) << 7)
    return bits.to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32)


# NAMED turns: hardware named barriers 8 (consumer warpgroup 0's turn) and 9 (warpgroup 1's), 256 threads each: the
# waiting warpgroup's 128 threads bar.sync, the other's 128 bar.arrive (Triton's partitions use barriers 0-3)
_TURN_SYNC_0 = gl.constexpr("bar.sync 8, 256; mov.u32 $0, $1;")
_TURN_SYNC_1 = gl.constexpr("bar.sync 9, 256; mov.u32 $0, $1;")
_TURN_ARRIVE_0 = gl.constexpr("{ .reg .pred p; setp.ne.s32 p, $1, 0; @p bar.arrive 8, 256; mov.u32 $0, $1; }")
_TURN_ARRIVE_1 = gl.constexpr("{ .reg .pred p; setp.ne.s32 p, $1, 0; @p bar.arrive 9, 256; mov.u32 $0, $1; }")


@gluon.jit
def _named_barrier(ARRIVE: gl.constexpr, HALF: gl.constexpr, flag):
    """Warpgroup HALF's turn barrier (named barrier 8 + HALF, 256 threads): bar.sync, or ARRIVE: bar.arrive when
    ``flag`` (int, warp-uniform) is nonzero; executed once by every thread of the calling warpgroup (a 128-element
    tensor, one element per thread)."""
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    f = gl.arange(0, 128, layout=lay) * 0 + flag
    if ARRIVE:
        if HALF == 0:
            gl.inline_asm_elementwise(_TURN_ARRIVE_0, "=r,r", [f], dtype=gl.int32, is_pure=False, pack=1)
        else:
            gl.inline_asm_elementwise(_TURN_ARRIVE_1, "=r,r", [f], dtype=gl.int32, is_pure=False, pack=1)
    elif HALF == 0:
        gl.inline_asm_elementwise(_TURN_SYNC_0, "=r,r", [f], dtype=gl.int32, is_pure=False, pack=1)
    else:
        gl.inline_asm_elementwise(_TURN_SYNC_1, "=r,r", [f], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _turn_wait(turn_w, j, HALF: gl.constexpr, NAMED: gl.constexpr = False):
    """PINGPONG: wait on ``turn_w`` (this warpgroup's turn barrier, the other warpgroup arrives on it) until this
    consumer warpgroup may issue its j-th block of products (block j of warpgroup 0 follows block j - 1 of warpgroup
    1; block j of warpgroup 1 follows block j of warpgroup 0). NAMED: on this warpgroup's named barrier instead
    (``_named_barrier``: no phases; warpgroup 1 arrives once ahead for warpgroup 0's block 0, ``_consumer``)."""
    if NAMED:
        _named_barrier(False, HALF, 1)
    elif HALF == 0:
        mbarrier.wait(turn_w.index(0), (j & 1) ^ 1)
    else:
        mbarrier.wait(turn_w.index(0), j & 1)


@gluon.jit
def _pass_turn(turn_o, HALF: gl.constexpr, THREAD_ARRIVE: gl.constexpr, NAMED: gl.constexpr = False, keep=1):
    """PINGPONG: the other warpgroup's turn passed on: an arrive on ``turn_o`` (``_release``), or NAMED: on the other
    warpgroup's named barrier, unless ``keep`` is 0 (warpgroup 1's last block of the walk: no block of warpgroup 0
    follows it)."""
    if NAMED:
        _named_barrier(True, 1 - HALF, keep)
    else:
        _release(turn_o.index(0), THREAD_ARRIVE)


@gluon.jit
def _release(bar, THREAD_ARRIVE: gl.constexpr):
    """One consumer warpgroup's arrive on ``bar``: by one elected thread after a warpgroup barrier (``mbarrier.arrive``,
    barrier count 1 per warpgroup), or THREAD_ARRIVE: by every thread on its own, no warpgroup barrier
    (``cp.async.mbarrier.arrive.noinc``: the consumer threads have no cp.async in flight, so it arrives at once;
    barrier count 128 per warpgroup). Each thread arrives after its own ``warpgroup_mma_wait``, so the stage's reads
    are complete either way."""
    if THREAD_ARRIVE:
        async_copy.mbarrier_arrive(bar, increment_count=False)
    else:
        mbarrier.arrive(bar, count=1)


@gluon.jit
def _scores(q_tile, k_smem, k_ready, k_empty, s_zero, c, turn_w, turn_o, j, NUM_STAGES: gl.constexpr, HALF: gl.constexpr,
            PINGPONG: gl.constexpr, THREAD_ARRIVE: gl.constexpr = False, FENCE: gl.constexpr = True,
            NAMED: gl.constexpr = False):
    """S = Q K^T of the ring's tile c (fp32, the wgmma accumulator layout of s_zero), then its K stage released.
    PINGPONG: issued as this warpgroup's product block j (``_turn_wait`` on ``turn_w``), the other warpgroup's turn
    passed on (an arrive on ``turn_o``).
    FENCE: a proxy fence between the stage's ready wait and the wgmma (without: ``_mainloop``'s ``FENCE``). NAMED: the
    turns on named barriers (``_turn_wait``, ``_pass_turn``)."""
    s = c % NUM_STAGES
    k_tile = k_smem.index(s)
    mbarrier.wait(k_ready.index(s), (c // NUM_STAGES) & 1)
    if FENCE:
        fence_async_shared()  # the rows came by cp.async (generic proxy); wgmma reads through the async proxy
    if PINGPONG:
        _turn_wait(turn_w, j, HALF, NAMED)
    qk_t = warpgroup_mma(q_tile, k_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    if PINGPONG:
        _pass_turn(turn_o, HALF, THREAD_ARRIVE, NAMED)
    qk, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(qk_t, q_tile, k_tile))
    _release(k_empty.index(s), THREAD_ARRIVE)
    return qk


@gluon.jit
def _values(p16, acc, v_smem, v_ready, v_empty, c, turn_w, turn_o, j, NUM_STAGES: gl.constexpr, HALF: gl.constexpr,
            PINGPONG: gl.constexpr, THREAD_ARRIVE: gl.constexpr = False, FENCE: gl.constexpr = True,
            NAMED: gl.constexpr = False, keep=1):
    """O += P V of the ring's tile c (P from registers), then its V stage released; PINGPONG, FENCE, NAMED as
    ``_scores``; ``keep``: ``_pass_turn``'s."""
    s = c % NUM_STAGES
    v_tile = v_smem.index(s)
    mbarrier.wait(v_ready.index(s), (c // NUM_STAGES) & 1)
    if FENCE:
        fence_async_shared()
    if PINGPONG:
        _turn_wait(turn_w, j, HALF, NAMED)
    acc_t = warpgroup_mma(p16, v_tile, acc, is_async=True)
    if PINGPONG:
        _pass_turn(turn_o, HALF, THREAD_ARRIVE, NAMED, keep)
    acc, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(acc_t, v_tile, p16))
    _release(v_empty.index(s), THREAD_ARRIVE)
    return acc


@gluon.jit
def _values_then_scores(p16, acc, q_tile, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, s_zero, c, turn_w, turn_o, j,
                        NUM_STAGES: gl.constexpr, HALF: gl.constexpr, PINGPONG: gl.constexpr,
                        THREAD_ARRIVE: gl.constexpr = False, FENCE: gl.constexpr = True, NAMED: gl.constexpr = False):
    """One product block: O += P V of tile c and S = Q K^T of tile c + 1 issued back to back (one proxy fence for
    both stages, one wait for both products), then both stages released. Returns (O, S of tile c + 1)."""
    sv = c % NUM_STAGES
    sk = (c + 1) % NUM_STAGES
    v_tile = v_smem.index(sv)
    k_tile = k_smem.index(sk)
    mbarrier.wait(v_ready.index(sv), (c // NUM_STAGES) & 1)
    mbarrier.wait(k_ready.index(sk), ((c + 1) // NUM_STAGES) & 1)
    if FENCE:
        fence_async_shared()
    if PINGPONG:
        _turn_wait(turn_w, j, HALF, NAMED)
    acc_t = warpgroup_mma(p16, v_tile, acc, is_async=True)
    qk_t = warpgroup_mma(q_tile, k_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    if PINGPONG:
        _pass_turn(turn_o, HALF, THREAD_ARRIVE, NAMED)
    acc, qk, _, _, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(acc_t, qk_t, p16, v_tile, q_tile, k_tile))
    _release(v_empty.index(sv), THREAD_ARRIVE)
    _release(k_empty.index(sk), THREAD_ARRIVE)
    return acc, qk


_VOTE_ANY_BELOW_1 = gl.constexpr("{ .reg .pred p, q; setp.lt.f32 p, $2, 0f3F800000; setp.lt.f32 q, $3, 0f3F800000; "
                     "or.pred p, p, q; vote.sync.any.pred p, p, 0xffffffff; selp.s32 $0, 1, 0, p; mov.b32 $1, $0; }")
# O x alpha over one thread's 64 accumulator elements behind a warp-uniform branch on the vote above ($192: the
# vote, broadcast; $0..$63 the accumulator, tied to the inputs $64..$127; $128..$191 alpha, broadcast)
_MUL_IF_VOTED = gl.constexpr("{ .reg .pred p; setp.ne.s32 p, $192, 0; @!p bra.uni RESCALE_DONE; "
                 + " ".join(f"mul.f32 ${i}, ${i}, ${128 + i};" for i in range(64)) + " RESCALE_DONE: }")
_MUL_IF_VOTED_CONSTRAINTS = gl.constexpr(",".join(["=f"] * 64 + [str(i) for i in range(64)] + ["f"] * 64 + ["r"] * 64))


# MAX_VOTE: a row's new running max from its 4 threads' partial maxima ($2, $3: this thread's, scaled, rows r and
# r + 8; $4, $5 the running maxima): when no thread of the warp has a partial above its running max + RESCALE_LOG2
# (vote), the running maxima stay (no row's max can move: the lazy rule); else each row's max over its 4 threads (the
# lanes of a quad: 2 butterfly shuffles) replaces the running max where it exceeds it by more than RESCALE_LOG2
_MAX_IF_VOTED = gl.constexpr(
    "{ .reg .pred p, q, e; .reg .f32 ta, tb, a, b, x; "
    "add.f32 ta, $4, 0f41000000; add.f32 tb, $5, 0f41000000; "
    "setp.gt.f32 p, $2, ta; setp.gt.f32 q, $3, tb; or.pred e, p, q; vote.sync.any.pred e, e, 0xffffffff; "
    "mov.f32 $0, $4; mov.f32 $1, $5; @!e bra.uni MAX_DONE; "
    "shfl.sync.bfly.b32 x, $2, 1, 0x1f, 0xffffffff; max.f32 a, $2, x; "
    "shfl.sync.bfly.b32 x, a, 2, 0x1f, 0xffffffff; max.f32 a, a, x; "
    "shfl.sync.bfly.b32 x, $3, 1, 0x1f, 0xffffffff; max.f32 b, $3, x; "
    "shfl.sync.bfly.b32 x, b, 2, 0x1f, 0xffffffff; max.f32 b, b, x; "
    "setp.gt.f32 p, a, ta; selp.f32 $0, a, $4, p; setp.gt.f32 q, b, tb; selp.f32 $1, b, $5, q; MAX_DONE: }")


@gluon.jit
def _thread_max(x):
    """``[M, 128]`` (the wgmma accumulator layout) -> ``[M, 4]``: each thread's own partial row maxima (register-only,
    as ``_thread_sums``)."""
    M: gl.constexpr = x.shape[0]
    for _ in gl.static_range(4):
        a, b = gl.reshape(x, [M, 2, x.shape[1] // 2]).permute(0, 2, 1).split()
        x = gl.maximum(a, b)
    a, b = gl.reshape(x, [M, 4, 2]).split()
    return gl.maximum(a, b)


@gluon.jit
def _per_thread_to_tile(y, like):
    """``[M, 4]`` per-thread row values (``_thread_sums``' layout: column t is lane t of a row's quad) -> ``[M, 128]``
    in ``like``'s layout, each element its row's value: the inverse of ``_thread_sums``' folds (register-only)."""
    M: gl.constexpr = y.shape[0]
    z = gl.reshape(gl.join(y, y), [M, 8])
    for _ in gl.static_range(4):
        z = gl.reshape(gl.join(z, z).permute(0, 2, 1), [M, 2 * z.shape[1]])
    return gl.convert_layout(z, like.type.layout)


@gluon.jit
def _rescale(acc, alpha, SKIP: gl.constexpr, PER_THREAD: gl.constexpr = False):
    """O x alpha per row (the lazy online softmax's rescale: alpha < 1 where a row's running max moved, else exactly
    1). SKIP (a ``[64, D]`` accumulator at D = 128, 64 elements per thread): each warp votes whether any of its rows
    has alpha < 1 and branches over its 64 multiplies per thread when none has (warp-uniform, no warpgroup
    barrier): with the lazy threshold the max rarely moves after a group's first tiles, and the multiplies sit
    between the turn wait and the next P V on every consumer's critical path. PER_THREAD (with SKIP): alpha is
    ``[M, 4]`` in ``_thread_sums``' layout (MAX_VOTE)."""
    if SKIP:
        need = gl.inline_asm_elementwise(_VOTE_ANY_BELOW_1, "=r,=r,f,f", [alpha], dtype=gl.int32, is_pure=False,
                                         pack=2)
        if PER_THREAD:
            alpha_b = _per_thread_to_tile(alpha, acc)
            need_b = _per_thread_to_tile(need, acc)
        else:
            alpha_b, _ = gl.broadcast(alpha[:, None], acc)
            need_b, _ = gl.broadcast(need[:, None], acc)
        acc = gl.inline_asm_elementwise(_MUL_IF_VOTED, _MUL_IF_VOTED_CONSTRAINTS, [acc, alpha_b, need_b],
                                        dtype=gl.float32, is_pure=False, pack=64)
    else:
        acc = acc * alpha[:, None]
    return acc


@gluon.jit
def _mainloop(q_tile, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, turn_w, turn_o, q_free, n_end, t0, n_tiles,
              c0, j0,
              sm_scale_log2, dtype: gl.constexpr, M: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
              NUM_STAGES: gl.constexpr, HALF: gl.constexpr, PIPELINE: gl.constexpr, PINGPONG: gl.constexpr,
              THREAD_ARRIVE: gl.constexpr, EARLY_Q: gl.constexpr = False, FENCE: gl.constexpr = True,
              SKIP_RESCALE: gl.constexpr = False, MAX_TREE: gl.constexpr = False,
              SUM_PARTIAL: gl.constexpr = False, MAX_VOTE: gl.constexpr = False, NAMED: gl.constexpr = False,
              keep_last=1):
    """One group's key tiles t0 .. t0 + n_tiles - 1 (>= 1 tile; ring tiles c0 ..): per tile S = Q K^T, the online
    softmax in base 2 with the lazy rescale, O += P V accumulated in fp32. Only the last tile masks the slots past
    the count (the loop body runs unmasked: no select per score). PIPELINE: tile t's P V and tile t + 1's QK^T
    issued as one block (one fence, one wait). PINGPONG (implies PIPELINE's blocks; FA3's inter-warpgroup schedule): the two consumer warpgroups take
    turns issuing their blocks (mbarriers ``turn_w`` / ``turn_o``), so one's softmax runs under the other's products;
    ``j0`` counts this warpgroup's earlier blocks (all items: n_tiles + 1 per item). EARLY_Q: this warpgroup's arrive
    on ``q_free`` (the item's Q slot) once its last QK^T has completed, before the last tile's softmax and P V. Returns (O
    unnormalised, running max (log2 units), row sum). FENCE=False: no proxy fence between a stage's ready wait
    and its wgmma (flash-attn-4's sm90 forward and CUTLASS's cp.async GMMA mainloops issue the wgmma right after the
    cp.async pipeline's wait; ptxas makes each fence a MEMBAR.ALL.CTA + FENCE.VIEW.ASYNC.S). SKIP_RESCALE: the
    accumulator's rescale only when a row's max moved (``_rescale``). MAX_TREE: ``_row_max``'s tree. SUM_PARTIAL: the row sums
    kept as per-thread partials over the tiles, finished once at the end (``_softmax_tile``). MAX_VOTE (with
    SUM_PARTIAL, SKIP_RESCALE): the running max per thread too, its shuffles only when a warp's vote says a row's max
    may move (``_softmax_tile``); finished once at the end. NAMED (PINGPONG): the turns on named barriers
    (``_turn_wait``); ``keep_last`` 0 drops the last block's arrive (``_pass_turn``)."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    m_i = gl.full([M], float("-inf"), gl.float32, layout=row_s)
    acc = gl.zeros([M, HEAD_DIM], gl.float32, layout=o_layout)
    s_zero = gl.zeros([M, BLOCK_N], gl.float32, layout=s_layout)
    if SUM_PARTIAL:  # [M, 4] zeros in _thread_sums' layout
        l_i = _thread_sums(s_zero)
        if MAX_VOTE:
            m_i = gl.full(l_i.shape, float("-inf"), gl.float32, layout=l_i.type.layout)
    else:
        l_i = gl.zeros([M], gl.float32, layout=row_s)
    qk = _scores(q_tile, k_smem, k_ready, k_empty, s_zero, c0, turn_w, turn_o, j0, NUM_STAGES, HALF, PINGPONG,
                 THREAD_ARRIVE, FENCE, NAMED)
    for t in range(n_tiles - 1):  # every tile but the last: all slots valid
        c = c0 + t
        p16, m_i, l_i, alpha = _softmax_tile(qk, t, n_end, m_i, l_i, sm_scale_log2, offs_n, dtype, BLOCK_N, p_layout,
                                             row_o, False, MAX_TREE, SUM_PARTIAL, MAX_VOTE)
        acc = _rescale(acc, alpha, SKIP_RESCALE, MAX_VOTE)
        if PIPELINE or PINGPONG:
            acc, qk = _values_then_scores(p16, acc, q_tile, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, s_zero,
                                          c, turn_w, turn_o, j0 + 1 + t, NUM_STAGES, HALF, PINGPONG, THREAD_ARRIVE, FENCE,
                                          NAMED)
        else:
            acc = _values(p16, acc, v_smem, v_ready, v_empty, c, turn_w, turn_o, 0, NUM_STAGES, HALF, False, THREAD_ARRIVE,
                          FENCE)
            qk = _scores(q_tile, k_smem, k_ready, k_empty, s_zero, c + 1, turn_w, turn_o, 0, NUM_STAGES, HALF, False,
                         THREAD_ARRIVE, FENCE)
    if EARLY_Q:  # every QK^T of this warpgroup has completed (each waited for): the Q tile is free
        mbarrier.arrive(q_free, count=1)
    t = n_tiles - 1  # the last tile: its slots past the count weigh nothing
    p16, m_i, l_i, alpha = _softmax_tile(qk, t0 + t, n_end, m_i, l_i, sm_scale_log2, offs_n, dtype, BLOCK_N, p_layout,
                                         row_o, True, MAX_TREE, SUM_PARTIAL, MAX_VOTE)
    acc = _rescale(acc, alpha, SKIP_RESCALE, MAX_VOTE)
    acc = _values(p16, acc, v_smem, v_ready, v_empty, c0 + t, turn_w, turn_o, j0 + n_tiles, NUM_STAGES, HALF, PINGPONG,
                  THREAD_ARRIVE, FENCE, NAMED, keep_last)
    if SUM_PARTIAL:
        l_i = gl.convert_layout(gl.sum(l_i, 1), row_s)
        if MAX_VOTE:  # a row's 4 copies are equal
            m_i = gl.convert_layout(gl.max(m_i, 1), row_s)
    return acc, m_i, l_i


@gluon.jit
def _halves_max(x):
    """``[M, N]`` -> ``[M, N // 2]``: the elementwise max of the left and right column halves."""
    M: gl.constexpr = x.shape[0]
    N: gl.constexpr = x.shape[1]
    a, b = gl.reshape(x, [M, 2, N // 2]).permute(0, 2, 1).split()
    return gl.maximum(a, b)


@gluon.jit
def _thread_sums(x):
    """``[M, 128]`` (the wgmma accumulator layout) -> ``[M, 4]``: each thread's own partial row sums, by the column
    halves' sums (register-only, as ``_row_max``'s tree) and the last column pair; ``gl.sum(., 1)`` finishes a row
    (the shuffles across the row's 4 threads)."""
    M: gl.constexpr = x.shape[0]
    for _ in gl.static_range(4):
        a, b = gl.reshape(x, [M, 2, x.shape[1] // 2]).permute(0, 2, 1).split()
        x = a + b
    a, b = gl.reshape(x, [M, 4, 2]).split()
    return a + b


@gluon.jit
def _row_max(x, TREE: gl.constexpr):
    """Row maxima of the scores ``[M, 128]`` (the wgmma accumulator layout; the result in its row slice). TREE: as a
    tree, the column halves' maxima four times (columns 64, 32, 16, 8 apart are a thread's own registers in that
    layout: no data movement), then the last 8 columns by ``gl.max``: a dependent chain of ~5 instead of 32 maxima per
    thread and row before the shuffles, at the head of every tile's softmax."""
    if TREE:
        m = gl.max(_halves_max(_halves_max(_halves_max(_halves_max(x)))), 1)
        return gl.convert_layout(m, gl.SliceLayout(1, x.type.layout))
    else:
        return gl.max(x, 1)


@gluon.jit
def _softmax_tile(qk, t, n_end, m_i, l_i, sm_scale_log2, offs_n, dtype: gl.constexpr, BLOCK_N: gl.constexpr,
                  p_layout: gl.constexpr, row_o: gl.constexpr, MASK: gl.constexpr = True, MAX_TREE: gl.constexpr = False,
                  SUM_PARTIAL: gl.constexpr = False, MAX_VOTE: gl.constexpr = False):
    """Key tile t's scores -> (P in q's dtype as the P V wgmma's register operand, new running max, new row sum,
    the accumulator's rescale factor per row); base 2, lazy rescale; MASK (the last tile): slots past n_end weigh
    nothing. MAX_TREE: the row maxima as a tree (``_row_max``). SUM_PARTIAL: ``l_i`` / the new row sum are each
    thread's partial sums ``[M, 4]`` (``_thread_sums``; the caller finishes them once per item), so no shuffle per
    tile for the sums. MAX_VOTE (with SUM_PARTIAL): ``m_i`` / the new running max and the returned rescale factor are
    ``[M, 4]`` in that layout too (each thread's copy of its rows' values): each thread's partial maxima, one warp vote,
    and the shuffles across a row's 4 threads only when some row's max may move (``_MAX_IF_VOTED``: same values as
    the row maxima's shuffles every tile)."""
    if MASK:
        qk = gl.where((t * BLOCK_N + offs_n < n_end)[None, :], qk, float("-inf"))
    if MAX_VOTE:
        pm = _thread_max(qk) * sm_scale_log2
        m_new = gl.inline_asm_elementwise(_MAX_IF_VOTED, "=f,=f,f,f,f,f", [pm, m_i], dtype=gl.float32, is_pure=False,
                                          pack=2)
        p = gl.exp2(qk * sm_scale_log2 - _per_thread_to_tile(m_new, qk))
        alpha = gl.exp2(m_i - m_new)
        l_new = l_i * alpha + _thread_sums(p)
    else:
        m_tile = _row_max(qk, MAX_TREE) * sm_scale_log2
        m_new = gl.where(m_tile > m_i + RESCALE_LOG2, m_tile, m_i)
        p = gl.exp2(qk * sm_scale_log2 - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        if SUM_PARTIAL:
            ps = _thread_sums(p)
            l_new = l_i * gl.convert_layout(alpha, gl.SliceLayout(1, ps.type.layout))[:, None] + ps
        else:
            l_new = l_i * alpha + gl.sum(p, 1)
        alpha = gl.convert_layout(alpha, row_o)
    return gl.convert_layout(p.to(dtype), p_layout), m_new, l_new, alpha


@gluon.jit
def _mainloop_overlap(q_tile, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, turn_w, turn_o, q_free, n_end, c0, j0,
                      sm_scale_log2, dtype: gl.constexpr, M: gl.constexpr, HEAD_DIM: gl.constexpr,
                      BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, HALF: gl.constexpr, PINGPONG: gl.constexpr,
                      THREAD_ARRIVE: gl.constexpr = False, EARLY_Q: gl.constexpr = False,
                      FENCE: gl.constexpr = True):
    """``_mainloop`` with FA3's intra-warpgroup overlap: tile t's QK^T and tile t-1's P V are issued back to back,
    tile t's softmax runs while the P V product is still on the tensor cores (one wait for the QK^T only), and the
    accumulator is rescaled after that product completes. Same arithmetic as ``_mainloop``.

    PINGPONG (FA3's inter-warpgroup schedule): the two consumer warpgroups take turns issuing their products (mbarriers
    ``turn_w``, ``turn_o``, one arrive each), so one's softmax runs while the other's products use the tensor cores;
    ``j0`` counts this warpgroup's earlier loop iterations (all items) for the turn barriers' phases.
    THREAD_ARRIVE, EARLY_Q, FENCE as ``_mainloop``'s."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    m_i = gl.full([M], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([M], gl.float32, layout=row_s)
    acc = gl.zeros([M, HEAD_DIM], gl.float32, layout=o_layout)
    s_zero = gl.zeros([M, BLOCK_N], gl.float32, layout=s_layout)
    n_tiles = gl.cdiv(n_end, BLOCK_N)
    qk = _scores(q_tile, k_smem, k_ready, k_empty, s_zero, c0, turn_w, turn_o, 0, NUM_STAGES, HALF, False, THREAD_ARRIVE,
                 FENCE)
    p16, m_i, l_i, alpha = _softmax_tile(qk, 0, n_end, m_i, l_i, sm_scale_log2, offs_n, dtype, BLOCK_N, p_layout,
                                         row_o)  # acc is 0: no rescale
    for t in range(1, n_tiles):
        c = c0 + t
        sk = c % NUM_STAGES
        k_tile = k_smem.index(sk)
        mbarrier.wait(k_ready.index(sk), (c // NUM_STAGES) & 1)
        sv = (c - 1) % NUM_STAGES
        v_tile = v_smem.index(sv)
        mbarrier.wait(v_ready.index(sv), ((c - 1) // NUM_STAGES) & 1)
        if FENCE:
            fence_async_shared()
        if PINGPONG:  # my turn: the other warpgroup has issued its products of its previous iteration
            j = j0 + t - 1
            mbarrier.wait(turn_w.index(0), ((j & 1) ^ 1) if HALF == 0 else (j & 1))
        qk_t = warpgroup_mma(q_tile, k_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        acc_t = warpgroup_mma(p16, v_tile, acc, is_async=True)
        if PINGPONG:
            _release(turn_o.index(0), THREAD_ARRIVE)
        qk, _, _ = warpgroup_mma_wait(num_outstanding=1, deps=(qk_t, q_tile, k_tile))  # QK^T done, P V in flight
        _release(k_empty.index(sk), THREAD_ARRIVE)
        p16_next, m_i, l_i, alpha = _softmax_tile(qk, t, n_end, m_i, l_i, sm_scale_log2, offs_n, dtype, BLOCK_N,
                                                  p_layout, row_o)
        acc, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(acc_t, v_tile, p16))
        _release(v_empty.index(sv), THREAD_ARRIVE)
        acc = acc * alpha[:, None]
        p16 = p16_next
    if EARLY_Q:  # every QK^T of this warpgroup has completed: the Q tile is free
        mbarrier.arrive(q_free, count=1)
    c = c0 + n_tiles - 1  # the last tile's P V
    sv = c % NUM_STAGES
    v_tile = v_smem.index(sv)
    mbarrier.wait(v_ready.index(sv), (c // NUM_STAGES) & 1)
    if FENCE:
        fence_async_shared()
    acc_t = warpgroup_mma(p16, v_tile, acc, is_async=True)
    acc, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(acc_t, v_tile, p16))
    _release(v_empty.index(sv), THREAD_ARRIVE)
    return acc, m_i, l_i


@gluon.jit
def _epilogue(acc, m_i, l_i, q_idx, q_idx2, PERM, OUT, LSE, RES, RES_SCALE, RES_COEF, RES_MEAN, perm_off, rowh, C, S, b, h,
              group,
              lse_base, stride_ob, stride_oh, stride_os, stride_od, stride_rb, stride_rh, stride_rs, stride_rd,
              stride_cb, stride_ch, stride_cs, stride_eb, stride_eh, stride_es, stride_mb, stride_mh, stride_mg,
              stride_md, stage, M: gl.constexpr, HEAD_DIM: gl.constexpr, RETURN_LSE: gl.constexpr,
              RES_KIND: gl.constexpr, ROW64: gl.constexpr, STAGE_OUT: gl.constexpr, STREAM: gl.constexpr,
              NO_STORE: gl.constexpr = False):
    """O / l (+ the residual, dequantised in fp32) stored to the rows q_idx = perm[rowh ..] (loaded by the caller
    before its mainloop, in the accumulator's row layout; STAGE_OUT: q_idx2, the same rows in the staged layout's
    row slice, also loaded before the mainloop) of ``out`` by strides; the LSE.
    Residual kinds as ``sparse_attention._store_half``: 1 plain, 2 fp8_row, 3 int4_row, 4 int4_group (+ coef x the
    group's mean row). STAGE_OUT: the rounded rows go through ``stage`` (this warpgroup's Q tile, free once its
    products are done) into a row-major layout, so each warp store writes whole 256-byte rows (the wgmma layout
    writes 4 bytes per thread). NO_STORE (a timing diagnostic, WRONG results): the O and LSE stores left out."""
    b64 = b.to(gl.int64)
    h64 = h.to(gl.int64)
    o_layout: gl.constexpr = acc.type.layout
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    l_o = gl.convert_layout(l_i, row_o)
    out = acc / l_o[:, None]
    ok = (q_idx >= 0) & (q_idx < S)
    rows = gl.where(ok, q_idx, 0)
    if ROW64:
        rows = rows.to(gl.int64)
    if RETURN_LSE:
        lse = (gl.convert_layout(m_i, row_o) + gl.log2(l_o)) * 0.6931471805599453
        if not NO_STORE:
            gl.store(LSE + lse_base + rows, lse, mask=ok)
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    if RES_KIND != 0:
        r_base = b64 * stride_rb + h64 * stride_rh
        if RES_KIND >= 3:  # int4_row / int4_group: byte j holds element 2j (low nibble) and 2j + 1 (high nibble)
            byte = gl.load(RES + r_base + rows[:, None] * stride_rs + (offs_d // 2)[None, :] * stride_rd,
                           mask=ok[:, None], other=0x88, eviction_policy=STREAM).to(gl.int32)
            r = (((byte >> ((offs_d % 2) * 4)[None, :]) & 0xF) - 8).to(gl.float32)
        elif RES_KIND == 2:  # fp8_row, read as uint8 bit patterns
            byte = gl.load(RES + r_base + rows[:, None] * stride_rs + offs_d[None, :] * stride_rd,
                           mask=ok[:, None], other=0, eviction_policy=STREAM).to(gl.int32)
            r = _e4m3_to_f32_div256(byte)
        else:
            r = gl.load(RES + r_base + rows[:, None] * stride_rs + offs_d[None, :] * stride_rd,
                        mask=ok[:, None], other=0.0, eviction_policy=STREAM).to(gl.float32)
        if RES_KIND >= 2:
            row_scale = gl.load(RES_SCALE + b64 * stride_cb + h64 * stride_ch + rows * stride_cs, mask=ok,
                                other=0.0).to(gl.float32)  # bf16 for int4_group
            if RES_KIND == 2:
                row_scale = row_scale * 256.0
            r = r * row_scale[:, None]
        if RES_KIND == 4:  # int4_group: + coef (e4m3 bits) x the group's mean row (bf16)
            coef = gl.load(RES_COEF + b64 * stride_eb + h64 * stride_eh + rows * stride_es, mask=ok,
                           other=0).to(gl.int32)
            coef = _e4m3_to_f32_div256(coef) * 256.0
            mean = gl.load(RES_MEAN + b64 * stride_mb + h64 * stride_mh + group.to(gl.int64) * stride_mg
                           + offs_d * stride_md).to(gl.float32)
            r = r + coef[:, None] * mean[None, :]
        out = out + r
    if STAGE_OUT:
        st_lay: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (HEAD_DIM // 8), HEAD_DIM // 8], [4, 1], [1, 0])
        stage.store(out.to(OUT.dtype.element_ty))
        o2 = stage.load(st_lay)
        ok2 = (q_idx2 >= 0) & (q_idx2 < S)
        rows2 = gl.where(ok2, q_idx2, 0)
        if ROW64:
            rows2 = rows2.to(gl.int64)
        offs_d2 = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, st_lay))
        o_ptr = OUT + b64 * stride_ob + h64 * stride_oh + rows2[:, None] * stride_os + offs_d2[None, :] * stride_od
        gl.store(o_ptr, o2, mask=ok2[:, None], eviction_policy=STREAM)
    else:
        o_ptr = OUT + b64 * stride_ob + h64 * stride_oh + rows[:, None] * stride_os + offs_d[None, :] * stride_od
        if not NO_STORE:
            gl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=ok[:, None], eviction_policy=STREAM)


@gluon.jit
def _store_partial(acc, m_i, l_i, WS_O, WS_ML, sub, HALF: gl.constexpr, M: gl.constexpr, HEAD_DIM: gl.constexpr):
    """SPLIT: one part's rows HALF*64 .. +64 into the workspace slot ``sub``: O unnormalised (fp32 ``[.., 128, D]``)
    and (running max in log2 units, row sum) (fp32 ``[.., 128, 2]``)."""
    o_layout: gl.constexpr = acc.type.layout
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    rows = sub.to(gl.int64) * 128 + HALF * M + gl.arange(0, M, layout=row_o)
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    gl.store(WS_O + rows[:, None] * HEAD_DIM + offs_d[None, :], acc)
    gl.store(WS_ML + rows * 2, gl.convert_layout(m_i, row_o))
    gl.store(WS_ML + rows * 2 + 1, gl.convert_layout(l_i, row_o))


@gluon.jit
def _consumer(Q, PERM, KV_IDX, OUT, LSE, RES, RES_SCALE, RES_COEF, RES_MEAN, WS_O, WS_ML, q_smem, k_smem, v_smem,
              q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turn_w, turn_o, w0, n_work, w_step, H, G_MB,
              n_slots, C, K_ALLOC, S, n_full, n_parts, sm_scale_log2,
              stride_qb, stride_qh, stride_qs, stride_qd, stride_ob, stride_oh, stride_os, stride_od,
              stride_rb, stride_rh, stride_rs, stride_rd, stride_cb, stride_ch, stride_cs,
              stride_eb, stride_eh, stride_es, stride_mb, stride_mh, stride_mg, stride_md,
              HALF: gl.constexpr, M_BLOCKS: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
              NUM_STAGES: gl.constexpr, RETURN_LSE: gl.constexpr, RES_KIND: gl.constexpr, ROW64: gl.constexpr,
              PIPELINE: gl.constexpr, PERSISTENT: gl.constexpr, OVERLAP: gl.constexpr, PINGPONG: gl.constexpr,
              STAGE_OUT: gl.constexpr, Q_SLOTS: gl.constexpr, THREAD_ARRIVE: gl.constexpr, EARLY_Q: gl.constexpr,
              CP_ASYNC_FENCE: gl.constexpr, Q_REGS: gl.constexpr, SPLIT: gl.constexpr, STREAM: gl.constexpr,
              SKIP_RESCALE: gl.constexpr = False, MAX_TREE: gl.constexpr = False,
              SUM_PARTIAL: gl.constexpr = False, DIAG: gl.constexpr = False, MAX_VOTE: gl.constexpr = False,
              NAMED: gl.constexpr = False, NO_STORE: gl.constexpr = False):
    """One consumer warpgroup: rows HALF*64 .. +64 of each work item's 128 query rows (group order). Per item, the
    loads whose values are needed later go out first: the count's tail (PERSISTENT: the next item's, counted an item
    later) and the epilogue's perm rows, both in flight under the mainloop. SPLIT: ``n_work`` counts virtual work
    indices (``_sub_item``); a part of an item runs its key tiles only (an empty part none) and stores its
    unnormalised O, running max and row sum to the workspace (``_store_partial``) for ``sparse_tail_merge``. NAMED
    (PINGPONG, not SPLIT / OVERLAP): the turns on named barriers (``_turn_wait``): warpgroup 1 arrives once before its
    walk (warpgroup 0's first block) and drops the arrive of its walk's last block, so every arrive meets a wait."""
    M: gl.constexpr = 64
    q_lay: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (HEAD_DIM // 8), HEAD_DIM // 8], [4, 1], [1, 0])
    st_lay: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (HEAD_DIM // 8), HEAD_DIM // 8], [4, 1], [1, 0])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    q_dot: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    c = 0  # ring tiles consumed so far (all items)
    i = 0
    jb = 0  # SPLIT: product blocks issued so far (pingpong turns), n_tiles + 1 per non-empty part
    if NAMED and HALF == 1:  # warpgroup 0's first turn
        _named_barrier(True, 0, (w0 < n_work).to(gl.int32))
    if PERSISTENT:  # the first item's count tail (the loop loads each next item's)
        w_first = _sub_item(w0, n_full, n_parts, SPLIT)[0]
        tail = _tail_probe(KV_IDX + _work_item(w_first, H, G_MB, M_BLOCKS, n_slots, C, K_ALLOC)[4], K_ALLOC,
                           w0 < n_work, 128, 4, STREAM)
    for vw in range(w0, n_work, w_step):
        if DIAG and HALF == 0:
            _stamp(WS_ML, i, w_step, n_work, 0)
        w, part, parts = _sub_item(vw, n_full, n_parts, SPLIT)
        b, h, group, row0, idx_off, perm_off = _work_item(w, H, G_MB, M_BLOCKS, n_slots, C, K_ALLOC)
        rowh = row0 + HALF * M
        if not PERSISTENT:
            tail = _tail_probe(KV_IDX + idx_off, K_ALLOC, True, 128, 4, STREAM)
        offs_mo = rowh + gl.arange(0, M, layout=row_o)
        epi_idx = gl.load(PERM + perm_off + offs_mo, mask=offs_mo < C, other=-1,
                          eviction_policy=STREAM)  # used by the epilogue
        if STAGE_OUT:  # the staged epilogue's rows too, in its store layout's row slice
            offs_m2 = rowh + gl.arange(0, M, layout=gl.SliceLayout(1, st_lay))
            epi_idx2 = gl.load(PERM + perm_off + offs_m2, mask=offs_m2 < C, other=-1, eviction_policy=STREAM)
        else:
            epi_idx2 = epi_idx
        if PERSISTENT:  # the queries came from the producer; the count from the tail loaded an item ago
            n_end = _count_from_tail(tail, KV_IDX + idx_off, K_ALLOC, 128, 4)
            w_next = _sub_item(vw + w_step, n_full, n_parts, SPLIT)[0]
            tail = _tail_probe(KV_IDX + _work_item(w_next, H, G_MB, M_BLOCKS, n_slots, C, K_ALLOC)[4], K_ALLOC,
                               vw + w_step < n_work, 128, 4, STREAM)
            qs = i % Q_SLOTS
            q_tile = q_smem.index(qs * 2 + HALF)
            mbarrier.wait(q_ready.index(qs), (i // Q_SLOTS) & 1)
            if CP_ASYNC_FENCE:  # the queries came by cp.async too
                fence_async_shared()
            if Q_REGS:  # this half's queries into registers (the QK^T's A operand): the slot is free at once
                q_tile = q_tile.load(q_dot)
                mbarrier.arrive(q_empty.index(qs), count=1)
            if DIAG and HALF == 0:
                _stamp(WS_ML, i, w_step, n_work, 1)
        else:  # one item per program: this half's Q rows through perm, into its own tile
            offs_m = rowh + gl.arange(0, M, layout=gl.SliceLayout(1, q_lay))
            q_idx = gl.load(PERM + perm_off + offs_m, mask=offs_m < C, other=-1, eviction_policy=STREAM)
            n_end = _count_from_tail(tail, KV_IDX + idx_off, K_ALLOC, 128, 4)
            q_ok = (q_idx >= 0) & (q_idx < S)
            q_rows = gl.where(q_ok, q_idx, 0)
            if ROW64:
                q_rows = q_rows.to(gl.int64)
            offs_dq = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, q_lay))
            q_base = Q + b.to(gl.int64) * stride_qb + h.to(gl.int64) * stride_qh
            q = gl.load(q_base + q_rows[:, None] * stride_qs + offs_dq[None, :] * stride_qd, mask=q_ok[:, None],
                        other=0.0, eviction_policy=STREAM)
            q_tile = q_smem.index(HALF)
            q_tile.store(q)
            fence_async_shared()
        if OVERLAP:
            acc, m_i, l_i = _mainloop_overlap(q_tile, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, turn_w,
                                              turn_o, q_empty.index(i % Q_SLOTS), n_end, c, c - i, sm_scale_log2,
                                              Q.dtype.element_ty, M, HEAD_DIM, BLOCK_N, NUM_STAGES, HALF, PINGPONG,
                                              THREAD_ARRIVE, EARLY_Q if not Q_REGS else False, CP_ASYNC_FENCE)
        elif SPLIT:  # this part's key tiles (none: an empty part, O = 0 and l = 0 for the merge)
            t_lo, t_hi = _part_tiles(gl.cdiv(n_end, BLOCK_N), part, parts)
            if t_hi > t_lo:
                acc, m_i, l_i = _mainloop(q_tile, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, turn_w, turn_o,
                                          q_empty.index(i % Q_SLOTS), n_end, t_lo, t_hi - t_lo, c, jb, sm_scale_log2,
                                          Q.dtype.element_ty, M, HEAD_DIM, BLOCK_N, NUM_STAGES, HALF, PIPELINE,
                                          PINGPONG, THREAD_ARRIVE, EARLY_Q if not Q_REGS else False, CP_ASYNC_FENCE)
                jb += t_hi - t_lo + 1
            else:
                acc = gl.zeros([M, HEAD_DIM], gl.float32, layout=o_layout)
                m_i = gl.full([M], float("-inf"), gl.float32, layout=row_s)
                l_i = gl.zeros([M], gl.float32, layout=row_s)
                if EARLY_Q and not Q_REGS:  # the mainloop would have freed the Q slot
                    mbarrier.arrive(q_empty.index(i % Q_SLOTS), count=1)
        else:
            if HALF == 0:
                keep_last = 1
            else:  # warpgroup 1's last block of the walk passes no turn (NAMED)
                keep_last = (vw + w_step < n_work).to(gl.int32)
            acc, m_i, l_i = _mainloop(q_tile, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, turn_w, turn_o,
                                      q_empty.index(i % Q_SLOTS), n_end, 0, gl.cdiv(n_end, BLOCK_N), c, c + i,
                                      sm_scale_log2, Q.dtype.element_ty, M, HEAD_DIM, BLOCK_N, NUM_STAGES, HALF,
                                      PIPELINE, PINGPONG, THREAD_ARRIVE, EARLY_Q if not Q_REGS else False,
                                      CP_ASYNC_FENCE, SKIP_RESCALE, MAX_TREE, SUM_PARTIAL, MAX_VOTE, NAMED, keep_last)
        if DIAG:
            _stamp(WS_ML, i, w_step, n_work, 2 + 2 * HALF)
        if SPLIT:
            c += t_hi - t_lo
        else:
            c += gl.cdiv(n_end, BLOCK_N)
        if PERSISTENT and not STAGE_OUT and not EARLY_Q:  # every QK^T of the item is done: its Q slot is free
            mbarrier.arrive(q_empty.index(i % Q_SLOTS), count=1)
        if SPLIT and parts > 1:  # a part of a split item: merged by sparse_tail_merge after the launch
            _store_partial(acc, m_i, l_i, WS_O, WS_ML, vw - n_full, HALF, M, HEAD_DIM)
        else:
            _epilogue(acc, m_i, l_i, epi_idx, epi_idx2, PERM, OUT, LSE, RES, RES_SCALE, RES_COEF, RES_MEAN, perm_off,
                      rowh, C, S, b, h, group, (b * H + h).to(gl.int64) * S, stride_ob, stride_oh, stride_os, stride_od,
                      stride_rb, stride_rh, stride_rs, stride_rd, stride_cb, stride_ch, stride_cs, stride_eb,
                      stride_eh, stride_es, stride_mb, stride_mh, stride_mg, stride_md, q_tile, M, HEAD_DIM,
                      RETURN_LSE, RES_KIND, ROW64, STAGE_OUT, STREAM, NO_STORE)
        if PERSISTENT and STAGE_OUT:  # the Q tile staged the output rows: free it now
            mbarrier.arrive(q_empty.index(i % Q_SLOTS), count=1)
        if DIAG and HALF == 0:
            _stamp(WS_ML, i, w_step, n_work, 3)
        i += 1


@gluon.jit
def _sparse_fwd_sm90(
    Q, K, V, PERM, KV_IDX, OUT, LSE, RES, RES_SCALE, RES_COEF, RES_MEAN, WS_O, WS_ML,
    sm_scale_log2, H, S, SK, n_slots, K_ALLOC, C, n_work, n_full, n_parts, w_first,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_ob, stride_oh, stride_os, stride_od,
    stride_rb, stride_rh, stride_rs, stride_rd,
    stride_cb, stride_ch, stride_cs,
    stride_eb, stride_eh, stride_es,
    stride_mb, stride_mh, stride_mg, stride_md,
    M_BLOCKS: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
    RETURN_LSE: gl.constexpr, RES_KIND: gl.constexpr, ROW64: gl.constexpr, ROW_THREADS: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, PIPELINE: gl.constexpr, PERSISTENT: gl.constexpr,
    OVERLAP: gl.constexpr, PINGPONG: gl.constexpr, STAGE_OUT: gl.constexpr, Q_SLOTS: gl.constexpr,
    L2_PREFETCH: gl.constexpr, THREAD_ARRIVE: gl.constexpr, EARLY_Q: gl.constexpr, CP_ASYNC_FENCE: gl.constexpr,
    Q_REGS: gl.constexpr, IDX_AHEAD: gl.constexpr, NEXT_ITEM: gl.constexpr, SPLIT: gl.constexpr,
    NO_COPY: gl.constexpr, STREAM: gl.constexpr, SKIP_RESCALE: gl.constexpr,
    MAX_TREE: gl.constexpr, SUM_PARTIAL: gl.constexpr, DIAG: gl.constexpr,
    MAX_VOTE: gl.constexpr, NAMED_TURNS: gl.constexpr, NO_STORE: gl.constexpr,
    num_warps: gl.constexpr,
):
    G_MB = (n_slots // C) * M_BLOCKS  # work items per (b, h)
    if PERSISTENT:  # one program per SM walks items pid, pid + programs, ... (a tail launch: from w_first)
        w0 = w_first + gl.program_id(0)
        w_step = gl.num_programs(0)
        w_end = n_work
    else:  # one item per program
        w0 = gl.program_id(1) * G_MB + gl.program_id(0)
        w_step = 1
        w_end = w0 + 1
    # (each partition counts its items' valid slots itself, its other first loads in flight meanwhile)

    dtype: gl.constexpr = Q.dtype.element_ty
    tile_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, HEAD_DIM], dtype)
    Q_TILES: gl.constexpr = 2 * Q_SLOTS if PERSISTENT else 2  # (Q_SLOTS slots x) 2 halves of 64 rows
    q_smem = gl.allocate_shared_memory(dtype, [Q_TILES, 64, HEAD_DIM], q_layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], tile_layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], tile_layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(j), count=128)  # one cp.async arrive per producer thread
        mbarrier.init(v_ready.index(j), count=128)
        mbarrier.init(k_empty.index(j), count=256 if THREAD_ARRIVE else 2)  # per consumer thread / warpgroup
        mbarrier.init(v_empty.index(j), count=256 if THREAD_ARRIVE else 2)
    # PINGPONG: the barrier each consumer warpgroup waits on before issuing its products (the other arrives on it),
    # one allocation each: a wait and an arrive on one allocation made Triton put a warpgroup bar.sync between them
    turn_0 = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    turn_1 = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(turn_0.index(0), count=128 if THREAD_ARRIVE else 1)
    mbarrier.init(turn_1.index(0), count=128 if THREAD_ARRIVE else 1)
    for j in gl.static_range(2):
        mbarrier.init(q_ready.index(j), count=128)
        mbarrier.init(q_empty.index(j), count=2)

    # worker arguments are spelled out (a tuple built with + loses its constexpr wrappers in Triton 3.6)
    gl.warp_specialize([
        (_consumer, (Q, PERM, KV_IDX, OUT, LSE, RES, RES_SCALE, RES_COEF, RES_MEAN, WS_O, WS_ML, q_smem, k_smem, v_smem,
                     q_ready,
                     q_empty, k_ready, v_ready, k_empty, v_empty, turn_0, turn_1, w0, w_end, w_step, H, G_MB, n_slots, C,
                     K_ALLOC, S, n_full, n_parts, sm_scale_log2, stride_qb, stride_qh, stride_qs, stride_qd, stride_ob,
                     stride_oh, stride_os,
                     stride_od, stride_rb, stride_rh, stride_rs, stride_rd, stride_cb, stride_ch, stride_cs,
                     stride_eb, stride_eh, stride_es, stride_mb, stride_mh, stride_mg, stride_md,
                     0, M_BLOCKS, HEAD_DIM, BLOCK_N, NUM_STAGES, RETURN_LSE, RES_KIND, ROW64, PIPELINE, PERSISTENT, OVERLAP,
                     PINGPONG, STAGE_OUT, Q_SLOTS, THREAD_ARRIVE, EARLY_Q, CP_ASYNC_FENCE, Q_REGS, SPLIT, STREAM,
                     SKIP_RESCALE, MAX_TREE, SUM_PARTIAL, DIAG, MAX_VOTE, NAMED_TURNS, NO_STORE)),
        (_consumer, (Q, PERM, KV_IDX, OUT, LSE, RES, RES_SCALE, RES_COEF, RES_MEAN, WS_O, WS_ML, q_smem, k_smem, v_smem,
                     q_ready,
                     q_empty, k_ready, v_ready, k_empty, v_empty, turn_1, turn_0, w0, w_end, w_step, H, G_MB, n_slots, C,
                     K_ALLOC, S, n_full, n_parts, sm_scale_log2, stride_qb, stride_qh, stride_qs, stride_qd, stride_ob,
                     stride_oh, stride_os,
                     stride_od, stride_rb, stride_rh, stride_rs, stride_rd, stride_cb, stride_ch, stride_cs,
                     stride_eb, stride_eh, stride_es, stride_mb, stride_mh, stride_mg, stride_md,
                     1, M_BLOCKS, HEAD_DIM, BLOCK_N, NUM_STAGES, RETURN_LSE, RES_KIND, ROW64, PIPELINE, PERSISTENT, OVERLAP,
                     PINGPONG, STAGE_OUT, Q_SLOTS, THREAD_ARRIVE, EARLY_Q, CP_ASYNC_FENCE, Q_REGS, SPLIT, STREAM,
                     SKIP_RESCALE, MAX_TREE, SUM_PARTIAL, DIAG, MAX_VOTE, NAMED_TURNS, NO_STORE)),
        (_producer, (Q, K, V, PERM, KV_IDX, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty,
                     v_empty, w0, w_end, w_step, H, G_MB, n_slots, C, K_ALLOC, S, SK, n_full, n_parts,
                     stride_qb, stride_qh, stride_qs, stride_qd, stride_kb, stride_kh, stride_ks, stride_kd,
                     stride_vb, stride_vh, stride_vs, stride_vd,
                     M_BLOCKS, HEAD_DIM, BLOCK_N, NUM_STAGES, ROW_THREADS, ROW64, PERSISTENT, Q_SLOTS, L2_PREFETCH,
                     EARLY_Q, IDX_AHEAD, NEXT_ITEM, SPLIT, NO_COPY, STREAM, WS_ML, DIAG)),
    ], [4, 4], [CONSUMER_REGS, PRODUCER_REGS])


def launch_args(q, k, v, perm, kv_idx, *, scale=None, return_lse=False, out=None, residual=None, num_stages=None,
                row_threads=None, consumer_regs=None, producer_regs=None, maxnreg=None, row64=None, pipeline=None,
                persistent=None, num_sms=None, overlap=None, pingpong=None, stage_out=None, l2_hints=None,
                q_slots=None, l2_prefetch=None, thread_arrive=None, early_q=None, cp_async_fence=None, q_regs=None,
                idx_ahead=None, next_item=None, split_tail=None, tail_launch=None, skip_rescale=None,
                max_tree=None, sum_partial=None, max_vote=None, named_turns=None, diag_no_copy=False,
                diag_times=None, diag_no_store=False):
    """(grid, positional args, meta) of one launch, and (out, lse, tail): tail None, or with ``split_tail`` and a
    last, partial round of work items the arguments of ``sparse_tail_merge.merge`` (run after the launch: it writes
    the split items' rows); the op and the offline compile share it.

    Raises:
        ValueError: a group width C that does not divide ``perm``'s width, or a head dim / dtype this kernel lacks.
    """
    B, H, S, D = q.shape
    if D not in HEAD_DIMS or q.dtype not in DTYPES:
        raise ValueError(f"the sm_90 Gluon kernel runs D in {HEAD_DIMS}, fp16/bf16; got D = {D}, {q.dtype}")
    G, k_alloc, n_slots, C = group_shape(perm, kv_idx)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    cfg = config(D)
    m_blocks = triton.cdiv(C, BLOCK_M)
    if row64 is None:
        row64 = needs_row64(q, k, v, out, residual)
    perm = perm.contiguous()
    kv_idx = kv_idx.contiguous()
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(B, H, S, dtype=torch.float32, device=q.device) if return_lse else out
    kind, res_ptrs, res_strides = residual_args(residual, out)  # the Triton kernel's residual kinds
    persistent = bool(cfg["persistent"] if persistent is None else persistent)
    n_work = G * m_blocks * B * H
    if persistent:
        if num_sms is None:
            num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count
        grid = (max(1, min(n_work, num_sms)),)
    else:
        grid = (G * m_blocks, B * H)
    num_stages = num_stages or cfg["num_stages"]
    if q_slots is None:  # persistent: two Q slots unless the ring is 3 deep (224 KiB: room for one)
        q_slots = 1 if num_stages >= 3 else 2
    if q_slots not in (1, 2):
        raise ValueError(f"q_slots must be 1 or 2, got {q_slots}")
    overlap = bool(cfg["overlap"] if overlap is None else overlap)
    thread_arrive = bool(cfg["thread_arrive"] if thread_arrive is None else thread_arrive)
    stage_out = bool(cfg["stage_out"] if stage_out is None else stage_out)
    early_q = bool(cfg["early_q"] if early_q is None else early_q)
    cp_async_fence = bool(cfg["cp_async_fence"] if cp_async_fence is None else cp_async_fence)
    q_regs = bool(cfg["q_regs"] if q_regs is None else q_regs)
    if (cfg["idx_ahead"] if idx_ahead is None else idx_ahead) not in (1, 2, 3):
        raise ValueError(f"idx_ahead must be 1, 2 or 3, got {idx_ahead}")
    next_item = bool(cfg["next_item"] if next_item is None else next_item)
    if next_item and (not persistent or int(cfg["idx_ahead"] if idx_ahead is None else idx_ahead) == 3):
        raise ValueError("next_item runs persistent with idx_ahead 1 or 2 (each item's first loads an item early)")
    if q_regs and not early_q:
        raise ValueError("q_regs frees the Q slot at the item's start: it needs early_q (the producer's order)")
    if early_q and (stage_out or not persistent):
        raise ValueError("early_q runs persistent, not with stage_out (its epilogue stages the output rows in the Q "
                         "tile)")
    split_tail = int(cfg["split_tail"] if split_tail is None else split_tail)
    if split_tail and (not persistent or overlap or stage_out
                       or int(cfg["idx_ahead"] if idx_ahead is None else idx_ahead) == 3):
        raise ValueError("split_tail runs persistent, without overlap / stage_out, idx_ahead 1 or 2")
    skip_rescale = bool(cfg["skip_rescale"] if skip_rescale is None else skip_rescale) and D == 128
    sum_partial = bool(cfg["sum_partial"] if sum_partial is None else sum_partial)
    max_vote = bool(cfg["max_vote"] if max_vote is None else max_vote) and D == 128
    if max_vote and not (skip_rescale and sum_partial) or max_vote and overlap:
        raise ValueError("max_vote keeps the running max per thread: it runs with skip_rescale and sum_partial "
                         "(D = 128; ignored at D = 64), not with overlap")
    named_turns = bool(cfg["named_turns"] if named_turns is None else named_turns)
    pingpong = bool(cfg["pingpong"] if pingpong is None else pingpong)
    if named_turns and (not pingpong or overlap or split_tail):
        raise ValueError("named_turns passes the pingpong turns on named barriers: it runs with pingpong, without "
                         "overlap / split_tail (tail_launch: its split launch keeps the mbarrier turns)")
    tail_launch = int(cfg["tail_launch"] if tail_launch is None else tail_launch)
    if tail_launch and (not persistent or overlap or stage_out or split_tail
                        or int(cfg["idx_ahead"] if idx_ahead is None else idx_ahead) == 3):
        raise ValueError("tail_launch runs persistent, without overlap / stage_out / split_tail, idx_ahead 1 or 2")
    n_full, n_parts, n_virtual, tail, ws_o, ws_ml = n_work, 1, n_work, None, out, lse
    if split_tail:  # the last round's items in n_parts key ranges each (at most split_tail), so more programs run it
        rounds, n_tail = divmod(n_work, grid[0])
        n_parts = min(split_tail, grid[0] // n_tail) if n_tail and rounds else 1
        if n_parts > 1:
            n_full = rounds * grid[0]
            n_virtual = n_full + n_tail * n_parts
            ws_o = torch.empty(n_tail * n_parts, BLOCK_M, D, dtype=torch.float32, device=q.device)
            ws_ml = torch.empty(n_tail * n_parts, BLOCK_M, 2, dtype=torch.float32, device=q.device)
            tail = dict(ws_o=ws_o, ws_ml=ws_ml, n_full=n_full, n_tail=n_tail, n_parts=n_parts, perm=perm, out=out,
                        lse=lse if return_lse else None, residual=residual, H=H, S=S, C=C, n_slots=n_slots,
                        m_blocks=m_blocks, row64=bool(row64))
    if diag_times is not None:  # the timing diagnostic's clock stamps go where the split workspace would
        if split_tail or tail_launch or not persistent:
            raise ValueError("diag_times runs persistent without split_tail / tail_launch")
        need = grid[0] * -(-n_work // grid[0]) * 8
        if diag_times.dtype != torch.float32 or diag_times.numel() < need or not diag_times.is_contiguous():
            raise ValueError(f"diag_times must be a contiguous float32 tensor of at least {need} elements")
        ws_ml = diag_times
    tail_parts = 1
    if tail_launch:  # the last round's items in a second launch, split into key ranges (no residual: the merge's)
        rounds, n_tail = divmod(n_work, grid[0])
        tail_parts = min(tail_launch, grid[0] // n_tail) if n_tail and 0 < rounds <= TAIL_MAX_ROUNDS else 1
        if tail_parts > 1:
            n_full = n_virtual = rounds * grid[0]  # this launch: whole rounds only
            ws_o = torch.empty(n_tail * tail_parts, BLOCK_M, D, dtype=torch.float32, device=q.device)
            ws_ml = torch.empty(n_tail * tail_parts, BLOCK_M, 2, dtype=torch.float32, device=q.device)
            tail = dict(ws_o=ws_o, ws_ml=ws_ml, n_full=n_full, n_tail=n_tail, n_parts=tail_parts, perm=perm,
                        out=out, lse=lse if return_lse else None, residual=residual, H=H, S=S, C=C,
                        n_slots=n_slots, m_blocks=m_blocks, row64=bool(row64))

    def _args(out_lse, res_ptrs, res_strides, n_virtual, n_full, n_parts, w_first):
        return (q, k, v, perm, kv_idx, out, out_lse, *res_ptrs, ws_o, ws_ml, scale * _LOG2E, H, S, k.shape[2],
                n_slots, k_alloc, C, n_virtual, n_full, n_parts, w_first, *q.stride(), *k.stride(), *v.stride(),
                *out.stride(), *res_strides)

    args = _args(lse, res_ptrs, res_strides, n_virtual, n_full, n_parts, 0)
    meta = dict(M_BLOCKS=m_blocks, HEAD_DIM=D, BLOCK_N=BLOCK_N, NUM_STAGES=num_stages,
                RETURN_LSE=bool(return_lse), RES_KIND=kind, ROW64=bool(row64),
                ROW_THREADS=row_threads or cfg["row_threads"],
                CONSUMER_REGS=consumer_regs or cfg["consumer_regs"], PRODUCER_REGS=producer_regs or cfg["producer_regs"],
                PIPELINE=bool(cfg["pipeline"] if pipeline is None else pipeline), PERSISTENT=persistent,
                OVERLAP=overlap,
                PINGPONG=pingpong,
                STAGE_OUT=stage_out,
                Q_SLOTS=q_slots if persistent else 1,
                L2_PREFETCH=bool(cfg["l2_prefetch"] if l2_prefetch is None else l2_prefetch),
                THREAD_ARRIVE=thread_arrive,
                EARLY_Q=early_q,
                CP_ASYNC_FENCE=cp_async_fence,
                Q_REGS=q_regs,
                IDX_AHEAD=int(cfg["idx_ahead"] if idx_ahead is None else idx_ahead),
                NEXT_ITEM=next_item,
                SPLIT=bool(split_tail),
                NO_COPY=bool(diag_no_copy),
                NO_STORE=bool(diag_no_store),
                SKIP_RESCALE=skip_rescale,
                MAX_TREE=bool(cfg["max_tree"] if max_tree is None else max_tree),
                SUM_PARTIAL=sum_partial,
                DIAG=diag_times is not None,
                MAX_VOTE=max_vote,
                NAMED_TURNS=named_turns,
                **_l2_policies(cfg["l2_hints"] if l2_hints is None else l2_hints),
                num_warps=4, maxnreg=maxnreg or cfg["maxnreg"])
    if tail_parts > 1:  # the tail launch: one program per part, its partial O / max / sum to the workspace only
        # (no residual, no LSE: the merge adds them), the split walk's registers 216 / 72 (its producer spills at
        # 224 / 56); the next-item walk is the whole-item launch's
        _, none_ptrs, none_strides = residual_args(None, out)
        n_parts_virtual = n_full + tail["n_tail"] * tail_parts
        tail["launch"] = ((tail["n_tail"] * tail_parts,),
                          _args(out, none_ptrs, none_strides, n_parts_virtual, n_full, tail_parts, n_full),
                          dict(meta, RETURN_LSE=False, RES_KIND=0, SPLIT=True, NEXT_ITEM=False, NAMED_TURNS=False,
                               CONSUMER_REGS=216, PRODUCER_REGS=72))
    return grid, args, meta, (out, lse, tail)


def sparse_attention(q, k, v, perm, kv_idx, *, scale=None, return_lse=False, out=None, residual=None, **tuning):
    """Token-sparse attention on the sm_90 Gluon kernel; the contract of ``sparse_attention.sparse_attention``.

    Args:
        q, k, v: ``[B, H, S, D]`` / ``[B, H, Sk, D]`` fp16/bf16 on an sm_90 GPU, any strides (unit stride on D and
            16-byte aligned rows for the 16-byte copies), D in ``HEAD_DIMS``.
        perm: int32 ``[B, H, G*C]`` query groups, -1 padding at the tail (any C; C > 128 runs several programs).
        kv_idx: int32 ``[B, H, G, K_alloc]``, each row sorted with trailing -1, at least one valid slot.
        scale, return_lse, out, residual: as the Triton kernel's.
        tuning: ``num_stages`` (K/V ring depth: 2, or 3 = 225 KiB shared), ``row_threads`` (producer threads per copied row: 4, each warp copy
            8 rows x 64 bytes; 8: 4 rows x 128 bytes, whole 128-byte lines per request; 16: 2 rows x 256 bytes),
            ``consumer_regs``, ``producer_regs``, ``maxnreg`` (the register split), ``row64``, ``pipeline`` (issue the
            next tile's QK^T right behind this tile's P V, one wait for both), ``persistent`` (one program per SM
            walking the work items; the producer gathers the next item's Q (2 slots) and K/V tiles while the consumers
            run the epilogue; ``num_sms``: programs, default the device's SM count; ``q_slots``: 2 Q slots,
            or 1, the default with ``num_stages=3`` (224 KiB): the item's first K/V tiles then go out before its
            queries), ``overlap`` (FA3's schedule: tile t's
            softmax while tile t-1's P V runs; ``_mainloop_overlap``), ``pingpong`` (the two consumer warpgroups take
            turns issuing their products: with the plain schedule, blocks of tile t's P V + tile t + 1's QK^T, FA3's
            inter-warpgroup schedule; with ``overlap``, that schedule's pairs), ``stage_out`` (output rows through
            shared memory into a row-major layout: whole-row stores), ``l2_hints`` (``_l2_policies``), ``l2_prefetch``
            (each K/V tile's rows prefetched to L2 with evict_last before the producer waits for their ring slots),
            ``thread_arrive`` (the consumers release K/V stages and pass pingpong turns with one arrive per thread, no
            warpgroup barrier per arrive: ``_release``), ``early_q`` (persistent, not with ``stage_out``: each item's
            Q slot freed at its last QK^T and the next item's queries
            gathered right behind its first K/V tile; ``_producer``), ``cp_async_fence`` (False: no proxy fence
            between a K/V stage's (persistent: the Q slot's) ready wait and the wgmma reading it, as flash-attn-4's
            sm90 forward and CUTLASS's cp.async GMMA mainloops; ``_mainloop``), ``q_regs`` (with ``early_q``: each
            consumer warpgroup loads its 64 query rows into registers at the item's start (the QK^T's A operand) and
            frees the Q slot at once, so the next item's queries load during this item's whole mainloop),
            ``idx_ahead`` (1, 2 or 3: the producer loads each tile's kv_idx slots that many tiles ahead),
            ``next_item`` (persistent, idx_ahead 1 or 2: the producer issues each item's first loads (count tail,
            first tiles' indices, perm entries) when the previous item starts: ``_producer``), ``split_tail`` (N >= 2,
            persistent: the items of the last, partial round of the programs' walk are split into up to N key
            ranges, one program each, so the last round keeps more SMs busy (Wan2.1-1.3B 480p: 3072 items on 132
            SMs = 23.3 rounds; unsplit, the last round runs 36 items on 132 SMs); each part stores its unnormalised O,
            max and row sum to a workspace and ``sparse_tail_merge.merge`` combines them into the output rows),
            ``tail_launch`` (N >= 2, persistent, at most ``TAIL_MAX_ROUNDS`` whole rounds: as ``split_tail``, but
            this launch walks whole rounds only and
            the last, partial round's items run in a second launch of the kernel, N key ranges each, one program
            per part, without residual or LSE (the merge adds them): the first launch keeps its register split
            and schedule), ``skip_rescale`` (D = 128; ignored at D = 64: each warp skips its accumulator's
            rescale when none of its rows' running max moved, ``_rescale``), ``diag_times`` (a timing diagnostic,
            results unchanged: a float32 tensor of programs x ceil(items / programs) x 8 slots that receives the SM
            clock (``%clock`` bits) at each item's start, queries in registers, mainloop end and epilogue end of
            consumer warpgroup 0 (slots 0-3), mainloop end of warpgroup 1 (4), and the producer's item start, count
            known and last copies issued (5-7); persistent, no split), ``max_tree`` (the scores' row maxima
            as a tree: ``_row_max``), ``sum_partial`` (the row sums as per-thread partials, finished once per
            item: ``_thread_sums``), ``max_vote`` (with skip_rescale and sum_partial, D = 128; ignored at D = 64: the
            running max kept per thread too, the row maxima's shuffles only when a warp's vote says a row's max may
            move: ``_softmax_tile``), ``named_turns`` (pingpong, not overlap / split_tail: the turns on named
            barriers, ``_turn_wait``), ``diag_no_store`` (a timing diagnostic with WRONG results: no O / LSE stores,
            ``_epilogue``), ``diag_no_copy`` (a timing diagnostic with WRONG results: no K/V copies, so the launch
            runs at the consumer warpgroups' speed; the benchmark's "consumers alone" row).
    Returns:
        ``out`` (original query order), or (out, LSE fp32 ``[B, H, S]``, natural log).
    Raises:
        ValueError: see ``launch_args``. Any compile or launch error of Triton propagates (the dispatch falls back).
    """
    grid, args, meta, (out, lse, tail) = launch_args(q, k, v, perm, kv_idx, scale=scale, return_lse=return_lse,
                                                     out=out, residual=residual, **tuning)
    _sparse_fwd_sm90[grid](*args, **meta)
    if tail is not None:  # the split items' parts (tail_launch: run by a second launch) -> their rows (and LSE)
        tail = dict(tail)
        launch = tail.pop("launch", None)
        if launch is not None:
            _sparse_fwd_sm90[launch[0]](*launch[1], **launch[2])
        sparse_tail_merge.merge(**tail)
    return (out, lse) if return_lse else out


def compiled_kernels() -> list:
    """Every compiled variant of the Gluon kernel in this process (triton ``CompiledKernel``, loaded), for the GPU
    benchmark and tests to read ``n_regs`` / ``n_spills`` (triton 3.x internals)."""
    out = []
    for caches in getattr(_sparse_fwd_sm90, "device_caches", {}).values():
        for ck in caches[0].values():
            ck._init_handles()
            out.append(ck)
    return out
