"""MC-Sparse GPU kernels behind one interface (docs/architecture.md, "Kernel ops").

Each op validates its inputs, then runs on the best backend that accepts the call (``registry``):
Triton and flash-attn-4 where present, the torch reference (``kernels/reference``) anywhere. Optional GPU
libraries that are missing or broken never break this import: their backend is registered as unavailable
with the reason. Pass ``backend="torch"`` (or another name) to force one; ``registry.report()`` lists them.

Tensor conventions: q, k, v ``[B, H, S, D]`` (fp16, bf16, fp32 or fp64); ``perm`` int32 ``[B, H, G*C]``;
``kv_idx`` int32 ``[B, H, G, K_alloc]`` sorted with -1 padding; LSE fp32 ``[B, H, S]``. The reuse path's op
(``sparse_attention`` with ``out=`` and ``residual=``, kernels/residual.py) takes q/k/v and writes ``out`` by strides,
so ``[B, H, S, D]`` views of ComfyUI's ``[B, S, H*D]`` tensors go in and out without copies.
"""

from __future__ import annotations

import math
import numbers

import torch

from . import reference, registry
from .registry import Backend, NoCapableBackendError
from .residual import Residual

registry.register(
    Backend(
        name="torch",
        priority=0,
        ops={
            "dense_attention": reference.dense_attention,
            "group_prob_sums": reference.group_prob_sums,
            "select_kv": reference.select_kv,
            "sparse_attention": reference.sparse_attention,
            "pddp_groups": reference.pddp_groups,
            "decode_bitmask": reference.decode_bitmask,
        },
    )
)

from . import _optional  # noqa: E402  (registers the GPU backends, or their unavailable reasons)

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

__all__ = [
    "Backend",
    "NoCapableBackendError",
    "Residual",
    "decode_bitmask",
    "dense_attention",
    "group_prob_sums",
    "pddp_groups",
    "registry",
    "select_kv",
    "sparse_attention",
]


def _check_qkv(q, k, v=None):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, H, S, D], got shape {tuple(t.shape)}")
        if t.dtype not in _FLOATS:
            raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
        if t.dtype != q.dtype or t.device != q.device:
            raise TypeError(f"{name} must match q's dtype and device ({q.dtype}, {q.device}), got {t.dtype}, {t.device}")
    if q.shape[0] < 1 or q.shape[1] < 1 or q.shape[3] < 1:
        raise ValueError(f"q must have B, H and D >= 1, got shape {tuple(q.shape)}")
    if k.shape[2] < 1:
        raise ValueError(f"k must hold at least one key (Sk >= 1), got shape {tuple(k.shape)}")
    if k.shape[:2] != q.shape[:2] or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k must be [B, H, Sk, D] with q's B, H, D {tuple(q.shape)}, got {tuple(k.shape)}")
    if v is not None and v.shape != k.shape:
        raise ValueError(f"v must have k's shape [B, H, Sk, D] {tuple(k.shape)}, got {tuple(v.shape)}")


def _check_int(name, value, low=1):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"{name} must be >= {low} (an int), got {value!r}")


def _check_perm(perm, q, group_size):
    B, H, S, _ = q.shape
    _check_int("group_size", group_size)
    width = -(-S // group_size) * group_size
    if not isinstance(perm, torch.Tensor):
        raise TypeError(f"perm must be an int32 tensor [B, H, ceil(S/C)*C], got {type(perm).__name__}")
    if perm.device != q.device:
        raise ValueError(f"perm must be on q's device {q.device}, got {perm.device}")
    if perm.dtype != torch.int32 or tuple(perm.shape) != (B, H, width):
        raise ValueError(f"perm must be int32 [B, H, ceil(S/C)*C] = {(B, H, width)}, got {perm.dtype} {tuple(perm.shape)}")


def _check_lse(lse, q):
    B, H, S, _ = q.shape
    if not isinstance(lse, torch.Tensor) or not lse.dtype.is_floating_point:
        raise TypeError(f"lse must be a float32 tensor [B, H, S] from dense_attention(..., return_lse=True), got "
                        f"{_desc(lse)}")
    if tuple(lse.shape) != (B, H, S) or lse.device != q.device:
        raise ValueError(f"lse must be [B, H, S] = {(B, H, S)} on q's device {q.device}, got {tuple(lse.shape)} on "
                         f"{lse.device}")


def _scale(q, scale):
    if scale is None:
        return 1.0 / math.sqrt(q.shape[-1])
    if not math.isfinite(float(scale)):
        raise ValueError(f"scale must be a finite number (None = 1/sqrt(D)), got {scale!r}")
    return float(scale)


def dense_attention(q, k, v, *, scale=None, return_lse=False, backend="auto"):
    """Dense attention, optionally with the fp32 row LSE (pass 1 of exact selection).

    Args: q ``[B, H, S, D]``, k and v ``[B, H, Sk, D]``; scale (None = 1/sqrt(D)); return_lse.
    Returns: O ``[B, H, S, D]`` in q's dtype, or (O, LSE fp32 ``[B, H, S]``, natural log).
    Raises: TypeError/ValueError on malformed inputs; NoCapableBackendError.
    """
    _check_qkv(q, k, v)
    return registry.call("dense_attention", q, k, v, scale=_scale(q, scale), return_lse=return_lse, backend=backend)


def group_prob_sums(q, k, lse, perm, *, group_size, scale=None, backend="auto"):
    """Pass 2: exact probabilities summed over each query group -> fp32 ``[B, H, G, Sk]``.

    See ``kernels.reference.attention.group_prob_sums`` for the definition.
    Raises: TypeError / ValueError on malformed q, k, perm, lse (``[B, H, S]`` on q's device) or group_size < 1.
    """
    _check_qkv(q, k)
    _check_perm(perm, q, group_size)
    _check_lse(lse, q)
    return registry.call("group_prob_sums", q, k, lse, perm, group_size=group_size, scale=_scale(q, scale), backend=backend)


def select_kv(q, k, lse, perm, num_keys, *, group_size, kv_tile, scale=None, backend="auto"):
    """Pass 2 + top-K: int32 ``[B, H, G, ceil(K/kv_tile)*kv_tile]`` sorted indices, -1 padding.

    Raises: TypeError / ValueError on malformed q, k, perm or lse (lse must be ``[B, H, S]`` on q's device), when
    num_keys is not an int in [1, Sk], or group_size or kv_tile is not an int >= 1.
    """
    _check_qkv(q, k)
    _check_perm(perm, q, group_size)
    _check_lse(lse, q)
    if isinstance(num_keys, bool) or not isinstance(num_keys, numbers.Integral) or not 1 <= num_keys <= k.shape[2]:
        raise ValueError(f"num_keys must be in [1, {k.shape[2]}] (an int; Sk, the KV length, at most), got {num_keys!r}")
    _check_int("kv_tile", kv_tile)
    return registry.call(
        "select_kv", q, k, lse, perm, num_keys, group_size=group_size, kv_tile=kv_tile, scale=_scale(q, scale), backend=backend
    )


def sparse_attention(q, k, v, perm, kv_idx, *, scale=None, return_lse=False, out=None, residual=None, backend="auto"):
    """Token-sparse attention over each group's gathered KV tokens, output in the original query order.

    Args:
        q, k, v: ``[B, H, S, D]`` (k, v ``[B, H, Sk, D]``), any strides: e.g. ``x.view(B, S, H, D).transpose(1, 2)``
            of ComfyUI's ``[B, S, H*D]`` tensors, read in place.
        perm: int32 ``[B, H, G*C]`` query groups (-1 in the last G*C - S slots).
        kv_idx: int32 ``[B, H, G, K_alloc]``, each row sorted ascending with trailing -1 padding.
        scale: softmax scale; None means 1/sqrt(D).
        return_lse: also return the fp32 LSE ``[B, H, S]`` (natural log, scale applied) of the sparse part.
        out: optional ``[B, H, S, D]`` tensor in q's dtype on q's device, any strides (e.g. a view of a
            ``[B, S, H*D]`` buffer); written in place (every element of the view, nothing outside it) and returned.
        residual: optional ``kernels.Residual`` ("plain", "fp8_row", "int4_row" or "int4_group": then its ``mean``
            has one row per group of ``kv_idx``); the result is sparse + R, R added in fp32 before rounding (in the
            kernel's epilogue on the Triton and CuTeDSL backends).
        backend: "auto" or a backend name (``registry.backend_names()``).
    perm and kv_idx must come from ``pddp_groups`` and ``select_kv`` / ``decode_bitmask`` (or keep their contract: each
    query once, indices in [0, Sk) sorted with trailing -1, at least one per group): their values are not checked
    here, since that would cost a device sync on every reuse step.
    Returns:
        O ``[B, H, S, D]`` (q's dtype; ``out`` itself when given), or (O, LSE fp32 ``[B, H, S]``).
    Raises:
        TypeError / ValueError: malformed q/k/v, perm, kv_idx, out (shape, dtype, device, overlapping q/k/v) or
        residual (shape or device not q's). NoCapableBackendError: nothing can run the call.
    """
    _check_qkv(q, k, v)
    if (not isinstance(kv_idx, torch.Tensor) or kv_idx.dtype != torch.int32 or kv_idx.dim() != 4
            or kv_idx.shape[:2] != q.shape[:2] or kv_idx.shape[2] < 1 or kv_idx.shape[3] < 1):
        raise ValueError(f"kv_idx must be int32 [B, H, G, K] with q's B, H, got {_desc(kv_idx)}")
    if not isinstance(perm, torch.Tensor):
        raise TypeError(f"perm must be an int32 tensor [B, H, G*C], got {type(perm).__name__}")
    if kv_idx.device != q.device or perm.device != q.device:
        raise ValueError(f"perm and kv_idx must be on q's device {q.device}, got {perm.device}, {kv_idx.device}")
    G = kv_idx.shape[2]
    if perm.shape[-1] % G:
        raise ValueError(f"perm width {perm.shape[-1]} must be G*C for kv_idx's G = {G}")
    _check_perm(perm, q, perm.shape[-1] // G)
    if out is not None:
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(q.shape):
            raise ValueError(f"out must be a tensor of q's shape {tuple(q.shape)}, got {_desc(out)}")
        if out.dtype != q.dtype or out.device != q.device:
            raise TypeError(f"out must have q's dtype and device ({q.dtype}, {q.device}), got {out.dtype}, {out.device}")
        for name, t in (("q", q), ("k", k), ("v", v)):
            if _overlaps(out, t):
                raise ValueError(f"out must not share memory with {name} (the kernel reads {name} while writing out)")
    if residual is not None:
        if not isinstance(residual, Residual):
            raise TypeError(f"residual must be a kernels.Residual (or None), got {type(residual).__name__}")
        residual.check(q)
        if residual.mean is not None and residual.mean.shape[2] != G:
            raise ValueError(f"int4_group residual mean must have kv_idx's G = {G} rows per head, got "
                             f"{tuple(residual.mean.shape)}")
    return registry.call(
        "sparse_attention", q, k, v, perm, kv_idx, scale=_scale(q, scale), return_lse=return_lse, out=out,
        residual=residual, backend=backend,
    )


def decode_bitmask(bits, *, num_tokens, out=None, width=None, backend="auto"):
    """Bitmask selection rows -> sorted int32 KV indices with trailing -1 (the cache's compact form, decoded).

    Args:
        bits: uint8 ``[..., ceil(num_tokens/8)]``, little bit order: bit j of byte b is token 8b + j
            (comfyui_mc_sparse/encoding.py); bits of tokens >= num_tokens are ignored.
        num_tokens: S, the KV length.
        out: int32 ``[..., width]`` with bits' leading shape, on bits' device, whose leading dims flatten to rows
            (e.g. ``stacked[0]`` of a ``[2, H, G, K_alloc]`` buffer two CFG entries decode into); every element is
            written. None allocates one ``width`` wide.
        width: K_alloc when ``out`` is None.
        backend: "auto" (one Triton launch on CUDA, no host sync, no int64 intermediates) or a backend name.
    Returns:
        ``out``: each row's set tokens ascending, then -1. A row with more than ``width`` set tokens keeps its first
        ``width`` (the cache never stores one; checking would cost a device sync).
    Raises:
        TypeError / ValueError: bits not uint8 of ceil(num_tokens/8) bytes per row, out of the wrong dtype, shape or
        device, or neither out nor width given.
    """
    if not isinstance(bits, torch.Tensor) or bits.dtype != torch.uint8 or bits.dim() < 1:
        raise TypeError(f"bits must be a uint8 tensor [..., ceil(S/8)], got {_desc(bits)}")
    if num_tokens < 1 or bits.shape[-1] != -(-num_tokens // 8):
        raise ValueError(f"bits must have ceil(num_tokens/8) = {-(-num_tokens // 8)} bytes per row, got {bits.shape[-1]}")
    if out is None:
        if width is None or width < 1:
            raise ValueError(f"give out or a width >= 1, got width={width}")
        out = torch.empty(*bits.shape[:-1], width, dtype=torch.int32, device=bits.device)
    if not isinstance(out, torch.Tensor) or out.dtype != torch.int32 or tuple(out.shape[:-1]) != tuple(bits.shape[:-1]):
        raise ValueError(f"out must be int32 [{', '.join(map(str, bits.shape[:-1]))}, width], got {_desc(out)}")
    if width is not None and out.shape[-1] != width:
        raise ValueError(f"out's width {out.shape[-1]} differs from width={width}")
    if out.device != bits.device:
        raise ValueError(f"out must be on bits' device {bits.device}, got {out.device}")
    if out.shape[-1] < 1 or out.stride(-1) != 1 or not _rows_uniform(out):
        raise ValueError(f"out must have unit stride on its last dim and leading dims that flatten to rows, got strides "
                         f"{out.stride()}")
    return registry.call("decode_bitmask", bits, out, num_tokens=num_tokens, backend=backend)


def _rows_uniform(t: torch.Tensor) -> bool:
    """True when t's leading dims flatten to one row stride (t.view(-1, width) works without a copy)."""
    try:
        t.view(-1, t.shape[-1])
    except RuntimeError:
        return False
    return True


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when the byte ranges of a and b intersect (conservative for interleaved views)."""
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a0 < b1 and b0 < a1


def _span(t: torch.Tensor) -> tuple[int, int]:
    lo = t.data_ptr()
    return lo, lo + (sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride())) + 1) * t.element_size()


def _desc(t) -> str:
    return f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


def pddp_groups(q, group_size, *, power_iters=8, backend="auto"):
    """Fast PDDP query groups: int32 ``[B, H, ceil(S/C)*C]`` (see ``kernels.reference.pddp``); every query once, also
    for non-finite q (the anchor path never passes one: it checks q first).

    Raises: TypeError / ValueError on a malformed q, or group_size or power_iters not an int >= 1.
    """
    _check_qkv(q, q)
    _check_int("group_size", group_size)
    _check_int("power_iters", power_iters)
    return registry.call("pddp_groups", q, group_size, power_iters=power_iters, backend=backend)
