"""Properties of the reuse path that no other test pinned: each test here was written after breaking that property
in a scratch copy (the mutation named in its docstring) left the whole CPU suite green."""

from __future__ import annotations

import math
import os

import pytest
import torch
from comfyui_mc_sparse_pack.comfyui_mc_sparse.attention import anchor_attention
from comfyui_mc_sparse_pack.comfyui_mc_sparse.cache import CacheKey, MetadataCache, encode_entry
from comfyui_mc_sparse_pack.comfyui_mc_sparse.config import MCSparseConfig
from comfyui_mc_sparse_pack.comfyui_mc_sparse.prefetch import ReuseLoader


def _stored_entry(gen):
    q, k, v = (torch.randn(1, 2, 128, 64, generator=gen) for _ in range(3))
    _, entry = anchor_attention(q, k, v, MCSparseConfig(density=0.5, group_size=64), backend="torch")
    return encode_entry(entry)


def test_a_prefetch_for_another_device_is_never_served(gen):
    """Mutation: ``ReuseLoader.load`` serving the pending group without comparing its device. A group prefetched for
    one device and asked for on another (e.g. the model moved between evaluations) is decoded again on the asked
    device (a miss; the stale prefetch counts as dropped), never handed over on the wrong device."""
    cache = MetadataCache("gpu")
    key = CacheKey(1)
    cache.put(key, _stored_entry(gen))
    loader = ReuseLoader(cache)
    loader.prefetch((key,), torch.device("cpu"), torch.float32)
    batch = loader.load((key,), torch.device("meta"), torch.float32)  # meta: a second device on a CPU-only machine
    assert all(t.device.type == "meta" for t in batch.tensors())
    assert (loader.hits, loader.misses, loader.dropped) == (0, 1, 1)
    loader.prefetch((key,), torch.device("cpu"), torch.float32)
    batch = loader.load((key,), torch.device("cpu"), torch.float32)  # same device: the prefetch is served
    assert all(t.device.type == "cpu" for t in batch.tensors()) and loader.hits == 1


def test_the_summary_names_a_kernel_that_failed_in_the_run(gen):
    """Mutation: the runner's summary without its "kernel fallback:" lines. A backend that fails at run time is
    skipped for the rest of the run (registry) and the summary says which one failed on which op, and why."""
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.engine import MCSparseRunner
    from comfyui_mc_sparse_pack.kernels import registry

    def broken(*args, **kwargs):
        raise RuntimeError("simulated launch failure")

    registry.register(registry.Backend(name="broken_sum", priority=99, ops={"sparse_attention": broken}))
    try:
        runner = MCSparseRunner(MCSparseConfig(density=0.5, group_size=64, warmup_steps=1, anchor_steps=(0,)))
        q, k, v = (torch.randn(1, 2, 128, 64, generator=gen) for _ in range(3))
        runner.attention(q, k, v, step=0, layer=0, key=CacheKey(0))
        out = runner.attention(q, k, v, step=1, layer=0, key=CacheKey(0))
        assert torch.isfinite(out).all() and runner.stats.sparse_calls == 1
        text = runner.summary()
        assert ("kernel fallback: broken_sum failed on sparse_attention in this run: RuntimeError: simulated launch "
                "failure") in text, text
        assert "sparse_attention=torch" in text
    finally:
        registry._backends.pop("broken_sum", None)


def test_each_cfg_branch_reuses_its_own_entry_when_the_batching_changes(gen):
    """Mutation: the override naming the conditioning chunks in reverse batch order (uncond's entry stored under
    cond's uuid). Consistent within one batching, so only a change of batching shows it: the anchor step batched
    [uncond, cond], the reuse step split into one call per branch (ComfyUI does this when memory is short) must give
    each branch exactly what the batched reuse call gives it."""
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter import lifecycle, override, settings
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter.callsite import CallSite

    from ._comfy_standins import raw_attention, transformer_options

    s = settings.build_settings(preset="custom", density=0.3, dense_warmup="1", warmup_layers=0, anchor_steps="1",
                                query_tile=64, cache_placement="auto", backend="torch", min_tokens=0, verbose=False)
    anchor_x = torch.randn(2, 192, 128, generator=gen)  # [uncond; cond], [B, S, H*D] with 2 heads x 64
    reuse_x = anchor_x + 0.3 * torch.randn(2, 192, 128, generator=gen)
    site = CallSite(0, "wan")
    outs = {}
    for batching in ("batched", "split"):
        run = lifecycle.RunState(s, torch.tensor([1.0, 0.8, 0.0]))
        over = override.make_override(None)
        over(raw_attention, anchor_x, anchor_x, anchor_x, 2, transformer_options=transformer_options(run, site, sigma=1.0))
        if batching == "batched":
            outs[batching] = over(raw_attention, reuse_x, reuse_x, reuse_x, 2,
                                  transformer_options=transformer_options(run, site, sigma=0.8))
        else:
            rows = []
            for i, (c, uuid) in enumerate(((1, "u0"), (0, "u1"))):
                x = reuse_x[i:i + 1]
                opts = {**transformer_options(run, site, chunks=1, sigma=0.8), "cond_or_uncond": [c], "uuids": [uuid]}
                rows.append(over(raw_attention, x, x, x, 2, transformer_options=opts))
            outs[batching] = torch.cat(rows)
        assert run.counts()["sparse"] == 2, run.summary()
    torch.testing.assert_close(outs["split"], outs["batched"], rtol=1e-5, atol=1e-5)


def test_context_windows_keep_their_own_entries_through_the_override(gen):
    """Mutation: the override ignoring ``transformer_options["context_window"]`` (every window under one cache key).
    With ComfyUI's context windows each window's anchor entry is its own: a reuse call of window A gives what a run
    that only ever saw window A gives, and a window the anchor step never saw runs dense with the reason."""
    import types

    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter import lifecycle, override, settings
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter.callsite import CallSite

    from ._comfy_standins import raw_attention, transformer_options

    s = settings.build_settings(preset="custom", density=0.3, dense_warmup="1", warmup_layers=0, anchor_steps="1",
                                query_tile=64, cache_placement="auto", backend="torch", min_tokens=0, verbose=False)
    windows = [types.SimpleNamespace(index_list=list(range(i, i + 8))) for i in (0, 4, 8)]
    anchor_x = [torch.randn(1, 192, 128, generator=gen) for _ in range(2)]
    reuse_x = anchor_x[0] + 0.3 * torch.randn(1, 192, 128, generator=gen)
    site = CallSite(0, "wan")

    def call(run, over, x, window, sigma):
        opts = {**transformer_options(run, site, chunks=1, sigma=sigma), "context_window": window}
        return over(raw_attention, x, x, x, 2, transformer_options=opts)

    outs = []
    for seen in ((0, 1), (0,)):
        run = lifecycle.RunState(s, torch.tensor([1.0, 0.8, 0.0]))
        over = override.make_override(None)
        for w in seen:
            call(run, over, anchor_x[w], windows[w], 1.0)
        outs.append(call(run, over, reuse_x, windows[0], 0.8))
        assert run.counts()["sparse"] == 1
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    out = call(run, over, reuse_x, windows[2], 0.8)  # never seen at the anchor step
    assert torch.equal(out, raw_attention(reuse_x, reuse_x, reuse_x, 2))
    assert "context window not seen at the anchor step" in run.summary()


def test_a_batch_with_several_sigmas_is_placed_at_its_largest_sigma():
    """Mutation: ``steps.current_sigma`` taking the batch's smallest sigma. A model evaluation whose batch carries
    different sigmas is placed at the step of its largest (the earliest step it belongs to), never a later one."""
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter.steps import current_sigma, step_index

    schedule = [1.0, 0.8, 0.6, 0.0]
    sigma = current_sigma({"sigmas": torch.tensor([0.6, 0.8])})
    assert sigma == pytest.approx(0.8) and step_index(sigma, schedule) == 1
    assert current_sigma({"sigmas": [0.6, 0.8]}) == pytest.approx(0.8) and current_sigma({}) is None


def test_an_override_installed_after_ours_is_chained_and_reported(caplog):
    """Mutation: the CALC_COND_BATCH wrapper re-asserting our override without noting what displaced it. Another
    node's override found on top is chained below ours, the evaluation gets its step, and the summary names it."""
    import logging

    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter import lifecycle, override, settings
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter.steps import STEP_KEY

    s = settings.build_settings(preset="custom", density=0.5, dense_warmup="1", warmup_layers=0, anchor_steps="1",
                                query_tile=64, cache_placement="auto", backend="torch", min_tokens=0, verbose=False)
    run = lifecycle.RunState(s, torch.tensor([1.0, 0.8, 0.6, 0.0]))

    def foreign_override(func, *args, **kwargs):
        return func(*args, **kwargs)

    model_options = {"transformer_options": {override.RUN_KEY: run, "optimized_attention_override": foreign_override}}
    seen = {}

    def executor(model, conds, x_in, timestep, options):
        seen.update(options["transformer_options"])
        return "evaluated"

    with caplog.at_level(logging.WARNING):
        assert lifecycle.calc_cond_batch_wrapper(executor, None, [], None, torch.tensor([0.8]), model_options) == "evaluated"
    top = model_options["transformer_options"]["optimized_attention_override"]
    assert override.is_ours(top) and top.previous is foreign_override and seen[STEP_KEY] == 1
    assert "foreign_override" in run.summary() and any("foreign_override" in r.getMessage() for r in caplog.records)


def test_a_vace_call_and_its_main_block_keep_separate_entries(gen):
    """Mutation: the run's cache keys without the call site's kind. A VACE block attached after main block 0 has the
    same block index and shape as block 0's self-attention; both anchor (neither is taken for a sampler's second
    evaluation of the step), and a reuse call of the VACE block gives what a run without block 0 gives."""
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter import lifecycle, override, settings
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter.callsite import CallSite

    from ._comfy_standins import raw_attention, transformer_options

    s = settings.build_settings(preset="custom", density=0.3, dense_warmup="1", warmup_layers=0, anchor_steps="1",
                                query_tile=64, cache_placement="auto", backend="torch", min_tokens=0, verbose=False)
    main, vace = CallSite(0, "wan"), CallSite(0, "wan", kind="vace")
    anchor_x = {main: torch.randn(1, 192, 128, generator=gen), vace: torch.randn(1, 192, 128, generator=gen)}
    reuse_x = anchor_x[vace] + 0.3 * torch.randn(1, 192, 128, generator=gen)

    def call(run, over, x, site, sigma):
        return over(raw_attention, x, x, x, 2, transformer_options=transformer_options(run, site, chunks=1, sigma=sigma))

    outs = []
    for sites in ((main, vace), (vace,)):
        run = lifecycle.RunState(s, torch.tensor([1.0, 0.8, 0.0]))
        over = override.make_override(None)
        for site in sites:
            call(run, over, anchor_x[site], site, 1.0)
        assert run.counts()["anchor"] == len(sites), run.summary()
        outs.append(call(run, over, reuse_x, vace, 0.8))
        assert run.counts()["sparse"] == 1
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def test_schedule_boundaries_of_the_warmup_and_anchors():
    """The edges of the schedule no other test pinned (mutations that left the suite green, one per line below):
    step_kind without 'before the first anchor' (steps between a short warm-up and a later anchor ran REUSE with no
    cache); the node's same-unit check at 'anchor < warm-up' off by one; the mixed-unit move at 'anchor < last
    warm-up step' off by one; a warm-up longer than the call not clamped; the 'runs dense' note never written."""
    from comfyui_mc_sparse_pack.comfyui_mc_sparse import schedule
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter import settings

    def custom(warmup, anchors):
        return settings.build_settings(preset="custom", density=0.5, dense_warmup=warmup, warmup_layers=0,
                                       anchor_steps=anchors, query_tile=64, cache_placement="auto", backend="auto",
                                       min_tokens=0, verbose=False)

    cfg = MCSparseConfig(warmup_steps=2, anchor_steps=(5,))
    assert [schedule.step_kind(cfg, s, 1).value for s in range(8)] == ["dense"] * 5 + ["anchor", "reuse", "reuse"]
    r = settings.resolve_schedule(custom("2", "6"), 10)
    assert (r.warmup_steps, r.anchor_steps, r.notes) == (2, (5,), ())

    with pytest.raises(ValueError, match="anchor steps must not come before the last dense warm-up step"):
        custom("10", "9")
    custom("10", "10")

    r = settings.resolve_schedule(custom("10", "18%"), 50)  # 18 % of 50 = step 9, one before the warm-up's last
    assert (r.warmup_steps, r.anchor_steps) == (10, (9,))
    assert any("anchor steps 9 fall inside the dense warm-up" in n for n in r.notes), r.notes

    r = settings.resolve_schedule(custom("60", "auto"), 50)
    assert (r.warmup_steps, r.anchor_steps) == (50, (49,))
    assert r.notes == ("the dense warm-up covers all 50 steps of this sampler call",)

    r = settings.resolve_schedule(custom("auto", "60"), 50)
    assert (r.warmup_steps, r.anchor_steps) == (50, ())
    assert "no anchor step falls inside this sampler call: it runs dense" in r.notes, r.notes


@pytest.mark.parametrize("S", [65536, 65537, 131072, 131073])
def test_encodings_round_trip_at_the_16_and_17_bit_boundaries(S):
    """Selections and query groups that hold the last token S - 1 round-trip bit-exactly on both sides of the 16-bit
    (65536) and 17-bit (131072) limits, and take the bytes the estimate counts (mutations that left the suite green:
    a requested 'uint16' kept at S = 65537, 17-bit groups at S = 131073: token 65536 / 131072 decoded as 0 / 65536)."""
    from comfyui_mc_sparse_pack.comfyui_mc_sparse import encoding

    kv = torch.full((1, 1, 1, 8), -1, dtype=torch.int32)
    kv[..., :3] = torch.tensor([0, S // 2, S - 1], dtype=torch.int32)
    for requested in ("auto", "bitmask", "uint16", "int32"):
        enc = encoding.encode_selection(kv, S, 3, requested)
        assert torch.equal(encoding.decode_selection(enc), kv), (requested, enc.kind)
        assert enc.nbytes == encoding.selection_nbytes(enc.kind, 1, S, 3, 8)
    C = 128
    perm = torch.full((1, 1, -(-S // C) * C), -1, dtype=torch.int32)
    perm[0, 0, :S] = torch.arange(S - 1, -1, -1, dtype=torch.int32)
    enc = encoding.encode_groups(perm, S)
    assert torch.equal(encoding.decode_groups(enc), perm), enc.kind
    assert enc.nbytes == encoding.groups_nbytes(1, 1, S, C)


def test_the_cache_peak_in_the_summary_is_the_stored_bytes_across_anchors(gen):
    """The summary's cache peak (``cache_where``: where the cache lived, how much) is the estimate's bytes, also after a
    second anchor step replaced every entry (mutation: the host peak never updated left the suite green; the
    summary then said the cache was 'empty')."""
    from comfyui_mc_sparse_pack.comfyui_mc_sparse import engine, memory

    S = 192
    cfg = MCSparseConfig(density=0.25, group_size=64, warmup_steps=1, anchor_steps=(0, 2))
    runner = engine.MCSparseRunner(cfg, backend="torch")
    keys = [CacheKey(0, branch="uncond"), CacheKey(0, branch="cond")]
    est = memory.estimate_for_config(cfg, heads=2, head_dim=64, layers=2, tokens=S, branches=2)
    for step in (0, 1, 2):  # anchor, reuse, a second anchor
        for layer in (0, 1):
            q, k, v = (torch.randn(2, 2, S, 64, generator=gen) for _ in range(3))
            runner.call(q, k, v, step=step, layer=layer, keys=[CacheKey(layer, key.branch) for key in keys])
        c = runner.cache
        assert c.nbytes == c.peak_bytes == c.host_bytes == c.peak_host_bytes == est.total_bytes, step
    assert runner.cache_where() == f"CPU memory {engine._size(est.total_bytes)}"
    assert f"metadata cache: peak CPU memory {engine._size(est.total_bytes)}" in runner.summary()


def test_the_summary_headline_share_and_dense_runs(gen, monkeypatch):
    """The headline's sparse share counts self-attention calls only (cross-attention's dense calls are not in it); a run
    the pack turned dense before any sparse call says 'stayed dense' and why; a run interrupted before any sparse
    call gets no 'no speedup' WARNING (mutations that left the suite green: the share over every call, the
    'stayed dense' headline dropped, the WARNING without the interrupted check)."""
    from comfyui_mc_sparse_pack.comfyui_mc_sparse import engine
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter import lifecycle, override, settings
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter.callsite import CallSite

    from ._comfy_standins import raw_attention, transformer_options
    from .test_adapter_inputs import _outer_sample

    def run_three_steps():
        s = settings.build_settings(preset="custom", density=0.5, dense_warmup="1", warmup_layers=0, anchor_steps="1",
                                    query_tile=64, cache_placement="auto", backend="torch", min_tokens=0, verbose=False)
        run = lifecycle.RunState(s, torch.tensor([1.0, 0.8, 0.6, 0.0]))
        x = torch.randn(2, 160, 128, generator=gen)
        for sigma in (1.0, 0.8, 0.6):
            for site in (CallSite(0, "wan"), None, None):  # one self-attention call, two cross-attention calls
                opts = transformer_options(run, site, chunks=2, sigma=sigma)
                override.make_override(None)(raw_attention, x, x, x, 2, transformer_options=opts)
        return run

    run = run_three_steps()
    assert run.counts() == {"sparse": 4, "anchor": 2, "dense": 6}  # per CFG chunk
    assert run.summary().startswith("MC-Sparse: 67% of self-attention sparse"), run.summary()

    def broken(*args, **kwargs):
        raise RuntimeError("simulated bug in the anchor")

    monkeypatch.setenv("MC_SPARSE_RAISE_ERRORS", "0")
    monkeypatch.setattr(engine, "anchor_attention", broken)
    run = run_three_steps()
    assert run.counts()["sparse"] == 0
    assert run.summary().startswith("MC-Sparse: stayed dense: internal error; dense for the rest of the run"), \
        run.summary()

    monkeypatch.undo()
    _, text, _ = _outer_sample(monkeypatch, 0, RuntimeError("CUDA out of memory"))
    assert "run interrupted before its first step" in text and "WARNING: no attention call went sparse" not in text


def test_the_summary_says_when_the_cache_spilled_or_noted_something(gen):
    """Entries the cache moved to CPU memory (GPU memory short) and the cache's own notes (pin budget used up, pinning
    failed) reach the run summary (mutations: either line dropped left the suite green; the spill needs a GPU, so the
    counters are set here as ``MetadataCache.put`` sets them)."""
    from comfyui_mc_sparse_pack.comfyui_mc_sparse import engine

    runner = engine.MCSparseRunner(MCSparseConfig(density=0.5, group_size=64, warmup_steps=1, anchor_steps=(0,)),
                                   backend="torch")
    q, k, v = (torch.randn(1, 2, 128, 64, generator=gen) for _ in range(3))
    runner.call(q, k, v, step=0, layer=0, key=CacheKey(0, "c"))
    runner.cache._spill("cache placement gpu: GPU memory short (0.10 GiB free), entries moved to CPU memory")
    runner.cache._once("CPU cache memory could not be pinned: copies are synchronous (slower)")
    text = runner.summary()
    assert "; 1 entries moved to CPU memory (GPU memory short)" in text, text
    assert "note: cache placement gpu: GPU memory short (0.10 GiB free)" in text, text
    assert "note: CPU cache memory could not be pinned" in text, text


def test_the_token_count_suggested_after_an_out_of_memory_fits_exactly():
    """After an out of memory error the 'fewer latent tokens: at most T' suggestion is exact for a cache of that many
    entries (warm-up layers hold none): T tokens fit, T + 1 do not; with no GPU memory at all nothing is suggested
    (mutations that left the suite green: the suggestion's layers without the warm-up layers, i.e. fewer entries
    than the run's; 'at most 0 tokens' suggested)."""
    import re

    from comfyui_mc_sparse_pack.comfyui_mc_sparse import memory

    cfg = MCSparseConfig(density=0.25, warmup_layers=2, residual_dtype="bfloat16", cache_placement="gpu",
                         cache_headroom_gib=0.0)
    entries, free = 28, 3 << 30
    tips = memory.suggest_settings(cfg, (1, 12, 32760, 128), entries, free)
    tokens = int(re.search(r"fewer latent tokens: at most (\d+)", " ".join(tips)).group(1))

    def plan(t):
        return memory.plan_cache(cfg, heads=12, head_dim=128, layers=entries + cfg.warmup_layers, tokens=t, branches=1,
                                 gpu_free=free, host=None, suggest=False)

    assert not plan(tokens).dense and plan(tokens).estimate.entries == entries and plan(tokens + 1).dense
    assert not any("fewer latent tokens" in t for t in memory.suggest_settings(cfg, (1, 12, 32760, 128), entries, 0))


def test_an_entry_of_another_shape_is_never_reused(gen):
    """A reuse call whose stored entry was made for another q shape (same key: here keys without a shape, as the demo
    and raylight build them) anchors again ('late anchor', noted) instead of reusing the stale groups, and the summary's
    'anchor steps taken' lists only the scheduled anchors (mutations that left the suite green: the freshness check
    without the shape; every anchor call listed as a scheduled anchor)."""
    from comfyui_mc_sparse_pack.comfyui_mc_sparse import engine
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.schedule import StepKind
    from comfyui_mc_sparse_pack.kernels import reference

    runner = engine.MCSparseRunner(MCSparseConfig(density=0.5, group_size=64, warmup_steps=1, anchor_steps=(0,)),
                                   backend="torch")
    key = CacheKey(1, "c")
    small = [torch.randn(1, 2, 128, 64, generator=gen) for _ in range(3)]
    large = [torch.randn(1, 2, 192, 64, generator=gen) for _ in range(3)]
    assert runner.call(*small, step=0, layer=1, key=key)[1] is StepKind.ANCHOR
    out, kind = runner.call(*large, step=1, layer=1, key=key)
    assert kind is StepKind.ANCHOR and tuple(runner.cache.get(key).shape) == (1, 2, 192, 64)
    torch.testing.assert_close(out, reference.dense_attention(*large), rtol=2e-2, atol=2e-2)  # an anchor is dense + R
    assert runner.call(*large, step=2, layer=1, key=key)[1] is StepKind.REUSE
    text = runner.summary()
    assert "late anchor at step 2 (1-based)" in text and "anchor steps taken (1-based): 1\n" in text + "\n", text


def test_a_batch_whose_chunks_run_different_kinds(gen):
    """A CFG batch at a reuse step where only one branch has an entry (the other was not seen at the anchor step):
    that branch anchors late (its output is the dense one) while the other reuses, each as it would alone, and the call
    reports ANCHOR (mutation that left the suite green: the whole batch sent down the reuse path when any chunk
    reuses, which then fails on the missing entry)."""
    from comfyui_mc_sparse_pack.comfyui_mc_sparse import engine
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.schedule import StepKind
    from comfyui_mc_sparse_pack.kernels import reference

    def runner():
        return engine.MCSparseRunner(MCSparseConfig(density=0.5, group_size=64, warmup_steps=1, anchor_steps=(0,)),
                                     backend="torch")

    keys = [CacheKey(1, "uncond"), CacheKey(1, "cond")]
    anchor = [torch.randn(1, 2, 128, 64, generator=gen) for _ in range(3)]
    q, k, v = (torch.randn(2, 2, 128, 64, generator=gen) for _ in range(3))
    mixed = runner()
    mixed.call(*anchor, step=0, layer=1, key=keys[1])  # only the cond branch anchors
    out, kind = mixed.call(q, k, v, step=1, layer=1, keys=keys)
    assert kind is StepKind.ANCHOR and mixed.stats.calls[StepKind.REUSE] == 1
    torch.testing.assert_close(out[:1], reference.dense_attention(q[:1], k[:1], v[:1]), rtol=2e-2, atol=2e-2)
    alone = runner()
    alone.call(*anchor, step=0, layer=1, key=keys[1])
    torch.testing.assert_close(out[1:], alone.call(q[1:], k[1:], v[1:], step=1, layer=1, key=keys[1])[0])


@pytest.mark.parametrize("joint", ["video_first", "text_first"])
def test_joint_calls_with_their_own_text_masks_are_exact_at_the_anchor(gen, joint):
    """Two joint [video, text] / [text, video] calls with different text masks (split CFG: the negative prompt pads
    more text tokens) are each exact at the anchor step under their own mask (mutations that left the suite green: the
    mask memo answering for another mask tensor of the same length; with text first, the first video key also passed
    as a text key)."""
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter import lifecycle, override, settings
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter.callsite import TEXT_LEN_KEY, CallSite

    from ._comfy_standins import raw_attention, transformer_options

    s = settings.build_settings(preset="custom", density=0.5, dense_warmup="1", warmup_layers=0, anchor_steps="1",
                                query_tile=64, cache_placement="auto", backend="torch", min_tokens=0, verbose=False)
    run = lifecycle.RunState(s, torch.tensor([1.0, 0.8, 0.0]), family="hunyuan_video")
    sv, st, h = 192, 16, 2
    text = slice(sv, sv + st) if joint == "video_first" else slice(0, st)
    for layer, pad in ((0, 4), (1, 9)):
        q, k, v = (torch.randn(1, h, sv + st, 64, generator=gen) for _ in range(3))
        mask = torch.zeros(1, 1, sv + st)
        mask[..., text.stop - pad:text.stop] = -torch.finfo(torch.float32).max  # the last `pad` text tokens
        opts = {**transformer_options(run, CallSite(layer, "hunyuan_video", joint), chunks=1, sigma=1.0),
                TEXT_LEN_KEY: st}
        out = override.make_override(None)(raw_attention, q, k, v, h, mask=mask, skip_reshape=True,
                                           skip_output_reshape=True, transformer_options=opts)
        ref = raw_attention(q, k, v, h, mask=mask.unsqueeze(1), skip_reshape=True, skip_output_reshape=True)
        torch.testing.assert_close(out, ref.to(out.dtype), rtol=1e-4, atol=1e-4)
    assert run.counts() == {"sparse": 0, "anchor": 2, "dense": 0}


def test_a_prebuilt_h3_layout_is_used_only_for_its_own_shapes(monkeypatch):
    """MiniMax-H3: the payload's prebuilt packed layout serves a forward only when its signature (text length, padded
    video T/H/W, audio length) matches; otherwise one is built for this forward's shapes, as the model's own _forward
    does (mutation that left the suite green: the prebuilt layout taken whatever its shapes, e.g. a second resolution
    with a stale payload); the built one from the PADDED video shape (an odd H / W) with the payload's keyframes and
    references (mutations that left the suite green: the unpadded shape, keyframes or refs dropped: a layout without
    the condition rows the model packs, so the video rows would be misplaced). ComfyUI v0.33.0's modules are
    stand-ins here."""
    import sys
    import types

    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter import minimax

    class PackedLayout:
        def __init__(self, *signature, keyframes=None, refs=None):
            self.signature, self.keyframes, self.refs = signature, keyframes, refs

    def pad_to_patch_size(x, patch):  # comfy/ldm/common_dit.py: each of T, H, W padded up to its patch multiple
        pads = [(-n) % p for n, p in zip(x.shape[-3:], patch)]
        return torch.nn.functional.pad(x, (0, pads[2], 0, pads[1], 0, pads[0]))

    mods = {name: types.ModuleType(name) for name in
            ("comfy", "comfy.ldm", "comfy.ldm.common_dit", "comfy.ldm.minimax", "comfy.ldm.minimax.model")}
    mods["comfy.ldm.common_dit"].pad_to_patch_size = pad_to_patch_size
    mods["comfy.ldm.minimax.model"].PackedLayout = PackedLayout
    mods["comfy"].ldm = mods["comfy.ldm"]
    mods["comfy.ldm"].common_dit, mods["comfy.ldm"].minimax = mods["comfy.ldm.common_dit"], mods["comfy.ldm.minimax"]
    mods["comfy.ldm.minimax"].model = mods["comfy.ldm.minimax.model"]
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    dm = types.SimpleNamespace(patch_size=(1, 2, 2))
    x = [torch.zeros(1, 24, 5, 8, 12), torch.zeros(1, 32, 2, 7)]
    context = torch.zeros(1, 9, 16)
    own = PackedLayout(9, 5, 8, 12, 7)
    assert minimax.packed_layout(dm, x, context, {"layout": own}) is own
    stale = PackedLayout(9, 5, 16, 24, 7)
    built = minimax.packed_layout(dm, x, context, {"layout": stale})
    assert built is not stale and built.signature == (9, 5, 8, 12, 7)
    keyframes, refs = [{"resolved_frame_index": 0}], [{"kind": "ref_img"}]
    odd = [torch.zeros(1, 24, 5, 7, 11), x[1]]
    built = minimax.packed_layout(dm, odd, context, {"keyframes": keyframes, "refs": refs})
    assert built.signature == (9, 5, 8, 12, 7) and built.keyframes is keyframes and built.refs is refs


@pytest.mark.parametrize("cfg, branches", [(1.0, 1), (5.0, 2)])
def test_the_plan_counts_a_cache_branch_per_evaluated_conditioning(cfg, branches):
    """Before sampling the cache is planned for 2 branches only when the uncond branch is evaluated (a negative and
    cfg != 1: at cfg 1 ComfyUI skips it), with the latent's tokens and the model's geometry (mutation that left the
    suite green: a negative prompt counted at cfg 1, doubling the planned cache)."""
    import types

    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter import lifecycle, settings

    from ._comfy_standins import ModelPatcher, wan_model

    planned = []

    class Runner:
        def plan(self, **kwargs):
            planned.append(kwargs)

        def close(self):
            pass

    dm = wan_model()
    s = settings.build_settings(preset="custom", density=0.5, dense_warmup="1", warmup_layers=0, anchor_steps="1",
                                query_tile=64, cache_placement="auto", backend="torch", min_tokens=0, verbose=False)
    run = lifecycle.RunState(s, torch.linspace(1, 0, 11), family="wan", runner_factory=lambda c, b: Runner())
    guider = types.SimpleNamespace(model_patcher=ModelPatcher(dm), conds={"positive": [], "negative": []}, cfg=cfg)
    lifecycle._plan_or_dense(run, guider, torch.zeros(1, 16, 21, 60, 104))
    assert planned == [dict(heads=12, head_dim=128, layers=3, tokens=21 * 30 * 52, branches=branches, batch=1,
                            num_steps=10)]


def test_the_plan_of_a_packed_latent_a_cfg_share_and_a_failed_estimate(caplog):
    """Before sampling: a packed multi-stream latent (ComfyUI v0.33.0 ``latent_shapes``, e.g. MiniMax-H3's video +
    audio) is planned from its first stream (the video), not the packed noise; a raylight CFG rank's share of 3
    evaluated conditionings over 2 ranks is 2 (rounded up: a rank runs 2 of them); an estimate that raises
    ValueError / TypeError is logged and the run stays sparse (it must never stop or densify sampling). Mutations
    that left the suite green: the packed noise's shape planned, the share rounded down, the estimate's errors
    caught by the planning's catch-all (the call went dense)."""
    import logging
    import types

    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter import lifecycle, settings

    from ._comfy_standins import ModelPatcher, wan_model

    planned = []

    class Runner:
        fail = False

        def plan(self, **kwargs):
            planned.append(kwargs)
            if Runner.fail:
                raise ValueError("simulated estimate failure")

        def close(self):
            pass

    s = settings.build_settings(preset="custom", density=0.5, dense_warmup="1", warmup_layers=0, anchor_steps="1",
                                query_tile=64, cache_placement="auto", backend="torch", min_tokens=0, verbose=False)
    guider = _guider("Guider_DualCFG", ("positive", "middle", "negative"), cfg1=8.0, cfg2=8.0, nested=False)
    guider.model_patcher = ModelPatcher(wan_model())

    def plan(**kw):
        run = lifecycle.RunState(s, torch.linspace(1, 0, 11), family="wan", runner_factory=lambda c, b: Runner())
        lifecycle._plan_or_dense(run, guider, **kw)
        return run

    video, audio = (1, 16, 21, 60, 104), (1, 32, 2, 8)
    packed = torch.zeros(1, math.prod(video) + math.prod(audio))  # the streams flattened into one tensor
    run = plan(noise=packed, latent_shapes=[video, audio], branch_split=2)
    assert planned == [dict(heads=12, head_dim=128, layers=3, tokens=21 * 30 * 52, branches=2, batch=1,
                            num_steps=10)], planned
    Runner.fail = True
    with caplog.at_level(logging.WARNING):
        run = plan(noise=torch.zeros(video))
    assert run.runner is not None  # (go_dense drops the runner)
    assert any("no cache estimate for this run (simulated estimate failure)" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("stack_views", [True, False])
def test_kept_batches_count_their_int32_bytes_and_never_keep_a_residual_copy(monkeypatch, stack_views):
    """Decoded groups kept for later reuse steps are charged their int32 groups and indices (both), and a group whose
    stacked residual is a per-call copy (stacked views off) is never kept: keeping it would hold a second copy of its
    residual outside the plan (mutations that left the suite green: only the groups' bytes charged; the per-call copy
    kept)."""
    from comfyui_mc_sparse_pack.comfyui_mc_sparse import prefetch

    from .test_reuse_path import _batched_reuse_run

    real_init = prefetch.ReuseLoader.__init__

    def init(self, cache):
        real_init(self, cache)
        self.keep_budget_bytes = 1 << 30

    monkeypatch.setattr(prefetch.ReuseLoader, "__init__", init)
    run, _ = _batched_reuse_run(monkeypatch, stack_views)
    loader = run.runner.loader
    if not stack_views:
        assert loader.kept_loads == 0 and loader.kept_bytes == 0
        return
    kept = [batch for _, batch in loader._kept.values()]
    assert len(kept) == 2 and loader.kept_loads == 2 * 2 * 2  # 2 layers, reuse steps 3-4, 2 entries each
    assert loader.kept_bytes == sum(b.perm.numel() * 4 + b.kv_idx.numel() * 4 for b in kept)


def test_the_registry_classifies_and_records_what_ran(gen):
    """The CPU allocator's failure counts as out of memory (never a backend failure to skip); a backend picked after
    the requested one refused says 'fallback' and why; the run's record names the backend that ran an op last
    (mutations that left the suite green: only CUDA's 'out of memory' text recognised; 'best available' for a
    fallback; the first backend kept in the record)."""
    from comfyui_mc_sparse_pack import kernels
    from comfyui_mc_sparse_pack.kernels import registry

    assert registry.is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate "
                                                  "1099511627776 bytes"))
    assert not registry.is_out_of_memory(RuntimeError("an unrelated failure"))
    q = torch.randn(1, 2, 40, 32, generator=gen)  # float32: the Triton backend refuses it even when requested
    chosen = registry.candidates("sparse_attention", q, "triton")
    assert chosen[0][1].startswith("fallback; triton (requested): runs float16/bfloat16 only"), chosen[0][1]
    perm = kernels.pddp_groups(q, 16, backend="torch")
    kv = torch.arange(8, dtype=torch.int32).expand(1, 2, 3, 8).contiguous()
    registry.register(registry.Backend(name="record_test", priority=-1,
                                       ops={"sparse_attention": kernels.reference.sparse_attention}))
    try:
        record = registry.Record()
        with registry.recording(record):
            kernels.sparse_attention(q, q, q, perm, kv, backend="record_test")
            assert record.choices["sparse_attention"].backend == "record_test"
            kernels.sparse_attention(q, q, q, perm, kv, backend="torch")
        assert record.choices["sparse_attention"].backend == "torch"
    finally:
        registry._backends.pop("record_test", None)


def test_quantised_residuals_stay_finite_at_extreme_rows(gen):
    """fp8, int4 and int4-group storage of rows at the edges of fp32 (a row of subnormal values, whose fp8 scale
    max|R| / 448 underflows to 0; a group whose rows cancel, so its mean row is tiny and the rows' weights on it are
    huge) decode to finite values within the format's error (before: the fp8 row stored 0 / 0 = NaN, and a NaN
    residual row turns that query's output NaN at every reuse step)."""
    from comfyui_mc_sparse_pack.comfyui_mc_sparse import encoding

    S, D, C = 128, 64, 64
    r = torch.randn(1, 1, S, D, generator=gen)
    r[0, 0, 3] = torch.randn(D, generator=gen) * 1e-44  # subnormal row (some entries exactly 0)
    v, e = torch.randn(D, generator=gen), torch.randn(D, generator=gen) * 1e-6
    r[0, 0, 64:128:2], r[0, 0, 65:128:2] = v + e, -v + e  # group 1: rows cancel, its mean row is ~1e-6
    perm = torch.arange(S, dtype=torch.int32).view(1, 1, S)
    for name in ("float8_e4m3fn", "int4", "int4_group"):
        enc = encoding.encode_residual(r, name, perm=perm, num_groups=S // C)
        back = encoding.decode_residual(enc, torch.float32, perm=perm)
        assert torch.isfinite(back).all(), name
        rel = float((back - r).abs().sum() / r.abs().sum())
        assert rel < (0.05 if name == "float8_e4m3fn" else 0.2), (name, rel)


def _run_state(sigmas, **over):
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter import lifecycle, settings

    base = dict(preset="custom", density=0.5, dense_warmup="1", warmup_layers=0, anchor_steps="1", query_tile=64,
                cache_placement="auto", backend="torch", min_tokens=0, verbose=False)
    return lifecycle.RunState(settings.build_settings(**{**base, **over}), sigmas)


def test_a_warmup_over_every_step_says_so_and_steps_only_advance(monkeypatch):
    """A dense warm-up longer than the sampler call keeps the run dense with that reason (not "no anchor step"); the
    step an interrupted run reports is the highest one reached, also when a later evaluation is at an earlier step;
    the step of an evaluation is read once per sigmas tensor. Mutations: the warm-up reason branch dropped, the
    last step overwritten by a lower one, the per-tensor step memo dropped (a device read per attention call)."""
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter import lifecycle

    sigmas = torch.linspace(1.0, 0.0, 51)
    run = _run_state(sigmas, dense_warmup="60", anchor_steps="auto")
    assert run.runner is None and run.dense_run_reason == "dense warm-up covers all 50 steps"
    run = _run_state(sigmas)
    run.note_step(5)
    run.note_step(3)
    assert run.last_step == 5
    reads = []
    monkeypatch.setattr(lifecycle, "current_sigma", lambda options: reads.append(1) or float(options["sigmas"][0]))
    options = {"sigmas": sigmas[7:8].clone()}
    assert run.step_of(options) == run.step_of(options) == 7 and len(reads) == 1


def test_the_backend_line_names_each_reason_once_and_an_unregistered_backend_runs_auto(monkeypatch):
    """The summary's backend line gives each reason the requested backend was passed over once (two ops with the
    same refusal) and leaves out the ops it does not implement; a backend name the registry does not hold (its
    package failed before registering) runs "auto" with a note. Mutations: no deduplication / no filter; the note
    dropped."""
    from comfyui_mc_sparse_pack.kernels import registry

    run = _run_state(torch.linspace(1.0, 0.0, 5), backend="triton")
    why = "fallback; triton (requested): runs float16/bfloat16 only, got torch.float32"
    run.runner.kernels.choices.update({
        "select_kv": registry.Choice("torch", why), "sparse_attention": registry.Choice("torch", why),
        "pddp_groups": registry.Choice("torch", "fallback; triton (requested): does not implement pddp_groups"),
    })
    line = run.backend_line()
    assert line.count("runs float16/bfloat16 only") == 1 and "does not implement" not in line, line
    monkeypatch.delitem(registry._backends, "cutedsl")
    run = _run_state(torch.linspace(1.0, 0.0, 5), backend="cutedsl")
    assert any("backend 'cutedsl' is not registered here" in note for note in run.notes), run.notes
    assert run.runner.backend == "auto"


def test_the_payoff_check_at_its_edges(monkeypatch):
    """Before sampling (``payoff.dense_reason``): exactly ``min_tokens`` tokens may go sparse; a model whose only
    marked block count is unknown (1) is not refused for having no non-warm-up block; an unknown dtype / head dim is
    probed as bf16 / the largest head dim (so Triton, asked for by name on the interpreter, is a fast kernel); a fast
    backend other than Triton counts; the refusal text leaves out backends that do not implement the op. Mutations:
    ``<=`` at min_tokens, the warm-up layers' floor dropped, the dtype default dropped, only Triton counted, the
    "does not implement" filter dropped."""
    from comfyui_mc_sparse_pack import kernels
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter.payoff import dense_reason
    from comfyui_mc_sparse_pack.kernels import registry

    cfg = MCSparseConfig(density=0.2, group_size=128, warmup_steps=10, warmup_layers=1, anchor_steps=(9,))
    common = dict(num_steps=50, min_tokens=4096)
    assert dense_reason(cfg, layers=30, requested_backend="torch", tokens=4096, **common) is None
    assert "fewer than min tokens" in dense_reason(cfg, layers=30, requested_backend="torch", tokens=4095, **common)
    assert dense_reason(cfg, layers=1, requested_backend="auto", **common) is None
    cpu = torch.device("cpu")
    if os.environ.get("TRITON_INTERPRET") == "1":  # CPU tensors run on Triton's interpreter (tests/conftest.py)
        assert dense_reason(cfg, layers=30, requested_backend="triton", device=cpu, **common) is None
    why = dense_reason(cfg, layers=30, requested_backend="auto", device=cpu, dtype=torch.bfloat16, head_dim=128,
                       **common)
    assert why.startswith("no fast sparse kernel on cpu") and "does not implement" not in why, why
    monkeypatch.setitem(registry._backends, "fast_cpu", registry.Backend(
        name="fast_cpu", priority=50, ops={"sparse_attention": kernels.reference.sparse_attention}))
    assert dense_reason(cfg, layers=30, requested_backend="auto", device=cpu, dtype=torch.bfloat16, head_dim=128,
                        **common) is None


def test_min_tokens_and_the_mask_threshold_at_their_edges(gen):
    """A call of exactly ``min_tokens`` latent tokens goes sparse (one fewer stays dense, with the reason); a text
    mask entry of exactly -1e4 counts as masked out (the override's threshold), so that joint call goes sparse and is
    exact at the anchor under the mask. Mutations: ``<=`` at min_tokens; ``<`` at the mask threshold."""
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter import override
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter.callsite import TEXT_LEN_KEY, CallSite

    from ._comfy_standins import raw_attention, transformer_options

    q, k, v = (torch.randn(1, 2, 160, 64, generator=gen) for _ in range(3))
    for min_tokens, anchors in ((160, 1), (161, 0)):
        run = _run_state(torch.tensor([1.0, 0.5, 0.0]), min_tokens=min_tokens)
        opts = transformer_options(run, CallSite(1, "wan"), chunks=1, sigma=1.0)
        override.make_override(None)(raw_attention, q, k, v, 2, skip_reshape=True, skip_output_reshape=True,
                                     transformer_options=opts)
        assert run.counts()["anchor"] == anchors, (min_tokens, run.summary())
    assert "fewer" in run.summary() and "161" in run.summary(), run.summary()
    run = _run_state(torch.tensor([1.0, 0.5, 0.0]))
    mask = torch.zeros(1, 1, 160)
    mask[..., -4:] = -1e4  # the last 4 of 16 text tokens
    opts = {**transformer_options(run, CallSite(1, "hunyuan_video", "video_first"), chunks=1, sigma=1.0),
            TEXT_LEN_KEY: 16}
    out = override.make_override(None)(raw_attention, q, k, v, 2, mask=mask, skip_reshape=True,
                                       skip_output_reshape=True, transformer_options=opts)
    ref = raw_attention(q, k, v, 2, mask=mask.unsqueeze(1), skip_reshape=True, skip_output_reshape=True)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert run.counts()["anchor"] == 1, run.summary()


def _guider(name, conds, **attrs):
    """A stand-in guider of ComfyUI class ``name`` whose own predict_noise is ComfyUI's (CFGGuider's subclasses keep
    or replace it as in comfy_extras)."""
    base = type("CFGGuider", (), {"predict_noise": lambda self, *a, **k: None})
    cls = base if name == "CFGGuider" else type(name, (base,), {} if name == "Guider_Basic" else
                                                {"predict_noise": lambda self, *a, **k: None})
    guider = cls()
    guider.conds = dict.fromkeys(conds, [])
    guider.cfg = 1.0  # CFGGuider.__init__'s; Guider_DualCFG never changes it
    for key, value in attrs.items():
        setattr(guider, key, value)
    return guider


@pytest.mark.parametrize("name, conds, attrs, branches", [
    ("CFGGuider", ("positive", "negative"), dict(cfg=5.0), 2),
    ("CFGGuider", ("positive", "negative"), dict(cfg=1.0), 1),
    ("Guider_Basic", ("positive",), {}, 1),
    ("Guider_DualCFG", ("positive", "middle", "negative"), dict(cfg1=8.0, cfg2=8.0, nested=False), 3),
    ("Guider_DualCFG", ("positive", "middle", "negative"), dict(cfg1=8.0, cfg2=1.0, nested=False), 2),
    ("Guider_DualCFG", ("positive", "middle", "negative"), dict(cfg1=1.0, cfg2=1.0, nested=False), 1),
    ("Guider_DualCFG", ("positive", "middle", "negative"), dict(cfg1=1.0, cfg2=1.0, nested=True), 3),
    ("Guider_PerpNeg", ("positive", "negative", "empty_negative_prompt"), dict(cfg=6.0, neg_scale=1.0), 3),
    ("Guider_PerpNeg", ("positive", "negative", "empty_negative_prompt"), dict(cfg=6.0, neg_scale=0.0), 2),
    ("Guider_PerpNeg", ("positive", "negative", "empty_negative_prompt"), dict(cfg=1.0, neg_scale=0.0), 1),
    ("SomeCustomGuider", ("positive", "negative"), dict(cfg=3.0), 2),
])
def test_the_plan_counts_the_conditionings_each_guider_evaluates(name, conds, attrs, branches):
    """The cache is planned for the conditionings the guider's predict_noise really evaluates: ComfyUI's DualCFG
    guider runs three at cfg 8 / 8 (its ``cfg`` attribute stays 1.0: the CFGGuider rule planned 1, a third of the
    cache) and PerpNeg three (planned 2); their cfg-1 shortcuts drop branches as ComfyUI does."""
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter import lifecycle

    assert lifecycle.evaluated_branches(_guider(name, conds, **attrs)) == branches


def test_a_guider_subclass_without_its_own_predict_noise_counts_as_its_base():
    """The rule is the class that defines predict_noise (MRO): a node pack's subclass of Guider_DualCFG that keeps
    its predict_noise is counted as DualCFG (3 at cfg 8 / 8, not CFGGuider's 1); a DualCFG guider whose conds hold
    none of its three names still plans 1 branch, never 0. Mutations: the rule by the class's own name; the
    DualCFG count without its floor of 1."""
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter import lifecycle

    dual = _guider("Guider_DualCFG", ("positive", "middle", "negative"), cfg1=8.0, cfg2=8.0, nested=False)
    sub = type("MyDualCFG", (type(dual),), {})()
    sub.__dict__.update(vars(dual))
    assert lifecycle.evaluated_branches(sub) == 3
    assert lifecycle.evaluated_branches(_guider("Guider_DualCFG", ("other",), cfg1=8.0, cfg2=8.0, nested=False)) == 1


def test_schedule_resolution_with_mixed_units_and_anchors_at_the_end():
    """A box that mixes steps and percents is never rejected at the node (units are compared per sampler call): its
    anchors inside the warm-up move to the warm-up's last step, merged into one; an anchor one past the call's last
    step is dropped and named. Mutations that left the suite green: the mixed-unit test as 'all anchors in the other
    unit', the drop / keep bounds at the call's end off by one, moved anchors not merged."""
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter import settings

    def custom(warmup, anchors):
        return settings.build_settings(preset="custom", density=0.5, dense_warmup=warmup, warmup_layers=0,
                                       anchor_steps=anchors, query_tile=64, cache_placement="auto", backend="auto",
                                       min_tokens=0, verbose=False)

    mixed = settings.resolve_schedule(custom("15", "10, 20%"), 50)  # steps 10 and 10 (20 %), both before step 15
    assert (mixed.warmup_steps, mixed.anchor_steps) == (15, (14,)) and "moved to its last step 15" in mixed.notes[0]
    merged = settings.resolve_schedule(custom("6", "2%, 4%"), 50)  # steps 1 and 2 -> both to step 6, one anchor
    assert merged.anchor_steps == (5,)
    end = settings.resolve_schedule(custom("auto", "5, 10"), 9)  # step 10 of a 9-step call
    assert end.anchor_steps == (4,) and "anchor steps 10 lie past the end of this 9-step" in end.notes[0]


def test_calc_cond_batch_wrapper_hands_each_evaluation_its_step_on_a_copy():
    """CALC_COND_BATCH (``comfy/samplers.py`` args ``(model, conds, x_in, timestep, model_options)``, positional or
    keyword): the executor gets a copy of the options with this evaluation's step, from the batch's largest sigma;
    the guider's options never hold a step; a NaN or empty timestep gives no step and no error (the attention calls
    read the sigma themselves). Mutations that left the suite green: the step written into the shared options, the
    smallest sigma, a NaN or empty timestep raising."""
    import types

    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter import lifecycle, settings
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter.override import RUN_KEY
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter.steps import STEP_KEY

    s = settings.build_settings(preset="custom", density=0.5, dense_warmup="1", warmup_layers=0, anchor_steps="1",
                                query_tile=64, cache_placement="auto", backend="torch", min_tokens=0, verbose=False)
    run = lifecycle.RunState(s, torch.tensor([1.0, 0.8, 0.6, 0.4, 0.0]), family="wan",
                             runner_factory=lambda c, b: types.SimpleNamespace(close=lambda: None))
    guider_options = {"transformer_options": {RUN_KEY: run}}
    seen = []

    def executor(*args, **kwargs):
        options = kwargs["model_options"] if "model_options" in kwargs else args[4]
        seen.append(options["transformer_options"].get(STEP_KEY))
        return "out"

    for timestep, want in ((torch.tensor([0.6, 0.8]), 1), (torch.tensor([float("nan")]), None),
                           (torch.tensor([]), None)):
        seen.clear()
        assert lifecycle.calc_cond_batch_wrapper(executor, None, None, None, timestep, guider_options) == "out"
        assert lifecycle.calc_cond_batch_wrapper(executor, None, None, None, timestep=timestep,
                                                 model_options=guider_options) == "out"
        assert seen == [want, want] and STEP_KEY not in guider_options["transformer_options"], (timestep, seen)


def test_prepare_state_and_cleanup_callbacks():
    """ON_PREPARE_STATE re-asserts the override on the model_options it is handed (positionally in newer ComfyUI,
    ``(patcher, timestep, model_options)``) or else on the patcher's; ON_CLEANUP frees the active runs' caches.
    Mutations that left the suite green: the positional model_options ignored, the cleanup doing nothing."""
    import types

    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter import lifecycle, override

    handed = {"transformer_options": {}}
    patcher = types.SimpleNamespace(model_options={"transformer_options": {}})
    lifecycle.on_prepare_state(patcher, torch.tensor([1.0]), handed)
    assert override.is_ours(handed["transformer_options"].get("optimized_attention_override"))
    assert "optimized_attention_override" not in patcher.model_options["transformer_options"]
    lifecycle.on_prepare_state(patcher, torch.tensor([1.0]))
    assert override.is_ours(patcher.model_options["transformer_options"].get("optimized_attention_override"))
    closed = []
    holder = lifecycle.MCSparsePatch(None)
    holder.active_runs.append(types.SimpleNamespace(close=lambda: closed.append(1)))
    lifecycle.on_cleanup(types.SimpleNamespace(model_options={"transformer_options": {lifecycle.HOLDER_KEY: holder}}))
    assert closed == [1]


def test_outer_sample_restores_the_guiders_options_also_after_an_error(monkeypatch):
    """OUTER_SAMPLE runs the sampler on a clone of the guider's model_options (holding this run's state) and puts the
    guider's own dict back afterwards, also when the sampler raises, so the next sampler call on that guider starts
    clean. Mutation that left the suite green: the options not restored."""
    import types

    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter import lifecycle, settings
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter.override import RUN_KEY

    from ._comfy_standins import install_comfy_modules

    install_comfy_modules(monkeypatch)
    s = settings.build_settings(preset="custom", density=0.5, dense_warmup="1", warmup_layers=0, anchor_steps="1",
                                query_tile=64, cache_placement="auto", backend="torch", min_tokens=0, verbose=False)
    original = {"transformer_options": {lifecycle.HOLDER_KEY: lifecycle.MCSparsePatch(s, "wan")}}
    guider = types.SimpleNamespace(model_options=original)
    during = []

    def executor(noise, latent, sampler, sigmas, fail=False):
        during.append(guider.model_options)
        if fail:
            raise RuntimeError("sampler failed")
        return "done"

    executor.class_obj = guider
    assert lifecycle.outer_sample_wrapper(executor, None, None, None, torch.tensor([1.0, 0.5, 0.0])) == "done"
    with pytest.raises(RuntimeError, match="sampler failed"):
        lifecycle.outer_sample_wrapper(executor, None, None, None, torch.tensor([1.0, 0.5, 0.0]), fail=True)
    assert guider.model_options is original and RUN_KEY not in original["transformer_options"]
    assert all(d is not original and RUN_KEY in d["transformer_options"] for d in during)


def _wan_like(name, blocks, vace=0, mapping=None, missing_self_attn=()):
    """A stand-in of ComfyUI's Wan model class ``name``: ``blocks`` blocks (those in ``missing_self_attn`` without a
    self_attn), ``vace`` VACE blocks and their ``vace_layers_mapping``."""
    dm = type(name, (torch.nn.Module,), {})()
    dm.blocks = torch.nn.ModuleList(torch.nn.Module() for _ in range(blocks))
    for i, block in enumerate(dm.blocks):
        if i not in missing_self_attn:
            block.self_attn = torch.nn.Identity()
    if vace:
        dm.vace_blocks = torch.nn.ModuleList(torch.nn.Module() for _ in range(vace))
        for block in dm.vace_blocks:
            block.self_attn = torch.nn.Identity()
        dm.vace_layers_mapping = mapping or {}
    return dm


def test_call_site_marks_and_plans_at_their_edges():
    """The marking wrappers and plans where only the real-ComfyUI tier looked: a forward called without
    transformer_options is called unchanged; the mark goes on a copy (the caller's dict never carries it); main block
    0 starts a fresh VACE occurrence count; a Wan block without self-attention is not patched; a VACE block outside
    vace_layers_mapping gets its own layer after the main blocks; applying the plan twice keeps one layer of marks;
    HunyuanVideo without double blocks reads as [text, video]. Seven mutations that left the CPU suite green."""
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter import layouts
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter.callsite import MARK_KEY, OCCURRENCE_KEY, CallSite

    from ._comfy_standins import ModelPatcher

    seen = []

    def original(*args, **kwargs):
        seen.append(kwargs)
        return "out"

    block0 = layouts._marking_forward(original, CallSite(0, "wan"), reset_occurrences=True)
    vace = layouts._marking_forward(original, CallSite(0, "wan", kind="vace"), count_occurrences=True)
    assert block0(1) == "out" and seen == [{}]  # no options: nothing added
    options = {OCCURRENCE_KEY: {(0, "vace"): 5}}  # a stale count
    block0(1, transformer_options=options)
    vace(1, transformer_options=options)
    vace(1, transformer_options=options)
    assert [kw["transformer_options"][MARK_KEY].occurrence for kw in seen[2:]] == [0, 1]
    assert MARK_KEY not in options

    plan = layouts.plan_for(_wan_like("WanModel", 3, missing_self_attn=(1,)))
    assert [rel for rel, _ in plan.patches] == ["blocks.0.self_attn.forward", "blocks.2.self_attn.forward"]
    plan = layouts.plan_for(_wan_like("VaceWanModel", 4, vace=2, mapping={0: 0}))  # VACE block 1 unmapped
    marks = {rel: factory(original).mc_sparse_marker for rel, factory in plan.patches}
    assert marks["vace_blocks.0.self_attn.forward"].layer == 0 and marks["vace_blocks.1.self_attn.forward"].layer == 5
    forwards = dict(plan.patches)  # a VACE model's block 0 starts each forward's occurrence count (plan_for's flag)
    stale = {OCCURRENCE_KEY: {(0, "vace"): 5}}
    forwards["blocks.0.self_attn.forward"](original)(1, transformer_options=stale)
    assert stale[OCCURRENCE_KEY] == {}
    stale = {OCCURRENCE_KEY: {(0, "vace"): 5}}
    forwards["blocks.1.self_attn.forward"](original)(1, transformer_options=stale)  # later blocks leave it
    assert stale[OCCURRENCE_KEY] == {(0, "vace"): 5}

    patcher = ModelPatcher(_wan_like("WanModel", 2))
    plan = layouts.plan_for(patcher.get_model_object("diffusion_model"))
    assert layouts.install_plan(patcher, plan) == 2
    first = dict(patcher.object_patches)
    assert layouts.install_plan(patcher, plan) == 0 and patcher.object_patches == first

    assert layouts._hunyuan_video_order(type("HunyuanVideo", (), {})()) == "text_first"


def test_wan_variants_of_the_2026_snapshot():
    """ComfyUI v0.33.0's Wan subclasses that run Wan's own blocks (SCAIL, SCAIL-2, WanDancer) are marked like Wan;
    the causal autoregressive Wan and Wan Animate 2 stay dense with a reason naming them (not the generic one). The
    real models: tests/integration/test_comfyui_2026.py."""
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter import layouts

    for name in ("SCAILWanModel", "SCAIL2WanModel", "WanDancerModel"):
        plan = layouts.plan_for(_wan_like(name, 2))
        assert plan.family == "wan" and plan.reason_unsupported is None
        assert [rel for rel, _ in plan.patches] == ["blocks.0.self_attn.forward", "blocks.1.self_attn.forward"]
    for name, words in (("CausalWanModel", "KV cache"), ("WanAnimate2Model", "per frame")):
        plan = layouts.plan_for(_wan_like(name, 2))
        assert plan.family is None and not plan.patches and words in plan.reason_unsupported


def test_window_keys_and_key_masks_at_their_edges():
    """override._window_key: no window is None (the summary's 'no context windows'); windows are keyed by their index
    list (two window objects of one step or of two steps with the same frames are the same key; repr is only the
    fallback). override._analyse_mask: a bool key mask (True = attend) keeps the unmasked keys like its additive
    form; a mask that masks nothing keeps every key without an index list (None, None). Five mutations that left the
    suite green."""
    from types import SimpleNamespace

    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter import override

    assert override._window_key(None) is None
    a, b = SimpleNamespace(index_list=[0, 1, 2]), SimpleNamespace(index_list=torch.tensor([0, 1, 2]))
    assert override._window_key(a) == override._window_key(b) == ("window", (0, 1, 2))
    assert override._window_key(SimpleNamespace(index_list=[1, 2, 3])) != override._window_key(a)
    seq, latent = 10, slice(4, 10)
    keep = torch.ones(seq, dtype=torch.bool)
    keep[[1, 3]] = False  # two padded text keys
    additive = torch.where(keep, 0.0, float("-inf"))
    for mask in (keep.view(1, 1, seq), additive.view(1, 1, seq)):
        idx, why = override._analyse_mask(mask, seq, latent)
        assert why is None and idx.tolist() == [0, 2, 4, 5, 6, 7, 8, 9]
    assert override._analyse_mask(torch.ones(1, 1, seq, dtype=torch.bool), seq, latent) == (None, None)
    assert override._analyse_mask(torch.zeros(1, 1, seq), seq, latent) == (None, None)


def test_argument_checks_of_settings_cache_and_encodings():
    """Guards that a mutation could drop with the adapter, cache and encoding tests green (session 10: each 'if' before
    a raise in settings / cache / encoding replaced by False): an anchor list with no step (',') and a density that is
    text under 'custom', a schedule for 0 steps, an unknown cache placement or fixed choice, an unknown selection
    encoding, kv_idx / perm of the wrong dtype or rank, K outside [1, K_alloc], a 4-bit residual of odd head dim.
    Each is a clear error naming the argument."""
    from comfyui_mc_sparse_pack.comfyui_mc_sparse import encoding
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter import settings

    def build(**over):
        base = dict(preset="custom", density=0.5, dense_warmup="1", warmup_layers=0, anchor_steps="1", query_tile=64,
                    cache_placement="auto", backend="auto", min_tokens=0, verbose=False)
        return settings.build_settings(**{**base, **over})

    with pytest.raises(ValueError, match="anchor steps must list at least one step"):
        build(anchor_steps=" , ;")
    with pytest.raises(TypeError, match="density must be a number"):
        build(density="0.5")
    with pytest.raises(ValueError, match="num_steps must be >= 1"):
        settings.resolve_schedule(build(), 0)
    with pytest.raises(ValueError, match="placement must be one of"):
        MetadataCache("disk")
    with pytest.raises(ValueError, match="choice must be 'gpu' or 'cpu'"):
        MetadataCache("auto").fix_placement("auto")
    with pytest.raises(ValueError, match="index_encoding must be one of"):
        encoding.pick_selection_encoding("bits", 100, 10, 16)
    idx = torch.arange(16, dtype=torch.int32).view(1, 1, 1, 16)
    with pytest.raises(ValueError, match="kv_idx must be int32"):
        encoding.encode_selection(idx.long(), 100, 16)
    with pytest.raises(ValueError, match="kv_idx must be int32"):
        encoding.encode_selection(idx[0], 100, 16)
    for k in (0, 17):
        with pytest.raises(ValueError, match=r"num_keys must be in \[1, K_alloc=16\]"):
            encoding.encode_selection(idx, 100, k)
    with pytest.raises(ValueError, match="perm must be int32"):
        encoding.encode_groups(torch.arange(16).view(1, 1, 16), 16)
    with pytest.raises(ValueError, match="residual needs an even head dim"):
        encoding.encode_residual(torch.randn(1, 1, 16, 7), "int4")


def test_outer_sample_without_the_patch_and_a_run_where_no_op_ran(monkeypatch):
    """OUTER_SAMPLE on a guider whose options hold no MC-Sparse patch (the wrapper outlived it) runs the sampler as
    is, options untouched; a run with a named backend where no kernel op ran says so on its backend line. (Mutations
    that left the suite green: the holder check dropped, the 'no kernel op ran' branch dropped.)"""
    import types

    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter import lifecycle, settings

    from ._comfy_standins import install_comfy_modules

    install_comfy_modules(monkeypatch)
    options = {"transformer_options": {}}
    guider = types.SimpleNamespace(model_options=options)
    seen = []

    def executor(noise, latent, sampler, sigmas):
        seen.append(guider.model_options)
        return "done"

    executor.class_obj = guider
    assert lifecycle.outer_sample_wrapper(executor, None, None, None, torch.tensor([1.0, 0.5, 0.0])) == "done"
    assert seen == [options] and seen[0] is options and options == {"transformer_options": {}}

    s = settings.build_settings(preset="custom", density=0.5, dense_warmup="1", warmup_layers=0, anchor_steps="1",
                                query_tile=64, cache_placement="auto", backend="torch", min_tokens=0, verbose=False)
    run = lifecycle.RunState(s, torch.tensor([1.0, 0.5, 0.0]))
    assert run.backend_line() == "backend: requested torch; no kernel op ran in this sampler call"
