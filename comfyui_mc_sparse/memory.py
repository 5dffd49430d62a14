"""What the metadata cache will cost and what the schedule will buy, before sampling.

``estimate_cache`` gives the bytes of the encoded cache (``encoding``) per (layer, branch) entry and in total,
for model dims, tokens, density, C, CFG branches, selection encoding and residual dtype; the byte formulas are
the encoder's own (``encoding.*_nbytes``), so an estimate equals the stored bytes of real entries
(tests/test_memory.py). ``expected_speedup`` models a denoising step as attention (a share ``a`` of a dense
step) plus the rest, and costs each step of the schedule:

- dense step: 1;
- anchor step: (1 - a) + a * (1 + 0.5 + s / e): dense pass 1, pass 2 of exact selection at ~half a dense
  attention in GEMM work (MC-Sparse sec. 3.3), one sparse evaluation for the residual; PDDP is negligible;
- reuse step: (1 - a) + a * (s / e + d), with kernel efficiency e = (dense time x s) / sparse time (project
  assumption 0.90: the flash-attn-4 paged route measured 0.87-0.90 at the 14B shape, docs/performance.md) and
  d the cache's decode / transfer overhead as a fraction of a dense attention (0 when hidden by prefetch).
Dense warm-up layers count as dense in every step. With a = 0.68 this reproduces performance.md's 1.57x (s =
0.25, e = 0.90) and 1.76x (s = 0.15, e = 0.97) for Wan2.1-14B 720p at the paper's 50-step schedule.

Attention shares were measured on an H200 with ComfyUI's Wan2.1 code (docs/performance.md): 48 % of a
Wan2.1-14B 480p step (S = 32760), 68 % at 720p (S = 75600), 58 % for Wan2.1-1.3B at 480p. Attention grows as
S^2 and the rest as S, so a share measured at S0 carries to S as r = a0/(1 - a0) * S/S0, a = r/(1 + r) (the
14B 480p point predicts 0.68 at 720p, as measured). Other models use the 14B calibration, marked uncalibrated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from . import encoding
from .config import MCSparseConfig
from .schedule import StepKind, count_steps
from .selection import keys_for_density

GIB = 1 << 30

ATTENTION_SHARES = {
    # (heads, head_dim): (tokens S0 where measured, self-attention share of a dense step at S0)
    (40, 128): (32760, 0.48),  # Wan2.1/2.2-14B, 480p 81 frames (720p measured 0.68, predicted 0.68)
    (12, 128): (32760, 0.58),  # Wan2.1-1.3B, 480p 81 frames
}
DEFAULT_KERNEL_EFFICIENCY = 0.90
# Cost of decoding a compact entry at a reuse call, as a fraction of one dense attention call: measured on the
# H200 at the Wan2.1-14B 480p shape (docs/cache.md: +1.8 ms per layer for bitmask selections, +2.9 ms with an fp8
# residual, against ~36 ms of dense attention per block). The bitmask decode scales like dense attention with S
# (H*S^2/C vs H*S^2*D), the fp8 dequantisation like S, so the fp8 part is an upper bound at larger S.
DECODE_OVERHEAD = {"bitmask": 0.05, "uint16": 0.005, "int32": 0.0}
FP8_DECODE_OVERHEAD = 0.03
SELECTION_PASS_COST = 0.5  # pass 2 + top-K as a fraction of one dense attention (paper sec. 3.3)


@dataclass(frozen=True)
class CacheEstimate:
    """Bytes of the encoded metadata cache.

    Attributes:
        entries: cached (layer, branch) entries = sparse layers x branches.
        groups_bytes, selection_bytes, residual_bytes: per entry, encoded.
        selection_encoding: the encoding "auto" resolved to ("bitmask", "uint16" or "int32").
        residual_dtype: storage dtype name of the residual ("none" when off).
        naive_entry_bytes: per entry in the paper's layout (int32 perm and indices, bf16 residual).
        working_bytes: GPU bytes of decoded entries in flight at a reuse step (current + prefetched next:
            int32 groups and indices, residual in the compute dtype), needed on the GPU whatever the placement.
    """

    entries: int
    groups_bytes: int
    selection_bytes: int
    residual_bytes: int
    selection_encoding: str
    residual_dtype: str
    naive_entry_bytes: int
    working_bytes: int

    @property
    def entry_bytes(self) -> int:
        """Bytes of one encoded (layer, branch) entry."""
        return self.groups_bytes + self.selection_bytes + self.residual_bytes

    @property
    def total_bytes(self) -> int:
        """Bytes of the whole encoded cache."""
        return self.entry_bytes * self.entries

    @property
    def naive_total_bytes(self) -> int:
        return self.naive_entry_bytes * self.entries


def estimate_cache(
    *,
    heads: int,
    head_dim: int,
    layers: int,
    tokens: int,
    density: float,
    group_size: int = 128,
    kv_tile: int = 64,
    branches: int = 2,
    batch: int = 1,
    warmup_layers: int = 0,
    index_encoding: str = "auto",
    residual_dtype: str = "bfloat16",
    residual_scale: str = "row",
    residual: bool = True,
    decoded_dtype_bytes: int = 2,
) -> CacheEstimate:
    """Cache bytes for one model and resolution.

    Args:
        heads, head_dim: H and D of the self-attention. layers: transformer blocks (all, dense warm-up
            layers included: they are subtracted). tokens: S. density: s in (0, 1].
        group_size, kv_tile: C and the KV tile (K = ``keys_for_density``). branches: conditioning branches
            cached separately (2 with CFG, 1 without). batch: B per call (1 when ComfyUI's conds arrive as
            separate chunks, which is how the adapter keys them).
        warmup_layers: blocks that always run dense (no entry). index_encoding, residual_dtype,
            residual_scale, residual: as in ``MCSparseConfig``. decoded_dtype_bytes: bytes of q's dtype (2
            for bf16/fp16), for the decoded residual in flight.
    Returns:
        CacheEstimate (bytes).
    Raises:
        ValueError: a dimension < 1 or an unknown encoding.
    """
    for name, value in (("heads", heads), ("head_dim", head_dim), ("layers", layers), ("tokens", tokens),
                        ("branches", branches), ("batch", batch)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    num_keys = keys_for_density(density, tokens, kv_tile)
    width = -(-num_keys // kv_tile) * kv_tile
    groups = -(-tokens // group_size)
    rows = batch * heads * groups
    kind = encoding.pick_selection_encoding(index_encoding, tokens, num_keys, width)
    sel = encoding.selection_nbytes(kind, rows, tokens, num_keys, width)
    grp = encoding.groups_nbytes(batch, heads, tokens, group_size)
    res = encoding.residual_nbytes(batch, heads, tokens, head_dim, residual_dtype, residual_scale) if residual else 0
    naive = rows * width * 4 + batch * heads * groups * group_size * 4
    naive += 2 * batch * heads * tokens * head_dim if residual else 0
    decoded = rows * width * 4 + batch * heads * groups * group_size * 4
    if residual:  # a residual kept on the GPU in the compute dtype is used in place; counted anyway (CPU placement)
        decoded += batch * heads * tokens * head_dim * decoded_dtype_bytes
    entries = max(0, layers - warmup_layers) * branches
    return CacheEstimate(entries, grp, sel, res, kind, residual_dtype if residual else "none", naive, 2 * decoded)


def estimate_for_config(config: MCSparseConfig, *, heads: int, head_dim: int, layers: int, tokens: int,
                        branches: int = 2, batch: int = 1) -> CacheEstimate:
    """``estimate_cache`` with the density, C, tile, layers and storage settings of ``config``."""
    return estimate_cache(
        heads=heads, head_dim=head_dim, layers=layers, tokens=tokens, density=config.density,
        group_size=config.group_size, kv_tile=config.kv_tile, branches=branches, batch=batch,
        warmup_layers=config.warmup_layers, index_encoding=config.index_encoding,
        residual_dtype=config.residual_dtype, residual_scale=config.residual_scale, residual=config.residual,
    )


# --- speed ----------------------------------------------------------------------------------------------------


def attention_share(heads: int, head_dim: int, tokens: int) -> tuple[float, bool]:
    """(self-attention share of a dense step, calibrated?) for a model of ``heads`` x ``head_dim`` at S tokens.

    Scales a measured share (``ATTENTION_SHARES``) with S (see the module docstring); models not in the table
    use the Wan2.1-14B calibration and return calibrated=False.
    """
    calibrated = (heads, head_dim) in ATTENTION_SHARES
    s0, a0 = ATTENTION_SHARES.get((heads, head_dim), ATTENTION_SHARES[(40, 128)])
    r = a0 / (1 - a0) * tokens / s0
    return r / (1 + r), calibrated


@dataclass(frozen=True)
class SpeedupEstimate:
    """Expected DiT denoising speedup of a schedule over dense (text encoders and VAE excluded).

    Attributes:
        speedup: dense time / MC-Sparse time of the sampler call. reuse_speedup: the same for one reuse step.
        attention_share: a. kernel_efficiency: e. steps: counts per step kind (over layers, in layer-steps).
        calibrated: the share came from a measurement of this model (else the 14B calibration).
        overhead: the reuse call's extra cost assumed (fraction of a dense attention).
    """

    speedup: float
    reuse_speedup: float
    attention_share: float
    kernel_efficiency: float
    steps: dict
    calibrated: bool
    overhead: float = 0.0


def expected_speedup(
    config: MCSparseConfig,
    *,
    num_steps: int,
    num_layers: int,
    attention_share: float,
    kernel_efficiency: float = DEFAULT_KERNEL_EFFICIENCY,
    overhead: float = 0.0,
    calibrated: bool = True,
) -> SpeedupEstimate:
    """Expected speedup of ``config``'s schedule over ``num_steps`` x ``num_layers`` (model in the docstring).

    Args:
        attention_share: a in (0, 1), self-attention's share of a dense step. kernel_efficiency: e in (0, 1].
        overhead: extra cost of a reuse call as a fraction of a dense attention (cache decode or transfer not
            hidden), >= 0.
    Raises:
        ValueError: an argument out of range.
    """
    if not 0.0 < attention_share < 1.0:
        raise ValueError(f"attention_share must be in (0, 1), got {attention_share}")
    if not 0.0 < kernel_efficiency <= 1.0:
        raise ValueError(f"kernel_efficiency must be in (0, 1], got {kernel_efficiency}")
    if num_steps < 1 or num_layers < 1:
        raise ValueError(f"num_steps and num_layers must be >= 1, got {num_steps}, {num_layers}")
    a, sparse = attention_share, config.density / kernel_efficiency + overhead
    cost = {StepKind.DENSE: 1.0, StepKind.ANCHOR: 1.0 + SELECTION_PASS_COST + sparse, StepKind.REUSE: sparse}
    counts = count_steps(config, num_steps, num_layers)
    attention = sum(cost[kind] * n for kind, n in counts.items()) / num_layers  # in dense-attention steps
    total = num_steps * (1 - a) + a * attention
    return SpeedupEstimate(num_steps / total, 1.0 / ((1 - a) + a * sparse), a, kernel_efficiency,
                           {k.value: n for k, n in counts.items()}, calibrated, overhead)


# --- messages -------------------------------------------------------------------------------------------------


def decode_overhead(est: CacheEstimate) -> float:
    """The reuse call's decode cost for ``est``'s formats, as a fraction of a dense attention call (measured)."""
    fp8 = FP8_DECODE_OVERHEAD if est.residual_dtype == encoding.FP8_DTYPE_NAME else 0.0
    return DECODE_OVERHEAD[est.selection_encoding] + fp8


def _gb(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB // 10 else f"{n / 2**20:.1f} MiB"


def format_plan(est: CacheEstimate, speed: SpeedupEstimate | None = None, placement: str | None = None) -> str:
    """One log line: the cache's bytes (parts, against the naive layout), placement, expected speedup."""
    line = (
        f"MC-Sparse plan: cache {_gb(est.total_bytes)} for {est.entries} layer x branch entries "
        f"({_gb(est.entry_bytes)} each: selections {est.selection_encoding} {_gb(est.selection_bytes)}, "
        f"residual {est.residual_dtype} {_gb(est.residual_bytes)}, groups {_gb(est.groups_bytes)}; "
        f"naive int32 + bf16 layout {_gb(est.naive_total_bytes)})"
    )
    if placement:
        line += f", placement {placement} (+{_gb(est.working_bytes)} GPU working set)"
    if speed is not None:
        line += (
            f"; expected DiT speedup {speed.speedup:.2f}x (reuse steps {speed.reuse_speedup:.2f}x; attention "
            f"{speed.attention_share:.0%} of a dense step{'' if speed.calibrated else ', uncalibrated model'}, "
            f"sparse kernel efficiency {speed.kernel_efficiency:.2f} assumed, cache decode {speed.overhead:.2f} of a "
            f"dense attention)"
        )
    return line


def suggest_settings(config: MCSparseConfig, shape: tuple[int, ...], entries: int, free_bytes: int | None,
                     host_bytes: int | None = None) -> list[str]:
    """Settings that would fit a cache of ``entries`` entries for q of ``shape`` ``[B, H, S, D]``.

    Args:
        free_bytes: GPU bytes available to the cache (None: unknown). host_bytes: CPU bytes available for a
            'cpu' placement (None: unknown, assumed enough).
    Returns:
        Human strings, cheapest change first, each with the bytes it needs; empty when nothing listed fits.
    """
    B, H, S, D = shape

    def est(**changes):
        fields = {"density": config.density, "group_size": config.group_size, "kv_tile": config.kv_tile,
                  "index_encoding": config.index_encoding, "residual_dtype": config.residual_dtype,
                  "residual_scale": config.residual_scale, "residual": config.residual} | changes
        return estimate_cache(heads=H, head_dim=D, layers=entries, tokens=S, batch=B, branches=1, **fields)

    out = []
    budget = math.inf if free_bytes is None else free_bytes
    now = est()
    fp8 = est(residual_dtype=encoding.FP8_DTYPE_NAME)
    if config.residual_dtype != encoding.FP8_DTYPE_NAME and fp8.total_bytes + fp8.working_bytes <= budget:
        out.append(f"residual_dtype='{encoding.FP8_DTYPE_NAME}' ({_gb(fp8.total_bytes)} on the GPU)")
    host_ok = host_bytes is None or now.total_bytes <= host_bytes
    if config.cache_placement != "cpu" and now.working_bytes <= budget and host_ok:
        out.append(f"cache_placement='cpu' ({_gb(now.total_bytes)} of CPU memory, {_gb(now.working_bytes)} on the GPU)")
    if fp8.working_bytes <= budget and (host_bytes is None or fp8.total_bytes <= host_bytes):
        out.append(f"cache_placement='cpu' with residual_dtype='{encoding.FP8_DTYPE_NAME}' "
                   f"({_gb(fp8.total_bytes)} of CPU memory)")
    none = est(residual=False)
    if config.residual and none.total_bytes + none.working_bytes <= budget:
        out.append(f"residual off ({_gb(none.total_bytes)}; costs fidelity, paper sec. 5 ablation: -3.5 dB)")
    out.append("fewer frames or a lower resolution (the cache grows with tokens S: residual ~S, selections ~S^2)")
    return out
