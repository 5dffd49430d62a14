"""The split-tail merge of the sm_90 Gluon sparse kernel (kernels/triton/sparse_tail_merge.py) under the Triton
interpreter against float64, and the split plan of ``sparse_attention_sm90.launch_args`` (``split_tail``).

The parts are built in float64 from the definition (each part's key tiles as ``_part_tiles`` cuts them, its rows'
unnormalised O, a running max in log2 units that is the exact max or a stale one, and the row sum; an empty part
max -inf, sum 0), so the merged rows must equal sparse attention over the whole selection + the residual; every
other output row stays NaN (the merge writes only the split items' rows)."""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from comfyui_mc_sparse_pack.kernels import reference

from .test_reuse_op import make_residual, native_views, random_groups, random_kv_idx

_LOG2E = 1.4426950408889634


def _merge_mod():
    return importlib.import_module("comfyui_mc_sparse_pack.kernels.triton.sparse_tail_merge")


def _g90():
    return importlib.import_module("comfyui_mc_sparse_pack.kernels.triton.sparse_attention_sm90")


def _part_tiles(n_tiles, part, parts):  # sparse_attention_sm90._part_tiles
    per = -(-n_tiles // parts)
    lo = min(part * per, n_tiles)
    return lo, min(lo + per, n_tiles)


def _partials(q, k, v, perm, idx, C, n_full, n_tail, n_parts, stale):
    """Workspace (O [n_tail*n_parts, 128, D], (m, l) [.., 128, 2]) of the split items, float64 maths, fp32 stored."""
    B, H, S, D = q.shape
    m_blocks = -(-C // 128)
    g_mb = (perm.shape[-1] // C) * m_blocks
    scale = _LOG2E / math.sqrt(D)
    ws_o = torch.full((n_tail * n_parts, 128, D), float("nan"))
    ws_ml = torch.full((n_tail * n_parts, 128, 2), float("nan"))
    for j in range(n_tail):
        w = n_full + j
        bh, pid_m = divmod(w, g_mb)
        b, h = divmod(bh, H)
        group, mb = divmod(pid_m, m_blocks)
        rows = perm[b, h, group * C + mb * 128: group * C + min(C, mb * 128 + 128)].long()
        qr = torch.zeros(128, D, dtype=torch.float64)
        qr[:len(rows)] = torch.where((rows >= 0)[:, None], q[b, h, rows.clamp(min=0)].double(), 0.0)
        keys = idx[b, h, group]
        keys = keys[keys >= 0].long()
        n_tiles = -(-len(keys) // 128)
        for p in range(n_parts):
            slot = j * n_parts + p
            lo, hi = _part_tiles(n_tiles, p, n_parts)
            part_keys = keys[lo * 128: hi * 128]
            if len(part_keys) == 0:
                ws_o[slot], ws_ml[slot, :, 0], ws_ml[slot, :, 1] = 0.0, float("-inf"), 0.0
                continue
            s = qr @ k[b, h, part_keys].double().T * scale
            m = s.amax(-1) - (3.0 if stale and p % 2 else 0.0)  # a stale max (lazy rescale) must merge the same
            pr = torch.exp2(s - m[:, None])
            ws_o[slot] = (pr @ v[b, h, part_keys].double()).float()
            ws_ml[slot, :, 0], ws_ml[slot, :, 1] = m.float(), pr.sum(-1).float()
    return ws_o, ws_ml


@pytest.mark.parametrize(("C", "K", "k_alloc", "n_parts", "kind", "dtype"), [
    (128, 300, 384, 2, None, torch.bfloat16),  # 3 tiles in 2 parts (2 + 1)
    (128, 200, 512, 4, "int4_group", torch.float16),  # 2 tiles in 4 parts: two empty parts
    (64, 290, 384, 3, "plain", torch.bfloat16),  # C = 64: half the item's rows are past C; 3 tiles in 3 parts
    (192, 130, 256, 2, "fp8_row", torch.float16),  # C = 192: two items per group (128 + 64 rows)
], ids=["2-parts", "empty-parts-int4-group", "C64-plain", "C192-fp8"])
def test_merge_matches_float64(gen, C, K, k_alloc, n_parts, kind, dtype):
    B, H, S, D = 2, 2, 300, 32
    q, k, v = native_views(gen, B, S, H, D, dtype)
    perm = random_groups(gen, B, H, S, C)
    G = perm.shape[-1] // C
    idx = random_kv_idx(gen, B, H, G, S, K, k_alloc)
    m_blocks = -(-C // 128)
    n_work = B * H * G * m_blocks
    n_tail = 3
    n_full = n_work - n_tail
    ws_o, ws_ml = _partials(q, k, v, perm, idx, C, n_full, n_tail, n_parts, stale=True)
    res = None if kind is None else make_residual(torch.randn(B, H, S, D, generator=gen) * 0.05, kind, perm, G)
    base = torch.full((B, S, H * D), float("nan"), dtype=dtype)
    out = base.view(B, S, H, D).transpose(1, 2)
    lse = torch.full((B, H, S), float("nan"))
    _merge_mod().merge(ws_o, ws_ml, n_full, n_tail, n_parts, perm, out, lse, res, H, S, C, perm.shape[-1], m_blocks,
                       False)
    ref, ref_lse = reference.sparse_attention(q.double(), k.double(), v.double(), perm, idx, return_lse=True)
    if res is not None:
        ref = ref + res.dequantize(torch.float64, perm)
    written = torch.zeros(B, H, S, dtype=torch.bool)  # the split items' query rows
    g_mb = G * m_blocks
    for w in range(n_full, n_work):
        bh, pid_m = divmod(w, g_mb)
        b, h = divmod(bh, H)
        group, mb = divmod(pid_m, m_blocks)
        rows = perm[b, h, group * C + mb * 128: group * C + min(C, mb * 128 + 128)].long()
        written[b, h, rows[rows >= 0]] = True
    assert written.any()
    got = out.double()
    assert not got[written].isnan().any(), "a split item's row was not written"
    assert got[~written].isnan().all(), "the merge wrote a row outside the split items"
    err = float((got[written] - ref[written]).norm() / ref[written].norm())
    lse_err = float((lse.double()[written] - ref_lse.double()[written]).abs().max())
    print(f"C{C} K{K} parts {n_parts} {kind} {dtype}: rel_l2 {err:.2e}, lse {lse_err:.2e}")
    assert err < 6e-3, err
    assert lse_err < 1e-4, lse_err
    assert lse[~written].isnan().all()


def test_split_plan(gen):
    """launch_args with split_tail: the last, partial round's items are split into min(split_tail, programs //
    tail items) parts (virtual work count n_full + tail * parts, a workspace slot per part and the merge's
    arguments); none when the items fill whole rounds or the tail is too wide to split; refused where the kernel
    has no split path."""
    g = _g90()
    q = torch.randn(1, 2, 1000, 128, generator=gen).to(torch.bfloat16)
    perm, idx = random_groups(gen, 1, 2, 1000, 128), random_kv_idx(gen, 1, 2, 8, 1000, 100, 128)  # 16 items
    base = dict(pingpong=True, persistent=True, num_stages=3, thread_arrive=True, early_q=True, q_regs=True)
    _, args, meta, (_, _, tail) = g.launch_args(q, q, q, perm, idx, num_sms=7, split_tail=4, **base)
    # 16 items on 7 programs: 2 rounds of 7, then 2 items split into min(4, 7 // 2) = 3 parts each
    assert meta["SPLIT"] and tail["n_full"] == 14 and tail["n_tail"] == 2 and tail["n_parts"] == 3
    assert tail["ws_o"].shape == (6, 128, 128) and tail["ws_ml"].shape == (6, 128, 2)
    n_virtual, n_full, n_parts = args[20:23]
    assert (n_virtual, n_full, n_parts) == (20, 14, 3)
    assert g.launch_args(q, q, q, perm, idx, num_sms=8, split_tail=4, **base)[3][2] is None  # 2 whole rounds
    assert g.launch_args(q, q, q, perm, idx, num_sms=12, split_tail=4, **base)[3][2]["n_parts"] == 3  # 4 items left
    assert g.launch_args(q, q, q, perm, idx, num_sms=9, split_tail=4, **base)[3][2] is None  # 7 of 9 left: 9 // 7 = 1
    assert g.launch_args(q, q, q, perm, idx, num_sms=7, **base)[3][2] is None  # off by default
    assert not g.launch_args(q, q, q, perm, idx, num_sms=7, **base)[2]["SPLIT"]
    for bad in (dict(persistent=False, early_q=False, q_regs=False), dict(idx_ahead=3)):
        with pytest.raises(ValueError, match="split_tail"):
            g.launch_args(q, q, q, perm, idx, num_sms=7, split_tail=4, **{**base, **bad})


def test_tail_launch_plan(gen, monkeypatch):
    """launch_args with tail_launch: the first launch walks whole rounds only (virtual work count = n_full, no split
    path), the last round's items go to a second launch (one program per part, starting at work index n_full,
    split path on, no residual or LSE there, its own register split) and the merge; none when the items fill whole
    rounds; refused where the kernel has no split path."""
    g = _g90()
    q = torch.randn(1, 2, 1000, 128, generator=gen).to(torch.bfloat16)
    perm, idx = random_groups(gen, 1, 2, 1000, 128), random_kv_idx(gen, 1, 2, 8, 1000, 100, 128)  # 16 items
    base = dict(pingpong=True, persistent=True, num_stages=3, thread_arrive=True, early_q=True, q_regs=True,
                skip_rescale=True)
    grid, args, meta, (_, _, tail) = g.launch_args(q, q, q, perm, idx, num_sms=7, tail_launch=4, **base)
    assert grid == (7,) and not meta["SPLIT"] and meta["SKIP_RESCALE"] and args[20:24] == (14, 14, 1, 0)
    assert tail["n_full"] == 14 and tail["n_tail"] == 2 and tail["n_parts"] == 3
    grid2, args2, meta2 = tail["launch"]
    assert grid2 == (6,) and args2[20:24] == (20, 14, 3, 14)
    assert meta2["SPLIT"] and meta2["RES_KIND"] == 0 and not meta2["RETURN_LSE"]
    assert (meta2["CONSUMER_REGS"], meta2["PRODUCER_REGS"]) == (216, 72)
    assert args2[11] is tail["ws_o"] and args2[12] is tail["ws_ml"]
    assert g.launch_args(q, q, q, perm, idx, num_sms=8, tail_launch=4, **base)[3][2] is None  # 2 whole rounds
    monkeypatch.setattr(g, "TAIL_MAX_ROUNDS", 1)  # a long walk: its last round's idle share is not worth 2 launches
    assert g.launch_args(q, q, q, perm, idx, num_sms=7, tail_launch=4, **base)[3][2] is None
    monkeypatch.undo()
    for bad in (dict(persistent=False, early_q=False, q_regs=False), dict(split_tail=4)):
        with pytest.raises(ValueError, match="tail_launch"):
            g.launch_args(q, q, q, perm, idx, num_sms=7, tail_launch=4, **{**base, **bad})
