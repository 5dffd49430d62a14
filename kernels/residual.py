"""The cached residual R = O_dense - O_sparse as the sparse kernels take it (the formats are defined below).

The reuse output is sparse attention + R, with R added in the kernel's epilogue in fp32 before the output is
rounded to q's dtype (MC-Sparse, arXiv 2610.06801, sec. 3.4: the residual carries the dropped keys' contribution
from the anchor step). R stays in its stored form; the kernels dequantise it in registers:

- ``"plain"``: ``data`` ``[B, H, S, D]`` bf16 / fp16 / fp32, R = data;
- ``"fp8_row"``: ``data`` float8_e4m3fn ``[B, H, S, D]``, ``scale`` fp32 ``[B, H, S]``, R = data * scale[..., None];
- ``"int4_row"``: ``data`` uint8 ``[B, H, S, D // 2]`` where byte j of a row holds element 2j in its low nibble and
  element 2j + 1 in its high nibble, each nibble q + 8 with q in [-7, 7]; ``scale`` fp32 ``[B, H, S]``,
  R = q * scale[..., None].

Any strides are accepted (the kernels read by strides). Shapes are checked against q by ``check``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KINDS = ("plain", "fp8_row", "int4_row")
_PLAIN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _fp8_dtype():
    return getattr(torch, "float8_e4m3fn", None)


@dataclass(frozen=True)
class Residual:
    """A residual in one of the stored forms above.

    Attributes:
        data: the stored values (see the module docstring for each kind's dtype and shape).
        scale: fp32 ``[B, H, S]`` per-row scales for "fp8_row" and "int4_row"; None for "plain".
        kind: "plain", "fp8_row" or "int4_row".
    Raises (at construction):
        ValueError / TypeError: unknown kind, wrong dtype, wrong rank, a scale given or missing, or a scale whose
        shape is not data's ``[B, H, S]``.
    """

    data: torch.Tensor
    scale: torch.Tensor | None = None
    kind: str = "plain"

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Residual kind must be one of {KINDS}, got {self.kind!r}")
        if not isinstance(self.data, torch.Tensor) or self.data.dim() != 4:
            raise ValueError(f"Residual data must be a 4-D tensor [B, H, S, D or D//2], got {_desc(self.data)}")
        if self.kind == "plain":
            if self.data.dtype not in _PLAIN_DTYPES:
                raise TypeError(f"plain Residual data must be bfloat16, float16 or float32, got {self.data.dtype}")
            if self.scale is not None:
                raise ValueError("plain Residual takes no scale (scale must be None)")
            return
        want = _fp8_dtype() if self.kind == "fp8_row" else torch.uint8
        if want is None or self.data.dtype != want:
            raise TypeError(f"{self.kind} Residual data must be {want}, got {self.data.dtype}")
        if not isinstance(self.scale, torch.Tensor) or self.scale.dtype != torch.float32:
            raise TypeError(f"{self.kind} Residual needs a float32 scale [B, H, S], got {_desc(self.scale)}")
        if tuple(self.scale.shape) != tuple(self.data.shape[:3]):
            raise ValueError(f"{self.kind} Residual scale must be [B, H, S] = {tuple(self.data.shape[:3])}, "
                             f"got {tuple(self.scale.shape)}")
        if self.scale.device != self.data.device:
            raise ValueError(f"Residual scale must be on data's device {self.data.device}, got {self.scale.device}")

    def check(self, q: torch.Tensor) -> None:
        """Raise ValueError unless this residual fits attention output of q's shape ``[B, H, S, D]`` and device."""
        B, H, S, D = q.shape
        want = (B, H, S, D // 2) if self.kind == "int4_row" else (B, H, S, D)
        if self.kind == "int4_row" and D % 2:
            raise ValueError(f"int4_row Residual needs an even head dim, got D = {D}")
        if tuple(self.data.shape) != want:
            raise ValueError(f"{self.kind} Residual data must be {want} for q {tuple(q.shape)}, got {tuple(self.data.shape)}")
        if self.data.device != q.device:
            raise ValueError(f"Residual must be on q's device {q.device}, got {self.data.device}")

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """R as a new ``[B, H, S, D]`` tensor in ``dtype`` (the reference path; the kernels never call this)."""
        if self.kind == "plain":
            return self.data.to(dtype)
        scale = self.scale.to(torch.float64 if dtype == torch.float64 else torch.float32).unsqueeze(-1)
        if self.kind == "fp8_row":
            return (self.data.to(scale.dtype) * scale).to(dtype)
        low = (self.data & 0xF).to(torch.int8) - 8
        high = (self.data >> 4).to(torch.int8) - 8
        q = torch.stack((low, high), dim=-1).flatten(-2)  # element 2j from the low nibble, 2j + 1 from the high
        return (q.to(scale.dtype) * scale).to(dtype)


def _desc(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"{t.dtype} {tuple(t.shape)}"
    return type(t).__name__


def finish_unfused(o: torch.Tensor, out: torch.Tensor | None, residual: Residual | None) -> torch.Tensor:
    """For backends without the fused epilogue: o + R (in fp32) written into ``out`` (or o itself); returns it."""
    if residual is not None:
        o = (o.float() + residual.dequantize(torch.float32)).to(o.dtype)
    if out is None:
        return o
    out.copy_(o)
    return out
