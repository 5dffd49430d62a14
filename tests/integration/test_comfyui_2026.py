"""ComfyUI v0.33.0 only (COMFYUI_2026_DIR): MiniMax-H3 through ComfyUI's own loader and sampler, ComfyUI's
``block_index``, and comfy-kitchen / AttentionTensorContainer attention while the node is active.

H3 checks spy on ComfyUI's copy of ``adapter.override.dispatch`` (what the container entry calls with the
peeked ``[1, H, S, D]`` tensors) and compare with exact float64 attention: every non-video row (text,
keyframe conditions, audio) is exact on every call, including the sparse ones; the video rows of reuse calls
are not (they went sparse); at density 1.0 every row is exact. The expected video start is computed here from
the shapes (text + 2 x audio frames + condition rows), not from the model's PackedLayout, so a wrong layout
fails.
"""

import importlib.util
import math
from pathlib import Path

import pytest
import torch

_spec = importlib.util.spec_from_file_location("mc_sparse_h3_tiny", Path(__file__).with_name("h3_tiny.py"))
h3_tiny = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(h3_tiny)

pytestmark = pytest.mark.comfyui("v0.33.0")

PATCH = {"preset": "custom", "density": 0.3, "dense_warmup": "auto", "warmup_layers": 0, "anchor_steps": "auto",
         "query_tile": "64", "cache_placement": "auto", "backend": "torch", "min_tokens": 0, "verbose": False}


def _patch(nodes, model, **over):
    return nodes.NODE_CLASS_MAPPINGS["MCSparsePatch"].execute(model, **{**PATCH, **over}).result[0]


def _reference(q, k, v):
    """Exact attention in float64, ``[B, H, S, D]`` in, ``[B, S, H*D]`` out."""
    p = torch.softmax(q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1]), -1)
    out = p @ v.double()
    b, h, s, d = out.shape
    return out.transpose(1, 2).reshape(b, s, h * d)


@pytest.fixture
def spy(comfy, monkeypatch):
    """Every marked call: site, transformer_options, q/k/v as dispatched, our output, whether it was a reuse."""
    headless, _ = comfy
    override = headless.comfy_pack_module("comfyui_mc_sparse.adapter.override")
    real = override.dispatch
    calls = []

    def wrapped(run, site, q, k, v, heads, **kw):
        before = run.counts()["sparse"]
        out = real(run, site, q, k, v, heads, **kw)
        if site is not None:
            calls.append({"site": site, "options": kw["options"], "q": q, "k": k, "v": v, "out": out,
                          "reuse": run.counts()["sparse"] > before, "skip_reshape": kw["skip_reshape"]})
        return out

    monkeypatch.setattr(override, "dispatch", wrapped)
    return calls


def _h3_model(comfy):
    headless, nodes = comfy
    name = h3_tiny.write_checkpoint(headless.models_dir())
    model = nodes.UNETLoader().load_unet(name, "default")[0]
    assert type(model.get_model_object("diffusion_model")).__name__ == "MiniMaxH3Model"
    return model


def _h3_sample(nodes, model, *, pos_extra=None, steps=6, cfg=5.0):
    latent = h3_tiny.av_latent()
    pos = h3_tiny.conditioning(1, **(pos_extra or {}))
    neg = h3_tiny.conditioning(2)
    out = nodes.common_ksampler(model, 3, steps, cfg, "euler", "simple", pos, neg, latent)[0]["samples"]
    return out


def _check_h3_calls(calls, *, video_start, exact_video=False):
    """Non-video rows exact on every call; video rows of reuse calls differ from exact unless density 1."""
    text_lens = {c["options"].get("mc_sparse_text_len") for c in calls}
    assert text_lens == {video_start}, text_lens
    reuse = [c for c in calls if c["reuse"]]
    assert reuse, "no H3 call ran the sparse path"
    for c in calls:
        q, out = c["q"], c["out"]
        assert c["skip_reshape"] and q.dim() == 4 and q.shape[0] == 1  # [1, H, S, D] views, as the model made them
        ref = _reference(q, c["k"], c["v"])
        torch.testing.assert_close(out[:, :video_start].double(), ref[:, :video_start], rtol=1e-4, atol=1e-4)
        if exact_video:
            torch.testing.assert_close(out.double(), ref, rtol=1e-3, atol=1e-3)
    if not exact_video:
        c = reuse[-1]
        ref = _reference(c["q"], c["k"], c["v"])
        assert (c["out"][:, video_start:].double() - ref[:, video_start:]).abs().max() > 1e-4  # video went sparse
    return reuse


def test_h3_text_video_through_loader_and_sampler(comfy, summaries, spy):
    """t2va: [text 24 | audio 2 x 37 | video 7 x 8 x 8]: UNETLoader detects H3, KSampler samples the AV latent,
    the video rows go sparse (counters), text and audio rows are exact; density 1.0 equals the unpatched run."""
    _, nodes = comfy
    base = _h3_model(comfy)
    out = _h3_sample(nodes, _patch(nodes, base))
    assert all(torch.isfinite(t).all() for t in out.unbind())
    c = summaries.counts()
    text = summaries.summaries[-1]
    assert c["sparse"] > 0 and c["anchor"] > 0, text
    assert "only the target video rows are sparse" in text
    blocks = {call["site"].layer for call in spy}
    assert blocks == set(range(h3_tiny.BLOCKS))
    _check_h3_calls(spy, video_start=24 + 2 * 37)

    spy.clear()
    full = _h3_sample(nodes, _patch(nodes, base, density=0.99))  # every key kept: the machinery equals dense
    _check_h3_calls(spy, video_start=24 + 2 * 37, exact_video=True)
    plain = _h3_sample(nodes, base)
    for a, b in zip(full.unbind(), plain.unbind()):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
    one = _h3_sample(nodes, _patch(nodes, base, density=1.0))  # density 1: the unpatched model, bit for bit
    assert all(torch.equal(a, b) for a, b in zip(one.unbind(), plain.unbind()))


def test_h3_with_audio_and_video_guides(comfy, summaries, spy):
    """fl2va-style keyframe (MiniMaxH3AddGuide's conditioning form) with a video guide and an AUDIO guide:
    [text 24 | cond 64 | cond_audio 16 | audio 74 | video 448] on the positive branch, [text | audio | video] on the
    negative: each branch gets its own layout from the model's PackedLayout; only video rows go sparse."""
    _, nodes = comfy
    base = _h3_model(comfy)
    kf = h3_tiny.keyframe(5, audio_t=8)
    out = _h3_sample(nodes, _patch(nodes, base), pos_extra={"minimax_keyframes": [kf]})
    assert all(torch.isfinite(t).all() for t in out.unbind())
    assert summaries.counts()["sparse"] > 0, summaries.summaries[-1]
    with_guides = [c for c in spy if c["q"].shape[2] == 24 + 64 + 16 + 74 + 448]
    plain = [c for c in spy if c["q"].shape[2] == 24 + 74 + 448]
    assert with_guides and plain and len(with_guides) + len(plain) == len(spy)
    segments = with_guides[0]["options"]["mc_sparse_h3_segments"]
    assert [s[2] for s in segments] == ["text", "cond", "cond_audio", "audio", "video"], segments
    _check_h3_calls(with_guides, video_start=24 + 64 + 16 + 74)
    _check_h3_calls(plain, video_start=24 + 74)


def test_h3_preset_follows_published_schedule(comfy, summaries):
    """Preset 'fast' on H3: the published schedule scaled (10 of 49 dense, one anchor at the last dense step),
    block 0 dense, min 4096 video tokens: the tiny 448-token video stays dense and the summary says why."""
    _, nodes = comfy
    _h3_sample(nodes, _patch(nodes, _h3_model(comfy), preset="fast", warmup_layers=1, min_tokens=2048), steps=10)
    text = summaries.summaries[-1]
    assert "published H3 schedule" in text and "dense warm-up 2 steps" in text, text
    assert "anchors at steps 2 (1-based)" in text, text
    assert "448 latent tokens per attention call, fewer than min tokens (4096)" in text, text  # decided up front


def test_block_index_from_transformer_options(comfy, summaries, spy):
    """Wan on the 2026 model code sets transformer_options["block_index"] / ["block_type"] before each block:
    every marked self-attention call sees ComfyUI's index equal to the marked block, and no disagreement note."""
    headless, nodes = comfy
    base = nodes.UNETLoader().load_unet(headless.write_tiny_checkpoint("wan21_t2v"), "default")[0]
    shifted = nodes.NODE_CLASS_MAPPINGS["ModelSamplingSD3"]().patch(_patch(nodes, base), 8.0)[0]
    g = torch.Generator().manual_seed(0)
    cond = [[torch.randn(1, 64, 4096, generator=g), {}]]
    nodes.common_ksampler(shifted, 3, 6, 5.0, "euler", "simple", cond, cond, {"samples": torch.zeros(1, 16, 3, 16, 16)})
    assert spy and summaries.counts()["sparse"] > 0
    for c in spy:
        assert c["options"]["block_index"] == c["site"].layer and c["options"]["block_type"] == "double"
    assert "differs from the marked block" not in summaries.summaries[-1]


def test_attention_backend_node_and_containers_while_active(comfy, summaries, spy):
    """ComfyUI's ModelAttentionBackend after the patch node (it writes the same override key): MC-Sparse stays on
    top and chains it; H3's AttentionTensorContainer inputs reach the chained backend's container path on dense
    calls and the sparse path on reuse calls."""
    import comfy.ldm.modules.attention as attention

    _, nodes = comfy
    backend_node = nodes.NODE_CLASS_MAPPINGS["ModelAttentionBackend"]
    options = backend_node.INPUT_TYPES()["required"]["attention"][0]
    choice = "comfy kitchen attention" if "comfy kitchen attention" in options else "pytorch attention"
    # warmup_layers 1: block 0 runs dense in every step, through the chained backend (the whole call dense)
    patched = backend_node().patch(_patch(nodes, _h3_model(comfy), warmup_layers=1), choice)[0]
    seen = {"container": 0}
    chained = patched.model_options["transformer_options"]["optimized_attention_override"]
    inner = getattr(chained, "container_function", None)

    def counting(*args, **kwargs):
        seen["container"] += 1
        if inner is not None:
            return inner(*args, **kwargs)
        q, k, v = (c.take() for c in args[:3])
        return attention.optimized_attention(q, k, v, *args[3:], **kwargs)

    chained.container_function = counting
    out = _h3_sample(nodes, patched)
    assert all(torch.isfinite(t).all() for t in out.unbind())
    text = summaries.summaries[-1]
    assert summaries.counts()["sparse"] > 0 and "another attention override" in text, text
    assert seen["container"] > 0  # dense warm-up calls went through the chained backend's container entry
    _check_h3_calls(spy, video_start=24 + 2 * 37)


@pytest.mark.parametrize(("kind", "cls", "extra_tokens"), [
    ("wan21_scail", "SCAILWanModel", 3 * 4 * 4),  # the pose latent's tokens, appended to the video's
    ("wan22_wandancer", "WanDancerModel", 0),
])
def test_wan_variants_of_the_2026_snapshot_go_sparse(comfy, summaries, spy, kind, cls, extra_tokens):
    """SCAIL (pose tokens appended to the video's, ``wan/model.py`` SCAILWanModel) and WanDancer (music injected
    after blocks, ``wan/model_wandancer.py``) run Wan's own blocks: their self-attention goes sparse over the whole
    sequence the block sees. Anchor / dense calls are exact; the last reuse call is not (it went sparse)."""
    headless, nodes = comfy
    model = nodes.UNETLoader().load_unet(headless.write_tiny_checkpoint(kind), "default")[0]
    assert type(model.get_model_object("diffusion_model")).__name__ == cls
    g = torch.Generator().manual_seed(7)
    extra = {"pose_video_latent": torch.randn(1, 16, 3, 8, 8, generator=g)} if kind == "wan21_scail" else \
        {"audio_embed": torch.randn(1, 12, 35, generator=g)}
    pos = [[torch.randn(1, 64, 4096, generator=g), dict(extra)]]
    neg = [[torch.randn(1, 64, 4096, generator=g), dict(extra)]]
    nodes.common_ksampler(_patch(nodes, model), 3, 6, 5.0, "euler", "simple", pos, neg,
                          {"samples": torch.zeros(1, 16, 3, 16, 16)})
    assert "not supported" not in summaries.summaries[-1]
    assert summaries.counts()["sparse"] > 0 and summaries.counts()["anchor"] > 0
    assert spy and {c["q"].shape[1] for c in spy} == {3 * 8 * 8 + extra_tokens}
    for c in spy:
        if not c["reuse"]:
            h = c["q"].shape[-1] // 128
            q, k, v = (t.unflatten(-1, (h, 128)).transpose(1, 2) for t in (c["q"], c["k"], c["v"]))
            torch.testing.assert_close(c["out"].double(), _reference(q, k, v), rtol=1e-3, atol=1e-3)
    c = [c for c in spy if c["reuse"]][-1]
    h = c["q"].shape[-1] // 128
    q, k, v = (t.unflatten(-1, (h, 128)).transpose(1, 2) for t in (c["q"], c["k"], c["v"]))
    assert (c["out"].double() - _reference(q, k, v)).abs().max() > 1e-4
