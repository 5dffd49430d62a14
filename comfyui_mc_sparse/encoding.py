"""Compact storage of a metadata-cache entry: query groups, KV selections and the residual.

The paper's layout (int32 indices, bf16 residual) costs ``4 s H S^2 / C + 2 H S D`` bytes per layer and branch
(MC-Sparse, arXiv 2610.06801, sec. 3.5; docs/cache.md): ~54 GB for Wan2.1-14B at
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
first S slots when S <= 65536, as 16 bits + one high bit (a bit plane) when S <= 131072 (Wan2.1 720p: S = 75600),
the -1 tail implied; else as given.

Residual R = O_dense - O_sparse ``[B, H, S, D]`` is stored in one of the forms the sparse kernel's epilogue reads
(``kernels.Residual``, kernels/residual.py): plain bf16/fp16/fp32; float8_e4m3fn with an fp32 scale per row (one
query of one head, D values: max |R| -> 448); or 4-bit with an fp32 scale per row (two values per byte, the
scale picked per row to minimise the L1 error, ``encode_residual``). The reuse path hands the stored form to the
kernel as is (``residual_for_kernel``); only the torch reference dequantises. This is the only lossy part: its
cost in output error is measured in tests/test_cache.py and tests/bench_cache.py (docs/cache.md).
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
INT4_NAME = "int4"
INT4_GROUP_NAME = "int4_group"
_PLAIN = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
RESIDUAL_FORMATS = (*_PLAIN, FP8_DTYPE_NAME, INT4_NAME, INT4_GROUP_NAME)
"""Residual storage names: plain dtypes, fp8 e4m3 with a row scale, 4-bit with a row scale, 4-bit deviations from
each query group's weighted mean row (``encode_residual``)."""
INT4_CLIPS = (1.0, 0.9, 0.8, 0.7, 0.6)
"""Candidate clip ratios of the int4 row scale (``encode_residual``); 1.0 is round-to-nearest with max|R| / 7."""
_FP8_MAX = 448.0  # largest finite float8_e4m3fn value
_FP8_MIN_AMAX = _FP8_MAX * torch.finfo(torch.float32).tiny  # below it max|R| / 448 is no normal fp32
_INT4_MAX = 7.0  # q in [-7, 7]: nibble q + 8 in [1, 15]
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


def encode_selection(kv_idx: torch.Tensor, num_tokens: int, num_keys: int, requested: str = "auto", *,
                     checked: bool = False) -> EncodedSelection:
    """Encode ``kv_idx`` losslessly (see the module docstring for the choice).

    Args:
        kv_idx: int32 ``[B, H, G, K_alloc]``, rows sorted ascending, -1 past K (docs/architecture.md).
        num_tokens: S, the KV length (indices lie in [0, S)). num_keys: K <= K_alloc.
        requested: "auto", "bitmask", "uint16" or "int32".
        checked: the rows are known to be "K sorted indices in [0, S) then -1" (they come from ``kernels.select_kv``,
            whose every backend writes exactly that): skip the check, and its device-to-host sync.
    Returns:
        EncodedSelection on kv_idx's device. Rows that are not "K sorted indices then -1" are stored as int32
        whatever was requested, so the round trip stays exact (unless ``checked`` vouched for them).
    Raises:
        ValueError: kv_idx is not int32 4-D, or K is outside [1, K_alloc].
    """
    if kv_idx.dtype != torch.int32 or kv_idx.dim() != 4:
        raise ValueError(f"kv_idx must be int32 [B, H, G, K_alloc], got {kv_idx.dtype} {tuple(kv_idx.shape)}")
    width = kv_idx.shape[-1]
    if not 1 <= num_keys <= width:
        raise ValueError(f"num_keys must be in [1, K_alloc={width}], got {num_keys}")
    kind = pick_selection_encoding(requested, num_tokens, num_keys, width)
    if kind != "int32" and not checked and not _rows_are_k_sorted(kv_idx, num_keys, num_tokens):
        log.debug("selection rows are not K sorted indices; stored as int32")
        kind = "int32"
    if kind == "int32":
        data = kv_idx.clone()
    elif kind == "uint16":
        data = kv_idx[..., :num_keys].to(torch.int16)  # keeps the low 16 bits; decode masks them back
    else:
        data = _pack_bits(kv_idx[..., :num_keys], num_tokens)
    return EncodedSelection(kind, data, num_tokens, num_keys, width)


PACK_BITS = "words"
"""How ``encode_selection`` builds a bitmask (both bit-exact, tests/test_cache.py): "words", one zeroed int32 word per
32 tokens, each key's bit added by ``scatter_add_`` (the keys of a row are distinct, so the sum is their OR), the words
read as their little-endian bytes; "bytes", a zeroed byte per token, each key's byte set by ``scatter_``, then the 8
bytes of each output byte shifted and summed. H200 round s6r1, one 1.3B 480p anchor entry (3072 rows, K 4928): 0.31 ms
by words against 1.12 ms by bytes (method of record); the 58 anchor calls of a run 41 ms faster."""


def _pack_bits(idx: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Sorted indices ``[..., K]`` -> uint8 bitmask ``[..., ceil(S/8)]`` (``PACK_BITS`` says how)."""
    if PACK_BITS == "words":
        return _pack_bits_words(idx, num_tokens)
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


def _pack_bits_words(idx: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``_pack_bits`` by int32 words: word w holds tokens 32w .. 32w + 31 (bit t % 32; bit 31 is the sign bit), so its
    little-endian bytes are bitmask bytes 4w .. 4w + 3; distinct keys set distinct bits, so ``scatter_add_`` is their
    OR (no carries, no overflow)."""
    lead = idx.shape[:-1]
    nbytes = -(-num_tokens // 8)
    rows = idx.reshape(-1, idx.shape[-1])
    words = torch.zeros(rows.shape[0], -(-nbytes // 4), dtype=torch.int32, device=idx.device)
    for r0, r1 in _row_chunks(rows.shape[0], 4 * rows.shape[1]):  # int64 word index + int32 bit per key
        chunk = rows[r0:r1]
        bit = torch.bitwise_left_shift(torch.ones_like(chunk), chunk & 31)
        words[r0:r1].scatter_add_(1, (chunk >> 5).long(), bit)
    out = words.view(torch.uint8)
    if out.shape[1] != nbytes:
        out = out[:, :nbytes].contiguous()
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
    """Query groups ``perm``, compact (lossless).

    Attributes:
        kind: "uint16" (S <= 65536: ``data`` int16 bit pattern ``[B, H, S]``), "uint17" (S <= 131072: ``data``
            the low 16 bits as int16 ``[B, H, S]``, ``high`` uint8 ``[B, H, ceil(S/8)]`` bit 16 of each slot,
            little bit order), or "int32" (``data`` the ``[B, H, G*C]`` array as given).
        width: G*C. num_tokens: S. The -1 tail of the first two kinds is implied.
    """

    kind: str
    data: torch.Tensor
    num_tokens: int
    width: int
    high: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return _tensor_bytes(self.data) + _tensor_bytes(self.high)

    def tensors(self) -> list[torch.Tensor]:
        return [self.data] + ([self.high] if self.high is not None else [])

    def with_tensors(self, it) -> EncodedGroups:
        data = next(it)
        return EncodedGroups(self.kind, data, self.num_tokens, self.width, next(it) if self.high is not None else None)


def groups_kind(num_tokens: int) -> str:
    """The encoding of query groups for S = ``num_tokens`` (when the layout is as documented)."""
    if num_tokens <= _UINT16_LIMIT:
        return "uint16"
    return "uint17" if num_tokens <= 2 * _UINT16_LIMIT else "int32"


def groups_nbytes(batch: int, heads: int, num_tokens: int, group_size: int) -> int:
    """Bytes of encoded query groups: 2 per query (S <= 65536), 2 per query + 1 bit (S <= 131072), else 4 per
    slot of the G*C-wide rows."""
    kind = groups_kind(num_tokens)
    if kind == "uint16":
        return batch * heads * num_tokens * 2
    if kind == "uint17":
        return batch * heads * (num_tokens * 2 + -(-num_tokens // 8))
    return batch * heads * (-(-num_tokens // group_size) * group_size) * 4


def encode_groups(perm: torch.Tensor, num_tokens: int, *, checked: bool = False) -> EncodedGroups:
    """Encode int32 ``perm`` ``[B, H, G*C]`` (tail slots -1) losslessly: 16 or 17 bits per query when S <= 131072
    and the layout is as documented (one device sync to check, skipped when ``checked``: perm comes from
    ``kernels.pddp_groups``), else as given."""
    if perm.dtype != torch.int32 or perm.dim() != 3:
        raise ValueError(f"perm must be int32 [B, H, G*C], got {perm.dtype} {tuple(perm.shape)}")
    width = perm.shape[-1]
    kind = groups_kind(num_tokens)
    head, tail = perm[..., :num_tokens], perm[..., num_tokens:]
    if kind == "int32" or not (checked or bool((tail == -1).all() & (head >= 0).all() & (head < num_tokens).all())):
        return EncodedGroups("int32", perm.clone(), num_tokens, width)
    low = head.to(torch.int16)  # keeps the low 16 bits; decode masks them back
    if kind == "uint16":
        return EncodedGroups("uint16", low, num_tokens, width)
    high = _pack_flags(head >= _UINT16_LIMIT)
    return EncodedGroups("uint17", low, num_tokens, width, high)


def decode_groups(enc: EncodedGroups, device: torch.device | str | None = None, *, non_blocking: bool = False) -> torch.Tensor:
    """int32 ``[B, H, G*C]`` query groups, bit-exact, on ``device`` (None: where the data is)."""
    data = enc.data if device is None else enc.data.to(device, non_blocking=non_blocking)
    if enc.kind == "int32":
        return data
    out = torch.empty(*data.shape[:-1], enc.width, dtype=torch.int32, device=data.device)
    head = out[..., : enc.num_tokens]
    torch.bitwise_and(data.to(torch.int32), 0xFFFF, out=head)
    if enc.kind == "uint17":
        high = enc.high if device is None else enc.high.to(device, non_blocking=non_blocking)
        head.add_(_unpack_flags(high, enc.num_tokens).to(torch.int32) << 16)
    out[..., enc.num_tokens :] = -1
    return out


def _pack_flags(flags: torch.Tensor) -> torch.Tensor:
    """bool ``[..., n]`` -> uint8 ``[..., ceil(n/8)]``, bit j of byte b = flag 8b + j."""
    n = flags.shape[-1]
    pad = -(-n // 8) * 8 - n
    bits = torch.nn.functional.pad(flags.to(torch.uint8), (0, pad)).view(*flags.shape[:-1], -1, 8)
    shifts = torch.arange(8, dtype=torch.uint8, device=flags.device)
    return (bits << shifts).sum(-1, dtype=torch.uint8)


def _unpack_flags(packed: torch.Tensor, n: int) -> torch.Tensor:
    """uint8 ``[..., ceil(n/8)]`` -> uint8 0/1 ``[..., n]`` (inverse of ``_pack_flags``)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 1).flatten(-2)[..., :n]


# --- residual -------------------------------------------------------------------------------------------------


def residual_nbytes(batch: int, heads: int, num_tokens: int, head_dim: int, dtype_name: str,
                    num_groups: int | None = None) -> int:
    """Bytes of an encoded residual ``[B, H, S, D]`` stored as ``dtype_name`` (``RESIDUAL_FORMATS``).

    bf16/fp16: 2 per element, fp32: 4, fp8: 1 + a 4-byte scale per row, int4: 1/2 + a 4-byte scale per row,
    int4_group: 1/2 + a 2-byte scale + a 1-byte coef per row, + a bf16 mean row (2 D bytes) per query group
    (``num_groups`` G = ceil(S / C) per head, required for it). Raises ValueError for an unknown name or a missing G.
    """
    rows = batch * heads * num_tokens
    if dtype_name == FP8_DTYPE_NAME:
        return rows * head_dim + rows * 4
    if dtype_name == INT4_NAME:
        return rows * -(-head_dim // 2) + rows * 4
    if dtype_name == INT4_GROUP_NAME:
        if num_groups is None:
            raise ValueError("int4_group residual bytes need the number of query groups per head")
        return rows * (-(-head_dim // 2) + 3) + batch * heads * num_groups * head_dim * 2
    if dtype_name in _PLAIN:
        return rows * head_dim * _PLAIN[dtype_name].itemsize
    raise ValueError(f"residual dtype must be one of {RESIDUAL_FORMATS}, got {dtype_name!r}")


@dataclass
class EncodedResidual:
    """The residual ``[B, H, S, D]`` in one of the forms the sparse kernel's epilogue reads (kernels/residual.py;
    ``kernels.Residual``, which defines each): kind "plain" (``data`` bf16/fp16/fp32), "fp8_row" (``data``
    float8_e4m3fn, ``scale`` fp32 ``[B, H, S]``), "int4_row" (``data`` uint8 ``[B, H, S, D//2]``, ``scale`` fp32) or
    "int4_group" (``data`` as int4_row, ``scale`` bf16 ``[B, H, S]``, ``coef`` float8_e4m3fn ``[B, H, S]``, ``mean``
    bf16 ``[B, H, G, D]``: R = coef * mean[group of the query] + q * scale)."""

    kind: str
    data: torch.Tensor
    scale: torch.Tensor | None = None
    coef: torch.Tensor | None = None
    mean: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return sum(_tensor_bytes(t) for t in self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.data, self.scale, self.coef, self.mean) if t is not None]

    def with_tensors(self, it) -> EncodedResidual:
        data = next(it)
        rest = [None if t is None else next(it) for t in (self.scale, self.coef, self.mean)]
        return EncodedResidual(self.kind, data, *rest)


def _int4_rows(rows: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``[N, D]`` -> (uint8 ``[N, D // 2]`` packed nibbles q + 8, scale ``[N, 1]`` in ``scale_dtype``).

    q = round(x / s) clamped to [-7, 7], s chosen per row among ``clip * max|x| / 7`` for ``clip`` in ``INT4_CLIPS``
    (each candidate rounded to ``scale_dtype`` first, so q is computed with the scale the kernel will read) as the one
    with the least L1 error of q * s; zero rows get s = 1, q = 0."""
    amax = rows.abs().amax(-1, keepdim=True)
    base = torch.where(amax > 0, amax / _INT4_MAX, torch.ones_like(amax))
    best_s, best_err = None, None
    for clip in INT4_CLIPS:
        s = (base * clip).to(scale_dtype).float()
        err = (torch.round(rows / s).clamp_(-_INT4_MAX, _INT4_MAX).mul_(s) - rows).abs_().sum(-1, keepdim=True)
        if best_err is None:
            best_s, best_err = s, err
        else:
            better = err < best_err
            best_s, best_err = torch.where(better, s, best_s), torch.where(better, err, best_err)
    nib = torch.round(rows / best_s).clamp_(-_INT4_MAX, _INT4_MAX).add_(8).to(torch.uint8)
    return nib[:, 0::2] | (nib[:, 1::2] << 4), best_s.to(scale_dtype)


def encode_residual(residual: torch.Tensor, dtype_name: str, perm: torch.Tensor | None = None,
                    num_groups: int | None = None) -> EncodedResidual:
    """Store ``residual`` ``[B, H, S, D]`` (any float dtype; fp32 keeps the quantisers exact) as ``dtype_name``.

    - "bfloat16" / "float16" / "float32": a cast.
    - "float8_e4m3fn": one fp32 scale per row (one query of one head) mapping the row's max |R| to 448.
    - "int4": q = round(R / s) clamped to [-7, 7] with one fp32 scale s per row, chosen per row among
      ``s = clip * max|R| / 7`` for ``clip`` in ``INT4_CLIPS`` as the one with the least L1 error of q * s (the
      round-to-nearest absmax scale is clip 1.0; clipping the largest values buys finer steps for the rest:
      measured in docs/cache.md, residual L1 error 0.128 -> 0.103 on the synthetic workload).
    - "int4_group" (needs ``perm``, the entry's int32 ``[B, H, G*C]`` query groups, and ``num_groups`` G): per
      query group the mean of its rows, rounded to bf16 (M); per row the least-squares weight a = <R, M> / <M, M>
      rounded to e4m3 (0 when M = 0); the deviation R - a M stored as "int4" does, with a bf16 scale. The queries of
      a group are similar and share one selection, so their residual rows are correlated: 0.4 of the error of "int4"
      for 1.5 % more bytes at C = 128 (docs/cache.md).
    Zero rows get scale 1 (q = 0). Raises ValueError for an unknown name, an odd D for the 4-bit forms, or a missing
    or misshapen perm for "int4_group".
    """
    if dtype_name in _PLAIN:
        return EncodedResidual("plain", residual.to(_PLAIN[dtype_name]))
    if dtype_name not in (FP8_DTYPE_NAME, INT4_NAME, INT4_GROUP_NAME):
        raise ValueError(f"residual dtype must be one of {RESIDUAL_FORMATS}, got {dtype_name!r}")
    B, H, S, D = residual.shape
    rows = residual.reshape(B * H * S, D)
    if dtype_name == FP8_DTYPE_NAME:
        scales = torch.empty(B * H * S, 1, dtype=torch.float32, device=residual.device)
        data = torch.empty(B * H * S, D, dtype=torch.float8_e4m3fn, device=residual.device)
        for r0, r1 in _row_chunks(rows.shape[0], D):
            chunk = rows[r0:r1].float()
            amax = chunk.abs().amax(-1, keepdim=True)
            s = scales[r0:r1]
            # rows whose scale would underflow fp32 (max |R| < ~5e-36, zero rows included) keep scale 1: their values
            # round to 0 in e4m3 (an error below 1e-35) instead of 0 / 0 = NaN
            torch.where(amax > _FP8_MIN_AMAX, amax / _FP8_MAX, torch.ones_like(amax), out=s)
            data[r0:r1] = (chunk / s).clamp_(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
        return EncodedResidual("fp8_row", data.view(B, H, S, D), scales.view(B, H, S))
    if D % 2:
        raise ValueError(f"{dtype_name} residual needs an even head dim, got D = {D}")
    if dtype_name == INT4_GROUP_NAME:
        return _encode_int4_group(residual, perm, num_groups)
    scales = torch.empty(B * H * S, 1, dtype=torch.float32, device=residual.device)
    data = torch.empty(B * H * S, D // 2, dtype=torch.uint8, device=residual.device)
    for r0, r1 in _row_chunks(rows.shape[0], 4 * D):  # ~4 row-sized temporaries per candidate
        data[r0:r1], scales[r0:r1] = _int4_rows(rows[r0:r1].float(), torch.float32)
    return EncodedResidual("int4_row", data.view(B, H, S, D // 2), scales.view(B, H, S))


def _encode_int4_group(residual: torch.Tensor, perm: torch.Tensor | None, num_groups: int | None) -> EncodedResidual:
    """The "int4_group" form (``encode_residual``), worked in group order a few heads at a time."""
    B, H, S, D = residual.shape
    if perm is None or num_groups is None or perm.dtype != torch.int32 or perm.dim() != 3 \
            or tuple(perm.shape[:2]) != (B, H) or perm.shape[-1] < S or perm.shape[-1] % num_groups:
        raise ValueError(f"int4_group needs the entry's int32 perm [B, H, G*C] (G*C >= S = {S}) and G, got "
                         f"{None if perm is None else (perm.dtype, tuple(perm.shape))} and G = {num_groups}")
    dev = residual.device
    n_slots, G = perm.shape[-1], num_groups
    C = n_slots // G
    data = torch.empty(B * H, S, D // 2, dtype=torch.uint8, device=dev)
    scale = torch.empty(B * H, S, dtype=torch.bfloat16, device=dev)
    coef = torch.empty(B * H, S, dtype=torch.float8_e4m3fn, device=dev)
    mean = torch.empty(B * H, G, D, dtype=torch.bfloat16, device=dev)
    flat, slots = residual.reshape(B * H, S, D), perm.to(dev).reshape(B * H, n_slots)
    for h0, h1 in _row_chunks(B * H, 6 * n_slots * D):  # ~6 group-order temporaries of one head
        n = h1 - h0
        valid = slots[h0:h1] >= 0
        src = slots[h0:h1].clamp_min(0).long()
        rows = torch.gather(flat[h0:h1], 1, src.unsqueeze(-1).expand(-1, -1, D)).float()  # [n, G*C, D]
        rows = rows.mul_(valid.unsqueeze(-1)).view(n, G, C, D)
        count = valid.view(n, G, C).sum(-1, keepdim=True).clamp_min(1)
        m = (rows.sum(2) / count).to(torch.bfloat16)  # [n, G, D]
        mean[h0:h1] = m
        mf = m.float().unsqueeze(2)  # [n, G, 1, D]
        norm = mf.pow(2).sum(-1)
        a = torch.where(norm > 0, (rows * mf).sum(-1) / norm.clamp_min(1e-30), torch.zeros_like(norm))
        a = a.clamp_(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)  # [n, G, C]
        rows.sub_(a.float().unsqueeze(-1) * mf)
        packed, s = _int4_rows(rows.view(-1, D), torch.bfloat16)
        # back to query order: each query sits in one slot; the padding slots land in a spare row S, dropped
        dest = torch.where(valid, src, S).unsqueeze(-1)
        for part, out in ((packed.view(n, -1, D // 2), data), (s.view(n, -1, 1), scale.unsqueeze(-1)),
                          (a.view(n, -1, 1).view(torch.uint8), coef.view(torch.uint8).unsqueeze(-1))):
            w = part.shape[-1]
            spare = torch.zeros(n, S + 1, w, dtype=part.dtype, device=dev)
            spare.scatter_(1, dest.expand(-1, -1, w), part)
            out[h0:h1] = spare[:, :S]
    return EncodedResidual("int4_group", data.view(B, H, S, D // 2), scale.view(B, H, S), coef.view(B, H, S),
                           mean.view(B, H, G, D))


def residual_for_kernel(enc: EncodedResidual, device: torch.device | str | None = None, *,
                        non_blocking: bool = False) -> kernels.Residual:
    """The stored residual as the sparse kernel takes it (``kernels.Residual``, kernels/residual.py), on ``device``
    (None: where it is), without dequantising: only a copy when the device differs. The result shares the stored
    tensors when no copy is needed (callers must not modify them)."""
    moved = enc if device is None else enc.with_tensors(iter([t.to(device, non_blocking=non_blocking)
                                                                for t in enc.tensors()]))
    return kernels.Residual(data=moved.data, scale=moved.scale, kind=moved.kind, coef=moved.coef, mean=moved.mean)


def decode_residual(enc: EncodedResidual, dtype: torch.dtype, device: torch.device | str | None = None, *,
                    non_blocking: bool = False, perm: torch.Tensor | None = None) -> torch.Tensor:
    """The residual dequantised to a ``[B, H, S, D]`` tensor in ``dtype`` (tests and benchmarks only: the reuse
    path hands ``residual_for_kernel`` to the kernel). ``perm``: the entry's query groups, needed for "int4_group"."""
    res = residual_for_kernel(enc, device, non_blocking=non_blocking)
    return res.dequantize(dtype, None if perm is None else perm.to(res.data.device))
