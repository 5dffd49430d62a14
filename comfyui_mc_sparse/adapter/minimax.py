"""MiniMax-H3 (ComfyUI v0.33.0, ``comfy/ldm/minimax/model.py``): which rows of its packed sequence are video,
how the blocks are marked, and the authors' published schedule.

The model attends over ONE packed sequence per call (batch 1): ``PackedLayout.segments`` is a contiguous table
of ``(start, stop, kind)`` with kinds text / cond / cond_audio / ref_img / ref_audio / audio / video, the
target audio and the target video always the last two (``PackedLayout.__init__``, "target audio then target
video"). Only the target **video** rows are sparsified, as the paper does; every other row (text, keyframe
and reference conditions, audio) is kept exact, like HunyuanVideo's text: in the override's joint path
(``override._joint_chunk``, ``joint="text_first"``) non-video *query* rows are exact over all keys and video
query rows are MC-Sparse over the video keys plus every non-video key exactly (``extra_kv``, LSE merge).

The layout is the model's own: a DIFFUSION_MODEL wrapper (``layout_wrapper``) takes the ``PackedLayout`` the
model itself would use for this forward (``minimax_payload["layout"]`` when its ``signature`` matches, else
``PackedLayout`` built with the same arguments as ``MiniMaxH3Model._forward``), checks that exactly one video
segment ends the sequence, and stores its start under ``callsite.TEXT_LEN_KEY`` in this forward's
transformer_options. No layout (or an unexpected one) leaves the key unset: the calls then run dense with the
reason "joint sequence without a known text length", counted in the run summary.

Self-attention sites: ``blocks.{i}.attn.forward`` (``Attention.forward(x, rope_freqs, transformer_options)``;
q/k/v reach the override as ``[1, H, S, D]`` views of the qkv buffer, ``skip_reshape=True``, inside
``AttentionTensorContainer``s that ``wrap_attn`` unwraps or hands to ``override``'s ``container_function``).
The token refiner's blocks (``token_refiner.blocks.{j}.attn``) are not marked: they run dense (and run once
per sampling in ``extra_conds``, outside the sampler).

Published configuration (the authors' public scripts, github dodododddo/mcsparse): 49 steps, the
first 10 dense, ONE anchor at the last dense step (0-based 9), block 0 dense, density 0.15, minimum sequence
4096 tokens, head dim 128. ``h3_schedule`` scales it to a sampler call's step count.
"""

from __future__ import annotations

import logging
from typing import Any

from .callsite import LAYOUT_MISSING_KEY, TEXT_LEN_KEY, CallSite
from .layouts import _mark

logger = logging.getLogger(__name__)

FAMILY = "minimax_h3"

H3_STEPS = 49
H3_DENSE_STEPS = 10
H3_DENSE_BLOCKS = 1
H3_MIN_TOKENS = 4096

SEGMENTS_KEY = "mc_sparse_h3_segments"
"""transformer_options key (per forward) with this forward's ``PackedLayout.segments`` as a tuple of
``(start, stop, kind)``, for the run summary and tests."""

def h3_schedule(num_steps: int) -> tuple[int, tuple[int, ...]]:
    """The published H3 schedule scaled to ``num_steps``: ``(dense warm-up steps, 0-based anchor steps)``.

    49 steps -> (10, (9,)): the first 10 steps dense and one anchor at the last dense step, whose dense
    output is the anchor's own. Other step counts keep the fraction 10/49 (rounded, at least 1; at most
    ``num_steps``) and the single anchor at the last warm-up step.

    Raises:
        ValueError: ``num_steps`` < 1.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    warmup = min(num_steps, max(1, round(num_steps * H3_DENSE_STEPS / H3_STEPS)))
    return warmup, (warmup - 1,)


def patches(diffusion_model: Any) -> list[tuple[str, Any]]:
    """Object patches marking each DiT block's self-attention (``blocks.{i}.attn.forward``) with
    ``CallSite(i, "minimax_h3", joint="text_first")``; the text length comes from ``TEXT_LEN_KEY``."""
    out = []
    for i, block in enumerate(getattr(diffusion_model, "blocks", [])):
        if hasattr(block, "attn"):
            out.append((f"blocks.{i}.attn.forward", _mark(CallSite(i, FAMILY, "text_first"))))
    return out


def video_rows(segments, seq_len: int) -> tuple[int, int] | str:
    """``(start, stop)`` of the target video rows in a packed sequence of ``seq_len`` rows, or a reason.

    Args:
        segments: ``PackedLayout.segments``, ``(start, stop, kind)`` contiguous from 0.
        seq_len: ``PackedLayout.seq_len``.
    Returns:
        the video segment's bounds when there is exactly one and it ends the sequence (the override's joint
        path keeps rows ``[0, start)`` exact); otherwise a string saying what is unexpected.
    """
    video = [(a, b) for a, b, kind in segments if kind == "video"]
    if len(video) != 1:
        return f"{len(video)} video segments in the packed layout (expected 1)"
    start, stop = video[0]
    if stop != seq_len:
        return f"the video segment [{start}, {stop}) does not end the packed sequence of {seq_len} rows"
    if start <= 0 or start >= stop:
        return f"video segment [{start}, {stop}) leaves no non-video rows or no video rows"
    return start, stop


def packed_layout(diffusion_model: Any, x: Any, context: Any, payload: dict | None) -> Any:
    """The ``PackedLayout`` ``MiniMaxH3Model._forward`` uses for this call (same rule: the payload's prebuilt
    layout when its ``signature`` matches the padded latent shapes, else one built from them).

    Args:
        diffusion_model: the ``MiniMaxH3Model``.
        x: ``[video [1, C, T, H, W], audio [1, 32, 2, Ta]]`` as the model's ``_forward`` receives it.
        context: ``[1, L, hidden or text_dim]`` text states.
        payload: ``minimax_payload`` (may be None).
    Raises:
        ImportError: not inside ComfyUI v0.33.0 (no ``comfy.ldm.minimax``).
    """
    import comfy.ldm.common_dit
    from comfy.ldm.minimax.model import PackedLayout

    payload = payload or {}
    video = comfy.ldm.common_dit.pad_to_patch_size(x[0], diffusion_model.patch_size)
    signature = (int(context.shape[1]), int(video.shape[2]), int(video.shape[3]), int(video.shape[4]),
                 int(x[1].shape[-1]))
    layout = payload.get("layout")
    if layout is not None and tuple(layout.signature) == signature:
        return layout
    return PackedLayout(*signature, keyframes=payload.get("keyframes"), refs=payload.get("refs"))


def layout_wrapper(executor, x, timestep, context, transformer_options, *args, **kwargs):
    """DIFFUSION_MODEL wrapper (``MiniMaxH3Model.forward`` runs ``_forward`` through it): record where this
    forward's video rows are (``TEXT_LEN_KEY`` = start of the video segment) before the blocks run."""
    if isinstance(transformer_options, dict):
        transformer_options.pop(TEXT_LEN_KEY, None)
        transformer_options.pop(LAYOUT_MISSING_KEY, None)
        try:
            dm = executor.class_obj
            layout = packed_layout(dm, x, context, kwargs.get("minimax_payload"))
            rows = video_rows(layout.segments, int(layout.seq_len))
            transformer_options[SEGMENTS_KEY] = tuple((int(a), int(b), str(k)) for a, b, k in layout.segments)
        except Exception as err:  # a layout we cannot read: dense, with the reason in the summary
            rows = f"no packed layout ({type(err).__name__}: {err})"
        if isinstance(rows, str):
            transformer_options[LAYOUT_MISSING_KEY] = rows
        else:
            transformer_options[TEXT_LEN_KEY] = rows[0]
    return executor(x, timestep, context, transformer_options, *args, **kwargs)


def preset_for_run(settings: Any, num_steps: int) -> tuple[Any, Any]:
    """A node preset (not "custom") on MiniMax-H3: the published H3 configuration for a sampler call.

    Density stays the preset's ('fast' = 0.15, the published value); the schedule is ``h3_schedule``; at
    least block 0 stays dense (``warmup_layers`` >= 1) and video sequences under 4096 tokens stay dense
    (``min_tokens`` >= 4096). "custom" settings are returned unchanged with the generic schedule.

    Args:
        settings: ``settings.PatchSettings``. num_steps: this sampler call's step count (>= 1).
    Returns:
        ``(settings for this run, settings.ResolvedSchedule)``.
    """
    import dataclasses

    from .settings import ResolvedSchedule, resolve_schedule

    if settings.preset == "custom":
        return settings, resolve_schedule(settings, num_steps)
    warmup, anchors = h3_schedule(num_steps)
    run_settings = dataclasses.replace(settings, warmup_layers=max(settings.warmup_layers, H3_DENSE_BLOCKS),
                                       min_tokens=max(settings.min_tokens, H3_MIN_TOKENS))
    note = (f"MiniMax-H3 preset '{settings.preset}': the published H3 schedule ({H3_DENSE_STEPS} of {H3_STEPS} "
            f"steps dense, one anchor at the last dense step) scaled to {num_steps} steps; blocks < "
            f"{run_settings.warmup_layers} dense; video sequences under {run_settings.min_tokens} tokens dense")
    return run_settings, ResolvedSchedule(num_steps=num_steps, warmup_steps=warmup, anchor_steps=anchors,
                                          notes=(note,))
