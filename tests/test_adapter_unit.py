"""Unit tests of the ComfyUI adapter against small stand-ins of ComfyUI contracts (no ComfyUI needed).

Stand-ins (``tests/_comfy_standins.py``, each citing the ComfyUI Oct-2025 lines it mirrors): ``_func`` a raw
attention backend, ``_options`` the transformer_options of one model call.
"""

import functools
import json
from pathlib import Path

import pytest
import torch
from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter import lifecycle, override, settings, steps
from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter.callsite import TEXT_LEN_KEY, CallSite

from ._comfy_standins import raw_attention as _func
from ._comfy_standins import transformer_options

ROOT = Path(__file__).resolve().parent.parent


def _settings(**over):
    base = dict(preset="custom", density=0.5, dense_warmup="auto", warmup_layers=0, anchor_steps="auto", query_tile=64,
                cache_placement="auto", backend="auto", min_tokens=0, verbose=False)
    return settings.build_settings(**{**base, **over})


def test_build_settings_rejects_bad_inputs_naming_them():
    """Bad widget values raise ValueError naming the input and the value."""
    with pytest.raises(ValueError, match="density must be in"):
        _settings(density=1.5)
    with pytest.raises(ValueError, match="anchor steps"):
        _settings(anchor_steps="ten")
    with pytest.raises(ValueError, match="dense warm-up"):
        _settings(dense_warmup="-3")
    with pytest.raises(ValueError, match="query tile C"):
        _settings(query_tile=96)
    with pytest.raises(ValueError, match="anchor steps must not come before"):
        _settings(dense_warmup="10", anchor_steps="5, 26")
    assert _settings(preset="fast").density == 0.15


def test_resolve_schedule_scales_paper_and_percent():
    """auto = paper schedule scaled; percents resolve per sampler call; anchors past the end are dropped."""
    r = settings.resolve_schedule(_settings(), 50)
    assert (r.warmup_steps, r.anchor_steps) == (10, (9,))
    r = settings.resolve_schedule(_settings(dense_warmup="20%", anchor_steps="20%, 52%"), 10)
    assert (r.warmup_steps, r.anchor_steps) == (2, (1, 5))  # a second anchor is an option of custom
    r = settings.resolve_schedule(_settings(dense_warmup="6"), 30)
    assert (r.warmup_steps, r.anchor_steps) == (6, (5,))  # own warm-up, auto anchors: one, on its last step
    r = settings.resolve_schedule(_settings(dense_warmup="2", anchor_steps="2, 26"), 10)
    assert r.anchor_steps == (1,) and any("dropped" in n for n in r.notes)


@pytest.mark.parametrize("preset,density", [("quality", 0.25), ("balanced", 0.20), ("fast", 0.15)])
def test_presets_run_the_published_schedule(preset, density):
    """Every preset: its density, 20 % dense warm-up, ONE anchor on the last warm-up step, block 0 dense; the
    custom boxes (density, warm-up, warm-up layers, anchors) are ignored."""
    s = _settings(preset=preset, density=0.9, dense_warmup="3", warmup_layers=5, anchor_steps="3, 26")
    assert (s.density, s.warmup_layers, s.warmup, s.anchors) == (density, 1, None, None)
    for steps, warmup in ((50, 10), (49, 10), (30, 6), (20, 4), (8, 2)):
        r = settings.resolve_schedule(s, steps)
        assert (r.warmup_steps, r.anchor_steps, r.notes) == (warmup, (warmup - 1,), ())


@pytest.mark.parametrize("sampler_sigmas,sigma,expected", [
    ([1.0, 0.8, 0.5, 0.2, 0.0], 0.8, 1),      # first-order: exact entry
    ([1.0, 0.8, 0.5, 0.2, 0.0], 0.65, 1),     # ancestral: between entries -> the interval's step
    ([1.0, 0.8, 0.5, 0.2, 0.0], 0.2, 3),      # last step
    ([0.889, 0.7, 0.616], 0.889, 0),          # split sampler: local schedule not starting at 1
    ([1.0, 0.8, 0.5, 0.2, 0.0], 1.2, 0),      # above the schedule: clamp
    ([1.0, 0.8, 0.5, 0.2, 0.0], 0.8 * (1 + 5e-5), 1),  # an entry read back a little high (float32 sigma): same step
    ([1.0, 0.8, 0.5, 0.2, 0.0], 0.8 * (1 + 1e-3), 0),  # beyond the tolerance: still the previous interval
    ([1.0, 0.8, 0.5, 0.2, 0.0], 0.0, 3),      # the schedule's final 0 (no step of its own): the last step
])
def test_step_index(sampler_sigmas, sigma, expected):
    """The step is the schedule interval holding the sigma (heun/ancestral/split samplers)."""
    assert steps.step_index(sigma, torch.tensor(sampler_sigmas)) == expected


def test_step_index_refuses_a_schedule_without_steps_and_a_nan_sigma():
    with pytest.raises(ValueError, match="at least 2 values"):
        steps.step_index(0.5, torch.tensor([1.0]))
    with pytest.raises(ValueError, match="NaN"):
        steps.step_index(float("nan"), torch.tensor([1.0, 0.0]))
    assert steps.step_index(0.5, [1.0, 0.0]) == 0  # a plain list works as the tensor does
    assert steps.current_sigma({"sigmas": torch.tensor([])}) is None  # an empty batch: no sigma, no error


_options = functools.partial(transformer_options, chunks=2, sigma=0.5)


@pytest.mark.parametrize("skip_reshape,skip_output_reshape", [(False, False), (True, False), (True, True),
                                                             (False, True)])
def test_override_layouts_and_reuse_matches_dense_at_full_density(gen, skip_reshape, skip_output_reshape):
    """Both layouts and skip_output_reshape are honoured; at density 0.99 (every key kept once K is rounded up to
    the KV tile) the anchor and reuse paths equal dense. skip_output_reshape gives [B, H, S, D] whatever the input
    layout, as ComfyUI's backends (``attention_pytorch``: before, [B, S, H*D] came back for (False, True))."""
    sig = torch.tensor([1.0, 0.8, 0.6, 0.4, 0.2, 0.0])
    run = lifecycle.RunState(_settings(density=0.99, dense_warmup="1", anchor_steps="1"), sig)
    over = override.make_override(None)
    b, h, s, d = 2, 2, 160, 64  # 160 tokens: not a multiple of C=64
    q, k, v = (torch.randn(b, h, s, d, generator=gen) for _ in range(3))
    args = (q, k, v) if skip_reshape else tuple(t.transpose(1, 2).reshape(b, s, h * d) for t in (q, k, v))
    site = CallSite(0, "wan")
    ref = _func(*args, h, skip_reshape=skip_reshape, skip_output_reshape=skip_output_reshape)
    for sigma in (1.0, 0.8):  # anchor at step 0, reuse at step 1
        out = over(_func, *args, h, skip_reshape=skip_reshape, skip_output_reshape=skip_output_reshape,
                   transformer_options=_options(run, site, sigma=sigma))
        assert out.shape == ref.shape == ((b, h, s, d) if skip_output_reshape else (b, s, h * d))
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert run.counts()["sparse"] == 2 and run.counts()["anchor"] == 2  # two cond chunks each


def test_override_passes_through_unmarked_masked_and_outside_runs(gen):
    """Cross-attention (unmarked), masked calls and calls outside a run go to func unchanged, counted."""
    run = lifecycle.RunState(_settings(), torch.linspace(1, 0, 9))
    over = override.make_override(None)
    q = torch.randn(2, 128, 128, generator=gen)
    kx = torch.randn(2, 512, 128, generator=gen)
    out = over(_func, q, kx, kx, 2, transformer_options=_options(run, None))
    torch.testing.assert_close(out, _func(q, kx, kx, 2))
    assert over(_func, q, q, q, 2, transformer_options={}).shape == q.shape
    mask = torch.zeros(1, 1, 128)
    over(_func, q, q, q, 2, mask=mask, transformer_options=_options(run, CallSite(0, "wan")))
    reasons = run.runner.stats.dense_reasons
    assert any("not a marked" in r for r in reasons) and reasons["masked attention"] == 1


def test_override_chains_previous_and_installer_is_idempotent():
    """install_override chains a foreign override once and reports it; ours is never stacked twice."""
    calls = []

    def foreign(func, *a, **kw):
        calls.append(1)
        return func(*a, **kw)

    options = {"optimized_attention_override": foreign}
    assert override.install_override(options) is not None
    assert override.install_override(options) is None
    q = torch.randn(1, 8, 128)
    options["optimized_attention_override"](_func, q, q, q, 1, transformer_options={})
    assert calls == [1]


def test_joint_video_text_keeps_text_rows_exact_and_respects_mask(gen):
    """HunyuanVideo-style [video, text]: text query rows exact; padded text keys (mask) carry no weight."""
    sig = torch.tensor([1.0, 0.8, 0.6, 0.0])
    run = lifecycle.RunState(_settings(density=0.5, dense_warmup="1", anchor_steps="1"), sig)
    over = override.make_override(None)
    b, h, sv, st, d = 1, 2, 192, 16, 128
    q, k, v = (torch.randn(b, h, sv + st, d, generator=gen) for _ in range(3))
    mask = torch.zeros(1, 1, sv + st)
    mask[..., -4:] = -torch.finfo(torch.float32).max  # 4 padded text tokens
    site = CallSite(0, "hunyuan_video", "video_first")
    ref = _func(q, k, v, h, mask=mask.unsqueeze(1), skip_reshape=True, skip_output_reshape=True)
    for sigma in (1.0, 0.8):
        opts = {**_options(run, site, chunks=1, sigma=sigma), TEXT_LEN_KEY: st}
        out = over(_func, q, k, v, h, mask=mask, skip_reshape=True, skip_output_reshape=True, transformer_options=opts)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out[:, :, sv:], ref[:, :, sv:], rtol=1e-4, atol=1e-4)
    assert run.counts()["sparse"] == 1


def test_holder_deepcopy_is_fresh_and_runstate_shared():
    """ModelPatcher.clone deep-copies model_options (model_patcher.py L293): holder fresh, run state shared."""
    import copy

    holder = lifecycle.MCSparsePatch(_settings(), "wan")
    holder.active_runs.append(object())
    clone = copy.deepcopy({"h": holder})["h"]
    assert clone is not holder and clone.settings == holder.settings and clone.active_runs == []
    run = lifecycle.RunState(_settings(), torch.linspace(1, 0, 5))
    assert copy.deepcopy(run) is run


def test_workflows_match_node_definitions():
    """Every shipped workflow has the patch node with the frozen input names (UI widgets in schema order,
    API inputs by name), and every API link points at a node that exists."""
    frozen = ["preset", "density", "dense_warmup", "warmup_layers", "anchor_steps", "query_tile", "cache_placement",
              "backend", "min_tokens", "verbose", "residual_precision", "memory_headroom_gib"]
    files = sorted((ROOT / "workflows").glob("*.json"))
    assert len(files) >= 6
    for path in files:
        data = json.loads(path.read_text(encoding="utf-8"))
        if path.name.endswith("_api.json"):
            patches = [n for n in data.values() if n["class_type"] == "MCSparsePatch"]
            assert patches, path.name
            for node in patches:
                assert [k for k in node["inputs"] if k != "model"] == frozen, path.name
                assert node["inputs"]["model"][0] in data
            for node in data.values():
                for val in node["inputs"].values():
                    if isinstance(val, list) and len(val) == 2 and isinstance(val[0], str):
                        assert val[0] in data, (path.name, val)
        else:
            graphs = [data] + data.get("definitions", {}).get("subgraphs", [])
            patches = [n for g in graphs for n in g["nodes"] if n["type"] == "MCSparsePatch"]
            assert patches, path.name
            for node in patches:
                assert len(node["widgets_values"]) == len(frozen)
                settings.build_settings(**dict(zip(frozen, [*node["widgets_values"][:5], int(node["widgets_values"][5]),
                                                            *node["widgets_values"][6:]])))
