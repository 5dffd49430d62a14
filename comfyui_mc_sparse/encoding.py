"""Compact storage of a metadata-cache entry: query groups, KV selections and the residual.

The paper's layout (int32 indices, bf16 residual) costs ``4 s H S^2 / C + 2 H S D`` bytes per layer and branch
(MC-Sparse, arXiv 2610.06801, sec. 3.5; ``method.md`` "Memory the cache needs"): ~54 GB for Wan2.1-14B at
480p with CFG. This module stores the same information in fewer bytes and decodes it just in time, before the
sparse kernel runs (on a side CUDA stream when the cache prefetches, ``cache.MetadataCache``).

Selections (``kv_idx`` int32 ``[B, H, G, K_alloc]``, sorted ascending, -1 past K) are stored losslessly, as
the smallest of (project decision; sizes per group of S tokens keeping K):
- ``bitmask``: one bit per KV token, ``ceil(S/8)`` bytes whatever K is (little bit order: bit j of byte b is
  token 8b + j). Within 25 % of the information content ``log2(S choose K)`` bits at s = 0.25 (S/8 bytes vs
  S * H2(0.25) / 8 = 0.81 S/8), so delta or entropy codes would buy little and cost a serial decode.
- ``uint16``: the K indices in 16 bits (S <= 65536), 2K bytes: smaller than the bitmask when s < 1/16.
- ``int32``: the array as given, 4 K_alloc bytes; the only one that accepts unsorted rows or rows holding
  other than K tokens, so any input round-trips.
Decoding a bitmask uses ``torch.nonzero_static`` (no device-to-host sync) over bit planes, in row chunks that
bound the temporaries. Round trips are bit-exact (tests/test_cache.py).

Query groups (``perm`` int32 ``[B, H, G*C]``, -1 in the last G*C - S slots) are stored as 16-bit values for the
first S slots when S <= 65536 (the -1 tail is implied), else as given.

Residual R = O_dense - O_sparse ``[B, H, S, D]``: kept in bf16/fp16/fp32 as configured, or as float8_e4m3fn
with a float32 scale per row (one query of one head: ``[B, H, S, 1]``, 3 % overhead at D = 128) or per
tensor; the row scale maps each row's max |R| to 448 (e4m3's largest finite value). This is the only lossy
part: its cost in output error is measured in tests/test_cache.py and tests/bench_cache.py (docs/cache.md).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .. import kernels

log = logging.getLogger(__name__)

SELECTION_ENCODINGS = ("auto", "bitmask", "uint16", "int32")
"""Accepted ``MCSparseConfig.index_encoding`` values; "auto" picks the smallest that applies."""

FP8_DTYPE_NAME = "float8_e4m3fn"
RESIDUAL_SCALES = ("row", "tensor")
_FP8_MAX = 448.0  # largest finite float8_e4m3fn value
_CHUNK_ELEMENTS = 1 << 26  # temporaries per decode/encode chunk (64 Mi elements: 64-512 MiB)
_UINT16_LIMIT = 1 << 16  # 16-bit indices address tokens 0 .. 65535


def _tensor_bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _row_chunks(rows: int, row_elements: int):
    step = max(1, _CHUNK_ELEMENTS // max(1, row_elements))
    for r0 in range(0, rows, step):
        yield r0, min(rows, r0 + step)


# --- sizes (shared with memory.estimate_cache, so the estimate and the stored bytes cannot drift apart) ------


def selection_nbytes(kind: str, rows: int, num_tokens: int, num_keys: int, width: int) -> int:
    """Bytes of one encoded selection of ``rows`` = B*H*G groups over ``num_tokens`` = S KV tokens.

    Args: kind "bitmask" / "uint16" / "int32"; num_keys K; width K_alloc (>= K, the int32 row width).
    """
    if kind == "bitmask":
        return rows * (-(-num_tokens // 8))
    if kind == "uint16":
        return rows * num_keys * 2
    if kind == "int32":
        return rows * width * 4
    raise ValueError(f"kind must be one of {SELECTION_ENCODINGS[1:]}, got {kind!r}")


def pick_selection_encoding(requested: str, num_tokens: int, num_keys: int, width: int) -> str:
    """The encoding "auto" (or ``requested``) resolves to for S = ``num_tokens``, K = ``num_keys``.

    "auto": the smallest of bitmask (S/8 bytes per group), uint16 (2K, only when S <= 65536) and int32
    (4 K_alloc); ties go to the simpler index form. A requested "uint16" with S > 65536 becomes "int32".
    Raises ValueError for an unknown name.
    """
    if requested not in SELECTION_ENCODINGS:
        raise ValueError(f"index_encoding must be one of {SELECTION_ENCODINGS}, got {requested!r}")
    if requested == "uint16" and num_tokens > _UINT16_LIMIT:
        return "int32"
    if requested != "auto":
        return requested
    options = (["uint16"] if num_tokens <= _UINT16_LIMIT else []) + ["int32", "bitmask"]  # ties: first wins
    return min(options, key=lambda kind: selection_nbytes(kind, 1, num_tokens, num_keys, width))


def groups_nbytes(batch: int, heads: int, num_tokens: int, group_size: int) -> int:
    """Bytes of encoded query groups: 2 per query when S <= 65536, else 4 per slot of the G*C-wide rows."""
    if num_tokens <= _UINT16_LIMIT:
        return batch * heads * num_tokens * 2
    return batch * heads * (-(-num_tokens // group_size) * group_size) * 4


def residual_nbytes(batch: int, heads: int, num_tokens: int, head_dim: int, dtype_name: str, scale: str = "row") -> int:
    """Bytes of an encoded residual ``[B, H, S, D]`` in ``dtype_name`` (+ fp32 scales for fp8)."""
    n = batch * heads * num_tokens * head_dim
    if dtype_name == FP8_DTYPE_NAME:
        return n + (batch * heads * num_tokens * 4 if scale == "row" else 4)
    return n * torch.empty((), dtype=getattr(torch, dtype_name)).element_size()


# --- selections -----------------------------------------------------------------------------------------------


@dataclass
class EncodedSelection:
    """One layer call's KV selections, compact.

    Attributes:
        kind: "bitmask" (uint8 ``[B, H, G, ceil(S/8)]``), "uint16" (int16 bit pattern ``[B, H, G, K]``) or
            "int32" (the ``[B, H, G, K_alloc]`` array as given).
        data: the tensor above.
        num_tokens: S, the KV length. num_keys: K, tokens per group. width: K_alloc, the decoded row width.
    """

    kind: str
    data: torch.Tensor
    num_tokens: int
    num_keys: int
    width: int

    @property
    def nbytes(self) -> int:
        return _tensor_bytes(self.data)


def _rows_are_k_sorted(kv_idx: torch.Tensor, num_keys: int, num_tokens: int) -> bool:
    """True when every row holds exactly K strictly increasing indices in [0, S), then -1 (one device sync)."""
    head, tail = kv_idx[..., :num_keys], kv_idx[..., num_keys:]
    ok = (head >= 0).all() & (head < num_tokens).all() & (tail == -1).all()
    if num_keys > 1:
        ok &= (head[..., 1:] > head[..., :-1]).all()
    return bool(ok)


def encode_selection(kv_idx: torch.Tensor, num_tokens: int, num_keys: int, requested: str = "auto") -> EncodedSelection:
    """Encode ``kv_idx`` losslessly (see the module docstring for the choice).

    Args:
        kv_idx: int32 ``[B, H, G, K_alloc]``, rows sorted ascending, -1 past K (docs/architecture.md).
        num_tokens: S, the KV length (indices lie in [0, S)). num_keys: K <= K_alloc.
        requested: "auto", "bitmask", "uint16" or "int32".
    Returns:
        EncodedSelection on kv_idx's device. Rows that are not "K sorted indices then -1" are stored as int32
        whatever was requested, so the round trip stays exact.
    Raises:
        ValueError: kv_idx is not int32 4-D, or K is outside [1, K_alloc].
    """
    if kv_idx.dtype != torch.int32 or kv_idx.dim() != 4:
        raise ValueError(f"kv_idx must be int32 [B, H, G, K_alloc], got {kv_idx.dtype} {tuple(kv_idx.shape)}")
    width = kv_idx.shape[-1]
    if not 1 <= num_keys <= width:
        raise ValueError(f"num_keys must be in [1, K_alloc={width}], got {num_keys}")
    kind = pick_selection_encoding(requested, num_tokens, num_keys, width)
    if kind != "int32" and not _rows_are_k_sorted(kv_idx, num_keys, num_tokens):
        log.debug("selection rows are not K sorted indices; stored as int32")
        kind = "int32"
    if kind == "int32":
        data = kv_idx.clone()
    elif kind == "uint16":
        data = kv_idx[..., :num_keys].to(torch.int16)  # keeps the low 16 bits; decode masks them back
    else:
        data = _pack_bits(kv_idx[..., :num_keys], num_tokens)
    return EncodedSelection(kind, data, num_tokens, num_keys, width)


def _pack_bits(idx: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Sorted indices ``[..., K]`` -> uint8 bitmask ``[..., ceil(S/8)]``."""
    lead = idx.shape[:-1]
    nbytes = -(-num_tokens // 8)
    rows = idx.reshape(-1, idx.shape[-1])
    out = torch.empty(rows.shape[0], nbytes, dtype=torch.uint8, device=idx.device)
    shifts = torch.arange(8, dtype=torch.uint8, device=idx.device)
    for r0, r1 in _row_chunks(rows.shape[0], nbytes * 8):
        bits = torch.zeros(r1 - r0, nbytes * 8, dtype=torch.uint8, device=idx.device)
        bits.scatter_(1, rows[r0:r1].long(), 1)
        out[r0:r1] = (bits.view(r1 - r0, nbytes, 8) << shifts).sum(-1, dtype=torch.uint8)
    return out.reshape(*lead, nbytes)


def decode_selection(
    enc: EncodedSelection, device: torch.device | str | None = None, *, non_blocking: bool = False
) -> torch.Tensor:
    """The int32 ``[B, H, G, K_alloc]`` selection, bit-exact, on ``device`` (None: where the data is); an
    "int32" entry already there is returned itself (callers must not modify it).

    The data is copied to ``device`` first (``non_blocking`` for pinned sources), then decoded there on the
    current stream. A bitmask decode needs no device-to-host sync where ``torch.nonzero_static`` exists.
    """
    data = enc.data if device is None else enc.data.to(device, non_blocking=non_blocking)
    if enc.kind == "int32":
        return data
    if enc.kind == "bitmask" and data.is_cuda and kernels.registry.candidates("decode_bitmask", data)[0][0].name == "triton":
        return kernels.decode_bitmask(data, num_tokens=enc.num_tokens, width=enc.width)  # one launch, int32, no sync
    lead = data.shape[:-1]
    out = torch.empty(*lead, enc.width, dtype=torch.int32, device=data.device)
    if enc.width > enc.num_keys:
        out[..., enc.num_keys :] = -1
    if enc.kind == "uint16":
        torch.bitwise_and(data.to(torch.int32), 0xFFFF, out=out[..., : enc.num_keys])
        return out
    rows = data.reshape(-1, data.shape[-1])
    flat_out = out.view(-1, enc.width)
    row_bits = rows.shape[1] * 8
    ones = torch.ones(8, dtype=torch.uint8, device=data.device)  # made on the device: no host copy, no sync
    masks = ones << torch.arange(8, dtype=torch.uint8, device=data.device)  # 1, 2, 4, ..., 128
    for r0, r1 in _row_chunks(rows.shape[0], row_bits):
        # nonzero where bit j of byte b is set: flat position (row * row_bits + 8b + j), row-major = sorted per row
        bits = torch.bitwise_and(rows[r0:r1].unsqueeze(-1), masks).view(-1)
        count = (r1 - r0) * enc.num_keys
        if hasattr(torch, "nonzero_static"):
            pos = torch.nonzero_static(bits, size=count)
        else:  # older torch: one device sync per chunk
            pos = torch.nonzero(bits)
        pos = pos.view(r1 - r0, enc.num_keys).to(torch.int32)  # < 2**31: a chunk holds < 2**26 bits
        base = torch.arange(r1 - r0, dtype=torch.int32, device=data.device).mul_(row_bits).unsqueeze(-1)
        torch.sub(pos, base, out=flat_out[r0:r1, : enc.num_keys])
    return out


# --- query groups ---------------------------------------------------------------------------------------------


@dataclass
class EncodedGroups:
    """Query groups ``perm``, compact: ``data`` int16 bit pattern ``[B, H, S]`` ("uint16") or the int32
    ``[B, H, G*C]`` array as given ("int32"); ``width`` = G*C, ``num_tokens`` = S."""

    kind: str
    data: torch.Tensor
    num_tokens: int
    width: int

    @property
    def nbytes(self) -> int:
        return _tensor_bytes(self.data)


def encode_groups(perm: torch.Tensor, num_tokens: int) -> EncodedGroups:
    """Encode int32 ``perm`` ``[B, H, G*C]`` (tail slots -1) losslessly; 16-bit when S <= 65536 and the
    layout is as documented (one device sync to check), else as given."""
    if perm.dtype != torch.int32 or perm.dim() != 3:
        raise ValueError(f"perm must be int32 [B, H, G*C], got {perm.dtype} {tuple(perm.shape)}")
    width = perm.shape[-1]
    head, tail = perm[..., :num_tokens], perm[..., num_tokens:]
    if num_tokens <= _UINT16_LIMIT and bool((tail == -1).all() & (head >= 0).all() & (head < num_tokens).all()):
        return EncodedGroups("uint16", head.to(torch.int16), num_tokens, width)
    return EncodedGroups("int32", perm.clone(), num_tokens, width)


def decode_groups(enc: EncodedGroups, device: torch.device | str | None = None, *, non_blocking: bool = False) -> torch.Tensor:
    """int32 ``[B, H, G*C]`` query groups, bit-exact, on ``device`` (None: where the data is)."""
    data = enc.data if device is None else enc.data.to(device, non_blocking=non_blocking)
    if enc.kind == "int32":
        return data
    out = torch.empty(*data.shape[:-1], enc.width, dtype=torch.int32, device=data.device)
    torch.bitwise_and(data.to(torch.int32), 0xFFFF, out=out[..., : enc.num_tokens])
    out[..., enc.num_tokens :] = -1
    return out


# --- residual -------------------------------------------------------------------------------------------------


@dataclass
class EncodedResidual:
    """The residual ``[B, H, S, D]``: ``data`` in bf16/fp16/fp32 (``scale`` None), or float8_e4m3fn with a
    float32 ``scale`` ``[B, H, S, 1]`` (row) or ``[1, 1, 1, 1]`` (tensor); value = data * scale."""

    data: torch.Tensor
    scale: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return _tensor_bytes(self.data) + _tensor_bytes(self.scale)


def encode_residual(residual: torch.Tensor, dtype_name: str, scale: str = "row") -> EncodedResidual:
    """Store ``residual`` ``[B, H, S, D]`` as ``dtype_name`` ("bfloat16", "float16", "float32" or
    "float8_e4m3fn"); fp8 uses a per-``scale`` ("row" or "tensor") float32 scale, amax -> 448.

    Raises ValueError for an unknown dtype or scale name.
    """
    if dtype_name != FP8_DTYPE_NAME:
        if dtype_name not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"residual dtype must be bfloat16, float16, float32 or {FP8_DTYPE_NAME}, got {dtype_name!r}")
        return EncodedResidual(residual.to(getattr(torch, dtype_name)))
    if scale not in RESIDUAL_SCALES:
        raise ValueError(f"residual_scale must be one of {RESIDUAL_SCALES}, got {scale!r}")
    B, H, S, D = residual.shape
    rows = residual.reshape(B * H * S, D)
    data = torch.empty(B * H * S, D, dtype=torch.float8_e4m3fn, device=residual.device)
    if scale == "tensor":
        amax = residual.abs().amax().float()
        scales = torch.where(amax > 0, amax / _FP8_MAX, torch.ones_like(amax)).reshape(1, 1)
    else:
        scales = torch.empty(B * H * S, 1, dtype=torch.float32, device=residual.device)
    for r0, r1 in _row_chunks(rows.shape[0], D):
        chunk = rows[r0:r1].float()
        if scale == "row":
            amax = chunk.abs().amax(-1, keepdim=True)
            scales[r0:r1] = torch.where(amax > 0, amax / _FP8_MAX, torch.ones_like(amax))
            s = scales[r0:r1]
        else:
            s = scales
        data[r0:r1] = (chunk / s).clamp_(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
    shape = (B, H, S, 1) if scale == "row" else (1, 1, 1, 1)
    return EncodedResidual(data.reshape(B, H, S, D), scales.reshape(shape))


def decode_residual(
    enc: EncodedResidual, dtype: torch.dtype, device: torch.device | str | None = None, *, non_blocking: bool = False
) -> torch.Tensor:
    """The residual ``[B, H, S, D]`` in ``dtype`` on ``device`` (None: where the data is); returns the stored
    tensor itself when no copy or conversion is needed (callers must not modify it)."""
    data = enc.data if device is None else enc.data.to(device, non_blocking=non_blocking)
    if enc.scale is None:
        return data if data.dtype == dtype else data.to(dtype)
    scale = enc.scale if device is None else enc.scale.to(device, non_blocking=non_blocking)
    B, H, S, D = data.shape
    out = torch.empty(B, H, S, D, dtype=dtype, device=data.device)
    rows, flat_out = data.reshape(-1, D), out.view(-1, D)
    scales = scale.reshape(-1, 1)
    for r0, r1 in _row_chunks(rows.shape[0], D):
        s = scales if scales.shape[0] == 1 else scales[r0:r1]
        torch.mul(rows[r0:r1].to(dtype), s, out=flat_out[r0:r1])  # fp8 -> dtype is exact; product in fp32
    return out
