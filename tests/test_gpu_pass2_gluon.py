"""The warp-specialised sm_90 Gluon pass 2 (kernels/triton/selection_sm90.py) on an H200 against float64 and the
Triton pair kernel: the same float8 operands (``selection.fp8_operands``), NaN-poisoned outputs, ragged S, odd group
counts, a ragged last group, B = 2, Sk != S, D 64 / 128, C 100 / 128, float16 and float32 sums; the dispatch
(``gluon=True``) runs it without a fallback and select_kv on its sums is exactly their top-K; no register spills.

Skipped without an sm_90 GPU (the CPU side: tests/test_pass2_dispatch.py). Run:
``python -m pytest -q -m gpu tests/test_gpu_pass2_gluon.py`` (~20 s on an H200, compiles included).
"""

from __future__ import annotations

import pytest
import torch
from comfyui_mc_sparse_pack.kernels import reference
from comfyui_mc_sparse_pack.kernels.reference.topk import top_k_rows as ref_top_k_rows

from .test_reuse_op import random_groups

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                       reason="needs an sm_90 CUDA GPU"),
]
SEED = 20261201


def _mods():
    from comfyui_mc_sparse_pack.kernels.triton import pass2_dispatch, selection, selection_sm90

    return selection, selection_sm90, pass2_dispatch


def _case(B, H, S, SK, D, C, seed):
    """q, k (bf16, a shared component per head as real q / k have), the exact LSE of softmax(q k^T), and random
    groups (-1 padding in the last group; no PDDP compile in this file's time budget)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    print(f"seed {seed}: B {B} H {H} S {S} Sk {SK} D {D} C {C}")
    q = (torch.randn(B, H, S, D, device="cuda", generator=gen)
         + torch.randn(B, H, 1, D, device="cuda", generator=gen)).to(torch.bfloat16)
    k = (torch.randn(B, H, SK, D, device="cuda", generator=gen)
         + 2 * torch.randn(B, H, 1, D, device="cuda", generator=gen)).to(torch.bfloat16)
    _, lse = reference.dense_attention(q.double(), k.double(), k.double(), return_lse=True)
    perm = random_groups(torch.Generator().manual_seed(seed), B, H, S, C).cuda()
    return q, k, lse.float(), perm


CASES = [  # B, H, S, Sk, D, C: G = 32 (even, ragged last group); B = 2, Sk != S, C = 100, G = 29 (odd, ragged); D 64
    (1, 2, 4000, 4000, 128, 128),
    (2, 3, 2850, 2000, 128, 100),
    (1, 2, 2900, 2900, 64, 128),
]


# (case, tuning): the default on every case, the options on the B = 2 / Sk != S / odd-G case (time budget: < 45 s)
VARIANTS = [(c, {}) for c in CASES] + [(CASES[1], t) for t in (  # the newest first (a round's time cap cuts the tail)
    dict(poly=20), dict(poly=22, pingpong=True, ksplit=3), dict(poly=10), dict(poly=10, ksplit=3), dict(ksplit=5),
    dict(poly=10, pingpong=True), dict(poly=12), dict(poly=11),
    dict(poly=10, thread_arrive=True), dict(groups=3, poly=10), dict(pingpong=True, thread_arrive=True),
    dict(thread_arrive=True), dict(groups=3, thread_arrive=True, poly=0), dict(kb_poly=True), dict(groups=3, poly=0),
    dict(poly=0, kb_poly=False))]  # the last: the configuration of session 5 (FADD row sums, 2^KB in the kernel)
BF16_P_RTOL = 2e-3  # poly >= 10: the exponentials rounded to bfloat16 (2^-9) before the tensor cores sum them


@pytest.mark.parametrize(("case", "tuning"), VARIANTS,
                         ids=lambda v: "B{}H{}S{}Sk{}D{}C{}".format(*v) if isinstance(v, tuple) else str(v))
def test_gluon_pass2_equals_float64_and_the_triton_kernel(case, tuning):
    """Every entry written (NaN-poisoned outputs); fp32 sums within 5e-4 relative L2 per group of the float64 sums of
    the same float8 operands (H200: the e4m3 wgmma's accumulation, as the Triton kernel's 5e-5 - 1.4e-4) and within
    1e-4 relative of the Triton pair kernel's (the same products and exponentials; only the row-sum order differs;
    ``kb_poly``: the per-key factor by the FMA-pipe polynomial, < 5e-5 relative); fp16 sums within one fp16
    rounding of the Triton kernel's. ``poly=10`` (row sums on the tensor cores from bfloat16 exponentials): within
    ``BF16_P_RTOL`` relative L2 per group of both, 1e-2 per entry of the Triton kernel's."""
    selection, g90, _ = _mods()
    B, H, S, SK, D, C = case
    eff = {**g90.config(D), **tuning}  # the launch's configuration
    pow2 = eff["kb_poly"] == 2  # the operands carry 2^KB
    q, k, lse, perm = _case(*case, seed=SEED + S + len(str(tuning)))
    q8, k8, qf, lse_s, kb = selection.fp8_operands(q, k, lse, D**-0.5, kb_pow2=pow2)
    G = perm.shape[-1] // C
    want32 = selection.group_prob_sums(q, k, lse, perm, group_size=C, fp8=True, gluon=False)
    want16 = torch.empty(B, H, G, SK, dtype=torch.float16, device="cuda")
    selection.group_prob_sums(q, k, lse, perm, group_size=C, fp8=True, gluon=False, out=want16)
    for dtype, want in ((torch.float32, want32), (torch.float16, want16)):
        out = torch.full((B, H, G, SK), float("nan"), dtype=dtype, device="cuda")
        g90.group_prob_sums_fp8(q8, k8, qf, lse_s, kb, perm.contiguous(), out, group_size=C, **tuning)
        torch.cuda.synchronize()
        assert not out.isnan().any(), f"{int(out.isnan().sum())} entries not written ({dtype})"
        bf16_p = eff["poly"] >= 10
        if dtype == torch.float32:
            rel_t = float(((out - want).abs() / want.abs().clamp_min(1e-30)).max())
            print(f"fp32: max relative difference to the Triton kernel {rel_t:.2e}")
            assert rel_t < (1e-2 if bf16_p else 1e-4), rel_t
            if bf16_p:
                rel_l2 = float(((out.double() - want.double()).norm(dim=-1) / want.double().norm(dim=-1)).max())
                assert rel_l2 < BF16_P_RTOL, rel_l2
        elif bf16_p:
            assert torch.allclose(out.float(), want.float(), rtol=1e-2, atol=1e-7), \
                float((out.float() - want.float()).abs().max())
        else:
            assert torch.allclose(out.float(), want.float(), rtol=2**-10, atol=1e-7), \
                float((out.float() - want.float()).abs().max())
    # against float64 on the dequantised float8 operands (as tests/test_anchor_gpu.py's float8 test)
    (_, qs), (_, ks) = selection.fp8_stats(q), selection.fp8_stats(k)
    deq = reference.group_prob_sums(q8.double() * qs.double()[..., None, None],
                                    k8.double() * ks.double()[..., None, None], lse_s.double(), perm, group_size=C)
    deq = deq * (kb.double() if pow2 else torch.exp2(kb.double()))[:, :, None, :]
    out = torch.full((B, H, G, SK), float("nan"), dtype=torch.float32, device="cuda")
    g90.group_prob_sums_fp8(q8, k8, qf, lse_s, kb, perm.contiguous(), out, group_size=C, **tuning)
    rel = (out.double() - deq).norm(dim=-1) / deq.norm(dim=-1)
    print(f"float64: max relative L2 per group {float(rel.max()):.2e}")
    assert float(rel.max()) < (BF16_P_RTOL if eff["poly"] >= 10 else 5e-4), float(rel.max())


def test_gluon_pass2_through_the_dispatch_and_select_kv():
    """gluon=True: the Gluon kernel runs (no fallback remembered), its sums are the direct call's bit for bit, and
    select_kv on it is exactly the top-K of its float16 sums (ties to the lower index) and keeps >= 99.5 % of the
    float64 top-K's probability mass; no register spills in any compiled variant."""
    selection, g90, dispatch = _mods()
    dispatch.reset()
    S, D, C, H, kq = 2900, 128, 128, 2, 734
    q, k, lse, perm = _case(1, H, S, S, D, C, seed=SEED)
    G = perm.shape[-1] // C
    q8, k8, qf, lse_s, kb = selection.fp8_operands(q, k, lse, D**-0.5, kb_pow2=dispatch.gluon_kb_pow2(D))
    direct = torch.full((1, H, G, S), float("nan"), device="cuda")
    g90.group_prob_sums_fp8(q8, k8, qf, lse_s, kb, perm, direct, group_size=C)
    out = selection.group_prob_sums(q, k, lse, perm, group_size=C, fp8=True, gluon=True)
    assert dispatch.fallback_reason() is None, dispatch.fallback_reason()
    assert torch.equal(out, direct)
    idx = selection.select_kv(q, k, lse, perm, kq, group_size=C, kv_tile=128, fp8=True, gluon=True)
    sums16 = torch.empty(1, H, G, S, dtype=torch.float16, device="cuda")
    selection.group_prob_sums(q, k, lse, perm, group_size=C, fp8=True, gluon=True, out=sums16)
    assert torch.equal(idx, ref_top_k_rows(sums16, kq, idx.shape[-1]))
    ref = reference.group_prob_sums(q.double(), k.double(), lse.double(), perm, group_size=C)
    kept = ref.gather(-1, idx[..., :kq].long()).sum(-1)
    assert bool((kept >= 0.995 * ref.topk(kq, -1).values.sum(-1)).all())
    assert dispatch.fallback_reason() is None
    stats = [(ck.n_regs, ck.n_spills) for ck in g90.compiled_kernels()]
    print("compiled Gluon pass-2 kernels (n_regs, n_spills):", stats)
    assert stats and all(sp == 0 for _, sp in stats)
