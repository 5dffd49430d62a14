"""MC-Sparse settings: one frozen, validated configuration per patched model.

Sources: MC-Sparse (arXiv 2610.06801) sec. 3 (density, query tile C) and sec. 4 (schedule: dense warm-up
steps and layers, anchor steps). Steps are 0-based indices within one sampler call's schedule: the authors'
published video setting "10 dense warm-up steps of 50, one anchor folded into the last of them" is
``warmup_steps=10, anchor_steps=(9,)`` (the default); the paper's two-anchor setting (1-based steps 10 and 26)
is ``anchor_steps=(9, 25)``.
"""

from __future__ import annotations

from dataclasses import dataclass

GROUP_SIZES = (64, 128)
"""Accepted query tile sizes C (the sparse kernel's query tile; every query group holds exactly C queries)."""

HEAD_DIMS = (64, 128)
"""Head dims the sparse path supports (Wan/HunyuanVideo 128, Hunyuan3D 64); other calls stay dense."""

RESIDUAL_DTYPES = ("auto", "bfloat16", "float16", "float32", "float8_e4m3fn", "int4_group", "int4")
"""Residual storage: "auto" (chosen before sampling from free memory: ``memory.plan_cache``), a plain dtype,
float8_e4m3fn / int4 with a float32 scale per row, or int4_group (4-bit deviations from each query group's weighted
mean row) (``encoding.encode_residual``)."""

INDEX_ENCODINGS = ("auto", "bitmask", "uint16", "int32")
"""KV selection storage (``encoding``): "auto" picks the smallest lossless form for the density and S."""

CACHE_PLACEMENTS = ("auto", "gpu", "cpu")
""""gpu": entries stay on the compute device (moved to CPU only when GPU memory is short); "cpu": in pinned CPU
memory, the next layer's entry prefetched on a side stream; "auto": GPU while the cache fits the free memory
minus ``cache_headroom_gib``, else CPU."""


@dataclass(frozen=True)
class MCSparseConfig:
    """What MC-Sparse does on one model.

    Attributes:
        density: s in (0, 1], the fraction of KV tokens each query group keeps (K = ceil(s*S), rounded up
            to ``kv_tile``, at most S). 1.0 means every token: sparse output equals dense.
        group_size: C in {64, 128}, queries per group (and the sparse kernel's query tile).
        kv_tile: K is rounded up to a multiple of this (the sparse kernel's KV tile), >= 1.
        warmup_steps: the first ``warmup_steps`` steps of a sampler call run dense attention (>= 0).
        warmup_layers: transformer blocks with index < this always run dense (>= 0).
        anchor_steps: 0-based steps that refresh the metadata cache: dense output, new query groups, exact
            selection and residual. Strictly increasing, >= 0, at least one; the first must be
            >= warmup_steps - 1 (it may overlap the last warm-up step).
        power_iters: power-iteration steps per PDDP split (>= 1).
        residual: add the cached residual O_dense - O_sparse at reuse steps (sec. 3.4). False gives
            "MC-Sparse without residual" (an ablation).
        residual_dtype: storage of the residual: "auto" (default: bf16 when the cache fits the memory free
            before sampling, else fp8, else int4_group, else int4: ``memory.plan_cache``; bf16 when no plan is
            made), "bfloat16", "float16", "float32", "float8_e4m3fn" (half the bytes of bf16, fp32 row scale),
            "int4_group" (4-bit deviations from each query group's mean row: ~0.27 of bf16's bytes) or "int4" (4-bit,
            fp32 row scale: a quarter); their fidelity cost is measured in docs/cache.md.
        index_encoding: KV selection storage, lossless: "auto" (default: smallest of bitmask, 16-bit and
            32-bit indices for the density and S), "bitmask", "uint16" or "int32" (see ``encoding``).
        cache_placement: "auto" (default), "gpu" or "cpu" (see ``CACHE_PLACEMENTS``).
        cache_headroom_gib: GiB the cache leaves free for ComfyUI: on the GPU (activations) when it is kept
            there, and in host memory when it is pinned there; >= 0, default 4 (``memory.plan_cache``).
    Raises:
        ValueError / TypeError: a field is out of range; the message names the field and the range.
    """

    density: float = 0.25
    group_size: int = 128
    kv_tile: int = 64
    warmup_steps: int = 10
    warmup_layers: int = 0
    anchor_steps: tuple[int, ...] = (9,)
    power_iters: int = 8
    residual: bool = True
    residual_dtype: str = "auto"
    index_encoding: str = "auto"
    cache_placement: str = "auto"
    cache_headroom_gib: float = 4.0

    def __post_init__(self):
        object.__setattr__(self, "anchor_steps", tuple(self.anchor_steps))
        _check_number("density", self.density)
        if not 0.0 < self.density <= 1.0:
            raise ValueError(f"density must be in (0, 1], got {self.density}")
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int):
            raise TypeError(f"group_size (query tile C) must be 64 or 128 as an int, got {self.group_size!r}")
        if self.group_size not in GROUP_SIZES:
            raise ValueError(f"group_size (query tile C) must be 64 or 128, got {self.group_size}")
        for name, low in (("kv_tile", 1), ("warmup_steps", 0), ("warmup_layers", 0), ("power_iters", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        anchors = self.anchor_steps
        if not anchors:
            raise ValueError("anchor_steps must hold at least one step, got ()")
        if any(isinstance(a, bool) or not isinstance(a, int) for a in anchors):
            raise TypeError(f"anchor_steps must be ints, got {anchors}")
        if any(a < 0 for a in anchors) or any(b <= a for a, b in zip(anchors, anchors[1:])):
            raise ValueError(f"anchor_steps must be strictly increasing steps >= 0, got {anchors}")
        if anchors[0] < self.warmup_steps - 1:
            raise ValueError(
                f"anchor_steps must not start before the dense warm-up ends: the first anchor must be >= "
                f"warmup_steps - 1 = {self.warmup_steps - 1}, got {anchors[0]}"
            )
        if self.residual_dtype not in RESIDUAL_DTYPES:
            raise ValueError(f"residual_dtype must be one of {RESIDUAL_DTYPES}, got {self.residual_dtype!r}")
        for name, options in (("index_encoding", INDEX_ENCODINGS), ("cache_placement", CACHE_PLACEMENTS)):
            if getattr(self, name) not in options:
                raise ValueError(f"{name} must be one of {options}, got {getattr(self, name)!r}")
        _check_number("cache_headroom_gib", self.cache_headroom_gib)
        if not 0.0 <= self.cache_headroom_gib < float("inf"):
            raise ValueError(f"cache_headroom_gib must be a finite number >= 0, got {self.cache_headroom_gib}")


def _check_number(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if value != value:  # NaN
        raise ValueError(f"{name} must be a number, got NaN")
