"""Fast PDDP query grouping in Triton: directions from a subsample, one binning pass per tree level that reads Q
through the permutation, and a rank split by per-node histograms instead of a sort (MC-Sparse, arXiv 2610.06801,
sec. 3.2).

Same tree and contract as ``kernels.reference.pddp`` (a node of g groups splits by rank along its principal
direction into ceil(g/2)*C queries and the rest, until every group holds C queries). Per tree level, four launches,
no copy of Q, no covariance in memory, no sort and no host sync:

- ``_direction`` (one program per node and head): gathers ``samples`` rows of the node, evenly spaced over its real
  slots, through ``perm``, in chunks of 64; accumulates their covariance [D, D] in fp32 by ``tl.dot`` of bf16 rows
  shifted by the first chunk's mean, then power iteration on it in registers (start: the axis of largest variance
  plus that column, as ``reference.principal_direction``; the two reductions alternate between the matrix's axes,
  which is the same product for a symmetric matrix, so no layout change is needed). From the sample it also takes
  the mean m and the standard deviation s of the projections on the direction v and stores the node's binning
  map: bin(x) = floor((x . v - (m - 4 s)) * NB / (8 s)), clamped to [0, NB). The split rank lies within 4 s of the
  mean for any distribution (Cantelli), so the split falls in an interior bin. It also zeroes the node's histogram.
- ``_bin`` (one program per BLOCK slots of a node): bin of every real query of the node (one read of its row),
  stored per slot, and counted into the node's histogram (int32 atomics: exact, order-free).
- ``_count`` (one program per TILE slots of a node): the threshold bin t (the bin holding the node's split rank L)
  and k = L - (queries in bins below t), both from the histogram; per tile, the number of queries below t and in t.
- ``_apply`` (same tiles): exclusive prefix of those counts over the node's earlier tiles, then a stable partition:
  queries below t, then the first k queries of bin t in slot order, go left; the rest right; -1 padding slots keep
  their place (the node's real queries are always its first slots). Writes the other half of a double-buffered perm.
- ``_leaf`` (one program per two-group node and head, the last split of every branch): direction from all the node's
  queries, their projections sorted in the program (``tl.sort`` of int64 keys: projection bits, then slot), the C
  smallest left. One launch and one read of the node instead of four launches and two reads.
- ``_subtree`` (option ``SUBTREE`` = N: one program per node of 3..N groups and head, in place of every histogram
  level and leaf below it): the node's query ids in a scratch row; per round, the direction of every sub-node of
  >= 2 groups (in turn), then one ``tl.sort`` of int64 keys (sub-node, projection bits, position) orders all
  sub-nodes at once, each cut at ceil(g/2)*C. Option ``SORTSPLIT`` = N: the same program with one round, one launch
  per level for every node of <= N groups (directions in parallel, no histogram / count / apply).
- ``SQUARE`` (option): directions by repeated squaring of the covariance / Gram matrix (``tl.dot``, trace-normalised)
  instead of power-iteration matrix-vector products.
- ``COMPACT`` (default on): the root's ``_bin`` also writes an int8 copy of q (each query centred on the root's sample
  mean; ``HEAD_SCALE``: one fp32 scale per head, twice the root sample's largest centred entry over 127, larger
  entries clip; else one per query) that every later level reads: 128 B a query instead of 256 B at D = 128.

Difference from the reference: the direction of a node larger than ``samples`` comes from a subsample (a two-group
node's from all its queries, as the reference), and queries whose projections share the threshold bin (width 8 s / NB, 0.016 s at NB = 512) are split by slot order instead of
projection. Grouping quality is measured against the reference by the mean within-group variance
(tests/test_anchor_kernels.py, tests/bench_anchor.py). The tree's node table depends only on (S, C) and lives on the
device; tables are cached for at most ``_PLAN_CACHE`` shapes (least recently used first out).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

_PLAN_CACHE = 8  # (S, C, device) node tables kept at once
SAMPLES = 64  # rows per node for its principal direction (<= _GRAM_MAX: by the samples' Gram matrix)
POWER_ITERS_MAX = 4  # power-iteration steps per node at most (H200, 64 samples: 14B 720p 3.45 ms at variance ratio
# 1.011 with 4 steps; 2 steps 3.38 ms at 1.023)
BINS = 512  # histogram bins per node (the threshold bin spans 8 / BINS standard deviations of the projections)
_BLOCK_BIN = 64  # slots per program of _bin (one gathered row each)
_TILE = 1024  # slots per program of _count / _apply
_PREFIX = 128  # tile counts summed per step of _apply's prefix loop
_DIR_WARPS = None  # warps of _direction / _leaf; None: ``direction_warps``
_GRAM_MAX = 64  # samples up to which directions come from the samples' Gram matrix instead of the covariance
COMPACT = True  # levels below the root read an int8 copy of q written by the root's _bin (per-query scale: H200,
# 64 samples: 14B 720p 3.02 ms against 3.45 ms reading q, variance ratio 1.012)
HEAD_SCALE = True  # the int8 copy has one scale per head (twice the root sample's largest entry / 127; rows of q have
# similar magnitudes: Wan2.1 RMS-normalises q) instead of one per query: no 4-byte scale gather per row and level
GRAPH = True  # run the tree as one CUDA graph where q is small (see _graph_eligible)
_GRAPH_MAX_BYTES = 256 << 20  # q bytes up to which the graph path is taken (1.3B 480p: 100 MB; 14B 720p: 774 MB)
_GRAPH_CACHE = 2  # graphs kept at once (each holds a copy of q and the tree's buffers)
_SUB_SLOTS = 2048  # most slots of a _subtree node (its sort keys hold the position in 11 bits)
LOCAL_HIST = False  # _bin adds its block's histogram (one atomic per distinct bin) instead of one atomic per query
SORTSPLIT = 0  # nodes of 3 to this many groups split once per level by a one-round _subtree program (sort), not
# by the histogram path (0: off; takes precedence over SUBTREE)
SUBTREE = 2  # nodes of up to this many groups split to the end in one program (2: ``_leaf``; 0: none)
SQUARE = False  # directions by repeated squaring of the covariance / Gram matrix (tl.dot) instead of power iteration
LEAF = True  # two-group nodes split by _leaf in one program (False: every node by the histogram path)


@triton.jit
def _gather(base, scb, perm_row, slot, take, stride_qs, stride_qd, D: tl.constexpr, FIRST: tl.constexpr,
            READ8: tl.constexpr):
    """Rows [len(slot), D] fp32 of the queries in ``slot`` of the permutation (the identity when FIRST); READ8: from
    the int8 copy, centred on the head's mean, times the row's scale ``scb[query]`` (READ8 == 1) or the head's one
    scale ``scb[0]`` (READ8 == 2)."""
    if FIRST:
        qi = slot
    else:
        qi = tl.load(perm_row + slot, mask=take, other=0)
    offs_d = tl.arange(0, D)
    x = tl.load(base + qi.to(tl.int64)[:, None] * stride_qs + offs_d[None, :] * stride_qd,
                mask=take[:, None], other=0).to(tl.float32)
    if READ8 == 2:
        x = x * tl.load(scb)
    elif READ8:
        x = x * tl.load(scb + qi, mask=take, other=0.0)[:, None]
    return x


@triton.jit
def _rows(Q, Q8, SC, b, h, bh, S, stride_qb, stride_qh, stride_qs, stride_qd, D: tl.constexpr, READ8: tl.constexpr):
    """(base, scale base, row stride, column stride) of one head's rows: q itself, or (READ8) its int8 copy (scales:
    one per query, READ8 == 2: one per head)."""
    if READ8:
        return Q8 + bh.to(tl.int64) * S * D, SC + bh.to(tl.int64) * (1 if READ8 == 2 else S), D, 1
    else:
        return Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh, SC, stride_qs, stride_qd


@triton.jit
def _sample_cov(base, scb, perm_row, start, count, m, stride_qs, stride_qd,
                D: tl.constexpr, CHUNK: tl.constexpr, FIRST: tl.constexpr, READ8: tl.constexpr):
    """(cov, mean): m times the covariance [D, D] fp32 of ``m`` rows evenly spaced over the node's ``count`` real slots,
    by ``tl.dot`` of bf16 rows shifted by the first chunk's mean (covariance is shift-invariant; the shift keeps the
    bf16 products small), and their mean [D]."""
    offs_c = tl.arange(0, CHUNK)
    take = offs_c < m
    x = _gather(base, scb, perm_row, start + (offs_c.to(tl.int64) * count) // m, take, stride_qs, stride_qd, D,
                FIRST, READ8)
    mu = tl.sum(x, 0) / tl.minimum(m, CHUNK).to(tl.float32)
    cov = tl.zeros([D, D], dtype=tl.float32)
    ssum = tl.zeros([D], dtype=tl.float32)
    for c0 in range(0, m, CHUNK):
        i = c0 + offs_c
        take = i < m
        x = _gather(base, scb, perm_row, start + (i.to(tl.int64) * count) // m, take, stride_qs, stride_qd, D,
                    FIRST, READ8)
        x = tl.where(take[:, None], x - mu[None, :], 0.0)
        ssum += tl.sum(x, 0)
        xb = x.to(tl.bfloat16)
        cov += tl.dot(tl.trans(xb), xb)
    mf = tl.maximum(m, 1).to(tl.float32)
    return cov - ssum[:, None] * ssum[None, :] / mf, mu + ssum / mf


@triton.jit
def _top_direction(cov, PAIRS: tl.constexpr, D: tl.constexpr, SQ: tl.constexpr = 0):
    """(v, lam): unit top eigenvector of the symmetric PSD ``cov`` and |cov v| (its eigenvalue).

    SQ == 0: 2 * PAIRS power-iteration steps from the axis of largest variance plus that column (as
    ``reference.principal_direction``); the two reductions alternate between the matrix's axes (the same product for
    a symmetric matrix): no layout change. SQ > 0: the matrix squared SQ times by ``tl.dot`` (bf16 operands, fp32
    accumulation, divided by its trace before each product: eigenvalues <= 1, no overflow), i.e. cov^(2^SQ) in SQ
    tensor-core products instead of 2^SQ dependent matrix-vector reductions; its column of largest diagonal entry,
    then one product with ``cov`` itself (v and lam from the unrounded matrix)."""
    offs_d = tl.arange(0, D)
    eye = offs_d[:, None] == offs_d[None, :]
    if SQ > 0:
        a = cov
        for _ in tl.static_range(SQ):
            tr = tl.sum(tl.sum(tl.where(eye, a, 0.0), 1), 0)
            ab = (a / tl.maximum(tr, 1e-30)).to(tl.bfloat16)
            a = tl.dot(ab, ab)
        diag = tl.sum(tl.where(eye, a, 0.0), 1)
        best = tl.max(diag, 0)
        axis = tl.min(tl.where(diag == best, offs_d, D), 0)
        u = (offs_d == axis).to(tl.float32) * 1e-6 + tl.sum(tl.where(offs_d[None, :] == axis, a, 0.0), 1)
        u = u / tl.maximum(tl.sqrt(tl.sum(u * u, 0)), 1e-30)
        u = tl.sum(cov * u[:, None], 0)  # cov u
    else:
        diag = tl.sum(tl.where(eye, cov, 0.0), 1)
        best = tl.max(diag, 0)
        axis = tl.min(tl.where(diag == best, offs_d, D), 0)
        u = (offs_d == axis).to(tl.float32) + tl.sum(tl.where(offs_d[None, :] == axis, cov, 0.0), 1)
        for _ in tl.static_range(PAIRS):
            u = u / tl.maximum(tl.sqrt(tl.sum(u * u, 0)), 1e-30)
            w = tl.sum(cov * u[:, None], 0)  # cov u (cov symmetric: reduce over rows)
            w = w / tl.maximum(tl.sqrt(tl.sum(w * w, 0)), 1e-30)
            u = tl.sum(cov * w[None, :], 1)  # cov w
    lam = tl.sqrt(tl.sum(u * u, 0))
    return u / tl.maximum(lam, 1e-30), lam


@triton.jit
def _node_direction(base, scb, perm_row, start, count, m, stride_qs, stride_qd,
                    D: tl.constexpr, SCHUNK: tl.constexpr, PAIRS: tl.constexpr, FIRST: tl.constexpr,
                    GRAM: tl.constexpr, READ8: tl.constexpr, SQ: tl.constexpr = 0):
    """(v, lam, mean): unit principal direction [D] of ``m`` rows evenly spaced over the node's ``count`` real slots,
    m times their variance along it, their mean [D]. GRAM (m <= SCHUNK): power iteration on the rows' Gram matrix
    [SCHUNK, SCHUNK] (same eigenvalues as the covariance; v = X^T u), far fewer registers than the [D, D]
    covariance; else ``_sample_cov`` in chunks of SCHUNK rows."""
    if GRAM:
        offs_c = tl.arange(0, SCHUNK)
        take = offs_c < m
        x = _gather(base, scb, perm_row, start + (offs_c.to(tl.int64) * count) // m, take, stride_qs, stride_qd, D,
                FIRST, READ8)
        mean = tl.sum(x, 0) / m.to(tl.float32)
        xc = tl.where(take[:, None], x - mean[None, :], 0.0)
        xb = xc.to(tl.bfloat16)
        u, lam = _top_direction(tl.dot(xb, tl.trans(xb)), PAIRS, SCHUNK, SQ)
        v = tl.sum(xb.to(tl.float32) * u[:, None], 0)  # from the bf16 rows: the fp32 ones need not stay live
        v = v / tl.maximum(tl.sqrt(tl.sum(v * v, 0)), 1e-30)
    else:
        cov, mean = _sample_cov(base, scb, perm_row, start, count, m, stride_qs, stride_qd, D, SCHUNK, FIRST, READ8)
        v, lam = _top_direction(cov, PAIRS, D, SQ)
    return v, lam, mean


@triton.jit
def _direction(
    Q, Q8, SC, MU, PERM, NODE_START, NODE_COUNT, V, OFF, HIST,
    H, N, S, n_slots, stride_qb, stride_qh, stride_qs, stride_qd,
    PAIRS: tl.constexpr, M: tl.constexpr, D: tl.constexpr, SCHUNK: tl.constexpr, NB: tl.constexpr,
    FIRST: tl.constexpr, GRAM: tl.constexpr, READ8: tl.constexpr, WRITE8: tl.constexpr, SQ: tl.constexpr = 0,
):
    node = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    start = tl.load(NODE_START + node)
    count = tl.load(NODE_COUNT + node)  # real queries in the node (its first slots)
    m = tl.minimum(count, M)  # rows sampled: evenly spaced over the node, all of it when count <= M
    perm_row = PERM + bh.to(tl.int64) * n_slots
    base, scb, sqs, sqd = _rows(Q, Q8, SC, b, h, bh, S, stride_qb, stride_qh, stride_qs, stride_qd, D, READ8)
    v, lam, mean = _node_direction(base, scb, perm_row, start, count, m, sqs, sqd, D, SCHUNK, PAIRS, FIRST, GRAM,
                                   READ8, SQ)
    if WRITE8:  # the root's sample mean: the int8 copy is centred on it
        tl.store(MU + bh.to(tl.int64) * D + tl.arange(0, D), mean)
    if WRITE8 == 2:  # one scale for the head: twice the sample's largest centred entry over 127
        offs_c = tl.arange(0, SCHUNK)
        m2 = tl.minimum(m, SCHUNK)
        take = offs_c < m2
        xs = _gather(base, scb, perm_row, start + (offs_c.to(tl.int64) * count) // m2, take, sqs, sqd, D, FIRST, 0)
        amax = tl.max(tl.max(tl.where(take[:, None], tl.abs(xs - mean[None, :]), 0.0), 1), 0)
        tl.store(SC + bh, 2.0 * amax / 127.0)
    # binning map from the sample: mean and standard deviation of the projections on v (lam = m * variance)
    mean_p = tl.sum(mean * v, 0)
    sd = tl.sqrt(lam / tl.maximum(m, 1).to(tl.float32))
    scale = tl.where(sd > 0, NB / (8.0 * tl.maximum(sd, 1e-30)), 0.0)
    row = bh.to(tl.int64) * N + node
    tl.store(V + row * D + tl.arange(0, D), v * scale)
    tl.store(OFF + row, (mean_p - 4.0 * sd) * scale)
    tl.store(HIST + row * NB + tl.arange(0, NB), tl.zeros([NB], dtype=tl.int32))


@triton.jit
def _leaf(
    Q, Q8, SC, PERM_IN, PERM_OUT, KEYS, NODE_START, NODE_COUNT,
    H, N, S, n_slots, C, stride_qb, stride_qh, stride_qs, stride_qd,
    PAIRS: tl.constexpr, M: tl.constexpr, D: tl.constexpr, SCHUNK: tl.constexpr, CHUNK: tl.constexpr,
    NP: tl.constexpr, FIRST: tl.constexpr, GRAM: tl.constexpr, READ8: tl.constexpr, SQ: tl.constexpr = 0,
):
    """A node of two groups (2C slots, NP >= 2C a power of two) split in one program: direction from min(M, count) of
    its real queries (``_node_direction``), their projections as int64 keys (order-preserving bits of the fp32
    projection, then the slot: ties by slot), one ``tl.sort``, the C smallest left, the rest right, padding last."""
    node = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    start = tl.load(NODE_START + node)
    count = tl.load(NODE_COUNT + node)
    perm_row = PERM_IN + bh.to(tl.int64) * n_slots
    base, scb, sqs, sqd = _rows(Q, Q8, SC, b, h, bh, S, stride_qb, stride_qh, stride_qs, stride_qd, D, READ8)
    v, lam, mean = _node_direction(base, scb, perm_row, start, count, tl.minimum(count, M), sqs, sqd, D, SCHUNK,
                                   PAIRS, FIRST, GRAM, READ8, SQ)
    keys = KEYS + (bh.to(tl.int64) * N + node) * NP
    for c0 in tl.static_range(0, NP, CHUNK):
        i = c0 + tl.arange(0, CHUNK)
        real = i < count
        x = _gather(base, scb, perm_row, start + i, real, sqs, sqd, D, FIRST, READ8)
        p = tl.sum(x * v[None, :], 1)
        bits = tl.where(p == p, p, 0.0).to(tl.int32, bitcast=True)
        key = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)
        key = tl.where(real, key, 0x7FFFFFFF)  # padding after every real query
        tl.store(keys + i, (key << 32) | i.to(tl.int64), mask=i < NP)
    tl.debug_barrier()  # the keys were stored by other threads of this program
    srt = tl.sort(tl.load(keys + tl.arange(0, NP)))
    j = tl.arange(0, NP)
    src = (srt & 0xFFFFFFFF).to(tl.int32)
    real = j < count
    if FIRST:
        val = start + src
    else:
        val = tl.load(perm_row + start + src, mask=real, other=-1)
    tl.store(PERM_OUT + bh.to(tl.int64) * n_slots + start + j, tl.where(real, val, -1), mask=j < 2 * C)


@triton.jit
def _sub_node(g, k, lvl):
    """(first group, groups) of sub-node ``k`` (0-based, left to right) ``lvl`` splits below a node of ``g`` groups
    (each split: ceil(g/2) groups left, the rest right; a sub-node of 1 group has an empty right child). Scalars or
    int32 tensors."""
    lo = g * 0
    gs = g + lo
    for step in range(0, lvl):
        half = (gs + 1) // 2
        right = ((k >> (lvl - 1 - step)) & 1) == 1
        lo = tl.where(right, lo + half, lo)
        gs = tl.where(right, gs - half, half)
    return lo, gs


@triton.jit
def _sub_of(gi, g, lvl):
    """(sub-node index, its groups) at ``lvl`` splits below a node of ``g`` groups, of the nodes' group ``gi``
    (int32 tensor, gi < g)."""
    lo = gi * 0
    gs = lo + g
    k = lo
    for _ in range(0, lvl):
        half = (gs + 1) // 2
        right = gi >= lo + half
        lo = tl.where(right, lo + half, lo)
        gs = tl.where(right, gs - half, half)
        k = k * 2 + right.to(tl.int32)
    return k, gs


@triton.jit
def _subtree(
    Q, Q8, SC, PERM_IN, PERM_OUT, IDS, KEYS, VS, NODE_START, NODE_SIZE, NODE_COUNT,
    H, N, S, n_slots, C, stride_qb, stride_qh, stride_qs, stride_qd,
    PAIRS: tl.constexpr, M: tl.constexpr, D: tl.constexpr, SCHUNK: tl.constexpr, CHUNK: tl.constexpr,
    NP: tl.constexpr, LEVELS: tl.constexpr, FIRST: tl.constexpr, GRAM: tl.constexpr, READ8: tl.constexpr,
    SQ: tl.constexpr = 0,
):
    """A node of g <= 2^LEVELS groups (size g*C <= NP slots, NP a power of two <= 2048) split down to single groups in
    one program: LEVELS rounds; in round l every sub-node of >= 2 groups takes its direction from min(M, count) of
    its real queries (``_node_direction``, sampled evenly over its current order), then one ``tl.sort`` of int64
    keys (sub-node, order-preserving bits of the fp32 projection, position) orders every sub-node by projection at
    once: its first ceil(gs/2)*C positions are its left child (ties by position, padding last, sub-nodes of one
    group keep their order). The node's current query ids live in ``IDS`` (NP int32 per program), the round's
    directions in ``VS`` (2^(LEVELS-1) x D fp32 per program), the keys in ``KEYS`` (NP int64 per program)."""
    node = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    start = tl.load(NODE_START + node)
    size = tl.load(NODE_SIZE + node)
    count = tl.load(NODE_COUNT + node)
    g = size // C
    row = bh.to(tl.int64) * N + node
    ids_row = IDS + row * NP
    keys = KEYS + row * NP
    vs = VS + row * ((1 << (LEVELS - 1)) * D)
    base, scb, sqs, sqd = _rows(Q, Q8, SC, b, h, bh, S, stride_qb, stride_qh, stride_qs, stride_qd, D, READ8)
    offs_d = tl.arange(0, D)
    j = tl.arange(0, NP)
    if FIRST:
        ids = tl.where(j < count, start + j, -1)
    else:
        ids = tl.load(PERM_IN + bh.to(tl.int64) * n_slots + start + j, mask=j < count, other=-1)
    tl.store(ids_row + j, ids)
    tl.debug_barrier()
    for lvl in range(0, LEVELS):
        for k in range(0, 1 << lvl):
            lo, gs = _sub_node(g, k, lvl)
            cnt = tl.minimum(tl.maximum(count - lo * C, 0), gs * C)
            if (gs >= 2) & (cnt > 0):
                v, lam, mean = _node_direction(base, scb, ids_row, lo * C, cnt, tl.minimum(cnt, M), sqs, sqd, D,
                                               SCHUNK, PAIRS, False, GRAM, READ8, SQ)
                tl.store(vs + k * D + offs_d, v)
        tl.debug_barrier()  # the directions were stored by other threads of this program
        for c0 in tl.static_range(0, NP, CHUNK):
            i = c0 + tl.arange(0, CHUNK)
            qi = tl.load(ids_row + i, mask=i < NP, other=-1)
            real = qi >= 0
            inside = i < size
            ksub, gs_i = _sub_of(tl.minimum(i // C, g - 1), g, lvl)
            splits = real & (gs_i >= 2)
            x = _gather(base, scb, ids_row, qi, real, sqs, sqd, D, True, READ8)
            vv = tl.load(vs + ksub[:, None] * D + offs_d[None, :], mask=splits[:, None], other=0.0)
            p = tl.sum(x * vv, 1)
            bits = tl.where(p == p, p, 0.0).to(tl.int32, bitcast=True)
            pk = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64) + tl.full([CHUNK], 2147483648, tl.int64)
            pk = tl.where(splits, pk, tl.zeros([CHUNK], tl.int64))  # order-preserving in [0, 2^32); one group: kept
            pk = tl.where(real, pk, tl.full([CHUNK], 4294967295, tl.int64))  # padding after the sub-node's queries
            sub = tl.where(inside, ksub, 1 << LEVELS).to(tl.int64)  # slots past the node last
            tl.store(keys + i, (sub << 43) | (pk << 11) | i.to(tl.int64), mask=i < NP)
        tl.debug_barrier()
        srt = tl.sort(tl.load(keys + j))
        ids = tl.load(ids_row + (srt & 0x7FF).to(tl.int32))
        tl.debug_barrier()  # every thread read the old order
        tl.store(ids_row + j, ids)
        tl.debug_barrier()
    tl.store(PERM_OUT + bh.to(tl.int64) * n_slots + start + j, ids, mask=j < size)


@triton.jit
def _bin(
    Q, Q8, SC, MU, PERM, NODE_START, NODE_COUNT, V, OFF, HIST, BINS_OUT,
    H, N, S, n_slots, stride_qb, stride_qh, stride_qs, stride_qd,
    BLOCK: tl.constexpr, D: tl.constexpr, NB: tl.constexpr, FIRST: tl.constexpr, READ8: tl.constexpr,
    WRITE8: tl.constexpr, LOCAL: tl.constexpr = False,
):
    tile = tl.program_id(0)
    node = tl.program_id(1)
    bh = tl.program_id(2)
    b = bh // H
    h = bh % H
    start = tl.load(NODE_START + node)
    count = tl.load(NODE_COUNT + node)
    j = tile * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, D)
    real = j < count
    slot = bh.to(tl.int64) * n_slots + start + j
    base, scb, sqs, sqd = _rows(Q, Q8, SC, b, h, bh, S, stride_qb, stride_qh, stride_qs, stride_qd, D, READ8)
    x = _gather(base, scb, PERM + bh.to(tl.int64) * n_slots, start + j, real, sqs, sqd, D, FIRST, READ8)
    if WRITE8:  # the int8 copy of each query, centred on the root's sample mean, one scale per query or per head
        qi = start + j  # the identity at the root
        xc = x - tl.load(MU + bh.to(tl.int64) * D + offs_d)[None, :]
        row8 = bh.to(tl.int64) * S + qi
        if WRITE8 == 2:  # the head's scale (from the root's sample, _direction): entries beyond 127 steps clip
            q8 = tl.floor(xc / tl.maximum(tl.load(SC + bh), 1e-30) + 0.5)
        else:
            sc = tl.max(tl.abs(xc), 1) / 127.0
            q8 = tl.floor(xc / tl.maximum(sc, 1e-30)[:, None] + 0.5)
            tl.store(SC + row8, sc, mask=real)
        q8 = tl.minimum(tl.maximum(q8, -127.0), 127.0).to(tl.int8)
        tl.store(Q8 + row8[:, None] * D + offs_d[None, :], q8, mask=real[:, None])
    row = bh.to(tl.int64) * N + node
    v = tl.load(V + row * D + offs_d)
    p = tl.sum(x * v[None, :], 1) - tl.load(OFF + row)
    p = tl.where(p == p, p, 0.0)  # a NaN query goes to bin 0
    bins = tl.minimum(tl.maximum(p, 0.0), NB - 1.0).to(tl.int32)  # truncation = floor on [0, NB)
    tl.store(BINS_OUT + slot, bins, mask=real)
    if LOCAL:  # the block's own histogram first: one atomic per distinct bin (neighbouring queries share bins)
        h = tl.histogram(bins, NB, mask=real)
        tl.atomic_add(HIST + row * NB + tl.arange(0, NB), h, mask=h > 0)
    else:
        tl.atomic_add(HIST + row * NB + bins, tl.full([BLOCK], 1, tl.int32), mask=real)


@triton.jit
def _threshold(HIST, row, left, NB: tl.constexpr):
    """(t, k): the bin holding rank ``left`` of the node's histogram, and how many of its queries go left."""
    hist = tl.load(HIST + row * NB + tl.arange(0, NB))
    t = tl.sum((tl.cumsum(hist, 0) <= left).to(tl.int32), 0)
    below = tl.sum(tl.where(tl.arange(0, NB) < t, hist, 0), 0)
    return t, left - below


@triton.jit
def _node_split(HIST, NODE_START, NODE_SIZE, NODE_COUNT, bh, N, C, NB: tl.constexpr):
    """This program's node (grid axis 1): (first slot, size in slots, query count, slots going left = the node's first
    half of whole groups, histogram row, threshold bin t, how many of bin t go left)."""
    node = tl.program_id(1)
    start = tl.load(NODE_START + node)
    size = tl.load(NODE_SIZE + node)
    count = tl.load(NODE_COUNT + node)
    left = ((size // C + 1) // 2) * C
    row = bh.to(tl.int64) * N + node
    t, k = _threshold(HIST, row, left, NB)
    return start, size, count, left, row, t, k


@triton.jit
def _count(
    BINS_IN, HIST, NODE_START, NODE_SIZE, NODE_COUNT, CNT,
    N, n_slots, n_tiles, C,
    TILE: tl.constexpr, NB: tl.constexpr,
):
    tile = tl.program_id(0)
    bh = tl.program_id(2)
    start, size, count, left, row, t, k = _node_split(HIST, NODE_START, NODE_SIZE, NODE_COUNT, bh, N, C, NB)
    j = tile * TILE + tl.arange(0, TILE)
    real = j < count
    bins = tl.load(BINS_IN + bh.to(tl.int64) * n_slots + start + j, mask=real, other=NB)
    cnt = CNT + (row * n_tiles + tile) * 2
    tl.store(cnt, tl.sum((bins < t).to(tl.int32), 0))
    tl.store(cnt + 1, tl.sum((bins == t).to(tl.int32), 0))


@triton.jit
def _apply(
    PERM_IN, PERM_OUT, BINS_IN, HIST, NODE_START, NODE_SIZE, NODE_COUNT, CNT,
    S, N, n_slots, n_tiles, C,
    TILE: tl.constexpr, NB: tl.constexpr, PREFIX: tl.constexpr, FIRST: tl.constexpr,
):
    tile = tl.program_id(0)
    bh = tl.program_id(2)
    start, size, count, left, row, t, k = _node_split(HIST, NODE_START, NODE_SIZE, NODE_COUNT, bh, N, C, NB)
    # queries below t (a) and in t (e) in the node's tiles before this one
    acc_a = tl.zeros([PREFIX], dtype=tl.int32)
    acc_e = tl.zeros([PREFIX], dtype=tl.int32)
    cnt = CNT + row * n_tiles * 2
    for i0 in range(0, tile, PREFIX):
        i = i0 + tl.arange(0, PREFIX)
        acc_a += tl.load(cnt + i * 2, mask=i < tile, other=0)
        acc_e += tl.load(cnt + i * 2 + 1, mask=i < tile, other=0)
    a0 = tl.sum(acc_a, 0)
    e0 = tl.sum(acc_e, 0)
    r0 = tl.minimum(tile * TILE, count) - a0 - e0  # queries above t before this tile
    j = tile * TILE + tl.arange(0, TILE)
    inside = j < size
    real = j < count
    slot = bh.to(tl.int64) * n_slots + start + j
    bins = tl.load(BINS_IN + slot, mask=real, other=NB)
    lt = (real & (bins < t)).to(tl.int32)
    eq = (real & (bins == t)).to(tl.int32)
    gt = (real & (bins > t)).to(tl.int32)
    a = a0 + tl.cumsum(lt, 0) - lt  # exclusive counts in slot order
    e = e0 + tl.cumsum(eq, 0) - eq
    r = r0 + tl.cumsum(gt, 0) - gt
    dest = tl.where(lt > 0, a + tl.minimum(e, k),
                    tl.where(eq > 0, tl.where(e < k, a + e, left + r + e - k),
                             tl.where(gt > 0, left + r + tl.maximum(e - k, 0), j)))
    if FIRST:
        val = tl.where(j < S, start + j, -1)
    else:
        val = tl.load(PERM_IN + slot, mask=inside, other=-1)
    tl.store(PERM_OUT + bh.to(tl.int64) * n_slots + start + dest, val, mask=inside)


def direction_warps(major: int, compact: bool, samples: int = 64) -> int:
    """Warps of ``_direction`` / ``_leaf`` / ``_subtree`` on a device of compute capability ``major``.x: 4 on sm_90
    (H200, 14B 720p: 5.39 ms against 7.21 ms with 8 warps at 256 samples, the same grouping; spill-free by
    tests/ptxas_grouping.py), else 8 (4 spill on sm_80, and with the int8 copy and > 64 samples on sm_90)."""
    return 4 if major >= 9 and (not compact or samples <= _GRAM_MAX) else 8


@functools.lru_cache(maxsize=16)
def _major(device: torch.device) -> int:
    return torch.cuda.get_device_capability(device)[0] if device.type == "cuda" else 9


@functools.lru_cache(maxsize=_PLAN_CACHE)
def _plan(S: int, C: int, device: torch.device, gmax: int, finish: bool = True) -> tuple:
    """Per level: (copy, big, small). ``copy``: some node of the level no longer splits or was finished by an earlier
    level (its slots are carried over); ``big``: None or (N, n_max, node start slot, node size in slots, real queries
    per node) of the nodes split by the histogram path, the tables int32 device tensors; ``small``: None or (N, start,
    count, size, n_max, rounds) of the nodes of 2..``gmax`` groups split in one program each (``_leaf`` when gmax
    is 2, else ``_subtree``): ``finish``: to single groups (``rounds`` = ceil(log2(most groups))), else split once
    (rounds 1; their halves go on at the next level); gmax 0: every node by the histogram path."""
    G = -(-S // C)
    nodes = [(0, G, False)]  # (first block, blocks, finished)
    levels = []
    while any(g > 1 and not done for _, g, done in nodes):
        parts = []
        for big in (True, False):
            split = [(b, g) for b, g, done in nodes if g > 1 and not done and (g > gmax) == big]
            if not split:
                parts.append(None)
                continue
            start = [b * C for b, _ in split]
            size = [g * C for _, g in split]
            count = [max(0, min(s + n, S) - s) for s, n in zip(start, size)]
            table = torch.tensor([start, size, count], dtype=torch.int32).to(device)
            parts.append((len(split), max(size), table[0], table[1], table[2]) if big
                         else (len(split), table[0], table[2], table[1], max(size),
                               (max(g for _, g in split) - 1).bit_length() if finish else 1))
        levels.append((any(g == 1 or done for _, g, done in nodes), *parts))
        nodes = [half for b, g, done in nodes for half in (
            ((b, -(-g // 2), False), (b + -(-g // 2), g // 2, False)) if (g > gmax or not finish) and g > 1 and not done
            else ((b, g, g > 1),))]
    return tuple(levels)


def pddp_groups(q: torch.Tensor, group_size: int, *, power_iters: int = 8, samples: int = SAMPLES,
                bins: int = BINS, phase_hook=None) -> torch.Tensor:
    """Query groups of exactly ``group_size`` queries by Fast PDDP; contract of ``kernels.reference.pddp_groups``.

    Args:
        q: ``[B, H, S, D]`` fp16/bf16 (any strides), D a power of two in [16, 256].
        group_size: C >= 1. power_iters: matrix-vector products of the power iteration per node (>= 1; at most
            ``POWER_ITERS_MAX`` are run; rounded up to an even count); with ``SQUARE``: the matrix is raised to the
            power 2^ceil(log2(power_iters)) by that many squarings.
        samples: rows per node its direction is computed from (a power of two >= 16; default ``SAMPLES``; up to
            ``_GRAM_MAX`` by the samples' Gram matrix).
        bins: histogram bins per node for the rank split (a power of two >= 16; default ``BINS``).
        phase_hook: benchmarks only: called with "copy", "direction", "bin", "count", "apply", "leaf" after each
            launch (the tree then runs eagerly, never as the CUDA graph).
    Small q on CUDA (``_graph_eligible``) runs as a CUDA graph from the second call of a shape on (``_graph_replay``:
    the same kernels, the same output; host launch overhead is most of the time at 1.3B 480p: 1.31 ms eager against
    0.42 ms as one graph, H200).
    Returns:
        int32 ``[B, H, G*C]``, G = ceil(S / C): group g is ``perm[..., g*C:(g+1)*C]``; each query index in [0, S)
        appears once; the last G*C - S entries are -1.
    Raises:
        ValueError: group_size < 1, power_iters < 1, or samples / bins not a power of two >= 16.
    """
    if group_size < 1 or power_iters < 1:
        raise ValueError(f"group_size and power_iters must be >= 1, got {group_size}, {power_iters}")
    for name, val in (("samples", samples), ("bins", bins)):
        if val < 16 or val & (val - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {val}")
    B, H, S, D = q.shape
    C = group_size
    G = -(-S // C)
    BH = B * H
    n_slots = G * C
    gmax = max(2, SUBTREE, SORTSPLIT) if LEAF else 0
    while gmax > 2 and triton.next_power_of_2(gmax * C) > _SUB_SLOTS:  # _subtree's keys hold 11 position bits
        gmax -= 1
    finish = SORTSPLIT < 2
    levels = _plan(S, C, q.device, gmax, finish)
    if not levels:  # one group: the queries in order, then the padding
        out = torch.full((BH, n_slots), -1, dtype=torch.int32, device=q.device)
        out[:, :S] = torch.arange(S, dtype=torch.int32, device=q.device)
        return out.reshape(B, H, n_slots)
    power_iters = min(power_iters, POWER_ITERS_MAX)
    args = (C, levels, gmax, finish, power_iters, samples, bins)
    if phase_hook is None and _graph_eligible(q):
        key = (tuple(q.shape), q.stride(), q.dtype, q.device, args[:1] + args[2:], COMPACT, HEAD_SCALE, SQUARE,
               LOCAL_HIST, _DIR_WARPS, _BLOCK_BIN, _TILE, _PREFIX)
        out = _graph_replay(key, q, args)
        if out is not None:
            return out
    return _tree(q, *args, phase_hook)


def _graph_eligible(q: torch.Tensor) -> bool:
    """Whether to run the tree as a CUDA graph: on CUDA, ``GRAPH`` on, q at most ``_GRAPH_MAX_BYTES`` (where the
    host's ~30 launches cost more than the GPU's work; larger q would pay its copy into the graph's input for
    nothing), and the stream not being captured already."""
    return (GRAPH and q.is_cuda and q.numel() * q.element_size() <= _GRAPH_MAX_BYTES
            and not torch.cuda.is_current_stream_capturing())


_GRAPHS: dict = {}  # key -> (graph, static q, static output, plan levels kept alive) or None (capture failed)


def _graph_replay(key, q: torch.Tensor, args: tuple):
    """The tree as a CUDA graph captured once per ``key`` (shape, strides, dtype, device, options): q copied into
    the graph's own input buffer, one replay, the output cloned. The first call of a key returns None (the caller
    runs the tree eagerly, which compiles every kernel); the second captures. A capture or replay that fails warns
    and is not retried for that key (None: the eager path). At most ``_GRAPH_CACHE`` graphs are kept (oldest
    out)."""
    if key not in _GRAPHS:
        _GRAPHS[key] = "seen"
        return None
    entry = _GRAPHS[key]
    if entry is None:
        return None
    if entry == "seen":
        try:
            with torch.cuda.device(q.device):
                static_q = torch.empty_strided(q.shape, q.stride(), dtype=q.dtype, device=q.device)
                static_q.copy_(q)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # other threads' CUDA calls go on
                    static_out = _tree(static_q, *args, None)
        except Exception as err:  # noqa: BLE001 (any capture failure: run eagerly from now on)
            import warnings

            warnings.warn(f"PDDP CUDA graph capture failed ({type(err).__name__}: {err}); running eagerly")
            _GRAPHS[key] = None
            return None
        while sum(isinstance(e, tuple) for e in _GRAPHS.values()) >= _GRAPH_CACHE:
            del _GRAPHS[next(k for k, e in _GRAPHS.items() if isinstance(e, tuple))]
        _GRAPHS.pop(key)
        _GRAPHS[key] = entry = (graph, static_q, static_out, args[1])
    graph, static_q, static_out, _ = entry
    try:
        with torch.cuda.device(q.device):
            static_q.copy_(q)
            graph.replay()
            return static_out.clone()
    except RuntimeError as err:  # e.g. the input buffer made under inference mode, written outside it: run eagerly
        import warnings

        warnings.warn(f"PDDP CUDA graph replay failed ({err}); running eagerly")
        _GRAPHS[key] = None
        return None


def _tree(q: torch.Tensor, C: int, levels: tuple, gmax: int, finish: bool, power_iters: int, samples: int, bins: int,
          phase_hook) -> torch.Tensor:
    """The launches of ``pddp_groups`` (arguments validated there): int32 [B, H, G*C]."""
    B, H, S, D = q.shape
    G = -(-S // C)
    BH = B * H
    n_slots = G * C
    hook = phase_hook or (lambda name: None)
    pairs = (power_iters + 1) // 2
    sq = max(1, (power_iters - 1).bit_length()) if SQUARE else 0  # squarings: cov^(2^sq), 2^sq >= power_iters
    gram = samples <= _GRAM_MAX  # directions from the samples' Gram matrix
    schunk = samples if gram else 64
    bigs = [big for _, big, _ in levels if big]
    leaves = [lf for _, _, lf in levels if lf]
    cur = torch.empty(BH, n_slots, dtype=torch.int32, device=q.device)
    nxt = torch.empty_like(cur)
    if bigs:
        n_alloc = max(n for n, *_ in bigs)
        bin_of = torch.empty(BH, n_slots, dtype=torch.int32, device=q.device)
        v = torch.empty(BH * n_alloc * D, dtype=torch.float32, device=q.device)
        off = torch.empty(BH * n_alloc, dtype=torch.float32, device=q.device)
        hist = torch.empty(BH * n_alloc * bins, dtype=torch.int32, device=q.device)
        cnt = torch.empty(BH * max(n * -(-n_max // _TILE) for n, n_max, *_ in bigs) * 2, dtype=torch.int32,
                          device=q.device)
    if leaves:
        np2 = max(triton.next_power_of_2(n_max) for *_, n_max, _ in leaves)
        n_leaf = max(n for n, *_ in leaves)
        keys = torch.empty(BH * n_leaf * np2, dtype=torch.int64, device=q.device)
        if gmax > 2 or not finish:
            ids = torch.empty(BH * n_leaf * np2, dtype=torch.int32, device=q.device)
            vs = torch.empty(BH * n_leaf * (1 << (max(r for *_, r in leaves) - 1)) * D, dtype=torch.float32,
                             device=q.device)
    strides = q.stride()
    compact = COMPACT and len(levels) > 1 and levels[0][1] is not None  # the root is split by the histogram path
    warps = _DIR_WARPS or direction_warps(_major(q.device), compact, samples)
    if compact:
        q8 = torch.empty(BH * S * D, dtype=torch.int8, device=q.device)
        sc = torch.empty(BH * S, dtype=torch.float32, device=q.device)
        mu = torch.empty(BH * D, dtype=torch.float32, device=q.device)
    else:
        q8 = sc = mu = cur  # unused
    for level, (copy, big, leaf) in enumerate(levels):
        first = level == 0
        code8 = 2 if HEAD_SCALE else 1  # READ8 / WRITE8: int8 copy with a scale per head (2) or per query (1)
        read8, write8 = code8 if compact and not first else 0, code8 if compact and first else 0
        if copy:  # nodes that no longer split keep their slots
            nxt.copy_(cur)
            hook("copy")
        if big:
            N, n_max, start, size, count = big
            _direction[(N, BH)](q, q8, sc, mu, cur, start, count, v, off, hist, H, N, S, n_slots, *strides,
                                PAIRS=pairs, M=samples, D=D, SCHUNK=schunk, NB=bins, FIRST=first, GRAM=gram,
                                READ8=read8, WRITE8=write8, SQ=sq, num_warps=warps)
            hook("direction")
            _bin[(triton.cdiv(n_max, _BLOCK_BIN), N, BH)](q, q8, sc, mu, cur, start, count, v, off, hist, bin_of, H, N,
                                                            S, n_slots, *strides, BLOCK=_BLOCK_BIN, D=D, NB=bins,
                                                            FIRST=first, READ8=read8, WRITE8=write8,
                                                            LOCAL=LOCAL_HIST, num_warps=4)
            hook("bin")
            n_tiles = triton.cdiv(n_max, _TILE)
            _count[(n_tiles, N, BH)](bin_of, hist, start, size, count, cnt, N, n_slots, n_tiles, C, TILE=_TILE,
                                     NB=bins, num_warps=4)
            hook("count")
            _apply[(n_tiles, N, BH)](cur, nxt, bin_of, hist, start, size, count, cnt, S, N, n_slots, n_tiles, C,
                                     TILE=_TILE, NB=bins, PREFIX=_PREFIX, FIRST=first, num_warps=4)
            hook("apply")
        if leaf and gmax == 2 and finish:
            N, start, count, _, n_max, _ = leaf
            _leaf[(N, BH)](q, q8, sc, cur, nxt, keys, start, count, H, N, S, n_slots, C, *strides,
                           PAIRS=pairs, M=samples, D=D, SCHUNK=schunk, CHUNK=64, NP=triton.next_power_of_2(n_max),
                           FIRST=first, GRAM=gram, READ8=read8, SQ=sq, num_warps=warps)
            hook("leaf")
        elif leaf:
            N, start, count, size, n_max, rounds = leaf
            _subtree[(N, BH)](q, q8, sc, cur, nxt, ids, keys, vs, start, size, count, H, N, S, n_slots, C, *strides,
                              PAIRS=pairs, M=samples, D=D, SCHUNK=schunk, CHUNK=min(64, triton.next_power_of_2(n_max)),
                              NP=triton.next_power_of_2(n_max), LEVELS=rounds, FIRST=first, GRAM=gram, READ8=read8, SQ=sq, num_warps=warps)
            hook("leaf")
        cur, nxt = nxt, cur
    return cur.reshape(B, H, n_slots)
