"""Reuse-step cache loads in the order the attention calls really arrive (issue 14, item 1).

One attention call reads a **group** of cache entries: one per conditioning chunk of its batch, in batch order
(``((block 3, uncond), (block 3, cond))`` when ComfyUI runs both CFG branches in one batch; ``((block 3, uncond),)``
when it splits the batch because memory is short, ``comfy/samplers.py`` L255-276: then every block runs for one
branch, then every block for the other). Context windows, VACE blocks and joint models change the order again.

``CallOrder`` learns the order from the calls themselves: every call group (anchor and reuse calls alike) is recorded
as the successor of the call before it, so after one evaluation in a batching mode the next call is known exactly;
an evaluation is expected to start the way the previous one did (ComfyUI decides the batching per evaluation, so
a switch costs one miss). Before a pair has been seen, the guess comes from the anchor step's order: the group
that followed at the anchor step, or, when the batching changed (anchor batched, reuse split, or the reverse), the
next block of the same lane (conditioning branch and context window), lanes in the order the anchor step met them.

``ReuseLoader`` decodes a group for the sparse kernel: int32 query groups and KV indices of all its entries stacked
into one batch (so one kernel launch serves both CFG branches), and the residual in its stored form as a
``kernels.Residual`` (the kernel adds it in its epilogue). ``prefetch`` does that on a side CUDA stream while the
current call computes, for the one group predicted next only (bounded: one group pending; a pending group that
is not the one asked for is dropped, never decoded further); ``load`` takes the pending group when it is the one
asked for (a hit) or decodes in line (a miss). Hits and misses are counted per entry for the run summary.
No host-device sync anywhere: events order the two streams, ``record_stream`` keeps the side stream's tensors
alive until the compute stream is done with them.

Decoded groups kept (``keep_budget_bytes``, set before sampling by ``MCSparseRunner.plan`` from the memory plan, 0 =
off): every reuse step reads the same entries (they change only at an anchor step), so when the plan's GPU budget
holds the cache, its working set AND the int32 groups and indices of every entry with half of it to spare (the rest
stays for the model's activations), a group whose entries live on the compute device is decoded once and its
``ReuseBatch`` kept until ``clear``: later reuse calls of it do no decode and no prefetch. Decided once from the plan,
never from the free memory read mid-run (8258d10 did that; the 14B 720p run then ran out of memory). With a view-
stacked residual (``_rebind``) keeping adds only the int32 tensors, which the budget counts.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from .. import kernels
from . import encoding
from .cache import CacheEntry, CacheKey, MetadataCache, StoredEntry
from .encoding import decode_groups, decode_selection

Group = tuple[CacheKey, ...]
"""The cache keys one attention call reads, in the order of its batch's conditioning chunks."""


def _lane(key: CacheKey) -> Hashable:
    """The sequence a key belongs to when calls run one conditioning branch at a time: branch and context window."""
    return (key.branch, key.window)


class CallOrder:
    """Learns which call group follows which (module docstring); pure bookkeeping, no tensors.

    Attributes:
        predictions, wrong: predictions handed out for a following call, and how many of them the call that came
            next did not match (for tests and the summary).
    """

    def __init__(self):
        self._succ: dict[Group, Group] = {}  # group -> the group seen right after it, latest
        self._last: Group | None = None  # the latest call group seen
        self._predicted: Group | None = None  # the latest prediction, checked against the next call
        self._eval_first: Group | None = None  # the first call group of the latest model evaluation
        self._at_eval_start = False
        self._anchor_step: int | None = None
        self._anchor_keys: list[CacheKey] = []  # keys in the order the latest anchor step stored them
        self._anchor_groups: list[Group] = []  # that step's call groups, in order
        self._anchor_group_index: dict[Group, int] = {}
        self._lanes: dict[Hashable, list[CacheKey]] = {}  # lane -> its keys in anchor order
        self._lane_pos: dict[CacheKey, tuple[Hashable, int]] = {}
        self._lane_order: list[Hashable] = []
        self.predictions = self.wrong = 0

    def anchor_call(self, group: Sequence[CacheKey], step: int) -> None:
        """An anchor call at ``step`` stored ``group``'s entries: record the anchor step's order (a new anchor step
        starts a new record) and learn the group as the successor of the call before it."""
        group = tuple(group)
        if step != self._anchor_step:
            self._anchor_step = step
            self._anchor_keys, self._anchor_groups, self._anchor_group_index = [], [], {}
            self._lanes, self._lane_pos, self._lane_order = {}, {}, []
        if group not in self._anchor_group_index:
            self._anchor_group_index[group] = len(self._anchor_groups)
            self._anchor_groups.append(group)
        for key in group:
            if key in self._lane_pos:
                continue
            lane = _lane(key)
            if lane not in self._lanes:
                self._lanes[lane] = []
                self._lane_order.append(lane)
            self._lane_pos[key] = (lane, len(self._lanes[lane]))
            self._lanes[lane].append(key)
            self._anchor_keys.append(key)
        self.observe(group)

    def observe(self, group: Sequence[CacheKey]) -> None:
        """A call reads (or stores) ``group`` now: it is the successor of the call before it."""
        group = tuple(group)
        if self._predicted is not None:
            self.predictions += 1
            self.wrong += self._predicted != group
            self._predicted = None
        if self._last is not None:
            self._succ[self._last] = group
        if self._at_eval_start:
            self._eval_first, self._at_eval_start = group, False
        self._last = group

    def begin_evaluation(self) -> Group | None:
        """A model evaluation starts: the group its first call is expected to read (the previous evaluation's first
        group; before there is one, the group predicted after the latest call); None when nothing is known."""
        self._at_eval_start = True
        if self._eval_first is not None:
            self._predicted = self._eval_first
            return self._eval_first
        return None if self._last is None else self.predict(self._last)

    def predict(self, group: Sequence[CacheKey]) -> Group | None:
        """The group expected right after ``group``: the one seen after it before, else the anchor step's guess
        (module docstring); None when nothing is known. The prediction is checked against the next ``observe``."""
        group = tuple(group)
        nxt = self._succ.get(group)
        if nxt is None:
            nxt = self._guess(group)
        self._predicted = nxt
        return nxt

    def _guess(self, group: Group) -> Group | None:
        i = self._anchor_group_index.get(group)
        if i is not None:  # same batching as at the anchor step: the anchor step's next call, cyclically
            return self._anchor_groups[(i + 1) % len(self._anchor_groups)]
        if not group or any(key not in self._lane_pos for key in group):
            return None
        # batching changed since the anchor step: each lane's next key; past a lane's end, the next lanes' first
        nxt = []
        for key in group:
            lane, pos = self._lane_pos[key]
            keys = self._lanes[lane]
            if pos + 1 < len(keys):
                nxt.append(keys[pos + 1])
            else:
                return self._first_of_next_lanes(group)
        return tuple(nxt)

    def _first_of_next_lanes(self, group: Group) -> Group:
        """The first keys of the ``len(group)`` lanes after the group's last lane (cyclically)."""
        last = max(self._lane_order.index(_lane(key)) for key in group)
        n = len(self._lane_order)
        lanes = [self._lane_order[(last + 1 + j) % n] for j in range(min(len(group), n))]
        return tuple(self._lanes[lane][0] for lane in lanes)

    def clear(self) -> None:
        """Forget everything (the cache was freed)."""
        self.__init__()


@dataclass
class ReuseBatch:
    """A call group's entries decoded for one sparse-kernel launch over the whole batch.

    Attributes:
        perm: int32 ``[B, H, G*C]``; kv_idx: int32 ``[B, H, G, K_alloc]`` (B = entries x batch per entry).
        residual: the residual in its stored form (``kernels.Residual``, stacked likewise), or None when off.
    """

    perm: torch.Tensor
    kv_idx: torch.Tensor
    residual: kernels.Residual | None

    def tensors(self) -> list[torch.Tensor]:
        r = self.residual
        return [self.perm, self.kv_idx] + ([] if r is None else r.tensors())


@dataclass
class _Pending:
    group: Group
    batch: ReuseBatch
    event: torch.cuda.Event | None
    device: torch.device


class ReuseLoader:
    """Decodes call groups from a ``MetadataCache`` for the reuse kernel, with a one-group prefetch (module docstring).

    Attributes:
        hits, misses: entries served by a prefetch / decoded in line. dropped: prefetched entries never used.
    Not thread-safe; one per runner.
    """

    def __init__(self, cache: MetadataCache):
        self.cache = cache
        self._pending: _Pending | None = None
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self.hits = self.misses = self.dropped = 0
        self.keep_budget_bytes = 0  # int32 bytes decoded batches may keep on the GPU in all (0: none; runner.plan)
        self._kept: dict[Group, tuple[torch.device, ReuseBatch]] = {}
        self.kept_bytes = self.peak_kept_bytes = 0
        self.kept_loads = 0  # entries served from a kept batch (neither prefetched nor decoded)

    @property
    def hit_rate(self) -> float | None:
        """Share of reuse-step entry loads served by a prefetch (None before any load)."""
        n = self.hits + self.misses
        return self.hits / n if n else None

    def load(self, group: Sequence[CacheKey], device: torch.device, dtype: torch.dtype) -> ReuseBatch:
        """The decoded entries of ``group`` on ``device`` (residual in its stored form; ``dtype`` is the compute dtype
        for entries kept undecoded), stacked in group order. The prefetched batch when it is this group (the current
        stream waits for it on the device), else decoded now on the current stream.

        Raises: KeyError when an entry is missing (callers check ``MetadataCache.get`` first).
        """
        group = tuple(group)
        kept = self._kept.get(group)
        if kept is not None and kept[0] == device:
            self.kept_loads += len(group)
            return kept[1]
        pending, self._pending = self._pending, None
        if pending is not None and pending.group == group and pending.device == device:
            if pending.event is not None:
                current = torch.cuda.current_stream(device)
                current.wait_event(pending.event)
                for t in pending.batch.tensors():
                    t.record_stream(current)  # made on the side stream, used (and freed) on this one
            self.hits += len(group)
            self._keep(group, pending.batch, device)
            return pending.batch
        if pending is not None:
            self.dropped += len(pending.group)
        self.misses += len(group)
        stored = self._stored(group)
        if device.type == "cuda":
            current = torch.cuda.current_stream(device)
            for s in stored:
                if isinstance(s, StoredEntry) and s.ready is not None:
                    current.wait_event(s.ready)
        batch = _decode_group(stored, device, dtype)
        _rebind(stored, batch, device)
        if device.type == "cuda":
            event = _record(device)
            for s in stored:
                if isinstance(s, StoredEntry) and s.host is not None:
                    s.host.used(event)
        self._keep(group, batch, device)
        return batch

    def prefetch(self, group: Sequence[CacheKey] | None, device: torch.device, dtype: torch.dtype) -> None:
        """Start decoding ``group`` on a side stream (synchronously without CUDA); replaces any other pending group.
        No-op for None, for the group already pending, or when an entry is missing."""
        if group is None:
            return
        group = tuple(group)
        if self._pending is not None and self._pending.group == group and self._pending.device == device:
            return
        kept = self._kept.get(group)
        if kept is not None and kept[0] == device:
            return
        stored = [self.cache.get(key) for key in group]
        if any(s is None for s in stored):
            return
        if self._pending is not None:
            self.dropped += len(self._pending.group)
            self._pending = None
        if device.type != "cuda":
            batch = _decode_group(stored, device, dtype)
            _rebind(stored, batch, device)
            self._pending = _Pending(group, batch, None, device)
            return
        side = self._streams.get(device)
        if side is None:
            # high priority: the small decode kernels get SMs as soon as any block of the layer's kernels retires
            side = self._streams[device] = torch.cuda.Stream(device, priority=-1)
        with torch.cuda.stream(side):
            for s in stored:
                if isinstance(s, StoredEntry):
                    if s.ready is not None:
                        side.wait_event(s.ready)
                    if s.host is None:
                        for t in s.tensors():
                            t.record_stream(side)  # read here: not to be reused before this stream is past it
            batch = _decode_group(stored, device, dtype)
            event = _record(device)
        _rebind(stored, batch, device)
        for s in stored:
            if isinstance(s, StoredEntry) and s.host is not None:
                s.host.used(event)
        self._pending = _Pending(group, batch, event, device)

    def clear(self) -> None:
        """Drop the pending group and the kept batches (the cache is being freed or replaced)."""
        self._pending = None
        self._kept.clear()
        self.kept_bytes = 0

    def _keep(self, group: Group, batch: ReuseBatch, device: torch.device) -> None:
        """Keep ``group``'s decoded batch for later reuse steps when every entry is stored on ``device`` and its int32
        groups and indices fit what is left of ``keep_budget_bytes``."""
        if not self.keep_budget_bytes or group in self._kept:
            return
        stored = [self.cache.get(key) for key in group]
        if not all(isinstance(s, StoredEntry) and s.host is None and s.device == device for s in stored):
            return
        if len(stored) > 1 and batch.residual is not None and \
                _adjacent([t for s in stored for t in s.residual.tensors()[:1]]) is None:
            return  # the residual is a per-call copy (not the entries' rows): keeping it would double its bytes
        extra = sum(t.numel() * t.element_size() for t in (batch.perm, batch.kv_idx))
        if self.kept_bytes + extra > self.keep_budget_bytes:
            return
        self._kept[group] = (device, batch)
        self.kept_bytes += extra
        self.peak_kept_bytes = max(self.peak_kept_bytes, self.kept_bytes)

    def _stored(self, group: Group) -> list:
        stored = [self.cache.get(key) for key in group]
        missing = [key for key, s in zip(group, stored) if s is None]
        if missing:
            raise KeyError(f"no cache entry for {missing}")
        return stored


STACK_VIEWS = True
"""Stacked residuals as views (``_rebind``): after the first stacked decode of a call group whose entries are stored
on the compute device, the entries' residuals are that batch's rows, so later decodes of the group take a view instead
of copying 2 x residual bytes per reuse call (at Wan2.1-1.3B 480p ~200 MB read + written on the side stream per call,
competing with the layer's kernels for memory bandwidth). Memory-neutral: the separate residual tensors are freed when
their rows take over (the per-call stacked copy today's decode allocates is the same size). False: copy every call
(the benchmark's ``--profile-reuse`` times both side by side)."""


def _rebind(stored: list, batch: ReuseBatch, device: torch.device) -> None:
    """After a stacked decode of ``stored`` (two or more entries, all ``StoredEntry`` kept on ``device``, residual
    tensors passed to the kernel as stored): make each entry's stored residual its rows of ``batch``'s stacked
    residual, so the next decode of the same group in the same order is a view (``_adjacent``), not a copy. No-op when
    ``STACK_VIEWS`` is off, when the batch already is such a view, or for any other entry form."""
    r = batch.residual
    if not STACK_VIEWS or r is None or len(stored) < 2:
        return
    if not all(isinstance(s, StoredEntry) and s.host is None and s.device == device and s.residual is not None
               for s in stored):
        return
    stacked = r.tensors()
    b = batch.perm.shape[0] // len(stored)
    for i, s in enumerate(stored):
        own = s.residual.tensors()
        if len(own) != len(stacked) or any(t.shape[1:] != u.shape[1:] or t.dtype != u.dtype or t.shape[0] != b
                                           for t, u in zip(own, stacked)):
            return  # the kernel's form is not the stored tensors one for one: leave the entries alone
        if any(t.data_ptr() == u[i * b:(i + 1) * b].data_ptr() for t, u in zip(own, stacked)):
            return  # already rows of this batch
    if device.type == "cuda":
        current = torch.cuda.current_stream(device)
        for t in stacked:
            t.record_stream(current)  # made on the prefetch stream, read by later calls on the compute stream
    for i, s in enumerate(stored):
        s.residual = s.residual.with_tensors(iter([u[i * b:(i + 1) * b] for u in stacked]))


def _adjacent(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """One tensor over ``parts`` (equal shapes and dtypes) when they are consecutive contiguous blocks of one storage,
    in order (rows of an earlier stacked decode, ``_rebind``): a view, no copy. None otherwise."""
    first = parts[0]
    if not all(t.is_contiguous() and t.dtype == first.dtype and t.shape == first.shape and t.device == first.device
               for t in parts):
        return None
    base = first.untyped_storage().data_ptr()
    step = first.numel() * first.element_size()
    for i, t in enumerate(parts):
        if t.untyped_storage().data_ptr() != base or t.data_ptr() != first.data_ptr() + i * step:
            return None
    return first.as_strided((len(parts) * first.shape[0], *first.shape[1:]), first.stride(), first.storage_offset())


def _decode_group(stored: list, device: torch.device, dtype: torch.dtype) -> ReuseBatch:
    """Decode entries (``StoredEntry`` or raw ``CacheEntry``) into one stacked ``ReuseBatch`` on the current stream:
    a single entry without any copy; several into preallocated stacked buffers, each decoded into its rows (the
    residual as a view when the entries' residuals already are consecutive rows of one tensor, ``_rebind``)."""
    if len(stored) == 1:
        return _decode_one(stored[0], device, dtype, None, None, None)
    first = _decode_shapes(stored[0])
    b = first["b"]
    n = len(stored)
    perm = torch.empty(n * b, *first["perm"], dtype=torch.int32, device=device)
    kv_idx = torch.empty(n * b, *first["kv"], dtype=torch.int32, device=device)
    residual, copy_residual = None, True
    if first["res"] is not None:  # the first entry's residual form, each of its tensors stacked n times
        like, parts = first["res"]
        views = None
        if STACK_VIEWS:
            here = [_residual_of(x) for x in stored]
            if all(r is not None and r.kind == like.kind and r.data.device == device and len(r.tensors()) == len(parts)
                   for r in here):
                views = [_adjacent([r.tensors()[j] for r in here]) for j in range(len(parts))]
        if views is not None and all(v is not None for v in views):
            residual, copy_residual = like.with_tensors(views), False
        else:
            residual = like.with_tensors(torch.empty(n * b, *shape, dtype=dt, device=device) for dt, shape in parts)
    for i, s in enumerate(stored):
        rows = slice(i * b, (i + 1) * b)
        _decode_one(s, device, dtype, perm[rows], kv_idx[rows],
                    None if residual is None or not copy_residual else [t[rows] for t in residual.tensors()])
    return ReuseBatch(perm, kv_idx, residual)


def _decode_shapes(s) -> dict:
    """Per-entry shapes of the decoded parts (without the batch dim) and the residual's stored form."""
    B, H, S, D = s.shape
    if isinstance(s, CacheEntry):
        perm_shape, kv_shape = tuple(s.perm.shape[1:]), tuple(s.kv_idx.shape[1:])
    else:  # every selection encoding keeps the group dim: data [B, H, G, ...]
        perm_shape, kv_shape = (H, s.groups.width), (H, s.selection.data.shape[2], s.selection.width)
    r = _residual_of(s)
    res = None
    if r is not None:
        res = (r, [(t.dtype, tuple(t.shape[1:])) for t in r.tensors()])
    return {"b": B, "perm": perm_shape, "kv": kv_shape, "res": res}


def _residual_of(s) -> kernels.Residual | None:
    """The residual of an entry as a ``kernels.Residual`` in its stored form (no data copied)."""
    if isinstance(s, CacheEntry):
        return _as_residual(s.residual)
    if s.residual is None:
        return None
    return _as_residual(s.residual)


def _as_residual(r) -> kernels.Residual | None:
    """``kernels.Residual`` of a stored or raw residual: a tensor (plain), a ``kernels.Residual`` (as is), or an
    ``encoding.EncodedResidual`` (plain data, or fp8 data with a per-row scale)."""
    if r is None or isinstance(r, kernels.Residual):
        return r
    if isinstance(r, torch.Tensor):
        return kernels.Residual(data=r, kind="plain")
    for_kernel = getattr(encoding, "residual_for_kernel", None)  # the storage module's own conversion, when it has one
    if for_kernel is not None:
        return for_kernel(r)
    if r.scale is None:
        return kernels.Residual(data=r.data, kind="plain")
    if r.scale.numel() == 1:  # one scale for the tensor: the kernel takes row scales
        return kernels.Residual(data=r.data, scale=r.scale.reshape(1, 1, 1).expand(r.data.shape[:3]), kind="fp8_row")
    return kernels.Residual(data=r.data, scale=r.scale.reshape(r.data.shape[:3]), kind="fp8_row")


def _decode_one(s, device: torch.device, dtype: torch.dtype, perm_out, kv_out, res_out) -> ReuseBatch:
    """Decode one entry on ``device``, into the given row views of stacked buffers, or into new tensors (None)."""
    if isinstance(s, CacheEntry):
        perm, kv_idx, residual = s.perm, s.kv_idx, _as_residual(s.residual)
        if perm.device != device:
            perm, kv_idx = perm.to(device), kv_idx.to(device)
    else:
        staged = s.to_device(device, non_blocking=s.host is not None and s.host.pinned)
        perm = decode_groups(staged.groups)
        kv_idx = _decode_selection(staged.selection, kv_out)
        residual = _residual_of(staged)
    if perm_out is not None:
        perm_out.copy_(perm)
        perm = perm_out
    if kv_out is not None and kv_idx is not kv_out:
        kv_out.copy_(kv_idx)
        kv_idx = kv_out
    if res_out is not None and residual is not None:
        for dst, src in zip(res_out, residual.tensors(), strict=True):
            dst.copy_(src)
    return ReuseBatch(perm, kv_idx, residual)


def _decode_selection(sel, out: torch.Tensor | None) -> torch.Tensor:
    """int32 KV indices of an encoded selection, written into ``out`` when given; a bitmask goes through the
    kernels' one-launch decode (no int64 intermediates, no host sync)."""
    if sel.kind == "bitmask":
        if out is None:
            return kernels.decode_bitmask(sel.data, num_tokens=sel.num_tokens, width=sel.width)
        return kernels.decode_bitmask(sel.data, num_tokens=sel.num_tokens, out=out)
    return decode_selection(sel)


def _record(device: torch.device) -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event
