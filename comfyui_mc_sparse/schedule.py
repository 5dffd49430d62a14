"""Which attention a layer runs at a denoising step: dense, anchor or reuse (MC-Sparse sec. 4).

Pure functions of the configuration and the 0-based step index within one sampler call's schedule.
"""

from __future__ import annotations

import enum
import math

from .config import MCSparseConfig

WARMUP_FRACTION = 0.2
"""Dense warm-up share of the published schedule: the authors' public code (github dodododddo/mcsparse) runs 49
steps, the first 10 dense, one anchor folded into the last dense step, block 0 dense (MC-Sparse sec. 4; issue
15). 20 % gives 10 steps at 49 and at 50."""


class StepKind(enum.Enum):
    """DENSE: plain dense attention. ANCHOR: dense output plus a metadata-cache refresh (groups, exact
    selection, residual). REUSE: sparse attention with the cached groups and indices, plus the residual."""

    DENSE = "dense"
    ANCHOR = "anchor"
    REUSE = "reuse"


def step_kind(config: MCSparseConfig, step: int, layer: int) -> StepKind:
    """Kind of attention for 0-based ``step`` of the sampler call and transformer block ``layer``.

    Layers below ``warmup_layers`` are always dense; anchor steps are anchors; steps before the first
    anchor (the dense warm-up) are dense; every later step reuses the latest anchor's cache.
    Raises ValueError for a negative step or layer.
    """
    if step < 0 or layer < 0:
        raise ValueError(f"step and layer must be >= 0, got step={step}, layer={layer}")
    if layer < config.warmup_layers:
        return StepKind.DENSE
    if step in config.anchor_steps:
        return StepKind.ANCHOR
    if step < config.anchor_steps[0]:  # (the warm-up: the config keeps the first anchor >= warmup_steps - 1)
        return StepKind.DENSE
    return StepKind.REUSE


def paper_video_schedule(num_steps: int) -> tuple[int, tuple[int, ...]]:
    """The authors' published video schedule scaled to ``num_steps``: (warmup_steps, 0-based anchor_steps).

    Dense warm-up = 20 % of the steps (rounded half up, at least one step), and ONE anchor folded into the last
    warm-up step, so the anchor's dense output is that step's own: 50 steps -> (10, (9,)), 49 -> (10, (9,)),
    20 -> (4, (3,)), 4 -> (1, (0,)). A second anchor (the paper's step 26 of 50, "20%, 52%") is an option of the
    node's 'custom' preset, not of this schedule.
    Raises ValueError when num_steps < 1.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    warmup = min(num_steps, max(1, math.floor(num_steps * WARMUP_FRACTION + 0.5)))
    return warmup, (warmup - 1,)


def count_steps(config: MCSparseConfig, num_steps: int, num_layers: int) -> dict[StepKind, int]:
    """How many (step, layer) calls of each kind a run of ``num_steps`` x ``num_layers`` makes."""
    counts = dict.fromkeys(StepKind, 0)
    for step in range(num_steps):
        for layer in range(num_layers):
            counts[step_kind(config, step, layer)] += 1
    return counts
