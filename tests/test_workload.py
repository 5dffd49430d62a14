"""The synthetic DiT-like workload: shapes, dtypes, determinism, smooth drift, plausible attention statistics."""

import math

import pytest
import torch
from comfyui_mc_sparse_pack.comfyui_mc_sparse.tools import workload
from comfyui_mc_sparse_pack.comfyui_mc_sparse.tools.workload import SyntheticWorkload, WorkloadSpec

SMALL = dict(frames=4, height=8, width=16, heads=5, head_dim=64, num_steps=10)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_shapes_and_dtypes(dtype):
    """q, k, v are [B, H, S, D] in the asked dtype, finite, on the workload's device."""
    spec = WorkloadSpec(**{**SMALL, "batch": 2})
    q, k, v = SyntheticWorkload(spec).qkv(3, dtype=dtype)
    for t in (q, k, v):
        assert t.shape == (2, 5, 4 * 8 * 16, 64) and t.dtype == dtype and t.device.type == "cpu"
        assert torch.isfinite(t).all()
    assert not torch.equal(q[0], q[1])  # each batch element has its own content


def test_low_precision_rounds_the_fp32_tensors():
    """fp16/bf16 outputs are the fp32 tensors rounded, not another workload."""
    wl = SyntheticWorkload(WorkloadSpec(**SMALL))
    ref = wl.qkv(2)[0]
    assert _rel(wl.qkv(2, dtype=torch.bfloat16)[0], ref) < 1e-2


def test_same_seed_same_tensors_other_seed_other_tensors():
    """The workload is a pure function of (spec, step, layer): two instances with one seed agree bitwise."""
    a = SyntheticWorkload(WorkloadSpec(**SMALL, seed=7)).qkv(4, layer=1)
    b = SyntheticWorkload(WorkloadSpec(**SMALL, seed=7)).qkv(4, layer=1)
    c = SyntheticWorkload(WorkloadSpec(**SMALL, seed=8)).qkv(4, layer=1)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], c[0])


def test_layers_have_their_own_heads():
    """Two layers share the latent but not the head weights."""
    wl = SyntheticWorkload(WorkloadSpec(**SMALL))
    assert not torch.equal(wl.qkv(1, layer=0)[0], wl.qkv(1, layer=1)[0])
    assert set(wl.head_kinds(0)) == set(workload.HEAD_KINDS)  # 5 heads cover every kind


def test_drift_is_smooth_and_grows_with_step_distance():
    """Consecutive steps differ a little; the change from an anchor step grows with the distance to it."""
    wl = SyntheticWorkload(WorkloadSpec(**{**SMALL, "num_steps": 20}))
    qs = [wl.qkv(t)[0] for t in range(20)]
    anchor = 5
    dist = [_rel(qs[t], qs[anchor]) for t in range(anchor, 20)]
    assert all(b > a for a, b in zip(dist, dist[1:])), dist
    steps = [_rel(qs[t + 1], qs[t]) for t in range(19)]
    assert max(steps) < 0.2 and dist[-1] > 2 * max(steps)


def test_zero_drift_is_static():
    """drift = 0: every step gives the same tensors."""
    wl = SyntheticWorkload(WorkloadSpec(**SMALL, drift=0.0))
    assert torch.equal(wl.qkv(0)[1], wl.qkv(9)[1])


def test_attention_is_plausible_for_a_video_dit():
    """Top-20 % recall in the real-DiT range, mass concentrated locally and on sinks, entropy well below uniform."""
    spec = WorkloadSpec(frames=8, height=16, width=16, heads=5, head_dim=128, num_steps=20)
    wl = SyntheticWorkload(spec)
    q, k, _ = wl.qkv(10)
    stats = workload.attention_stats(q, k, wl.positions, sinks=wl.sink_tokens, max_queries=512)
    assert 0.8 <= stats["top_recall"] <= 0.95, stats
    box_share = (3 * 5 * 5) / spec.tokens  # the (1, 2, 2) box holds at most 75 of the 2048 tokens
    assert stats["local_mass"] > 5 * box_share, stats
    assert stats["sink_mass"] > 10 * spec.num_sinks / spec.tokens, stats
    assert 0.4 < stats["entropy_ratio"] < 0.85, stats


def test_rope_bands_follow_wan():
    """Band split (time, height, width): Wan2.1's (44, 42, 42) at D = 128, each even, summing to D."""
    assert workload.rope_bands(128) == (44, 42, 42)
    for d in (6, 8, 64, 96, 128):
        bands = workload.rope_bands(d)
        assert sum(bands) == d and all(b % 2 == 0 and b > 0 for b in bands)


def test_positions_follow_the_token_order():
    """Token s sits at (f, y, x) with s = (f * height + y) * width + x."""
    wl = SyntheticWorkload(WorkloadSpec(**SMALL))
    f, y, x = wl.positions[77].tolist()
    assert (f * 8 + y) * 16 + x == 77


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"frames": 0}, "frames must be >= 1, got 0"),
        ({"heads": 2.0}, "heads must be an int, got float"),
        ({"head_dim": 65}, "head_dim must be even"),
        ({"head_dim": 4}, "head_dim must be >= 6"),
        ({"num_sinks": 10_000}, r"num_sinks must be < S = 512"),
        ({"drift": -1.0}, "drift must be >= 0"),
        ({"drift": math.nan}, "drift must be a finite number"),
        ({"rope_base": 1.0}, "rope_base must be > 1"),
    ],
)
def test_spec_rejects_bad_values(kwargs, match):
    """Each bad field raises, naming the field and its range."""
    with pytest.raises((ValueError, TypeError), match=match):
        WorkloadSpec(**{**SMALL, **kwargs})


def test_qkv_rejects_bad_step_layer_dtype():
    """Out-of-range step, negative layer and integer dtypes raise with the accepted range."""
    wl = SyntheticWorkload(WorkloadSpec(**SMALL))
    with pytest.raises(ValueError, match=r"step must be in \[0, 10\)"):
        wl.qkv(10)
    with pytest.raises(ValueError, match="layer must be an int >= 0"):
        wl.qkv(0, layer=-1)
    with pytest.raises(TypeError, match="dtype must be float16"):
        wl.qkv(0, dtype=torch.int32)
    with pytest.raises(TypeError, match="spec must be a WorkloadSpec"):
        SyntheticWorkload(SMALL)
