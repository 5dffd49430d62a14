"""Random configurations through the attention override (the torch backend, float64 reference): every combination
of joint layout (none, video first, text first), conditioning chunks, rows per chunk, heads, head dim, text length
(0 to all masked), token count off the query tile, layout flags, query tile, density and dtype must give, at the
anchor step, exactly the caller's attention (under the text mask) and, at reuse steps on the anchor's own inputs,
sparse + residual = the anchor's dense output; never an internal error. The configurations come from a fixed seed
and each failure prints its own."""

from __future__ import annotations

import random

import torch
from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter import lifecycle, override, settings
from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter.callsite import TEXT_LEN_KEY, CallSite

from ._comfy_standins import raw_attention, transformer_options

TRIALS = 20


def _config(rnd: random.Random) -> dict:
    joint = rnd.choice([None, "video_first", "text_first"])
    text = rnd.choice([0, 1, 7, 16]) if joint else 0
    skip_reshape = rnd.choice([True, False])
    return dict(joint=joint, chunks=rnd.choice([1, 2]), per_chunk=rnd.choice([1, 2]), heads=rnd.choice([1, 2, 3]),
                head_dim=rnd.choice([64, 128]), text=text, video=rnd.choice([64, 100, 129, 200]),
                skip_reshape=skip_reshape, skip_output_reshape=skip_reshape and rnd.choice([True, False]),
                tile=rnd.choice([64, 128]), density=rnd.choice([0.3, 0.5, 0.9]),
                dtype=rnd.choice([torch.float32, torch.bfloat16]),
                masked=rnd.randint(0, text) if text and rnd.random() < 0.5 else None)


def test_random_override_configurations_are_exact_at_the_anchor_and_reproduce_it_at_reuse():
    rnd = random.Random(20261201)
    gen = torch.Generator().manual_seed(20261201)
    for _ in range(TRIALS):
        c = _config(rnd)
        B, H, D, S = c["chunks"] * c["per_chunk"], c["heads"], c["head_dim"], c["video"] + c["text"]
        mask = None
        if c["masked"] is not None:
            text = slice(c["video"], S) if c["joint"] == "video_first" else slice(0, c["text"])
            mask = torch.zeros(1, 1, S, dtype=c["dtype"])
            mask[..., text.stop - c["masked"]:text.stop] = -torch.finfo(torch.float32).max
        s = settings.build_settings(preset="custom", density=c["density"], dense_warmup="1", warmup_layers=0,
                                    anchor_steps="1", query_tile=c["tile"], cache_placement="auto", backend="torch",
                                    min_tokens=0, verbose=False)
        family = "hunyuan_video" if c["joint"] else "wan"
        run = lifecycle.RunState(s, torch.tensor([1.0, 0.8, 0.6, 0.0]), family=family)
        over = override.make_override(None)
        q, k, v = (torch.randn(B, H, S, D, generator=gen, dtype=c["dtype"]) for _ in range(3))
        if not c["skip_reshape"]:
            q, k, v = (t.transpose(1, 2).reshape(B, S, H * D) for t in (q, k, v))
        flags = dict(skip_reshape=c["skip_reshape"], skip_output_reshape=c["skip_output_reshape"])
        ref = raw_attention(q, k, v, H, mask=None if mask is None else mask.unsqueeze(1), **flags)
        exact = 1e-4 if c["dtype"] == torch.float32 else 2e-2
        for sigma, tol in ((1.0, exact), (0.8, 2 * exact + 2e-2), (0.6, 2 * exact + 2e-2)):  # reuse: R stored in bf16
            opts = transformer_options(run, CallSite(1, family, c["joint"]), chunks=c["chunks"], sigma=sigma)
            if c["joint"]:
                opts[TEXT_LEN_KEY] = c["text"]
            out = over(raw_attention, q, k, v, H, mask=mask, transformer_options=opts, **flags)
            assert out.shape == ref.shape and out.dtype == ref.dtype, (c, sigma)
            err = float((out.double() - ref.double()).abs().max())
            assert err <= tol, (c, sigma, err)
        counts = run.counts()
        assert counts["anchor"] == c["chunks"] and counts["sparse"] == 2 * c["chunks"], (c, run.summary(), counts)
        assert "internal error" not in run.summary(), (c, run.summary())
