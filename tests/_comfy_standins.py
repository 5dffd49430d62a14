"""Small stand-ins of ComfyUI (Oct-2025 snapshot) contracts shared by the adapter's unit tests.

* ``raw_attention``: a raw attention backend as ``wrap_attn`` hands it to an override,
  ``comfy/ldm/modules/attention.py`` L476-516 (``attention_pytorch``): q/k/v (B, S, H*D) or, with skip_reshape,
  (B, H, S, D); output (B, S, H*D) unless skip_output_reshape. Computed in float64 (the tests' reference).
* ``transformer_options``: what ``comfy/samplers.py`` L321-323 adds per model call (cond_or_uncond, uuids, sigmas),
  plus the pack's run state and the self-attention mark.
"""

import math

import torch
from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter import override
from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter.callsite import MARK_KEY


def raw_attention(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
                  **kwargs):
    """Reference dense attention in float64 with ComfyUI's layout contract."""
    if not skip_reshape:
        b, s, hd = q.shape
        q, k, v = (t.view(b, -1, heads, hd // heads).transpose(1, 2) for t in (q, k, v))
    scores = q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores + mask.double()
    out = (torch.softmax(scores, -1) @ v.double()).to(q.dtype)
    if skip_reshape and skip_output_reshape:
        return out
    b, h, s, d = out.shape
    return out.transpose(1, 2).reshape(b, s, h * d)


def transformer_options(run, site, chunks=2, sigma=0.5):
    """transformer_options of one model call with ``chunks`` conditioning chunks (uncond first) at ``sigma``."""
    return {override.RUN_KEY: run, MARK_KEY: site, "cond_or_uncond": [1, 0][:chunks],
            "uuids": [f"u{i}" for i in range(chunks)], "sigmas": torch.tensor([sigma])}
