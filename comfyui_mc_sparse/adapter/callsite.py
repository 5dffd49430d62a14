"""The mark a self-attention call site carries into the attention override, and the transformer_options keys.

``layouts`` puts a ``CallSite`` under ``MARK_KEY`` in a copy of transformer_options for every marked module's
forward; ``override`` reads it. Kept apart from both so neither imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass

MARK_KEY = "mc_sparse_call_site"
"""transformer_options key of the ``CallSite`` put there by a marked module's forward."""

OCCURRENCE_KEY = "mc_sparse_occurrences"
"""transformer_options key of a per-forward ``{(layer, kind): calls so far}`` dict, reset by main block 0's
mark; numbers repeated calls of one site within a forward (VACE blocks run once per VACE context)."""

TEXT_LEN_KEY = "mc_sparse_text_len"
"""transformer_options key where a joint model's double block records the text length for its single blocks
(the dict is the per-forward one built in ``comfy/samplers.py`` L302-323, so the value lives one forward)."""

LAYOUT_MISSING_KEY = "mc_sparse_h3_layout_problem"
"""transformer_options key (per forward) with the reason a joint model's text length could not be established
(MiniMax-H3: no readable packed layout, ``minimax.layout_wrapper``); the override's dense reason for that forward's
joint calls."""


@dataclass(frozen=True)
class CallSite:
    """A marked self-attention call.

    Attributes:
        layer: block index used by the schedule's dense warm-up layers and the cache key (0-based).
        family: "wan", "hunyuan_video", "hunyuan3d", "hunyuan3d21" or "minimax_h3".
        joint: None (the sequence is all latent tokens), "video_first" ([video, text]) or "text_first"
            ([text, latent]); text tokens are never sparsified.
        text_len: number of text tokens in a joint sequence (None: read ``TEXT_LEN_KEY`` at call time).
        prefix: leading non-latent tokens that are still attended sparsely (Hunyuan3D 2.1 time token: 1).
        kind: which call inside the block: "self" (the block's own self-attention) or "vace" (a VACE block
            attached after main block ``layer``); part of the cache key.
        occurrence: 0 for the first call of this (layer, kind) in one forward, 1 for the next, ... (VACE
            blocks once per VACE context); part of the cache key.
        comfy_block: ``(block_type, block_index)`` ComfyUI itself puts in transformer_options while this
            site's block runs, in versions that set them (v0.33.0: Wan ``("double", i)``, HunyuanVideo
            ``("double", i)`` / ``("single", j)``); None where it sets none. The mark stays the source of
            ``layer`` (it names the module whose weights made q/k, which is what a cache entry belongs to);
            ComfyUI's index is checked against it on every call and a disagreement is noted in the summary.
    """

    layer: int
    family: str
    joint: str | None = None
    text_len: int | None = None
    prefix: int = 0
    kind: str = "self"
    occurrence: int = 0
    comfy_block: tuple[str, int] | None = None

    @property
    def cache_kind(self) -> str:
        """``CacheKey.kind`` of this call: ``kind``, plus ``#occurrence`` for repeats within a forward."""
        return self.kind if not self.occurrence else f"{self.kind}#{self.occurrence}"
