"""The compact metadata cache: bit-exact selections and groups, fp8 residual cost, placement, prefetch, OOM."""

import pytest
import torch
from comfyui_mc_sparse_pack import kernels
from comfyui_mc_sparse_pack.comfyui_mc_sparse import attention, encoding, engine
from comfyui_mc_sparse_pack.comfyui_mc_sparse.cache import CacheKey, MetadataCache, StoredEntry, encode_entry
from comfyui_mc_sparse_pack.comfyui_mc_sparse.config import MCSparseConfig
from comfyui_mc_sparse_pack.comfyui_mc_sparse.schedule import StepKind
from comfyui_mc_sparse_pack.comfyui_mc_sparse.tools.workload import SyntheticWorkload, WorkloadSpec


def _selection(gen, B, H, G, S, K, width):
    """Random sorted selections of exactly K tokens per group, -1 past K (the select_kv contract)."""
    scores = torch.rand(B, H, G, S, generator=gen)
    idx = torch.sort(torch.topk(scores, K, dim=-1).indices, dim=-1).values.to(torch.int32)
    pad = torch.full((B, H, G, width - K), -1, dtype=torch.int32)
    return torch.cat([idx, pad], dim=-1)


def _rel_l1(a, b):
    return ((a.double() - b.double()).abs().sum() / b.double().abs().sum()).item()


# --- encodings ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["auto", "bitmask", "uint16", "int32"])
@pytest.mark.parametrize("S,K,width", [(1000, 256, 256), (1003, 70, 128), (77, 77, 128), (9, 1, 64), (65536, 300, 320)])
def test_selection_round_trip_is_bit_exact(gen, kind, S, K, width):
    """Every encoding decodes to the identical int32 array: same indices, same order, same -1 padding."""
    kv = _selection(gen, 2, 3, 4, S, K, width)
    enc = encoding.encode_selection(kv, S, K, kind)
    out = encoding.decode_selection(enc)
    assert out.dtype == torch.int32 and torch.equal(out, kv)
    if kind != "auto":
        assert enc.kind == kind


def test_selection_from_a_real_anchor_round_trips(gen):
    """Selections made by select_kv (ragged S, K = S at density 1) survive the bitmask exactly."""
    for S, density in ((300, 0.2), (130, 1.0)):
        q, k, v = (torch.randn(1, 2, S, 64, generator=gen) for _ in range(3))
        cfg = MCSparseConfig(density=density, group_size=64, warmup_steps=0, anchor_steps=(0,))
        _, entry = attention.anchor_attention(q, k, v, cfg)
        stored = encode_entry(entry, index_encoding="bitmask")
        back = stored.decode(q.device, q.dtype)
        assert torch.equal(back.kv_idx, entry.kv_idx) and torch.equal(back.perm, entry.perm)
        assert stored.selection.kind == "bitmask" and stored.groups.kind == "uint16"


def test_rows_not_k_sorted_fall_back_to_int32(gen):
    """Unsorted rows or rows with fewer than K tokens are stored as given, so the round trip stays exact."""
    kv = _selection(gen, 1, 2, 3, 500, 64, 64)
    unsorted = kv.flip(-1).contiguous()
    short = kv.clone()
    short[0, 0, 0, -1] = -1
    for bad in (unsorted, short):
        enc = encoding.encode_selection(bad, 500, 64, "bitmask")
        assert enc.kind == "int32" and torch.equal(encoding.decode_selection(enc), bad)


@pytest.mark.parametrize("S,K,expected", [(32760, 8192, "bitmask"), (32760, 1024, "uint16"), (32760, 2040, "uint16"),
                                          (32760, 2048, "bitmask"),
                                          (75600, 18944, "bitmask"), (200000, 1024, "int32"), (200000, 8192, "bitmask")])
def test_auto_picks_the_smallest_encoding(S, K, expected):
    """auto: bitmask (S/8 bytes) beats 16-bit indices (2K) above s = 1/16; int32 only where neither fits."""
    assert encoding.pick_selection_encoding("auto", S, K, K) == expected


def test_groups_round_trip_and_tail(gen):
    """Query groups: 16-bit for S <= 65536 with the -1 tail restored; anything else stored as int32."""
    q = torch.randn(2, 3, 200, 64, generator=gen)
    perm = kernels.pddp_groups(q, 64)
    enc = encoding.encode_groups(perm, 200)
    assert enc.kind == "uint16" and enc.nbytes == 2 * 3 * 200 * 2
    assert torch.equal(encoding.decode_groups(enc), perm)
    odd = perm.clone()
    odd[0, 0, -1] = 5  # not the documented -1 tail
    assert encoding.encode_groups(odd, 200).kind == "int32"


@pytest.mark.parametrize("scale", ["row", "tensor"])
def test_fp8_residual_error_is_small_and_scaled(gen, scale):
    """fp8 e4m3 with a scale keeps the residual within e4m3's rounding (~2-3 % relative L1), rows of any size."""
    r = torch.randn(1, 2, 300, 64, generator=gen) * torch.logspace(-4, 1, 300).view(1, 1, 300, 1)
    enc = encoding.encode_residual(r, "float8_e4m3fn", scale)
    back = encoding.decode_residual(enc, torch.float32)
    assert enc.data.dtype == torch.float8_e4m3fn and enc.nbytes == r.numel() + (2 * 300 * 4 if scale == "row" else 4)
    assert _rel_l1(back, r) < 0.04
    if scale == "row":  # small rows are as precise as large ones
        assert _rel_l1(back[..., :30, :], r[..., :30, :]) < 0.04


def test_fp8_residual_fidelity_cost_on_reuse_output():
    """The fp8 residual's cost: change in relative L1 (reuse output vs dense) stays well below the residual's gain."""
    spec = WorkloadSpec(frames=4, height=8, width=16, heads=4, head_dim=64, num_steps=20, drift=0.8, seed=3)
    wl = SyntheticWorkload(spec)
    q0, k0, v0 = wl.qkv(10, dtype=torch.bfloat16)
    q1, k1, v1 = wl.qkv(12, dtype=torch.bfloat16)
    dense = kernels.dense_attention(q1, k1, v1)
    cfg = MCSparseConfig(density=0.2, group_size=64, warmup_steps=0, anchor_steps=(0,), residual_dtype="float8_e4m3fn")
    _, entry = attention.anchor_attention(q0, k0, v0, cfg)
    errors = {}
    for name, dtype, scale in (("bf16", "bfloat16", "row"), ("fp8-row", "float8_e4m3fn", "row"),
                               ("fp8-tensor", "float8_e4m3fn", "tensor")):
        stored = encode_entry(entry, residual_dtype=dtype, residual_scale=scale)
        errors[name] = _rel_l1(attention.reuse_attention(q1, k1, v1, stored.decode(q1.device, q1.dtype)), dense)
    no_residual = _rel_l1(kernels.sparse_attention(q1, k1, v1, entry.perm, entry.kv_idx), dense)
    gain = no_residual - errors["bf16"]
    assert gain > 0
    for name in ("fp8-row", "fp8-tensor"):
        assert abs(errors[name] - errors["bf16"]) < 0.1 * gain, (errors, no_residual)


# --- placement and prefetch -----------------------------------------------------------------------------------


def _workload_run(gen, placement, steps=5, layers=3, branches=("c", "u"), residual_dtype="bfloat16"):
    cfg = MCSparseConfig(density=0.25, group_size=64, warmup_steps=1, anchor_steps=(0, 3), cache_placement=placement,
                         residual_dtype=residual_dtype)
    runner = engine.MCSparseRunner(cfg)
    inputs = {}
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    g = torch.Generator().manual_seed(seed)
    outs = []
    for step in range(steps):
        for layer in range(layers):
            for branch in branches:
                q, k, v = inputs.setdefault((step, layer, branch), [torch.randn(1, 2, 160, 64, generator=g) for _ in range(3)])
                key = CacheKey(layer, branch, None, tuple(q.shape))
                outs.append(runner.attention(q, k, v, step=step, layer=layer, key=key))
    return runner, outs


def test_cpu_placement_prefetches_in_anchor_order_and_matches_gpu_placement(gen):
    """Without CUDA the cpu path runs synchronously: every reuse load after the first of a run is a prefetch hit,
    and the outputs equal those of the resident ('gpu') placement bit for bit."""
    state = gen.get_state()
    cpu_runner, cpu_outs = _workload_run(gen, "cpu")
    gen.set_state(state)
    gpu_runner, gpu_outs = _workload_run(gen, "gpu")
    assert all(torch.equal(a, b) for a, b in zip(cpu_outs, gpu_outs))
    reuse = cpu_runner.stats.calls[StepKind.REUSE]
    assert reuse == 3 * 3 * 2  # steps 1, 2 and 4 reuse; 3 layers x 2 branches each
    # the first reuse call after each anchor finds nothing prefetched (step 1 and step 4); all others hit
    assert cpu_runner.cache.misses == 2 and cpu_runner.cache.hits == reuse - 2
    assert "2 in line" in cpu_runner.summary() and cpu_runner.cache.host_bytes > 0
    cpu_runner.close()
    assert cpu_runner.cache.nbytes == 0 and len(cpu_runner.cache) == 0


def test_stored_entries_are_compact_and_accounted(gen):
    """The runner stores encoded entries: bitmask + 16-bit groups + fp8 residual, counted in the cache's bytes."""
    runner, _ = _workload_run(gen, "auto", residual_dtype="float8_e4m3fn")
    entries = [runner.cache.get(CacheKey(layer, b, None, (1, 2, 160, 64))) for layer in range(3) for b in "cu"]
    assert all(isinstance(e, StoredEntry) for e in entries)
    e = entries[0]
    assert e.selection.kind == "bitmask" and e.groups.kind == "uint16" and e.residual.data.dtype == torch.float8_e4m3fn
    assert runner.cache.nbytes == sum(x.nbytes for x in entries) == 6 * e.nbytes
    assert "float8_e4m3fn (row scale)" in runner.summary()


class _FakeEntry:
    """Just what placement looks at: a CUDA device and a size (no CUDA needed)."""

    device = torch.device("cuda", 0)

    def __init__(self, nbytes):
        self.nbytes = nbytes


@pytest.mark.parametrize(
    "placement,expected_bytes,free,entry,choice,spilled",
    [
        ("cpu", None, 100 << 30, 1 << 20, "cpu", False),
        ("gpu", None, 100 << 30, 1 << 30, "gpu", False),
        ("gpu", None, 1 << 30, 1 << 30, "cpu", True),  # would leave less than the margin: moved, not OOM
        ("auto", 30 << 30, 40 << 30, 1 << 30, "gpu", False),  # whole cache + 4 GiB headroom fits
        ("auto", 30 << 30, 32 << 30, 1 << 30, "cpu", False),  # decided up front: all in CPU memory
        ("auto", None, 6 << 30, 1 << 30, "gpu", False),  # no plan: per entry, fits with headroom
        ("auto", None, 4 << 30, 1 << 30, "cpu", True),  # no plan: spills once headroom is reached
    ],
)
def test_placement_decisions_follow_free_memory(placement, expected_bytes, free, entry, choice, spilled):
    """gpu/cpu/auto from the free-memory hook, the headroom and the plan; shortage moves entries, never raises."""
    seen = []
    cache = MetadataCache(placement, headroom_bytes=4 << 30, expected_bytes=expected_bytes,
                          free_memory_fn=lambda dev: seen.append(dev) or free)
    assert cache._choose(_FakeEntry(entry), 0) == choice
    assert (cache.moved == 1) is spilled and bool(cache.notes) is spilled
    assert all(d == torch.device("cuda", 0) for d in seen)


def test_config_rejects_unknown_storage_settings():
    """New config fields validate like the old ones."""
    with pytest.raises(ValueError, match="cache_placement must be one of"):
        MCSparseConfig(cache_placement="disk")
    with pytest.raises(ValueError, match="index_encoding must be one of"):
        MCSparseConfig(index_encoding="zip")
    with pytest.raises(ValueError, match="residual_scale must be one of"):
        MCSparseConfig(residual_scale="block")
    with pytest.raises(ValueError, match="cache_headroom_gib must be a finite number >= 0, got -1"):
        MCSparseConfig(cache_headroom_gib=-1)


# --- out of memory --------------------------------------------------------------------------------------------


def test_out_of_memory_falls_back_to_dense_with_settings_that_fit(gen, monkeypatch):
    """An OOM in the pack's path frees the cache, names settings that would fit, and the run continues dense."""
    cfg = MCSparseConfig(density=0.25, group_size=64, warmup_steps=0, anchor_steps=(0,))
    runner = engine.MCSparseRunner(cfg)
    runner.plan(heads=2, head_dim=64, layers=2, tokens=128, branches=1, num_steps=4)
    q, k, v = (torch.randn(1, 2, 128, 64, generator=gen) for _ in range(3))
    runner.attention(q, k, v, step=0, layer=0, key=CacheKey(0, "c", None, tuple(q.shape)))
    assert len(runner.cache) == 1

    def boom(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(engine, "anchor_attention", boom)
    out = runner.attention(q, k, v, step=0, layer=1, key=CacheKey(1, "c", None, tuple(q.shape)))
    assert torch.allclose(out, kernels.dense_attention(q, k, v))
    assert len(runner.cache) == 0 and runner.disabled_reason
    later = runner.attention(q, k, v, step=1, layer=0, key=CacheKey(0, "c", None, tuple(q.shape)))
    assert torch.allclose(later, kernels.dense_attention(q, k, v))
    text = runner.summary()
    assert "out of memory at step 0, layer 1 (CUDA out of memory. Tried to allocate 2.00 GiB)" in text
    assert "Settings that would fit: residual_dtype='float8_e4m3fn'" in text and "cache_placement='cpu'" in text
    assert "dense x2: out of memory; dense for the rest of the run" in text
