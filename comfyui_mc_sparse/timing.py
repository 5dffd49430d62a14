"""The one timer of the pack: attention call times by step kind and call shape, without a device sync per call.

On CUDA each call records a pair of events on the current stream; pairs the device has finished are read while the
run goes on (a non-blocking query at each later ``stop``, host work the device does not wait for while it is busy),
the rest when the times are asked for (end of a run); elsewhere the wall clock. ``engine.MCSparseRunner`` owns one per
run; the adapter times its dense warm-up calls with the same one.
"""

from __future__ import annotations

import time
from collections import deque

import torch


class CallTimer:
    """Milliseconds of calls, grouped by ``(kind, shape)``; ``kind`` is a step kind name ("dense", "anchor",
    "reuse"), ``shape`` the call's ``(H, S, D)``; each value is divided by the call's batch (ms per batch item).

    Attributes:
        drain: pairs read per ``stop`` at most, oldest first, when the device has finished them (0: all are read
            at the end by ``times``, one blocking read of every pair of the run).
    """

    DRAIN = 2
    """Default ``drain``: two per call keeps the pending pairs of a run near the few the device has not reached."""

    def __init__(self, drain: int | None = None):
        self._pending: deque[tuple] = deque()
        self._ms: dict[tuple[str, tuple], list[float]] = {}
        self.drain = self.DRAIN if drain is None else int(drain)

    def start(self, device: torch.device):
        """A start mark on ``device``: a recorded CUDA event, or a perf_counter value."""
        if device.type == "cuda":
            return self._event(device), device
        return time.perf_counter()

    def stop(self, start, kind: str, shape: tuple, per: int = 1) -> None:
        """Record the time since ``start`` (from ``start``) divided by ``per`` under ``(kind, shape)``."""
        per = max(1, int(per))
        if isinstance(start, float):
            self._ms.setdefault((kind, tuple(shape)), []).append((time.perf_counter() - start) * 1000.0 / per)
            return
        event, device = start
        self._pending.append((event, self._event(device), kind, tuple(shape), per))
        for _ in range(min(self.drain, len(self._pending) - 1)):  # never the pair just recorded
            if not self._pending[0][1].query():  # the oldest pair is not finished: neither are later ones
                break
            self._read(self._pending.popleft())

    def times(self, kind: str) -> dict[tuple, list[float]]:
        """``{shape: [ms per batch item, ...]}`` of the calls of ``kind`` so far (waits for pending CUDA events)."""
        if self._pending:
            self._pending[-1][1].synchronize()
            for pair in self._pending:
                self._read(pair)
            self._pending.clear()
        return {shape: list(ms) for (k, shape), ms in self._ms.items() if k == kind}

    @property
    def pending(self) -> int:
        """Pairs recorded and not read yet."""
        return len(self._pending)

    @staticmethod
    def _event(device: torch.device) -> torch.cuda.Event:
        """A timing event recorded on ``device``'s current stream."""
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(device))
        return event

    def _read(self, pair: tuple) -> None:
        start, end, k, shape, per = pair
        self._ms.setdefault((k, shape), []).append(start.elapsed_time(end) / per)
