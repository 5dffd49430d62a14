"""Cache memory and speedup estimates: equal to real stored bytes, and to the numbers in the docs."""

import dataclasses

import pytest
import torch
from comfyui_mc_sparse_pack.comfyui_mc_sparse import attention, engine, memory
from comfyui_mc_sparse_pack.comfyui_mc_sparse.cache import CacheEntry, CacheKey, encode_entry
from comfyui_mc_sparse_pack.comfyui_mc_sparse.config import MCSparseConfig
from comfyui_mc_sparse_pack.comfyui_mc_sparse.selection import keys_for_density

GB = 1e9


@pytest.mark.parametrize(
    "S,C,density,enc,res,residual",
    [
        (300, 64, 0.25, "auto", "bfloat16", True),
        (300, 64, 0.05, "auto", "float8_e4m3fn", True),
        (257, 128, 0.5, "uint16", "float8_e4m3fn", True),
        (200, 64, 0.3, "int32", "float32", True),
        (190, 64, 1.0, "bitmask", "bfloat16", False),
        (300, 64, 0.25, "auto", "int4", True),
        (300, 64, 0.25, "auto", "int4_group", True),  # ragged: 5 groups of 64 for 300 tokens
        (257, 128, 0.2, "uint16", "int4_group", True),
        (257, 128, 0.2, "auto", "auto", True),
    ],
)
def test_estimate_equals_stored_bytes_of_real_anchor_entries(gen, S, C, density, enc, res, residual):
    """estimate_cache's per-entry bytes are exactly the encoded bytes of an entry from a real anchor call."""
    B, H, D = 2, 3, 64
    q, k, v = (torch.randn(B, H, S, D, generator=gen) for _ in range(3))
    cfg = MCSparseConfig(density=density, group_size=C, warmup_steps=0, anchor_steps=(0,), residual=residual,
                         residual_dtype=res, index_encoding=enc)
    _, entry = attention.anchor_attention(q, k, v, cfg)
    stored = encode_entry(entry, index_encoding=enc, residual_dtype="bfloat16" if res == "auto" else res)
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
    assert line.startswith("MC-Sparse plan: cache") and "expected DiT speedup" in line and line == runner.plan_line
    assert "MC-Sparse plan" not in runner.summary()  # logged once, before sampling; not repeated (issue 9, defect 8)


def test_wan14b_480p_cfg_sizes_against_method_md():
    """Naive layout ~54 GB (the paper's estimate, encoding.py); bitmask + bf16 residual ~30 GB; bitmask + fp8 residual <= 20 GB."""
    kw = dict(heads=40, head_dim=128, layers=40, tokens=32760, density=0.25, group_size=128, branches=2)
    bf16 = memory.estimate_cache(**kw)
    fp8 = memory.estimate_cache(**kw, residual_dtype="float8_e4m3fn")
    assert 53 * GB < bf16.naive_total_bytes < 55 * GB
    assert bf16.selection_encoding == "bitmask" and bf16.selection_bytes == 40 * 256 * 4095
    assert 30 * GB < bf16.total_bytes < 31 * GB
    assert fp8.total_bytes < 20 * GB and fp8.total_bytes > 17 * GB
    assert "naive int32 + bf16 layout" in memory.format_plan(fp8, placement="cpu")


def _entry_of(gen, B, H, S, D, C, K, width):
    """A CacheEntry with the anchor's layout (groups a permutation + -1 tail, K sorted keys + -1, fp32 R), built
    directly: an anchor call at these S would take minutes on a CPU."""
    G = -(-S // C)
    perm = torch.full((B, H, G * C), -1, dtype=torch.int32)
    perm[..., :S] = torch.stack([torch.randperm(S, generator=gen) for _ in range(B * H)]).view(B, H, S).to(torch.int32)
    kv = torch.full((B, H, G, width), -1, dtype=torch.int32)
    kv[..., :K] = torch.sort(torch.randperm(S, generator=gen)[:K]).values.to(torch.int32)  # one K-set for all groups
    return CacheEntry(perm, kv, torch.randn(B, H, S, D, generator=gen), K, (B, H, S, D))


def test_estimate_equals_stored_bytes_past_16_bit_tokens(gen):
    """At S > 65536 (Wan2.1 720p's 75600 tokens; here 1 head) the estimate is the stored bytes too: 17-bit groups,
    bitmask selections, each residual precision."""
    S, C, density = 75600, 128, 0.25
    cfg = MCSparseConfig(density=density, warmup_layers=1)
    K = keys_for_density(density, S, cfg.kv_tile)
    entry = _entry_of(gen, 1, 1, S, 128, C, K, K)
    for res in ("bfloat16", "float8_e4m3fn", "int4_group", "int4"):
        stored = encode_entry(entry, residual_dtype=res)
        est = memory.estimate_for_config(cfg, heads=1, head_dim=128, layers=40, tokens=S, branches=2, residual_dtype=res)
        assert stored.groups.kind == "uint17" and stored.selection.kind == "bitmask"
        assert est.entry_bytes == stored.nbytes and est.entries == 78
        assert (est.groups_bytes, est.selection_bytes, est.residual_bytes) == (
            stored.groups.nbytes, stored.selection.nbytes, stored.residual.nbytes)


def test_wan14b_quality_cfg_sizes_meet_the_bars():
    """Issue 10's bars at the quality preset (s = 0.25, block 0 dense, C = 128, CFG): int4-group (what 'auto' stores
    when bf16 and fp8 fit nowhere) and int4 <= 32 GiB at 720p and <= 12 GiB at 480p; the others for the record."""
    cfg = MCSparseConfig(density=0.25, warmup_layers=1)
    sizes = {}
    for name, S in (("720p", 75600), ("480p", 32760)):
        for res in ("bfloat16", "float8_e4m3fn", "int4_group", "int4"):
            est = memory.estimate_for_config(cfg, heads=40, head_dim=128, layers=40, tokens=S, residual_dtype=res)
            sizes[name, res] = est.total_bytes / 2**30
    print({k: round(v, 2) for k, v in sizes.items()})
    for res in ("int4_group", "int4"):
        assert sizes["720p", res] <= 32 and sizes["480p", res] <= 12
    assert sizes["720p", "bfloat16"] > sizes["720p", "float8_e4m3fn"] > sizes["720p", "int4_group"] > sizes["720p", "int4"]


GIB = 2**30
_720P = dict(heads=40, head_dim=128, layers=40, tokens=75600, branches=2)


@pytest.mark.parametrize(
    "gpu_free,available,residual,placement,expected",
    [
        (100, 200, "auto", "auto", ("bfloat16", "gpu")),  # H200: all on the GPU
        (20, 128, "auto", "auto", ("bfloat16", "cpu")),  # 24 GB card, 128 GB host: bf16 pinned (73 <= 96)
        (60, 128, "auto", "auto", ("bfloat16", "cpu")),  # fp8 would fit the GPU (53.8 <= 60): bf16 in RAM first
        (20, 64, "auto", "auto", ("float8_e4m3fn", "cpu")),  # 64 GB host: 46 GiB fp8 <= 48
        (20, 48, "auto", "auto", ("int4_group", "cpu")),  # 48 GB host: 31.9 GiB int4-group <= 36
        (40, 40, "auto", "auto", ("int4_group", "gpu")),  # 48 GB card: int4-group on the GPU (31.9 + 3.7 + 4 <= 40)
        (20, 32, "auto", "auto", (None, None)),  # 32 GB host: pin budget 24 < 31.6: dense
        (20, 128, "auto", "gpu", (None, None)),  # forced GPU, too small
        (100, 200, "int4", "cpu", ("int4", "cpu")),  # forced precision and placement
        (20, 64, "bfloat16", "auto", (None, None)),  # forced bf16 does not fit a 64 GB host
        (7, 128, "auto", "auto", (None, None)),  # GPU cannot hold the working set + headroom
        (36, 8, "auto", "auto", (None, None)),  # int4 31.6 + 4 headroom fits 36 GiB, not with its 3.7 GiB working set
    ],
)
def test_plan_decisions_from_free_memory_figures(gpu_free, available, residual, placement, expected):
    """bf16 when it fits, else fp8, else int4-group, else int4; GPU before pinned host memory; never more pinned than the budget."""
    cfg = MCSparseConfig(density=0.25, warmup_layers=1, residual_dtype=residual, cache_placement=placement)
    host = memory.HostMemory(available * GIB, available * GIB)
    plan = memory.plan_cache(cfg, gpu_free=gpu_free * GIB, host=host, windows=False, **_720P)
    assert (plan.residual_dtype, plan.placement) == expected, plan.describe()
    if plan.placement == "cpu":
        assert plan.estimate.total_bytes <= plan.host_budget <= 0.75 * host.available
    if plan.dense:  # the reason quotes the smallest cache among the precisions tried
        assert plan.fits and "this run stays dense. Would fit: " in plan.describe()
        assert f"needs {memory._gb(min(e.total_bytes for e in plan.options.values()))} at least" in plan.reason
    else:
        assert plan.estimate == plan.options[plan.residual_dtype]


def test_plan_line_says_why_each_better_precision_does_not_fit():
    """24 GB card (8 GiB free) with 110 GiB of RAM at 720p: bf16 and fp8 fit the pin budget but their GPU working
    sets (two decoded entries: 4.80 / 4.10 GiB) do not fit the 4 GiB left after the headroom, so auto takes
    int4-group; the line says so."""
    cfg = MCSparseConfig(density=0.25, warmup_layers=1)
    plan = memory.plan_cache(cfg, gpu_free=8 * GIB, host=memory.HostMemory(110 * GIB, 128 * GIB), windows=False, **_720P)
    assert (plan.residual_dtype, plan.placement) == ("int4_group", "cpu")
    line = plan.describe()
    assert "int4-group: reuse output within 0.001 rel L1 of bf16's" in line
    assert "bf16 72.93 GiB (cache + working set" in line and "in RAM: its GPU working set 4.80 GiB > 4.00 GiB" in line
    assert "in RAM: its GPU working set 4.10 GiB > 4.00 GiB" in line
    small = memory.plan_cache(cfg, gpu_free=8 * GIB, host=memory.HostMemory(48 * GIB, 64 * GIB), windows=False, **_720P)
    assert "fp8 45.69 GiB (cache + working set 49.79 GiB > GPU 4.00 GiB free after the headroom; in RAM: its GPU " in small.describe()


def test_pin_budget_rule():
    """Pinned bytes: at most 75 % of the available host memory and available - headroom; 40 % of the total on
    Windows; nothing when the figures are unknown."""
    host = memory.HostMemory(40 * GIB, 64 * GIB)
    assert memory.pin_budget(host, 4 * GIB, windows=False) == 30 * GIB
    assert memory.pin_budget(host, 20 * GIB, windows=False) == 20 * GIB
    assert memory.pin_budget(host, 4 * GIB, windows=True) == int(0.4 * 64 * GIB)
    assert memory.pin_budget(None, 0) == 0
    assert memory.pin_budget(memory.HostMemory(1 * GIB, 8 * GIB), 4 * GIB, windows=False) == 0


def test_refuses_to_pin_past_the_budget():
    """A plan never puts the cache in host memory past the pin budget, whichever precision it tries: with 41.4 GiB
    available (budget 31.05 GiB) int4's 31.63 GiB is refused, with 42.2 GiB (budget 31.65 GiB) int4-group's 31.85 GiB
    is refused and int4 is taken (the row-scaled form stays in the 'auto' ladder for this margin)."""
    cfg = MCSparseConfig(density=0.25, warmup_layers=1)
    refused = memory.plan_cache(cfg, gpu_free=20 * GIB, host=memory.HostMemory(int(41.4 * GIB), 64 * GIB),
                                windows=False, **_720P)
    taken = memory.plan_cache(cfg, gpu_free=20 * GIB, host=memory.HostMemory(int(42.2 * GIB), 64 * GIB),
                              windows=False, **_720P)
    assert refused.dense and (taken.residual_dtype, taken.placement) == ("int4", "cpu")
    unknown = memory.plan_cache(cfg, gpu_free=20 * GIB, host=None, **_720P)
    assert unknown.dense and "host memory unknown (nothing pinned)" in unknown.describe()


def test_dense_run_says_why_before_it_starts_and_names_what_fits(gen):
    """A cache that fits nowhere: plan() warns before sampling, every call runs dense, and the message names a
    setting that would fit (here the residual precision, forced to bf16; 'auto' then takes int4)."""
    cfg = MCSparseConfig(density=0.25, group_size=64, warmup_steps=0, anchor_steps=(0,), residual_dtype="bfloat16",
                         cache_headroom_gib=0.0)
    int4 = memory.estimate_for_config(cfg, heads=2, head_dim=64, layers=2, tokens=256, branches=1, residual_dtype="int4")
    gpu = int4.total_bytes + int4.working_bytes  # fits int4 on the GPU, not fp8 or bf16
    runner = engine.MCSparseRunner(cfg, free_memory_fn=lambda dev: gpu, host_memory_fn=lambda: None)
    line = runner.plan(heads=2, head_dim=64, layers=2, tokens=256, branches=1, num_steps=2,
                       device=torch.device("cuda", 0))
    assert "this run stays dense" in line and "residual precision int4" in line
    assert runner.cache_plan.dense and runner.disabled_reason
    q, k, v = (torch.randn(1, 2, 256, 64, generator=gen) for _ in range(3))
    out = runner.attention(q, k, v, step=1, layer=0, key=CacheKey(0, "c", None, tuple(q.shape)))
    assert torch.allclose(out, engine.kernels.dense_attention(q, k, v)) and len(runner.cache) == 0
    assert "dense run: cache does not fit" in runner.summary()
    ok = engine.MCSparseRunner(dataclasses.replace(cfg, residual_dtype="auto"), free_memory_fn=lambda dev: gpu,
                               host_memory_fn=lambda: None)
    ok.plan(heads=2, head_dim=64, layers=2, tokens=256, branches=1, device=torch.device("cuda", 0))
    assert ok.residual_dtype == "int4" and ok.disabled_reason is None and "auto -> int4" in ok.plan_line


@pytest.mark.parametrize("placement", ["auto", "gpu", "cpu"])
def test_off_cuda_the_device_does_not_constrain_the_cache_but_placement_cpu_does_not_fit(placement):
    """engine.MCSparseRunner.plan on a non-CUDA device (CPU, MPS): no free-memory figure limits the cache, so 'auto'
    and 'gpu' keep it on the device whatever its size; 'cpu' placement (pinned host memory, CUDA only) has no pin
    budget there, so the run stays dense and the plan line names a placement that fits."""
    cfg = MCSparseConfig(density=0.25, group_size=64, warmup_steps=0, anchor_steps=(0,), cache_placement=placement)
    runner = engine.MCSparseRunner(cfg, free_memory_fn=lambda dev: 0, host_memory_fn=lambda: None)
    line = runner.plan(heads=40, head_dim=128, layers=40, tokens=75600, num_steps=50, device=torch.device("cpu"))
    if placement == "cpu":
        assert runner.disabled_reason and "this run stays dense" in line and "cache placement auto" in line, line
    else:
        assert runner.disabled_reason is None and runner.residual_dtype == "bfloat16", line


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
    """The paper's 50-step schedule with the measured attention shares gives the ideal speedups of docs/speedup.md."""
    share, calibrated = memory.attention_share(heads, 128, tokens)
    cfg = MCSparseConfig(density=density, anchor_steps=(9, 25))  # performance.md: the paper's two anchors
    sp = memory.expected_speedup(cfg, num_steps=50, num_layers=layers, attention_share=share, kernel_efficiency=eff)
    assert calibrated and sp.speedup == pytest.approx(expected, abs=0.006)


def test_plan_line_says_what_the_anchors_cost():
    """The published schedule (one anchor folded into the last warm-up step) costs one anchor; a second anchor
    doubles the anchors' share of the run; the plan line states both figures."""
    share, _ = memory.attention_share(40, 128, 75600)
    one = memory.expected_speedup(MCSparseConfig(density=0.15, warmup_layers=1), num_steps=50, num_layers=40,
                                  attention_share=share)
    two = memory.expected_speedup(MCSparseConfig(density=0.15, warmup_layers=1, anchor_steps=(9, 25)), num_steps=50,
                                  num_layers=40, attention_share=share)
    # anchor step = 1 + a * (0.5 + s/e) * 39/40 dense steps; with 10 dense + 1 anchor (its step dense anyway)
    per_step = 1 + share * (memory.SELECTION_PASS_COST + 0.15 / memory.DEFAULT_KERNEL_EFFICIENCY) * 39 / 40
    assert one.anchors == 1 and two.anchors == 2
    assert one.anchor_step_cost == pytest.approx(per_step) and two.anchor_step_cost == pytest.approx(per_step)
    assert two.anchor_share == pytest.approx(2 * one.anchor_share * two.speedup / one.speedup, rel=1e-9)
    assert one.speedup > two.speedup and 0.01 < one.anchor_share < 0.03
    est = memory.estimate_cache(heads=40, head_dim=128, layers=39, tokens=75600, branches=2, density=0.15)
    line = memory.format_plan(est, one)
    assert f"1 anchor step at ~{per_step:.2f}x a dense step each, ~{one.anchor_share:.1%} of the run" in line


def test_attention_share_scales_with_tokens():
    """14B: 48 % at 480p predicts the 68 % measured at 720p; unknown models are marked uncalibrated."""
    assert memory.attention_share(40, 128, 75600)[0] == pytest.approx(0.68, abs=0.005)
    assert memory.attention_share(24, 128, 118800)[1] is False


def test_suggestions_fit_the_budget():
    """After an out of memory error: suggestions are settings whose plan fits the GPU memory left; one residual
    precision, the best that fits (int4-group; int4 fits too: mutation listing every fitting precision)."""
    cfg = MCSparseConfig(density=0.25, residual_dtype="bfloat16")
    shape = (1, 40, 32760, 128)
    tips = memory.suggest_settings(cfg, shape, 80, free_bytes=20 * 2**30)
    assert tips[0].startswith("residual precision int4") and "gpu" in tips[0]  # fp8: 15.8 + 1.0 + 4 > 20 GiB
    assert sum(t.startswith("residual precision") for t in tips) == 1, tips
    tight = memory.suggest_settings(cfg, shape, 80, free_bytes=2 * 2**30, host=memory.HostMemory(100 * GIB, 128 * GIB))
    assert any("memory headroom" in t or "fewer latent tokens" in t for t in tight)


def test_residual_off_is_suggested_as_the_python_apis_setting():
    """Where only a cache without the residual fits (selections and groups alone), the suggestions say so and that it
    is no node input (MCSparseConfig.residual; the node always stores the residual). Mutation: the suggestion
    dropped, or any residual-precision suggestion made where none fits."""
    cfg = MCSparseConfig(density=0.25, residual_dtype="auto", cache_placement="gpu", cache_headroom_gib=0.0)
    kw = dict(heads=12, head_dim=128, layers=30, tokens=32760, branches=2)
    none = memory.estimate_for_config(dataclasses.replace(cfg, residual=False), **kw)
    gpu = none.total_bytes + none.working_bytes  # a residual-free cache fits the GPU exactly; int4's does not
    plan = memory.plan_cache(cfg, gpu_free=gpu, host=None, **kw)
    assert plan.dense
    off = [f for f in plan.fits if f.startswith("residual off")]
    assert off and "not a node input" in off[0] and "MCSparseConfig(residual=False)" in off[0], plan.fits
    assert not any(f.startswith("residual precision") for f in plan.fits), plan.fits
    # without the residual the plan weighs one storage, not four equal ones (its line would list four equal sizes)
    off_plan = memory.plan_cache(dataclasses.replace(cfg, residual=False), gpu_free=gpu, host=None, **kw)
    assert not off_plan.dense and list(off_plan.options) == ["bfloat16"], off_plan.options


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
def test_estimate_matches_cuda_allocations():
    """On a GPU, storing an encoded entry allocates what the estimate says (allocator rounding aside)."""
    dev = torch.device("cuda")
    B, H, S, D = 1, 8, 4096, 128
    q, k, v = (torch.randn(B, H, S, D, device=dev, dtype=torch.bfloat16) for _ in range(3))
    cfg = MCSparseConfig(density=0.25, warmup_steps=0, anchor_steps=(0,), residual_dtype="float8_e4m3fn")
    _, entry = attention.anchor_attention(q, k, v, cfg)
    torch.cuda.synchronize()  # 6 tensors with int4 / 17-bit groups, 5 here
    before = torch.cuda.memory_allocated(dev)
    stored = encode_entry(entry, residual_dtype="float8_e4m3fn")
    torch.cuda.synchronize()
    grown = torch.cuda.memory_allocated(dev) - before
    est = memory.estimate_for_config(cfg, heads=H, head_dim=D, layers=1, tokens=S, branches=1)
    assert stored.nbytes == est.entry_bytes
    assert est.entry_bytes <= grown <= est.entry_bytes + 5 * 512  # 5 tensors, 512-byte allocator blocks
