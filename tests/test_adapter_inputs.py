"""Bad and unusual input through the adapter, the backend combo, VACE call sites, the extra_kv route (CI).

Stand-ins mirror ComfyUI (Oct-2025 snapshot) contracts: ``_func`` and ``_options`` from
``tests/_comfy_standins.py`` (a raw backend, the transformer_options of one call); ``VaceWanModel`` the attributes ``comfy/ldm/wan/model.py`` L661-776 sets
(``blocks``, ``vace_blocks``, ``vace_layers_mapping``), with blocks that call ``self_attn.forward`` with
``transformer_options`` as ``WanAttentionBlock.forward`` does (L235).
"""

import functools
import logging
import types

import pytest
import torch
from comfyui_mc_sparse_pack import kernels
from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter import layouts, lifecycle, override, settings
from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter.callsite import MARK_KEY, TEXT_LEN_KEY, CallSite

from ._comfy_standins import raw_attention as _func
from ._comfy_standins import transformer_options


def _settings(**over):
    base = dict(preset="custom", density=0.5, dense_warmup="1", warmup_layers=0, anchor_steps="1", query_tile=64,
                cache_placement="auto", backend="auto", min_tokens=0, verbose=False)
    return settings.build_settings(**{**base, **over})


_options = functools.partial(transformer_options, chunks=1, sigma=1.0)


SIGMAS = torch.tensor([1.0, 0.8, 0.6, 0.0])  # anchor at step 0, reuse at steps 1 and 2


def test_backend_combo_is_the_registry():
    """The node's backend options are the registry's names (auto + every registered backend, in order) except the
    grouping-only backend, which auto picks for the one op it has."""
    assert list(settings.BACKENDS) == [n for n in kernels.registry.backend_names() if n != "torch_gpu"]


@pytest.mark.parametrize("field,value,match", [
    ("preset", "ultra", "preset must be one of"), ("backend", "cuda", "backend must be one of"),
    ("cache_placement", "disk", "cache placement must be one of"), ("min_tokens", -1, "min tokens must be"),
    ("warmup_layers", 1.5, "dense warm-up layers must be"), ("density", float("nan"), "density must be in"),
    ("anchor_steps", "0", "1-based"), ("dense_warmup", "150%", "dense warm-up percent"),
    ("residual_precision", "int8", "residual precision must be one of"),
    ("memory_headroom_gib", -1.0, "memory headroom must be"), ("memory_headroom_gib", True, "memory headroom must be"),
])
def test_bad_node_values_name_the_input(field, value, match):
    """A bad widget value stops the node with "<input> must ..., got ..."."""
    with pytest.raises((ValueError, TypeError), match=match):
        _settings(**{field: value})


@pytest.mark.parametrize("precision,dtype", [("auto", "auto"), ("bf16", "bfloat16"), ("fp8", "float8_e4m3fn"),
                                             ("int4", "int4_group")])
def test_residual_precision_and_headroom_reach_the_runner(precision, dtype):
    """The node's residual precision and memory headroom become the run's config (plan_cache decides 'auto')."""
    run = lifecycle.RunState(_settings(residual_precision=precision, memory_headroom_gib=2.5), SIGMAS)
    assert run.config.residual_dtype == dtype and run.config.cache_headroom_gib == 2.5
    assert run.runner.residual_dtype == ("bfloat16" if dtype == "auto" else dtype)


def test_cache_size_tooltip_is_computed():
    """The tooltip's sizes are memory.py's estimates per node option (quality preset; the node's int4 is the group
    form: 720p 31.9 GiB, 480p 9.8 GiB)."""
    note = settings.cache_size_note()
    assert "720p: bf16 72.9 / fp8 45.7 / int4 31.9 GiB" in note and "480p: bf16 27.6 / fp8 15.8 / int4 9.8 GiB" in note


def test_unknown_model_is_exact_pass_through_and_counted(gen):
    """A model family MC-Sparse does not know: bit-identical to func, every call counted with the reason."""
    plan = layouts.plan_for(torch.nn.Linear(2, 2))
    assert plan.family is None and "not supported" in plan.reason_unsupported
    run = lifecycle.RunState(_settings(), SIGMAS, unsupported=plan.reason_unsupported)
    over = override.make_override(None)
    q = torch.randn(1, 256, 128, generator=gen)
    out = over(_func, q, q, q, 1, transformer_options=_options(run, None))
    assert torch.equal(out, _func(q, q, q, 1))
    assert run.counts() == {"sparse": 0, "anchor": 0, "dense": 1}
    head = run.summary().splitlines()[0]
    assert head.startswith("MC-Sparse: stayed dense: model Linear is not supported"), head


@pytest.mark.parametrize("seq", [97, 161, 200])
def test_odd_token_counts_go_sparse(gen, seq):
    """Token counts that are not multiples of C (a ragged last group) run the sparse path; at density 0.99 (all keys
    once K is rounded up to the KV tile) it equals dense."""
    run = lifecycle.RunState(_settings(density=0.99), SIGMAS)
    over = override.make_override(None)
    q, k, v = (torch.randn(1, 2, seq, 64, generator=gen) for _ in range(3))
    ref = _func(q, k, v, 2, skip_reshape=True, skip_output_reshape=True)
    for sigma in (1.0, 0.8):
        out = over(_func, q, k, v, 2, skip_reshape=True, skip_output_reshape=True,
                   transformer_options=_options(run, CallSite(0, "wan"), sigma=sigma))
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert run.counts()["sparse"] == 1


def test_nan_input_falls_back_to_dense_with_reason(gen):
    """NaN latents (q/k/v not finite) at an anchor: reported dense fallback, the caller's own attention runs."""
    run = lifecycle.RunState(_settings(), SIGMAS)
    over = override.make_override(None)
    q = torch.randn(1, 2, 128, 64, generator=gen)
    q[0, 0, 5, 3] = float("nan")
    out = over(_func, q, q, q, 2, skip_reshape=True, transformer_options=_options(run, CallSite(0, "wan")))
    assert out.shape == (1, 128, 128) and torch.isnan(out).any()  # what dense attention gives on NaN input
    assert any("non-finite" in r for r in run.runner.stats.dense_reasons), run.runner.stats.dense_reasons


def test_unsupported_head_dim_and_mask_are_reported_dense(gen):
    """Head dim 80 and a masked non-joint call stay dense, exactly, each with its reason in the summary."""
    run = lifecycle.RunState(_settings(), SIGMAS)
    over = override.make_override(None)
    site = CallSite(0, "wan")
    q = torch.randn(1, 128, 160, generator=gen)  # 2 heads x 80
    assert torch.equal(over(_func, q, q, q, 2, transformer_options=_options(run, site)), _func(q, q, q, 2))
    q2 = torch.randn(1, 128, 128, generator=gen)
    mask = torch.zeros(1, 1, 128)
    out = over(_func, q2, q2, q2, 1, mask=mask, transformer_options=_options(run, site))
    assert torch.equal(out, _func(q2, q2, q2, 1, mask=mask))
    text = run.summary()
    assert "head dim 80 not supported" in text and "masked attention" in text


def test_summary_names_backend_and_reason(gen):
    """After a sparse run the summary says which backend ran each kernel op, and why not the requested one."""
    run = lifecycle.RunState(_settings(backend="triton"), SIGMAS)  # float32 here: Triton refuses, torch runs
    over = override.make_override(None)
    q, k, v = (torch.randn(1, 2, 128, 64, generator=gen) for _ in range(3))
    for sigma in (1.0, 0.8):
        over(_func, q, k, v, 2, skip_reshape=True, transformer_options=_options(run, CallSite(0, "wan"), sigma=sigma))
    line = run.backend_line()
    assert line.startswith("backend: requested triton; ran torch (") and "flash_attn" not in line
    assert "triton (requested): runs float16/bfloat16 only" in line.split("why:")[1], line
    assert line in run.summary()


class _Attn(torch.nn.Module):
    def forward(self, x, transformer_options=None):
        return transformer_options[MARK_KEY]


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = _Attn()


class VaceWanModel(torch.nn.Module):
    """Stand-in of ``comfy/ldm/wan/model.py`` VaceWanModel: 4 blocks, VACE blocks after blocks 0 and 2."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(4))
        self.vace_blocks = torch.nn.ModuleList(_Block() for _ in range(2))
        self.vace_layers_mapping = {0: 0, 2: 1}


def test_vace_sites_keyed_by_main_block_kind_and_context():
    """VACE blocks get the main block's index, kind "vace", and one occurrence per VACE context per forward."""
    model = VaceWanModel()
    plan = layouts.plan_for(model)
    patched = {}
    for rel, factory in plan.patches:
        mod = model.get_submodule(rel.rsplit(".", 1)[0])
        patched[rel] = factory(mod.forward)
    for _forward in range(2):  # the occurrence count restarts every forward (block 0 resets it)
        options = {}
        seen = []
        for i in range(4):
            seen.append(patched[f"blocks.{i}.self_attn.forward"](None, transformer_options=options))
            ii = model.vace_layers_mapping.get(i)
            if ii is not None:
                for _context in range(2):
                    seen.append(patched[f"vace_blocks.{ii}.self_attn.forward"](None, transformer_options=options))
        keys = [(s.layer, s.cache_kind) for s in seen]
        assert keys == [(0, "self"), (0, "vace"), (0, "vace#1"), (1, "self"), (2, "self"), (2, "vace"),
                        (2, "vace#1"), (3, "self")]


class _ExtraKVRunner:
    """A runner with the lead's ``extra_kv`` signature; attends exactly over cat(k, k_text) and records calls."""

    def __init__(self, config, backend):
        from comfyui_mc_sparse_pack.comfyui_mc_sparse.engine import RunStats
        from comfyui_mc_sparse_pack.comfyui_mc_sparse.schedule import StepKind

        self.stats, self.kind, self.seen = RunStats(), StepKind, []

    def call(self, q, k, v, *, step, layer, key=None, keys=None, dense_fn=None, scale=None, extra_kv=None, out=None):
        self.seen.append((q.shape, extra_kv[0].shape))
        kind = self.kind.REUSE if step else self.kind.ANCHOR
        self.stats.calls[kind] += 1
        kk, vv = torch.cat((k, extra_kv[0]), 2), torch.cat((v, extra_kv[1]), 2)
        result = torch.softmax(q @ kk.transpose(-1, -2) * scale, -1) @ vv
        return (result if out is None else out.copy_(result)), kind

    def record_dense(self, reason):
        self.stats.calls[self.kind.DENSE] += 1
        self.stats.dense_reasons[reason] += 1

    def dense_attention(self, q, k, v, *, scale):
        return torch.softmax(q @ k.transpose(-1, -2) * scale, -1) @ v

    def summary_lines(self):
        return []

    def cache_where(self):
        return "nowhere (stand-in)"

    def close(self):
        pass


def test_joint_call_passes_text_keys_as_extra_kv(gen):
    """The runner gets video queries/keys only plus the unmasked text keys as extra_kv; text rows stay exact;
    masked text keys carry no weight; the summary says which route ran."""
    run = lifecycle.RunState(_settings(), SIGMAS, family="hunyuan_video", runner_factory=_ExtraKVRunner)
    over = override.make_override(None)
    sv, st, pad = 128, 16, 4
    q, k, v = (torch.randn(1, 2, sv + st, 128, generator=gen) for _ in range(3))
    mask = torch.zeros(1, 1, sv + st)
    mask[..., -pad:] = -torch.finfo(torch.float32).max
    opts = {**_options(run, CallSite(0, "hunyuan_video", "video_first"), sigma=0.8), TEXT_LEN_KEY: st}
    out = over(_func, q, k, v, 2, mask=mask, skip_reshape=True, skip_output_reshape=True, transformer_options=opts)
    assert run.runner.seen == [((1, 2, sv, 128), (1, 2, st - pad, 128))]
    ref = _func(q, k, v, 2, mask=mask.unsqueeze(1), skip_reshape=True, skip_output_reshape=True)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)  # the stand-in is exact: so is every row
    assert "attended exactly beside the sparse latent keys (extra_kv)" in run.summary()


def test_geometry_for_the_cache_estimate():
    """Tokens per call from the latent shape and patch size (Wan: (1, 2, 2), padded up), heads and head dim."""
    dm = types.SimpleNamespace(patch_size=(1, 2, 2), num_heads=12, dim=1536)
    plan = layouts.PatchPlan("wan", (("a", None),) * 30, False, None)
    geo = layouts.geometry(dm, plan, (1, 16, 21, 60, 105))  # 832x480 -> 60x104 latent is even; 105 is odd
    assert (geo.heads, geo.head_dim, geo.tokens, geo.layers) == (12, 128, 21 * 30 * 53, 30)
    assert layouts.geometry(dm, layouts.PatchPlan(None, (), False, "x"), (1, 16, 3, 8, 8)) is None


def test_geometry_of_the_other_families_and_the_joint_text_length():
    """Hunyuan3D 2.1 calls hold one time token beside the N latent tokens; a patch size that is not (t, h, w) gives no
    geometry (the estimate is then skipped, not wrong); a joint double block records the text length of ``txt`` for
    its call and the single blocks after it. Mutations: the time token dropped, the patch-size check dropped, the
    double blocks' text length not recorded."""
    attn = types.SimpleNamespace(num_heads=16, head_dim=64)
    dm = types.SimpleNamespace(blocks=[types.SimpleNamespace(attn1=attn)] * 2)
    geo = layouts.geometry(dm, layouts.PatchPlan("hunyuan3d21", (("a", None),) * 2, True, None), (1, 64, 4096))
    assert (geo.heads, geo.head_dim, geo.tokens, geo.layers) == (16, 64, 4097, 2)
    wan = types.SimpleNamespace(patch_size=(2, 2), num_heads=12, dim=1536)
    assert layouts.geometry(wan, layouts.PatchPlan("wan", (("a", None),), False, None), (1, 16, 3, 8, 8)) is None

    class HunyuanVideo(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.double_blocks = torch.nn.ModuleList([_Attn()])
            self.single_blocks = torch.nn.ModuleList([_Attn()])

    model = HunyuanVideo()
    plan = layouts.plan_for(model)
    (double_rel, double_factory), (single_rel, single_factory) = plan.patches
    options = {}
    double = double_factory(lambda x, txt=None, transformer_options=None: transformer_options[MARK_KEY])
    single = single_factory(model.single_blocks[0].forward)
    site = double(None, txt=torch.zeros(1, 7, 8), transformer_options=options)
    assert site.text_len == 7 and options[TEXT_LEN_KEY] == 7
    assert single(None, transformer_options=options).layer == 1


def test_geometry_of_minimax_h3_hunyuan_video_and_hunyuan3d20():
    """MiniMax-H3's video stream padded up to its patch (odd T, H, W; heads and head dim from its blocks' attention),
    HunyuanVideo's width from ``hidden_size`` (it has no ``dim``), Hunyuan3D 2.0's head dim from its double blocks'
    hidden size / heads. Mutations that left the suite green: H3's tokens rounded down, HunyuanVideo's geometry lost
    (no plan), Hunyuan3D 2.0's head dim fixed at 64."""
    plan = layouts.PatchPlan("minimax_h3", (("a", None),) * 3, False, None)
    h3 = types.SimpleNamespace(patch_size=(1, 2, 2),
                               blocks=[types.SimpleNamespace(attn=types.SimpleNamespace(heads=56, head_dim=128))])
    geo = layouts.geometry(h3, plan, (1, 24, 87, 95, 169))
    assert (geo.heads, geo.head_dim, geo.tokens, geo.layers) == (56, 128, 87 * 48 * 85, 3)
    hv = types.SimpleNamespace(patch_size=(1, 2, 2), num_heads=24, hidden_size=3072)
    geo = layouts.geometry(hv, layouts.PatchPlan("hunyuan_video", (("a", None),) * 2, False, None), (1, 16, 33, 68, 120))
    assert (geo.heads, geo.head_dim, geo.tokens, geo.layers) == (24, 128, 33 * 34 * 60, 2)
    block = types.SimpleNamespace(num_heads=16, hidden_size=2048)
    h3d = types.SimpleNamespace(double_blocks=[block])
    geo = layouts.geometry(h3d, layouts.PatchPlan("hunyuan3d", (("a", None),) * 2, False, None), (1, 64, 3072))
    assert (geo.heads, geo.head_dim, geo.tokens, geo.layers) == (16, 128, 3072, 2)


# -- presets, warm-up / anchor consistency, interrupted runs ---------------------------------------------------

@pytest.mark.parametrize("preset", ["quality", "balanced", "fast"])
def test_presets_ignore_the_custom_boxes_entirely(preset):
    """A preset neither uses nor validates density / dense warm-up / anchor steps (the tooltip's promise);
    the other inputs are still validated."""
    s = _settings(preset=preset, density=7.0, dense_warmup="abc", anchor_steps="abc")
    assert (s.density, s.warmup, s.anchors) == (settings.PRESETS[preset], None, None)
    s = _settings(preset=preset, dense_warmup="10", anchor_steps="5")  # contradictory only under custom
    assert (s.warmup, s.anchors) == (None, None)
    with pytest.raises(ValueError, match="query tile C"):
        _settings(preset=preset, anchor_steps="abc", query_tile=96)
    with pytest.raises(ValueError, match="anchor steps"):
        _settings(preset="custom", anchor_steps="abc")


@pytest.mark.parametrize("warmup,anchors", [("10", "5"), ("10", "26, 5"), ("50%", "20%, 60%")])
def test_same_unit_anchor_inside_warmup_is_rejected_by_the_node(warmup, anchors):
    """Same units (steps/steps or %/%): an anchor before the warm-up's last step stops the node, naming both."""
    with pytest.raises(ValueError, match=r"anchor steps must not come before the last dense warm-up step"):
        _settings(dense_warmup=warmup, anchor_steps=anchors)
    _settings(dense_warmup=warmup, anchor_steps=anchors.replace("5", "50").replace("20%", "50%"))  # at/after: fine


def test_mixed_unit_anchor_inside_warmup_moves_to_its_last_step_with_a_note():
    """Mixed units are compared per sampler call: the anchor moves to the warm-up's last step, noted."""
    r = settings.resolve_schedule(_settings(dense_warmup="10", anchor_steps="10%, 60%"), 50)
    assert (r.warmup_steps, r.anchor_steps) == (10, (9, 29))
    assert any("anchor steps 5 fall inside the dense warm-up" in n and "last step 10" in n for n in r.notes), r.notes
    r = settings.resolve_schedule(_settings(dense_warmup="50%", anchor_steps="3, 8"), 10)
    assert (r.warmup_steps, r.anchor_steps) == (5, (4, 7)) and any("moved" in n for n in r.notes)


def test_auto_warmup_with_custom_anchors_runs_dense_up_to_the_first_anchor():
    """auto warm-up: 20% with auto anchors; with custom anchors every step up to and including the first anchor
    (earlier or later than 20%); no anchor inside the call -> all dense."""
    assert settings.resolve_schedule(_settings(dense_warmup="auto", anchor_steps="auto"), 50).warmup_steps == 10
    r = settings.resolve_schedule(_settings(dense_warmup="auto", anchor_steps="5, 26"), 50)
    assert (r.warmup_steps, r.anchor_steps, r.notes) == (5, (4, 25), ())
    r = settings.resolve_schedule(_settings(dense_warmup="auto", anchor_steps="30, 40"), 50)
    assert (r.warmup_steps, r.anchor_steps) == (30, (29, 39))
    r = settings.resolve_schedule(_settings(dense_warmup="auto", anchor_steps="60"), 50)
    assert (r.warmup_steps, r.anchor_steps) == (50, ())


class InterruptProcessingException(Exception):  # noqa: N818  (ComfyUI's name)
    """Stand-in of ``comfy.model_management.InterruptProcessingException`` (same name)."""


def _outer_sample(monkeypatch, run_steps, raise_exc):
    """Drive ``outer_sample_wrapper`` like ``comfy/samplers.py`` L1032-1035: the executor evaluates the model
    through ``calc_cond_batch_wrapper`` (args ``(model, conds, x_in, timestep, model_options)``) for
    ``run_steps`` sigmas, one self-attention call each, then raises ``raise_exc`` (or returns)."""
    import logging

    from ._comfy_standins import install_comfy_modules

    install_comfy_modules(monkeypatch)
    holder = lifecycle.MCSparsePatch(_settings(dense_warmup="1", anchor_steps="1"), "wan")
    guider = types.SimpleNamespace(model_options={"transformer_options": {lifecycle.HOLDER_KEY: holder}})
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 128, 64, generator=gen)

    def executor(noise, latent, sampler, sigmas):
        for sigma in sigmas[:run_steps]:
            def inner(model, conds, x, timestep, model_options):
                opts = {**model_options["transformer_options"], MARK_KEY: CallSite(0, "wan"),
                        "cond_or_uncond": [0], "uuids": ["u0"], "sigmas": timestep}
                return opts["optimized_attention_override"](_func, q, q, q, 2, skip_reshape=True,
                                                            transformer_options=opts)
            lifecycle.calc_cond_batch_wrapper(inner, None, None, None, sigma.reshape(1), guider.model_options)
        if raise_exc is not None:
            raise raise_exc
        return "done"

    executor.class_obj = guider
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger(lifecycle.__name__)
    old_level = log.level
    log.setLevel(logging.INFO)
    log.addHandler(handler)
    try:
        result = lifecycle.outer_sample_wrapper(executor, None, None, None, torch.tensor([1.0, 0.8, 0.6, 0.4, 0.0]))
    except BaseException as err:
        result = err
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)
    summaries = [r.getMessage() for r in records if r.getMessage().startswith("MC-Sparse:") and not r.exc_info]
    assert len(summaries) == 1 and not holder.active_runs
    return result, summaries[0], records[-1].levelno


def test_interrupted_run_says_so_in_its_summary(monkeypatch):
    """An exception (ComfyUI's interrupt, OOM, ...) during sampling: the summary's first line says the run was
    interrupted after which step and by what, gives the counts so far, and the exception still propagates."""
    err, text, level = _outer_sample(monkeypatch, 3, InterruptProcessingException("interrupted"))
    assert isinstance(err, InterruptProcessingException)
    head = text.splitlines()[0]
    assert head.startswith("MC-Sparse: run interrupted after step 3 of 4 (InterruptProcessingException): "
                           "2 sparse, 1 anchor, 0 dense attention calls so far"), head
    assert "WARNING: no attention call went sparse" not in text and level == logging.WARNING
    err, text, _ = _outer_sample(monkeypatch, 0, RuntimeError("CUDA out of memory"))
    assert text.startswith("MC-Sparse: run interrupted before its first step (RuntimeError): 0 sparse"), text
    result, text, level = _outer_sample(monkeypatch, 4, None)
    assert result == "done" and text.startswith("MC-Sparse: 75% of self-attention sparse, cache in ")
    assert "  calls: 3 sparse, 1 anchor, 0 dense over 4 steps" in text
    assert "interrupted" not in text and level == logging.INFO
