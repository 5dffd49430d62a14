"""The paper's sparse-attention diagnostics on exact dense probabilities (MC-Sparse, arXiv 2610.06801, sec. 2).

Every method here keeps, for each query, a set of KV tokens, and is scored against dense attention with
the exact probabilities ``P = softmax(q k^T * scale)``:

- ``vanilla_bsa``: block-sparse attention with mean-pooled scores. Query blocks of ``group_size`` tokens
  and KV blocks of ``kv_tile`` tokens along the token order; score = mean(q block) . mean(k block); each
  query block keeps its top ``ceil(K / kv_tile)`` KV blocks.
- ``block_oracle``: the same blocks, chosen by their true summed mass ``sum_{i in block, j in KV block} P``.
- ``token_oracle``: each query block (or each group of a given ``perm``) keeps its top-K KV tokens by
  summed mass (one selection shared by the block).
- ``per_query_oracle``: every query keeps its own top-K KV tokens.
- ``evaluate_selection``: any (perm, kv_idx) selection, e.g. MC-Sparse's cached one at a reuse step.
- ``sol_attn``: ComfyUI core's Sol-Attn (arXiv 2607.24027) called through comfy-kitchen, at a block
  budget chosen so that its realized density matches the target.

K = ``selection.keys_for_density(density, S, kv_tile)`` for all of them, so the methods compare at the
same budget; each result carries its *realized* density (kept (query, key) pairs / S^2, averaged over
batch and heads), which is what a comparison must match.

Metrics (sec. 2): attention recall = mean over queries of the kept exact mass ``sum_{j kept} P_ij``;
output relative L1 = ``||O_sparse - O_dense||_1 / ||O_dense||_1``. A method's sparse output is the softmax
over its kept keys only (renormalized), plus an optional residual.

Cost: the exact probabilities of every (batch, head) are formed chunk by chunk (at most ``_CHUNK_BYTES``
of scores at once), so memory stays bounded, but the work is that of several dense attentions in fp32
on the torch path: these are diagnostics for small S (a few thousand tokens per head), not a runtime
path. ``max_prob_bytes`` (default 8 GiB of B*H*S*S fp32 probabilities) rejects larger calls up front.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ... import kernels
from ..selection import keys_for_density

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_MAX_PROB_BYTES",
    "SOL_BLOCK",
    "SparseResult",
    "attention_recall",
    "block_oracle",
    "bsa_selection",
    "check_size",
    "dense_reference",
    "evaluate_selection",
    "per_query_oracle",
    "relative_l1",
    "sol_attn",
    "sol_attn_selection",
    "token_oracle",
    "vanilla_bsa",
]

DEFAULT_MAX_PROB_BYTES = 8 * 2**30
"""Largest B*H*S*S*4 bytes of exact probabilities the diagnostics accept by default (8 GiB: S = 23170 at
B*H = 4); they are computed in chunks, so this bounds the run time, not the peak memory."""

SOL_BLOCK = 64
"""Sol-Attn's query and key block (comfy-kitchen ``backends/eager/sol_attn.py`` BLOCK)."""

_CHUNK_BYTES = 1 << 26  # fp32 scores per chunk: 64 MiB, a handful of temporaries of that size at once
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# selector(chunk) -> bool mask [B, H, g, C or 1, S] of kept keys for the chunk's groups
Selector = Callable[["_Chunk"], torch.Tensor]


@dataclass
class SparseResult:
    """One sparse method scored against dense attention.

    Attributes:
        method: display name.
        out: ``[B, H, S, D]`` sparse output in q's dtype (plus residual when one was given), or None when
            the method could not run (see ``note``).
        kept_mass: fp32 ``[B, H, S]``, each query's kept exact mass in [0, 1] (None when unavailable).
        recall: mean of ``kept_mass`` (attention recall), in [0, 1]; NaN when unavailable.
        density: realized density, kept (query, key) pairs / S^2 averaged over batch and heads, in (0, 1].
        rel_l1: output relative L1 against dense (set by the caller that has the dense output, e.g.
            ``with_rel_l1``); None until then.
        note: how the row was made or why it is unavailable.
        extra: method-specific numbers (e.g. Sol-Attn's block budget).
    """

    method: str
    out: torch.Tensor | None
    kept_mass: torch.Tensor | None
    recall: float
    density: float
    rel_l1: float | None = None
    note: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def available(self) -> bool:
        """False when the method could not run here (``note`` says why)."""
        return self.out is not None

    def with_rel_l1(self, dense_out: torch.Tensor) -> SparseResult:
        """Set ``rel_l1`` against ``dense_out`` [B, H, S, D] and return self."""
        if self.out is not None:
            self.rel_l1 = relative_l1(self.out, dense_out)
        return self


# --- metrics ----------------------------------------------------------------------------------------


def relative_l1(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref||_1 / ||ref||_1`` over all elements, accumulated in float64 (a unitless float >= 0).

    Raises: ValueError when the shapes differ or ref is all zeros; TypeError for non-tensors.
    """
    for name, t in (("out", out), ("ref", ref)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if out.shape != ref.shape:
        raise ValueError(f"out must have ref's shape {tuple(ref.shape)}, got {tuple(out.shape)}")
    denom = ref.double().abs().sum()
    if denom == 0:
        raise ValueError("ref must have a nonzero L1 norm, got all zeros")
    return float((out.double() - ref.double()).abs().sum() / denom)


def attention_recall(kept_mass: torch.Tensor) -> float:
    """Attention recall: the mean over queries (and batch, heads) of the kept exact mass ``[B, H, S]``."""
    return float(kept_mass.double().mean())


# --- validation -------------------------------------------------------------------------------------


def check_size(q: torch.Tensor, max_prob_bytes: int = DEFAULT_MAX_PROB_BYTES) -> None:
    """Reject inputs whose exact probabilities would exceed ``max_prob_bytes`` (B*H*S*S fp32).

    Raises: ValueError naming the GiB it would need, the limit and the shape.
    """
    B, H, S, _ = q.shape
    need = B * H * S * S * 4
    if need > max_prob_bytes:
        raise ValueError(
            f"q must be small enough for exact diagnostics: B*H*S*S fp32 probabilities need "
            f"{need / 2**30:.1f} GiB of work at (B={B}, H={H}, S={S}), over the limit of "
            f"{max_prob_bytes / 2**30:.1f} GiB (computed in {_CHUNK_BYTES >> 20} MiB chunks, but in fp32 on the "
            f"torch path); use fewer heads or tokens, or pass a larger max_prob_bytes"
        )


def _check_inputs(q, k, v, density=None, group_size=None, kv_tile=None, max_prob_bytes=DEFAULT_MAX_PROB_BYTES):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, H, S, D], got shape {tuple(t.shape)}")
        if t.dtype not in _FLOATS:
            raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
    if not (q.shape == k.shape == v.shape):
        raise ValueError(
            f"q, k, v must have one shape [B, H, S, D] (self-attention), got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise TypeError(
            f"q, k, v must share dtype and device, got {q.dtype}/{k.dtype}/{v.dtype} on {q.device}/{k.device}/{v.device}"
        )
    if q.shape[2] < 1 or q.shape[3] < 1:
        raise ValueError(f"q must have S >= 1 tokens and D >= 1, got shape {tuple(q.shape)}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{name} must be finite, got NaN or inf values")
    if density is not None:
        if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0.0 < density <= 1.0:
            raise ValueError(f"density must be a number in (0, 1], got {density!r}")
    for name, value in (("group_size", group_size), ("kv_tile", kv_tile)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    check_size(q, max_prob_bytes)


def _scale(q: torch.Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def _acc(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


# --- the chunked evaluator --------------------------------------------------------------------------


@dataclass
class _Chunk:
    """Groups [g0, g0 + g) of one evaluation: exact probabilities of their queries and what selectors need."""

    g0: int
    idx: torch.Tensor  # int64 [B, H, g, C] query indices (clamped; see valid)
    valid: torch.Tensor  # bool [B, H, g, C] real query slots
    q: torch.Tensor  # [B, H, g, C, D] queries (acc dtype)
    p: torch.Tensor  # [B, H, g, C, S] exact probabilities (0 on padding slots)


def _token_order_groups(B, H, S, group_size, device) -> torch.Tensor:
    """int32 ``[B, H, G*C]`` identity perm (blocks of C along the token order), -1 padding."""
    G = -(-S // group_size)
    perm = torch.full((G * group_size,), -1, dtype=torch.int32, device=device)
    perm[:S] = torch.arange(S, dtype=torch.int32, device=device)
    return perm.expand(B, H, -1)


def _evaluate(q, k, v, perm, group_size, selector: Selector, scale, residual=None):
    """Run ``selector`` over the query groups of ``perm`` and score the selection.

    Returns: (out [B, H, S, D] q.dtype, kept_mass fp32 [B, H, S], realized density float).
    """
    acc = _acc(q)
    B, H, S, D = q.shape
    C = group_size
    G = perm.shape[-1] // C
    groups = perm.reshape(B, H, G, C)
    kf, vf = k.to(acc), v.to(acc)
    out = torch.zeros(B, H, S, D, dtype=acc, device=q.device)
    kept = torch.zeros(B, H, S, dtype=torch.float32, device=q.device)
    pairs = 0
    step = max(1, _CHUNK_BYTES // (4 * B * H * C * S))
    for g0 in range(0, G, step):
        idx = groups[:, :, g0 : g0 + step].long()  # [B, H, g, C]
        valid = idx >= 0
        idx = idx.clamp_min(0)
        qg = torch.gather(q, 2, idx.reshape(B, H, -1, 1).expand(-1, -1, -1, D)).reshape(*idx.shape, D).to(acc)
        scores = torch.matmul(qg, kf.unsqueeze(2).transpose(-1, -2)) * scale  # [B, H, g, C, S]
        p = torch.softmax(scores, dim=-1) * valid.unsqueeze(-1)
        del scores
        mask = selector(_Chunk(g0=g0, idx=idx, valid=valid, q=qg, p=p))  # [B, H, g, C|1, S]
        pm = p * mask
        mass = pm.sum(-1)  # [B, H, g, C]
        o = torch.matmul(pm, vf.unsqueeze(2)) / mass.clamp_min(1e-30).unsqueeze(-1)  # [B, H, g, C, D]
        pairs += int((mask.sum(-1, dtype=torch.int64) * valid).sum()) if mask.shape[3] == C else int(
            (mask.sum(-1, dtype=torch.int64) * valid.sum(-1, keepdim=True)).sum()
        )
        flat = idx.reshape(B, H, -1)
        keep = valid.reshape(B, H, -1)
        # padding slots point at query 0 with zero mass; write real slots only
        src_o = (o.reshape(B, H, -1, D) * keep.unsqueeze(-1)).to(acc)
        out.scatter_add_(2, flat.unsqueeze(-1).expand(-1, -1, -1, D), src_o)
        kept.scatter_add_(2, flat, (mass.reshape(B, H, -1) * keep).float())
    if residual is not None:
        out = out + residual.to(acc)
    return out.to(q.dtype), kept, pairs / (B * H * S * S)


def _result(method, q, k, v, perm, group_size, selector, scale, note="", residual=None, extra=None):
    out, kept, density = _evaluate(q, k, v, perm, group_size, selector, scale, residual=residual)
    return SparseResult(method, out, kept, attention_recall(kept), density, note=note, extra=extra or {})


def _topk_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    """bool mask of the top-``k`` entries of the last dim (ties broken as ``torch.topk``)."""
    mask = torch.zeros_like(scores, dtype=torch.bool)
    return mask.scatter_(-1, torch.topk(scores, k, dim=-1, sorted=False).indices, True)


def _block_sums(x: torch.Tensor, tile: int) -> torch.Tensor:
    """Sum the last dim [.., S] in blocks of ``tile`` -> [.., ceil(S / tile)] (ragged last block)."""
    S = x.shape[-1]
    nb = -(-S // tile)
    pad = nb * tile - S
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], nb, tile).sum(-1)


def _expand_blocks(block_mask: torch.Tensor, tile: int, S: int) -> torch.Tensor:
    """bool [.., nb] block mask -> bool [.., S] token mask."""
    return block_mask.repeat_interleave(tile, dim=-1)[..., :S]


# --- dense reference and the methods ----------------------------------------------------------------


def dense_reference(q, k, v, *, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention O ``[B, H, S, D]`` (q's dtype) and its fp32 row LSE ``[B, H, S]`` (natural log),
    through ``kernels.dense_attention``. Raises as the kernel op does."""
    return kernels.dense_attention(q, k, v, scale=_scale(q, scale), return_lse=True)


def per_query_oracle(q, k, v, density: float, *, kv_tile: int = 64, scale: float | None = None,
                     max_prob_bytes: int = DEFAULT_MAX_PROB_BYTES) -> SparseResult:
    """Per-query oracle (sec. 2): every query keeps its own top-K keys by exact probability.

    Args:
        q, k, v: ``[B, H, S, D]`` (fp16/bf16/fp32/fp64, one shape, finite). density: s in (0, 1];
        K = keys_for_density(s, S, kv_tile). scale: None = 1/sqrt(D).
    Returns: ``SparseResult``; realized density K/S. Only the discarded-tail error remains.
    Raises: TypeError / ValueError on bad inputs or above ``max_prob_bytes`` (``check_size``).
    """
    _check_inputs(q, k, v, density, None, kv_tile, max_prob_bytes)
    B, H, S, _ = q.shape
    K = keys_for_density(density, S, kv_tile)
    chunk_c = 64  # queries per chunk row; the selection is per query, so any grouping gives the same result
    perm = _token_order_groups(B, H, S, chunk_c, q.device)
    return _result("per-query oracle", q, k, v, perm, chunk_c, lambda c: _topk_mask(c.p, K), _scale(q, scale))


def token_oracle(q, k, v, density: float, *, group_size: int = 128, kv_tile: int = 64,
                 perm: torch.Tensor | None = None, scale: float | None = None,
                 max_prob_bytes: int = DEFAULT_MAX_PROB_BYTES) -> SparseResult:
    """Token oracle (sec. 2): each query group keeps the K KV tokens of largest summed exact mass.

    Args:
        q, k, v: ``[B, H, S, D]``. density: s in (0, 1]. group_size: C, queries per group (>= 1).
        perm: int32 ``[B, H, ceil(S/C)*C]`` query groups (e.g. Fast PDDP's), or None for blocks of C along
            the token order. kv_tile: K is rounded up to it. scale: None = 1/sqrt(D).
    Returns: ``SparseResult``; realized density K/S (one shared selection per group, no KV binding).
    Raises: TypeError / ValueError on bad inputs.
    """
    _check_inputs(q, k, v, density, group_size, kv_tile, max_prob_bytes)
    B, H, S, _ = q.shape
    K = keys_for_density(density, S, kv_tile)
    perm = _check_perm(perm, q, group_size)
    select = lambda c: _topk_mask(c.p.sum(3, keepdim=True), K)  # noqa: E731  [B, H, g, 1, S]
    return _result("token oracle", q, k, v, perm, group_size, select, _scale(q, scale))


def block_oracle(q, k, v, density: float, *, group_size: int = 128, kv_tile: int = 64,
                 perm: torch.Tensor | None = None, scale: float | None = None,
                 max_prob_bytes: int = DEFAULT_MAX_PROB_BYTES) -> SparseResult:
    """Block oracle (sec. 2): each query group keeps the ``ceil(K / kv_tile)`` KV blocks (``kv_tile``
    consecutive tokens) of largest summed exact mass.

    Args: as ``token_oracle``. Returns: ``SparseResult``; realized density <= K/S (a kept ragged last
    block holds fewer tokens). Raises: TypeError / ValueError on bad inputs.
    """
    _check_inputs(q, k, v, density, group_size, kv_tile, max_prob_bytes)
    B, H, S, _ = q.shape
    K = keys_for_density(density, S, kv_tile)
    nb = -(-K // kv_tile)
    perm = _check_perm(perm, q, group_size)

    def select(c: _Chunk) -> torch.Tensor:
        mass = _block_sums(c.p.sum(3, keepdim=True), kv_tile)  # [B, H, g, 1, nblocks]
        return _expand_blocks(_topk_mask(mass, min(nb, mass.shape[-1])), kv_tile, S)

    return _result("block oracle", q, k, v, perm, group_size, select, _scale(q, scale))


def bsa_selection(q, k, density: float, *, group_size: int = 128, kv_tile: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Vanilla block-sparse selection (sec. 2) as token indices: (perm, kv_idx) in the kernel layout.

    Query blocks are ``group_size`` consecutive tokens (perm = identity), KV blocks ``kv_tile`` consecutive
    tokens; a block's pooled vector is the mean of its real tokens; score = pooled q . pooled k (the
    softmax scale does not change the ranking); each query block keeps its top ``ceil(K / kv_tile)`` KV
    blocks, K = keys_for_density(density, S, kv_tile).

    Args: q, k ``[B, H, S, D]``; density in (0, 1]; group_size, kv_tile >= 1.
    Returns: perm int32 ``[B, H, G*C]``; kv_idx int32 ``[B, H, G, ceil(K/kv_tile)*kv_tile]`` sorted, -1 for
        the missing tokens of a kept ragged last block. Feed them to ``kernels.sparse_attention``.
    """
    _check_inputs(q, k, k, density, group_size, kv_tile, max_prob_bytes=float("inf"))
    B, H, S, D = q.shape
    K = keys_for_density(density, S, kv_tile)
    nb = min(-(-K // kv_tile), -(-S // kv_tile))
    acc = _acc(q)
    scores = torch.matmul(_pool(q.to(acc), group_size), _pool(k.to(acc), kv_tile).transpose(-1, -2))  # [B, H, G, nbk]
    blocks = torch.sort(torch.topk(scores, nb, dim=-1, sorted=False).indices, dim=-1).values  # [B, H, G, nb]
    tokens = (blocks.unsqueeze(-1) * kv_tile + torch.arange(kv_tile, device=q.device)).flatten(-2)  # ascending
    kv_idx = torch.where(tokens < S, tokens, -1).to(torch.int32)  # only the last block can be ragged
    return _token_order_groups(B, H, S, group_size, q.device).contiguous(), kv_idx


def vanilla_bsa(q, k, v, density: float, *, group_size: int = 128, kv_tile: int = 64,
                scale: float | None = None, residual: torch.Tensor | None = None,
                max_prob_bytes: int = DEFAULT_MAX_PROB_BYTES) -> SparseResult:
    """Vanilla block-sparse attention (sec. 2): ``bsa_selection`` scored by ``evaluate_selection``.

    Args:
        q, k, v: ``[B, H, S, D]``. density: s in (0, 1]. group_size: query block; kv_tile: KV block.
        residual: optional ``[B, H, S, D]`` added to the output (BSA with residual compensation).
        scale: None = 1/sqrt(D).
    Returns: ``SparseResult``; realized density ceil(K/kv_tile) blocks' real tokens / S.
    Raises: TypeError / ValueError on bad inputs.
    """
    _check_inputs(q, k, v, density, group_size, kv_tile, max_prob_bytes)
    perm, kv_idx = bsa_selection(q, k, density, group_size=group_size, kv_tile=kv_tile)
    name = "vanilla BSA" + (" + residual" if residual is not None else "")
    return evaluate_selection(q, k, v, perm, kv_idx, residual=residual, scale=scale, method=name,
                              max_prob_bytes=max_prob_bytes)


def evaluate_selection(q, k, v, perm: torch.Tensor, kv_idx: torch.Tensor, *, residual: torch.Tensor | None = None,
                       scale: float | None = None, method: str = "selection",
                       max_prob_bytes: int = DEFAULT_MAX_PROB_BYTES) -> SparseResult:
    """Score a given token selection (e.g. MC-Sparse's cached groups and indices at a reuse step).

    Args:
        q, k, v: ``[B, H, S, D]`` of the step being scored. perm: int32 ``[B, H, G*C]`` query groups;
        kv_idx: int32 ``[B, H, G, K_alloc]`` (-1 = masked slot), as in docs/architecture.md.
        residual: optional ``[B, H, S, D]`` added to the sparse output (MC-Sparse sec. 3.4).
    Returns: ``SparseResult``; realized density = real (non -1) index slots x queries of each group / S^2.
    Raises: TypeError / ValueError on bad inputs or mismatched perm / kv_idx.
    """
    _check_inputs(q, k, v, None, None, None, max_prob_bytes)
    B, H, S, D = q.shape
    if not isinstance(kv_idx, torch.Tensor) or kv_idx.dtype != torch.int32 or kv_idx.dim() != 4 or kv_idx.shape[:2] != (B, H):
        raise ValueError(f"kv_idx must be int32 [B, H, G, K] with B, H = {(B, H)}, got {_describe(kv_idx)}")
    G = kv_idx.shape[2]
    if not isinstance(perm, torch.Tensor) or perm.dim() != 3 or G == 0 or perm.shape[-1] % G:
        raise ValueError(f"perm must be int32 [B, H, G*C] with kv_idx's G = {G}, got {_describe(perm)}")
    C = perm.shape[-1] // G
    perm = _check_perm(perm, q, C)
    if residual is not None and (not isinstance(residual, torch.Tensor) or residual.shape != q.shape):
        raise ValueError(f"residual must be a tensor of q's shape {tuple(q.shape)}, got {_describe(residual)}")
    if bool((kv_idx >= S).any()) or bool((kv_idx < -1).any()):
        raise ValueError(f"kv_idx must hold token indices in [0, {S}) or -1, got values outside")
    k_alloc = kv_idx.shape[3]

    def select(c: _Chunk) -> torch.Tensor:
        rows = kv_idx[:, :, c.g0 : c.g0 + c.idx.shape[2]].long()  # [B, H, g, K_alloc]
        mask = torch.zeros(*rows.shape[:3], S + 1, dtype=torch.bool, device=q.device)
        mask.scatter_(-1, torch.where(rows < 0, S, rows), True)  # -1 slots land in the dropped column S
        return mask[..., :S].unsqueeze(3)

    return _result(method, q, k, v, perm, C, select, _scale(q, scale), residual=residual, extra={"k_alloc": k_alloc})


def _pool(x: torch.Tensor, tile: int) -> torch.Tensor:
    """Mean of each block of ``tile`` consecutive tokens: ``[B, H, S, D]`` -> ``[B, H, ceil(S/tile), D]``."""
    B, H, S, D = x.shape
    nb = -(-S // tile)
    pad = nb * tile - S
    sums = torch.nn.functional.pad(x, (0, 0, 0, pad)).reshape(B, H, nb, tile, D).sum(3)
    counts = torch.full((nb,), float(tile), dtype=x.dtype, device=x.device)
    counts[-1] = tile - pad
    return sums / counts[:, None]


def _check_perm(perm, q, group_size) -> torch.Tensor:
    B, H, S, _ = q.shape
    if perm is None:
        return _token_order_groups(B, H, S, group_size, q.device)
    width = -(-S // group_size) * group_size
    if not isinstance(perm, torch.Tensor) or perm.dtype != torch.int32 or tuple(perm.shape) != (B, H, width):
        raise ValueError(f"perm must be int32 [B, H, ceil(S/C)*C] = {(B, H, width)}, got {_describe(perm)}")
    real = perm[..., :S].long()
    if bool((real < 0).any()) or bool((real >= S).any()) or bool((perm[..., S:] != -1).any()):
        raise ValueError(f"perm must hold each query index in [0, {S}) once, then -1 padding, got other values")
    ones = torch.ones_like(real, dtype=torch.int32)
    seen = torch.zeros(B, H, S, dtype=torch.int32, device=q.device).scatter_add_(2, real, ones)
    if bool((seen != 1).any()):
        raise ValueError("perm must hold each query index exactly once, got duplicates")
    return perm


def _describe(x) -> str:
    return f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__


# --- Sol-Attn through comfy-kitchen -----------------------------------------------------------------


def _sol_budget(S: int) -> int:
    """Key blocks of 64 tokens Sol-Attn sees (n = ceil(S / 64))."""
    return -(-S // SOL_BLOCK)


def _sol_topk_count(n: int, ratio: float) -> int:
    """comfy-kitchen's documented top-k budget: round(ratio * n) clamped to [1, n - 1]; 0 when n <= 1."""
    return max(0, min(n - 1, max(1, round(ratio * n))))


def sol_attn_selection(q: torch.Tensor, k: torch.Tensor, topk_ratio: float) -> torch.Tensor:
    """Which key blocks Sol-Attn attends exactly under ``topk_ratio`` (no sinks), reproduced from its rule.

    comfy-kitchen 0.2.40 (``backends/eager/sol_attn.py``, ``topk_ratio`` branch): query and key blocks of
    64 tokens along the token order; a key block's routing score for a query block is the mean over the
    block's queries of ``q . (mean(k block) - mean over blocks)``; the mean-shift is one constant per row,
    so the ranking is that of mean(q block) . mean(k block), the vanilla BSA score. Each query block keeps
    its top ``round(ratio * n)`` blocks (clamped to [1, n - 1], ties at the k-th score kept) and, always,
    the diagonal block and its two neighbours. The other blocks enter its softmax as one pooled term each
    (tail), which this selection does not count as kept.

    Args: q, k ``[B, H, S, D]``; topk_ratio in (0, 1).
    Returns: bool ``[B, H, n, n]`` (query block, key block), n = ceil(S / 64). Agreement with the library's
        own routing: exact up to float ties in the scores (the library's arithmetic order differs).
    """
    scores = _sol_scores(q, k)
    return _sol_exact(scores, _sol_topk_count(scores.shape[-1], topk_ratio))


def _sol_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Routing scores mean(q block) . mean(k block), ``[B, H, n, n]`` (ranking-equivalent to Sol-Attn's)."""
    acc = _acc(q)
    return torch.matmul(_pool(q.to(acc), SOL_BLOCK), _pool(k.to(acc), SOL_BLOCK).transpose(-1, -2))


def _sol_exact(scores: torch.Tensor, kk: int) -> torch.Tensor:
    """Top-``kk`` blocks per row (ties at the k-th score kept) plus the diagonal +-1: bool ``[B, H, n, n]``."""
    n = scores.shape[-1]
    exact = torch.zeros_like(scores, dtype=torch.bool)
    if kk:
        exact = scores >= scores.topk(kk, dim=-1).values[..., -1:]
    idx = torch.arange(n, device=scores.device)
    return exact | ((idx[None, :] - idx[:, None]).abs() <= 1)


def _sol_pairs(exact: torch.Tensor, S: int) -> float:
    """Realized density of a Sol block mask [B, H, n, n]: exact (query, key) token pairs / S^2, mean over B, H."""
    n = exact.shape[-1]
    lengths = torch.full((n,), float(SOL_BLOCK), device=exact.device)
    lengths[-1] = S - (n - 1) * SOL_BLOCK
    pairs = (exact.double() * lengths[None, :].double() * lengths[:, None].double()).sum((-1, -2))
    return float(pairs.mean()) / (S * S)


def sol_attn(q, k, v, density: float, *, scale: float | None = None, tail: bool = True,
             max_prob_bytes: int = DEFAULT_MAX_PROB_BYTES) -> SparseResult:
    """Sol-Attn (ComfyUI core's sparse attention, arXiv 2607.24027) through the real comfy-kitchen library,
    at the block budget whose realized density is closest to ``density``.

    The call is ``comfy_kitchen.sol_attn(q, k, v, topk_ratio=kk / n, scale=..., tail=tail)`` per (batch,
    head) in its ``(B, T, H, 128)`` layout, the eager backend on CPU (fused backends where comfy-kitchen
    picks them). Head dims below 128 are zero-padded to 128 with the original scale passed explicitly,
    which leaves every score and the output unchanged. The budget kk (top-k blocks per query block) is
    the one whose realized density, counted with ``sol_attn_selection`` (top-k, the forced diagonal
    +-1 blocks, ragged last block), is nearest the target. Realized density and recall count the exactly
    attended pairs only; ``tail=True`` (the library default) also gives each query one pooled term per
    unrouted block (n - kept blocks, about 1/64 of a key each), which approximates the tail and is not
    counted as kept.

    Returns: ``SparseResult`` ("Sol-Attn (comfy-kitchen)"); ``out`` is the library's output, ``kept_mass``
        from the reproduced selection; ``extra`` holds topk_ratio, blocks, n_blocks, tail and call_ms (the
        library calls' wall time in ms, synchronised on GPUs). When comfy-kitchen is missing
        or refuses the call (e.g. head_dim > 128), the result is unavailable (out None) with the reason.
    Raises: TypeError / ValueError on bad inputs.
    """
    _check_inputs(q, k, v, density, None, None, max_prob_bytes)
    B, H, S, D = q.shape
    name = "Sol-Attn (comfy-kitchen)"
    try:
        import comfy_kitchen
    except Exception as err:  # an optional library: ImportError or a broken install
        return SparseResult(name, None, None, float("nan"), float("nan"), note=f"comfy-kitchen unavailable: {err}")
    if D > 128:
        return SparseResult(name, None, None, float("nan"), float("nan"), note=f"head_dim {D} > 128 (Sol-Attn takes 128)")
    n = _sol_budget(S)
    if n < 3:
        return SparseResult(name, None, None, float("nan"), float("nan"), note=f"S = {S} < 129: Sol-Attn keeps every block")
    scores = _sol_scores(q, k)
    best = None
    for kk in range(1, n):  # realized density grows with kk; stop at the first budget past the target
        realized = _sol_pairs(_sol_exact(scores, kk), S)
        if best is None or abs(realized - density) < abs(best[1] - density):
            best = (kk, realized)
        if realized > density:
            break
    kk = best[0]
    ratio = kk / n
    if _sol_topk_count(n, ratio) != kk:
        raise RuntimeError(f"internal: topk_ratio {ratio} does not give {kk} of {n} blocks")
    exact = _sol_exact(scores, kk)  # [B, H, n, n]
    sc = _scale(q, scale)
    dtype = q.dtype if q.dtype in (torch.float16, torch.bfloat16, torch.float32) else torch.float32
    out = torch.empty_like(q)
    _sync(q.device)
    start = time.perf_counter()
    try:
        for b in range(B):
            for h in range(H):  # one head per call: the eager backend materializes (T, T) scores several times
                qkv = [_to_sol_layout(t[b : b + 1, h : h + 1], dtype) for t in (q, k, v)]
                o = comfy_kitchen.sol_attn(*qkv, scale=sc, topk_ratio=ratio, tail=tail)  # (1, T, 1, 128)
                out[b, h] = o[0, :, 0, :D].to(q.dtype)
    except Exception as err:  # comfy-kitchen's refusals (NoCapableBackendError, size guard) name the reason
        logger.debug("sol_attn unavailable: %s", err)
        return SparseResult(name, None, None, float("nan"), float("nan"), note=f"comfy-kitchen refused: {err}")
    _sync(q.device)
    call_ms = (time.perf_counter() - start) * 1000
    perm = _token_order_groups(B, H, S, SOL_BLOCK, q.device)

    def select(c: _Chunk) -> torch.Tensor:
        rows = exact[:, :, c.g0 : c.g0 + c.idx.shape[2]]  # [B, H, g, n]
        return _expand_blocks(rows, SOL_BLOCK, S).unsqueeze(3)

    _, kept, density_real = _evaluate(q, k, v, perm, SOL_BLOCK, select, sc)
    note = f"topk_ratio={ratio:.4f} ({kk} of {n} blocks + diagonal +-1), tail={'on' if tail else 'off'}"
    extra = {"topk_ratio": ratio, "blocks": kk, "n_blocks": n, "tail": tail, "call_ms": call_ms}
    return SparseResult(name, out, kept, attention_recall(kept), density_real, note=note, extra=extra)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _to_sol_layout(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[B, H, S, D]`` -> contiguous ``(B, S, H, 128)`` in ``dtype``, zero-padding D up to 128."""
    x = x.transpose(1, 2).to(dtype)
    if x.shape[-1] < 128:
        x = torch.nn.functional.pad(x, (0, 128 - x.shape[-1]))
    return x.contiguous()
