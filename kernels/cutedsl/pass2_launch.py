"""The CuTeDSL pass-2 kernel's launch tensors (``kernels/cutedsl/pass2_sm90.py``), in the order of
``Pass2Sm90.__call__``, with their symbolic shapes: the kernel is compiled from fake tensors of ``ARG_SHAPES`` and
the compiled function checks at every call that the dims sharing a name are equal (a mismatch is a ValueError at
launch time). Built with torch only, so the CPU suite checks every launch path against ``ARG_SHAPES``
(tests/test_cutedsl_pass2_launch.py).
"""

from __future__ import annotations

import torch

HEAD_DIM = 128

# (argument, dtype key, shape: a name per dim (equal names: equal extents) or an int, divisibility of the last dim)
ARG_SHAPES = (
    ("mQ", "uint8", ("bh", "s", HEAD_DIM), 16),
    ("mK", "uint8", ("bh", "sk", HEAD_DIM), 16),
    ("mLSE", "float32", ("bh", "s"), 1),
    ("mPerm", "int32", ("bh", "n"), 1),
    ("mKB", "float32", ("bh", "sk"), 1),
    ("mQF", "float32", ("bh",), 1),
    ("mOut", "out", ("b", "h", "g", "sk_out"), 1),
    ("mInf", "float32", (4,), 4),
    ("mSel", "int32", ("sel_b", "sel_h", "sel_g", "sel_w"), 1),
    ("mFlag", "int8", ("flag_rows",), 1),
    ("mCnt", "int32", ("cnt_rows",), 1),
)

_INF: dict = {}  # device -> fp32 [4] of +inf (the LSE a padded query slot copies; also the placeholders' storage)
_FLAGS: dict = {}  # device -> int8 flags of the fused top-K (one per row, every one written by the kernel)


def inf(dev) -> torch.Tensor:
    """fp32 ``[4]`` of +inf on ``dev`` (cached)."""
    t = _INF.get(dev)
    if t is None:
        t = _INF[dev] = torch.full((4,), float("inf"), dtype=torch.float32, device=dev)
    return t


def flags(dev, rows: int) -> torch.Tensor:
    """int8 ``[rows]`` on ``dev`` (a cached buffer's first rows; the fused top-K writes each row's flag)."""
    buf = _FLAGS.get(dev)
    if buf is None or buf.numel() < rows:
        buf = _FLAGS[dev] = torch.empty(rows, dtype=torch.int8, device=dev)
    return buf[:rows]


def launch_tensors(q8, k8, qf, lse_s, kb, perm, out, *, group_size: int, sel=None, ksplit: int = 1) -> tuple:
    """The tensor arguments of one launch, in ``ARG_SHAPES`` order: the float8 operands as bytes ``(B*H, S, D)`` /
    ``(B*H, Sk, D)``, lse_s ``(B*H, S)``, perm ``(B*H, G*C)``, kb ``(B*H, Sk)``, qf ``(B*H,)``, out as given, +inf
    ``[4]``; with the fused top-K (``sel`` int32 ``[B, H, G, width]``) sel, the rows' flags ``[B*H*G]`` and, with key
    parts (ksplit > 1), zeroed per-row part counters ``[B*H*G]``; without it ``[1, 1, 1, 4]`` / ``[16]`` / ``[4]``
    placeholders (never read)."""
    B, H, S, D = q8.shape
    SK = k8.shape[2]
    G = perm.shape[-1] // group_size
    dev = q8.device
    pad = inf(dev)
    if sel is not None:
        flag = flags(dev, B * H * G)
        cnt = torch.zeros(B * H * G, dtype=torch.int32, device=dev) if ksplit > 1 else pad.view(torch.int32)
    else:
        sel, flag, cnt = pad.view(torch.int32).view(1, 1, 1, 4), pad.view(torch.int8), pad.view(torch.int32)
    return (q8.view(torch.uint8).view(B * H, S, D), k8.view(torch.uint8).view(B * H, SK, D),
            lse_s.contiguous().view(B * H, S), perm.contiguous().view(B * H, G * group_size),
            kb.contiguous().view(B * H, SK), qf.contiguous().view(B * H), out, pad, sel, flag, cnt)


def shape_mismatches(tensors) -> list[str]:
    """The ways ``tensors`` (``launch_tensors``' tuple) break ``ARG_SHAPES``: wrong rank, an int dim of another extent,
    a named dim whose extent differs from the first argument's with that name (empty: the compiled kernel accepts
    the shapes)."""
    seen: dict = {}
    bad = []
    for (name, _, shape, _), t in zip(ARG_SHAPES, tensors, strict=True):
        if t.dim() != len(shape):
            bad.append(f"{name}: rank {t.dim()} != {len(shape)}")
            continue
        for i, d in enumerate(shape):
            n = int(t.shape[i])
            if isinstance(d, int):
                if n != d:
                    bad.append(f"{name}.shape[{i}] = {n} != {d}")
            elif seen.setdefault(d, (name, n))[1] != n:
                bad.append(f"{name}.shape[{i}] = {n} != {seen[d][0]}'s {d} = {seen[d][1]}")
    return bad
