"""MiniMax-H3 and ComfyUI v0.33.0 support without ComfyUI: the published schedule, the video rows of a packed
layout, the H3 preset, HunyuanVideo's joint order read from the model, and the AttentionTensorContainer entry.

The real-model checks (ComfyUI's loader, sampler and PackedLayout; float64 references) are in
``tests/integration/test_comfyui_2026.py``.
"""

import pytest
import torch
from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter import layouts, minimax, override, settings


@pytest.mark.parametrize("steps, warmup", [(49, 10), (50, 10), (20, 4), (10, 2), (4, 1), (1, 1), (27, 6), (37, 8)])
def test_h3_schedule_scales_published_one(steps, warmup):
    """10 of 49 steps dense, ONE anchor at the last dense step, scaled, rounded to the nearest step (27 steps: 5.51
    -> 6; mutation that left the suite green: rounded down)."""
    assert minimax.h3_schedule(steps) == (warmup, (warmup - 1,))


def test_h3_schedule_rejects_zero_steps():
    with pytest.raises(ValueError, match="num_steps"):
        minimax.h3_schedule(0)


def test_video_rows_from_segments():
    segs = [(0, 24, "text"), (24, 88, "cond"), (88, 104, "cond_audio"), (104, 178, "audio"), (178, 626, "video")]
    assert minimax.video_rows(segs, 626) == (178, 626)
    assert "does not end" in minimax.video_rows(segs[:-1] + [(178, 600, "video")], 626)
    assert "0 video segments" in minimax.video_rows(segs[:-1], 178)
    assert "2 video segments" in minimax.video_rows(segs + [(626, 700, "video")], 700)
    assert "no non-video rows" in minimax.video_rows([(0, 10, "video")], 10)
    assert "no video rows" in minimax.video_rows([(0, 10, "text"), (10, 10, "video")], 10)  # an empty video segment


def _settings(preset, **over):
    base = dict(preset=preset, density=0.3, dense_warmup="auto", warmup_layers=0, anchor_steps="auto",
                query_tile=64, cache_placement="auto", backend="auto", min_tokens=0, verbose=False)
    return settings.build_settings(**{**base, **over})


def test_h3_preset_for_run():
    """A preset on H3: published schedule, block 0 dense, min 4096 tokens; custom is left alone."""
    s, sched = minimax.preset_for_run(_settings("fast"), 49)
    assert (sched.warmup_steps, sched.anchor_steps) == (10, (9,))
    assert s.density == 0.15 and s.warmup_layers == 1 and s.min_tokens == 4096
    assert "published H3 schedule" in sched.notes[0]
    custom = _settings("custom", dense_warmup="3", anchor_steps="3")
    s2, sched2 = minimax.preset_for_run(custom, 10)
    assert s2 is custom and (sched2.warmup_steps, sched2.anchor_steps) == (3, (2,))


class _Block(torch.nn.Module):
    def __init__(self, **attrs):
        super().__init__()
        for k, v in attrs.items():
            setattr(self, k, v)


class _HunyuanVideo(torch.nn.Module):
    def __init__(self, flipped):
        super().__init__()
        attrs = {"flipped_img_txt": True} if flipped else {}
        self.double_blocks = torch.nn.ModuleList([_Block(**attrs), _Block(**attrs)])
        self.single_blocks = torch.nn.ModuleList([_Block()])


_HunyuanVideo.__name__ = "HunyuanVideo"


@pytest.mark.parametrize("flipped, joint", [(True, "video_first"), (False, "text_first")])
def test_hunyuan_video_order_read_from_model(flipped, joint):
    """v0.3.64 (flipped_img_txt on the double blocks): [video, text]; v0.33.0 (no attribute): [text, video]."""
    plan = layouts.plan_for(_HunyuanVideo(flipped))
    assert plan.family == "hunyuan_video"
    sites = [factory(lambda *a, **k: None).mc_sparse_marker for _, factory in plan.patches]
    assert {s.joint for s in sites} == {joint}
    assert [s.comfy_block for s in sites] == [("double", 0), ("double", 1), ("single", 0)]


class _H3Attn(torch.nn.Module):
    heads, head_dim = 2, 128


class MiniMaxH3Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Block(attn=_H3Attn()) for _ in range(3)])
        self.token_refiner = _Block(blocks=torch.nn.ModuleList([_Block(attn=_H3Attn())]))
        self.patch_size = (1, 2, 2)


def test_h3_plan_marks_dit_blocks_only():
    plan = layouts.plan_for(MiniMaxH3Model())
    assert plan.family == "minimax_h3" and plan.diffusion_model_wrapper is minimax.layout_wrapper
    assert [p for p, _ in plan.patches] == [f"blocks.{i}.attn.forward" for i in range(3)]
    site = plan.patches[1][1](lambda *a, **k: None).mc_sparse_marker
    assert (site.layer, site.joint, site.text_len) == (1, "text_first", None)
    geo = layouts.geometry(MiniMaxH3Model(), plan, (1, 24, 7, 16, 16))
    assert (geo.heads, geo.head_dim, geo.tokens, geo.layers) == (2, 128, 7 * 8 * 8, 3)


def test_block_index_disagreement_is_noted():
    """ComfyUI's (block_type, block_index) equal to the mark: nothing noted; different: one note."""

    class Run:
        notes: list = []

    site = layouts.CallSite(2, "wan", comfy_block=("double", 2))
    fwd = layouts._marking_forward(lambda *a, **k: k["transformer_options"], site)
    run = Run()
    seen = fwd(transformer_options={"block_index": 2, "block_type": "double", "mc_sparse_run": run})
    assert seen[layouts.MARK_KEY].layer == 2 and run.notes == []
    fwd(transformer_options={"block_index": 3, "block_type": "double", "mc_sparse_run": run})
    fwd(transformer_options={"block_index": 3, "block_type": "double", "mc_sparse_run": run})
    assert len(run.notes) == 1 and "block index double 3 differs from the marked block double 2" in run.notes[0]


class _Container:
    """Stand-in for v0.33.0 ``AttentionTensorContainer`` (attention.py L152-168): peek / take, single owner."""

    def __init__(self, t):
        self.tensor = t

    def peek(self):
        if self.tensor is None:
            raise RuntimeError("consumed")
        return self.tensor

    def take(self):
        t = self.peek()
        self.tensor = None
        return t


def test_container_entry_outside_a_run_uses_previous_container_path():
    """No MC-Sparse run: the containers go untouched to the chained override's own container_function."""
    got = {}

    def previous(func, *a, **k):
        raise AssertionError("tensor path used")

    def previous_containers(q, k, v, heads, **kw):
        got["args"] = (q, k, v, heads, kw["skip_reshape"])
        return "dense"

    previous.container_function = previous_containers
    ours = override.make_override(previous)
    cs = [_Container(torch.randn(1, 2, 8, 4)) for _ in range(3)]
    assert ours.container_function(*cs, 2, skip_reshape=True, transformer_options={}) == "dense"
    assert got["args"][:3] == tuple(cs) and got["args"][3:] == (2, True)


def test_container_entry_in_a_run_peeks_without_copy_and_releases():
    """In a run the dispatch sees the very tensors in the containers (no copy); they are released after."""
    seen = {}

    def fake_dispatch(run, site, q, k, v, heads, **kw):
        seen["qkv"] = (q, k, v)
        return "sparse"

    ts = [torch.randn(1, 2, 8, 4).transpose(2, 3).transpose(2, 3) for _ in range(3)]
    cs = [_Container(t) for t in ts]
    real = override.dispatch
    override.dispatch = fake_dispatch
    try:
        ours = override.make_override(None)
        out = ours.container_function(*cs, 2, skip_reshape=True,
                                      transformer_options={override.RUN_KEY: object()})
    finally:
        override.dispatch = real
    assert out == "sparse" and all(a is b for a, b in zip(seen["qkv"], ts))
    assert all(c.tensor is None for c in cs)


def test_h3_layout_wrapper_sets_only_this_forwards_rows(monkeypatch):
    """Each forward's transformer_options say where THIS forward's video rows start, or why it has none: a layout that
    cannot be read after a readable one removes the earlier text length (else its joint calls would split a new
    sequence at a stale row), and a readable one removes an earlier reason. Mutation: either key not reset first."""
    import types

    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter.callsite import LAYOUT_MISSING_KEY, TEXT_LEN_KEY

    good = types.SimpleNamespace(segments=((0, 12, "text"), (12, 60, "video")), seq_len=60)
    layouts = [good, RuntimeError("unreadable"), good]

    def packed_layout(dm, x, context, payload):
        item = layouts.pop(0)
        if isinstance(item, Exception):
            raise item
        return item

    monkeypatch.setattr(minimax, "packed_layout", packed_layout)

    class Executor:
        class_obj = None

        def __call__(self, x, timestep, context, transformer_options):
            return dict(transformer_options)

    options = {}  # one dict across forwards: the worst case (ComfyUI copies it per call)
    seen = [minimax.layout_wrapper(Executor(), None, None, None, options) for _ in range(3)]
    assert seen[0].get(TEXT_LEN_KEY) == 12 and LAYOUT_MISSING_KEY not in seen[0]
    assert TEXT_LEN_KEY not in seen[1] and "unreadable" in seen[1][LAYOUT_MISSING_KEY]
    assert seen[2].get(TEXT_LEN_KEY) == 12 and LAYOUT_MISSING_KEY not in seen[2]


def test_h3_patches_skip_blocks_without_attention():
    """Only blocks that have an ``attn`` get an object patch (a patch on a missing attribute fails when ComfyUI
    applies it). Mutation: every block patched."""
    model = MiniMaxH3Model()
    del model.blocks[1].attn
    assert [p for p, _ in minimax.patches(model)] == ["blocks.0.attn.forward", "blocks.2.attn.forward"]
