"""The float8 operand pass in one persistent launch (kernels/triton/operands.py, ``selection.fp8_operands(persistent=)``)
under the Triton interpreter: the same outputs as the three-launch path, the rounding of its own statistics, the
ticket order's guarantee (a head's quantising items after all its statistics items), and the fallbacks. The
programs' waits on each other only happen on a GPU: tests/bench_select_race.py compares the two paths there."""

from __future__ import annotations

import math

import pytest
import torch
from comfyui_mc_sparse_pack.kernels import registry

from .test_anchor_kernels import DEVICE, _assert_pow2_scale

triton_backend = next(b for b in registry.backends() if b.name == "triton")
pytestmark = pytest.mark.skipif(
    bool(triton_backend.unavailable_reason), reason=f"triton backend unavailable: {triton_backend.unavailable_reason}"
)


def _mods():
    from comfyui_mc_sparse_pack.kernels.triton import operands, selection

    return operands, selection


def _inputs(gen, B=2, H=3, S=300, SK=170, D=32):
    """Strided [B, S, H*D] views (as ComfyUI's), keys with a large shared component, an all-zero key head, a mean
    query that pushes kb past its clamp."""
    q = (torch.randn(B, S, H * D, generator=gen) * 3).to(torch.bfloat16).view(B, S, H, D).transpose(1, 2)
    k = (torch.randn(B, SK, H * D, generator=gen) + 4 * torch.randn(B, 1, H * D, generator=gen))
    k = k.to(torch.bfloat16).view(B, SK, H, D).transpose(1, 2)
    k[-1, -1] = 0.0
    q[0, 1, :, 0] = 300.0
    lse = torch.randn(B, H, S, generator=gen)
    return q, k, lse


@pytest.mark.parametrize(("split", "quant", "skew", "pow2", "unroll", "evict"),
                         [(64, 128, 1, True, 2, False), (256, 64, 2, False, 1, True), (96, 32, 1, False, 2, True)])
def test_persistent_operands_round_their_own_statistics(gen, split, quant, skew, pow2, unroll, evict):
    """q8 / k8 are bitwise the float8 rounding of (x - mean) / scale with the launch's own mean and scale (ragged
    last items: S = 300, Sk = 170 against 64- to 256-row items), the means are the float64 means to 1e-5, the scales
    follow the power-of-two rule (an all-zero head: 1), lse_s / kb / qf follow fp8_operands' formulas (kb clamped, or
    2^kb), and the three-launch path's outputs agree (the same scales; float8 elements within one rounding step).
    Mutations: a statistics item's slot or a head's arrival count wrong (means / scales off), the K tensor's rows
    quantised with q's statistics, a ragged item's rows dropped (NaN poison in the comparison)."""
    operands, selection = _mods()
    q, k, lse = _inputs(gen)
    scale = 0.125
    st = {}
    got = operands.fp8_operands_persistent(q.to(DEVICE), k.to(DEVICE), lse.to(DEVICE), scale, kb_pow2=pow2,
                                           split_rows=split, quant_rows=quant, skew=skew, unroll=unroll, evict=evict,
                                           stats=st)
    q8, k8, qf, lse_s, kb = (t.cpu() for t in got)
    mq, mk, qs, ks = (st[n].cpu() for n in ("mq", "mk", "q_scale", "k_scale"))
    assert torch.allclose(mq.double(), q.double().mean(2), rtol=1e-5, atol=1e-5)
    assert torch.allclose(mk.double(), k.double().mean(2), rtol=1e-5, atol=1e-5)
    for x, m, sc in ((q, mq, qs), (k, mk, ks)):
        _assert_pow2_scale(sc, (x.float() - m[:, :, None]).abs().amax((-2, -1)))
    assert float(ks[-1, -1]) == 1.0
    want_q8 = ((q.float() - mq[:, :, None]) / qs[..., None, None]).to(torch.float8_e4m3fn)
    want_k8 = ((k.float() - mk[:, :, None]) / ks[..., None, None]).to(torch.float8_e4m3fn)
    assert torch.equal(q8.view(torch.uint8), want_q8.view(torch.uint8))
    assert torch.equal(k8.view(torch.uint8), want_k8.view(torch.uint8))
    assert torch.allclose(qf, qs * ks * scale * math.log2(math.e), rtol=1e-6, atol=0)
    want_lse = lse.double() - scale * (q.double() @ mk.double()[..., None]).squeeze(-1)
    assert torch.allclose(lse_s.double(), want_lse, rtol=1e-5, atol=1e-4)
    want_kb = (scale * math.log2(math.e) * ((k.double() - mk.double()[:, :, None]) @ mq.double()[..., None]).squeeze(-1)
               ).clamp(-100, 100)
    assert torch.allclose(kb.double(), torch.exp2(want_kb) if pow2 else want_kb, rtol=1e-5, atol=1e-3)
    # the three-launch path: the same scales; means summed in another order, so a float8 element may round the other
    # way (at most one e4m3 step: 1/8 relative, or the subnormal step 2^-9) and lse_s / kb agree to fp32 rounding
    three = [t.cpu() for t in selection.fp8_operands(q.to(DEVICE), k.to(DEVICE), lse.to(DEVICE), scale, kb_pow2=pow2,
                                                     persistent=False)]
    assert torch.equal(qf, three[2])
    for a, b in zip((q8, k8), three[:2]):
        a, b = a.float(), b.float()
        assert bool(((a - b).abs() <= b.abs() / 8 + 2.0**-9).all()) and float((a != b).float().mean()) < 0.01
    assert torch.allclose(lse_s, three[3], rtol=1e-5, atol=1e-4) and torch.allclose(kb, three[4], rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize(("bh", "ns", "nb", "skew"), [(1, 3, 5, 1), (5, 4, 9, 1), (5, 7, 2, 2), (3, 2, 2, 4)])
def test_schedule_puts_each_head_quantising_after_its_statistics(bh, ns, nb, skew):
    """The ticket order holds every item once, and each head's quantising items come after all of its statistics
    items (what makes the launch deadlock-free: a waiting item's statistics were all taken earlier), the quantising
    items of head h beside the statistics of head h + skew. Mutations: skew 0 (a head's quantising interleaved with
    its own statistics), the interleave indexing off by one (an item twice, another missing)."""
    operands, _ = _mods()
    order = operands._schedule_host(bh, ns, nb, skew)
    assert sorted(order) == sorted(h * 65536 + i for h in range(bh) for i in range(ns + nb))
    pos = {c: n for n, c in enumerate(order)}
    for h in range(bh):
        last_stats = max(pos[h * 65536 + i] for i in range(ns))
        quant = [pos[h * 65536 + ns + j] for j in range(nb)]
        assert last_stats < min(quant)
        if h + skew < bh:  # beside head h + skew's statistics: after its first, before its last
            nxt = [pos[(h + skew) * 65536 + i] for i in range(ns)]
            assert min(nxt) < max(quant) and min(quant) < max(nxt)


def test_refusal_and_failure_fall_back_to_three_launches(gen, monkeypatch, caplog):
    """fp8_operands(persistent=True): where operands.refusal says no (skew 0 here), and after a failing launch (logged
    once, remembered for the process), the three-launch path answers with the same outputs."""
    operands, selection = _mods()
    monkeypatch.setattr(selection, "_PERSISTENT_FAILED", [])
    q, k, lse = _inputs(gen, H=2, S=70, SK=90)
    args = (q.to(DEVICE), k.to(DEVICE), lse.to(DEVICE), 0.125)
    want = selection.fp8_operands(*args, persistent=False)
    assert "skew" in operands.refusal(q, k, skew=0)
    calls = []

    def boom(*a, **kw):
        calls.append(1)
        raise RuntimeError("persistent boom")

    monkeypatch.setattr(operands, "fp8_operands_persistent", boom)
    for _ in range(2):
        got = selection.fp8_operands(*args, persistent=True)
        assert all(torch.equal(a.float(), b.float()) for a, b in zip(got, want))
    assert len(calls) == 1 and "persistent boom" in selection._PERSISTENT_FAILED[0]
    assert "persistent float8 operand pass failed" in caplog.text


def test_refusal_at_the_item_code_limits():
    """operands.refusal at its edges (shapes only, nothing launched): B * H below 2^15 and a head's statistics +
    quantising items below 2^16 (the item codes bh * 65536 + idx), skew >= 1, quant_rows a power of two >= 16 (one
    register tile per item: a 96-row item cannot be one); fp8_operands_persistent raises the reason.
    Mutations: a limit off by one, an item count summed wrongly, the quant_rows check dropped."""
    from types import SimpleNamespace

    operands, _ = _mods()

    def shapes(bh=1, s=64, sk=64):
        return SimpleNamespace(shape=(1, bh, s, 64)), SimpleNamespace(shape=(1, bh, sk, 64))

    ok = dict(split_rows=64, quant_rows=64)
    assert operands.refusal(*shapes(bh=(1 << 15) - 1), **ok) is None
    assert "heads" in operands.refusal(*shapes(bh=1 << 15), **ok)
    # statistics + quantising items of one head: 2 * (S / 64 + Sk / 64) with 64-row items
    assert operands.refusal(*shapes(s=64 * 20000, sk=64 * 12767), **ok) is None  # 65534 items
    assert "rows per head" in operands.refusal(*shapes(s=64 * 20000, sk=64 * 12768), **ok)  # 65536
    assert operands.refusal(*shapes(s=64 * 20000 + 1, sk=64 * 12766), **ok) is None  # 65534: one more of each
    assert operands.refusal(*shapes(), skew=1) is None and "skew" in operands.refusal(*shapes(), skew=0)
    for rows in (16, 32, 64, 128):
        assert operands.refusal(*shapes(), quant_rows=rows) is None
    for rows in (8, 96, 100, 192):
        assert "power of two" in operands.refusal(*shapes(), quant_rows=rows)
    q = torch.zeros(1, 1, 8, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="power of two"):
        operands.fp8_operands_persistent(q, q, torch.zeros(1, 1, 8), 0.125, quant_rows=96)
