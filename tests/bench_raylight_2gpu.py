"""MC-Sparse through raylight's Wan path on 2 GPUs (Ulysses degree 2) vs one GPU, same run (issue 12).
A benchmark, not a test (not collected). NOT YET RUN: prepared on CPU; needs 2 GPUs, ray is not needed.

Phase 1 (one process, GPU 0; ``bench_comfyui_speedup``'s model and timed sampling): Wan2.1 T2V random bf16 weights
(seeded), ComfyUI's own sampling (``comfy.sample.sample``, euler/simple, ``--cfg``), unpatched dense and the
MC-Sparse Patch node's function (``apply_mc_sparse``) at ``--density``.
Phase 2 (two processes, NCCL, one per GPU; what raylight's Ray actor does at start-up, without Ray):
``raylight.distributed_worker.parallel_group_manager.initialize_xfuser_parallel`` (Ulysses 2, ring 1, attention
``--attention``), the same model and weights, raylight's USP injection as an ON_LOAD callback (``RayWorker.patch_usp``:
``usp_dit_forward``, ``usp_self_attn_forward``, xDiT attention with the inner-attention dispatcher), then: dense;
``apply_mc_sparse_raylight`` (what the MC-Sparse Patch (Ray) node runs in each actor) at density 1.0 and ``--density``.
Schedule of every patched run: custom, dense warm-up 1 step with its anchor, the remaining ``--steps`` - 1 reuse.

Reported (``--out``/raylight_2gpu.json, printed side by side):
* fidelity: relative L2 of final latents: 2-GPU dense vs 1-GPU dense (the bf16 noise of the split), 2-GPU MC-Sparse
  1.0 vs 1-GPU dense, 2-GPU MC-Sparse ``--density`` vs 1-GPU MC-Sparse same density; pass = within
  max(3 x noise, 0.02);
* speed: mean reuse-step time; speedup = dense step / reuse step on 1 GPU and on 2 GPUs, and their ratio ->
  ``multigpu_2gpu_speedup_ratio`` in ``--scoreboard`` (bar >= 0.95). Whole-call times are in the JSON too.

Needs (the lead carries them): ``.comfyui`` (ComfyUI), ``.raylight`` (a raylight checkout WITH
``src/raylight/distributed_modules/inner_attention/`` and the dispatcher in ``attention.py``: komikndr/raylight at or
after 55ea37b), and xfuser 0.7.0 + yunchang 0.6.4 installed (``tests/pack_raylight_wheels.sh``). Usage:
    COMFYUI_DIR=.comfyui RAYLIGHT_DIR=.raylight python tests/bench_raylight_2gpu.py --out $OUT
    (~6 min on 2 H200; --smoke: Wan 1.3B 480p 33 frames, ~1.5 min, to check the plumbing first)
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
import _scoreboard  # noqa: E402

BAR = 0.95


def _speedup_bench():
    """``tests/bench_comfyui_speedup.py`` as a module (model building and timed sampling are shared)."""
    spec = importlib.util.spec_from_file_location("bench_comfyui_speedup", ROOT / "tests" / "bench_comfyui_speedup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _settings(density: float) -> dict:
    return dict(preset="custom", density=density, dense_warmup="1", warmup_layers=0, anchor_steps="1", query_tile=128,
                cache_placement="gpu", backend="auto", min_tokens=0, verbose=False)


def _sample(bench, env, patcher, args, shape, device):
    """Timed sampling (``bench_comfyui_speedup.timed_sample``) that also keeps the final latent."""
    captured = {}
    real = env.sample.sample

    class Capture:
        def __getattr__(self, name):
            return getattr(env.sample, name)

        @staticmethod
        def sample(*a, **kw):
            captured["out"] = real(*a, **kw)
            return captured["out"]

    saved, env.sample = env.sample, Capture()
    try:
        rec = bench.timed_sample(env, patcher, steps=args.steps, shape=shape, cfg=args.cfg, sampler="euler",
                                 scheduler="simple", seed=args.seed, device=device)
    finally:
        env.sample = saved
    run = rec.pop("run", None)
    rec = {k: v for k, v in rec.items() if k in ("step_s", "call_s", "finite", "latent_std", "load_s")}
    if run is not None:
        rec["counts"] = run.counts()
    return rec, captured["out"].float().cpu()


def _reuse_step_s(rec: dict) -> float | None:
    """Mean of the steps after the first (the dense/anchor step): the reuse steps of the patched runs."""
    steps = rec.get("step_s") or []
    return sum(steps[1:]) / len(steps[1:]) if len(steps) > 1 else None


def phase_one_gpu(args, out_dir: Path) -> None:
    """GPU 0 alone: dense and MC-Sparse (one-GPU node path)."""
    os.environ["CUDA_VISIBLE_DEVICES"] = "0"  # before CUDA starts in this process
    bench = _speedup_bench()
    device = torch.device("cuda", 0)
    env = bench.setup(args.comfyui, "cuda")
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter.lifecycle import apply_mc_sparse  # loaded by setup

    patcher, info = bench.build_model(env, args.model, device, torch.bfloat16, args.seed)
    shape = bench.latent_shape(args.res, args.frames)
    result = {"model": info, "runs": {}}
    for label, density in (("dense", None), (f"mc{args.density:g}", args.density)):
        try:
            model = patcher if density is None else apply_mc_sparse(patcher, **_settings(density))
            rec, latent = _sample(bench, env, model, args, shape, device)
            torch.save(latent, out_dir / f"gpu1_{label}.pt")
            result["runs"][label] = rec
        except Exception:
            result["runs"][label] = {"error": traceback.format_exc()}
        (out_dir / "gpu1.json").write_text(json.dumps(result, indent=2, default=str))


def phase_two_gpu(rank: int, args, out_dir: Path) -> None:
    """One of two Ulysses ranks, as raylight's actor sets itself up (without Ray)."""
    os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)  # one GPU per process, as raylight's RayWorker does
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    torch.distributed.init_process_group("nccl", rank=rank, world_size=2, timeout=datetime.timedelta(minutes=5),
                                         init_method=f"tcp://127.0.0.1:{args.port}")
    bench = _speedup_bench()
    env = bench.setup(args.comfyui, "cuda")  # ComfyUI first: raylight imports comfy
    sys.path.insert(0, str(Path(args.raylight) / "src"))
    import raylight  # noqa: F401  (installs raylight's xfuser import shim)
    from raylight.distributed_worker.parallel_group_manager import initialize_xfuser_parallel

    initialize_xfuser_parallel(rank, 2, {"ulysses_degree": 2, "ring_degree": 1, "cfg_degree": 1, "pp_degree": 1,
                                         "is_xdit": True, "attention": args.attention, "sync_ulysses": False})
    from raylight.distributed_modules.usp import USPInjectRegistry

    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter.raylight import apply_mc_sparse_raylight

    patcher, info = bench.build_model(env, args.model, device, torch.bfloat16, args.seed)
    patcher.add_callback(env.pe.CallbacksMP.ON_LOAD, USPInjectRegistry.inject)
    shape = bench.latent_shape(args.res, args.frames)
    result = {"model": info, "runs": {}}
    for label, density in (("dense", None), ("mc1", 1.0), (f"mc{args.density:g}", args.density)):
        try:
            model = patcher if density is None else apply_mc_sparse_raylight(patcher, **_settings(density))
            rec, latent = _sample(bench, env, model, args, shape, device)
            if rank == 0:
                torch.save(latent, out_dir / f"gpu2_{label}.pt")
            result["runs"][label] = rec
        except Exception:
            result["runs"][label] = {"error": traceback.format_exc()}
        torch.distributed.barrier()
        if rank == 0:
            (out_dir / "gpu2.json").write_text(json.dumps(result, indent=2, default=str))
    torch.distributed.destroy_process_group()


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def report(args, out_dir: Path) -> dict:
    """Fidelity and speed from both phases' files; updates the scoreboard (2 GPUs really ran)."""
    one = json.loads((out_dir / "gpu1.json").read_text())
    two = json.loads((out_dir / "gpu2.json").read_text())
    mc = f"mc{args.density:g}"

    def load(name):
        path = out_dir / f"{name}.pt"
        return torch.load(path) if path.is_file() else None

    lat = {n: load(n) for n in ("gpu1_dense", f"gpu1_{mc}", "gpu2_dense", "gpu2_mc1", f"gpu2_{mc}")}
    fid = {}
    if lat["gpu1_dense"] is not None and lat["gpu2_dense"] is not None:
        noise = rel_l2(lat["gpu2_dense"], lat["gpu1_dense"])
        bound = max(3 * noise, 0.02)
        fid = {"noise_2gpu_dense_vs_1gpu_dense": noise, "bound": bound}
        if lat["gpu2_mc1"] is not None:
            fid["mc1_2gpu_vs_1gpu_dense"] = rel_l2(lat["gpu2_mc1"], lat["gpu1_dense"])
        if lat[f"gpu2_{mc}"] is not None and lat[f"gpu1_{mc}"] is not None:
            fid[f"{mc}_2gpu_vs_1gpu_{mc}"] = rel_l2(lat[f"gpu2_{mc}"], lat[f"gpu1_{mc}"])
            fid[f"{mc}_1gpu_vs_1gpu_dense"] = rel_l2(lat[f"gpu1_{mc}"], lat["gpu1_dense"])
        fid["pass"] = all(v <= bound for k, v in fid.items() if k.startswith("mc") and "_2gpu_vs_" in k)
    speed = {}
    for name, runs in (("gpu1", one["runs"]), ("gpu2", two["runs"])):
        d, s = _reuse_step_s(runs.get("dense", {})), _reuse_step_s(runs.get(mc, {}))
        speed[name] = {"dense_step_s": d, "reuse_step_s": s, "speedup": d / s if d and s else None,
                       "dense_call_s": runs.get("dense", {}).get("call_s"), "mc_call_s": runs.get(mc, {}).get("call_s"),
                       "mc_counts": runs.get(mc, {}).get("counts")}
    s1, s2 = speed["gpu1"]["speedup"], speed["gpu2"]["speedup"]
    ratio = s2 / s1 if s1 and s2 else None
    result = {"fidelity": fid, "speed": speed, "multigpu_2gpu_speedup_ratio": ratio, "bar": BAR,
              "errors": {f"{p}/{k}": r["error"] for p, js in (("gpu1", one), ("gpu2", two))
                         for k, r in js["runs"].items() if "error" in r}}
    (out_dir / "raylight_2gpu.json").write_text(json.dumps(result, indent=2, default=str))
    print(json.dumps({k: v for k, v in result.items() if k != "errors"}, indent=2, default=str))
    for where, err in result["errors"].items():
        print(f"ERROR {where}:\n{err}")
    if ratio is not None and not args.smoke:
        write_scoreboard(args, out_dir, ratio, speed, fid)
    return result


def write_scoreboard(args, out_dir: Path, ratio: float, speed: dict, fid: dict) -> None:
    _scoreboard.update({"multigpu_2gpu_speedup_ratio": _scoreboard.entry(
        ratio, "ratio", digits=3, gpu=f"2x {torch.cuda.get_device_name(0)}",
        command="COMFYUI_DIR=.comfyui RAYLIGHT_DIR=.raylight python tests/bench_raylight_2gpu.py --out $OUT",
        commit=_scoreboard.measured_commit(),
        note=(f"Wan2.1 {args.model} {args.res} {args.frames} frames, random bf16 weights, raylight Wan USP path, "
              f"Ulysses 2 / ring 1, attention {args.attention}, cfg {args.cfg}, density {args.density:g}; mean "
              f"reuse-step time: 1-GPU speedup {speed['gpu1']['speedup']:.3f}x, 2-GPU {speed['gpu2']['speedup']:.3f}x; "
              f"fidelity (rel L2) {json.dumps({k: round(v, 4) for k, v in fid.items() if isinstance(v, float)})}"))},
        out_dir / "scoreboard.json", args.scoreboard)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--comfyui", default=os.environ.get("COMFYUI_DIR", ""))
    ap.add_argument("--raylight", default=os.environ.get("RAYLIGHT_DIR", ""))
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="wan14b")
    ap.add_argument("--res", default="720p")
    ap.add_argument("--frames", type=int, default=81)
    ap.add_argument("--steps", type=int, default=4, help="1 dense+anchor step, then reuse steps")
    ap.add_argument("--density", type=float, default=0.25)
    ap.add_argument("--cfg", type=float, default=1.0, help="1.0: one branch per step (halves the run time)")
    ap.add_argument("--attention", default="TORCH_CUDNN",
                    help="yunchang AttnType member name for xDiT dense attention (TORCH_CUDNN, TORCH_FLASH, FA3, ...)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--port", type=int, default=29531)
    ap.add_argument("--smoke", action="store_true", help="Wan 1.3B 480p 33 frames; no scoreboard update")
    ap.add_argument("--scoreboard", default=str(_scoreboard.BOARD))
    ap.add_argument("--phase", choices=["all", "one", "two", "report"], default="all")
    args = ap.parse_args()
    if args.smoke:
        args.model, args.res, args.frames = "wan1.3b", "480p", 33
    if not args.comfyui or not args.raylight:
        ap.error("--comfyui / COMFYUI_DIR and --raylight / RAYLIGHT_DIR are required")
    if torch.cuda.device_count() < 2 and args.phase in ("all", "two"):
        print("needs 2 GPUs; found", torch.cuda.device_count())
        return 2
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    ctx = torch.multiprocessing.get_context("spawn")
    if args.phase in ("all", "one"):
        p = ctx.Process(target=phase_one_gpu, args=(args, out_dir))
        p.start()
        p.join()
        print(f"phase 1 (1 GPU) done in {time.perf_counter() - t0:.0f} s, exit {p.exitcode}")
    if args.phase in ("all", "two"):
        torch.multiprocessing.start_processes(phase_two_gpu, args=(args, out_dir), nprocs=2, join=True,
                                              start_method="spawn")
        print(f"phase 2 (2 GPUs) done at {time.perf_counter() - t0:.0f} s")
    if args.phase in ("all", "report"):
        result = report(args, out_dir)
        ratio = result["multigpu_2gpu_speedup_ratio"]
        return 0 if ratio is not None and result["fidelity"].get("pass") else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
