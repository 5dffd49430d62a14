"""Torch reference of Fast PDDP query grouping (MC-Sparse, arXiv 2610.06801, sec. 3.2).

Per (batch, head), the queries are split recursively: project each node's queries on the node's
principal direction (top eigenvector of its covariance, by power iteration), order them by projection and
cut so that the left part holds ceil(g/2)*C queries, g = ceil(n/C) being the node's group count. Every
final group then holds exactly C queries, except the last one when S is not a multiple of C (its tail is
padded with -1). Node boundaries depend only on S and C, so one tree depth is processed for all heads
and all nodes at once on a padded [B*H, nodes, n_max, D] view. Only index arrays pass between levels.
"""

from __future__ import annotations

import torch


def principal_direction(cov: torch.Tensor, iters: int) -> torch.Tensor:
    """Top eigenvector of symmetric PSD matrices by power iteration.

    Args:
        cov: ``[..., D, D]`` fp32/fp64 covariance matrices.
        iters: power-iteration steps (>= 1).
    Returns:
        ``[..., D]`` unit vectors (sign arbitrary). Starts from the column of the largest diagonal entry,
        which is never orthogonal to the top eigenvector unless the matrix is degenerate; a zero matrix
        gives that unit column.
    """
    D = cov.shape[-1]
    start = cov.diagonal(dim1=-2, dim2=-1).argmax(dim=-1)  # [...]
    v = torch.nn.functional.one_hot(start, D).to(cov.dtype)
    v = v + torch.gather(cov, -1, start[..., None, None].expand(*cov.shape[:-1], 1)).squeeze(-1)
    for _ in range(iters):
        v = v / v.norm(dim=-1, keepdim=True).clamp_min(1e-30)
        v = torch.matmul(cov, v.unsqueeze(-1)).squeeze(-1) + 1e-12 * v
    return v / v.norm(dim=-1, keepdim=True).clamp_min(1e-30)


def split_sizes(n: int, group_size: int) -> tuple[int, int]:
    """Sizes of the two halves of a node of ``n`` queries: (ceil(g/2)*C, n - that), g = ceil(n/C)."""
    g = -(-n // group_size)
    left = -(-g // 2) * group_size
    return left, n - left


def pddp_groups(q: torch.Tensor, group_size: int, *, power_iters: int = 8) -> torch.Tensor:
    """Query groups of exactly ``group_size`` queries by Fast PDDP.

    Args:
        q: ``[B, H, S, D]`` queries (any float dtype; statistics in fp32).
        group_size: C, queries per group (> 0).
        power_iters: power-iteration steps per node.
    Returns:
        int32 ``[B, H, G*C]``, G = ceil(S / C): group g is ``perm[..., g*C:(g+1)*C]``; each query index
        appears once; the last G*C - S entries are -1.
    """
    B, H, S, D = q.shape
    C = group_size
    G = -(-S // C)
    x = q.reshape(B * H, S, D).float()
    perm = torch.arange(S, device=q.device).expand(B * H, S).clone()  # [BH, S] int64
    nodes = [(0, S)]  # (start, size), identical for every (b, h)
    while any(n > C for _, n in nodes):
        splitting = [(s, n) for s, n in nodes if n > C]
        n_max = max(n for _, n in splitting)
        starts = torch.tensor([s for s, _ in splitting], device=q.device)
        sizes = torch.tensor([n for _, n in splitting], device=q.device)
        pos = starts[:, None] + torch.arange(n_max, device=q.device)  # [N, n_max]
        valid = torch.arange(n_max, device=q.device)[None, :] < sizes[:, None]  # [N, n_max]
        pos = torch.where(valid, pos, starts[:, None])
        idx = perm[:, pos]  # [BH, N, n_max] query indices
        rows = torch.gather(x, 1, idx.reshape(B * H, -1, 1).expand(-1, -1, D)).reshape(*idx.shape, D)
        w = valid.to(x.dtype)[None, :, :, None]  # [1, N, n_max, 1]
        mean = (rows * w).sum(2, keepdim=True) / sizes.to(x.dtype)[None, :, None, None]
        centred = (rows - mean) * w  # [BH, N, n_max, D]
        cov = torch.matmul(centred.transpose(-1, -2), centred)  # [BH, N, D, D]
        direction = principal_direction(cov, power_iters)  # [BH, N, D]
        proj = torch.matmul(centred, direction.unsqueeze(-1)).squeeze(-1)  # [BH, N, n_max]
        proj = proj.masked_fill(~valid[None], float("inf"))
        order = torch.sort(proj, dim=-1, stable=True).indices  # ties keep the current order
        new = torch.gather(idx, 2, order)  # [BH, N, n_max]
        perm[:, pos[valid]] = new[:, valid]
        nodes = [half for s, n in nodes for half in (_halves(s, n, C) if n > C else [(s, n)])]
    out = torch.full((B * H, G * C), -1, dtype=torch.int32, device=q.device)
    out[:, :S] = perm.to(torch.int32)
    return out.reshape(B, H, G * C)


def _halves(start: int, n: int, group_size: int) -> list[tuple[int, int]]:
    left, right = split_sizes(n, group_size)
    return [(start, left), (start + left, right)]



def within_group_variance(q: torch.Tensor, perm: torch.Tensor, group_size: int) -> torch.Tensor:
    """Mean within-group query variance of a grouping (lower is better): the grouping-quality measure.

    Args:
        q: ``[B, H, S, D]`` queries (any float dtype; computed in float64 on q's device).
        perm: int32 ``[B, H, G*C]`` groups as ``pddp_groups`` returns them. group_size: C.
    Returns:
        float64 ``[B, H]``: per head, the mean over its S queries of the squared distance to their group's mean
        (the -1 padding slots of the last group excluded).
    """
    B, H, S, D = q.shape
    G = perm.shape[-1] // group_size
    out = torch.empty(B, H, dtype=torch.float64, device=q.device)
    for b in range(B):
        for h in range(H):
            slots = perm[b, h].long().reshape(G, group_size)
            valid = (slots >= 0).unsqueeze(-1)
            rows = q[b, h].double()[slots.clamp_min(0)] * valid  # [G, C, D]
            n = valid.sum(1).clamp_min(1)
            mean = rows.sum(1) / n
            out[b, h] = (((rows - mean.unsqueeze(1)) * valid) ** 2).sum() / S
    return out
