"""The ``optimized_attention_override`` MC-Sparse installs, and the per-call dispatch behind it.

Contract (ComfyUI ``comfy/ldm/modules/attention.py`` L118-134, ``wrap_attn``): the override is called as
``override(func, q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
skip_output_reshape=False, **kwargs)`` where ``func`` is the raw backend and kwargs carry
``transformer_options`` and ``_inside_attn_wrapper`` (forwarded untouched to ``func`` / ``previous``).
Layouts: q/k/v ``(B, S, heads*D)``, or ``(B, heads, S, D)`` with ``skip_reshape``; the output ``(B, S, heads*D)``,
or ``(B, heads, S, D)`` with ``skip_output_reshape`` whatever ``skip_reshape`` is (as ComfyUI's backends return it,
``attention_pytorch`` / ``attention_basic`` in v0.3.64 and v0.33.0).

Dispatch of one call (``dispatch``): unmarked calls (cross-attention, token refiners, text encoders), calls
outside an MC-Sparse sampler run, masked non-joint calls, short sequences and unsupported shapes run dense
through ``previous`` (any override installed before ours) or ``func`` and are counted with their reason.
Dense warm-up steps/layers also go straight to ``previous``/``func`` on the whole batch, so they are bit-
identical to the unpatched model. Anchor and reuse steps split the batch into its conditioning chunks
(``cond_or_uncond`` / ``uuids``, ``comfy/samplers.py`` L321-323) and call ``MCSparseRunner.attention`` per
chunk with a cache key of (block, uuid, context window, shape), never the batch position.

Joint text+latent sequences (HunyuanVideo [video, text], Hunyuan3D 2.0 [cond, latent]): text *query* rows
are recomputed exactly (dense, cheap: text is a few hundred rows). Padded text tokens (the additive text mask
is -inf/-max there) are removed from the keys, which is exact since they carry zero probability. Latent query
rows: MC-Sparse over the latent keys plus all unmasked text keys exactly (``extra_kv`` of
``MCSparseRunner.attention``: the two parts are merged by their LSE). The run summary names the route.
A mask with other values than 0 / large-negative, or one not shared by the batch, makes the call dense.

The Python logic runs under ``torch.compiler.disable`` (dynamo would otherwise guard on it and recompile
every call, docs/comfyui.md).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
from collections.abc import Callable
from typing import Any

import torch

from ..config import HEAD_DIMS
from .callsite import LAYOUT_MISSING_KEY, MARK_KEY, TEXT_LEN_KEY, CallSite
from .steps import STEP_KEY

logger = logging.getLogger(__name__)

RUN_KEY = "mc_sparse_run"
"""transformer_options key of the active ``lifecycle.RunState`` (set by the OUTER_SAMPLE wrapper)."""

PROBE_RUN_KEY = "mc_sparse_probe_run"
"""transformer_options key of the active ``probe.ProbeRun`` (set by the MC-Sparse Probe's OUTER_SAMPLE wrapper)."""

CURRENT_OPTIONS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("mc_sparse_options", default=None)
"""transformer_options of the model evaluation in progress, published by the APPLY_MODEL wrapper for models
whose attention sees none (Hunyuan3D 2.1). Set and reset around each evaluation; None outside."""

NOT_SELF_ATTENTION = "not a marked self-attention call (cross-attention, token refiner, unsupported block)"
"""The dense reason of calls MC-Sparse never considers (the summary's sparse share leaves them out)."""

_MASK_NEG = -1e4  # additive mask entries at or below this count as "masked out" (ComfyUI uses -finfo.max)


def make_override(previous: Callable | None) -> Callable:
    """Build the override, chained to ``previous`` (the override that was installed before, or None).

    The returned function carries ``mc_sparse_override = True`` and ``previous`` attributes, so the
    installer can recognise itself and never stack two MC-Sparse layers.
    """

    @torch.compiler.disable
    def mc_sparse_attention_override(func, q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                                     skip_output_reshape=False, **kwargs):
        @_callers
        def call(q_, k_, v_, mask_, skip_reshape_, skip_output_reshape_):
            if previous is not None:
                return previous(func, q_, k_, v_, heads, mask=mask_, attn_precision=attn_precision,
                                skip_reshape=skip_reshape_, skip_output_reshape=skip_output_reshape_, **kwargs)
            return func(q_, k_, v_, heads, mask=mask_, attn_precision=attn_precision, skip_reshape=skip_reshape_,
                        skip_output_reshape=skip_output_reshape_, **kwargs)

        options = kwargs.get("transformer_options") or {}
        probe = options.get(PROBE_RUN_KEY)
        if probe is not None:  # the MC-Sparse Probe looks at the call first; it never changes it
            probe.observe(options.get(MARK_KEY), q, k, v, heads, skip_reshape=skip_reshape, options=options,
                          scale=kwargs.get("scale"))
        run = options.get(RUN_KEY)
        if run is None:
            return call(q, k, v, mask, skip_reshape, skip_output_reshape)
        return _contained(run, options, lambda: dispatch(
            run, options.get(MARK_KEY), q, k, v, heads, mask=mask, skip_reshape=skip_reshape,
            skip_output_reshape=skip_output_reshape, options=options, call=call, scale=kwargs.get("scale")),
            lambda: call(q, k, v, mask, skip_reshape, skip_output_reshape))

    mc_sparse_attention_override.mc_sparse_override = True
    mc_sparse_attention_override.previous = previous
    mc_sparse_attention_override.container_function = make_container_function(previous)
    return mc_sparse_attention_override


def make_container_function(previous: Callable | None) -> Callable:
    """The override's entry for ``AttentionTensorContainer`` inputs (ComfyUI v0.33.0).

    ``wrap_attn`` (v0.33.0 ``comfy/ldm/modules/attention.py`` L171-204) calls
    ``override.container_function(q, k, v, heads, ..., **kwargs)`` instead of the override, without the backend
    ``func``, when q/k/v arrive in containers (MiniMax-H3 passes ``[1, H, S, D]`` views of its qkv buffer).
    MC-Sparse calls read the tensors with ``peek()`` (no copy) and release them when done. Dense calls keep the
    container path, so a backend that frees its inputs early still can: ``previous.container_function`` when
    the override below ours has one (``ModelPatcher.set_model_optimized_attention`` copies the backend's,
    e.g. comfy-kitchen's), else ComfyUI's selected backend ``attention.optimized_attention`` called with the
    containers and ``_inside_attn_wrapper`` (so ``wrap_attn`` skips the overrides and uses the backend's own
    container path, or takes the tensors for it).
    """

    def backend() -> Callable:
        import comfy.ldm.modules.attention as attention

        return attention.optimized_attention

    @torch.compiler.disable
    def container_function(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                           skip_output_reshape=False, **kwargs):
        containers = (q, k, v)
        flags = {"mask": mask, "attn_precision": attn_precision, "skip_reshape": skip_reshape,
                 "skip_output_reshape": skip_output_reshape}

        def dense_containers():
            if previous is not None and getattr(previous, "container_function", None) is not None:
                return previous.container_function(*containers, heads, **flags, **kwargs)
            if previous is not None:
                return previous(backend(), *(c.take() for c in containers), heads, **flags, **kwargs)
            return backend()(*containers, heads, **flags, **kwargs)

        options = kwargs.get("transformer_options") or {}
        run = options.get(RUN_KEY)
        if run is None:
            return dense_containers()
        qt, kt, vt = (c.peek() for c in containers)

        @_callers
        def call(q_, k_, v_, mask_, skip_reshape_, skip_output_reshape_):
            same = q_ is qt and k_ is kt and v_ is vt and mask_ is mask
            if same and (skip_reshape_, skip_output_reshape_) == (skip_reshape, skip_output_reshape):
                return dense_containers()  # the whole call dense: the backend's own container path
            if previous is not None:
                return previous(backend(), q_, k_, v_, heads, mask=mask_, attn_precision=attn_precision,
                                skip_reshape=skip_reshape_, skip_output_reshape=skip_output_reshape_, **kwargs)
            return backend()(q_, k_, v_, heads, mask=mask_, attn_precision=attn_precision, skip_reshape=skip_reshape_,
                             skip_output_reshape=skip_output_reshape_, **kwargs)

        try:
            return _contained(run, options, lambda: dispatch(
                run, options.get(MARK_KEY), qt, kt, vt, heads, mask=mask, skip_reshape=skip_reshape,
                skip_output_reshape=skip_output_reshape, options=options, call=call, scale=kwargs.get("scale")),
                lambda: call(qt, kt, vt, mask, skip_reshape, skip_output_reshape))
        finally:
            for c in containers:  # single owner: drop our hold on the inputs as a consuming backend would
                if getattr(c, "tensor", None) is not None:
                    c.take()

    return container_function


def _callers(call: Callable) -> Callable:
    """``call`` (the caller's own attention: previous override or ComfyUI's backend) with its exceptions marked
    (``engine.CALLER_ERROR_ATTR``), so the pack's error containment lets them propagate instead of retrying them."""
    from ..engine import CALLER_ERROR_ATTR

    def marked(*args, **kwargs):
        try:
            return call(*args, **kwargs)
        except Exception as err:
            with contextlib.suppress(AttributeError):  # an exception type without a __dict__ stays unmarked
                setattr(err, CALLER_ERROR_ATTR, True)
            raise

    return marked


def _contained(run, options: dict, sparse: Callable, dense: Callable):
    """``sparse()`` (the pack's dispatch of one call); an unexpected error in it (a bug, ``engine.contains``) turns
    the rest of the run dense (logged with its traceback, noted in the summary) and this call runs ``dense()``."""
    from ..engine import contains

    try:
        return sparse()
    except Exception as err:
        if not contains(err):
            raise
        site = options.get(MARK_KEY)
        step = options.get(STEP_KEY)
        where = (f"step {step + 1} (1-based), " if isinstance(step, int) else "") + \
            (f"block {site.layer}" if site is not None else "an unmarked call")
        run.internal_error(err, where)
    run.record_dense("internal error; dense for the rest of the run")
    return dense()


def is_ours(fn: Any) -> bool:
    """True when ``fn`` is an override built by ``make_override``."""
    return bool(getattr(fn, "mc_sparse_override", False))


def install_override(transformer_options: dict) -> str | None:
    """Put our override on top of ``transformer_options["optimized_attention_override"]`` (idempotent).

    Returns None when ours was already on top or the slot was empty; otherwise a description of the
    foreign override that was found on top (it is chained as ``previous``), for a warning.
    """
    current = transformer_options.get("optimized_attention_override")
    if is_ours(current):
        return None
    transformer_options["optimized_attention_override"] = make_override(current)
    if current is None:
        return None
    return getattr(current, "__qualname__", None) or type(current).__name__


def _to_heads_first(t: torch.Tensor, heads: int, skip_reshape: bool) -> torch.Tensor:
    if skip_reshape:
        return t  # [B, H, S, D]
    b, s, hd = t.shape
    return t.view(b, s, heads, hd // heads).transpose(1, 2)  # [B, S, H*D] -> [B, H, S, D]


def _from_heads_first(t: torch.Tensor, skip_output_reshape: bool) -> torch.Tensor:
    if skip_output_reshape:
        return t  # caller wants [B, H, S, D]
    b, h, s, d = t.shape
    return t.transpose(1, 2).reshape(b, s, h * d)


def _window_key(window: Any) -> Any:
    """A hashable, step-stable identity of a context window (``comfy/context_windows.py`` L226)."""
    if window is None:
        return None
    index_list = getattr(window, "index_list", None)
    if index_list is not None:
        return ("window", tuple(int(i) for i in index_list))
    return ("window", repr(window))


def chunk_branches(options: dict, batch: int) -> tuple[list[str], str | None]:
    """Each conditioning chunk's identity in batch order (ComfyUI's ``uuids``, else ``cond_or_uncond=<n>``, the cache
    key's branch), and why the batch cannot be keyed per chunk (None: it can): it does not split evenly into the
    chunks, or two chunks carry one identity (their entries would collide: one chunk would reuse the other's
    selection and residual; e.g. two positive conditionings in one batch where no ``uuids`` are given)."""
    cond_or_uncond = list(options.get("cond_or_uncond") or [0])
    uuids = list(options.get("uuids") or [])
    chunks = len(cond_or_uncond)
    if batch % chunks:
        return [], f"batch {batch} does not split into {chunks} conditioning chunks"
    branches = [str(uuids[i]) if i < len(uuids) else f"cond_or_uncond={cond_or_uncond[i]}" for i in range(chunks)]
    if len(set(branches)) < chunks:
        return [], "two conditioning chunks of the batch share one identity (uuid): their cache entries would collide"
    return branches, None


def _keep_mask(run, mask: torch.Tensor | None, seq: int, latent: slice) -> tuple[torch.Tensor | None, str | None]:
    """Indices of keys to keep for a joint call with an additive (or bool) key mask, or a reason to go dense.

    Accepts masks that broadcast to ``(1, 1, [1,] S)`` (one mask for the whole batch, per key only). The blocks of
    one model evaluation share one mask tensor, so the answer is kept for that tensor (``run.mask_memo``): one
    host sync per evaluation, not per attention call.
    """
    if mask is None:
        return None, None
    memo = getattr(run, "mask_memo", None)
    if memo is not None and memo[0] is mask and memo[1] == (seq, latent.start, latent.stop):
        return memo[2]
    result = _analyse_mask(mask, seq, latent)
    run.mask_memo = (mask, (seq, latent.start, latent.stop), result)
    return result


def _analyse_mask(mask: torch.Tensor, seq: int, latent: slice) -> tuple[torch.Tensor | None, str | None]:
    """``_keep_mask`` without the memo: one host sync (the three checks and the kept count read at once)."""
    m = mask
    if m.dtype == torch.bool:
        m = torch.where(m, 0.0, float("-inf"))
    if m.shape[-1] != seq or any(d != 1 for d in m.shape[:-1]):
        return None, f"mask of shape {tuple(mask.shape)} is not one per-key mask for the batch"
    row = m.reshape(seq).float()
    masked = row <= _MASK_NEG
    other, latent_masked, n_masked = torch.stack(
        (((row != 0) & ~masked).any(), masked[latent].any(), masked.sum())).tolist()
    if other:
        return None, "mask holds values other than 0 and masked-out"
    if latent_masked:
        return None, "mask masks latent tokens"
    if not n_masked:
        return None, None
    return torch.nonzero_static(~masked, size=seq - int(n_masked)).flatten(), None


def dispatch(run, site: CallSite | None, q, k, v, heads: int, *, mask, skip_reshape: bool, skip_output_reshape: bool,
             options: dict, call: Callable, scale: float | None = None):
    """Run one attention call dense or through MC-Sparse and return it in the caller's output layout.

    Args:
        run: the active ``lifecycle.RunState``.
        site: the ``CallSite`` mark of a self-attention call, or None (unmarked: dense).
        q, k, v: as ComfyUI passed them (see the module docstring for layouts).
        heads: number of heads H.
        call: ``(q, k, v, mask, skip_reshape, skip_output_reshape) -> out``, the dense path (previous or func).
        scale: softmax scale if the caller passed one, else 1/sqrt(D).
    """

    def dense(reason: str):
        run.record_dense(reason)
        return call(q, k, v, mask, skip_reshape, skip_output_reshape)

    if site is None:
        return dense(NOT_SELF_ATTENTION)
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return dense(f"q/k/v arrive as {type(q).__name__}, not tensors (AttentionTensorContainer)")
    if q.shape != k.shape or q.shape != v.shape:
        return dense(f"q/k/v shapes differ ({tuple(q.shape)} / {tuple(k.shape)} / {tuple(v.shape)})")
    if run.runner is None:
        return dense(run.dense_run_reason)
    disabled = getattr(run.runner, "disabled_reason", None)
    if disabled is not None and disabled.startswith("internal error"):  # a bug turned the run dense (``_contained``)
        return dense(disabled)
    seq = q.shape[2] if skip_reshape else q.shape[1]
    batch = q.shape[0]
    head_dim = q.shape[-1] if skip_reshape else q.shape[-1] // heads

    text_len = 0
    if site.joint is not None:
        text_len = site.text_len if site.text_len is not None else options.get(TEXT_LEN_KEY)
        if text_len is None:
            return dense(options.get(LAYOUT_MISSING_KEY) or "joint sequence without a known text length")
        text_len = int(text_len)
        if not 0 <= text_len < seq:
            return dense(f"joint text length {text_len} does not fit a sequence of {seq}")
    elif mask is not None:
        return dense("masked attention")
    latent_tokens = seq - text_len - site.prefix
    if latent_tokens < run.settings.min_tokens:
        return dense(f"fewer latent tokens ({latent_tokens}) than min tokens ({run.settings.min_tokens})")
    if head_dim not in HEAD_DIMS:
        return dense(f"head dim {head_dim} not supported ({', '.join(map(str, HEAD_DIMS))})")

    step = run.step_of(options)  # resolved once per model evaluation (steps.STEP_KEY): no device read here
    if step is None:
        return dense("no current sigma in transformer_options")
    kind = run.kind(step, site.layer)
    if kind == "dense":
        reason = "dense warm-up layer" if site.layer < run.config.warmup_layers else "dense warm-up step"
        return run.timed_dense(reason, (batch, heads, seq, head_dim),
                               lambda: call(q, k, v, mask, skip_reshape, skip_output_reshape), device=q.device)

    branches, why = chunk_branches(options, batch)
    if why is not None:
        return dense(why)
    chunks = len(branches)
    per_chunk = batch // chunks
    window = _window_key(options.get("context_window"))

    qh, kh, vh = (_to_heads_first(t, heads, skip_reshape) for t in (q, k, v))  # [B, H, S, D] views, no copies
    if site.joint is None:
        # the whole batch in one runner call (one kernel launch for both CFG branches at reuse steps), written
        # straight into the output in the caller's layout through a strided view
        out, out_h = _output_buffer(qh, skip_output_reshape)
        run.sparse_call(qh, kh, vh, step=step, layer=site.layer, branches=branches, window=window,
                        dense_fn=_dense_fn(call), scale=scale, kind=site.cache_kind, out=out_h)
        return out
    latent = slice(0, seq - text_len) if site.joint == "video_first" else slice(text_len, seq)
    keep, why = _keep_mask(run, mask, seq, latent)
    if why is not None:
        return dense(why)
    outs = []
    for i in range(chunks):
        rows = slice(i * per_chunk, (i + 1) * per_chunk)
        outs.append(_joint_chunk(run, site, qh[rows], kh[rows], vh[rows], text_len=text_len, keep=keep, step=step,
                                 branch=branches[i], window=window, scale=scale))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
    return _from_heads_first(out, skip_output_reshape)


def _output_buffer(qh: torch.Tensor, skip_output_reshape: bool):
    """The output tensor in the layout the caller expects, and its ``[B, H, S, D]`` view for the kernels to write:
    ``[B, S, H*D]`` (viewed as ``[B, H, S, D]`` by strides), or ``[B, H, S, D]`` itself with skip_output_reshape."""
    b, h, s, d = qh.shape
    if skip_output_reshape:
        out = torch.empty(b, h, s, d, dtype=qh.dtype, device=qh.device)
        return out, out
    out = torch.empty(b, s, h * d, dtype=qh.dtype, device=qh.device)
    return out, out.view(b, s, h, d).transpose(1, 2)


def _dense_fn(call: Callable) -> Callable:
    """``(q, k, v) [B, H, S, D] -> [B, H, S, D]`` through the caller's own dense path (previous or func)."""

    def dense_fn(q, k, v):
        out = call(q, k, v, None, True, True)
        if out.dim() == 3:  # a backend or previous override that ignores skip_output_reshape
            b, h, s, d = q.shape
            out = out.view(b, s, h, d).transpose(1, 2)
        return out

    return dense_fn


def _joint_chunk(run, site: CallSite, q, k, v, *, text_len: int, keep, step: int, branch, window, scale):
    """One conditioning chunk of a joint [video, text] / [text, latent] call, ``[B, H, S, D]`` in and out.

    Text query rows are always exact: dense over every kept key through the run's dense kernels (with no fp32 score
    matrix nor fp32 copies of K/V). Latent query rows: MC-Sparse over the latent
    keys plus *all* kept text keys exactly (``extra_kv``, LSE merge in the engine); masked text keys are left
    out of ``extra_kv``. Without text tokens the call is MC-Sparse over all keys (no key is masked then:
    ``_analyse_mask`` sends a call that masks a latent key dense).
    """
    seq = q.shape[2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if not text_len:
        return run.sparse_call(q, k, v, step=step, layer=site.layer, branches=[branch], window=window, dense_fn=None,
                               scale=scale, kind=site.cache_kind)
    text = slice(seq - text_len, seq) if site.joint == "video_first" else slice(0, text_len)
    latent = slice(0, seq - text_len) if site.joint == "video_first" else slice(text_len, seq)
    ks, vs = (k[:, :, keep], v[:, :, keep]) if keep is not None else (k, v)
    text_keys = torch.arange(text.start, text.stop, device=q.device)
    if keep is not None:
        text_keys = keep[(keep >= text.start) & (keep < text.stop)]
    extra = (k[:, :, text_keys], v[:, :, text_keys])
    out = torch.empty_like(q)
    out[:, :, latent] = run.sparse_call(q[:, :, latent], k[:, :, latent], v[:, :, latent], step=step,
                                        layer=site.layer, branches=[branch], window=window, dense_fn=None,
                                        scale=scale, kind=site.cache_kind, extra_kv=extra)
    out[:, :, text] = run.exact_attention(q[:, :, text], ks, vs, scale=scale)
    return out
