"""Bad input through the public kernel ops: a clear TypeError / ValueError naming the input, raised before any
backend runs (so no backend is blamed for the caller's mistake: nothing lands in the run's failure record)."""

from __future__ import annotations

import pytest
import torch
from comfyui_mc_sparse_pack import kernels
from comfyui_mc_sparse_pack.kernels import registry


def _inputs(gen, S=40, C=16):
    q, k, v = (torch.randn(1, 2, S, 32, generator=gen) for _ in range(3))
    perm = kernels.pddp_groups(q, C, backend="torch")
    _, lse = kernels.dense_attention(q, k, v, return_lse=True, backend="torch")
    return q, k, v, perm, lse


@pytest.mark.parametrize("bad, err, words", [
    (None, TypeError, "lse must be"),
    ("short", ValueError, "lse must be [B, H, S]"),
    ("int", TypeError, "lse must be"),
])
@pytest.mark.parametrize("op", ["select_kv", "group_prob_sums"])
def test_pass2_ops_check_the_lse(gen, op, bad, err, words):
    q, k, _, perm, lse = _inputs(gen)
    bad_lse = {None: None, "short": lse[:, :, 1:], "int": lse.to(torch.int32)}[bad]
    record = registry.Record()
    with registry.recording(record), pytest.raises(err, match=words.replace("[", r"\[").replace("]", r"\]")):
        if op == "select_kv":
            kernels.select_kv(q, k, bad_lse, perm, 8, group_size=16, kv_tile=8)
        else:
            kernels.group_prob_sums(q, k, bad_lse, perm, group_size=16)
    assert not record.failures  # a bad argument is not a backend failure


@pytest.mark.parametrize("group_size", [0, -16, 16.0])
def test_select_kv_rejects_a_bad_group_size(gen, group_size):
    q, k, _, perm, lse = _inputs(gen)
    with pytest.raises(ValueError, match="group_size must be"):
        kernels.select_kv(q, k, lse, perm, 8, group_size=group_size, kv_tile=8)


def test_sparse_attention_rejects_missing_perm_empty_selection_and_bad_scale(gen):
    q, k, v, perm, lse = _inputs(gen)
    kv_idx = kernels.select_kv(q, k, lse, perm, 8, group_size=16, kv_tile=8, backend="torch")
    with pytest.raises(TypeError, match="perm must be"):
        kernels.sparse_attention(q, k, v, None, kv_idx)
    with pytest.raises(ValueError, match="kv_idx must be"):
        kernels.sparse_attention(q, k, v, perm, kv_idx[:, :, :0])
    for scale in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="scale must be a finite number"):
            kernels.sparse_attention(q, k, v, perm, kv_idx, scale=scale)
        with pytest.raises(ValueError, match="scale must be a finite number"):
            kernels.dense_attention(q, k, v, scale=scale)
    out = kernels.sparse_attention(q, k, v, perm, kv_idx, scale=0.5, backend="torch")  # a finite scale still runs
    assert torch.isfinite(out).all()

