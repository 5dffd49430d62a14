"""Hunyuan3D 2.1: its ``Attention`` (ComfyUI ``comfy/ldm/hunyuan3dv2_1/hunyuandit.py`` L352-418) calls attention
without transformer_options, so ``layouts`` replaces ``blocks.i.attn1.forward`` with ``make_attn_forward``'s
function: the original projections, then the MC-Sparse dispatch of ``override``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import override
from .callsite import MARK_KEY, CallSite


FIXED_KEYWORDS = {"low_precision_attention": False}
"""Keyword arguments ComfyUI's own ``Attention.forward`` may pass to ``optimized_attention`` with a fixed value, which
the replacement's dense calls pass too where the original does: v0.33.0 passes ``low_precision_attention=False``
(``hunyuandit.py`` L411-417: SageAttention and other low-precision backends fall back to PyTorch attention for this
model); v0.3.64 passes none."""


def original_keywords(original: Callable) -> dict:
    """The ``FIXED_KEYWORDS`` whose names ``original`` (a function or bound method) passes as keywords: read from its
    code's constants (the keyword-name tuples of its calls), so the same pack matches either ComfyUI; {} for an
    object without Python code (e.g. another wrapper's callable)."""
    code = getattr(getattr(original, "__func__", original), "__code__", None)
    names = {n for c in (code.co_consts if code is not None else ()) if isinstance(c, tuple) for n in c}
    return {k: v for k, v in FIXED_KEYWORDS.items() if k in names}


def make_attn_forward(module, site: CallSite, original: Callable) -> Callable:
    """Replacement for ``hunyuan3dv2_1`` ``Attention.forward`` (``hunyuandit.py`` L390-418), which calls
    attention without transformer_options. Same projections and per-head q/k/v split as the original, then
    ``override.dispatch`` with the transformer_options the APPLY_MODEL wrapper published in ``override.CURRENT_OPTIONS``,
    contained like the override's entry (``override._contained``); its dense calls pass ``optimized_attention`` the
    fixed keywords the original passes (``original_keywords``). Outside an MC-Sparse run it calls ``original``
    unchanged.
    """
    keywords = original_keywords(original)

    def forward(x, *args, **kwargs):
        options = override.CURRENT_OPTIONS.get()
        run = options.get(override.RUN_KEY) if options else None
        if run is None or args or kwargs:
            return original(x, *args, **kwargs)
        from comfy.ldm.modules.attention import optimized_attention

        b, n, _ = x.shape
        heads, head_dim = module.num_heads, module.head_dim
        qkv = torch.cat((module.to_q(x), module.to_k(x), module.to_v(x)), dim=-1)
        width = qkv.shape[-1] // heads // 3
        # the original interleaves q/k/v per head: [.., heads, 3*width] then splits the last dim
        q, k, v = torch.split(qkv.view(1, -1, heads, width * 3), width, dim=-1)
        q = module.q_norm(q.reshape(b, n, heads, head_dim)).reshape(b, n, heads * head_dim)
        k = module.k_norm(k.reshape(b, n, heads, head_dim)).reshape(b, n, heads * head_dim)
        v = v.reshape(b, n, heads * head_dim)

        @override._callers
        def call(q_, k_, v_, mask_, skip_reshape_, skip_output_reshape_):
            return optimized_attention(q_, k_, v_, heads, mask=mask_, skip_reshape=skip_reshape_,
                                       skip_output_reshape=skip_output_reshape_, **keywords)

        # contained as the override's own entry is: a bug in the pack's dispatch gives this call (and the rest of
        # the run) the original attention instead of losing the run; ComfyUI's own errors propagate (_callers)
        out = override._contained(
            run, {**options, MARK_KEY: site},
            lambda: override.dispatch(run, site, q, k, v, heads, mask=None, skip_reshape=False,
                                      skip_output_reshape=False, options=options, call=call),
            lambda: call(q, k, v, None, False, False))
        return module.out_proj(out)

    forward.mc_sparse_marker = site
    return forward
