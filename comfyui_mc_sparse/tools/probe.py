"""The MC-Sparse Probe's computation: per block, MC-Sparse and its baselines scored against exact dense attention.

For one block's self-attention ``q, k, v`` ``[B, H, S, D]`` at the probe step (the *anchor*) and, later, the same
block's ``q', k', v'`` at a *reuse* step, the probe reports (MC-Sparse, arXiv 2610.06801, sec. 2 metrics):

- ``MC-Sparse anchor w/o residual``: Fast PDDP groups + exact top-K selection (``attention.anchor_attention``,
  the pack's own anchor step) at the anchor, without the residual: how good the selection is;
- ``MC-Sparse anchor``: the same plus the residual. Equal to dense by construction (R = O_dense - O_sparse);
  its error is the residual's storage rounding (a check, not a measurement);
- ``MC-Sparse reuse w/o residual`` / ``MC-Sparse reuse``: the anchor's cached groups, indices (and residual)
  over the reuse step's own q', k', v' (``attention.reuse_attention``'s arithmetic): what the Patch outputs;
- ``vanilla BSA``: mean-pooled block scores (``diagnostics.bsa_selection``), at the anchor;
- ``token oracle``: blocks of C consecutive queries keep their top-K keys by summed exact mass, at the anchor;
- ``per-query oracle``: every query keeps its own top-K keys, at the anchor (on ``oracle_queries`` evenly
  spaced queries per head; all queries when 0 or >= S).

Metrics: attention recall = mean over queries of the kept exact mass; relative L1 = ``||O - O_dense||_1 /
||O_dense||_1`` over all elements (per head too). K = ``selection.keys_for_density(density, S, kv_tile)``.

Two implementations with one output type (``MethodScore``):

* ``anchor_scores`` / ``reuse_scores``: the fast path the ComfyUI node runs. Every selection is scored with
  ``kernels.sparse_attention(..., return_lse=True)``: a query's kept mass is ``exp(LSE_kept - LSE_dense)``,
  so recall costs one sparse attention and never an S x S matrix. The per-query oracle forms exact
  probabilities for chunks of sampled query rows only (``_ROW_CHUNK_BYTES`` at a time). Memory stays that of a
  few attention outputs plus one ``[B, H, G, S]`` group-mass chunk inside ``select_kv``.
* ``exact_anchor_scores`` / ``exact_reuse_scores``: the pack's diagnostics (``tools/diagnostics.py``, chunked
  exact probabilities), for the CLI on captured tensors and for tests: the two must agree.

Everything runs on q's device; heads are independent, so callers pass any subset of heads.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

import torch

from ... import kernels
from ..attention import anchor_attention
from ..cache import CacheEntry
from ..config import GROUP_SIZES, MCSparseConfig
from ..selection import keys_for_density

MC_ANCHOR_NO_RES = "MC-Sparse anchor w/o residual"
MC_ANCHOR = "MC-Sparse anchor"
MC_REUSE_NO_RES = "MC-Sparse reuse w/o residual"
MC_REUSE = "MC-Sparse reuse"
BSA = "vanilla BSA"
TOKEN_ORACLE = "token oracle"
QUERY_ORACLE = "per-query oracle"

METHODS = (MC_REUSE, MC_REUSE_NO_RES, MC_ANCHOR_NO_RES, MC_ANCHOR, BSA, TOKEN_ORACLE, QUERY_ORACLE)
"""Every row the probe reports, in table / plot order."""

SHORT = {MC_REUSE: "MC reuse", MC_REUSE_NO_RES: "MC reuse-R", MC_ANCHOR_NO_RES: "MC anchor-R", MC_ANCHOR: "MC anchor",
         BSA: "BSA", TOKEN_ORACLE: "token orc", QUERY_ORACLE: "query orc"}
"""Column names of the text table (``-R``: without the residual)."""

_ROW_CHUNK_BYTES = 1 << 26  # fp32 scores of the per-query oracle's sampled rows per chunk: 64 MiB


@dataclass(frozen=True)
class ProbeSettings:
    """What the probe measures.

    Attributes:
        density: s in (0, 1], the fraction of keys every method keeps (K = keys_for_density(s, S, kv_tile)).
        group_size: C in {64, 128}: MC-Sparse's query groups and BSA's / the token oracle's query blocks.
        kv_tile: K is rounded up to it; BSA's KV block (>= 1).
        power_iters: Fast PDDP power-iteration steps (MC-Sparse's default 8).
        oracle_queries: queries per (batch, head) the per-query oracle is evaluated on, evenly spaced; 0 = all.
        backend: kernel backend for the fast path ("auto", "torch", "triton", ...).
    Raises:
        ValueError: a field out of range (the message names it).
    """

    density: float = 0.2
    group_size: int = 128
    kv_tile: int = 64
    power_iters: int = 8
    oracle_queries: int = 512
    backend: str = "auto"

    def __post_init__(self):
        if isinstance(self.density, bool) or not isinstance(self.density, (int, float)) or not 0.0 < self.density <= 1.0:
            raise ValueError(f"density must be a number in (0, 1], got {self.density!r}")
        if self.group_size not in GROUP_SIZES:
            raise ValueError(f"group_size (query tile C) must be one of {GROUP_SIZES}, got {self.group_size!r}")
        for name, low in (("kv_tile", 1), ("power_iters", 1), ("oracle_queries", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")

    def config(self) -> MCSparseConfig:
        """The MC-Sparse configuration of the probed anchor (residual on, stored as the pack stores it)."""
        return MCSparseConfig(density=self.density, group_size=self.group_size, kv_tile=self.kv_tile, warmup_steps=0,
                              anchor_steps=(0,), power_iters=self.power_iters)


@dataclass
class MethodScore:
    """One method on one block.

    Attributes:
        method: one of ``METHODS``.
        recall: attention recall in [0, 1] (mean kept exact mass over queries, batch and heads).
        rel_l1: output relative L1 against dense attention (>= 0, unitless).
        density: realized density, kept (query, key) pairs / S^2, mean over batch and heads.
        recall_per_head, rel_l1_per_head: the same per head (in the order of the heads given).
        note: how the row was measured when it differs from the others (e.g. sampled queries).
    """

    method: str
    recall: float
    rel_l1: float
    density: float
    recall_per_head: list[float] = field(default_factory=list)
    rel_l1_per_head: list[float] = field(default_factory=list)
    note: str = ""


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise ValueError unless q, k, v are one-shape ``[B, H, S, D]`` float tensors on one device, finite."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or not t.is_floating_point():
            raise ValueError(f"{name} must be a float [B, H, S, D] tensor, got {getattr(t, 'shape', type(t).__name__)}")
    if not (q.shape == k.shape == v.shape) or not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must share shape, dtype and device, got {tuple(q.shape)} {q.dtype} {q.device}, "
                         f"{tuple(k.shape)} {k.dtype} {k.device}, {tuple(v.shape)} {v.dtype} {v.device}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{name} must be finite, got NaN or inf values")


def _scale(q: torch.Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def _rel_l1_per_head(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, list[float]]:
    """Overall and per-head ``||out - ref||_1 / ||ref||_1`` in float64 (``[B, H, S, D]`` inputs)."""
    diff = (out.double() - ref.double()).abs().sum(dim=(0, 2, 3))  # [H]
    norm = ref.double().abs().sum(dim=(0, 2, 3))
    return float(diff.sum() / norm.sum().clamp_min(1e-300)), (diff / norm.clamp_min(1e-300)).tolist()


def _recall_per_head(kept: torch.Tensor) -> tuple[float, list[float]]:
    """Overall and per-head mean of the kept mass ``[B, H, S]`` (float64)."""
    k = kept.double()
    return float(k.mean()), k.mean(dim=(0, 2)).tolist()


def _selection_density(perm: torch.Tensor, kv_idx: torch.Tensor, S: int) -> float:
    """Kept (query, key) pairs / S^2 of a (perm, kv_idx) selection, mean over batch and heads."""
    B, H, G, _ = kv_idx.shape
    keys = (kv_idx >= 0).sum(-1, dtype=torch.int64)  # [B, H, G]
    queries = (perm.reshape(B, H, G, -1) >= 0).sum(-1, dtype=torch.int64)
    return float((keys * queries).sum()) / (B * H * S * S)


def token_order_groups(B: int, H: int, S: int, group_size: int, device) -> torch.Tensor:
    """int32 ``[B, H, ceil(S/C)*C]``: blocks of C consecutive queries (identity order), -1 padding."""
    G = -(-S // group_size)
    perm = torch.full((G * group_size,), -1, dtype=torch.int32, device=device)
    perm[:S] = torch.arange(S, dtype=torch.int32, device=device)
    return perm.expand(B, H, -1).contiguous()


def score_selection(q, k, v, perm, kv_idx, dense_out, dense_lse, *, method: str, scale: float | None = None,
                    residual: torch.Tensor | None = None, backend: str = "auto") -> MethodScore:
    """Score a (perm, kv_idx) selection against dense attention with one sparse attention call.

    Args:
        q, k, v: ``[B, H, S, D]``. perm: int32 ``[B, H, G*C]``; kv_idx: int32 ``[B, H, G, K_alloc]`` (kernel layout).
        dense_out, dense_lse: ``kernels.dense_attention(q, k, v, return_lse=True)`` of the same q, k, v.
        residual: optional ``[B, H, S, D]`` added to the sparse output (in fp32, then cast to q's dtype).
    Returns:
        ``MethodScore``; recall from ``exp(LSE_kept - LSE_dense)`` per query (the kept share of the softmax sum).
    """
    out, lse = kernels.sparse_attention(q, k, v, perm, kv_idx, scale=_scale(q, scale), return_lse=True, backend=backend)
    if residual is not None:
        out = (out.float() + residual.float()).to(q.dtype)
    recall, recall_h = _recall_per_head(torch.exp(lse.float() - dense_lse.float()))
    rel, rel_h = _rel_l1_per_head(out, dense_out)
    return MethodScore(method, recall, rel, _selection_density(perm, kv_idx, q.shape[2]), recall_h, rel_h)


def sampled_rows(S: int, count: int, device) -> torch.Tensor:
    """int64 ``[n]``: ``count`` evenly spaced query indices in [0, S) (all S when count is 0 or >= S)."""
    if count <= 0 or count >= S:
        return torch.arange(S, device=device)
    return torch.unique(torch.linspace(0, S - 1, count, device=device).round().long())


def per_query_oracle_scores(q, k, v, dense_out, dense_lse, num_keys: int, rows: torch.Tensor, *,
                            scale: float | None = None) -> MethodScore:
    """Per-query oracle on the query ``rows``: each keeps its own top-``num_keys`` keys by exact probability.

    Exact probabilities ``exp(q.k * scale - LSE_dense)`` are formed for chunks of rows only (fp32, at most
    ``_ROW_CHUNK_BYTES``), per (batch, head); the output is the softmax over the kept keys, cast to q's dtype.
    Recall and relative L1 are over the sampled rows (an estimate of the all-query values when rows < S).
    """
    B, H, S, D = q.shape
    sc = _scale(q, scale)
    n = rows.numel()
    chunk = max(1, _ROW_CHUNK_BYTES // (4 * S))
    kept = torch.empty(B, H, n, dtype=torch.float64, device=q.device)
    diff = torch.zeros(H, dtype=torch.float64, device=q.device)
    norm = torch.zeros(H, dtype=torch.float64, device=q.device)
    for b in range(B):
        for h in range(H):
            kf, vf = k[b, h].float(), v[b, h].float()  # [S, D]
            for r0 in range(0, n, chunk):
                r = rows[r0 : r0 + chunk]
                p = torch.exp(q[b, h, r].float() @ kf.T * sc - dense_lse[b, h, r].float().unsqueeze(-1))  # [r, S]
                top = torch.topk(p, num_keys, dim=-1, sorted=False)
                mass = top.values.sum(-1)  # [r]
                o = torch.zeros_like(p).scatter_(-1, top.indices, top.values) @ vf / mass.clamp_min(1e-30).unsqueeze(-1)
                ref = dense_out[b, h, r].double()
                diff[h] += (o.to(q.dtype).double() - ref).abs().sum()
                norm[h] += ref.abs().sum()
                kept[b, h, r0 : r0 + r.numel()] = mass.double()
    recall, recall_h = _recall_per_head(kept)
    note = "" if n == S else f"on {n} of {S} queries per head (evenly spaced)"
    return MethodScore(QUERY_ORACLE, recall, float(diff.sum() / norm.sum().clamp_min(1e-300)),
                       num_keys / S, recall_h, (diff / norm.clamp_min(1e-300)).tolist(), note)


def anchor_scores(q, k, v, settings: ProbeSettings, *, scale: float | None = None
                  ) -> tuple[dict[str, MethodScore], CacheEntry]:
    """The probe at the anchor step of one block (fast path).

    Args:
        q, k, v: ``[B, H, S, D]`` self-attention inputs (fp16 / bf16 / fp32; head dim 64 or 128 for MC-Sparse).
        settings: density, C, KV tile, per-query oracle sampling, backend. scale: None = 1/sqrt(D).
    Returns:
        ({method: MethodScore} for the anchor rows, MC-Sparse's ``CacheEntry`` (perm, kv_idx, residual) for
        ``reuse_scores``).
    Raises:
        ValueError: bad inputs (``check_qkv``, ``attention.check_inputs``).
    """
    from . import diagnostics

    check_qkv(q, k, v)
    B, H, S, _ = q.shape
    backend = settings.backend
    sc = _scale(q, scale)
    dense_out, dense_lse = kernels.dense_attention(q, k, v, scale=sc, return_lse=True, backend=backend)
    _, entry = anchor_attention(q, k, v, settings.config(), scale=sc, backend=backend, check_finite=False)
    scores = {
        MC_ANCHOR_NO_RES: score_selection(q, k, v, entry.perm, entry.kv_idx, dense_out, dense_lse, method=MC_ANCHOR_NO_RES,
                                          scale=sc, backend=backend),
        MC_ANCHOR: score_selection(q, k, v, entry.perm, entry.kv_idx, dense_out, dense_lse, method=MC_ANCHOR, scale=sc,
                                   residual=entry.residual, backend=backend),
    }
    perm, kv_idx = diagnostics.bsa_selection(q, k, settings.density, group_size=settings.group_size,
                                             kv_tile=settings.kv_tile)
    scores[BSA] = score_selection(q, k, v, perm, kv_idx, dense_out, dense_lse, method=BSA, scale=sc, backend=backend)
    num_keys = keys_for_density(settings.density, S, settings.kv_tile)
    perm = token_order_groups(B, H, S, settings.group_size, q.device)
    kv_idx = kernels.select_kv(q, k, dense_lse, perm, num_keys, group_size=settings.group_size, kv_tile=settings.kv_tile,
                               scale=sc, backend=backend)
    scores[TOKEN_ORACLE] = score_selection(q, k, v, perm, kv_idx, dense_out, dense_lse, method=TOKEN_ORACLE, scale=sc,
                                           backend=backend)
    del perm, kv_idx
    scores[QUERY_ORACLE] = per_query_oracle_scores(q, k, v, dense_out, dense_lse, num_keys,
                                                   sampled_rows(S, settings.oracle_queries, q.device), scale=sc)
    return scores, entry


def reuse_scores(q, k, v, entry: CacheEntry, settings: ProbeSettings, *, scale: float | None = None
                 ) -> dict[str, MethodScore]:
    """The probe at a reuse step of one block (fast path): the anchor's cached selection over this step's q, k, v,
    with and without the cached residual.

    Args:
        q, k, v: ``[B, H, S, D]`` of the reuse step (same shape as at the anchor). entry: from ``anchor_scores``
        (on q's device; see ``PackedEntry`` to keep it elsewhere in between).
    Raises:
        ValueError: bad inputs or an entry of another shape.
    """
    check_qkv(q, k, v)
    if tuple(entry.shape) != tuple(q.shape):
        raise ValueError(f"entry must come from the anchor of the same block and shape, got {entry.shape} for q {tuple(q.shape)}")
    sc = _scale(q, scale)
    backend = settings.backend
    dense_out, dense_lse = kernels.dense_attention(q, k, v, scale=sc, return_lse=True, backend=backend)
    return {
        MC_REUSE_NO_RES: score_selection(q, k, v, entry.perm, entry.kv_idx, dense_out, dense_lse, method=MC_REUSE_NO_RES,
                                         scale=sc, backend=backend),
        MC_REUSE: score_selection(q, k, v, entry.perm, entry.kv_idx, dense_out, dense_lse, method=MC_REUSE, scale=sc,
                                  residual=entry.residual, backend=backend),
    }


# --- the same rows through the pack's diagnostics (exact, chunked probabilities) --------------------------------

def _from_result(method: str, result, dense_out) -> MethodScore:
    result.with_rel_l1(dense_out)
    recall, recall_h = _recall_per_head(result.kept_mass)
    rel, rel_h = _rel_l1_per_head(result.out, dense_out)
    return MethodScore(method, recall, rel, result.density, recall_h, rel_h)


def exact_anchor_scores(q, k, v, settings: ProbeSettings, *, scale: float | None = None,
                        max_prob_bytes: int | None = None) -> tuple[dict[str, MethodScore], CacheEntry]:
    """``anchor_scores`` computed by ``tools/diagnostics.py`` (exact probabilities in chunks; every query of the
    per-query oracle). MC-Sparse's selection comes from the same ``attention.anchor_attention`` call.

    Raises: ValueError above the diagnostics' size limit (``diagnostics.check_size``; ``max_prob_bytes``).
    """
    from . import diagnostics

    check_qkv(q, k, v)
    limit = {} if max_prob_bytes is None else {"max_prob_bytes": max_prob_bytes}
    sc = _scale(q, scale)
    s, C, tile = settings.density, settings.group_size, settings.kv_tile
    dense_out, _ = diagnostics.dense_reference(q, k, v, scale=sc)
    _, entry = anchor_attention(q, k, v, settings.config(), scale=sc, backend=settings.backend, check_finite=False)
    rows = {
        MC_ANCHOR_NO_RES: diagnostics.evaluate_selection(q, k, v, entry.perm, entry.kv_idx, scale=sc, **limit),
        MC_ANCHOR: diagnostics.evaluate_selection(q, k, v, entry.perm, entry.kv_idx, residual=entry.residual, scale=sc,
                                                  **limit),
        BSA: diagnostics.vanilla_bsa(q, k, v, s, group_size=C, kv_tile=tile, scale=sc, **limit),
        TOKEN_ORACLE: diagnostics.token_oracle(q, k, v, s, group_size=C, kv_tile=tile, scale=sc, **limit),
        QUERY_ORACLE: diagnostics.per_query_oracle(q, k, v, s, kv_tile=tile, scale=sc, **limit),
    }
    return {m: _from_result(m, r, dense_out) for m, r in rows.items()}, entry


def exact_reuse_scores(q, k, v, entry: CacheEntry, settings: ProbeSettings, *, scale: float | None = None,
                       max_prob_bytes: int | None = None) -> dict[str, MethodScore]:
    """``reuse_scores`` computed by ``tools/diagnostics.py`` (``evaluate_selection`` with the cached selection)."""
    from . import diagnostics

    check_qkv(q, k, v)
    limit = {} if max_prob_bytes is None else {"max_prob_bytes": max_prob_bytes}
    sc = _scale(q, scale)
    dense_out, _ = diagnostics.dense_reference(q, k, v, scale=sc)
    rows = {
        MC_REUSE_NO_RES: diagnostics.evaluate_selection(q, k, v, entry.perm, entry.kv_idx, scale=sc, **limit),
        MC_REUSE: diagnostics.evaluate_selection(q, k, v, entry.perm, entry.kv_idx, residual=entry.residual, scale=sc,
                                                 **limit),
    }
    return {m: _from_result(m, r, dense_out) for m, r in rows.items()}


# --- keeping an anchor's selection between the anchor and the reuse step -----------------------------------------

@dataclass
class PackedEntry:
    """An MC-Sparse ``CacheEntry`` stored compactly (on the CPU by default) until the reuse step.

    The selection is kept as a bitmask (S bits per query group instead of K int32 indices: 6x smaller at 20 %
    density), the residual in its own dtype. ``nbytes`` is what it holds.
    """

    perm: torch.Tensor  # int32 [B, H, G*C]
    bits: torch.Tensor  # uint8 [B, H, G, ceil(S/8)]
    k_alloc: int
    residual: torch.Tensor | None
    num_keys: int
    shape: tuple

    @property
    def nbytes(self) -> int:
        """Bytes held (perm + bitmask + residual)."""
        res = self.residual.numel() * self.residual.element_size() if self.residual is not None else 0
        return self.perm.numel() * 4 + self.bits.numel() + res

    @staticmethod
    def pack(entry: CacheEntry, device="cpu") -> PackedEntry:
        """Compact ``entry`` and move it to ``device``."""
        S = entry.shape[2]
        B, H, G, k_alloc = entry.kv_idx.shape
        idx = entry.kv_idx.long()
        mask = torch.zeros(B, H, G, S + 1, dtype=torch.bool, device=idx.device)
        mask.scatter_(-1, torch.where(idx < 0, S, idx), True)  # -1 slots land in the dropped column S
        residual = entry.residual.to(device) if entry.residual is not None else None
        return PackedEntry(entry.perm.to(device), _packbits(mask[..., :S]).to(device), k_alloc, residual,
                           entry.num_keys, tuple(entry.shape))

    def unpack(self, device) -> CacheEntry:
        """The ``CacheEntry`` on ``device`` (kv_idx sorted ascending with -1 padding, as ``select_kv`` returns it)."""
        S = self.shape[2]
        B, H, G, _ = self.bits.shape
        pos = torch.arange(S, dtype=torch.int32, device=device)
        kv_idx = torch.empty(B, H, G, self.k_alloc, dtype=torch.int32, device=device)
        for h in range(H):  # one head at a time: the sort's temporaries are [B, G, S]
            mask = _unpackbits(self.bits[:, h].to(device), S)  # [B, G, S]
            idx = torch.where(mask, pos, S).sort(dim=-1).values[..., : self.k_alloc]  # real indices first, ascending
            kv_idx[:, h] = torch.where(idx >= S, -1, idx)
        residual = self.residual.to(device) if self.residual is not None else None
        return CacheEntry(perm=self.perm.to(device), kv_idx=kv_idx, residual=residual, num_keys=self.num_keys,
                          shape=self.shape)


_BIT_WEIGHTS = (1, 2, 4, 8, 16, 32, 64, 128)


def _packbits(mask: torch.Tensor) -> torch.Tensor:
    """bool ``[..., S]`` -> uint8 ``[..., ceil(S/8)]`` (bit j of byte i = element 8i + j)."""
    S = mask.shape[-1]
    pad = -S % 8
    m = torch.nn.functional.pad(mask.to(torch.uint8), (0, pad)).reshape(*mask.shape[:-1], -1, 8)
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=mask.device)
    return (m * weights).sum(-1, dtype=torch.uint8)


def _unpackbits(bits: torch.Tensor, S: int) -> torch.Tensor:
    """uint8 ``[..., ceil(S/8)]`` -> bool ``[..., S]`` (inverse of ``_packbits``)."""
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=bits.device)
    return ((bits.unsqueeze(-1) & weights) != 0).reshape(*bits.shape[:-1], -1)[..., :S]


# --- the report ------------------------------------------------------------------------------------------------

@dataclass
class BlockReport:
    """All rows of one block. ``step`` / ``reuse_step`` are 0-based within the sampler call (None: not reached)."""

    block: int
    heads: list[int]
    tokens: int
    step: int
    reuse_step: int | None = None
    scores: dict[str, MethodScore] = field(default_factory=dict)
    seconds: float = 0.0
    note: str = ""

    def worst_key(self) -> float:
        """The error the table sorts by: MC-Sparse's reuse output (with residual), else its anchor selection."""
        for method in (MC_REUSE, MC_ANCHOR_NO_RES):
            if method in self.scores:
                return self.scores[method].rel_l1
        return -1.0


@dataclass
class ProbeReport:
    """The probe's result for one sampler call: one ``BlockReport`` per probed block, plus context lines."""

    settings: ProbeSettings
    blocks: list[BlockReport] = field(default_factory=list)
    header: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def methods(self) -> list[str]:
        """The methods present in any block, in ``METHODS`` order."""
        seen = {m for b in self.blocks for m in b.scores}
        return [m for m in METHODS if m in seen]

    def table(self, per_head: bool = False) -> str:
        """The report as text: header, rel L1 and recall tables (worst blocks first), mean row, notes."""
        methods = self.methods()
        lines = list(self.header)
        s = self.settings
        lines.append(f"density {s.density:g}, query tile C={s.group_size}, KV tile {s.kv_tile}; probe time "
                     f"{self.seconds:.1f} s over {len(self.blocks)} blocks")
        order = sorted(self.blocks, key=lambda b: -b.worst_key())
        for title, attr, fmt in (("relative L1 of the output vs dense (lower is better), worst blocks first", "rel_l1",
                                  "{:.4f}"),
                                 ("attention recall (kept exact mass, higher is better)", "recall", "{:.4f}")):
            lines.append(title + ":")
            lines.append("  " + "block".rjust(5) + "".join(SHORT[m].rjust(12) for m in methods) + "   time")
            for b in order:
                cells = "".join((fmt.format(getattr(b.scores[m], attr)) if m in b.scores else "-").rjust(12)
                                for m in methods)
                lines.append(f"  {b.block:5d}{cells}  {b.seconds:5.2f}s")
            means = "".join((fmt.format(self.mean(m, attr)) if self.mean(m, attr) == self.mean(m, attr) else "-").rjust(12)
                            for m in methods)
            lines.append("  " + "mean".rjust(5) + means)
        dens = ", ".join(f"{SHORT[m]} {self.mean(m, 'density'):.3f}" for m in methods)
        lines.append(f"realized density (kept pairs / S^2): {dens}")
        if per_head:
            lines.append("per head, relative L1 of MC-Sparse (reuse with residual where measured), worst heads first:")
            for b in order:
                method = MC_REUSE if MC_REUSE in b.scores else MC_ANCHOR_NO_RES
                if method not in b.scores:
                    continue
                pairs = sorted(zip(b.heads, b.scores[method].rel_l1_per_head), key=lambda p: -p[1])
                lines.append(f"  block {b.block}: " + ", ".join(f"h{h} {e:.4f}" for h, e in pairs))
        notes = list(self.notes)
        for m in methods:
            for b in self.blocks:
                if m in b.scores and b.scores[m].note:
                    notes.append(f"{m}: {b.scores[m].note}")
                    break
        lines.extend(f"note: {n}" for n in dict.fromkeys(notes))
        lines.extend(f"note: block {b.block}: {b.note}" for b in self.blocks if b.note)
        return "\n".join(lines)

    def mean(self, method: str, attr: str) -> float:
        """Mean of ``attr`` of ``method`` over the blocks that have it (NaN when none)."""
        values = [getattr(b.scores[method], attr) for b in self.blocks if method in b.scores]
        return sum(values) / len(values) if values else float("nan")

    def to_json(self) -> dict:
        """Plain data (settings, header, notes, seconds, blocks with every score)."""
        return {"settings": asdict(self.settings), "header": self.header, "notes": self.notes, "seconds": self.seconds,
                "blocks": [asdict(b) for b in self.blocks]}


class Stopwatch:
    """Wall time of GPU work: synchronises the device at start and stop (the probe is not a hot path)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._sync()
        self.start = time.perf_counter()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def seconds(self) -> float:
        """Seconds since construction."""
        self._sync()
        return time.perf_counter() - self.start


def plot_report(report: ProbeReport, *, width: int = 960, height: int = 540) -> torch.Tensor:
    """Per-block relative L1 vs block index, one line per method: a ComfyUI IMAGE ``[1, height, width, 3]`` in [0, 1]
    (``plot.line_plot``). An empty report gives the axes and the title only."""
    from .plot import line_plot

    blocks = sorted(report.blocks, key=lambda b: b.block)
    xs = [b.block for b in blocks]
    series = {m: [b.scores[m].rel_l1 if m in b.scores else float("nan") for b in blocks] for m in report.methods()}
    title = f"MC-Sparse probe: rel L1 vs dense per block, density {report.settings.density:g}"
    return line_plot(xs, series, title=title, x_label="block index", y_label="relative L1", width=width, height=height)
