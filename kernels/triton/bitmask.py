"""Triton bitmask -> KV index decode: the cache's compact selection rows to the sparse kernel's ``kv_idx``.

One launch per call, one program per row (one query group of one head): the program walks its row's
``ceil(S/8)`` bytes BLOCK_BYTES at a time, expands each byte to its 8 bits (little bit order: bit j of byte b is
token 8b + j, ``comfyui_mc_sparse/encoding.py``), takes an exclusive prefix sum of the bits (``tl.cumsum``) plus the
running count of the bytes before, and stores each set token at its rank; then it fills the slots from its count to
``width`` with -1. Everything is int32 (only the row's base offset is 64-bit), nothing leaves the device, and the
output row stride is the caller's, so two CFG entries can decode into the halves of one stacked buffer.

Bit-exact with ``kernels.reference.decode_bitmask`` (integer work only).
"""

from __future__ import annotations

import triton
import triton.language as tl

_BLOCK_BYTES = 256  # bytes per step: 2048 bits, one prefix sum per step
_BLOCK_W = 1024  # slots per -1 fill step


@triton.jit
def _step_bits(bits_base, b0, n_bytes, num_tokens, BLOCK_BYTES: tl.constexpr):
    """Bytes [b0, b0 + BLOCK_BYTES) of one bitmask row as (token, bit), both int32 [BLOCK_BYTES, 8]; row-major order
    is ascending token order; bits past ``num_tokens`` or ``n_bytes`` are 0."""
    offs_b = tl.arange(0, BLOCK_BYTES)
    offs_j = tl.arange(0, 8)
    byte = tl.load(bits_base + b0 + offs_b, mask=b0 + offs_b < n_bytes, other=0).to(tl.int32)
    token = (b0 + offs_b)[:, None] * 8 + offs_j[None, :]
    bit = tl.where(token < num_tokens, (byte[:, None] >> offs_j[None, :]) & 1, 0)
    return token, bit


@triton.jit
def _fill_tail(out_base, count, width, BLOCK_W: tl.constexpr):
    """-1 into slots [count, width) of one output row."""
    for w0 in range((tl.minimum(count, width) // BLOCK_W) * BLOCK_W, width, BLOCK_W):
        slots = w0 + tl.arange(0, BLOCK_W)
        tl.store(out_base + slots, tl.full([BLOCK_W], -1, tl.int32), mask=(slots >= count) & (slots < width))


@triton.jit
def _decode_bitmask_fwd(
    BITS, OUT, n_bytes, num_tokens, width, stride_bits_row, stride_out_row,
    BLOCK_BYTES: tl.constexpr, BLOCK_W: tl.constexpr,
):
    row = tl.program_id(0)
    bits_base = BITS + row.to(tl.int64) * stride_bits_row
    out_base = OUT + row.to(tl.int64) * stride_out_row
    count = tl.zeros((), dtype=tl.int32)
    for b0 in range(0, n_bytes, BLOCK_BYTES):
        token, bit = _step_bits(bits_base, b0, n_bytes, num_tokens, BLOCK_BYTES)
        bit = tl.reshape(bit, [BLOCK_BYTES * 8])
        token = tl.reshape(token, [BLOCK_BYTES * 8])
        rank = count + tl.cumsum(bit, 0) - bit  # exclusive prefix: slot of each set token
        tl.store(out_base + rank, token, mask=(bit != 0) & (rank < width))
        count += tl.sum(bit, 0)
    _fill_tail(out_base, count, width, BLOCK_W)


@triton.jit
def _decode_bitmask_bytes_fwd(
    BITS, OUT, n_bytes, num_tokens, width, stride_bits_row, stride_out_row,
    BLOCK_BYTES: tl.constexpr, BLOCK_W: tl.constexpr,
):
    # Same result as _decode_bitmask_fwd with the prefix sum per BYTE (BLOCK_BYTES wide, of the bytes' set-bit counts)
    # instead of per bit (8 x wider), and each bit's rank inside its byte from an 8-wide prefix sum; larger steps.
    row = tl.program_id(0)
    bits_base = BITS + row.to(tl.int64) * stride_bits_row
    out_base = OUT + row.to(tl.int64) * stride_out_row
    count = tl.zeros((), dtype=tl.int32)
    for b0 in range(0, n_bytes, BLOCK_BYTES):
        token, bit = _step_bits(bits_base, b0, n_bytes, num_tokens, BLOCK_BYTES)
        per_byte = tl.sum(bit, 1)
        before = tl.cumsum(per_byte, 0) - per_byte  # set bits in the step's earlier bytes
        within = tl.cumsum(bit, 1) - bit  # set bits below this one in its byte
        rank = count + before[:, None] + within
        tl.store(out_base + rank, token, mask=(bit != 0) & (rank < width))
        count += tl.sum(per_byte, 0)
    _fill_tail(out_base, count, width, BLOCK_W)


VARIANTS = {"bits": (_decode_bitmask_fwd, _BLOCK_BYTES, 4), "bytes": (_decode_bitmask_bytes_fwd, 1024, 8)}
"""Decode kernels: name -> (kernel, bytes per step, warps). "bits": one 2048-wide prefix sum per 256 bytes; "bytes":
a 1024-wide prefix sum of byte counts per 1024 bytes (tests/bench_decode.py times both)."""
VARIANT = "bits"
"""The variant ``decode_bitmask`` launches (both bit-exact with the reference)."""


def decode_bitmask(bits, out, *, num_tokens, variant=None):
    """Contract of ``kernels.decode_bitmask`` (validated there): uint8 ``[..., ceil(S/8)]`` -> ``out`` int32
    ``[..., width]`` (unit last stride, leading dims flattening to rows), one launch, no host sync. ``variant``: a
    ``VARIANTS`` name (None: ``VARIANT``)."""
    rows_bits = bits.reshape(-1, bits.shape[-1])  # a view for the cache's contiguous rows
    width = out.shape[-1]
    rows_out = out.view(-1, width)
    n = rows_bits.shape[0]
    if n == 0:
        return out
    kernel, block_bytes, warps = VARIANTS[variant or VARIANT]
    kernel[(n,)](
        rows_bits, rows_out, rows_bits.shape[1], num_tokens, width, rows_bits.stride(0), rows_out.stride(0),
        BLOCK_BYTES=block_bytes, BLOCK_W=_BLOCK_W, num_warps=warps,
    )
    return out
