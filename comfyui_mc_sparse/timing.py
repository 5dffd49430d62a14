"""The one timer of the pack: attention call times by step kind and call shape, without a device sync per call.

On CUDA each call records a pair of events on the current stream, read once when the times are asked for (end
of a run); elsewhere the wall clock. ``engine.MCSparseRunner`` owns one per run; the adapter times its dense
warm-up calls with the same one.
"""

from __future__ import annotations

import time

import torch


class CallTimer:
    """Milliseconds of calls, grouped by ``(kind, shape)``; ``kind`` is a step kind name ("dense", "anchor",
    "reuse"), ``shape`` the call's ``(H, S, D)``; each value is divided by the call's batch (ms per batch item)."""

    def __init__(self):
        self._pending: list[tuple] = []
        self._ms: dict[tuple[str, tuple], list[float]] = {}

    def start(self, device: torch.device):
        """A start mark on ``device``: a recorded CUDA event, or a perf_counter value."""
        if device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(device))
            return event, device
        return time.perf_counter()

    def stop(self, start, kind: str, shape: tuple, per: int = 1) -> None:
        """Record the time since ``start`` (from ``start``) divided by ``per`` under ``(kind, shape)``."""
        per = max(1, int(per))
        if isinstance(start, float):
            self._ms.setdefault((kind, tuple(shape)), []).append((time.perf_counter() - start) * 1000.0 / per)
            return
        event, device = start
        end = torch.cuda.Event(enable_timing=True)
        end.record(torch.cuda.current_stream(device))
        self._pending.append((event, end, kind, tuple(shape), per))

    def times(self, kind: str) -> dict[tuple, list[float]]:
        """``{shape: [ms per batch item, ...]}`` of the calls of ``kind`` so far (waits for pending CUDA events)."""
        if self._pending:
            self._pending[-1][1].synchronize()
            for start, end, k, shape, per in self._pending:
                self._ms.setdefault((k, shape), []).append(start.elapsed_time(end) / per)
            self._pending.clear()
        return {shape: list(ms) for (k, shape), ms in self._ms.items() if k == kind}
