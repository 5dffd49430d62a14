"""Cache memory and speedup estimates: equal to real stored bytes, and to the numbers in the docs."""

import pytest
import torch
from comfyui_mc_sparse_pack.comfyui_mc_sparse import attention, engine, memory
from comfyui_mc_sparse_pack.comfyui_mc_sparse.cache import CacheKey, encode_entry
from comfyui_mc_sparse_pack.comfyui_mc_sparse.config import MCSparseConfig

GB = 1e9


@pytest.mark.parametrize(
    "S,C,density,enc,res,scale,residual",
    [
        (300, 64, 0.25, "auto", "bfloat16", "row", True),
        (300, 64, 0.05, "auto", "float8_e4m3fn", "row", True),
        (257, 128, 0.5, "uint16", "float8_e4m3fn", "tensor", True),
        (200, 64, 0.3, "int32", "float32", "row", True),
        (190, 64, 1.0, "bitmask", "bfloat16", "row", False),
    ],
)
def test_estimate_equals_stored_bytes_of_real_anchor_entries(gen, S, C, density, enc, res, scale, residual):
    """estimate_cache's per-entry bytes are exactly the encoded bytes of an entry from a real anchor call."""
    B, H, D = 2, 3, 64
    q, k, v = (torch.randn(B, H, S, D, generator=gen) for _ in range(3))
    cfg = MCSparseConfig(density=density, group_size=C, warmup_steps=0, anchor_steps=(0,), residual=residual,
                         residual_dtype=res, residual_scale=scale, index_encoding=enc)
    _, entry = attention.anchor_attention(q, k, v, cfg)
    stored = encode_entry(entry, index_encoding=enc, residual_dtype=res, residual_scale=scale)
    est = memory.estimate_for_config(cfg, heads=H, head_dim=D, layers=5, tokens=S, branches=2, batch=B)
    assert est.entry_bytes == stored.nbytes
    assert (est.groups_bytes, est.selection_bytes) == (stored.groups.nbytes, stored.selection.nbytes)
    assert est.selection_encoding == stored.selection.kind and est.entries == 10
    assert est.naive_entry_bytes == entry.perm.numel() * 4 + entry.kv_idx.numel() * 4 + (2 * B * H * S * D if residual else 0)


def test_runner_cache_bytes_match_the_plan(gen):
    """A whole run's cache holds what plan() announced: entries x entry bytes, warm-up layers excluded."""
    cfg = MCSparseConfig(density=0.25, group_size=64, warmup_steps=1, warmup_layers=1, anchor_steps=(0,),
                         residual_dtype="float8_e4m3fn")
    runner = engine.MCSparseRunner(cfg)
    line = runner.plan(heads=2, head_dim=64, layers=3, tokens=192, branches=2, num_steps=6)
    for layer in range(3):
        for branch in "cu":
            q, k, v = (torch.randn(1, 2, 192, 64, generator=gen) for _ in range(3))
            runner.attention(q, k, v, step=0, layer=layer, key=CacheKey(layer, branch, None, tuple(q.shape)))
    est = memory.estimate_for_config(cfg, heads=2, head_dim=64, layers=3, tokens=192, branches=2)
    assert len(runner.cache) == est.entries == 4 and runner.cache.nbytes == est.total_bytes
    assert line.startswith("MC-Sparse plan: cache") and "expected DiT speedup" in line and line in runner.summary()


def test_wan14b_480p_cfg_sizes_against_method_md():
    """Naive layout ~54 GB (method.md); bitmask + bf16 residual ~30 GB; bitmask + fp8 residual <= 20 GB."""
    kw = dict(heads=40, head_dim=128, layers=40, tokens=32760, density=0.25, group_size=128, branches=2)
    bf16 = memory.estimate_cache(**kw)
    fp8 = memory.estimate_cache(**kw, residual_dtype="float8_e4m3fn")
    assert 53 * GB < bf16.naive_total_bytes < 55 * GB
    assert bf16.selection_encoding == "bitmask" and bf16.selection_bytes == 40 * 256 * 4095
    assert 30 * GB < bf16.total_bytes < 31 * GB
    assert fp8.total_bytes < 20 * GB and fp8.total_bytes > 17 * GB
    assert "naive int32 + bf16 layout" in memory.format_plan(fp8, placement="cpu")


@pytest.mark.parametrize(
    "heads,tokens,layers,density,eff,expected",
    [
        (40, 75600, 40, 0.25, 0.90, 1.57), (40, 75600, 40, 0.25, 0.97, 1.60),
        (40, 75600, 40, 0.15, 0.90, 1.74), (40, 75600, 40, 0.15, 0.97, 1.76),
        (40, 32760, 40, 0.25, 0.90, 1.34), (40, 32760, 40, 0.15, 0.97, 1.44),
        (12, 32760, 30, 0.25, 0.90, 1.45), (12, 32760, 30, 0.15, 0.97, 1.58),
    ],
)
def test_expected_speedup_reproduces_performance_md(heads, tokens, layers, density, eff, expected):
    """The paper's 50-step schedule with the measured attention shares gives performance.md's ideal speedups."""
    share, calibrated = memory.attention_share(heads, 128, tokens)
    cfg = MCSparseConfig(density=density)  # 10 warm-up steps, anchors (9, 25)
    sp = memory.expected_speedup(cfg, num_steps=50, num_layers=layers, attention_share=share, kernel_efficiency=eff)
    assert calibrated and sp.speedup == pytest.approx(expected, abs=0.006)


def test_attention_share_scales_with_tokens():
    """14B: 48 % at 480p predicts the 68 % measured at 720p; unknown models are marked uncalibrated."""
    assert memory.attention_share(40, 128, 75600)[0] == pytest.approx(0.68, abs=0.005)
    assert memory.attention_share(24, 128, 118800)[1] is False


def test_suggestions_fit_the_budget():
    """suggest_settings only lists settings whose GPU bytes fit the free memory given."""
    cfg = MCSparseConfig(density=0.25)
    shape = (1, 40, 32760, 128)
    tips = memory.suggest_settings(cfg, shape, 80, free_bytes=20 * 2**30)
    assert tips[0].startswith("residual_dtype='float8_e4m3fn'") and any("cache_placement='cpu'" in t for t in tips)
    tight = memory.suggest_settings(cfg, shape, 80, free_bytes=2 * 2**30)
    assert not any(t.startswith("residual_dtype") for t in tight) and any("cache_placement='cpu'" in t for t in tight)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
def test_estimate_matches_cuda_allocations():
    """On a GPU, storing an encoded entry allocates what the estimate says (allocator rounding aside)."""
    dev = torch.device("cuda")
    B, H, S, D = 1, 8, 4096, 128
    q, k, v = (torch.randn(B, H, S, D, device=dev, dtype=torch.bfloat16) for _ in range(3))
    cfg = MCSparseConfig(density=0.25, warmup_steps=0, anchor_steps=(0,), residual_dtype="float8_e4m3fn")
    _, entry = attention.anchor_attention(q, k, v, cfg)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(dev)
    stored = encode_entry(entry, residual_dtype="float8_e4m3fn")
    torch.cuda.synchronize()
    grown = torch.cuda.memory_allocated(dev) - before
    est = memory.estimate_for_config(cfg, heads=H, head_dim=D, layers=1, tokens=S, branches=1)
    assert stored.nbytes == est.entry_bytes
    assert est.entry_bytes <= grown <= est.entry_bytes + 5 * 512  # 5 tensors, 512-byte allocator blocks
