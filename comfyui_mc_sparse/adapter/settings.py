"""Node widget values -> validated patch settings, and their resolution for one sampler call.

The node stores *what the artist asked for* (``PatchSettings``); the number of denoising steps is only known
when a sampler starts, so warm-up and anchors given in percent (or left on ``auto``) are turned into concrete
0-based step indices per sampler call by ``resolve_schedule``. Nothing here imports ComfyUI.

Units used throughout:

* step numbers typed by the user are **1-based**, as ComfyUI's progress bar counts them ("10, 26" = the
  paper's video anchors, MC-Sparse arXiv 2610.06801 sec. 4); internally steps are 0-based within the sampler call;
* percentages are of the sampler call's step count (a Wan2.2 high-noise stage of 10 steps: "20%" = step 2);
* density is the fraction of KV tokens each query group keeps, in (0, 1].
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from fractions import Fraction

from ..config import CACHE_PLACEMENTS, GROUP_SIZES

logger = logging.getLogger(__name__)

PRESETS: dict[str, float] = {"quality": 0.25, "balanced": 0.20, "fast": 0.15}
"""Preset -> density. 25 % and 15 % are the paper's reported video settings (its Wan2.1 and HunyuanVideo results, quoted
in README.md). Every
preset runs the authors' published schedule scaled to the sampler call (``schedule.paper_video_schedule``: dense
warm-up 20 % of the steps, one anchor folded into its last step) with block 0 dense (``PRESET_WARMUP_LAYERS``)."""

PRESET_WARMUP_LAYERS = 1
"""Dense warm-up layers of every preset: block 0 always dense, as in the authors' published configuration."""

PRESET_NAMES = ("quality", "balanced", "fast", "custom")
RESIDUAL_PRECISIONS = {"auto": "auto", "bf16": "bfloat16", "fp8": "float8_e4m3fn", "int4": "int4_group"}
"""The node's residual precision options -> ``MCSparseConfig.residual_dtype`` (``memory.plan_cache`` decides 'auto').
The node's 'int4' is the group form (0.4 of the row-scaled "int4"'s error for 1.5 % more bytes, docs/cache.md)."""
MAX_HEADROOM_GIB = 256.0
BOX_DEFAULTS = {"density": 0.2, "dense_warmup": "auto", "warmup_layers": 1, "anchor_steps": "auto"}
"""Defaults of the node's density / dense warm-up / warm-up layers / anchor steps boxes (``nodes``): presets ignore the boxes and
warn when one differs from its default."""
BACKENDS = ("auto", "cutedsl", "flash_attn4", "cuda_sdpa", "triton", "torch")
"""The node's backend combo: ``kernels.registry.backend_names()`` (auto, then the registered backends, highest
priority first; an unavailable one is still listed and falls back with its reason in the summary), less
"torch_gpu", which implements only the query grouping and is picked by every choice for that op.
``tests/test_adapter_inputs.py`` checks the two stay equal."""


@dataclass(frozen=True)
class StepSpec:
    """One step position as typed: ``value`` is a 1-based step number, or a percent when ``percent``."""

    value: float
    percent: bool

    def to_index(self, num_steps: int) -> int:
        """0-based step index within a sampler call of ``num_steps`` steps (may be >= num_steps)."""
        if self.percent:
            return max(0, self._steps(num_steps) - 1)
        return int(self.value) - 1

    def to_count(self, num_steps: int) -> int:
        """Number of steps this spec covers from the start of a call of ``num_steps`` steps."""
        if self.percent:
            return min(num_steps, self._steps(num_steps))
        return int(self.value)

    def _steps(self, num_steps: int) -> int:
        """ceil(value % of ``num_steps``), exact: "28%" of 50 steps is 14 (in floats 0.28 * 50 = 14.000000000000002
        rounds up to 15)."""
        return math.ceil(Fraction(repr(self.value)) * num_steps / 100)

    def __str__(self) -> str:
        return f"{self.value:g}%" if self.percent else f"{int(self.value)}"


@dataclass(frozen=True)
class PatchSettings:
    """What the MC-Sparse Patch node asked for (validated, frozen, cheap to deep-copy).

    Attributes:
        preset: one of ``PRESET_NAMES`` (informational once resolved).
        density: fraction of KV tokens kept per query group, in (0, 1].
        group_size: query tile C, 64 or 128 tokens.
        warmup: dense warm-up length (steps or percent); None = the published schedule scaled to the call.
        warmup_layers: number of leading transformer blocks that always run dense (>= 0; presets: 1).
        anchors: anchor steps (1-based steps or percents); None = the published schedule's one anchor.
        cache_placement: "auto", "gpu" or "cpu": where cached indices/residuals live between steps.
        residual_precision: "auto", "bf16", "fp8" or "int4" (``RESIDUAL_PRECISIONS``): how the residual is stored.
        memory_headroom_gib: GiB the cache leaves free for ComfyUI on the GPU and in host memory, >= 0.
        backend: kernel backend request, one of ``BACKENDS``.
        min_tokens: self-attention calls with fewer tokens (per sequence) run dense.
        verbose: log every dense decision once per reason and a per-layer table at the end of a run.
    """

    preset: str
    density: float
    group_size: int
    warmup: StepSpec | None
    warmup_layers: int
    anchors: tuple[StepSpec, ...] | None
    cache_placement: str
    backend: str
    min_tokens: int
    verbose: bool
    residual_precision: str = "auto"
    memory_headroom_gib: float = 4.0


def parse_step_list(text: str, *, name: str, allow_empty: bool = False) -> tuple[StepSpec, ...] | None:
    """Parse ``"10, 26"`` (1-based steps) or ``"20%, 52%"`` (percent of the run); ``"auto"``/blank -> None.

    Raises:
        TypeError: ``text`` is not a string.
        ValueError: an entry is not a positive integer or a percent in (0, 100]; the message names ``name``.
    """
    if not isinstance(text, str):
        raise TypeError(f"{name} must be text like '10, 26' or '20%, 52%', got {type(text).__name__}")
    stripped = text.strip().lower()
    if stripped in ("", "auto"):
        return None
    specs = []
    for raw in stripped.replace(";", ",").split(","):
        item = raw.strip()
        if not item:
            continue
        specs.append(_parse_one(item, name=name))
    if not specs and not allow_empty:
        raise ValueError(f"{name} must list at least one step (e.g. '10, 26' or '20%, 52%') or 'auto', got {text!r}")
    return tuple(specs)


def _parse_one(item: str, *, name: str) -> StepSpec:
    if item.endswith("%"):
        try:
            value = float(item[:-1])
        except ValueError:
            raise ValueError(f"{name} must hold step numbers or percents like '20%', got {item!r}") from None
        if not (0.0 < value <= 100.0):  # (False for NaN too)
            raise ValueError(f"{name} percents must be in (0%, 100%], got {item!r}")
        return StepSpec(value, True)
    try:
        value = int(item)
    except ValueError:
        raise ValueError(f"{name} must hold whole step numbers (1-based) or percents like '20%', got {item!r}") from None
    if value < 1:
        raise ValueError(f"{name} step numbers are 1-based and must be >= 1, got {item!r}")
    return StepSpec(float(value), False)


def parse_warmup(text: str) -> StepSpec | None:
    """Parse the dense warm-up widget: ``"auto"``, a step count ``"10"`` (0 allowed) or a percent ``"20%"``.

    Raises:
        ValueError: anything else; the message names "dense warm-up".
    """
    if not isinstance(text, str):
        raise TypeError(f"dense warm-up must be text like '10' or '20%', got {type(text).__name__}")
    stripped = text.strip().lower()
    if stripped in ("", "auto"):
        return None
    if stripped.endswith("%"):
        try:
            value = float(stripped[:-1])
        except ValueError:
            raise ValueError(f"dense warm-up must be 'auto', a step count or a percent like '20%', got {text!r}") from None
        if not (0.0 <= value <= 100.0):
            raise ValueError(f"dense warm-up percent must be in [0%, 100%], got {text!r}")
        return StepSpec(value, True)
    try:
        value = int(stripped)
    except ValueError:
        raise ValueError(f"dense warm-up must be 'auto', a step count or a percent like '20%', got {text!r}") from None
    if value < 0:
        raise ValueError(f"dense warm-up must be >= 0 steps, got {text!r}")
    return StepSpec(float(value), False)


def build_settings(
    *,
    preset: str,
    density: float,
    dense_warmup: str,
    warmup_layers: int,
    anchor_steps: str,
    query_tile: int,
    cache_placement: str,
    backend: str,
    min_tokens: int,
    verbose: bool,
    residual_precision: str = "auto",
    memory_headroom_gib: float = 4.0,
) -> PatchSettings:
    """Validate the node's widget values and return ``PatchSettings``.

    With a preset other than "custom", density comes from ``PRESETS``, warm-up/anchors are the published
    schedule scaled to each sampler call (one anchor folded into the last dense warm-up step) and block 0 is
    dense (``PRESET_WARMUP_LAYERS``): the density, warm-up, warm-up layers and anchor widgets are ignored.

    Raises:
        ValueError / TypeError: naming the input, the accepted range and the value got.
    """
    if preset not in PRESET_NAMES:
        raise ValueError(f"preset must be one of {', '.join(PRESET_NAMES)}, got {preset!r}")
    if isinstance(warmup_layers, bool) or not isinstance(warmup_layers, int) or warmup_layers < 0:
        raise ValueError(f"dense warm-up layers must be a whole number >= 0, got {warmup_layers!r}")
    if query_tile not in GROUP_SIZES:
        raise ValueError(f"query tile C must be 64 or 128, got {query_tile!r}")
    if cache_placement not in CACHE_PLACEMENTS:
        raise ValueError(f"cache placement must be one of {', '.join(CACHE_PLACEMENTS)}, got {cache_placement!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 0:
        raise ValueError(f"min tokens must be a whole number >= 0, got {min_tokens!r}")
    if residual_precision not in RESIDUAL_PRECISIONS:
        raise ValueError(f"residual precision must be one of {', '.join(RESIDUAL_PRECISIONS)}, got {residual_precision!r}")
    if (isinstance(memory_headroom_gib, bool) or not isinstance(memory_headroom_gib, (int, float))
            or not 0.0 <= memory_headroom_gib <= MAX_HEADROOM_GIB):
        raise ValueError(f"memory headroom must be a number of GiB in [0, {MAX_HEADROOM_GIB:g}], got {memory_headroom_gib!r}")
    if preset != "custom":
        # A preset ignores the density / warm-up / warm-up layers / anchor boxes entirely (not even validated):
        # its density and the published schedule scaled to each sampler call, block 0 dense. Edited boxes are
        # named in a warning.
        edited = [f"{name} {value!r}" for name, value, default in (
            ("density", density, BOX_DEFAULTS["density"]), ("dense warm-up", dense_warmup, BOX_DEFAULTS["dense_warmup"]),
            ("warm-up layers", warmup_layers, BOX_DEFAULTS["warmup_layers"]),
            ("anchor steps", anchor_steps, BOX_DEFAULTS["anchor_steps"])) if value != default]
        if edited:
            logger.warning("MC-Sparse: preset '%s' sets density %g and the published schedule; it ignores %s (choose "
                           "preset 'custom' to use them)", preset, PRESETS[preset], ", ".join(edited))
        density, warmup, anchors = PRESETS[preset], None, None
        warmup_layers = PRESET_WARMUP_LAYERS
    else:
        if not isinstance(density, (int, float)) or isinstance(density, bool):
            raise TypeError(f"density must be a number in (0, 1], got {type(density).__name__}")
        if not (0.0 < float(density) <= 1.0):
            raise ValueError(f"density must be in (0, 1], got {density}")
        warmup = parse_warmup(dense_warmup)
        anchors = parse_step_list(anchor_steps, name="anchor steps")
        _check_same_unit_order(warmup, anchors)
    return PatchSettings(
        preset=preset,
        density=float(density),
        group_size=int(query_tile),
        warmup=warmup,
        warmup_layers=int(warmup_layers),
        anchors=anchors,
        cache_placement=cache_placement,
        backend=backend,
        min_tokens=int(min_tokens),
        verbose=bool(verbose),
        residual_precision=residual_precision,
        memory_headroom_gib=float(memory_headroom_gib),
    )


def _check_same_unit_order(warmup: StepSpec | None, anchors: tuple[StepSpec, ...] | None) -> None:
    """Warm-up and anchors typed in the same unit (all step numbers, or all percents): an anchor before the
    last warm-up step is a contradiction known now, so the node rejects it. Mixed units can only be compared
    once a sampler call's step count is known (``resolve_schedule`` then moves such an anchor, with a note).

    Raises:
        ValueError: naming "anchor steps" and "dense warm-up", with both values.
    """
    if warmup is None or anchors is None:
        return
    if any(a.percent != warmup.percent for a in anchors):
        return
    first = min(a.value for a in anchors)
    if first < warmup.value:
        unit = "%" if warmup.percent else ""
        raise ValueError(
            f"anchor steps must not come before the last dense warm-up step ({warmup.value:g}{unit}), "
            f"got first anchor {first:g}{unit}; with both in the same unit this is rejected (move the anchor "
            f"to >= {warmup.value:g}{unit} or shorten the dense warm-up)"
        )


@dataclass(frozen=True)
class ResolvedSchedule:
    """Warm-up and anchors of one sampler call, 0-based within its ``num_steps`` steps.

    ``notes`` lists adjustments made while resolving (anchors past the end dropped, anchors moved out of the
    warm-up), for the run summary.
    """

    num_steps: int
    warmup_steps: int
    anchor_steps: tuple[int, ...]
    notes: tuple[str, ...]


def resolve_schedule(settings: PatchSettings, num_steps: int) -> ResolvedSchedule:
    """Turn the settings' warm-up/anchor specs into concrete 0-based steps for a call of ``num_steps`` steps.

    ``auto`` uses ``schedule.paper_video_schedule(num_steps)`` (the published configuration scaled: 20 % dense
    warm-up, one anchor at its last step). A warm-up without anchors gets one anchor at its last step; anchors
    without a warm-up get a warm-up ending at the first anchor (a second anchor is typed, e.g. "20%, 52%"). Anchors inside the warm-up move to its last
    step (which is an anchor anyway); anchors past the end of the call are dropped; both are noted.

    Raises:
        ValueError: ``num_steps`` < 1.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    notes: list[str] = []
    if settings.warmup is None and settings.anchors is None:
        from ..schedule import paper_video_schedule

        warmup_steps, anchors = paper_video_schedule(num_steps)
        anchors = tuple(int(a) for a in anchors)
    else:
        if settings.anchors is not None:
            raw = [a.to_index(num_steps) for a in settings.anchors]
            dropped = sorted({r for r in raw if r >= num_steps})
            if dropped:
                notes.append(
                    f"anchor steps {', '.join(str(d + 1) for d in dropped)} lie past the end of this "
                    f"{num_steps}-step sampler call and were dropped"
                )
            anchors = tuple(sorted({r for r in raw if r < num_steps}))
        else:
            anchors = None
        if settings.warmup is not None:
            warmup_steps = settings.warmup.to_count(num_steps)
        else:
            warmup_steps = (anchors[0] + 1) if anchors else num_steps
        if anchors is None:
            first = max(0, min(warmup_steps, num_steps) - 1)
            anchors = (first,)
    warmup_steps = min(int(warmup_steps), num_steps)
    if anchors and anchors[0] < warmup_steps - 1:
        moved = [a for a in anchors if a < warmup_steps - 1]
        notes.append(
            f"anchor steps {', '.join(str(a + 1) for a in moved)} fall inside the dense warm-up and were "
            f"moved to its last step {warmup_steps}"
        )
        anchors = tuple(sorted({max(a, warmup_steps - 1) for a in anchors}))
    if not anchors:
        notes.append("no anchor step falls inside this sampler call: it runs dense")
    elif warmup_steps >= num_steps:
        notes.append(f"the dense warm-up covers all {num_steps} steps of this sampler call")
    return ResolvedSchedule(num_steps=num_steps, warmup_steps=warmup_steps, anchor_steps=tuple(anchors), notes=tuple(notes))


def cache_size_note(preset: str = "quality") -> str:
    """The cache sizes per residual precision option of the node (``RESIDUAL_PRECISIONS``) for Wan2.1-14B, 81 frames,
    CFG, at 720p and 480p under ``preset`` (block 0 dense), computed by ``memory.estimate_cache`` (for the node's
    tooltips)."""
    from ..config import MCSparseConfig
    from ..memory import GIB, estimate_for_config

    cfg = MCSparseConfig(density=PRESETS[preset], warmup_layers=1)
    parts = []
    for label, tokens in (("720p", 21 * 45 * 80), ("480p", 21 * 30 * 52)):
        sizes = []
        for option, p in RESIDUAL_PRECISIONS.items():
            if p != "auto":
                est = estimate_for_config(cfg, heads=40, head_dim=128, layers=40, tokens=tokens, residual_dtype=p)
                sizes.append(f"{option} {est.total_bytes / GIB:.1f}")
        parts.append(f"{label}: {' / '.join(sizes)} GiB")
    return f"Wan2.1-14B, 81 frames, CFG, preset {preset}: " + "; ".join(parts)
