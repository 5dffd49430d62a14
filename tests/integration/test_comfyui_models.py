"""MC-Sparse in a real ComfyUI (COMFYUI_DIR): HunyuanVideo, context windows, VACE, Hunyuan3D 2.0 and a LoRA.

Tiny random checkpoints with the real key names (``tools.headless.write_tiny_checkpoint``), loaded by
ComfyUI's own loaders and detection; CPU. Counters and cache keys come from the run summary the OUTER_SAMPLE
wrapper logs ("MC-Sparse: N sparse, M anchor, K dense ..." and "cache entries: ..."). Joint-sequence checks
spy on ComfyUI's copy of ``adapter.override.dispatch`` and compare with an exact float64 reference.
"""

import math
import re

import pytest
import torch

PATCH = {"preset": "custom", "density": 0.3, "dense_warmup": "auto", "warmup_layers": 0, "anchor_steps": "auto",
         "query_tile": "64", "cache_placement": "auto", "backend": "torch", "min_tokens": 0, "verbose": False}


def _patch(nodes, model, **over):
    return nodes.NODE_CLASS_MAPPINGS["MCSparsePatch"].execute(model, **{**PATCH, **over}).result[0]


def _load(comfy, kind):
    headless, nodes = comfy
    return nodes.UNETLoader().load_unet(headless.write_tiny_checkpoint(kind), "default")[0]


def _cond(seed, tokens=64, width=4096, **extra):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(1, tokens, width, generator=g), extra]]


def _wan_sample(nodes, model, latent, *, steps=6, cfg=5.0, pos=None, neg=None):
    shifted = nodes.NODE_CLASS_MAPPINGS["ModelSamplingSD3"]().patch(model, 8.0)[0]
    return nodes.common_ksampler(shifted, 3, steps, cfg, "euler", "simple", pos or _cond(1), neg or _cond(2),
                                 {"samples": latent})[0]["samples"]


def _cache_line(text):
    m = re.search(r"cache entries: (\d+) keys over (\d+) blocks?, (\d+) conditioning branch(?:es)?, (\w+) context "
                  r"windows, kinds ([\w#, ]+)", text)
    assert m, text
    return {"keys": int(m[1]), "blocks": int(m[2]), "branches": int(m[3]),
            "windows": 0 if m[4] == "no" else int(m[4]), "kinds": m[5].split(", ")}


def _masked_reference(q, k, v, mask):
    """Exact attention in float64, ``[B, H, S, D]`` in, ``[B, S, H*D]`` out (the flux ``attention`` layout)."""
    scores = q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores + mask.double().reshape(1, 1, 1, -1)
    out = torch.softmax(scores, -1) @ v.double()
    b, h, s, d = out.shape
    return out.transpose(1, 2).reshape(b, s, h * d)


@pytest.fixture
def joint_spy(comfy, monkeypatch):
    """Record every marked joint call: q/k/v/mask as ComfyUI passed them, our output, and whether it ran the
    sparse path (a reuse call)."""
    headless, _ = comfy
    override = headless.comfy_pack_module("comfyui_mc_sparse.adapter.override")
    real = override.dispatch
    calls = []

    def spy(run, site, q, k, v, heads, **kw):
        before = run.counts()["sparse"]
        out = real(run, site, q, k, v, heads, **kw)
        if site is not None and site.joint is not None:
            text_len = site.text_len if site.text_len is not None else kw["options"][override.TEXT_LEN_KEY]
            calls.append({"site": site, "text_len": int(text_len), "q": q, "k": k, "v": v, "mask": kw["mask"], "out": out,
                          "reuse": run.counts()["sparse"] > before, "skip_reshape": kw["skip_reshape"]})
        return out

    monkeypatch.setattr(override, "dispatch", spy)
    return calls


def _check_joint_calls(calls, *, padded):
    """Text rows exact (with the mask) on every joint call, including the sparse ones; the mask is there."""
    reuse = [c for c in calls if c["reuse"]]
    assert reuse, "no joint call ran the sparse path"
    for c in calls:
        q, k, v, mask, out = c["q"], c["k"], c["v"], c["mask"], c["out"]
        assert c["skip_reshape"] and q.dim() == 4
        seq = q.shape[2]
        text_len = c["text_len"]
        text = slice(seq - text_len, seq) if c["site"].joint == "video_first" else slice(0, text_len)
        if padded:
            assert mask is not None and int((mask.reshape(-1) <= -1e4).sum()) == padded
        else:
            assert mask is None
        ref = _masked_reference(q, k, v, mask)
        torch.testing.assert_close(out[:, text].double(), ref[:, text], rtol=1e-4, atol=1e-4)
    if padded:  # the check is sensitive to the mask: without it, the text rows differ
        c = reuse[0]
        seq = c["q"].shape[2]
        text = slice(seq - c["text_len"], seq) if c["site"].joint == "video_first" else slice(0, c["text_len"])
        unmasked = _masked_reference(c["q"], c["k"], c["v"], None)
        assert (unmasked[:, text] - c["out"][:, text].double()).abs().max() > 1e-3
    return reuse


def _hunyuan_prompt(headless, unet, *, patch=True, density=0.3, steps=6):
    prompt = headless.tinyfy_prompt(
        headless.load_api_workflow("hunyuan_video_t2v_mc_sparse_api.json"), unet_name=unet, width=128, height=128,
        length=9, steps=steps, patch_inputs={**PATCH, "density": density}, text_tokens=24, pooled_width=768,
        padded_tokens=6)
    if not patch:  # bypass: everything that read the patch node reads the loader
        pid = next(n for n, node in prompt.items() if node["class_type"] == "MCSparsePatch")
        src = prompt.pop(pid)["inputs"]["model"]
        for node in prompt.values():
            for name, val in node["inputs"].items():
                if isinstance(val, list) and val and val[0] == pid:
                    node["inputs"][name] = list(src)
    return prompt


def test_hunyuan_video_shipped_workflow(comfy, summaries, joint_spy):
    """HunyuanVideo through the shipped API workflow (BasicGuider + SamplerCustomAdvanced, synthetic text with
    6 padded tokens): sparse at reuse steps, token-refiner calls passed through, text rows exact with the mask,
    density 0.99 (every key kept) runs the machinery and matches the unpatched (bypassed) workflow, and density 1.0
    is the unpatched workflow bit for bit."""
    headless, nodes = comfy
    unet = headless.write_tiny_checkpoint("hunyuan_video")
    result = headless.execute_prompt(_hunyuan_prompt(headless, unet))
    assert result["success"], result["messages"]
    c = summaries.counts()
    assert c["sparse"] > 0 and c["anchor"] > 0, summaries.summaries[-1]
    text = summaries.summaries[-1]
    refiner_blocks = 2  # TokenRefiner depth of the tiny model (hunyuan_video/model.py L150-166), one forward/step
    m = re.search(r"dense x(\d+): not a marked self-attention call", text)
    assert m and int(m[1]) == 6 * refiner_blocks, text  # every refiner call passed through, nothing else
    assert _cache_line(text)["blocks"] == 4  # 2 double + 2 single blocks
    _check_joint_calls(joint_spy, padded=6)

    joint_spy.clear()
    full = headless.execute_prompt(_hunyuan_prompt(headless, unet, density=0.99))
    assert summaries.counts()["sparse"] > 0
    for call in joint_spy:  # every row (video too) equals masked dense attention when every key is kept
        ref = _masked_reference(call["q"], call["k"], call["v"], call["mask"])
        torch.testing.assert_close(call["out"].double(), ref, rtol=1e-3, atol=1e-3)
    plain = headless.execute_prompt(_hunyuan_prompt(headless, unet, patch=False))
    torch.testing.assert_close(full["latents"][0], plain["latents"][0], rtol=2e-3, atol=2e-3)
    one = headless.execute_prompt(_hunyuan_prompt(headless, unet, density=1.0))
    assert torch.equal(one["latents"][0], plain["latents"][0])


def test_context_windows_keep_caches_per_window(comfy, summaries):
    """WanContextWindowsManual (2 windows of 3 latent frames): one cache entry per window x block x branch, the
    step is not advanced per window (state shared across windows would advance it once per window), no late anchors; at
    density 1.0 the windowed run equals the unpatched windowed run."""
    import comfy.context_windows as cw

    _, nodes = comfy
    base = _load(comfy, "wan21_t2v")
    ctx = nodes.NODE_CLASS_MAPPINGS["WanContextWindowsManual"]

    import inspect

    newer = {"freenoise": False, "retain_first_frame": False, "split_conds_to_windows": False}  # v0.33.0 inputs
    params = inspect.signature(ctx.execute).parameters
    extra = {k: v for k, v in newer.items() if k in params}

    def windowed(model):  # 9 frames -> 3 latent frames per window, overlap 1 -> 1 frame: windows [0-2], [2-4]
        return ctx.execute(model, 9, 1, cw.ContextSchedules.STATIC_STANDARD, 1, False,
                           cw.ContextFuseMethods.PYRAMID, **extra).result[0]

    _wan_sample(nodes, _patch(nodes, base), torch.zeros(1, 16, 3, 16, 16))  # no windows: 3 frames, 192 tokens
    single = summaries.counts()
    _wan_sample(nodes, windowed(_patch(nodes, base)), torch.zeros(1, 16, 5, 16, 16))
    text = summaries.summaries[-1]
    keys = _cache_line(text)
    assert keys == {"keys": 3 * 2 * 2, "blocks": 3, "branches": 2, "windows": 2, "kinds": ["self"]}, text
    assert summaries.counts()["sparse"] == 2 * single["sparse"] and summaries.counts()["anchor"] == 2 * single["anchor"]
    assert "late anchor" not in text

    z = torch.zeros(1, 16, 5, 16, 16)
    ref = _wan_sample(nodes, windowed(base), z)
    out = _wan_sample(nodes, windowed(_patch(nodes, base, density=1.0)), z)
    assert torch.equal(out, ref)


def test_vace_blocks_get_their_own_cache_entries(comfy, summaries):
    """VaceWanModel with two VACE contexts: VACE blocks (attached to main blocks 0 and 2) are keyed by kind
    "vace" and per context ("vace#1"), apart from the main blocks; no late anchors; density 1.0 = unpatched."""
    _, nodes = comfy
    base = _load(comfy, "wan21_vace")
    g = torch.Generator().manual_seed(5)
    frames = [torch.randn(1, 32, 3, 16, 16, generator=g) for _ in range(2)]
    masks = [torch.ones(1, 64, 3, 16, 16) for _ in range(2)]
    extra = {"vace_frames": frames, "vace_mask": masks, "vace_strength": [1.0, 0.5]}
    pos, neg = _cond(1, **extra), _cond(2, **extra)
    z = torch.zeros(1, 16, 3, 16, 16)
    out = _wan_sample(nodes, _patch(nodes, base), z, pos=pos, neg=neg)
    text = summaries.summaries[-1]
    assert torch.isfinite(out).all() and summaries.counts()["sparse"] > 0, text
    keys = _cache_line(text)
    # main: 4 blocks x 2 branches; VACE: 2 blocks x 2 contexts x 2 branches
    assert keys["keys"] == 4 * 2 + 2 * 2 * 2 and keys["kinds"] == ["self", "vace", "vace#1"], text
    assert "late anchor" not in text
    ref = _wan_sample(nodes, base, z, pos=pos, neg=neg)
    full = _wan_sample(nodes, _patch(nodes, base, density=1.0), z, pos=pos, neg=neg)
    assert torch.equal(full, ref)


def test_hunyuan3d_v20_joint_cond_latent(comfy, summaries, joint_spy):
    """Hunyuan3D 2.0 (joint [image cond, latent], head dim 64, no mask): sparse at reuse steps, condition rows
    exact; density 1.0 equals the unpatched model."""
    _, nodes = comfy
    base = _load(comfy, "hunyuan3d")
    g = torch.Generator().manual_seed(0)
    pos = [[torch.randn(1, 16, 1024, generator=g), {}]]
    neg = [[torch.zeros(1, 16, 1024), {}]]

    def sample(model):
        shifted = nodes.NODE_CLASS_MAPPINGS["ModelSamplingAuraFlow"]().patch_aura(model, 1.0)[0]
        return nodes.common_ksampler(shifted, 1, 5, 5.0, "euler", "normal", pos, neg,
                                     {"samples": torch.zeros(1, 64, 192), "type": "hunyuan3dv2"})[0]["samples"]

    out = sample(_patch(nodes, base))
    assert torch.isfinite(out).all() and summaries.counts()["sparse"] > 0, summaries.summaries[-1]
    reuse = _check_joint_calls(joint_spy, padded=0)
    assert reuse[0]["q"].shape[-1] == 64 and reuse[0]["site"].joint == "text_first"
    ref = sample(base)
    full = sample(_patch(nodes, base, density=1.0))
    assert torch.equal(full, ref)


def test_real_lora_file_then_patch_clone_unload(comfy, summaries):
    """A LoRA file with Wan key names through LoraLoaderModelOnly, then the patch node; clone + unload between
    runs: same counters and output each run, the LoRA changes the result, the base model is restored."""
    import comfy.model_management as mm

    headless, nodes = comfy
    base = _load(comfy, "wan21_t2v")
    z = torch.zeros(1, 16, 3, 16, 16)
    plain = _wan_sample(nodes, base, z)
    lora = nodes.LoraLoaderModelOnly().load_lora_model_only(base, headless.write_tiny_wan_lora(), 1.0)[0]
    assert len(lora.patches) == 3 * 4  # every q/k/v/o of the 3 blocks was mapped (no "lora key not loaded")
    patched = _patch(nodes, lora)
    first = _wan_sample(nodes, patched.clone(), z)
    counts = summaries.counts()
    assert counts["sparse"] > 0
    mm.unload_all_models()
    second = _wan_sample(nodes, patched.clone(), z)
    assert summaries.counts() == counts
    torch.testing.assert_close(second, first, rtol=1e-5, atol=1e-5)
    dense_lora = _wan_sample(nodes, lora, z)
    assert (dense_lora - plain).abs().max() > 1e-2  # the LoRA is live under the patch
    mm.unload_all_models()
    torch.testing.assert_close(_wan_sample(nodes, base, z), plain, rtol=0, atol=0)
