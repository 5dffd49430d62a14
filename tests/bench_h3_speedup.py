"""MiniMax-H3 denoising speedup of MC-Sparse preset 'fast' in ComfyUI v0.33.0's own sampling (issue 11).

A benchmark, not a test (not collected). What it does:

1. imports ComfyUI v0.33.0 from ``--comfyui`` (the modules sampling needs; ``comfy.supported_models.MiniMaxH3``),
   loads this pack the way ComfyUI does (``_standalone.load_pack``);
2. builds ``model_base.MiniMaxH3`` -> ``comfy.ldm.minimax.model.MiniMaxH3Model`` with the published geometry
   (hidden 5376, 56 heads x 128, ffn 14336, text_dim 5120) in bf16 on the GPU, random weights N(0, 0.02) (norms 1,
   RoPE inverse frequencies 10000^(-i/16)), **with ``--blocks`` of the 50 DiT blocks** (default 8): the full model
   (~62 GB of weights) fits, but 50 blocks x 2 CFG branches at ~104k tokens cost ~60 s per dense step, too long
   for the 8-minute budget. Every block is timed (CUDA events around each block through ComfyUI's own
   ``patches_replace["dit"][("double_block", i)]`` hook), and each step kind's full-model time is
   ``non-block time + block 0 + 49 x mean(blocks 1..B-1)`` (block 0 stays dense in every step; blocks 1..49 are
   alike in shape and cost);
3. picks the longest packed sequence that fits: candidate lengths of a 768p (1344 x 768) video at 24 fps, longest
   first (345 frames = the authors' ~104k packed tokens); for each, the pack's own planner ``memory.plan_cache``
   decides for the FULL 50-block model (preset 'fast', 2 CFG branches, residual precision 'auto': bf16, fp8, int4;
   placement 'auto': GPU, else pinned CPU memory) with the GPU memory left beside the full model's weights and an
   activation estimate, and the host memory available; the first length it does not leave dense is used, and
   the timed run uses the planned residual precision and placement (so reuse steps pay the CPU->GPU prefetch if
   the plan says so);
4. samples with ``comfy.sample.sample`` (euler, simple, cfg 5; synthetic Qwen3-VL states ``[1, 256, 5120]``
   positive and negative; a NestedTensor AV latent as ``EmptyMiniMaxH3LatentAV`` makes): unpatched for
   ``--dense-steps`` steps, then patched with ``apply_mc_sparse(preset="fast")`` (the node as a user sets it, on
   H3 the published schedule: ``adapter/minimax.h3_schedule``) for ``--steps`` steps (4: anchor, reuse x 3);
   kernels are compiled first on the exact shapes (one anchor + one reuse call through the pack's runner);
5. extrapolates to the published 49-step schedule (9 dense + 1 anchor + 39 reuse, block 0 dense) against 49
   unpatched dense steps, per step kind (as ``tests/bench_comfyui_speedup.py`` does), and writes
   ``h3_speedup_fast`` to ``docs/results/scoreboard.json`` (and ``OUT/scoreboard.json``, tests/_scoreboard.py) with
   the packed token count; the commit: --commit, else $MC_SPARSE_COMMIT, else git HEAD.

Usage (H200, ~5 minutes; the lead carries ``.gpu-bundle-h3`` made by ``tests/make_h3_gpu_bundle.sh``):
    python3 tests/bench_h3_speedup.py --comfyui /tmp/comfyui-2026 --out $OUT
CPU smoke (tiny model, a minute):
    .venv-comfy26/bin/python tests/bench_h3_speedup.py --comfyui .comfyui-2026 --tiny --out /tmp/h3bench
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _scoreboard  # noqa: E402
from bench_comfyui_speedup import _stub_if_missing  # noqa: E402

KEY = "h3_speedup_fast"

FULL = {"hidden_size": 5376, "num_attention_heads": 56, "attention_head_dim": 128, "ffn_hidden_size": 14336,
        "text_dim": 5120, "time_embed_hidden_size": 5376, "time_embed_dim": 2688, "num_layers": 50}
TINY = {"hidden_size": 256, "num_attention_heads": 2, "attention_head_dim": 128, "ffn_hidden_size": 512,
        "text_dim": 64, "time_embed_hidden_size": 256, "time_embed_dim": 128, "num_layers": 50}
PUBLISHED_STEPS = 49
FRAMES = (345, 311, 277, 243, 209, 175, 124)  # 17k + 5 frames at 24 fps (EmptyMiniMaxH3LatentAV's grid)


class Env:
    """Imported ComfyUI and pack modules."""


def setup(comfyui_dir: str, device: torch.device) -> Env:
    root = Path(comfyui_dir).resolve()
    if not (root / "comfy" / "ldm" / "minimax" / "model.py").is_file():
        raise FileNotFoundError(f"--comfyui must be a ComfyUI v0.33.0 checkout (comfy/ldm/minimax), got {root}")
    sys.path.insert(0, str(root))
    from comfy.cli_args import args

    if device.type == "cpu":
        args.cpu = True
    env = Env()
    env.stubbed = _stub_if_missing("torchsde", "SDE samplers only; euler does not use it")
    import comfy.model_base
    import comfy.model_management
    import comfy.model_patcher
    import comfy.nested_tensor
    import comfy.patcher_extension
    import comfy.sample

    try:  # imports every text encoder (transformers): may break on a transformers other than ComfyUI's
        import comfy.supported_models

        env.h3_config = comfy.supported_models.MiniMaxH3
        env.config_source = "comfy.supported_models.MiniMaxH3"
    except Exception as err:  # noqa: BLE001  the same config class, without the text-encoder imports
        import comfy.latent_formats
        import comfy.supported_models_base

        env.h3_config = _fallback_h3_config(comfy.supported_models_base, comfy.model_base, comfy.latent_formats)
        env.config_source = f"local copy of MiniMaxH3 (comfy.supported_models failed: {type(err).__name__}: {err})"
        print(f"note: {env.config_source}", flush=True)
    env.root = str(root)
    env.mm = comfy.model_management
    env.model_patcher = comfy.model_patcher
    env.nested = comfy.nested_tensor
    env.pe = comfy.patcher_extension
    env.sample = comfy.sample
    sys.path.insert(0, str(ROOT / "comfyui_mc_sparse"))
    import importlib
    import importlib.util

    import _standalone

    try:
        pack = _standalone.load_pack()  # the checkout root as a package, as nodes.load_custom_node does
    except Exception as err:  # e.g. comfy_api needs PyAV, absent here: the package without its root __init__
        spec = importlib.util.spec_from_file_location(_standalone.PACK_NAME, ROOT / "__init__.py",
                                                      submodule_search_locations=[str(ROOT)])
        pack = importlib.util.module_from_spec(spec)
        sys.modules[_standalone.PACK_NAME] = pack
        print(f"note: package shell without the root __init__ (load_pack failed: {type(err).__name__}: {err})",
              flush=True)
    p = pack.__name__
    for name in ("lifecycle", "minimax", "settings"):
        setattr(env, name, importlib.import_module(f"{p}.comfyui_mc_sparse.adapter.{name}"))
    for name in ("engine", "config", "cache", "memory"):
        setattr(env, name, importlib.import_module(f"{p}.comfyui_mc_sparse.{name}"))
    return env


def _fallback_h3_config(supported_models_base, model_base, latent_formats):
    class MiniMaxH3(supported_models_base.BASE):  # comfy/supported_models.py MiniMaxH3, minus clip_target
        unet_config = {"image_model": "minimax_h3"}  # noqa: RUF012
        sampling_settings = {"shift": 12.0, "audio_shift": 3.0}  # noqa: RUF012
        unet_extra_config = {}  # noqa: RUF012
        latent_format = latent_formats.MiniMaxH3AV
        memory_usage_factor = 0.114
        supported_inference_dtypes = [torch.bfloat16, torch.float32]  # noqa: RUF012

        def get_model(self, state_dict, prefix="", device=None):
            return model_base.MiniMaxH3(self, device=device)

    return MiniMaxH3


def now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def build(env: Env, geo: dict, blocks: int, device: torch.device, dtype: torch.dtype, seed: int):
    """``model_base.MiniMaxH3`` with ``blocks`` DiT blocks, random weights; returns (ModelPatcher, info)."""
    unet = {"image_model": "minimax_h3", **geo, "num_layers": blocks, "token_refiner_num_layers": 2,
            "latents_dim": 24, "audio_latents_dim": 32, "timestep_input_dim": 256, "rope_inv_freq_len": 16}
    t0 = time.perf_counter()
    config = env.h3_config(unet)
    config.set_inference_dtype(dtype, None)
    base = config.get_model({}, device=device)
    dm = base.diffusion_model
    g = torch.Generator(device=device).manual_seed(seed)
    n = 0
    with torch.no_grad():
        for name, p in dm.named_parameters():
            n += p.numel()
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
        inv = dm.rope.inv_freq
        inv.copy_(10000.0 ** (-torch.arange(inv.numel(), dtype=torch.float32, device=inv.device) / inv.numel()))
    per_block = sum(p.numel() * p.element_size() for p in dm.blocks[0].parameters())
    patcher = env.model_patcher.ModelPatcher(base, load_device=device, offload_device=device)
    info = {"blocks": blocks, "params": n, "block_bytes": per_block, "build_s": time.perf_counter() - t0,
            "config": unet, "class": type(dm).__name__}
    return patcher, info


def av_shape(frames: int, width: int, height: int) -> tuple[tuple, tuple]:
    """Video and audio latent shapes of ``EmptyMiniMaxH3LatentAV`` (nodes_minimax_h3.py ``temporal_shape``)."""
    latent_t = 2 if frames <= 5 else ((frames - 5) // 17) * 5 + 2
    audio_t = round(frames / 24 * 40)
    return (1, 24, latent_t, height // 16, width // 16), (1, 32, 2, audio_t)


def video_tokens(vshape) -> int:
    return vshape[2] * math.ceil(vshape[3] / 2) * math.ceil(vshape[4] / 2)


def plan_length(env: Env, geo: dict, block_bytes: int, other_bytes: int, text_len: int, width: int, height: int,
                device: torch.device, act_bytes_per_token: float, frames_list) -> dict:
    """The longest candidate whose FULL-model cache the pack's own planner places (``memory.plan_cache``: residual
    precision bf16 -> fp8 -> int4 and placement GPU -> pinned CPU memory, preset 'fast' on the published H3
    schedule, 2 CFG branches, default headroom) beside the full model's weights and an activation estimate."""
    heads, head_dim = geo["num_attention_heads"], geo["attention_head_dim"]
    warm, anchors = env.minimax.h3_schedule(PUBLISHED_STEPS)
    cfg = env.config.MCSparseConfig(density=0.15, group_size=128, warmup_steps=warm, warmup_layers=1,
                                    anchor_steps=anchors, cache_placement="auto", residual_dtype="auto")
    total_gpu = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    weights = geo["num_layers"] * block_bytes + other_bytes
    host = env.memory.host_memory()
    tried = []
    for frames in frames_list:
        vshape, ashape = av_shape(frames, width, height)
        tokens = video_tokens(vshape)
        packed = tokens + 2 * ashape[-1] + text_len
        gpu_free = None if total_gpu is None else max(0, total_gpu - weights - int(act_bytes_per_token * packed))
        plan = env.memory.plan_cache(cfg, heads=heads, head_dim=head_dim, layers=geo["num_layers"], tokens=tokens,
                                     branches=2, batch=1, gpu_free=gpu_free, host=host, suggest=False)
        row = {"frames": frames, "video_tokens": tokens, "packed_tokens": packed,
               "gpu_free_gib_full_model": None if gpu_free is None else gpu_free / 2**30,
               "host_available_gib": None if host is None else host.available / 2**30,
               "residual": plan.residual_dtype, "placement": plan.placement,
               "cache_gib_full_model": None if plan.estimate is None else plan.estimate.total_bytes / 2**30,
               "dense_reason": plan.reason}
        tried.append(row)
        if not plan.dense:
            label = {v: k for k, v in env.settings.RESIDUAL_PRECISIONS.items()}[plan.residual_dtype]
            return {"frames": frames, "vshape": vshape, "ashape": ashape, "video_tokens": tokens,
                    "packed_tokens": packed, "placement": plan.placement, "residual_precision": label,
                    "tried": tried}
    raise RuntimeError(f"no candidate length fits: {tried}")


class BlockTimer:
    """Per-block CUDA-event timing through ``patches_replace["dit"][("double_block", i)]`` (model.py L640-650)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pending: list[tuple] = []  # (eval index, block, start, end)
        self.eval_index = -1

    def patch(self, i: int):
        def replace(args, extra):
            if self.device.type == "cuda":
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                out = extra["original_block"](args)
                e.record()
            else:
                s = time.perf_counter()
                out = extra["original_block"](args)
                e = time.perf_counter()
            self.pending.append((self.eval_index, i, s, e))
            return out

        return replace

    def resolve(self) -> dict[int, dict[int, float]]:
        """{eval index: {block: seconds summed over the eval's forwards}}."""
        out: dict[int, dict[int, float]] = {}
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for ev, i, s, e in self.pending:
            dt = s.elapsed_time(e) / 1000.0 if self.device.type == "cuda" else e - s
            out.setdefault(ev, {}).setdefault(i, 0.0)
            out[ev][i] += dt
        return out


def timed_sample(env: Env, patcher, *, steps: int, plan: dict, text_len: int, geo: dict, device, seed: int) -> dict:
    m = patcher.clone()
    blocks = len(m.get_model_object("diffusion_model").blocks)
    timer = BlockTimer(device)
    for i in range(blocks):
        m.set_model_patch_replace(timer.patch(i), "dit", "double_block", i)
    rec = {"evals": [], "step_ends": [], "t_start": None, "run": None}

    def sampler_sample(executor, *args, **kwargs):
        rec["t_start"] = now(device)
        return executor(*args, **kwargs)

    def calc_cond_batch(executor, *args, **kwargs):
        mo = args[4] if len(args) > 4 else kwargs.get("model_options") or {}
        run = (mo.get("transformer_options") or {}).get("mc_sparse_run")
        rec["run"] = run or rec["run"]
        before = run.counts() if run is not None else {"sparse": 0, "anchor": 0, "dense": 0}
        timer.eval_index = len(rec["evals"])
        t0 = now(device)
        out = executor(*args, **kwargs)
        t1 = now(device)
        after = run.counts() if run is not None else before
        rec["evals"].append({"eval_s": t1 - t0, "calls": {k: after[k] - before[k] for k in after}})
        return out

    m.add_wrapper_with_key(env.pe.WrappersMP.SAMPLER_SAMPLE, "h3_bench", sampler_sample)
    m.add_wrapper_with_key(env.pe.WrappersMP.CALC_COND_BATCH, "h3_bench", calc_cond_batch)

    def callback(step, x0, x, total):
        rec["step_ends"].append(now(device))

    g = torch.Generator().manual_seed(seed)
    video, audio = torch.randn(plan["vshape"], generator=g), torch.randn(plan["ashape"], generator=g)
    noise = env.nested.NestedTensor((video, audio))
    latent = env.nested.NestedTensor((torch.zeros(plan["vshape"]), torch.zeros(plan["ashape"])))
    cg = torch.Generator().manual_seed(seed + 1)
    pos = [[torch.randn(1, text_len, geo["text_dim"], generator=cg), {}]]
    neg = [[torch.randn(1, text_len, geo["text_dim"], generator=cg), {}]]
    t0 = time.perf_counter()
    out = env.sample.sample(m, noise, steps, 5.0, "euler", "simple", pos, neg, latent, denoise=1.0,
                            callback=callback, disable_pbar=True, seed=seed)
    rec["call_s"] = time.perf_counter() - t0
    tensors = out.unbind() if getattr(out, "is_nested", False) else [out]
    rec["finite"] = all(bool(torch.isfinite(t).all()) for t in tensors)
    blocks_by_eval = timer.resolve()
    prev = rec["t_start"]
    rows = []
    for i, t in enumerate(rec["step_ends"]):
        ev = rec["evals"][i] if len(rec["evals"]) == len(rec["step_ends"]) else None
        calls = ev["calls"] if ev else {}
        kind = "anchor" if calls.get("anchor") else "reuse" if calls.get("sparse") else "dense"
        per_block = blocks_by_eval.get(i, {})
        rows.append({"step": i + 1, "kind": kind, "wall_s": t - prev, "eval_s": ev["eval_s"] if ev else None,
                     "calls": calls, "block_s": [per_block.get(b, 0.0) for b in range(blocks)]})
        prev = t
    rec["rows"] = rows
    if rec["run"] is not None:
        rec["summary"] = rec["run"].summary()
        runner = rec["run"].runner
        if runner is not None:
            c = runner.cache
            rec["cache"] = {"peak_bytes": c.peak_bytes, "peak_gpu_bytes": c.peak_gpu_bytes,
                            "peak_host_bytes": c.peak_host_bytes, "placement": runner.config.cache_placement}
    del m
    return rec


def full_step(row: dict, full_blocks: int) -> float:
    """Full-model step time from a B-block step: wall - blocks + block 0 + (full-1) x mean(blocks 1..B-1)."""
    b = row["block_s"]
    rest = b[1:] or b
    return row["wall_s"] - sum(b) + b[0] + (full_blocks - 1) * statistics.mean(rest)


def warm(values: list[float]) -> float:
    return statistics.median(values[1:] if len(values) >= 2 else values) if values else float("nan")


def prewarm(env: Env, geo: dict, plan: dict, device, dtype) -> float:
    """One anchor and one reuse call at the exact per-branch shape (video rows + non-video extra keys), so
    kernel compilation is not inside the timed steps."""
    t0 = now(device)
    heads, d = geo["num_attention_heads"], geo["attention_head_dim"]
    s, extra = plan["video_tokens"], plan["packed_tokens"] - plan["video_tokens"]
    residual = env.settings.RESIDUAL_PRECISIONS[plan.get("residual_precision", "auto")]  # the timed run's storage
    cfg = env.config.MCSparseConfig(density=0.15, group_size=128, warmup_steps=0, warmup_layers=0, anchor_steps=(0,),
                                    residual_dtype=residual)
    runner = env.engine.MCSparseRunner(cfg, backend="auto")
    g = torch.Generator(device=device).manual_seed(7)
    q, k, v = (torch.randn(1, heads, s, d, generator=g, device=device, dtype=dtype) for _ in range(3))
    kx, vx = (torch.randn(1, heads, extra, d, generator=g, device=device, dtype=dtype) for _ in range(2))
    key = env.cache.CacheKey(layer=0, branch="prewarm", window=None, shape=tuple(q.shape), kind="self")
    for step in (0, 1):
        runner.attention(q, k, v, step=step, layer=0, key=key, extra_kv=(kx, vx))
    runner.close()
    del q, k, v, kx, vx, runner
    return now(device) - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--comfyui", required=True, help="ComfyUI v0.33.0 checkout")
    ap.add_argument("--out", required=True, help="output folder (h3_speedup.json)")
    ap.add_argument("--blocks", type=int, default=8, help="DiT blocks built and timed (of 50)")
    ap.add_argument("--steps", type=int, default=4, help="patched steps (preset fast: anchor + reuse)")
    ap.add_argument("--dense-steps", type=int, default=2, help="unpatched steps")
    ap.add_argument("--text-tokens", type=int, default=256)
    ap.add_argument("--frames", type=int, default=None, help="force one frame count (17k + 5)")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke: tiny dims, 64x64, 22 frames")
    ap.add_argument("--residual-precision", default=None, help="force bf16 / fp8 / int4 instead of the plan's")
    ap.add_argument("--no-scoreboard", action="store_true")
    ap.add_argument("--commit", default=None, help="commit measured (default $MC_SPARSE_COMMIT, else git HEAD)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() and not a.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    geo = TINY if a.tiny else FULL
    width, height = (256, 256) if a.tiny else (1344, 768)
    result: dict = {"argv": sys.argv, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    "torch": torch.__version__}
    path = out_dir / "h3_speedup.json"

    def dump():
        path.write_text(json.dumps(result, indent=2, default=str))

    try:
        env = setup(a.comfyui, device)
        base, info = build(env, geo, a.blocks, device, dtype, a.seed)
        info["config_source"], info["stubbed"] = env.config_source, env.stubbed
        result["model"] = info
        dm = base.model.diffusion_model
        other = sum(p.numel() * p.element_size() for p in dm.parameters()) - a.blocks * info["block_bytes"]
        frames = [a.frames] if a.frames else ([22] if a.tiny else list(FRAMES))
        # activation peak per packed token: ~ qkv (3 x H x D) + mlp (2 x ffn) + 4 x hidden, bf16, x 1.5 margin
        act_per_token = 1.5 * 2 * (3 * geo["num_attention_heads"] * geo["attention_head_dim"]
                                   + 3 * geo["ffn_hidden_size"] + 4 * geo["hidden_size"])
        plan = plan_length(env, geo, info["block_bytes"], other, a.text_tokens, width, height, device, act_per_token,
                           frames)
        if a.residual_precision:
            plan["residual_precision"] = a.residual_precision
        result["plan"] = {k: v for k, v in plan.items()}
        print(f"plan: {plan['frames']} frames, {plan['video_tokens']} video / {plan['packed_tokens']} packed tokens, "
              f"full-model cache -> {plan['placement']}, residual {plan['residual_precision']}", flush=True)
        dump()
        dense = timed_sample(env, base, steps=a.dense_steps, plan=plan, text_len=a.text_tokens, geo=geo,
                             device=device, seed=a.seed)
        result["dense"] = {k: dense[k] for k in ("rows", "call_s", "finite")}
        dump()
        if device.type == "cuda":
            result["prewarm_s"] = prewarm(env, geo, plan, device, dtype)
        patch = {"preset": "fast", "cache_placement": plan["placement"],
                 "residual_precision": plan["residual_precision"]}
        if a.tiny:  # the preset keeps videos under 4096 tokens dense: the smoke test uses its schedule by hand, and
            # backend torch (named: on the CPU 'auto' finds no fast sparse kernel and the run would stay dense)
            patch.update(preset="custom", density=0.15, dense_warmup="1", anchor_steps="1", warmup_layers=1,
                         min_tokens=0, query_tile=64, backend="torch")
        patched_model = env.lifecycle.apply_mc_sparse(base, **patch)
        sparse = timed_sample(env, patched_model, steps=a.steps, plan=plan, text_len=a.text_tokens, geo=geo,
                              device=device, seed=a.seed)
        result["patched"] = {k: sparse.get(k) for k in ("rows", "call_s", "finite", "summary", "cache")}
        dump()
        by_kind: dict[str, list[float]] = {"dense": [], "anchor": [], "reuse": []}
        for r in dense["rows"]:
            by_kind["dense"].append(full_step(r, geo["num_layers"]))
        for r in sparse["rows"]:
            if r["kind"] in ("anchor", "reuse"):
                by_kind[r["kind"]].append(full_step(r, geo["num_layers"]))
        missing = [k for k, v in by_kind.items() if not v]
        if missing:
            raise RuntimeError(f"no timed step of kind {missing}: {[r['kind'] for r in sparse['rows']]}")
        d, an, re_ = warm(by_kind["dense"]), warm(by_kind["anchor"]), warm(by_kind["reuse"])
        warm_steps, anchors = env.minimax.h3_schedule(PUBLISHED_STEPS)
        n_dense, n_anchor = warm_steps - len(anchors), len(anchors)
        n_reuse = PUBLISHED_STEPS - n_dense - n_anchor
        speedup = PUBLISHED_STEPS * d / (n_dense * d + n_anchor * an + n_reuse * re_)
        result["full_model_step_s"] = {"dense": d, "anchor": an, "reuse": re_, "samples": by_kind}
        result["schedule"] = {"steps": PUBLISHED_STEPS, "dense": n_dense, "anchor": n_anchor, "reuse": n_reuse}
        result[KEY] = speedup
        result["finite"] = dense["finite"] and sparse["finite"]
        note = (f"{plan['packed_tokens']} packed tokens ({plan['video_tokens']} video, 768p {plan['frames']} frames, "
                f"text {a.text_tokens}, audio {2 * plan['ashape'][-1]}); CFG 2 branches; preset fast (density 0.15, "
                f"published H3 schedule {n_dense} dense + {n_anchor} anchor + {n_reuse} reuse of 49, block 0 dense); "
                f"{a.blocks} of 50 blocks built and timed per block, full model = non-block + block 0 + 49 x mean "
                f"sparse-eligible block, per step kind; cache {plan['placement']}, residual "
                f"{plan['residual_precision']} (the pack's memory.plan_cache for the full 50-block model)")
        result["note"] = note
        print(f"{KEY} = {speedup:.3f}x  (dense {d:.2f} s, anchor {an:.2f} s, reuse {re_:.2f} s per full-model step)",
              flush=True)
        print(f"note: {note}", flush=True)
        if not a.no_scoreboard and not a.tiny and device.type == "cuda":
            _scoreboard.update({KEY: _scoreboard.entry(
                speedup, "x", note, command="python3 tests/bench_h3_speedup.py --comfyui <v0.33.0> --out $OUT",
                commit=_scoreboard.measured_commit(a.commit), gpu=result["device"], digits=3)},
                out_dir / "scoreboard.json")
    except Exception as err:  # noqa: BLE001
        result["error"] = f"{type(err).__name__}: {err}"
        result["traceback"] = traceback.format_exc()
        print(result["traceback"], flush=True)
        dump()
        return 1
    dump()
    return 0


if __name__ == "__main__":
    sys.exit(main())
