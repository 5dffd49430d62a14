"""Fast PDDP query grouping in Triton: directions from a subsample, one projection pass per tree level that reads Q
through the permutation, and a sort of the projections only (MC-Sparse, arXiv 2610.06801, sec. 3.2).

Same tree and contract as ``kernels.reference.pddp`` (a node of g groups splits by rank along its principal
direction into ceil(g/2)*C and the rest, until every group holds C queries), restructured so that no copy of Q,
no covariance matrix and no host sync exists:

- ``_direction`` (one program per node and head): gathers ``samples`` rows of the node, evenly spaced over its
  current slots, through ``perm``, in chunks of 64; accumulates their covariance [D, D] in fp32 by ``tl.dot`` of
  bf16 rows shifted by the first chunk's mean (cov = sum x x^T - s s^T / m), then power iteration on it in
  registers (start: the axis of largest variance plus that column, as ``reference.principal_direction``). A node
  with at most ``samples`` queries uses all of them (the reference's covariance, from bf16-rounded rows).
- ``_project`` (one program per 64 slots of a node and head): p = q[perm[slot]] . v_node in fp32 (the node mean is a
  constant shift of every projection within the node and is skipped: ranks do not change); slots past the node or
  holding no query get +inf, so they sort last and the tail stays in the last group.
- ``torch.sort`` of the projections within each node on a padded [B*H*N, n_max] view (ties keep the current order),
  then ``_apply`` writes each node's slots in the sorted order into the other half of a double-buffered perm.

Per level: four launches (copy, direction, projection, sort, apply ~ five), one read of Q (256 B per query at D =
128, through the permutation), sample reads (<= ``samples`` rows per node). The tree's node table depends only on
(S, C) and lives on the device; tables are cached for at most ``_PLAN_CACHE`` shapes (least recently used first
out), so the cache never grows with the shapes seen.
Differences from the reference: the direction of a node larger than ``samples`` comes from a subsample (grouping
quality measured against the reference by the mean within-group variance, tests/test_anchor_kernels.py and
tests/bench_anchor.py); projections from the input dtype's values in fp32 (the reference: fp32 rows).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

_PLAN_CACHE = 8  # (S, C, device) node tables kept at once
SAMPLES = 256  # rows per node for its principal direction


@triton.jit
def _direction(
    Q, PERM, NODE_START, NODE_COUNT, V,
    H, n_slots, stride_qb, stride_qh, stride_qs, stride_qd, stride_vb, stride_vn,
    ITERS: tl.constexpr, M: tl.constexpr, D: tl.constexpr, CHUNK: tl.constexpr,
):
    node = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    start = tl.load(NODE_START + node)
    count = tl.load(NODE_COUNT + node)  # real queries in the node (its slots below S)
    m = tl.minimum(count, M)  # rows sampled: evenly spaced over the node, all of it when count <= M
    offs_c = tl.arange(0, CHUNK)
    offs_d = tl.arange(0, D)
    perm_row = PERM + bh.to(tl.int64) * n_slots
    base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    # shift: the mean of the first chunk (covariance is shift-invariant; the shift keeps bf16 products small)
    take = offs_c < m
    qi = tl.load(perm_row + start + (offs_c.to(tl.int64) * count) // m, mask=take, other=0)
    x = tl.load(base + qi.to(tl.int64)[:, None] * stride_qs + offs_d[None, :] * stride_qd,
                mask=take[:, None], other=0.0).to(tl.float32)
    mu = tl.sum(x, 0) / tl.minimum(m, CHUNK).to(tl.float32)
    cov = tl.zeros([D, D], dtype=tl.float32)
    ssum = tl.zeros([D], dtype=tl.float32)
    for c0 in range(0, m, CHUNK):
        i = c0 + offs_c
        take = i < m
        qi = tl.load(perm_row + start + (i.to(tl.int64) * count) // m, mask=take, other=0)
        x = tl.load(base + qi.to(tl.int64)[:, None] * stride_qs + offs_d[None, :] * stride_qd,
                    mask=take[:, None], other=0.0).to(tl.float32)
        x = tl.where(take[:, None], x - mu[None, :], 0.0)
        ssum += tl.sum(x, 0)
        xb = x.to(tl.bfloat16)
        cov += tl.dot(tl.trans(xb), xb)
    cov = cov - ssum[:, None] * ssum[None, :] / tl.maximum(m, 1).to(tl.float32)
    # power iteration from the axis of largest variance plus that column (as reference.principal_direction)
    diag = tl.sum(tl.where(offs_d[:, None] == offs_d[None, :], cov, 0.0), 1)
    best = tl.max(diag, 0)
    axis = tl.min(tl.where(diag == best, offs_d, D), 0)
    e = (offs_d == axis).to(tl.float32)
    v = e + tl.sum(cov * e[None, :], 1)
    for _ in tl.static_range(ITERS):
        v = v / tl.maximum(tl.sqrt(tl.sum(v * v, 0)), 1e-30)
        v = tl.sum(cov * v[None, :], 1) + 1e-12 * v
    v = v / tl.maximum(tl.sqrt(tl.sum(v * v, 0)), 1e-30)
    tl.store(V + bh.to(tl.int64) * stride_vb + node.to(tl.int64) * stride_vn + offs_d, v)


@triton.jit
def _project(
    Q, PERM, NODE_START, NODE_SIZE, V, P,
    H, S, n_slots, n_max, stride_qb, stride_qh, stride_qs, stride_qd, stride_vb, stride_vn,
    BLOCK: tl.constexpr, D: tl.constexpr,
):
    tile = tl.program_id(0)
    node = tl.program_id(1)
    bh = tl.program_id(2)
    b = bh // H
    h = bh % H
    start = tl.load(NODE_START + node)
    size = tl.load(NODE_SIZE + node)
    j = tile * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, D)
    slot = start + j
    inside = (j < size) & (slot < S)
    qi = tl.load(PERM + bh.to(tl.int64) * n_slots + slot, mask=inside, other=-1)
    real = inside & (qi >= 0)
    base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    x = tl.load(base + tl.where(real, qi, 0).to(tl.int64)[:, None] * stride_qs + offs_d[None, :] * stride_qd,
                mask=real[:, None], other=0.0).to(tl.float32)
    v = tl.load(V + bh.to(tl.int64) * stride_vb + node.to(tl.int64) * stride_vn + offs_d)
    p = tl.sum(x * v[None, :], 1)
    p = tl.where(real, p, float("inf"))
    tl.store(P + (bh.to(tl.int64) * tl.num_programs(1) + node) * n_max + j, p, mask=j < n_max)


@triton.jit
def _apply(
    PERM_IN, PERM_OUT, ORDER, NODE_START, NODE_SIZE,
    n_slots, n_max,
    BLOCK: tl.constexpr,
):
    tile = tl.program_id(0)
    node = tl.program_id(1)
    bh = tl.program_id(2)
    start = tl.load(NODE_START + node)
    size = tl.load(NODE_SIZE + node)
    j = tile * BLOCK + tl.arange(0, BLOCK)
    ok = j < size
    src = tl.load(ORDER + (bh.to(tl.int64) * tl.num_programs(1) + node) * n_max + j, mask=ok, other=0)
    row = bh.to(tl.int64) * n_slots
    val = tl.load(PERM_IN + row + start + src, mask=ok, other=-1)
    tl.store(PERM_OUT + row + start + j, val, mask=ok)


@functools.lru_cache(maxsize=_PLAN_CACHE)
def _plan(S: int, C: int, device: torch.device) -> tuple:
    """Per level: (N, n_max, node start slot, node size in slots, real queries per node) as int32 device tensors."""
    G = -(-S // C)
    nodes = [(0, G)]  # (first block, blocks)
    levels = []
    while any(g > 1 for _, g in nodes):
        split = [(b, g) for b, g in nodes if g > 1]
        start = [b * C for b, _ in split]
        size = [g * C for _, g in split]
        count = [max(0, min(s + n, S) - s) for s, n in zip(start, size)]
        table = torch.tensor([start, size, count], dtype=torch.int32).to(device)
        levels.append((len(split), max(size), table[0], table[1], table[2]))
        nodes = [half for b, g in nodes for half in (((b, -(-g // 2)), (b + -(-g // 2), g // 2)) if g > 1 else ((b, g),))]
    return tuple(levels)


def pddp_groups(q: torch.Tensor, group_size: int, *, power_iters: int = 8, samples: int = SAMPLES) -> torch.Tensor:
    """Query groups of exactly ``group_size`` queries by Fast PDDP; contract of ``kernels.reference.pddp_groups``.

    Args:
        q: ``[B, H, S, D]`` fp16/bf16 (any strides), D a power of two in [16, 256].
        group_size: C >= 1. power_iters: power-iteration steps per node (>= 1).
        samples: rows per node its direction is computed from (a power of two >= 16; default ``SAMPLES``).
    Returns:
        int32 ``[B, H, G*C]``, G = ceil(S / C): group g is ``perm[..., g*C:(g+1)*C]``; each query index in [0, S)
        appears once; the last G*C - S entries are -1.
    Raises:
        ValueError: group_size < 1, power_iters < 1, or samples not a power of two >= 16.
    """
    if group_size < 1 or power_iters < 1:
        raise ValueError(f"group_size and power_iters must be >= 1, got {group_size}, {power_iters}")
    if samples < 16 or samples & (samples - 1):
        raise ValueError(f"samples must be a power of two >= 16, got {samples}")
    B, H, S, D = q.shape
    C = group_size
    G = -(-S // C)
    BH = B * H
    n_slots = G * C
    cur = torch.full((BH, n_slots), -1, dtype=torch.int32, device=q.device)
    cur[:, :S] = torch.arange(S, dtype=torch.int32, device=q.device)
    nxt = torch.empty_like(cur)
    levels = _plan(S, C, q.device)
    if levels:
        v = torch.empty(BH, max(n for n, *_ in levels), D, dtype=torch.float32, device=q.device)
    block = 64
    for N, n_max, start, size, count in levels:
        _direction[(N, BH)](
            q, cur, start, count, v, H, n_slots, *q.stride(), v.stride(0), v.stride(1),
            ITERS=power_iters, M=samples, D=D, CHUNK=64, num_warps=8,
        )
        proj = torch.empty(BH, N, n_max, dtype=torch.float32, device=q.device)
        grid = (triton.cdiv(n_max, block), N, BH)
        _project[grid](q, cur, start, size, v, proj, H, S, n_slots, n_max, *q.stride(), v.stride(0), v.stride(1),
                       BLOCK=block, D=D, num_warps=4)
        order = torch.sort(proj, dim=-1, stable=True).indices
        nxt.copy_(cur)  # nodes that no longer split keep their slots
        _apply[grid](cur, nxt, order, start, size, n_slots, n_max, BLOCK=block, num_warps=4)
        cur, nxt = nxt, cur
    return cur.reshape(B, H, n_slots)
