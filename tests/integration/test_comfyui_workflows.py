"""The shipped workflows against a real ComfyUI (both checkouts, see conftest): the node-definition records the CPU
test uses are current, and the Wan2.2 14B two-stage API twin runs headless (tiny checkpoint, both experts
patched)."""

import json
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
PATCH = {"preset": "custom", "density": 0.3, "query_tile": "64", "min_tokens": 0, "warmup_layers": 0, "backend": "torch"}


def test_node_definitions_snapshot_is_current(comfy, comfy_version):
    """The node-definition records equal what this ComfyUI declares: on v0.3.64 every node type of
    tests/data/comfyui_node_defs.json; on v0.33.0 every type of tests/data/comfyui_node_defs_v0.33.0.json (the
    MiniMax-H3 workflow's core nodes) and the pack's own nodes as recorded in the v0.3.64 file (one definition in
    both ComfyUIs)."""
    headless, _ = comfy
    stored = json.loads((ROOT / "tests" / "data" / "comfyui_node_defs.json").read_text(encoding="utf-8"))
    if comfy_version == "v0.33.0":
        own = {k: stored[k] for k in stored if k.startswith("MCSparse")}
        stored = json.loads((ROOT / "tests" / "data" / "comfyui_node_defs_v0.33.0.json").read_text(encoding="utf-8"))
        assert own and json.loads(json.dumps(headless.node_definitions(own))) == own
    live = json.loads(json.dumps(headless.node_definitions(stored)))
    assert live == stored


def test_wan22_two_stage_api_twin_runs_both_experts_sparse(comfy, summaries):
    """The flattened Wan2.2 14B two-stage twin (turbo off: plain experts, KSamplerAdvanced 0-3 / 3-6 of 6):
    two sampler calls, each with its own MC-Sparse run that goes sparse."""
    headless, _ = comfy
    unet = headless.write_tiny_checkpoint("wan21_t2v")
    prompt = headless.tinyfy_prompt(headless.load_api_workflow("wan22_t2v_14b_two_stage_mc_sparse_api.json"),
                                    unet_name=unet, width=128, height=128, length=9, steps=6, patch_inputs=PATCH,
                                    text_tokens=64)
    stages = sorted((n for n in prompt.values() if n["class_type"] == "KSamplerAdvanced"),
                    key=lambda n: n["inputs"]["start_at_step"])
    stages[0]["inputs"].update(end_at_step=3)
    stages[1]["inputs"].update(start_at_step=3, end_at_step=6)
    patches = [n for n in prompt.values() if n["class_type"] == "MCSparsePatch"]
    assert len(patches) == 2
    result = headless.execute_prompt(prompt)
    assert result["success"], result["messages"]
    assert len(summaries.summaries) == 2
    assert summaries.counts(0)["sparse"] > 0 and summaries.counts(1)["sparse"] > 0, summaries.summaries
    assert torch.isfinite(result["latents"][-1]).all()
