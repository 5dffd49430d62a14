"""The metadata cache: query groups, KV indices and residual per (layer, branch), refreshed at anchor
steps and read at reuse steps (MC-Sparse sec. 3.5), with byte accounting.

Entries are keyed by ``CacheKey``, never by batch position: the branch is the conditioning's uuid
(cond/uncond), the window names a context window, and the shape keeps a resolution change from reusing
a stale entry.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch


@dataclass
class CacheEntry:
    """What an anchor step leaves for the reuse steps of one (layer, branch).

    Attributes:
        perm: int32 ``[B, H, G*C]`` query groups (docs/architecture.md).
        kv_idx: int32 ``[B, H, G, K_alloc]`` each group's selected KV tokens, sorted, -1 = masked slot.
        residual: ``[B, H, S, D]`` O_dense - O_sparse at the anchor step (config.residual_dtype), or None
            when the residual is off.
        num_keys: K, the selected tokens per group.
        shape: the ``[B, H, S, D]`` shape of the q it was made for.
    """

    perm: torch.Tensor
    kv_idx: torch.Tensor
    residual: torch.Tensor | None
    num_keys: int
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Bytes held on the device (indices + residual)."""
        tensors = (self.perm, self.kv_idx, self.residual)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def fits(self, q: torch.Tensor) -> bool:
        """True when this entry was made for q's shape on q's device."""
        return tuple(q.shape) == self.shape and q.device == self.perm.device


@dataclass(frozen=True)
class CacheKey:
    """Identity of one cache entry.

    Attributes:
        layer: transformer block index (>= 0).
        branch: the conditioning branch, e.g. ComfyUI's ``transformer_options["uuids"]`` entry (cond/uncond).
        window: context-window identity, or None.
        shape: the ``[B, H, S, D]`` shape of the q the entry serves.
        kind: which call inside a block (e.g. "self", "vace"), for blocks that attend more than once.
    """

    layer: int
    branch: Hashable = 0
    window: Hashable = None
    shape: tuple[int, ...] = ()
    kind: str = "self"


class MetadataCache:
    """Cache entries of one sampling run, with current and peak bytes.

    Not thread-safe; one instance per sampler call (ComfyUI: created by the OUTER_SAMPLE wrapper).
    """

    def __init__(self):
        self._entries: dict[CacheKey, CacheEntry] = {}
        self.nbytes = 0
        self.peak_bytes = 0

    def get(self, key: CacheKey) -> CacheEntry | None:
        """The entry for ``key``, or None."""
        return self._entries.get(key)

    def put(self, key: CacheKey, entry: CacheEntry) -> None:
        """Store (or replace) the entry for ``key``."""
        old = self._entries.pop(key, None)
        if old is not None:
            self.nbytes -= old.nbytes
        self._entries[key] = entry
        self.nbytes += entry.nbytes
        self.peak_bytes = max(self.peak_bytes, self.nbytes)

    def clear(self) -> None:
        """Drop every entry (frees the tensors unless referenced elsewhere)."""
        self._entries.clear()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)
