"""What the metadata cache will cost, where it goes and in which precision, and what the schedule will buy,
before sampling.

``plan_cache`` picks the residual precision ('auto': bf16, else fp8, else int4-group, else int4) and the placement
(GPU, else pinned host memory within ``pin_budget``) from the free memory, or keeps the run dense with the settings
that would fit.

``estimate_cache`` gives the bytes of the encoded cache (``encoding``) per (layer, branch) entry and in total,
for model dims, tokens, density, C, CFG branches, selection encoding and residual dtype; the byte formulas are
the encoder's own (``encoding.*_nbytes``), so an estimate equals the stored bytes of real entries
(tests/test_memory.py). ``expected_speedup`` models a denoising step as attention (a share ``a`` of a dense
step) plus the rest, and costs each step of the schedule:

- dense step: 1;
- anchor step: (1 - a) + a * (1 + 0.5 + s / e): dense pass 1, pass 2 of exact selection at ~half a dense
  attention in GEMM work (MC-Sparse sec. 3.3), one sparse evaluation for the residual; PDDP is negligible;
- reuse step: (1 - a) + a * (s / e + d), with kernel efficiency e = (dense time x s) / sparse time (project
  assumption 0.90: the flash-attn-4 paged route measured 0.87-0.90 at the 14B shape, docs/kernels-benchmark.md) and
  d the cache's decode / transfer overhead as a fraction of a dense attention (0 when hidden by prefetch).
Dense warm-up layers count as dense in every step. With a = 0.68 this reproduces the 1.57x (s =
0.25, e = 0.90) and 1.76x (s = 0.15, e = 0.97) for Wan2.1-14B 720p at the paper's 50-step schedule.

Attention shares were measured on an H200 with ComfyUI's Wan2.1 code (docs/speedup.md): 48 % of a
Wan2.1-14B 480p step (S = 32760), 68 % at 720p (S = 75600), 58 % for Wan2.1-1.3B at 480p. Attention grows as
S^2 and the rest as S, so a share measured at S0 carries to S as r = a0/(1 - a0) * S/S0, a = r/(1 + r) (the
14B 480p point predicts 0.68 at 720p, as measured). Other models use the 14B calibration, marked uncalibrated.
"""

from __future__ import annotations

import math
import sys
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
FP8_DECODE_OVERHEAD = 0.03  # dequantising pass before the kernel reads the residual itself; int4 assumed the same
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
            int32 groups and indices, the residual as stored), needed on the GPU whatever the placement.
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
    residual: bool = True,
) -> CacheEstimate:
    """Cache bytes for one model and resolution.

    Args:
        heads, head_dim: H and D of the self-attention. layers: transformer blocks (all, dense warm-up
            layers included: they are subtracted). tokens: S. density: s in (0, 1].
        group_size, kv_tile: C and the KV tile (K = ``keys_for_density``). branches: conditioning branches
            cached separately (2 with CFG, 1 without). batch: B per call (1 when ComfyUI's conds arrive as
            separate chunks, which is how the adapter keys them).
        warmup_layers: blocks that always run dense (no entry). index_encoding, residual: as in
            ``MCSparseConfig``. residual_dtype: a storage name (``encoding.RESIDUAL_FORMATS``; "auto" counts as
            bf16, what it resolves to without a plan: use ``plan_cache`` for the choice).
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
    residual_dtype = "bfloat16" if residual_dtype == "auto" else residual_dtype
    res = encoding.residual_nbytes(batch, heads, tokens, head_dim, residual_dtype, groups) if residual else 0
    naive = rows * width * 4 + batch * heads * groups * group_size * 4
    naive += 2 * batch * heads * tokens * head_dim if residual else 0
    # in flight at a reuse call: int32 groups and indices, the residual in its stored form (the kernel reads it)
    decoded = rows * width * 4 + batch * heads * groups * group_size * 4 + res
    entries = max(0, layers - warmup_layers) * branches
    return CacheEstimate(entries, grp, sel, res, kind, residual_dtype if residual else "none", naive, 2 * decoded)


def estimate_for_config(config: MCSparseConfig, *, heads: int, head_dim: int, layers: int, tokens: int,
                        branches: int = 2, batch: int = 1, residual_dtype: str | None = None) -> CacheEstimate:
    """``estimate_cache`` with the density, C, tile, layers and storage settings of ``config`` (the residual
    stored as ``residual_dtype`` when given, e.g. what 'auto' resolved to)."""
    return estimate_cache(
        heads=heads, head_dim=head_dim, layers=layers, tokens=tokens, density=config.density,
        group_size=config.group_size, kv_tile=config.kv_tile, branches=branches, batch=batch,
        warmup_layers=config.warmup_layers, index_encoding=config.index_encoding,
        residual_dtype=residual_dtype or config.residual_dtype, residual=config.residual,
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
        anchors: anchor steps in the schedule. anchor_step_cost: one anchor step's time in dense steps.
        anchor_share: the anchors' time beyond the dense attention their step runs anyway (pass 2 + top-K, one
            sparse evaluation), as a fraction of the whole MC-Sparse run.
    """

    speedup: float
    reuse_speedup: float
    attention_share: float
    kernel_efficiency: float
    steps: dict
    calibrated: bool
    overhead: float = 0.0
    anchors: int = 0
    anchor_step_cost: float = 1.0
    anchor_share: float = 0.0


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
    extra = cost[StepKind.ANCHOR] - cost[StepKind.DENSE]
    anchor_layers = counts[StepKind.ANCHOR]
    n_anchors = len([s for s in config.anchor_steps if s < num_steps])
    per_step = 1.0 + a * extra * anchor_layers / max(1, n_anchors) / num_layers
    return SpeedupEstimate(num_steps / total, 1.0 / ((1 - a) + a * sparse), a, kernel_efficiency,
                           {k.value: n for k, n in counts.items()}, calibrated, overhead, n_anchors, per_step,
                           a * extra * anchor_layers / num_layers / total)


# --- messages -------------------------------------------------------------------------------------------------


def decode_overhead(est: CacheEstimate) -> float:
    """The reuse call's decode cost for ``est``'s formats, as a fraction of a dense attention call (measured)."""
    quantised = est.residual_dtype in (encoding.FP8_DTYPE_NAME, encoding.INT4_NAME, encoding.INT4_GROUP_NAME)
    return DECODE_OVERHEAD[est.selection_encoding] + (FP8_DECODE_OVERHEAD if quantised else 0.0)


def _gb(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB // 10 else f"{n / 2**20:.1f} MiB"


def format_plan(est: CacheEstimate, speed: SpeedupEstimate | None = None, placement: str | None = None,
                plan: CachePlan | None = None) -> str:
    """One log line: the cache's bytes (parts, against the naive layout), placement, the memory decision
    (``plan``: the choice, the other precisions' sizes, the figures it was made from) and the expected speedup."""
    line = (
        f"MC-Sparse plan: cache {_gb(est.total_bytes)} for {est.entries} layer x branch entries "
        f"({_gb(est.entry_bytes)} each: selections {est.selection_encoding} {_gb(est.selection_bytes)}, "
        f"residual {est.residual_dtype} {_gb(est.residual_bytes)}, groups {_gb(est.groups_bytes)}; "
        f"naive int32 + bf16 layout {_gb(est.naive_total_bytes)})"
    )
    if placement:
        line += f", placement {placement} (+{_gb(est.working_bytes)} GPU working set)"
    if plan is not None:
        line += f"; {plan.describe()}"
    if speed is not None:
        line += (
            f"; expected DiT speedup {speed.speedup:.2f}x (reuse steps {speed.reuse_speedup:.2f}x; attention "
            f"{speed.attention_share:.0%} of a dense step{'' if speed.calibrated else ', uncalibrated model'}, "
            f"sparse kernel efficiency {speed.kernel_efficiency:.2f} assumed, cache decode {speed.overhead:.2f} of a "
            f"dense attention)"
        )
        if speed.anchors:
            line += (
                f"; {speed.anchors} anchor step{'s' if speed.anchors > 1 else ''} at ~{speed.anchor_step_cost:.2f}x "
                f"a dense step each, ~{speed.anchor_share:.1%} of the run (estimate)"
            )
    return line


# --- placement and precision before sampling ------------------------------------------------------------------

AUTO_PRECISIONS = ("bfloat16", encoding.FP8_DTYPE_NAME, encoding.INT4_GROUP_NAME, encoding.INT4_NAME)
"""What residual precision 'auto' tries, in order: the first whose cache fits (GPU or pinned host memory) wins.
int4-group before int4: 0.4 of the error for 1.5 % more bytes (docs/cache.md); int4 only where that margin decides."""
PRECISION_LABELS = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", encoding.FP8_DTYPE_NAME: "fp8",
                    encoding.INT4_GROUP_NAME: "int4-group", encoding.INT4_NAME: "int4"}
_FIDELITY_NOTES = {  # H200, Wan2.1-14B 720p shape, synthetic workload (docs/cache.md): reuse output rel L1 over bf16's
    encoding.INT4_GROUP_NAME: "; int4-group: reuse output within 0.001 rel L1 of bf16's (measured, docs/cache.md)",
    encoding.INT4_NAME: "; int4 costs some fidelity in the steps right after the anchor (+0.005 rel L1, docs/cache.md)",
}
HOST_PIN_SHARE = 0.75
"""Share of the host's *available* memory (psutil ``virtual_memory().available``) the cache may pin. Pinned pages
cannot be swapped or reclaimed, so pinning all of it would push ComfyUI's own later allocations (VAE decode,
models it moves to RAM, its own pinned weights) and the OS page cache into swap or the OOM killer; a quarter of
what is available (and at least ``cache_headroom_gib``) stays free."""
WINDOWS_PIN_SHARE = 0.40
"""On Windows the driver caps page-locked memory near half of RAM: the cache pins at most 40 % of the total
(ComfyUI's own pinned-memory cap, ``comfy/model_management.py`` MAX_PINNED_MEMORY, uses the same figure)."""


@dataclass(frozen=True)
class HostMemory:
    """Host memory figures in bytes: ``available`` (what new allocations can take without swapping), ``total``,
    and where they came from ("psutil", "/proc/meminfo" or "given")."""

    available: int
    total: int
    source: str = "given"


def host_memory() -> HostMemory | None:
    """The host's memory now: psutil (a ComfyUI requirement, imported lazily), else Linux ``/proc/meminfo``, else
    None (unknown: the plan then does not pin, ``plan_cache``)."""
    try:
        import psutil

        vm = psutil.virtual_memory()
        return HostMemory(int(vm.available), int(vm.total), "psutil")
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.split()[1:2]}
        return HostMemory(info["MemAvailable"], info["MemTotal"], "/proc/meminfo")
    except (OSError, KeyError, ValueError, IndexError):
        return None


def pin_budget(host: HostMemory | None, headroom_bytes: int, *, windows: bool | None = None) -> int:
    """Bytes the cache may pin in host memory: ``HOST_PIN_SHARE`` of the available memory and no more than
    available - headroom (and ``WINDOWS_PIN_SHARE`` of the total on Windows); 0 when the figures are unknown."""
    if host is None:
        return 0
    budget = min(int(HOST_PIN_SHARE * host.available), host.available - headroom_bytes)
    if sys.platform == "win32" if windows is None else windows:
        budget = min(budget, int(WINDOWS_PIN_SHARE * host.total))
    return max(0, budget)


@dataclass(frozen=True)
class CachePlan:
    """The cache's precision and placement for one run, decided before sampling (``plan_cache``).

    Attributes:
        residual_dtype: the storage chosen (``encoding.RESIDUAL_FORMATS``), None when the run stays dense.
        placement: "gpu" or "cpu" (pinned host memory), None when the run stays dense.
        estimate: the chosen cache's ``CacheEstimate`` (None when dense).
        options: residual storage -> ``CacheEstimate`` for every precision considered (the sizes shown).
        gpu_budget: GPU bytes free for the cache and its working set, before the headroom (None: unknown or
            not a GPU run: not a constraint). host_budget: bytes it may pin (``pin_budget``).
        headroom: bytes left free for ComfyUI. host: the host figures used (None: unknown).
        requested: the config's residual_dtype and cache_placement.
        reason: why the run stays dense (None otherwise). fits: settings that would fit, when dense.
    """

    residual_dtype: str | None
    placement: str | None
    estimate: CacheEstimate | None
    options: dict
    gpu_budget: int | None
    host_budget: int
    headroom: int
    host: HostMemory | None
    requested: tuple[str, str]
    reason: str | None = None
    fits: tuple[str, ...] = ()

    @property
    def dense(self) -> bool:
        return self.residual_dtype is None

    def why_not(self, precision: str) -> str:
        """Why ``precision`` does not fit (each placement tried), '' when it does: e.g. 'GPU working set 4.80 GiB >
        4.00 GiB free after the headroom'."""
        est = self.options[precision]
        gpu_left = None if self.gpu_budget is None else self.gpu_budget - self.headroom
        reasons = []
        for placement in _PLACEMENT_ORDER[self.requested[1]]:
            if _fit(est, placement, self.gpu_budget, self.host_budget, self.headroom):
                return ""
            if placement == "gpu":
                reasons.append(f"cache + working set {_gb(est.total_bytes + est.working_bytes)} > GPU "
                               f"{_gb(max(0, gpu_left))} free after the headroom")
            elif gpu_left is not None and est.working_bytes > gpu_left:
                reasons.append(f"in RAM: its GPU working set {_gb(est.working_bytes)} > {_gb(max(0, gpu_left))}")
            else:
                reasons.append(f"in RAM: > pin budget {_gb(self.host_budget)}")
        return "; ".join(reasons)

    def describe(self) -> str:
        """The decision in words: choice, sizes of each precision (and why each better one does not fit), the memory
        figures, what would fit."""
        sizes = ", ".join(f"{PRECISION_LABELS.get(k, k)} {_gb(e.total_bytes)}" + (
            f" ({self.why_not(k)})" if k != self.residual_dtype and self.why_not(k) else "")
            for k, e in self.options.items())
        gpu = "GPU free unknown" if self.gpu_budget is None else f"GPU {_gb(self.gpu_budget)} free"
        host = ("host memory unknown (nothing pinned)" if self.host is None else
                f"host pin budget {_gb(self.host_budget)} of {_gb(self.host.available)} available")
        figures = f"{gpu}, headroom {_gb(self.headroom)}, {host}"
        dtype, placement = self.requested
        if self.dense:
            fits = "; ".join(self.fits) or "no single setting change (free GPU or host memory first)"
            return (f"cache does not fit: residual {dtype}, placement {placement} ({sizes}; {figures}): this run "
                    f"stays dense. Would fit: {fits}")
        cost = _FIDELITY_NOTES.get(self.residual_dtype, "")
        return (f"residual {dtype} -> {PRECISION_LABELS.get(self.residual_dtype, self.residual_dtype)}, placement "
                f"{placement} -> {self.placement} ({sizes}; {figures}{cost})")


def _fit(est: CacheEstimate, placement: str, gpu_budget: int | None, host_budget: int, headroom: int) -> bool:
    gpu_left = math.inf if gpu_budget is None else gpu_budget - headroom
    if placement == "gpu":
        return est.total_bytes + est.working_bytes <= gpu_left
    return est.working_bytes <= gpu_left and est.total_bytes <= host_budget


_PLACEMENT_ORDER = {"auto": ("gpu", "cpu"), "gpu": ("gpu",), "cpu": ("cpu",)}


def plan_cache(config: MCSparseConfig, *, heads: int, head_dim: int, layers: int, tokens: int, branches: int = 2,
               batch: int = 1, gpu_free: int | None, host: HostMemory | None, windows: bool | None = None,
               suggest: bool = True) -> CachePlan:
    """Choose the residual precision and the placement before sampling, from the free memory.

    Precisions tried: ``AUTO_PRECISIONS`` for "auto" (bf16, then fp8, int4-group, int4), else only the configured one;
    for each, placements "gpu" then "cpu" ('auto'), or the configured one; the first that fits wins:
    - gpu: cache + working set + headroom <= ``gpu_free``;
    - cpu: working set + headroom <= ``gpu_free`` and cache <= ``pin_budget(host, headroom)`` (never pins more).
    Nothing fits: the run stays dense (``CachePlan.dense``), ``reason`` says why and ``fits`` names settings
    that would fit (residual precision, headroom, placement, a shorter video).

    Args:
        config: the settings (density, C, warm-up layers, residual_dtype, cache_placement, cache_headroom_gib).
        heads, head_dim, layers, tokens, branches, batch: as ``estimate_cache``.
        gpu_free: GPU bytes the cache may use (the adapter's ComfyUI-aware figure); None: not a GPU run, or
            unknown (no GPU constraint). host: ``host_memory()`` figures; None: unknown (nothing may be pinned).
        windows: apply the Windows pinning cap (None: when running on Windows).
        suggest: when dense, work out ``fits`` (a few dozen more estimates).
    """
    headroom = int(config.cache_headroom_gib * GIB)
    host_budget = pin_budget(host, headroom, windows=windows)
    precisions = AUTO_PRECISIONS if config.residual_dtype == "auto" else (config.residual_dtype,)
    if not config.residual:
        precisions = ("bfloat16",)  # no residual stored: the precision changes nothing
    kw = dict(heads=heads, head_dim=head_dim, layers=layers, tokens=tokens, branches=branches, batch=batch)
    options = {p: estimate_for_config(config, residual_dtype=p, **kw) for p in precisions}
    requested = (PRECISION_LABELS.get(config.residual_dtype, config.residual_dtype), config.cache_placement)
    common = dict(options=options, gpu_budget=gpu_free, host_budget=host_budget, headroom=headroom, host=host,
                  requested=requested)
    for p, est in options.items():
        for placement in _PLACEMENT_ORDER[config.cache_placement]:
            if _fit(est, placement, gpu_free, host_budget, headroom):
                return CachePlan(p, placement, est, **common)
    smallest = min(options.values(), key=lambda e: e.total_bytes)
    reason = (f"the cache needs {_gb(smallest.total_bytes)} at least ({smallest.residual_dtype} residual) and "
              f"{_gb(smallest.working_bytes)} of GPU working set")
    fits = tuple(_what_would_fit(config, kw, gpu_free, host, windows)) if suggest else ()
    return CachePlan(None, None, None, reason=reason, fits=fits, **common)


def _what_would_fit(config: MCSparseConfig, kw: dict, gpu_free: int | None, host: HostMemory | None,
                    windows: bool | None) -> list[str]:
    """Single setting changes that make ``plan_cache`` fit, cheapest in fidelity first: node inputs by their names,
    then the residual off, which only the Python API sets (``MCSparseConfig.residual``), so said."""
    import dataclasses

    def fits(**change) -> CachePlan | None:
        plan = plan_cache(dataclasses.replace(config, **change), gpu_free=gpu_free, host=host, windows=windows,
                          suggest=False, **kw)
        return None if plan.dense else plan

    out = []
    for p in AUTO_PRECISIONS:
        if config.residual_dtype not in ("auto", p) and (plan := fits(residual_dtype=p)):
            out.append(f"residual precision {PRECISION_LABELS[p]} ({_gb(plan.estimate.total_bytes)}, "
                       f"{plan.placement})")
            break
    if config.cache_placement != "auto" and (plan := fits(cache_placement="auto")):
        out.append(f"cache placement auto ({plan.placement})")
    for gib in (2.0, 1.0, 0.0):
        if gib < config.cache_headroom_gib and (plan := fits(cache_headroom_gib=gib)):
            out.append(f"memory headroom {gib:g} GiB ({_gb(plan.estimate.total_bytes)} "
                       f"{PRECISION_LABELS[plan.residual_dtype]}, {plan.placement}; less memory left for ComfyUI)")
            break
    lo, hi = 0, kw["tokens"]  # largest token count that fits: a shorter video or a lower resolution
    while hi - lo > 1:
        mid = (lo + hi) // 2
        plan = plan_cache(config, gpu_free=gpu_free, host=host, windows=windows, suggest=False,
                          **(kw | {"tokens": mid}))
        lo, hi = (mid, hi) if not plan.dense else (lo, mid)
    if lo >= 1:
        out.append(f"fewer latent tokens: at most {lo} (now {kw['tokens']}: fewer frames or a lower resolution)")
    if config.residual:
        none = dataclasses.replace(config, residual=False)
        if not plan_cache(none, gpu_free=gpu_free, host=host, windows=windows, suggest=False, **kw).dense:
            out.append("residual off (MCSparseConfig(residual=False) in the Python API, not a node input; costs "
                       "fidelity: paper sec. 5 ablation, -3.5 dB)")
    return out


def suggest_settings(config: MCSparseConfig, shape: tuple[int, ...], entries: int, free_bytes: int | None,
                     host: HostMemory | None = None) -> list[str]:
    """Settings that would fit a cache of ``entries`` entries for q of ``shape`` ``[B, H, S, D]`` after an out of
    memory error: ``plan_cache``'s suggestions for ``free_bytes`` of GPU memory (None: unknown) and ``host``."""
    B, H, S, D = shape
    kw = dict(heads=H, head_dim=D, layers=entries + config.warmup_layers, tokens=S, branches=1, batch=B)
    return _what_would_fit(config, kw, free_bytes, host, None) or ["fewer frames or a lower resolution"]
