"""The merge of the CuTeDSL kernel's "split_tail" parts (kernels/cutedsl/tail_merge.py) under the Triton interpreter,
against its definition in float64 on the same workspace: LSE = log sum_p exp(LSE_p), O = sum_p exp(LSE_p - LSE) O_p,
rounded once into ``out[b, perm[row], h]``, the LSE into ``lse[b, h, perm[row]]``.

The op-level test (tests/test_cutedsl_backend.py, ``test_split_tail_parts_merged``) compares with sparse attention
after the workspace's own bf16 rounding, so its bound is loose: dividing by the part-weight sum + 0.01 there stayed
inside it. Here the workspace is the input, so the only error left is the output's rounding (2^-8 relative in bf16).
"""

from __future__ import annotations

import importlib

import pytest
import torch


def _merge_mod():
    return importlib.import_module("comfyui_mc_sparse_pack.kernels.cutedsl.tail_merge")


def _case(gen, *, B, H, S, D, n_parts, n_split, dtype):
    """Random perm rows (heads inside a batch element, the last group of each head padded with -1), a workspace of
    ``n_split`` split groups x ``n_parts`` parts (one part of the first split group empty: LSE -inf)."""
    G = -(-S // 128)
    N = B * H * G
    perm = torch.full((B * H, G * 128), -1, dtype=torch.int32)
    for bh in range(B * H):
        perm[bh, :S] = torch.randperm(S, generator=gen).to(torch.int32)
    rows = n_split * n_parts * 128
    ws_o = torch.randn(rows, D, generator=gen).to(dtype)
    ws_lse = torch.randn(rows, generator=gen) * 3
    ws_lse[128:256] = float("-inf")  # split group 0, part 1: no keys
    return perm.view(N, 128), ws_o, ws_lse, N - n_split, G


def _reference(ws_o, ws_lse, perm_rows, n_full, n_split, n_parts, G, B, H, S, D):
    """float64 out ``[B, S, H, D]`` and LSE ``[B, H, S]`` (NaN where no split group writes)."""
    out = torch.full((B, S, H, D), float("nan"), dtype=torch.float64)
    lse = torch.full((B, H, S), float("nan"), dtype=torch.float64)
    for j in range(n_split):
        n = n_full + j
        b, h = divmod(n // G, H)
        part_lse = ws_lse.double().view(n_split, n_parts, 128)[j]  # [P, 128]
        part_o = ws_o.double().view(n_split, n_parts, 128, D)[j]  # [P, 128, D]
        total = part_lse.logsumexp(0)  # [128]
        o = ((part_lse - total).exp()[..., None] * part_o).sum(0)
        ok = perm_rows[n] >= 0
        q = perm_rows[n][ok].long()
        out[b, q, h] = o[ok]
        lse[b, h, q] = total[ok]
    return out, lse


@pytest.mark.parametrize(("B", "H", "S", "D", "n_parts", "n_split", "dtype", "with_lse"), [
    (1, 2, 330, 64, 3, 2, torch.bfloat16, True),
    (2, 3, 200, 128, 5, 4, torch.float16, True),
    (1, 2, 300, 64, 2, 3, torch.bfloat16, False),
])
def test_tail_merge_is_one_softmax_over_the_parts(gen, B, H, S, D, n_parts, n_split, dtype, with_lse):
    """Each split group's rows are the LSE-weighted mean of its parts (an empty part, LSE -inf, weighs 0), rounded
    once; padded slots (perm -1) and the other groups' rows are never written, in out (a strided [B, S, H*D + 8]
    buffer) and in the LSE. Mutations that fail here: the weight sum + 0.01 as divisor, log of the sum halved."""
    perm_rows, ws_o, ws_lse, n_full, G = _case(gen, B=B, H=H, S=S, D=D, n_parts=n_parts, n_split=n_split, dtype=dtype)
    buf = torch.full((B, S, H * D + 8), float("nan"), dtype=dtype)
    out = buf[..., : H * D].view(B, S, H, D)
    lse = torch.full((B, H, S), float("nan"), dtype=torch.float32) if with_lse else None
    _merge_mod().merge(ws_o, ws_lse, perm_rows, out, lse, n_full, n_split, n_parts, G)

    ref, ref_lse = _reference(ws_o, ws_lse, perm_rows, n_full, n_split, n_parts, G, B, H, S, D)
    written = ~ref.isnan()
    assert torch.equal(~out.isnan(), written)  # exactly the split groups' valid rows
    assert buf[..., H * D:].isnan().all()  # nothing past the view
    err = (out.double() - ref)[written].abs()
    assert float((err - 2**-8 * ref[written].abs()).max()) <= 1e-6
    if with_lse:
        assert torch.equal(~lse.isnan(), ~ref_lse.isnan())
        assert float((lse.double() - ref_lse)[~ref_lse.isnan()].abs().max()) <= 1e-5


def test_tail_merge_without_split_groups_writes_nothing(gen):
    """n_split = 0 (no last round to split): no launch, out untouched."""
    perm_rows, ws_o, ws_lse, _, G = _case(gen, B=1, H=1, S=256, D=64, n_parts=2, n_split=1, dtype=torch.bfloat16)
    out = torch.full((1, 256, 1, 64), float("nan"), dtype=torch.bfloat16)
    _merge_mod().merge(ws_o, ws_lse, perm_rows, out, None, 2, 0, 2, G)
    assert out.isnan().all()
