"""The CuTeDSL sm_90 pass 2 (kernels/cutedsl/pass2_sm90.py) on an H200 against float64 and the Triton pair kernel:
the same float8 operands (``selection.fp8_operands(kb_pow2=True)``), NaN-poisoned outputs that are a strided view of
a larger buffer (nothing written outside the view: no key past Sk, no other head), ragged S and Sk (a partial last
key tile; an odd key-tile count, so the consumers' last pair holds an all-zero tile), odd group counts, a ragged last
group, padded slots inside groups (perm -1), B = 2, Sk != S, C 100 / 128, float16 and float32 sums, a persistent
walk of several groups per CTA (num_ctas small: the query ring wraps), key splits (ksplit, an empty last part),
the FMA-pipe exponential share (poly), the LSE through global or shared memory (lse_smem), the query-half
products (qsplit 1, and 2: rolled over tile pairs), four consumer warpgroups (wg4), two query groups per work item
(pair), and the fused top-K (``test_cutedsl_fused_topk_equals_brute_force``).

``test_cutedsl_pass2_equals_float64`` uses torch-made operands (no Triton compile: what a round with a short cap
runs, ``-k "not triton"``); ``..._and_the_triton_kernel`` the operands of ``selection.fp8_operands`` and the
Triton pair kernel's sums. Skipped without an sm_90 GPU or without the CuTeDSL stack (cutlass-dsl, flash-attn-4,
quack). Run: ``python -m pytest -q -m gpu tests/test_gpu_cutedsl_pass2.py`` (~60 s on an H200, compiles included).
"""

from __future__ import annotations

import inspect

import pytest
import torch
from comfyui_mc_sparse_pack.kernels import reference
from comfyui_mc_sparse_pack.kernels.reference.topk import top_k_rows

from .test_reuse_op import random_groups

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                       reason="needs an sm_90 CUDA GPU"),
]
SEED = 20261201


def _mods():
    try:
        from comfyui_mc_sparse_pack.kernels.cutedsl import pass2_sm90
    except ImportError as err:  # the CuTeDSL stack is not installed on this machine
        pytest.skip(f"CuTeDSL stack unavailable: {err}")
    from comfyui_mc_sparse_pack.kernels.triton import selection

    return selection, pass2_sm90


@pytest.fixture(scope="module", autouse=True)
def _warm(request):
    """Every config the SELECTED tests of this file compile, in parallel child processes (disk cache), first."""
    _mods()
    from ._cute_pass2_warm import warm_parallel

    configs = []
    for item in request.session.items:
        if item.module is request.module and "num_keys" in getattr(getattr(item, "callspec", None), "params", {}):
            opts = item.callspec.params["opts"]
            more = {k: opts[k] for k in ("wg4", "stages", "pair", "overlap", "unit_qf") if k in opts}
            for c in (dict(out_dtype="float16", **more), dict(out_dtype="float16", topk=True, **more)):  # fused tests
                if c not in configs:
                    configs.append(c)
        tun = getattr(getattr(item, "callspec", None), "params", {}).get("tuning")
        if item.module is request.module and tun is not None:
            keys = {k: v for k, v in tun.items() if k in _COMPILED}
            more = [{k: v for k, v in keys.items() if k != "unit_qf"}] if "unit_qf" in keys else []  # its plain form
            for kk in [keys] + more:
                for dt in ("float32",) if kk or more else ("float32", "float16"):
                    if dict(out_dtype=dt, **kk) not in configs:
                        configs.append(dict(out_dtype=dt, **kk))
    print("parallel compiles:", warm_parallel(configs))


def _case(B, H, S, SK, C, seed, holes=False):
    """q, k (bf16, a shared component per head as real q / k have), the exact LSE of softmax(q k^T) over the Sk keys,
    and random groups (-1 padding in the last group; with ``holes`` also ~3 % of the slots inside groups)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    print(f"seed {seed}: B {B} H {H} S {S} Sk {SK} C {C} holes {holes}")
    D = 128
    q = (torch.randn(B, H, S, D, device="cuda", generator=gen)
         + torch.randn(B, H, 1, D, device="cuda", generator=gen)).to(torch.bfloat16)
    k = (torch.randn(B, H, SK, D, device="cuda", generator=gen)
         + 2 * torch.randn(B, H, 1, D, device="cuda", generator=gen)).to(torch.bfloat16)
    _, lse = reference.dense_attention(q.double(), k.double(), k.double(), return_lse=True)
    cpu = torch.Generator().manual_seed(seed)
    perm = random_groups(cpu, B, H, S, C)
    if holes:
        perm[torch.rand(perm.shape, generator=cpu) < 0.03] = -1
    return q, k, lse.float(), perm.cuda()


def _triton_sums(selection, q, k, lse, perm, C, out):
    """The Triton pair kernel's float8 sums (the Gluon and CuTeDSL kernels off)."""
    extra = {"cute": False} if "cute" in inspect.signature(selection.group_prob_sums).parameters else {}
    return selection.group_prob_sums(q, k, lse, perm, group_size=C, fp8=True, gluon=False, out=out, **extra)


CASES = [  # B, H, S, Sk, C, holes: G = 32 (ragged last group), Sk = 4000 (partial last tile, 32 tiles);
    # B = 2, Sk != S, C = 100, G = 29 (odd), 16 key tiles; Sk = 2900: 23 key tiles (odd: an all-zero tile), holes
    (1, 2, 4000, 4000, 128, False),
    (2, 3, 2850, 2000, 100, False),
    (1, 2, 2900, 2900, 128, True),
]
# the defaults (ksplit auto: 2 on these small cases); a persistent walk of many items per CTA (the query ring wraps);
# a key split with an empty last part (12 tile pairs in 5 parts of 3); 3 stages; the LSE read through perm (no
# lse_smem); the FMA-pipe share; qsplit 1 and 2 (tile pairs rolled; 21 tiles in auto parts, 11 in 3 parts: odd parts
# take the one-tile path); four consumer warpgroups; pair
VARIANTS = [(c, {}) for c in CASES] + [(CASES[1], dict(num_ctas=5, ksplit=1)), (CASES[2], dict(num_ctas=7, ksplit=5)),
                                       (CASES[0], dict(stages=3)), (CASES[2], dict(poly=10)),
                                       (CASES[2], dict(lse_smem=False)),
                                       (CASES[1], dict(lse_smem=False, num_ctas=5, ksplit=3)),
                                       (CASES[2], dict(qsplit=1)),
                                       (CASES[1], dict(qsplit=1, lse_smem=False, poly=8, num_ctas=5, ksplit=3)),
                                       (CASES[0], dict(qsplit=2)),
                                       (CASES[1], dict(qsplit=2, poly=4, num_ctas=5, ksplit=3)),
                                       (CASES[2], dict(wg4=True, stages=3, num_ctas=6)),
                                       (CASES[1], dict(pair=True, num_ctas=5)),
                                       (CASES[2], dict(pair=True, wg4=True, stages=3, ksplit=2)),
                                       (CASES[1], dict(pair=True, overlap=True, num_ctas=4))]


def _written_sums(p2, operands, perm, C, tuning, dtype):
    """The kernel's sums for the float8 ``operands`` (q8, k8, qf, lse_s, kb) written into a NaN-poisoned view of a
    larger buffer: every entry of the view written, nothing outside it."""
    B, H, _, _ = operands[0].shape
    G, SK = perm.shape[-1] // C, operands[1].shape[2]
    buf = torch.full((B, H + 1, G, SK + 64), float("nan"), dtype=dtype, device="cuda")
    out = buf[:, :H, :, :SK]
    p2.group_prob_sums_fp8(*operands, perm.contiguous(), out, group_size=C, **tuning)
    torch.cuda.synchronize()
    assert not out.isnan().any(), f"{int(out.isnan().sum())} of {out.numel()} entries not written ({dtype})"
    assert buf[:, H:].isnan().all() and buf[..., SK:].isnan().all(), "written outside the output view"
    return out


# the tuning keys that are compile-time
_COMPILED = ("stages", "poly", "lse_smem", "qsplit", "wg4", "pair", "overlap", "unit_qf")


@pytest.mark.parametrize(("case", "tuning"), VARIANTS,
                         ids=lambda v: "B{}H{}S{}Sk{}C{}h{}".format(*v) if isinstance(v, tuple) else str(v))
def test_cutedsl_pass2_equals_float64_and_the_triton_kernel(case, tuning):  # (-k 'not triton': skip)
    """Every entry of the view written, nothing outside it (NaN-poisoned buffer with an extra head and 64 columns
    past Sk); fp32 sums within 1e-4 relative per entry of the Triton pair kernel's (the same e4m3 products, FFMA and
    ex2.approx; only a key's row-sum order differs; poly: 1e-3, the FMA-pipe polynomial's error) and within 5e-4
    relative L2 per group of the float64 sums of the same float8 operands; fp16 sums (the compiled variants' fp32 only,
    one compile each) within one fp16 rounding of the Triton kernel's."""
    selection, p2 = _mods()
    B, H, S, SK, C, holes = case
    q, k, lse, perm = _case(B, H, S, SK, C, seed=SEED + S + len(str(tuning)), holes=holes)
    q8, k8, qf, lse_s, kb = selection.fp8_operands(q, k, lse, 128**-0.5, kb_pow2=True)
    G = perm.shape[-1] // C
    poly = tuning.get("poly", p2.config()["poly"])
    compiled_variant = bool(set(tuning) & set(_COMPILED))
    for dtype in (torch.float32,) if compiled_variant else (torch.float32, torch.float16):
        want = _triton_sums(selection, q, k, lse, perm, C, torch.empty(B, H, G, SK, dtype=dtype, device="cuda"))
        out = _written_sums(p2, (q8, k8, qf, lse_s, kb), perm, C, tuning, dtype)
        if dtype == torch.float32:
            rel_t = float(((out - want).abs() / want.abs().clamp_min(1e-30)).max())
            print(f"fp32: max relative difference to the Triton kernel {rel_t:.2e}")
            assert rel_t < (1e-3 if poly else 1e-4), rel_t
            out32 = out.clone()
        else:
            diff = float((out.float() - want.float()).abs().max())
            assert torch.allclose(out.float(), want.float(), rtol=1e-3 if poly else 2**-10, atol=1e-7), diff
    # against float64 on the dequantised float8 operands (as tests/test_gpu_pass2_gluon.py)
    (_, qs), (_, ks) = selection.fp8_stats(q), selection.fp8_stats(k)
    deq = reference.group_prob_sums(q8.double() * qs.double()[..., None, None],
                                    k8.double() * ks.double()[..., None, None], lse_s.double(), perm, group_size=C)
    deq = deq * kb.double()[:, :, None, :]
    rel = (out32.double() - deq).norm(dim=-1) / deq.norm(dim=-1)
    print(f"float64: max relative L2 per group {float(rel.max()):.2e}")
    assert float(rel.max()) < 5e-4, float(rel.max())


def _torch_operands(B, H, S, SK, C, seed, holes=False):
    """Float8 operands made in torch (no Triton compile: fast on a cold machine): q8, k8 from randn x 4, the head
    factor qf, the exact natural-log LSE of the scores q8 . k8 x qf / log2(e) over the Sk keys (so the sums lie in
    [0, C]), 2^KB in [0.5, 2], and random groups."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    print(f"seed {seed}: B {B} H {H} S {S} Sk {SK} C {C} holes {holes} (torch operands)")
    q8 = (4 * torch.randn(B, H, S, 128, device="cuda", generator=gen)).to(torch.float8_e4m3fn)
    k8 = (4 * torch.randn(B, H, SK, 128, device="cuda", generator=gen)).to(torch.float8_e4m3fn)
    qf = 0.008 * (1 + torch.rand(B, H, device="cuda", generator=gen))
    s = torch.einsum("bhsd,bhkd->bhsk", q8.double(), k8.double()) * qf.double()[..., None, None] / _LOG2E
    lse_s = torch.logsumexp(s, -1).float()
    kb = torch.exp2(torch.rand(B, H, SK, device="cuda", generator=gen) * 2 - 1)
    cpu = torch.Generator().manual_seed(seed)
    perm = random_groups(cpu, B, H, S, C)
    if holes:
        perm[torch.rand(perm.shape, generator=cpu) < 0.03] = -1
    return q8, k8, qf, lse_s, kb, perm.cuda()


_LOG2E = 1.4426950408889634


@pytest.mark.parametrize(("case", "tuning"), VARIANTS,
                         ids=lambda v: "B{}H{}S{}Sk{}C{}h{}".format(*v) if isinstance(v, tuple) else str(v))
def test_cutedsl_pass2_equals_float64(case, tuning):
    """On torch-made float8 operands (no Triton kernel involved): every entry of the view written, nothing outside it
    (NaN-poisoned buffer with an extra head and 64 columns past Sk), fp32 sums within 3e-3 relative L2 per group of
    float64 (the e4m3 wgmma accumulates below fp32 precision: these unsmoothed randn x 4 operands' scores carry
    ~1e-3 absolute error, measured 2e-4 - 1.3e-3 on the H200 in round s8final; the Triton kernel's sums, same
    products, agree with this kernel's to 3e-5 there), fp16 sums (the default config) within one fp16 rounding of the
    fp32 sums."""
    _, p2 = _mods()
    B, H, S, SK, C, holes = case
    q8, k8, qf, lse_s, kb, perm = _torch_operands(B, H, S, SK, C, SEED + S + len(str(tuning)), holes)
    want = reference.group_prob_sums(q8.double(), k8.double() * (qf.double() / (_LOG2E * 128**-0.5))[..., None, None],
                                     lse_s.double(), perm, group_size=C) * kb.double()[:, :, None, :]
    compiled_variant = bool(set(tuning) & set(_COMPILED))
    got = {dtype: _written_sums(p2, (q8, k8, qf, lse_s, kb), perm, C, tuning, dtype)
           for dtype in ((torch.float32,) if compiled_variant else (torch.float32, torch.float16))}
    rel = (got[torch.float32].double() - want).norm(dim=-1) / want.norm(dim=-1)
    print(f"float64: max relative L2 per group {float(rel.max()):.2e}")
    assert float(rel.max()) < 3e-3, float(rel.max())
    if torch.float16 in got:
        f32 = got[torch.float32]
        assert torch.allclose(got[torch.float16].float(), f32.half().float(), rtol=2**-10, atol=1e-7), \
            float((got[torch.float16].float() - f32).abs().max())


@pytest.mark.parametrize("tuning", [dict(unit_qf=True), dict(unit_qf=True, poly=0, num_ctas=5, ksplit=3),
                                    dict(unit_qf=True, qsplit=2, lse_smem=False, num_ctas=7)],
                         ids=["unitdefault", "unitmufu", "unitqsplit"])
def test_cutedsl_pass2_unit_qf_equals_float64(tuning):
    """``unit_qf`` on torch-made operands whose head 0 has qf = 1 (the scores q8 . k8 in log2 units: the fast form,
    2^score x the query's weight) and head 1 qf = 0.5 (``selection.unit_qf_factors`` sends it to the default
    form): every entry of the view written, nothing outside it, fp32 sums within 3e-3 relative L2 per group of
    float64 (the test above's bound: the e4m3 wgmma's accumulation; + the polynomial's error with poly) and within
    1e-4 relative per entry of the default kernel's sums on the same operands (with the fast form's poly, default
    ``UNIT_POLY``, of degree ``UNIT_POLY_DEG``: 1e-4 + that polynomial's largest relative error,
    ``POLY_REL_ERROR``: a sum of positive terms, each within it)."""
    selection, p2 = _mods()
    B, H, S, SK, C, holes = CASES[2]
    q8, k8, qf, lse_s, kb, perm = _torch_operands(B, H, S, SK, C, SEED + 7 + len(str(tuning)), holes)
    r = qf.double().sqrt()[..., None, None]  # qf moved into the operands: q8 . k8 is the score in log2 units
    q8, k8 = (q8.double() * r).to(torch.float8_e4m3fn), (k8.double() * r).to(torch.float8_e4m3fn)
    qf = torch.ones_like(qf)
    qf[:, 1] = 0.5
    s = torch.einsum("bhsd,bhkd->bhsk", q8.double(), k8.double()) * qf.double()[..., None, None] / _LOG2E
    lse_s = torch.logsumexp(s, -1).float()
    assert selection.unit_qf_factors(qf, lse_s, kb).tolist() == [1.0, -0.5]
    want = reference.group_prob_sums(q8.double(), k8.double() * (qf.double() / (_LOG2E * 128**-0.5))[..., None, None],
                                     lse_s.double(), perm, group_size=C) * kb.double()[:, :, None, :]
    got = _written_sums(p2, (q8, k8, qf, lse_s, kb), perm, C, tuning, torch.float32)
    poly_err = p2.POLY_REL_ERROR[tuning.get("poly_deg", p2.unit_poly_degree())] if tuning.get("poly", p2.UNIT_POLY) else 0.0
    rel = (got.double() - want).norm(dim=-1) / want.norm(dim=-1)
    print(f"float64: max relative L2 per group {float(rel.max()):.2e}")
    assert float(rel.max()) < 3e-3 + poly_err, float(rel.max())
    plain = _written_sums(p2, (q8, k8, qf, lse_s, kb), perm, C, {k: v for k, v in tuning.items() if k != "unit_qf"},
                          torch.float32)
    rel_p = float(((got - plain).abs() / plain.abs().clamp_min(1e-30)).max())
    print(f"max relative difference to the default form {rel_p:.2e}")
    assert rel_p < 1e-4 + poly_err, rel_p


def test_cutedsl_pass2_refusals():
    """The calls the kernel does not take are refused with a reason (the dispatch then runs the Triton kernel)."""
    _, p2 = _mods()
    q8 = torch.zeros(1, 1, 256, 128, device="cuda").to(torch.float8_e4m3fn)
    out = torch.empty(1, 1, 2, 256, dtype=torch.float16, device="cuda")
    assert p2.refusal(q8, q8, 128, out) is None
    assert "group size" in p2.refusal(q8, q8, 64, out)
    assert "head dim" in p2.refusal(q8[..., :64].contiguous(), q8[..., :64].contiguous(), 128, out)
    assert "float8" in p2.refusal(q8.to(torch.bfloat16), q8, 128, out)
    assert "contiguous" in p2.refusal(q8.transpose(2, 3).contiguous().transpose(2, 3), q8, 128, out)
    assert "sums" in p2.refusal(q8, q8, 128, out.to(torch.bfloat16))
    with pytest.raises(ValueError, match="cannot run"):
        p2.group_prob_sums_fp8(q8, q8, None, None, None, None, out.to(torch.bfloat16), group_size=128)


# The fused top-K (``group_prob_sums_fp8(select=(sel, K))``): case, K, width, launch / plan options. Sk a multiple of 8
# (16-byte rows); Sk 4000: 500 16-byte vectors, the sweeps' last step ragged; C = 100 (padded query slots), B = 2,
# 5 CTAs (each walks many rows: both selecting warps' ring slots wrap); K = Sk and K = 1; twin keys (every sum tied
# with its neighbour's: the tie rule decides); a sample plan whose brackets miss (every row through the radix launch).
# Then: four consumer warpgroups (wg4, 3 stages); key splits (a row's parts from different CTAs, the last part's
# selecting warp selects it; 2000 keys = 11 stages of 192 in 5 parts of 3: an empty last part); two groups per item
# (pair; G = 29: the last item's second group does not exist; with a key split; with overlapped wgmmas).
FUSED = [
    ((1, 2, 4000, 4000, 128, False), 1000, 1024, {}, False),
    ((2, 3, 2850, 2000, 100, False), 500, 512, dict(num_ctas=5, pair=False), False),
    ((1, 2, 2900, 2904, 128, True), 2904, 2944, {}, False),
    ((1, 2, 2900, 2904, 128, True), 1, 64, dict(num_ctas=3), False),
    ((1, 3, 3000, 4000, 128, False), 1300, 1344, dict(num_ctas=4), True),
    ((1, 2, 3000, 4000, 128, False), 2000, 2048, dict(bracket=(8, 500, 1, 1)), True),
    ((2, 3, 2850, 2000, 100, True), 700, 768, dict(wg4=True, pair=False, stages=3, num_ctas=5), False),
    ((1, 2, 4000, 4000, 128, False), 1000, 1024, dict(ksplit=2, num_ctas=7, pair=False), False),
    ((2, 3, 2850, 2000, 100, True), 333, 384, dict(ksplit=5, num_ctas=5), True),
    ((2, 3, 2850, 2000, 100, False), 600, 640, dict(pair=True, stages=3, num_ctas=5), True),
    ((1, 2, 2900, 2904, 128, True), 1000, 1024, dict(pair=True, stages=3, ksplit=2, num_ctas=6), False),
    ((2, 3, 2850, 2000, 100, True), 1999, 2048, dict(pair=True, overlap=True, stages=3, num_ctas=7), False),
    # the unit_qf kernel with the fused top-K (pair not given: none, as unit_qf requires)
    ((1, 2, 4000, 4000, 128, False), 1000, 1024, dict(unit_qf=True), False),
]


@pytest.mark.parametrize(("case", "num_keys", "width", "opts", "twins"), FUSED,
                         ids=lambda v: "B{}H{}S{}Sk{}C{}h{}".format(*v) if isinstance(v, tuple) else str(v))
def test_cutedsl_fused_topk_equals_brute_force(case, num_keys, width, opts, twins):
    """The fused selection equals the brute-force top-K of the kernel's own float16 sums (``reference.top_k_rows``:
    ties to the lower index, ascending, -1 up to the width), every slot of the strided selection view written
    (poisoned -7 in a buffer with an extra head on each side), nothing outside it; the sums equal the unfused
    launch's bit for bit; every row's flag written (poisoned 7) and, with the missing plan, rows sent to the radix
    launch. ``twins``: keys come in identical pairs (k8 and 2^KB duplicated), so every sum has an equal neighbour."""
    _, p2 = _mods()
    from comfyui_mc_sparse_pack.kernels.cutedsl import pass2_launch as launch

    B, H, S, SK, C, holes = case
    q8, k8, qf, lse_s, kb, perm = _torch_operands(B, H, S, SK, C, SEED + S + num_keys, holes)
    if twins:
        # keys 2j and 2j + 1 the same (on the bytes: float8 kernels are sparse on CUDA)
        k8 = k8.view(torch.uint8)[:, :, 0::2].repeat_interleave(2, dim=2).contiguous().view(torch.float8_e4m3fn)
        kb = kb[:, :, 0::2].repeat_interleave(2, dim=2).contiguous()
        s = torch.einsum("bhsd,bhkd->bhsk", q8.double(), k8.double()) * qf.double()[..., None, None] / _LOG2E
        lse_s = torch.logsumexp(s, -1).float()
    G = perm.shape[-1] // C
    plain = torch.empty(B, H, G, SK, dtype=torch.float16, device="cuda")
    p2.group_prob_sums_fp8(q8, k8, qf, lse_s, kb, perm, plain, group_size=C, ksplit=1,
                           **{k: v for k, v in opts.items() if k not in ("bracket", "ksplit")})
    sums = torch.full((B, H, G, SK), float("nan"), dtype=torch.float16, device="cuda")
    buf = torch.full((B, H + 2, G, width), -7, dtype=torch.int32, device="cuda")
    sel = buf[:, 1:H + 1]
    launch.flags(q8.device, B * H * G).fill_(7)
    assert p2.select_refusal(q8, k8, C, sums, sel, num_keys, policy=False) is None
    p2.group_prob_sums_fp8(q8, k8, qf, lse_s, kb, perm, sums, group_size=C, select=(sel, num_keys), **opts)
    torch.cuda.synchronize()
    flags = launch.flags(q8.device, B * H * G).clone()
    print(f"rows through the radix launch: {int(flags.sum())} of {flags.numel()}")
    assert not sums.isnan().any(), f"{int(sums.isnan().sum())} sums not written"
    assert torch.equal(sums, plain), "the fused launch's sums differ from the unfused launch's"
    assert bool(((flags == 0) | (flags == 1)).all()), "a row's flag not written"
    if "bracket" in opts:
        assert int(flags.sum()) > 0, "the missing plan sent no row to the radix launch"
    assert bool((buf[:, 0] == -7).all() and (buf[:, H + 1] == -7).all()), "written outside the selection view"
    want = top_k_rows(sums, num_keys, width)
    bad = (sel != want).any(-1)
    assert not bool(bad.any()), (f"{int(bad.sum())} of {bad.numel()} rows differ; first: "
                                 f"{sel[bad][0][:16].tolist()} vs {want[bad][0][:16].tolist()}")
    if twins:  # ties at the threshold were decided (the K-th and (K+1)-th sums equal somewhere)
        srt = torch.sort(sums.float(), dim=-1, descending=True).values
        print(f"rows with a tie at the threshold: {int((srt[..., num_keys - 1] == srt[..., num_keys]).sum())}")


def test_cutedsl_fused_topk_refusals():
    """The fused top-K refuses float32 sums, rows not 16-byte aligned, a bad selection tensor and K out of range; the
    dispatch's question (policy) also a walk that needs key parts to fill the SMs (this 1-item walk)."""
    _, p2 = _mods()
    q8 = torch.zeros(1, 1, 256, 128, device="cuda").to(torch.float8_e4m3fn)
    out = torch.empty(1, 1, 2, 256, dtype=torch.float16, device="cuda")
    sel = torch.empty(1, 1, 2, 128, dtype=torch.int32, device="cuda")
    refuse = lambda *a: p2.select_refusal(*a, policy=False)  # noqa: E731
    assert refuse(q8, q8, 128, out, sel, 100) is None
    assert "key parts" in p2.select_refusal(q8, q8, 128, out, sel, 100)
    assert "float16" in refuse(q8, q8, 128, out.float(), sel, 100)
    assert "aligned" in refuse(q8, q8, 128, out[..., :252], sel, 100)
    assert "sel" in refuse(q8, q8, 128, out, sel.long(), 100)
    assert "num_keys" in refuse(q8, q8, 128, out, sel, 129)
    assert "num_keys" in refuse(q8, q8, 128, out, sel, 0)
