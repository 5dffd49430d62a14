"""The fidelity nodes in a real ComfyUI (COMFYUI_DIR), tiny random Wan checkpoint with the real key names, CPU.

* The Probe's report numbers equal the pack's diagnostics run on the q/k/v the same run captured.
* The shipped probe workflow (API twin: Patch + Probe + sampler + Probe Report + PreviewAny) runs through
  ``PromptExecutor``; the Report node's plot renders (IMAGE [1, 540, 960, 3] in [0, 1]) and the files are written.
* MC-Sparse Compare renders: side-by-side IMAGE of the right shape and range, PSNR / SSIM numbers.
"""

import json
from pathlib import Path

import pytest
import torch

PATCH = {"preset": "custom", "density": 0.3, "dense_warmup": "auto", "warmup_layers": 0, "anchor_steps": "auto",
         "query_tile": "64", "cache_placement": "auto", "backend": "torch", "min_tokens": 0, "verbose": False}
PROBE = {"density": 0.2, "query_tile": "128", "probe_step": "auto", "reuse_step": "auto", "blocks": "all", "heads": 0,
         "per_head": True, "oracle_queries": 0, "capture_blocks": "all"}


@pytest.fixture
def output_dir(comfy, tmp_path):
    import folder_paths

    old = folder_paths.get_output_directory()
    folder_paths.set_output_directory(str(tmp_path))
    yield tmp_path
    folder_paths.set_output_directory(old)


def _cond(seed):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(1, 512, 4096, generator=g), {}]]


def test_probe_report_equals_diagnostics_on_the_captured_tensors(comfy, output_dir):
    """Patch + Probe on the tiny Wan model, 6 euler steps: the report (JSON written by the node) equals
    ``capture.report_from_capture(exact=True)`` (tools/diagnostics.py on the captured q/k/v) for every block and
    method; the Report node returns the plot and the table."""
    headless, nodes = comfy
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.tools import capture
    mapping = nodes.NODE_CLASS_MAPPINGS
    base = nodes.UNETLoader().load_unet(headless.write_tiny_checkpoint("wan21_t2v"), "default")[0]
    patched = mapping["MCSparsePatch"].execute(base, **PATCH).result[0]
    model, handle = mapping["MCSparseProbe"].execute(patched, **PROBE).result
    shifted = mapping["ModelSamplingSD3"]().patch(model, 8.0)[0]
    latent = nodes.common_ksampler(shifted, 3, 6, 5.0, "euler", "simple", _cond(1), _cond(2),
                                   {"samples": torch.zeros(1, 16, 3, 16, 16)})[0]
    plot, text = mapping["MCSparseProbeReport"].execute(handle, latent).result
    assert plot.shape == (1, 540, 960, 3) and float(plot.min()) >= 0 and float(plot.max()) <= 1
    assert "MC-Sparse Probe: WanModel" in text and "settings from the MC-Sparse Patch" in text
    files = {Path(f).suffix: Path(f) for f in handle.files}
    node = json.loads(files[".json"].read_text())
    assert [b["block"] for b in node["blocks"]] == [0, 1, 2] and node["settings"]["density"] == 0.3
    exact = capture.report_from_capture(files[".safetensors"], exact=True)
    assert [b.block for b in exact.blocks] == [0, 1, 2]
    for got, ref in zip(node["blocks"], exact.blocks):
        assert set(got["scores"]) == set(ref.scores) and len(ref.scores) == 7, got["scores"].keys()
        for method, score in ref.scores.items():
            mine = got["scores"][method]
            assert mine["recall"] == pytest.approx(score.recall, rel=1e-4, abs=1e-6), (got["block"], method)
            assert mine["rel_l1"] == pytest.approx(score.rel_l1, rel=1e-3, abs=1e-5), (got["block"], method)
            assert mine["density"] == pytest.approx(score.density, abs=1e-9), (got["block"], method)


def test_probe_workflow_runs_and_report_renders(comfy, output_dir):
    """The shipped probe API twin, tinyfied, through PromptExecutor: success, the report files are written and the
    Report node's preview image was saved (it renders)."""
    headless, _ = comfy
    unet = headless.write_tiny_checkpoint("wan21_t2v")
    prompt = headless.tinyfy_prompt(headless.load_api_workflow("wan21_t2v_1.3b_probe_api.json"), unet_name=unet,
                                    width=128, height=128, length=9, steps=6, patch_inputs=PATCH)
    for node in prompt.values():
        if node["class_type"] == "MCSparseProbe":
            node["inputs"].update(heads=1, oracle_queries=64, blocks="0, 2", capture_blocks="none")
    result = headless.execute_prompt(prompt)
    assert result["success"], result["messages"]
    texts = sorted((output_dir / "mc_sparse_probe").glob("probe_*.txt"))
    assert len(texts) == 1
    body = texts[0].read_text()
    assert "per-query oracle: on 64 of 192 queries per head" in body and "heads probed per block: 1" in body
    import folder_paths

    previews = list(Path(folder_paths.get_temp_directory()).glob("ComfyUI_temp_*.png"))
    assert previews, "the Report node saved no preview image"


def test_compare_node_renders(comfy):
    """MC-Sparse Compare in ComfyUI: IMAGE [B, H, 3W + 8, 3] in [0, 1], the numbers and the text."""
    _, nodes = comfy
    g = torch.Generator().manual_seed(0)
    a = torch.rand(2, 24, 32, 3, generator=g)
    b = (a + 0.05 * torch.randn(a.shape, generator=g)).clamp(0, 1)
    image, text, psnr, ssim = nodes.NODE_CLASS_MAPPINGS["MCSparseCompare"].execute(a, b, "patched", "dense").result
    assert image.shape == (2, 24, 3 * 32 + 8, 3) and float(image.min()) >= 0 and float(image.max()) <= 1
    assert 20 < psnr < 40 and 0 < ssim < 1 and "patched vs dense: 2 frames" in text
