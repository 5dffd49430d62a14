"""Metadata-cache benchmark on a CUDA GPU (not collected by pytest): prints a table, writes JSON to --out.

At the Wan2.1-14B 480p 81-frame self-attention shape (B=1, H=40, S=32760, D=128, bf16), density 0.25, C=128:
1. bytes: one real anchor entry (synthetic DiT-like q/k/v, ``tools/workload.py``) is encoded with each residual
   option; its selections and groups are decoded on the GPU and compared bit for bit; the cache of the
   40-layer x 2-branch (CFG) run is that entry's bytes x 80, next to ``memory.estimate_cache`` and the paper's
   naive layout (int32 indices + bf16 residual);
2. fidelity: relative L1 of the reuse output against dense at later steps of the workload, residual in bf16,
   fp8 with a row scale, fp8 with a tensor scale, and without residual;
3. speed: a reuse step over a stack of --layers layers through ``MCSparseRunner.attention`` (load, prefetch of
   the next layer, sparse kernel, residual), with the cache resident on the GPU and in pinned CPU memory,
   bf16 and fp8 residual, plus the naive uncompressed resident cache; each alone ("attention only", the worst
   case for hiding copies) and with each layer's non-attention work emulated by bf16 GEMMs of Wan2.1-14B's FFN
   shape calibrated to 39.5 ms per layer (1.58 s / 40 blocks, docs/performance.md). Medians of interleaved
   repeats (variant order rotated), wall time between device syncs. Ratio = CPU-placement / GPU-placement.

Usage: python tests/bench_cache.py --out bench_cache.json [--layers 40] [--budget-s 150]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "comfyui_mc_sparse"))
import _standalone

_standalone.load_pack()
from comfyui_mc_sparse_pack import kernels  # noqa: E402
from comfyui_mc_sparse_pack.comfyui_mc_sparse import attention, engine, memory  # noqa: E402
from comfyui_mc_sparse_pack.comfyui_mc_sparse.cache import CacheEntry, CacheKey, encode_entry  # noqa: E402
from comfyui_mc_sparse_pack.comfyui_mc_sparse.config import MCSparseConfig  # noqa: E402
from comfyui_mc_sparse_pack.comfyui_mc_sparse.tools.workload import SyntheticWorkload, WorkloadSpec  # noqa: E402

GRID = (21, 30, 52)  # Wan2.1 480p, 81 frames: 32760 tokens
H, D, DENSITY, C = 40, 128, 0.25, 128
ENTRIES = 40 * 2  # 40 blocks x 2 CFG branches
ANCHOR_STEP, REUSE_STEPS = 9, (12, 24)  # 0-based steps of a 50-step schedule
MLP_MS_PER_LAYER = 1580.0 / 40  # Wan2.1-14B 480p step without self-attention, per block (performance.md)
RESIDUALS = {"bf16": ("bfloat16", "row"), "fp8-row": ("float8_e4m3fn", "row"), "fp8-tensor": ("float8_e4m3fn", "tensor")}


def rel_l1(a, b):
    return ((a.float() - b.float()).abs().sum() / b.float().abs().sum()).item()


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def section(report, name, fn):
    """Run one part; a failure is recorded and the others still run."""
    t0 = time.perf_counter()
    try:
        report[name] = fn()
    except Exception as err:  # a benchmark reports what broke and keeps going
        report[name] = {"error": f"{type(err).__name__}: {err}"}
        print(f"[{name}] FAILED: {type(err).__name__}: {err}", flush=True)
    print(f"[{name}] {time.perf_counter() - t0:.1f} s", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_cache.json")
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--budget-s", type=float, default=150.0, help="wall seconds for the timed repeats")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on any device: checks the script runs")
    args = ap.parse_args()
    global GRID, H, C
    if args.smoke:
        GRID, H, C, args.layers, args.budget_s = (4, 8, 16), 2, 64, 3, 1.0
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    gpu = torch.cuda.get_device_name() if dev.type == "cuda" else "none (CPU)"
    report = {"env": {"torch": torch.__version__, "gpu": gpu, "python": platform.python_version(),
                      "shape": [1, H, GRID[0] * GRID[1] * GRID[2], D], "density": DENSITY, "C": C}}
    try:
        import triton

        report["env"]["triton"] = triton.__version__
    except ImportError:
        pass
    spec = WorkloadSpec(frames=GRID[0], height=GRID[1], width=GRID[2], heads=H, head_dim=D, num_steps=50, seed=0)
    wl = SyntheticWorkload(spec, device=dev)
    S = spec.tokens
    cfg = MCSparseConfig(density=DENSITY, group_size=C, warmup_steps=0, anchor_steps=(0,), residual_dtype="float8_e4m3fn")
    q0, k0, v0 = wl.qkv(ANCHOR_STEP, dtype=torch.bfloat16)
    sync()
    t0 = time.perf_counter()
    _, entry = attention.anchor_attention(q0, k0, v0, cfg)  # residual kept in float32 (fp8 config)
    sync()
    report["anchor_s"] = time.perf_counter() - t0
    report["kernels"] = {op: c.backend for op, c in kernels.registry.last_choices().items()}
    print(f"anchor {report['anchor_s']:.2f} s, kernels {report['kernels']}", flush=True)

    def bytes_part():
        out = {"naive_entry_bytes": entry.perm.numel() * 4 + entry.kv_idx.numel() * 4 + 2 * entry.residual.numel()}
        out["naive_total_GB"] = out["naive_entry_bytes"] * ENTRIES / 1e9
        for name, (dtype, scale) in RESIDUALS.items():
            stored = encode_entry(entry, residual_dtype=dtype, residual_scale=scale)
            back = stored.decode(dev, torch.bfloat16)
            sync()
            est = memory.estimate_cache(heads=H, head_dim=D, layers=40, tokens=S, density=DENSITY, group_size=C,
                                        branches=2, residual_dtype=dtype, residual_scale=scale)
            out[name] = {
                "selection": stored.selection.kind, "groups": stored.groups.kind,
                "selection_bytes": stored.selection.nbytes, "groups_bytes": stored.groups.nbytes,
                "residual_bytes": stored.residual.nbytes, "entry_bytes": stored.nbytes,
                "total_GB": stored.nbytes * ENTRIES / 1e9, "estimate_total_GB": est.total_bytes / 1e9,
                "bit_exact_selection": bool(torch.equal(back.kv_idx, entry.kv_idx)),
                "bit_exact_groups": bool(torch.equal(back.perm, entry.perm)),
            }
        return out

    def fidelity_part():
        out = {}
        stored = {n: encode_entry(entry, residual_dtype=d, residual_scale=s) for n, (d, s) in RESIDUALS.items()}
        for step in (ANCHOR_STEP, *REUSE_STEPS):
            q, k, v = wl.qkv(step, dtype=torch.bfloat16)
            dense = kernels.dense_attention(q, k, v)
            sparse = kernels.sparse_attention(q, k, v, entry.perm, entry.kv_idx)
            row = {"no residual": rel_l1(sparse, dense), "fp32 residual": rel_l1(sparse + entry.residual.to(q.dtype), dense)}
            for name, st in stored.items():
                row[name] = rel_l1(sparse + st.decode(dev, q.dtype).residual, dense)
            out[f"step {step}"] = row
            print(f"fidelity step {step}: " + ", ".join(f"{k_} {v_:.5f}" for k_, v_ in row.items()), flush=True)
        return out

    def speed_part():
        L = args.layers
        q, k, v = wl.qkv(REUSE_STEPS[0], dtype=torch.bfloat16)
        keys = [CacheKey(layer, "cond", None, tuple(q.shape)) for layer in range(L)]
        naive = CacheEntry(entry.perm, entry.kv_idx, entry.residual.to(torch.bfloat16), entry.num_keys, entry.shape)
        runners = {}
        t0 = time.perf_counter()
        for name, placement, dtype in (("naive resident", "gpu", None), ("bf16 gpu", "gpu", "bfloat16"),
                                       ("bf16 cpu", "cpu", "bfloat16"), ("fp8 gpu", "gpu", "float8_e4m3fn"),
                                       ("fp8 cpu", "cpu", "float8_e4m3fn")):
            r = engine.MCSparseRunner(dataclasses.replace(cfg, cache_placement=placement, residual_dtype=dtype or "bfloat16"))
            for key in keys:
                if dtype is None:
                    r.cache.put(key, naive)  # the paper's layout, as before this issue: nothing to decode
                else:
                    r._store(key, entry, 0)  # what an anchor call stores: encode, place, remember the layer order
            runners[name] = r
        sync()
        setup_s = time.perf_counter() - t0
        width, hidden = (5120, 13824) if not args.smoke else (64, 128)  # Wan2.1-14B: dim 5120, FFN 13824
        x = torch.randn(S, width, device=dev, dtype=torch.bfloat16)
        w1 = torch.randn(width, hidden, device=dev, dtype=torch.bfloat16) * 0.01
        w2 = torch.randn(hidden, width, device=dev, dtype=torch.bfloat16) * 0.01

        def ffn():
            return (x @ w1) @ w2

        for _ in range(3):
            ffn()
        sync()
        t0 = time.perf_counter()
        for _ in range(5):
            ffn()
        sync()
        ffn_ms = (time.perf_counter() - t0) * 200
        reps_mlp = 1 if args.smoke else max(1, round(MLP_MS_PER_LAYER / ffn_ms))
        outs = {}

        def step(name, mlp):
            r = runners[name]
            for layer, key in enumerate(keys):
                outs[name] = r.attention(q, k, v, step=1, layer=layer, key=key)
                if mlp:
                    for _ in range(reps_mlp):
                        ffn()

        def timed(name, mlp):
            sync()
            t = time.perf_counter()
            step(name, mlp)
            sync()
            return (time.perf_counter() - t) * 1000

        times = {(n, m): [] for n in runners for m in (False, True)}
        for mlp in (False, True):
            for n in runners:
                step(n, mlp)  # warm-up (Triton compile, prefetch chain primed)
        first = {key: timed(*key) for key in times}
        for key, ms in first.items():
            times[key].append(ms)
        per_round = sum(first.values()) / 1000
        rounds = max(2, min(9, int(args.budget_s / max(per_round, 1e-3))))
        names = list(times)
        for i in range(rounds - 1):
            for key in names[i % len(names):] + names[: i % len(names)]:
                times[key].append(timed(*key))
        out = {"layers": L, "setup_s": setup_s, "ffn_ms": ffn_ms, "ffn_reps_per_layer": reps_mlp, "rounds": rounds}
        for (n, mlp), ms in times.items():
            out.setdefault(n, {})["with FFN" if mlp else "attention only"] = {"median_ms": statistics.median(ms), "all_ms": ms}
        for dtype in ("bf16", "fp8"):
            for mode in ("attention only", "with FFN"):
                cpu_ms, gpu_ms = out[f"{dtype} cpu"][mode]["median_ms"], out[f"{dtype} gpu"][mode]["median_ms"]
                out[f"{dtype} cpu/gpu, {mode}"] = cpu_ms / gpu_ms
            out[f"{dtype} outputs equal cpu vs gpu"] = bool(torch.equal(outs[f"{dtype} cpu"], outs[f"{dtype} gpu"]))
        for n, r in runners.items():
            c = r.cache
            out[n]["cache"] = {"gpu_GB": c.gpu_bytes / 1e9, "host_GB": c.host_bytes / 1e9, "hits": c.hits,
                               "misses": c.misses, "moved": c.moved, "notes": list(c.notes)}
            hosts = [e.host for e in (c.get(key) for key in keys) if getattr(e, "host", None) is not None]
            out[n]["cache"]["pinned"] = f"{sum(h.pinned for h in hosts)}/{len(hosts)}"
        # one load alone, no prefetch: what a layer's decode (and copy) costs when not hidden
        for n in ("bf16 gpu", "bf16 cpu", "fp8 gpu", "fp8 cpu"):
            stored = runners[n].cache.get(keys[0])
            ms = []
            for _ in range(3):
                sync()
                t = time.perf_counter()
                stored.decode(dev, torch.bfloat16, non_blocking=stored.host is not None)
                sync()
                ms.append((time.perf_counter() - t) * 1000)
            out[n]["one load alone ms"] = min(ms)
        for r in runners.values():
            r.close()
        return out

    section(report, "bytes", bytes_part)
    section(report, "fidelity", fidelity_part)
    section(report, "speed", speed_part)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print_table(report)


def print_table(rep):
    b = rep.get("bytes", {})
    if "bf16" in b:
        print(f"\ncache, Wan2.1-14B 480p 81f, s={DENSITY}, CFG ({ENTRIES} entries): naive {b['naive_total_GB']:.1f} GB")
        for name in RESIDUALS:
            e = b[name]
            print(f"  {name:10s} {e['total_GB']:6.2f} GB (estimate {e['estimate_total_GB']:.2f}); per entry: selections "
                  f"{e['selection']} {e['selection_bytes'] / 1e6:.1f} MB, groups {e['groups_bytes'] / 1e6:.1f} MB, residual "
                  f"{e['residual_bytes'] / 1e6:.1f} MB; bit-exact {e['bit_exact_selection'] and e['bit_exact_groups']}")
    f = rep.get("fidelity", {})
    for step, row in f.items():
        if isinstance(row, dict):
            print(f"  rel L1 vs dense, {step}: " + ", ".join(f"{k}={v:.5f}" for k, v in row.items()))
    s = rep.get("speed", {})
    if "layers" in s:
        print(f"\nreuse step, {s['layers']} layers (median ms of {s['rounds']} rounds):")
        for n in ("naive resident", "bf16 gpu", "bf16 cpu", "fp8 gpu", "fp8 cpu"):
            print(f"  {n:15s} attention only {s[n]['attention only']['median_ms']:8.1f}   with FFN "
                  f"{s[n]['with FFN']['median_ms']:8.1f}   cache {s[n]['cache']}" + (
                      f"   one load alone {s[n]['one load alone ms']:.2f} ms" if "one load alone ms" in s[n] else ""))
        for key, val in s.items():
            if "cpu/gpu" in key or "equal" in key:
                print(f"  {key}: {val:.3f}" if isinstance(val, float) else f"  {key}: {val}")


if __name__ == "__main__":
    main()
