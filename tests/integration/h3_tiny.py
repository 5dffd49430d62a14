"""A tiny MiniMax-H3 checkpoint and AV latents/conditioning for the v0.33.0 integration tests.

The checkpoint is built from ComfyUI's own ``comfy.ldm.minimax.model.MiniMaxH3Model`` on the meta device, so its
keys and shapes are what ``comfy/model_detection.py`` detects as MiniMax H3 (``video_patch_proj`` +
``audio_patch_proj``; heads = qkv rows / (3 x q_norm width)): hidden 256 = 2 heads x 128, ffn 512, 2 DiT blocks,
1 token-refiner block, text_dim 64. Weights ~N(0, 0.02) in fp16 (fp32 where the model keeps fp32), norms 1, RoPE
inverse frequencies 10000^(-i/16). Latents are ``EmptyMiniMaxH3LatentAV``'s NestedTensor (video [1, 24, T, H, W],
audio [1, 32, 2, Ta]).
"""

from __future__ import annotations

import torch

TEXT_DIM = 64
BLOCKS = 2


def write_checkpoint(models_dir, *, seed: int = 0) -> str:
    """Write ``mc_sparse_tiny_minimax_h3.safetensors`` into ``models_dir`` (once); return its file name."""
    name = "mc_sparse_tiny_minimax_h3.safetensors"
    path = models_dir / name
    if path.exists():
        return name
    import comfy.ops
    from comfy.ldm.minimax.model import MiniMaxH3Model
    from safetensors.torch import save_file

    with torch.device("meta"):
        model = MiniMaxH3Model(hidden_size=256, num_layers=BLOCKS, token_refiner_num_layers=1, num_attention_heads=2,
                               attention_head_dim=128, ffn_hidden_size=512, text_dim=TEXT_DIM,
                               time_embed_hidden_size=256, time_embed_dim=128, operations=comfy.ops.disable_weight_init)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for key, p in model.state_dict(keep_vars=True).items():
        shape = tuple(p.shape)
        if key == "rope.inv_freq":
            t = 10000.0 ** (-torch.arange(shape[0], dtype=torch.float32) / shape[0])
        elif "norm" in key:
            t = torch.ones(shape)
        else:
            t = torch.randn(shape, generator=g) * 0.02
        tensors[key] = t.to(torch.float32 if key == "rope.inv_freq" else torch.float16).contiguous()
    save_file(tensors, str(path))
    return name


def av_latent(width: int = 256, height: int = 256, length: int = 22):
    """``EmptyMiniMaxH3LatentAV.execute(width, height, length)``'s latent dict (ComfyUI's own node)."""
    from comfy_extras.nodes_minimax_h3 import EmptyMiniMaxH3LatentAV

    return EmptyMiniMaxH3LatentAV.execute(width, height, length).result[0]


def conditioning(seed: int, tokens: int = 24, **extra):
    """Synthetic Qwen3-VL states ``[1, tokens, TEXT_DIM]`` (the text encoder's output form) with cond extras."""
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(1, tokens, TEXT_DIM, generator=g), dict(extra)]]


def keyframe(seed: int, *, video_frames: int = 1, h: int = 16, w: int = 16, audio_t: int = 8, frame: int = 0) -> dict:
    """One ``MiniMaxH3AddGuide`` keyframe (its conditioning form): a video guide latent and an audio guide latent."""
    g = torch.Generator().manual_seed(seed)
    return {"resolved_frame_index": frame, "latent": torch.randn(1, 24, video_frames, h, w, generator=g),
            "audio_latent": torch.randn(1, 32, 2, audio_t, generator=g)}
