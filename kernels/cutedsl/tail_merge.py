"""The merge of the CuTeDSL kernel's "split_tail" parts (``sparse_fwd_sm90.py``): a Triton kernel.

With "split_tail" the groups of the persistent walk's last, partial round (r = N mod G groups for G CTAs) run as
P work items each over consecutive key tiles, and each item writes its normalised output rows (group order, the
kernel's dtype) and their natural-log LSE to a workspace, a discarded (empty) part LSE -inf. For each of those groups
this kernel combines its parts as one softmax over all their keys: LSE = log sum_p exp(LSE_p), O = sum_p exp(LSE_p -
LSE) O_p (fp32), rounded once into ``out[b, perm[row], h, :]`` by strides (padded slots, perm -1, skipped), and the LSE
into ``lse[b, h, perm[row]]``. Runs wherever Triton runs, the interpreter included (tests/test_cutedsl_tail_merge.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
try:  # programmatic dependent launch; a Triton without it launches "pdl" calls plainly
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    gdc_launch_dependents = gdc_wait = None

TILE = 128  # rows per group (C)


@triton.jit
def _merge(WS_O, WS_L, PERM, OUT, LSE, n_full, n_parts, groups_per_head, H,
           s_ob, s_os, s_oh, s_lb, s_lh,
           D: tl.constexpr, WITH_LSE: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # a programmatic dependent launch: the kernel's parts written and visible first
        gdc_wait()
        gdc_launch_dependents()
    j = tl.program_id(0)  # the j-th split group: group n_full + j, workspace items j * n_parts ..
    group = n_full + j
    bh = group // groups_per_head
    b = bh // H
    h = bh % H
    rows = tl.arange(0, 128)
    cols = tl.arange(0, D)
    q = tl.load(PERM + group.to(tl.int64) * 128 + rows)
    item0 = j.to(tl.int64) * n_parts
    m = tl.full([128], float("-inf"), tl.float32)
    for p in range(n_parts):
        m = tl.maximum(m, tl.load(WS_L + (item0 + p) * 128 + rows))
    total = tl.zeros([128], tl.float32)
    o = tl.zeros([128, D], tl.float32)
    for p in range(n_parts):
        base = (item0 + p) * 128 + rows
        w = tl.exp(tl.load(WS_L + base) - m)  # a discarded part: exp(-inf) = 0
        total += w
        o += tl.load(WS_O + base[:, None] * D + cols[None, :]).to(tl.float32) * w[:, None]
    o = o / total[:, None]
    ok = q >= 0
    qq = tl.where(ok, q, 0).to(tl.int64)
    dst = OUT + b.to(tl.int64) * s_ob + qq[:, None] * s_os + h.to(tl.int64) * s_oh + cols[None, :]
    tl.store(dst, o.to(OUT.dtype.element_ty), mask=ok[:, None])
    if WITH_LSE:
        tl.store(LSE + b.to(tl.int64) * s_lb + h.to(tl.int64) * s_lh + qq, m + tl.log(total), mask=ok)


def merge(ws_o: torch.Tensor, ws_lse: torch.Tensor, perm_rows: torch.Tensor, out: torch.Tensor,
          lse: torch.Tensor | None, n_full: int, n_split: int, n_parts: int, groups_per_head: int,
          pdl: bool = False) -> None:
    """Combine the parts of groups ``n_full .. n_full + n_split - 1`` (``sparse_fwd_sm90`` "split_tail").

    ws_o ``(rows, D)`` fp16/bf16 and ws_lse fp32 ``(rows,)``, contiguous, item j*P + p at rows (j*P + p)*128 ..;
    perm_rows int32 ``(N, 128)`` contiguous (N = B*H*G groups, heads inside a batch element); out ``(B, S, H, D)``
    (the model's layout; unit stride on D), written at the split groups' rows; lse fp32 ``(B, H, S)`` with unit stride
    on S, or None. One program per split group, on out's device and current stream; ``pdl``: launched as a
    programmatic dependent launch (CUDA sm_90+ only: the kernel waits for the one before it)."""
    if n_split <= 0:
        return
    B, S, H, D = out.shape
    with_lse = lse is not None
    pdl = pdl and gdc_wait is not None
    lse_arg = lse if with_lse else ws_lse
    _merge[(n_split,)](ws_o, ws_lse, perm_rows, out, lse_arg, n_full, n_parts, groups_per_head, H,
                       out.stride(0), out.stride(1), out.stride(2),
                       lse.stride(0) if with_lse else 0, lse.stride(1) if with_lse else 0,
                       D=D, WITH_LSE=with_lse, PDL=pdl, **({"launch_pdl": True} if pdl else {}))
