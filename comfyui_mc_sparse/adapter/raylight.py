"""MC-Sparse inside raylight's sequence-parallel workers (xDiT Ulysses), one Ray actor per GPU.

raylight (github komikndr/raylight) runs a ComfyUI model in one Ray actor per GPU. Its Wan path splits the
token sequence across the Ulysses group; xDiT's long-context attention swaps sequence for heads with an
all-to-all, calls ``ring_attn_fn`` on the **full sequence and this rank's heads** ``[B, S, H/N, D]``, and swaps
back. raylight's inner-attention registry (``src/raylight/distributed_modules/inner_attention/``) replaces that
``ring_attn_fn`` with a dispatcher: when ``transformer_options["raylight_inner_attention"]`` holds a processor
(``set_inner_attention``), the dispatcher calls ``processor(dense, q, k, v, *, transformer_options, **kwargs)``
instead, where ``dense(q, k, v, **kwargs)`` is xDiT's own attention and kwargs are xDiT's (``softmax_scale``,
``causal``, ``dropout_p``, ``window_size``, ``joint_tensor_key``, ...). A processor without
``supports_ring = True`` is refused when the ring degree is above 1.

MC-Sparse is per head (groups, selections and residual are computed head by head), so on the full sequence with
a slice of the heads it is exactly the one-GPU algorithm restricted to those heads: each rank's output equals
the one-GPU MC-Sparse output's same heads (``tests/test_raylight.py``). Ring attention splits the *keys* across
ranks; a top-K over one rank's share of the keys is a different selection (and the residual would need the
ring's merged LSE), so ring degrees above 1 are refused (``RING_REFUSAL``).

Per rank (each Ray actor is its own process): ``apply_mc_sparse_raylight`` installs, on the actor's model,

* ``MCSparseInnerAttention`` as raylight's inner attention (registered as ``PROCESSOR_NAME``);
* an OUTER_SAMPLE wrapper: a ``lifecycle.RunState`` per sampler call (the step from the sigmas, the pay-off check
  and the cache plan as on one GPU, the plan for this rank's heads), whose summary is gathered from every rank and
  logged once, by rank 0 (``report_across_ranks``);
* a DIFFUSION_MODEL wrapper that publishes this evaluation's transformer_options and installs
  ``forward_options_shim`` (raylight's Wan self-attention calls its xDiT attention without
  transformer_options, so the dispatcher would never see the processor there; the shim passes them).

Cache keys carry this rank's head slice (``kind`` "self@u<rank>/<degree>"), so ranks never share an entry even
when they share a process (tests). Only the Wan family goes sparse through raylight for now; other models'
calls run xDiT's dense attention and the summary says why. Nothing here imports raylight, xfuser or ray at
module level.
"""

from __future__ import annotations

import contextvars
import datetime
import itertools
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..config import HEAD_DIMS
from .lifecycle import HOLDER_KEY, MCSparsePatch, run_sampler_call
from .callsite import MARK_KEY, CallSite
from .override import RUN_KEY, _callers, _contained, _window_key, chunk_branches

logger = logging.getLogger(__name__)

PROCESSOR_NAME = "mc_sparse:mc_sparse"
"""Name of the processor in raylight's ``InnerAttentionRegistry``."""

INNER_ATTENTION_KEY = "raylight_inner_attention"
"""raylight's transformer_options key of the active inner-attention processor (``registry.py``)."""

WRAPPER_KEY = "mc_sparse_raylight"
OCCURRENCE_KEY = "mc_sparse_raylight_occurrences"
"""transformer_options key of a per-evaluation ``{block index: self-attention calls so far}`` dict (VACE blocks
reuse their main block's index; each repeat gets its own cache entry)."""

SUPPORTED_FAMILIES = ("wan",)

RING_REFUSAL = (
    "MC-Sparse cannot run with ring attention (raylight ring degree {ring} > 1): ring attention splits the keys "
    "across GPUs, and MC-Sparse's top-K selection over one GPU's share of the keys is a different (untested) "
    "algorithm. Use Ulysses only (Ulysses degree = number of GPUs per CFG group, ring degree 1) or remove the "
    "MC-Sparse Patch (Ray) node."
)

SUMMARY_TIMEOUT_S = 30.0

_EVAL_OPTIONS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("mc_sparse_raylight_options", default=None)
_RUN_SEQ = itertools.count()


@dataclass(frozen=True)
class HeadSlice:
    """This rank's place in the parallel groups: Ulysses ``rank`` of ``degree``, the ring degree, and its CFG group
    ``cfg_rank`` of ``cfg_degree`` (raylight's CFG parallelism, ``distributed_modules/cfg_utils.py``: each CFG group
    evaluates its 1 / cfg_degree of the batch's rows, in order; transformer_options are not split)."""

    rank: int = 0
    degree: int = 1
    ring: int = 1
    cfg_rank: int = 0
    cfg_degree: int = 1

    @property
    def tag(self) -> str:
        """Suffix of the cache key's ``kind``: "@u<rank>/<degree>"."""
        return f"@u{self.rank}/{self.degree}"


def xfuser_head_slice() -> HeadSlice:
    """This process's Ulysses rank and degree, ring degree and CFG rank and degree from xfuser's parallel state;
    ``HeadSlice()`` (one GPU) when xfuser is absent or its groups are not initialised."""
    try:
        from xfuser.core.distributed import (
            get_classifier_free_guidance_rank,
            get_classifier_free_guidance_world_size,
            get_ring_parallel_world_size,
            get_ulysses_parallel_rank,
            get_ulysses_parallel_world_size,
        )

        return HeadSlice(int(get_ulysses_parallel_rank()), int(get_ulysses_parallel_world_size()),
                         int(get_ring_parallel_world_size()), int(get_classifier_free_guidance_rank()),
                         int(get_classifier_free_guidance_world_size()))
    except Exception:  # ImportError, or the groups are not set up in this process
        return HeadSlice()


def rank_branches(options: dict, batch: int, head_slice: HeadSlice) -> tuple[list[str], str | None]:
    """``override.chunk_branches`` for this rank's ``batch`` rows: with CFG parallelism (``cfg_degree`` > 1) the
    options describe the whole batch (cfg_degree x batch rows) and this rank holds rows cfg_rank x batch onward,
    so it takes those rows' chunk identities (the reason when its rows do not cover whole chunks)."""
    degree = max(1, head_slice.cfg_degree)
    branches, why = chunk_branches(options, batch * degree)
    if why is not None or degree == 1:
        return branches, why
    per_chunk = batch * degree // len(branches)
    if batch % per_chunk:
        return [], f"raylight CFG rank {head_slice.cfg_rank}: its {batch} rows split conditioning chunks of {per_chunk}"
    first = head_slice.cfg_rank * batch // per_chunk
    return branches[first:first + batch // per_chunk], None


def check_ring(head_slice: HeadSlice) -> None:
    """Raise ``RuntimeError(RING_REFUSAL)`` when ``head_slice.ring > 1``."""
    if head_slice.ring > 1:
        raise RuntimeError(RING_REFUSAL.format(ring=head_slice.ring))


class MCSparseInnerAttention:
    """raylight inner-attention processor running MC-Sparse on this rank's heads (full sequence).

    Called by raylight's dispatcher as ``processor(dense, q, k, v, *, transformer_options, **kwargs)`` with q,
    k, v ``[B, S, H_local, D]`` (xDiT / flash layout, after the Ulysses all-to-all) and ``dense(q, k, v,
    **kwargs)`` xDiT's own attention. Returns ``[B, S, H_local, D]`` in q's dtype (a contiguous tensor), or
    whatever ``dense`` returns on the dense paths. The state lives in the ``RunState`` under
    ``transformer_options[RUN_KEY]`` (set by ``outer_sample_wrapper``); outside a run every call is dense.

    Args:
        head_slice_fn: ``() -> HeadSlice`` of the calling rank (default ``xfuser_head_slice``; tests pass one
            per simulated rank).
    """

    supports_ring = False

    def __init__(self, head_slice_fn: Callable[[], HeadSlice] | None = None):
        self.head_slice_fn = head_slice_fn or xfuser_head_slice

    def __call__(self, dense, q, k, v, *, transformer_options, **kwargs):
        options = transformer_options or {}
        run = options.get(RUN_KEY)
        if run is None:
            return dense(q, k, v, **kwargs)
        head_slice = self.head_slice_fn()
        if head_slice.ring > 1:  # raylight refuses first; never run a ring-split selection (a setup error: raised)
            raise RuntimeError(RING_REFUSAL.format(ring=head_slice.ring))
        marked = _callers(dense)
        # contained as the override's entry is: a bug here gives this call (and the rest of the run) xDiT's attention
        layer = options.get("block_index")
        where = {**options, MARK_KEY: CallSite(layer, "wan") if isinstance(layer, int) else None}  # for the summary
        return _contained(run, where,
                          lambda: self._dispatch(run, options, marked, head_slice, q, k, v, kwargs),
                          lambda: marked(q, k, v, **kwargs))

    def _dispatch(self, run, options: dict, dense, head_slice: HeadSlice, q, k, v, kwargs: dict):
        def fallback(reason: str):
            run.record_dense(reason)
            return dense(q, k, v, **kwargs)

        why = _unsupported_call(q, k, v, kwargs)
        if why is not None:
            return fallback(why)
        if run.runner is None:
            return fallback(run.dense_run_reason)
        layer = options.get("block_index")
        if not isinstance(layer, int):
            return fallback("raylight: no block index in transformer_options")
        batch, seq, heads, head_dim = q.shape
        if seq < run.settings.min_tokens:
            return fallback(f"fewer latent tokens ({seq}) than min tokens ({run.settings.min_tokens})")
        if head_dim not in HEAD_DIMS:
            return fallback(f"head dim {head_dim} not supported ({', '.join(map(str, HEAD_DIMS))})")
        step = run.step_of(options)  # once per model evaluation (steps.STEP_KEY / one read per sigmas tensor)
        if step is None:
            return fallback("no current sigma in transformer_options")
        seen = options.setdefault(OCCURRENCE_KEY, {})
        occurrence = seen.get(layer, 0)
        seen[layer] = occurrence + 1
        if run.kind(step, layer) == "dense":
            reason = "dense warm-up layer" if layer < run.config.warmup_layers else "dense warm-up step"
            return run.timed_dense(reason, (batch, heads, seq, head_dim), lambda: dense(q, k, v, **kwargs))

        branches, why = rank_branches(options, batch, head_slice)
        if why is not None:
            return fallback(why)
        window = _window_key(options.get("context_window"))
        kind = "self" + (f"#{occurrence}" if occurrence else "") + head_slice.tag
        dense_fn = _heads_first_dense(dense, kwargs)
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))  # [B, H_local, S, D] views
        out = torch.empty_like(q)  # [B, S, H_local, D], the layout xDiT expects back; the kernel writes its view
        run.sparse_call(qh, kh, vh, step=step, layer=layer, branches=branches, window=window, dense_fn=dense_fn,
                        scale=kwargs.get("softmax_scale"), kind=kind, out=out.transpose(1, 2))
        return out


def _unsupported_call(q, k, v, kwargs: dict) -> str | None:
    """Why this xDiT attention call must stay dense (None: MC-Sparse may run it)."""
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        return "raylight: q/k/v are not [B, S, H, D] tensors"
    if q.shape != k.shape or q.shape != v.shape:
        return "raylight: not self-attention (q/k/v shapes differ, e.g. cross-attention)"
    if kwargs.get("joint_tensor_key") is not None or kwargs.get("joint_tensor_value") is not None:
        return "raylight: joint text keys (xDiT joint strategy)"
    if kwargs.get("causal") or (kwargs.get("dropout_p") or 0.0) > 0.0 or kwargs.get("alibi_slopes") is not None:
        return "raylight: causal, dropout or ALiBi attention"
    window = kwargs.get("window_size")
    if window is not None and tuple(window) != (-1, -1):
        return "raylight: windowed (local) attention"
    if kwargs.get("return_attn_probs"):
        return "raylight: attention probabilities requested"
    return None


def _heads_first_dense(dense, kwargs: dict):
    """``(q, k, v) [B, H, S, D] -> [B, H, S, D]`` through xDiT's dense attention (for the runner's fallbacks)."""

    def dense_fn(q, k, v):
        out = dense(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **kwargs)
        if isinstance(out, tuple):  # some xDiT ring functions return (out, lse, ...)
            out = out[0]
        return out.transpose(1, 2)

    return dense_fn


# -- passing transformer_options to raylight's xDiT attention where its model code does not -----------------

def forward_options_shim(module) -> bool:
    """Wrap ``module.xfuser_optimized_attention`` (a raylight model module's xDiT attention) so a call without
    ``transformer_options`` gets the ones ``diffusion_model_wrapper`` published for this evaluation.

    raylight's Wan self-attention (``diffusion_models/wan/xdit_context_parallel.py``, ``usp_self_attn_forward``)
    calls ``xfuser_optimized_attention(q, k, v, heads=...)`` with no transformer_options, so raylight's
    dispatcher selects no processor there. The wrapper is looked up as a module global at call time, so
    replacing the attribute reaches every block. Idempotent; calls outside an evaluation are unchanged.

    Returns:
        True when the module's attention is (now) wrapped.
    """
    fn = getattr(module, "xfuser_optimized_attention", None)
    if fn is None:
        return False
    if getattr(fn, "mc_sparse_options_shim", False):
        return True

    def xfuser_attention_with_options(*args, **kwargs):
        if "transformer_options" not in kwargs:
            published = _EVAL_OPTIONS.get()
            if published is not None:
                kwargs["transformer_options"] = published
        return fn(*args, **kwargs)

    xfuser_attention_with_options.mc_sparse_options_shim = True
    xfuser_attention_with_options.wrapped = fn
    module.xfuser_optimized_attention = xfuser_attention_with_options
    return True


def _install_shims() -> None:
    """``forward_options_shim`` on every loaded raylight Wan module (cheap: a few dict lookups)."""
    for name in ("raylight.diffusion_models.wan.xdit_context_parallel",
                 "raylight.diffusion_models.wan.xdit_context_parallel_animate"):
        module = sys.modules.get(name)
        if module is not None:
            forward_options_shim(module)


def diffusion_model_wrapper(executor, *args, **kwargs):
    """DIFFUSION_MODEL: publish this evaluation's transformer_options (the dict raylight's forward fills with
    ``block_index``) for ``forward_options_shim``, with a fresh per-evaluation occurrence count.
    Args as ``WanModel._forward``: ``(x, timestep, context, clip_fea, time_dim_concat, transformer_options)``."""
    options = kwargs.get("transformer_options", args[5] if len(args) > 5 else None)
    if not isinstance(options, dict) or options.get(RUN_KEY) is None:
        return executor(*args, **kwargs)
    _install_shims()
    options[OCCURRENCE_KEY] = {}
    token = _EVAL_OPTIONS.set(options)
    try:
        return executor(*args, **kwargs)
    finally:
        _EVAL_OPTIONS.reset(token)


# -- one run per sampler call on each rank, one summary for all ranks ----------------------------------------

def outer_sample_wrapper(executor, *args, **kwargs):
    """OUTER_SAMPLE on one rank: ``lifecycle.run_sampler_call`` (a fresh ``RunState`` for this sampler call, its
    pay-off check and cache plan as on one GPU for this rank's share: the heads of its Ulysses degree, the
    conditioning branches of its CFG degree) without the attention override (the processor runs MC-Sparse here);
    the summary goes to ``report_across_ranks``."""
    share = xfuser_head_slice()
    return run_sampler_call(executor, args, kwargs, install=False, head_split=share.degree,
                            branch_split=share.cfg_degree,
                            report=lambda run: report_across_ranks(run.summary(), finished=run.interrupted_by is None))


def _default_group():
    """(rank, world size, c10d store) of the default process group, or None outside torch.distributed."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # private API: without it each rank logs its own summary
        store = None
    return dist.get_rank(), dist.get_world_size(), store


def report_across_ranks(text: str, *, finished: bool = True, group=None, run_id: int | None = None,
                        timeout_s: float = SUMMARY_TIMEOUT_S, log: logging.Logger | None = None) -> str | None:
    """Gather each rank's run summary and log them once, on rank 0.

    Every rank publishes its summary in the process group's key-value store (non-blocking); rank 0 waits at
    most ``timeout_s`` for each other rank's, then logs one combined text (rank 0's summary, then each other
    rank's first line and the lines rank 0's lacks). No collective is used, so a rank that failed or was
    interrupted can never hang the others. Without a process group (one GPU) the summary is logged as is.

    Args:
        text: this rank's ``RunState.summary()``. finished: False when the sampler call ended by an exception
            (logged as a warning). group: ``(rank, world, store)``; None = the default process group (tests pass
            a fake). run_id: the sampler call's number, equal on every rank (None: this process's count of
            reported runs; every rank runs the same sampler calls). log: logger (default this module's).
    Returns:
        The text rank 0 logged (None on other ranks).
    """
    log = log or logger
    level = logging.INFO if finished and "WARNING" not in text else logging.WARNING
    group = group if group is not None else _default_group()
    if group is None or group[1] <= 1:
        log.log(level, "%s", text)
        return text
    rank, world, store = group
    if store is None:
        log.log(level, "%s", f"[rank {rank}] {text}")
        return text if rank == 0 else None
    seq = next(_RUN_SEQ) if run_id is None else run_id
    key = f"mc_sparse/summary/{seq}/rank{{}}"
    if rank != 0:
        store.set(key.format(rank), text)
        return None
    parts = [text]
    for other in range(1, world):
        try:
            store.wait([key.format(other)], datetime.timedelta(seconds=timeout_s))
            got = store.get(key.format(other))
            parts.append(got.decode() if isinstance(got, bytes) else str(got))
            store.delete_key(key.format(other))
        except Exception as err:  # timeout or a store error: say so, never fail the run
            parts.append(f"MC-Sparse: no summary from this rank within {timeout_s:g} s ({type(err).__name__})")
    combined = combine_summaries(parts)
    if any("WARNING" in p for p in parts):
        level = logging.WARNING
    log.log(level, "%s", combined)
    return combined


def combine_summaries(parts: list[str]) -> str:
    """One text from per-rank summaries (index = rank): a header, rank 0's summary, then for each other rank its
    first line and any line rank 0's summary does not have."""
    base = parts[0].splitlines()
    lines = [f"MC-Sparse through raylight: {len(parts)} ranks (each its own heads of the full sequence)",
             "  rank 0: " + (base[0] if base else "")]
    lines.extend("  " + line for line in base[1:])
    known = set(base)
    for rank, text in enumerate(parts[1:], start=1):
        own = text.splitlines()
        lines.append(f"  rank {rank}: " + (own[0] if own else ""))
        lines.extend("    " + line.strip() for line in own[1:] if line not in known)
    return "\n".join(lines)


# -- the actor-side patch and the registry -------------------------------------------------------------------

def register_with_raylight() -> bool:
    """Register ``MCSparseInnerAttention`` as ``PROCESSOR_NAME`` in raylight's registry (idempotent).

    Returns:
        True when registered (now or before); False when raylight's inner-attention registry is not importable.
    """
    try:
        from raylight.distributed_modules.inner_attention import InnerAttentionRegistry, register_inner_attention
    except ImportError:
        return False
    if PROCESSOR_NAME not in InnerAttentionRegistry.available():
        register_inner_attention(PROCESSOR_NAME)(MCSparseInnerAttention)
    return True


def apply_mc_sparse_raylight(model, *, head_slice: HeadSlice | None = None, **settings):
    """Return a clone of one rank's ``ModelPatcher`` with MC-Sparse as raylight's inner attention.

    Args:
        model: the actor's ComfyUI ``ModelPatcher``.
        head_slice: this rank's ``HeadSlice`` (None: from xfuser's parallel state).
        settings: the MC-Sparse Patch node's inputs (``settings.build_settings``; same names).
    Returns:
        The patched clone (the original is not modified).
    Raises:
        RuntimeError: ring degree above 1 (``RING_REFUSAL``), or raylight's inner-attention registry missing.
        ValueError / TypeError: a bad setting, naming the input.
    """
    import comfy.patcher_extension as pe

    from .layouts import plan_for
    from .settings import build_settings

    check_ring(head_slice or xfuser_head_slice())
    built = build_settings(**settings)
    if not register_with_raylight():
        raise RuntimeError("MC-Sparse Patch (Ray): this raylight has no inner-attention registry "
                           "(raylight.distributed_modules.inner_attention); update raylight")
    from raylight.distributed_modules.inner_attention import create_inner_attention, set_inner_attention

    plan = plan_for(model.get_model_object("diffusion_model"))
    family, unsupported = plan.family, plan.reason_unsupported
    if unsupported is None and family not in SUPPORTED_FAMILIES:
        unsupported = f"model family {family} not supported through raylight yet"
    patched = set_inner_attention(model, create_inner_attention(PROCESSOR_NAME))
    options = patched.model_options.setdefault("transformer_options", {})
    options[HOLDER_KEY] = MCSparsePatch(built, family, unsupported)
    patched.remove_wrappers_with_key(pe.WrappersMP.OUTER_SAMPLE, WRAPPER_KEY)
    patched.remove_wrappers_with_key(pe.WrappersMP.DIFFUSION_MODEL, WRAPPER_KEY)
    patched.add_wrapper_with_key(pe.WrappersMP.OUTER_SAMPLE, WRAPPER_KEY, outer_sample_wrapper)
    patched.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, WRAPPER_KEY, diffusion_model_wrapper)
    if unsupported:
        logger.warning("MC-Sparse (raylight): %s; attention stays dense", unsupported)
    return patched
