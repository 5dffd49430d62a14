"""``python -m comfyui_mc_sparse demo``: MC-Sparse against dense and block-sparse baselines on a synthetic
DiT-like workload, as one table (MC-Sparse, arXiv 2610.06801: the sec. 2 diagnostics over the sec. 4 schedule).

The demo runs a whole sampling schedule (``schedule.paper_video_schedule`` scaled to ``--steps``: dense
warm-up, anchor steps, reuse steps) over ``workload.SyntheticWorkload`` through ``engine.MCSparseRunner``,
one runner per density, and at every reuse step (the steps where a sparse method changes the output)
scores against that step's dense attention:

- dense: ``kernels.dense_attention`` (density 1, recall 1, relative L1 0; its time is the baseline);
- vanilla BSA: mean-pooled block scores recomputed at the step (``diagnostics.vanilla_bsa``);
- Sol-Attn (comfy-kitchen): ComfyUI core's method through the real library, at the block budget whose
  realized density is nearest the target (``diagnostics.sol_attn``);
- MC-Sparse without residual: the anchor's cached groups and KV indices over the step's own q, k, v;
- MC-Sparse: the runner's output (the same plus the cached residual).

Columns per density: realized density (kept query-key pairs / S^2), recall (kept exact mass), relative
L1 against dense, attention time in ms (mean per call). Metrics are averaged over reuse steps and layers.
Progress goes to stderr, the table to stdout, ``--json`` writes every number.

``probe --captured FILE`` prints the MC-Sparse Probe's table from a capture file (``capture.run_probe``).

``comfyui`` (alias ``comfyui-demo``) runs the shipped Wan workflow headless in a ComfyUI checkout
(``tools.headless.run_headless_demo``) when that module is present.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import math
import os
import platform
import sys
import time
from collections import defaultdict

import torch

from ... import kernels
from .. import schedule
from ..cache import CacheEntry, CacheKey
from ..config import GROUP_SIZES, HEAD_DIMS, MCSparseConfig
from ..engine import MCSparseRunner
from ..schedule import StepKind
from . import capture as probe_capture
from . import diagnostics, workload

logger = logging.getLogger(__name__)

ROWS = ("dense", "vanilla BSA", "Sol-Attn (comfy-kitchen)", "MC-Sparse w/o residual", "MC-Sparse")
"""Table rows, in order."""

QUICK = {"size": "small", "heads": 2, "steps": 8, "layers": 1}
"""``--quick``: S = 2048, 2 heads, 8 steps (5 reuse steps), one layer; well under 2 minutes on 2 CPU cores."""

DEFAULTS = {"size": "small", "heads": 4, "steps": 20, "layers": 1}
"""Embedded defaults of ``demo``: S = 2048 tokens (8 x 16 x 16), 4 heads of 128, 20 steps (15 reuse steps)."""


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m comfyui_mc_sparse`` argument parser (subcommands ``demo`` and ``comfyui``)."""
    parser = argparse.ArgumentParser(prog="python -m comfyui_mc_sparse", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="MC-Sparse vs dense, vanilla BSA and Sol-Attn on a synthetic workload")
    grid = demo.add_argument_group("token grid (synthetic latent frames x rows x columns)")
    grid.add_argument("--size", choices=sorted(workload.SIZES), help="named grid: " + ", ".join(
        f"{k} {'x'.join(map(str, v))} = {math.prod(v)} tokens" for k, v in workload.SIZES.items()))
    grid.add_argument("--frames", type=int, help="latent frames (with --height and --width, overrides --size)")
    grid.add_argument("--height", type=int, help="latent rows")
    grid.add_argument("--width", type=int, help="latent columns")
    demo.add_argument("--densities", type=float, nargs="+", default=[0.1, 0.2, 0.3], help="target densities in (0, 1]")
    demo.add_argument("--steps", type=int, help=f"denoising steps (default {DEFAULTS['steps']})")
    demo.add_argument("--layers", type=int, help=f"attention layers per step (default {DEFAULTS['layers']})")
    demo.add_argument("--heads", type=int, help=f"attention heads (default {DEFAULTS['heads']})")
    demo.add_argument("--head-dim", type=int, default=128, choices=HEAD_DIMS, help="head dim (default 128)")
    demo.add_argument("--group-size", type=int, default=64, choices=GROUP_SIZES, help="query tile C (default 64)")
    demo.add_argument("--kv-tile", type=int, default=64, help="KV tile: K and BSA's KV blocks (default 64)")
    demo.add_argument("--device", default="auto", help="auto (a GPU when present), cpu, cuda, cuda:1, ...")
    demo.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                      help="q/k/v dtype (default float32 on CPU, bfloat16 on GPU)")
    demo.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    demo.add_argument("--quick", action="store_true",
                      help="fast CI setting: " + ", ".join(f"{k}={v}" for k, v in QUICK.items()))
    demo.add_argument("--json", metavar="PATH", help="also write every number to this JSON file")
    probe_capture.add_probe_parser(sub)
    comfy = sub.add_parser("comfyui", aliases=["comfyui-demo"],
                           help="run the shipped Wan workflow headless in a ComfyUI checkout (tiny random model)")
    comfy.add_argument("--comfyui-dir", default=os.environ.get("COMFYUI_DIR"),
                       help="path of a ComfyUI checkout (default $COMFYUI_DIR)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m comfyui_mc_sparse``. Returns a process exit code (0 = success)."""
    args = build_parser().parse_args(argv)
    if args.command == "probe":
        return probe_capture.run_probe(args)
    if args.command != "demo":
        return _comfyui(args)
    code = _demo(args)
    if code == 0 and os.environ.get("COMFYUI_DIR"):  # the main job also runs a shipped workflow in that ComfyUI
        print(f"\nCOMFYUI_DIR is set: running the shipped Wan 2.1 T2V workflow headless in {os.environ['COMFYUI_DIR']}")
        code = _comfyui(argparse.Namespace(comfyui_dir=os.environ["COMFYUI_DIR"]), optional=True)
    return code


def _comfyui(args, *, optional: bool = False) -> int:
    """Run the shipped Wan workflow headless in ``args.comfyui_dir``. When ComfyUI cannot run here at all (no
    checkout at that path, or this Python lacks ComfyUI's requirements) that is exit 2, or, with ``optional`` (the
    demo after $COMFYUI_DIR was found in the environment), a note on stderr and exit 0: the demo itself succeeded.
    A workflow that runs and fails is a failure either way."""

    def cannot(text: str) -> int:
        if optional:
            print(f"comfyui: skipped the headless ComfyUI run: {text}", file=sys.stderr)
            return 0
        print(f"comfyui: {text}", file=sys.stderr)
        return 2

    try:
        headless = importlib.import_module(".headless", __package__)
    except ImportError as err:
        return cannot(f"the headless runner is not available in this checkout ({err})")
    if not args.comfyui_dir or not os.path.isfile(os.path.join(args.comfyui_dir, "comfy", "model_patcher.py")):
        return cannot(f"--comfyui-dir (or $COMFYUI_DIR) must name a ComfyUI checkout, got {args.comfyui_dir!r}")
    try:
        return int(headless.run_headless_demo(args.comfyui_dir))
    except ImportError as err:  # ComfyUI's own requirements are missing from this Python
        return cannot(f"this Python cannot import ComfyUI from {args.comfyui_dir} ({err}); run "
                      "`python -m comfyui_mc_sparse comfyui` with ComfyUI's Python environment (the one that runs "
                      "ComfyUI, with its requirements installed)")


# --- demo ---------------------------------------------------------------------------------------------


def _settings(args) -> dict:
    base = QUICK if args.quick else DEFAULTS
    grid = workload.SIZES[args.size or base["size"]]
    explicit = (args.frames, args.height, args.width)
    if any(x is not None for x in explicit):
        if any(x is None for x in explicit):
            raise ValueError(f"--frames, --height and --width must be given together, got {explicit}")
        sinks = workload.WorkloadSpec.num_sinks  # the synthetic workload's attention-sink tokens
        if all(x >= 1 for x in explicit) and math.prod(explicit) <= sinks:
            raise ValueError(f"--frames x --height x --width must hold more than {sinks} tokens (the synthetic "
                             f"workload's attention sinks), got {math.prod(explicit)}")
        grid = explicit
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            device = torch.device(args.device)
        except RuntimeError:
            raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, got {args.device!r}") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device {args.device}: no CUDA GPU is available to this torch ({torch.__version__})")
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, got {args.device!r}")
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    steps = args.steps if args.steps is not None else base["steps"]
    for name, value in (("densities", args.densities),):
        if not value or any(not 0.0 < d <= 1.0 for d in value):
            raise ValueError(f"--{name} must be numbers in (0, 1], got {value}")
    for name in ("heads", "layers"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        raise ValueError(f"--json must name a file in an existing folder, got {args.json}")
    if steps < 2:
        raise ValueError(f"--steps must be >= 2 (at least one anchor and one reuse step), got {steps}")
    warmup, anchors = schedule.paper_video_schedule(steps)
    return {
        "grid": tuple(grid), "heads": base["heads"] if args.heads is None else args.heads, "head_dim": args.head_dim,
        "layers": base["layers"] if args.layers is None else args.layers, "steps": steps, "warmup_steps": warmup, "anchor_steps": anchors,
        "densities": list(args.densities), "group_size": args.group_size, "kv_tile": args.kv_tile,
        "device": str(device), "dtype": dtype, "seed": args.seed, "quick": bool(args.quick),
    }


def _demo(args) -> int:
    try:
        cfg = _settings(args)
        spec = workload.WorkloadSpec(*cfg["grid"], heads=cfg["heads"], head_dim=cfg["head_dim"],
                                     num_steps=cfg["steps"], seed=cfg["seed"])
        configs = {d: MCSparseConfig(density=d, group_size=cfg["group_size"], kv_tile=cfg["kv_tile"],
                                     warmup_steps=cfg["warmup_steps"], anchor_steps=cfg["anchor_steps"])
                   for d in cfg["densities"]}
        S = spec.tokens
        B, H = spec.batch, spec.heads
        diagnostics.check_size(torch.empty(B, H, S, 0, device="meta"))
    except (ValueError, TypeError) as err:
        print(f"demo: {err}", file=sys.stderr)
        return 2
    results = run_demo(cfg, spec, configs)
    table = format_table(results, cfg)
    print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def _progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device):
    """(result, milliseconds) of ``fn()``, synchronised on GPUs."""
    _sync(device)
    start = time.perf_counter()
    out = fn()
    _sync(device)
    return out, (time.perf_counter() - start) * 1000


def run_demo(cfg: dict, spec: workload.WorkloadSpec, configs: dict[float, MCSparseConfig]) -> dict:
    """Run the schedule and collect per-method metrics (see the module docstring). Returns a JSON-able dict:
    ``{"settings": ..., "rows": {method: {str(density): {"density", "recall", "rel_l1", "time_ms", ...}}}}``."""
    with kernels.registry.recording(kernels.registry.Record()) as record:
        return _run_demo(cfg, spec, configs, record)


def _run_demo(cfg: dict, spec: workload.WorkloadSpec, configs: dict[float, MCSparseConfig], record) -> dict:
    device = torch.device(cfg["device"])
    dtype = getattr(torch, cfg["dtype"])
    wl = workload.SyntheticWorkload(spec, device=device)
    runners = {d: MCSparseRunner(c) for d, c in configs.items()}
    acc = defaultdict(lambda: defaultdict(list))  # (method, density) -> metric -> values over reuse calls
    notes: dict[str, str] = {}
    started = time.perf_counter()
    _progress(f"demo: synthetic workload {'x'.join(map(str, spec.grid))} = {spec.tokens} tokens, {spec.heads} heads "
              f"x {spec.head_dim}, {cfg['layers']} layer(s), {cfg['steps']} steps (warm-up {cfg['warmup_steps']}, "
              f"anchors {list(cfg['anchor_steps'])}), densities {cfg['densities']}, {device} {cfg['dtype']}")
    for step in range(cfg["steps"]):
        t0 = time.perf_counter()
        kind = schedule.step_kind(next(iter(configs.values())), step, 0)
        for layer in range(cfg["layers"]):
            q, k, v = wl.qkv(step, layer=layer, dtype=dtype)
            key = CacheKey(layer=layer, shape=tuple(q.shape))
            if kind is not StepKind.REUSE:
                for runner in runners.values():  # warm-up and anchors: the runner's own dense/anchor path
                    runner.attention(q, k, v, step=step, layer=layer, key=key)
                continue
            dense, dense_ms = _timed(lambda: kernels.dense_attention(q, k, v), device)
            _add(acc, "dense", None, step=step, density=1.0, recall=1.0, rel_l1=0.0, time_ms=dense_ms)
            for d, runner in runners.items():
                out, ms = _timed(lambda: runner.attention(q, k, v, step=step, layer=layer, key=key), device)
                entry = _cached_entry(runner, key, q)
                scored = diagnostics.evaluate_selection(q, k, v, entry.perm, entry.kv_idx, method="MC-Sparse")
                _add(acc, "MC-Sparse", d, step=step, density=scored.density, recall=scored.recall,
                     rel_l1=diagnostics.relative_l1(out, dense), time_ms=ms)
                bare, ms = _timed(lambda: kernels.sparse_attention(q, k, v, entry.perm, entry.kv_idx), device)
                _add(acc, "MC-Sparse w/o residual", d, step=step, density=scored.density, recall=scored.recall,
                     rel_l1=diagnostics.relative_l1(bare, dense), time_ms=ms)
                bsa, ms = _timed(lambda: _bsa_attention(q, k, v, d, cfg), device)
                scored = diagnostics.vanilla_bsa(q, k, v, d, group_size=cfg["group_size"], kv_tile=cfg["kv_tile"])
                _add(acc, "vanilla BSA", d, step=step, density=scored.density, recall=scored.recall,
                     rel_l1=diagnostics.relative_l1(bsa, dense), time_ms=ms)
                sol = diagnostics.sol_attn(q, k, v, d)
                if sol.available:
                    _add(acc, "Sol-Attn (comfy-kitchen)", d, step=step, density=sol.density, recall=sol.recall,
                         rel_l1=diagnostics.relative_l1(sol.out, dense), time_ms=sol.extra["call_ms"])
                notes[f"Sol-Attn s={d:g}" + ("" if sol.available else " unavailable")] = sol.note
        _progress(f"  step {step + 1}/{cfg['steps']} ({kind.value}) {time.perf_counter() - t0:.1f} s")
    for runner in runners.values():
        logger.info("%s", runner.summary())
        record.choices.update(runner.kernels.choices)
        runner.close()
    rows = {m: {} for m in ROWS}
    for (method, d), metrics in acc.items():
        cell = {name: sum(vals) / len(vals) for name, vals in metrics.items() if name != "step"}
        cell["calls"] = len(metrics["step"])
        cell["per_call"] = {name: vals for name, vals in metrics.items()}
        if method == "dense":
            rows[method] = {str(x): dict(cell) for x in cfg["densities"]}
        else:
            rows[method][str(d)] = cell
    return {
        "title": "MC-Sparse demo on a synthetic DiT-like workload",
        "settings": {**cfg, "grid": list(cfg["grid"]), "tokens": spec.tokens, "anchor_steps": list(cfg["anchor_steps"])},
        "environment": {"torch": torch.__version__, "python": platform.python_version(), "device": _device_name(device),
                        "threads": torch.get_num_threads(),
                        "kernels": {op: c.backend for op, c in record.choices.items()}},
        "rows": rows,
        "notes": notes,
        "wall_s": time.perf_counter() - started,
    }


def _cached_entry(runner: MCSparseRunner, key: CacheKey, q: torch.Tensor) -> CacheEntry:
    """The runner's cached groups and indices for ``key``, decoded (read-only: the runner's prefetch state
    and hit counters are left alone)."""
    return runner.cache.peek(key, q.device, q.dtype)


def _add(acc, method, target, **metrics) -> None:
    for name, value in metrics.items():
        acc[(method, target)][name].append(float(value))


def _bsa_attention(q, k, v, density: float, cfg: dict) -> torch.Tensor:
    """Vanilla BSA as it would run: pooled block scores, top blocks per query block, expanded to token
    indices and run through the same token-sparse kernel op as MC-Sparse (identity query groups)."""
    perm, kv_idx = diagnostics.bsa_selection(q, k, density, group_size=cfg["group_size"], kv_tile=cfg["kv_tile"])
    return kernels.sparse_attention(q, k, v, perm, kv_idx)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def format_table(results: dict, cfg: dict | None = None) -> str:
    """The demo's one table (plain text, fixed width): one row per method, per density four columns."""
    settings = results["settings"]
    densities = [str(d) for d in settings["densities"]]
    head1 = f"{'':<26}" + "".join(f"| {'s = ' + d:^29} " for d in densities)
    head2 = f"{'method':<26}" + "".join(f"| {'dens':>6} {'recall':>6} {'relL1':>6} {'ms':>7} " for _ in densities)
    lines = [
        f"MC-Sparse demo, synthetic DiT-like workload: {'x'.join(map(str, settings['grid']))} = {settings['tokens']} "
        f"tokens, {settings['heads']} heads x {settings['head_dim']}, {settings['layers']} layer(s), "
        f"{settings['steps']} steps (anchors {settings['anchor_steps']}), C = {settings['group_size']}, "
        f"{settings['device']} {settings['dtype']}",
        "metrics: mean over reuse steps; dens = realized density (kept query-key pairs / S^2), recall = kept "
        "exact attention mass, relL1 = ||O - O_dense||_1 / ||O_dense||_1, ms = attention time per call",
        head1, head2, "-" * len(head2),
    ]
    for method in ROWS:
        cells = results["rows"].get(method, {})
        line = f"{method:<26}"
        for d in densities:
            c = cells.get(d)
            if c is None:
                line += f"| {'unavailable':^29} "
            else:
                line += f"| {c['density']:6.3f} {c['recall']:6.3f} {c['rel_l1']:6.3f} {c['time_ms']:7.1f} "
        lines.append(line)
    for name, note in results.get("notes", {}).items():
        lines.append(f"{name}: {note}")
    env = results["environment"]
    lines.append(f"device {env['device']}, torch {env['torch']}, kernels: "
                 + ", ".join(f"{op}={b}" for op, b in sorted(env["kernels"].items())) + f"; wall {results['wall_s']:.0f} s")
    return "\n".join(lines)
