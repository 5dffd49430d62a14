"""Backend registry: which implementation runs each op, and why.

A backend declares, as data, the ops it implements and a ``refuse(op, q) -> reason | None`` rule
(device, architecture, dtype, head dim, installed libraries). ``call`` picks the highest-priority
backend that accepts the call, or the one the user named, and falls back to the next one when the chosen
backend fails at run time. The torch reference accepts everything, so a call only fails when the inputs are
invalid or memory runs out.

What is remembered is per run, not per process: inside ``with recording(record):`` (the engine enters it around
each of its calls) the backend each op ran on and the backends that failed are kept in that ``Record``; a failed
backend is skipped for the rest of that run (logged once) and tried again by the next run. Out of memory is never
a backend failure: it propagates at once, to the caller's out-of-memory path (``is_out_of_memory``).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

log = logging.getLogger(__name__)


class NoCapableBackendError(RuntimeError):
    """No available backend accepts the call; the message lists every backend's reason."""


@dataclass(frozen=True)
class Backend:
    """One implementation family of the ops.

    Attributes:
        name: the dispatch key users pass as ``backend=`` (e.g. "torch", "triton", "flash_attn4").
        priority: higher runs first under ``backend="auto"``.
        ops: op name -> function with the reference's signature (``kernels/reference``).
        refuse: ``(op, q, requested) -> str | None``: why this backend cannot run that call (None = it
            can); ``requested`` is True when the caller named this backend (e.g. the Triton interpreter
            runs CPU tensors only when asked for by name).
        unavailable_reason: set when the backend's toolchain failed to import; the backend is then skipped.
    """

    name: str
    priority: int
    ops: Mapping[str, Callable] = field(default_factory=dict)
    refuse: Callable[[str, torch.Tensor, bool], str | None] = lambda op, q, requested: None
    unavailable_reason: str | None = None


@dataclass
class Choice:
    """The backend that ran an op, and the reason it was picked (shown in the run summary)."""

    backend: str
    reason: str


@dataclass
class Record:
    """What the kernel calls of one run did (see ``recording``).

    Attributes:
        choices: op -> the backend that ran it most recently in this run, with the reason.
        failures: (backend, op) -> the run-time error that made this run skip that backend for that op.
    """

    choices: dict[str, Choice] = field(default_factory=dict)
    failures: dict[tuple[str, str], str] = field(default_factory=dict)


_backends: dict[str, Backend] = {}
_RECORD: contextvars.ContextVar[Record | None] = contextvars.ContextVar("mc_sparse_kernel_record", default=None)


@contextlib.contextmanager
def recording(record: Record) -> Iterator[Record]:
    """Within the block, kernel calls (this thread / task) note their choices and failures in ``record``."""
    token = _RECORD.set(record)
    try:
        yield record
    finally:
        _RECORD.reset(token)


class FailureMemo:
    """A run-time failure of one kernel (``key``: (kernel, op), as in ``Record.failures``) remembered where its caller
    falls back to another kernel: in the active run's record inside ``recording`` (the next run tries again), else for
    the rest of the process. Used by the Triton backend's Gluon dispatches (kernels/triton/sparse_dispatch.py,
    kernels/triton/pass2_dispatch.py)."""

    def __init__(self, key: tuple[str, str]):
        self.key = key
        self._process: str | None = None

    def reason(self) -> str | None:
        """The remembered failure (a message), or None."""
        record = _RECORD.get()
        return record.failures.get(self.key) if record is not None else self._process

    def remember(self, reason: str) -> None:
        record = _RECORD.get()
        if record is not None:
            record.failures[self.key] = reason
        else:
            self._process = reason

    def reset(self) -> None:
        """Forget the process-level failure (tests; a new record starts clean itself)."""
        self._process = None


def is_out_of_memory(err: BaseException) -> bool:
    """True for a CUDA or CPU allocation failure (torch raises RuntimeError for the CPU allocator)."""
    if isinstance(err, (torch.cuda.OutOfMemoryError, MemoryError)):
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


def register(backend: Backend) -> None:
    """Add or replace a backend (called by each backend package at import)."""
    _backends[backend.name] = backend


def backends() -> list[Backend]:
    """All registered backends, available or not, highest priority first."""
    return sorted(_backends.values(), key=lambda b: -b.priority)


def backend_names() -> list[str]:
    """Names accepted by ``backend=``: "auto" and every registered backend."""
    return ["auto", *(b.name for b in backends())]


def _refusal(b: Backend, op: str, q: torch.Tensor, requested: bool = False) -> str | None:
    if b.unavailable_reason:
        return f"unavailable ({b.unavailable_reason})"
    if op not in b.ops:
        return f"does not implement {op}"
    record = _RECORD.get()
    if record is not None and (b.name, op) in record.failures:
        return f"failed earlier in this run ({record.failures[b.name, op]})"
    return b.refuse(op, q, requested)


def candidates(op: str, q: torch.Tensor, backend: str = "auto") -> list[tuple[Backend, str]]:
    """Backends that accept ``op`` on ``q``, best first, each with the reason it is eligible.

    Raises:
        ValueError: ``backend`` is not "auto" nor a registered name.
        NoCapableBackendError: nothing accepts the call (lists every refusal).
    """
    if backend != "auto" and backend not in _backends:
        raise ValueError(f"backend must be one of {backend_names()}, got {backend!r}")
    order = backends()
    refusals = []
    if backend != "auto":
        named = _backends[backend]
        why = _refusal(named, op, q, requested=True)
        if why is None:
            order = [named] + [b for b in order if b is not named]
        else:
            refusals.append(f"{backend} (requested): {why}")
    out = []
    for b in order:
        why = _refusal(b, op, q, requested=b.name == backend)
        if why is None:
            picked = "requested" if b.name == backend else ("best available" if not refusals else "fallback")
            out.append((b, f"{picked}; " + "; ".join(refusals) if refusals else picked))
        elif not (backend != "auto" and b.name == backend):
            refusals.append(f"{b.name}: {why}")
    if not out:
        raise NoCapableBackendError(f"no backend can run {op} on {_describe(q)}: " + "; ".join(refusals))
    return out


def call(op: str, q: torch.Tensor, *args, backend: str = "auto", **kwargs):
    """Run ``op(q, *args, **kwargs)`` on the best backend that accepts it (see ``candidates``).

    A backend that raises anything but ValueError/TypeError (bad input is the caller's error, and the same for
    every backend) or out of memory (``is_out_of_memory``: propagates unchanged, the caller frees memory) is
    logged, skipped for that op for the rest of the run (the active ``Record``; without one, only this call) and
    the next candidate runs. The last candidate's error propagates unchanged.
    """
    chosen = candidates(op, q, backend)
    record = _RECORD.get()
    for i, (b, reason) in enumerate(chosen):
        try:
            result = b.ops[op](q, *args, **kwargs)
        except (ValueError, TypeError):
            raise
        except Exception as err:  # a kernel that breaks at run time must not lose the user's run
            if i == len(chosen) - 1 or is_out_of_memory(err):
                raise  # the last resort failed (the inputs), or memory ran out: not a backend to skip
            if record is not None:
                record.failures[b.name, op] = f"{type(err).__name__}: {err}"
            log.warning("MC-Sparse: backend %s failed on %s (%s: %s); falling back", b.name, op, type(err).__name__, err)
            continue
        if record is not None:
            record.choices[op] = Choice(b.name, reason)
        return result
    raise AssertionError("unreachable: the last candidate re-raises")


def report() -> str:
    """One line per backend: available or why not, and the ops it implements."""
    lines = []
    for b in backends():
        state = "available" if not b.unavailable_reason else f"unavailable: {b.unavailable_reason}"
        lines.append(f"{b.name} (priority {b.priority}): {state}; ops: {', '.join(sorted(b.ops))}")
    return "\n".join(lines)


def _describe(q: torch.Tensor) -> str:
    return f"q of shape {tuple(q.shape)}, {q.dtype}, on {q.device}"
