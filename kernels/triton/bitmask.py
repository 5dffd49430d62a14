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
def _decode_bitmask_fwd(
    BITS, OUT, n_bytes, num_tokens, width, stride_bits_row, stride_out_row,
    BLOCK_BYTES: tl.constexpr, BLOCK_W: tl.constexpr,
):
    row = tl.program_id(0)
    bits_base = BITS + row.to(tl.int64) * stride_bits_row
    out_base = OUT + row.to(tl.int64) * stride_out_row
    offs_b = tl.arange(0, BLOCK_BYTES)
    offs_j = tl.arange(0, 8)
    count = tl.zeros((), dtype=tl.int32)
    for b0 in range(0, n_bytes, BLOCK_BYTES):
        byte = tl.load(bits_base + b0 + offs_b, mask=b0 + offs_b < n_bytes, other=0).to(tl.int32)
        token = (b0 + offs_b)[:, None] * 8 + offs_j[None, :]  # [BLOCK_BYTES, 8], row-major = ascending tokens
        bit = tl.where(token < num_tokens, (byte[:, None] >> offs_j[None, :]) & 1, 0)
        bit = tl.reshape(bit, [BLOCK_BYTES * 8])
        token = tl.reshape(token, [BLOCK_BYTES * 8])
        rank = count + tl.cumsum(bit, 0) - bit  # exclusive prefix: slot of each set token
        tl.store(out_base + rank, token, mask=(bit != 0) & (rank < width))
        count += tl.sum(bit, 0)
    for w0 in range((tl.minimum(count, width) // BLOCK_W) * BLOCK_W, width, BLOCK_W):
        slots = w0 + tl.arange(0, BLOCK_W)
        tl.store(out_base + slots, tl.full([BLOCK_W], -1, tl.int32), mask=(slots >= count) & (slots < width))


def decode_bitmask(bits, out, *, num_tokens):
    """Contract of ``kernels.decode_bitmask`` (validated there): uint8 ``[..., ceil(S/8)]`` -> ``out`` int32
    ``[..., width]`` (unit last stride, leading dims flattening to rows), one launch, no host sync."""
    rows_bits = bits.reshape(-1, bits.shape[-1])  # a view for the cache's contiguous rows
    width = out.shape[-1]
    rows_out = out.view(-1, width)
    n = rows_bits.shape[0]
    if n == 0:
        return out
    _decode_bitmask_fwd[(n,)](
        rows_bits, rows_out, rows_bits.shape[1], num_tokens, width, rows_bits.stride(0), rows_out.stride(0),
        BLOCK_BYTES=_BLOCK_BYTES, BLOCK_W=_BLOCK_W, num_warps=4,
    )
    return out
