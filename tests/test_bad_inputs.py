"""Bad input through the public kernel ops: a clear TypeError / ValueError naming the input, raised before any
backend runs (so no backend is blamed for the caller's mistake: nothing lands in the run's failure record)."""

from __future__ import annotations

import re

import pytest
import torch
from comfyui_mc_sparse_pack import kernels
from comfyui_mc_sparse_pack.kernels import registry


def _inputs(gen, S=40, C=16):
    q, k, v = (torch.randn(1, 2, S, 32, generator=gen) for _ in range(3))
    perm = kernels.pddp_groups(q, C, backend="torch")
    _, lse = kernels.dense_attention(q, k, v, return_lse=True, backend="torch")
    return q, k, v, perm, lse


@pytest.mark.parametrize("bad, err, words", [
    (None, TypeError, "lse must be"),
    ("short", ValueError, "lse must be [B, H, S]"),
    ("int", TypeError, "lse must be"),
])
@pytest.mark.parametrize("op", ["select_kv", "group_prob_sums"])
def test_pass2_ops_check_the_lse(gen, op, bad, err, words):
    q, k, _, perm, lse = _inputs(gen)
    bad_lse = {None: None, "short": lse[:, :, 1:], "int": lse.to(torch.int32)}[bad]
    record = registry.Record()
    with registry.recording(record), pytest.raises(err, match=words.replace("[", r"\[").replace("]", r"\]")):
        if op == "select_kv":
            kernels.select_kv(q, k, bad_lse, perm, 8, group_size=16, kv_tile=8)
        else:
            kernels.group_prob_sums(q, k, bad_lse, perm, group_size=16)
    assert not record.failures  # a bad argument is not a backend failure


@pytest.mark.parametrize("group_size", [0, -16, 16.0])
def test_select_kv_rejects_a_bad_group_size(gen, group_size):
    q, k, _, perm, lse = _inputs(gen)
    with pytest.raises(ValueError, match="group_size must be"):
        kernels.select_kv(q, k, lse, perm, 8, group_size=group_size, kv_tile=8)


def test_sparse_attention_rejects_missing_perm_empty_selection_and_bad_scale(gen):
    q, k, v, perm, lse = _inputs(gen)
    kv_idx = kernels.select_kv(q, k, lse, perm, 8, group_size=16, kv_tile=8, backend="torch")
    with pytest.raises(TypeError, match="perm must be"):
        kernels.sparse_attention(q, k, v, None, kv_idx)
    with pytest.raises(ValueError, match="kv_idx must be"):
        kernels.sparse_attention(q, k, v, perm, kv_idx[:, :, :0])
    for scale in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="scale must be a finite number"):
            kernels.sparse_attention(q, k, v, perm, kv_idx, scale=scale)
        with pytest.raises(ValueError, match="scale must be a finite number"):
            kernels.dense_attention(q, k, v, scale=scale)
    out = kernels.sparse_attention(q, k, v, perm, kv_idx, scale=0.5, backend="torch")  # a finite scale still runs
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("shape", [(0, 2, 40, 32), (1, 0, 40, 32), (1, 2, 40, 0)])
def test_empty_batch_heads_or_head_dim_are_named(shape):
    """A q with no batch element, no head or head dim 0 is a clear ValueError naming q (before: a reshape error deep
    in the reference, or ZeroDivisionError from the default scale 1/sqrt(D))."""
    q = torch.randn(shape)
    perm = torch.zeros(shape[0], shape[1], 48, dtype=torch.int32)
    kv_idx = torch.zeros(shape[0], shape[1], 3, 8, dtype=torch.int32)
    with pytest.raises(ValueError, match="q must have B, H and D >= 1"):
        kernels.dense_attention(q, q, q)
    with pytest.raises(ValueError, match="q must have B, H and D >= 1"):
        kernels.sparse_attention(q, q, q, perm, kv_idx)


def _runner():
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.config import MCSparseConfig
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.engine import MCSparseRunner

    return MCSparseRunner(MCSparseConfig(density=0.5, group_size=64, warmup_steps=1, anchor_steps=(0,)), backend="torch")


def test_the_runner_refuses_keys_it_cannot_keep_apart(gen):
    """``MCSparseRunner.call``: exactly one of key / keys, a batch that splits into the keys' chunks, and distinct keys
    (two chunks of one key would share one cache entry: the override checks the identities first, this is the
    runner's own contract), each a ValueError before anything runs or is stored."""
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.cache import CacheKey

    q = torch.randn(2, 2, 128, 64, generator=gen)
    runner = _runner()
    for kw, words in [(dict(key=CacheKey(1), keys=[CacheKey(1)]), "exactly one of key"), ({}, "exactly one of key"),
                      (dict(keys=[CacheKey(1)] * 3), "must split into 3"),
                      (dict(keys=[CacheKey(1, branch="a")] * 2), "keys must be distinct")]:
        with pytest.raises(ValueError, match=words):
            runner.call(q, q, q, step=0, layer=1, **kw)
    assert len(runner.cache) == 0


@pytest.mark.parametrize("where, error", [("kernel", ValueError("simulated bug: bad stride")),
                                          ("loader", KeyError("simulated bug: lost entry"))])
def test_a_bug_in_the_reuse_path_turns_the_run_dense_and_is_reported(gen, monkeypatch, where, error):
    """The node never loses a run: an unexpected error in the sparse path (here the reuse kernel raising what the
    registry does not fall back on) gives the exact dense output for that call and every later one, frees the cache
    and puts the error in the summary. With MC_SPARSE_RAISE_ERRORS=1 (the test suite's setting) it propagates."""
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.cache import CacheKey
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.schedule import StepKind
    from comfyui_mc_sparse_pack.kernels import reference

    q, k, v = (torch.randn(2, 2, 128, 64, generator=gen) for _ in range(3))
    keys = [CacheKey(1, branch="uncond"), CacheKey(1, branch="cond")]

    def broken(*args, **kwargs):
        raise error

    if where == "kernel":
        registry.register(registry.Backend(name="bug_test", priority=99, ops={"sparse_attention": broken}))
    else:
        from comfyui_mc_sparse_pack.comfyui_mc_sparse.prefetch import ReuseLoader

        monkeypatch.setattr(ReuseLoader, "load", broken)
    try:
        monkeypatch.setenv("MC_SPARSE_RAISE_ERRORS", "1")
        strict = _runner()
        strict.call(q, k, v, step=0, layer=1, keys=keys)  # anchor (its sparse pass runs on the named torch backend)
        strict.backend = "auto"
        with pytest.raises(type(error), match="simulated bug"):
            strict.call(q, k, v, step=1, layer=1, keys=keys)

        monkeypatch.setenv("MC_SPARSE_RAISE_ERRORS", "0")
        runner = _runner()
        runner.call(q, k, v, step=0, layer=1, keys=keys)
        assert len(runner.cache) == 2
        runner.backend = "auto"
        out = torch.full_like(q, float("nan"))
        result, kind = runner.call(q, k, v, step=1, layer=1, keys=keys, out=out)
        assert kind is StepKind.DENSE and result is out
        torch.testing.assert_close(out, reference.dense_attention(q, k, v))
        assert len(runner.cache) == 0 and runner.disabled_reason.startswith("internal error")
        text = runner.summary()
        assert "internal error at step 2 (1-based), block 1" in text and "simulated bug" in text
        _, kind = runner.call(q, k, v, step=2, layer=1, keys=keys)
        assert kind is StepKind.DENSE and runner.stats.dense_reasons[runner.disabled_reason] == 2
    finally:
        registry._backends.pop("bug_test", None)


_SIGMAS = torch.tensor([1.0, 0.8, 0.6, 0.0])  # anchor at step 0, reuse at steps 1 and 2


def _adapter_run(min_tokens=0):
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter import lifecycle, settings

    s = settings.build_settings(preset="custom", density=0.5, dense_warmup="1", warmup_layers=0, anchor_steps="1",
                                query_tile=64, cache_placement="auto", backend="torch", min_tokens=min_tokens,
                                verbose=False)
    return lifecycle.RunState(s, _SIGMAS)


@pytest.mark.parametrize(("min_tokens", "sparse"), [(160, True), (161, False)])
def test_min_tokens_keeps_a_call_of_exactly_that_many_tokens(gen, min_tokens, sparse):
    """'calls with fewer latent tokens stay dense' (README, the node's min_tokens): a 160-token call runs MC-Sparse at
    min tokens 160 and stays dense at 161, in the per-call check (override) and in the sampler call's pay-off check
    (mutation: ``<=`` for ``<`` in payoff.dense_reason passed every test)."""
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter import override, payoff
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter.callsite import CallSite

    from ._comfy_standins import raw_attention, transformer_options

    x = torch.randn(2, 160, 128, generator=gen)  # [B, S, H*D], 2 heads x 64
    run = _adapter_run(min_tokens)
    options = transformer_options(run, CallSite(0, "wan"), chunks=2, sigma=1.0)
    override.make_override(None)(raw_attention, x, x, x, 2, transformer_options=options)
    assert (run.counts()["anchor"] > 0) is sparse, run.summary()
    assert ("fewer latent tokens (160) than min tokens (161)" in run.summary()) is not sparse
    why = payoff.dense_reason(run.config, num_steps=50, layers=30, requested_backend="torch", min_tokens=min_tokens,
                              tokens=160)
    assert (why is None) is sparse, why


def test_min_tokens_counts_latent_tokens_without_the_prefix(gen):
    """The per-call min_tokens check counts latent tokens: a call site's prefix tokens (Hunyuan3D 2.1's time token,
    ``CallSite.prefix``) do not count, so a 161-token call with a 1-token prefix runs MC-Sparse at min tokens 160 and
    stays dense at 161 (mutation: the prefix left in the count)."""
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter import override
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter.callsite import CallSite

    from ._comfy_standins import raw_attention, transformer_options

    x = torch.randn(2, 161, 128, generator=gen)
    for min_tokens, sparse in ((160, True), (161, False)):
        run = _adapter_run(min_tokens)
        options = transformer_options(run, CallSite(0, "wan", prefix=1), chunks=2, sigma=1.0)
        override.make_override(None)(raw_attention, x, x, x, 2, transformer_options=options)
        assert (run.counts()["anchor"] > 0) is sparse, run.summary()
        assert ("fewer latent tokens (160) than min tokens (161)" in run.summary()) is not sparse


def test_the_mask_memo_is_per_mask_and_layout():
    """``override._keep_mask`` keeps its answer for one mask tensor (one host sync per model evaluation), keyed by the
    sequence and its latent slice too: the same mask with another layout is analysed again (mutation: the memo keyed
    by the tensor alone handed the second layout the first one's kept keys)."""
    import types

    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter import override

    run = types.SimpleNamespace(mask_memo=None)
    mask = torch.zeros(1, 1, 20)
    mask[..., :3] = torch.finfo(torch.float32).min  # keys 0-2 masked: text in [text, latent], latent in the other
    keep, why = override._keep_mask(run, mask, 20, slice(5, 20))
    assert why is None and keep.tolist() == list(range(3, 20))
    assert override._keep_mask(run, mask, 20, slice(5, 20))[0] is keep  # the memo
    keep2, why2 = override._keep_mask(run, mask, 20, slice(0, 15))
    assert keep2 is None and why2 == "mask masks latent tokens"


def test_a_backend_ignoring_skip_output_reshape_still_serves_the_runners_dense_path(gen):
    """The runner's dense fallback goes through the caller's own attention asked for [B, H, S, D]
    (``override._dense_fn``); a backend or earlier override that returns [B, S, H*D] anyway is reshaped, so a call
    the runner sends dense (here a NaN in q at the anchor step) still returns the caller's layout and values
    (mutation: the reshape dropped: a shape error)."""
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter import override
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter.callsite import CallSite

    from ._comfy_standins import raw_attention, transformer_options

    def flat_only(q, k, v, heads, mask=None, skip_reshape=False, skip_output_reshape=False, **kwargs):
        return raw_attention(q, k, v, heads, mask=mask, skip_reshape=skip_reshape)  # always [B, S, H*D]

    x = torch.randn(2, 160, 128, generator=gen)
    x[1, 7, 3] = float("nan")
    run = _adapter_run()
    out = override.make_override(None)(flat_only, x, x, x, 2,
                                       transformer_options=transformer_options(run, CallSite(0, "wan"), sigma=1.0))
    ref = raw_attention(x, x, x, 2)
    assert out.shape == ref.shape and torch.equal(out.isnan(), ref.isnan())
    torch.testing.assert_close(out.nan_to_num(), ref.nan_to_num(), rtol=1e-5, atol=1e-5)
    assert "non-finite input" in run.summary(), run.summary()


def _case(name, gen):
    """(q, k, v, heads, mask, site, options edits, the summary's dense reason) of one call the adapter must run dense."""
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter.callsite import TEXT_LEN_KEY, CallSite

    x = torch.randn(3 if name == "batch" else 2, 160, 128, generator=gen)  # [B, S, H*D], 2 heads x 64
    wan, joint = CallSite(0, "wan"), CallSite(0, "hunyuan_video", joint="video_first")
    neg = torch.finfo(torch.float32).min
    half = torch.zeros(1, 1, 160)
    half[..., 150:] = 0.5
    latent_masked = torch.zeros(1, 1, 160)
    latent_masked[..., 3] = neg
    return {
        "batch": (x, x, x, 2, None, wan, {}, "batch 3 does not split into 2 conditioning chunks"),
        "same uuid": (x, x, x, 2, None, wan, {"uuids": ["u0", "u0"]}, "share one identity"),
        "same chunk, no uuids": (x, x, x, 2, None, joint, {"uuids": None, "cond_or_uncond": [0, 0], TEXT_LEN_KEY: 10},
                                 "share one identity"),
        "shapes": (x, x[:, :100], x[:, :100], 2, None, wan, {}, "q/k/v shapes differ"),
        "no text length": (x, x, x, 2, None, joint, {}, "joint sequence without a known text length"),
        "text too long": (x, x, x, 2, None, joint, {TEXT_LEN_KEY: 160}, "joint text length 160 does not fit"),
        "no sigma": (x, x, x, 2, None, wan, {"sigmas": None}, "no current sigma in transformer_options"),
        "mask values": (x, x, x, 2, half, joint, {TEXT_LEN_KEY: 10}, "mask holds values other than 0 and masked-out"),
        "latent masked": (x, x, x, 2, latent_masked, joint, {TEXT_LEN_KEY: 10}, "mask masks latent tokens"),
        "mask per query": (x, x, x, 2, torch.zeros(1, 160, 160), joint, {TEXT_LEN_KEY: 10},
                           "is not one per-key mask for the batch"),
    }[name]


@pytest.mark.parametrize("name", ["batch", "same uuid", "same chunk, no uuids", "shapes", "no text length",
                                  "text too long", "no sigma", "mask values", "latent masked", "mask per query"])
def test_calls_the_adapter_cannot_take_run_dense_exactly_and_say_why(gen, name):
    """Each call the override cannot run sparse (a batch that does not split into its conditioning chunks or whose
    chunks carry one identity, so that one would reuse the other's cache entry, a marked call whose q/k/v differ, a
    joint call without a usable text length or with a mask that is not a per-key 0 / masked-out mask over text keys
    only, no sigma to place the step) is the caller's own attention, bit for bit, with the reason counted in the run
    summary. (Before: two chunks of one identity shared a cache key; at the next reuse step the first chunk got the
    second's selection and residual, 0.5 max abs error against dense, silently.)"""
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter import override

    from ._comfy_standins import raw_attention, transformer_options

    q, k, v, heads, mask, site, edits, reason = _case(name, gen)
    run = _adapter_run()
    options = {**transformer_options(run, site, chunks=2, sigma=1.0), **edits}
    out = override.make_override(None)(raw_attention, q, k, v, heads, mask=mask, transformer_options=options)
    assert torch.equal(out, raw_attention(q, k, v, heads, mask=mask))
    assert run.counts()["anchor"] == 0 and reason in run.summary(), run.summary()


def test_a_marked_call_with_containers_instead_of_tensors_is_the_callers_own(gen):
    """q / k / v that arrive as something else than tensors (v0.33.0's AttentionTensorContainer when no container
    entry is taken) go to the caller's attention untouched, counted with the reason, not as an internal error that
    would turn the rest of the run dense (mutation: the dispatch without this check passed every CPU test)."""
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter import override
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter.callsite import CallSite

    from ._comfy_standins import transformer_options

    class Container:  # a stand-in: holds a tensor, is none
        def __init__(self, t):
            self.tensor = t

    x = torch.randn(2, 160, 128, generator=gen)
    sentinel = torch.randn(2, 160, 128, generator=gen)
    seen = []

    def func(q, k, v, heads, **kwargs):
        seen.append((q, k, v))
        return sentinel

    run = _adapter_run()
    boxes = tuple(Container(x) for _ in range(3))
    out = override.make_override(None)(func, *boxes, 2, transformer_options=transformer_options(run, CallSite(0, "wan")))
    assert out is sentinel and seen == [boxes]
    text = run.summary()
    assert "q/k/v arrive as Container, not tensors" in text and "internal error" not in text, text


def test_a_bug_in_the_override_turns_the_run_dense_and_the_callers_errors_propagate(gen, monkeypatch):
    """An unexpected error in the override's own code (here the joint-sequence split) gives the caller's attention
    for that call and every later sparse candidate, with the error in the summary; an error of the caller's own
    attention (ComfyUI's) propagates at once, never retried or blamed on the pack."""
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter import override
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter.callsite import TEXT_LEN_KEY, CallSite

    from ._comfy_standins import raw_attention, transformer_options

    monkeypatch.setenv("MC_SPARSE_RAISE_ERRORS", "0")

    def broken(*args, **kwargs):
        raise IndexError("simulated bug in the joint split")

    monkeypatch.setattr(override, "_joint_chunk", broken)
    run = _adapter_run()
    over = override.make_override(None)
    x = torch.randn(2, 160, 128, generator=gen)
    site = CallSite(0, "hunyuan_video", joint="video_first")
    for sigma in (1.0, 0.8):  # the anchor step, then a reuse step
        options = {**transformer_options(run, site, chunks=2, sigma=sigma), TEXT_LEN_KEY: 10}
        assert torch.equal(over(raw_attention, x, x, x, 2, transformer_options=options), raw_attention(x, x, x, 2))
    text = run.summary()
    assert "internal error at block 0 (IndexError: simulated bug in the joint split)" in text, text
    assert run.counts() == {"sparse": 0, "anchor": 0, "dense": 2}

    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("the caller's attention failed")

    with pytest.raises(RuntimeError, match="the caller's attention failed"):
        over(failing, x, x, x, 2, mask=torch.zeros(1, 1, 160),
             transformer_options=transformer_options(_adapter_run(), CallSite(0, "wan"), chunks=2, sigma=1.0))
    assert len(calls) == 1


def test_percent_steps_are_exact_where_floats_round_up():
    """'28%' of 50 steps is step 14 and a 14-step warm-up, '7%' of 100 is 7 (in floats 0.28 * 50 and 0.07 * 100 exceed
    the integer and ceil took one step more); every integer percent of 1-200 steps equals the exact ceil(p * n / 100)."""
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter.settings import StepSpec

    assert StepSpec(28.0, True).to_index(50) == 13 and StepSpec(28.0, True).to_count(50) == 14
    assert StepSpec(7.0, True).to_count(100) == 7 and StepSpec(55.0, True).to_index(100) == 54
    assert StepSpec(12.5, True).to_count(8) == 1 and StepSpec(12.5, True).to_count(9) == 2
    for p in range(1, 101):
        for n in range(1, 201):
            exact = -(-p * n // 100)
            assert StepSpec(float(p), True).to_count(n) == min(n, exact), (p, n)
            assert StepSpec(float(p), True).to_index(n) == max(0, exact - 1), (p, n)


def test_integer_arguments_of_the_anchor_ops_are_checked(gen):
    """num_keys, kv_tile, group_size and power_iters that are not ints >= 1 (a float, a bool, None, 0; num_keys also
    past Sk) raise a ValueError naming the argument (before: TypeErrors from torch.full / topk, an IndexError, or True taken as 1)."""
    q, k, _, perm, lse = _inputs(gen)
    for num_keys in (8.5, True, 0, 41):
        with pytest.raises(ValueError, match=r"num_keys must be in \[1, 40\] \(an int"):
            kernels.select_kv(q, k, lse, perm, num_keys, group_size=16, kv_tile=8)
    for kv_tile in (8.0, None, 0):
        with pytest.raises(ValueError, match=r"kv_tile must be >= 1 \(an int\)"):
            kernels.select_kv(q, k, lse, perm, 8, group_size=16, kv_tile=kv_tile)
    for group_size in (16.0, True, 0):
        with pytest.raises(ValueError, match=r"group_size must be >= 1 \(an int\)"):
            kernels.pddp_groups(q, group_size)
    for iters in (0, -1, 2.0):
        with pytest.raises(ValueError, match=r"power_iters must be >= 1 \(an int\)"):
            kernels.pddp_groups(q, 16, power_iters=iters)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the Triton interpreter on NaN rows
@pytest.mark.parametrize("backend", [b.name for b in registry.backends()
                                     if "pddp_groups" in b.ops and not b.unavailable_reason])
def test_pddp_groups_keep_every_query_for_non_finite_q(gen, backend):
    """The grouping's contract (each query once, -1 only in the tail) holds for a q with a NaN row and an inf entry
    (mutation: the torch-ops GPU grouping sorted NaN projections after the padding, so -1 slots moved into the first
    group and tail queries fell out of the permutation)."""
    S, C = 40, 16
    q = torch.randn(1, 2, S, 32, generator=gen).to(torch.float16)
    q[0, 0, 5] = float("nan")
    q[0, 1, 7, 3] = float("inf")
    if backend != "torch" and torch.cuda.is_available():
        q = q.cuda()
    perm = kernels.pddp_groups(q, C, backend=backend).cpu()
    for h in range(2):
        assert sorted(perm[0, h, :S].tolist()) == list(range(S)), (h, perm[0, h].tolist())
        assert (perm[0, h, S:] == -1).all()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the Triton interpreter on NaN rows
@pytest.mark.parametrize("backend", (["auto"] if torch.cuda.is_available() else []) + [
    b.name for b in registry.backends() if "select_kv" in b.ops and not b.unavailable_reason])
def test_select_kv_rows_stay_valid_selections_for_non_finite_inputs(gen, backend):
    """A model whose q or k overflows at an anchor step (a NaN q row, a NaN k row, an inf q entry, each in its own
    head; the LSE of the dense pass then NaN / inf there) still gets, from every select_kv backend, rows that keep the
    selection's contract: K distinct ascending indices in [0, S), then -1. The reuse steps' sparse kernels gather K/V
    rows by these indices, so an index outside [0, S) would be an out-of-bounds read on the GPU (a crash mid-sampling)
    rather than a NaN output. The clean head's rows equal the torch reference's where the backend is exact (CPU).
    On a CUDA machine also the default path ("auto": float8 pass 2, the CuTeDSL kernel when installed, the fused
    top-K) at a shape it runs (D = C = 128)."""
    cuda = torch.cuda.is_available() and backend != "torch"
    B, H, S, D, C, K = (1, 4, 1000, 128, 128, 300) if cuda else (1, 4, 200, 64, 64, 70)
    dev = "cuda" if cuda else "cpu"
    q, k, v = (torch.randn(B, H, S, D, generator=gen).to(torch.bfloat16).to(dev) for _ in range(3))
    q[0, 1, 17] = float("nan")
    k[0, 2, S - 1] = float("nan")
    q[0, 3, 5, 3] = float("inf")
    perm = kernels.pddp_groups(q, C)
    _, lse = kernels.dense_attention(q, k, v, return_lse=True)
    idx = kernels.select_kv(q, k, lse, perm, K, group_size=C, kv_tile=16, backend=backend).cpu()
    head, tail = idx[..., :K], idx[..., K:]
    for h in range(H):
        assert bool((head[0, h] >= 0).all() and (head[0, h] < S).all()), (h, head[0, h].min(), head[0, h].max())
        assert bool((head[0, h, :, 1:] > head[0, h, :, :-1]).all()) and bool((tail[0, h] == -1).all()), h
    if not cuda:
        want = kernels.select_kv(q, k, lse, perm, K, group_size=C, kv_tile=16, backend="torch")
        assert torch.equal(idx[0, 0], want[0, 0])


def test_a_bug_while_planning_a_sampler_call_turns_it_dense(monkeypatch):
    """An unexpected error before the first step (in the pay-off check / cache plan the sampler wrapper runs) gives a
    finished dense run whose summary names the error, instead of a lost one (mutation: the wrapper calling
    ``_plan_before_sampling`` unguarded); with MC_SPARSE_RAISE_ERRORS=1 it propagates."""
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter import payoff

    from .test_adapter_inputs import _outer_sample

    def broken(*args, **kwargs):
        raise AttributeError("simulated bug: no attribute 'num_heads'")

    monkeypatch.setattr(payoff, "dense_reason", broken)
    monkeypatch.setenv("MC_SPARSE_RAISE_ERRORS", "0")
    result, text, _ = _outer_sample(monkeypatch, 4, None)
    assert result == "done", result
    assert "internal error while planning this sampler call (AttributeError: simulated bug" in text, text
    assert "0 sparse" in text and "interrupted" not in text, text
    monkeypatch.setenv("MC_SPARSE_RAISE_ERRORS", "1")
    err, _, _ = _outer_sample(monkeypatch, 4, None)
    assert isinstance(err, AttributeError)


def test_a_bug_in_the_prefetch_at_an_evaluations_start_turns_the_run_dense(gen, monkeypatch):
    """The prefetch a model evaluation starts with (``begin_evaluation``, outside any attention call): an unexpected
    error there frees the cache and turns the rest of the run dense with a note, instead of escaping ComfyUI's
    CALC_COND_BATCH wrapper (mutation: begin_evaluation calling the prefetch unguarded). With MC_SPARSE_RAISE_ERRORS=1
    it propagates (mutation: the guard without its re-raise passed every test)."""
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.cache import CacheKey
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.prefetch import ReuseLoader
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.schedule import StepKind

    q, k, v = (torch.randn(2, 2, 128, 64, generator=gen) for _ in range(3))
    keys = [CacheKey(1, branch="uncond"), CacheKey(1, branch="cond")]

    def broken(*args, **kwargs):
        raise KeyError("simulated bug: lost entry")

    for strict in ("1", "0"):
        monkeypatch.setenv("MC_SPARSE_RAISE_ERRORS", strict)
        runner = _runner()
        runner.call(q, k, v, step=0, layer=1, keys=keys)
        assert runner.call(q, k, v, step=1, layer=1, keys=keys)[1] is StepKind.REUSE
        with monkeypatch.context() as m:
            m.setattr(ReuseLoader, "prefetch", broken)
            if strict == "1":
                with pytest.raises(KeyError, match="simulated bug"):
                    runner.begin_evaluation(2)
                assert runner.disabled_reason is None
            else:
                runner.begin_evaluation(2)
    assert runner.disabled_reason.startswith("internal error") and len(runner.cache) == 0
    assert "internal error at the prefetch starting step 3 (1-based) (KeyError" in runner.summary()
    assert runner.call(q, k, v, step=2, layer=1, keys=keys)[1] is StepKind.DENSE


def test_an_unreadable_h3_layout_runs_dense_and_says_why(gen, monkeypatch):
    """MiniMax-H3: when the forward's packed layout cannot be read (here: no ComfyUI v0.33.0 to build it), its joint
    calls are the caller's attention and the summary gives the layout's reason, not only 'without a known text
    length' (before: the reason was recorded in transformer_options and never read)."""
    import sys
    import types

    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter import minimax, override
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter.callsite import CallSite

    from ._comfy_standins import raw_attention, transformer_options

    monkeypatch.setitem(sys.modules, "comfy", types.ModuleType("comfy"))  # a ComfyUI without comfy.ldm
    run = _adapter_run()
    x = torch.randn(1, 160, 128, generator=gen)
    opts = transformer_options(run, CallSite(0, "minimax_h3", joint="text_first"), chunks=1, sigma=1.0)

    def forward(x_, timestep, context, transformer_options):
        return override.make_override(None)(raw_attention, x, x, x, 2, transformer_options=transformer_options)

    forward.class_obj = types.SimpleNamespace(patch_size=(1, 2, 2))
    out = minimax.layout_wrapper(forward, [x, x], None, x, opts)
    assert torch.equal(out, raw_attention(x, x, x, 2))
    assert "dense x1: no packed layout (ModuleNotFoundError" in run.summary(), run.summary()


def test_the_node_rejects_edge_values_naming_the_input():
    """Values just outside each box's range stop the node with a message naming the input; ';' separates steps like
    ',' (mutations that left the suite green: an anchor at 0 %, a warm-up of -1 steps, a headroom above the maximum
    and min tokens = True accepted; ';' not splitting; a warm-up of 100.5 %), NaN percents included."""
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter import settings

    def build(**over):
        base = dict(preset="custom", density=0.5, dense_warmup="1", warmup_layers=0, anchor_steps="1", query_tile=64,
                    cache_placement="auto", backend="auto", min_tokens=0, verbose=False)
        return settings.build_settings(**{**base, **over})

    for over, words in ((dict(anchor_steps="0%"), "anchor steps percents must be in"),
                        (dict(dense_warmup="-1"), "dense warm-up must be >= 0 steps"),
                        (dict(memory_headroom_gib=settings.MAX_HEADROOM_GIB + 0.5), "memory headroom must be"),
                        (dict(min_tokens=True), "min tokens must be a whole number"),
                        (dict(dense_warmup="100.5%"), "dense warm-up percent must be in"),
                        (dict(dense_warmup="nan%"), "dense warm-up percent must be in"),
                        (dict(anchor_steps="nan%"), "anchor steps percents must be in"),
                        (dict(anchor_steps="100.5%"), "anchor steps percents must be in")):
        with pytest.raises(ValueError, match=words):
            build(**over)
    assert build(dense_warmup="10", anchor_steps="10; 26").anchors == build(dense_warmup="10", anchor_steps="10, 26").anchors
    assert len(build(dense_warmup="10", anchor_steps="10; 26").anchors) == 2


@pytest.mark.parametrize("joint", ["video_first", "text_first"])
def test_a_joint_call_whose_mask_masks_every_text_key_stays_sparse(gen, joint):
    """A joint [video, text] call whose mask masks every text token (an empty prompt padded out) has no text key to
    attend exactly: anchor and reuse steps run MC-Sparse over the video keys alone, exact at the anchor under the
    mask (before: the empty text keys reached dense attention as Sk = 0, a ValueError that made the rest of the run
    dense as an internal error)."""
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter import override
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter.callsite import TEXT_LEN_KEY, CallSite

    from ._comfy_standins import raw_attention, transformer_options

    run = _adapter_run()
    sv, st, h = 192, 16, 2
    text = slice(sv, sv + st) if joint == "video_first" else slice(0, st)
    mask = torch.zeros(1, 1, sv + st)
    mask[..., text] = -torch.finfo(torch.float32).max
    over = override.make_override(None)
    for sigma in (1.0, 0.8):
        q, k, v = (torch.randn(1, h, sv + st, 64, generator=gen) for _ in range(3))
        opts = {**transformer_options(run, CallSite(1, "hunyuan_video", joint), chunks=1, sigma=sigma),
                TEXT_LEN_KEY: st}
        out = over(raw_attention, q, k, v, h, mask=mask, skip_reshape=True, skip_output_reshape=True,
                   transformer_options=opts)
        assert torch.isfinite(out).all()
        if sigma == 1.0:
            ref = raw_attention(q, k, v, h, mask=mask.unsqueeze(1), skip_reshape=True, skip_output_reshape=True)
            torch.testing.assert_close(out, ref.to(out.dtype), rtol=1e-4, atol=1e-4)
    assert run.counts() == {"sparse": 1, "anchor": 1, "dense": 0}, run.summary()
    assert "internal error" not in run.summary()


@pytest.mark.parametrize("case", ["out_shares_k", "out_shares_v", "out_device", "perm_width", "perm_device",
                                  "decode_width", "decode_rows", "k_device", "k_head_dim", "perm_device_pass2",
                                  "lse_device", "kv_idx_empty", "decode_bytes", "decode_out_device",
                                  "out_shares_one_element", "q_not_a_tensor", "perm_int64", "perm_short",
                                  "decode_bits_int32", "decode_no_width", "decode_out_int64", "decode_no_tokens"])
def test_public_op_checks_no_other_test_reached(gen, case):
    """Each check of the public ops that a mutation could drop with the suite green: ``out`` sharing memory with k or
    v (the kernel reads them while writing out), ``out`` or perm on another device, a perm width that is not G*C for
    kv_idx's G, and decode_bitmask's ``out`` of another width than ``width`` or whose rows do not flatten; q that is
    no tensor, a perm of another dtype or width in pass 2, decode_bitmask's bits not uint8, neither out nor width, an
    out not int32 (session 10: each of these six checks dropped left test_bad_inputs, test_reuse_op,
    test_reference_ops and test_mc_sparse green; session 12: num_tokens 0, which 0-byte rows matched). Each is a clear
    TypeError / ValueError before any backend runs (no backend failure recorded)."""
    q, k, v, perm, lse = _inputs(gen)
    kv_idx = kernels.select_kv(q, k, lse, perm, 8, group_size=16, kv_tile=8, backend="torch")
    bits = torch.zeros(6, 5, dtype=torch.uint8)
    shared = torch.randn(2 * q.numel() - 1, generator=gen)  # out's last element is k's first
    call, err, words = {
        "out_shares_k": (lambda: kernels.sparse_attention(q, k, v, perm, kv_idx, out=k), ValueError,
                         "must not share memory with k"),
        "out_shares_v": (lambda: kernels.sparse_attention(q, k, v, perm, kv_idx, out=v[:, :, :]), ValueError,
                         "must not share memory with v"),
        "out_device": (lambda: kernels.sparse_attention(q, k, v, perm, kv_idx, out=torch.empty(q.shape, device="meta")),
                       TypeError, "out must have q's dtype and device"),
        "perm_width": (lambda: kernels.sparse_attention(q, k, v, perm, torch.cat((kv_idx, kv_idx[:, :, :2]), 2)),
                       ValueError, "perm width 48 must be G*C for kv_idx's G = 5"),
        "perm_device": (lambda: kernels.sparse_attention(q, k, v, perm.to("meta"), kv_idx), ValueError,
                        "perm and kv_idx must be on q's device"),
        "decode_width": (lambda: kernels.decode_bitmask(bits, num_tokens=40, out=torch.empty(6, 8, dtype=torch.int32),
                                                        width=16), ValueError, "differs from width=16"),
        "decode_rows": (lambda: kernels.decode_bitmask(bits.view(2, 3, 5), num_tokens=40,
                                                       out=torch.empty(3, 2, 8, dtype=torch.int32).transpose(0, 1)),
                        ValueError, "flatten to rows"),
        "k_device": (lambda: kernels.dense_attention(q, k.to("meta"), v.to("meta")), TypeError,
                     "k must match q's dtype and device"),
        "k_head_dim": (lambda: kernels.dense_attention(q, k[..., :16], v[..., :16]), ValueError,
                       "k must be [B, H, Sk, D] with q's B, H, D"),
        "perm_device_pass2": (lambda: kernels.select_kv(q, k, lse, perm.to("meta"), 8, group_size=16, kv_tile=8),
                              ValueError, "perm must be on q's device"),
        "lse_device": (lambda: kernels.group_prob_sums(q, k, lse.to("meta"), perm, group_size=16), ValueError,
                       "lse must be [B, H, S] = (1, 2, 40) on q's device"),
        "kv_idx_empty": (lambda: kernels.sparse_attention(q, k, v, perm, kv_idx[..., :0]), ValueError,
                         "kv_idx must be int32 [B, H, G, K]"),
        "decode_bytes": (lambda: kernels.decode_bitmask(bits, num_tokens=48, width=8), ValueError,
                         "ceil(num_tokens/8) = 6 bytes per row, got 5"),
        "decode_out_device": (lambda: kernels.decode_bitmask(bits, num_tokens=40,
                                                             out=torch.empty(6, 8, dtype=torch.int32, device="meta")),
                              ValueError, "out must be on bits' device"),
        "out_shares_one_element": (lambda: kernels.sparse_attention(q, shared[q.numel() - 1:].view(q.shape), v, perm,
                                                                    kv_idx, out=shared[:q.numel()].view(q.shape)),
                                   ValueError, "must not share memory with k"),
        "q_not_a_tensor": (lambda: kernels.dense_attention(q.numpy(), k, v), TypeError, "q must be a torch.Tensor"),
        "perm_int64": (lambda: kernels.select_kv(q, k, lse, perm.long(), 8, group_size=16, kv_tile=8), ValueError,
                       "perm must be int32 [B, H, ceil(S/C)*C] = (1, 2, 48)"),
        "perm_short": (lambda: kernels.group_prob_sums(q, k, lse, perm[..., :32], group_size=16), ValueError,
                       "perm must be int32 [B, H, ceil(S/C)*C] = (1, 2, 48)"),
        "decode_bits_int32": (lambda: kernels.decode_bitmask(bits.int(), num_tokens=40, width=8), TypeError,
                              "bits must be a uint8 tensor"),
        "decode_no_width": (lambda: kernels.decode_bitmask(bits, num_tokens=40), ValueError, "give out or a width"),
        "decode_out_int64": (lambda: kernels.decode_bitmask(bits, num_tokens=40, out=torch.empty(6, 8, dtype=torch.long)),
                             ValueError, "out must be int32 [6, width]"),
        "decode_no_tokens": (lambda: kernels.decode_bitmask(bits[:, :0], num_tokens=0, width=8), ValueError,
                             "ceil(num_tokens/8) = 0 bytes per row, got 0"),
    }[case]
    record = registry.Record()
    with registry.recording(record), pytest.raises(err, match=re.escape(words)):
        call()
    assert not record.failures


def test_out_right_before_k_in_one_buffer_is_not_an_overlap(gen):
    """``out`` ending exactly where k starts in one buffer shares no byte with it: the call runs (the overlap check
    compares half-open byte ranges). Mutation: adjacent ranges counted as overlapping."""
    q, k, v, perm, lse = _inputs(gen)
    kv_idx = kernels.select_kv(q, k, lse, perm, 8, group_size=16, kv_tile=8, backend="torch")
    buf = torch.empty(2 * q.numel())
    out, k2 = buf[:q.numel()].view(q.shape), buf[q.numel():].view(q.shape)
    k2.copy_(k)
    got = kernels.sparse_attention(q, k2, v, perm, kv_idx, out=out, backend="torch")
    assert got is out
    torch.testing.assert_close(out, kernels.sparse_attention(q, k, v, perm, kv_idx, backend="torch"))


class _H3D21Attention(torch.nn.Module):
    """``comfy/ldm/hunyuan3dv2_1/hunyuandit.py`` ``Attention`` (L352-418): q/k/v projections, per-head q/k norms, the
    interleaved per-head split, attention without transformer_options, out_proj."""

    def __init__(self, gen, heads=2, head_dim=64):
        super().__init__()
        dim = heads * head_dim
        self.num_heads, self.head_dim = heads, head_dim
        self.to_q, self.to_k, self.to_v, self.out_proj = (torch.nn.Linear(dim, dim) for _ in range(4))
        for p in self.parameters():
            p.data = torch.randn(p.shape, generator=gen) * dim**-0.5
        self.q_norm = self.k_norm = torch.nn.LayerNorm(head_dim)
        self.requires_grad_(False)  # ComfyUI samples under inference mode

    def forward(self, x):
        from comfy.ldm.modules.attention import optimized_attention

        B, N, _ = x.shape
        qkv = torch.cat((self.to_q(x), self.to_k(x), self.to_v(x)), dim=-1)
        split = qkv.shape[-1] // self.num_heads // 3
        q, k, v = torch.split(qkv.view(1, -1, self.num_heads, split * 3), split, dim=-1)
        q = self.q_norm(q.reshape(B, N, self.num_heads, self.head_dim)).reshape(B, N, -1)
        k = self.k_norm(k.reshape(B, N, self.num_heads, self.head_dim)).reshape(B, N, -1)
        return self.out_proj(optimized_attention(q, k, v.reshape(B, N, -1), heads=self.num_heads))


def test_hunyuan3d21_attention_forward_contains_a_bug_and_passes_the_callers_errors(gen, monkeypatch):
    """Hunyuan3D 2.1's replaced attention forward (its attention gets no transformer_options, so the pack calls its
    dispatch itself): in a run it equals the original forward at the anchor step; a bug in the pack's dispatch
    gives the original attention for that call and every later one, with the error in the summary (before: it
    propagated and lost the run, as the override's own entry never lets one); an error of ComfyUI's attention
    propagates unchanged."""
    import sys
    import types

    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter import hunyuan3d21, override
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter.callsite import CallSite

    from ._comfy_standins import raw_attention, transformer_options

    backend = {"fn": lambda q, k, v, heads, mask=None, skip_reshape=False, skip_output_reshape=False, **kw:
               raw_attention(q, k, v, heads, mask=mask, skip_reshape=skip_reshape,
                             skip_output_reshape=skip_output_reshape).float()}
    mods = {name: types.ModuleType(name) for name in ("comfy", "comfy.ldm", "comfy.ldm.modules",
                                                      "comfy.ldm.modules.attention")}
    mods["comfy.ldm.modules.attention"].optimized_attention = lambda *a, **kw: backend["fn"](*a, **kw)
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setenv("MC_SPARSE_RAISE_ERRORS", "0")
    attn = _H3D21Attention(gen)
    site = CallSite(1, "hunyuan3d21", prefix=1)
    forward = hunyuan3d21.make_attn_forward(attn, site, attn.forward)
    x = torch.randn(1, 200, 128, generator=gen)
    run = _adapter_run()

    def call(sigma):
        token = override.CURRENT_OPTIONS.set(transformer_options(run, site, chunks=1, sigma=sigma))
        try:
            return forward(x)
        finally:
            override.CURRENT_OPTIONS.reset(token)

    torch.testing.assert_close(call(1.0), attn.forward(x), rtol=1e-4, atol=1e-4)  # the anchor: exact
    assert run.counts()["anchor"] == 1

    def broken(*args, **kwargs):
        raise IndexError("simulated bug in the layout")

    monkeypatch.setattr(override, "_to_heads_first", broken)
    for sigma in (0.8, 0.8):  # reuse step: the bug, then the run is dense
        torch.testing.assert_close(call(sigma), attn.forward(x))
    assert "internal error at block 1 (IndexError: simulated bug in the layout)" in run.summary(), run.summary()

    def comfy_fails(*args, **kwargs):
        raise RuntimeError("ComfyUI's attention failed")

    backend["fn"] = comfy_fails
    with pytest.raises(RuntimeError, match="ComfyUI's attention failed"):
        call(0.8)


class _H3D21AttentionV033(_H3D21Attention):
    """ComfyUI v0.33.0's ``Attention.forward`` (``hunyuandit.py`` L390-420): as v0.3.64's, its attention called with
    ``low_precision_attention=False`` (SageAttention and other low-precision backends run PyTorch attention here)."""

    def forward(self, x):
        from comfy.ldm.modules.attention import optimized_attention

        B, N, _ = x.shape
        qkv = torch.cat((self.to_q(x), self.to_k(x), self.to_v(x)), dim=-1)
        split = qkv.shape[-1] // self.num_heads // 3
        q, k, v = torch.split(qkv.view(B, -1, self.num_heads, split * 3), split, dim=-1)
        q = self.q_norm(q.reshape(B, N, self.num_heads, self.head_dim)).reshape(B, N, -1)
        k = self.k_norm(k.reshape(B, N, self.num_heads, self.head_dim)).reshape(B, N, -1)
        return self.out_proj(optimized_attention(q, k, v.reshape(B, N, -1), heads=self.num_heads,
                                                 low_precision_attention=False))


@pytest.mark.parametrize("version", ["v0.3.64", "v0.33.0"])
def test_hunyuan3d21_dense_calls_keep_the_originals_precision_keyword(gen, monkeypatch, version):
    """The replaced Hunyuan3D 2.1 forward's dense calls (here the warm-up step and a dense warm-up layer) reach
    ComfyUI's attention with the keywords the original forward passes: ``low_precision_attention=False`` under v0.33.0
    (with SageAttention selected the unpatched model runs PyTorch attention there; the patched one ran SageAttention
    in every dense call), nothing extra under v0.3.64 (whose backends never heard of it). Mutation: the keyword dropped
    (the bug) or always passed."""
    import sys
    import types

    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter import hunyuan3d21, override
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter.callsite import CallSite

    from ._comfy_standins import raw_attention, transformer_options

    seen = []

    def backend(q, k, v, heads, mask=None, skip_reshape=False, skip_output_reshape=False, **kw):
        seen.append(kw)
        return raw_attention(q, k, v, heads, mask=mask, skip_reshape=skip_reshape,
                             skip_output_reshape=skip_output_reshape).float()

    mods = {name: types.ModuleType(name) for name in ("comfy", "comfy.ldm", "comfy.ldm.modules",
                                                      "comfy.ldm.modules.attention")}
    mods["comfy.ldm.modules.attention"].optimized_attention = backend
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    attn = (_H3D21AttentionV033 if version == "v0.33.0" else _H3D21Attention)(gen)
    want = {"low_precision_attention": False} if version == "v0.33.0" else {}
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter import lifecycle, settings

    x = torch.randn(1, 200, 128, generator=gen)
    s = settings.build_settings(preset="custom", density=0.5, dense_warmup="2", warmup_layers=1, anchor_steps="2",
                                query_tile=64, cache_placement="auto", backend="torch", min_tokens=0, verbose=False)
    run = lifecycle.RunState(s, torch.tensor([1.0, 0.8, 0.6, 0.4, 0.0]))
    for layer, sigma in ((1, 1.0), (0, 0.6)):  # block 1 at a dense warm-up step, block 0 (a dense layer) at a reuse step
        forward = hunyuan3d21.make_attn_forward(attn, CallSite(layer, "hunyuan3d21", prefix=1), attn.forward)
        token = override.CURRENT_OPTIONS.set(transformer_options(run, CallSite(layer, "hunyuan3d21", prefix=1),
                                                                 chunks=1, sigma=sigma))
        try:
            seen.clear()
            torch.testing.assert_close(forward(x), attn.forward(x))
        finally:
            override.CURRENT_OPTIONS.reset(token)
        assert seen and all(kw == want for kw in seen), (layer, sigma, seen)
