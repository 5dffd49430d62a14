"""Reliability fixes of issue 9, each with the test that failed before its fix (defect numbers in the docstrings),
and the tests that kill the issue's named mutations. Inputs are fresh random tensors from fixed, printed seeds
(``gen`` in conftest); ComfyUI is replaced by the stand-ins of ``tests/_comfy_standins.py``."""

from __future__ import annotations

import logging
import math
import re
import types

import torch
from comfyui_mc_sparse_pack import kernels
from comfyui_mc_sparse_pack.comfyui_mc_sparse import attention, engine
from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter import lifecycle, override, payoff, settings
from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter.callsite import MARK_KEY, TEXT_LEN_KEY, CallSite
from comfyui_mc_sparse_pack.comfyui_mc_sparse.cache import CacheKey
from comfyui_mc_sparse_pack.comfyui_mc_sparse.config import MCSparseConfig
from comfyui_mc_sparse_pack.comfyui_mc_sparse.timing import CallTimer
from comfyui_mc_sparse_pack.kernels import reference
from comfyui_mc_sparse_pack.kernels.torch_gpu import pddp

from ._comfy_standins import Executor, ModelPatcher, install_comfy_modules, transformer_options
from ._comfy_standins import raw_attention as _func

H, S, D = 2, 128, 64


class _SelfAttention(torch.nn.Module):
    def forward(self, x, transformer_options=None):
        return x


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = _SelfAttention()


class WanModel(torch.nn.Module):
    """A Wan-named diffusion model with one block (``layouts.plan_for`` goes by class name), H x D = 2 x 64."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Block()])
        self.patch_size, self.num_heads, self.dim = (1, 2, 2), H, H * D


def _apply(model, **over):
    base = dict(preset="custom", density=0.5, dense_warmup="1", warmup_layers=0, anchor_steps="1", query_tile=64,
                cache_placement="auto", backend="torch", min_tokens=0, verbose=False)
    return lifecycle.apply_mc_sparse(model, **{**base, **over})


def _sample(patcher, qkv, sigmas=(1.0, 0.8, 0.6, 0.4, 0.0), func=_func):
    """One sampler call as ``comfy/samplers.py`` makes it: the OUTER_SAMPLE wrappers around an executor that, per
    step, goes through the CALC_COND_BATCH wrappers to one marked self-attention call (block 0, one branch).
    Returns (outputs per step, the RunStates seen, the MC-Sparse summaries logged)."""
    sigmas = torch.tensor(sigmas)
    guider = types.SimpleNamespace(model_options=patcher.model_options, model_patcher=patcher, conds={}, cfg=1.0)
    q, k, v = qkv
    runs, outs = [], []

    def evaluate(model, conds, x, timestep, model_options):
        opts = model_options["transformer_options"]
        runs.append(opts.get(override.RUN_KEY))
        marked = {**opts, MARK_KEY: CallSite(0, "wan"), "cond_or_uncond": [0], "uuids": ["u0"], "sigmas": timestep}
        return opts["optimized_attention_override"](func, q, k, v, H, skip_reshape=True, skip_output_reshape=True,
                                                    transformer_options=marked)

    def sample(noise, latent, sampler, sigmas):
        for sigma in sigmas[:-1]:
            outs.append(Executor(evaluate, None, patcher.get_all_wrappers("calc_cond_batch"))(
                None, None, None, sigma.reshape(1), guider.model_options))
        return outs

    records = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    log = logging.getLogger(engine.__name__.rsplit(".", 1)[0])  # the package's logger: adapter and engine
    old = log.level
    log.setLevel(logging.INFO)
    log.addHandler(handler)
    try:
        Executor(sample, guider, patcher.get_all_wrappers("outer_sample"))(torch.zeros(1, 16, 1, 16, 16), None, None,
                                                                          sigmas)
    finally:
        log.removeHandler(handler)
        log.setLevel(old)
    summaries = [r.getMessage() for r in records if "  calls: " in r.getMessage()]
    return outs, runs, summaries, [r.getMessage() for r in records]


def _qkv(gen, s=S):
    return tuple(torch.randn(1, H, s, D, generator=gen) for _ in range(3))


# --- defect 1: two nodes in a chain --------------------------------------------------------------------------

def test_two_patch_nodes_in_a_chain_make_one_run_and_one_summary(monkeypatch, gen):
    """Defect 1: a second MC-Sparse node replaces the first one's wrappers and callbacks (ComfyUI appends wrappers
    under one key): one run, one summary, with the last node's settings."""
    install_comfy_modules(monkeypatch)
    chained = _apply(_apply(ModelPatcher(WanModel()), density=0.5), density=0.25)
    for kind in ("outer_sample", "calc_cond_batch"):
        assert len(chained.get_all_wrappers(kind)) == 1
    assert all(len(c) == 1 for cbs in chained.callbacks.values() for c in cbs.values())
    _, runs, summaries, _ = _sample(chained, _qkv(gen))
    assert len(summaries) == 1 and len({id(r) for r in runs}) == 1, summaries
    assert "density 0.25" in summaries[0] and "  calls: 3 sparse, 1 anchor" in summaries[0]


# --- mutations: no clone, state kept on the holder, run not closed -------------------------------------------

def test_apply_leaves_the_input_model_untouched(monkeypatch):
    """Mutation 'apply_mc_sparse without clone()': the node's input model keeps no holder, override, wrapper,
    callback nor object patch (bypassing the node leaves no trace)."""
    install_comfy_modules(monkeypatch)
    base = ModelPatcher(WanModel())
    patched = _apply(base)
    assert patched is not base and patched.object_patches and patched.get_all_wrappers("outer_sample")
    assert base.model_options == {"transformer_options": {}}
    assert not base.object_patches and not base.wrappers and not base.callbacks


def test_each_prompt_gets_a_fresh_run_on_a_reused_holder_and_the_run_is_closed(monkeypatch, gen):
    """Mutations 'a RunState kept on the node's holder across prompts' and 'run.close() removed': ComfyUI caches
    the node's output, so two prompts sample the same patched model (same holder, no clone in between). Each
    prompt gets its own RunState with the same counts and output, and each run's cache is freed at its end."""
    install_comfy_modules(monkeypatch)
    patched = _apply(ModelPatcher(WanModel()))
    qkv = _qkv(gen)
    first, runs1, summaries1, _ = _sample(patched, qkv)
    second, runs2, summaries2, _ = _sample(patched, qkv)
    assert {id(r) for r in runs1}.isdisjoint({id(r) for r in runs2})
    assert summaries1[0].splitlines()[1] == summaries2[0].splitlines()[1]  # the "calls:" line
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    for run in (runs1[0], runs2[0]):
        assert run.closed and len(run.runner.cache) == 0
    holder = patched.model_options["transformer_options"][lifecycle.HOLDER_KEY]
    assert not holder.active_runs and not [v for v in vars(holder).values() if isinstance(v, lifecycle.RunState)]


# --- mutation: warm-up steps computed by another attention ---------------------------------------------------

def test_warmup_steps_of_a_sparse_run_are_the_callers_attention_bit_for_bit(monkeypatch, gen):
    """Mutation 'warm-up steps computed by a different attention than the caller's': in a run that goes sparse
    later, every dense warm-up step is exactly the caller's attention (bitwise), in the adapter and in the engine."""
    install_comfy_modules(monkeypatch)
    q, k, v = _qkv(gen)
    outs, runs, _, _ = _sample(_apply(ModelPatcher(WanModel()), density=0.25, dense_warmup="2", anchor_steps="3"),
                               (q, k, v), sigmas=(1.0, 0.9, 0.8, 0.6, 0.4, 0.2, 0.1, 0.0))
    ref = _func(q, k, v, H, skip_reshape=True, skip_output_reshape=True)
    assert torch.equal(outs[0], ref) and torch.equal(outs[1], ref)
    assert runs[0].counts()["sparse"] == 4 and not torch.equal(outs[3], ref)
    runner = engine.MCSparseRunner(MCSparseConfig(density=0.5, group_size=64, warmup_steps=2, anchor_steps=(2,)))
    dense_fn = lambda q_, k_, v_: _func(q_, k_, v_, H, skip_reshape=True, skip_output_reshape=True)  # noqa: E731
    out, kind = runner.call(q, k, v, step=0, layer=0, key=CacheKey(0), dense_fn=dense_fn)
    assert kind.value == "dense" and torch.equal(out, ref)


# --- mutations: extra_kv at reuse steps, pass-2 LSE over all keys --------------------------------------------

def _joint(gen, s=S, t=24):
    q, k, v = _qkv(gen, s)
    kx, vx = (torch.randn(1, H, t, D, generator=gen) for _ in range(2))
    return q, k, v, kx, vx


def _exact(q, k, v, scale):
    return torch.softmax((q.double() @ k.double().transpose(-1, -2)) * scale, -1) @ v.double()


def test_reuse_steps_attend_the_extra_keys(gen):
    """Mutation 'the engine drops extra_kv at reuse steps': a joint call (text keys as extra_kv) at a reuse step
    on the anchor's own inputs equals exact attention over latent + text keys (fp32 residual: the anchor's
    correction is exact there); without the text keys it would be attention over the latent keys only."""
    q, k, v, kx, vx = _joint(gen)
    runner = engine.MCSparseRunner(MCSparseConfig(density=0.25, group_size=64, warmup_steps=0, anchor_steps=(0,),
                                                  residual_dtype="float32"))
    key = CacheKey(0)
    runner.call(q, k, v, step=0, layer=0, key=key, extra_kv=(kx, vx))
    out, kind = runner.call(q, k, v, step=1, layer=0, key=key, extra_kv=(kx, vx))
    assert kind.value == "reuse"
    ref = _exact(q, torch.cat((k, kx), 2), torch.cat((v, vx), 2), 1 / math.sqrt(D))
    assert (out.double() - ref).abs().max() < 1e-5


def test_selection_probabilities_are_normalised_over_latent_and_text_keys(gen):
    """Mutation 'pass-2 LSE over latent keys only when text keys exist': each group keeps the K latent keys of
    largest exact probability mass, with probabilities normalised over all keys (latent + text). Text keys that
    take most of the mass of some queries (and little of others) make the two normalisations pick other keys."""
    s, t, C = 256, 32, 64
    q, k, v, kx, vx = _joint(gen, s, t)
    u = torch.nn.functional.normalize(torch.randn(D, generator=gen), dim=0)
    q = q + 3.0 * torch.randn(1, H, s, 1, generator=gen) * u  # per query: how much it looks at the text keys
    kx = kx + 3.0 * u
    cfg = MCSparseConfig(density=0.125, group_size=C, warmup_steps=0, anchor_steps=(0,))
    _, entry = attention.anchor_attention(q, k, v, cfg, extra_kv=(kx, vx), backend="torch")
    scale = 1 / math.sqrt(D)
    scores = (q.double() @ torch.cat((k, kx), 2).double().transpose(-1, -2)) * scale
    prob = torch.softmax(scores, -1)[..., :s]  # [1, H, S, s]: latent keys, normalised over all keys
    got = best = 0.0
    for h in range(H):
        for g in range(entry.perm.shape[-1] // C):
            rows = entry.perm[0, h, g * C:(g + 1) * C]
            mass = prob[0, h, rows[rows >= 0].long()].sum(0)  # [s]
            idx = entry.kv_idx[0, h, g]
            got += float(mass[idx[idx >= 0].long()].sum())
            best += float(mass.topk(entry.num_keys).values.sum())
    assert got >= best * (1 - 1e-6), (got, best)


# --- defect 3: density 1 -------------------------------------------------------------------------------------

def test_density_one_is_an_exact_pass_through(monkeypatch, gen):
    """Defect 3: density >= 1 returns the input model itself; after another MC-Sparse node the run is all dense
    through the caller's attention (bitwise) and its summary says so in its first line."""
    install_comfy_modules(monkeypatch)
    base = ModelPatcher(WanModel())
    assert _apply(base, density=1.0) is base and not base.wrappers
    chained = _apply(_apply(base), density=1.0)
    q, k, v = _qkv(gen)
    outs, runs, summaries, _ = _sample(chained, (q, k, v))
    ref = _func(q, k, v, H, skip_reshape=True, skip_output_reshape=True)
    assert all(torch.equal(o, ref) for o in outs) and runs[0].runner is None
    assert summaries[0].startswith("MC-Sparse: stayed dense: density 1 keeps every token"), summaries[0]


# --- defect 4: decide before sampling whether the run can pay off --------------------------------------------

def test_runs_that_cannot_pay_off_stay_dense_and_say_why_once(monkeypatch, gen):
    """Defect 4: without a fast sparse kernel on the model's device (here the CPU: the torch reference only), the
    run stays dense from its first step, warns once before sampling and the summary's first line says why; too few
    reuse steps (2-step distilled stage) or too few tokens also stay dense; the reference asked for by name runs
    (testing: no pay-off decision but the user's min tokens)."""
    install_comfy_modules(monkeypatch)
    q, k, v = _qkv(gen)
    outs, runs, summaries, messages = _sample(_apply(ModelPatcher(WanModel()), backend="auto"), (q, k, v))
    ref = _func(q, k, v, H, skip_reshape=True, skip_output_reshape=True)
    assert all(torch.equal(o, ref) for o in outs) and runs[0].runner is None
    assert sum("runs dense: no fast sparse kernel on cpu" in m for m in messages) == 1, messages
    assert summaries[0].startswith("MC-Sparse: stayed dense: no fast sparse kernel on cpu")
    cfg = MCSparseConfig(density=0.2, group_size=64, warmup_steps=1, anchor_steps=(0,))
    assert "too few reuse steps" in payoff.dense_reason(cfg, num_steps=2, layers=30, requested_backend="auto",
                                                        min_tokens=0)
    assert payoff.dense_reason(cfg, num_steps=2, layers=30, requested_backend="torch", min_tokens=0) is None
    cfg = MCSparseConfig(density=0.2, group_size=64, warmup_steps=10, anchor_steps=(9, 25))
    assert payoff.dense_reason(cfg, num_steps=50, layers=30, requested_backend="auto", min_tokens=0) is None
    # the presets' block 0 dense: the estimate counts all 30 blocks (mutation: num_layers from min() -> one block,
    # the dense one: every run dense for "too few reuse steps")
    one_dense = MCSparseConfig(density=0.2, group_size=64, warmup_steps=10, anchor_steps=(9,), warmup_layers=1)
    assert payoff.dense_reason(one_dense, num_steps=50, layers=30, requested_backend="auto", min_tokens=0) is None
    for backend in ("auto", "torch"):
        assert "fewer than min tokens" in payoff.dense_reason(cfg, num_steps=50, layers=30, requested_backend=backend,
                                                              min_tokens=2048, tokens=1024)
    assert "no fast sparse kernel on cpu" in payoff.dense_reason(
        cfg, num_steps=50, layers=30, requested_backend="auto", min_tokens=0, device=torch.device("cpu"),
        dtype=torch.bfloat16, head_dim=128)
    assert payoff.dense_reason(cfg, num_steps=50, layers=30, requested_backend="torch", min_tokens=0,
                               device=torch.device("cpu"), dtype=torch.bfloat16, head_dim=128) is None


# --- defect 6: joint text rows through the dense kernels, one mask analysis per evaluation ---------------------

def test_joint_text_rows_use_the_dense_kernels_and_the_mask_is_read_once(gen, monkeypatch):
    """Defect 6: HunyuanVideo text query rows go through the dense attention kernels (no fp32 [B, H, T, S] score
    matrix), exactly; the blocks of one evaluation share one mask tensor, which is analysed (one host sync) once."""
    run = lifecycle.RunState(settings.build_settings(
        preset="custom", density=0.5, dense_warmup="1", warmup_layers=0, anchor_steps="1", query_tile=64,
        cache_placement="auto", backend="torch", min_tokens=0, verbose=False), torch.tensor([1.0, 0.8, 0.6, 0.0]))
    over = override.make_override(None)
    sv, st = 128, 16
    q, k, v = (torch.randn(1, H, sv + st, D, generator=gen) for _ in range(3))
    mask = torch.zeros(1, 1, sv + st)
    mask[..., -4:] = -torch.finfo(torch.float32).max
    dense_calls, analysed = [], []
    real_dense, real_analyse = kernels.dense_attention, override._analyse_mask
    monkeypatch.setattr(kernels, "dense_attention",
                        lambda q_, *a, **kw: dense_calls.append(q_.shape) or real_dense(q_, *a, **kw))
    monkeypatch.setattr(override, "_analyse_mask", lambda *a: analysed.append(1) or real_analyse(*a))
    ref = _func(q, k, v, H, mask=mask.unsqueeze(1), skip_reshape=True, skip_output_reshape=True)
    for layer in range(3):  # three blocks of one evaluation (the anchor step)
        opts = {**transformer_options(run, CallSite(layer, "hunyuan_video", "video_first"), chunks=1, sigma=1.0),
                TEXT_LEN_KEY: st}
        out = over(_func, q, k, v, H, mask=mask, skip_reshape=True, skip_output_reshape=True, transformer_options=opts)
        torch.testing.assert_close(out[:, :, sv:], ref[:, :, sv:], rtol=1e-4, atol=1e-4)
    assert (1, H, st, D) in dense_calls and len(analysed) == 1


# --- defects 7 and 8: the summary ----------------------------------------------------------------------------

def test_attention_time_counts_the_anchors_against_the_dense_calls_they_replace():
    """Defect 7: the measured-time line compares anchor + reuse calls with the same number of dense calls of the
    same shape (anchors cost more than dense: leaving them out overstated the saving), and is dropped when too
    few dense calls were timed to compare with."""
    timer = CallTimer()
    shape = (2, 4096, 128)
    for kind, ms, n in (("dense", 10.0, 4), ("anchor", 30.0, 2), ("reuse", 4.0, 10)):
        for _ in range(n):
            timer._ms.setdefault((kind, shape), []).append(ms)
    line = engine.attention_time_line(timer)
    assert "12 anchor + reuse calls took 0.100 s" in line and "dense ~0.120 s" in line and "saving 0.020 s" in line
    few = CallTimer()
    few._ms[("dense", shape)] = [10.0]
    few._ms[("reuse", shape)] = [4.0]
    assert engine.attention_time_line(few) is None


def test_summary_first_line_tells_an_artist_what_happened(monkeypatch, gen):
    """Defect 8: the first line (shown under the sampler) gives the share of self-attention that went sparse, the
    expected speedup and where the cache lived, in a dozen words or so; the summary repeats no counts, holds no
    plan line, no '1 steps'/'1 layers', no GPU working set on a CPU run and no note about absent backends."""
    install_comfy_modules(monkeypatch)
    _, _, summaries, messages = _sample(_apply(ModelPatcher(WanModel()), density=0.25), _qkv(gen),
                                        sigmas=(1.0, 0.8, 0.6, 0.4, 0.2, 0.1, 0.0))
    text = summaries[0]
    head = text.splitlines()[0]
    assert head.startswith("MC-Sparse: 83% of self-attention sparse, ~") and "x expected, cache in CPU memory" in head
    assert len(head.split()) <= 16, head
    assert len(re.findall(r"\d+ sparse, \d+ anchor", text)) == 1, text
    for absent in ("MC-Sparse plan", "1 steps", "1 layers", "GPU working set", "flash_attn", "not available"):
        assert absent not in text, (absent, text)
    assert sum(m.startswith("MC-Sparse plan") for m in messages) == 1  # logged once, before sampling


# --- defect 9: presets and the boxes they ignore -------------------------------------------------------------

def test_a_preset_names_the_edited_boxes_it_ignores(caplog):
    """Defect 9: a preset ignores the density / warm-up / anchor boxes; when one was edited, a warning names it."""
    base = dict(warmup_layers=1, query_tile=128, cache_placement="auto", backend="auto", min_tokens=2048, verbose=False)
    with caplog.at_level(logging.WARNING):
        settings.build_settings(preset="fast", density=0.2, dense_warmup="auto", anchor_steps="auto", **base)
    assert not caplog.records
    with caplog.at_level(logging.WARNING):
        s = settings.build_settings(preset="fast", density=0.5, dense_warmup="auto", anchor_steps="10, 26", **base)
    assert s.density == 0.15
    msg = caplog.records[-1].getMessage()
    assert "preset 'fast'" in msg and "density 0.5" in msg and "anchor steps '10, 26'" in msg
    assert "dense warm-up" not in msg


# --- defect 10: per-run state --------------------------------------------------------------------------------

def test_gpu_grouping_plans_are_bounded(gen):
    """Defect 10: the GPU grouping op's per-shape tree tables are a bounded memo, not a per-process dict that grows
    with every resolution a ComfyUI session meets."""
    pddp._PLANS.clear()
    for s in range(100, 100 + 8 * 37, 37):  # 8 shapes
        perm = pddp.pddp_groups(torch.randn(1, 1, s, 16, generator=gen), 16)
        assert torch.equal(torch.sort(perm[0, 0, :s]).values, torch.arange(s, dtype=torch.int32))
    assert 0 < len(pddp._PLANS) <= pddp.MAX_PLANS


def test_each_run_reports_its_own_kernels(gen):
    """Defect 10: which backend ran each op is recorded per run: a run that only ran dense warm-up calls reports no
    sparse op, whatever another run did before or meanwhile."""
    q, k, v = _qkv(gen)
    busy = engine.MCSparseRunner(MCSparseConfig(density=0.5, group_size=64, warmup_steps=0, anchor_steps=(0,)))
    idle = engine.MCSparseRunner(MCSparseConfig(density=0.5, group_size=64, warmup_steps=5, anchor_steps=(4,)))
    busy.attention(q, k, v, step=0, layer=0, key=CacheKey(0))
    idle.attention(q, k, v, step=0, layer=0, key=CacheKey(0))
    assert set(busy.kernels.choices) >= {"dense_attention", "pddp_groups", "select_kv", "sparse_attention"}
    assert set(idle.kernels.choices) == {"dense_attention"}
    assert reference  # the torch backend answered both (CPU)


class _FakeEvent:
    """A CUDA timing event stand-in: ``done`` says whether the device has passed it; times in ms on a fake clock."""

    clock = 0.0
    reads = 0
    made: list = []

    def __init__(self):
        _FakeEvent.clock += 1.0
        self.t, self.done = _FakeEvent.clock, False
        _FakeEvent.made.append(self)

    def query(self):
        return self.done

    def synchronize(self):  # the device has passed this event, hence every one recorded before it (one stream)
        for e in _FakeEvent.made[: _FakeEvent.made.index(self) + 1]:
            e.done = True

    def elapsed_time(self, end):
        _FakeEvent.reads += 1
        assert self.done and end.done, "read before the device finished the pair"
        return end.t - self.t


def test_call_timer_reads_finished_pairs_during_the_run(monkeypatch):
    """CallTimer reads the pairs the device has finished at later calls (never an unfinished one, oldest first, at most
    ``drain`` per call), so the end-of-run read has only the last few left; the times are the same either way
    (mutations: reading without the query, or popping the newest pair, fail here)."""
    events = []

    def event(device):
        events.append(_FakeEvent())
        return events[-1]

    monkeypatch.setattr(CallTimer, "_event", staticmethod(event))
    cuda = torch.device("cuda")
    timers = {n: CallTimer(drain=n) for n in (0, 2)}
    for t in timers.values():
        events.clear()
        _FakeEvent.made.clear()
        _FakeEvent.reads = 0
        for i in range(6):
            t.stop(t.start(cuda), "reuse", (2, 8, 4), per=2)
            for e in events[:-4]:  # the device is two calls behind the host
                e.done = True
        left = t.pending
        assert t.times("reuse") == {(2, 8, 4): [0.5] * 6}
        assert t.pending == 0 and _FakeEvent.reads == 6
        if t.drain:
            assert left == 3  # the two the device has not reached and one it finished after the last call
        else:
            assert left == 6


def test_call_timer_on_the_host_clock_and_on_an_idle_device(monkeypatch):
    """Off CUDA the timer reads the wall clock (ms since start, divided by the batch, at least 1); on CUDA a device that
    has finished everything still leaves the pair just recorded unread (read at the next call or at the end).
    Mutations: the elapsed time's sign, the batch floor, the newest pair read at once."""
    from comfyui_mc_sparse_pack.comfyui_mc_sparse import timing

    clock = iter([10.0, 10.25, 20.0, 20.5])
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(clock))
    t = CallTimer()
    assert t.drain == CallTimer.DRAIN == 2
    t.stop(t.start(torch.device("cpu")), "dense", (2, 8, 4))  # per: 1 by default
    t.stop(t.start(torch.device("cpu")), "dense", (2, 8, 4), per=0)  # a batch of 0: counted as 1
    assert t.times("dense") == {(2, 8, 4): [250.0, 500.0]}

    def event(device):
        e = _FakeEvent()
        e.done = True  # an idle device: passed at once
        return e

    monkeypatch.setattr(CallTimer, "_event", staticmethod(event))
    t = CallTimer()
    for _ in range(4):
        t.stop(t.start(torch.device("cuda")), "reuse", (2, 8, 4), per=1)
        assert t.pending == 1
    assert t.times("reuse") == {(2, 8, 4): [1.0] * 4} and t.pending == 0


def _summary_run(counts, *, not_self=0, anchors=(1, 4), config=True, keys=(), runner=True, interrupted=None,
                 disabled=None):
    """A stand-in of lifecycle.RunState with what adapter.summary reads."""
    from collections import Counter

    r = None
    if runner:
        r = types.SimpleNamespace(stats=types.SimpleNamespace(dense_reasons={override.NOT_SELF_ATTENTION: not_self}),
                                  speed=types.SimpleNamespace(speedup=1.5), cache_where=lambda: "GPU memory",
                                  summary_lines=lambda: ["runner line"], disabled_reason=disabled)
    return types.SimpleNamespace(
        counts=lambda: dict(counts), settings=types.SimpleNamespace(density=0.2, preset="custom", warmup_layers=1),
        schedule=types.SimpleNamespace(warmup_steps=2, anchor_steps=anchors), config=object() if config else None,
        runner=r, dense_reasons=Counter({"up front": 3}), cache_keys=list(keys), backend_line=lambda: "backend: b",
        displaced=[], notes=[], num_steps=8, dense_run_reason="too few tokens", interrupted_by=interrupted,
        last_step=None)


def test_summary_lines_from_the_run_state():
    """adapter.summary on a stand-in run: the headline's share counts only self-attention (cross-attention dense calls
    left out), the speed only with sparse calls, the cache with anchors too; the schedule line's 1-based anchors (or
    'none'), left out when no schedule was resolved; the cache-entries line (blocks, branches, windows); the WARNING
    when a finished run with a runner went sparse nowhere (not for an interrupted run or a run dense up front).
    Mutations that left the suite green: 16 in summary.py."""
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter import summary

    run = _summary_run({"sparse": 6, "anchor": 1, "dense": 3}, not_self=2)
    assert summary.headline(run) == "MC-Sparse: 75% of self-attention sparse, ~1.50x expected, cache in GPU memory"
    text = summary.format_summary(run)
    assert "  schedule: dense warm-up 2 steps, 1 layer; anchors at steps 2, 5 (1-based)" in text
    assert "runner line" in text and "backend: b" in text and "WARNING" not in text and "cache entries" not in text
    assert summary.headline(_summary_run({"sparse": 0, "anchor": 2, "dense": 5})) == \
        "MC-Sparse: 0% of self-attention sparse, cache in GPU memory"
    assert summary.headline(_summary_run({"sparse": 4, "anchor": 1, "dense": 0}, disabled="out of memory")) \
        .startswith("MC-Sparse: 80% of self-attention sparse")
    assert summary.headline(_summary_run({"sparse": 0, "anchor": 1, "dense": 0}, disabled="out of memory")) == \
        "MC-Sparse: stayed dense: out of memory"
    assert "anchors at steps none (1-based)" in summary.format_summary(_summary_run({"sparse": 0, "anchor": 0,
                                                                                    "dense": 1}, anchors=()))
    assert "schedule:" not in summary.format_summary(_summary_run({"sparse": 1, "anchor": 1, "dense": 0},
                                                                  config=False))
    one = [CacheKey(0, "b0", None, (1, 2, 64, 64), "self"), CacheKey(1, "b0", None, (1, 2, 64, 64), "self"),
           CacheKey(1, "b0", None, (1, 2, 64, 64), "vace")]
    assert "  cache entries: 3 keys over 2 blocks, 1 conditioning branch, no context windows, kinds self, vace" in \
        summary.format_summary(_summary_run({"sparse": 1, "anchor": 1, "dense": 0}, keys=one))
    two = [CacheKey(0, b, w, (1, 2, 64, 64), "self") for b in ("b0", "b1") for w in ("w0", "w1")]
    assert "  cache entries: 4 keys over 1 block, 2 conditioning branches, 2 context windows, kinds self" in \
        summary.format_summary(_summary_run({"sparse": 1, "anchor": 1, "dense": 0}, keys=two))
    warning = "WARNING: no attention call went sparse"
    assert warning in summary.format_summary(_summary_run({"sparse": 0, "anchor": 1, "dense": 4}))
    assert warning not in summary.format_summary(_summary_run({"sparse": 0, "anchor": 1, "dense": 4},
                                                              interrupted="KeyboardInterrupt"))
    dense = summary.format_summary(_summary_run({"sparse": 0, "anchor": 0, "dense": 3}, runner=False))
    assert warning not in dense and dense.startswith("MC-Sparse: stayed dense: too few tokens")
    assert "  dense x3: up front" in dense
