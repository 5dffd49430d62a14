"""Per-model rules: which modules run the self-attention MC-Sparse may replace, and their token layout.

The override alone cannot tell self- from cross-attention (ComfyUI passes both the same
transformer_options; docs/comfyui.md), nor which block it is in (the Oct-2025 snapshot sets no
block index for DiTs). So every self-attention call site of a supported model is **marked**: its module's
``forward`` is object-patched (``ModelPatcher.add_object_patch``, ``comfy/model_patcher.py`` L453; applied in
``patch_model`` L744-749, restored in ``unpatch_model`` L794-798) with a wrapper that calls the original with
a *copy* of transformer_options carrying a ``CallSite`` under ``MARK_KEY``. Calls without a mark (cross
attention, Wan I2V image branch, HunyuanVideo's token refiner, text encoders) are passed through dense.
A newer ComfyUI's ``transformer_options["block_index"]`` is not needed: the mark carries the block.

Models (class names of ``model.diffusion_model``; sources are ComfyUI snapshot files):

* Wan 2.1/2.2 T2V, I2V, FLF, Fun, Camera, 5B TI2V, HuMo (``comfy/ldm/wan/model.py``: ``WanModel`` and
  subclasses; self-attn ``blocks.i.self_attn``, call L81-87, q/k/v ``(B, S, H*128)``). Extra tokens
  (``reference_latent`` prepended L552-556, ``time_dim_concat`` appended) are just more self-attention tokens.
  v0.33.0's SCAIL / SCAIL-2 (``SCAILWanModel``, ``SCAIL2WanModel``: pose tokens appended to the video's, not in
  the cache estimate, which counts the latent's tokens) and WanDancer (``wan/model_wandancer.py``: music injected
  between blocks through unmarked cross-attention) run Wan's own blocks.
* Wan VACE (``VaceWanModel`` L661-776): main blocks as Wan. ``vace_blocks[ii]`` runs right after main block
  ``i`` (``vace_layers_mapping``, L702) with the same transformer_options, once per VACE context
  (``for iii in range(len(c))``, L766-769). Its call site gets the main block's index as ``layer`` (as newer
  ComfyUI's ``block_index`` does) and ``kind="vace"``, and each repeat within one forward an ``occurrence``
  number, so every VACE call has its own cache entry and never collides with main block ``i``.
* HunyuanVideo (``comfy/ldm/hunyuan_video/model.py`` ``HunyuanVideo`` L191): ``double_blocks.i`` and
  ``single_blocks.j`` (layer ``n_double + j``); joint sequence **[video, text]** in v0.3.64 (``flux/layers.py``
  L182-185 with ``flipped_img_txt``; single blocks get ``cat(img, txt)``, hunyuan L372) and **[text, video]**
  in v0.33.0 (``flipped_img_txt`` gone, ``cat(txt, img)``); the order is read from the double blocks.
* MiniMax-H3 (v0.33.0 ``comfy/ldm/minimax/model.py`` ``MiniMaxH3Model``): ``blocks.i.attn``; one packed
  sequence [text | conditions / references | audio | video]; the video rows come from the model's own
  ``PackedLayout`` (``minimax.py``), everything before them is kept exact.
* Hunyuan3D 2.0 (``comfy/ldm/hunyuan3d/model.py`` ``Hunyuan3Dv2`` L13): double blocks joint **[cond, latent]**
  (not flipped), single blocks ``cat(txt, img)`` (L123).
* Hunyuan3D 2.1 (``comfy/ldm/hunyuan3dv2_1/hunyuandit.py`` ``HunYuanDiTPlain`` L536): its ``Attention``
  (L352-418) calls attention **without** transformer_options, so ``blocks.i.attn1.forward`` is replaced by
  ``hunyuan3d21.make_attn_forward`` (same projections, then the MC-Sparse dispatch). The sequence is
  [1 time token, latent tokens]; the latent set is unordered (PDDP groups it; no grid is assumed).

Wan S2V (``WanModel_S2V``) passes no transformer_options to its blocks, and Wan Animate's face adapter calls
attention directly: both stay dense (unmarked). v0.33.0's causal autoregressive Wan and Wan Animate 2 stay dense
with their reason in the summary (``SKIPPED``). Every other model: dense pass-through, counted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .callsite import MARK_KEY, OCCURRENCE_KEY, TEXT_LEN_KEY, CallSite
from . import hunyuan3d21

logger = logging.getLogger(__name__)

WAN_FAMILY = ("WanModel", "VaceWanModel", "CameraWanModel", "HumoWanModel", "AnimateWanModel", "SCAILWanModel",
              "SCAIL2WanModel", "WanDancerModel")
SKIPPED = {
    "WanModel_S2V": "Wan S2V blocks pass no transformer_options (snapshot)",
    "CausalWanModel": "Wan causal autoregressive model (v0.33.0 wan/ar_model.py): its self-attention reads a rolling "
                      "KV cache of earlier frames, not one sequence per step",
    "WanAnimate2Model": "Wan Animate 2 (v0.33.0 wan/model_animate2.py) attends per frame against pose keys, not one "
                        "sequence per step",
}


@dataclass(frozen=True)
class PatchPlan:
    """What to object-patch on one model: ``(attribute path, factory(original) -> replacement)`` pairs,
    whether an APPLY_MODEL wrapper must publish transformer_options (Hunyuan3D 2.1), and the family."""

    family: str | None
    patches: tuple[tuple[str, Callable[[Callable], Callable]], ...]
    needs_context_publisher: bool
    reason_unsupported: str | None
    diffusion_model_wrapper: Callable | None = None
    """A DIFFUSION_MODEL wrapper that records the token layout of each forward (MiniMax-H3), or None."""


def _marking_forward(original: Callable, site: CallSite, *, record_text_len_from: str | None = None,
                     reset_occurrences: bool = False, count_occurrences: bool = False) -> Callable:
    """Wrap ``original`` (a module's forward) to call it with a copied transformer_options carrying ``site``.

    ``record_text_len_from`` names the kwarg whose ``shape[1]`` is the text length (joint double blocks):
    it is stored under ``TEXT_LEN_KEY`` in the caller's per-forward dict for the single blocks after them.
    ``reset_occurrences`` (the first main block) starts a fresh ``OCCURRENCE_KEY`` dict for this forward;
    ``count_occurrences`` (VACE blocks) numbers this site's calls within the forward.
    """

    def forward(*args: Any, **kwargs: Any):
        options = kwargs.get("transformer_options")
        if options is None:  # caller passed none (e.g. S2V); nothing to mark
            return original(*args, **kwargs)
        text_len = site.text_len
        if record_text_len_from is not None and record_text_len_from in kwargs:
            text_len = int(kwargs[record_text_len_from].shape[1])
            options[TEXT_LEN_KEY] = text_len
        if reset_occurrences:
            options[OCCURRENCE_KEY] = {}
        occurrence = 0
        if count_occurrences:
            seen = options.setdefault(OCCURRENCE_KEY, {})
            occurrence = seen.get((site.layer, site.kind), 0)
            seen[(site.layer, site.kind)] = occurrence + 1
        if site.comfy_block is not None and isinstance(options.get(BLOCK_INDEX_KEY), int):
            _check_block_index(options, site)
        marked = dict(options)
        marked[MARK_KEY] = site if (text_len, occurrence) == (site.text_len, site.occurrence) else CallSite(
            site.layer, site.family, site.joint, text_len, site.prefix, site.kind, occurrence, site.comfy_block
        )
        kwargs["transformer_options"] = marked
        return original(*args, **kwargs)

    forward.mc_sparse_marker = site
    return forward


BLOCK_INDEX_KEY = "block_index"
"""transformer_options key newer ComfyUI sets before each DiT block (with ``block_type``); v0.3.64 sets none."""


def _check_block_index(options: dict, site: CallSite) -> None:
    """Compare ComfyUI's ``(block_type, block_index)`` with ``site.comfy_block``; note a disagreement once in
    the active run's summary (``RunState.notes``), naming both."""
    got = (options.get("block_type", site.comfy_block[0]), options[BLOCK_INDEX_KEY])
    if got == site.comfy_block:
        return
    run = options.get("mc_sparse_run")
    note = (f"ComfyUI's block index {got[0]} {got[1]} differs from the marked block {site.comfy_block[0]} "
            f"{site.comfy_block[1]} (layer {site.layer}); the cache is keyed by the marked block")
    if run is not None and note not in run.notes:
        run.notes.append(note)


def _mark(site: CallSite, **kw) -> Callable[[Callable], Callable]:
    return lambda original: _marking_forward(original, site, **kw)


def plan_for(diffusion_model: Any) -> PatchPlan:
    """The object patches MC-Sparse needs on ``diffusion_model`` (a ``torch.nn.Module``), by class name."""
    name = type(diffusion_model).__name__
    if name in SKIPPED:
        return PatchPlan(None, (), False, SKIPPED[name])
    patches: list[tuple[str, Callable]] = []
    if name in WAN_FAMILY:
        blocks = getattr(diffusion_model, "blocks", [])
        vace_blocks = list(getattr(diffusion_model, "vace_blocks", None) or [])
        for i, block in enumerate(blocks):
            if hasattr(block, "self_attn"):
                patches.append((f"blocks.{i}.self_attn.forward",
                                _mark(CallSite(i, "wan", comfy_block=("double", i)),
                                      reset_occurrences=i == 0 and bool(vace_blocks))))
        # vace_layers_mapping: main block index -> VACE block index (wan/model.py L702)
        main_of = {ii: i for i, ii in (getattr(diffusion_model, "vace_layers_mapping", None) or {}).items()}
        for j, block in enumerate(vace_blocks):
            if hasattr(block, "self_attn"):
                main = main_of.get(j)
                site = CallSite(len(blocks) + j if main is None else main, "wan", kind="vace",
                                comfy_block=None if main is None else ("double", main))
                patches.append((f"vace_blocks.{j}.self_attn.forward", _mark(site, count_occurrences=True)))
        return PatchPlan("wan", tuple(patches), False, None)
    if name == "HunyuanVideo":
        return _joint_plan(diffusion_model, "hunyuan_video", _hunyuan_video_order(diffusion_model))
    if name == "Hunyuan3Dv2":
        return _joint_plan(diffusion_model, "hunyuan3d", "text_first")
    if name == "MiniMaxH3Model":
        from . import minimax

        return PatchPlan(minimax.FAMILY, tuple(minimax.patches(diffusion_model)), False, None,
                         diffusion_model_wrapper=minimax.layout_wrapper)
    if name == "HunYuanDiTPlain":
        for i, block in enumerate(getattr(diffusion_model, "blocks", [])):
            if hasattr(block, "attn1"):
                site = CallSite(i, "hunyuan3d21", prefix=1)
                patches.append((f"blocks.{i}.attn1.forward", _h3d21_factory(block.attn1, site, hunyuan3d21.make_attn_forward)))
        return PatchPlan("hunyuan3d21", tuple(patches), True, None)
    return PatchPlan(None, (), False, f"model {name} is not supported by MC-Sparse (dense pass-through)")


def _hunyuan_video_order(diffusion_model: Any) -> str:
    """HunyuanVideo's joint order, read from its double blocks: "video_first" where they carry
    ``flipped_img_txt=True`` (Oct-2025 v0.3.64, ``flux/layers.py`` L180-185; single blocks ``cat(img, txt)``),
    "text_first" where the attribute is gone (v0.33.0: ``cat(txt, img)`` in both block kinds)."""
    doubles = list(getattr(diffusion_model, "double_blocks", None) or [])
    flipped = bool(doubles) and bool(getattr(doubles[0], "flipped_img_txt", False))
    return "video_first" if flipped else "text_first"


def _h3d21_factory(module, site, maker):
    return lambda original: maker(module, site, original)


def _joint_plan(diffusion_model: Any, family: str, joint: str) -> PatchPlan:
    doubles = list(getattr(diffusion_model, "double_blocks", None) or [])
    singles = list(getattr(diffusion_model, "single_blocks", None) or [])
    patches = [
        (f"double_blocks.{i}.forward", _mark(CallSite(i, family, joint, comfy_block=("double", i)),
                                             record_text_len_from="txt"))
        for i in range(len(doubles))
    ]
    patches += [(f"single_blocks.{j}.forward", _mark(CallSite(len(doubles) + j, family, joint,
                                                              comfy_block=("single", j))))
                for j in range(len(singles))]
    return PatchPlan(family, tuple(patches), False, None)


def install_plan(patcher: Any, plan: PatchPlan) -> int:
    """Add ``plan``'s object patches to ``patcher`` (a ComfyUI ModelPatcher clone), chaining any object patch
    already registered for the same attribute (e.g. another pack's memory-efficient attention forward).
    Returns the number of patches installed. The model itself is untouched until ComfyUI loads it.
    """
    count = 0
    for rel, factory in plan.patches:
        key = f"diffusion_model.{rel}"
        existing = patcher.object_patches.get(key)
        if existing is not None and getattr(existing, "mc_sparse_marker", None) is not None:
            continue  # already ours (node applied twice): keep one layer of marking
        if existing is None:
            module_path, attr = key.rsplit(".", 1)
            module = patcher.get_model_object(module_path)
            existing = getattr(type(module), attr).__get__(module, type(module))
        patcher.add_object_patch(key, factory(existing))
        count += 1
    return count


@dataclass(frozen=True)
class Geometry:
    """Self-attention shape of one model evaluation, for the cache estimate before sampling.

    Attributes:
        heads: H. head_dim: D. tokens: S per self-attention call (latent tokens plus text/prefix tokens of
        a joint sequence, text counted as 0 when unknown before the first call). layers: marked call sites.
    """

    heads: int
    head_dim: int
    tokens: int
    layers: int


def geometry(diffusion_model: Any, plan: PatchPlan, latent_shape: tuple[int, ...]) -> Geometry | None:
    """``Geometry`` of ``diffusion_model`` for a latent of ``latent_shape`` (the OUTER_SAMPLE noise shape),
    or None for unsupported models / unknown layouts.

    Token counts: Wan and HunyuanVideo patchify (t, h, w) by ``patch_size`` (``wan/model.py`` L541-543,
    padding up as ``comfy.ldm.common_dit.pad_to_patch_size`` does); Hunyuan3D latents are ``[B, C, N]``
    (N tokens; 2.1 adds 1 time token, ``hunyuandit.py`` L620).
    """
    if plan.family is None:  # (every family below checks the latent's rank: an empty shape gives None)
        return None
    layers = len(plan.patches)
    dm = diffusion_model
    if plan.family in ("wan", "hunyuan_video"):
        patch = tuple(getattr(dm, "patch_size", (1, 2, 2)))
        if len(latent_shape) != 5 or len(patch) != 3:
            return None
        tokens = 1
        for size, p in zip(latent_shape[2:], patch):
            tokens *= -(-int(size) // int(p))
        heads = int(getattr(dm, "num_heads", 0))
        dim = int(getattr(dm, "dim", 0) or getattr(dm, "hidden_size", 0))
        return Geometry(heads, dim // heads, tokens, layers) if heads and dim else None
    if plan.family == "minimax_h3":  # latent_shape: the video stream [1, 24, T, H, W]; cache over video rows
        if len(latent_shape) != 5:
            return None
        patch = tuple(getattr(dm, "patch_size", (1, 2, 2)))
        tokens = 1
        for size, p in zip(latent_shape[2:], patch):
            tokens *= -(-int(size) // int(p))
        attn = dm.blocks[0].attn
        return Geometry(int(attn.heads), int(attn.head_dim), tokens, layers)
    if plan.family in ("hunyuan3d", "hunyuan3d21"):
        if len(latent_shape) != 3:
            return None
        tokens = int(latent_shape[-1]) + (1 if plan.family == "hunyuan3d21" else 0)
        if plan.family == "hunyuan3d21":
            attn = dm.blocks[0].attn1
            return Geometry(int(attn.num_heads), int(attn.head_dim), tokens, layers)
        block = dm.double_blocks[0]  # flux DoubleStreamBlock: num_heads, hidden_size (flux/layers.py L162)
        return Geometry(int(block.num_heads), int(block.hidden_size) // int(block.num_heads), tokens, layers)
    return None

