"""Run a shipped API workflow headless in a real ComfyUI checkout, with a tiny random checkpoint.

``run_headless_demo(comfyui_dir)`` is what ``python -m comfyui_mc_sparse comfyui-demo`` calls: it imports
ComfyUI in-process (docs/comfyui.md: ``args.cpu`` on a CPU-only machine,
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
import atexit
import copy
import json
import logging
import os
import shutil
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

CHECKPOINT_KINDS = ("wan21_t2v", "wan21_i2v", "wan22_5b", "wan21_vace", "hunyuan_video", "hunyuan3d", "hunyuan3d21",
                    "wan21_scail", "wan22_wandancer")

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
    # Order matters (kept apart so import sorting cannot swap them): ComfyUI's top-level utils/ package must be
    # imported before nodes, which puts comfy/ (with its own utils.py) first on sys.path.
    import utils.extra_config  # noqa: F401

    import nodes  # isort: skip

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
                                 "clip_vision_width": ("INT", {"default": 1280})},
                    "optional": {"pooled_width": ("INT", {"default": 0}), "padded_tokens": ("INT", {"default": 0})}}

        RETURN_TYPES = ("CONDITIONING",)
        FUNCTION = "make"
        CATEGORY = "testing"

        def make(self, seed, tokens, width, clip_vision_tokens, clip_vision_width, pooled_width=0, padded_tokens=0):
            g = torch.Generator().manual_seed(seed)
            extra = {}
            if pooled_width:  # HunyuanVideo's CLIP-L pooled output (model_base.HunyuanVideo.encode_adm)
                extra["pooled_output"] = torch.randn(1, pooled_width, generator=g)
            if padded_tokens:  # an int text mask, 0 on the last padded_tokens (hunyuan_video/model.py L340-349)
                mask = torch.ones(1, tokens, dtype=torch.long)
                mask[:, tokens - padded_tokens:] = 0
                extra["attention_mask"] = mask
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


def comfy_pack_module(relative: str) -> Any:
    """ComfyUI's own import of one of this pack's modules (``nodes.load_custom_node`` imports the checkout
    under a module name of its own, so the copy the tests import is a different module object).

    Args:
        relative: dotted path inside the pack, e.g. "comfyui_mc_sparse.adapter.override".
    Raises:
        LookupError: ComfyUI has not loaded the pack (call ``setup_comfy`` first).
    """
    suffix = str(PACK_ROOT / (relative.replace(".", os.sep) + ".py"))
    for name, module in list(sys.modules.items()):
        if getattr(module, "__file__", None) == suffix and name.endswith(relative) and \
                not name.startswith("comfyui_mc_sparse_pack"):
            return module
    raise LookupError(f"ComfyUI's copy of {relative} must be loaded (setup_comfy), got none in sys.modules")


FILE_INPUTS = ("unet_name", "ckpt_name", "lora_name", "clip_name", "clip_name1", "clip_name2", "vae_name", "image")
"""Combo inputs whose options are the files on a machine: their options are not recorded in node definitions."""


def node_definitions(class_types) -> dict:
    """The definitions of ``class_types`` in the running ComfyUI, as plain data for ``tests/data``.

    Returns ``{class_type: {"inputs": {name: {"type": T, "required": bool, "options": [...] | None}},
    "outputs": [types]}}`` in declaration order, from each node's ``INPUT_TYPES()`` / ``RETURN_TYPES`` (V1, and the
    V1 view V3 nodes expose, ``comfy_api/latest/_io.py``); ``T`` is "COMBO" for option lists. Missing types map
    to None.
    """
    import nodes

    out = {}
    for ct in sorted(set(class_types)):
        cls = nodes.NODE_CLASS_MAPPINGS.get(ct)
        if cls is None:
            out[ct] = None
            continue
        spec = cls.INPUT_TYPES()
        inputs = {}
        for section in ("required", "optional"):
            for name, entry in (spec.get(section) or {}).items():
                kind, opts = entry[0], (entry[1] if len(entry) > 1 and isinstance(entry[1], dict) else {})
                options = None
                if isinstance(kind, (list, tuple)):
                    options, kind = list(kind), "COMBO"
                elif kind == "COMBO":
                    options = list(opts.get("options") or [])
                if name in FILE_INPUTS:
                    options = None
                inputs[name] = {"type": kind, "required": section == "required", "options": options}
        out[ct] = {"inputs": inputs, "outputs": [str(t) for t in getattr(cls, "RETURN_TYPES", ())]}
    return out


def models_dir() -> Path:
    """A per-process temporary ``diffusion_models`` folder registered with ComfyUI's ``folder_paths``, removed when
    the process exits (its tiny checkpoints are ~0.5 GB per process: left behind, integration runs filled the disk)."""
    if "models_dir" not in _state:
        import folder_paths

        path = Path(tempfile.mkdtemp(prefix="mc_sparse_models_"))
        atexit.register(shutil.rmtree, path, ignore_errors=True)
        folder_paths.add_model_folder_path("diffusion_models", str(path), is_default=True)
        folder_paths.add_model_folder_path("loras", str(path), is_default=True)
        _state["models_dir"] = path
    return _state["models_dir"]


def write_tiny_checkpoint(kind: str, *, seed: int = 0) -> str:
    """Write a tiny random-weight checkpoint with the real key names; return its file name.

    kinds (``CHECKPOINT_KINDS``): "wan21_t2v" (in 16), "wan21_i2v" (in 36 + img_emb), "wan22_5b" (in/out 48),
    "wan21_vace" (4 blocks + 2 VACE blocks, vace_in_dim 96), "hunyuan_video" (2 double + 2 single blocks,
    2 heads x 128), "hunyuan3d" (v2.0: 1 double + 1 single block, 16 heads x 64), "hunyuan3d21"; ComfyUI v0.33.0 only:
    "wan21_scail" (SCAIL: in 20 + the pose patch embedding), "wan22_wandancer" (music encoder, audio injected
    after blocks 0 and 2). Built from ComfyUI's own model classes on the meta device so the keys and shapes are what
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


def write_tiny_wan_lora(*, rank: int = 4, dim: int = 256, blocks: int = 3, scale: float = 0.5, seed: int = 1) -> str:
    """Write a tiny LoRA for the tiny Wan checkpoints (``dim`` 256, ``blocks`` blocks) with Wan key names
    ``diffusion_model.blocks.{i}.self_attn.{q,k,v,o}.lora_{up,down}.weight`` + ``.alpha`` (the form
    ``comfy/lora.py`` ``load_lora`` maps through ``model_lora_keys_unet``); return its file name under "loras".
    """
    name = f"mc_sparse_tiny_wan_lora_r{rank}.safetensors"
    path = models_dir() / name
    if path.exists():
        return name
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(blocks):
        for proj in ("q", "k", "v", "o"):
            base = f"diffusion_model.blocks.{i}.self_attn.{proj}"
            tensors[f"{base}.lora_down.weight"] = (torch.randn(rank, dim, generator=g) * scale).to(torch.float16)
            tensors[f"{base}.lora_up.weight"] = (torch.randn(dim, rank, generator=g) * scale).to(torch.float16)
            tensors[f"{base}.alpha"] = torch.tensor(float(rank))
    save_file(tensors, str(path))
    return name


def _tiny_model(kind: str):
    import comfy.ops

    ops = comfy.ops.disable_weight_init
    with torch.device("meta"):
        if kind.startswith("wan"):
            from comfy.ldm.wan.model import WanModel

            if kind == "wan21_scail":  # v0.33.0 wan/model.py SCAILWanModel: pose tokens appended to the video's
                from comfy.ldm.wan.model import SCAILWanModel

                return SCAILWanModel(in_dim=20, out_dim=16, dim=256, ffn_dim=512, num_heads=2, num_layers=3,
                                     text_dim=4096, freq_dim=256, operations=ops)
            if kind == "wan22_wandancer":  # v0.33.0 wan/model_wandancer.py
                from comfy.ldm.wan.model_wandancer import WanDancerModel

                return WanDancerModel(in_dim=36, out_dim=16, dim=256, ffn_dim=512, num_heads=2, num_layers=3,
                                      text_dim=4096, freq_dim=256, audio_inject_layers=[0, 2], operations=ops)
            if kind == "wan21_vace":  # 4 main blocks, 2 VACE blocks after main blocks 0 and 2 (mapping L702)
                from comfy.ldm.wan.model import VaceWanModel

                return VaceWanModel(in_dim=16, out_dim=16, dim=256, ffn_dim=512, num_heads=2, num_layers=4,
                                    text_dim=4096, freq_dim=256, vace_layers=2, vace_in_dim=96, operations=ops)
            in_dim, out_dim, model_type = {"wan21_t2v": (16, 16, "t2v"), "wan21_i2v": (36, 16, "i2v"),
                                           "wan22_5b": (48, 48, "t2v")}[kind]
            return WanModel(model_type=model_type, in_dim=in_dim, out_dim=out_dim, dim=256, ffn_dim=512,
                            num_heads=2, num_layers=3, text_dim=4096, freq_dim=256, operations=ops)
        if kind == "hunyuan_video":
            import dataclasses

            from comfy.ldm.hunyuan_video import model as hv

            # v0.33.0's HunyuanVideoParams adds three required fields (what detection sets for plain T2V)
            newer = {"use_cond_type_embedding": False, "vision_in_dim": None, "meanflow_sum": False}
            fields = {f.name for f in dataclasses.fields(hv.HunyuanVideoParams)}
            return hv.HunyuanVideo(image_model=None, in_channels=16, out_channels=16, vec_in_dim=768,
                                   context_in_dim=4096, hidden_size=256, mlp_ratio=4.0, num_heads=2, depth=2,
                                   depth_single_blocks=2, axes_dim=[16, 56, 56], theta=256, patch_size=[1, 2, 2],
                                   qkv_bias=True, guidance_embed=True, byt5=False, meanflow=False, operations=ops,
                                   **{k: v for k, v in newer.items() if k in fields})
        if kind == "hunyuan3d":  # v2.0: detection fixes 16 heads (model_detection.py L432): 1024 -> head dim 64
            from comfy.ldm.hunyuan3d.model import Hunyuan3Dv2

            return Hunyuan3Dv2(in_channels=64, context_in_dim=1024, hidden_size=1024, mlp_ratio=4.0, num_heads=16,
                               depth=1, depth_single_blocks=1, qkv_bias=True, guidance_embed=False, operations=ops)
        if kind == "hunyuan3d21":
            from comfy.ldm.hunyuan3dv2_1.hunyuandit import HunYuanDiTPlain

            return HunYuanDiTPlain(in_channels=64, hidden_size=1024, context_dim=1024, depth=2, num_heads=16,
                                   operations=ops)
    raise ValueError(f"kind must be one of {', '.join(CHECKPOINT_KINDS)}, got {kind!r}")


def load_api_workflow(name: str) -> dict:
    """A shipped API-format workflow from ``workflows/`` (a deep copy)."""
    with open(WORKFLOWS / name, encoding="utf-8") as f:
        return json.load(f)


def tinyfy_prompt(prompt: dict, *, unet_name: str, width: int = 64, height: int = 64, length: int = 9,
                  steps: int = 6, cfg: float | None = None, sampler: str | None = None,
                  patch_inputs: dict | None = None, batch: int = 1, text_tokens: int = 512, text_width: int = 4096,
                  pooled_width: int = 0, padded_tokens: int = 0) -> dict:
    """Adapt a shipped video API workflow (Wan or HunyuanVideo) for a tiny CPU run.

    Text encoders become synthetic conditioning (``text_tokens`` x ``text_width``, optional pooled output and a
    text mask whose last ``padded_tokens`` are padding); VAE/video nodes are dropped and each sampler's latent
    goes to a sink; the latent is shrunk to ``width`` x ``height`` x ``length`` frames; KSampler /
    KSamplerAdvanced / BasicScheduler get ``steps``; loaders point at ``unet_name``; the patch node gets
    ``patch_inputs``.
    """
    prompt = copy.deepcopy(prompt)
    sinks = []
    for nid, node in list(prompt.items()):
        ct = node["class_type"]
        inputs = node["inputs"]
        if ct == "CLIPTextEncode":
            prompt[nid] = {"class_type": COND_NODE, "inputs": {
                "seed": int(nid) if nid.isdigit() else 1, "tokens": text_tokens, "width": text_width,
                "clip_vision_tokens": 0, "clip_vision_width": 1280, "pooled_width": pooled_width,
                "padded_tokens": padded_tokens}}
        elif ct in ("CLIPLoader", "DualCLIPLoader", "VAELoader", "VAEDecode", "CreateVideo", "SaveVideo",
                    "SaveAnimatedWEBP", "VAEDecodeTiled", "CLIPVisionLoader", "CLIPVisionEncode", "LoadImage"):
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
        elif ct == "BasicScheduler":
            inputs["steps"] = steps
        elif ct == "KSamplerSelect" and sampler is not None:
            inputs["sampler_name"] = sampler
        elif ct == "SamplerCustomAdvanced":
            sinks.append(nid)
        elif ct == "MCSparsePatch" and patch_inputs:
            inputs.update(patch_inputs)
    for nid in sinks:
        if not any(isinstance(v, list) and v and v[0] == nid for n in prompt.values() for v in n["inputs"].values()):
            prompt[f"sink{nid}"] = {"class_type": SINK_NODE, "inputs": {"samples": [nid, 0]}}
    return prompt


tinyfy_wan_prompt = tinyfy_prompt  # the name the first integration tests used


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
    import inspect

    kwargs = {}
    if "cache_args" in inspect.signature(execution.PromptExecutor).parameters:  # v0.33.0 reads cache_args["ram"]
        kwargs["cache_args"] = {"lru": 0, "ram": 0.0, "ram_inactive": 0.0}  # main.py's defaults with no flags
    executor = execution.PromptExecutor(_ServerStub(), cache_type=execution.CacheType.CLASSIC, **kwargs)
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
                                   "warmup_layers": 0, "backend": "torch"},  # the reference, asked for: CPU
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
