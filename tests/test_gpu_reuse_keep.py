"""GPU check of the reuse loads kept decoded (``prefetch.ReuseLoader``: a group decoded once, its batch kept, the
entries' residuals rebound to the kept rows): on CUDA, through the runner, with the side-stream prefetch, the reuse
outputs of a run that keeps its decoded groups equal those of a run that decodes every step, bit for bit."""

import pytest
import torch
from comfyui_mc_sparse_pack.comfyui_mc_sparse.cache import CacheKey
from comfyui_mc_sparse_pack.comfyui_mc_sparse.config import MCSparseConfig
from comfyui_mc_sparse_pack.comfyui_mc_sparse.engine import MCSparseRunner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
]


def _run(keep: bool, qkv, layers: int, steps: int):
    cfg = MCSparseConfig(density=0.15, group_size=128, warmup_steps=0, warmup_layers=0, anchor_steps=(0,))
    runner = MCSparseRunner(cfg)
    if not keep:
        runner.loader.keep_limit = lambda device: None
    heads, seq, dim = qkv[0].shape[1], qkv[0].shape[2], qkv[0].shape[3]
    outs = []
    for step in range(steps):
        runner.begin_evaluation(step)
        for layer in range(layers):
            keys = [CacheKey(layer=layer, branch=b, window=None, shape=(1, heads, seq, dim)) for b in ("u", "c")]
            out = torch.full((2, seq, heads * dim), float("nan"), device="cuda", dtype=qkv[0].dtype)
            out_h = out.view(2, seq, heads, dim).transpose(1, 2)
            runner.attention(*qkv, step=step, layer=layer, keys=keys, out=out_h)
            outs.append(out)
    torch.cuda.synchronize()
    return runner, outs


def test_kept_reuse_batches_match_decoding_every_step():
    g = torch.Generator(device="cuda").manual_seed(3)
    heads, seq, dim, layers, steps = 4, 4096, 128, 3, 4
    print("seed 3")
    flat = [torch.randn(2, seq, heads * dim, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    qkv = [t.view(2, seq, heads, dim).transpose(1, 2) for t in flat]  # ComfyUI's layout, strided views
    kept, outs_kept = _run(True, qkv, layers, steps)
    plain, outs_plain = _run(False, qkv, layers, steps)
    assert kept.loader.kept_loads == 2 * layers * (steps - 2) and plain.loader.kept_loads == 0
    for a, b in zip(outs_kept, outs_plain):
        assert torch.isfinite(a).all() and torch.equal(a, b)
    for group, (_, batch) in kept.loader._kept.items():
        for i, key in enumerate(group):
            assert kept.cache.get(key).residual.data.data_ptr() == batch.residual.data[i].data_ptr()
    kept.close()
    plain.close()
