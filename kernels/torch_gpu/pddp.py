"""Fast PDDP query grouping on the GPU without host syncs (MC-Sparse, arXiv 2610.06801, sec. 3.2).

Same algorithm and contract as ``kernels.reference.pddp`` (recursive split of each node's queries along the
principal direction of its covariance, by rank, left part = ceil(g/2)*C queries), restructured for a GPU:

- The tree depends only on (S, C): every level's node layout (padded [N, n_max] position table, scatter indices,
  real row counts) is built once on the host and cached on the device, so a call launches a fixed sequence of
  kernels and never waits for the device (the reference indexes with boolean masks and builds tensors from Python
  lists at every level).
- Queries are centred by their per-head mean once and kept in bf16 (one copy of q, plus one zero row that the
  padding slots of the position table point at, so padded rows add nothing to any statistic).
- Per level and node: one gathered bf16 copy of the node's rows, their fp32 sum, their Gram matrix by one batched
  bf16 matmul with fp32 output (``torch.bmm(..., out_dtype=torch.float32)``), cov = Gram - s s^T / n, the top
  eigenvector by power iteration (``reference.principal_direction``), projections by one batched matmul (the node
  mean is a constant shift of every projection and is skipped: ranks do not change), and a stable sort of the
  projections within each node on the padded [B*H*N, n_max] view (padding slots and the tail's missing queries
  hold +inf, so they sort last and the tail stays in the last group).

Differences from the reference: statistics from bf16-rounded centred rows (the reference uses fp32 rows), so
queries whose projections tie within that rounding can land in the other half; groups are otherwise the same.
Output: int32 ``[B, H, G*C]``, every query once, -1 only in the last G*C - S slots, groups of exactly C.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from ..reference.pddp import principal_direction

MAX_PLANS = 4
"""Tree tables kept at once (least recently used dropped first): one per (S, C, device) a run meets, so a
run sees its few shapes cached while a long ComfyUI session over many resolutions holds at most this many."""

_PLANS: OrderedDict[tuple[int, int, str], list[dict]] = OrderedDict()


def _plan(S: int, C: int, device: torch.device) -> list[dict]:
    """Per-level static tables of the PDDP tree of S queries in groups of C (cached per device, ``MAX_PLANS`` at most).

    Each level: ``pos`` int64 [N, n_max] slot of perm read by each padded node row (slot G*C = the zero-row
    sentinel for padding), ``pad`` bool [N, n_max] rows that must sort last (node padding, and slots >= S whose
    query is missing), ``count`` fp32 [N] real rows per node, ``dst`` / ``src`` int64 flat scatter indices
    (perm slot <- padded sorted row) of the real node rows.
    """
    key = (S, C, str(device))
    if key in _PLANS:
        _PLANS.move_to_end(key)
        return _PLANS[key]
    G = -(-S // C)
    nodes = [(0, G)]  # (first block, blocks)
    levels = []
    while any(g > 1 for _, g in nodes):
        split = [(b, g) for b, g in nodes if g > 1]
        n_max = max(g for _, g in split) * C
        starts = torch.tensor([b * C for b, _ in split], dtype=torch.int64)
        sizes = torch.tensor([g * C for _, g in split], dtype=torch.int64)
        col = torch.arange(n_max, dtype=torch.int64)
        inside = col[None, :] < sizes[:, None]
        slot = starts[:, None] + col[None, :]
        pos = torch.where(inside, slot, G * C)
        real = inside & (slot < S)
        count = real.sum(1).to(torch.float32)
        flat = torch.arange(pos.numel(), dtype=torch.int64).reshape(pos.shape)
        levels.append(dict(
            pos=pos.to(device), pad=(~real).to(device), count=count.to(device),
            dst=slot[inside].to(device), src=flat[inside].to(device), n=len(split), n_max=n_max,
        ))
        nodes = [half for b, g in nodes for half in (((b, -(-g // 2)), (b + -(-g // 2), g // 2)) if g > 1 else ((b, g),))]
    _PLANS[key] = levels
    while len(_PLANS) > MAX_PLANS:
        _PLANS.popitem(last=False)
    return levels


def _bmm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b of bf16 batches with an fp32 result (fp32 accumulation on CUDA; upcast elsewhere)."""
    if a.is_cuda:
        try:
            return torch.bmm(a, b, out_dtype=torch.float32)
        except (RuntimeError, TypeError):  # torch without bmm(out_dtype=...)
            pass
    return torch.bmm(a.float(), b.float())


def pddp_groups(q: torch.Tensor, group_size: int, *, power_iters: int = 8) -> torch.Tensor:
    """Query groups of exactly ``group_size`` queries by Fast PDDP, all heads at once, no host syncs.

    Args:
        q: ``[B, H, S, D]`` queries, fp16/bf16/fp32 (statistics from bf16 centred rows, fp32 accumulation).
        group_size: C, queries per group (>= 1).
        power_iters: power-iteration steps per node (>= 1).
    Returns:
        int32 ``[B, H, G*C]``, G = ceil(S / C): group g is ``perm[..., g*C:(g+1)*C]``; each query index in
        [0, S) appears once; the last G*C - S entries are -1.
    Raises:
        ValueError: group_size < 1 or power_iters < 1.
    """
    if group_size < 1 or power_iters < 1:
        raise ValueError(f"group_size and power_iters must be >= 1, got {group_size}, {power_iters}")
    B, H, S, D = q.shape
    C = group_size
    G = -(-S // C)
    BH = B * H
    dev = q.device
    x = q.reshape(BH, S, D)
    mean = x.float().mean(1, keepdim=True) if x.dtype != torch.float32 else x.mean(1, keepdim=True)
    xz = torch.zeros(BH, S + 1, D, dtype=torch.bfloat16, device=dev)  # row S of each head: the zero row
    xz[:, :S] = (x - mean).to(torch.bfloat16)
    xz = xz.reshape(BH * (S + 1), D)
    head_off = (torch.arange(BH, device=dev, dtype=torch.int64) * (S + 1))[:, None, None]
    # perm over G*C slots (+1 sentinel slot), query index S = missing query (zero row)
    perm = torch.full((BH, G * C + 1), S, dtype=torch.int64, device=dev)
    perm[:, :S] = torch.arange(S, device=dev)
    for lv in _plan(S, C, dev):
        N, n_max = lv["n"], lv["n_max"]
        qi = perm[:, lv["pos"]]  # [BH, N, n_max] query indices
        rows = xz.index_select(0, (qi + head_off).reshape(-1)).reshape(BH * N, n_max, D)
        s = rows.sum(1, dtype=torch.float32)  # [BH*N, D]
        gram = _bmm_f32(rows.transpose(1, 2), rows)  # [BH*N, D, D]
        cnt = lv["count"].repeat(BH)[:, None, None]
        cov = gram - s[:, :, None] * s[:, None, :] / cnt.clamp_min(1.0)
        v = principal_direction(cov, power_iters)  # [BH*N, D] fp32
        proj = _bmm_f32(rows, v.to(torch.bfloat16).unsqueeze(-1)).reshape(BH, N, n_max)
        # a non-finite q gives NaN projections, which sort after the padding's +inf: keep them finite so the padding
        # (and the tail's missing queries) still sort last and every query stays in the permutation
        proj = torch.nan_to_num(proj, nan=0.0).masked_fill(lv["pad"], float("inf"))
        order = torch.sort(proj, dim=-1, stable=True).indices
        new = torch.gather(qi, 2, order).reshape(BH, -1)
        perm[:, lv["dst"]] = new[:, lv["src"]]
    out = perm[:, : G * C]
    out = torch.where(out >= S, -1, out).to(torch.int32)
    return out.reshape(B, H, G * C)
