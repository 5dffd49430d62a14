"""The paper's diagnostics (sec. 2): oracles, vanilla BSA, Sol-Attn through comfy-kitchen, recall and relative L1."""

import math

import pytest
import torch
from comfyui_mc_sparse_pack import kernels
from comfyui_mc_sparse_pack.comfyui_mc_sparse.tools import diagnostics as dg
from comfyui_mc_sparse_pack.comfyui_mc_sparse import schedule
from comfyui_mc_sparse_pack.comfyui_mc_sparse.cache import CacheKey
from comfyui_mc_sparse_pack.comfyui_mc_sparse.config import MCSparseConfig
from comfyui_mc_sparse_pack.comfyui_mc_sparse.engine import MCSparseRunner
from comfyui_mc_sparse_pack.comfyui_mc_sparse.tools.workload import SyntheticWorkload, WorkloadSpec


def _qkv(gen, B=1, H=2, S=300, D=32, sharp=2.0):
    """Random q/k/v with some structure (a shared low-rank part) so selections differ from uniform."""
    base = torch.randn(B, H, S, 4, generator=gen) @ torch.randn(4, D, generator=gen)
    q = (base + torch.randn(B, H, S, D, generator=gen)) * sharp / math.sqrt(2)
    k = (base + torch.randn(B, H, S, D, generator=gen)) * sharp / math.sqrt(2)
    v = torch.randn(B, H, S, D, generator=gen)
    return q, k, v


@pytest.mark.parametrize("density", [0.1, 0.25, 0.5])
def test_recall_per_query_ge_token_ge_block_ge_bsa(gen, density):
    """At one budget K: per-query oracle >= token oracle >= block oracle >= vanilla BSA in recall."""
    q, k, v = _qkv(gen)
    kw = dict(group_size=64, kv_tile=16)
    pq = dg.per_query_oracle(q, k, v, density, kv_tile=16)
    tok = dg.token_oracle(q, k, v, density, **kw)
    blk = dg.block_oracle(q, k, v, density, **kw)
    bsa = dg.vanilla_bsa(q, k, v, density, **kw)
    eps = 1e-5
    assert pq.recall >= tok.recall - eps >= blk.recall - 2 * eps >= bsa.recall - 3 * eps, (pq, tok, blk, bsa)
    assert pq.density == tok.density  # same K
    # same block count; a kept ragged last KV block holds fewer tokens, so block densities may be below K/S
    assert blk.density <= tok.density + 1e-12 and bsa.density <= tok.density + 1e-12


def test_realized_density_counts_pairs(gen):
    """Realized density = kept pairs / S^2: K/S for token selections, real tokens of kept blocks for blocks."""
    q, k, v = _qkv(gen, S=100)
    K = 32  # keys_for_density(0.3, 100, 16): 30 rounded up to the tile
    assert dg.token_oracle(q, k, v, 0.3, group_size=64, kv_tile=16).density == pytest.approx(K / 100)
    assert dg.per_query_oracle(q, k, v, 0.3, kv_tile=16).density == pytest.approx(K / 100)
    # 7 KV blocks of 16 with a ragged last one of 4 tokens: 2 blocks kept, 20 to 32 tokens per query
    assert 20 / 100 <= dg.block_oracle(q, k, v, 0.3, group_size=64, kv_tile=16).density <= 32 / 100


def test_full_density_is_dense(gen):
    """At density 1 every method keeps everything: recall 1, output = dense."""
    q, k, v = _qkv(gen, S=130)
    dense, _ = dg.dense_reference(q, k, v)
    for fn in (dg.per_query_oracle, dg.token_oracle, dg.block_oracle, dg.vanilla_bsa):
        r = fn(q, k, v, 1.0).with_rel_l1(dense)
        assert r.recall == pytest.approx(1.0, abs=1e-5) and r.density == pytest.approx(1.0)
        assert r.rel_l1 < 1e-5, (r.method, r.rel_l1)


def test_evaluate_selection_matches_the_kernel_and_the_token_oracle(gen):
    """A pass-2 selection (kernels.select_kv) scores as the token oracle with the same groups, and the
    evaluator's output equals kernels.sparse_attention on that selection."""
    q, k, v = _qkv(gen, S=200)
    perm = kernels.pddp_groups(q, 64)
    dense, lse = kernels.dense_attention(q, k, v, return_lse=True)
    kv_idx = kernels.select_kv(q, k, lse, perm, 64, group_size=64, kv_tile=64)
    scored = dg.evaluate_selection(q, k, v, perm, kv_idx)
    oracle = dg.token_oracle(q, k, v, 64 / 200, group_size=64, perm=perm)
    assert scored.recall == pytest.approx(oracle.recall, abs=1e-5)
    assert scored.density == pytest.approx(64 / 200)
    assert dg.relative_l1(scored.out, kernels.sparse_attention(q, k, v, perm, kv_idx)) < 1e-5
    # recall is the kept probability mass: exp(LSE_sparse - LSE_dense) per query
    _, lse_sparse = kernels.sparse_attention(q, k, v, perm, kv_idx, return_lse=True)
    assert torch.allclose(scored.kept_mass, torch.exp(lse_sparse - lse), atol=1e-5)


def test_residual_is_added(gen):
    """A residual passed to a method is added to its sparse output."""
    q, k, v = _qkv(gen, S=128)
    plain = dg.vanilla_bsa(q, k, v, 0.5, group_size=64, kv_tile=64)
    res = torch.randn(q.shape, generator=gen)
    withres = dg.vanilla_bsa(q, k, v, 0.5, group_size=64, kv_tile=64, residual=res)
    assert torch.allclose(withres.out, plain.out + res, atol=1e-6)


def test_bsa_selection_is_sorted_blocks_with_padding():
    """bsa_selection returns whole KV blocks, ascending, -1 for the missing tail of a ragged last block."""
    gen = torch.Generator().manual_seed(0)
    q, k, _ = _qkv(gen, S=100)
    k[..., 96:, :] += 50 * q[..., :64, :].mean(2, keepdim=True)  # every query block wants the last block
    perm, kv_idx = dg.bsa_selection(q, k, 0.3, group_size=64, kv_tile=16)
    assert kv_idx.shape == (1, 2, 2, 32) and perm.shape == (1, 2, 128)  # K = 32: two blocks of 16
    assert torch.equal(perm[..., :100], torch.arange(100, dtype=torch.int32).expand(1, 2, 100))
    empty = (kv_idx == -1).sum(-1)
    assert set(empty.flatten().tolist()) <= {0, 12} and (empty == 12).any()  # ragged block 96..99: 12 empty slots
    for row, n_empty in zip(kv_idx.reshape(-1, 32), empty.flatten()):
        real = row[: 32 - n_empty]
        assert (real < 100).all() and (real.diff() > 0).all() and (row[32 - n_empty :] == -1).all()
        assert (real % 16 == 0).sum() == 2  # two whole blocks


def test_relative_l1_definition():
    """||a - b||_1 / ||b||_1, and its errors."""
    b = torch.tensor([1.0, -2.0, 3.0, 0.0])
    a = torch.tensor([1.5, -2.0, 2.0, 0.5])
    assert dg.relative_l1(a, b) == pytest.approx(2.0 / 6.0)
    with pytest.raises(ValueError, match="out must have ref's shape"):
        dg.relative_l1(a[:3], b)
    with pytest.raises(ValueError, match="ref must have a nonzero L1 norm"):
        dg.relative_l1(a, torch.zeros(4))
    with pytest.raises(TypeError, match="out must be a torch.Tensor"):
        dg.relative_l1([1.0], b)


def test_bad_inputs_raise_naming_the_input(gen):
    """Non-finite, mismatched, wrong-dtype inputs and out-of-range settings raise "x must ..., got ..."."""
    q, k, v = _qkv(gen, S=64)
    bad = q.clone()
    bad[0, 0, 3, 1] = float("nan")
    with pytest.raises(ValueError, match="q must be finite"):
        dg.token_oracle(bad, k, v, 0.2)
    with pytest.raises(ValueError, match="q, k, v must have one shape"):
        dg.block_oracle(q, k[:, :, :32], v, 0.2)
    with pytest.raises(TypeError, match="k must be float16, bfloat16, float32 or float64, got torch.int64"):
        dg.per_query_oracle(q, k.long(), v, 0.2)
    with pytest.raises(ValueError, match="v must be 4-D"):
        dg.vanilla_bsa(q, k, v[0], 0.2)
    for density in (0.0, 1.5, "0.2"):
        with pytest.raises(ValueError, match=r"density must be a number in \(0, 1\]"):
            dg.token_oracle(q, k, v, density)
    with pytest.raises(ValueError, match="group_size must be an int >= 1, got 0"):
        dg.token_oracle(q, k, v, 0.2, group_size=0)
    with pytest.raises(ValueError, match=r"perm must be int32 \[B, H, ceil\(S/C\)\*C\]"):
        dg.token_oracle(q, k, v, 0.2, group_size=64, perm=torch.zeros(1, 2, 64, dtype=torch.int64))
    with pytest.raises(ValueError, match="perm must hold each query index exactly once"):
        dg.token_oracle(q, k, v, 0.2, group_size=64, perm=torch.zeros(1, 2, 64, dtype=torch.int32))
    perm = kernels.pddp_groups(q, 64)
    with pytest.raises(ValueError, match=r"kv_idx must hold token indices in \[0, 64\) or -1"):
        dg.evaluate_selection(q, k, v, perm, torch.full((1, 2, 1, 64), 64, dtype=torch.int32))
    with pytest.raises(ValueError, match="kv_idx must be int32"):
        dg.evaluate_selection(q, k, v, perm, torch.zeros(1, 2, 1, 64, dtype=torch.int64))


def test_size_limit_names_the_memory_needed():
    """Above the limit the diagnostics refuse up front, naming the GiB the exact probabilities need."""
    q = torch.empty(1, 40, 75600, 128, device="meta")
    with pytest.raises(ValueError, match=r"need 851\.7 GiB .* over the limit of 8\.0 GiB"):
        dg.check_size(q)
    small = torch.zeros(1, 1, 512, 8)
    with pytest.raises(ValueError, match=r"need 0\.0 GiB"):
        dg.token_oracle(small, small, small + 1, 0.2, max_prob_bytes=1024)


def test_sol_attn_selection_reproduces_the_library(gen):
    """Our count of what Sol-Attn keeps is its own selection: with the pooled tail off, the library's output
    equals exact attention restricted to the reproduced blocks (head_dim 32 zero-padded to 128, S ragged)."""
    pytest.importorskip("comfy_kitchen")
    q, k, v = _qkv(gen, S=520)
    for density in (0.15, 0.4):
        r = dg.sol_attn(q, k, v, density, tail=False)
        assert r.available, r.note
        exact = dg.sol_attn_selection(q, k, r.extra["topk_ratio"])  # [B, H, 9, 9]
        mask = exact.repeat_interleave(64, -1).repeat_interleave(64, -2)[..., :520, :520]
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(32)
        p = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1)
        assert dg.relative_l1(r.out, p @ v) < 1e-4
        assert r.density == pytest.approx(float(mask.float().mean()))
        assert r.recall == pytest.approx(float((torch.softmax(scores, -1) * mask).sum(-1).mean()), abs=1e-5)


def test_sol_attn_matches_the_target_density(gen):
    """The chosen block budget puts Sol-Attn's realized density (diagonal included) nearest the target."""
    pytest.importorskip("comfy_kitchen")
    q, k, v = _qkv(gen, H=1, S=2048, D=128)
    n = 32
    for density in (0.1, 0.2, 0.3):
        r = dg.sol_attn(q, k, v, density)
        assert abs(r.density - density) <= 1.0 / n, (density, r.density, r.note)
        assert 0.0 < r.recall <= 1.0 and r.rel_l1 is None


def test_sol_attn_unavailable_for_large_head_dims(gen):
    """Sol-Attn takes head_dim 128; larger dims give an unavailable row with the reason, not an error."""
    q, k, v = _qkv(gen, S=256, D=160)
    r = dg.sol_attn(q, k, v, 0.2)
    assert not r.available and "128" in r.note and math.isnan(r.recall)


def test_mc_sparse_beats_its_ablation_and_bsa_at_a_reuse_step():
    """Synthetic workload, s = 0.2, a reuse step: MC-Sparse relL1 < MC-Sparse without residual < vanilla BSA.
    (Sol-Attn is reported, not asserted.)"""
    steps = 8
    spec = WorkloadSpec(frames=8, height=16, width=16, heads=2, head_dim=128, num_steps=steps, seed=3)
    wl = SyntheticWorkload(spec)
    warmup, anchors = schedule.paper_video_schedule(steps)
    cfg = MCSparseConfig(density=0.2, group_size=64, kv_tile=64, warmup_steps=warmup, anchor_steps=anchors)
    runner = MCSparseRunner(cfg)
    reuse = anchors[-1] + 2  # two steps past the last anchor
    for step in range(reuse + 1):
        q, k, v = wl.qkv(step)
        key = CacheKey(layer=0, shape=tuple(q.shape))
        out = runner.attention(q, k, v, step=step, layer=0, key=key)
    assert schedule.step_kind(cfg, reuse, 0) is schedule.StepKind.REUSE
    dense = kernels.dense_attention(q, k, v)
    entry = runner.cache.peek(key, q.device, q.dtype)
    mc = dg.relative_l1(out, dense)
    bare = dg.relative_l1(kernels.sparse_attention(q, k, v, entry.perm, entry.kv_idx), dense)
    bsa = dg.vanilla_bsa(q, k, v, 0.2, group_size=64, kv_tile=64).with_rel_l1(dense)
    sol = dg.sol_attn(q, k, v, 0.2).with_rel_l1(dense)
    print(f"relL1 MC-Sparse {mc:.4f}, w/o residual {bare:.4f}, vanilla BSA {bsa.rel_l1:.4f}, Sol-Attn {sol.rel_l1}")
    assert mc < bare < bsa.rel_l1
