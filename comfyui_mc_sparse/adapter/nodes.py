"""The "MC-Sparse Patch" node (ComfyUI V3 node API) and the pack's ``comfy_entrypoint`` (which also registers the
fidelity nodes of ``fidelity_nodes``: MC-Sparse Probe, Probe Report, Compare).

Schema pattern: core ``comfy_extras/nodes_easycache.py`` L328-356 (``io.ComfyNode`` + ``io.Schema``) and
entry point L490-498 (``ComfyExtension.get_node_list``). Imported only inside ComfyUI (root ``__init__``).

The node id, input ids and combo options are a persistence contract with saved workflows: never rename them
(``tests/test_adapter_workflows.py`` pins them).
"""

from __future__ import annotations

import logging

from comfy_api.latest import ComfyExtension, io

from .fidelity_nodes import FIDELITY_NODES
from .lifecycle import apply_mc_sparse
from .settings import (BACKENDS, BOX_DEFAULTS, CACHE_PLACEMENTS, MAX_HEADROOM_GIB, PRESET_NAMES, RESIDUAL_PRECISIONS,
                       cache_size_note)

logger = logging.getLogger(__name__)

NODE_ID = "MCSparsePatch"


class MCSparsePatch(io.ComfyNode):
    """MODEL in, MODEL out: MC-Sparse sparse self-attention on Wan 2.1/2.2, HunyuanVideo, Hunyuan3D and (ComfyUI
    v0.33.0) MiniMax-H3 (docs/comfyui.md, "Models")."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=NODE_ID,
            display_name="MC-Sparse Patch",
            category="model/patch",
            description=(
                "Training-free sparse attention for video and 3D diffusion transformers (MC-Sparse). "
                "Pays off on long token counts (video from ~480p/33 frames up, Hunyuan3D): each step after "
                "the dense warm-up attends only a fraction (density) of the tokens, corrected by a residual "
                "measured at anchor steps. Unsupported models and calls run normal dense attention; the run "
                "summary in the console says what went sparse and why anything stayed dense."
            ),
            inputs=[
                io.Model.Input("model", tooltip="The diffusion model (after the loader and any LoRA)."),
                io.Combo.Input(
                    "preset", options=list(PRESET_NAMES), default="balanced",
                    tooltip="quality = 25% density, balanced = 20%, fast = 15% (paper: 15-25% keeps PSNR ~28-33 dB "
                            "at 1.5-2x faster denoising). The presets use the authors' published schedule scaled to "
                            "your step count: the first 20% of the steps dense, one anchor on the last of them, "
                            "block 0 dense. They ignore the density / warm-up / warm-up layers / anchor boxes; pick "
                            "custom to use them (e.g. a second anchor).",
                ),
                io.Float.Input(
                    "density", default=BOX_DEFAULTS["density"], min=0.05, max=1.0, step=0.01,
                    display_mode=io.NumberDisplay.slider,
                    tooltip="custom only: share of tokens each query group looks at on sparse steps. Lower is "
                            "faster but drifts further from the dense result; 1.0 = no sparsity.",
                ),
                io.String.Input(
                    "dense_warmup", default=BOX_DEFAULTS["dense_warmup"],
                    tooltip="custom only: how many first steps run normal attention: a step count ('10') or a "
                            "percent of the sampler's steps ('20%'). auto: with auto anchors, 20% of the steps "
                            "(published: 10 of 50); with your own anchors, every step up to and including the first "
                            "anchor (anchors '5, 26' -> 5 steps; '30, 40' -> 30), since sparse steps need an "
                            "anchor before them.",
                ),
                io.Int.Input(
                    "warmup_layers", default=1, min=0, max=100,
                    tooltip="custom only (presets: 1): the first N transformer blocks always run normal attention "
                            "(they are the most sensitive). 1 is a good default.",
                ),
                io.String.Input(
                    "anchor_steps", default=BOX_DEFAULTS["anchor_steps"],
                    tooltip="custom only: steps (1-based, as in the progress bar) where MC-Sparse re-measures "
                            "which tokens matter, e.g. '10' for 50 steps, or percents '20%'. auto = one anchor on "
                            "the last dense warm-up step (10 of 50), which costs little since that step is dense "
                            "anyway. A second anchor ('10, 26' or '20%, 52%') costs about one more anchor step "
                            "(~2-3% of a 50-step run) and may help if late quality sags. Each "
                            "KSampler counts its own steps. An anchor before the warm-up's last step: with both "
                            "boxes in the same unit (steps and steps, or % and %) the node stops with an error; "
                            "with mixed units it moves to the warm-up's last step and the run summary notes it.",
                ),
                io.Combo.Input(
                    "query_tile", options=["128", "64"], default="128",
                    tooltip="Queries per group (C). 128 suits most GPUs; 64 for small or odd token counts.",
                ),
                io.Combo.Input(
                    "cache_placement", options=list(CACHE_PLACEMENTS), default="auto",
                    tooltip="Where the per-block cache lives between steps: gpu (fastest), cpu (saves VRAM on "
                            "long videos), auto.",
                ),
                io.Combo.Input(
                    "backend", options=list(BACKENDS), default="auto",
                    tooltip="Kernel backend. auto picks the fastest available: flash_attn4 or cuda_sdpa for the "
                            "dense passes; for the sparse ones cutedsl or flash_attn4's paged route (the optional "
                            "Hopper install, README), else triton; torch always works (slow). A backend that "
                            "cannot run here falls back, and the run summary says which ran and why.",
                ),
                io.Int.Input(
                    "min_tokens", default=2048, min=0, max=1_000_000, step=256,
                    tooltip="Attention over fewer latent tokens than this stays normal (sparsity does not pay "
                            "off on short sequences).",
                ),
                io.Boolean.Input(
                    "verbose", default=False,
                    tooltip="Log more detail (the patched call sites and the settings).",
                ),
                io.Combo.Input(
                    "residual_precision", options=list(RESIDUAL_PRECISIONS), default="auto",
                    tooltip="How the per-block correction (residual) is stored between steps: bf16 (exact), fp8 (half "
                            "the size, near-identical output), int4 (a quarter, slightly less faithful). auto: bf16 "
                            "when the cache fits your free VRAM or a safe share of your free RAM, else fp8, else "
                            "int4; the console says what it chose before sampling, or why the run stays dense and "
                            "which setting would fit. Cache sizes, " + cache_size_note() + ".",
                ),
                io.Float.Input(
                    "memory_headroom_gib", default=4.0, min=0.0, max=MAX_HEADROOM_GIB, step=0.5,
                    tooltip="GiB the cache leaves free for ComfyUI on the GPU (and in RAM when the cache lives "
                            "there). Raise it if you run out of memory elsewhere; lower it to fit a bigger cache. "
                            "At most 75% of the free RAM is ever used.",
                ),
            ],
            outputs=[io.Model.Output(tooltip="The model with MC-Sparse attention.")],
        )

    @classmethod
    def execute(cls, model, preset: str, density: float, dense_warmup: str, warmup_layers: int, anchor_steps: str,
                query_tile: str, cache_placement: str, backend: str, min_tokens: int, verbose: bool,
                residual_precision: str = "auto", memory_headroom_gib: float = 4.0) -> io.NodeOutput:
        try:
            tile = int(query_tile)
        except (TypeError, ValueError):
            raise ValueError(f"query tile C must be 64 or 128, got {query_tile!r}") from None
        return io.NodeOutput(apply_mc_sparse(
            model, preset=preset, density=density, dense_warmup=dense_warmup, warmup_layers=warmup_layers,
            anchor_steps=anchor_steps, query_tile=tile, cache_placement=cache_placement, backend=backend,
            min_tokens=min_tokens, verbose=verbose, residual_precision=residual_precision,
            memory_headroom_gib=memory_headroom_gib,
        ))


class MCSparseExtension(ComfyExtension):
    """The pack's node list for ComfyUI's V3 loader (``nodes.load_custom_node``)."""

    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        from .nodes_raylight import raylight_nodes

        return [MCSparsePatch, *FIDELITY_NODES, *raylight_nodes()]


async def comfy_entrypoint() -> MCSparseExtension:
    """V3 entry point ComfyUI calls when the pack exports no ``NODE_CLASS_MAPPINGS``."""
    return MCSparseExtension()
