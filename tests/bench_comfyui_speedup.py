"""DiT denoising speedup of MC-Sparse in real ComfyUI sampling (issue 5). A benchmark, not a test (not collected).

What it does, per configuration (model x resolution):

1. imports the few ComfyUI modules it needs from the checkout ``--comfyui`` (no ``nodes.py``, no text encoders;
   ``comfy.supported_models`` is tried and replaced by an identical WAN21_T2V config if its text-encoder imports
   fail), loads this pack the way ComfyUI does (``_standalone.load_pack``: the checkout root as a package);
2. builds Wan2.1 T2V with ComfyUI's own classes (``WAN21_T2V`` config -> ``model_base.WAN21`` ->
   ``comfy.ldm.wan.model.WanModel``) directly on the device in bf16, fills every parameter with N(0, 0.02)
   (norm weights 1, norm biases 0; ComfyUI's ops skip weight init), wraps it in ``comfy.model_patcher.ModelPatcher``;
3. runs ``comfy.sample.sample`` (what ``nodes.common_ksampler`` / KSampler calls; CFG on, synthetic conditioning
   ``[[randn(1, 512, 4096), {}]]`` positive and negative, latent ``[1, 16, (frames-1)//4+1, H/8, W/8]``):
   * unpatched, ``--dense-steps`` steps (ComfyUI's default attention: SDPA on NVIDIA), with a pass-through
     ``optimized_attention_override`` that syncs around each attention call and times it: the dense step time and
     the self-attention share of a dense step, measured in the same process;
   * patched with ``apply_mc_sparse`` (the MC-Sparse Patch node's function) per density, preset "custom" on a short
     schedule of ``--steps`` steps: ``--patched-warmup`` dense warm-up steps, one anchor right after, the rest reuse
     (default 4 steps: dense, anchor, reuse, reuse); ``--warmup-layers`` 0 = the paper's setting;
   * with ``--presets``: the node's 'fast' preset exactly as a user gets it (all other inputs at the node defaults;
     its schedule is the paper's scaled to the call: ``--preset-steps`` 4 -> anchors at steps 1 and 2, reuse 3, 4);
   Per-step wall times come from the sampler callback (device synchronised) against a SAMPLER_SAMPLE wrapper's
   start (after model loading); a CALC_COND_BATCH wrapper counts, per step, the MC-Sparse anchor / reuse / dense
   self-attention calls of the run (``RunState``), which is what classifies each step (dense / anchor / reuse).
   Before each patched run one layer's anchor and reuse run on random q/k/v of the exact call shape through the
   pack's runner, so Triton kernels are compiled before the timed steps;
4. extrapolates to the paper's 50-step schedule (10 dense warm-up steps, anchors at 1-based 10 and 26: 9 dense +
   2 anchor + 39 reuse steps), against 50 unpatched dense steps; and computes the IDEAL speedup of that schedule
   from parts measured in the same run: dense step D and its self-attention time A (non-attention N = D - A); a
   fraction f = (layers - warm-up layers) / layers of the attention goes sparse; an ideal reuse step costs
   N + A (1 - f) + A f s, an ideal anchor D + A f (0.5 + s) (pass 2 ~ half a dense attention, plus one sparse
   evaluation for the residual); ideal = 50 D / (9 D + 2 anchor + 39 reuse). Also at kernel efficiency 0.97 (the
   issue's figures). Achieved / ideal, the step type that loses the most against its ideal, the cache bytes (run
   summary / runner's cache) and, if the cache went to CPU memory, an estimated transfer time (bytes / measured
   pinned host-to-device bandwidth) are reported.

Everything goes to ``--out`` (JSON, rewritten after each run) and a markdown table at the end. Every run is in its
own try/except: an error is recorded and the next run goes on.

Usage (H200, ~6 minutes; see docs/speedup.md):
    COMFYUI_DIR=.comfyui python tests/bench_comfyui_speedup.py --plan headline --out $OUT/speedup.json
CPU smoke (a minute):
    COMFYUI_DIR=.comfyui .venv-comfy/bin/python tests/bench_comfyui_speedup.py --model tiny --res tiny --presets
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _scoreboard  # noqa: E402

MODELS = {  # Wan2.1 T2V: in_dim 16, text_dim 4096, freq_dim 256, patch (1, 2, 2), head dim 128
    "wan14b": {"dim": 5120, "num_heads": 40, "num_layers": 40, "ffn_dim": 13824},
    "wan1.3b": {"dim": 1536, "num_heads": 12, "num_layers": 30, "ffn_dim": 8960},
    "tiny": {"dim": 256, "num_heads": 2, "num_layers": 3, "ffn_dim": 512},
}
RESOLUTIONS = {"720p": (1280, 720), "480p": (832, 480), "tiny": (128, 128)}  # width x height in pixels

# Paper schedule (MC-Sparse video): 50 steps, 10 dense warm-up steps, anchors at 1-based 10 and 26 (main() rescales
# it with schedule.paper_video_schedule when --schedule-steps is not 50).
PAPER = {"steps": 50, "dense_warmup": "10", "anchor_steps": "10, 26"}
# The issue's bars (docs/kernels-benchmark.md): Wan2.1-14B 720p speedup per density, and achieved / ideal.
BARS = {("wan14b", "720p"): {0.25: 1.55, 0.15: 1.70}}
BAR_RATIO = 0.95

# --plan headline: what the issue's bars need, ~6 minutes on one H200 (estimates in docs/speedup.md).
HEADLINE = [  # later_warmup 0: the second density's run skips the dense step (A R R; saves ~23 s at 720p)
    {"model": "wan14b", "res": "720p", "densities": [0.25, 0.15], "presets": True, "later_warmup": 0},
    {"model": "wan14b", "res": "480p", "densities": [0.25], "presets": False},
    {"model": "wan1.3b", "res": "480p", "densities": [0.25], "presets": False},
]
# Issue 14's two GPU commands (docs/speedup.md): 14B 720p (presets quality and fast, the glue ratio, the peer,
# the prefetch hit rate with the cache in CPU memory and CFG split) in < 9 minutes; 14B 480p quality and the
# 1.3B whole-run 'fast' in < 8 minutes.
H720 = [{"model": "wan14b", "res": "720p", "densities": [], "presets": ["quality", "fast"], "glue": True,
         "peer": True, "cpu_split": 0.25}]
H480 = [{"model": "wan14b", "res": "480p", "densities": [], "presets": ["quality"]},
        {"model": "wan1.3b", "res": "480p", "densities": [], "presets": [], "whole": ("fast", 50)}]
# --plan w13: only the 1.3B 480p whole-run 'fast' (its bar), ~110 s on an H200.
W13 = [H480[1]]
# Rough H200 seconds per CFG step (dense) used only for the up-front time estimate (docs/kernels-benchmark.md).
EST_DENSE_STEP_S = {("wan14b", "720p"): 23.0, ("wan14b", "480p"): 6.0, ("wan1.3b", "480p"): 1.2}

log = logging.getLogger("bench_comfyui_speedup")


# ---------------------------------------------------------------------------------------------------------------
# ComfyUI and the pack
# ---------------------------------------------------------------------------------------------------------------

class Env:
    """The imported ComfyUI modules and the pack's modules (filled by ``setup``)."""


def setup(comfyui_dir: str, device: str) -> Env:
    """Import ComfyUI from ``comfyui_dir`` (CPU mode only when ``device`` is cpu) and load the pack."""
    root = Path(comfyui_dir).resolve()
    if not (root / "comfy" / "model_base.py").is_file():
        raise FileNotFoundError(f"--comfyui / COMFYUI_DIR must be a ComfyUI checkout (with comfy/), got {root}")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    stubbed = _stub_if_missing("torchsde", "SDE samplers only; euler and uni_pc do not use it")
    from comfy.cli_args import args

    if device == "cpu":
        args.cpu = True  # before comfy.model_management is imported (docs/comfyui.md)
    import comfy.latent_formats
    import comfy.model_base
    import comfy.model_management
    import comfy.model_patcher
    import comfy.patcher_extension
    import comfy.sample
    import comfy.samplers
    import comfy.supported_models_base

    env = Env()
    env.stubbed = stubbed
    env.comfy_root = str(root)
    env.model_base = comfy.model_base
    env.mm = comfy.model_management
    env.model_patcher = comfy.model_patcher
    env.pe = comfy.patcher_extension
    env.sample = comfy.sample
    env.samplers = comfy.samplers
    env.config_source = "comfy.supported_models.WAN21_T2V"
    try:  # imports every text encoder (transformers): may break on a transformers newer than ComfyUI's pin
        import comfy.supported_models

        env.wan_config_cls = comfy.supported_models.WAN21_T2V
    except Exception as err:  # the same config class, without the text-encoder imports
        env.wan_config_cls = _fallback_wan_config(comfy.supported_models_base, comfy.model_base, comfy.latent_formats)
        env.config_source = f"local copy of WAN21_T2V (comfy.supported_models failed: {type(err).__name__}: {err})"
        print(f"note: {env.config_source}", flush=True)

    sys.path.insert(0, str(ROOT / "comfyui_mc_sparse"))
    import _standalone

    try:
        pack = _standalone.load_pack()  # the checkout root as a package, as nodes.load_custom_node does
        env.pack_load = "_standalone.load_pack (root __init__, V3 entry point imported)"
    except Exception as err:  # e.g. comfy_api does not import here: load the package without its __init__
        import importlib.util

        name = _standalone.PACK_NAME
        sys.modules.pop(name, None)
        spec = importlib.util.spec_from_file_location(name, ROOT / "__init__.py", submodule_search_locations=[str(ROOT)])
        pack = importlib.util.module_from_spec(spec)
        sys.modules[name] = pack
        env.pack_load = f"package shell without the root __init__ (load_pack failed: {type(err).__name__}: {err})"
        print(f"note: {env.pack_load}", flush=True)
    import importlib

    p = pack.__name__
    env.lifecycle = importlib.import_module(f"{p}.comfyui_mc_sparse.adapter.lifecycle")
    env.settings = importlib.import_module(f"{p}.comfyui_mc_sparse.adapter.settings")
    env.engine = importlib.import_module(f"{p}.comfyui_mc_sparse.engine")
    env.config = importlib.import_module(f"{p}.comfyui_mc_sparse.config")
    env.cache = importlib.import_module(f"{p}.comfyui_mc_sparse.cache")
    env.schedule = importlib.import_module(f"{p}.comfyui_mc_sparse.schedule")
    env.selection = importlib.import_module(f"{p}.comfyui_mc_sparse.selection")
    env.kernels = importlib.import_module(f"{p}.kernels")
    env.override = importlib.import_module(f"{p}.comfyui_mc_sparse.adapter.override")
    return env


TRITON_ONLY_OFF = ("cutedsl", "flash_attn4")
"""Backends ``--kernels triton-only`` turns off: the ones that need packages beyond the pack's requirements."""
TRITON_ONLY_SUFFIX = "_triton_only"
"""Appended to the e2e speedup and anchor-over-dense scoreboard keys of a ``--kernels triton-only`` run (TEAM.md item
6); not to ``e2e_wan13b_480p_fast_speedup_whole_run`` (Triton-only by definition, issue 15)."""


def triton_only(env: Env) -> None:
    """Turn off the backends of ``TRITON_ONLY_OFF`` for this process (registered again as unavailable, with the
    reason), leaving what a user's default install runs: Triton, cuDNN / SDPA through torch, torch."""
    import dataclasses

    reg = env.kernels.registry
    for b in reg.backends():
        if b.name in TRITON_ONLY_OFF:
            reg.register(dataclasses.replace(b, unavailable_reason="turned off by --kernels triton-only"
                                             + (f" (was: {b.unavailable_reason})" if b.unavailable_reason else "")))


def _stub_if_missing(name: str, why: str) -> list[str]:
    """Put an empty module ``name`` in ``sys.modules`` when it cannot be imported (ComfyUI imports it at module
    level but this benchmark never calls it; any attribute access raises AttributeError)."""
    import importlib
    import importlib.machinery
    import types

    try:
        importlib.import_module(name)
        return []
    except ImportError:
        stub = types.ModuleType(name)
        stub.__spec__ = importlib.machinery.ModuleSpec(name, None)

        def missing(attr):
            raise AttributeError(f"{name} is a stub in this benchmark ({why}): no {attr}")

        stub.__getattr__ = missing  # module-level __getattr__ (PEP 562)
        sys.modules[name] = stub
        print(f"note: {name} is not installed: stubbed ({why})", flush=True)
        return [name]


def _fallback_wan_config(supported_models_base, model_base, latent_formats):
    class WAN21_T2V(supported_models_base.BASE):  # noqa: N801  (comfy/supported_models.py WAN21_T2V, minus clip_target)
        unet_config = {"image_model": "wan2.1", "model_type": "t2v"}  # noqa: RUF012  (ComfyUI's class layout)
        sampling_settings = {"shift": 8.0}  # noqa: RUF012  (ComfyUI's class layout)
        unet_extra_config = {}  # noqa: RUF012  (ComfyUI's class layout)
        latent_format = latent_formats.Wan21
        memory_usage_factor = 0.9
        supported_inference_dtypes = [torch.float16, torch.bfloat16, torch.float32]  # noqa: RUF012

        def __init__(self, unet_config):
            super().__init__(unet_config)
            self.memory_usage_factor = self.unet_config.get("dim", 2000) / 2222

        def get_model(self, state_dict, prefix="", device=None):
            return model_base.WAN21(self, device=device)

    return WAN21_T2V


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def now(device: torch.device) -> float:
    sync(device)
    return time.perf_counter()


# ---------------------------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------------------------

def build_model(env: Env, model: str, device: torch.device, dtype: torch.dtype, seed: int):
    """Wan2.1 T2V through ComfyUI's classes, random weights made on ``device``; returns (ModelPatcher, info)."""
    spec = MODELS[model]
    unet_config = {  # what comfy/model_detection.py detects from a Wan2.1 T2V checkpoint
        "image_model": "wan2.1", "model_type": "t2v", "dim": spec["dim"], "out_dim": 16,
        "num_heads": spec["num_heads"], "ffn_dim": spec["ffn_dim"], "num_layers": spec["num_layers"],
        "patch_size": (1, 2, 2), "freq_dim": 256, "window_size": (-1, -1), "qk_norm": True,
        "cross_attn_norm": True, "eps": 1e-6, "in_dim": 16, "text_dim": 4096,
    }
    t0 = time.perf_counter()
    config = env.wan_config_cls(unet_config)
    config.set_inference_dtype(dtype, None)  # weights and compute in dtype, no manual cast
    base = config.get_model({}, device=device)
    dm = base.diffusion_model
    g = torch.Generator(device=device).manual_seed(seed)
    n_params = 0
    other_dtypes: dict[str, str] = {}
    with torch.no_grad():
        norm_params = set()
        for module in dm.modules():
            if "norm" in type(module).__name__.lower():
                for name, p in module.named_parameters(recurse=False):
                    (p.fill_(1.0) if name in ("weight", "scale") else p.zero_())
                    norm_params.add(id(p))
        for name, p in dm.named_parameters():
            n_params += p.numel()
            if p.device.type != device.type:
                raise RuntimeError(f"parameter {name} is on {p.device}, expected {device}")
            if p.dtype != dtype:  # WanModel keeps patch_embedding in float32 on purpose
                other_dtypes[name] = str(p.dtype)
            if id(p) not in norm_params:
                p.normal_(0.0, 0.02, generator=g)
        bad = [name for name, p in dm.named_parameters() if not bool(torch.isfinite(p).all())]
    if bad:
        raise RuntimeError(f"non-finite parameters after init: {bad[:5]}")
    patcher = env.model_patcher.ModelPatcher(base, load_device=device, offload_device=device)
    sync(device)
    info = {"params": n_params, "param_bytes": n_params * torch.tensor([], dtype=dtype).element_size(),
            "build_s": time.perf_counter() - t0, "config": dict(unet_config.items()),
            "config_class": env.config_source, "dtype": str(dtype), "device": str(device),
            "params_not_in_dtype": other_dtypes}
    return patcher, info


def latent_shape(res: str, frames: int) -> tuple[int, ...]:
    w, h = RESOLUTIONS[res]
    return (1, 16, (frames - 1) // 4 + 1, h // 8, w // 8)


def tokens_of(shape: tuple[int, ...]) -> int:
    return shape[2] * math.ceil(shape[3] / 2) * math.ceil(shape[4] / 2)


# ---------------------------------------------------------------------------------------------------------------
# Timed sampling
# ---------------------------------------------------------------------------------------------------------------

def attention_timer(rec: dict, device: torch.device):
    """A pass-through ``optimized_attention_override`` (ComfyUI's ``wrap_attn`` contract) that times each call,
    split into self-attention (q and k of the same length) and the rest, per model evaluation."""

    def override(func, q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
                 **kwargs):
        sq, sk = (q.shape[2], k.shape[2]) if skip_reshape else (q.shape[1], k.shape[1])
        kind = "self" if sq == sk else "cross"
        t0 = now(device)
        out = func(q, k, v, heads, mask=mask, attn_precision=attn_precision, skip_reshape=skip_reshape,
                   skip_output_reshape=skip_output_reshape, **kwargs)
        dt = now(device) - t0
        rec["attn_current"][kind] += dt
        rec["attn_calls_current"][kind] += 1
        rec.setdefault("attn_func", getattr(func, "__name__", repr(func)))
        return out

    return override


def timed_sample(env: Env, patcher, *, steps: int, shape, cfg: float, sampler: str, scheduler: str, seed: int,
                 device: torch.device, time_attention: bool = False, split_cfg: bool = False,
                 override=None, profiler: StepProfiler | None = None) -> dict:
    """One ``comfy.sample.sample`` call with per-step timing. Returns the record (steps, evals, run state).

    split_cfg: make ComfyUI run cond and uncond as separate forwards, the way it does when memory is short: during
    the sampling loop only (after model loading), the model's memory estimate for a batch of more than one is made
    larger than any free memory, so ``_calc_cond_batch``'s rule (``comfy/samplers.py`` L262-276: batch only while
    ``memory_required(batch) * 1.5 < free memory``) picks batches of one. override: an attention override to install
    on the clone (the peer). profiler: profiles the steps it names (``StepProfiler``; those steps' walls include
    the profiler's start and stop)."""
    rec: dict = {"evals": [], "step_ends": [], "t_start": None, "run": None,
                 "attn_current": {"self": 0.0, "cross": 0.0}, "attn_calls_current": {"self": 0, "cross": 0},
                 "forwards_current": []}
    m = patcher.clone()
    if override is not None:
        m.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = override
    if time_attention:
        m.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = \
            attention_timer(rec, device)

    def sampler_sample(executor, *args, **kwargs):  # after model loading, around the sampling loop
        base_model = m.model
        if split_cfg:
            real = base_model.memory_required

            def memory_required(input_shape, *a, **kw):
                return float("inf") if input_shape[0] > shape[0] else real(input_shape, *a, **kw)

            base_model.memory_required = memory_required  # instance attribute, removed below
        rec["t_start"] = now(device)
        if profiler is not None:
            profiler.step_done(-1)
        try:
            return executor(*args, **kwargs)
        finally:
            if split_cfg:
                del base_model.memory_required

    def calc_cond_batch(executor, *args, **kwargs):  # once per model evaluation (both CFG branches)
        mo = args[4] if len(args) > 4 else kwargs.get("model_options") or {}
        run = (mo.get("transformer_options") or {}).get("mc_sparse_run")
        if run is not None:
            rec["run"] = run
        before = _run_counts(run)
        rec["attn_current"] = {"self": 0.0, "cross": 0.0}
        rec["attn_calls_current"] = {"self": 0, "cross": 0}
        rec["forwards_current"] = []
        timestep = args[3] if len(args) > 3 else kwargs.get("timestep")
        t0 = now(device)
        out = executor(*args, **kwargs)
        t1 = now(device)
        after = _run_counts(run)
        rec["evals"].append({
            "sigma": float(timestep.max()) if isinstance(timestep, torch.Tensor) else None, "eval_s": t1 - t0,
            "calls": {k: after[k] - before[k] for k in after}, "forward_batches": list(rec["forwards_current"]),
            "attn_s": dict(rec["attn_current"]) if time_attention else None,
            "attn_calls": dict(rec["attn_calls_current"]) if time_attention else None})
        return out

    def apply_model(executor, *args, **kwargs):  # each diffusion-model forward: its batch (2 = cond+uncond)
        x = args[0] if args else kwargs.get("x")
        rec["forwards_current"].append(int(x.shape[0]) if isinstance(x, torch.Tensor) else -1)
        return executor(*args, **kwargs)

    m.add_wrapper_with_key(env.pe.WrappersMP.SAMPLER_SAMPLE, "mc_sparse_bench", sampler_sample)
    m.add_wrapper_with_key(env.pe.WrappersMP.APPLY_MODEL, "mc_sparse_bench", apply_model)
    m.add_wrapper_with_key(env.pe.WrappersMP.CALC_COND_BATCH, "mc_sparse_bench", calc_cond_batch)

    def callback(step, x0, x, total_steps):
        rec["step_ends"].append((int(step), now(device)))
        if profiler is not None:
            profiler.step_done(int(step))

    g = torch.Generator().manual_seed(seed)
    latent = torch.zeros(shape)
    noise = torch.randn(shape, generator=g)  # as comfy.sample.prepare_noise: CPU, seeded
    cg = torch.Generator().manual_seed(seed + 1)
    positive = [[torch.randn(1, 512, 4096, generator=cg), {}]]
    negative = [[torch.randn(1, 512, 4096, generator=cg), {}]]
    gc_pauses = rec["gc_pauses"] = []  # (start, end, generation) of every garbage collection during the call
    gc_open = {}

    def gc_watch(phase, info):
        if phase == "start":
            gc_open["t"] = time.perf_counter()
        elif "t" in gc_open:
            gc_pauses.append((gc_open.pop("t"), time.perf_counter(), info.get("generation")))

    gc.callbacks.append(gc_watch)
    t_call = time.perf_counter()
    try:
        out = env.sample.sample(m, noise, steps, cfg, sampler, scheduler, positive, negative, latent, denoise=1.0,
                                callback=callback, disable_pbar=True, seed=seed)
    finally:
        gc.callbacks.remove(gc_watch)
    t_return = time.perf_counter()
    rec["call_s"] = t_return - t_call
    rec["t_call"], rec["t_return"] = t_call, t_return
    rec["finite"] = bool(torch.isfinite(out).all())
    rec["latent_std"] = float(out.float().std())
    rec["latent"] = out.detach().to("cpu", torch.float32)  # the sampled latent (--profile-reuse compares runs)
    prev = rec["t_start"]
    step_s = []
    for _, t in rec["step_ends"]:
        step_s.append(t - prev)
        prev = t
    rec["step_s"] = step_s
    rec["load_s"] = (rec["t_start"] - t_call) if rec["t_start"] else None
    lm = getattr(m.model, "model_lowvram", None)
    rec["model_lowvram"] = bool(lm) if lm is not None else None
    del m
    rec["t_done"] = time.perf_counter()
    return rec


def host_phases(rec: dict, pack: dict | None = None) -> dict:
    """Where a ``timed_sample`` call's time outside its steps went (host wall clock, s): ``before_first_step`` (the
    call until the sampler loop starts: model load, the wrappers' set-up, MC-Sparse's plan), ``after_last_step``
    (the last step's callback, device synchronised, until ``comfy.sample.sample`` returns: MC-Sparse's summary and
    freeing its cache, ComfyUI's clean-up, the latent's copy out) and ``bench_after`` (this script's own checks of the
    latent, not in any run's cost). ``pack``: the MC-Sparse phases timed by ``pack_phase_timer`` (s)."""
    ends = rec.get("step_ends") or []
    out = {"before_first_step": (rec["t_start"] - rec["t_call"]) if rec.get("t_start") else None,
           "after_last_step": (rec["t_return"] - ends[-1][1]) if ends and "t_return" in rec else None,
           "bench_after": (rec["t_done"] - rec["t_return"]) if "t_done" in rec and "t_return" in rec else None}
    pauses = rec.get("gc_pauses")
    if pauses is not None:  # Python's garbage collector: all its pauses in the call, and those after the last step
        out["gc_in_call"] = sum(b - a for a, b, _ in pauses)
        out["gc_full_collections"] = sum(1 for *_, g in pauses if g == 2)
        if ends:
            out["gc_after_last_step"] = sum(b - max(a, ends[-1][1]) for a, b, _ in pauses if b > ends[-1][1])
    if pack:
        out.update({f"pack_{k}": v for k, v in pack.items()})
    return out


class pack_phase_timer:  # noqa: N801  (a context manager used as a function)
    """Host wall time of the MC-Sparse adapter's own work around the sampler loop (``lifecycle``): the plan before
    sampling (``_plan_before_sampling``), the end-of-run summary and its log line (``_report``: reads the run's
    CUDA-event pairs) and freeing the cache (``RunState.close``). Patches the module functions for the ``with`` body
    (the OUTER_SAMPLE wrapper looks them up at call time); no device sync added. ``.s``: seconds per phase."""

    NAMES = {"_plan_before_sampling": "plan", "_report": "summary"}

    def __init__(self, env: Env):
        self.env = env
        self.s: dict[str, float] = {}

    def _wrap(self, fn, name):
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.s[name] = self.s.get(name, 0.0) + time.perf_counter() - t0
        return timed

    def __enter__(self) -> pack_phase_timer:
        lc = self.env.lifecycle
        self.saved = {attr: getattr(lc, attr) for attr in self.NAMES}
        for attr, name in self.NAMES.items():
            setattr(lc, attr, self._wrap(self.saved[attr], name))
        self.close = lc.RunState.close
        lc.RunState.close = self._wrap(self.close, "close")
        return self

    def __exit__(self, *exc):
        lc = self.env.lifecycle
        for attr, fn in self.saved.items():
            setattr(lc, attr, fn)
        lc.RunState.close = self.close
        return False


def _run_counts(run) -> dict:
    if run is None:
        return {"anchor": 0, "reuse": 0, "dense_self": 0, "dense_all": 0}
    c = run.counts()
    dense_self = sum(len(v) for v in run.dense_ms.values())
    return {"anchor": c["anchor"], "reuse": c["sparse"], "dense_self": dense_self, "dense_all": c["dense"]}


def classify(rec: dict) -> list[dict]:
    """Per-step rows: kind from the MC-Sparse call counts of that step (no run: dense)."""
    rows = []
    n = len(rec["step_s"])
    evals = rec["evals"]
    for i in range(n):
        ev = evals[i] if len(evals) == n else None
        calls = ev["calls"] if ev else {}
        kind = "anchor" if calls.get("anchor") else "reuse" if calls.get("reuse") else "dense"
        rows.append({"step": i + 1, "kind": kind, "wall_s": rec["step_s"][i],
                     "eval_s": ev["eval_s"] if ev else None, "calls": calls,
                     "forward_batches": ev["forward_batches"] if ev else None,
                     "self_attn_s": (ev["attn_s"] or {}).get("self") if ev and ev["attn_s"] else None,
                     "cross_attn_s": (ev["attn_s"] or {}).get("cross") if ev and ev["attn_s"] else None})
    if len(evals) != n:
        rows.append({"note": f"{len(evals)} model evaluations for {n} steps: kinds not attributed per step"})
    return rows


def warm_step(values: list[float]) -> float:
    """Steady-state time of a step kind: drop the first (cold) sample when there are two or more; median."""
    if not values:
        return float("nan")
    return statistics.median(values[1:] if len(values) >= 2 else values)


# ---------------------------------------------------------------------------------------------------------------
# Patched runs
# ---------------------------------------------------------------------------------------------------------------

def prewarm_kernels(env: Env, *, heads: int, head_dim: int, tokens: int, density: float, group_size: int,
                    device: torch.device, dtype: torch.dtype, backend: str = "auto", batch: int = 1) -> float:
    """One anchor and one reuse call of one layer at the exact call shape through the pack's runner (the same
    modules the adapter uses), so kernel compilation (and the Triton sparse op's one-time kernel timing per shape)
    is not inside the timed steps: ``batch`` conditioning chunks of one row each (2 = a CFG batch: the anchor runs
    per chunk, the reuse call on both). Returns seconds."""
    t0 = now(device)
    cfg = env.config.MCSparseConfig(density=density, group_size=group_size, warmup_steps=0, warmup_layers=0,
                                    anchor_steps=(0,))
    runner = env.engine.MCSparseRunner(cfg, backend=backend)
    g = torch.Generator(device=device).manual_seed(7)
    q, k, v = (torch.randn(batch, tokens, heads * head_dim, generator=g, device=device, dtype=dtype)
               .view(batch, tokens, heads, head_dim).transpose(1, 2) for _ in range(3))
    keys = [env.cache.CacheKey(layer=0, branch=f"prewarm{i}", window=None, shape=(1, *q.shape[1:]), kind="self")
            for i in range(batch)]
    runner.attention(q, k, v, step=0, layer=0, keys=keys)
    runner.attention(q, k, v, step=1, layer=0, keys=keys)
    runner.close()
    del q, k, v, runner
    return now(device) - t0


def schedule_counts(env: Env, settings, steps: int, layers: int) -> dict:
    """Steps of each kind (kind of the first sparse-eligible layer) when ``settings`` resolve to ``steps`` steps."""
    sched = env.settings.resolve_schedule(settings, steps)
    cfg = env.config.MCSparseConfig(density=settings.density, group_size=settings.group_size,
                                    warmup_steps=sched.warmup_steps, warmup_layers=0, anchor_steps=sched.anchor_steps)
    kinds = [env.schedule.step_kind(cfg, s, 0).value for s in range(steps)]
    return {"steps": steps, "warmup_steps": sched.warmup_steps, "anchors_1based": [a + 1 for a in sched.anchor_steps],
            "dense": kinds.count("dense"), "anchor": kinds.count("anchor"), "reuse": kinds.count("reuse"),
            "kinds": "".join(k[0].upper() for k in kinds)}


def h2d_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float | None:
    """Pinned host -> device bytes/s (median of 3 copies), or None off CUDA."""
    if device.type != "cuda":
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(3):
        t0 = now(device)
        dst.copy_(src, non_blocking=True)
        times.append(now(device) - t0)
    del src, dst
    return nbytes / statistics.median(times)


def run_patched(env: Env, base, *, label: str, apply_kwargs: dict, steps: int, args, shape, device, dtype,
                spec: dict) -> dict:
    """Patch ``base`` with ``apply_mc_sparse(**apply_kwargs)``, sample ``steps`` steps, return the record."""
    result: dict = {"label": label, "apply_kwargs": apply_kwargs, "steps": steps}
    apply_kwargs = {k: v for k, v in apply_kwargs.items() if not k.startswith("_")}  # bench-only options
    settings = env.settings.build_settings(**{**_node_defaults(), **apply_kwargs})
    result["timed_schedule"] = schedule_counts(env, settings, steps, spec["num_layers"])
    result["prewarm_s"] = prewarm_kernels(env, heads=spec["num_heads"], head_dim=spec["dim"] // spec["num_heads"],
                                          tokens=tokens_of(shape), density=settings.density,
                                          group_size=settings.group_size, device=device, dtype=dtype,
                                          backend=settings.backend)
    patched = env.lifecycle.apply_mc_sparse(base, **apply_kwargs)
    with override_call_timer(env, device) as calls:
        rec = timed_sample(env, patched, steps=steps, shape=shape, cfg=args.cfg, sampler=args.sampler,
                           scheduler=args.scheduler, seed=args.seed, device=device,
                           split_cfg=bool(result["apply_kwargs"].get("_split_cfg")))
    result["reuse_override_calls"] = calls.summary()
    del patched
    rows = classify(rec)
    result["per_step"] = rows
    result["finite"] = rec["finite"]
    result["latent_std"] = rec["latent_std"]
    result["load_s"] = rec["load_s"]
    result["model_lowvram"] = rec["model_lowvram"]
    by_kind: dict[str, list[float]] = {"dense": [], "anchor": [], "reuse": []}
    for r in rows:
        if "kind" in r:
            by_kind[r["kind"]].append(r["wall_s"])
    result["step_s_by_kind"] = by_kind
    expected = result["timed_schedule"]
    got = {k: len(v) for k, v in by_kind.items()}
    result["schedule_check"] = ("ok" if all(got[k] == expected[k] for k in got) else
                                f"MISMATCH: timed steps by kind {got}, schedule says {expected}")
    run = rec["run"]
    if run is None:
        result["error_note"] = "no MC-Sparse run state seen (the patch did not engage)"
        return result
    result["run_summary"] = run.summary()
    result["run_kernels"] = run_kernels(env, run)
    result["counts"] = run.counts()
    runner = run.runner
    if runner is not None:
        c = runner.cache
        ld = runner.loader
        result["cache"] = {"peak_bytes": c.peak_bytes, "peak_gpu_bytes": c.peak_gpu_bytes,
                           "peak_host_bytes": c.peak_host_bytes, "prefetched_loads": ld.hits, "inline_loads": ld.misses,
                           "dropped_prefetches": ld.dropped, "moved_to_cpu": c.moved,
                           "placement": runner.config.cache_placement,
                           "residual_dtype": getattr(runner, "residual_dtype", runner.config.residual_dtype),
                           "plan": runner.plan_line}
        result["anchors_taken_0based"] = list(runner.stats.anchors)
        result["engine_notes"] = list(runner.stats.notes)
        sparse_layers = spec["num_layers"] - runner.config.warmup_layers
        s_tok = tokens_of(shape)
        k = env.selection.keys_for_density(runner.config.density, s_tok, runner.config.kv_tile)
        result["keys_per_group"] = k
        result["effective_density"] = k / s_tok
        result["sparse_layers"] = sparse_layers
        # attention times measured by the adapter (per call, per conditioning chunk), summed per reuse step
        n_reuse = len(by_kind["reuse"])
        reuse_ms = sum(sum(v) for v in run.reuse_ms.values())
        result["reuse_attention_s_per_step"] = (reuse_ms / 1000.0 / n_reuse) if n_reuse else None
        if c.peak_host_bytes:
            bw = h2d_bandwidth(device)
            result["h2d_bytes_per_s"] = bw
            result["transfer_s_per_reuse_step_est"] = (c.peak_host_bytes / bw) if bw else None
    return result


class _OverrideCalls:
    """Per-call timing of the whole MC-Sparse override call at reuse steps (``override.dispatch``: the layout views,
    the runner, the stacked load, the kernel and the prefetch queued after it): a pair of CUDA events per call on the
    compute stream, read once at the end, so the span includes any wait on the prefetch's event and any gap the host
    leaves the GPU; keyed by the batch of the call (1 = CFG split, 2 = batched)."""

    def __init__(self, device):
        self.device = device
        self.pending: list = []
        self.ms: dict[int, list[float]] = {}

    def record(self, start, end, batch):
        if isinstance(start, float):
            self.ms.setdefault(batch, []).append((end - start) * 1000.0)
        else:
            self.pending.append((start, end, batch))

    def summary(self) -> dict:
        if self.pending:
            self.pending[-1][1].synchronize()
            for start, end, batch in self.pending:
                self.ms.setdefault(batch, []).append(start.elapsed_time(end))
            self.pending.clear()
        return {str(b): {"calls": len(v), "mean_ms": statistics.mean(v), "median_ms": statistics.median(v)}
                for b, v in sorted(self.ms.items()) if v}


class override_call_timer:  # noqa: N801  (a context manager used as a function)
    """Patch ``override.dispatch`` (looked up at call time by the installed override) to time reuse calls."""

    def __init__(self, env: Env, device: torch.device):
        self.env, self.calls = env, _OverrideCalls(device)

    def __enter__(self) -> _OverrideCalls:
        mod, calls, device = self.env.override, self.calls, self.calls.device
        self.real = real = mod.dispatch

        def timed(run, site, q, *args, **kwargs):
            runner = getattr(run, "runner", None)
            if runner is None or site is None:
                return real(run, site, q, *args, **kwargs)
            before = runner.stats.calls.get(self.env.schedule.StepKind.REUSE, 0)
            if device.type == "cuda":
                start = torch.cuda.Event(enable_timing=True)
                start.record()
            else:
                start = time.perf_counter()
            out = real(run, site, q, *args, **kwargs)
            if runner.stats.calls.get(self.env.schedule.StepKind.REUSE, 0) > before:
                if device.type == "cuda":
                    end = torch.cuda.Event(enable_timing=True)
                    end.record()
                else:
                    end = time.perf_counter()
                calls.record(start, end, int(q.shape[0]))
            return out

        mod.dispatch = timed
        return calls

    def __exit__(self, *exc):
        self.env.override.dispatch = self.real
        return False


def bare_kernel_ms(env: Env, *, batch: int, heads: int, head_dim: int, tokens: int, density: float, group_size: int,
                   device: torch.device, dtype: torch.dtype, backend: str = "auto", reps: int = 10) -> dict:
    """The sparse kernel alone at a reuse call's shape: ``kernels.sparse_attention`` on strided [B, H, S, D] views of
    [B, S, H*D] q/k/v, ``out=`` a view of a preallocated [B, S, H*D] buffer, the residual in the cache's stored form,
    the selection of a real anchor call (random q/k/v through the runner, as decoded for a reuse step). Mean of
    ``reps`` launches after one warm-up, timed by CUDA events (wall clock on CPU)."""
    cfg = env.config.MCSparseConfig(density=density, group_size=group_size, warmup_steps=0, warmup_layers=0,
                                    anchor_steps=(0,))
    runner = env.engine.MCSparseRunner(cfg, backend=backend)
    g = torch.Generator(device=device).manual_seed(11)
    flat = [torch.randn(batch, tokens, heads * head_dim, generator=g, device=device, dtype=dtype) for _ in range(3)]
    q, k, v = (t.view(batch, tokens, heads, head_dim).transpose(1, 2) for t in flat)
    keys = [env.cache.CacheKey(layer=0, branch=f"bare{i}", window=None, shape=(1, heads, tokens, head_dim))
            for i in range(batch)]
    runner.attention(q, k, v, step=0, layer=0, keys=keys)  # anchor: stores one entry per batch row
    entry = runner.loader.load(tuple(keys), device, dtype)  # decoded the way a reuse call gets it
    out = torch.empty(batch, tokens, heads * head_dim, device=device, dtype=dtype)
    out_h = out.view(batch, tokens, heads, head_dim).transpose(1, 2)

    def launch():
        env.kernels.sparse_attention(q, k, v, entry.perm, entry.kv_idx, out=out_h, residual=entry.residual,
                                     backend=backend)

    launch()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            launch()
        end.record()
        end.synchronize()
        ms = start.elapsed_time(end) / reps
    else:
        t0 = time.perf_counter()
        for _ in range(reps):
            launch()
        ms = (time.perf_counter() - t0) * 1000.0 / reps
    residual_kind = entry.residual.kind if entry.residual is not None else None
    runner.close()
    del q, k, v, flat, out, out_h, entry
    return {"batch": batch, "mean_ms": ms, "reps": reps, "residual": residual_kind}


def glue_ratio(env: Env, run: dict, *, spec: dict, tokens: int, device, dtype) -> dict | None:
    """Whole override call at reuse steps / the bare kernel on the same shapes (same process), per batch seen."""
    calls = run.get("reuse_override_calls") or {}
    if not calls:
        return None
    settings = env.settings.build_settings(**{**_node_defaults(), **{k: v for k, v in run["apply_kwargs"].items()
                                                                      if not k.startswith("_")}})
    per_batch = {}
    for b, c in calls.items():
        bare = bare_kernel_ms(env, batch=int(b), heads=spec["num_heads"], head_dim=spec["dim"] // spec["num_heads"],
                              tokens=tokens, density=settings.density, group_size=settings.group_size, device=device,
                              dtype=dtype, backend=settings.backend)
        per_batch[b] = {"override_call_ms": c["mean_ms"], "calls": c["calls"], "bare_kernel_ms": bare["mean_ms"],
                        "ratio": c["mean_ms"] / bare["mean_ms"], "residual": bare["residual"]}
    total = sum(v["calls"] for v in per_batch.values())
    ratio = sum(v["ratio"] * v["calls"] for v in per_batch.values()) / total
    return {"ratio": ratio, "per_batch": per_batch,
            "method": "mean CUDA-event span of the whole override call at reuse steps / mean of 10 bare "
                      "kernels.sparse_attention launches (strided views, out=, stored residual) on the same shape, "
                      "same process; weighted by calls per batch size"}


# --- the peer: ComfyUI core's "Model Sparse Attention" default, through our own override --------------------------

PEER = {"tau": 1.3, "start_percent": 0.2, "end_percent": 1.0, "min_tokens": 12288, "extra_tokens": 256,
        "head_dim": 128, "source": "Comfy-Org/ComfyUI comfy_extras/nodes_sparse_attention.py (BlockSparseAttention, "
                                   "method sol-attn: node defaults tau 1.3, start 0.2, end 1.0, min_tokens 12288, "
                                   "extra_tokens 256, no dense blocks; dense for masked calls, sigma outside the "
                                   "window, fewer tokens, non-CUDA, no kernel, other dtypes, head dim != 128, q/k/v "
                                   "shapes differing)"}


def load_sol_attn(fake: bool):
    """``comfy_kitchen`` (or, for a CPU smoke run, a stand-in with sol_attn's signature computing dense attention);
    returns (module-like, reason it is unavailable or None)."""
    if fake:
        import types

        def sol_attn(q, k, v, tau=1.0, scale=None, sink_blocks=None, sink_q=None, topk_ratio=0.0, token_aug=0, **kw):
            out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                                   v.transpose(1, 2), scale=scale)
            return out.transpose(1, 2)

        return types.SimpleNamespace(sol_attn=sol_attn, sol_attn_is_available=lambda device=None: True), None
    try:
        import comfy_kitchen as ck
    except Exception as err:  # not installed (carry the wheel: docs/speedup.md)
        return None, f"comfy_kitchen not importable: {type(err).__name__}: {err}"
    if not ck.sol_attn_is_available(torch.device("cuda") if torch.cuda.is_available() else None):
        return None, "comfy_kitchen.sol_attn_is_available() is False on this device"
    return ck, None


def make_peer_override(ck, *, sigma_start: float, sigma_end: float, counts: dict, device_type: str,
                       min_tokens: int = PEER["min_tokens"]):
    """Our own override doing what core's BlockSparseAttention override does by default (``PEER``): dense through
    ``func`` where its rules say so, else ``ck.sol_attn`` on [B, T, H, 128] views with its default arguments."""

    def override(func, q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
                 **kwargs):
        options = kwargs.get("transformer_options") or {}

        def dense(reason):
            counts[reason] = counts.get(reason, 0) + 1
            return func(q, k, v, heads, mask=mask, attn_precision=attn_precision, skip_reshape=skip_reshape,
                        skip_output_reshape=skip_output_reshape, **kwargs)

        if mask is not None:
            return dense("mask")
        tokens = q.shape[2] if skip_reshape else q.shape[1]
        sigmas = options.get("sigmas")
        if sigmas is not None:
            sigma = float(sigmas[0])  # the peer reads the sigma per call, as core does
            if sigma > sigma_start or sigma < sigma_end:
                return dense("sigma outside the start/end window")
        if tokens < min_tokens:
            return dense("fewer tokens than min_tokens")
        if skip_reshape:
            b, _, _, dim_head = q.shape
            qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v))
        else:
            b, _, width = q.shape
            dim_head = width // heads
            qs, ks, vs = (t.view(b, -1, heads, dim_head) for t in (q, k, v))
        if q.device.type != device_type or dim_head != PEER["head_dim"] or q.shape != k.shape or q.shape != v.shape \
                or q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            return dense("ineligible (device, head dim, dtype or cross-attention)")
        if q.dtype == torch.float32:
            qs, ks, vs = (t.to(torch.bfloat16) for t in (qs, ks, vs))
        out = ck.sol_attn(qs, ks, vs, tau=PEER["tau"], scale=kwargs.get("scale"), sink_blocks=[0, 0], sink_q=[0, 0],
                          topk_ratio=0.0, token_aug=PEER["extra_tokens"]).to(q.dtype)
        counts["sparse"] = counts.get("sparse", 0) + 1
        if skip_output_reshape:
            return out.transpose(1, 2)
        return out.reshape(b, -1, heads * dim_head)

    return override


def run_peer(env: Env, base, *, dense: dict, args, shape, device, steps: int = 3) -> dict:
    """Time the peer's sparse steps (its window opened from 0 % for the timed steps, so each one is sparse) and
    extrapolate its default schedule over ``PAPER['steps']`` steps: steps whose sigma is above
    ``percent_to_sigma(0.2)`` run dense (the unpatched dense step), the rest at the timed sparse step."""
    result: dict = {"label": "peer: core Model Sparse Attention default (Sol-Attn)", "peer": dict(PEER)}
    ck, why = load_sol_attn(args.peer_fake)
    if ck is None:
        result["not_measured"] = why
        print(f"[peer] not measured: {why}", flush=True)
        return result
    ms = base.get_model_object("model_sampling")
    sigma_start = float(ms.percent_to_sigma(PEER["start_percent"]))
    sigma_end = float(ms.percent_to_sigma(PEER["end_percent"]))
    sched = env.samplers.calculate_sigmas(ms, args.scheduler, PAPER["steps"])
    n_dense = int(sum(1 for s_ in sched[:-1].tolist() if s_ > sigma_start or s_ < sigma_end))
    n_sparse = PAPER["steps"] - n_dense
    counts: dict = {}
    timed_override = make_peer_override(ck, sigma_start=float("inf"), sigma_end=sigma_end, counts=counts,
                                        device_type=device.type,
                                        min_tokens=0 if args.peer_fake else PEER["min_tokens"])
    rec = timed_sample(env, base, steps=steps, shape=shape, cfg=args.cfg, sampler=args.sampler,
                       scheduler=args.scheduler, seed=args.seed, device=device, override=timed_override)
    sparse_step = warm_step(rec["step_s"])
    D = dense["dense_step_s"]
    total = n_dense * D + n_sparse * sparse_step
    result.update({
        "timed_steps_s": rec["step_s"], "sparse_step_s": sparse_step, "calls": counts, "finite": rec["finite"],
        "schedule_50": {"dense": n_dense, "sparse": n_sparse, "sigma_start": sigma_start},
        "total_dense_s": PAPER["steps"] * D, "total_peer_s": total, "speedup": PAPER["steps"] * D / total,
        "method": (f"extrapolated: {n_dense} dense x {D:.3f} s (unpatched dense step) + {n_sparse} sparse x "
                   f"{sparse_step:.3f} s (median of the timed sparse steps after the first) vs {PAPER['steps']} x "
                   f"{D:.3f} s; timed with the peer's window opened from 0 % so every timed step is sparse"),
        "kernel": "fake dense stand-in (smoke)" if args.peer_fake else "comfy_kitchen.sol_attn",
    })
    print(f"[peer] sparse step {sparse_step:.3f} s ({counts}); {PAPER['steps']} steps: {total:.1f} s -> "
          f"{result['speedup']:.3f}x", flush=True)
    return result


def run_cpu_split(env: Env, base, *, args, shape, device, dtype, spec, density: float) -> dict:
    """The prefetch hit rate with the cache in CPU memory and the CFG batch split (as ComfyUI does when memory is
    short, forced as ``timed_sample(split_cfg=True)`` describes): node inputs custom, density ``density``, warm-up 1
    step with the anchor in it, 2 reuse steps, placement cpu, residual precision auto (the pack's plan picks what
    the pin budget allows)."""
    kwargs = {"preset": "custom", "density": density, "dense_warmup": "1", "anchor_steps": "1", "warmup_layers": 0,
              "cache_placement": "cpu", "min_tokens": args.min_tokens, "_split_cfg": True}
    r = run_patched(env, base, label=f"cpu cache, CFG split, density {density:g}", apply_kwargs=kwargs, steps=3,
                    args=args, shape=shape, device=device, dtype=dtype, spec=spec)
    cache = r.get("cache") or {}
    loads = cache.get("prefetched_loads", 0) + cache.get("inline_loads", 0)
    r["prefetch_hit_rate"] = cache.get("prefetched_loads", 0) / loads if loads else None
    r["forward_batches"] = [row.get("forward_batches") for row in r.get("per_step", []) if "kind" in row]
    print(f"[cpu split] prefetch hit rate {r['prefetch_hit_rate']} ({cache.get('prefetched_loads')} prefetched, "
          f"{cache.get('inline_loads')} in line, {cache.get('dropped_prefetches')} dropped); forward batches "
          f"{r['forward_batches']}; residual {cache.get('residual_dtype')}, cache peak CPU "
          f"{fmt_bytes(cache.get('peak_host_bytes'))}; plan: {cache.get('plan')}", flush=True)
    return r


def run_whole(env: Env, base, *, preset: str, args, shape, device, steps: int, dense: dict | None = None,
              spec: dict | None = None, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Whole sampler calls, no extrapolation: ``steps`` steps unpatched, then the node's ``preset`` (all other inputs
    at the node defaults), each the wall time of one ``comfy.sample.sample`` call (model already on the GPU).

    Also where the patched run's time goes (``whole_breakdown``): per step kind (dense / anchor / reuse, from the
    sampler callback's synchronised wall times and the MC-Sparse call counts of each step), the attention calls the
    runner timed by CUDA events, the kernels that ran (``run_kernels``), and the ideal of the same schedule from the
    unpatched whole run's step and ``dense``'s self-attention time (the attention-timed unpatched run). With ``spec``
    (the model's) the kernels are compiled first (``prewarm_kernels`` at the CFG batch, ``prewarm_s``), as before the
    extrapolated runs: the figure is a run on a machine whose Triton cache is warm, in a process that ran before."""
    out: dict = {"label": f"whole run, {steps} steps, preset {preset}", "steps": steps}
    kwargs = {"preset": preset, "min_tokens": args.min_tokens}
    if args.backend != "auto":  # e.g. a CPU smoke run through Triton's interpreter (--backend triton)
        kwargs["backend"] = args.backend
    if spec is not None:  # compile the kernels (and time the Triton sparse op's choice) before the timed calls
        settings = env.settings.build_settings(**{**_node_defaults(), **kwargs})
        out["prewarm_s"] = prewarm_kernels(env, heads=spec["num_heads"], head_dim=spec["dim"] // spec["num_heads"],
                                           tokens=tokens_of(shape), density=settings.density,
                                           group_size=settings.group_size, device=device, dtype=dtype,
                                           backend=settings.backend, batch=2 if args.cfg != 1.0 else 1)
    recs, reps = {}, []
    for rep in range(max(1, getattr(args, "whole_repeat", 1))):
        walls, order = {}, ("dense", "patched") if rep % 2 == 0 else ("patched", "dense")  # every other pair reversed
        for name in order:
            model = base if name == "dense" else env.lifecycle.apply_mc_sparse(base, **kwargs)
            with pack_phase_timer(env) as pack:
                t0 = now(device)
                rec = timed_sample(env, model, steps=steps, shape=shape, cfg=args.cfg, sampler=args.sampler,
                                   scheduler=args.scheduler, seed=args.seed, device=device)
                walls[name] = now(device) - t0
            rec["host_phases"] = h = host_phases(rec, pack.s if name == "patched" else None)
            if None not in (h["before_first_step"], h["after_last_step"], h["bench_after"]):
                h["rest"] = (walls[name] - sum(rec["step_s"]) - h["before_first_step"] - h["after_last_step"]
                             - h["bench_after"])  # the model clone and wrappers, the device syncs around the call
            if not rep:
                out[f"{name}_finite"] = rec["finite"]
                if rec["run"] is not None:
                    out["run_summary"] = rec["run"].summary()
                recs[name] = rec
            walls[f"{name}_sampling"] = sum(rec["step_s"])
            walls[f"{name}_outside"] = rec["host_phases"]
            del model
        reps.append({"order": list(order), "dense_s": walls["dense"], "patched_s": walls["patched"],
                     "speedup": walls["dense"] / walls["patched"],
                     "sampling_speedup": walls["dense_sampling"] / walls["patched_sampling"],
                     "dense_sampling_s": walls["dense_sampling"], "patched_sampling_s": walls["patched_sampling"],
                     "host_phases": {"dense": walls["dense_outside"], "patched": walls["patched_outside"]}})
    for key in ("dense_s", "patched_s", "dense_sampling_s", "patched_sampling_s"):  # means over the repetitions
        out[key] = statistics.mean(r[key] for r in reps)
    out["speedup"] = out["dense_s"] / out["patched_s"]
    out["sampling_speedup"] = out["dense_sampling_s"] / out["patched_sampling_s"]
    out["repetitions"] = reps
    print(f"[whole run] {steps} steps: dense {out['dense_s']:.1f} s, preset {preset} {out['patched_s']:.1f} s -> "
          f"{out['speedup']:.3f}x" + (f" (kernels prewarmed before: {out['prewarm_s']:.1f} s)" if "prewarm_s" in out
                                      else ""), flush=True)
    if len(reps) > 1:
        sp = [r["speedup"] for r in reps]
        out["speedup_spread"] = {"min": min(sp), "max": max(sp), "n": len(sp)}
        print(f"  {len(reps)} repetitions (pairs alternate their order): " + "; ".join(
            f"{'/'.join(o[0].upper() for o in r['order'])} {r['dense_s']:.2f} vs {r['patched_s']:.2f} s -> "
            f"{r['speedup']:.4f}x (steps {r['sampling_speedup']:.4f}x)" for r in reps)
            + f"; figure = mean dense / mean patched {out['speedup']:.4f}x, per-pair spread {min(sp):.4f}-{max(sp):.4f}x",
            flush=True)
    for name in ("dense", "patched"):
        h = reps[0]["host_phases"][name]
        print(f"  outside the steps, {'unpatched' if name == 'dense' else 'patched'} (host s, first pair): " + ", ".join(
            f"{k.replace('_', ' ')} {v if isinstance(v, int) else f'{v:.4f}'}" for k, v in h.items() if v is not None),
            flush=True)
    run = recs["patched"]["run"]
    out["run_kernels"] = run_kernels(env, run)
    print(f"  kernels: {out['run_kernels']['line']}", flush=True)
    try:
        b = whole_breakdown(recs["dense"], recs["patched"], run, dense=dense,
                            layers=spec["num_layers"] if spec else 1, totals=reps[0])  # the pair of ``recs``
        out["breakdown"] = b
        for line in b["lines"]:
            print(f"  {line}", flush=True)
    except Exception as err:  # the breakdown explains the figure; it must not lose it
        out["breakdown_error"] = f"{type(err).__name__}: {err}"
        traceback.print_exc()
    return out


# --- --profile-reuse: where a reuse step's time goes (torch.profiler), stacked residual copies vs views --------------

class StepProfiler:
    """``torch.profiler`` over chosen sampler steps: ``steps`` maps a 0-based step to a name; each named step gets its
    own profile (started at the end of the step before it, after the sampler callback's device sync, stopped at its
    own callback). ``timed_sample`` calls ``step_done``. Profiles are analysed after the call (``trace_summary``)."""

    def __init__(self, steps: dict[int, str], device: torch.device):
        self.want = dict(steps)
        self.device = device
        self.active = None  # (step, profile, name)
        self.done: dict[str, object] = {}

    def step_done(self, step: int) -> None:
        """Step ``step`` (0-based; -1: sampling starts) is complete and the device synchronised."""
        if self.active is not None and self.active[0] == step:
            self.active[1].stop()
            self.done[self.active[2]] = self.active[1]
            self.active = None
        if step + 1 in self.want:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            prof = torch.profiler.profile(activities=acts, record_shapes=False, with_stack=False)
            prof.start()
            self.active = (step + 1, prof, self.want[step + 1])


GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
DISPATCH_LABEL = "mc_sparse.dispatch"
"""``record_function`` label around the MC-Sparse override's dispatch in profiled runs (host time per call)."""


def trace_summary(events: list[dict], top: int = 15) -> dict:
    """What one profiled step did, from its Chrome-trace events (``ts`` / ``dur`` in us).

    Returns: ``span_ms`` (first GPU start to last GPU end), ``busy_ms`` (union of every stream's GPU work), ``idle_ms``
    (span - busy: the device waiting for the host or a dependency), ``streams`` (per stream: ops, busy ms), ``kernels``
    (name -> [count, total ms], names cut at 100 characters), ``top`` (the ``top`` heaviest), ``gaps`` (idle gaps over
    5 us: count, total ms, the largest with the kernels around them), ``syncs`` (host runtime calls that wait for the
    device: count, ms), ``dispatch`` (``DISPATCH_LABEL`` host spans: count, total ms)."""
    gpu = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATS and "dur" in e),
                 key=lambda e: float(e["ts"]))
    out: dict = {"gpu_ops": len(gpu)}
    kernels: dict[str, list] = {}
    streams: dict[str, list] = {}
    for e in gpu:
        name = str(e.get("name", "?"))[:100]
        k = kernels.setdefault(name, [0, 0.0])
        k[0] += 1
        k[1] += float(e["dur"]) / 1000.0
        st = streams.setdefault(str((e.get("args") or {}).get("stream", "?")), [0, 0.0])
        st[0] += 1
        st[1] += float(e["dur"]) / 1000.0
    out["kernels"] = {n: [c, round(ms, 4)] for n, (c, ms) in sorted(kernels.items(), key=lambda kv: -kv[1][1])}
    out["top"] = list(out["kernels"].items())[:top]
    out["streams"] = {k: {"ops": c, "busy_ms": round(ms, 3)} for k, (c, ms) in streams.items()}
    busy, gaps = 0.0, []
    if gpu:
        cur_s, cur_e, cur_name = float(gpu[0]["ts"]), float(gpu[0]["ts"]) + float(gpu[0]["dur"]), gpu[0]["name"]
        for e in gpu[1:]:
            s0, e0 = float(e["ts"]), float(e["ts"]) + float(e["dur"])
            if s0 > cur_e:
                busy += cur_e - cur_s
                gaps.append((s0 - cur_e, str(cur_name)[:60], str(e.get("name", "?"))[:60]))
                cur_s, cur_e = s0, e0
            elif e0 > cur_e:
                cur_e = e0
            if e0 >= cur_e:
                cur_name = e.get("name", "?")
        busy += cur_e - cur_s
        span = max(float(e["ts"]) + float(e["dur"]) for e in gpu) - float(gpu[0]["ts"])
        out.update(span_ms=span / 1000.0, busy_ms=busy / 1000.0, idle_ms=(span - busy) / 1000.0)
    big = sorted((g for g in gaps if g[0] > 5.0), reverse=True)
    out["gaps"] = {"over_5us": len(big), "over_5us_ms": sum(g[0] for g in big) / 1000.0,
                   "largest": [{"us": round(g[0], 1), "after": g[1], "before": g[2]} for g in big[:8]]}
    syncs: dict[str, list] = {}
    dispatch = [0, 0.0]
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        name = str(e.get("name", ""))
        if "Synchronize" in name or name in ("aten::_local_scalar_dense", "cudaMemcpy"):
            v = syncs.setdefault(name, [0, 0.0])
            v[0] += 1
            v[1] += float(e["dur"]) / 1000.0
        elif name == DISPATCH_LABEL:
            dispatch[0] += 1
            dispatch[1] += float(e["dur"]) / 1000.0
    out["syncs"] = {k: {"count": c, "ms": round(ms, 3)} for k, (c, ms) in syncs.items()}
    out["dispatch"] = {"calls": dispatch[0], "host_ms": round(dispatch[1], 3),
                       "host_ms_per_call": round(dispatch[1] / dispatch[0], 4) if dispatch[0] else None}
    return out


def kernel_delta(a: dict, b: dict, top: int = 12) -> list[tuple[str, float, int, int]]:
    """Kernels whose total time differs most between two ``trace_summary`` results: (name, b - a ms, count a, count b),
    largest difference first."""
    names = set(a["kernels"]) | set(b["kernels"])
    rows = [(n, round(b["kernels"].get(n, [0, 0.0])[1] - a["kernels"].get(n, [0, 0.0])[1], 4),
             a["kernels"].get(n, [0, 0.0])[0], b["kernels"].get(n, [0, 0.0])[0]) for n in names]
    return sorted(rows, key=lambda r: -abs(r[1]))[:top]


def _profile_file(prof, path: Path) -> dict:
    """Export ``prof``'s Chrome trace gzipped to ``path`` and summarise it (``trace_summary``)."""
    import gzip
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(raw))
        data = raw.read_bytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(data, compresslevel=3))
    events = json.loads(data).get("traceEvents", [])
    return trace_summary(events)


def _print_profile(name: str, t: dict, wall: float | None) -> None:
    print(f"  [{name}] wall {wall if wall is None else round(wall, 4)} s; GPU span {t.get('span_ms', 0):.2f} ms, busy "
          f"{t.get('busy_ms', 0):.2f}, idle {t.get('idle_ms', 0):.2f} (gaps > 5 us: {t['gaps']['over_5us']}, "
          f"{t['gaps']['over_5us_ms']:.2f} ms); streams "
          + ", ".join(f"{k}: {v['ops']} ops {v['busy_ms']:.2f} ms" for k, v in t["streams"].items())
          + f"; host syncs {t['syncs'] or 'none'}; dispatch {t['dispatch']}", flush=True)
    for n, (c, ms) in t["top"][:10]:
        print(f"      {ms:9.3f} ms  x{c:<5d} {n}", flush=True)
    for g in t["gaps"]["largest"][:4]:
        print(f"      gap {g['us']:.0f} us after {g['after']} before {g['before']}", flush=True)


def run_profile(env: Env, base, *, preset: str, args, shape, device, steps: int, dense: dict, spec: dict,
                dtype: torch.dtype) -> dict:
    """``--profile-reuse``: where a reuse step's time goes beyond the kernels, and stacked residual copies against
    views (``prefetch.STACK_VIEWS``) and kept decoded groups (``engine.keep_budget``) side by side, in one process.

    1. the kernels prewarmed at the CFG batch (as ``run_whole``);
    2. unpatched, 4 steps: D = median of steps 2-3, step 4 profiled (``torch.profiler``, trace gzipped next to --out);
    3. the node's ``preset`` on ``steps`` steps, 4 runs: residual copies, views, views + decoded groups kept (the plan's
       ``engine.keep_budget``; the other runs keep nothing), copies again; the first run profiles its anchor step and
       each of the first three its last reuse step; per run the
       reuse steps' median wall (the first reuse step and profiled steps left out), the runner's reuse-call time per
       step (CUDA events: median call x calls) and the pack overhead per call against the step at those kernels
       (N + A (1 - f) + the calls, with A = ``dense``'s self-attention and N = D - A, as ``whole_breakdown``).
    Printed: per profiled step the GPU busy / idle time, streams, host syncs, the override's host time per call, the
    heaviest kernels and the largest idle gaps; the kernels whose time differs most between the unpatched step and
    each variant's reuse step; reuse step copy vs views."""
    import importlib

    prefetch = importlib.import_module(env.engine.__name__.rsplit(".", 1)[0] + ".prefetch")
    out: dict = {"label": f"profile, preset {preset}, {steps} steps", "steps": steps}
    kwargs = {"preset": preset, "min_tokens": args.min_tokens}
    if args.backend != "auto":
        kwargs["backend"] = args.backend
    settings = env.settings.build_settings(**{**_node_defaults(), **kwargs})
    out["prewarm_s"] = prewarm_kernels(env, heads=spec["num_heads"], head_dim=spec["dim"] // spec["num_heads"],
                                       tokens=tokens_of(shape), density=settings.density,
                                       group_size=settings.group_size, device=device, dtype=dtype,
                                       backend=settings.backend, batch=2 if args.cfg != 1.0 else 1)
    print(f"[profile] kernels prewarmed: {out['prewarm_s']:.1f} s", flush=True)
    stem = Path(args.out)
    traces = stem.parent / f"{stem.stem}_traces"
    common = dict(shape=shape, cfg=args.cfg, sampler=args.sampler, scheduler=args.scheduler, seed=args.seed,
                  device=device)
    prof = StepProfiler({3: "unpatched"}, device)
    rec = timed_sample(env, base, steps=4, profiler=prof, **common)
    D = statistics.median(rec["step_s"][1:3])
    summaries = {"unpatched": _profile_file(prof.done["unpatched"], traces / "unpatched.json.gz")}
    walls = {"unpatched": rec["step_s"][3]}
    out["unpatched"] = {"step_s": rec["step_s"], "D": D}
    A = float(dense["self_attn_s"])
    N = D - A
    real_dispatch = env.override.dispatch

    def annotated(*a, **kw):
        with torch.profiler.record_function(DISPATCH_LABEL):
            return real_dispatch(*a, **kw)

    runs, latents = [], []
    real_keep = env.engine.keep_budget
    env.override.dispatch = annotated
    try:
        for i, variant in enumerate(("copy", "views", "keep", "copy")):
            prefetch.STACK_VIEWS = variant != "copy"
            env.engine.keep_budget = real_keep if variant == "keep" else (lambda plan: 0)
            sc = schedule_counts(env, settings, steps, 1)
            kinds = sc["kinds"]
            want = {}
            if i == 0 and "A" in kinds:
                want[kinds.index("A")] = "anchor"
            if i < 3 and kinds.endswith("R"):
                want[steps - 1] = f"reuse ({variant})"
            prof = StepProfiler(want, device)
            model = env.lifecycle.apply_mc_sparse(base, **kwargs)
            rec = timed_sample(env, model, steps=steps, profiler=prof, **common)
            del model
            rows = [r for r in classify(rec) if "kind" in r]
            reuse_rows = [r for r in rows if r["kind"] == "reuse"]
            timed = [r["wall_s"] for r in reuse_rows[1:] if r["step"] - 1 not in want]
            run = rec["run"]
            runner = getattr(run, "runner", None)
            if runner is None:
                raise RuntimeError(f"the patched run stayed dense: {getattr(run, 'dense_run_reason', 'no run state')}")
            layers = spec["num_layers"]
            f = (layers - runner.config.warmup_layers) / layers
            per = [ms for v in runner.timer.times("reuse").values() for ms in v]
            batch = max((b for r in rows for b in (r.get("forward_batches") or [])), default=1)
            call_ms = statistics.median(per) * batch if per else float("nan")
            calls_per_step = runner.stats.calls[env.schedule.StepKind.REUSE] / max(len(reuse_rows), 1) / batch
            sparse_step = call_ms * calls_per_step / 1000.0
            reuse = statistics.median(timed) if timed else float("nan")
            at_kernels = N + A * (1 - f) + sparse_step
            r = {"variant": variant, "schedule": kinds, "reuse_steps_timed": timed, "reuse_step_s": reuse,
                 "reuse_call_ms": call_ms, "calls_per_step": calls_per_step, "at_kernels_s": at_kernels,
                 "pack_overhead_ms_per_step": (reuse - at_kernels) * 1000.0,
                 "pack_overhead_ms_per_call": (reuse - at_kernels) * 1000.0 / calls_per_step if calls_per_step else None,
                 "anchor_step_s": next((q["wall_s"] for q in rows if q["kind"] == "anchor"), None),
                 "loads": {"prefetched": runner.loader.hits, "inline": runner.loader.misses,
                           "kept": runner.loader.kept_loads, "kept_bytes": runner.loader.peak_kept_bytes,
                           "keep_budget": runner.loader.keep_budget_bytes},
                 "finite": rec["finite"]}
            latents.append(rec.pop("latent"))
            r["max_abs_diff_vs_run1"] = float((latents[-1] - latents[0]).abs().max())
            runs.append(r)
            print(f"[profile] run {i + 1} residual {variant}: {kinds}; reuse step median {reuse:.4f} s over "
                  f"{len(timed)}; reuse call {call_ms:.3f} ms x {calls_per_step:.0f}/step; at the kernels "
                  f"{at_kernels:.4f} s -> pack overhead {r['pack_overhead_ms_per_step']:+.2f} ms/step "
                  f"({r['pack_overhead_ms_per_call']:+.3f} ms/call); loads {r['loads']}; finite {rec['finite']}; "
                  f"latent max |diff| vs run 1 {r['max_abs_diff_vs_run1']:.3g}", flush=True)
            for step, name in want.items():
                if name in prof.done:
                    tag = name.split(" ")[0] + ("_" + variant if name.startswith("reuse") else "")
                    summaries[name] = _profile_file(prof.done[name], traces / f"{tag}.json.gz")
                    walls[name] = rec["step_s"][step]
    finally:
        env.override.dispatch = real_dispatch
        env.engine.keep_budget = real_keep
        prefetch.STACK_VIEWS = True
    out["runs"] = runs
    out["profiles"] = {k: {kk: vv for kk, vv in v.items() if kk != "kernels"} for k, v in summaries.items()}
    out["kernels"] = {k: v["kernels"] for k, v in summaries.items()}
    out["traces"] = str(traces)
    print(f"[profile] unpatched D {D:.4f} s (A {A:.4f}, N {N:.4f}); profiled steps (walls include the profiler):",
          flush=True)
    for name, t in summaries.items():
        _print_profile(name, t, walls.get(name))
    for name in summaries:
        if name.startswith("reuse"):
            out.setdefault("delta_vs_unpatched", {})[name] = d = kernel_delta(summaries["unpatched"], summaries[name])
            print(f"  kernels {name} - unpatched (ms, count unpatched -> reuse):", flush=True)
            for n, ms, ca, cb in d:
                print(f"      {ms:+9.3f} ms  {ca} -> {cb}  {n}", flush=True)
    # correctness on the device: views and kept runs must sample the latent a copy run does (runs 1 and 4, both copy,
    # give the noise floor)
    floor = runs[-1]["max_abs_diff_vs_run1"] if runs[-1]["variant"] == "copy" else 0.0
    checks = {}
    for v in ("views", "keep"):
        diff = max((r["max_abs_diff_vs_run1"] for r in runs if r["variant"] == v), default=float("nan"))
        checks[v] = {"max_abs_diff_vs_copy": diff, "copy_vs_copy": floor, "ok": diff <= floor}
        print(f"[profile] CHECK {v} vs copy: latent max |diff| {diff:.3g} (copy vs copy {floor:.3g}) -> "
              f"{'OK' if diff <= floor else 'FAILED'}", flush=True)
    out["checks"] = checks
    by = {v: [r["reuse_step_s"] for r in runs if r["variant"] == v] for v in ("copy", "views", "keep")}
    if all(by.values()):
        c = statistics.mean(by["copy"])
        out["reuse_step_s"] = {v: statistics.mean(x) for v, x in by.items()}
        print(f"[profile] reuse step, side by side: residual copies {c:.4f} s ({', '.join(f'{x:.4f}' for x in by['copy'])})"
              + "".join(f"; {v} {statistics.mean(by[v]):.4f} s ({statistics.mean(by[v]) / c:.4f} of copies, "
                        f"{(c - statistics.mean(by[v])) * 1000:+.2f} ms per step, x40 reuse steps of the 50-step run: "
                        f"{(c - statistics.mean(by[v])) * 40:+.3f} s)" for v in ("views", "keep")), flush=True)
    return out


def run_kernels(env: Env, run) -> dict:
    """The kernels the patched run's ops ran on (the runner's ``kernels.registry.Record``) and, for the Triton
    backend's sparse op, which kernel it chose per call shape (the run summary's "sparse kernel" line)."""
    runner = getattr(run, "runner", None)
    if runner is None:
        return {"ops": {}, "sparse_per_shape": [], "line": "no runner (the run stayed dense)"}
    ops = {op: c.backend for op, c in sorted(runner.kernels.choices.items())}
    per_shape = env.engine.triton_sparse_choices(runner)
    failures = {f"{b}/{op}": err for (b, op), err in runner.kernels.failures.items()}
    line = ", ".join(f"{op}={b}" for op, b in ops.items()) or "no kernel op ran"
    if per_shape:
        line += "; triton sparse op per shape: " + "; ".join(per_shape)
    if failures:
        line += "; FAILED: " + "; ".join(f"{k}: {v[:120]}" for k, v in failures.items())
    return {"ops": ops, "sparse_per_shape": per_shape, "failures": failures, "line": line}


def whole_breakdown(dense_rec: dict, patched_rec: dict, run, *, dense: dict | None, layers: int,
                    totals: dict | None = None) -> dict:
    """Where a whole patched run's time goes, against the ideal of the same schedule.

    Args:
        dense_rec, patched_rec: ``timed_sample`` records of the unpatched and the patched whole run.
        run: the patched run's ``lifecycle.RunState`` (its runner's ``CallTimer`` holds the CUDA-event times of
            its anchor, reuse and timed dense calls, ms per batch item per call).
        dense: the attention-timed unpatched run of the same config (``self_attn_s``: self-attention per dense step);
            None: no ideal.
        layers: transformer blocks.
        totals: ``run_whole``'s dict (whole-call walls ``dense_s`` / ``patched_s``), for the time outside the steps.
    Returns:
        dict: ``kinds`` (per kind: steps, total / mean wall s, ideal s per step, loss s), ``ideal`` (per-step ideals and
        the ideal total / speedup), ``attention`` (timer sums), ``lines`` (what to print).

    Ideal (the extrapolation's, per step, with D = the unpatched whole run's warm step, A = self-attention per dense
    step, N = D - A, f = sparse blocks / blocks, s = the keys' share): dense D; anchor D + A f (0.5 + s); reuse
    N + A (1 - f) + A f s. "At the measured kernels": reuse N + A (1 - f) + the measured sparse calls of a reuse
    step, anchor D + the measured anchor calls - A f (their dense part is the step's own attention): what the run
    would take with no pack cost besides its kernels.
    """
    rows = [r for r in classify(patched_rec) if "kind" in r]
    d_steps = dense_rec["step_s"]
    D = warm_step(d_steps) if d_steps else float("nan")
    kinds: dict[str, dict] = {}
    for kind in ("dense", "anchor", "reuse"):
        walls = [r["wall_s"] for r in rows if r["kind"] == kind]
        kinds[kind] = {"steps": len(walls), "total_s": sum(walls), "mean_s": statistics.mean(walls) if walls else None,
                       "median_s": statistics.median(walls) if walls else None,
                       "first_s": walls[0] if walls else None}
    batches = [b for r in rows for b in (r.get("forward_batches") or [])]
    batch = max(batches) if batches else 1
    runner = getattr(run, "runner", None)
    config = getattr(runner, "config", None)
    timer = getattr(runner, "timer", None)
    att = {}
    if timer is not None:  # ms per batch item per call, summed per kind -> seconds of whole calls
        for kind in ("dense", "anchor", "reuse"):
            per = [ms for v in timer.times(kind).values() for ms in v]
            att[kind] = {"calls": len(per), "total_s": sum(per) * (batch if kind != "anchor" else 1) / 1000.0,
                         "mean_call_ms": statistics.mean(per) * (batch if kind != "anchor" else 1) if per else None}
        # anchor calls run per conditioning chunk (batch 1 each); dense and reuse calls take the whole batch
    out: dict = {"kinds": kinds, "attention": att, "batch": batch, "unpatched_step_s": D,
                 "unpatched_first_step_s": d_steps[0] if d_steps else None,
                 "patched_first_step_s": rows[0]["wall_s"] if rows else None}
    lines = []
    if totals:
        out["outside_steps_s"] = {"dense": totals["dense_s"] - sum(d_steps),
                                  "patched": totals["patched_s"] - sum(r["wall_s"] for r in rows)}
    ideal = None
    if dense and config is not None and dense.get("self_attn_s") == dense.get("self_attn_s"):
        A = float(dense["self_attn_s"])
        N = D - A
        s = float(config.density)
        f = (layers - config.warmup_layers) / layers
        ideal = {"dense": D, "anchor": D + A * f * (0.5 + s), "reuse": N + A * (1 - f) + A * f * s}
        n_reuse, n_anchor = kinds["reuse"]["steps"], kinds["anchor"]["steps"]
        at_kernels = dict(ideal)
        if att.get("reuse", {}).get("calls") and n_reuse:
            sparse_step = att["reuse"]["total_s"] / n_reuse
            at_kernels["reuse"] = N + A * (1 - f) + sparse_step
            out["reuse_sparse_s_per_step"] = sparse_step
            out["reuse_sparse_ideal_s_per_step"] = A * f * s
            out["sparse_kernel_efficiency_vs_callers_attention"] = A * f * s / sparse_step if sparse_step else None
        if att.get("anchor", {}).get("calls") and n_anchor:
            at_kernels["anchor"] = D + att["anchor"]["total_s"] / n_anchor - A * f
            out["anchor_calls_s_per_step"] = att["anchor"]["total_s"] / n_anchor
        n_total = sum(k["steps"] for k in kinds.values())
        # both runs' first step is cold: the dense steps are compared with the unpatched run's same steps
        same = len(d_steps) == len(rows)

        def basis(k: str, per_step: float) -> float:
            if k == "dense" and same:
                return sum(d_steps[r["step"] - 1] for r in rows if r["kind"] == "dense")
            return kinds[k]["steps"] * per_step

        t_ideal = sum(basis(k, ideal[k]) for k in kinds)
        t_kern = sum(basis(k, at_kernels[k]) for k in kinds)
        t_meas = sum(k["total_s"] for k in kinds.values())
        t_dense = sum(d_steps) if same else n_total * D
        for k in kinds:
            kinds[k]["ideal_s"] = ideal[k]
            kinds[k]["at_kernels_s"] = at_kernels[k]
            kinds[k]["loss_vs_ideal_s"] = kinds[k]["total_s"] - basis(k, ideal[k])
            kinds[k]["pack_overhead_s"] = kinds[k]["total_s"] - basis(k, at_kernels[k])
        out["ideal"] = {"A_self_attn_s": A, "N_rest_s": N, "f_sparse_blocks": f, "density": s, "per_step": ideal,
                        "at_measured_kernels_per_step": at_kernels, "total_s": t_ideal,
                        "total_at_measured_kernels_s": t_kern, "measured_steps_s": t_meas,
                        "speedup_ideal": t_dense / t_ideal, "speedup_at_measured_kernels": t_dense / t_kern,
                        "speedup_steps": t_dense / t_meas if t_meas else None,
                        "steps_s_for_1.55x": t_dense / 1.55}
        lines.append(f"schedule {''.join(r['kind'][0].upper() for r in rows)}; unpatched step D {D:.4f} s, "
                     f"self-attention A {A:.4f} s, rest N {N:.4f} s; f {f:.3f}, s {s:g}")
    for k, v in kinds.items():
        if not v["steps"]:
            continue
        line = f"{k}: {v['steps']} x {v['mean_s']:.4f} s (median {v['median_s']:.4f}, first {v['first_s']:.4f}) = " \
               f"{v['total_s']:.2f} s"
        if ideal is not None:
            line += (f"; ideal {ideal[k]:.4f}/step (loss {v['loss_vs_ideal_s']:+.2f} s), at the measured kernels "
                     f"{v['at_kernels_s']:.4f}/step (pack overhead {v['pack_overhead_s']:+.2f} s)")
        if att.get(k, {}).get("calls"):
            line += f"; {att[k]['calls']} timed {k} calls {att[k]['total_s']:.2f} s (mean {att[k]['mean_call_ms']:.3f} ms)"
        lines.append(line)
    if ideal is not None:
        i = out["ideal"]
        lines.append(f"steps: measured {i['measured_steps_s']:.2f} s, at the measured kernels "
                     f"{i['total_at_measured_kernels_s']:.2f} s, "
                     f"ideal {i['total_s']:.2f} s; unpatched steps {t_dense:.2f} s -> {i['speedup_steps']:.3f}x "
                     f"measured, {i['speedup_at_measured_kernels']:.3f}x at the kernels, {i['speedup_ideal']:.3f}x ideal")
        if "reuse_sparse_s_per_step" in out:
            lines.append(f"reuse sparse calls {out['reuse_sparse_s_per_step']:.4f} s/step vs ideal "
                         f"{out['reuse_sparse_ideal_s_per_step']:.4f} (kernel efficiency vs the caller's attention "
                         f"{out['sparse_kernel_efficiency_vs_callers_attention']:.3f})")
        if att.get("dense", {}).get("calls") and "reuse_sparse_s_per_step" in out:
            # A on the clock of the sparse spans: the synchronised per-call timing of the unpatched run adds each
            # call's launch and sync latency to A (so N = D - A comes out low, and with it the step at the kernels)
            a_ev = att["dense"]["mean_call_ms"] * layers / 1000.0
            ev = {"A_s": a_ev, "reuse_at_kernels_s": D - a_ev + a_ev * (1 - f) + out["reuse_sparse_s_per_step"]}
            ev["reuse_pack_overhead_s_per_step"] = kinds["reuse"]["median_s"] - ev["reuse_at_kernels_s"]
            if "anchor_calls_s_per_step" in out:
                ev["anchor_at_kernels_s"] = D + out["anchor_calls_s_per_step"] - a_ev * f
                ev["anchor_pack_overhead_s"] = kinds["anchor"]["median_s"] - ev["anchor_at_kernels_s"]
            out["event_basis"] = ev
            lines.append(f"on the spans' clock (A from this run's {att['dense']['calls']} event-timed dense calls: "
                         f"{a_ev:.4f} s/step, vs {A:.4f} synchronised): reuse at the kernels "
                         f"{ev['reuse_at_kernels_s']:.4f} s/step, pack overhead "
                         f"{ev['reuse_pack_overhead_s_per_step'] * 1000:+.1f} ms per (median) reuse step"
                         + (f"; anchor at the kernels {ev['anchor_at_kernels_s']:.4f} s, pack overhead "
                            f"{ev['anchor_pack_overhead_s'] * 1000:+.1f} ms" if "anchor_at_kernels_s" in ev else ""))
        limits = {  # seconds of the run each part costs beyond the ideal (or, block 0, what it keeps dense)
            "sparse kernel below the caller's attention x s (reuse steps)":
                n_reuse * (out["reuse_sparse_s_per_step"] - A * f * s) if "reuse_sparse_s_per_step" in out else None,
            "pack overhead in reuse steps (beyond the measured kernels)": kinds["reuse"].get("pack_overhead_s"),
            "anchor steps beyond the ideal": kinds["anchor"].get("loss_vs_ideal_s"),
            "dense warm-up steps beyond the unpatched step": kinds["dense"].get("loss_vs_ideal_s"),
            "block 0 kept dense at reuse steps (the published schedule; sparse at the measured kernel would save)":
                n_reuse * (A * (1 - f) - out["reuse_sparse_s_per_step"] * (1 - f) / f)
                if "reuse_sparse_s_per_step" in out and f > 0 else None,
        }
        out["limits_s"] = {k: v for k, v in limits.items() if v is not None}
        need = t_dense / 1.55 - t_meas
        lines.append(f"to 1.55x from these steps: {need:+.2f} s; " + "; ".join(
            f"{k}: {v:+.2f} s" for k, v in out["limits_s"].items()))
    if "outside_steps_s" in out:
        o = out["outside_steps_s"]
        lines.append(f"outside the steps (call wall - steps): unpatched {o['dense']:.3f} s, patched {o['patched']:.3f} s")
    out["lines"] = lines
    return out


# --- scoreboard (docs/results/scoreboard.json) -----------------------------------------------------------------------

def scoreboard_entries(report: dict, *, command: str, commit: str, gpu: str | None) -> dict:
    """The scoreboard keys this benchmark measured in ``report`` (true values, bars met or not)."""
    out = {}
    kernels = report["args"].get("kernels", "installed")

    def put(key, value, unit, note, suffixed=False):
        # TEAM.md item 6: e2e / anchor keys measured with --kernels triton-only go under key + "_triton_only" (the
        # plain key holds the figure with the full Hopper install); the 1.3B whole-run key is Triton-only by definition
        if suffixed and kernels == "triton-only":
            key += TRITON_ONLY_SUFFIX
        if value is not None and value == value:
            out[key] = _scoreboard.entry(value, unit, note, command=command, commit=commit, gpu=gpu)

    for c in report["configs"]:
        tag = {("wan14b", "720p"): "wan14b_720p", ("wan14b", "480p"): "wan14b_480p",
               ("wan1.3b", "480p"): "wan13b_480p"}.get((c["model"], c["res"]))
        if tag is None:
            continue
        for r in c.get("runs", []):
            if r.get("prefetch_hit_rate") is not None and tag == "wan14b_720p":
                cache = r.get("cache") or {}
                put("prefetch_hit_rate_wan14b_720p", r["prefetch_hit_rate"], "fraction",
                    f"reuse loads served by prefetch {cache.get('prefetched_loads')} / "
                    f"{cache.get('prefetched_loads', 0) + cache.get('inline_loads', 0)}; cache placement cpu "
                    f"(residual {cache.get('residual_dtype')}, peak {fmt_bytes(cache.get('peak_host_bytes'))} in CPU "
                    "memory), CFG split forced the way ComfyUI splits when memory is short: during sampling "
                    "the model's memory_required for a batch > 1 is made infinite, so comfy/samplers.py "
                    "_calc_cond_batch runs uncond and cond as separate forwards; forward batches per step "
                    f"{r.get('forward_batches')}; density 0.25, 1 anchor step + 2 reuse steps")
            x = r.get("extrapolation")
            if not x:
                continue
            preset = (r.get("apply_kwargs") or {}).get("preset")
            if preset in ("quality", "fast") and not r.get("apply_kwargs", {}).get("_split_cfg"):
                put(f"e2e_{tag}_{preset}_speedup", x["speedup"], "x",
                    f"node preset '{preset}' vs unpatched (ComfyUI default attention); {x['method']}; cfg "
                    f"{report['args']['cfg']}, {report['args']['sampler']}/{report['args']['scheduler']}; "
                    f"--kernels {kernels}: {(r.get('run_kernels') or {}).get('line', '?')}", suffixed=True)
                if preset == "quality" and tag == "wan14b_720p":
                    put("anchor_over_dense_step_wan14b_720p", x["anchor_step_s"] / x["dense_step_s"], "ratio",
                        f"mean anchor step {x['anchor_step_s']:.3f} s / unpatched dense step {x['dense_step_s']:.3f} s, "
                        f"preset 'quality' (s = 0.25); --kernels {kernels}", suffixed=True)
                    g = r.get("glue")
                    if g:
                        put("reuse_glue_ratio_wan14b_720p", g["ratio"], "ratio",
                            f"{g['method']}; per batch: " + "; ".join(
                                f"B={b}: {v['override_call_ms']:.2f} ms / {v['bare_kernel_ms']:.2f} ms over "
                                f"{v['calls']} calls" for b, v in g["per_batch"].items()))
        peer = c.get("peer")
        if peer and tag == "wan14b_720p":
            if peer.get("speedup") is not None:
                put("e2e_wan14b_720p_solattn_speedup", peer["speedup"], "x",
                    f"our override calling {peer['kernel']} as core's Model Sparse Attention does by default (tau "
                    f"1.3, dense before 20 %, extra_tokens 256); {peer['method']}")
        whole = c.get("whole")
        ops = set(((whole or {}).get("run_kernels") or {}).get("ops", {}).values())
        if whole and tag == "wan13b_480p" and not ops & set(TRITON_ONLY_OFF):  # Triton-only by definition
            put("e2e_wan13b_480p_fast_speedup_whole_run", whole["speedup"], "x",
                f"whole comfy.sample.sample calls, {whole['steps']} steps each, no extrapolation: unpatched "
                f"{whole['dense_s']:.1f} s vs preset 'fast' {whole['patched_s']:.1f} s; cfg {report['args']['cfg']}; "
                + (f"kernels compiled and the sparse op's per-shape choice timed before the timed calls "
                   f"({whole['prewarm_s']:.1f} s, as in any later run of a process); " if "prewarm_s" in whole else "")
                + f"--kernels {kernels}: {(whole.get('run_kernels') or {}).get('line', '?')}")
    return out


PRESETS = ("quality", "balanced", "fast")
"""The node's presets (adapter/settings.py)."""


def only_presets(plan: list[dict], presets: list[str]) -> list[dict]:
    """``plan`` reduced to timing ``presets`` in each configuration: no density runs, glue ratio, peer, CPU split or
    whole runs (``--plan h720 --presets fast``: the 720p 'fast' bar alone, ~200 s on an H200)."""
    keep = ("model", "res")
    return [{**{k: c[k] for k in keep}, "densities": [], "presets": list(presets)} for c in plan]


def _node_defaults() -> dict:
    return {"preset": "balanced", "density": 0.2, "dense_warmup": "auto", "warmup_layers": 1, "anchor_steps": "auto",
                "query_tile": 128, "cache_placement": "auto", "backend": "auto", "min_tokens": 2048, "verbose": False}


# ---------------------------------------------------------------------------------------------------------------
# Extrapolation and the ideal
# ---------------------------------------------------------------------------------------------------------------

def extrapolate(env: Env, dense: dict, run: dict, *, settings_50, layers: int, eff_alt: float = 0.97,
                patched_dense: dict | None = None) -> dict:
    """The 50-step schedule's time from measured per-kind steps, against 50 dense steps, and its ideal.

    Dense steps of the schedule cost this run's patched dense step; a run without one uses the patched dense step
    of ``patched_dense`` (an earlier run of the same configuration), else the unpatched dense step."""
    sched = schedule_counts(env, settings_50, PAPER["steps"], layers)
    D = dense["dense_step_s"]
    A = dense["self_attn_s"]
    N = D - A
    kinds = run["step_s_by_kind"]
    d_src = "this patched run"
    if kinds["dense"]:
        d_pat = statistics.median(kinds["dense"])
    elif patched_dense is not None:
        d_pat = statistics.median(patched_dense["step_s_by_kind"]["dense"])
        d_src = f"patched run '{patched_dense['label']}'"
    else:
        d_pat, d_src = None, "unpatched"
    d_used = d_pat if d_pat is not None else D
    anchor = statistics.mean(kinds["anchor"]) if kinds["anchor"] else float("nan")
    reuse = warm_step(kinds["reuse"]) if len(kinds["reuse"]) >= 3 else (
        statistics.median(kinds["reuse"]) if kinds["reuse"] else float("nan"))
    nd, na, nr = sched["dense"], sched["anchor"], sched["reuse"]
    t_dense = PAPER["steps"] * D
    t_mc = nd * d_used + na * anchor + nr * reuse
    s = settings_50.density
    f = run.get("sparse_layers", layers) / layers

    def ideal(eff: float) -> dict:
        r_i = N + A * (1 - f) + A * f * s / eff
        a_i = D + A * f * (0.5 + s / eff)
        t_i = nd * D + na * a_i + nr * r_i
        return {"kernel_efficiency": eff, "reuse_step_s": r_i, "anchor_step_s": a_i, "total_s": t_i,
                "speedup": t_dense / t_i}

    ideal1, ideal_alt = ideal(1.0), ideal(eff_alt)
    speedup = t_dense / t_mc
    losses = {"dense steps (patch overhead on warm-up)": nd * (d_used - D),
              "anchor steps": na * (anchor - ideal1["anchor_step_s"]),
              "reuse steps": nr * (reuse - ideal1["reuse_step_s"])}
    out = {
        "method": (f"extrapolated: {nd} dense x {d_used:.3f} s ({d_src} dense step) + {na} anchor x {anchor:.3f} s "
                   f"(mean of {len(kinds['anchor'])} timed) + {nr} reuse x {reuse:.3f} s (median of "
                   f"{len(kinds['reuse'])} timed) vs {PAPER['steps']} x {D:.3f} s (unpatched dense step, warm)"),
        "schedule_50": sched, "dense_step_s": D, "patched_dense_step_s": d_pat, "anchor_step_s": anchor,
        "reuse_step_s": reuse, "total_dense_s": t_dense, "total_mc_sparse_s": t_mc, "speedup": speedup,
        "ideal": ideal1, "ideal_at_eff": ideal_alt, "achieved_over_ideal": speedup / ideal1["speedup"],
        "achieved_over_ideal_at_eff": speedup / ideal_alt["speedup"],
        "reuse_over_ideal": reuse / ideal1["reuse_step_s"], "anchor_over_ideal": anchor / ideal1["anchor_step_s"],
        "loss_s_vs_ideal": losses,
        "limiting_part": max(losses, key=lambda k: losses[k]) if max(losses.values()) > 0 else "none (at ideal)",
        "reuse_step_speedup": D / reuse,
    }
    ra = run.get("reuse_attention_s_per_step")
    if ra:  # measured sparse attention of a reuse step (adapter timing) -> kernel efficiency, non-attention rest
        out["reuse_sparse_attention_s"] = ra
        out["reuse_non_sparse_s"] = reuse - ra
        out["sparse_kernel_efficiency_vs_dense_attention"] = (A * f * s) / ra
        out["anchor_extra_over_dense_in_dense_attentions"] = (anchor - D) / (A * f) if A * f > 0 else None
    return out


# ---------------------------------------------------------------------------------------------------------------
# One configuration
# ---------------------------------------------------------------------------------------------------------------

def run_config(env: Env, cfg: dict, args, device: torch.device, dtype: torch.dtype, report: dict, save) -> None:
    model, res = cfg["model"], cfg["res"]
    spec = MODELS[model]
    shape = latent_shape(res, args.frames)
    entry = {"model": model, "res": res, "frames": args.frames, "latent": list(shape), "tokens": tokens_of(shape),
             "heads": spec["num_heads"], "layers": spec["num_layers"], "runs": [], "errors": []}
    report["configs"].append(entry)
    print(f"\n=== {model} {res}: latent {list(shape)}, {entry['tokens']} tokens, {spec['num_layers']} blocks x "
          f"{spec['num_heads']} heads ===", flush=True)
    base = None
    try:
        base, info = build_model(env, model, device, dtype, args.seed)
        entry["model_info"] = info
        print(f"built {info['params'] / 1e9:.2f} B params in {info['build_s']:.1f} s", flush=True)
        rec = timed_sample(env, base, steps=args.dense_steps, shape=shape, cfg=args.cfg, sampler=args.sampler,
                           scheduler=args.scheduler, seed=args.seed, device=device, time_attention=True)
        rows = classify(rec)
        step_s = rec["step_s"]
        self_attn = [r["self_attn_s"] for r in rows if "kind" in r]
        cross_attn = [r["cross_attn_s"] for r in rows if "kind" in r]
        dense = {"per_step": rows, "dense_step_s": warm_step(step_s), "self_attn_s": warm_step(self_attn),
                 "cross_attn_s": warm_step(cross_attn), "attention_func": rec.get("attn_func"),
                 "finite": rec["finite"], "latent_std": rec["latent_std"], "load_s": rec["load_s"],
                 "model_lowvram": rec["model_lowvram"],
                 "method": f"median of steps 2..{len(step_s)} of {len(step_s)}" if len(step_s) >= 2 else "one step"}
        dense["self_attn_share"] = dense["self_attn_s"] / dense["dense_step_s"]
        entry["dense"] = dense
        print(f"dense (unpatched, attention {dense['attention_func']}): steps "
              f"{', '.join(f'{t:.3f}' for t in step_s)} s -> {dense['dense_step_s']:.3f} s/step; self-attention "
              f"{dense['self_attn_s']:.3f} s ({100 * dense['self_attn_share']:.0f}%), cross {dense['cross_attn_s']:.3f} s"
              + ("" if rec["finite"] else "  WARNING: non-finite latent"), flush=True)
        save()
    except Exception as err:
        entry["errors"].append({"stage": "build/dense", **_failure("build/dense", err)})
        base = None
        _free(env, device)
        save()
        return

    runs = []  # (label, node inputs of the timed run, timed steps, node inputs of the 50-step schedule)
    for i, density in enumerate(cfg["densities"]):
        # later runs of a config may skip the dense warm-up step (--plan headline: time); their dense steps are
        # then extrapolated with the patched dense step of the first run of this configuration
        w = args.patched_warmup if i == 0 else cfg.get("later_warmup", args.patched_warmup)
        kwargs = {"preset": "custom", "density": density, "dense_warmup": str(w), "anchor_steps": str(w + 1),
                  "warmup_layers": args.warmup_layers, "query_tile": args.query_tile,
                  "cache_placement": args.cache_placement, "backend": args.backend, "min_tokens": args.min_tokens}
        runs.append((f"density {density:g}", kwargs, args.steps - (args.patched_warmup - w),
                     {**kwargs, "dense_warmup": PAPER["dense_warmup"], "anchor_steps": PAPER["anchor_steps"]}))
    presets = cfg["presets"] if isinstance(cfg["presets"], list) else (["fast"] if cfg["presets"] else [])
    for preset in presets:
        kwargs = {"preset": preset, "min_tokens": args.min_tokens}  # every other input at the node default
        runs.append((f"preset {preset}", kwargs, args.preset_steps, kwargs))
    for label, kwargs, steps, kwargs50 in runs:
        if args.budget_s and time.perf_counter() - T0 > args.budget_s:
            entry["runs"].append({"label": label, "skipped": f"time budget {args.budget_s:.0f} s spent"})
            print(f"[{label}] skipped: budget spent", flush=True)
            continue
        t0 = time.perf_counter()
        try:
            s50 = env.settings.build_settings(**{**_node_defaults(), **kwargs50})
            r = run_patched(env, base, label=label, apply_kwargs=kwargs, steps=steps, args=args, shape=shape,
                            device=device, dtype=dtype, spec=spec)
            first = next((q for q in entry["runs"] if q.get("step_s_by_kind", {}).get("dense")), None)
            r["extrapolation"] = x = extrapolate(env, dense, r, settings_50=s50, layers=spec["num_layers"],
                                                 patched_dense=first)
            if cfg.get("glue") and kwargs.get("preset") == "quality":
                try:
                    r["glue"] = g = glue_ratio(env, r, spec=spec, tokens=tokens_of(shape), device=device, dtype=dtype)
                    if g:
                        print(f"[{label}] glue ratio {g['ratio']:.3f}: " + "; ".join(
                            f"B={b}: override call {v['override_call_ms']:.2f} ms vs bare kernel "
                            f"{v['bare_kernel_ms']:.2f} ms" for b, v in g["per_batch"].items()), flush=True)
                except Exception as err:
                    r["glue_error"] = f"{type(err).__name__}: {err}"
                    traceback.print_exc()
            bar = BARS.get((model, res), {}).get(s50.density) if kwargs.get("preset") == "custom" else None
            x["bars"] = {"speedup_bar": bar, "speedup_met": None if bar is None else x["speedup"] >= bar,
                         "ratio_bar": BAR_RATIO, "ratio_met": x["achieved_over_ideal"] >= BAR_RATIO}
            entry["runs"].append(r)
            _print_run(r)
        except Exception as err:
            entry["runs"].append({"label": label, **_failure(label, err, device)})
        print(f"[{label}] {time.perf_counter() - t0:.1f} s wall", flush=True)
        save()
    extras = []  # (entry key, label, fn): the peer, the CPU-cache/split hit rate, whole runs
    if cfg.get("peer"):
        extras.append(("peer", "peer", lambda: run_peer(env, base, dense=dense, args=args, shape=shape, device=device)))
    if cfg.get("cpu_split"):
        extras.append(("runs", "cpu split", lambda: run_cpu_split(env, base, args=args, shape=shape, device=device,
                                                                  dtype=dtype, spec=spec, density=cfg["cpu_split"])))
    if cfg.get("whole"):
        preset, n = cfg["whole"]
        extras.append(("whole", "whole run", lambda: run_whole(env, base, preset=preset, args=args, shape=shape,
                                                               device=device, steps=n, dense=dense, spec=spec,
                                                               dtype=dtype)))
    if cfg.get("profile"):
        preset, n = cfg["profile"]
        extras.append(("profile", "profile", lambda: run_profile(env, base, preset=preset, args=args, shape=shape,
                                                                 device=device, steps=n, dense=dense, spec=spec,
                                                                 dtype=dtype)))
    for slot, label, fn in extras:
        if args.budget_s and time.perf_counter() - T0 > args.budget_s:
            skip = {"stage": label, "skipped": f"time budget {args.budget_s:.0f} s spent"}
            entry.setdefault("skipped", []).append(skip)
            print(f"[{label}] skipped: budget spent", flush=True)
            continue
        t0 = time.perf_counter()
        try:
            r = fn()
            if slot == "runs":
                entry["runs"].append(r)
            else:
                entry[slot] = r
        except Exception as err:
            entry["errors"].append({"stage": label, **_failure(label, err, device)})
        print(f"[{label}] {time.perf_counter() - t0:.1f} s wall", flush=True)
        save()
    base = None
    _free(env, device)


def _free(env: Env, device: torch.device) -> None:
    """Unload ComfyUI's models and free cached allocations before the next configuration (the caller has dropped
    its own reference to the model)."""
    try:
        env.mm.unload_all_models()
        env.mm.cleanup_models_gc()
    except Exception as err:  # freeing must not stop the benchmark
        print(f"note: ComfyUI unload failed: {err}", flush=True)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        print(f"freed: {torch.cuda.memory_allocated(device) / 2**30:.2f} GiB still allocated", flush=True)


def _failure(label: str, err: BaseException, device: torch.device | None = None) -> dict:
    """A failed stage (inside its ``except``): printed with its traceback, the CUDA cache emptied (``device``), and
    returned as the report's fields {"error", "traceback" (its last 3000 characters)}."""
    print(f"[{label}] FAILED: {type(err).__name__}: {err}", flush=True)
    traceback.print_exc()
    if device is not None and device.type == "cuda":
        torch.cuda.empty_cache()
    return {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-3000:]}


def _print_run(r: dict) -> None:
    x = r["extrapolation"]
    steps = " ".join(f"{row['kind'][0].upper()}:{row['wall_s']:.3f}" for row in r["per_step"] if "kind" in row)
    print(f"[{r['label']}] timed {r['timed_schedule']['kinds']} ({r['schedule_check']}): {steps} s; "
          f"kernels prewarm {r['prewarm_s']:.1f} s; finite={r['finite']}", flush=True)
    print(f"  {x['method']}", flush=True)
    print(f"  50 steps: dense {x['total_dense_s']:.1f} s, MC-Sparse {x['total_mc_sparse_s']:.1f} s -> "
          f"{x['speedup']:.3f}x; ideal {x['ideal']['speedup']:.3f}x (eff 0.97: {x['ideal_at_eff']['speedup']:.3f}x); "
          f"achieved/ideal {x['achieved_over_ideal']:.3f}; limiting part: {x['limiting_part']}", flush=True)
    cache = r.get("cache") or {}
    if cache:
        print(f"  cache peak {fmt_bytes(cache['peak_bytes'])} (GPU {fmt_bytes(cache['peak_gpu_bytes'])}, CPU "
              f"{fmt_bytes(cache['peak_host_bytes'])}); loads {cache['prefetched_loads']} prefetched, "
              f"{cache['inline_loads']} in line" + (f"; est. transfer {r['transfer_s_per_reuse_step_est']:.3f} s per "
                                                     "reuse step" if r.get("transfer_s_per_reuse_step_est") else ""),
              flush=True)
    first = (r.get("run_summary") or "").splitlines()[:1]
    if first:
        print(f"  {first[0]}", flush=True)
    if r.get("run_kernels"):
        print(f"  kernels: {r['run_kernels']['line']}", flush=True)


# ---------------------------------------------------------------------------------------------------------------
# Table
# ---------------------------------------------------------------------------------------------------------------

def fmt_bytes(n: int | float | None) -> str:
    if not n:
        return "0"
    return f"{n / 2**30:.2f} GiB" if n >= 2**29 else f"{n / 2**20:.1f} MiB"


def table(report: dict) -> str:
    n = PAPER["steps"]
    lines = [f"| model | res | tokens | run | dense step s (self-attn %) | anchor s | reuse s | {n} steps dense s | "
             f"{n} steps MC-Sparse s | speedup | ideal (eff 1 / 0.97) | achieved/ideal | bars | limiting part | "
             "cache peak (on CPU) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in report["configs"]:
        d = c.get("dense")
        head = f"| {c['model']} | {c['res']} | {c['tokens']} "
        if not d:
            if c.get("errors") or not c.get("skipped"):
                err = c["errors"][0]["error"] if c.get("errors") else "not run"
                lines.append(head + f"| FAILED: {err[:80]} | | | | | | | | | | | |")
            else:
                lines.append(head + f"| skipped: {c['skipped'][0]['skipped'][:80]} | | | | | | | | | | | |")
            continue
        for e in c.get("errors") or []:
            lines.append(head + f"| {e.get('stage', 'config')} FAILED: {e['error'][:80]} | | | | | | | | | | | |")
        for e in c.get("skipped") or []:
            lines.append(head + f"| {e['stage']} skipped: {e['skipped'][:80]} | | | | | | | | | | | |")
        for r in c["runs"]:
            if "extrapolation" not in r:
                why = r.get("error") or r.get("skipped") or (
                    f"prefetch hit rate {r['prefetch_hit_rate']:.4f}" if r.get("prefetch_hit_rate") is not None else "?")
                lines.append(head + f"| {r['label']}: {why[:80]} | | | | | | | | | | | |")
                continue
            x = r["extrapolation"]
            cache = r.get("cache") or {}
            b = x.get("bars") or {}
            bars = []
            if b.get("speedup_bar") is not None:
                bars.append(f">= {b['speedup_bar']:.2f}x {'met' if b['speedup_met'] else 'NOT met'}")
            if b.get("ratio_bar") is not None:
                bars.append(f"ratio >= {b['ratio_bar']:.2f} {'met' if b['ratio_met'] else 'NOT met'}")
            lines.append(
                head + f"| {r['label']} | {d['dense_step_s']:.3f} ({100 * d['self_attn_share']:.0f}%) | "
                f"{x['anchor_step_s']:.3f} | {x['reuse_step_s']:.3f} | {x['total_dense_s']:.1f} | "
                f"{x['total_mc_sparse_s']:.1f} | **{x['speedup']:.3f}x** | {x['ideal']['speedup']:.3f} / "
                f"{x['ideal_at_eff']['speedup']:.3f} | {x['achieved_over_ideal']:.3f} | {'; '.join(bars)} | "
                f"{x['limiting_part']} | {fmt_bytes(cache.get('peak_bytes'))} ({fmt_bytes(cache.get('peak_host_bytes'))}) |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------

T0 = time.perf_counter()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--comfyui", default=os.environ.get("COMFYUI_DIR", ""), help="ComfyUI checkout ($COMFYUI_DIR)")
    ap.add_argument("--plan", choices=["single", "headline", "headline-smoke", "h720", "h480", "h720-smoke",
                                       "h480-smoke", "w13", "w13-smoke"], default="single",
                    help="single: --model/--res/--densities; headline: wan14b 720p (0.25, 0.15, fast preset), "
                         "wan14b 480p and wan1.3b 480p (0.25); h720: wan14b 720p presets quality and fast, glue "
                         "ratio, the Sol-Attn peer, prefetch hit rate (CPU cache, CFG split); h480: wan14b 480p "
                         "quality, wan1.3b 480p 'fast' whole 50-step runs; w13: the wan1.3b 480p whole runs only; "
                         "*-smoke: the same with tiny models")
    ap.add_argument("--model", choices=list(MODELS), default="tiny")
    ap.add_argument("--res", choices=list(RESOLUTIONS), default="tiny")
    ap.add_argument("--frames", type=int, default=81)
    ap.add_argument("--densities", type=float, nargs="+", default=[0.25, 0.15])
    ap.add_argument("--steps", type=int, default=4, help="timed steps per patched run (>= warm-up + 3)")
    ap.add_argument("--patched-warmup", type=int, default=1, help="dense warm-up steps of the timed patched run")
    ap.add_argument("--dense-steps", type=int, default=2, help="timed steps of the unpatched run")
    ap.add_argument("--schedule-steps", type=int, default=50, help="the paper's schedule length (extrapolation)")
    ap.add_argument("--presets", nargs="*", choices=list(PRESETS), default=None,
                    help="--plan single: also time these node presets (no name: 'fast'); another --plan: time only "
                         "these presets in each of its configurations (no density runs, glue ratio, peer, CPU split "
                         "or whole runs), e.g. --plan h720 --presets fast")
    ap.add_argument("--preset-steps", type=int, default=4, help="steps of the fast-preset run (4: A A R R)")
    ap.add_argument("--warmup-layers", type=int, default=0, help="dense blocks in the density runs (paper: 0)")
    ap.add_argument("--query-tile", type=int, default=128)
    ap.add_argument("--cache-placement", default="auto", choices=["auto", "gpu", "cpu"])
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--kernels", choices=["installed", "triton-only"], default="installed",
                    help="installed: every kernel backend this Python can import; triton-only: the default kernels "
                         "a user has (no CUTLASS DSL / flash-attn-4): the cutedsl and flash_attn4 backends are "
                         "turned off even when importable, so the figure is repeatable whatever is installed")
    ap.add_argument("--profile-reuse", action="store_true",
                    help="per configuration of the plan only run_profile: the 'fast' preset on 8 steps, 4 runs "
                         "(stacked residual copies, views, views + kept decoded groups, copies), torch.profiler traces of an unpatched, the "
                         "anchor and a reuse step (gzipped next to --out), e.g. --plan w13 --profile-reuse (~100 s)")
    ap.add_argument("--min-tokens", type=int, default=None, help="node input (default 2048; 0 for --res tiny)")
    ap.add_argument("--sampler", default="euler", choices=["euler", "uni_pc"])
    ap.add_argument("--scheduler", default="simple")
    ap.add_argument("--cfg", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--whole-repeat", type=int, default=1,
                    help="whole-run pairs (unpatched + patched) to time; pairs after the first alternate their order; "
                         "the figure is mean unpatched / mean patched and the per-pair spread is printed (each pair "
                         "adds ~100 s at 1.3B 480p)")
    ap.add_argument("--budget-s", type=float, default=0.0, help="skip remaining runs after this many seconds (0: none)")
    ap.add_argument("--out", default="bench_comfyui_speedup.json")
    ap.add_argument("--scoreboard", default="", help="also update these scoreboard keys in this JSON file "
                    "(docs/results/scoreboard.json); the keys alone always go to <out>.scoreboard.json")
    ap.add_argument("--commit", default="", help="commit measured (default: git rev-parse --short HEAD, if any)")
    ap.add_argument("--peer-fake", action="store_true", help="smoke runs: the peer with a dense stand-in kernel")
    ap.add_argument("--merge", nargs="+", metavar="KEYS_JSON", help="only merge these <out>.scoreboard.json files "
                    "(from GPU runs) into --scoreboard (default docs/results/scoreboard.json) and exit")
    args = ap.parse_args()
    if args.merge:
        target = Path(args.scoreboard or _scoreboard.BOARD)
        return _scoreboard.main(["merge", *args.merge, "--board", str(target)])
    PAPER["steps"] = args.schedule_steps
    if not args.comfyui:
        ap.error("--comfyui or COMFYUI_DIR must name a ComfyUI checkout")
    if args.steps < args.patched_warmup + 3:
        ap.error(f"--steps must be >= --patched-warmup + 3 (dense, anchor, 2 reuse), got {args.steps}")
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]

    if args.plan == "headline":
        plan = [dict(c) for c in HEADLINE]
    elif args.plan == "headline-smoke":
        plan = [dict(c, model="tiny", res="tiny") for c in HEADLINE]
    elif args.plan in ("h720", "h480"):
        plan = [dict(c) for c in (H720 if args.plan == "h720" else H480)]
    elif args.plan == "w13":
        plan = [dict(c) for c in W13]
    elif args.plan in ("h720-smoke", "h480-smoke", "w13-smoke"):
        plan = [dict(c, model="tiny", res="tiny") for c in
                {"h720-smoke": H720, "h480-smoke": H480, "w13-smoke": W13}[args.plan]]
        plan = [dict(c, whole=(c["whole"][0], 4)) if c.get("whole") else c for c in plan]
    else:
        plan = [{"model": args.model, "res": args.res, "densities": args.densities,
                 "presets": (args.presets or ["fast"]) if args.presets is not None else []}]
    if args.presets is not None and args.plan != "single":
        plan = only_presets(plan, args.presets or ["fast"])
    if args.profile_reuse:  # each configuration: the profile of the 'fast' preset's reuse steps only
        smoke = all(c["res"] == "tiny" for c in plan)
        plan = [{"model": c["model"], "res": c["res"], "densities": [], "presets": [],
                 "profile": ("fast", 6 if smoke else 8)} for c in plan]
    if args.min_tokens is None:
        args.min_tokens = 0 if all(c["res"] == "tiny" for c in plan) else 2048

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    env = setup(args.comfyui, device.type)
    if args.kernels == "triton-only":
        triton_only(env)
    if device.type == "cuda" and device.index is None:
        device = env.mm.get_torch_device()  # cuda:N, the device object ComfyUI compares against
    if args.schedule_steps != 50:
        warm, anchors = env.schedule.paper_video_schedule(args.schedule_steps)
        PAPER.update(dense_warmup=str(warm), anchor_steps=", ".join(str(a + 1) for a in anchors))
    est = _estimate(env, plan, args)
    if est:
        print(f"estimated H200 time of the timed sampling of this plan: ~{est:.0f} s (+ import, model builds, "
              "kernel compilation)", flush=True)
    report = {"argv": sys.argv, "args": vars(args), "plan": plan, "host": platform.node(),
              "python": platform.python_version(), "torch": torch.__version__, "comfyui": env.comfy_root,
              "config_class": env.config_source, "pack_load": env.pack_load, "stubbed_modules": env.stubbed,
              "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
              "kernel_backends": [f"{b.name}{' (unavailable: ' + b.unavailable_reason + ')' if b.unavailable_reason else ''}"
                                  for b in env.kernels.registry.backends()],
              "extrapolation": (f"per step kind: unpatched run of {args.dense_steps} steps (dense step = median of steps "
                                f"2..); patched runs of {args.steps} steps (dense {args.patched_warmup}, anchor at step "
                                f"{args.patched_warmup + 1}, rest reuse) and the fast preset on {args.preset_steps} "
                                f"steps; {args.schedule_steps}-step totals = sum over the paper's schedule of the "
                                "measured time of each step kind"),
              "configs": []}
    out = Path(args.out)

    commit = _scoreboard.measured_commit(args.commit)
    command = " ".join(["python3", "tests/bench_comfyui_speedup.py"] + [a for a in sys.argv[1:]])
    gpu = report["gpu"]

    def save():
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1, default=str))
        try:  # the scoreboard keys measured so far (a killed run keeps them)
            entries = scoreboard_entries(report, command=command, commit=commit, gpu=gpu)
            report["scoreboard"] = entries
            _scoreboard.update(entries, out.with_suffix(".scoreboard.json"), args.scoreboard or None, say=False)
        except Exception as err:  # the measurement JSON above is what matters
            print(f"note: scoreboard not written: {type(err).__name__}: {err}", flush=True)

    print(f"ComfyUI {env.comfy_root} imported ({env.config_source}); pack: {env.pack_load}; "
          f"kernel backends: {', '.join(report['kernel_backends'])}", flush=True)
    for cfg in plan:
        if args.budget_s and time.perf_counter() - T0 > args.budget_s:
            report["configs"].append({**cfg, "tokens": "", "errors": [], "runs": [],
                                      "skipped": [{"stage": "config", "skipped": "time budget spent"}]})
            continue
        try:
            run_config(env, cfg, args, device, dtype, report, save)
        except Exception as err:  # run_config records its own errors; this is for a bug between its stages
            failed = {"stage": "config", "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
            if report["configs"] and report["configs"][-1].get("model") == cfg["model"] and \
                    report["configs"][-1].get("res") == cfg["res"]:
                report["configs"][-1]["errors"].append(failed)
            else:
                report["configs"].append({**cfg, "tokens": "", "runs": [], "errors": [failed]})
            traceback.print_exc()
        save()
    report["wall_s"] = time.perf_counter() - T0
    report["table"] = table(report)
    save()
    print(f"\nMC-Sparse DiT denoising speedup, {args.schedule_steps}-step paper schedule (extrapolated per step kind, "
          f"see {out}); wall {report['wall_s']:.0f} s\n")
    print(report["table"], flush=True)
    return exit_status(report)


def exit_status(report: dict) -> int:
    """The script's exit status: 1 when a stage failed (a config's error, a run's error, or a run with no result:
    neither an extrapolation nor the CPU split's hit rate), else 0. Rows the time budget (``--budget-s``) skipped do
    not fail it: the budget is the caller's choice (the rounds' e2e leaves the optional peer / CPU-split rows to it);
    each skipped row is named in the table and in the line printed here. (Before: any skip, and the CPU-split row
    even when it ran, made the script exit 1.)"""
    skipped = [f"{c['model']} {c['res']} {r.get('label') or r.get('stage')}" for c in report["configs"]
               for r in [*c.get("runs", []), *c.get("skipped", [])] if r.get("skipped")]
    if skipped:
        print(f"skipped by the time budget (not failures): {'; '.join(skipped)}", flush=True)
    measured = ("extrapolation", "skipped", "prefetch_hit_rate")
    failed = any(r.get("error") or not any(key in r for key in measured) for c in report["configs"]
                 for r in c.get("runs", [])) or any(c.get("errors") for c in report["configs"])
    return 1 if failed else 0


def _estimate(env: Env, plan: list[dict], args) -> float:
    """Rough H200 seconds of the timed sampling of ``plan`` (EST_DENSE_STEP_S; 0 when a config has no estimate)."""
    total = 0.0
    for c in plan:
        d = EST_DENSE_STEP_S.get((c["model"], c["res"]))
        if d is None:
            return 0.0
        att = {"720p": 0.68, "480p": 0.5}.get(c["res"], 0.5)
        total += args.dense_steps * d
        runs = []
        for i, s in enumerate(c["densities"]):
            w = args.patched_warmup if i == 0 else c.get("later_warmup", args.patched_warmup)
            runs.append((s, args.steps - (args.patched_warmup - w),
                         {"preset": "custom", "density": s, "dense_warmup": str(w), "anchor_steps": str(w + 1)}))
        presets = c["presets"] if isinstance(c["presets"], list) else (["fast"] if c["presets"] else [])
        for preset in presets:
            runs.append(({"quality": 0.25, "balanced": 0.2}.get(preset, 0.15), args.preset_steps, {"preset": preset}))
        for s, steps, kw in runs:
            sc = schedule_counts(env, env.settings.build_settings(**{**_node_defaults(), **kw}), steps, 1)
            total += sc["dense"] * d + sc["anchor"] * d * (1 + att * (0.5 + s / 0.9)) + \
                sc["reuse"] * d * (1 - att + att * s / 0.9)
    return total


if __name__ == "__main__":
    sys.exit(main())
