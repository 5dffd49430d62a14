"""One sampling run of MC-Sparse: the schedule, the metadata cache and the run statistics.

``MCSparseRunner.attention`` is the single entry the ComfyUI adapter and the demo call for each
self-attention call: it picks dense / anchor / reuse from the schedule (``schedule.step_kind``), keeps
the cache, and counts what ran and why, for the end-of-run summary. Nothing is lost on a bad call:
non-finite inputs, a missing cache entry, an out-of-memory error or an unexpected error in the sparse path (a bug:
logged with its traceback) fall back to dense attention and the summary says so.

One call serves a whole batch: ``keys`` names one cache entry per conditioning chunk of the batch (ComfyUI's CFG
batch holds uncond and cond), and at a reuse step the entries of all chunks are decoded into one stacked batch and
one sparse-kernel launch serves them all, writing into the caller's ``out`` (a strided view of ComfyUI's output
layout) with the residual added in the kernel's epilogue. Nothing on the reuse path reads a device value on the
host: the step comes from the caller, finiteness is checked at anchor steps only, and calls are timed by CUDA events
read at the end of the run (``timing.CallTimer``).

Cache (``cache``, ``encoding``): anchor entries are stored compactly and placed per ``config.cache_placement``.
Prefetch (``prefetch``): the order in which calls arrive is learned from the calls themselves (``CallOrder``), and
after a reuse call's kernel is queued the entries of the call predicted next are copied and decoded on a side CUDA
stream (``ReuseLoader``) while this one computes. ``plan`` gives the memory and speed estimate before sampling
(``memory``). Out of memory anywhere in the pack's path frees the cache, logs what would fit and turns the rest of
the run dense.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from .. import kernels
from . import memory
from .attention import NonFiniteInputError, anchor_attention, check_inputs, ineligible_reason, reuse_attention
from .cache import CacheKey, FreeMemoryFn, MetadataCache, encode_entry
from .config import MCSparseConfig
from .prefetch import CallOrder, ReuseLoader
from .schedule import StepKind, step_kind
from .timing import CallTimer

log = logging.getLogger(__name__)

DenseFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class RunStats:
    """Counts and measured times of one run.

    Attributes:
        calls: StepKind -> calls that ran as that kind.
        dense_reasons: reason -> dense calls (warm-up, ineligible input, fallbacks).
        anchors: anchor steps taken (0-based step indices, in order of first use; the summary prints them 1-based).
        notes: one-off events worth a line in the summary (fallbacks, OOM).
    """

    calls: Counter = field(default_factory=Counter)
    dense_reasons: Counter = field(default_factory=Counter)
    anchors: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def sparse_calls(self) -> int:
        """Calls that ran the sparse path (reuse steps)."""
        return self.calls[StepKind.REUSE]


class MCSparseRunner:
    """MC-Sparse state for one sampler call.

    Args:
        config: the validated settings.
        backend: kernel backend name ("auto", "torch", "triton", ...), see ``kernels.registry``.
        free_memory_fn: ``torch.device -> int``, the GPU bytes the cache may still take on that device
            (called before storing each anchor entry on a GPU, and by ``plan``). None: free device memory
            (``torch.cuda.mem_get_info``). The ComfyUI adapter passes one built on
            ``comfy.model_management.get_free_memory`` minus what the model still needs, so the cache never
            takes memory ComfyUI has counted on.
        host_memory_fn: ``() -> memory.HostMemory | None``, the host's available memory (``plan`` keeps pinned
            memory within ``memory.pin_budget`` of it); default psutil / ``/proc/meminfo``.
    Attributes:
        residual_dtype: the residual storage in use ("auto" resolved: bf16 until ``plan`` decides).
        cache_plan: ``memory.CachePlan`` from ``plan`` (None before). disabled_reason: why every call is dense
            (the cache fits nowhere, or an out-of-memory error), else None.
    """

    def __init__(self, config: MCSparseConfig, *, backend: str = "auto", free_memory_fn: FreeMemoryFn | None = None,
                 host_memory_fn: Callable[[], memory.HostMemory | None] = memory.host_memory):
        self.config = config
        self.host_memory_fn = host_memory_fn
        # 'auto' stores bf16 until plan() decides from the free memory
        self.residual_dtype = "bfloat16" if config.residual_dtype == "auto" else config.residual_dtype
        self._anchor_config = replace(config, residual_dtype=self.residual_dtype)
        self.backend = backend
        self.cache = MetadataCache(config.cache_placement, headroom_bytes=int(config.cache_headroom_gib * memory.GIB),
                                   free_memory_fn=free_memory_fn)
        self.stats = RunStats()
        self.disabled_reason: str | None = None
        self.cache_plan: memory.CachePlan | None = None
        self.plan_line: str | None = None
        self._plan: memory.CacheEstimate | None = None
        self.speed: memory.SpeedupEstimate | None = None
        self.timer = CallTimer()  # anchor, reuse and timed dense calls of this run
        self.kernels = kernels.registry.Record()  # which backend ran each op in this run, and which failed
        self.order = CallOrder()  # the order calls arrive in, learned (prefetch)
        self.loader = ReuseLoader(self.cache)
        self._entry_step: dict[CacheKey, int] = {}  # step at which each entry was stored
        self.sparse_shapes: set[tuple] = set()  # q shapes of this run's sparse kernel calls (summary: kernel per shape)
        self._device: torch.device | None = None  # of the latest reuse call (begin_evaluation prefetches there)
        self._dtype: torch.dtype | None = None

    def plan(self, *, heads: int, head_dim: int, layers: int, tokens: int, branches: int = 2, batch: int = 1,
             num_steps: int | None = None, attention_share: float | None = None,
             kernel_efficiency: float = memory.DEFAULT_KERNEL_EFFICIENCY, device: torch.device | None = None,
             model_heads: int | None = None) -> str:
        """Decide the residual precision and the cache placement from the free memory (``memory.plan_cache``),
        estimate the cache and the speedup; log it (info, or a warning when the run must stay dense) and keep it
        for the summary. Call before sampling.

        Args:
            heads, head_dim: H, D of the self-attention (H: the heads this runner caches). layers: transformer
                blocks. tokens: S per call. model_heads: the model's H when this runner holds a share of the heads
                (raylight's Ulysses ranks; None: ``heads``), for the attention-share calibration.
            branches: cached conditioning branches (2 with CFG). batch: B per runner call.
            num_steps: the sampler call's steps (None: no speedup estimate). attention_share: self-attention's
                share of a dense step (None: ``memory.attention_share``). kernel_efficiency: sparse kernel's
                fraction of the ideal 1/s speedup. device: the compute device (None: the current CUDA device when
                there is one); on a CUDA device the GPU's free memory (``free_memory_fn``) and the host's
                (``host_memory_fn``) decide; elsewhere the device's memory does not constrain the cache, and
                placement "cpu" (pinned host memory, which needs CUDA) does not fit: the run stays dense and the
                plan line names placement auto / gpu as what would fit.
        Returns:
            The log line (``memory.format_plan``). When nothing fits, every later call is dense and the line
            says why and which settings would fit.
        """
        if device is None and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        on_gpu = device is not None and device.type == "cuda"
        plan = memory.plan_cache(self.config, heads=heads, head_dim=head_dim, layers=layers, tokens=tokens,
                                 branches=branches, batch=batch, gpu_free=self.cache.free_bytes(device) if on_gpu else None,
                                 host=self.host_memory_fn() if on_gpu else None)
        self.cache_plan = plan
        est = plan.estimate or plan.options[next(iter(plan.options))]
        if plan.dense:
            self.disabled_reason = "the metadata cache fits in no memory (see the plan line)"
        else:
            self.residual_dtype = plan.residual_dtype
            self._anchor_config = replace(self.config, residual_dtype=plan.residual_dtype)
            if on_gpu:
                self.cache.pin_budget_bytes = plan.host_budget
                if self.config.cache_placement == "auto":
                    self.cache.fix_placement(plan.placement)
                self.loader.keep_budget_bytes = keep_budget(plan)
        speed = None
        if num_steps is not None and not plan.dense:
            calibrated = True
            if attention_share is None:
                attention_share, calibrated = memory.attention_share(model_heads or heads, head_dim, tokens)
            speed = memory.expected_speedup(self.config, num_steps=num_steps, num_layers=layers,
                                            attention_share=attention_share, kernel_efficiency=kernel_efficiency,
                                            overhead=memory.decode_overhead(est), calibrated=calibrated)
        self._plan = est
        self.speed = speed
        placement = None if plan.dense or not on_gpu else self.config.cache_placement
        self.plan_line = memory.format_plan(est, speed, placement, plan if on_gpu or plan.dense else None)
        if plan.dense:
            log.warning("%s", self.plan_line)
            self._note(f"dense run: {plan.describe()}")
        else:
            log.info("%s", self.plan_line)
        return self.plan_line

    def record_dense(self, reason: str) -> None:
        """Count a call that the caller ran densely itself (e.g. cross-attention, a masked call)."""
        self.stats.calls[StepKind.DENSE] += 1
        self.stats.dense_reasons[reason] += 1

    def begin_evaluation(self, step: int) -> None:
        """A model evaluation at 0-based ``step`` starts (the ComfyUI adapter calls this once per evaluation): at a
        reuse step, start fetching the entries its first call is expected to read (the prefetch queued after the
        previous evaluation's last call may have guessed otherwise, and after an anchor step there was none)."""
        first = self.order.begin_evaluation()
        if self.disabled_reason is not None or self._device is None:
            return
        if step_kind(self.config, step, self.config.warmup_layers) is StepKind.REUSE:
            try:  # outside any attention call: a bug here must not lose the run either
                self._prefetch(first)
            except Exception as err:
                if not contains(err):
                    raise
                self.internal_error(err, f"the prefetch starting step {step + 1} (1-based)")

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
        """``call(q, k, v, **kwargs)``'s output only (``[B, H, S, D]`` in q's dtype, ``out`` when given)."""
        return self.call(q, k, v, **kwargs)[0]

    def call(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        step: int,
        layer: int,
        key: CacheKey | None = None,
        keys: Sequence[CacheKey] | None = None,
        dense_fn: DenseFn | None = None,
        scale: float | None = None,
        extra_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, StepKind]:
        """Self-attention for one layer call at 0-based ``step``, and the kind of call that ran.

        Args:
            q, k, v: ``[B, H, S, D]``, any strides (e.g. views of ComfyUI's ``[B, S, H*D]``).
            key: the cache entry's identity (layer, branch, window, shape) when the batch is one conditioning chunk;
                or ``keys``: one key per conditioning chunk, in batch order (B splits into ``len(keys)`` equal
                chunks). Exactly one of the two.
            dense_fn: ``(q, k, v) -> [B, H, S, D]`` for dense calls (e.g. ComfyUI's own attention); None
                uses ``kernels.dense_attention``. With ``extra_kv`` it receives the concatenated keys and values.
            scale: softmax scale, None = 1/sqrt(D) (dense_fn must use the same).
            extra_kv: optional (k_x, v_x) ``[B, H, T, D]`` that every query attends exactly besides its selected
                keys (e.g. text tokens of a joint sequence); see ``attention.anchor_attention``.
            out: optional ``[B, H, S, D]`` tensor in q's dtype, any strides (a view of the caller's output buffer):
                the result is written there (by the sparse kernel itself at reuse steps) and returned.
        Returns:
            (``[B, H, S, D]`` in q's dtype (``out`` when given), the ``StepKind`` that ran: DENSE for a dense call
            (warm-up or fallback); when the conditioning chunks ran different kinds, ANCHOR if any chunk anchored,
            else REUSE if any reused).
        Raises:
            ValueError: both or neither of key/keys, keys not distinct, or a batch that does not split into the
                keys' chunks.
        """
        with kernels.registry.recording(self.kernels):
            return self._call(q, k, v, step=step, layer=layer, group=_group(key, keys, q), dense_fn=dense_fn,
                              scale=scale, extra_kv=extra_kv, out=out)

    def _call(self, q, k, v, *, step, layer, group, dense_fn, scale, extra_kv, out) -> tuple[torch.Tensor, StepKind]:
        dense_call = dense_fn or (lambda q_, k_, v_: kernels.dense_attention(q_, k_, v_, scale=scale, backend=self.backend))
        if extra_kv is None:
            dense = dense_call
        else:

            def dense(q_, k_, v_, x=extra_kv):
                return dense_call(q_, torch.cat([k_, x[0]], 2), torch.cat([v_, x[1]], 2))

        if self.disabled_reason is not None:
            return _into(out, self._dense(dense, q, k, v, self.disabled_reason)), StepKind.DENSE
        reason = ineligible_reason(q, k, v)
        if reason is not None:
            return _into(out, self._dense(dense, q, k, v, reason)), StepKind.DENSE
        kind = step_kind(self.config, step, layer)
        if kind is StepKind.DENSE:
            why = "dense warm-up layer" if layer < self.config.warmup_layers else "dense warm-up step"
            return _into(out, self._dense(dense, q, k, v, why, timed_shape=tuple(q.shape))), StepKind.DENSE
        b = q.shape[0] // len(group)
        chunk_shape = (b, *q.shape[1:])
        kinds = [self._chunk_kind(kind, key_, chunk_shape, step) for key_ in group]
        try:
            start = self._tic(q.device)
            if all(k_ is StepKind.REUSE for k_ in kinds):
                result = self._reuse(q, k, v, group, scale=scale, extra_kv=extra_kv, out=out)
                self._toc(StepKind.REUSE, start, tuple(q.shape))
                self.stats.calls[StepKind.REUSE] += len(group)
                return result, StepKind.REUSE
            result = self._per_chunk(q, k, v, group, kinds, step=step, dense=dense, scale=scale, extra_kv=extra_kv,
                                     out=out)
            if kind is StepKind.ANCHOR:
                self.order.anchor_call(group, step)  # the anchor step's call order: the first guess for reuse steps
            ran = next((k_ for k_ in (StepKind.ANCHOR, StepKind.REUSE) if k_ in kinds), StepKind.DENSE)
            return result, ran
        except NonFiniteInputError as err:
            return _into(out, self._dense(dense, q, k, v, f"non-finite input ({err})")), StepKind.DENSE
        except (Exception, MemoryError) as err:  # MemoryError is an Exception; named for the reader
            if kernels.registry.is_out_of_memory(err):
                self._out_of_memory(err, step, layer, q)
            elif not contains(err):
                raise
            else:  # a bug in the sparse path must not lose the user's run
                self.internal_error(err, f"step {step + 1} (1-based), block {layer}")
            return _into(out, self._dense(dense, q, k, v, self.disabled_reason)), StepKind.DENSE

    def _chunk_kind(self, kind: StepKind, key: CacheKey, shape: tuple, step: int) -> StepKind | str:
        """What one conditioning chunk runs at an anchor/reuse step: the step's kind, ANCHOR for a reuse chunk
        without a fresh entry (a late anchor), or a dense reason (str)."""
        stored = self.cache.get(key)
        fresh = stored is not None and tuple(stored.shape) == tuple(shape)
        if kind is StepKind.ANCHOR and fresh and self._entry_step.get(key) == step:
            # heun / dpm_2 style samplers evaluate the model twice at one step: one anchor is enough
            return "anchor step evaluated again by the sampler (dense, first anchor kept)"
        if kind is StepKind.REUSE and not fresh:
            if key.window is not None:  # a window the anchor step did not see will not be seen again either
                return "context window not seen at the anchor step (moving windows run dense)"
            self._note(f"late anchor at step {step + 1} (1-based): no cache entry for this layer/branch/shape "
                       "(the anchor step was skipped, e.g. by a step-caching node)")
            return StepKind.ANCHOR
        return kind

    def _reuse(self, q, k, v, group: tuple[CacheKey, ...], *, scale, extra_kv, out) -> torch.Tensor:
        """Reuse call over the whole batch: one stacked load of the group's entries, one kernel launch, then the
        prefetch of the group expected next (queued after this call's kernel, so the side stream overlaps it)."""
        check_inputs(q, k, v, check_finite=False)
        self.order.observe(group)
        self._device, self._dtype = q.device, q.dtype
        self.sparse_shapes.add(tuple(q.shape))
        batch = self.loader.load(group, q.device, q.dtype)
        result = reuse_attention(q, k, v, batch, scale=scale, backend=self.backend, extra_kv=extra_kv, out=out)
        del batch
        self._prefetch(self.order.predict(group))
        return result

    def _per_chunk(self, q, k, v, group, kinds, *, step: int, dense, scale, extra_kv, out) -> torch.Tensor:
        """Each conditioning chunk on its own (an anchor step, or chunks of different kinds): anchor, reuse or dense."""
        b = q.shape[0] // len(group)
        result = out if out is not None else torch.empty_like(q, memory_format=torch.contiguous_format)
        for i, (key, kind) in enumerate(zip(group, kinds)):
            rows = slice(i * b, (i + 1) * b)
            qc, kc, vc = q[rows], k[rows], v[rows]
            xc = None if extra_kv is None else (extra_kv[0][rows], extra_kv[1][rows])
            if isinstance(kind, str):
                result[rows] = self._dense(dense if xc is None else _with_extra(dense, xc), qc, kc, vc, kind)
            elif kind is StepKind.ANCHOR:
                self._device, self._dtype = q.device, q.dtype
                self.sparse_shapes.add(tuple(qc.shape))
                start = self._tic(qc.device)
                o, entry = anchor_attention(qc, kc, vc, self._anchor_config, scale=scale, backend=self.backend,
                                            extra_kv=xc)
                self._store(key, entry, step)
                if step in self.config.anchor_steps and step not in self.stats.anchors:
                    self.stats.anchors.append(step)
                result[rows] = o
                self._toc(kind, start, tuple(qc.shape))
                self.stats.calls[kind] += 1
            else:
                start = self._tic(qc.device)
                self._reuse(qc, kc, vc, (key,), scale=scale, extra_kv=xc, out=result[rows])
                self._toc(kind, start, tuple(qc.shape))
                self.stats.calls[kind] += 1
        return result

    def _store(self, key: CacheKey, entry, step: int) -> None:
        """Encode and place an anchor entry."""
        stored = encode_entry(entry, index_encoding=self.config.index_encoding, residual_dtype=self.residual_dtype)
        del entry
        self.loader.clear()  # a prefetched copy of an older entry is stale
        self.cache.put(key, stored)
        self._entry_step[key] = step

    def _prefetch(self, group) -> None:
        """Start fetching ``group`` (a failure only costs speed)."""
        if group is None or self._device is None:
            return
        try:
            self.loader.prefetch(group, self._device, self._dtype)
        except torch.cuda.OutOfMemoryError:
            self._note("a prefetch ran out of GPU memory and was skipped (entries are then decoded in line)")

    def _out_of_memory(self, err: BaseException, step: int, layer: int, q: torch.Tensor) -> None:
        """Free the cache, turn the rest of the run dense, and say what would have fit."""
        entries = self._plan.entries if self._plan is not None else max(len(self.cache), 1)
        self.loader.clear()
        self.cache.clear()
        self._entry_step.clear()
        self.order.clear()
        if q.device.type == "cuda":
            torch.cuda.empty_cache()  # hand the freed cache back, so ComfyUI sees it free
        free = self.cache.free_bytes(q.device)
        c = self.config
        est = memory.estimate_cache(
            heads=q.shape[1], head_dim=q.shape[3], layers=entries, tokens=q.shape[2], batch=q.shape[0], branches=1,
            density=c.density, group_size=c.group_size, kv_tile=c.kv_tile, index_encoding=c.index_encoding,
            residual_dtype=self.residual_dtype, residual=c.residual,
        )
        fits = memory.suggest_settings(c, tuple(q.shape), entries, free,
                                       self.host_memory_fn() if q.device.type == "cuda" else None)
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        self.disabled_reason = "out of memory; dense for the rest of the run"
        self._note(
            f"out of memory at step {step + 1} (1-based), block {layer} ({first}); the cache was freed and the rest of "
            f"this run is dense. This cache needs ~{est.total_bytes / memory.GIB:.2f} GiB for {entries} entries of q "
            f"{list(q.shape)} (placement {c.cache_placement}, residual {self.residual_dtype})"
            + (f"; {free / memory.GIB:.2f} GiB of GPU memory free now" if free is not None else "")
            + ". Settings that would fit: " + "; ".join(fits) + "."
        )
        log.warning("MC-Sparse: %s", self.stats.notes[-1])

    def internal_error(self, err: BaseException, where: str) -> None:
        """An unexpected error in the pack's attention path (a bug, not the user's input) at ``where`` (e.g. "step 3
        (1-based), block 5"): log it with its traceback, free the cache and turn the rest of the run dense; the
        summary says so. The caller then runs the call dense."""
        log.error("MC-Sparse: internal error at %s; the rest of this run is dense", where, exc_info=err)
        self.loader.clear()
        self.cache.clear()
        self._entry_step.clear()
        self.order.clear()
        first = str(err).strip().splitlines()[0][:300] if str(err).strip() else ""
        self.disabled_reason = "internal error; dense for the rest of the run"
        self._note(f"internal error at {where} ({type(err).__name__}: {first}); the cache was freed and the rest of "
                   f"this run is dense (please report it with the console log)")

    def close(self) -> None:
        """Free the cache (the run is over): GPU tensors, pinned CPU buffers, prefetches."""
        self.loader.clear()
        self.cache.clear()
        self._entry_step.clear()
        self.order.clear()

    def dense_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None):
        """Exact attention through this run's kernel backends (``kernels.dense_attention``), not counted as a call:
        q ``[B, H, T, D]``, k and v ``[B, H, S, D]`` -> ``[B, H, T, D]`` in q's dtype (e.g. a joint model's text rows)."""
        with kernels.registry.recording(self.kernels):
            return kernels.dense_attention(q, k, v, scale=scale, backend=self.backend)

    def summary(self) -> str:
        """The end-of-run summary of a runner used on its own (the demo): a header with the call counts, then
        ``summary_lines``. The ComfyUI adapter writes its own header (``adapter.summary``)."""
        s = self.stats
        head = (f"MC-Sparse run summary: {s.calls[StepKind.REUSE]} sparse (reuse), {s.calls[StepKind.ANCHOR]} anchor, "
                f"{s.calls[StepKind.DENSE]} dense attention calls; density {self.config.density:g}, "
                f"C={self.config.group_size}")
        lines = [head, *("  " + line for line in self.summary_lines())]
        if sum(s.calls.values()) and not s.sparse_calls:
            lines.append("  WARNING: no attention call went sparse in this run: MC-Sparse gave no speedup")
        return "\n".join(lines)

    def summary_lines(self) -> list[str]:
        """Detail lines (no header, no indent): dense reasons, anchors taken, cache, kernels that ran and fallbacks,
        measured attention time, notes. The plan line is logged once before sampling, not repeated here."""
        s = self.stats
        lines = [f"dense x{n}: {reason}" for reason, n in s.dense_reasons.most_common()]
        taken = ", ".join(str(step + 1) for step in s.anchors)  # 1-based, as ComfyUI's progress bar counts
        lines.append(f"anchor steps taken (1-based): {taken or 'none'}")
        lines.extend(self._cache_lines())
        choices = self.kernels.choices
        if choices:
            lines.append("kernels: " + ", ".join(f"{op}={c.backend}" for op, c in sorted(choices.items())))
        if getattr(choices.get("sparse_attention"), "backend", None) == "triton":
            per_shape = triton_sparse_choices(self)
            if per_shape:
                lines.append("sparse kernel (triton backend) per call shape: " + "; ".join(per_shape))
        lines.extend(f"kernel fallback: {b} failed on {op} in this run: {err}"
                     for (b, op), err in self.kernels.failures.items())
        timing = attention_time_line(self.timer)
        if timing:
            lines.append(timing)
        lines.extend(f"note: {n}" for n in s.notes)
        return lines

    def cache_where(self) -> str:
        """Where the cache lived at its peak, in a few words ("GPU 12.0 MiB", "CPU memory 1.20 GiB", ...)."""
        c = self.cache
        parts = [f"{name} {_size(n)}" for name, n in (("GPU", c.peak_gpu_bytes), ("CPU memory", c.peak_host_bytes)) if n]
        return " + ".join(parts) if parts else "empty"

    def _cache_lines(self) -> list[str]:
        c, cfg = self.cache, self.config
        res = "off" if not cfg.residual else self.residual_dtype + (
            " (row scale)" if self.residual_dtype in ("float8_e4m3fn", "int4") else
            " (group mean + row scale)" if self.residual_dtype == "int4_group" else "")
        line = (f"metadata cache: peak {self.cache_where()}, placement {cfg.cache_placement}, selections "
                f"{cfg.index_encoding}, residual {res}")
        ld = self.loader
        if ld.hits or ld.misses:
            line += (f"; reuse loads: {ld.hits} prefetched, {ld.misses} in line (prefetch hit rate "
                     f"{ld.hit_rate:.1%})")
        if ld.kept_loads:
            line += (f", {ld.kept_loads} from decoded batches kept on the GPU (peak {_size(ld.peak_kept_bytes)} of int32 "
                     "groups and indices, within the plan's budget)")
        if c.moved:
            line += f"; {c.moved} entries moved to CPU memory (GPU memory short)"
        return [line, *(f"note: {n}" for n in c.notes)]

    def _dense(self, dense: DenseFn, q, k, v, reason: str, timed_shape: tuple | None = None) -> torch.Tensor:
        start = self._tic(q.device) if timed_shape is not None else None
        out = dense(q, k, v)
        if timed_shape is not None:
            self._toc(StepKind.DENSE, start, timed_shape)
        self.record_dense(reason)
        return out

    def _note(self, text: str) -> None:
        if text not in self.stats.notes:
            self.stats.notes.append(text)

    def _tic(self, device: torch.device):
        """A start mark of the run's timer (a CUDA event on ``device``, no sync; the wall clock elsewhere)."""
        return self.timer.start(device)

    def _toc(self, kind: StepKind, start, shape: tuple) -> None:
        """Record the call of ``shape`` ``(B, H, S, D)`` since ``start`` under ``kind`` (ms per batch item)."""
        self.timer.stop(start, kind.value, tuple(shape[1:]), shape[0])


def keep_budget(plan: memory.CachePlan) -> int:
    """int32 bytes the reuse loader may keep decoded on the GPU for the run (``prefetch`` module docstring): every
    entry's decoded groups and indices when the cache is on the GPU and cache + working set + those bytes take at most
    half of the plan's GPU budget beyond the headroom (the other half stays for the model's activations); else 0."""
    est = plan.estimate
    if plan.dense or est is None or plan.placement != "gpu" or plan.gpu_budget is None:
        return 0
    kept = est.entries * max(0, est.working_bytes // 2 - est.residual_bytes)
    if est.total_bytes + est.working_bytes + kept > (plan.gpu_budget - plan.headroom) // 2:
        return 0
    return kept


RAISE_ERRORS_ENV = "MC_SPARSE_RAISE_ERRORS"
"""Environment variable: "1" makes an unexpected error in the sparse path propagate instead of turning the run dense
(tests/conftest.py sets it, so a bug fails its test instead of hiding behind the dense fallback)."""


CALLER_ERROR_ATTR = "mc_sparse_caller_error"
"""Attribute the adapter sets on an exception raised by the caller's own attention (ComfyUI's): never contained,
since running that attention again would only fail again."""


def contains(err: BaseException) -> bool:
    """Whether an unexpected error in the pack's attention path is turned into a dense fallback (True) or propagates:
    it propagates with ``RAISE_ERRORS_ENV`` = "1", for ComfyUI's interrupt, and when the caller's own attention
    raised it (``CALLER_ERROR_ATTR``)."""
    return not (os.environ.get(RAISE_ERRORS_ENV) == "1" or type(err).__name__ == "InterruptProcessingException"
                or getattr(err, CALLER_ERROR_ATTR, False))


def _group(key: CacheKey | None, keys: Sequence[CacheKey] | None, q: torch.Tensor) -> tuple[CacheKey, ...]:
    if (key is None) == (keys is None):
        raise ValueError("give exactly one of key (one conditioning chunk) and keys (one per chunk)")
    group = (key,) if keys is None else tuple(keys)
    if not group or q.shape[0] % len(group):
        raise ValueError(f"the batch of {q.shape[0]} must split into {len(group)} equal conditioning chunks (keys)")
    if len(set(group)) < len(group):
        raise ValueError(f"keys must be distinct (one cache entry per conditioning chunk), got {group}")
    return group


def _into(out: torch.Tensor | None, result: torch.Tensor) -> torch.Tensor:
    """``result`` written into ``out`` when given (the caller's buffer), else ``result``."""
    if out is None or out is result:
        return result
    return out.copy_(result)


def _with_extra(dense, chunk_extra):
    """The dense closure bound to one chunk's extra keys (``dense`` defaults to the whole batch's)."""
    return lambda q_, k_, v_: dense(q_, k_, v_, chunk_extra)


def _size(n: int) -> str:
    return f"{n / memory.GIB:.2f} GiB" if n >= memory.GIB // 10 else f"{n / 2**20:.1f} MiB"


def triton_sparse_choices(runner: MCSparseRunner) -> list[str]:
    """Which kernel the Triton backend's sparse op ran for each q shape of ``runner``'s sparse calls, as its auto mode
    measured it (``kernels/triton/sparse_dispatch.py``: ``choices`` a Gluon schedule name, ``_times`` ms per
    candidate): "[B, H, S, D], residual plain gluon plain (plain 3.100, pingpong 3.000, triton 3.500 ms)";
    "gluon (forced: MC_SPARSE_GLUON)", "triton (forced: ...)", "triton (the Gluon kernel failed in this run)" or
    "triton (Gluon not timed: refused or not sm_90)". Empty when that module was never imported (no Triton sparse
    call in this process). Reads the dispatch module's state; never imports it."""
    import sys

    dispatch = sys.modules.get(f"{kernels.__name__}.triton.sparse_dispatch")
    if dispatch is None:
        return []
    mode = dispatch.gluon_mode()
    choices = getattr(dispatch, "choices", {})
    times = getattr(dispatch, "_times", {})
    failed = runner.kernels.failures.get(getattr(dispatch, "GLUON_KEY", None))
    lines = []
    for shape in sorted(runner.sparse_shapes):
        name = "[" + ", ".join(map(str, shape)) + "]"
        if failed is not None:
            lines.append(f"{name} triton (the Gluon kernel failed in this run)")
        elif mode != "auto":
            lines.append(f"{name} {'gluon' if mode == 'on' else 'triton'} (forced: MC_SPARSE_GLUON)")
        else:
            keys = [key for key in choices if tuple(key[2]) == shape]
            if not keys:
                lines.append(f"{name} triton (Gluon not timed: refused or not sm_90)")
            for key in keys:
                t = times.get(key)
                extra = (" (" + ", ".join(f"{n} {ms:.3f}" for n, ms in t.items()) + " ms)") if isinstance(t, dict) else ""
                lse = ", LSE" if key[-1] else ""
                res = f", residual {key[-2]}" if key[-2] else ""
                chosen = choices[key] if choices[key] == "triton" else f"gluon {choices[key]}"
                lines.append(f"{name}{res}{lse} {chosen}{extra}")
    return lines


MIN_DENSE_SAMPLES = 3
"""Dense calls of a shape needed before the summary compares measured times with them."""


def attention_time_line(timer: CallTimer) -> str | None:
    """What the anchor and reuse calls cost against the same calls run dense, both as measured in this run.

    Per call shape ``(H, S, D)`` with at least ``MIN_DENSE_SAMPLES`` timed dense calls (the dense warm-up): the
    anchor + reuse calls' measured time, against their number x the mean dense call time of that shape. Anchors
    count (they cost more than a dense call). None when nothing can be compared. Times are ms per batch item.
    """
    dense, anchor, reuse = timer.times("dense"), timer.times("anchor"), timer.times("reuse")
    spent = replaced = 0.0
    calls = samples = 0
    for shape in set(anchor) | set(reuse):
        base = dense.get(shape, [])
        if len(base) < MIN_DENSE_SAMPLES:
            continue
        mine = anchor.get(shape, []) + reuse.get(shape, [])
        spent += sum(mine)
        replaced += len(mine) * sum(base) / len(base)
        calls += len(mine)
        samples += len(base)
    if not calls:
        return None
    return (f"attention time (measured): {calls} anchor + reuse calls took {spent / 1000:.3f} s; the same calls dense "
            f"~{replaced / 1000:.3f} s (mean of {samples} dense warm-up calls of the same shape), "
            f"{'saving' if replaced >= spent else 'costing'} {abs(replaced - spent) / 1000:.3f} s")
