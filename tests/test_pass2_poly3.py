"""Pass 2's degree-3 FMA-pipe exponential (``kernels/triton/selection._exp2_poly3``) and the pair kernel's
``poly3`` shares under TRITON_INTERPRET=1 (CPU) against float64 (issue 15).

- ``_exp2_poly3`` itself: relative error < 7.6e-5 of 2^x on [-125, 127] (dense grid, integers and half-integers
  included), 2^-125 (to the same bound) below -125 (the clamp), every element written.
- the float8 pair kernel with ``poly3`` = (g0, g1) eighths on the polynomial: sums within 1e-4 relative L2 per group
  of the same kernel without it (float64-checked too), never bit-identical to it (the polynomial really runs), odd
  group count and ragged S, every entry written (NaN poison).
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from comfyui_mc_sparse_pack.kernels import reference, registry
from comfyui_mc_sparse_pack.kernels.triton.selection import _exp2_poly3

triton_backend = next(b for b in registry.backends() if b.name == "triton")
pytestmark = pytest.mark.skipif(
    bool(triton_backend.unavailable_reason), reason=f"triton backend unavailable: {triton_backend.unavailable_reason}"
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _selection():
    from comfyui_mc_sparse_pack.kernels.triton import selection

    return selection


@triton.jit
def _poly3_kernel(X, Y, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    tl.store(Y + offs, _exp2_poly3(tl.load(X + offs, mask=ok, other=0.0)), mask=ok)


def test_exp2_poly3_error_bound():
    """2^x by ``_exp2_poly3`` within 7.6e-5 relative of float64 on [-125, 127]; 2^-125 below (its clamp)."""
    kern = _poly3_kernel
    x = torch.cat([torch.linspace(-125, 127, 60001, dtype=torch.float64), torch.arange(-125, 128).double(),
                   torch.arange(-125, 127).double() + 0.5, torch.tensor([-0.0, 1e-7, -1e-7, 0.4999999])]).float()
    y = torch.full_like(x, float("nan"))
    kern[(triton.cdiv(x.numel(), 1024),)](x.to(DEVICE), y_dev := y.to(DEVICE), x.numel(), BLOCK=1024)
    y = y_dev.cpu()
    assert not y.isnan().any()
    rel = (y.double() / torch.exp2(x.double()) - 1).abs()
    assert float(rel.max()) < 7.6e-5, float(rel.max())
    below = torch.tensor([-125.5, -126.0, -200.0, -1e30, float("-inf")])
    yb = torch.full_like(below, float("nan"))
    kern[(1,)](below.to(DEVICE), yb_dev := yb.to(DEVICE), below.numel(), BLOCK=16)
    assert float((yb_dev.cpu().double() / 2.0**-125 - 1).abs().max()) < 7.6e-5


def test_pair_kernel_poly3_shares_match_float64(gen):
    """The float8 pair kernel with ``poly3``: its sums within 1e-4 relative L2 (per group) of the same kernel on MUFU
    exponentials, and close to float64 of its own operands; not the same bits (the polynomial ran); every entry
    written; odd group count (the last program's missing second group is not stored)."""
    sel = _selection()
    S, C, D = 330, 128, 32  # G = 3 (odd), ragged last tile and group
    q = (torch.randn(1, 2, S, D, generator=gen) + torch.randn(1, 2, 1, D, generator=gen)).to(torch.bfloat16)
    k = (torch.randn(1, 2, S, D, generator=gen) + 2 * torch.randn(1, 2, 1, D, generator=gen)).to(torch.bfloat16)
    _, lse = reference.dense_attention(q.double(), k.double(), k.double(), return_lse=True)
    lse = lse.float()
    perm = torch.stack([torch.cat([torch.randperm(S, generator=gen), torch.full((3 * C - S,), -1)]) for _ in range(2)])
    perm = perm.to(torch.int32)[None]
    args = (q.to(DEVICE), k.to(DEVICE), lse.to(DEVICE), perm.to(DEVICE))
    base = torch.full((1, 2, 3, S), float("nan"), device=DEVICE)
    sel.group_prob_sums(*args, group_size=C, out=base, fp8=True, pipelined=False)
    assert not base.isnan().any()
    q8, k8, _, lse_s, kb = sel.fp8_operands(*args[:3], D**-0.5)
    (_, qs), (_, ks) = sel.fp8_stats(args[0]), sel.fp8_stats(args[1])
    deq = reference.group_prob_sums(q8.double() * qs.double()[..., None, None],
                                    k8.double() * ks.double()[..., None, None], lse_s.double(), args[3], group_size=C)
    deq = deq * torch.exp2(kb.double())[:, :, None, :]
    # group 1's odd tiles / group 0's even tiles (S = 330: tiles 0-5), and the odd columns of every tile
    for poly3 in ((0, 2), (2, 0), (4, 4)):
        got = torch.full_like(base, float("nan"))
        sel.group_prob_sums(*args, group_size=C, out=got, fp8=True, pipelined=False, poly3=poly3)
        assert not got.isnan().any()
        for g in range(3):
            diff = got[:, :, g].double() - base[:, :, g].double()
            rel = float(diff.norm() / base[:, :, g].double().norm())
            assert rel < 1e-4, (poly3, g, rel)
            # the polynomial ran on the group(s) it names, and only there
            assert bool((diff != 0).any()) == (poly3[g % 2] > 0), (poly3, g)
            if poly3[g % 2] == 2:  # every other 64-key tile: group 0's even tiles, group 1's odd ones, bit-equal elsewhere
                tiles = torch.arange(S) // 64
                assert bool((diff[..., tiles % 2 != g % 2] == 0).all()), (poly3, g)
                assert bool((diff[..., tiles % 2 == g % 2] != 0).any()), (poly3, g)
        rel = (got.double() - deq).norm(dim=-1) / deq.norm(dim=-1)
        assert float(rel.max()) < 2e-4, (poly3, float(rel.max()))


def test_poly3_rejects_bad_shares(gen):
    sel = _selection()
    q = torch.randn(1, 1, 40, 32, generator=gen).to(torch.bfloat16)
    lse = torch.zeros(1, 1, 40)
    perm = torch.arange(40, dtype=torch.int32)[None, None]
    for bad in ((0, 1), (3, 0), (0, 0, 0)):
        with pytest.raises(ValueError, match="poly3"):
            sel.group_prob_sums(q, q, lse, perm, group_size=40, poly3=bad)
    with pytest.raises(ValueError, match="pair kernel"):
        sel.group_prob_sums(q, q, lse, perm, group_size=40, poly3=(0, 4), pair=False, fp8=False)


def test_fp8_operands_kb_pow2(gen):
    """``fp8_operands(kb_pow2=True)``: the same operands with 2^kb in place of kb (what the Triton pair kernel reads
    by default, KB_POW2); the pair kernel on either form gives the same sums."""
    sel = _selection()
    S, C, D = 200, 128, 32
    q = (torch.randn(1, 2, S, D, generator=gen) + torch.randn(1, 2, 1, D, generator=gen)).to(torch.bfloat16)
    k = (torch.randn(1, 2, S, D, generator=gen) + 3 * torch.randn(1, 2, 1, D, generator=gen)).to(torch.bfloat16)
    lse = torch.randn(1, 2, S, generator=gen) + 6.0
    a = sel.fp8_operands(q.to(DEVICE), k.to(DEVICE), lse.to(DEVICE), D**-0.5)
    b = sel.fp8_operands(q.to(DEVICE), k.to(DEVICE), lse.to(DEVICE), D**-0.5, kb_pow2=True)
    for x, y in zip(a[:4], b[:4]):
        assert torch.equal(x.float(), y.float())
    assert float(a[4].abs().max()) > 0.5  # a real per-key term
    assert torch.allclose(b[4].double(), torch.exp2(a[4].double()), rtol=1e-6, atol=0)


def _three_group_inputs(gen, S=330, C=128, D=32):
    """(q, k, lse, perm) on DEVICE for pass 2: 2 heads, G = 3 query groups of C (the last one ragged, -1 padded)."""
    q = (torch.randn(1, 2, S, D, generator=gen) + torch.randn(1, 2, 1, D, generator=gen)).to(torch.bfloat16)
    k = torch.randn(1, 2, S, D, generator=gen).to(torch.bfloat16)
    lse = (torch.randn(1, 2, S, generator=gen) + 7.0).float()
    perm = torch.stack([torch.cat([torch.randperm(S, generator=gen), torch.full((3 * C - S,), -1)]) for _ in range(2)])
    return q.to(DEVICE), k.to(DEVICE), lse.to(DEVICE), perm.to(torch.int32)[None].to(DEVICE)


def test_one_group_kernel_equals_the_pair_kernel(gen):
    """``one_group=True`` (one query group per program, the pair kernel's ONE_GROUP): the same bits as the pair kernel
    (the same per-group arithmetic), odd group count, every entry written; refused with the pair-only options."""
    sel = _selection()
    S, C = 330, 128  # G = 3
    args = _three_group_inputs(gen, S, C)
    want = torch.full((1, 2, 3, S), float("nan"), device=DEVICE)
    sel.group_prob_sums(*args, group_size=C, out=want, fp8=True, pipelined=False)
    got = torch.full_like(want, float("nan"))
    sel.group_prob_sums(*args, group_size=C, out=got, fp8=True, pipelined=False, one_group=True)
    assert not got.isnan().any() and torch.equal(got, want)
    with pytest.raises(ValueError, match="one_group"):
        sel.group_prob_sums(*args, group_size=C, fp8=True, pipelined=True, one_group=True)
    # with the top-K fused into the kernel's epilogue: the same selection as the pair kernel + separate top-K
    kw = dict(group_size=C, kv_tile=16, fp8=True, pipelined=False)
    assert torch.equal(sel.select_kv(*args, 100, topk_fused=True, one_group=True, **kw),
                       sel.select_kv(*args, 100, topk_fused=False, one_group=False, **kw))


@pytest.mark.parametrize("fused", [False, True])
def test_one_group_is_the_default_with_and_without_the_fused_top_k(gen, monkeypatch, fused):
    """The float8 pair kernel runs one query group per program by default (``_ONE_GROUP_DEFAULT``) whether or not the
    top-K is fused into its epilogue (H200 round s6r1: select_kv fused 0.565-0.576 with one group per program against
    0.589-0.596 with two at 1.3B 480p, 0.471-0.478 against 0.485-0.497 at 14B 720p): the launch has G programs per
    head and ONE_GROUP set, and the selection equals the two-group kernel's."""
    sel = _selection()
    S, C = 330, 128  # G = 3
    args = _three_group_inputs(gen, S, C)
    launches, kernel = [], sel._group_prob_sums_pair

    class Spy:
        def __getitem__(self, grid):
            def launch(*a, **kw):
                launches.append((grid, kw["ONE_GROUP"], kw.get("TOPK", False)))
                return kernel[grid](*a, **kw)
            return launch

    monkeypatch.setattr(sel, "_group_prob_sums_pair", Spy())
    kw = dict(group_size=C, kv_tile=16, fp8=True, pipelined=False, topk_fused=fused)
    got = sel.select_kv(*args, 100, **kw)
    assert launches == [((3, 2), True, fused)]
    assert torch.equal(got, sel.select_kv(*args, 100, one_group=False, **kw))
    assert launches[1] == ((2, 2), False, fused)
