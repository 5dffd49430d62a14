"""One MC-Sparse attention layer call: the anchor step and the reuse step (MC-Sparse sec. 3).

Anchor step (sec. 3.3-3.5): pass 1 dense attention with the row LSE gives the output the model uses;
Fast PDDP groups the queries into groups of exactly C; pass 2 + top-K selects each group's K KV tokens
from exact probabilities; one sparse evaluation gives the residual R = O_dense - O_sparse. Reuse step:
sparse attention with the cached groups and indices over the *current* q, k, v, plus the cached R.

Tensors are ``[B, H, S, D]`` self-attention inputs (q, k, v of one shape), fp16 / bf16 / fp32.
"""

from __future__ import annotations

import math

import torch

from .. import kernels
from .cache import CacheEntry
from .config import HEAD_DIMS, MCSparseConfig
from .selection import keys_for_density

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

FINITE_BESIDE = True
"""Anchor step on CUDA: the finite check of q, k, v (and ``extra_kv``) runs on a high-priority side stream while pass 1
starts, and the host waits for the check alone (its flags read on the side stream), not for the whole queue: no drain
of the device and no idle gap before pass 1 (H200 round s6r1, 1.3B 480p: the synchronous check cost 0.9 ms of a 19.2
ms anchor call). Pass 1 may then run on non-finite inputs (harmless: dense attention only carries them into its
output, which the caller then discards); PDDP, the selection and the sparse pass never see them. False: the check
drains the device before pass 1, as before."""

_SIDE_STREAMS: dict = {}  # device -> the side stream of FINITE_BESIDE


class NonFiniteInputError(ValueError):
    """q, k or v holds NaN or inf (raised before PDDP, the selection or the sparse pass run; on CUDA pass 1 may have
    run on them, ``FINITE_BESIDE``)."""


def ineligible_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why this call cannot take the sparse path (a short human string), or None when it can.

    Checks: 4-D ``[B, H, S, D]`` tensors of one shape (self-attention), float16/bfloat16/float32, head dim
    in ``config.HEAD_DIMS``. Cheap (no device sync); finiteness is checked separately at anchor steps.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            return f"{name} is not a tensor ({type(t).__name__})"
        if t.dim() != 4:
            return f"{name} is not [B, H, S, D] (shape {tuple(t.shape)})"
    if q.device.type == "meta" or not (q.device == k.device == v.device):
        return f"q, k, v must be real tensors on one device, got {q.device}, {k.device}, {v.device}"
    if not (q.shape == k.shape == v.shape):
        return f"not self-attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if q.dtype not in _DTYPES or not (q.dtype == k.dtype == v.dtype):
        return f"unsupported dtype {q.dtype}/{k.dtype}/{v.dtype} (float16, bfloat16, float32 supported)"
    if q.shape[-1] not in HEAD_DIMS:
        return f"unsupported head dim {q.shape[-1]} (supported: {', '.join(map(str, HEAD_DIMS))})"
    if q.shape[2] < 1:
        return "empty sequence"
    return None


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, check_finite: bool = True) -> None:
    """Raise when ``ineligible_reason`` finds a problem or (with ``check_finite``) q, k or v is not finite.

    Raises:
        ValueError: wrong shapes, dtype or head dim (message names the input and the accepted range).
        NonFiniteInputError: NaN or inf in q, k or v (waits for the check: ``_FiniteCheck``).
    """
    reason = ineligible_reason(q, k, v)
    if reason is not None:
        raise ValueError(f"q, k, v must be self-attention [B, H, S, D] inputs MC-Sparse supports: {reason}")
    if check_finite:
        _FiniteCheck((("q", q), ("k", k), ("v", v))).result()


class _FiniteCheck:
    """Whether each of ``named`` ((name, tensor) pairs) is finite: one float32 sum per tensor over its memory in
    order (NaN and inf carry through a sum, so the sum is finite when every element is; a finite tensor whose values
    sum past float32's range, ~3e38, counts as non-finite: that call then runs dense), one read for all. On CUDA with
    ``FINITE_BESIDE`` the sums run on a side stream and ``result`` reads them there, waiting for that stream alone;
    elsewhere everything runs at once."""

    def __init__(self, named):
        self.names = [name for name, _ in named]
        tensors = [t for _, t in named]
        device = tensors[0].device
        self.side = _side_stream(device) if FINITE_BESIDE and device.type == "cuda" else None
        if self.side is None:
            self.flags = torch.isfinite(torch.stack([_in_order(t).sum(dtype=torch.float32) for t in tensors])).tolist()
            return
        self.side.wait_stream(torch.cuda.current_stream(device))  # the inputs are written on the current stream
        with torch.cuda.stream(self.side):
            self.flags = torch.isfinite(torch.stack([_in_order(t).sum(dtype=torch.float32) for t in tensors]))

    def result(self) -> None:
        """Raise NonFiniteInputError naming the first non-finite tensor (on CUDA: after the side stream's sums)."""
        flags = self.flags
        if self.side is not None:
            with torch.cuda.stream(self.side):  # the copy and its wait are the side stream's, not the whole queue's
                flags = flags.tolist()
        for name, ok in zip(self.names, flags):
            if not ok:
                raise NonFiniteInputError(f"{name} must be finite, got NaN or inf values")


def _in_order(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a 1-D view of its memory when its dims permute to a contiguous tensor (e.g. the [B, H, S, D] view of
    a [B, S, H*D] tensor), so a reduction reads it in order; else ``t``."""
    p = t.permute(sorted(range(t.dim()), key=lambda i: -t.stride(i)))
    return p.view(-1) if p.is_contiguous() else t


def anchor_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    config: MCSparseConfig,
    *,
    scale: float | None = None,
    backend: str = "auto",
    check_finite: bool = True,
    extra_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, CacheEntry]:
    """Anchor step of one layer: the dense output and a fresh cache entry.

    Args:
        q, k, v: ``[B, H, S, D]`` self-attention inputs. config: density, C, KV tile, residual settings.
        scale: softmax scale, None = 1/sqrt(D). backend: kernel backend name or "auto".
        check_finite: raise NonFiniteInputError on NaN/inf inputs, before PDDP or the selection see them (on CUDA
            the check runs beside pass 1, ``FINITE_BESIDE``, and the host waits for it alone).
        extra_kv: optional (k_x, v_x) ``[B, H, T, D]``: keys every query attends exactly, besides its selected
            ones (e.g. the text tokens of a joint video+text sequence); merged by LSE. Selection probabilities
            are normalised over all S + T keys.
    Returns:
        (O_dense ``[B, H, S, D]`` in q's dtype (over all S + T keys), CacheEntry).
    Raises:
        ValueError / NonFiniteInputError: see ``check_inputs``; extra_kv of the wrong shape.
    """
    check_inputs(q, k, v, check_finite=False)
    extra_kv = _nonempty(q, extra_kv)
    finite = None
    if check_finite:  # started here, waited for after pass 1 is queued (FINITE_BESIDE)
        named = [("q", q), ("k", k), ("v", v)]
        if extra_kv is not None:
            named += [("extra_kv k", extra_kv[0]), ("extra_kv v", extra_kv[1])]
        finite = _FiniteCheck(named)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    k_all, v_all = (k, v) if extra_kv is None else (torch.cat([k, extra_kv[0]], 2), torch.cat([v, extra_kv[1]], 2))
    out, lse = kernels.dense_attention(q, k_all, v_all, scale=scale, return_lse=True, backend=backend)
    del k_all, v_all
    if finite is not None:
        finite.result()
    perm = kernels.pddp_groups(q, config.group_size, power_iters=config.power_iters, backend=backend)
    num_keys = keys_for_density(config.density, k.shape[2], config.kv_tile)
    kv_idx = kernels.select_kv(
        q, k, lse, perm, num_keys, group_size=config.group_size, kv_tile=config.kv_tile, scale=scale, backend=backend
    )
    residual = None
    if config.residual:
        sparse = _sparse(q, k, v, perm, kv_idx, extra_kv, scale, backend)
        # 'auto' unresolved (no plan) is bf16; quantised storage (fp8, int4, int4_group) gets R in float32 (``_residual``)
        name = "bfloat16" if config.residual_dtype == "auto" else config.residual_dtype
        residual = _residual(out, sparse, name)
    return out, CacheEntry(perm=perm, kv_idx=kv_idx, residual=residual, num_keys=num_keys, shape=tuple(q.shape),
                           checked=True)


def reuse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    entry,
    *,
    scale: float | None = None,
    backend: str = "auto",
    extra_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reuse step of one layer: sparse attention over the current q, k, v with the cached groups and indices, plus
    the cached residual, in one kernel launch for the whole batch (the residual added in the kernel's epilogue).

    Args:
        q, k, v: ``[B, H, S, D]`` of the current step, any strides (e.g. views of ComfyUI's ``[B, S, H*D]``).
        entry: the cached ``perm``, ``kv_idx`` and ``residual`` for this batch: a ``CacheEntry`` from
            ``anchor_attention`` on the same shape, or a ``prefetch.ReuseBatch`` (entries of several conditioning
            chunks stacked). A residual tensor is taken as a plain ``kernels.Residual``.
        extra_kv: the always-attended keys of this step, as given to ``anchor_attention``: then the sparse part and
            the exact part are merged by their LSE and the residual is added after the merge.
        out: optional ``[B, H, S, D]`` tensor in q's dtype, any strides (a view of the caller's output buffer);
            written and returned.
    Returns:
        ``[B, H, S, D]`` in q's dtype (``out`` when given).
    Raises:
        ValueError: a ``CacheEntry`` made for another shape (callers key entries by shape, see ``cache``).
    """
    fits = getattr(entry, "fits", None)
    if fits is not None and not fits(q):
        raise ValueError(f"entry must be made for q's shape and device, got {entry.shape} for q {tuple(q.shape)} on {q.device}")
    residual = entry.residual
    if isinstance(residual, torch.Tensor):
        residual = kernels.Residual(data=residual, kind="plain")
    extra_kv = _nonempty(q, extra_kv)
    if extra_kv is None:
        return kernels.sparse_attention(q, k, v, entry.perm, entry.kv_idx, scale=scale, out=out, residual=residual,
                                        backend=backend)
    if residual is None:
        merged = _sparse(q, k, v, entry.perm, entry.kv_idx, extra_kv, scale, backend)
    else:  # merged and R added in float32, rounded once to q's dtype (as the kernels' residual epilogue)
        merged = _sparse(q, k, v, entry.perm, entry.kv_idx, extra_kv, scale, backend, dtype=torch.float32)
        merged = merged.add_(residual.dequantize(torch.float32, entry.perm)).to(q.dtype)
    if out is None:
        return merged
    return out.copy_(merged)


def merge_attention(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor, *,
                    dtype: torch.dtype | None = None) -> torch.Tensor:
    """Attention over the union of two disjoint key sets, from each part's output and LSE.

    Args:
        o1, o2: ``[B, H, S, D]`` softmax attention outputs over key sets 1 and 2; lse1, lse2: their fp32
            ``[B, H, S]`` log-sum-exps (natural log, scale applied). dtype: of the result (None: o1's; float32
            for a caller that adds more before its one rounding, ``reuse_attention``).
    Returns:
        ``[B, H, S, D]`` in ``dtype``, exactly the attention over both sets (up to rounding).
    """
    m = torch.maximum(lse1, lse2)
    w1, w2 = torch.exp(lse1 - m), torch.exp(lse2 - m)
    merged = (o1.float() * w1.unsqueeze(-1) + o2.float() * w2.unsqueeze(-1)) / (w1 + w2).unsqueeze(-1)
    return merged.to(o1.dtype if dtype is None else dtype)


def _residual(dense: torch.Tensor, sparse: torch.Tensor, dtype_name: str) -> torch.Tensor:
    """R = O_dense - O_sparse without fp32 copies of the outputs.

    Plain half storage ("bfloat16" / "float16"): one elementwise pass written over ``sparse`` (the anchor's own
    buffer), rounded once to the storage dtype. Otherwise (float32 storage, or fp8 / int4, which
    ``encoding.encode_residual`` quantises from full precision, cache.py): the exact difference in float32, one
    upcast of ``dense`` that becomes R in place (no float32 copy of ``sparse``, no extra temporaries).
    """
    store = getattr(torch, dtype_name, None)
    if store in (torch.float16, torch.bfloat16):
        torch.sub(dense, sparse, out=sparse)
        return sparse if store == sparse.dtype else sparse.to(store)
    if dense.dtype == torch.float32:
        return dense - sparse  # never in place: ``dense`` is the output the caller returns
    return dense.float().sub_(sparse)


def _sparse(q, k, v, perm, kv_idx, extra_kv, scale, backend, dtype=None):
    """Token-sparse attention over the selected keys, merged with exact attention over ``extra_kv`` (the merge in
    ``dtype``, ``merge_attention``)."""
    if extra_kv is None:
        return kernels.sparse_attention(q, k, v, perm, kv_idx, scale=scale, backend=backend)
    o_sel, lse_sel = kernels.sparse_attention(q, k, v, perm, kv_idx, scale=scale, return_lse=True, backend=backend)
    o_x, lse_x = kernels.dense_attention(q, extra_kv[0], extra_kv[1], scale=scale, return_lse=True, backend=backend)
    return merge_attention(o_sel, lse_sel, o_x, lse_x, dtype=dtype)


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device, priority=-1)
    return stream


def _nonempty(q: torch.Tensor, extra_kv):
    """``extra_kv`` checked (``_check_extra``), or None when it holds no key (e.g. a joint call whose mask masks every
    text token): attention over the selected keys and an empty set is attention over the selected keys."""
    _check_extra(q, extra_kv)
    return None if extra_kv is None or extra_kv[0].shape[2] == 0 else extra_kv


def _check_extra(q: torch.Tensor, extra_kv) -> None:
    if extra_kv is None:
        return
    if not isinstance(extra_kv, (tuple, list)) or len(extra_kv) != 2:
        raise TypeError(f"extra_kv must be a (k, v) pair of tensors, got {type(extra_kv).__name__}")
    B, H, _, D = q.shape
    for name, t in zip(("extra_kv k", "extra_kv v"), extra_kv):
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or (t.shape[0], t.shape[1], t.shape[3]) != (B, H, D):
            raise ValueError(f"{name} must be [B, H, T, D] with q's B, H, D {(B, H, D)}, got {getattr(t, 'shape', t)}")
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name} must match q's dtype and device, got {t.dtype} on {t.device}")
    if extra_kv[0].shape != extra_kv[1].shape:
        raise ValueError(f"extra_kv k and v must have one shape, got {tuple(extra_kv[0].shape)} and {tuple(extra_kv[1].shape)}")
