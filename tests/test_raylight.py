"""The raylight inner-attention processor (``adapter/raylight.py``) against raylight's own registry and dispatcher.

raylight's source is never committed: point ``RAYLIGHT_DIR`` at a raylight checkout (the folder holding ``src/``,
with ``src/raylight/distributed_modules/inner_attention/``); the tests that need it are skipped otherwise.
Two Ulysses ranks are simulated in one process by handing each rank its slice of the heads of one CPU tensor
(what the all-to-all gives each rank): every rank's output must equal the one-GPU MC-Sparse output's same heads.
"""

import datetime
import logging
import os
import sys
import types
from pathlib import Path

import pytest
import torch
from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter import lifecycle, override, settings
from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter import raylight as ray_mc
from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter.callsite import CallSite

from ._comfy_standins import raw_attention, transformer_options

RANKS = 2


@pytest.fixture(scope="module")
def inner():
    """raylight's ``inner_attention`` package from ``RAYLIGHT_DIR`` (skipped with the reason when absent)."""
    root = os.environ.get("RAYLIGHT_DIR")
    if not root:
        pytest.skip("RAYLIGHT_DIR is not set (a raylight checkout with src/raylight/distributed_modules/"
                    "inner_attention/; fetch github:komikndr/raylight)")
    src = Path(root) / "src"
    if not (src / "raylight" / "distributed_modules" / "inner_attention").is_dir():
        pytest.skip(f"{src}/raylight/distributed_modules/inner_attention is missing (raylight too old)")
    if str(src) not in sys.path:
        sys.path.insert(0, str(src))
    try:
        import raylight.distributed_modules.inner_attention as ia
    except ImportError as err:
        pytest.skip(f"raylight's inner_attention does not import here: {err}")
    return ia


def _settings(**over):
    base = dict(preset="custom", density=0.25, dense_warmup="1", warmup_layers=1, anchor_steps="1", query_tile=64,
                cache_placement="cpu", backend="torch", min_tokens=0, verbose=False)
    return settings.build_settings(**{**base, **over})


class FakeXfuserAttention:
    """xDiT's long-context attention as raylight's dispatcher sees it: ``ring_attn_fn(q, k, v, **kwargs)`` on
    ``[B, S, H, D]`` (flash layout), here exact attention in float64 cast back to q's dtype."""

    def __init__(self):
        self.dense_calls = 0
        self.ring_attn_fn = self._ring

    def _ring(self, q, k, v, softmax_scale=None, **kwargs):
        self.dense_calls += 1
        out = raw_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), q.shape[2], skip_reshape=True,
                            skip_output_reshape=True)
        return out.transpose(1, 2)


def _options(run, layer, sigma, chunks=2):
    return {override.RUN_KEY: run, "block_index": layer, "cond_or_uncond": [1, 0][:chunks],
            "uuids": [f"u{i}" for i in range(chunks)], "sigmas": torch.tensor([sigma])}


def _xdit_kwargs(**over):
    return {"dropout_p": 0.0, "softmax_scale": None, "causal": False, "window_size": (-1, -1), "alibi_slopes": None,
            "deterministic": False, "return_attn_probs": False, "group": None, "joint_tensor_key": None,
            "joint_tensor_value": None, "joint_strategy": "none", **over}


def test_registration_and_set_inner_attention(inner):
    """The processor registers under its namespaced name (idempotently) and raylight creates and installs it."""
    assert ray_mc.register_with_raylight() and ray_mc.register_with_raylight()
    assert ray_mc.PROCESSOR_NAME in inner.InnerAttentionRegistry.available()
    processor = inner.create_inner_attention(ray_mc.PROCESSOR_NAME)
    assert isinstance(processor, ray_mc.MCSparseInnerAttention) and processor.supports_ring is False
    assert ray_mc.INNER_ATTENTION_KEY == inner.INNER_ATTENTION_KEY

    class Model:
        model_options = {"transformer_options": {}}

        def clone(self):
            other = Model()
            other.model_options = dict(self.model_options)
            return other

    patched = inner.set_inner_attention(Model(), processor)
    assert patched.model_options["transformer_options"][inner.INNER_ATTENTION_KEY] is processor


def test_two_ulysses_ranks_equal_one_gpu_heads(inner, gen):
    """Key property: through raylight's dispatcher, each simulated rank's output (its heads, full sequence) equals
    the one-GPU MC-Sparse output's same heads at warm-up, anchor and reuse steps; the two ranks share one
    RunState, so a cache key without the head slice would hand rank 1 rank 0's selections."""
    sig = torch.tensor([1.0, 0.6, 0.3, 0.0])
    one_gpu = lifecycle.RunState(_settings(), sig, family="wan")
    ranks = lifecycle.RunState(_settings(), sig, family="wan")
    over = override.make_override(None)
    xdit = FakeXfuserAttention()
    dispatcher = inner.InnerAttentionDispatcher(xdit)
    per_rank = 4 // RANKS
    processors = [ray_mc.MCSparseInnerAttention(lambda r=r: ray_mc.HeadSlice(r, RANKS, 1)) for r in range(RANKS)]
    b, h, s, d = 2, 4, 320, 64  # 2 conditioning chunks; 320 tokens = 5 query groups of 64
    base = [torch.randn(b, h, s, d, generator=gen) for _ in range(3)]
    max_gap_to_dense = 0.0
    for sigma in sig[:-1].tolist():
        for layer in range(2):
            q, k, v = (t + 0.3 * torch.randn(t.shape, generator=gen) for t in base)  # drifts a little per call
            ref = over(raw_attention, q, k, v, h, skip_reshape=True, skip_output_reshape=True,
                       transformer_options=transformer_options(one_gpu, CallSite(layer, "wan"), sigma=sigma))
            for r, processor in enumerate(processors):
                heads = slice(r * per_rank, (r + 1) * per_rank)
                ql, kl, vl = (t[:, heads].transpose(1, 2).contiguous() for t in (q, k, v))  # [B, S, H/N, D]
                with dispatcher.scope(processor, _options(ranks, layer, sigma)):
                    out = xdit.ring_attn_fn(ql, kl, vl, **_xdit_kwargs())
                assert out.shape == ql.shape and out.dtype == ql.dtype and torch.isfinite(out).all()
                torch.testing.assert_close(out.transpose(1, 2), ref[:, heads], rtol=1e-5, atol=1e-5)
            dense = raw_attention(q, k, v, h, skip_reshape=True, skip_output_reshape=True)
            max_gap_to_dense = max(max_gap_to_dense, float((ref - dense).abs().max()))
    assert ranks.counts()["sparse"] == RANKS * one_gpu.counts()["sparse"] > 0
    assert ranks.counts()["anchor"] == RANKS * one_gpu.counts()["anchor"] > 0
    assert max_gap_to_dense > 1e-3  # the sparse path really ran (density 0.25 differs from dense)
    kinds = {key.kind for key in ranks.cache_keys}
    assert kinds == {f"self@u{r}/{RANKS}" for r in range(RANKS)}


def test_dense_paths_pass_xdit_arguments_through(inner, gen):
    """Outside a run, cross-attention shapes, joint/causal calls and dense warm-up run xDiT's attention with the
    caller's arguments; reasons are counted."""
    run = lifecycle.RunState(_settings(), torch.tensor([1.0, 0.5, 0.0]), family="wan")
    xdit = FakeXfuserAttention()
    dispatcher = inner.InnerAttentionDispatcher(xdit)
    processor = ray_mc.MCSparseInnerAttention(lambda: ray_mc.HeadSlice(0, 2, 1))
    q = torch.randn(2, 128, 2, 64, generator=gen)
    ctx = torch.randn(2, 16, 2, 64, generator=gen)
    cases = [({}, q, q, "outside"),
             (_options(run, 1, 0.5), q, ctx, "not self-attention"),
             (_options(run, 1, 0.5), q, q, "joint text keys"),
             (_options(run, 1, 0.5), q, q, "causal"),
             (_options(run, 0, 0.5), q, q, "warm-up layer")]
    extra = [{}, {}, {"joint_tensor_key": ctx}, {"causal": True}, {}]
    for (opts, qq, kv, _), more in zip(cases, extra):
        before = xdit.dense_calls
        with dispatcher.scope(processor, opts):
            out = xdit.ring_attn_fn(qq, kv, kv, **_xdit_kwargs(**more))
        assert xdit.dense_calls == before + 1
        torch.testing.assert_close(out, xdit._ring(qq, kv, kv))
    reasons = " | ".join(run.runner.stats.dense_reasons)
    for _, _, _, why in cases[1:]:
        assert why in reasons


def test_ring_refused_with_a_clear_message(inner):
    """raylight's scope refuses the processor under ring attention; the pack refuses first, naming the fix."""
    with pytest.raises(RuntimeError, match="ring"):
        with inner.inner_attention_scope(ray_mc.MCSparseInnerAttention(), {}, ring_world_size=2):
            pass
    with pytest.raises(RuntimeError, match=r"ring degree 2 > 1.*Ulysses only"):
        ray_mc.check_ring(ray_mc.HeadSlice(0, 2, 2))
    ray_mc.check_ring(ray_mc.HeadSlice(1, 2, 1))  # Ulysses only: accepted
    run = lifecycle.RunState(_settings(), torch.tensor([1.0, 0.5, 0.0]), family="wan")
    q = torch.randn(1, 128, 2, 64)
    ring_processor = ray_mc.MCSparseInnerAttention(lambda: ray_mc.HeadSlice(0, 1, 2))
    with pytest.raises(RuntimeError, match="ring degree 2"):
        ring_processor(lambda *a, **k: q, q, q, q, transformer_options=_options(run, 1, 0.5, chunks=1))


class FakeStore:
    """The c10d key-value store calls ``report_across_ranks`` makes (set / wait / get / delete_key)."""

    def __init__(self):
        self.data = {}

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def wait(self, keys, timeout):
        assert isinstance(timeout, datetime.timedelta)
        missing = [key for key in keys if key not in self.data]
        if missing:
            raise RuntimeError(f"timeout waiting for {missing}")

    def get(self, key):
        return self.data[key]

    def delete_key(self, key):
        return self.data.pop(key, None) is not None


def test_summary_gathered_and_logged_once_by_rank_zero():
    """Rank 1 only publishes; rank 0 logs one text holding both ranks' tallies (and says when a rank is missing)."""
    records = []

    class Log:
        def log(self, level, fmt, text):
            records.append((level, text))

    store = FakeStore()
    rank1 = "MC-Sparse: 3 sparse, 1 anchor, 2 dense attention calls over 4 steps\n  note: only on rank 1"
    rank0 = "MC-Sparse: 4 sparse, 1 anchor, 2 dense attention calls over 4 steps\n  schedule: x"
    assert ray_mc.report_across_ranks(rank1, group=(1, 2, store), run_id=7, log=Log()) is None
    assert records == []
    text = ray_mc.report_across_ranks(rank0, group=(0, 2, store), run_id=7, log=Log())
    assert len(records) == 1 and records[0] == (logging.INFO, text)
    assert "rank 0: MC-Sparse: 4 sparse" in text and "rank 1: MC-Sparse: 3 sparse" in text
    assert "only on rank 1" in text and text.count("schedule: x") == 1
    assert store.data == {}  # rank 0 removed what it read
    records.clear()
    text = ray_mc.report_across_ranks(rank0, group=(0, 2, FakeStore()), timeout_s=0.01, log=Log())
    assert len(records) == 1 and "rank 1: MC-Sparse: no summary from this rank" in text


def test_forward_options_shim_passes_published_options_only_when_missing():
    """raylight's Wan self-attention passes no transformer_options: the shim adds this evaluation's, once."""
    seen = []
    module = types.SimpleNamespace(xfuser_optimized_attention=lambda *a, **kw: seen.append(kw.get("transformer_options")))
    assert ray_mc.forward_options_shim(module) and ray_mc.forward_options_shim(module)
    assert module.xfuser_optimized_attention.wrapped.__name__ == "<lambda>"  # wrapped once, not twice
    run_options = {override.RUN_KEY: object()}
    explicit = {"mine": 1}

    def executor(*args, **kwargs):
        module.xfuser_optimized_attention(1, 2, 3, heads=2)
        module.xfuser_optimized_attention(1, 2, 3, heads=2, transformer_options=explicit)
        return "out"

    assert ray_mc.diffusion_model_wrapper(executor, 0, 0, 0, None, None, run_options) == "out"
    module.xfuser_optimized_attention(1, 2, 3, heads=2)  # outside an evaluation
    assert seen == [run_options, explicit, None]
    assert run_options[ray_mc.OCCURRENCE_KEY] == {}


def _xdit_dense(calls):
    """xDiT's attention as the processor's ``dense``: float64 SDPA on ``[B, S, H, D]`` with its softmax_scale."""

    def dense(q, k, v, softmax_scale=None, **kwargs):
        calls.append(softmax_scale)
        qh, kh, vh = (t.transpose(1, 2).double() for t in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, scale=softmax_scale)
        return out.transpose(1, 2).to(q.dtype)
    return dense


@pytest.mark.parametrize(("what", "why"), [
    ("cross", "not self-attention"), ("dropout", "causal, dropout or ALiBi"), ("alibi", "causal, dropout or ALiBi"),
    ("window", "windowed (local) attention"), ("probs", "attention probabilities requested"),
    ("short", "fewer latent tokens (128) than min tokens (256)"), ("head_dim", "head dim 48 not supported"),
    ("batch", "batch 3 does not split into 2 conditioning chunks"), ("v_dim", "not self-attention"),
    ("joint_value", "joint text keys"), ("same_uuid", "share one identity"),
])
def test_processor_calls_that_stay_dense_say_why(gen, what, why):
    """Each xDiT call MC-Sparse cannot run exactly (cross-attention, dropout, ALiBi, a window, probabilities asked
    for, too few tokens, an unsupported head dim, a batch that is not whole conditioning chunks or whose chunks carry
    one identity) runs xDiT's own attention with the caller's arguments, and the summary's dense reasons name it (no raylight needed: the
    processor called as raylight's dispatcher calls it). Mutations: any one of these checks dropped."""
    run = lifecycle.RunState(_settings(min_tokens=256 if what == "short" else 0), torch.tensor([1.0, 0.5, 0.0]),
                             family="wan")
    calls = []
    dense = _xdit_dense(calls)
    B, S, D = (3 if what == "batch" else 2), (128 if what == "short" else 320), (48 if what == "head_dim" else 64)
    q, k, v = (torch.randn(B, S, 2, D, generator=gen) for _ in range(3))
    if what == "cross":
        k, v = k[:, :16], v[:, :16]
    if what == "v_dim":  # q and k alike, v of another head dim
        v = v[..., :32]
    more = {"dropout": {"dropout_p": 0.1}, "alibi": {"alibi_slopes": torch.ones(2)}, "window": {"window_size": (64, 64)},
            "probs": {"return_attn_probs": True}, "joint_value": {"joint_tensor_value": torch.ones(1)}}.get(what, {})
    kwargs = _xdit_kwargs(softmax_scale=0.3, **more)
    processor = ray_mc.MCSparseInnerAttention(lambda: ray_mc.HeadSlice(0, 2, 1))
    options = _options(run, 1, 0.5)
    if what == "same_uuid":
        options["uuids"] = ["u0", "u0"]
    out = processor(dense, q, k, v, transformer_options=options, **kwargs)
    torch.testing.assert_close(out, dense(q, k, v, **kwargs))
    assert calls == [0.3, 0.3]
    assert run.counts()["sparse"] == 0
    assert any(why in reason for reason in run.runner.stats.dense_reasons), run.runner.stats.dense_reasons


def test_processor_edges_min_tokens_and_warmup_layers(gen):
    """A call of exactly ``min_tokens`` tokens is taken (the node's rule: fewer stay dense), and a block below
    ``warmup_layers`` is counted as a dense warm-up LAYER in the summary, not a warm-up step (mutations that left the
    suite green: '<=' at min tokens; the layer reason dropped)."""
    calls = []
    dense = _xdit_dense(calls)
    q, k, v = (torch.randn(2, 256, 2, 64, generator=gen) for _ in range(3))
    processor = ray_mc.MCSparseInnerAttention(lambda: ray_mc.HeadSlice(0, 2, 1))
    run = lifecycle.RunState(_settings(min_tokens=256, warmup_layers=2), torch.tensor([1.0, 0.5, 0.0]), family="wan")
    for layer in (1, 2):
        processor(dense, q, k, v, transformer_options=_options(run, layer, 0.5), **_xdit_kwargs())
    reasons = run.runner.stats.dense_reasons
    assert not any("fewer latent tokens" in r for r in reasons), reasons
    assert reasons.get("dense warm-up layer") == 1 and run.counts()["anchor"] + run.counts()["sparse"] >= 1, (
        reasons, run.counts())


def test_processor_reuse_steps_use_xdit_scale_and_count_repeated_blocks(gen):
    """xDiT's ``softmax_scale`` reaches the sparse kernel: a run at scale 0.3 equals a run at the default 1/sqrt(D)
    on q x 0.3 sqrt(D) (the same logits) at warm-up, anchor and reuse steps. A block called twice in one evaluation
    (VACE) gets a second cache entry ("self#1@u0/2"). Mutations: the sparse call without the caller's scale (the
    reuse steps then mix 1/sqrt(D) with the anchor's 0.3 residual); the occurrence count not advanced."""
    sig = torch.tensor([1.0, 0.6, 0.3, 0.0])
    runs = [lifecycle.RunState(_settings(density=0.5), sig, family="wan") for _ in range(2)]
    dense = _xdit_dense([])
    processor = ray_mc.MCSparseInnerAttention(lambda: ray_mc.HeadSlice(0, 2, 1))
    base = [torch.randn(2, 320, 2, 64, generator=gen) for _ in range(3)]
    for sigma in sig[:-1].tolist():
        options = [_options(run, 1, sigma) for run in runs]
        for _ in range(2):  # the block and its repeat in the same evaluation
            q, k, v = (t + 0.3 * torch.randn(t.shape, generator=gen) for t in base)
            got = processor(dense, q, k, v, transformer_options=options[0], **_xdit_kwargs(softmax_scale=0.3))
            want = processor(dense, q * (0.3 * 64**0.5), k, v, transformer_options=options[1], **_xdit_kwargs())
            assert float((got - want).abs().sum() / want.abs().sum()) < 1e-4  # ~1e-6 (rounding); 0.8 at scale 1/8
    for run in runs:
        assert run.counts()["sparse"] == 8  # step 3: 2 calls x 2 conditioning chunks x 2 ranks' worth of entries
        assert {key.kind for key in run.cache_keys} == {"self@u0/2", "self#1@u0/2"}


@pytest.mark.parametrize("uuids", [True, False])
def test_cfg_parallel_ranks_equal_one_gpu_rows(gen, uuids):
    """raylight's CFG parallelism (``cfg_utils.cfg_parallel_forward``): each CFG rank evaluates its row of the CFG
    batch while transformer_options still describe both conditionings. Each rank's processor output equals the
    one-GPU MC-Sparse output's same row at warm-up, anchor and reuse steps, under its own branch's cache key (both
    ranks share one RunState here: a rank keyed by the other's branch would reuse its selection). Before: every call
    on a CFG rank ran dense ("batch 1 does not split into 2 conditioning chunks"). Also with uuids absent
    (cond_or_uncond names the branches); a CFG rank whose rows split a chunk runs dense and says why."""
    sig = torch.tensor([1.0, 0.6, 0.3, 0.0])
    one_gpu = lifecycle.RunState(_settings(), sig, family="wan")
    ranks = lifecycle.RunState(_settings(), sig, family="wan")
    over = override.make_override(None)
    dense = _xdit_dense([])
    processors = [ray_mc.MCSparseInnerAttention(lambda r=r: ray_mc.HeadSlice(cfg_rank=r, cfg_degree=2))
                  for r in range(2)]
    b, h, s, d = 2, 2, 320, 64
    base = [torch.randn(b, h, s, d, generator=gen) for _ in range(3)]
    for sigma in sig[:-1].tolist():
        for layer in range(2):
            q, k, v = (t + 0.3 * torch.randn(t.shape, generator=gen) for t in base)
            ref = over(raw_attention, q, k, v, h, skip_reshape=True, skip_output_reshape=True,
                       transformer_options=transformer_options(one_gpu, CallSite(layer, "wan"), sigma=sigma))
            for r, processor in enumerate(processors):
                options = _options(ranks, layer, sigma)
                if not uuids:
                    del options["uuids"]
                ql, kl, vl = (t[r:r + 1].transpose(1, 2) for t in (q, k, v))  # this CFG rank's row, [1, S, H, D]
                out = processor(dense, ql, kl, vl, transformer_options=options, **_xdit_kwargs())
                torch.testing.assert_close(out.transpose(1, 2), ref[r:r + 1], rtol=1e-5, atol=1e-5)
    assert ranks.counts()["sparse"] == one_gpu.counts()["sparse"] > 0
    assert ranks.counts()["anchor"] == one_gpu.counts()["anchor"] > 0
    want = {"u0", "u1"} if uuids else {"cond_or_uncond=1", "cond_or_uncond=0"}
    assert {key.branch for key in ranks.cache_keys} == want
    split = lifecycle.RunState(_settings(), sig, family="wan")
    options = _options(split, 1, 0.6, chunks=1)  # one conditioning chunk of 2 rows over 2 CFG ranks of 1 row
    processors[1](dense, ql, kl, vl, transformer_options=options, **_xdit_kwargs())
    assert split.counts()["sparse"] == 0
    assert any("rows split conditioning chunks" in why for why in split.runner.stats.dense_reasons)


def test_processor_contains_a_bug_and_passes_xdits_errors(gen, monkeypatch):
    """A bug in the processor's own code (here the context-window key) gives that call and the rest of the run
    xDiT's attention, with the error in the summary, as the override's entry does; an error of xDiT's own attention
    propagates unchanged; ring attention is still refused with an error (a setup error, not contained)."""
    monkeypatch.setenv("MC_SPARSE_RAISE_ERRORS", "0")
    run = lifecycle.RunState(_settings(), torch.tensor([1.0, 0.6, 0.3, 0.0]), family="wan")
    calls = []
    dense = _xdit_dense(calls)
    processor = ray_mc.MCSparseInnerAttention(lambda: ray_mc.HeadSlice(0, 2, 1))
    q, k, v = (torch.randn(2, 320, 2, 64, generator=gen) for _ in range(3))

    def broken(window):
        raise IndexError("simulated bug in the window key")

    monkeypatch.setattr(ray_mc, "_window_key", broken)
    for sigma in (1.0, 0.6):
        out = processor(dense, q, k, v, transformer_options=_options(run, 1, sigma), **_xdit_kwargs())
        torch.testing.assert_close(out, dense(q, k, v))
    assert "internal error at block 1 (IndexError: simulated bug in the window key)" in run.summary(), run.summary()
    assert run.counts()["sparse"] == 0

    def xdit_fails(*args, **kwargs):
        raise RuntimeError("xDiT failed")

    with pytest.raises(RuntimeError, match="xDiT failed"):
        processor(xdit_fails, q, k, v, transformer_options=_options(run, 1, 0.3), **_xdit_kwargs())
    ring = ray_mc.MCSparseInnerAttention(lambda: ray_mc.HeadSlice(0, 1, 2))
    with pytest.raises(RuntimeError, match="ring degree 2"):
        ring(dense, q, k, v, transformer_options=_options(run, 1, 0.3), **_xdit_kwargs())


def test_xdit_dense_returning_a_tuple_gives_its_output():
    """Some xDiT ring functions return (out, lse, ...): the runner's dense fallback takes the output, heads first.
    Mutation: the tuple passed on."""
    out = torch.randn(2, 8, 3, 16)
    dense_fn = ray_mc._heads_first_dense(lambda q, k, v, **kw: (out, torch.zeros(2, 3, 8)), {})
    x = torch.zeros(2, 3, 8, 16)
    assert torch.equal(dense_fn(x, x, x), out.transpose(1, 2))


def test_diffusion_model_wrapper_publishes_only_in_a_run_and_resets_the_occurrences():
    """Outside an MC-Sparse run the DIFFUSION_MODEL wrapper publishes nothing (the shim adds no options) and leaves the
    options alone; in a run each evaluation starts its block occurrence count afresh, also on a reused options dict.
    Mutations: options published outside a run; the previous evaluation's counts kept."""
    seen = []
    module = types.SimpleNamespace(xfuser_optimized_attention=lambda *a, **kw: seen.append(kw.get("transformer_options")))
    ray_mc.forward_options_shim(module)

    def executor(*args, **kwargs):
        seen.append(dict(args[5].get(ray_mc.OCCURRENCE_KEY, {"absent": True})))
        module.xfuser_optimized_attention(1, 2, 3, heads=2)
        return "out"

    plain = {"block_index": 3}
    assert ray_mc.diffusion_model_wrapper(executor, 0, 0, 0, None, None, plain) == "out"
    assert seen == [{"absent": True}, None] and plain == {"block_index": 3}
    seen.clear()
    run_options = {override.RUN_KEY: object(), ray_mc.OCCURRENCE_KEY: {1: 2}}  # the previous evaluation's counts
    ray_mc.diffusion_model_wrapper(executor, 0, 0, 0, None, None, run_options)
    assert seen == [{}, run_options]


def test_one_rank_logs_its_summary_as_is_and_a_ranks_warning_is_a_warning():
    """A process group of one rank logs the summary unchanged (no store round trip, no header); on two ranks a
    WARNING in another rank's summary makes the combined text a WARNING; lines rank 0 already has are not repeated.
    Mutations: world size 1 sent through the store; the other ranks' warnings logged at INFO; repeated lines."""
    records = []

    class Log:
        def log(self, level, fmt, text):
            records.append((level, text))

    assert ray_mc.report_across_ranks("MC-Sparse: 1 sparse", group=(0, 1, FakeStore()), log=Log()) == \
        "MC-Sparse: 1 sparse"
    assert records == [(logging.INFO, "MC-Sparse: 1 sparse")]
    records.clear()
    store = FakeStore()
    ray_mc.report_across_ranks("MC-Sparse: 2 sparse\n  schedule: s\n  WARNING: rank 1 went dense", group=(1, 2, store),
                               run_id=3, log=Log())
    text = ray_mc.report_across_ranks("MC-Sparse: 3 sparse\n  schedule: s", group=(0, 2, store), run_id=3, log=Log())
    assert records == [(logging.WARNING, text)] and text.count("schedule: s") == 1 and "rank 1 went dense" in text


def test_the_actor_loads_the_pack_by_path_or_says_where_it_is_missing():
    """What the Ray node runs in each actor (``raylight_actor.patch_on_actor``, pickled by value): with the pack's
    folder missing on that host, an ImportError naming the path (nothing left in sys.modules); with it present, the
    pack is loaded from the folder under the given name (as ComfyUI loads custom nodes) and the patch runs there,
    here (no ComfyUI in this process) stopping where the patch first imports ComfyUI."""
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter import raylight_actor

    with pytest.raises(ImportError, match="not at /nonexistent/pack on this Ray worker's host"):
        raylight_actor.patch_on_actor(None, "/nonexistent/pack", "mc_sparse_actor_missing", {})
    assert "mc_sparse_actor_missing" not in sys.modules
    name = "mc_sparse_actor_pack"
    root = Path(__file__).resolve().parent.parent
    try:
        with pytest.raises(ImportError, match="comfy"):
            raylight_actor.patch_on_actor(None, str(root), name, dict(_settings_kwargs()))
        assert sys.modules[name].__file__ == str(root / "__init__.py")
        assert f"{name}.comfyui_mc_sparse.adapter.raylight" in sys.modules
    finally:
        for mod in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[mod]


def _settings_kwargs():
    return dict(preset="custom", density=0.25, dense_warmup="1", warmup_layers=1, anchor_steps="1", query_tile=64,
                cache_placement="cpu", backend="torch", min_tokens=0, verbose=False)


def _ray_outer_sample(monkeypatch, degree, min_tokens=0, cfg_degree=1):
    """raylight's OUTER_SAMPLE wrapper on rank 1 of a Ulysses group of ``degree`` (in CFG group 0 of ``cfg_degree``):
    a Wan model of 12 heads x 128,
    3 blocks, a 21 x 60 x 104 latent (S = 32760), CFG, 10 steps. Returns (the kwargs of the runner's plan call or
    None, the rank's summary)."""
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.engine import MCSparseRunner

    from ._comfy_standins import ModelPatcher, install_comfy_modules, wan_model

    install_comfy_modules(monkeypatch)
    monkeypatch.setattr(ray_mc, "xfuser_head_slice", lambda: ray_mc.HeadSlice(1, degree, 1, 0, cfg_degree))
    planned, summaries = [], []
    monkeypatch.setattr(ray_mc, "report_across_ranks", lambda text, **kw: summaries.append(text))
    real_plan = MCSparseRunner.plan

    def plan(self, **kw):
        line = real_plan(self, **kw)
        planned.append(dict(kw, speed=self.speed))
        return line

    monkeypatch.setattr(MCSparseRunner, "plan", plan)
    holder = lifecycle.MCSparsePatch(_settings(min_tokens=min_tokens, cache_placement="auto"), "wan")
    guider = types.SimpleNamespace(model_patcher=ModelPatcher(wan_model()), conds={"positive": [], "negative": []}, cfg=5.0,
                                   model_options={"transformer_options": {lifecycle.HOLDER_KEY: holder}})

    def executor(noise, latent, sampler, sigmas):
        return "done"

    executor.class_obj = guider
    out = ray_mc.outer_sample_wrapper(executor, torch.zeros(1, 16, 21, 60, 104), None, None, torch.linspace(1, 0, 11))
    assert out == "done" and len(summaries) == 1 and not holder.active_runs
    return (planned[0] if planned else None), summaries[0]


@pytest.mark.parametrize("degree", [1, 2, 4])
def test_raylight_sampler_calls_plan_their_share_of_the_heads(monkeypatch, degree):
    """Each rank plans its cache (placement, residual precision) for its Ulysses share of the heads, with the
    whole model's heads for the speed estimate (mutation: raylight's OUTER_SAMPLE without the plan call, as before
    session 11, or planning all 12 heads on each rank)."""
    kwargs, text = _ray_outer_sample(monkeypatch, degree)
    assert kwargs is not None, "no cache plan on this rank"
    assert kwargs["heads"] == 12 // degree and kwargs["head_dim"] == 128 and kwargs["tokens"] == 21 * 30 * 52
    assert kwargs["branches"] == 2 and kwargs["layers"] == 3
    assert "dense" not in text.splitlines()[0], text
    one_gpu, _ = _ray_outer_sample(monkeypatch, 1)
    assert kwargs["speed"] == one_gpu["speed"] and kwargs["speed"].calibrated  # the 1.3B calibration, all heads


def test_raylight_cfg_parallel_ranks_plan_their_branch(monkeypatch):
    """A CFG-parallel rank (CFG degree 2, raylight's ``cfg_utils``) evaluates one of the two CFG branches: its cache
    plan counts 1 branch (before: 2, twice the cache it holds), with its Ulysses share of the heads."""
    kwargs, _ = _ray_outer_sample(monkeypatch, 2, cfg_degree=2)
    assert kwargs["branches"] == 1 and kwargs["heads"] == 6


def test_raylight_sampler_call_that_cannot_pay_off_runs_dense_and_says_why(monkeypatch):
    """The one-GPU pay-off check holds on every rank: too few latent tokens for min_tokens -> dense, with the reason
    in the summary and no cache plan."""
    kwargs, text = _ray_outer_sample(monkeypatch, 2, min_tokens=10 ** 6)
    assert kwargs is None
    assert "fewer than min tokens (1000000)" in text, text
