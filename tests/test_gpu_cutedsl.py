"""The CuTeDSL sparse kernel (kernels/cutedsl) on a Hopper GPU against the float64 torch reference (issue 16).

Skipped unless CUDA compute capability 9.x and nvidia-cutlass-dsl + flash-attn-4 import. The op (through the
registry, asserting it ran on the kernel) on both head dims and dtypes, ragged K (counts that differ
per group, tails inside a tile), S not a multiple of 128, B = 2, native [B, S, H*D] views in and out (a NaN-filled
output buffer written in full, padding between rows left alone), every residual kind (plain in bf16 / fp16 / fp32,
fp8_row, int4_row, int4_group) and the LSE; more and fewer groups than SMs (the op's kernels run persistent with
two query groups in flight per CTA, ``rules``); the kernel options launched directly, the "overlap" kernel on grids
of 1 to 500 CTAs, with and without a residual.
Run: python3 -m pytest -q tests/test_gpu_cutedsl.py (about 1-2 minutes on an H200, mostly compiles: ~3-7 s each);
one round's selection: tests/gpu_round_cute.sh.
"""

from __future__ import annotations

import os

import pytest
import torch
from comfyui_mc_sparse_pack import kernels
from comfyui_mc_sparse_pack.kernels import reference, registry

from .test_gpu_reuse_kernel import _inputs as _reuse_inputs
from .test_reuse_op import make_residual


def _hopper_and_cutedsl() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    if torch.cuda.get_device_capability()[0] != 9:
        return "needs an sm_90 (Hopper) GPU"
    b = {x.name: x for x in registry.backends()}.get("cutedsl")
    if b is None or b.unavailable_reason:
        return f"the cutedsl backend is unavailable ({b.unavailable_reason if b else 'not registered'})"
    return None


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_hopper_and_cutedsl() is not None, reason=str(_hopper_and_cutedsl()))]


def _native(gen, B, S, H, D, dtype):
    base = torch.randn(B, S, H * D, generator=gen, device="cuda").to(dtype)
    return base.view(B, S, H, D).transpose(1, 2)


def _inputs(gen, B, H, S, C, K, k_alloc, ragged):
    """tests/test_gpu_reuse_kernel.py's random groups and sorted selections, optionally with ragged counts."""
    perm, idx = _reuse_inputs(gen, B, H, S, C, K, k_alloc)
    G = idx.shape[2]
    if ragged:  # some groups keep fewer keys (trailing -1 over several tiles), one keeps a single key
        cut = torch.randint(1, K + 1, (B, H, G), generator=gen, device="cuda")
        cut.view(-1)[0] = 1
        slot = torch.arange(k_alloc, device="cuda")
        idx = torch.where(slot < cut[..., None], idx, torch.full_like(idx, -1))
    return perm, idx


def _cutedsl(*args, **kwargs):
    """kernels.sparse_attention on the cutedsl backend; fails unless the kernel itself ran (no fallback)."""
    with registry.recording(registry.Record()) as record:
        got = kernels.sparse_attention(*args, backend="cutedsl", **kwargs)
    assert record.choices["sparse_attention"].backend == "cutedsl", (record.choices, record.failures)
    return got


def _check(got, lse, q, k, v, perm, idx, res=None, tol=6e-3):
    ref, ref_lse = reference.sparse_attention(q.double(), k.double(), v.double(), perm, idx, return_lse=True)
    if res is not None:
        ref = ref + res.dequantize(torch.float64, perm)
    err = float((got.double() - ref).norm() / ref.norm())
    assert err < tol, err
    if lse is not None:
        assert float((lse.double() - ref_lse.double()).abs().max()) < 2e-3
    return err


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("D", [128, 64])
@pytest.mark.parametrize(("S", "K", "ragged", "kv_tile"), [
    (4000, 1000, False, 128), (3000 + 8, 777, True, 128), (2500, 704, False, 64), (2500, 650, True, 64),
], ids=["S4000", "S3008-ragged", "S2500-kalloc704", "S2500-ragged-kalloc704"])
def test_cutedsl_vs_float64(dtype, D, S, K, ragged, kv_tile):
    """B = 2, native views in, a NaN-filled out view written in full, LSE. kv_tile 64 (the engine's default rounding
    of K): K_alloc 704 is 5.5 key tiles, so the last tile's slots past the row's end are clamped to its last slot by
    the producer and masked."""
    gen = torch.Generator(device="cuda").manual_seed(11 + D + S + K)
    B, H, C = 2, 3, 128
    q, k, v = (_native(gen, B, S, H, D, dtype) for _ in range(3))
    perm, idx = _inputs(gen, B, H, S, C, K, -(-K // kv_tile) * kv_tile, ragged)
    base = torch.full((B, S, H * D), float("nan"), dtype=dtype, device="cuda")
    out = base.view(B, S, H, D).transpose(1, 2)
    got, lse = _cutedsl(q, k, v, perm, idx, out=out, return_lse=True)
    assert got is out and not base.isnan().any() and not lse.isnan().any()
    err = _check(got, lse, q, k, v, perm, idx)
    print(f"cutedsl {dtype} D={D} S={S} K={K} ragged={ragged}: rel err {err:.2e}")


# session 9's candidate for the register epilogue (calls with a residual): the staged default's pdl + v3 and the
# next item's queries / count / index ahead
RES_CAND = "persistent,overlap,pdl,v3,q_ahead,cnt_ahead,idx_ahead"


@pytest.mark.parametrize("kind", ["plain", "plain-fp16", "plain-fp32", "fp8_row", "int4_row", "int4_group"])
def test_cutedsl_residual_epilogue(kind):
    """O = sparse + R for every residual form, B = 2, S not a multiple of 128, ragged counts, LSE; the out view's rows
    are padded (a [B, S, H*D + 8] buffer): the padding stays NaN, every element of the view is written. R is as large
    as O, so a residual read from the wrong row or dequantised wrong fails the tolerance."""
    _residual_case(kind)


@pytest.mark.parametrize("kind", ["plain", "int4_group"])
def test_cutedsl_residual_candidate(monkeypatch, kind):
    """``test_cutedsl_residual_epilogue`` with the register epilogue's candidate options (``RES_CAND`` through
    $MC_SPARSE_CUTEDSL_RES_OPTIONS): 68 groups (fewer than the SMs: one per CTA), then 544 groups (4-5 per CTA on
    132 SMs: the walk crosses groups of 1-5 key tiles, the next group's queries / count / index read ahead where a
    group has 5)."""
    monkeypatch.setenv("MC_SPARSE_CUTEDSL_RES_OPTIONS", RES_CAND)
    _residual_case(kind)
    _residual_case(kind, H=16)


def _residual_case(kind, H=2):
    gen = torch.Generator(device="cuda").manual_seed(5)
    B, S, D, C, K = 2, 2050, 128, 128, 640
    q, k, v = (_native(gen, B, S, H, D, torch.bfloat16) for _ in range(3))
    perm, idx = _inputs(gen, B, H, S, C, K, K, True)
    r = torch.randn(B, H, S, D, generator=gen, device="cuda") * 0.05
    if kind.startswith("plain-"):
        res = kernels.Residual(r.to(torch.float16 if kind == "plain-fp16" else torch.float32))
    else:
        res = make_residual(r, kind, perm, idx.shape[2])
    base = torch.full((B, S, H * D + 8), float("nan"), dtype=torch.bfloat16, device="cuda")
    out = base[..., :H * D].view(B, S, H, D).transpose(1, 2)
    got, lse = _cutedsl(q, k, v, perm, idx, out=out, residual=res, return_lse=True)
    assert got is out and not out.isnan().any() and base[..., H * D:].isnan().all()
    _check(got, lse, q, k, v, perm, idx, res)


@pytest.mark.parametrize(("B", "H", "S"), [(2, 8, 5000), (1, 1, 300)], ids=["640-groups", "3-groups"])
def test_cutedsl_groups_vs_sms(B, H, S):
    """More groups than SMs (several waves of CTAs) and fewer (a grid smaller than the SM count), ragged counts, no out (a new tensor), LSE, against float64."""
    gen = torch.Generator(device="cuda").manual_seed(23)
    D, C, K = 128, 128, 300
    q, k, v = (_native(gen, B, S, H, D, torch.bfloat16) for _ in range(3))
    perm, idx = _inputs(gen, B, H, S, C, K, -(-K // 128) * 128, True)
    got, lse = _cutedsl(q, k, v, perm, idx, return_lse=True)
    assert not got.isnan().any()
    err = _check(got, lse, q, k, v, perm, idx)
    print(f"cutedsl {B * H * (-(-S // C))} groups: rel err {err:.2e}")


def test_cutedsl_is_preferred_on_hopper():
    """Picked by the registry without a backend name, with a residual and the LSE."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    q, k, v = (_native(gen, 1, 512, 2, 128, torch.bfloat16) for _ in range(3))
    perm, idx = _inputs(gen, 1, 2, 512, 128, 128, 128, False)
    res = make_residual(torch.randn(1, 2, 512, 128, generator=gen, device="cuda") * 0.05, "fp8_row")
    with registry.recording(registry.Record()) as record:
        got, lse = kernels.sparse_attention(q, k, v, perm, idx, residual=res, return_lse=True)
    assert record.choices["sparse_attention"].backend == "cutedsl", record.choices
    _check(got, lse, q, k, v, perm, idx, res)


@pytest.mark.parametrize(("dtype", "D", "lse", "producer", "epilogue", "options", "ctas"), [
    (torch.bfloat16, 128, True, "cp.async+evict", "smem", (), None),
    (torch.float16, 64, True, "cp.async+l2", "smem", (), None),
    (torch.bfloat16, 64, False, "cp.async+evict", "registers", (), None),
    (torch.float16, 128, True, "cp.async", "smem", (), None),
    (torch.bfloat16, 128, False, "cp.async+evict", "smem", ("persistent",), 7),
    (torch.float16, 64, True, "cp.async+evict", "smem", ("persistent",), 5),
    (torch.float16, 64, True, "cp.async+evict", "registers", ("persistent",), 3),
], ids=lambda x: ("-".join(x) or "plain") if isinstance(x, tuple) else None)
def test_cutedsl_kernel_variants(dtype, D, lse, producer, epilogue, options, ctas):
    """The kernel's producer (L2-hinted copies), epilogue (staged in shared memory) and options (the staged epilogue
    in its own tile for a persistent grid), launched directly: B = 2, S not a
    multiple of 128, ragged counts (one group with a single key), K_alloc not a multiple of 128, native views, a
    NaN-filled out written in full (every row of the view: the staged epilogue stores 16-byte pieces of rows), LSE in
    query order, against float64. ``ctas``: a persistent grid of that many CTAs (138 groups: each CTA runs 20-46 of
    them, its staged output tile and query tile reused), None one CTA per group."""
    import math

    from comfyui_mc_sparse_pack.kernels.cutedsl import compile as cc
    from comfyui_mc_sparse_pack.kernels.triton.counts import valid_counts

    gen = torch.Generator(device="cuda").manual_seed(31 + D)
    B, H, S, C, K = 2, 3, 2900, 128, 700
    q, k, v = (_native(gen, B, S, H, D, dtype) for _ in range(3))
    perm, idx = _inputs(gen, B, H, S, C, K, 704, True)
    base = torch.full((B, S, H * D), float("nan"), dtype=dtype, device="cuda")
    out = base.view(B, S, H, D).transpose(1, 2)
    lse_t = torch.full((B, H, S), float("nan"), device="cuda") if lse else None
    fn = cc.compiled({torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype], D, lse, "none", 2, producer,
                     epilogue, options)
    n = B * H * idx.shape[2]
    cc.launch(fn, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), out.transpose(1, 2), lse_t,
              perm.reshape(n, C).contiguous(), idx.reshape(n, -1).contiguous(), valid_counts(idx), None, None, None,
              None, 1 / math.sqrt(D), ctas or n)
    assert not base.isnan().any() and (lse_t is None or not lse_t.isnan().any())
    err = _check(out, lse_t, q, k, v, perm, idx)
    print(f"cutedsl {producer} {epilogue} {options} ctas={ctas} {dtype} D={D}: rel err {err:.2e}")


@pytest.mark.parametrize(("dtype", "D", "lse", "options"), [
    (torch.bfloat16, 128, True, ("overlap", "persistent")), (torch.float16, 64, False, ("overlap", "persistent")),
    (torch.bfloat16, 128, False, ("overlap", "persistent", "hide_epi")),
    (torch.float16, 64, True, ("overlap", "persistent", "hide_epi")),
    (torch.bfloat16, 128, False, ("overlap", "persistent", "hide_epi", "split_tail")),
    (torch.float16, 64, False, ("overlap", "persistent", "hide_epi", "q_ahead", "cnt_ahead", "idx_ahead")),
], ids=["bf16-d128-lse", "fp16-d64", "hide-bf16-d128", "hide-fp16-d64-lse", "split-bf16-d128", "ahead-fp16-d64"])
def test_cutedsl_overlap_grids(dtype, D, lse, options):
    """The "overlap" option (two groups in flight per CTA: 2-slot query ring, the next group's first Q K^T issued
    with this group's last P V, O staged in the finished group's query slot) against float64 on persistent grids of
    1, 2, 7 and 500 CTAs over 138 groups (one CTA walking all of them through the ring; CTAs with one group only,
    which never take the cross-group step), ragged counts (one group with a single key: a group of one tile, whose
    last P V is its first), K_alloc not a multiple of 128, B = 2, a NaN-filled out written in full each time, the
    LSE in query order. With "hide_epi" the boundary also runs the next group's second key tile while the output
    is stored (groups of one tile take the plain boundary); with "split_tail" launched with one part per group (its
    workspace unused; the split itself is tested through the op, ``test_cutedsl_split_tail``). With "q_ahead" /
    "cnt_ahead" / "idx_ahead" the next group's queries, count and first index entries are read during this group
    (groups of 5-6 key tiles) or at the next group's start (1-4 tiles), and the consumers read its count ahead: walks
    mix both, the last group of a CTA has no next."""
    import math

    from comfyui_mc_sparse_pack.kernels.cutedsl import compile as cc
    from comfyui_mc_sparse_pack.kernels.triton.counts import valid_counts

    gen = torch.Generator(device="cuda").manual_seed(47 + D)
    B, H, S, C, K = 2, 3, 2900, 128, 700
    q, k, v = (_native(gen, B, S, H, D, dtype) for _ in range(3))
    perm, idx = _inputs(gen, B, H, S, C, K, 704, True)
    fn = cc.compiled({torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype], D, lse, "none", 2,
                     "cp.async+evict", "smem", options)
    n = B * H * idx.shape[2]
    ws = (torch.empty(128, D, dtype=dtype, device="cuda"), torch.empty(128, device="cuda")) \
        if "split_tail" in options else (None, None)  # one part per group: the workspace unused
    for ctas in (1, 2, 7, 500):
        base = torch.full((B, S, H * D), float("nan"), dtype=dtype, device="cuda")
        out = base.view(B, S, H, D).transpose(1, 2)
        lse_t = torch.full((B, H, S), float("nan"), device="cuda") if lse else None
        cc.launch(fn, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), out.transpose(1, 2), lse_t,
                  perm.reshape(n, C).contiguous(), idx.reshape(n, -1).contiguous(), valid_counts(idx), None, None,
                  None, None, 1 / math.sqrt(D), ctas, *ws, 1)
        assert not base.isnan().any() and (lse_t is None or not lse_t.isnan().any()), ctas
        err = _check(out, lse_t, q, k, v, perm, idx)
        print(f"cutedsl {options} ctas={ctas} {dtype} D={D}: rel err {err:.2e}")


SPLIT = "persistent,overlap,hide_epi,split_tail"
CAND = SPLIT + ",pdl,v3"  # round s8r1's candidate options (the op's default since s8r2)
AHEAD = CAND + ",q_ahead,cnt_ahead,idx_ahead"  # session 9's candidate: the next item's queries, count, index ahead

LAZY = AHEAD + ",lazy_rescale"  # + the running max raised only past a threshold, O's rescale skipped per warp
IDX_L2 = LAZY + ",idx_l2"  # + kv_idx / perm lines prefetched into L2 ahead (the op's default since round s10r2)


@pytest.mark.parametrize("options", [SPLIT, CAND, AHEAD, LAZY, IDX_L2], ids=[
    "split", "split-pdl-v3", "split-pdl-v3-ahead", "split-pdl-v3-early-lazy", "split-pdl-v3-early-lazy-idx-l2"])
@pytest.mark.parametrize(("B", "H", "S", "K", "ragged", "lse"), [
    (2, 3, 2900, 700, True, True), (1, 1, 140 * 128 - 5, 3000, False, False),
], ids=["138-groups-ragged-lse", "140-groups"])
def test_cutedsl_split_tail(monkeypatch, B, H, S, K, ragged, lse, options):
    """The op with "split_tail" (+ hide_epi; and with "pdl": the counts launch, the kernel and the merge as
    programmatic dependent launches, "v3": 3 V stages on their own pipeline state): the last round's groups (N mod SMs of them) split into parts through
    the workspace and merged (``tail_merge``), against float64: 138 groups with ragged counts of 1-6 key tiles on
    132 SMs (6 groups in 16 parts: empty parts, LSE -inf), and 140 groups of 24 key tiles without the LSE (8 groups
    in 16 parts of 1-2 tiles); a NaN-filled out written in full."""
    from comfyui_mc_sparse_pack.kernels.cutedsl import rules

    monkeypatch.setenv("MC_SPARSE_CUTEDSL_OPTIONS", options)
    gen = torch.Generator(device="cuda").manual_seed(71 + S)
    C, D = 128, 128
    q, k, v = (_native(gen, B, S, H, D, torch.bfloat16) for _ in range(3))
    perm, idx = _inputs(gen, B, H, S, C, K, -(-K // 128) * 128, ragged)
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    parts = rules.split_parts(B * H * idx.shape[2], sms)
    assert parts > 1, f"these shapes do not split on {sms} SMs"
    base = torch.full((B, S, H * D), float("nan"), dtype=torch.bfloat16, device="cuda")
    out = base.view(B, S, H, D).transpose(1, 2)
    got = _cutedsl(q, k, v, perm, idx, out=out, return_lse=lse)
    got, lse_t = got if lse else (got, None)
    assert not base.isnan().any() and (lse_t is None or not lse_t.isnan().any())
    err = _check(out, lse_t, q, k, v, perm, idx)
    print(f"cutedsl split_tail {B * H * idx.shape[2]} groups on {sms} SMs, {parts} parts: rel err {err:.2e}")


@pytest.mark.parametrize(("options", "with_res"), [(CAND, False), (AHEAD, False), (RES_CAND, True), (LAZY, False)],
                         ids=["pdl-v3", "pdl-v3-ahead", "res-pdl-v3-ahead", "pdl-v3-early-lazy"])
def test_cutedsl_pdl_chain(monkeypatch, options, with_res):
    """"pdl" (with "v3"; the op's three launches as programmatic dependent launches, each waiting for the kernel before it):
    three op calls queued with no host synchronisation, each reading what the launch just before it wrote: k made
    by a torch kernel, then the selection cut by a torch kernel, then the first call's output (its kernel's rows and
    the tail merge's rows) as the third call's queries, read in place right after the second call's merge; 138 groups (the last round split and merged), ragged counts,
    the LSE; each output against float64 on the inputs it was given. A kernel reading before its predecessor ended
    would read stale or NaN inputs. ``with_res``: each call with a plain bf16 residual (the register epilogue, its
    options ``options`` through $MC_SPARSE_CUTEDSL_RES_OPTIONS; no tail merge)."""
    monkeypatch.setenv("MC_SPARSE_CUTEDSL_RES_OPTIONS" if with_res else "MC_SPARSE_CUTEDSL_OPTIONS", options)
    gen = torch.Generator(device="cuda").manual_seed(83)
    B, H, S, C, D, K = 2, 3, 2900, 128, 128, 700
    q, k, v = (_native(gen, B, S, H, D, torch.bfloat16) for _ in range(3))
    perm, idx = _inputs(gen, B, H, S, C, K, 768, True)
    res = kernels.Residual((torch.randn(B, H, S, D, generator=gen, device="cuda") * 0.05).to(torch.bfloat16)) \
        if with_res else None
    bases = [torch.full((B, S, H * D), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(3)]
    outs = [b.view(B, S, H, D).transpose(1, 2) for b in bases]
    k8 = k * 8  # the third call's keys: scores of O-sized queries still far from uniform
    torch.cuda.synchronize()
    k2 = (k.float() * 0.5 + 0.25).to(torch.bfloat16)  # a torch kernel right before the op's first launch
    o1, l1 = _cutedsl(q, k2, v, perm, idx, out=outs[0], return_lse=True, residual=res)
    idx2 = torch.where(torch.arange(idx.shape[-1], device="cuda") < 300, idx, -1).to(torch.int32)
    o2, l2 = _cutedsl(q, k2, v, perm, idx2, out=outs[1], return_lse=True, residual=res)
    o3, l3 = _cutedsl(o1, k8, v, perm, idx, out=outs[2], return_lse=True, residual=res)
    torch.cuda.synchronize()
    assert not any(b.isnan().any() for b in bases)
    for got, lse, qq, kk, ii in ((o1, l1, q, k2, idx), (o2, l2, q, k2, idx2), (o3, l3, o1, k8, idx)):
        err = _check(got, lse, qq, kk, v, perm, ii, res)
        print(f"cutedsl pdl chain: rel err {err:.2e}")


@pytest.mark.parametrize("kind", ["plain", "int4_group"])
def test_cutedsl_overlap_residual(kind):
    """The "overlap" option with the register epilogue and a residual (the reuse path's call) against float64 on
    persistent grids of 1, 7 and 500 CTAs: ragged counts, B = 2, S not a multiple of 128, padded out rows (the
    padding stays NaN), LSE."""
    import math

    from comfyui_mc_sparse_pack.kernels.cutedsl import compile as cc
    from comfyui_mc_sparse_pack.kernels.cutedsl.op import _residual_args
    from comfyui_mc_sparse_pack.kernels.triton.counts import valid_counts

    gen = torch.Generator(device="cuda").manual_seed(61)
    B, H, S, D, C, K = 2, 2, 2050, 128, 128, 640
    q, k, v = (_native(gen, B, S, H, D, torch.bfloat16) for _ in range(3))
    perm, idx = _inputs(gen, B, H, S, C, K, K, True)
    r = torch.randn(B, H, S, D, generator=gen, device="cuda") * 0.05
    res = kernels.Residual(r.to(torch.bfloat16)) if kind == "plain" else make_residual(r, kind, perm, idx.shape[2])
    res_name, *res_args = _residual_args(res)
    fn = cc.compiled("bfloat16", D, True, res_name, 2, "cp.async+evict", "registers", ("overlap", "persistent"))
    n = B * H * idx.shape[2]
    for ctas in (1, 7, 500):
        base = torch.full((B, S, H * D + 8), float("nan"), dtype=torch.bfloat16, device="cuda")
        out = base[..., :H * D].view(B, S, H, D).transpose(1, 2)
        lse_t = torch.full((B, H, S), float("nan"), device="cuda")
        cc.launch(fn, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), out.transpose(1, 2), lse_t,
                  perm.reshape(n, C).contiguous(), idx.reshape(n, -1).contiguous(), valid_counts(idx), *res_args,
                  1 / math.sqrt(D), ctas)
        assert not out.isnan().any() and base[..., H * D:].isnan().all() and not lse_t.isnan().any(), ctas
        _check(out, lse_t, q, k, v, perm, idx, res)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cutedsl_lazy_rescale_ramp(monkeypatch, dtype, options=LAZY):
    """"lazy_rescale" where the running max moves a lot: keys scaled up toward the low token indices (the kernel
    walks a group's key tiles from the last to the first, so each tile's scores grow past the threshold over the
    previous max: rows rescaled mid-walk), mixed with tiles that stay under it; 138 groups (the last round split and
    merged), ragged counts, the LSE, through the op against float64."""
    monkeypatch.setenv("MC_SPARSE_CUTEDSL_OPTIONS", options)
    gen = torch.Generator(device="cuda").manual_seed(97)
    B, H, S, C, D, K = 2, 3, 2900, 128, 128, 700
    q, k, v = (_native(gen, B, S, H, D, dtype) for _ in range(3))
    ramp = 1 + 12 * (1 - torch.arange(S, device="cuda") / S) ** 2  # x13 at token 0, x1 at the end
    k = (k.float() * ramp[:, None]).to(dtype)
    perm, idx = _inputs(gen, B, H, S, C, K, 768, True)
    base = torch.full((B, S, H * D), float("nan"), dtype=dtype, device="cuda")
    out = base.view(B, S, H, D).transpose(1, 2)
    got, lse = _cutedsl(q, k, v, perm, idx, out=out, return_lse=True)
    assert not base.isnan().any() and not lse.isnan().any()
    err = _check(got, lse, q, k, v, perm, idx)
    print(f"cutedsl lazy_rescale ramp {dtype}: rel err {err:.2e}")


# a round's candidate options named at run time (tests/gpu_round_cute.sh), ";"-separated sets: the staged epilogue's
# through $MC_SPARSE_CUTEDSL_TEST_OPTIONS, the register epilogue's through $MC_SPARSE_CUTEDSL_TEST_RES_OPTIONS; test
# ids c0, c1, ... in that order
_ENV_CANDS = [x for x in os.environ.get("MC_SPARSE_CUTEDSL_TEST_OPTIONS", "").split(";") if x]
_ENV_RES_CANDS = [x for x in os.environ.get("MC_SPARSE_CUTEDSL_TEST_RES_OPTIONS", "").split(";") if x]


@pytest.mark.skipif(not _ENV_CANDS, reason="no $MC_SPARSE_CUTEDSL_TEST_OPTIONS")
@pytest.mark.parametrize("case", ["split-138-lse", "split-140", "chain", "ramp", "grids"])
@pytest.mark.parametrize("options", _ENV_CANDS or [""], ids=[f"c{i}" for i in range(max(1, len(_ENV_CANDS)))])
def test_cutedsl_env_candidate(monkeypatch, options, case):
    """Staged-epilogue options from $MC_SPARSE_CUTEDSL_TEST_OPTIONS through the op: the split last rounds (138
    groups ragged with the LSE, 140 groups of 24 tiles), the pdl chain, the ramped keys (rows rescaled mid-walk);
    and the compiled kernel on persistent grids of 1, 2, 7 and 500 CTAs (``test_cutedsl_overlap_grids``: walks of
    many rounds)."""
    if case == "grids":
        test_cutedsl_overlap_grids(torch.bfloat16, 128, True, tuple(options.split(",")))
    elif case == "split-138-lse":
        test_cutedsl_split_tail(monkeypatch, 2, 3, 2900, 700, True, True, options)
    elif case == "split-140":
        test_cutedsl_split_tail(monkeypatch, 1, 1, 140 * 128 - 5, 3000, False, False, options)
    elif case == "chain":
        test_cutedsl_pdl_chain(monkeypatch, options, False)
    else:
        test_cutedsl_lazy_rescale_ramp(monkeypatch, torch.bfloat16, options)


@pytest.mark.skipif(not _ENV_RES_CANDS, reason="no $MC_SPARSE_CUTEDSL_TEST_RES_OPTIONS")
@pytest.mark.parametrize("case", ["plain", "int4_group", "chain"])
@pytest.mark.parametrize("options", _ENV_RES_CANDS or [""], ids=[f"c{i}" for i in range(max(1, len(_ENV_RES_CANDS)))])
def test_cutedsl_env_res_candidate(monkeypatch, options, case):
    """Register-epilogue options from $MC_SPARSE_CUTEDSL_TEST_RES_OPTIONS through the op: plain and int4_group
    residuals on 68 and 544 groups, the pdl chain with a plain residual."""
    monkeypatch.setenv("MC_SPARSE_CUTEDSL_RES_OPTIONS", options)
    if case == "chain":
        test_cutedsl_pdl_chain(monkeypatch, options, True)
    else:
        _residual_case(case)
        _residual_case(case, H=16)
