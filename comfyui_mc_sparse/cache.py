"""The metadata cache: query groups, KV indices and residual per (layer, branch), refreshed at anchor
steps and read at reuse steps (MC-Sparse sec. 3.5), stored compactly, placed on the GPU or in pinned CPU
memory, with byte accounting.

Entries are keyed by ``CacheKey``, never by batch position: the branch is the conditioning's uuid
(cond/uncond), the window names a context window, and the shape keeps a resolution change from reusing
a stale entry.

Storage (``encoding``): an anchor step's ``CacheEntry`` (int32 groups and indices, residual) becomes a
``StoredEntry``: bitmask or 16-bit selections (bit-exact), 16/17-bit groups, residual in bf16, fp8 or 4-bit
(+ row scales). A reuse step decodes it back to a ``CacheEntry`` just before the sparse kernel (the residual
stays in its stored form: the kernel's epilogue reads it).

Placement (``MCSparseConfig.cache_placement``, the paper's "cache offload", sec. 4):
- "gpu": entries on the compute device; an entry that would leave less than a small margin of free GPU
  memory goes to CPU memory instead (counted, and said in the summary), never an out-of-memory error;
- "cpu": entries in pinned CPU memory (``cudaHostRegister`` on plain CPU tensors, so the bytes are exact and
  returned at ``clear``; pageable memory when CUDA is absent or pinning fails);
- "auto": decided before sampling by ``memory.plan_cache`` (GPU when the whole cache, its working set and the
  headroom fit the free GPU memory, else pinned CPU memory within the pin budget; ``fix_placement``); without a
  plan it decides per entry, spilling to CPU.
Never more than ``pin_budget_bytes`` of host memory is page-locked (``memory.pin_budget``): past it, pageable.
Free memory comes from ``free_memory_fn(device)`` (the ComfyUI adapter can pass one that subtracts what the
model still needs) or ``torch.cuda.mem_get_info``.

Reading entries at reuse steps (decode, prefetch on a side CUDA stream in the order calls arrive) is
``prefetch.ReuseLoader``'s job. Entries record when their bytes are ready (``StoredEntry.ready``); host buffers
remember the events of their last copies and are not rewritten or unpinned before those complete.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch

from .config import CACHE_PLACEMENTS
from .encoding import (
    EncodedGroups,
    EncodedResidual,
    EncodedSelection,
    decode_groups,
    decode_selection,
    encode_groups,
    encode_residual,
    encode_selection,
    residual_for_kernel,
)

log = logging.getLogger(__name__)

PLACEMENTS = CACHE_PLACEMENTS  # one source: config
_GPU_MARGIN = 256 << 20  # bytes 'gpu' placement always leaves free (decode temporaries, allocator slack)
_ALIGN = 256  # byte alignment of each tensor inside a host buffer (any dtype's element size divides it)

FreeMemoryFn = Callable[[torch.device], int]


@dataclass
class CacheEntry:
    """What an anchor step leaves for the reuse steps of one (layer, branch), decoded (what kernels take).

    Attributes:
        perm: int32 ``[B, H, G*C]`` query groups (docs/architecture.md).
        kv_idx: int32 ``[B, H, G, K_alloc]`` each group's selected KV tokens, sorted, -1 = masked slot.
        residual: O_dense - O_sparse at the anchor step, or None when the residual is off: a ``[B, H, S, D]``
            tensor as the anchor made it (float32 when the storage quantises, which ``encode_entry`` does), or,
            decoded from storage, the ``kernels.Residual`` the sparse kernel takes (``encoding``).
        num_keys: K, the selected tokens per group.
        shape: the ``[B, H, S, D]`` shape of the q it was made for.
        checked: perm and kv_idx come straight from ``kernels.pddp_groups`` / ``kernels.select_kv`` (their layout
            contract holds), so ``encode_entry`` stores them without checking (no device-to-host sync).
    """

    perm: torch.Tensor
    kv_idx: torch.Tensor
    residual: torch.Tensor | None
    num_keys: int
    shape: tuple[int, ...]
    checked: bool = False

    @property
    def nbytes(self) -> int:
        """Bytes held on the device (indices + residual)."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def fits(self, q: torch.Tensor) -> bool:
        """True when this entry was made for q's shape on q's device."""
        return tuple(q.shape) == self.shape and q.device == self.perm.device

    def tensors(self) -> list[torch.Tensor]:
        r = self.residual
        parts = [r] if isinstance(r, torch.Tensor) else [] if r is None else r.tensors()
        return [self.perm, self.kv_idx, *parts]


@dataclass
class StoredEntry:
    """A ``CacheEntry`` in compact storage (``encoding``), on the GPU or in CPU memory.

    Attributes:
        groups, selection, residual: the encoded parts (residual None when off).
        num_keys: K. shape: ``[B, H, S, D]`` of the q it serves.
        ready: CUDA event after which the tensors hold their values (None: ready now).
    """

    groups: EncodedGroups
    selection: EncodedSelection
    residual: EncodedResidual | None
    num_keys: int
    shape: tuple[int, ...]
    ready: torch.cuda.Event | None = None
    host: _HostBuffer | None = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        """Bytes of the stored (encoded) tensors."""
        return self.groups.nbytes + self.selection.nbytes + (self.residual.nbytes if self.residual else 0)

    @property
    def device(self) -> torch.device:
        return self.groups.data.device

    def fits(self, q: torch.Tensor) -> bool:
        """True when this entry was made for q's shape (it is decoded onto q's device)."""
        return tuple(q.shape) == self.shape

    def tensors(self) -> list[torch.Tensor]:
        return self.groups.tensors() + [self.selection.data] + (self.residual.tensors() if self.residual else [])

    def _with_tensors(self, new: list[torch.Tensor]) -> StoredEntry:
        it = iter(new)
        groups = self.groups.with_tensors(it)
        sel = self.selection
        selection = EncodedSelection(sel.kind, next(it), sel.num_tokens, sel.num_keys, sel.width)
        residual = None if self.residual is None else self.residual.with_tensors(it)
        return StoredEntry(groups, selection, residual, self.num_keys, self.shape)

    def to_device(self, device: torch.device, *, non_blocking: bool = False) -> StoredEntry:
        """The encoded tensors copied to ``device`` (all copies first, so a side stream's copies are not queued
        behind decode kernels waiting for SMs); self when already there."""
        if self.device == device:
            return self
        return self._with_tensors([t.to(device, non_blocking=non_blocking) for t in self.tensors()])

    def decode(self, device: torch.device, *, non_blocking: bool = False) -> CacheEntry:
        """The ``CacheEntry`` on ``device``: bit-exact int32 groups and selections, the residual in its stored
        form as a ``kernels.Residual`` (not dequantised).

        Runs on the current stream; ``non_blocking`` copies from pinned memory asynchronously.
        """
        staged = self.to_device(device, non_blocking=non_blocking)
        perm = decode_groups(staged.groups)
        kv_idx = decode_selection(staged.selection)
        residual = None if staged.residual is None else residual_for_kernel(staged.residual)
        return CacheEntry(perm, kv_idx, residual, self.num_keys, self.shape)


def encode_entry(entry: CacheEntry, *, index_encoding: str = "auto", residual_dtype: str = "bfloat16") -> StoredEntry:
    """Compact ``entry`` on its own device (see ``encoding`` for the formats; one device sync to check rows, none
    for an anchor's own ``checked`` entry).

    Args: index_encoding: as in ``MCSparseConfig``. residual_dtype: a storage name of
        ``encoding.RESIDUAL_FORMATS`` (already resolved: not "auto").
    Raises: ValueError for malformed tensors or unknown names.
    """
    S = entry.shape[2]
    residual = None
    if entry.residual is not None:
        residual = encode_residual(entry.residual, residual_dtype, entry.perm, entry.kv_idx.shape[2])
    return StoredEntry(
        groups=encode_groups(entry.perm, S, checked=entry.checked),
        selection=encode_selection(entry.kv_idx, S, entry.num_keys, index_encoding, checked=entry.checked),
        residual=residual,
        num_keys=entry.num_keys,
        shape=entry.shape,
    )


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


class _HostBuffer:
    """One entry's bytes in CPU memory: a plain uint8 tensor, page-locked with ``cudaHostRegister`` when CUDA
    is available (exact size, unlike the power-of-two caching host allocator; unlocked on ``release``); where
    registering fails, torch's pinned allocator; pageable when that fails too."""

    def __init__(self, nbytes: int, pin: bool):
        self.data = torch.empty(nbytes, dtype=torch.uint8)
        self.events: list[torch.cuda.Event] = []  # copies reading or writing these bytes, newest last
        self.pinned = self.registered = False
        if pin and nbytes:
            try:
                err = torch.cuda.cudart().cudaHostRegister(self.data.data_ptr(), nbytes, 1)  # 1: portable
                self.pinned = self.registered = int(err) == 0
            except (RuntimeError, AttributeError, TypeError) as exc:  # no cudart binding
                log.debug("cudaHostRegister unavailable: %s", exc)
            if not self.pinned:
                try:  # torch's caching host allocator (sizes rounded up to a power of two, kept by torch)
                    self.data = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
                    self.pinned = True
                except RuntimeError as exc:
                    log.debug("pinned allocation failed, staying pageable: %s", exc)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def view(self, offset: int, like: torch.Tensor) -> torch.Tensor:
        n = like.numel() * like.element_size()
        return self.data[offset : offset + n].view(like.dtype).view(like.shape)

    def used(self, event: torch.cuda.Event | None) -> None:
        if event is not None:
            self.events = self.events[-1:] + [event]

    def wait_on(self, stream) -> None:
        """Make ``stream`` wait until every recorded copy of these bytes is done (before rewriting them)."""
        for ev in self.events:
            stream.wait_event(ev)
        self.events.clear()

    def release(self) -> None:
        """Wait for the last copies, then unlock the pages (idempotent)."""
        for ev in self.events:
            ev.synchronize()
        self.events.clear()
        if self.registered:
            self.registered = self.pinned = False
            torch.cuda.cudart().cudaHostUnregister(self.data.data_ptr())

    def __del__(self):
        try:
            self.release()
        except Exception:  # interpreter shutdown: CUDA may be gone already
            pass


def _layout(tensors: list[torch.Tensor]) -> tuple[list[int], int]:
    offsets, pos = [], 0
    for t in tensors:
        offsets.append(pos)
        pos += -(-(t.numel() * t.element_size()) // _ALIGN) * _ALIGN
    return offsets, pos


class MetadataCache:
    """Cache entries of one sampling run, with placement and current / peak bytes.

    Args:
        placement: "gpu" (default), "cpu" or "auto" (module docstring).
        headroom_bytes: GPU bytes 'auto' leaves free for the model. free_memory_fn: ``device -> bytes`` the
            cache may still use there (None: ``torch.cuda.mem_get_info``).
        pin_budget_bytes: host bytes the cache may page-lock (``memory.pin_budget``); past it host buffers stay
            pageable (noted). None: no limit (no plan was made).
    Decided up front by ``MCSparseRunner.plan`` through ``fix_placement``; without it 'auto' decides per entry.
    Attributes:
        nbytes, peak_bytes: stored bytes now / at most. gpu_bytes, host_bytes: of which on a GPU / in CPU
        memory (a CPU-only run counts its entries as host). moved: entries put in CPU memory because GPU memory
        was short. notes: events for the run summary.
    Not thread-safe; one instance per sampler call (ComfyUI: created by the OUTER_SAMPLE wrapper).
    """

    def __init__(self, placement: str = "gpu", *, headroom_bytes: int = 0, free_memory_fn: FreeMemoryFn | None = None,
                 pin_budget_bytes: int | None = None):
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
        self.placement = placement
        self.headroom_bytes = headroom_bytes
        self.free_memory_fn = free_memory_fn
        self.pin_budget_bytes = pin_budget_bytes
        self.pinned_bytes = 0
        self._entries: dict[CacheKey, CacheEntry | StoredEntry] = {}
        self._auto_choice: str | None = None
        self.nbytes = self.peak_bytes = 0
        self.gpu_bytes = self.host_bytes = self.peak_gpu_bytes = self.peak_host_bytes = 0
        self.moved = 0
        self.notes: list[str] = []

    # --- queries ---------------------------------------------------------------------------------------------

    def get(self, key: CacheKey) -> CacheEntry | StoredEntry | None:
        """The entry for ``key`` as stored, or None."""
        return self._entries.get(key)

    def peek(self, key: CacheKey, device: torch.device, dtype: torch.dtype | None = None) -> CacheEntry | None:
        """The entry for ``key`` decoded on ``device`` (``dtype`` unused: the residual stays in its stored form),
        or None; read-only (for diagnostics and tests)."""
        stored = self._entries.get(key)
        if stored is None or isinstance(stored, CacheEntry):
            return stored
        return stored.decode(device)

    def __len__(self) -> int:
        return len(self._entries)

    def free_bytes(self, device: torch.device) -> int | None:
        """Bytes the cache may still use on ``device`` (None for non-CUDA devices)."""
        if device.type != "cuda":
            return None
        if self.free_memory_fn is not None:
            return int(self.free_memory_fn(device))
        return torch.cuda.mem_get_info(device)[0]

    # --- store -----------------------------------------------------------------------------------------------

    def put(self, key: CacheKey, entry: CacheEntry | StoredEntry) -> None:
        """Store (or replace) the entry for ``key``. A ``StoredEntry`` on a CUDA device is placed per
        ``placement`` (copied to CPU memory when so decided); a ``CacheEntry`` is kept as given.

        Raises: MemoryError / torch.cuda.OutOfMemoryError when even CPU memory cannot hold it.
        """
        old = self._entries.pop(key, None)
        if old is not None:
            self._account(old, -1)
        reusable = old.host if isinstance(old, StoredEntry) else None
        if isinstance(entry, StoredEntry) and entry.device.type == "cuda":
            old_gpu = old.nbytes if old is not None and _on_gpu(old) else 0
            if self._choose(entry, old_gpu) == "cpu":
                entry = self._to_host(entry, reusable)
                reusable = None if entry.host is reusable else reusable
            else:
                entry.ready = _record(entry.device)
        if reusable is not None:
            self._release(reusable)
        self._entries[key] = entry
        self._account(entry, +1)

    def fix_placement(self, choice: str) -> None:
        """Where 'auto' puts every entry from now on ("gpu" or "cpu"), decided before sampling
        (``memory.plan_cache``); the per-entry checks of ``put`` still move an entry that would not fit."""
        if choice not in ("gpu", "cpu"):
            raise ValueError(f"choice must be 'gpu' or 'cpu', got {choice!r}")
        self._auto_choice = choice

    def decide(self, device: torch.device) -> str:
        """Where new entries for ``device`` go as things stand: "gpu" or "cpu" ('auto' without a fixed choice:
        "gpu", with the per-entry checks of ``put``)."""
        if device.type != "cuda" or self.placement == "cpu":
            return "cpu"
        if self.placement == "gpu":
            return "gpu"
        return self._auto_choice or "gpu"

    def _choose(self, entry: StoredEntry, old_gpu: int) -> str:
        if self.decide(entry.device) == "cpu":
            return "cpu"
        free = self.free_bytes(entry.device) + old_gpu
        if self.placement == "gpu":
            if entry.nbytes + _GPU_MARGIN <= free:
                return "gpu"
            self._spill(f"cache placement gpu: GPU memory short ({free / 2**30:.2f} GiB free), entries moved to CPU memory")
            return "cpu"
        if entry.nbytes + self.headroom_bytes <= free:
            return "gpu"
        self._spill(f"cache placement auto: GPU memory short ({free / 2**30:.2f} GiB free, "
                    f"{self.headroom_bytes / 2**30:.1f} GiB headroom), entries moved to CPU memory")
        return "cpu"

    def _release(self, buf: _HostBuffer) -> None:
        if buf.pinned:
            self.pinned_bytes -= buf.nbytes
        buf.release()

    def _once(self, note: str) -> None:
        if note not in self.notes:
            self.notes.append(note)
            log.warning("MC-Sparse: %s", note)

    def _spill(self, note: str) -> None:
        self.moved += 1
        if note not in self.notes:
            self.notes.append(note)
            log.warning("MC-Sparse: %s", note)

    def _to_host(self, entry: StoredEntry, reusable: _HostBuffer | None) -> StoredEntry:
        tensors = entry.tensors()
        offsets, total = _layout(tensors)
        pin = torch.cuda.is_available()
        if reusable is not None and reusable.nbytes == total:
            buf = reusable
            buf.wait_on(torch.cuda.current_stream(entry.device))  # earlier prefetches must finish reading it
        else:
            if pin and self.pin_budget_bytes is not None and self.pinned_bytes + total > self.pin_budget_bytes:
                pin = False  # never page-lock more than the plan's share of the host's available memory
                self._once(f"host memory: the pin budget ({self.pin_budget_bytes / 2**30:.2f} GiB) is used up; "
                           "further entries stay pageable (copies are synchronous, slower)")
            buf = _HostBuffer(total, pin)
            if pin and not buf.pinned:
                self._once("CPU cache memory could not be pinned: copies are synchronous (slower)")
            self.pinned_bytes += total if buf.pinned else 0
        host = [buf.view(off, t) for off, t in zip(offsets, tensors)]
        for dst, src in zip(host, tensors):
            dst.copy_(src, non_blocking=buf.pinned)
        stored = entry._with_tensors(host)
        stored.host = buf
        stored.ready = _record(entry.device)
        buf.used(stored.ready)
        return stored

    def _account(self, entry, sign: int) -> None:
        n = sign * entry.nbytes
        self.nbytes += n
        if _on_gpu(entry):
            self.gpu_bytes += n
        else:
            self.host_bytes += n
        self.peak_bytes = max(self.peak_bytes, self.nbytes)
        self.peak_gpu_bytes = max(self.peak_gpu_bytes, self.gpu_bytes)
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)

    # --- free ------------------------------------------------------------------------------------------------

    def clear(self) -> None:
        """Drop every entry, unpinning CPU buffers once their copies are done."""
        for entry in self._entries.values():
            if isinstance(entry, StoredEntry) and entry.host is not None:
                self._release(entry.host)
        self._entries.clear()
        self.nbytes = self.gpu_bytes = self.host_bytes = 0
        self._auto_choice = None


def _on_gpu(entry) -> bool:
    tensor = entry.perm if isinstance(entry, CacheEntry) else entry.groups.data
    return tensor.device.type == "cuda"


def _record(device: torch.device) -> torch.cuda.Event | None:
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event
