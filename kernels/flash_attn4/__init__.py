"""The flash-attn-4 backend (``flash_attn.cute``, flash-attn-4 4.0.0b36 on nvidia-cutlass-dsl 4.8.1): dense pass 1
with LSE, and token-sparse attention through FA4's paged-KV route with one-token pages (docs/kernels.md, sec. 0.1).

Importing this package imports ``flash_attn.cute``; without it (or with a broken CuTeDSL stack) the import error
is recorded by ``kernels/_optional.py`` as the backend's unavailable reason. Registers
``Backend(name="flash_attn4", priority=30)``: on sm90+ it is the fastest dense kernel measured on the H200
(669 / 649 TFLOP/s at the Wan2.1 shapes, docs/kernels-benchmark.md). FA4 compiles each kernel variant on its first call
(seconds); ``FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1`` keeps them on disk.

Sparse mapping: K and V ``[B, H, S, D]`` are seen in place as page pools of one-token pages ``(rows, 1, 1, D)``
(``kv_pages``); each (b, h, group) is one FA4 batch entry whose page table holds its selected tokens' page ids and
whose ``seqused_k`` is its count of valid slots (the -1 slots are trailing, by the kv_idx convention), both written
by one Triton launch from kv_idx; the group's C queries are gathered to ``(B*H*G, C, 1, D)`` by one launch, and one
launch scatters FA4's output back to the original query order with the residual added (kernels/triton/
paged_route.py). FA4 puts batch entries on grid.z (at most 65535), so larger calls run in chunks.

Both ops are registered behind ``_as_backend_failure``: FA4's own ValueError / TypeError on a call the public op has
validated becomes a RuntimeError, a fallback for the rest of the run with the reason in the run summary.
"""

from __future__ import annotations

import functools
import math
import os

import torch

from flash_attn.cute import flash_attn_func
from flash_attn.cute import interface as _fa4
from flash_attn.cute.interface import _flash_attn_fwd  # the varlen entry without autograd; takes out= / lse=

from ..registry import Backend, register
from ..triton import paged_route

__all__ = ["dense_attention", "kv_pages", "refuse", "sparse_attention"]

_DTYPES = (torch.float16, torch.bfloat16)
_MAX_BATCH = 65535  # CUDA grid.z limit: FA4's sm90 non-causal scheduler puts batch entries there


def refuse(op: str, q: torch.Tensor, requested: bool) -> str | None:
    """Why this backend cannot run ``op`` on ``q`` (None when it can)."""
    if q.device.type != "cuda":
        return f"runs on CUDA devices, got {q.device.type}"
    if q.dtype not in _DTYPES:
        return f"runs float16/bfloat16 only, got {q.dtype}"
    major, _ = torch.cuda.get_device_capability(q.device)
    if major < 9:
        return f"needs compute capability >= 9.0 (Hopper or newer), got {major}.x"
    d = q.shape[-1]
    if op == "sparse_attention" and d not in (64, 128):
        return f"paged-KV route runs head dim 64 or 128, got {d}"
    if d % 8 or d > 256:
        return f"head dim must be a multiple of 8 and at most 256, got {d}"
    return None


def dense_attention(q, k, v, *, scale=None, return_lse=False):
    """Dense attention on FA4; same contract as ``kernels.reference.dense_attention``.

    Args: q ``[B, H, S, D]``, k, v ``[B, H, Sk, D]``, fp16/bf16 on sm90+; scale (None = 1/sqrt(D)); return_lse.
    Returns: O ``[B, H, S, D]`` (a transposed view of FA4's ``[B, S, H, D]`` output), or (O, LSE fp32 ``[B, H, S]``).
    """
    out, lse = flash_attn_func(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale, return_lse=return_lse
    )
    out = out.transpose(1, 2)
    return (out, lse) if return_lse else out


def kv_pages(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int, int]]:
    """K and V ``[B, H, S, D]`` as FA4 page pools of one-token pages ``(rows, 1, 1, D)`` and the page strides.

    Without a copy when k and v have the same strides, unit stride on D, every other stride a multiple of D, 16-byte
    aligned storage and an int32 largest page id (``[B, H, S, D]`` contiguous tensors and the model's ``[B, S, H*D]``
    views alike): the pool is the storage from the tensor's first element seen as rows of D. Otherwise contiguous
    copies. Returns (k pool, v pool, (page_b, page_h, page_s)): token t of (b, h) is page b*page_b + h*page_h +
    t*page_s of both pools. Raises RuntimeError when even the copies' B*H*S rows do not fit int32 page ids."""
    B, H, S, D = k.shape
    st = k.stride()
    if (st == v.stride() and st[3] == 1 and all(x >= 0 and x % D == 0 for x in st[:3])
            and k.data_ptr() % 16 == 0 and v.data_ptr() % 16 == 0):
        pb, ph, ps = (x // D for x in st[:3])
        rows = (B - 1) * pb + (H - 1) * ph + (S - 1) * ps + 1
        if rows < 2**31:
            def pool(x):
                return torch.as_strided(x, (rows, 1, 1, D), (D, D, D, 1), x.storage_offset())
            return pool(k), pool(v), (pb, ph, ps)
    if B * H * S >= 2**31:
        # RuntimeError, not ValueError: the call is valid, this route cannot take it (the registry falls back)
        raise RuntimeError(f"flash_attn4 paged route: {B * H * S} K/V rows do not fit int32 page ids")
    kc, vc = (_aligned_copy(x).reshape(B * H * S, 1, 1, D) for x in (k, v))
    return kc, vc, (H * S, S, 1)


def _aligned_copy(x: torch.Tensor) -> torch.Tensor:
    """x as a contiguous tensor with 16-byte aligned storage: ``contiguous()`` returns an already contiguous tensor
    itself, also one that starts off alignment (e.g. a view one element into a buffer), so that one is cloned."""
    c = x.contiguous()
    return c if c.data_ptr() % 16 == 0 else c.clone()


class _RecordingCache:
    """Stands in for ``_flash_attn_fwd.compile_cache`` during one call: remembers the compiled kernel the interface
    fetched and the arguments it called it with."""

    def __init__(self, inner):
        self.inner, self.fn, self.args = inner, None, None

    def __contains__(self, key):
        return key in self.inner

    def __setitem__(self, key, value):
        self.inner[key] = value

    def __getitem__(self, key):
        fn = self.inner[key]

        def call(*args):
            self.fn, self.args = fn, args
            return fn(*args)
        return call

    def __getattr__(self, name):
        return getattr(self.inner, name)


# (device, dtype, D, C, LSE, tuning) -> (compiled kernel, its argument list with None at the per-call tensors' slots)
_DIRECT: dict = {}
# argument slots of FA4's sm90 compiled forward (interface.py, call_args for arch 9): q, k, v, out, lse,
# softmax_scale, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table, ... (the rest fixed for this route)
_SLOTS = {"q": 0, "k": 1, "v": 2, "out": 3, "lse": 4, "scale": 5, "used": 9, "table": 10}


def _paged_call(q, k, v, used, table, out, lse, scale, tuning):
    """One FA4 paged launch. The first call of a key goes through ``_flash_attn_fwd`` (its checks, its compile
    cache) and records the compiled kernel and its arguments; later calls launch that kernel directly with this
    call's tensors (~0.1 ms of host work less per call, which the GPU otherwise waits for between our launches).
    The recording is kept only when the arguments are exactly ours in the expected slots (this call's tensors,
    nothing else a tensor), so a different FA4 build falls back to the interface. ``MC_SPARSE_FA4_DIRECT=0`` turns
    the direct launch off."""
    key = (q.device, q.dtype, q.shape[-1], q.shape[1], lse is None, tuple(sorted(tuning.items())))
    hit = _DIRECT.get(key) if os.environ.get("MC_SPARSE_FA4_DIRECT", "1") != "0" else None
    if hit is not None:
        fn, args = hit
        args = list(args)
        for name, t in (("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse), ("scale", scale), ("used", used),
                        ("table", table)):
            args[_SLOTS[name]] = t
        fn(*args)
        return
    rec = _RecordingCache(_fa4._flash_attn_fwd.compile_cache)
    _fa4._flash_attn_fwd.compile_cache = rec
    try:
        _flash_attn_fwd(q, k, v, seqused_k=used, page_table=table, softmax_scale=scale, return_lse=lse is not None,
                        out=out, lse=lse, **tuning)
    finally:
        _fa4._flash_attn_fwd.compile_cache = rec.inner
    if rec.args is not None and _is_our_call(rec.args, dict(q=q, k=k, v=v, out=out, lse=lse, used=used, table=table),
                                             scale):
        args = list(rec.args)
        for slot in _SLOTS.values():
            args[slot] = None
        _DIRECT[key] = (rec.fn, tuple(args))


def _is_our_call(args, tensors, scale) -> bool:
    """True when ``args`` hold exactly ``tensors`` (same storage, shape, strides) at ``_SLOTS`` and no other tensor."""
    if len(args) <= max(_SLOTS.values()) or args[_SLOTS["scale"]] != scale:
        return False
    for name, t in tensors.items():
        a = args[_SLOTS[name]]
        if t is None or a is None:
            if (t is None) != (a is None):
                return False
        elif not (isinstance(a, torch.Tensor) and a.data_ptr() == t.data_ptr() and a.shape == t.shape
                  and a.stride() == t.stride() and a.dtype == t.dtype):
            return False
    slots = set(_SLOTS.values())
    return not any(isinstance(a, torch.Tensor) for i, a in enumerate(args) if i not in slots)


def sparse_attention(q, k, v, perm, kv_idx, *, scale=None, return_lse=False, out=None, residual=None, **tuning):
    """Token-sparse attention through FA4's paged KV with one-token pages; contract of
    ``kernels.reference.sparse_attention`` (kv_idx's -1 slots must be trailing in each group, as select_kv makes them).

    Per call: one Triton launch writes the page table and each group's valid count (``seqused_k``) from kv_idx
    (int32, no host sync), one gathers the queries to group order, FA4 runs (one launch per 65535 groups), one
    scatters its output to ``out`` by strides with the residual added in fp32 (kernels/triton/paged_route.py). K and
    V are read in place (``kv_pages``). FA4's compiled kernel is launched directly after the first call of a shape
    class (``_paged_call``). ``tuning``: FA4's ``tile_mn``, ``mma_pv_is_rs``, ``intra_wg_overlap``,
    ``num_splits`` (benchmarks; defaults FA4's).

    Returns: ``out`` (a new ``[B, H, S, D]`` in q's dtype when None), original query order, or (out, LSE fp32
    ``[B, H, S]``).
    """
    B, H, S, D = q.shape
    G = kv_idx.shape[2]
    C = perm.shape[-1] // G
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if residual is not None:
        residual.check(q)
        residual.check_groups(perm)
    k_pool, v_pool, strides = kv_pages(k, v)
    table, used = paged_route.page_table(kv_idx, strides)
    q_groups = paged_route.gather_queries(q, perm, C)
    o_groups = torch.empty_like(q_groups)
    lse_groups = torch.empty(B * H * G, 1, C, dtype=torch.float32, device=q.device) if return_lse else None
    for n0 in range(0, B * H * G, _MAX_BATCH):
        n1 = min(B * H * G, n0 + _MAX_BATCH)
        _paged_call(q_groups[n0:n1], k_pool, v_pool, used[n0:n1], table[n0:n1], o_groups[n0:n1],
                    None if lse_groups is None else lse_groups[n0:n1], scale, tuning)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    return paged_route.scatter_output(o_groups, lse_groups, perm, out, residual)


def _as_backend_failure(op):
    """``op`` with FA4's ValueError / TypeError (its interface's argument checks, the compiled kernel's TVM-FFI
    argument checks, the DSL's ``DSLUserCodeTypeError``) raised as RuntimeError: the public ops have validated the
    inputs, so these are this backend's failures, and the registry, which treats ValueError / TypeError as the
    caller's error, then falls back for the rest of the run instead of losing it (as the CuTeDSL op does,
    ``kernels/cutedsl/op.py``)."""

    @functools.wraps(op)
    def run(*args, **kwargs):
        try:
            return op(*args, **kwargs)
        except (ValueError, TypeError) as err:
            raise RuntimeError(f"flash-attn-4 failed: {type(err).__name__}: {err}") from err

    return run


register(
    Backend(
        name="flash_attn4",
        priority=30,
        ops={"dense_attention": _as_backend_failure(dense_attention),
             "sparse_attention": _as_backend_failure(sparse_attention)},
        refuse=refuse,
    )
)
