"""Compiling the CuTeDSL sparse kernel once per (dtype, head dim, LSE, residual form) and keeping it on disk.

``compiled(dtype, head_dim, with_lse, residual)`` returns the compiled kernel; ``launch`` calls it with torch tensors (TVM-FFI
calling convention, on the current CUDA stream). Shapes, strides and sizes are dynamic, so one compiled
kernel serves every resolution, batch and density. The first call in a process compiles (tens of seconds; the
benchmark prints it) unless a previous process left the compiled object in the disk cache: flash-attn-4's persistent
JIT cache (``flash_attn.cute.cache_utils.JITPersistentCache``, used as a library) under
``$MC_SPARSE_CUTEDSL_CACHE_DIR`` (default ``~/.cache/comfyui_mc_sparse/cutedsl``), keyed by the key below plus a
hash of this package's kernel sources and the libraries' versions (``source_hash``), so a changed kernel or an
upgraded flash-attn-4 / DSL never loads a stale object.

Offline compilation without a GPU (``tests/test_cutedsl_backend.py::test_offline_sm90_compile``): set
``CUTE_DSL_ARCH=sm_90a`` before importing cutlass; ``compile_fake`` builds the same kernel from fake tensors.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import logging
import os
import sys
import threading
from pathlib import Path

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from quack.compile_utils import make_fake_stream, make_fake_tensor

from .sparse_fwd_sm90 import EPILOGUES, OPTIONS, PRODUCERS, STAMP_SLOTS, SparseFwdSm90

_DTYPES = {"float16": cutlass.Float16, "bfloat16": cutlass.BFloat16}
# the kernel's residual forms (compile-time): none, plain in one of three dtypes, or a row-scaled byte form
RESIDUALS = {"none": (None, None), "plain_bfloat16": ("plain", cutlass.BFloat16),
             "plain_float16": ("plain", cutlass.Float16), "plain_float32": ("plain", cutlass.Float32),
             "fp8_row": ("fp8_row", cutlass.Uint8), "int4_row": ("int4_row", cutlass.Uint8),
             "int4_group": ("int4_group", cutlass.Uint8)}
STAGES = 2  # 3 stages measured -1 to +2 % at 1.3B, up to -11 % at 14B on the H200 (the regroup kernel, 2026-12-01)
# "cp.async+evict" (flash-attn-4's row copies with a 256-byte L2 prefetch and evict-last; sparse_fwd_sm90.py): the
# best row at 7 of 8 points on the H200 (+0.02-0.04 of dense x s over plain "cp.async", side by side, 2026-12-01
# round 2 at 3d95386); "cp.async+l2" (prefetch only) is unmeasured. A TMA producer (one 1 x 64 box per row) measured
# 0.53-0.60 of dense x s: removed.
PRODUCER = "cp.async+evict"
_memory: dict = {}
_lock = threading.Lock()
log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1)
def source_hash() -> str:
    """sha256 (16 hex) of this package's kernel sources and the versions of everything the compiled object is built
    from (Python, the DSL, flash-attn-4 and quack whose code the kernel inlines, TVM-FFI's calling convention): part
    of every cache key. Computed once per process: ``compiled`` runs on every call, and hashing the files there cost
    about 1 ms of host time per call (measured on a busy CPU), as long as the 1.3B kernel itself."""
    h = hashlib.sha256(f"py{sys.version_info[0]}.{sys.version_info[1]} cutlass={cutlass.__version__}".encode())
    for dist in ("flash-attn-4", "quack-kernels", "apache-tvm-ffi"):
        try:
            h.update(f" {dist}={importlib.metadata.version(dist)}".encode())
        except importlib.metadata.PackageNotFoundError:  # a bundle unpacked without its .dist-info
            h.update(f" {dist}=?".encode())
    here = Path(__file__).resolve().parent
    for src in sorted(here.glob("*.py")):
        h.update(src.name.encode())
        h.update(src.read_bytes())
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    """Where compiled kernels persist between ComfyUI starts."""
    env = os.environ.get("MC_SPARSE_CUTEDSL_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "comfyui_mc_sparse" / "cutedsl"


def default_stages() -> int:
    """K/V pipeline stages: ``$MC_SPARSE_CUTEDSL_STAGES`` (2 or 3) or the measured default.

    Raises: ValueError for any other value (the op turns it into a fallback with this reason)."""
    raw = os.environ.get("MC_SPARSE_CUTEDSL_STAGES", str(STAGES))
    if raw.strip() not in ("2", "3"):
        raise ValueError(f"MC_SPARSE_CUTEDSL_STAGES must be 2 or 3, got {raw!r}")
    return int(raw)


def _fake_args(dtype: str, head_dim: int, with_lse: bool, residual: str, out_align: int = 4):
    """Fake tensors of one launch (``sparse_fwd_sm90.py``'s contract): q/out share (B, S, H) with the residual and
    LSE; k/v have their own length; alignments as ``rules.call_refusal`` checks them, out rows ``out_align`` bytes
    (16 for the staged epilogue's 16-byte stores)."""
    dt = _DTYPES[dtype]
    b, s, sk, h, n, k = (cute.sym_int() for _ in range(6))
    q = make_fake_tensor(dt, (b, s, h, head_dim), divisibility=8)
    kk, vv = (make_fake_tensor(dt, (b, sk, h, head_dim), divisibility=8) for _ in range(2))
    o = make_fake_tensor(dt, (b, s, h, head_dim), divisibility=out_align // 2)
    lse = make_fake_tensor(Float32, (b, h, s), divisibility=1) if with_lse else None
    perm = make_fake_tensor(Int32, (n, 128), divisibility=1)
    idx = make_fake_tensor(Int32, (n, k), divisibility=1)
    counts = make_fake_tensor(Int32, (n,), divisibility=1)
    kind, rdt = RESIDUALS[residual]
    res = scale = coef = mean = None
    packed = kind in ("int4_row", "int4_group")
    if kind is not None:
        res = make_fake_tensor(rdt, (b, s, h, head_dim // 2 if packed else head_dim), divisibility=1 if packed else 2)
    if kind in ("fp8_row", "int4_row"):
        scale = make_fake_tensor(Float32, (b, h, s), divisibility=1)
    if kind == "int4_group":
        scale = make_fake_tensor(cutlass.BFloat16, (b, h, s), divisibility=1)
        coef = make_fake_tensor(cutlass.Uint8, (b, h, s), divisibility=1)
        mean = make_fake_tensor(cutlass.BFloat16, (b, h, cute.sym_int(), head_dim), divisibility=2)
    return q, kk, vv, o, lse, perm, idx, counts, res, scale, coef, mean


def compile_fake(dtype: str, head_dim: int, with_lse: bool, residual: str = "none", stages: int | None = None,
                 producer: str | None = None, epilogue: str = "registers", options: tuple = ()):
    """Compile the kernel (``sparse_fwd_sm90.py``) from fake tensors; ``residual`` a key of ``RESIDUALS``, ``producer``
    one of ``PRODUCERS`` (None: ``PRODUCER``), ``epilogue`` one of ``EPILOGUES`` (the staged one wants 16-byte
    aligned out rows), ``options`` a tuple of ``OPTIONS``. Needs no GPU with CUTE_DSL_ARCH=sm_90a. Raises KeyError
    for an unknown residual form, ValueError for an unknown producer, epilogue or option."""
    producer = producer or PRODUCER
    if producer not in PRODUCERS or epilogue not in EPILOGUES or any(o not in OPTIONS for o in options):
        raise ValueError(f"unknown producer {producer!r}, epilogue {epilogue!r} or options {options!r}")
    args = _fake_args(dtype, head_dim, with_lse, residual, 16 if epilogue == "smem" else 4)
    kernel = SparseFwdSm90(_DTYPES[dtype], head_dim, stages or default_stages(), RESIDUALS[residual][0], producer,
                           epilogue, tuple(options))
    ws = (None, None)
    if "split_tail" in options:  # the parts' workspace: O rows (dtype) and LSE
        rows = cute.sym_int()
        ws = (make_fake_tensor(_DTYPES[dtype], (rows, head_dim), divisibility=8),
              make_fake_tensor(Float32, (rows,), divisibility=1))
    # "stamps" (a diagnostic): its int64 (items, STAMP_SLOTS) tensor
    stamps = (make_fake_tensor(cutlass.Int64, (cute.sym_int(), len(STAMP_SLOTS)), divisibility=1)
              if "stamps" in options else None)
    return cute.compile(kernel, *args, Float32(1.0), Int32(1), *ws, Int32(1), stamps, make_fake_stream(),
                        options="--enable-tvm-ffi")


def compiled(dtype: str, head_dim: int, with_lse: bool, residual: str = "none", stages: int | None = None,
             producer: str | None = None, epilogue: str = "registers", options: tuple = ()):
    """The compiled kernel for these static parameters: from memory, the disk cache, or a fresh compile."""
    stages = stages or default_stages()
    producer = producer or PRODUCER
    options = tuple(sorted(options))
    key = ("mc_sparse_fwd_sm90", dtype, head_dim, with_lse, residual, stages, producer, epilogue, options,
           source_hash())
    return _cached(key, lambda: compile_fake(dtype, head_dim, with_lse, residual, stages, producer, epilogue,
                                             options))


def _cached(key, build):
    with _lock:
        fn = _memory.get(key)
        if fn is not None:
            return fn
        disk = _disk_cache()
        fn = _from_disk(disk, key)
        if fn is None:
            fn = _to_disk(disk, key, build())
        _memory[key] = fn
        return fn


def _disk_cache():
    try:
        from flash_attn.cute.cache_utils import JITPersistentCache

        path = cache_dir()
        path.mkdir(parents=True, exist_ok=True)
        return JITPersistentCache(path)
    except Exception:  # no writable home, an older flash-attn-4: compile per process
        return None


def _from_disk(disk, key):
    """The cached kernel, or None on a miss or an unusable cache (a directory that exists but takes no lock files,
    e.g. a read-only file system, or a lock held past flash-attn-4's timeout): then this process compiles it."""
    if disk is None:
        return None
    try:
        return disk[key] if key in disk else None
    except Exception as err:
        log.warning("MC-Sparse: CuTeDSL disk cache %s unusable (%s: %s); compiling in this process",
                    cache_dir(), type(err).__name__, err)
        return None


def _to_disk(disk, key, fn):
    """Store a fresh compile (returns the object the cache hands back, or fn itself when the cache cannot store)."""
    if disk is None:
        return fn
    try:
        disk[key] = fn
        return disk[key] if key in disk else fn
    except Exception as err:
        log.warning("MC-Sparse: CuTeDSL disk cache %s cannot store (%s: %s); the next start compiles again",
                    cache_dir(), type(err).__name__, err)
        return fn


def launch(fn, q, k, v, out, lse, perm_rows, kv_rows, counts, res_data, res_scale, res_coef, res_mean,
           scale: float, num_ctas: int, ws_o=None, ws_lse=None, n_parts: int = 1, stamps=None) -> None:
    """Run a compiled kernel (``sparse_fwd_sm90.py``'s contract): q/out ``(B, S, H, D)``, k/v ``(B, Sk, H, D)``,
    lse fp32 ``(B, H, S)`` or None, perm_rows int32 ``(N, 128)``, kv_rows int32 ``(N, K_alloc)``, counts ``(N,)``,
    res_data ``(B, S, H, D or D//2)``, res_scale ``(B, H, S)``, res_coef uint8 ``(B, H, S)``, res_mean bf16
    ``(B, H, G, D)``, each or None as the residual form has them; ``num_ctas`` CTAs (at most N run); for a
    "split_tail" kernel the parts' workspace ``ws_o`` ``(rows, D)`` (q's dtype) and ``ws_lse`` fp32 ``(rows,)``
    (rows >= 128 * r * n_parts, r the groups of the last round) and ``n_parts`` (1: no split), else None; for a
    "stamps" kernel (a diagnostic) ``stamps`` int64 ``(items, len(STAMP_SLOTS))`` (items >= the walk's work items:
    N + num_ctas is enough), else None."""
    fn(q, k, v, out, lse, perm_rows, kv_rows, counts, res_data, res_scale, res_coef, res_mean, scale, num_ctas, ws_o,
       ws_lse, n_parts, stamps)


def warm(stages: int | None = None) -> dict:
    """Compile (or load from disk) every kernel the backend launches without a residual; seconds per variant."""
    import time

    took = {}
    for dtype in _DTYPES:
        for head_dim in (64, 128):
            for with_lse in (False, True):
                t = time.perf_counter()
                compiled(dtype, head_dim, with_lse, "none", stages)
                took[f"{dtype} d{head_dim}{' lse' if with_lse else ''}"] = round(time.perf_counter() - t, 2)
    return took
