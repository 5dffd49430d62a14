"""The Triton PDDP kernels (kernels/triton/grouping.py) under TRITON_INTERPRET=1 (CPU) against float64 / torch models.

- ``_direction``: the node's direction is the float64 top eigenvector of its sampled rows' covariance (the sample: the
  evenly spaced real slots, read through the permutation), its binning map the float64 mean / standard deviation of
  the sample's projections; every output written (poisoned first), the node's histogram zeroed.
- ``_bin``: each real query's bin is floor(x . v - off) of the kernel's own map (float64), the histogram is exactly
  the per-node count of those bins.
- ``_count`` + ``_apply``: exactly the stable partition of each node (the L = ceil(g/2)*C smallest (bin, slot) go
  left, both halves keep slot order, -1 padding stays last), multi-tile nodes and the prefix loop included, ragged
  last node, every slot of a splitting node written and no other.
- ``_leaf``: a two-group node's C queries of smallest float64 projection on the top eigenvector of all its queries go
  left (the sign of the direction is free), padding last, every slot of the node written and no other.
- the whole grouping with small tiles: contract on ragged S (levels where some nodes no longer split), determinism.
"""

from __future__ import annotations

import pytest
import torch
from comfyui_mc_sparse_pack.kernels import reference, registry
from comfyui_mc_sparse_pack.kernels.reference.pddp import within_group_variance
from comfyui_mc_sparse_pack.kernels.triton import grouping

triton_backend = next(b for b in registry.backends() if b.name == "triton")
pytestmark = pytest.mark.skipif(
    bool(triton_backend.unavailable_reason), reason=f"triton backend unavailable: {triton_backend.unavailable_reason}"
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _level_tables(S, C):
    """The histogram path's node tables of every level (leaves off): (N, n_max, start, size, count, device tables)."""
    return [(N, n_max, start.cpu(), size.cpu(), count.cpu(), (start, size, count))
            for _, (N, n_max, start, size, count), _ in grouping._plan(S, C, torch.device(DEVICE), 0)]


def _perm_in(gen, BH, S, n_slots):
    perm = torch.full((BH, n_slots), -1, dtype=torch.int32)
    for bh in range(BH):
        perm[bh, :S] = torch.randperm(S, generator=gen).to(torch.int32)
    return perm


@pytest.mark.parametrize("S,C,tile,prefix", [(75, 8, 8, 2), (130, 16, 16, 4)])
def test_rank_split_is_the_stable_partition(gen, S, C, tile, prefix):
    """Random bins with many ties: _count + _apply give exactly the stable partition by (bin, slot) of every node."""
    BH, NB = 3, 16
    G = -(-S // C)
    n_slots = G * C
    for level, (N, n_max, start, size, count, dev) in enumerate(_level_tables(S, C)):
        first = level == 0
        perm_in = torch.arange(n_slots, dtype=torch.int32).where(torch.arange(n_slots) < S, -1).expand(BH, -1).clone() \
            if first else _perm_in(gen, BH, S, n_slots)
        bins = torch.randint(0, 5, (BH, n_slots), generator=gen, dtype=torch.int32) * 3  # few values: ties
        hist = torch.zeros(BH, N, NB, dtype=torch.int32)
        for bh in range(BH):
            for i in range(N):
                s, c = int(start[i]), int(count[i])
                hist[bh, i] = torch.bincount(bins[bh, s:s + c].long(), minlength=NB).to(torch.int32)
        n_tiles = -(-n_max // tile)
        cnt = torch.full((BH * N * n_tiles * 2,), -7, dtype=torch.int32)
        out = torch.full((BH, n_slots), -7, dtype=torch.int32)
        args = [t.to(DEVICE) for t in (perm_in, out, bins, hist.reshape(-1), *dev, cnt)]
        grouping._count[(n_tiles, N, BH)](args[2], args[3], *dev, args[7], N, n_slots, n_tiles, C, TILE=tile, NB=NB)
        grouping._apply[(n_tiles, N, BH)](*args, S, N, n_slots, n_tiles, C, TILE=tile, NB=NB, PREFIX=prefix,
                                          FIRST=first)
        got = args[1].cpu()
        want = torch.full((BH, n_slots), -7, dtype=torch.int32)
        for bh in range(BH):
            for i in range(N):
                s, n, c = int(start[i]), int(size[i]), int(count[i])
                left = -(-(n // C) // 2) * C
                order = torch.sort(bins[bh, s:s + c], stable=True).indices
                goes_left = torch.zeros(c, dtype=torch.bool)
                goes_left[order[:left]] = True
                rows = perm_in[bh, s:s + c]
                want[bh, s:s + n] = torch.cat([rows[goes_left], rows[~goes_left], perm_in[bh, s + c:s + n]])
        assert torch.equal(got, want), f"level {level}"


@pytest.mark.parametrize("mode,samples,sq", [("root", 256, 0), ("below", 32, 0), ("root", 64, 0), ("root write8", 256, 0),
                                             ("below read8", 64, 0), ("below read8", 256, 0), ("root", 256, 3),
                                             ("below", 32, 4), ("below read8", 64, 2), ("root write8 head", 64, 0),
                                             ("root write8 head", 256, 0), ("below read8 head", 64, 0),
                                             ("root local", 64, 0), ("below local", 64, 0)])
def test_direction_and_bins_match_float64(gen, mode, samples, sq):
    """_direction (covariance and Gram paths): top eigenvector of the sampled rows' covariance, binning map from their
    projections (power iteration, or sq > 0: repeated squaring by tl.dot); _bin: bins and histogram of every real
    query from that map (float64), histogram zeroed first (one atomic per query, or "local": per distinct bin of
    the block).
    At the root with WRITE8: the int8 copy of every query (row scale, or "head": one scale per head, twice the root
    sample's largest centred entry / 127, entries beyond it clipped; centred on the root's sample mean) dequantises
    to q within half a step; below the root with READ8: the same from a given int8 copy. Outputs poisoned."""
    B, H, S, D, C, NB = 1, 2, 150, 32, 16, 64
    G = -(-S // C)
    n_slots = G * C
    first, code8 = mode.startswith("root"), 2 if "head" in mode else 1
    read8, write8 = code8 * ("read8" in mode), code8 * ("write8" in mode)
    axis = torch.randn(H, 1, D, generator=gen)
    q = (torch.randn(B, H, S, 1, generator=gen) * 3.0 * axis + torch.randn(B, H, S, D, generator=gen) * 0.5
         + torch.randn(H, 1, D, generator=gen)).to(torch.bfloat16)
    x_all = q.reshape(B * H, S, D).double()
    q8 = torch.full((B * H * S * D,), -99, dtype=torch.int8)
    sc = torch.full((B * H * S,), float("nan"))
    mu = torch.full((B * H * D,), float("nan"))
    if read8:  # a given int8 copy (any centre): the kernels must read it, not q
        centre = x_all.mean(1, keepdim=True) + 0.1
        scale = (x_all - centre).abs().amax(-1, keepdim=True) / 127
        if code8 == 2:  # one scale per head, smaller than the largest entry: some codes clip
            scale = scale.amax(1, keepdim=True) * 0.6
        codes = ((x_all - centre) / scale).round().clamp(-127, 127)
        q8, sc = codes.to(torch.int8).reshape(-1), scale.float().reshape(-1)
        x_all = codes * scale.float().double()
        sc = torch.cat([sc, torch.full((B * H * S - sc.numel(),), float("nan"))])  # past the head scales: unused
    level = 0 if first else 1
    N, n_max, start, size, count, dev = _level_tables(S, C)[level]
    perm = _perm_in(gen, B * H, S, n_slots)
    v = torch.full((B * H * N * D,), float("nan"))
    off = torch.full((B * H * N,), float("nan"))
    hist = torch.full((B * H * N * NB,), 99, dtype=torch.int32)
    bins = torch.full((B * H, n_slots), -7, dtype=torch.int32)
    qd, q8_d, sc_d, mu_d, perm_d, v_d, off_d, hist_d, bins_d = (
        t.to(DEVICE) for t in (q, q8, sc, mu, perm, v, off, hist, bins))
    grouping._direction[(N, B * H)](qd, q8_d, sc_d, mu_d, perm_d, dev[0], dev[2], v_d, off_d, hist_d, H, N, S,
                                    n_slots, *qd.stride(), PAIRS=8, M=samples, D=D, SCHUNK=min(samples, 64), NB=NB,
                                    FIRST=first, GRAM=samples <= 64, READ8=read8, WRITE8=write8, SQ=sq)
    grouping._bin[(-(-n_max // 16), N, B * H)](qd, q8_d, sc_d, mu_d, perm_d, dev[0], dev[2], v_d, off_d, hist_d,
                                               bins_d, H, N, S, n_slots, *qd.stride(), BLOCK=16, D=D, NB=NB,
                                               FIRST=first, READ8=read8, WRITE8=write8, LOCAL="local" in mode)
    v, off, hist, bins = (t.cpu() for t in (v_d, off_d, hist_d, bins_d))
    v, off, hist = v.reshape(B * H, N, D), off.reshape(B * H, N), hist.reshape(B * H, N, NB)
    assert torch.isfinite(v).all() and torch.isfinite(off).all()
    for bh in range(B * H):
        ids = torch.arange(n_slots, dtype=torch.int32) if first else perm[bh]
        for i in range(N):
            s, c = int(start[i]), int(count[i])
            m = min(c, samples)
            sample = x_all[bh, ids[s + torch.arange(m) * c // m].long()]
            centred = sample - sample.mean(0)
            evals, evecs = torch.linalg.eigh(centred.T @ centred)
            top = evecs[:, -1]
            scale = float(v[bh, i].double().norm())
            unit = v[bh, i].double() / scale
            assert abs(float(unit @ top)) > 0.999
            sd = (float(evals[-1]) / m) ** 0.5
            assert scale == pytest.approx(NB / (8 * sd), rel=2e-2)
            mean_p = float(sample.mean(0) @ unit)
            assert float(off[bh, i]) == pytest.approx((mean_p - 4 * sd) * scale, abs=0.05 * NB)
            rows = x_all[bh, ids[s:s + c].long()]
            p = rows @ v[bh, i].double() - float(off[bh, i])
            want = p.floor().clamp(0, NB - 1).long()
            got = bins[bh, s:s + c].long()
            near = (p - p.round()).abs() < 1e-3  # float32 rounding may land either side of an integer
            assert torch.equal(got[~near], want[~near]) and bool(((got - want).abs() <= 1).all())
            assert torch.equal(hist[bh, i], torch.bincount(got, minlength=NB).to(torch.int32))
        if write8:
            mean = mu_d.cpu().reshape(B * H, D)[bh].double()
            sample = x_all[bh, torch.arange(min(S, samples)) * S // min(S, samples)]
            assert torch.allclose(mean, sample.mean(0), atol=1e-4)
            codes = q8_d.cpu().reshape(B * H, S, D)[bh].double()
            if code8 == 2:
                m = min(S, samples, 64)
                head_sample = x_all[bh, torch.arange(m) * S // m]
                step = sc_d.cpu()[bh].double().expand(S)
                assert float(step[0]) == pytest.approx(2 * float((head_sample - mean).abs().max()) / 127, rel=1e-5)
                assert bool(torch.isnan(sc_d.cpu()[B * H:]).all())  # no per-query scales written
            else:
                step = sc_d.cpu().reshape(B * H, S)[bh].double()
                assert torch.allclose(step, (x_all[bh] - mean).abs().amax(-1) / 127, rtol=1e-5)
            want = ((x_all[bh] - mean) / step[:, None]).clamp(-127, 127)  # clipped entries: the largest code
            assert bool(((codes - want).abs() <= 0.5 + 1e-4).all())


@pytest.mark.parametrize("S,C,first,samples,sq", [(90, 16, False, 256, 0), (28, 16, True, 256, 0),
                                                  (40, 24, False, 256, 0), (90, 16, False, 16, 0),
                                                  (90, 16, False, 256, 3), (40, 24, True, 16, 4)])
def test_leaf_splits_by_the_float64_projection(gen, S, C, first, samples, sq):
    """_leaf on two-group nodes (the ragged last one too; C not a power of two: NP > 2C): the C queries of smallest
    float64 projection on the top eigenvector of the node's sampled queries (all of them, or 16 by the Gram path)
    go left, the rest right, padding -1 last;
    every slot of the node written and no other (output poisoned)."""
    B, H, D = 1, 2, 32
    G = -(-S // C)
    n_slots = G * C
    axis = torch.randn(H, 1, D, generator=gen)
    q = (torch.randn(B, H, S, 1, generator=gen) * 3.0 * axis + torch.randn(B, H, S, D, generator=gen) * 0.3
         + torch.randn(H, 1, D, generator=gen)).to(torch.bfloat16)
    levels = grouping._plan(S, C, torch.device(DEVICE), 2)
    level = 0 if first else len(levels) - 1
    N, start, count = levels[level][2][:3]
    perm = torch.arange(n_slots, dtype=torch.int32).where(torch.arange(n_slots) < S, -1).expand(B * H, -1).clone() \
        if first else _perm_in(gen, B * H, S, n_slots)
    np2 = 1 << (2 * C - 1).bit_length()
    out = torch.full((B * H, n_slots), -7, dtype=torch.int32, device=DEVICE)
    keys = torch.full((B * H * N * np2,), -7, dtype=torch.int64, device=DEVICE)
    qd = q.to(DEVICE)
    grouping._leaf[(N, B * H)](qd, qd, keys, perm.to(DEVICE), out, keys, start, count, H, N, S, n_slots, C,
                               *qd.stride(), PAIRS=8, M=samples, D=D, SCHUNK=min(samples, 64), CHUNK=64, NP=np2,
                               FIRST=first, GRAM=samples <= 64, READ8=False, SQ=sq)
    out, start, count = out.cpu(), start.cpu(), count.cpu()
    x_all = q.reshape(B * H, S, D).double()
    inside = torch.zeros(n_slots, dtype=torch.bool)
    for i in range(N):
        s, c = int(start[i]), int(count[i])
        inside[s:s + 2 * C] = True
        for bh in range(B * H):
            rows = perm[bh, s:s + c]
            x = x_all[bh, rows.long()]
            m = min(c, samples)
            sample = x[torch.arange(m) * c // m]
            centred = sample - sample.mean(0)
            p = x @ torch.linalg.eigh(centred.T @ centred)[1][:, -1]
            order = torch.sort(p).indices
            got = out[bh, s:s + 2 * C]
            assert (got[c:] == -1).all()
            left = set(got[:C].tolist())
            assert left in (set(rows[order[:C]].tolist()), set(rows[order[c - C:]].tolist()))  # sign of v arbitrary
            assert sorted(got[:c].tolist()) == sorted(rows.tolist())
    assert (out[:, ~inside] == -7).all()


@pytest.mark.parametrize("S,C,leaf,compact,square,subtree", [
    (120, 8, True, False, False, 2), (120, 8, False, True, False, 2), (93, 16, True, True, False, 2),
    (93, 16, True, False, True, 2), (93, 8, True, True, False, 8), (120, 8, True, False, True, 5),
    (40, 8, True, False, False, 8), (93, 8, True, False, False, -8)])
def test_grouping_with_small_tiles_keeps_the_contract(gen, S, C, leaf, compact, square, subtree, monkeypatch):
    """The whole grouping with tiles smaller than the nodes (multi-tile prefix sums), ragged S and levels where some
    nodes no longer split, with / without leaves, subtrees of up to 5 and 8 groups (the root one when S <= 8C) or
    (subtree -8) nodes of up to 8 groups split once per level by the sort program (SORTSPLIT), the
    int8 copy of q below the root and repeated squaring: every query once, -1 only in the tail, deterministic,
    within 5 % of the torch reference's within-group variance and better than a random grouping."""
    monkeypatch.setattr(grouping, "_TILE", 16)
    monkeypatch.setattr(grouping, "_PREFIX", 2)
    monkeypatch.setattr(grouping, "_BLOCK_BIN", 16)
    monkeypatch.setattr(grouping, "LEAF", leaf)
    monkeypatch.setattr(grouping, "COMPACT", compact)
    monkeypatch.setattr(grouping, "SQUARE", square)
    monkeypatch.setattr(grouping, "SUBTREE", max(subtree, 0))
    monkeypatch.setattr(grouping, "SORTSPLIT", max(-subtree, 0))
    q = (torch.randn(1, 2, S, 1, generator=gen) * torch.randn(1, 2, 1, 16, generator=gen)
         + 0.3 * torch.randn(1, 2, S, 16, generator=gen)).to(torch.bfloat16)
    perm = grouping.pddp_groups(q.to(DEVICE), C, power_iters=4, samples=16).cpu()
    G = -(-S // C)
    assert perm.dtype == torch.int32 and perm.shape == (1, 2, G * C)
    assert (perm[..., S:] == -1).all()
    assert torch.equal(torch.sort(perm[..., :S], dim=-1).values, torch.arange(S, dtype=torch.int32).expand(1, 2, S))
    assert torch.equal(perm, grouping.pddp_groups(q.to(DEVICE), C, power_iters=4, samples=16).cpu())
    rnd = torch.stack([torch.randperm(S, generator=gen) for _ in range(2)]).to(torch.int32).reshape(1, 2, S)
    pad = torch.full((1, 2, G * C - S), -1, dtype=torch.int32)
    v_fast, v_ref, v_rnd = (float(within_group_variance(q, p, C).sum())
                            for p in (perm, reference.pddp_groups(q, C), torch.cat([rnd, pad], -1)))
    assert v_fast <= 1.05 * v_ref and v_fast < 0.5 * v_rnd


def test_direction_warps_rule():
    """4 warps only where measured faster and compiled spill-free (sm_90; with the int8 copy only at <= 64 samples),
    else 8."""
    assert grouping.direction_warps(9, False, 256) == 4
    assert grouping.direction_warps(10, False, 256) == 4
    assert grouping.direction_warps(8, False, 64) == 8
    assert grouping.direction_warps(9, True, 256) == 8
    assert grouping.direction_warps(9, True, 64) == 4


def test_graph_path_only_for_small_cuda_q(monkeypatch):
    """The CUDA-graph path is never taken on the CPU, for q above _GRAPH_MAX_BYTES, or with GRAPH off."""
    q = torch.zeros(1, 2, 64, 16, dtype=torch.bfloat16)
    assert not grouping._graph_eligible(q)
    monkeypatch.setattr(grouping, "GRAPH", False)
    assert not grouping._graph_eligible(q)


def test_graph_capture_failure_runs_eagerly(gen, monkeypatch):
    """A shape whose CUDA-graph capture fails (no CUDAGraph; on the CPU also the device) warns once, returns the eager tree's groups on
    every call, and is not captured again."""
    def no_graph():
        raise RuntimeError("no CUDA graphs here")

    monkeypatch.setattr(grouping, "_graph_eligible", lambda q: True)
    monkeypatch.setattr(grouping, "_GRAPHS", {})
    monkeypatch.setattr(torch.cuda, "CUDAGraph", no_graph)
    q = torch.randn(1, 1, 40, 16, generator=gen).to(torch.bfloat16).to(DEVICE)
    eager = grouping._tree(q, 8, grouping._plan(40, 8, q.device, 2), 2, True, 4, 16, 64, None)
    first = grouping.pddp_groups(q, 8, samples=16, bins=64)  # first call of the shape: eager
    with pytest.warns(UserWarning, match="capture failed"):
        second = grouping.pddp_groups(q, 8, samples=16, bins=64)
    third = grouping.pddp_groups(q, 8, samples=16, bins=64)
    assert list(grouping._GRAPHS.values()) == [None]
    assert all(torch.equal(p, eager) for p in (first, second, third))
