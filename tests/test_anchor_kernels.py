"""The anchor step's selection kernels under TRITON_INTERPRET=1 (CPU) against float64 / brute-force references.

- ``kernels/triton/topk.py`` (radix top-K): exactly the brute-force top-K of the same sums, ties to the lower token
  index, with many ties, rows longer than one 1024-entry chunk, K not a multiple of any tile, K = Sk, padding to
  K_alloc; every output slot written (outputs poisoned first).
- ``kernels/triton/topk_seg.py`` (the separate top-K's "seg" form): the same, on every path (fallbacks, a warp's slots
  overflowing, warp parts past the row, ties at T split across warps).
- ``select_kv`` on the Triton backend (pass 2 + radix top-K): exactly the top-K of the kernel's own group sums, and
  close to the float64 top-K in kept probability mass.
"""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl
from comfyui_mc_sparse_pack import kernels
from comfyui_mc_sparse_pack.kernels import reference, registry
from comfyui_mc_sparse_pack.kernels.reference.topk import top_k_rows as ref_top_k_rows

triton_backend = next(b for b in registry.backends() if b.name == "triton")
pytestmark = pytest.mark.skipif(
    bool(triton_backend.unavailable_reason), reason=f"triton backend unavailable: {triton_backend.unavailable_reason}"
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
POISON = -7


def _brute_force(sums: torch.Tensor, k: int, width: int) -> torch.Tensor:
    """Python-sorted top-K by (value desc, index asc) per row; the definition the kernels must match."""
    rows = sums.double().clamp_min(0).reshape(-1, sums.shape[-1]).tolist()
    out = []
    for row in rows:
        keep = sorted(sorted(range(len(row)), key=lambda j: (-row[j], j))[:k])
        out.append(keep + [-1] * (width - k))
    return torch.tensor(out, dtype=torch.int32).reshape(*sums.shape[:-1], width)


def _tied_sums(gen, rows, sk, dtype, levels):
    """Group-sum-like rows (>= 0) drawn from ``levels`` distinct values: many exact ties, incl. at the K-th value."""
    vals = torch.rand(levels, generator=gen, dtype=torch.float64) * 3.0
    vals[0] = 0.0
    pick = torch.randint(0, levels, (rows, sk), generator=gen)
    return vals[pick].to(dtype)


def test_reference_top_k_is_the_brute_force(gen):
    """The reference rule (stable descending sort) is the documented one: value desc, then lower index."""
    sums = _tied_sums(gen, 6, 50, torch.float64, levels=5)
    sums[0, 3] = -0.0
    sums[1, :] = -1.0  # negatives rank as 0: the first K indices win
    for k in (1, 7, 50):
        assert torch.equal(ref_top_k_rows(sums, k, 64), _brute_force(sums, k, 64))
    assert ref_top_k_rows(sums, 5, 8)[1].tolist() == [0, 1, 2, 3, 4, -1, -1, -1]


from comfyui_mc_sparse_pack.kernels.triton import topk as triton_topk  # noqa: E402  (after the skip marker)
from comfyui_mc_sparse_pack.kernels.triton import topk_seg  # noqa: E402


_TOPK_CASES = [(1500, 37, 64, 4), (1500, 1500, 1536, 3), (300, 1, 5, 300), (2100, 700, 704, 40),
               (1500, 1200, 1216, 4)]  # the last: the K-th key is 0, ties of +0.0 and -0.0 (row 3) at it
_F16, _F32 = torch.float16, torch.float32


@pytest.mark.parametrize("method,dtype,sk,k,width,levels", [
    *(("radix", dt, *case) for dt in (_F16, _F32) for case in _TOPK_CASES),
    # the bracket method (slower under the interpreter: a subset; rows of 4104 keys load whole 16-byte tiles)
    *(("bracket", _F16, *case) for case in _TOPK_CASES), ("bracket", _F32, 2100, 700, 704, 40),
    ("bracket", _F16, 4104, 1000, 1008, 3000)])
def test_radix_top_k_equals_brute_force_with_ties(gen, method, dtype, sk, k, width, levels):
    """Exact: both methods (radix threshold / sample bracket on tiles, then compaction) == brute-force top-K of the
    same values; every slot written; rows whose length is not a multiple of 8 (unaligned: masked
    loads) and one that is (16-byte loads of whole tiles, then a partial tile)."""
    sums = _tied_sums(gen, 5, sk, dtype, levels)
    sums[2] = sums[2].abs() * torch.rand(sk, generator=gen).to(dtype)  # a row of distinct values
    sums[3, ::7] = -0.0  # -0.0 ties with +0.0
    out = torch.full((5, width), POISON, dtype=torch.int32)
    got = triton_topk.top_k_rows(sums.to(DEVICE), k, width, out=out.to(DEVICE), method=method).cpu()
    assert torch.equal(got, _brute_force(sums, k, width))
    assert torch.equal(got, ref_top_k_rows(sums, k, width))


@pytest.mark.parametrize("rows_per_step,prefetch", [(16, False), (64, True)])
def test_bracket_top_k_tilings(gen, rows_per_step, prefetch):
    """The bracket method with small tiles (16 rows of 8 keys), without the prefetch, on an aligned row of 4104
    keys (many whole tiles, a partial one) with ties at the threshold: the brute-force top-K, every slot written."""
    sums = _tied_sums(gen, 3, 4104, torch.float16, levels=2000)
    out = torch.full((3, 1024), POISON, dtype=torch.int32)
    got = triton_topk.top_k_rows(sums.to(DEVICE), 1000, 1024, out=out.to(DEVICE), method="bracket",
                                 block=rows_per_step * 8, prefetch=prefetch).cpu()
    assert torch.equal(got, _brute_force(sums, 1000, 1024))


@pytest.mark.parametrize("dtype,cand_count", [(torch.float16, 0), (torch.float32, 0), (torch.float16, 1),
                                              (torch.float16, 2), (torch.float16, 3)])
def test_bracket_top_k_is_exact_on_every_path(gen, dtype, cand_count):
    """The bracket method with few samples (strata of 4 keys) and a small candidate buffer: rows where the bracket
    holds the K-th key (radix select among the candidates) and rows where it cannot (radix fallback), all exact:
    - row 0: distinct random values -> bracket hit;
    - row 1: the sampled positions hold 0, every other key is larger -> the bracket sits below the K-th key
      (more than K keys above it) -> fallback;
    - row 2: the sampled positions hold large values, every other key 0, K above their count -> the bracket sits
      above the K-th key (too few keys at or above its low end) -> fallback;
    - row 3: one value everywhere -> more candidates than the buffer holds -> fallback;
    - row 4: ties at the threshold inside a hit (levels drawn from 300 values);
    - row 5: 1000 consecutive bit patterns, shuffled: every key value inside the bracket occurs, so a search
      that stops short of a single value picks a wrong threshold.
    ``cand_count``: the threshold among the candidates by counting, one or two bits per pass, or one bit on int16 pairs
    (3, ``_count_ge_pairs``) (the separate top-K after the CuTeDSL pass 2), the same rows and the same fallbacks (its
    candidate slots: 512, one sweep step). Mutations of 3: the half-count split dropped (low half only), the padding
    -1 (counted as >= every trial): each fails."""
    sk, k, width, stride, cap = 1000, 300, 320, 4, 512
    pos = triton_topk.sample_positions(sk, stride)
    assert len(pos) == 250 and bool((pos < sk).all()) and len(set(pos.tolist())) == 250
    sums = torch.rand(6, sk, generator=gen, dtype=torch.float64) + 0.5
    sums[1, pos] = 0.0
    sums[2] = 0.0
    sums[2, pos] = 3.0 + torch.rand(len(pos), generator=gen, dtype=torch.float64)
    sums[3] = 0.75
    sums[4] = _tied_sums(gen, 1, sk, torch.float64, levels=300)[0]
    sums = sums.to(dtype)
    codes = torch.randperm(sk, generator=gen) + (0x3C00 if dtype == torch.float16 else 0x3F800000)
    sums[5] = codes.to(torch.int16 if dtype == torch.float16 else torch.int32).view(dtype)
    out = torch.full((6, width), POISON, dtype=torch.int32)
    got, fell_back = triton_topk.top_k_rows(sums.to(DEVICE), k, width, out=out.to(DEVICE), cap=cap, method="bracket",
                                            sample_stride=stride, return_fallbacks=True, cand_count=cand_count,
                                            num_warps=2)  # (512-key sweep steps: the counting buffer stays 512)
    assert torch.equal(got.cpu(), _brute_force(sums, k, width))
    assert fell_back.cpu().tolist() == [0, 1, 1, 1, 0, 0]


def test_separate_top_k_bracket_width(gen, monkeypatch):
    """top_k_rows(z=): the bracket's half-width in sigmas; None takes topk._SEPARATE_Z. A narrow bracket (z = 0: +-2
    samples) misses rows (the radix launch writes them) where z = 5 misses none; every result is the brute force.
    Mutation: z not passed to bracket_plan (fallback counts equal) fails."""
    sk, k, width = 2000, 700, 704
    sums = (torch.rand(16, sk, generator=gen, dtype=torch.float64) + 0.5).to(torch.float16)
    want = _brute_force(sums, k, width)
    fb = {}
    for z in (0.0, 5.0, None):
        if z is None:
            monkeypatch.setattr(triton_topk, "_SEPARATE_Z", 0.0)
        got, fell = triton_topk.top_k_rows(sums.to(DEVICE), k, width, method="bracket", return_fallbacks=True,
                                           cand_count=1, z=z)
        assert torch.equal(got.cpu(), want), z
        fb[z] = int(fell.sum())
    assert fb[5.0] == 0 and fb[0.0] > 0 and fb[None] == fb[0.0], fb


def test_bracket_plan_ranks():
    """The bracket: K * n_samp / Sk samples expected above the K-th key, +- (5 sigma + 2); whole rows sampled when
    Sk < 1024; the Wan2.1-14B 720p row (75600 float16 keys) reads one key per 74 (1021 samples, <= 1024 in
    registers), the 1.3B 480p row (32760) one per 32 (1023: as many as the registers hold); the candidate slots
    cover 1.3x the bracket's expected keys."""
    assert triton_topk.bracket_plan(1000, 300, 2) == (1, 1000, 300 - 75, 300 + 75, 256)  # sigma = sqrt(210)
    stride, n, hi, lo, cap = triton_topk.bracket_plan(75600, 18900, 2)
    margin = math.ceil(5 * (1021 * 0.1875) ** 0.5) + 2
    assert (stride, n, hi, lo, cap) == (74, 1021, 255 - margin, 256 + margin, 16384)
    assert triton_topk.bracket_plan(32760, 8190, 2)[:2] == (32, 1023)
    assert triton_topk.bracket_plan(32760, 8190, 4)[:2] == (32, 1023)  # float32 sums: the same
    assert triton_topk.bracket_plan(32760, 8190, 2, stride=63)[:2] == (63, 520)  # the plan before session 8
    assert triton_topk.bracket_plan(100, 1, 2)[2] <= 0  # no upper bound: the bracket starts at the top
    assert triton_topk.bracket_plan(75600, 18900, 2, stride=4, cap=64)[::4] == (74, 64)  # <= 1024 samples; cap given


def test_radix_top_k_rejects_bad_arguments():
    """K outside [1, Sk], width < K, or another dtype: clear errors naming the argument."""
    sums = torch.rand(2, 10)
    with pytest.raises(ValueError, match="num_keys must be in"):
        triton_topk.top_k_rows(sums, 11, 16)
    with pytest.raises(ValueError, match="width >= num_keys"):
        triton_topk.top_k_rows(sums, 5, 4)
    with pytest.raises(TypeError, match="float16 or float32"):
        triton_topk.top_k_rows(sums.double(), 5, 8)
    with pytest.raises(ValueError, match="method must be"):
        triton_topk.top_k_rows(sums, 5, 8, method="sort")
    with pytest.raises(ValueError, match="power of two"):
        triton_topk.top_k_rows(sums, 5, 8, cap=100)


@triton.jit
def _sum_first_nonzero(a0, a1, b0, b1):
    return a0 + b0, tl.where(a1 != 0, a1, b1)


@triton.jit
def _tuple_reduce_kernel(X, O, R: tl.constexpr, N: tl.constexpr, FLAT: tl.constexpr):
    x = tl.load(X + tl.arange(0, R)[:, None] * N + tl.arange(0, N)[None, :])
    nz = tl.where(x % 3 == 0, 0, x)
    if FLAT:
        s, f = tl.reduce((x, nz), None, _sum_first_nonzero)
        tl.store(O, s)
        tl.store(O + 1, f)
    else:
        s0, f0 = tl.reduce((x, nz), 0, _sum_first_nonzero)
        s1, f1 = tl.reduce((x, nz), 1, _sum_first_nonzero)
        tl.store(O + tl.arange(0, N), s0)
        tl.store(O + N + tl.arange(0, N), f0)
        tl.store(O + 2 * N + tl.arange(0, R), s1)
        tl.store(O + 2 * N + R + tl.arange(0, R), f1)


@pytest.mark.skipif(DEVICE == "cuda", reason="the interpreter's reduction (tests/_triton_interp.py fix 4)")
@pytest.mark.parametrize("rows,cols", [(8, 4), (2, 16)])
def test_interpreter_tuple_reduce_equals_the_per_element_one(gen, rows, cols):
    """The interpreter's pairwise ``tl.reduce`` (tests/_triton_interp.py, which the top-K's ``_kth_largest2`` runs on)
    gives what the per-element original gives, along either axis, with a combine function that is
    associative but not commutative (the first nonzero entry: a swapped or reordered pair changes it) beside a sum;
    axis=None (the original mishandles a tuple there) equals the flattened row-major result."""
    from triton.runtime import interpreter

    x = torch.randint(1, 40, (rows, cols), generator=gen, dtype=torch.int32)
    x[torch.rand(rows, cols, generator=gen) < 0.4] *= 3  # zeros of the second operand, also leading ones
    x[0, 0] = 3
    patched = interpreter.ReduceOps.generic_reduce
    outs = []
    for impl in (patched.original, patched):
        interpreter.ReduceOps.generic_reduce = impl
        try:
            out = torch.full((2 * (rows + cols),), POISON, dtype=torch.int32)
            _tuple_reduce_kernel[(1,)](x, out, rows, cols, False)
            outs.append(out)
        finally:
            interpreter.ReduceOps.generic_reduce = patched
    assert torch.equal(outs[0], outs[1])
    flat = torch.full((2,), POISON, dtype=torch.int32)
    _tuple_reduce_kernel[(1,)](x, flat, rows, cols, True)
    nz = x.flatten()[x.flatten() % 3 != 0]
    assert flat.tolist() == [int(x.sum()), int(nz[0])]


@triton.jit
def _cand_threshold_kernel(CAND, N, W, KK, LO, HI, OUT, STEP: tl.constexpr, COUNT: tl.constexpr):
    """Row r of CAND ([rows, W] int16, N copies): (T, need) of ``topk._cand_threshold[_count]`` into OUT[r, 0:2]."""
    r = tl.program_id(0)
    kk = tl.load(KK + r)  # (rows of W >= N slots: the count pads to a multiple of STEP)
    lo = tl.load(LO + r)
    hi = tl.load(HI + r)
    if COUNT:
        t, need = triton_topk._cand_threshold_count(CAND + r * W, N, kk, lo, hi, STEP, COUNT)
    else:
        t, need = triton_topk._cand_threshold(CAND + r * W, N, kk, lo, hi, STEP)
    tl.store(OUT + 2 * r, t)
    tl.store(OUT + 2 * r + 1, need)


@pytest.mark.parametrize("count", [1, 2, 0])
def test_candidate_threshold_is_the_kth_largest_copy(gen, count):
    """topk's threshold among the bracket's copies (``_cand_threshold_count``: bit search by counting, one or two bits
    per pass (odd and even range bit lengths);
    ``_cand_threshold``: radix histograms): T = the kk-th largest of the n copies (every one in [lo, hi]) and need = kk
    minus the copies above T, with many ties, kk = 1, kk = n, hi - lo = 0, 1, a power of two and 0x7C00 - lo (the top
    bit of the range needed), n not a multiple of the chunk (STEP 64); row 8: every value of a 7-bit range, T - lo odd
    (the lowest bit decides)."""
    n, rows = 300, 9
    spans = [0, 1, 2, 64, 255, 256, 4000, 0x7C00, 127]
    lo = torch.tensor([0, 7, 100, 300, 1, 0, 2000, 0, 3], dtype=torch.int32)
    hi = lo + torch.tensor(spans, dtype=torch.int32)
    cand = torch.full((rows, 320), 0x7C00, dtype=torch.int16)  # slots past n: above every copy (must not count)
    for r in range(rows):  # a few levels (ties), the range's ends among them
        levels = torch.randint(0, spans[r] + 1, (12,), generator=gen)
        levels[0], levels[1] = 0, spans[r]
        cand[r, :n] = (lo[r] + levels[torch.randint(0, 12, (n,), generator=gen)]).to(torch.int16)
    cand[7, :40] = 0x7C00  # the top bit of the range decides T
    cand[5, :n] = cand[5, :n].clamp_max(lo[5] + 200)
    cand[5, 0], cand[5, n - 1] = lo[5] + 250, lo[5] + 256  # the largest copy is the last one (kk = 2)
    cand[8, :n] = (lo[8] + torch.arange(n)[torch.randperm(n, generator=gen)] % 128).to(torch.int16)
    kk = torch.tensor([1, n, 150, 37, 299, 2, 77, 45, 42], dtype=torch.int32)  # row 8: T = lo + 107
    out = torch.full((rows, 2), POISON, dtype=torch.int32).to(DEVICE)
    _cand_threshold_kernel[(rows,)](cand.to(DEVICE), n, 320, kk.to(DEVICE), lo.to(DEVICE), hi.to(DEVICE), out,
                                    STEP=64, COUNT=count)
    out = out.cpu()
    for r in range(rows):
        vals = sorted(cand[r, :n].tolist(), reverse=True)
        t = vals[kk[r] - 1]
        assert out[r].tolist() == [t, int(kk[r]) - sum(v > t for v in vals)], r


def _groups(gen, B, H, S, C):
    G = -(-S // C)
    perm = torch.full((B, H, G * C), -1, dtype=torch.int32)
    for b in range(B):
        for h in range(H):
            perm[b, h, :S] = torch.randperm(S, generator=gen).to(torch.int32)
    return perm


@pytest.mark.parametrize("S,D,C,num_keys,kv_tile", [(300, 32, 64, 45, 16), (130, 64, 128, 130, 64)])
def test_select_kv_is_the_exact_top_k_of_its_group_sums(gen, S, D, C, num_keys, kv_tile):
    """Triton select_kv: ragged S (S % C != 0), K not a tile multiple: equals the top-K (ties: lower index) of the
    Triton pass-2 sums stored in float16, and keeps >= 99.5 % of the float64 top-K's probability mass."""
    B, H = 1, 2
    q, k = (torch.randn(B, H, S, D, generator=gen).to(torch.bfloat16) for _ in range(2))
    _, lse = reference.dense_attention(q.double(), k.double(), k.double(), return_lse=True)
    perm = _groups(gen, B, H, S, C)
    q, k, lse, perm = (t.to(DEVICE) for t in (q, k, lse, perm))
    idx = kernels.select_kv(q, k, lse, perm, num_keys, group_size=C, kv_tile=kv_tile, backend="triton").cpu()
    k_alloc = -(-num_keys // kv_tile) * kv_tile
    assert idx.shape == (B, H, -(-S // C), k_alloc)
    sums16 = kernels.group_prob_sums(q, k, lse, perm, group_size=C, backend="triton").to(torch.float16).cpu()
    assert torch.equal(idx, ref_top_k_rows(sums16, num_keys, k_alloc))
    exact = reference.group_prob_sums(q.cpu().double(), k.cpu().double(), lse.cpu(), perm.cpu(), group_size=C)
    best = exact.topk(num_keys, -1).values.sum(-1)
    kept = exact.gather(-1, idx[..., :num_keys].long()).sum(-1)
    assert bool((kept >= 0.995 * best).all())


from comfyui_mc_sparse_pack.kernels.reference.pddp import within_group_variance  # noqa: E402
from comfyui_mc_sparse_pack.kernels.triton import grouping  # noqa: E402


def _structured_q(gen, grid, D, H=1):
    """Queries as a smooth random function of the token's (frame, row, column) position plus noise."""
    pos = torch.stack(torch.meshgrid(*(torch.arange(n, dtype=torch.float32) for n in grid), indexing="ij"), -1)
    pos = pos.reshape(-1, 3) / torch.tensor(grid, dtype=torch.float32)
    heads = [torch.sin(pos @ (torch.randn(3, D, generator=gen) * 6.0)) + pos @ torch.randn(3, D, generator=gen)
             + 0.3 * torch.randn(pos.shape[0], D, generator=gen) for _ in range(H)]
    return torch.stack(heads).unsqueeze(0).to(torch.bfloat16)


@pytest.mark.parametrize("S,C,samples", [(200, 32, 32), (96, 64, 16)])
def test_triton_grouping_contract(gen, S, C, samples):
    """Triton PDDP: int32 [B, H, G*C], every query exactly once, -1 only in the last G*C - S slots (ragged S);
    the output buffer is fully written (it starts as -1 everywhere and every slot below S must change)."""
    q = torch.randn(2, 1, S, 16, generator=gen).to(torch.bfloat16)
    perm = grouping.pddp_groups(q.to(DEVICE), C, power_iters=3, samples=samples).cpu()
    G = -(-S // C)
    assert perm.dtype == torch.int32 and perm.shape == (2, 1, G * C)
    assert (perm[..., S:] == -1).all()
    assert torch.equal(torch.sort(perm[..., :S], dim=-1).values, torch.arange(S, dtype=torch.int32).expand(2, 1, S))


def test_triton_grouping_quality_matches_the_reference(gen):
    """On structured (DiT-like) queries the subsampled-direction grouping's mean within-group variance is within 5 %
    of the torch reference's (pddp_variance_ratio bar 1.05), and far below a random grouping's."""
    C, grid = 32, (4, 8, 12)
    q = _structured_q(gen, grid, 16)
    S = q.shape[2]
    fast = grouping.pddp_groups(q.to(DEVICE), C, power_iters=4, samples=64).cpu()
    ref = reference.pddp_groups(q, C)
    rnd = torch.randperm(S, generator=gen).to(torch.int32).reshape(1, 1, S)
    v_fast, v_ref, v_rnd = (float(within_group_variance(q, p, C).sum()) for p in (fast, ref, rnd))
    assert v_fast <= 1.05 * v_ref and v_fast < 0.75 * v_rnd


def test_within_group_variance_definition():
    """Two groups {0, 1} and {2, 3} of 1-D queries 0, 2, 10, 14: squared deviations 1+1+4+4 over 4 queries."""
    q = torch.tensor([0.0, 2.0, 10.0, 14.0]).reshape(1, 1, 4, 1)
    perm = torch.tensor([[[0, 1, 3, 2]]], dtype=torch.int32)
    assert within_group_variance(q, perm, 2).item() == pytest.approx(2.5)
    perm = torch.tensor([[[0, 1, 3, 2, -1, -1]]], dtype=torch.int32)  # padding slots excluded
    assert within_group_variance(q, perm[..., :4], 2).item() == pytest.approx(2.5)


def test_fp8_pass2_is_close_and_keeps_the_mass(gen):
    """The approximate float8 pass 2 (benchmark option): sums within 5 % relative of float64, every entry written,
    and its top-K keeps >= 99 % of the exact top-K's probability mass."""
    from comfyui_mc_sparse_pack.kernels.triton import selection

    S, C, K = 260, 64, 50
    q, k = (torch.randn(1, 2, S, 32, generator=gen).to(torch.bfloat16) for _ in range(2))
    _, lse = reference.dense_attention(q.double(), k.double(), k.double(), return_lse=True)
    perm = _groups(gen, 1, 2, S, C)
    out = torch.full((1, 2, perm.shape[-1] // C, S), float("nan"))
    selection.group_prob_sums(q.to(DEVICE), k.to(DEVICE), lse.to(DEVICE), perm.to(DEVICE), group_size=C, out=out,
                              fp8=True, block_n=64)
    ref = reference.group_prob_sums(q.double(), k.double(), lse, perm, group_size=C)
    assert not out.isnan().any()
    assert float((out.double() - ref).norm() / ref.norm()) < 5e-2
    kept = ref.gather(-1, out.topk(K, -1).indices).sum(-1)
    assert bool((kept >= 0.99 * ref.topk(K, -1).values.sum(-1)).all())


def test_select_kv_falls_back_to_torch_topk_when_the_radix_kernel_fails(gen, monkeypatch, caplog):
    """A radix top-K that cannot run (compiler/resource failure) costs neither the run nor its speed: torch.topk
    answers with the same set (no ties here), and the failure is logged."""
    from comfyui_mc_sparse_pack.kernels.triton import selection

    q, k = (torch.randn(1, 1, 130, 32, generator=gen).to(torch.bfloat16) for _ in range(2))
    _, lse = reference.dense_attention(q.double(), k.double(), k.double(), return_lse=True)
    perm = _groups(gen, 1, 1, 130, 64)
    want = selection.select_kv(q, k, lse, perm, 40, group_size=64, kv_tile=16)

    def broken(*a, **kw):
        raise RuntimeError("out of resources (simulated)")

    monkeypatch.setattr(selection, "top_k_rows", broken)
    monkeypatch.setattr(selection, "_RADIX_FAILED", [])
    with caplog.at_level("WARNING"):
        got = selection.select_kv(q, k, lse, perm, 40, group_size=64, kv_tile=16)
    assert torch.equal(got, want) and "Triton top-K failed" in caplog.text


def test_select_kv_retries_the_radix_top_k_when_the_bracket_scratch_runs_out_of_memory(gen, monkeypatch, caplog):
    """Out of memory in the default (bracket) top-K: the call is answered by the radix method (the same exact
    selection), logged once, and the Triton top-K stays on; out of memory in the radix method itself is raised."""
    from comfyui_mc_sparse_pack.kernels.triton import selection

    q, k = (torch.randn(1, 1, 130, 32, generator=gen).to(torch.bfloat16) for _ in range(2))
    _, lse = reference.dense_attention(q.double(), k.double(), k.double(), return_lse=True)
    perm = _groups(gen, 1, 1, 130, 64)
    want = selection.select_kv(q, k, lse, perm, 40, group_size=64, kv_tile=16)
    real, methods = selection.top_k_rows, []

    def tight(*a, method=None, **kw):
        methods.append(method)
        if method != "radix":
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(*a, method=method, **kw)

    monkeypatch.setattr(selection, "top_k_rows", tight)
    monkeypatch.setattr(selection, "_RADIX_FAILED", [])
    monkeypatch.setattr(selection, "_BRACKET_OOM", [])
    with caplog.at_level("WARNING"):
        got = selection.select_kv(q, k, lse, perm, 40, group_size=64, kv_tile=16)
        again = selection.select_kv(q, k, lse, perm, 40, group_size=64, kv_tile=16)
    assert torch.equal(got, want) and torch.equal(again, want)
    assert methods == [None, "radix", None, "radix"] and selection._RADIX_FAILED == []
    assert caplog.text.count("out of memory for the bracket") == 1
    methods.clear()
    monkeypatch.setattr(selection, "top_k_rows", lambda *a, **kw: tight(*a, **{**kw, "method": "bracket"}))
    with pytest.raises(torch.cuda.OutOfMemoryError):  # out of memory in the radix call itself
        selection.select_kv(q, k, lse, perm, 40, group_size=64, kv_tile=16, topk_method="radix")
    assert methods == ["bracket"] and selection._RADIX_FAILED == []


@pytest.mark.parametrize("exp,tol,stagger", [("fp32", 2e-3, False), ("f16_emulated", 4e-3, False),
                                             ("fp32", 2e-3, True)])
def test_pair_pass2_matches_float64(gen, exp, tol, stagger):
    """Two query groups per program: group sums within ``tol`` relative (L2) of float64 with an odd group count
    (the last program's second group is missing and must not be stored: its row of the output is a real group of
    another program), ragged S, every entry written (NaN poison); the packed-exp roundings (emulated) stay close;
    the staggered form (group 1 half a tile behind, its last tile after the loop) gives the same bits."""
    from comfyui_mc_sparse_pack.kernels.triton import selection

    S, C = 300, 64  # G = 5
    q, k = (torch.randn(1, 2, S, 32, generator=gen).to(torch.bfloat16) for _ in range(2))
    _, lse = reference.dense_attention(q.double(), k.double(), k.double(), return_lse=True)
    perm = _groups(gen, 1, 2, S, C)
    out = torch.full((1, 2, perm.shape[-1] // C, S), float("nan"))
    selection.group_prob_sums(q.to(DEVICE), k.to(DEVICE), lse.to(DEVICE), perm.to(DEVICE), group_size=C, out=out,
                              pair=True, exp=exp, block_n=64, pipelined=stagger)
    ref = reference.group_prob_sums(q.double(), k.double(), lse, perm, group_size=C)
    assert not out.isnan().any()
    one = selection.group_prob_sums(q.to(DEVICE), k.to(DEVICE), lse.to(DEVICE), perm.to(DEVICE), group_size=C,
                                    exp=exp, block_n=64).cpu()  # one group per program, same exponentials
    if DEVICE == "cpu":  # the interpreter sums in the same order: the same bits
        assert torch.equal(out, one)
    for g in range(ref.shape[2]):  # each group's row on its own (a swapped or shifted group fails here)
        assert float((out[:, :, g].double() - ref[:, :, g]).norm() / ref[:, :, g].norm()) < tol


def test_select_kv_pair_f16_is_exact_top_k_of_its_sums(gen):
    """select_kv with the pair kernel and half-precision exponentials (emulated on the CPU): still exactly the
    top-K of its own float16 sums, and >= 99.5 % of the float64 top-K's probability mass."""
    S, D, C, K = 260, 32, 64, 77
    q, k = (torch.randn(1, 2, S, D, generator=gen).to(torch.bfloat16) for _ in range(2))
    _, lse = reference.dense_attention(q.double(), k.double(), k.double(), return_lse=True)
    perm = _groups(gen, 1, 2, S, C)
    from comfyui_mc_sparse_pack.kernels.triton import selection

    idx = selection.select_kv(q, k, lse, perm, K, group_size=C, kv_tile=16, pair=True, exp="f16_emulated")
    sums16 = selection.group_prob_sums(q, k, lse, perm, group_size=C, pair=True, exp="f16_emulated").half()
    assert torch.equal(idx, ref_top_k_rows(sums16, K, idx.shape[-1]))
    exact = reference.group_prob_sums(q.double(), k.double(), lse, perm, group_size=C)
    kept = exact.gather(-1, idx[..., :K].long()).sum(-1)
    assert bool((kept >= 0.995 * exact.topk(K, -1).values.sum(-1)).all())


@pytest.mark.parametrize("cap,C,kw,want", [
    (None, 128, {}, ("pair", True, False, 0)), ((9, 0), 128, {}, ("pair", False, True, 0)),
    ((9, 0), 100, {}, ("pair", False, True, 0)), ((8, 9), 128, {}, ("fwd", None, None, False)),
    ((9, 0), 64, {"fp8": False}, ("fwd", None, None, False)),
    ((9, 0), 64, {"pair": True, "fp8": False}, ("pair", True, False, 0)),
    ((8, 0), 128, {"pair": True}, ("pair", True, False, 0)),
    ((9, 0), 128, {"pair": True, "pipelined": False, "fp8": False}, ("pair", False, False, 0)),
    ((9, 0), 128, {"pair": False, "fp8": False}, ("fwd", None, None, False)),
    ((9, 0), 128, {"pair": False, "pipelined": True, "fp8": False}, ("fwd", None, None, False)),
    ((9, 0), 128, {"poly": True, "fp8": False}, ("pair", True, False, 2)),
    ((9, 0), 128, {"poly": 1, "fp8": False}, ("pair", True, False, 1)),
    ((9, 0), 128, {"poly": 2, "pair": False, "fp8": False}, ("fwd", None, None, True)),
    ((9, 0), 128, {"fp8": True}, ("pair", False, True, 0)), ((8, 9), 128, {"fp8": True}, ("pair", False, True, 0)),
    ((9, 0), 128, {"fp8": True, "pair": False}, ("pair", False, True, 0)),
    ((9, 0), 128, {"fp8": True, "pipelined": True}, ("pair", True, True, 0)),
    ((9, 0), 128, {"fp8": None}, ("pair", False, True, 0)), ((8, 9), 128, {"fp8": None}, ("fwd", None, None, False)),
    (None, 128, {"fp8": None}, ("pair", True, False, 0)),
    ((8, 6), 128, {"fp8": True}, ("fwd", None, None, False)), ((9, 0), 200, {"fp8": True}, ("fwd", None, None, False)),
    ((9, 0), 128, {"fp8": True, "poly": 1}, ("pair", False, True, 1)),
    ((9, 0), 128, {"fp8": True, "D": 16}, ("pair", True, False, 0)),
])
def test_pass2_default_kernel_dispatch(gen, monkeypatch, cap, C, kw, want):
    """group_prob_sums' default: on sm_90+ the float8 two-group kernel unstaggered (C <= 128), under the
    interpreter and on sm_89 (fp8 not the default there) the staggered bf16 two-group kernel for 64 < C <= 128; one
    group per program below sm_90 and for C <= 64 (not measured there); explicit options win; poly runs on the
    kernel picked (its share with the pair kernel); fp8 forces the pair kernel, and is ignored below sm_89, for
    C > 128 and for a head dim the e4m3 MMA cannot take (16)."""
    from comfyui_mc_sparse_pack.kernels.triton import selection

    ran = []

    class Spy:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            def launch(*args, **meta):
                ran.append((self.name, meta.get("STAGGER"), meta.get("FP8"), meta["POLY"]))
                return self.kernel[grid](*args, **meta)
            return launch

    for name in ("pair", "fwd"):
        attr = f"_group_prob_sums_{name}"
        monkeypatch.setattr(selection, attr, Spy(name, getattr(selection, attr)))
    monkeypatch.setattr(selection, "_capability", lambda device: cap)
    monkeypatch.delenv("MC_SPARSE_PASS2_FP8", raising=False)
    D = kw.pop("D", 32)
    q, k = (torch.randn(1, 1, 70, D, generator=gen).to(torch.bfloat16) for _ in range(2))
    _, lse = reference.dense_attention(q.double(), k.double(), k.double(), return_lse=True)
    perm = _groups(gen, 1, 1, 70, C)
    selection.group_prob_sums(q, k, lse, perm, group_size=C, block_n=32, **kw)
    assert ran == [want]


def _fp8_dequantised_sums(selection, q, k, lse, perm, C, scale):
    """float64 group sums of what the float8 kernel multiplies: fp8_operands' copies dequantised, its shifted LSE and
    its per-key factor 2^kb (the smoothing of fp8_operands' docstring)."""
    q8, k8, _, lse_s, kb = selection.fp8_operands(q, k, lse, scale)
    _, qs = selection.fp8_stats(q)
    _, ks = selection.fp8_stats(k)
    deq = reference.group_prob_sums(q8.double() * qs.double()[..., None, None], k8.double() * ks.double()[..., None, None],
                                    lse_s.double(), perm, group_size=C, scale=scale)
    return deq * torch.exp2(kb.double())[:, :, None, :]


def _assert_pow2_scale(sc, amax):
    """The float8 scale rule: a power of two with amax / scale in (224, 448] (nothing saturates, at most one binade of
    e4m3's range unused), 1 where amax is 0."""
    mant, _ = torch.frexp(sc)
    assert bool((mant == 0.5).all()), sc  # powers of two
    ratio = torch.where(amax > 0, amax / sc, torch.full_like(amax, 448.0))
    assert bool(((ratio > 224) & (ratio <= 448)).all()), ratio
    assert bool((sc[amax == 0] == 1).all())


def test_fp8_scale_is_the_largest_power_of_two_that_fits():
    """fp8_stats' scale at the rule's edges: amax with mantissa 1.75 (exactly 448 after scaling), just above it (the
    next power of two: 224 < ratio), a power of two, a tiny head (amax < 2^-111: scale 1), all-equal rows (amax 0)."""
    from comfyui_mc_sparse_pack.kernels.triton import selection

    amax = torch.tensor([1.75, 1.75 * (1 + 2**-20), 1.0, 3.0 * 2.0**-30, 2.0**-120, 0.0, 448.0 * 2.0**40])
    x = torch.zeros(1, len(amax), 2, 32)
    x[0, :, 0, 0] = amax  # column 0 holds amax and -amax: mean 0, largest |x - mean| amax
    x[0, :, 1, 0] = -amax
    mean, sc = selection.fp8_stats(x.to(DEVICE))
    assert torch.equal(mean.cpu(), torch.zeros(1, len(amax), 32))
    assert sc.cpu()[0].tolist() == [2.0**-8, 2.0**-7, 2.0**-8, 2.0**-37, 1.0, 1.0, 2.0**40]


def test_fp8_operands_are_the_smoothed_rounded_copies(gen):
    """fp8_operands on strided [B, S, H*D] views (keys with a large shared component, as DiT keys have): q8 / k8 are
    (x - head mean) / head scale rounded to nearest even (bitwise torch's float8_e4m3fn cast of the same fp32
    quotient), every element written; the scale is the power of two that puts amax|x - mean| in (224, 448] (nothing
    saturates, no range wasted by a large constant column); an all-zero head gets scale 1 (no NaN); lse_s = lse - scale q . mean_k and kb = scale log2(e) mean_q . (k - mean_k), clamped
    to [-100, 100]; qf = q scale x k scale x softmax scale x log2(e)."""
    from comfyui_mc_sparse_pack.kernels.triton import selection

    B, H, S, SK, D = 2, 3, 70, 90, 32
    q = (torch.randn(B, S, H * D, generator=gen) * 3).to(torch.bfloat16).view(B, S, H, D).transpose(1, 2)
    k = (torch.randn(B, SK, H * D, generator=gen) + 4 * torch.randn(B, 1, H * D, generator=gen))
    k = k.to(torch.bfloat16).view(B, SK, H, D).transpose(1, 2)
    k[1, 2] = 0.0  # an all-zero head
    q[0, 1, :, 0] = 300.0  # a mean query that gives keys logits beyond the clamp
    lse = torch.randn(B, H, S, generator=gen)
    scale = 0.125
    q8, k8, qf, lse_s, kb = (t.cpu() for t in selection.fp8_operands(q.to(DEVICE), k.to(DEVICE), lse.to(DEVICE), scale))
    mq, qs = selection.fp8_stats(q)
    mk, ks = selection.fp8_stats(k)
    assert torch.allclose(mq.double(), q.double().mean(2), rtol=1e-5, atol=1e-5)
    assert torch.allclose(mk.double(), k.double().mean(2), rtol=1e-5, atol=1e-5)
    for x, m, sc in ((q, mq, qs), (k, mk, ks)):
        amax = (x.float() - m[:, :, None]).abs().amax((-2, -1))
        _assert_pow2_scale(sc, amax)
    assert float(ks[1, 2]) == 1.0
    assert q8.dtype == torch.float8_e4m3fn and q8.shape == (B, H, S, D) and k8.shape == (B, H, SK, D)
    want_q8 = ((q.float() - mq[:, :, None]) / qs[..., None, None]).to(torch.float8_e4m3fn)
    want_k8 = ((k.float() - mk[:, :, None]) / ks[..., None, None]).to(torch.float8_e4m3fn)
    assert torch.equal(q8.view(torch.uint8), want_q8.view(torch.uint8))
    assert torch.equal(k8.view(torch.uint8), want_k8.view(torch.uint8))
    assert not k8.float().isnan().any()
    assert torch.allclose(qf, qs * ks * scale * math.log2(math.e), rtol=1e-6, atol=0)
    want_lse = lse.double() - scale * (q.double() @ mk.double()[..., None]).squeeze(-1)
    assert torch.allclose(lse_s.double(), want_lse, rtol=1e-5, atol=1e-4)
    want_kb = scale * math.log2(math.e) * ((k.double() - mk.double()[:, :, None]) @ mq.double()[..., None]).squeeze(-1)
    assert float(want_kb.abs().max()) > 100  # the clamp is exercised
    assert torch.allclose(kb.double(), want_kb.clamp(-100, 100), rtol=1e-5, atol=1e-3)


def test_fp8_operands_unit_qf_moves_qf_into_the_copies(gen):
    """fp8_operands(unit_qf=True): qf exactly 1 where both scales can grow by t = sqrt(1 / qf) <= UNIT_MAX_T, the
    copies then (x - mean) x 1 / (scale t) rounded (within one e4m3 step of it) and their products the scores in
    log2 units about as close to the float64 ones as the default copies' products x qf; a head whose t would exceed
    UNIT_MAX_T keeps the default copies and qf bit for bit; lse_s and kb unchanged."""
    from comfyui_mc_sparse_pack.kernels.triton import selection

    B, H, S, SK, D = 1, 3, 70, 90, 32
    q = (torch.randn(B, H, S, D, generator=gen) * 3).to(torch.bfloat16)
    k = (torch.randn(B, H, SK, D, generator=gen) + 4 * torch.randn(B, H, 1, D, generator=gen)).to(torch.bfloat16)
    q[0, 2] = q[0, 2] * 1e-5  # tiny: t > UNIT_MAX_T
    k[0, 2] = k[0, 2] * 1e-5
    lse = torch.randn(B, H, S, generator=gen)
    scale = 0.125
    dev = [t.to(DEVICE) for t in (q, k, lse)]
    base = [t.cpu() for t in selection.fp8_operands(*dev, scale)]
    unit = [t.cpu() for t in selection.fp8_operands(*dev, scale, unit_qf=True)]
    assert torch.equal(unit[3], base[3]) and torch.equal(unit[4], base[4])
    t = (1 / base[2].double()).sqrt()
    assert float(t[0, 2]) > 1024 and float(t[0, :2].max()) <= 1024
    assert torch.equal(unit[2][0, :2], torch.ones(2)), unit[2]
    assert float(unit[2][0, 2]) == float(base[2][0, 2])
    assert torch.equal(unit[0][0, 2].view(torch.uint8), base[0][0, 2].view(torch.uint8))
    assert torch.equal(unit[1][0, 2].view(torch.uint8), base[1][0, 2].view(torch.uint8))
    mq, qs = selection.fp8_stats(q)
    mk, ks = selection.fp8_stats(k)
    exact = ((q.double() - mq.double()[:, :, None]) @ (k.double() - mk.double()[:, :, None]).transpose(-1, -2)
             * scale * math.log2(math.e))
    for h in range(2):
        want_q = (q[0, h].double() - mq[0, h].double()) / (float(qs[0, h]) * float(t[0, h]))
        step = want_q.abs().clamp_min(2.0**-6) * 2.0**-3  # one e4m3 step (subnormal spacing 2^-9 below 2^-6)
        assert bool(((unit[0][0, h].double() - want_q).abs() <= step).all())
        s_unit = unit[0][0, h].double() @ unit[1][0, h].double().T
        s_base = base[0][0, h].double() @ base[1][0, h].double().T * float(base[2][0, h])
        err_u = float((s_unit - exact[0, h]).norm() / exact[0, h].norm())
        err_b = float((s_base - exact[0, h]).norm() / exact[0, h].norm())
        assert err_u < 1.5 * err_b + 1e-3, (h, err_u, err_b)


def test_unit_qf_factors_send_only_safe_heads_to_the_fast_form():
    """``unit_qf_factors``: +1 for a head with qf exactly 1 whose ranges pass (min b + min kb > UNIT_LO, max b +
    max kb < UNIT_HI, b = -lse_s log2(e), kb = log2 of the keys' factors; one Triton launch), -qf for every other head:
    qf != 1 (by one ulp too), each bound crossed alone, a NaN / +-inf LSE, a NaN / inf / 0 / negative key factor, a
    NaN qf. Rows of 1100 / 40 values (two 1024-lane blocks, tails): the fast heads 8 / 9 sit where a masked lane read
    as a value would move the LSE's min (8: all LSEs > 1, keys up to 2^100) or max (9: all < 1, keys down to 2^-120)
    across a bound."""
    from comfyui_mc_sparse_pack.kernels.triton import selection

    gen = torch.Generator().manual_seed(7)
    lo, hi, log2e = selection.UNIT_LO.value, selection.UNIT_HI.value, math.log2(math.e)
    H, S, SK = 16, 1100, 40
    qf = torch.ones(1, H)
    qf[0, 1] = 0.25
    qf[0, 2] = float(torch.nextafter(torch.tensor(1.0), torch.tensor(2.0)))
    lse = 20 + torch.randn(1, H, S, generator=gen)  # b ~ -29
    kb2 = torch.exp2(torch.randn(1, H, SK, generator=gen))
    lse[0, 3, 1030] = (-lo + 1) / log2e  # min b + min kb <= UNIT_LO (scores could overflow); in the second block
    lse[0, 4, 7] = -(hi + 1) / log2e  # max b > UNIT_HI alone
    kb2[0, 5, 3] = 2.0 ** 100  # max kb + max b > UNIT_HI
    lse[0, 5, 0] = -(hi - 100 + 1) / log2e
    lse[0, 6, 1099] = float("nan")
    kb2[0, 7, 39] = float("nan")
    kb2[0, 8, 3] = 2.0 ** 100  # fast: max b + max kb = 100 - min lse log2(e) ~ 76 < UNIT_HI
    lse[0, 9] -= 40  # fast: min b + min kb = -120 - max lse log2(e) ~ -95 > UNIT_LO
    kb2[0, 9, 5] = 2.0 ** -120
    lse[0, 10, 2], lse[0, 11, 2] = float("inf"), float("-inf")
    kb2[0, 12, 1], kb2[0, 13, 1], kb2[0, 14, 1] = float("inf"), 0.0, -1.0
    qf[0, 15] = float("nan")
    got = selection.unit_qf_factors(qf.to(DEVICE), lse.to(DEVICE), kb2.to(DEVICE)).cpu()
    assert got.shape == (H,) and got.dtype == torch.float32
    want = -qf[0]
    want[[0, 8, 9]] = 1.0
    assert torch.equal(got[:15], want[:15]), got
    assert not bool(got[15] > 0), got  # a NaN qf: the default form (the kernel takes the fast one for qf > 0)
    # within the bounds by a margin: fast
    lse[0, 3, 1030] = (-lo - 10) / log2e
    assert selection.unit_qf_factors(qf.to(DEVICE), lse.to(DEVICE), kb2.to(DEVICE))[3] == 1.0


def test_fp8_operands_unit_signs_equal_unit_qf_factors(gen):
    """fp8_operands(unit_signs=True)'s sixth output (each quantising program's min / max / NaN count of the lse_s or
    2^kb values it wrote, reduced per head by _unit_qf_final) == unit_qf_factors on its own qf / lse_s / 2^kb, bit
    for bit, on B = 2 (b * H + h indexing) x 4 heads, ragged S / Sk (partial last blocks, 5 and 6 blocks of 64 rows):
    fast heads, an LSE whose max b crosses UNIT_HI alone, one whose min b + min kb crosses UNIT_LO (in q's last
    partial block; in k's by its last key's kb = -100), a NaN LSE, a NaN key row, a head with qf != 1 (tiny inputs:
    t > UNIT_MAX_T); twice; the other five outputs equal fp8_operands' without it. Without kb_pow2: ValueError.
    Mutations: the reduction missing the last block, q's last block counted as k's, the NaN count
    dropped: each fails."""
    from comfyui_mc_sparse_pack.kernels.triton import selection

    B, H, S, SK, D = 2, 4, 300, 330, 32
    lo, hi, log2e = selection.UNIT_LO.value, selection.UNIT_HI.value, math.log2(math.e)
    for rep in range(2):
        q = (torch.randn(B, H, S, D, generator=gen) * 3).to(torch.bfloat16)
        k = (torch.randn(B, H, SK, D, generator=gen) + 2 * torch.randn(B, H, 1, D, generator=gen)).to(torch.bfloat16)
        lse = 20 + torch.randn(B, H, S, generator=gen)
        lse[0, 1, 17] = -(hi + 1) / log2e  # max b > UNIT_HI
        lse[0, 2, S - 3] = (-lo + 40) / log2e  # min b + min kb < UNIT_LO, in the last (partial) block
        lse[1, 0, 100 + rep] = float("nan")
        k[1, 1, SK - 1] = float("nan")
        q[0, 3] += 2.0  # a mean query of norm ~11: the last key (last block, the head's last program in the
        k[0, 3, SK - 1] = -60 * q[0, 3].float().mean(0) / q[0, 3].float().mean(0).norm()  # interpreter) gets kb = -100
        q[1, 3], k[1, 3] = q[1, 3] * 1e-5, k[1, 3] * 1e-5  # qf != 1
        if rep:
            lse[0, 1, 17] = 20.0  # the head fast again: nothing of the first call left in the counters
        dev = [t.to(DEVICE) for t in (q, k, lse)]
        got = [t.cpu() for t in selection.fp8_operands(*dev, 0.125, kb_pow2=True, unit_qf=True, unit_signs=True)]
        plain = [t.cpu() for t in selection.fp8_operands(*dev, 0.125, kb_pow2=True, unit_qf=True)]
        assert len(got) == 6
        for a, b in zip(got[:5], plain):  # bit for bit, NaN where NaN
            torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=0, equal_nan=True)
        want = selection.unit_qf_factors(*(t.to(DEVICE) for t in plain[2:5])).cpu()
        torch.testing.assert_close(got[5], want, rtol=0, atol=0, equal_nan=True)
        assert want.shape == (B * H,) and bool((want[[0, 6]] == 1).all()), want
        assert bool((want[[2, 3, 4, 5]] < 0).all()) and not bool(want[7] == 1), want
        assert bool(want[1] == 1) == bool(rep), want
    with pytest.raises(ValueError, match="kb_pow2"):
        selection.fp8_operands(*dev, 0.125, unit_qf=True, unit_signs=True)


@pytest.mark.parametrize("stagger,poly", [(True, 0), (False, 0), (True, 1), (True, 2), (False, 1)])
def test_fp8_pair_pass2_is_exact_on_its_float8_operands(gen, stagger, poly):
    """The float8 pass 2 computes the exact group sums of its own smoothed float8 operands (fp32 accumulation of
    exact fp8 x fp8 products; relative error <= 2e-5 per group without the polynomial exponentials, 2e-4 with them),
    with B = 2 (the per-head factor is read at b * H + h), keys with a shared component (the per-key factor
    matters), an odd group count, ragged S, every entry written (NaN poison); and its top-K (K = 30 % of S) keeps
    >= 99.5 % of the exact top-K's probability mass."""
    from comfyui_mc_sparse_pack.kernels.triton import selection

    B, H, S, D, C = 2, 2, 300, 32, 64  # G = 5
    q = (torch.randn(B, H, S, D, generator=gen) + torch.randn(B, H, 1, D, generator=gen)).to(torch.bfloat16)
    k = torch.randn(B, H, S, D, generator=gen) * torch.rand(B, H, 1, 1, generator=gen) * 3
    k = (k + 2 * torch.randn(B, H, 1, D, generator=gen)).to(torch.bfloat16)
    _, lse = reference.dense_attention(q.double(), k.double(), k.double(), return_lse=True)
    lse = lse.float()
    perm = _groups(gen, B, H, S, C)
    out = torch.full((B, H, perm.shape[-1] // C, S), float("nan")).to(DEVICE)
    selection.group_prob_sums(q.to(DEVICE), k.to(DEVICE), lse.to(DEVICE), perm.to(DEVICE), group_size=C, out=out,
                              fp8=True, pipelined=stagger, poly=poly, block_n=64)
    out = out.cpu()
    assert not out.isnan().any()
    deq = _fp8_dequantised_sums(selection, q, k, lse, perm, C, D**-0.5)
    tol = 2e-4 if poly else 2e-5
    for g in range(deq.shape[2]):  # each group's row on its own
        assert float((out[:, :, g].double() - deq[:, :, g]).norm() / deq[:, :, g].norm()) < tol
    exact = reference.group_prob_sums(q.double(), k.double(), lse.double(), perm, group_size=C)
    kept = exact.gather(-1, out.topk(90, -1).indices).sum(-1)
    assert bool((kept >= 0.995 * exact.topk(90, -1).values.sum(-1)).all())


@pytest.mark.parametrize("poly", [1, 2])
def test_pair_pass2_polynomial_share_matches_float64(gen, poly):
    """The pair kernel with a quarter (group 1's odd query columns) or half (all of group 1) of the exponentials on
    the FMA pipe: each group's sums within 1e-4 of float64 (the polynomial's 4e-5), odd G, every entry written."""
    from comfyui_mc_sparse_pack.kernels.triton import selection

    S, C = 300, 64
    q, k = (torch.randn(1, 2, S, 32, generator=gen).to(torch.bfloat16) for _ in range(2))
    _, lse = reference.dense_attention(q.double(), k.double(), k.double(), return_lse=True)
    perm = _groups(gen, 1, 2, S, C)
    out = torch.full((1, 2, perm.shape[-1] // C, S), float("nan")).to(DEVICE)
    selection.group_prob_sums(q.to(DEVICE), k.to(DEVICE), lse.to(DEVICE), perm.to(DEVICE), group_size=C, out=out,
                              pair=True, poly=poly, block_n=64)
    out = out.cpu()
    ref = reference.group_prob_sums(q.double(), k.double(), lse, perm, group_size=C)
    assert not out.isnan().any()
    for g in range(ref.shape[2]):
        assert float((out[:, :, g].double() - ref[:, :, g]).norm() / ref[:, :, g].norm()) < 1e-4


def test_fp8_default_switch(monkeypatch):
    """MC_SPARSE_PASS2_FP8 = 1 / 0 overrides the measured default (float8 on sm_90+, not on sm_89 nor under the
    interpreter); never below sm_89; other values are errors."""
    from comfyui_mc_sparse_pack.kernels.triton import selection

    monkeypatch.setenv("MC_SPARSE_PASS2_FP8", "1")
    assert selection.fp8_default((9, 0)) and selection.fp8_default((8, 9)) and selection.fp8_default(None)
    assert not selection.fp8_default((8, 0))
    monkeypatch.setenv("MC_SPARSE_PASS2_FP8", "0")
    assert not selection.fp8_default((9, 0))
    monkeypatch.setenv("MC_SPARSE_PASS2_FP8", "yes")
    with pytest.raises(ValueError, match="MC_SPARSE_PASS2_FP8"):
        selection.fp8_default((9, 0))
    monkeypatch.delenv("MC_SPARSE_PASS2_FP8")
    assert selection.fp8_default((9, 0)) == selection._FP8_DEFAULT and selection.fp8_default((10, 0))
    assert not selection.fp8_default((8, 9)) and not selection.fp8_default(None)


def _digit_hist_reference(sums16):
    """int32 [..., HIST_BINS] histogram of the top 8 bits of float16 sums' order keys (negatives as key 0)."""
    key = sums16.view(torch.int16).to(torch.int32).clamp_min(0) >> 8
    return torch.nn.functional.one_hot(key.long(), 128).sum(-2).to(torch.int32)


@pytest.mark.parametrize("stagger,fp8", [(True, False), (False, False), (True, True)])
def test_pass2_counts_the_first_digit_histogram(gen, stagger, fp8):
    """The pair kernel's first-digit histogram (hist=) is exactly the histogram of the top 8 bits of the float16
    sums it stored, per group (odd G: the missing group's row untouched; ragged S: keys past Sk not counted); the
    one-group kernel writes zeros."""
    from comfyui_mc_sparse_pack.kernels.triton import selection

    S, C = 300, 64  # G = 5
    q, k = (torch.randn(1, 2, S, 32, generator=gen).to(torch.bfloat16) for _ in range(2))
    _, lse = reference.dense_attention(q.double(), k.double(), k.double(), return_lse=True)
    lse = lse.float()
    perm = _groups(gen, 1, 2, S, C)
    G = perm.shape[-1] // C
    sums = torch.full((1, 2, G, S), float("nan"), dtype=torch.float16).to(DEVICE)
    hist = torch.full((1, 2, G, 128), -7, dtype=torch.int32).to(DEVICE)
    selection.group_prob_sums(q.to(DEVICE), k.to(DEVICE), lse.to(DEVICE), perm.to(DEVICE), group_size=C, out=sums,
                              hist=hist, pair=True, pipelined=stagger, fp8=fp8, block_n=64)
    sums, hist = sums.cpu(), hist.cpu()
    assert not sums.isnan().any()
    assert torch.equal(hist, _digit_hist_reference(sums))
    one = torch.full((1, 2, G, 128), -7, dtype=torch.int32)
    selection.group_prob_sums(q, k, lse, perm, group_size=C, hist=one, pair=False, fp8=False, block_n=64)
    assert bool((one == 0).all())


def test_radix_top_k_with_a_given_first_digit_histogram(gen):
    """top_k_rows(hist=...): with the true first-digit histogram the radix method skips its first pass and is still
    the brute-force top-K (ties included); with a histogram whose counts do not add up to Sk (zeros, doubled) it
    recounts and stays exact; a wrong histogram that adds up to Sk is believed (the pass is really skipped) and
    still writes nothing past K; a misshapen hist is a ValueError."""
    sums = _tied_sums(gen, 6, 1500, torch.float16, levels=40)
    sums[2] = sums[2].abs() * torch.rand(1500, generator=gen).to(torch.float16)
    true = _digit_hist_reference(sums)
    want = _brute_force(sums, 300, 320)
    for hist in (true, torch.zeros_like(true), 2 * true):
        out = torch.full((6, 320), POISON, dtype=torch.int32)
        got = triton_topk.top_k_rows(sums.to(DEVICE), 300, 320, out=out.to(DEVICE), method="radix",
                                     hist=hist.contiguous().to(DEVICE)).cpu()
        assert torch.equal(got, want)
    # a histogram that adds up to Sk but is wrong is believed (proof that the pass is skipped): a wrong threshold,
    # yet no write past K (the compaction's guard) and no crash
    wrong = torch.zeros_like(true)
    wrong[:, 0] = 1500
    out = torch.full((6, 320), POISON, dtype=torch.int32)
    got = triton_topk.top_k_rows(sums.to(DEVICE), 300, 320, out=out.to(DEVICE), method="radix",
                                 hist=wrong.to(DEVICE)).cpu()
    assert not torch.equal(got, want) and bool((got[:, 300:] == -1).all())
    with pytest.raises(ValueError, match="hist must be"):
        triton_topk.top_k_rows(sums, 300, 320, method="radix", hist=true[:, :64])


@pytest.mark.parametrize("fp8", [False, True])
def test_select_kv_with_the_pass2_histogram_is_unchanged(gen, fp8):
    """select_kv(topk_hist=True) gives exactly the selection of select_kv(topk_hist=False) (both the exact top-K of
    the same float16 sums), with head chunks (a partial last chunk) and B = 2."""
    from comfyui_mc_sparse_pack.kernels.triton import selection

    B, H, S, C, K = 2, 3, 260, 64, 77
    q, k = (torch.randn(B, H, S, 32, generator=gen).to(torch.bfloat16) for _ in range(2))
    _, lse = reference.dense_attention(q.double(), k.double(), k.double(), return_lse=True)
    lse = lse.float()
    perm = _groups(gen, B, H, S, C)
    kw = dict(group_size=C, kv_tile=16, heads_per_chunk=2, fp8=fp8, pair=True)
    with_hist = selection.select_kv(q, k, lse, perm, K, topk_hist=True, **kw)
    without = selection.select_kv(q, k, lse, perm, K, topk_hist=False, topk_method="radix", **kw)
    assert torch.equal(with_hist, without)
    sums16 = selection.group_prob_sums(q, k, lse, perm, group_size=C, fp8=fp8, pair=True).half()
    assert torch.equal(with_hist, ref_top_k_rows(sums16, K, with_hist.shape[-1]))


@pytest.mark.parametrize("fp8,cap,one_group,rpt,cand_count", [
    (False, None, False, 1, False), (True, 16, False, 1, False), (True, None, True, 1, False),
    (True, None, True, 2, False), (True, None, True, 1, True), (True, None, True, 1, 2)])
def test_pass2_fused_top_k_is_the_top_k_of_its_sums(gen, fp8, cap, one_group, rpt, cand_count):
    """group_prob_sums(select=topk.FusedRows): the pair kernel's epilogue writes each group's top-K of the float16 sums
    it stored (B = 2, 9 groups: the last pair has one group; 16-byte rows, one whole 1024-key tile and a partial one),
    and ``finish`` the rows whose bracket missed (cap 16: every row overflows its candidate slots and goes to the radix
    launch; default cap: none does), also with one group per program (one_group), two tile rows per thread (rpt:
    one masked 2048-key step) and the threshold among the candidates by counting (cand_count: one / two bits per
    pass): the brute-force top-K
    of the same sums, every slot written (poisoned first);
    select_kv(topk_fused=True) == select_kv(topk_fused=False)."""
    from comfyui_mc_sparse_pack.kernels.triton import selection, topk

    B, H, S, C, K, width = 2, 1, 1096, 128, 300, 320
    G = -(-S // C)
    q, k = (torch.randn(B, H, S, 32, generator=gen).to(torch.bfloat16) for _ in range(2))
    _, lse = reference.dense_attention(q.double(), k.double(), k.double(), return_lse=True)
    lse = lse.float()
    perm = _groups(gen, B, H, S, C)
    sums = torch.full((B, H, G, S), float("nan"), dtype=torch.float16)
    plan = topk.bracket_plan(S, K, 2, cap=cap or (1024 if cand_count else None))  # (count: a multiple of its step)
    fused = topk.FusedRows(torch.full((B, H, G, width), POISON, dtype=torch.int32), K, width, plan,
                           torch.empty(B * H * G, plan[4], dtype=torch.int16), torch.empty(B * H * G, dtype=torch.int8),
                           rows_per_thread=rpt, cand_count=cand_count)
    selection.group_prob_sums(q, k, lse, perm, group_size=C, out=sums, fp8=fp8, pair=True, select=fused,
                              one_group=one_group)
    assert fused.done
    assert fused.flags.tolist() == [int(cap is not None)] * (B * H * G)
    fused.finish(sums)
    assert torch.equal(fused.out, _brute_force(sums, K, width))
    if not fp8:
        kw = dict(group_size=C, kv_tile=64, fp8=fp8, pair=True)
        assert torch.equal(selection.select_kv(q, k, lse, perm, K, topk_fused=True, **kw),
                           selection.select_kv(q, k, lse, perm, K, topk_fused=False, **kw))


def test_select_kv_fused_top_k_options_keep_the_selection(gen, monkeypatch):
    """select_kv's fused top-K options (the path of sm_90, forced here): topk_z (the bracket's half-width: 4 sigma, and
    1 sigma, where rows fall back), topk_count=False and topk_stride (fewer samples; fused and separate) give the
    defaults' selection, the brute-force top-K of the same float16 sums."""
    from comfyui_mc_sparse_pack.kernels.triton import selection

    monkeypatch.setattr(selection, "_capability", lambda device: (9, 0))
    B, H, S, C, K = 1, 2, 300, 128, 70
    q, k = (torch.randn(B, H, S, 32, generator=gen).to(torch.bfloat16) for _ in range(2))
    _, lse = reference.dense_attention(q.double(), k.double(), k.double(), return_lse=True)
    perm = _groups(gen, B, H, S, C)
    kw = dict(group_size=C, kv_tile=64, fp8=False)
    got = selection.select_kv(q, k, lse.float(), perm, K, **kw)
    sums16 = selection.group_prob_sums(q, k, lse.float(), perm, group_size=C, fp8=False).half()
    assert torch.equal(got, ref_top_k_rows(sums16, K, got.shape[-1]))
    for opts in (dict(topk_z=4.0), dict(topk_z=1.0), dict(topk_count=False)):
        assert torch.equal(selection.select_kv(q, k, lse.float(), perm, K, **opts, **kw), got), opts
    # topk_stride: the bracket's keys per sample reach its plan, fused and separate, and keep the selection
    from comfyui_mc_sparse_pack.kernels.triton import topk

    strides, plan = [], topk.bracket_plan
    monkeypatch.setattr(topk, "bracket_plan", lambda *a, **k_: strides.append(k_.get("stride")) or plan(*a, **k_))
    for fused in (True, False):
        assert torch.equal(selection.select_kv(q, k, lse.float(), perm, K, topk_stride=7, topk_fused=fused, **kw),
                           got), fused
    assert strides == [7, 7], strides


@pytest.mark.parametrize("cap,want", [((9, 0), True), ((8, 9), False), (None, False)])
def test_select_kv_fuses_the_top_k_by_default_on_sm90(gen, monkeypatch, cap, want):
    """select_kv's default: the top-K fused into the pair pass-2 kernel on sm_90+ (measured there), the separate
    top-K under the interpreter and below sm_90; topk_fused=False always separate; the selection is the same."""
    from comfyui_mc_sparse_pack.kernels.triton import selection

    calls, real = [], selection.group_prob_sums

    def spy(*args, **kw):
        calls.append(kw.get("select") is not None)
        return real(*args, **kw)

    monkeypatch.setattr(selection, "group_prob_sums", spy)
    monkeypatch.setattr(selection, "_capability", lambda device: cap)
    B, H, S, C, K = 1, 1, 300, 128, 70
    q, k = (torch.randn(B, H, S, 32, generator=gen).to(torch.bfloat16) for _ in range(2))
    _, lse = reference.dense_attention(q.double(), k.double(), k.double(), return_lse=True)
    perm = _groups(gen, B, H, S, C)
    kw = dict(group_size=C, kv_tile=64, fp8=False)
    got = selection.select_kv(q, k, lse.float(), perm, K, **kw)
    off = selection.select_kv(q, k, lse.float(), perm, K, topk_fused=False, **kw)
    assert calls == [want, False]
    assert torch.equal(got, off)


# ``kernels/triton/topk_seg.py`` (the separate top-K's "seg" form, select_kv's default since session 13): exactly the
# brute force on every path (bracket hits, fallbacks, a warp's slots overflowing, warp parts past the row, ties at T
# split across warps), and rows it does not take (float32, unaligned) on the bracket method.


def _run_seg(sums, k, width, **kw):
    out = torch.full((*sums.shape[:-1], width), POISON, dtype=torch.int32)
    got, fell = triton_topk.top_k_rows(sums.to(DEVICE), k, width, out=out.to(DEVICE), method="seg",
                                       return_fallbacks=True, **kw)
    return got.cpu(), fell.cpu()


def test_seg_top_k_equals_brute_force(gen):
    """Rows of 2056 keys (two 256-key steps per warp at 2 warps, the last warp's quarter not full) at K = 700:
    distinct values (bracket hit), ties drawn from 300 levels (ties at T split across warps), -0.0 and negatives
    (rank as +0.0), a constant row (every key a copy, all tied at T), the sampled positions 0 and every other key
    larger (the bracket below the K-th key: fallback), three values (ties at T in every warp's quarter),
    30 % of the keys above 0 and the rest +-0.0 (T = 0: the zero padding of the candidate slots is >= T too)."""
    sk, k, width = 2056, 700, 768
    sums = torch.rand(7, sk, generator=gen, dtype=torch.float64) + 0.5
    vals = torch.rand(300, generator=gen, dtype=torch.float64) * 3.0
    sums[1] = vals[torch.randint(0, 300, (sk,), generator=gen)]
    sums[2] = vals[torch.randint(0, 300, (sk,), generator=gen)]
    sums[2, ::5] = -0.0
    sums[2, 1::7] = -1.5
    sums[3] = 0.75
    pos = triton_topk.sample_positions(sk, 4)
    sums[4, pos] = 0.0
    sums[5] = vals[torch.randint(0, 3, (sk,), generator=gen)]  # three values: many ties at T across every warp
    sums[6] = torch.where(torch.rand(sk, generator=gen) < 0.3, sums[6], 0.0)  # fewer than K above 0: T = +0.0
    sums[6, 3::11] = -0.0
    sums = sums.to(torch.float16)
    got, fell = _run_seg(sums, k, width, sample_stride=4, num_warps=2, cap=2048)  # (every key a copy in row 3)
    assert torch.equal(got, _brute_force(sums, k, width))
    assert fell.tolist() == [0, 0, 0, 0, 1, 0, 0], fell


@pytest.mark.parametrize("prefetch", [True, False])
def test_seg_top_k_ties_at_zero_across_warps(gen, prefetch):
    """T = +0.0 with the kept zeros in both warps' quarters (2 warps, quarters of 1280 keys): the first quarter 20
    zeros and -0.0 among positives, the second mostly zeros: the second warp's first tie rank counts the first
    quarter's zeros only (the candidate slots' zero padding is >= 0 too: counted, the second warp keeps too few).
    Mutation: the zero padding counted as copies == T fails. With and without the next step's load issued first."""
    sk, k, width = 2056, 1500, 1536
    sums = torch.rand(3, sk, generator=gen, dtype=torch.float64) + 0.5
    for r in range(3):
        zeros = torch.randperm(1280, generator=gen)[:20]
        sums[r, zeros] = 0.0 if r else -0.0
        sums[r, 1280:] = torch.where(torch.rand(sk - 1280, generator=gen) < 0.13, sums[r, 1280:], 0.0)
    sums = sums.to(torch.float16)
    got, fell = _run_seg(sums, k, width, num_warps=2, prefetch=prefetch, cap=2048)  # (~700 zeros a warp: copies)
    assert torch.equal(got, _brute_force(sums, k, width))
    assert fell.tolist() == [0, 0, 0], fell


def test_seg_top_k_slot_overflow_and_plan(gen):
    """A warp with more copies than its slots (256, wide bracket) flags the row (radix launch), still exact;
    ``seg_plan``: whole 256-key steps per warp quarter, slots >= twice a warp's share."""
    sk, k, width = 1024, 300, 320
    sums = (torch.rand(3, sk, generator=gen, dtype=torch.float64) + 0.5).to(torch.float16)
    got, fell = _run_seg(sums, k, width, cap=256, num_warps=1, z=20.0)  # (one warp, most of its 1024 keys inside)
    assert torch.equal(got, _brute_force(sums, k, width))
    assert fell.tolist() == [1, 1, 1]
    for warps in (4, 8):  # (8: quarters of one 256-key step, the last four warps past the row)
        got, fell = _run_seg(sums, k, width, num_warps=warps)
        assert torch.equal(got, _brute_force(sums, k, width)) and fell.tolist() == [0, 0, 0]
    assert topk_seg.seg_plan(32760, 5280, 4) == (32, 4096)
    assert topk_seg.seg_plan(75600, 12210, 4) == (74, 8192)
    assert topk_seg.seg_plan(1024, 10, 4) == (1, 512)


@pytest.mark.parametrize("dtype,sk", [(torch.float32, 1024), (torch.float16, 1003)])
def test_seg_top_k_other_rows_take_the_bracket_method(gen, dtype, sk):
    """float32 sums and rows whose length is not a multiple of 8 run the bracket method (same result)."""
    sums = (torch.rand(2, sk, generator=gen, dtype=torch.float64) + 0.5).to(dtype)
    got, _ = _run_seg(sums, 100, 128)
    assert torch.equal(got, _brute_force(sums, 100, 128))
