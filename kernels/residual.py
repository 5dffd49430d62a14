"""The cached residual R = O_dense - O_sparse as the sparse kernels take it (the formats are defined below).

The reuse output is sparse attention + R, with R added in the kernel's epilogue in fp32 before the output is
rounded to q's dtype (MC-Sparse, arXiv 2610.06801, sec. 3.4: the residual carries the dropped keys' contribution
from the anchor step). R stays in its stored form; the kernels dequantise it in registers:

- ``"plain"``: ``data`` ``[B, H, S, D]`` bf16 / fp16 / fp32, R = data;
- ``"fp8_row"``: ``data`` float8_e4m3fn ``[B, H, S, D]``, ``scale`` fp32 ``[B, H, S]``, R = data * scale[..., None];
- ``"int4_row"``: ``data`` uint8 ``[B, H, S, D // 2]`` where byte j of a row holds element 2j in its low nibble and
  element 2j + 1 in its high nibble, each nibble q + 8 with q in [-7, 7]; ``scale`` fp32 ``[B, H, S]``,
  R = q * scale[..., None];
- ``"int4_group"``: ``data`` as int4_row (uint8 ``[B, H, S, D // 2]``, q in [-7, 7], nibble q + 8, element 2j low);
  ``scale`` **bfloat16** ``[B, H, S]``; ``coef`` float8_e4m3fn ``[B, H, S]``; ``mean`` bfloat16 ``[B, H, G, D]``, one
  row per query group (G = perm's width / C), R[b, h, s] = coef[b, h, s] * mean[b, h, g] + q[b, h, s] * scale[b, h, s]
  where g is the group that holds query s in ``perm`` (slot // C). The queries of a group were grouped for being
  similar and share one KV selection, so their residual rows are strongly correlated: what is left after the group's
  mean row is about half of R (E|R - M| / E|R| = 0.55 on the synthetic workload), so the 4-bit steps are half as
  coarse (docs/cache.md). Kernels whose program is one query group read the group's mean row once.

Any strides are accepted (the kernels read by strides). Shapes are checked against q by ``check``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KINDS = ("plain", "fp8_row", "int4_row", "int4_group")
_PLAIN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _fp8_dtype():
    return getattr(torch, "float8_e4m3fn", None)


@dataclass(frozen=True)
class Residual:
    """A residual in one of the stored forms above.

    Attributes:
        data: the stored values (see the module docstring for each kind's dtype and shape).
        scale: ``[B, H, S]`` per-row scales: fp32 for "fp8_row" and "int4_row", bf16 for "int4_group"; None for
            "plain".
        kind: "plain", "fp8_row", "int4_row" or "int4_group".
        coef: float8_e4m3fn ``[B, H, S]``, each row's weight of its group's mean row ("int4_group" only).
        mean: bf16 ``[B, H, G, D]``, each query group's mean residual row ("int4_group" only).
    Raises (at construction):
        ValueError / TypeError: unknown kind, wrong dtype, wrong rank, a scale / coef / mean given or missing, or
        one whose shape or device is not data's.
    """

    data: torch.Tensor
    scale: torch.Tensor | None = None
    kind: str = "plain"
    coef: torch.Tensor | None = None
    mean: torch.Tensor | None = None

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
        else:
            want = _fp8_dtype() if self.kind == "fp8_row" else torch.uint8
            if want is None or self.data.dtype != want:
                raise TypeError(f"{self.kind} Residual data must be {want}, got {self.data.dtype}")
            scale_dtype = torch.bfloat16 if self.kind == "int4_group" else torch.float32
            if not isinstance(self.scale, torch.Tensor) or self.scale.dtype != scale_dtype:
                raise TypeError(f"{self.kind} Residual needs a {scale_dtype} scale [B, H, S], got {_desc(self.scale)}")
            self._same_place("scale [B, H, S]", self.scale, tuple(self.data.shape[:3]))
        if self.kind != "int4_group":
            if self.coef is not None or self.mean is not None:
                raise ValueError(f"{self.kind} Residual takes no coef / mean (int4_group only)")
            return
        if not isinstance(self.coef, torch.Tensor) or self.coef.dtype != _fp8_dtype():
            raise TypeError(f"int4_group Residual needs a float8_e4m3fn coef [B, H, S], got {_desc(self.coef)}")
        self._same_place("coef [B, H, S]", self.coef, tuple(self.data.shape[:3]))
        if not isinstance(self.mean, torch.Tensor) or self.mean.dtype != torch.bfloat16 or self.mean.dim() != 4:
            raise TypeError(f"int4_group Residual needs a bfloat16 mean [B, H, G, D], got {_desc(self.mean)}")
        B, H, _, half = self.data.shape
        self._same_place("mean [B, H, G, D]", self.mean, (B, H, self.mean.shape[2], 2 * half))

    def _same_place(self, name: str, t: torch.Tensor, shape: tuple) -> None:
        if tuple(t.shape) != shape:
            raise ValueError(f"{self.kind} Residual {name} must be {shape}, got {tuple(t.shape)}")
        if t.device != self.data.device:
            raise ValueError(f"Residual {name.split()[0]} must be on data's device {self.data.device}, got {t.device}")

    def tensors(self) -> list[torch.Tensor]:
        """The stored tensors, in field order (data, then scale, coef, mean where present)."""
        return [t for t in (self.data, self.scale, self.coef, self.mean) if t is not None]

    def with_tensors(self, new) -> "Residual":
        """The same kind with ``new`` (an iterable, in ``tensors()`` order) in place of the stored tensors."""
        it = iter(new)
        data = next(it)
        rest = [None if t is None else next(it) for t in (self.scale, self.coef, self.mean)]
        return Residual(data, rest[0], self.kind, rest[1], rest[2])

    def check(self, q: torch.Tensor) -> None:
        """Raise ValueError unless this residual fits attention output of q's shape ``[B, H, S, D]`` and device."""
        B, H, S, D = q.shape
        packed = self.kind in ("int4_row", "int4_group")
        want = (B, H, S, D // 2) if packed else (B, H, S, D)
        if packed and D % 2:
            raise ValueError(f"{self.kind} Residual needs an even head dim, got D = {D}")
        if tuple(self.data.shape) != want:
            raise ValueError(f"{self.kind} Residual data must be {want} for q {tuple(q.shape)}, got {tuple(self.data.shape)}")
        if self.data.device != q.device:
            raise ValueError(f"Residual must be on q's device {q.device}, got {self.data.device}")

    def check_groups(self, perm: torch.Tensor) -> None:
        """Raise ValueError unless ``mean`` has one row per query group of ``perm`` (int32 ``[B, H, G*C]``); a no-op
        for the kinds without group rows."""
        if self.kind == "int4_group" and (perm.dim() != 3 or perm.shape[-1] % self.mean.shape[2]):
            raise ValueError(f"int4_group Residual mean has G = {self.mean.shape[2]} rows per head, which do not "
                             f"divide perm's width {tuple(perm.shape)}")

    def dequantize(self, dtype: torch.dtype = torch.float32, perm: torch.Tensor | None = None) -> torch.Tensor:
        """R as a new ``[B, H, S, D]`` tensor in ``dtype`` (the reference path; the kernels never call this).

        ``perm`` (int32 ``[B, H, G*C]``, -1 padding) is needed for "int4_group": it says which group's mean row each
        query adds (ValueError without it)."""
        if self.kind == "plain":
            return self.data.to(dtype)
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        scale = self.scale.to(acc).unsqueeze(-1)
        if self.kind == "fp8_row":
            return (self.data.to(scale.dtype) * scale).to(dtype)
        low = (self.data & 0xF).to(torch.int8) - 8
        high = (self.data >> 4).to(torch.int8) - 8
        q = torch.stack((low, high), dim=-1).flatten(-2)  # element 2j from the low nibble, 2j + 1 from the high
        r = q.to(acc) * scale
        if self.kind == "int4_group":
            if perm is None:
                raise ValueError("an int4_group Residual needs perm to dequantize (each query adds its group's mean)")
            self.check_groups(perm)
            r += self.coef.to(acc).unsqueeze(-1) * _group_rows(self.mean.to(acc), perm, r.shape[2])
        return r.to(dtype)


def _desc(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"{t.dtype} {tuple(t.shape)}"
    return type(t).__name__


def _group_rows(mean: torch.Tensor, perm: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``[B, H, S, D]``: row s = mean[b, h, g] for the group g whose slots of ``perm`` hold query s (zeros for a
    query no slot holds)."""
    B, H, G, D = mean.shape
    C = perm.shape[-1] // G
    slots = torch.arange(perm.shape[-1], device=perm.device).div(C, rounding_mode="floor")
    group_of = torch.full((B, H, num_tokens + 1), G, dtype=torch.long, device=perm.device)  # G: the zero row
    dest = torch.where(perm >= 0, perm.long(), num_tokens)  # -1 slots land in the spare column
    group_of.scatter_(2, dest, slots.expand(B, H, -1))
    padded = torch.cat([mean, mean.new_zeros(B, H, 1, D)], 2)
    return torch.gather(padded, 2, group_of[..., :num_tokens, None].expand(-1, -1, -1, D))

