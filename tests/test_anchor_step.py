"""The anchor step's structure: pass 1 on the best dense backend with LSE, exactly once per anchor call (its output
is the step's own, no second dense evaluation), and the residual computed in the outputs' dtype."""

from __future__ import annotations

import pytest
import torch
from comfyui_mc_sparse_pack import kernels
from comfyui_mc_sparse_pack.comfyui_mc_sparse import attention
from comfyui_mc_sparse_pack.comfyui_mc_sparse.cache import CacheKey
from comfyui_mc_sparse_pack.comfyui_mc_sparse.config import MCSparseConfig
from comfyui_mc_sparse_pack.comfyui_mc_sparse.engine import MCSparseRunner
from comfyui_mc_sparse_pack.kernels import reference, registry


@pytest.fixture
def counting_dense_backend():
    """A dense backend with LSE above every real one (priority 99) that counts its calls; removed afterwards."""
    calls = []

    def dense(q, k, v, *, scale=None, return_lse=False):
        calls.append(return_lse)
        return reference.dense_attention(q, k, v, scale=scale, return_lse=return_lse)

    registry.register(registry.Backend(name="stub_fast_dense", priority=99, ops={"dense_attention": dense}))
    yield calls
    registry._backends.pop("stub_fast_dense")


def test_anchor_pass1_runs_once_on_the_fastest_dense_backend(gen, counting_dense_backend):
    """The runner's anchor step (the last dense warm-up step) evaluates dense attention exactly once, with LSE, on
    the highest-priority dense backend, and never calls the caller's dense_fn: the anchor's dense output is the
    step's output."""
    cfg = MCSparseConfig(density=0.25, group_size=64, warmup_steps=1, anchor_steps=(0,))
    runner = MCSparseRunner(cfg)
    q, k, v = (torch.randn(1, 2, 200, 64, generator=gen) for _ in range(3))
    caller = []
    out = runner.attention(q, k, v, step=0, layer=0, key=CacheKey(0, shape=tuple(q.shape)),
                           dense_fn=lambda *a: caller.append(1) or reference.dense_attention(*a))
    assert counting_dense_backend == [True] and caller == []
    assert runner.kernels.choices["dense_attention"].backend == "stub_fast_dense"
    assert torch.allclose(out, reference.dense_attention(q, k, v), atol=1e-5)


@pytest.mark.parametrize("dtype,store", [(torch.bfloat16, "bfloat16"), (torch.float16, "bfloat16"),
                                          (torch.bfloat16, "float32"), (torch.bfloat16, "float8_e4m3fn"),
                                          (torch.float32, "float32"), (torch.float32, "int4")])
def test_residual_is_dense_minus_sparse_without_fp32_copies(gen, dtype, store):
    """R = O_dense - O_sparse: rounded once to a half storage dtype, writing over the sparse output's buffer (no new
    full-size tensor); float32 and quantised storage (fp8, int4: quantised later from full precision) get it
    exactly in float32."""
    dense, sparse = (torch.randn(1, 2, 50, 16, generator=gen).to(dtype) for _ in range(2))
    want = dense.double() - sparse.double()
    buf = sparse.data_ptr()
    dense_before = dense.clone()
    r = attention._residual(dense, sparse.clone() if store == "float32" else sparse, store)
    assert torch.equal(dense, dense_before)  # the dense output is the layer's output: never written
    expect_dtype = {"bfloat16": torch.bfloat16}.get(store, torch.float32)
    assert r.dtype == expect_dtype
    tol = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[r.dtype]
    assert torch.allclose(r.double(), want, atol=tol * want.abs().max().item() + 1e-6)
    if store == "bfloat16" and dtype == torch.bfloat16:
        assert r.data_ptr() == buf


def test_anchor_then_reuse_restores_dense_at_the_anchor_inputs(gen):
    """sparse + R at the anchor's own inputs is the dense output (the residual's definition), bf16 inputs."""
    q, k, v = (torch.randn(1, 2, 150, 64, generator=gen).to(torch.bfloat16) for _ in range(3))
    cfg = MCSparseConfig(density=0.3, group_size=64)
    out, entry = attention.anchor_attention(q, k, v, cfg)
    again = attention.reuse_attention(q, k, v, entry)
    assert (again.float() - out.float()).abs().max() < 3e-2
    assert kernels.sparse_attention(q, k, v, entry.perm, entry.kv_idx).dtype == torch.bfloat16


def test_anchor_entry_encodes_without_the_layout_check(gen, monkeypatch):
    """The anchor's own entry is marked checked: encode_entry skips the row/group layout checks (each a device sync)
    and still round-trips bit-exactly; an unmarked entry is still checked."""
    from comfyui_mc_sparse_pack.comfyui_mc_sparse import cache, encoding

    q, k, v = (torch.randn(1, 2, 300, 64, generator=gen).to(torch.bfloat16) for _ in range(3))
    _, entry = attention.anchor_attention(q, k, v, MCSparseConfig(density=0.2, group_size=64))
    assert entry.checked
    calls = []
    real = encoding._rows_are_k_sorted
    monkeypatch.setattr(encoding, "_rows_are_k_sorted", lambda *a: calls.append(1) or real(*a))
    stored = cache.encode_entry(entry, index_encoding="bitmask")
    assert calls == [] and stored.selection.kind == "bitmask"
    back = stored.decode(q.device)
    assert torch.equal(back.kv_idx, entry.kv_idx) and torch.equal(back.perm, entry.perm)
    unmarked = cache.CacheEntry(entry.perm, entry.kv_idx, entry.residual, entry.num_keys, entry.shape)
    cache.encode_entry(unmarked, index_encoding="bitmask")
    assert calls == [1]
