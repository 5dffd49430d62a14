"""The MC-Sparse algorithm on the reference path: config, schedule, anchor and reuse steps, the run."""

import dataclasses
import math
import re

import pytest
import torch
from comfyui_mc_sparse_pack import kernels
from comfyui_mc_sparse_pack.comfyui_mc_sparse import attention, engine, schedule, selection
from comfyui_mc_sparse_pack.comfyui_mc_sparse.cache import CacheKey, MetadataCache
from comfyui_mc_sparse_pack.comfyui_mc_sparse.config import MCSparseConfig
from comfyui_mc_sparse_pack.comfyui_mc_sparse.schedule import StepKind


def _qkv(gen, B=1, H=2, S=200, D=64, dtype=torch.float32):
    return [torch.randn(B, H, S, D, generator=gen).to(dtype) for _ in range(3)]


def _rel_l1(a, b):
    return ((a.double() - b.double()).abs().sum() / b.double().abs().sum()).item()


# --- configuration and schedule -------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"density": 0.0}, r"density must be in \(0, 1\], got 0.0"),
        ({"density": 1.5}, r"density must be in \(0, 1\], got 1.5"),
        ({"density": float("nan")}, "density must be a number, got NaN"),
        ({"density": "0.2"}, "density must be a number"),
        ({"group_size": 96}, "group_size .* must be 64 or 128, got 96"),
        ({"kv_tile": 0}, "kv_tile must be >= 1, got 0"),
        ({"warmup_steps": -1}, "warmup_steps must be >= 0"),
        ({"warmup_layers": 1.5}, "warmup_layers must be an int"),
        ({"anchor_steps": ()}, "anchor_steps must hold at least one step"),
        ({"anchor_steps": (5, 5)}, "strictly increasing"),
        ({"warmup_steps": 10, "anchor_steps": (3, 25)}, r"must not start before the dense warm-up ends.*>= .* = 9, got 3"),
        ({"residual_dtype": "int8"}, "residual_dtype must be one of"),
        ({"group_size": True}, "group_size .* as an int"),
        ({"group_size": 64.0}, "group_size .* as an int"),
        ({"power_iters": 0}, "power_iters must be >= 1, got 0"),
        ({"anchor_steps": (True,)}, "anchor_steps must be ints"),
        ({"anchor_steps": (9.0,)}, "anchor_steps must be ints"),
        ({"anchor_steps": (-1, 4), "warmup_steps": 0}, "strictly increasing steps >= 0"),
        ({"warmup_steps": 10, "anchor_steps": (8,)}, r"first anchor must be >= warmup_steps - 1 = 9, got 8"),
        ({"index_encoding": "uint8"}, "index_encoding must be one of"),
        ({"cache_placement": "disk"}, "cache_placement must be one of"),
        ({"cache_headroom_gib": -0.5}, "cache_headroom_gib must be a finite number >= 0"),
        ({"cache_headroom_gib": float("inf")}, "cache_headroom_gib must be a finite number >= 0"),
        ({"cache_headroom_gib": "4"}, "cache_headroom_gib must be a number"),
        ({"density": True}, "density must be a number"),  # a bool is no density (True would read as 1.0)
        ({"kv_tile": True}, "kv_tile must be an int"),  # nor a tile size (True would read as 1)
    ],
)
def test_config_rejects_bad_values_naming_the_field(kwargs, match):
    """Each bad setting raises, naming the field, the accepted range and the value got."""
    with pytest.raises((ValueError, TypeError), match=match):
        MCSparseConfig(**kwargs)


def test_config_accepts_the_edges_and_step_kind_before_the_first_anchor():
    """The edges that are valid: density 1, kv_tile 1, no warm-up, headroom 0, the first anchor on the last warm-up
    step; defaults with the residual on. step_kind: a step before the first anchor is dense even with no warm-up
    (nothing cached yet), negative steps / layers and an empty schedule are refused. Mutations: an edge refused, the
    'before the first anchor' test joined with 'and', a check dropped."""
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.schedule import StepKind, paper_video_schedule, step_kind

    for kw in ({"density": 1.0}, {"kv_tile": 1}, {"warmup_steps": 0, "anchor_steps": (0,)}, {"cache_headroom_gib": 0},
               {"warmup_steps": 10, "anchor_steps": (9, 26)}, {"group_size": 64}):
        MCSparseConfig(**kw)
    assert MCSparseConfig().residual is True
    with pytest.raises(dataclasses.FrozenInstanceError):  # one config per run, never edited in place
        MCSparseConfig().density = 0.5
    cfg = MCSparseConfig(warmup_steps=0, warmup_layers=1, anchor_steps=(3,))
    assert [step_kind(cfg, step, 1).value for step in range(5)] == ["dense"] * 3 + ["anchor", "reuse"]
    assert step_kind(cfg, 4, 0) is StepKind.DENSE
    for step, layer in ((-1, 1), (4, -1)):
        with pytest.raises(ValueError, match="must be >= 0"):
            step_kind(cfg, step, layer)
    with pytest.raises(ValueError, match="num_steps must be >= 1"):
        paper_video_schedule(0)
    assert paper_video_schedule(1) == (1, (0,))


def test_schedule_warmup_anchors_reuse():
    """Warm-up steps and layers are dense, anchors refresh (the first overlaps the last warm-up step), the rest reuse."""
    cfg = MCSparseConfig(warmup_steps=10, warmup_layers=1, anchor_steps=(9, 25))
    kinds = [schedule.step_kind(cfg, s, 3) for s in range(50)]
    assert kinds[:9] == [StepKind.DENSE] * 9
    assert kinds[9] is StepKind.ANCHOR and kinds[25] is StepKind.ANCHOR
    assert all(kinds[s] is StepKind.REUSE for s in range(50) if s not in (range(10)) and s != 25)
    assert all(schedule.step_kind(cfg, s, 0) is StepKind.DENSE for s in range(50))
    counts = schedule.count_steps(cfg, 50, 1 + 1)
    assert counts[StepKind.REUSE] == 39 and counts[StepKind.ANCHOR] == 2


def test_published_schedule_has_one_anchor_folded_into_the_last_warmup_step():
    """The authors' published schedule: 20 % dense warm-up (10 of 49 or 50), ONE anchor on its last step."""
    assert schedule.paper_video_schedule(50) == (10, (9,))
    assert schedule.paper_video_schedule(49) == (10, (9,))
    assert schedule.paper_video_schedule(20) == (4, (3,))
    assert schedule.paper_video_schedule(1) == (1, (0,))
    for n in range(1, 80):
        warmup, anchors = schedule.paper_video_schedule(n)
        MCSparseConfig(warmup_steps=warmup, anchor_steps=anchors)  # always valid
        assert anchors == (warmup - 1,) and 1 <= warmup <= n and abs(warmup - 0.2 * n) <= 0.5 + (n < 5)
    cfg = MCSparseConfig()  # the default is the published schedule at 50 steps
    counts = schedule.count_steps(cfg, 50, 1)
    assert (cfg.warmup_steps, cfg.anchor_steps) == (10, (9,))
    assert counts == {StepKind.DENSE: 9, StepKind.ANCHOR: 1, StepKind.REUSE: 40}


@pytest.mark.parametrize("density,S,tile,K", [(0.25, 1000, 64, 256), (0.2, 100, 64, 64), (1.0, 190, 64, 190), (0.9, 100, 64, 100), (0.01, 5, 64, 5)])
def test_keys_for_density_rounds_up_to_the_tile_and_caps_at_s(density, S, tile, K):
    """K = ceil(s*S) rounded up to the KV tile, never more than S."""
    assert selection.keys_for_density(density, S, tile) == K


@pytest.mark.parametrize("density,S,tile,K", [(0.25, 1000, 1, 250), (0.1, 30, 1, 3), (0.07, 100, 1, 7),
                                              (0.001, 100, 1, 1), (1.0, 1, 64, 1), (0.5, 3, 1, 2)])
def test_keys_for_density_without_a_tile_and_at_one_token(density, S, tile, K):
    """With a tile of 1: K = ceil(s*S) exactly (0.1 * 30 is 3.0000000000000004 in floating point: 3 keys, not 4), at
    least one key; one token keeps one. Mutations: the float slack's sign, the floor of one key."""
    assert selection.keys_for_density(density, S, tile) == K


@pytest.mark.parametrize("args,match", [((0.0, 10, 1), "density"), ((1.0000001, 10, 1), "density"),
                                        ((float("nan"), 10, 1), "density"), ((0.5, 0, 1), "num_tokens"),
                                        ((0.5, 10, 0), "kv_tile")])
def test_keys_for_density_refuses_out_of_range_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        selection.keys_for_density(*args)


# --- anchor and reuse steps -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_anchor_step_returns_dense_and_compensated_sparse_equals_dense(gen, dtype):
    """At an anchor step the output is dense, and sparse + residual reproduces it."""
    q, k, v = _qkv(gen, B=2, S=300, dtype=dtype)
    cfg = MCSparseConfig(density=0.2, group_size=64, warmup_steps=0, anchor_steps=(0,), residual_dtype="float32")
    out, entry = attention.anchor_attention(q, k, v, cfg)
    dense = kernels.dense_attention(q, k, v)
    assert torch.equal(out, dense)
    compensated = attention.reuse_attention(q, k, v, entry)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    assert _rel_l1(compensated, dense) < tol


def test_reuse_step_uses_current_qkv_and_cached_groups_indices_residual(gen):
    """A reuse step is sparse attention over the *current* q, k, v with the cached groups and indices, plus R."""
    q0, k0, v0 = _qkv(gen, S=260)
    cfg = MCSparseConfig(density=0.3, group_size=64, warmup_steps=0, anchor_steps=(0,))
    _, entry = attention.anchor_attention(q0, k0, v0, cfg)
    q1, k1, v1 = (t + 0.3 * torch.randn(t.shape, generator=gen) for t in (q0, k0, v0))
    out = attention.reuse_attention(q1, k1, v1, entry)
    expected = kernels.sparse_attention(q1, k1, v1, entry.perm, entry.kv_idx) + entry.residual
    assert torch.allclose(out, expected, atol=1e-6)
    stale = kernels.sparse_attention(q0, k0, v0, entry.perm, entry.kv_idx) + entry.residual
    assert not torch.allclose(out, stale, atol=1e-3)


def test_density_one_equals_dense_at_reuse(gen):
    """At density 1.0 every token is kept: a reuse step equals dense attention of the current step."""
    q, k, v = _qkv(gen, S=150, D=128)
    cfg = MCSparseConfig(density=1.0, group_size=128, warmup_steps=0, anchor_steps=(0,), residual=False)
    _, entry = attention.anchor_attention(q, k, v, cfg)
    q1, k1, v1 = _qkv(gen, S=150, D=128)
    assert torch.allclose(attention.reuse_attention(q1, k1, v1, entry), kernels.dense_attention(q1, k1, v1), atol=1e-5)


@pytest.mark.parametrize("B,S,C,density", [(3, 200, 64, 0.2), (1, 130, 128, 0.5), (2, 7, 64, 0.3), (1, 1, 64, 0.5), (1, 70, 64, 1.0)])
def test_shapes_batches_ragged_and_tiny(gen, B, S, C, density):
    """Batch > 1, S not a multiple of C, K >= S and tiny S all give finite, fully written outputs."""
    q, k, v = _qkv(gen, B=B, S=S)
    cfg = MCSparseConfig(density=density, group_size=C, warmup_steps=0, anchor_steps=(0,))
    out, entry = attention.anchor_attention(q, k, v, cfg)
    assert entry.perm.shape == (B, 2, -(-S // C) * C) and entry.kv_idx.shape[2] == -(-S // C)
    reused = attention.reuse_attention(q, k, v, entry)
    assert reused.shape == q.shape and torch.isfinite(reused).all()
    # batch items are independent: item 0 alone gives the same selection
    if B > 1:
        _, solo = attention.anchor_attention(q[:1], k[:1], v[:1], cfg)
        assert torch.equal(solo.kv_idx, entry.kv_idx[:1])


def test_residual_improves_reuse_accuracy(gen):
    """With a slowly drifting input, sparse + residual is closer to dense than sparse alone."""
    base = _qkv(gen, S=512, D=64)
    q0, k0, v0 = (t * 2 for t in base)
    cfg = MCSparseConfig(density=0.2, group_size=64, warmup_steps=0, anchor_steps=(0,))
    _, entry = attention.anchor_attention(q0, k0, v0, cfg)
    q1, k1, v1 = (t + 0.05 * torch.randn(t.shape, generator=gen) for t in (q0, k0, v0))
    dense = kernels.dense_attention(q1, k1, v1)
    with_r = attention.reuse_attention(q1, k1, v1, entry)
    without = kernels.sparse_attention(q1, k1, v1, entry.perm, entry.kv_idx)
    assert _rel_l1(with_r, dense) < _rel_l1(without, dense)


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda q: (q, q, q[..., :100, :]), "not self-attention"),
        (lambda q: (q[..., :48], q[..., :48], q[..., :48]), "unsupported head dim 48"),
        (lambda q: (q.double(), q.double(), q.double()), "unsupported dtype"),
        (lambda q: (q[0], q[0], q[0]), r"not \[B, H, S, D\]"),
    ],
)
def test_anchor_rejects_unsupported_inputs(gen, make, match):
    """Mismatched shapes, unsupported head dim or dtype raise a ValueError naming the problem."""
    q = torch.randn(1, 2, 128, 64, generator=gen)
    cfg = MCSparseConfig(group_size=64, warmup_steps=0, anchor_steps=(0,))
    with pytest.raises(ValueError, match=match):
        attention.anchor_attention(*make(q), cfg)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_anchor_rejects_non_finite_inputs(gen, bad):
    """NaN or inf in k raises NonFiniteInputError naming k."""
    q, k, v = _qkv(gen, S=128)
    k[0, 1, 5, 3] = bad
    cfg = MCSparseConfig(group_size=64, warmup_steps=0, anchor_steps=(0,))
    with pytest.raises(attention.NonFiniteInputError, match="k must be finite"):
        attention.anchor_attention(q, k, v, cfg)


def test_finite_check_reads_comfyui_views_in_memory_order_and_names_the_tensor(gen):
    """The anchor's finite check sums each tensor over its memory in order: the [B, H, S, D] view of a [B, S, H*D]
    tensor is read as that tensor's 1-D view (no copy); a NaN or inf anywhere, in any of the named tensors, is found
    and named (mutation: a check over the first head only, or naming by position, fails here)."""
    B, S, H, D = 1, 40, 3, 8
    flat = torch.randn(B, S, H * D, generator=gen)
    view = flat.view(B, S, H, D).transpose(1, 2)
    line = attention._in_order(view)
    assert line.dim() == 1 and line.data_ptr() == flat.data_ptr() and torch.equal(line, flat.view(-1))
    odd = torch.randn(B, H, S, 2 * D, generator=gen)[..., ::2]  # not a permutation of a contiguous tensor: as is
    assert attention._in_order(odd) is odd
    attention._FiniteCheck((("q", view), ("odd", odd))).result()
    for name, pos in (("q", (0, 2, 39, 7)), ("odd", (0, 1, 0, 0))):
        for bad in (float("nan"), float("inf"), float("-inf")):
            tensors = {"q": view.clone(), "odd": odd.clone()}
            tensors[name][pos] = bad
            with pytest.raises(attention.NonFiniteInputError, match=f"^{name} must be finite"):
                attention._FiniteCheck(tuple(tensors.items())).result()


def test_reuse_rejects_an_entry_of_another_shape(gen):
    """A cache entry is never applied to a different shape."""
    q, k, v = _qkv(gen, S=128)
    cfg = MCSparseConfig(group_size=64, warmup_steps=0, anchor_steps=(0,))
    _, entry = attention.anchor_attention(q, k, v, cfg)
    q2, k2, v2 = _qkv(gen, S=192)
    with pytest.raises(ValueError, match="entry must be made for q's shape"):
        attention.reuse_attention(q2, k2, v2, entry)


# --- one run ---------------------------------------------------------------------------------------


def _run(runner, gen, steps, layers, S=192, branches=("cond", "uncond"), nan_at=None):
    outs = {}
    for step in range(steps):
        for layer in range(layers):
            for branch in branches:
                q, k, v = _qkv(gen, S=S)
                if nan_at == (step, layer):
                    q[0, 0, 0, 0] = float("nan")
                key = CacheKey(layer, branch, None, tuple(q.shape))
                outs[step, layer, branch] = runner.attention(q, k, v, step=step, layer=layer, key=key)
    return outs


def test_runner_follows_the_schedule_and_summarises(gen):
    """A run counts dense warm-up, anchor and reuse calls per branch and reports the cache."""
    cfg = MCSparseConfig(density=0.25, group_size=64, warmup_steps=2, warmup_layers=1, anchor_steps=(1, 4))
    runner = engine.MCSparseRunner(cfg)
    _run(runner, gen, steps=6, layers=3)
    c = runner.stats.calls
    # layer 0 always dense (6 steps x 2 branches); layers 1-2: step 0 dense, steps 1 and 4 anchors, rest reuse
    assert c[StepKind.DENSE] == 12 + 4 and c[StepKind.ANCHOR] == 8 and c[StepKind.REUSE] == 12
    assert runner.stats.anchors == [1, 4]
    assert len(runner.cache) == 4 and runner.cache.nbytes > 0
    text = runner.summary()
    assert "12 sparse (reuse)" in text and "dense warm-up layer" in text and "anchor steps taken (1-based): 2, 5" in text
    runner.close()
    assert len(runner.cache) == 0


def test_runner_falls_back_to_dense_on_non_finite_input_and_says_so(gen):
    """NaN at an anchor step runs dense for that call, and the summary names the reason."""
    cfg = MCSparseConfig(density=0.25, group_size=64, warmup_steps=0, anchor_steps=(0,))
    runner = engine.MCSparseRunner(cfg)
    outs = _run(runner, gen, steps=1, layers=1, branches=("c",), nan_at=(0, 0))
    assert torch.isnan(outs[0, 0, "c"]).any()  # dense of NaN input is the model's own behaviour
    assert "non-finite input" in runner.summary()


def test_runner_takes_a_late_anchor_when_the_cache_is_missing(gen):
    """A reuse step without a cache entry (anchor skipped, new branch) anchors instead and notes it."""
    cfg = MCSparseConfig(density=0.25, group_size=64, warmup_steps=0, anchor_steps=(0,))
    runner = engine.MCSparseRunner(cfg)
    q, k, v = _qkv(gen, S=192)
    runner.attention(q, k, v, step=3, layer=0, key=CacheKey(0, "c", None, tuple(q.shape)))
    assert runner.stats.calls[StepKind.ANCHOR] == 1 and "late anchor at step 4 (1-based)" in runner.summary()


def test_runner_warns_when_nothing_went_sparse(gen):
    """A run with no sparse call says so loudly."""
    runner = engine.MCSparseRunner(MCSparseConfig(group_size=64, warmup_steps=10, anchor_steps=(9,)))
    _run(runner, gen, steps=2, layers=1, branches=("c",))
    assert "WARNING: no attention call went sparse" in runner.summary()


def test_runner_passes_unsupported_calls_to_dense_fn(gen):
    """Cross-attention shapes and unsupported head dims go to dense_fn, counted with the reason."""
    runner = engine.MCSparseRunner(MCSparseConfig(group_size=64, warmup_steps=0, anchor_steps=(0,)))
    q = torch.randn(1, 2, 128, 64, generator=gen)
    kv = torch.randn(1, 2, 77, 64, generator=gen)
    seen = []

    def dense_fn(q_, k_, v_):
        seen.append(k_.shape[2])
        return kernels.dense_attention(q_, k_, v_)

    out = runner.attention(q, kv, kv, step=0, layer=0, key=CacheKey(0), dense_fn=dense_fn)
    assert out.shape == q.shape and seen == [77]
    assert "not self-attention" in runner.summary()


def test_metadata_cache_accounts_bytes(gen):
    """The cache's byte count is the entries' indices + residuals, and replacing an entry does not double count."""
    cache = MetadataCache()
    q, k, v = _qkv(gen, S=128)
    cfg = MCSparseConfig(group_size=64, warmup_steps=0, anchor_steps=(0,))
    _, entry = attention.anchor_attention(q, k, v, cfg)
    expected = entry.perm.numel() * 4 + entry.kv_idx.numel() * 4 + entry.residual.numel() * 2
    cache.put(CacheKey(0), entry)
    cache.put(CacheKey(0), entry)
    assert cache.nbytes == expected == entry.nbytes and cache.peak_bytes == expected
    assert math.isclose(cache.nbytes, expected)


# --- joint sequences: keys every query attends exactly -------------------------------------------------


def test_merge_attention_equals_attention_over_the_union(gen):
    """Merging two disjoint key sets' outputs by LSE is attention over their union."""
    q, k, v = _qkv(gen, S=96)
    o1, l1 = kernels.dense_attention(q, k[:, :, :40], v[:, :, :40], return_lse=True)
    o2, l2 = kernels.dense_attention(q, k[:, :, 40:], v[:, :, 40:], return_lse=True)
    assert torch.allclose(attention.merge_attention(o1, l1, o2, l2), kernels.dense_attention(q, k, v), atol=1e-5)


def test_extra_keys_are_attended_exactly_at_anchor_and_reuse(gen):
    """With extra_kv (text keys of a joint sequence) the anchor output is dense over video + text keys, and a
    reuse step equals sparse-over-selected merged with exact-over-text, plus the residual."""
    q, k, v = _qkv(gen, S=256)
    kx, vx = (torch.randn(1, 2, 30, 64, generator=gen) for _ in range(2))
    cfg = MCSparseConfig(density=0.25, group_size=64, warmup_steps=0, anchor_steps=(0,), residual_dtype="float32")
    out, entry = attention.anchor_attention(q, k, v, cfg, extra_kv=(kx, vx))
    full = kernels.dense_attention(q, torch.cat([k, kx], 2), torch.cat([v, vx], 2))
    assert torch.allclose(out, full, atol=1e-6)
    assert _rel_l1(attention.reuse_attention(q, k, v, entry, extra_kv=(kx, vx)), full) < 1e-5
    # at density 1.0 and no residual, a reuse step is exact dense attention over all keys
    exact = MCSparseConfig(density=1.0, group_size=64, warmup_steps=0, anchor_steps=(0,), residual=False)
    _, entry1 = attention.anchor_attention(q, k, v, exact, extra_kv=(kx, vx))
    assert torch.allclose(attention.reuse_attention(q, k, v, entry1, extra_kv=(kx, vx)), full, atol=1e-5)


def test_joint_reuse_rounds_once(gen):
    """A reuse step with extra_kv and a residual (bf16 q/k/v, bf16 R) is the LSE merge of its two parts plus R in
    float32, rounded once to bf16, as the kernels' residual epilogue rounds (before: the merge was rounded to bf16,
    then the sum again; mutation: that double rounding differs from this in some elements)."""
    q, k, v = (t.to(torch.bfloat16) for t in _qkv(gen, S=256))
    kx, vx = (torch.randn(1, 2, 30, 64, generator=gen).to(torch.bfloat16) for _ in range(2))
    cfg = MCSparseConfig(density=0.25, group_size=64, warmup_steps=0, anchor_steps=(0,), residual_dtype="bfloat16")
    _, entry = attention.anchor_attention(q, k, v, cfg, extra_kv=(kx, vx))
    q2, k2, v2 = (t + 0.5 * torch.randn(t.shape, generator=gen).to(torch.bfloat16) for t in (q, k, v))
    o_sel, l_sel = kernels.sparse_attention(q2, k2, v2, entry.perm, entry.kv_idx, return_lse=True)
    o_x, l_x = kernels.dense_attention(q2, kx, vx, return_lse=True)
    merged = attention.merge_attention(o_sel, l_sel, o_x, l_x, dtype=torch.float32)
    want = (merged + entry.residual.float()).to(torch.bfloat16)
    out = torch.full_like(q2, float("nan")).transpose(1, 2).contiguous().transpose(1, 2)  # a strided view, poisoned
    got = attention.reuse_attention(q2, k2, v2, entry, extra_kv=(kx, vx), out=out)
    assert got is out and torch.equal(got, want)


def test_runner_dense_fn_sees_extra_keys(gen):
    """A dense call with extra_kv hands dense_fn the concatenated keys and values."""
    runner = engine.MCSparseRunner(MCSparseConfig(group_size=64, warmup_steps=2, anchor_steps=(1,)))
    q, k, v = _qkv(gen, S=128)
    kx, vx = (torch.randn(1, 2, 7, 64, generator=gen) for _ in range(2))
    seen = []
    runner.attention(q, k, v, step=0, layer=0, key=CacheKey(0), extra_kv=(kx, vx),
                     dense_fn=lambda a, b, c: seen.append(b.shape[2]) or kernels.dense_attention(a, b, c))
    assert seen == [135]


def test_extra_kv_of_the_wrong_shape_is_rejected(gen):
    """extra_kv must share q's batch, heads, head dim, dtype and device, and be finite at an anchor step (mutations:
    the dtype check dropped; extra_kv left out of the finite check: a NaN text key reached the selection)."""
    q, k, v = _qkv(gen, S=128)
    cfg = MCSparseConfig(group_size=64, warmup_steps=0, anchor_steps=(0,))
    with pytest.raises(ValueError, match=r"extra_kv k must be \[B, H, T, D\]"):
        attention.anchor_attention(q, k, v, cfg, extra_kv=(torch.randn(1, 3, 5, 64), torch.randn(1, 3, 5, 64)))
    kx = torch.randn(1, 2, 5, 64, generator=gen)
    for bad, words in (((kx,), "a (k, v) pair"), ((kx, kx, kx), "a (k, v) pair"), ((kx, kx[:, :, :4]), "one shape"),
                       ((kx, kx.to("meta")), "extra_kv v must match q's dtype and device"),
                       ((kx.double(), kx), "extra_kv k must match q's dtype and device")):
        with pytest.raises((TypeError, ValueError), match=re.escape(words)):
            attention.anchor_attention(q, k, v, cfg, extra_kv=bad)
    for i, name in ((0, "extra_kv k"), (1, "extra_kv v")):
        bad = [kx, kx.clone()]
        bad[i] = bad[i].clone()
        bad[i][0, 1, 2, 3] = float("inf") if i else float("nan")
        with pytest.raises(attention.NonFiniteInputError, match=name):
            attention.anchor_attention(q, k, v, cfg, extra_kv=tuple(bad))


def test_ineligible_calls_are_named_and_merge_survives_far_apart_lses(gen):
    """The sparse path's eligibility names q/k/v on different devices, mixed dtypes and an empty sequence; merging
    two parts whose LSEs lie 200 apart (exp(200) overflows float32) stays finite and equals the dominant part.
    Four mutations that left the suite green (the device / dtype / empty checks dropped, the merge's max shift)."""
    q, k, v = _qkv(gen, S=64)
    assert "one device" in attention.ineligible_reason(q, k.to("meta"), v)
    assert "unsupported dtype" in attention.ineligible_reason(q, k.half(), v)
    assert attention.ineligible_reason(*(t[:, :, :0] for t in (q, k, v))) == "empty sequence"
    lse1 = torch.zeros(1, 2, 64)
    merged = attention.merge_attention(q, lse1, v, lse1 + 200.0)
    assert torch.isfinite(merged).all() and torch.allclose(merged, v)


def test_a_second_evaluation_at_an_anchor_step_runs_dense_not_a_second_anchor(gen):
    """Multi-evaluation samplers (heun) hit an anchor step twice: the second call is dense, the cache is kept."""
    runner = engine.MCSparseRunner(MCSparseConfig(group_size=64, warmup_steps=0, anchor_steps=(0,)))
    q, k, v = _qkv(gen, S=128)
    key = CacheKey(0, "c", None, tuple(q.shape))
    runner.attention(q, k, v, step=0, layer=0, key=key)
    out = runner.attention(q, k, v, step=0, layer=0, key=key)
    assert runner.stats.calls[StepKind.ANCHOR] == 1 and torch.allclose(out, kernels.dense_attention(q, k, v))
    assert "anchor step evaluated again" in runner.summary()


def test_a_context_window_unseen_at_the_anchor_runs_dense_with_the_reason(gen):
    """Moving context windows never match an anchor entry: dense with the reason, no anchor per step."""
    runner = engine.MCSparseRunner(MCSparseConfig(group_size=64, warmup_steps=0, anchor_steps=(0,)))
    q, k, v = _qkv(gen, S=128)
    runner.attention(q, k, v, step=0, layer=0, key=CacheKey(0, "c", (0, 8), tuple(q.shape)))
    runner.attention(q, k, v, step=1, layer=0, key=CacheKey(0, "c", (1, 9), tuple(q.shape)))
    assert runner.stats.calls[StepKind.ANCHOR] == 1
    assert "context window not seen at the anchor step" in runner.summary()


def test_cpu_allocation_failure_turns_the_run_dense_and_says_what_fits(gen, monkeypatch):
    """The CPU allocator's RuntimeError counts as out of memory: the rest of the run is dense, with advice."""
    runner = engine.MCSparseRunner(MCSparseConfig(group_size=64, warmup_steps=0, anchor_steps=(0,)))

    def no_memory(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes")

    monkeypatch.setattr(engine, "anchor_attention", no_memory)
    q, k, v = _qkv(gen, S=128)
    out = runner.attention(q, k, v, step=0, layer=0, key=CacheKey(0))
    assert torch.allclose(out, kernels.dense_attention(q, k, v)) and runner.disabled_reason
    assert "out of memory" in runner.summary()


def test_meta_tensors_and_empty_keys_are_refused(gen):
    """Tensors without data and key sets without keys get a clear refusal, not an internal error."""
    q = torch.empty(1, 2, 128, 64, device="meta")
    assert "real tensors" in attention.ineligible_reason(q, q, q)
    with pytest.raises(TypeError, match="group_size .* must be 64 or 128"):
        MCSparseConfig(group_size=64.0)
    x = torch.randn(1, 2, 16, 64, generator=gen)
    with pytest.raises(ValueError, match=r"k must hold at least one key"):
        kernels.dense_attention(x, x[:, :, :0], x[:, :, :0])


def test_an_anchor_over_two_conditioning_chunks_with_extra_keys(gen):
    """One runner call holding two conditioning chunks (CFG) and extra keys per chunk (a joint model's text keys):
    at the anchor each chunk gets its own rows of extra_kv (the output is each chunk's exact attention over its
    latent and extra keys), and a NaN anchor input makes the call dense with a reason naming the tensor. Mutations
    that left the suite green: the whole batch's extra keys handed to each chunk; the reason without the tensor."""
    runner = engine.MCSparseRunner(MCSparseConfig(group_size=64, warmup_steps=1, anchor_steps=(0,)))
    q, k, v = _qkv(gen, B=2, S=128)
    kx, vx = (torch.randn(2, 2, 7, 64, generator=gen) for _ in range(2))
    keys = [CacheKey(0, "cond"), CacheKey(0, "uncond")]
    out = runner.attention(q, k, v, step=0, layer=0, keys=keys, extra_kv=(kx, vx))
    want = kernels.dense_attention(q, torch.cat([k, kx], 2), torch.cat([v, vx], 2), backend="torch")
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    bad = k.clone()
    bad[1, 0, 3, 5] = float("nan")
    runner.attention(q, bad, v, step=0, layer=1, keys=[CacheKey(1, "cond"), CacheKey(1, "uncond")])
    assert any("non-finite input" in r and "k must be finite" in r for r in runner.stats.dense_reasons), \
        runner.stats.dense_reasons
