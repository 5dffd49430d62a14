"""CuTeDSL sparse kernel benchmark on an sm_90 GPU (issue 16; not collected by pytest).

At the Wan2.1-1.3B 480p (B=1, H=12, S=32760) and 14B 720p (H=40, S=75600) shapes, D = 128, bf16, C = 128, for
s in {0.1, 0.15, 0.25, 0.5} (each group's indices a random sorted set of floor(s*S) tokens, -1-padded to a multiple of
128), measured side by side in one process:
- dense with LSE: flash-attn-4 (the baseline of every ratio: "flash-attn-4 dense x s") and cuDNN SDPA;
- ``cutedsl op``: ``kernels.sparse_attention(..., backend="cutedsl")`` on the model's native [B, S, H*D] views
  writing an ``out=`` view (what the reuse path calls: counts launch + kernel), and with a plain bf16 residual;
  ``cutedsl kernel``: the compiled kernel's launch alone (counts computed before), also with the other K/V stage
  count (2 / 3: the kernel stages no output in shared memory, so 3 stages fit at D = 128); ``triton op``: the Triton kernel
  on the same call; efficiency = FA4 dense ms * s / sparse ms;
- the compile time (a compile from fake tensors, never the disk cache) and the disk-cache load time (a fresh
  process).
The error of the CuTeDSL op (into a NaN-filled out: the count of NaN left is printed too; and with the plain
residual) and of the Triton op against the torch reference (float32, a sub-sample of heads) is printed before timing.
It writes --out JSON and the scoreboard key ``cutedsl_sparse_eff_min`` (the op's minimum; command and --commit).

Usage: python tests/bench_cutedsl.py --out $OUT/bench_cutedsl.json --commit <hash> [--shapes 1.3b,14b] [--rep 200]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "comfyui_mc_sparse"))
import _standalone  # noqa: E402

_standalone.load_pack()
import triton.testing  # noqa: E402
from comfyui_mc_sparse_pack import kernels  # noqa: E402
from comfyui_mc_sparse_pack.kernels import reference, registry  # noqa: E402

SHAPES = {"1.3b": dict(B=1, H=12, S=32760, D=128), "14b": dict(B=1, H=40, S=75600, D=128)}
C = 128


def ms(fn, rep):
    return triton.testing.do_bench(fn, warmup=min(100, rep), rep=rep, return_mode="median")


def native(gen, B, S, H, D):
    return torch.randn(B, S, H * D, generator=gen, device="cuda", dtype=torch.bfloat16).view(B, S, H, D).transpose(1, 2)


def inputs(gen, B, H, S, s):
    G = -(-S // C)
    num = int(s * S)
    k_alloc = -(-num // 128) * 128
    perm = torch.full((B, H, G * C), -1, dtype=torch.int32, device="cuda")
    perm[..., :S] = torch.argsort(torch.rand(B, H, S, generator=gen, device="cuda"), -1).to(torch.int32)
    idx = torch.full((B, H, G, k_alloc), -1, dtype=torch.int32, device="cuda")
    for h in range(H):
        top = torch.rand(B, G, S, generator=gen, device="cuda").topk(num, -1, sorted=False).indices
        idx[:, h, :, :num] = top.sort(-1).values.to(torch.int32)
    return perm, idx


def check(got, q, k, v, perm, idx, heads=2, res=None):
    ref = reference.sparse_attention(q[:, :heads].float(), k[:, :heads].float(), v[:, :heads].float(), perm[:, :heads],
                                     idx[:, :heads])
    if res is not None:  # a plain residual
        ref = ref + res.data[:, :heads].float()
    g = got[:, :heads].float()
    return float((g - ref).norm() / ref.norm())


def run_shape(name, shp, densities, rep, log):
    B, H, S, D = shp["B"], shp["H"], shp["S"], shp["D"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (native(gen, B, S, H, D) for _ in range(3))
    res = kernels.Residual(torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2) * 0.01)
    out = torch.empty(B, S, H * D, device="cuda", dtype=torch.bfloat16).view(B, S, H, D).transpose(1, 2)
    qc, kc, vc = (t.contiguous() for t in (q, k, v))
    dense = {}
    avail = {b.name for b in registry.backends() if not b.unavailable_reason}
    for nm, be in (("flash_attn4", "flash_attn4"), ("cudnn", "cuda_sdpa")):
        if be in avail:
            dense[nm] = ms(lambda: kernels.dense_attention(qc, kc, vc, return_lse=True, backend=be), rep)
            log(f"{name} dense {nm} (LSE): {dense[nm]:.2f} ms")
    base_name = "flash_attn4" if "flash_attn4" in dense else min(dense, key=dense.get)
    base = dense[base_name]
    rows = {}
    from comfyui_mc_sparse_pack.kernels.cutedsl import compile as cc
    from comfyui_mc_sparse_pack.kernels.triton.counts import valid_counts
    for s in densities:
        perm, idx = inputs(gen, B, H, S, s)
        r = {}
        out.fill_(float("nan"))
        with registry.recording(registry.Record()) as rec:
            got = kernels.sparse_attention(q, k, v, perm, idx, out=out, backend="cutedsl")
        if rec.choices["sparse_attention"].backend != "cutedsl":  # a fallback would be timed instead of the kernel
            raise SystemExit(f"the cutedsl kernel did not run: {rec.choices} {rec.failures}")
        r["cutedsl_err"] = check(got, q, k, v, perm, idx)
        r["cutedsl_nan_outputs_err"] = float(out.isnan().sum())
        got = kernels.sparse_attention(q, k, v, perm, idx, out=out, residual=res, backend="cutedsl")
        r["cutedsl + residual_err"] = check(got, q, k, v, perm, idx, res=res)
        got_t = kernels.sparse_attention(q, k, v, perm, idx, backend="triton")
        r["triton_err"] = check(got_t, q, k, v, perm, idx)
        r["cutedsl op"] = ms(lambda: kernels.sparse_attention(q, k, v, perm, idx, out=out, backend="cutedsl"), rep)
        r["cutedsl op + plain residual"] = ms(
            lambda: kernels.sparse_attention(q, k, v, perm, idx, out=out, residual=res, backend="cutedsl"), rep)
        counts = valid_counts(idx)
        n = counts.shape[0]
        views = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), out.transpose(1, 2), None, perm.view(n, C),
                 idx.view(n, -1), counts, None, None, None, None, 1 / math.sqrt(D), n)
        for st in (cc.default_stages(), 5 - cc.default_stages()):  # 2 and 3 K/V stages
            fn = cc.compiled("bfloat16", D, False, "none", st)
            tag = "cutedsl kernel" if st == cc.default_stages() else f"cutedsl kernel {st} stages"
            r[tag] = ms(lambda: cc.launch(fn, *views), rep)
        r["triton op"] = ms(lambda: kernels.sparse_attention(q, k, v, perm, idx, out=out, backend="triton"), rep)
        eff = {kk: base * s / vv for kk, vv in r.items() if not kk.endswith("_err")}
        log(f"{name} s={s}: " + ", ".join(f"{kk} {vv:.2f} ms (eff {eff[kk]:.3f})" for kk, vv in r.items()
                                           if not kk.endswith("_err"))
            + "; rel err " + ", ".join(f"{kk[:-4]} {vv:.2e}" for kk, vv in r.items() if kk.endswith("_err")))
        rows[s] = dict(ms=r, efficiency=eff)
    return dict(dense_ms=dense, baseline=base_name, densities=rows)


def compile_times(log):
    """Compile seconds (``compile_fake``: always a compile, whatever the disk cache holds) in this process and
    disk-cache load seconds in a fresh one."""
    from comfyui_mc_sparse_pack.kernels.cutedsl import compile as cc
    t = time.perf_counter()
    cc.compile_fake("bfloat16", 64, True)  # compiled() would load a cache left by an earlier run: not a compile
    cold = time.perf_counter() - t
    t = time.perf_counter()
    cc.compile_fake("bfloat16", 128, True, "plain_bfloat16")
    cold_res = time.perf_counter() - t
    cc.compiled("bfloat16", 64, True)  # now on disk (a compile or a load) for the fresh process below
    code = ("import sys,time; sys.path.insert(0, %r); import _standalone; _standalone.load_pack(); "
            "from comfyui_mc_sparse_pack.kernels.cutedsl import compile as cc; t=time.perf_counter(); "
            "cc.compiled('bfloat16', 64, True); print(time.perf_counter()-t)") % str(ROOT / "comfyui_mc_sparse")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ.copy())
    warm = float(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 and p.stdout.strip() else None
    log(f"compile: {cold:.1f} s (with a residual: {cold_res:.1f} s); from the disk cache "
        f"({cc.cache_dir()}) in a fresh process: {warm} s "
        f"({p.stderr.strip()[-300:]})")
    return dict(first_compile_s=cold, residual_compile_s=cold_res, disk_cache_load_s=warm,
                cache_dir=str(cc.cache_dir()))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="1.3b,14b")
    ap.add_argument("--densities", default="0.1,0.15,0.25,0.5")
    ap.add_argument("--rep", type=int, default=200)
    ap.add_argument("--commit", default=os.environ.get("MC_SPARSE_COMMIT", "unknown"))
    ap.add_argument("--scoreboard", default=str(ROOT / "docs/results/scoreboard.json"))
    args = ap.parse_args()
    lines = []

    def log(msg):
        print(msg, flush=True)
        lines.append(msg)

    log(f"GPU {torch.cuda.get_device_name()}; backends:\n{registry.report()}")
    report = dict(gpu=torch.cuda.get_device_name(), commit=args.commit, shapes={})
    report["compile"] = compile_times(log)
    for name in args.shapes.split(","):
        report["shapes"][name] = run_shape(name, SHAPES[name], [float(x) for x in args.densities.split(",")], args.rep,
                                           log)
    effs = {(n, s): r["efficiency"]["cutedsl op"] for n, sh in report["shapes"].items()
            for s, r in sh["densities"].items()}
    worst = min(effs, key=effs.get)
    report["cutedsl_sparse_eff_min"] = effs[worst]
    kern = min(r["efficiency"]["cutedsl kernel"] for sh in report["shapes"].values() for r in sh["densities"].values())
    log(f"cutedsl_sparse_eff_min {effs[worst]:.3f} at {worst} (kernel alone: min {kern:.3f})")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(report, log=lines), indent=1, default=str))
    board_path = Path(args.scoreboard)
    board = json.loads(board_path.read_text()) if board_path.is_file() else {}
    bases = "; ".join(f"{n}: {sh['baseline']} {sh['dense_ms'][sh['baseline']]:.2f} ms" for n, sh in report["shapes"].items())
    board["cutedsl_sparse_eff_min"] = dict(
        value=round(effs[worst], 4), unit="ratio",
        command="python tests/bench_cutedsl.py --out $OUT/bench_cutedsl.json --commit <hash>", commit=args.commit,
        gpu=report["gpu"], date=datetime.date.today().isoformat(),
        note=(f"min over shapes x s of dense with LSE x s / CuTeDSL op (native views, out=, counts launch + kernel); "
              f"worst at {worst[0]} s={worst[1]}; dense baseline {bases}; kernel alone min {kern:.3f}; compile "
              f"{report['compile']}"),
    )
    board_path.write_text(json.dumps(board, indent=2) + "\n")
    Path(args.out).with_name("scoreboard.json").write_text(json.dumps(board, indent=2) + "\n")


if __name__ == "__main__":
    main()
