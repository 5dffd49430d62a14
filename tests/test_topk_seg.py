"""``kernels/triton/topk_seg.py`` (the separate top-K's "seg" form) under TRITON_INTERPRET=1 (CPU): exactly the
brute-force top-K of the same float16 sums (ties to the lower token index, every slot written, outputs poisoned
first) on every path: bracket hits, rows the counts send to the radix launch, a thread's candidate slots overflowing,
rows that do not fill the last warp's quarter, and rows the form does not take (float32, unaligned: the bracket
method)."""

from __future__ import annotations

import pytest
import torch
from comfyui_mc_sparse_pack.kernels import registry
from comfyui_mc_sparse_pack.kernels.reference.topk import top_k_rows as ref_top_k_rows

triton_backend = next(b for b in registry.backends() if b.name == "triton")
pytestmark = pytest.mark.skipif(
    bool(triton_backend.unavailable_reason), reason=f"triton backend unavailable: {triton_backend.unavailable_reason}"
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
POISON = -7

from comfyui_mc_sparse_pack.kernels.triton import topk, topk_seg  # noqa: E402  (after the skip marker)


def _brute_force(sums: torch.Tensor, k: int, width: int) -> torch.Tensor:
    """Python-sorted top-K by (value desc, index asc) per row; the definition the kernels must match."""
    rows = sums.double().clamp_min(0).reshape(-1, sums.shape[-1]).tolist()
    out = []
    for row in rows:
        keep = sorted(sorted(range(len(row)), key=lambda j: (-row[j], j))[:k])
        out.append(keep + [-1] * (width - k))
    return torch.tensor(out, dtype=torch.int32).reshape(*sums.shape[:-1], width)


def _run(sums, k, width, **kw):
    out = torch.full((*sums.shape[:-1], width), POISON, dtype=torch.int32)
    got, fell = topk.top_k_rows(sums.to(DEVICE), k, width, out=out.to(DEVICE), method="seg", return_fallbacks=True,
                                **kw)
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
    pos = topk.sample_positions(sk, 4)
    sums[4, pos] = 0.0
    sums[5] = vals[torch.randint(0, 3, (sk,), generator=gen)]  # three values: many ties at T across every warp
    sums[6] = torch.where(torch.rand(sk, generator=gen) < 0.3, sums[6], 0.0)  # fewer than K above 0: T = +0.0
    sums[6, 3::11] = -0.0
    sums = sums.to(torch.float16)
    got, fell = _run(sums, k, width, sample_stride=4, num_warps=2, cap=2048)  # (every key a copy in row 3)
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
    got, fell = _run(sums, k, width, num_warps=2, prefetch=prefetch, cap=2048)  # (~700 zeros a warp: copies)
    assert torch.equal(got, _brute_force(sums, k, width))
    assert fell.tolist() == [0, 0, 0], fell


def test_seg_top_k_slot_overflow_and_plan(gen):
    """A warp with more copies than its slots (256, wide bracket) flags the row (radix launch), still exact;
    ``seg_plan``: whole 256-key steps per warp quarter, slots >= twice a warp's share."""
    sk, k, width = 1024, 300, 320
    sums = (torch.rand(3, sk, generator=gen, dtype=torch.float64) + 0.5).to(torch.float16)
    got, fell = _run(sums, k, width, cap=256, num_warps=1, z=20.0)  # (one warp, most of its 1024 keys inside)
    assert torch.equal(got, _brute_force(sums, k, width))
    assert fell.tolist() == [1, 1, 1]
    for warps in (4, 8):  # (8: quarters of one 256-key step, the last four warps past the row)
        got, fell = _run(sums, k, width, num_warps=warps)
        assert torch.equal(got, _brute_force(sums, k, width)) and fell.tolist() == [0, 0, 0]
    assert topk_seg.seg_plan(32760, 5280, 4) == (32, 4096)
    assert topk_seg.seg_plan(75600, 12210, 4) == (74, 8192)
    assert topk_seg.seg_plan(1024, 10, 4) == (1, 512)


@pytest.mark.parametrize("dtype,sk", [(torch.float32, 1024), (torch.float16, 1003)])
def test_seg_top_k_other_rows_take_the_bracket_method(gen, dtype, sk):
    """float32 sums and rows whose length is not a multiple of 8 run the bracket method (same result)."""
    sums = (torch.rand(2, sk, generator=gen, dtype=torch.float64) + 0.5).to(dtype)
    got, _ = _run(sums, 100, 128)
    assert torch.equal(got, _brute_force(sums, 100, 128))
