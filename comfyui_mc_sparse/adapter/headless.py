"""Run a shipped API workflow headless in a real ComfyUI checkout, with a tiny random checkpoint.

``run_headless_demo(comfyui_dir)`` is what ``python -m comfyui_mc_sparse comfyui-demo`` calls: it imports
ComfyUI in-process (``shared/docs/comfyui.md`` 4.2 recipe: ``args.cpu`` on a CPU-only machine,
``utils.extra_config`` before ``nodes``, ``init_extra_nodes``, ``load_custom_node`` on this checkout),
writes a tiny Wan 2.1 T2V checkpoint with the real key names (random fp16 weights, 2 heads x 128, 3 blocks)
into a temporary ``diffusion_models`` folder, adapts ``workflows/wan21_t2v_1.3b_mc_sparse_api.json``
(text encoder and VAE nodes swapped for synthetic conditioning and a sink; small latent, few steps), runs it
through ``execution.PromptExecutor`` and prints the MC-Sparse run summary. The integration tests use the
same helpers.

This module imports ComfyUI only inside its functions; ComfyUI must be importable from ``comfyui_dir``.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import os
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

PACK_ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS = PACK_ROOT / "workflows"

# Synthetic-conditioning node ids the harness registers (never shipped to users).
COND_NODE = "MCSparseTestConditioning"
SINK_NODE = "MCSparseTestLatentSink"

_state: dict[str, Any] = {}  # the one ComfyUI import of this process (ComfyUI itself is process-global)


def setup_comfy(comfyui_dir: str) -> Any:
    """Import ComfyUI from ``comfyui_dir`` for in-process use (once per process) and load this pack as a
    custom node the way ComfyUI does. Returns the ``nodes`` module.

    Raises:
        FileNotFoundError: ``comfyui_dir`` has no ``main.py``/``nodes.py``.
    """
    if "nodes" in _state:
        return _state["nodes"]
    root = Path(comfyui_dir).resolve()
    if not (root / "nodes.py").is_file():
        raise FileNotFoundError(f"COMFYUI_DIR must be a ComfyUI checkout (with nodes.py), got {root}")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from comfy.cli_args import args

    if not torch.cuda.is_available():
        args.cpu = True
    import utils.extra_config  # noqa: F401  (before nodes: nodes puts comfy/ first on sys.path)
    import nodes

    asyncio.run(nodes.init_extra_nodes(init_custom_nodes=False, init_api_nodes=False))
    ok = asyncio.run(nodes.load_custom_node(str(PACK_ROOT)))
    if not ok or "MCSparsePatch" not in nodes.NODE_CLASS_MAPPINGS:
        raise RuntimeError(f"ComfyUI did not register MCSparsePatch from {PACK_ROOT}")
    _register_test_nodes(nodes)
    _state["nodes"] = nodes
    return nodes


def _register_test_nodes(nodes) -> None:
    class Conditioning:
        """Synthetic text (and optional CLIP-vision) conditioning: seeded random embeddings."""

        @classmethod
        def INPUT_TYPES(cls):
            return {"required": {"seed": ("INT", {"default": 0}), "tokens": ("INT", {"default": 512}),
                                 "width": ("INT", {"default": 4096}), "clip_vision_tokens": ("INT", {"default": 0}),
                                 "clip_vision_width": ("INT", {"default": 1280})}}

        RETURN_TYPES = ("CONDITIONING",)
        FUNCTION = "make"
        CATEGORY = "testing"

        def make(self, seed, tokens, width, clip_vision_tokens, clip_vision_width):
            g = torch.Generator().manual_seed(seed)
            extra = {}
            if clip_vision_tokens:
                class _ClipVisionOutput:
                    pass

                cv = _ClipVisionOutput()
                cv.penultimate_hidden_states = torch.randn(1, clip_vision_tokens, clip_vision_width, generator=g)
                extra["clip_vision_output"] = cv
            return ([[torch.randn(1, tokens, width, generator=g), extra]],)

    class Sink:
        @classmethod
        def INPUT_TYPES(cls):
            return {"required": {"samples": ("LATENT",)}}

        RETURN_TYPES = ()
        FUNCTION = "sink"
        OUTPUT_NODE = True
        CATEGORY = "testing"

        def sink(self, samples):
            _state.setdefault("latents", []).append(samples["samples"].clone())
            return {"ui": {"mc_sparse_latent_shape": [list(samples["samples"].shape)]}}

    nodes.NODE_CLASS_MAPPINGS[COND_NODE] = Conditioning
    nodes.NODE_CLASS_MAPPINGS[SINK_NODE] = Sink


def models_dir() -> Path:
    """A per-process temporary ``diffusion_models`` folder registered with ComfyUI's ``folder_paths``."""
    if "models_dir" not in _state:
        import folder_paths

        path = Path(tempfile.mkdtemp(prefix="mc_sparse_models_"))
        folder_paths.add_model_folder_path("diffusion_models", str(path), is_default=True)
        _state["models_dir"] = path
    return _state["models_dir"]


def write_tiny_checkpoint(kind: str, *, seed: int = 0) -> str:
    """Write a tiny random-weight checkpoint with the real key names; return its file name.

    kinds: "wan21_t2v" (in 16), "wan21_i2v" (in 36 + img_emb), "wan22_5b" (in/out 48), "hunyuan_video",
    "hunyuan3d21". Built from ComfyUI's own model classes on the meta device so the keys and shapes are what
    ComfyUI's detection (``comfy/model_detection.py``) expects; weights ~N(0, 0.02) in fp16, norms 1.
    """
    name = f"mc_sparse_tiny_{kind}.safetensors"
    path = models_dir() / name
    if path.exists():
        return name
    model = _tiny_model(kind)
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for key, p in model.state_dict(keep_vars=True).items():
        shape = tuple(p.shape)
        if key.endswith(("norm.weight", "norm_q.weight", "norm_k.weight", "norm1.weight", "norm2.weight",
                         "norm3.weight", "query_norm.scale", "key_norm.scale", "q_norm.weight", "k_norm.weight")):
            t = torch.ones(shape)
        else:
            t = torch.randn(shape, generator=g) * 0.02
        tensors[key] = t.to(torch.float16).contiguous()
    save_file(tensors, str(path))
    return name


def _tiny_model(kind: str):
    import comfy.ops

    ops = comfy.ops.disable_weight_init
    with torch.device("meta"):
        if kind.startswith("wan"):
            from comfy.ldm.wan.model import WanModel

            in_dim, out_dim, model_type = {"wan21_t2v": (16, 16, "t2v"), "wan21_i2v": (36, 16, "i2v"),
                                           "wan22_5b": (48, 48, "t2v")}[kind]
            return WanModel(model_type=model_type, in_dim=in_dim, out_dim=out_dim, dim=256, ffn_dim=512,
                            num_heads=2, num_layers=3, text_dim=4096, freq_dim=256, operations=ops)
        if kind == "hunyuan_video":
            from comfy.ldm.hunyuan_video.model import HunyuanVideo

            return HunyuanVideo(image_model=None, in_channels=16, out_channels=16, vec_in_dim=768, context_in_dim=4096,
                                hidden_size=256, mlp_ratio=2.0, num_heads=2, depth=2, depth_single_blocks=2,
                                axes_dim=[16, 56, 56], theta=256, patch_size=[1, 2, 2], qkv_bias=True,
                                guidance_embed=True, operations=ops)
        if kind == "hunyuan3d21":
            from comfy.ldm.hunyuan3dv2_1.hunyuandit import HunYuanDiTPlain

            return HunYuanDiTPlain(in_channels=64, hidden_size=1024, context_dim=1024, depth=2, num_heads=16,
                                   operations=ops)
    raise ValueError(f"kind must be one of wan21_t2v, wan21_i2v, wan22_5b, hunyuan_video, hunyuan3d21, got {kind!r}")


def load_api_workflow(name: str) -> dict:
    """A shipped API-format workflow from ``workflows/`` (a deep copy)."""
    with open(WORKFLOWS / name, encoding="utf-8") as f:
        return json.load(f)


def tinyfy_wan_prompt(prompt: dict, *, unet_name: str, width: int = 64, height: int = 64, length: int = 9,
                      steps: int = 6, cfg: float | None = None, sampler: str | None = None,
                      patch_inputs: dict | None = None, batch: int = 1) -> dict:
    """Adapt a shipped Wan API workflow for a tiny CPU run: swap text encoders for synthetic conditioning,
    drop VAE/video nodes for a latent sink, shrink the latent and steps, point loaders at ``unet_name``."""
    prompt = copy.deepcopy(prompt)
    sinks = []
    for nid, node in list(prompt.items()):
        ct = node["class_type"]
        inputs = node["inputs"]
        if ct == "CLIPTextEncode":
            prompt[nid] = {"class_type": COND_NODE, "inputs": {"seed": int(nid) if nid.isdigit() else 1, "tokens": 512,
                                                              "width": 4096, "clip_vision_tokens": 0,
                                                              "clip_vision_width": 1280}}
        elif ct in ("CLIPLoader", "VAELoader", "VAEDecode", "CreateVideo", "SaveVideo", "SaveAnimatedWEBP",
                    "VAEDecodeTiled", "CLIPVisionLoader", "CLIPVisionEncode", "LoadImage"):
            del prompt[nid]
        elif ct == "UNETLoader":
            inputs["unet_name"] = unet_name
            inputs["weight_dtype"] = "default"
        elif ct == "EmptyHunyuanLatentVideo":
            inputs.update(width=width, height=height, length=length, batch_size=batch)
        elif ct in ("KSampler", "KSamplerAdvanced"):
            inputs["steps"] = steps
            if cfg is not None:
                inputs["cfg"] = cfg
            if sampler is not None:
                inputs["sampler_name"] = sampler
            if ct == "KSamplerAdvanced":
                inputs["end_at_step"] = min(inputs.get("end_at_step", steps), 10000)
            sinks.append(nid)
        elif ct == "MCSparsePatch" and patch_inputs:
            inputs.update(patch_inputs)
    for nid in sinks:
        if not any(isinstance(v, list) and v and v[0] == nid for n in prompt.values() for v in n["inputs"].values()):
            prompt[f"sink{nid}"] = {"class_type": SINK_NODE, "inputs": {"samples": [nid, 0]}}
    return prompt


class _ServerStub:
    """The minimum of ``server.PromptServer`` that ``execution.PromptExecutor`` touches (comfyui.md 4.2)."""

    def __init__(self):
        self.client_id = None
        self.last_node_id = None
        self.last_prompt_id = None
        self.sockets_metadata = {}

    def send_sync(self, event, data, sid=None):
        pass


def execute_prompt(prompt: dict) -> dict:
    """Validate and run an API prompt through ``execution.PromptExecutor`` (no cache between calls).

    Returns ``{"success": bool, "messages": [...], "latents": [tensors from the sink nodes]}``.
    Raises:
        ValueError: the prompt does not validate (the node errors are in the message).
    """
    import execution

    pid = str(uuid.uuid4())
    valid = asyncio.run(execution.validate_prompt(pid, prompt, None))
    if not valid[0]:
        raise ValueError(f"prompt does not validate: {valid[1]} {json.dumps(valid[3], default=str)[:2000]}")
    _state["latents"] = []
    executor = execution.PromptExecutor(_ServerStub(), cache_type=execution.CacheType.CLASSIC)
    executor.execute(prompt, pid, {}, valid[2])
    return {"success": executor.success, "messages": executor.status_messages, "latents": list(_state["latents"])}


def run_headless_demo(comfyui_dir: str) -> int:
    """Run the shipped Wan 2.1 T2V API workflow headless in ``comfyui_dir`` with a tiny random checkpoint and
    print the MC-Sparse run summary. Returns a process exit code (0 = ran and something went sparse)."""
    # ComfyUI imports this pack under its own module name (nodes.load_custom_node), so capture at the root.
    handler = _CaptureHandler()
    root = logging.getLogger()
    root.addHandler(handler)
    old_level = root.level
    root.setLevel(logging.INFO)
    try:
        setup_comfy(comfyui_dir)
        unet = write_tiny_checkpoint("wan21_t2v")
        prompt = tinyfy_wan_prompt(
            load_api_workflow("wan21_t2v_1.3b_mc_sparse_api.json"), unet_name=unet, width=64, height=64, length=9,
            steps=8, patch_inputs={"preset": "custom", "density": 0.3, "query_tile": "64", "min_tokens": 0,
                                   "warmup_layers": 0},
        )
        result = execute_prompt(prompt)
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
    for record in handler.records:
        print(record)
    if not result["success"]:
        print("ComfyUI run failed:", result["messages"])
        return 1
    return 0 if any("WARNING: no attention" not in r for r in handler.records if r.startswith("MC-Sparse:")) else 2


class _CaptureHandler(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.records: list[str] = []

    def emit(self, record):
        if record.getMessage().startswith("MC-Sparse:"):
            self.records.append(record.getMessage())


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run_headless_demo(os.environ.get("COMFYUI_DIR", "")))
