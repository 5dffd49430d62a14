"""Torch reference of the bitmask -> KV index decode (the cache's compact selection, comfyui_mc_sparse/encoding.py).

Format: uint8 ``[..., ceil(S/8)]``, one bit per KV token, little bit order (bit j of byte b is token 8b + j).
Decoded: int32 ``[..., width]`` with each row's set tokens ascending, then -1 to the end of the row.
"""

from __future__ import annotations

import torch

_CHUNK_BITS = 1 << 24  # bits expanded at once (16 Mi bytes of uint8 temporaries)


def decode_bitmask(bits: torch.Tensor, out: torch.Tensor, *, num_tokens: int) -> torch.Tensor:
    """Write each bitmask row's set token indices (ascending, then -1) into ``out`` and return it.

    Args:
        bits: uint8 ``[..., ceil(num_tokens/8)]``; bits for tokens >= num_tokens are ignored.
        out: int32 ``[..., width]`` with bits' leading shape (any strides); every element is written.
        num_tokens: S.
    Returns:
        ``out``. A row with more than ``width`` set tokens keeps its first ``width`` (the cache never makes one).
    """
    width = out.shape[-1]
    rows = bits.reshape(-1, bits.shape[-1])
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    token = torch.arange(rows.shape[1] * 8, device=bits.device)
    step = max(1, _CHUNK_BITS // max(1, rows.shape[1] * 8))
    result = torch.full((rows.shape[0], width), -1, dtype=torch.int32, device=bits.device)
    for r0 in range(0, rows.shape[0], step):
        chunk = rows[r0 : r0 + step]
        on = ((chunk.unsqueeze(-1) >> shifts) & 1).bool().reshape(chunk.shape[0], -1) & (token < num_tokens)
        # stable sort puts set tokens first, in ascending order
        order = torch.sort((~on).to(torch.int8), dim=-1, stable=True).indices[:, :width]
        n = min(width, order.shape[1])
        picked = torch.where(torch.gather(on, 1, order), order, -1)
        result[r0 : r0 + step, :n] = picked.to(torch.int32)
    out.copy_(result.reshape(out.shape))
    return out
