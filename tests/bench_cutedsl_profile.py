"""Where the CuTeDSL sparse kernel's time goes, on an sm_90 GPU (issue 16; not collected by pytest).

One process, bf16, D = 128, C = 128, the compiled kernel's launch alone (counts computed before), at the Wan2.1-1.3B
480p and 14B 720p shapes, each row timed side by side with flash-attn-4 dense with LSE (the baseline:
efficiency = dense ms x s / ms, and per key tile: us per CTA wave per key tile):
- ``kernel``: the production kernel, random perm, each group a random sorted key set (``bench_cutedsl.inputs``);
- ``perm identity``: the same keys, queries in token order (query gather and output scatter contiguous);
- ``shared keys``: every group of a head has the same random key set (the dense kernel's L2 reuse pattern);
- ``contiguous keys``: every group's keys are tokens 0 .. n-1 (best-case locality, same code path);
- ``kv bhsd``: random keys read from [B, H, S, D]-contiguous K/V (rows of a head 256 bytes apart, not H*256);
- ``no store``: the epilogue writes nothing (a never-true test keeps the math): the epilogue's cost;
- ``smem epilogue``: O staged in the query tile's shared memory, rows written 16 bytes per thread (the kernel's
  ``epilogue="smem"``);
- ``persistent``: the production kernel on one CTA per SM (grid-stride over the groups);
- ``no load``: the producer issues no K/V copies (Q still gathered; stages signalled at once): the consumers alone;
- ``fa4 Sk=n``: flash-attn-4 dense on the first n keys (contiguous, TMA), n = the sparse key count: the same work
  through TMA;
- at 1.3B, key-tile sweeps (1, 2, 4, 8 tiles of random keys) of the kernel, ``no load`` and ``fa4 Sk=n``: the fixed
  cost per group (intercept of a line through us per wave vs tiles).
Each variant's output is checked against the float32 torch reference where it computes the real thing (kernel,
perm identity, shared / contiguous keys, kv bhsd) so a wrong variant shows in the same run.

Usage: python tests/bench_cutedsl_profile.py --out $OUT/profile.json [--shapes 1.3b,14b] [--rep 20]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_cutedsl as bc  # noqa: E402  (loads the pack)

from comfyui_mc_sparse_pack import kernels  # noqa: E402
from comfyui_mc_sparse_pack.kernels import reference  # noqa: E402

C = 128


def ms(fn, rep):
    return triton.testing.do_bench(fn, warmup=min(100, rep), rep=rep, return_mode="median")


def variant_kernels():
    """name -> compiled kernel (bf16, D 128, no LSE, no residual) for the production class and two probes."""
    import cutlass.cute as cute
    import cutlass
    from cutlass import Float32, Int32
    from quack.compile_utils import make_fake_stream

    from comfyui_mc_sparse_pack.kernels.cutedsl import compile as cc
    from comfyui_mc_sparse_pack.kernels.cutedsl.sparse_fwd_sm90 import SparseFwdSm90

    class NoStore(SparseFwdSm90):
        @cute.jit
        def _store_row(self, acc, lse, tOcO, m: cutlass.Constexpr[int], b, h, g, q_row, mO, mLSE, mRes, mScale,
                       mCoef, mMean):
            if acc[m, 0] == Float32(-1.2345e30):  # never true: keeps the finalize math alive
                mO[b, q_row, h, 0] = mO.element_type(acc[m, 0])

    class NoLoad(SparseFwdSm90):
        @cute.jit
        def load_KV(self, tma_load_fn, paged_kv_manager, sX, block, pipeline_kv, producer_state, K_or_V,
                    page_idx=None):
            cute.arch.cp_async_commit_group()
            pipeline_kv.producer_commit(producer_state)

    out = {}
    classes = [("kernel", SparseFwdSm90, {}), ("no store", NoStore, {}), ("no load", NoLoad, {}),
               ("smem epilogue", SparseFwdSm90, dict(epilogue="smem"))]
    for name, cls, kw in classes:
        t = time.perf_counter()
        obj = cls(cutlass.BFloat16, 128, cc.default_stages(), None, **kw)
        out_align = 16 if kw.get("epilogue") == "smem" else 4
        out[name] = cute.compile(obj, *cc._fake_args("bfloat16", 128, False, "none", out_align), Float32(1.0),
                                 Int32(1), None, None, Int32(1), make_fake_stream(), options="--enable-tvm-ffi")
        print(f"compiled {name} in {time.perf_counter() - t:.1f} s", flush=True)
    return out


def key_sets(gen, B, H, S, num, how):
    """(perm, idx) with ``num`` keys per group: how = random / perm identity / shared / contiguous."""
    G = -(-S // C)
    k_alloc = -(-num // 128) * 128
    if how == "perm identity":
        perm = torch.full((B, H, G * C), -1, dtype=torch.int32, device="cuda")
        perm[..., :S] = torch.arange(S, dtype=torch.int32, device="cuda")
    else:
        perm = torch.full((B, H, G * C), -1, dtype=torch.int32, device="cuda")
        perm[..., :S] = torch.argsort(torch.rand(B, H, S, generator=gen, device="cuda"), -1).to(torch.int32)
    idx = torch.full((B, H, G, k_alloc), -1, dtype=torch.int32, device="cuda")
    if how == "contiguous":
        idx[..., :num] = torch.arange(num, dtype=torch.int32, device="cuda")
    elif how == "shared":
        for h in range(H):
            top = torch.rand(B, 1, S, generator=gen, device="cuda").topk(num, -1, sorted=False).indices
            idx[:, h, :, :num] = top.sort(-1).values.to(torch.int32)
    else:
        for h in range(H):
            top = torch.rand(B, G, S, generator=gen, device="cuda").topk(num, -1, sorted=False).indices
            idx[:, h, :, :num] = top.sort(-1).values.to(torch.int32)
    return perm, idx


def run_shape(name, shp, densities, rep, fns, log, sweep):
    from comfyui_mc_sparse_pack.kernels.cutedsl import compile as cc
    from comfyui_mc_sparse_pack.kernels.triton.counts import valid_counts

    B, H, S, D = shp["B"], shp["H"], shp["S"], shp["D"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (bc.native(gen, B, S, H, D) for _ in range(3))
    qc, kc, vc = (t.contiguous() for t in (q, k, v))
    out = torch.empty(B, S, H * D, device="cuda", dtype=torch.bfloat16).view(B, S, H, D).transpose(1, 2)
    G = -(-S // C)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    waves = math.ceil(B * H * G / sms)
    dense = ms(lambda: kernels.dense_attention(qc, kc, vc, return_lse=True, backend="flash_attn4"), rep)
    log(f"{name}: fa4 dense (LSE) {dense:.3f} ms, {waves} waves, {1e3 * dense / waves / G:.3f} us per wave per tile")
    res = dict(dense_ms=dense, waves=waves, rows={})

    heads = 2 if S < 50000 else 1  # heads checked against the reference

    def launch(fn, perm, idx, kk=k, vv=v, ctas=None):
        n = B * H * G
        counts = valid_counts(idx)
        views = (q.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2), out.transpose(1, 2), None,
                 perm.view(n, C), idx.view(n, -1), counts, None, None, None, None, 1 / math.sqrt(D), ctas or n)
        return lambda: cc.launch(fn, *views)

    def err(perm, idx, kk=k, vv=v):
        ref = reference.sparse_attention(q[:, :heads].float(), kk[:, :heads].float(), vv[:, :heads].float(),
                                         perm[:, :heads], idx[:, :heads])
        return float((out[:, :heads].float() - ref).norm() / ref.norm())

    def row(tag, s, n_keys, fn, check=None):
        if check is not None:
            out.fill_(float("nan"))
            fn()
            torch.cuda.synchronize()
            e, nan = check(), int(out.isnan().sum())
        t = ms(fn, rep)
        tiles = -(-n_keys // 128)
        r = dict(ms=t, eff=dense * s / t, us_per_wave=1e3 * t / waves, tiles=tiles)
        if check is not None:
            r.update(err=e, nan=nan)
        res["rows"][f"{tag} s={s:g}"] = r
        log(f"{name} {tag:16s} s={s:<6g} {t:8.3f} ms  eff {r['eff']:.3f}  {r['us_per_wave']:7.2f} us/wave "
            f"({tiles} tiles)" + (f"  rel err {e:.2e} NaN left {nan}" if check is not None else ""))

    for s in densities:
        num = int(s * S)
        perm, idx = key_sets(gen, B, H, S, num, "random")
        row("kernel", s, num, launch(fns["kernel"], perm, idx), lambda: err(perm, idx))
        row("no store", s, num, launch(fns["no store"], perm, idx))
        row("no load", s, num, launch(fns["no load"], perm, idx))
        row("smem epilogue", s, num, launch(fns["smem epilogue"], perm, idx), lambda: err(perm, idx))
        row("persistent", s, num, launch(fns["kernel"], perm, idx, ctas=sms), lambda: err(perm, idx))
        row("kv bhsd", s, num, launch(fns["kernel"], perm, idx, kc, vc), lambda: err(perm, idx, kc, vc))
        for how in ("perm identity", "shared", "contiguous"):
            p2, i2 = key_sets(gen, B, H, S, num, how)
            row(how, s, num, launch(fns["kernel"], p2, i2), lambda: err(p2, i2))
        kn, vn = kc[:, :, :num], vc[:, :, :num]
        row("fa4 Sk=n", s, num, lambda: kernels.dense_attention(qc, kn, vn, return_lse=True, backend="flash_attn4"))
    if sweep:
        for tiles in (1, 2, 4, 8):
            num = tiles * 128
            s = num / S
            perm, idx = key_sets(gen, B, H, S, num, "random")
            row(f"kernel {tiles}t", s, num, launch(fns["kernel"], perm, idx), lambda: err(perm, idx))
            row(f"no load {tiles}t", s, num, launch(fns["no load"], perm, idx))
            row(f"no store {tiles}t", s, num, launch(fns["no store"], perm, idx))
            row(f"smem epi {tiles}t", s, num, launch(fns["smem epilogue"], perm, idx), lambda: err(perm, idx))
            kn, vn = kc[:, :, :num], vc[:, :, :num]
            row(f"fa4 {tiles}t", s, num,
                lambda: kernels.dense_attention(qc, kn, vn, return_lse=True, backend="flash_attn4"))
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="1.3b,14b")
    ap.add_argument("--densities", default="0.1,0.5")
    ap.add_argument("--rep", type=int, default=20)
    ap.add_argument("--commit", default="unknown")
    args = ap.parse_args()
    lines = []

    def log(msg):
        print(msg, flush=True)
        lines.append(msg)

    t0 = time.perf_counter()
    fns = variant_kernels()
    report = dict(gpu=torch.cuda.get_device_name(), commit=args.commit, shapes={})
    for name in args.shapes.split(","):
        report["shapes"][name] = run_shape(name, bc.SHAPES[name], [float(x) for x in args.densities.split(",")],
                                           args.rep, fns, log, sweep=name == "1.3b")
    log(f"total {time.perf_counter() - t0:.0f} s")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(report, log=lines), indent=1))


if __name__ == "__main__":
    main()
