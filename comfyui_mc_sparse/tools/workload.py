"""Synthetic DiT-like self-attention inputs for tests and the demo (not a model; no weights, no video).

``SyntheticWorkload`` builds q, k, v ``[B, H, S, D]`` for the self-attention of a made-up video diffusion
transformer over a (frames, height, width) token grid, at any denoising step and layer. It imitates the
structure that sparse attention exploits in real video DiTs (MC-Sparse, arXiv 2610.06801, sec. 2 and
sec. 3.5), without being tuned to any sparse method:

- 3D RoPE-like positions: the head dim is split into time / height / width bands (Wan2.1's split: for
  D = 128, 44 / 42 / 42 dims); each band pair rotates by ``position * base**(-2i/d_band)``. A per-head
  position vector shared by q and k then gives scores that peak at zero 3D offset (locality).
- Content clusters: every token belongs softly to one of a few semantic clusters laid out as smooth blobs
  over space and time; q and k of the same cluster align (q = W_q c, k = W_k c with W_k close to W_q).
- Sinks: a few tokens whose keys carry a large component along a per-head direction every query leans to.
- Per-head variety: heads are "local" (3D neighbourhood), "spatial" (same frame, little temporal
  reach), "temporal" (same place across frames), "cluster" (content, little position) or "mixed".
- Drift over denoising steps: the latent state at step t is ``cos(a_t) * A + sin(a_t) * B`` for two
  independent latent states A and B, with the angle ``a_t = drift * (1 - (1 - t/(T-1))**2)`` moving fast
  early and slowly late (as real denoising trajectories do). Groups and selections made at an anchor step
  stay good nearby and degrade slowly with step distance.

What it is not: it has no text tokens, no cross-attention, no learned weights, no timestep modulation,
no layer-to-layer dependence beyond a shared latent; its statistics (``attention_stats``) are in the range
reported for real video DiTs (top-20 % of keys hold ~0.8-0.95 of each query's mass; most mass within a
local 3D neighbourhood, cluster mates and sinks), not measured against a particular checkpoint.

Determinism: parameters are drawn on the CPU from ``torch.Generator().manual_seed(seed)`` (per layer, a
generator seeded from (seed, layer)), then moved to the target device, where the fp32 arithmetic runs; the
same seed gives bitwise-identical tensors on one device and equal tensors up to fp32 rounding across
devices. Token order is frame-major, then row, then column (``s = (f * height + y) * width + x``), as in
Wan2.1's patchified latent.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

__all__ = ["HEAD_KINDS", "SIZES", "SyntheticWorkload", "WorkloadSpec", "attention_stats", "rope_bands"]

HEAD_KINDS = ("local", "spatial", "temporal", "cluster", "mixed")
"""Head behaviours, cycled over heads in a seeded order (see ``SyntheticWorkload.head_kinds``)."""

SIZES = {"tiny": (4, 8, 16), "small": (8, 16, 16), "medium": (12, 24, 32)}
"""Named (frames, height, width) grids: 512, 2048 and 9216 tokens."""

# Score weights per head kind: (time, height, width) position strength, content strength. Position
# strength s adds s**2 * sum_i cos(omega_i * offset) to a pair's logit (summed over the band's pairs).
_KIND_WEIGHTS = {
    "local": ((0.9, 1.0, 1.0), 0.5),
    "spatial": ((1.2, 0.3, 0.3), 0.6),
    "temporal": ((0.1, 1.0, 1.0), 0.4),
    "cluster": ((0.25, 0.35, 0.35), 1.2),
    "mixed": ((0.6, 0.7, 0.7), 0.9),
}
_POS_LOGITS = 8.0  # logit budget of one RoPE band at zero offset (times the head's strength squared)
_CONTENT_LOGITS = 6.0  # logit of a query with its own key's content (times the head's content strength)
_SINK_LOGITS = 3.5  # logit every query gives a sink key (times the head's sink lean)
_LATENT_DIM = 64  # channels of the synthetic latent state (the "model dim" before per-head projections)
_CLUSTER_SHARPNESS = 4.0  # softmax temperature of cluster membership: crisp blobs, still smooth in time


@dataclass(frozen=True)
class WorkloadSpec:
    """Shape and knobs of a synthetic workload.

    Attributes:
        frames, height, width: token grid (latent frames x latent rows x latent columns), each >= 1;
            S = frames * height * width tokens.
        heads: H >= 1. head_dim: D, even and >= 6 (three RoPE bands of even width).
        batch: B >= 1; each batch element has its own latent content, all share the head weights.
        num_steps: T >= 1 denoising steps the drift spans (step indices 0 .. T-1).
        num_clusters: content clusters (>= 1). num_sinks: sink tokens (>= 0, < S).
        drift: total drift angle in radians between step 0 and step T-1 (>= 0; 0 = a static workload).
        sharpness: multiplies every logit (>= 0): the attention temperature of the whole model.
        rope_base: RoPE frequency base (> 1).
        seed: any int; the same seed gives the same tensors.
    Raises:
        ValueError / TypeError: a field is out of range or of the wrong type (message names it).
    """

    frames: int = 8
    height: int = 16
    width: int = 16
    heads: int = 4
    head_dim: int = 128
    batch: int = 1
    num_steps: int = 20
    num_clusters: int = 6
    num_sinks: int = 4
    drift: float = 0.8
    sharpness: float = 1.0
    rope_base: float = 10000.0
    seed: int = 0

    def __post_init__(self):
        for name, low in (
            ("frames", 1), ("height", 1), ("width", 1), ("heads", 1), ("head_dim", 6), ("batch", 1),
            ("num_steps", 1), ("num_clusters", 1), ("num_sinks", 0), ("seed", -(2**63)),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (RoPE rotates pairs), got {self.head_dim}")
        if self.num_sinks >= self.tokens:
            raise ValueError(f"num_sinks must be < S = {self.tokens} tokens, got {self.num_sinks}")
        for name, low in (("drift", 0.0), ("sharpness", 0.0), ("rope_base", 1.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise TypeError(f"{name} must be a finite number, got {value!r}")
            if value < low or (name == "rope_base" and value == low):
                raise ValueError(f"{name} must be {'>' if name == 'rope_base' else '>='} {low}, got {value}")

    @property
    def tokens(self) -> int:
        """S = frames * height * width."""
        return self.frames * self.height * self.width

    @property
    def grid(self) -> tuple[int, int, int]:
        """(frames, height, width)."""
        return (self.frames, self.height, self.width)


def rope_bands(head_dim: int) -> tuple[int, int, int]:
    """Dims of the (time, height, width) RoPE bands, each even, summing to ``head_dim`` (Wan2.1's split:
    height = width = 2 * (D // 6), time gets the rest; D = 128 -> (44, 42, 42), D = 64 -> (24, 20, 20))."""
    side = 2 * (head_dim // 6)
    return (head_dim - 2 * side, side, side)


def _check_step(step, num_steps: int) -> None:
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"step must be an int, got {type(step).__name__}")
    if not 0 <= step < num_steps:
        raise ValueError(f"step must be in [0, {num_steps}) (the spec's num_steps), got {step}")


class SyntheticWorkload:
    """Synthetic video-DiT self-attention q/k/v over a token grid, per denoising step and layer.

    Args:
        spec: a ``WorkloadSpec``.
        device: where the tensors are built and returned (``"cpu"``, ``"cuda"``, a ``torch.device``).
    Use ``qkv(step, layer=0, dtype=torch.float32)``; ``drift_angle(step)`` gives the latent's angle.
    """

    def __init__(self, spec: WorkloadSpec, device: str | torch.device = "cpu"):
        if not isinstance(spec, WorkloadSpec):
            raise TypeError(f"spec must be a WorkloadSpec, got {type(spec).__name__}")
        self.spec = spec
        self.device = torch.device(device)
        gen = torch.Generator().manual_seed(spec.seed)
        B, (Fr, Hh, W) = spec.batch, spec.grid
        # two latent states (A, B) of cluster fields and detail fields, per batch element
        self._cluster_fields = torch.stack(
            [_smooth_field(gen, B, spec.num_clusters, spec.grid, (4.0, 6.0, 6.0)) for _ in range(2)]
        )  # [2, B, S, n_clusters]
        self._detail_fields = torch.stack(
            [_smooth_field(gen, B, _LATENT_DIM, spec.grid, (2.0, 3.0, 3.0)) for _ in range(2)]
        )  # [2, B, S, L]
        self._noise = torch.randn(2, B, spec.tokens, _LATENT_DIM, generator=gen)  # [2, B, S, L]
        self._centroids = torch.randn(spec.num_clusters, _LATENT_DIM, generator=gen)  # [n_clusters, L]
        self._sinks = torch.randperm(spec.tokens, generator=gen)[: spec.num_sinks]  # [n_sinks] token indices
        f, y, x = torch.meshgrid(torch.arange(Fr), torch.arange(Hh), torch.arange(W), indexing="ij")
        self.positions = torch.stack([f, y, x], dim=-1).reshape(-1, 3)  # [S, 3] (frame, row, col), int64
        self._cos, self._sin = _rope_tables(self.positions, spec.head_dim, spec.rope_base)  # [S, D/2] each
        self._layers: dict[int, dict] = {}

    @property
    def sink_tokens(self) -> torch.Tensor:
        """int64 ``[num_sinks]`` token indices of the sink tokens (same for every head, step and layer)."""
        return self._sinks.clone()

    def drift_angle(self, step: int) -> float:
        """Angle (radians) of the latent state at 0-based ``step``: ``drift * (1 - (1 - t/(T-1))**2)``."""
        _check_step(step, self.spec.num_steps)
        u = step / max(1, self.spec.num_steps - 1)
        return self.spec.drift * (1.0 - (1.0 - u) ** 2)

    def head_kinds(self, layer: int = 0) -> tuple[str, ...]:
        """Kind of each head of ``layer`` (one of ``HEAD_KINDS``), cycled in a seeded order."""
        return self._layer(layer)["kinds"]

    def _layer(self, layer: int) -> dict:
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
            raise ValueError(f"layer must be an int >= 0, got {layer!r}")
        if layer not in self._layers:
            self._layers[layer] = self._make_layer(layer)
        return self._layers[layer]

    def _make_layer(self, layer: int) -> dict:
        spec = self.spec
        H, D, L = spec.heads, spec.head_dim, _LATENT_DIM
        gen = torch.Generator().manual_seed((spec.seed * 1_000_003 + 7919 * (layer + 1)) % (2**63))
        order = torch.randperm(len(HEAD_KINDS), generator=gen).tolist()
        kinds = tuple(HEAD_KINDS[order[h % len(HEAD_KINDS)]] for h in range(H))
        jitter = 0.8 + 0.4 * torch.rand(H, 4, generator=gen)  # per-head strength variation, [0.8, 1.2)
        pos_strength = torch.tensor([_KIND_WEIGHTS[k][0] for k in kinds]) * jitter[:, :3]  # [H, 3]
        content_strength = torch.tensor([_KIND_WEIGHTS[k][1] for k in kinds]) * jitter[:, 3]  # [H]
        # position vector shared by q and k: each pair of band a has norm pos_strength[h, a] * sqrt(P / n_a),
        # so band a adds pos_strength**2 * P * mean_i cos(omega_i * offset_a) to a logit (peak at offset 0)
        bands = rope_bands(D)
        pairs = torch.tensor(bands) // 2
        band_of_pair = torch.repeat_interleave(torch.arange(3), pairs)  # [D/2]
        phase = 2 * math.pi * torch.rand(H, D // 2, generator=gen)
        amp = pos_strength[:, band_of_pair] * torch.sqrt(_POS_LOGITS / pairs[band_of_pair].float())  # [H, D/2]
        pos_vec = torch.stack([amp * torch.cos(phase), amp * torch.sin(phase)], dim=-1).reshape(H, D)
        w_q = torch.randn(H, L, D, generator=gen) / math.sqrt(L)  # [H, L, D]: unit-variance outputs
        w_k = (w_q + 0.5 * torch.randn(H, L, D, generator=gen) / math.sqrt(L)) / math.sqrt(1.25)
        w_v = torch.randn(H, L, D, generator=gen) / math.sqrt(L)
        sink_dir = F.normalize(torch.randn(H, D, generator=gen), dim=-1)  # [H, D]
        sink_lean = 0.7 + 0.6 * torch.rand(H, generator=gen)  # sink logit multiplier per head, [0.7, 1.3)
        v_bias = torch.randn(H, D, generator=gen) * 0.5  # values share a mean, as real V projections do
        return {
            "kinds": kinds, "pos_vec": pos_vec, "content": content_strength * _CONTENT_LOGITS / D,
            "w_q": w_q, "w_k": w_k, "w_v": w_v, "sink_dir": sink_dir, "sink_lean": sink_lean, "v_bias": v_bias,
        }

    def latent(self, step: int) -> torch.Tensor:
        """fp32 ``[B, S, 64]`` latent content at ``step`` (unit variance per channel), on the CPU."""
        angle = self.drift_angle(step)
        a, b = math.cos(angle), math.sin(angle)
        fields = a * self._cluster_fields[0] + b * self._cluster_fields[1]  # [B, S, n_clusters]
        membership = torch.softmax(_CLUSTER_SHARPNESS * fields, dim=-1)
        detail = a * self._detail_fields[0] + b * self._detail_fields[1]
        noise = a * self._noise[0] + b * self._noise[1]
        content = 1.0 * (membership @ self._centroids) + 0.6 * detail + 0.35 * noise  # [B, S, L]
        return content / content.std(dim=(0, 1), keepdim=True).clamp_min(1e-6)

    @torch.no_grad()
    def qkv(self, step: int, *, layer: int = 0, dtype: torch.dtype = torch.float32):
        """q, k, v of one self-attention call.

        Args:
            step: 0-based denoising step in [0, num_steps).
            layer: transformer block index (>= 0); each layer has its own seeded head weights.
            dtype: output dtype (fp16, bf16, fp32, fp64); arithmetic runs in fp32 (fp64 for fp64).
        Returns:
            (q, k, v), each ``[B, H, S, D]`` in ``dtype`` on ``self.device``. Softmax scale 1/sqrt(D).
        Raises:
            ValueError / TypeError: step, layer or dtype out of range.
        """
        if dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            raise TypeError(f"dtype must be float16, bfloat16, float32 or float64, got {dtype}")
        p = self._layer(layer)
        spec, dev = self.spec, self.device
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        c = self.latent(step).to(dev, acc)  # [B, S, L]
        cq = torch.einsum("bsl,hld->bhsd", c, p["w_q"].to(dev, acc))  # [B, H, S, D]
        ck = torch.einsum("bsl,hld->bhsd", c, p["w_k"].to(dev, acc))
        v = torch.einsum("bsl,hld->bhsd", c, p["w_v"].to(dev, acc)) + p["v_bias"].to(dev, acc)[None, :, None]
        content = p["content"].to(dev, acc)[None, :, None, None].sqrt()  # [1, H, 1, 1]
        pos = p["pos_vec"].to(dev, acc)[None, :, None, :]  # [1, H, 1, D]
        cos, sin = self._cos.to(dev, acc), self._sin.to(dev, acc)
        # x_q . x_k is the logit; q = x_q * D**0.25 (and k alike) undoes the softmax scale 1/sqrt(D)
        x_q = _rotate(pos + content * cq, cos, sin)
        x_k = _rotate(pos + content * ck, cos, sin)
        if spec.num_sinks:
            sink_dir = p["sink_dir"].to(dev, acc)[None, :, None, :]  # [1, H, 1, D]
            lean = (p["sink_lean"].to(dev, acc) * _SINK_LOGITS).sqrt()[None, :, None, None]
            x_q = x_q + lean * sink_dir
            x_k[:, :, self._sinks.to(dev)] += lean * sink_dir
        root = spec.head_dim**0.25 * math.sqrt(spec.sharpness)
        q, k = x_q * root, x_k * root
        return q.to(dtype), k.to(dtype), v.to(dtype)


def _smooth_field(gen, batch: int, channels: int, grid: tuple[int, int, int], corr: tuple[float, float, float]):
    """Unit-variance random field ``[batch, S, channels]`` smooth over the grid (correlation ~``corr`` tokens
    per axis): Gaussian noise on a coarse lattice, trilinearly upsampled."""
    coarse = tuple(max(2, math.ceil(n / c) + 1) for n, c in zip(grid, corr))
    base = torch.randn(batch, channels, *coarse, generator=gen)
    field = F.interpolate(base, size=grid, mode="trilinear", align_corners=True)  # [B, C, F, H, W]
    field = field.flatten(2).transpose(1, 2)  # [B, S, C]
    return (field - field.mean(dim=1, keepdim=True)) / field.std(dim=1, keepdim=True).clamp_min(1e-6)


def _rope_tables(positions: torch.Tensor, head_dim: int, base: float):
    """cos/sin ``[S, D/2]`` of 3D RoPE: pair i of band a rotates by ``pos_a * base**(-2 j / d_a)``."""
    angles = []
    for axis, d in enumerate(rope_bands(head_dim)):
        freqs = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # [d/2]
        angles.append(positions[:, axis, None].double() * freqs)  # [S, d/2]
    theta = torch.cat(angles, dim=-1)  # [S, D/2]
    return torch.cos(theta).float(), torch.sin(theta).float()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs (2i, 2i+1) of ``x`` [..., S, D] by the angles behind cos/sin [S, D/2]."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


@torch.no_grad()
def attention_stats(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor | None = None, *,
                    sinks: torch.Tensor | None = None, top_fraction: float = 0.2, radius=(1, 2, 2),
                    max_queries: int = 1024) -> dict[str, float]:
    """Summary of dense attention on (a sample of) queries, to check a workload's plausibility.

    Args:
        q, k: ``[B, H, S, D]``. positions: int ``[S, 3]`` (frame, row, col) or None (no locality share).
        sinks: int token indices or None. top_fraction: share of keys for the top-mass recall, in (0, 1].
        radius: (frames, rows, cols) half-widths of the "local neighbourhood" box.
        max_queries: queries sampled evenly along the token order (all when S is smaller).
    Returns:
        dict with ``entropy_ratio`` (mean row entropy / ln S, in [0, 1]), ``top_recall`` (mean mass of each
        row's top ``top_fraction`` keys), ``local_mass`` (mass inside the neighbourhood box), ``sink_mass``,
        all averaged over batch, heads and sampled queries.
    """
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must be [B, H, S, D] of one shape, got {tuple(q.shape)}, {tuple(k.shape)}")
    if not 0.0 < top_fraction <= 1.0:
        raise ValueError(f"top_fraction must be in (0, 1], got {top_fraction}")
    S = q.shape[2]
    rows = torch.linspace(0, S - 1, min(S, max_queries), device=q.device).round().long()
    scores = (q[:, :, rows].float() @ k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])  # [B, H, r, S]
    p = torch.softmax(scores, dim=-1)
    entropy = -(p * torch.log(p.clamp_min(1e-30))).sum(-1)
    top = torch.topk(p, max(1, math.ceil(top_fraction * S)), dim=-1).values.sum(-1)
    out = {
        "entropy_ratio": float(entropy.mean() / math.log(S)) if S > 1 else 0.0,
        "top_recall": float(top.mean()),
    }
    if positions is not None:
        pos = positions.to(q.device)
        delta = (pos[rows, None, :] - pos[None, :, :]).abs()  # [r, S, 3]
        box = (delta <= torch.tensor(radius, device=q.device)).all(-1)  # [r, S]
        out["local_mass"] = float((p * box).sum(-1).mean())
    if sinks is not None and len(sinks):
        out["sink_mass"] = float(p[..., sinks.to(q.device)].sum(-1).mean())
    return out
