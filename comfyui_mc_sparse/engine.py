"""One sampling run of MC-Sparse: the schedule, the metadata cache and the run statistics.

``MCSparseRunner.attention`` is the single entry the ComfyUI adapter and the demo call for each
self-attention call: it picks dense / anchor / reuse from the schedule (``schedule.step_kind``), keeps
the cache, and counts what ran and why, for the end-of-run summary. Nothing is lost on a bad call:
non-finite inputs, a missing cache entry, or an out-of-memory error fall back to dense attention and the
summary says so.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .. import kernels
from .attention import NonFiniteInputError, anchor_attention, check_inputs, ineligible_reason, reuse_attention
from .cache import CacheKey, MetadataCache
from .config import MCSparseConfig
from .schedule import StepKind, step_kind

log = logging.getLogger(__name__)

DenseFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class RunStats:
    """Counts and measured times of one run.

    Attributes:
        calls: StepKind -> calls that ran as that kind.
        dense_reasons: reason -> dense calls (warm-up, ineligible input, fallbacks).
        anchors: anchor steps taken (step indices, in order of first use).
        time_ms: StepKind -> attention milliseconds measured (device-synchronised only when timing is on).
        time_calls: StepKind -> calls included in time_ms.
        notes: one-off events worth a line in the summary (fallbacks, OOM).
    """

    calls: Counter = field(default_factory=Counter)
    dense_reasons: Counter = field(default_factory=Counter)
    anchors: list[int] = field(default_factory=list)
    time_ms: Counter = field(default_factory=Counter)
    time_calls: Counter = field(default_factory=Counter)
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
        measure_time: synchronise around each call and record its time per step kind (for the summary's
            "attention time saved"); costs one device sync per call on GPUs.
    """

    def __init__(self, config: MCSparseConfig, *, backend: str = "auto", measure_time: bool = False):
        self.config = config
        self.backend = backend
        self.measure_time = measure_time
        self.cache = MetadataCache()
        self.stats = RunStats()
        self.disabled_reason: str | None = None
        self._dense_ms_by_shape: dict[tuple, list[float]] = {}
        self._reuse_ms_by_shape: dict[tuple, list[float]] = {}

    def record_dense(self, reason: str) -> None:
        """Count a call that the caller ran densely itself (e.g. cross-attention, a masked call)."""
        self.stats.calls[StepKind.DENSE] += 1
        self.stats.dense_reasons[reason] += 1

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        step: int,
        layer: int,
        key: CacheKey,
        dense_fn: DenseFn | None = None,
        scale: float | None = None,
    ) -> torch.Tensor:
        """Self-attention for one layer call at 0-based ``step``.

        Args:
            q, k, v: ``[B, H, S, D]``. key: the cache entry's identity (layer, branch, window, shape).
            dense_fn: ``(q, k, v) -> [B, H, S, D]`` for dense calls (e.g. ComfyUI's own attention); None
                uses ``kernels.dense_attention``.
            scale: softmax scale, None = 1/sqrt(D) (dense_fn must use the same).
        Returns:
            ``[B, H, S, D]`` in q's dtype.
        """
        dense = dense_fn or (lambda q_, k_, v_: kernels.dense_attention(q_, k_, v_, scale=scale, backend=self.backend))
        if self.disabled_reason is not None:
            return self._dense(dense, q, k, v, self.disabled_reason)
        reason = ineligible_reason(q, k, v)
        if reason is not None:
            return self._dense(dense, q, k, v, reason)
        kind = step_kind(self.config, step, layer)
        if kind is StepKind.DENSE:
            why = "dense warm-up layer" if layer < self.config.warmup_layers else "dense warm-up step"
            return self._dense(dense, q, k, v, why, timed_shape=tuple(q.shape))
        entry = self.cache.get(key) if kind is StepKind.REUSE else None
        if kind is StepKind.REUSE and (entry is None or not entry.fits(q)):
            self._note(f"late anchor at step {step}: no cache entry for this layer/branch/shape (anchor step skipped?)")
            kind = StepKind.ANCHOR
        try:
            start = self._tic()
            if kind is StepKind.ANCHOR:
                out, entry = anchor_attention(q, k, v, self.config, scale=scale, backend=self.backend)
                self.cache.put(key, entry)
                if step not in self.stats.anchors:
                    self.stats.anchors.append(step)
            else:
                check_inputs(q, k, v, check_finite=False)
                out = reuse_attention(q, k, v, entry, scale=scale, backend=self.backend)
            self._toc(kind, start, tuple(q.shape))
        except NonFiniteInputError as err:
            return self._dense(dense, q, k, v, f"non-finite input ({err})")
        except torch.cuda.OutOfMemoryError as err:
            self.cache.clear()
            self.disabled_reason = "out of GPU memory; dense for the rest of the run"
            self._note(
                f"out of memory at step {step}, layer {layer} ({err}); the cache was freed and the rest of this run is "
                "dense. Lower the density, set cache placement to cpu, or reduce resolution/frames to fit."
            )
            log.warning("MC-Sparse: %s", self.stats.notes[-1])
            return self._dense(dense, q, k, v, self.disabled_reason)
        self.stats.calls[kind] += 1
        return out

    def close(self) -> None:
        """Free the cache (the run is over)."""
        self.cache.clear()

    def summary(self) -> str:
        """The end-of-run summary: calls per kind, dense reasons, anchors, cache memory, time saved."""
        s = self.stats
        total = sum(s.calls.values())
        lines = [
            f"MC-Sparse run summary: {total} attention calls: {s.calls[StepKind.REUSE]} sparse (reuse), "
            f"{s.calls[StepKind.ANCHOR]} anchor, {s.calls[StepKind.DENSE]} dense; density {self.config.density:g}, "
            f"C={self.config.group_size}"
        ]
        for reason, n in s.dense_reasons.most_common():
            lines.append(f"  dense x{n}: {reason}")
        lines.append(f"  anchor steps taken: {', '.join(map(str, s.anchors)) or 'none'}")
        lines.append(f"  metadata cache: peak {self.cache.peak_bytes / 2**20:.1f} MiB")
        choices = kernels.registry.last_choices()
        if choices:
            lines.append("  kernels: " + ", ".join(f"{op}={c.backend}" for op, c in sorted(choices.items())))
            missing = [f"{b.name} ({b.unavailable_reason})" for b in kernels.registry.backends() if b.unavailable_reason]
            if missing:
                lines.append("  kernel backends not available: " + "; ".join(missing))
            lines.extend(f"  kernel fallback: {b} failed on {op}: {err}" for (b, op), err in kernels.registry.failures().items())
        saved = self.time_saved_ms()
        if saved is not None:
            lines.append(f"  attention time saved (measured): {saved / 1000:.2f} s")
        lines.extend(f"  note: {n}" for n in s.notes)
        if total and not s.sparse_calls:
            lines.append("  WARNING: no attention call went sparse in this run: MC-Sparse gave no speedup")
        return "\n".join(lines)

    def time_saved_ms(self) -> float | None:
        """Reuse calls x (mean dense time - mean reuse time) per shape, from measured calls; None if unmeasured."""
        saved, any_pair = 0.0, False
        for shape, reuse in self._reuse_ms_by_shape.items():
            dense = self._dense_ms_by_shape.get(shape)
            if dense:
                any_pair = True
                saved += len(reuse) * (sum(dense) / len(dense)) - sum(reuse)
        return saved if any_pair else None

    def _dense(self, dense: DenseFn, q, k, v, reason: str, timed_shape: tuple | None = None) -> torch.Tensor:
        start = self._tic()
        out = dense(q, k, v)
        if timed_shape is not None:
            self._toc(StepKind.DENSE, start, timed_shape)
        self.record_dense(reason)
        return out

    def _note(self, text: str) -> None:
        if text not in self.stats.notes:
            self.stats.notes.append(text)

    def _tic(self) -> float | None:
        if not self.measure_time:
            return None
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()

    def _toc(self, kind: StepKind, start: float | None, shape: tuple) -> None:
        if start is None:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        ms = (time.perf_counter() - start) * 1000
        self.stats.time_ms[kind] += ms
        self.stats.time_calls[kind] += 1
        if kind is StepKind.DENSE:
            self._dense_ms_by_shape.setdefault(shape, []).append(ms)
        elif kind is StepKind.REUSE:
            self._reuse_ms_by_shape.setdefault(shape, []).append(ms)
