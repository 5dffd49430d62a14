"""Which attention a layer runs at a denoising step: dense, anchor or reuse (MC-Sparse sec. 4).

Pure functions of the configuration and the 0-based step index within one sampler call's schedule.
"""

from __future__ import annotations

import enum
import math

from .config import MCSparseConfig

PAPER_STEPS = 50
PAPER_WARMUP_STEPS = 10
PAPER_ANCHORS_1_BASED = (10, 26)


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
    if step < config.warmup_steps or step < config.anchor_steps[0]:
        return StepKind.DENSE
    return StepKind.REUSE


def paper_video_schedule(num_steps: int) -> tuple[int, tuple[int, ...]]:
    """The paper's video schedule scaled to ``num_steps``: (warmup_steps, 0-based anchor_steps).

    At 50 steps this is 10 warm-up steps and anchors (9, 25) (1-based 10 and 26). Fewer steps scale the
    fractions 10/50 and 26/50 (rounded, at least one warm-up step); duplicate anchors collapse.
    Raises ValueError when num_steps < 1.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    warmup = max(1, round(num_steps * PAPER_WARMUP_STEPS / PAPER_STEPS))
    anchors = sorted({max(warmup, math.floor(num_steps * a / PAPER_STEPS + 0.5)) - 1 for a in PAPER_ANCHORS_1_BASED})
    return warmup, tuple(a for a in anchors if a < num_steps) or (num_steps - 1,)


def count_steps(config: MCSparseConfig, num_steps: int, num_layers: int) -> dict[StepKind, int]:
    """How many (step, layer) calls of each kind a run of ``num_steps`` x ``num_layers`` makes."""
    counts = dict.fromkeys(StepKind, 0)
    for step in range(num_steps):
        for layer in range(num_layers):
            counts[step_kind(config, step, layer)] += 1
    return counts
