"""MC-Sparse in a real ComfyUI (COMFYUI_DIR), tiny random checkpoints with real key names, CPU.

Each test names the scenario of issue 2 it covers. Counters come from the run summary the OUTER_SAMPLE
wrapper logs at the end of every sampler call ("MC-Sparse: N sparse, M anchor, K dense ...").
"""

import torch

PATCH = {"preset": "custom", "density": 0.3, "dense_warmup": "auto", "warmup_layers": 0, "anchor_steps": "auto",
         "query_tile": "64", "cache_placement": "auto", "backend": "torch", "min_tokens": 0, "verbose": False}


def _patch(nodes, model, **over):
    out = nodes.NODE_CLASS_MAPPINGS["MCSparsePatch"].execute(model, **{**PATCH, **over})
    return out.result[0]


def _cond(seed, tokens=512, width=4096):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(1, tokens, width, generator=g), {}]]


def _sample(nodes, model, *, latent, steps=6, cfg=5.0, sampler="euler", scheduler="simple", seed=3):
    shifted = nodes.NODE_CLASS_MAPPINGS["ModelSamplingSD3"]().patch(model, 8.0)[0]
    return nodes.common_ksampler(shifted, seed, steps, cfg, sampler, scheduler, _cond(1), _cond(2),
                                 {"samples": latent})[0]["samples"]


def _load(comfy, kind):
    headless, nodes = comfy
    return nodes.UNETLoader().load_unet(headless.write_tiny_checkpoint(kind), "default")[0]


def test_shipped_wan_workflow_runs_sparse_at_reuse_steps(comfy, summaries):
    """Shipped API workflow through PromptExecutor: reuse steps run the sparse path (counters)."""
    headless, _ = comfy
    unet = headless.write_tiny_checkpoint("wan21_t2v")
    prompt = headless.tinyfy_wan_prompt(headless.load_api_workflow("wan21_t2v_1.3b_mc_sparse_api.json"),
                                        unet_name=unet, width=128, height=128, length=9, steps=8, patch_inputs=PATCH)
    result = headless.execute_prompt(prompt)
    assert result["success"], result["messages"]
    c = summaries.counts()
    # 8 steps, warm-up 2 (paper scaled), anchors at steps 2 and 4 (1-based), 3 blocks, cfg batch of 2 chunks
    assert c["sparse"] > 0 and c["anchor"] > 0, summaries.summaries[-1]
    assert torch.isfinite(result["latents"][0]).all()


def test_density_one_matches_unpatched(comfy, summaries):
    """density 1.0 is an exact pass-through: bit for bit the unpatched run, also after another MC-Sparse node."""
    _, nodes = comfy
    base = _load(comfy, "wan21_t2v")
    z = torch.zeros(1, 16, 3, 16, 16)
    ref = _sample(nodes, base, latent=z)
    assert _patch(nodes, base, density=1.0) is base
    assert torch.equal(_sample(nodes, _patch(nodes, base, density=1.0), latent=z), ref)
    assert torch.equal(_sample(nodes, _patch(nodes, _patch(nodes, base), density=1.0), latent=z), ref)
    assert summaries.summaries[-1].startswith("MC-Sparse: stayed dense: density 1 keeps every token")


def test_dense_warmup_is_bit_identical_and_bypass_leaves_no_trace(comfy, summaries):
    """A schedule whose warm-up covers the run is bit-identical; the unpatched base model is untouched."""
    _, nodes = comfy
    base = _load(comfy, "wan21_t2v")
    z = torch.zeros(1, 16, 3, 16, 16)
    ref = _sample(nodes, base, latent=z, steps=4)
    patched = _patch(nodes, base, dense_warmup="100%", anchor_steps="100%")
    out = _sample(nodes, patched, latent=z, steps=4)
    assert torch.equal(out, ref)
    after = _sample(nodes, base, latent=z, steps=4)  # "bypassed": the original model after a patched run
    assert torch.equal(after, ref)
    assert "optimized_attention_override" not in base.model_options.get("transformer_options", {})
    assert not base.object_patches


def test_state_resets_between_runs_cfg1_and_batch2(comfy, summaries):
    """Two runs report the same counters (fresh state per sampler call); cfg 1 and latent batch 2 work."""
    _, nodes = comfy
    patched = _patch(nodes, _load(comfy, "wan21_t2v"))
    z = torch.zeros(1, 16, 3, 16, 16)
    a = _sample(nodes, patched, latent=z)
    b = _sample(nodes, patched, latent=z)
    assert summaries.counts(-1) == summaries.counts(-2) and torch.equal(a, b)
    _sample(nodes, patched, latent=z, cfg=1.0)
    cfg1 = summaries.counts()
    assert cfg1["sparse"] * 2 == summaries.counts(-2)["sparse"]  # one chunk instead of two
    out = _sample(nodes, patched, latent=torch.zeros(2, 16, 3, 16, 16))
    assert out.shape[0] == 2 and torch.isfinite(out).all() and summaries.counts()["sparse"] > 0


def test_heun_and_ancestral(comfy, summaries):
    """heun (repeated sigmas) and euler_ancestral (in-between sigmas) map to steps and go sparse."""
    _, nodes = comfy
    patched = _patch(nodes, _load(comfy, "wan21_t2v"))
    z = torch.zeros(1, 16, 3, 16, 16)
    for sampler in ("heun", "euler_ancestral"):
        out = _sample(nodes, patched, latent=z, sampler=sampler)
        assert torch.isfinite(out).all()
        assert summaries.counts()["sparse"] > 0, summaries.summaries[-1]


def test_two_stage_ksampler_advanced_and_resolution_change(comfy, summaries):
    """Wan2.2-style high/low split with KSamplerAdvanced: each stage gets its own state and anchors; a second
    sampler at another resolution (grid not a multiple of C) never reuses a stale cache."""
    _, nodes = comfy
    high = _patch(nodes, _load(comfy, "wan21_t2v"))
    low = _patch(nodes, _load(comfy, "wan21_t2v"))
    adv = nodes.KSamplerAdvanced()
    z = {"samples": torch.zeros(1, 16, 3, 16, 16)}
    s1 = adv.sample(high, "enable", 5, 12, 4.0, "euler", "simple", _cond(1), _cond(2), z, 0, 6, "enable")[0]
    s2 = adv.sample(low, "disable", 5, 12, 4.0, "euler", "simple", _cond(1), _cond(2), s1, 6, 10000, "disable")[0]
    assert torch.isfinite(s2["samples"]).all()
    assert summaries.counts(-1)["sparse"] > 0 and summaries.counts(-2)["sparse"] > 0
    # 14x18 latent -> 7x9 per frame x 3 frames = 189 tokens, not a multiple of C=64
    out = _sample(nodes, high, latent=torch.zeros(1, 16, 3, 14, 18))
    assert torch.isfinite(out).all() and summaries.counts()["sparse"] > 0


def test_lora_clone_unload_between_runs(comfy, summaries):
    """patch -> clone (as LoRA/ModelSampling nodes do) -> run -> unload_all_models -> run: still sparse."""
    import comfy.model_management as mm

    _, nodes = comfy
    patched = _patch(nodes, _load(comfy, "wan21_t2v")).clone()
    z = torch.zeros(1, 16, 3, 16, 16)
    _sample(nodes, patched, latent=z)
    first = summaries.counts()
    mm.unload_all_models()
    _sample(nodes, patched, latent=z)
    assert summaries.counts() == first and first["sparse"] > 0


def test_i2v_and_wan22_5b(comfy, summaries):
    """Wan2.1 I2V (image cross-attention untouched) and Wan2.2 5B (48-channel latent) go sparse."""
    headless, nodes = comfy
    i2v = _patch(nodes, _load(comfy, "wan21_i2v"))
    shifted = nodes.NODE_CLASS_MAPPINGS["ModelSamplingSD3"]().patch(i2v, 8.0)[0]
    g = torch.Generator().manual_seed(0)

    class CV:
        penultimate_hidden_states = torch.randn(1, 257, 1280, generator=g)

    concat = torch.zeros(1, 16, 3, 16, 16)
    pos = [[torch.randn(1, 512, 4096, generator=g), {"clip_vision_output": CV(), "concat_latent_image": concat}]]
    neg = [[torch.randn(1, 512, 4096, generator=g), {"clip_vision_output": CV(), "concat_latent_image": concat}]]
    out = nodes.common_ksampler(shifted, 1, 6, 5.0, "euler", "simple", pos, neg,
                                {"samples": torch.zeros(1, 16, 3, 16, 16)})[0]["samples"]
    assert torch.isfinite(out).all() and summaries.counts()["sparse"] > 0
    text = summaries.summaries[-1]
    assert "not a marked self-attention call" in text  # image + text cross-attention passed through
    five_b = _patch(nodes, _load(comfy, "wan22_5b"))
    out = _sample(nodes, five_b, latent=torch.zeros(1, 48, 3, 16, 16))
    assert torch.isfinite(out).all() and summaries.counts()["sparse"] > 0


def test_later_override_is_chained_and_reported(comfy, summaries):
    """A node writing optimized_attention_override after MC-Sparse is chained under it and reported."""
    _, nodes = comfy
    patched = _patch(nodes, _load(comfy, "wan21_t2v")).clone()
    seen = []

    def foreign(func, *args, **kwargs):
        seen.append(1)
        return func(*args, **kwargs)

    patched.model_options["transformer_options"]["optimized_attention_override"] = foreign
    _sample(nodes, patched, latent=torch.zeros(1, 16, 3, 16, 16))
    assert seen and summaries.counts()["sparse"] > 0
    assert "another attention override" in summaries.summaries[-1]


def test_torch_compile_second_run_no_recompile(comfy, summaries):
    """TorchCompileModel + MC-Sparse: the second run does not recompile (Python logic is compiler-disabled)."""
    import torch._dynamo as dynamo

    _, nodes = comfy
    compile_node = nodes.NODE_CLASS_MAPPINGS.get("TorchCompileModel")
    if compile_node is None:
        import pytest

        pytest.skip("TorchCompileModel not available in this ComfyUI")
    patched = _patch(nodes, _load(comfy, "wan21_t2v"))
    compiled = compile_node.execute(patched, "inductor").result[0] if hasattr(compile_node, "execute") else None
    z = torch.zeros(1, 16, 3, 16, 16)
    dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    _sample(nodes, compiled, latent=z, steps=3)
    graphs_after_first = counters["stats"]["unique_graphs"]
    _sample(nodes, compiled, latent=z, steps=3)
    assert graphs_after_first > 0
    assert counters["stats"]["unique_graphs"] == graphs_after_first  # no new graph = no recompile in run 2
    assert summaries.counts()["sparse"] > 0


def test_hunyuan3d21_object_patch_route(comfy, summaries):
    """Hunyuan3D 2.1 (no transformer_options at attention): the replaced attn1 forwards go sparse, and their dense
    calls pass the fixed keywords this ComfyUI's own forward passes (v0.33.0: low_precision_attention=False)."""
    import importlib
    import inspect

    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter import hunyuan3d21

    dit = importlib.import_module("comfy.ldm.hunyuan3dv2_1.hunyuandit")
    source = inspect.getsource(dit.Attention.forward)
    want = {"low_precision_attention": False} if "low_precision_attention=False" in source else {}
    assert hunyuan3d21.original_keywords(dit.Attention.forward) == want, source
    _, nodes = comfy
    model = _patch(nodes, _load(comfy, "hunyuan3d21"))
    g = torch.Generator().manual_seed(0)
    pos = [[torch.randn(1, 16, 1024, generator=g), {}]]
    neg = [[torch.zeros(1, 16, 1024), {}]]
    out = nodes.common_ksampler(model, 1, 6, 5.0, "euler", "normal", pos, neg,
                                {"samples": torch.zeros(1, 64, 256), "type": "hunyuan3dv2"})[0]["samples"]
    assert torch.isfinite(out).all() and summaries.counts()["sparse"] > 0, summaries.summaries[-1]


def test_interrupted_run_says_so_in_its_summary(comfy, summaries):
    """ComfyUI's interrupt (the progress hook raises InterruptProcessingException after step 3 of 6, as
    ``main.py``'s hook does when the user presses cancel): the summary says "run interrupted after step 3"
    with the counts so far; the exception reaches the caller; the next run is a normal one."""
    import comfy.model_management as mm
    import pytest
    from comfy import utils as comfy_utils  # not "import comfy.utils": that would shadow the comfy fixture

    _, nodes = comfy
    patched = _patch(nodes, _load(comfy, "wan21_t2v"))
    z = torch.zeros(1, 16, 3, 16, 16)

    def hook(value, total, preview, node_id=None):
        if value >= 3:
            raise mm.InterruptProcessingException()

    old = comfy_utils.PROGRESS_BAR_HOOK
    comfy_utils.set_progress_bar_global_hook(hook)
    try:
        with pytest.raises(mm.InterruptProcessingException):
            _sample(nodes, patched, latent=z, steps=6)
    finally:
        comfy_utils.set_progress_bar_global_hook(old)
    head = summaries.summaries[-1].splitlines()[0]
    assert head.startswith("MC-Sparse: run interrupted after step 3 of 6 (InterruptProcessingException): "), head
    assert "calls so far" in head and "WARNING" not in summaries.summaries[-1]
    _sample(nodes, patched, latent=z, steps=6)
    assert "interrupted" not in summaries.summaries[-1] and summaries.counts()["sparse"] > 0
