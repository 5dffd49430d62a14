"""Plots as ComfyUI IMAGE tensors, drawn with torch alone (lines, markers, a 3x5 pixel font).

Why not matplotlib: it is not one of ComfyUI's requirements (``requirements.txt`` of v0.3.64) nor installed in
either of our test environments, so a matplotlib path would ship untested and look different per machine. This
drawing is one code path, deterministic, tested on the CPU, and needs nothing beyond torch.

``line_plot`` returns ``[1, H, W, 3]`` float32 in [0, 1] (ComfyUI's IMAGE layout: batch, height, width, RGB).
Text is upper-cased; characters outside the font are drawn as blanks.
"""

from __future__ import annotations

import math

import torch

# 3 x 5 glyphs, one string per row, '#' = ink.
_GLYPHS = {
    "A": (".#.", "#.#", "###", "#.#", "#.#"), "B": ("##.", "#.#", "##.", "#.#", "##."),
    "C": (".##", "#..", "#..", "#..", ".##"), "D": ("##.", "#.#", "#.#", "#.#", "##."),
    "E": ("###", "#..", "##.", "#..", "###"), "F": ("###", "#..", "##.", "#..", "#.."),
    "G": (".##", "#..", "#.#", "#.#", ".##"), "H": ("#.#", "#.#", "###", "#.#", "#.#"),
    "I": ("###", ".#.", ".#.", ".#.", "###"), "J": ("..#", "..#", "..#", "#.#", ".#."),
    "K": ("#.#", "#.#", "##.", "#.#", "#.#"), "L": ("#..", "#..", "#..", "#..", "###"),
    "M": ("#.#", "###", "###", "#.#", "#.#"), "N": ("##.", "#.#", "#.#", "#.#", "#.#"),
    "O": (".#.", "#.#", "#.#", "#.#", ".#."), "P": ("##.", "#.#", "##.", "#..", "#.."),
    "Q": (".#.", "#.#", "#.#", "##.", ".##"), "R": ("##.", "#.#", "##.", "#.#", "#.#"),
    "S": (".##", "#..", ".#.", "..#", "##."), "T": ("###", ".#.", ".#.", ".#.", ".#."),
    "U": ("#.#", "#.#", "#.#", "#.#", "###"), "V": ("#.#", "#.#", "#.#", "#.#", ".#."),
    "W": ("#.#", "#.#", "###", "###", "#.#"), "X": ("#.#", "#.#", ".#.", "#.#", "#.#"),
    "Y": ("#.#", "#.#", ".#.", ".#.", ".#."), "Z": ("###", "..#", ".#.", "#..", "###"),
    "0": ("###", "#.#", "#.#", "#.#", "###"), "1": (".#.", "##.", ".#.", ".#.", "###"),
    "2": ("##.", "..#", ".#.", "#..", "###"), "3": ("##.", "..#", ".#.", "..#", "##."),
    "4": ("#.#", "#.#", "###", "..#", "..#"), "5": ("###", "#..", "##.", "..#", "##."),
    "6": (".##", "#..", "###", "#.#", "###"), "7": ("###", "..#", ".#.", ".#.", ".#."),
    "8": ("###", "#.#", "###", "#.#", "###"), "9": ("###", "#.#", "###", "..#", "##."),
    ".": ("...", "...", "...", "...", ".#."), ",": ("...", "...", "...", ".#.", "#.."),
    "-": ("...", "...", "###", "...", "..."), "+": ("...", ".#.", "###", ".#.", "..."),
    "%": ("#.#", "..#", ".#.", "#..", "#.#"), "/": ("..#", "..#", ".#.", "#..", "#.."),
    "(": (".#.", "#..", "#..", "#..", ".#."), ")": (".#.", "..#", "..#", "..#", ".#."),
    ":": ("...", ".#.", "...", ".#.", "..."), "=": ("...", "###", "...", "###", "..."),
    "_": ("...", "...", "...", "...", "###"), "<": ("..#", ".#.", "#..", ".#.", "..#"),
    ">": ("#..", ".#.", "..#", ".#.", "#.."),
}

PALETTE = ((0.84, 0.15, 0.16), (1.00, 0.50, 0.05), (0.17, 0.63, 0.17), (0.12, 0.47, 0.71), (0.58, 0.40, 0.74),
           (0.55, 0.34, 0.29), (0.89, 0.47, 0.76), (0.50, 0.50, 0.50), (0.74, 0.74, 0.13), (0.09, 0.75, 0.81))
"""Series colours (RGB in [0, 1]), in series order."""

_GLYPH_CACHE: dict[str, torch.Tensor] = {}


def _glyph(ch: str) -> torch.Tensor | None:
    rows = _GLYPHS.get(ch)
    if rows is None:
        return None
    if ch not in _GLYPH_CACHE:
        _GLYPH_CACHE[ch] = torch.tensor([[c == "#" for c in row] for row in rows], dtype=torch.bool)
    return _GLYPH_CACHE[ch]


def text_width(text: str, scale: int) -> int:
    """Pixels ``draw_text`` uses for ``text`` at ``scale`` (4 columns per character, minus the last gap)."""
    return max(0, 4 * len(text) - 1) * scale


def draw_text(canvas: torch.Tensor, x: int, y: int, text: str, color, scale: int = 2) -> None:
    """Draw ``text`` (upper-cased) into ``canvas`` ``[H, W, 3]`` with its top-left corner at (x, y), clipped."""
    H, W, _ = canvas.shape
    c = torch.tensor(color, dtype=canvas.dtype)
    for i, ch in enumerate(text.upper()):
        g = _glyph(ch)
        if g is None:
            continue
        big = g.repeat_interleave(scale, 0).repeat_interleave(scale, 1)  # [5s, 3s]
        x0, y0 = x + 4 * scale * i, y
        xs0, ys0 = max(0, x0), max(0, y0)
        xs1, ys1 = min(W, x0 + big.shape[1]), min(H, y0 + big.shape[0])
        if xs1 <= xs0 or ys1 <= ys0:
            continue
        sub = big[ys0 - y0 : ys1 - y0, xs0 - x0 : xs1 - x0]
        canvas[ys0:ys1, xs0:xs1][sub] = c


def draw_line(canvas: torch.Tensor, x0: float, y0: float, x1: float, y1: float, color, width: int = 1) -> None:
    """Draw a straight segment (pixel centres sampled along it, ``width`` pixels thick), clipped to the canvas."""
    H, W, _ = canvas.shape
    n = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
    t = torch.linspace(0.0, 1.0, n)
    xs = (x0 + (x1 - x0) * t).round().long()
    ys = (y0 + (y1 - y0) * t).round().long()
    c = torch.tensor(color, dtype=canvas.dtype)
    lo = -(width // 2)
    for dx in range(lo, lo + width):
        for dy in range(lo, lo + width):
            px, py = xs + dx, ys + dy
            keep = (px >= 0) & (px < W) & (py >= 0) & (py < H)
            canvas[py[keep], px[keep]] = c


def fill_rect(canvas: torch.Tensor, x0: int, y0: int, x1: int, y1: int, color) -> None:
    """Fill the half-open pixel box [x0, x1) x [y0, y1), clipped."""
    H, W, _ = canvas.shape
    canvas[max(0, y0) : min(H, y1), max(0, x0) : min(W, x1)] = torch.tensor(color, dtype=canvas.dtype)


def _nice_ticks(top: float, count: int = 5) -> list[float]:
    """About ``count`` round tick values from 0 to >= top (1, 2, 5 x 10^n steps)."""
    if not top > 0 or not math.isfinite(top):
        return [0.0, 1.0]
    raw = top / count
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    n = math.ceil(top / step - 1e-9)
    return [i * step for i in range(n + 1)]


def _fmt(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 1:
        return f"{value:g}"
    return f"{value:.3f}".rstrip("0").rstrip(".") if abs(value) >= 0.001 else f"{value:.0e}"


def line_plot(xs: list[int], series: dict[str, list[float]], *, title: str, x_label: str, y_label: str,
              width: int = 960, height: int = 540) -> torch.Tensor:
    """A line plot with markers, axes, ticks, a title and a legend, as a ComfyUI IMAGE.

    Args:
        xs: x positions (e.g. block indices), ascending; every series has one value per x (NaN = no point).
        series: label -> values, drawn in ``PALETTE`` order.
        title, x_label, y_label: text (drawn upper-case with the 3x5 font).
        width, height: pixels (>= 320 x 200).
    Returns:
        float32 ``[1, height, width, 3]`` in [0, 1], white background.
    Raises:
        ValueError: sizes out of range or a series of the wrong length.
    """
    if width < 320 or height < 200:
        raise ValueError(f"width x height must be at least 320 x 200, got {width} x {height}")
    for label, values in series.items():
        if len(values) != len(xs):
            raise ValueError(f"series {label!r} must have one value per x ({len(xs)}), got {len(values)}")
    canvas = torch.ones(height, width, 3, dtype=torch.float32)
    ink = (0.1, 0.1, 0.1)
    grid = (0.88, 0.88, 0.88)
    s = 2  # font scale
    legend_w = max([text_width(lbl, s) for lbl in series] + [0]) + 40
    left, right, top, bottom = 70, width - legend_w - 20, 40, height - 50
    if right - left < 100:
        right = width - 20
    draw_text(canvas, left, 12, title, ink, s)
    finite = [v for vals in series.values() for v in vals if isinstance(v, (int, float)) and math.isfinite(v)]
    ticks = _nice_ticks(max(finite) if finite else 1.0)
    y_top = ticks[-1] if ticks[-1] > 0 else 1.0
    x_min, x_max = (min(xs), max(xs)) if xs else (0, 1)
    span = max(1, x_max - x_min)

    def px(x: float) -> float:
        return left + (x - x_min) / span * (right - left) if len(xs) > 1 else (left + right) / 2

    def py(y: float) -> float:
        return bottom - y / y_top * (bottom - top)

    for t in ticks:
        y = py(t)
        draw_line(canvas, left, y, right, y, grid)
        label = _fmt(t)
        draw_text(canvas, left - 6 - text_width(label, s), int(y) - 5, label, ink, s)
    x_ticks = xs if len(xs) <= 20 else xs[:: math.ceil(len(xs) / 20)]
    for x in x_ticks:
        label = str(x)
        draw_line(canvas, px(x), bottom, px(x), bottom + 4, ink)
        draw_text(canvas, int(px(x)) - text_width(label, s) // 2, bottom + 8, label, ink, s)
    draw_line(canvas, left, top, left, bottom, ink, 2)
    draw_line(canvas, left, bottom, right, bottom, ink, 2)
    draw_text(canvas, (left + right - text_width(x_label, s)) // 2, height - 18, x_label, ink, s)
    draw_text(canvas, left, top - 14, y_label, ink, s)
    for i, (label, values) in enumerate(series.items()):
        color = PALETTE[i % len(PALETTE)]
        points = [(px(x), py(v)) for x, v in zip(xs, values) if isinstance(v, (int, float)) and math.isfinite(v)]
        for (xa, ya), (xb, yb) in zip(points, points[1:]):
            draw_line(canvas, xa, ya, xb, yb, color, 2)
        for xa, ya in points:
            fill_rect(canvas, int(xa) - 3, int(ya) - 3, int(xa) + 4, int(ya) + 4, color)
        ly = top + 6 + 18 * i
        fill_rect(canvas, right + 20, ly, right + 32, ly + 10, color)
        draw_text(canvas, right + 38, ly, label, ink, s)
    return canvas.clamp_(0.0, 1.0).unsqueeze(0)
