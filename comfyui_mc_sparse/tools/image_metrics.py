"""PSNR and SSIM between two ComfyUI IMAGE batches, and a side-by-side / difference image (torch only).

IMAGE tensors are ``[B, H, W, C]`` float in [0, 1] (ComfyUI's layout; C = 3 RGB, a 4th alpha channel is
ignored; both batches must have one shape, channels included: RGB against RGBA is an error). Frames are compared
pairwise (frame i of A with frame i of B); the data range L is 1.

* PSNR (dB) per frame: ``10 log10(L^2 / MSE)`` over all pixels and the RGB channels; ``inf`` for identical
  frames. Overall: ``10 log10(L^2 / mean MSE)`` with the MSE pooled over every frame (not the mean of the
  per-frame dB values, which one identical frame would make infinite).
* SSIM per frame: Wang, Bovik, Sheikh and Simoncelli, "Image quality assessment: from error visibility to
  structural similarity", IEEE TIP 13(4), 2004, eq. (13) with their parameters: an 11 x 11 circular-symmetric
  Gaussian window of standard deviation 1.5 (normalised to sum 1), K1 = 0.01, K2 = 0.03, C1 = (K1 L)^2,
  C2 = (K2 L)^2; local statistics only where the window fits inside the image ("valid", no padding), the SSIM
  map averaged over positions (their mean SSIM, eq. 17), computed on each RGB channel separately and averaged
  over the channels (the paper defines it on one grey channel; no down-sampling). Overall: the mean over frames.
  Frames must be at least 11 x 11 pixels.

Computed in float64, frames in chunks (bounded memory for long videos).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

WINDOW = 11
SIGMA = 1.5
K1, K2 = 0.01, 0.03
DIFF_GAIN = 4.0
"""The difference panel shows ``min(1, DIFF_GAIN * mean_channel |A - B|)`` in grey levels."""
_FRAMES_PER_CHUNK = 8


@dataclass
class Comparison:
    """PSNR / SSIM of two IMAGE batches.

    Attributes:
        psnr: per-frame PSNR in dB (``inf`` where identical). ssim: per-frame mean SSIM in [-1, 1].
        psnr_overall: dB from the pooled MSE. ssim_overall: mean of ``ssim``.
    """

    psnr: list[float]
    ssim: list[float]
    psnr_overall: float
    ssim_overall: float

    def text(self, label_a: str = "A", label_b: str = "B") -> str:
        """A short report: overall numbers, then per frame (worst SSIM first when there are more than 8 frames)."""
        lines = [f"{label_a} vs {label_b}: {len(self.psnr)} frames, PSNR {_db(self.psnr_overall)} (pooled MSE), "
                 f"SSIM {self.ssim_overall:.4f} (mean over frames; Wang et al. 2004, 11x11 Gaussian window, sigma 1.5)"]
        order = list(range(len(self.psnr)))
        if len(order) > 8:
            order = sorted(order, key=lambda i: self.ssim[i])[:8]
            lines.append("worst 8 frames by SSIM:")
        lines.extend(f"  frame {i}: PSNR {_db(self.psnr[i])}, SSIM {self.ssim[i]:.4f}" for i in order)
        return "\n".join(lines)


def _db(value: float) -> str:
    return "inf dB (identical)" if math.isinf(value) else f"{value:.2f} dB"


def check_images(a: torch.Tensor, b: torch.Tensor) -> None:
    """Raise ValueError unless a and b are IMAGE batches ``[B, H, W, C]`` of one shape, B >= 1, C >= 3, H, W >= 11.

    Raises: TypeError for non-tensors; ValueError naming both shapes otherwise.
    """
    for name, t in (("image_a", a), ("image_b", b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor IMAGE [B, H, W, C], got {type(t).__name__}")
        if t.dim() != 4 or t.shape[-1] < 3 or not t.is_floating_point():
            raise ValueError(f"{name} must be a float IMAGE [B, H, W, C] with C >= 3, got {t.dtype} {tuple(t.shape)}")
    if a.shape[0] < 1:
        raise ValueError(f"image_a and image_b must hold at least one frame, got {tuple(a.shape)}")
    if a.shape != b.shape:
        raise ValueError(f"image_a and image_b must have the same [frames, height, width, channels], got "
                         f"{tuple(a.shape)} and {tuple(b.shape)} (run both with the same size and length)")
    if a.shape[1] < WINDOW or a.shape[2] < WINDOW:
        raise ValueError(f"images must be at least {WINDOW} x {WINDOW} pixels for SSIM, got {a.shape[2]} x {a.shape[1]}")


def gaussian_window(size: int = WINDOW, sigma: float = SIGMA) -> torch.Tensor:
    """float64 ``[size]`` 1-D Gaussian (sum 1); the 2-D window is its outer product (separable)."""
    x = torch.arange(size, dtype=torch.float64) - (size - 1) / 2
    g = torch.exp(-(x**2) / (2 * sigma**2))
    return g / g.sum()


def _filter(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Valid separable filtering of ``[N, 1, H, W]`` by the outer product of ``g`` with itself."""
    n = g.numel()
    x = torch.nn.functional.conv2d(x, g.view(1, 1, n, 1))
    return torch.nn.functional.conv2d(x, g.view(1, 1, 1, n))


def compare(a: torch.Tensor, b: torch.Tensor) -> Comparison:
    """PSNR and SSIM of IMAGE batches ``a`` and ``b`` ``[B, H, W, C]`` in [0, 1] (see the module docstring).

    Raises: TypeError / ValueError from ``check_images``.
    """
    check_images(a, b)
    g = gaussian_window().to(a.device)
    c1, c2 = K1**2, K2**2
    psnr, ssim, sq_sum = [], [], 0.0
    for f0 in range(0, a.shape[0], _FRAMES_PER_CHUNK):
        x = a[f0 : f0 + _FRAMES_PER_CHUNK, ..., :3].double()
        y = b[f0 : f0 + _FRAMES_PER_CHUNK, ..., :3].to(a.device).double()
        mse = ((x - y) ** 2).mean(dim=(1, 2, 3))  # [f]
        sq_sum += float(mse.sum())
        psnr += [float("inf") if m == 0 else 10 * math.log10(1.0 / m) for m in mse.tolist()]
        n, h, w, c = x.shape
        xs = x.permute(0, 3, 1, 2).reshape(n * c, 1, h, w)  # each channel a separate image
        ys = y.permute(0, 3, 1, 2).reshape(n * c, 1, h, w)
        mu_x, mu_y = _filter(xs, g), _filter(ys, g)
        sxx = _filter(xs * xs, g) - mu_x**2
        syy = _filter(ys * ys, g) - mu_y**2
        sxy = _filter(xs * ys, g) - mu_x * mu_y
        smap = ((2 * mu_x * mu_y + c1) * (2 * sxy + c2)) / ((mu_x**2 + mu_y**2 + c1) * (sxx + syy + c2))
        ssim += smap.mean(dim=(1, 2, 3)).view(n, c).mean(dim=1).tolist()
    mean_mse = sq_sum / a.shape[0]
    overall = float("inf") if mean_mse == 0 else 10 * math.log10(1.0 / mean_mse)
    return Comparison(psnr, ssim, overall, sum(ssim) / len(ssim))


def side_by_side(a: torch.Tensor, b: torch.Tensor, *, gap: int = 4) -> torch.Tensor:
    """``[B, H, 3W + 2 gap, 3]`` float32 in [0, 1]: A | B | amplified difference (``DIFF_GAIN``), white gaps.

    Raises: as ``check_images`` (shapes must match).
    """
    check_images(a, b)
    x, y = a[..., :3].float().clamp(0, 1), b[..., :3].to(a.device).float().clamp(0, 1)
    diff = ((x - y).abs().mean(dim=-1, keepdim=True) * DIFF_GAIN).clamp(0, 1).expand_as(x)
    white = torch.ones(x.shape[0], x.shape[1], gap, 3, dtype=torch.float32, device=x.device)
    return torch.cat([x, white, y, white, diff], dim=2).contiguous()
