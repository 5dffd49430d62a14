"""Pass-2 kernel exponential variants on a CUDA GPU, side by side (not collected by pytest; issue 15).

The Triton pair kernel (``kernels/triton/selection._group_prob_sums_pair``, float8 QK^T, unstaggered: select_kv's
default on sm_90) alone, on float8 operands computed once (``fp8_operands``), per variant of its exponentials
(``VARIANTS``: ``poly3`` = eighths of group 0's / group 1's exponentials on the degree-3 FMA-pipe polynomial
``_exp2_poly3``; ``maxnreg``: ptxas register cap; ``exp="none"``: no exponential at all, the timing floor of
everything else), each / the best dense attention call with LSE (flash-attn-4 when importable, cuDNN), at
Wan2.1-1.3B 480p (all 12 heads) and Wan2.1-14B 720p (one head chunk of ``HEADS_14B`` heads, extrapolated to 40).

Check (before timing, every variant): no NaN left in a NaN-poisoned fp32 output; each variant's sums within
``POLY_RTOL`` relative L2 per group of the default kernel's (the polynomial's error bound 7.6e-5 on its share plus
summation order); the default kernel within 5e-4 of float64 sums of its own dequantised operands on 4 groups. A
variant that fails is reported and not timed.

Usage (checkout root, H200): python tests/bench_pass2_exp.py --out OUT [--shapes 1.3b,14b] [--variants a,b]
[--rep 100] [--commit HASH]. Writes OUT/bench_pass2_exp.json after each shape and OUT/summary.json with
``pass2_kernel_over_dense_<shape>`` (the default kernel) and ``pass2_kernel_best_variant_over_dense_<shape>`` (no
scoreboard key: the pass-2 kernel alone is a part of ``pass2_topk_over_dense_max``).
Expected run time on an H200: ~40 s per shape (compiles ~3 s per variant, dense baseline, timings).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "comfyui_mc_sparse"))
import _standalone  # noqa: E402

_standalone.load_pack()
import triton  # noqa: E402
import triton.testing  # noqa: E402
from comfyui_mc_sparse_pack import kernels  # noqa: E402
from comfyui_mc_sparse_pack.kernels import reference  # noqa: E402
from comfyui_mc_sparse_pack.kernels.triton import grouping, selection  # noqa: E402

SHAPES = {"1.3b": dict(H=12, grid=(21, 30, 52)), "14b": dict(H=40, grid=(21, 45, 80))}
HEADS_14B = 5
C = D = 128
POLY_RTOL = 3e-4
VARIANTS = {  # name: keywords of launch()
    "default": {},  # as select_kv ran it before s5r1: 2^KB by MUFU in the kernel (now: "kb pow2")
    "no exp (floor)": dict(exp="none"),
    "poly3 1/8": dict(poly3=(0, 2)),
    "poly3 1/4": dict(poly3=(0, 4)),
    "poly3 3/8": dict(poly3=(4, 2)),
    "poly3 1/2": dict(poly3=(4, 4)),
    "maxnreg 232": dict(maxnreg=232),
    "poly3 1/4 maxnreg 232": dict(poly3=(0, 4), maxnreg=232),
    "poly3 1/2 maxnreg 232": dict(poly3=(4, 4), maxnreg=232),
    "poly3 1/4 maxnreg 200": dict(poly3=(0, 4), maxnreg=200),
    "kb pow2": dict(kb_pow2=True),
    "gluon ws": dict(gluon=dict(poly=0, kb_poly=False)),  # the warp-specialised sm_90 kernel (selection_sm90), as in s5
    "gluon ws poly3 1/4": dict(gluon=dict(poly=5, kb_poly=False)),  # a quarter of its exponentials on _exp2_poly3
    "gluon ws kb poly": dict(gluon=dict(kb_poly=True, poly=0)),  # its per-key factor on the FMA pipe
    "gluon ws kb pow2": dict(gluon=dict(kb_poly=2, poly=0), kb_pow2=True),  # 2^KB precomputed, as the Triton default
    "gluon ws unroll 4": dict(gluon=dict(unroll=4, poly=0, kb_poly=False)),
    "kb pow2 st2": dict(kb_pow2=True, num_stages=2),
    "kb pow2 st4": dict(kb_pow2=True, num_stages=4),
    "kb pow2 stagger": dict(kb_pow2=True, stagger=True),
    # one query group per program: 4 CTAs per SM if <= 128 registers (each K tile read by 1 group instead of 2)
    "kb pow2 1grp": dict(kb_pow2=True, one_group=True),
    "kb pow2 1grp maxnreg 128": dict(kb_pow2=True, one_group=True, maxnreg=128),
    "poly3 1/4 kb pow2": dict(poly3=(0, 4), kb_pow2=True),
    # session 6: the Gluon kernel with 2^KB precomputed; per-thread stage releases (no warpgroup barrier per tile);
    # three consumer warpgroups (3 warps per SM sub-partition instead of 2); its two timing floors ("exp": "none"
    # skips the sums check): no exponential, and no product (the MUFU / FMA work and stores alone)
    "gluon ws kb pow2 ta": dict(gluon=dict(kb_poly=2, thread_arrive=True, poly=0), kb_pow2=True),
    "gluon ws g3 kb pow2": dict(gluon=dict(groups=3, kb_poly=2, poly=0), kb_pow2=True),
    "gluon ws g3 kb pow2 ta": dict(gluon=dict(groups=3, kb_poly=2, thread_arrive=True, poly=0), kb_pow2=True),
    "gluon ws u4 kb pow2": dict(gluon=dict(unroll=4, kb_poly=2, poly=0), kb_pow2=True),
    "gluon ws no exp (floor)": dict(gluon=dict(poly=8, kb_poly=2), kb_pow2=True, exp="none"),
    "gluon ws no mma (floor)": dict(gluon=dict(poly=9, kb_poly=2), kb_pow2=True, exp="none"),
    # the row sums on the tensor cores (exponentials rounded to bfloat16, times a column of ones by a wgmma): no FADD
    # per score; "rtol": the sums check's bound for it (bf16 rounding of each term, 2^-9)
    "gluon ws sum mma": dict(gluon=dict(poly=10, kb_poly=2), kb_pow2=True, rtol=2e-3),
    "gluon ws sum mma ta": dict(gluon=dict(poly=10, kb_poly=2, thread_arrive=True), kb_pow2=True, rtol=2e-3),
    "gluon ws g3 sum mma": dict(gluon=dict(groups=3, poly=10, kb_poly=2), kb_pow2=True, rtol=2e-3),
    # + 1/8 / 1/4 of the exponentials on the degree-3 FMA polynomial (the FADDs' issue slots are free now)
    "gluon ws sum mma poly 1/8": dict(gluon=dict(poly=11, kb_poly=2), kb_pow2=True, rtol=2e-3),
    "gluon ws sum mma poly 1/4": dict(gluon=dict(poly=12, kb_poly=2), kb_pow2=True, rtol=2e-3),
    # the two consumer warpgroups take turns issuing their products (FA3's pingpong)
    "gluon ws sum mma pp": dict(gluon=dict(poly=10, kb_poly=2, pingpong=True), kb_pow2=True, rtol=2e-3),
    "gluon ws kb pow2 pp": dict(gluon=dict(kb_poly=2, pingpong=True, poly=0), kb_pow2=True),
    # each tile's row-sum wgmma waited for after the next tile's exponentials (+ a quarter on the FMA pipe, pingpong)
    "gluon ws sum mma defer": dict(gluon=dict(poly=20, kb_poly=2), kb_pow2=True, rtol=2e-3),
    "gluon ws sum mma defer poly 1/4": dict(gluon=dict(poly=22, kb_poly=2), kb_pow2=True, rtol=2e-3),
    "gluon ws sum mma defer pp": dict(gluon=dict(poly=20, kb_poly=2, pingpong=True), kb_pow2=True, rtol=2e-3),
    # each program takes a quarter of the keys (4x the programs: 1.3B 6144 instead of 1536, a smaller last wave)
    "gluon ws sum mma ks4": dict(gluon=dict(poly=10, kb_poly=2, ksplit=4), kb_pow2=True, rtol=2e-3),
    "gluon ws kb pow2 ks4": dict(gluon=dict(kb_poly=2, ksplit=4, poly=0), kb_pow2=True),
    # the Gluon kernel at its default config (selection_sm90.config), as select_kv(gluon=True) runs it
    "gluon ws default": dict(gluon={}, kb_pow2=False, rtol=2e-3),  # kb_pow2: what config()'s kb_poly reads
    # session 7: the one-group kernel (select_kv's pass 2): its timing floor without exponentials. Measured and
    # removed since (the default "kb pow2 1grp" 0.5226 in round s7r1, 0.5058 in s7r2): row sums as two partial sums
    # 0.5450, on the tensor cores 0.5761, a quarter of the exponentials on the degree-3 polynomial 0.5997, 4 stages
    # 0.5524; the sums stored by inline PTX 0.5148, 2 stages 0.5506, 8 warps on 128-key tiles 0.5601
    "kb pow2 1grp no exp (floor)": dict(kb_pow2=True, one_group=True, exp="none"),
}


def launch(ops, perm, out, *, poly3=(0, 0), exp="fp32", maxnreg=None, kb_pow2=False, gluon=None, num_stages=3,
           stagger=False, one_group=False, rtol=None):
    """The pair kernel alone on precomputed float8 operands ``ops`` = (q8, k8, qf, lse_s, kb), as
    ``selection.group_prob_sums`` launches it with fp8 (unstaggered, BLOCK_N 64, 4 warps, 3 stages). ``kb_pow2``:
    ``ops`` carries 2^KB in place of KB. ``gluon``: the Gluon kernel instead, with these tuning keywords. ``rtol``:
    the sums check's bound for this variant (not a launch parameter)."""
    q8, k8, qf, lse_s, kb = ops
    if gluon is not None:
        from comfyui_mc_sparse_pack.kernels.triton import selection_sm90

        return selection_sm90.group_prob_sums_fp8(q8, k8, qf, lse_s, kb, perm, out, group_size=C, **gluon)
    B, H, S, _ = q8.shape
    SK = k8.shape[2]
    n_slots = perm.shape[-1]
    G = n_slots // C
    extra = {} if maxnreg is None else dict(maxnreg=maxnreg)
    selection._group_prob_sums_pair[(G if one_group else triton.cdiv(G, 2), B * H)](
        q8, k8, lse_s, perm, out, qf, kb, qf, 1.0, H, S, SK, n_slots, C, G,
        *q8.stride(), *k8.stride(), *lse_s.stride(), *out.stride(), *selection._fused_topk_args(None, out, 4, qf)[0],
        HEAD_DIM=D, BLOCK_M=128, BLOCK_N=64, EXP_MODE=3 if exp == "none" else 0, STAGGER=stagger, FP8=True, POLY=0,
        P3_G0=poly3[0], P3_G1=poly3[1], KEY_BITS=16 if out.dtype == torch.float16 else 32, WITH_HIST=False,
        KB_POW2=kb_pow2, ONE_GROUP=one_group, num_warps=4, num_stages=num_stages, **extra)
    return out


GLUON_DEFAULT_VARIANT = "gluon ws default"


def spawn_precompile(names, shape="1.3b", go_file=None, log_dir=None):
    """One process per variant among ``names`` that compiles it for ``shape`` (float32 and float16 sums, the race's
    check and timing launches) into Triton's disk cache, so the race's first launches load it instead of compiling
    one variant after another (~5 s each): a Gluon variant only compiles (``warmup``: no kernel runs) until
    ``go_file`` exists, then (``go_file`` given) every variant is checked on random operands at ``shape`` against
    the Triton kernel in its own process (``_check_one``: an illegal address there cannot poison the caller's CUDA
    context; a Triton variant compiles there, at its first launches). Returns {name: process}
    (``wait_precompile``); logs in ``log_dir`` (None: discarded)."""
    procs = {}
    for name in names:
        if name in VARIANTS and (go_file is not None or VARIANTS[name].get("gluon") is not None):
            log = subprocess.DEVNULL if log_dir is None else open(Path(log_dir) / f"p2ws_child_{len(procs)}.log", "w")
            shapes = f"{shape},14b" if name == GLUON_DEFAULT_VARIANT and shape != "14b" else shape  # select_kv's
            procs[name] = subprocess.Popen(  # Gluon rows run at both shapes: its child checks both (14B on 5 heads)
                [sys.executable, __file__, "--precompile", name, "--shapes", shapes, "--out", "unused"]
                + ([] if go_file is None else ["--go", str(go_file)]), stdout=log, stderr=subprocess.STDOUT)
    return procs


def wait_precompile(procs, seconds):
    """Wait at most ``seconds`` in all for ``spawn_precompile``'s children (killing the ones still running);
    {name: exit status} (0: compiled and, with a go file, checked; None: killed)."""
    end = time.time() + seconds
    rcs = {}
    for name, p in procs.items():
        try:
            rcs[name] = p.wait(timeout=max(0.1, end - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            rcs[name] = None
    return rcs


def _check_one(name, shape, heads=None):
    """The variant on random operands at ``shape`` (bf16 q / k with a shared component per head, their LSE from
    cuDNN, random groups with -1 padding) against the Triton kernel (\"kb pow2\"): exit status 0
    when every entry is written and the sums are within the variant's bound; 3 otherwise."""
    H, S = heads or SHAPES[shape]["H"], math.prod(SHAPES[shape]["grid"])
    G = -(-S // C)
    gen = torch.Generator(device="cuda").manual_seed(20261201)
    q = (torch.randn(1, H, S, D, device="cuda", generator=gen)
         + torch.randn(1, H, 1, D, device="cuda", generator=gen)).to(torch.bfloat16)
    k = (torch.randn(1, H, S, D, device="cuda", generator=gen)
         + 2 * torch.randn(1, H, 1, D, device="cuda", generator=gen)).to(torch.bfloat16)
    _, lse = kernels.dense_attention(q, k, k, return_lse=True, backend="cuda_sdpa")  # no JIT compile in 8 children
    perm = torch.full((1, H, G * C), -1, dtype=torch.int32, device="cuda")
    for h in range(H):
        perm[0, h, :S] = torch.randperm(S, device="cuda", generator=gen).to(torch.int32)
    by_pow2 = variant_ops(selection.fp8_operands(q, k, lse.float(), D**-0.5))
    ref = launch_variant("kb pow2", by_pow2, perm, torch.full((1, H, G, S), float("nan"), device="cuda"))
    got = launch_variant(name, by_pow2, perm, torch.full((1, H, G, S), float("nan"), device="cuda"))
    # the race's timing launch (float16 sums): compiled into the cache, and checked too (the kernel stores each
    # dtype by its own code)
    got16 = launch_variant(name, by_pow2, perm, torch.full((1, H, G, S), float("nan"), dtype=torch.float16,
                                                             device="cuda"))
    torch.cuda.synchronize()
    nan = int(got.isnan().sum()) + int(got16.isnan().sum())
    rel = float(((got.double() - ref.double()).norm(dim=-1) / ref.double().norm(dim=-1)).max())
    rel16 = float(((got16.double() - ref.double()).norm(dim=-1) / ref.double().norm(dim=-1)).max())
    bound = VARIANTS[name].get("rtol", POLY_RTOL)
    ok = nan == 0 and (VARIANTS[name].get("exp") == "none" or (rel <= bound and rel16 <= bound + 1e-3))
    print(f"{name} {shape} H {H}: NaN left {nan}, rel L2 vs kb pow2 {rel:.2e} (float16 sums {rel16:.2e}; bound "
          f"{bound}, + 1e-3 for float16's rounding) -> {'ok' if ok else 'FAILED'}", flush=True)
    return ok


def _precompile_one(name, shapes, go_file=None):
    """``spawn_precompile``'s child: the variant's Gluon kernel compiled for the race's launches at each shape;
    then, once ``go_file`` exists (at most 300 s), ``_check_one`` at each (14B on 5 heads); exit status 3 if one
    fails."""
    for shape in shapes if VARIANTS[name].get("gluon") is not None else ():
        _compile_one(name, shape, HEADS_14B if shape == "14b" else None)
    if go_file:
        end = time.time() + 300
        while not Path(go_file).exists() and time.time() < end:
            time.sleep(0.2)
        ok = [_check_one(name, shape, HEADS_14B if shape == "14b" else None) for shape in shapes]
        sys.exit(0 if all(ok) else 3)


def _compile_one(name, shape, heads=None):
    """The variant's Gluon kernel compiled (``warmup``) for float32 and float16 sums at ``shape`` (``heads``: fewer
    heads, the same specialisation)."""
    from comfyui_mc_sparse_pack.kernels.triton import selection_sm90

    H, S = heads or SHAPES[shape]["H"], math.prod(SHAPES[shape]["grid"])
    G = -(-S // C)
    q8 = torch.empty(1, H, S, D, dtype=torch.float8_e4m3fn, device="cuda")
    k8 = torch.empty(1, H, S, D, dtype=torch.float8_e4m3fn, device="cuda")
    qf, lse_s, kb = (torch.empty(*s, dtype=torch.float32, device="cuda") for s in ((H,), (1, H, S), (1, H, S)))
    perm = torch.empty(1, H, G * C, dtype=torch.int32, device="cuda")
    for dtype in (torch.float32, torch.float16):
        out = torch.empty(1, H, G, S, dtype=dtype, device="cuda")
        grid, args, meta = selection_sm90.launch_args(q8, k8, qf, lse_s, kb, perm, out, group_size=C,
                                                      **VARIANTS[name]["gluon"])
        selection_sm90._pass2_fwd_sm90.warmup(*args, grid=grid, **meta)
        del out
    print(f"{name} {shape}: compiled", flush=True)


def variant_ops(ops):
    """{kb_pow2: operands}: ``ops`` from ``fp8_operands`` as they are (False) and with 2^KB in place of KB (True)."""
    return {False: ops, True: (*ops[:4], torch.exp2(ops[4]))}


def launch_variant(name, ops_by_pow2, perm, out):
    """VARIANTS[name] launched on the operands it reads (``variant_ops``): what the race in another process calls."""
    kw = VARIANTS[name]
    return launch(ops_by_pow2[bool(kw.get("kb_pow2"))], perm, out, **kw)


def float64_check(q, k, lse, perm, ops, sums, groups=4):
    """Relative L2 of the kernel's sums (fp32 [1, H, G, S]) against float64 sums of its dequantised operands on the
    first ``groups`` groups of head 0."""
    q8, k8, qf, lse_s, kb = ops
    (_, qs), (_, ks) = selection.fp8_stats(q[:, :1]), selection.fp8_stats(k[:, :1])
    p = perm[:, :1, : groups * C]
    ref = reference.group_prob_sums(q8[:, :1].double() * qs.double()[..., None, None],
                                    k8[:, :1].double() * ks.double()[..., None, None], lse_s[:, :1].double(), p,
                                    group_size=C)
    ref = ref * torch.exp2(kb[:, :1].double())[:, :, None, :]
    got = sums[:, :1, :groups].double()
    return float(((got - ref).norm(dim=-1) / ref.norm(dim=-1)).max())


def run_shape(name, H, grid, rep, names, log):
    S = math.prod(grid)
    gen = torch.Generator(device="cuda").manual_seed(20261201)
    sys.path.insert(0, str(ROOT / "tests"))
    from bench_anchor import dense_fns, structured_q  # noqa: E402 (the same inputs as bench_anchor)

    q = structured_q(H, grid, gen)
    k, v = (torch.randn(1, H, S, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    res = dict(S=S, H=H, dense={}, variants={})
    for dname, fn in dense_fns().items():
        fn(q, k, v)
        res["dense"][dname] = triton.testing.do_bench(lambda: fn(q, k, v), warmup=25, rep=rep, return_mode="median")
        log(f"{name} dense {dname} (LSE): {res['dense'][dname]:.3f} ms")
    best_name = min(res["dense"], key=res["dense"].get)
    best = res["dense"][best_name]
    res["best_dense"] = dict(name=best_name, ms=best)
    _, lse = kernels.dense_attention(q, k, v, return_lse=True, backend=best_name)
    hc = H if name == "1.3b" else HEADS_14B
    q, k, lse = q[:, :hc], k[:, :hc], lse[:, :hc]
    del v
    perm = grouping.pddp_groups(q, C).contiguous()
    ops = selection.fp8_operands(q, k, lse, D**-0.5)
    by_pow2 = variant_ops(ops)
    G = perm.shape[-1] // C
    want = launch(ops, perm, torch.full((1, hc, G, S), float("nan"), device="cuda"))
    res["default_vs_float64"] = float64_check(q, k, lse, perm, ops, want)
    log(f"{name} default kernel vs float64 of its operands (4 groups): rel L2 {res['default_vs_float64']:.2e} "
        f"({'ok' if res['default_vs_float64'] < 5e-4 else 'FAILED'})")
    out16 = torch.empty(1, hc, G, S, dtype=torch.float16, device="cuda")
    for vname in names:
        kw = VARIANTS[vname]
        r = res["variants"][vname] = {}
        try:
            vops = by_pow2[bool(kw.get("kb_pow2"))]
            got = launch(vops, perm, torch.full((1, hc, G, S), float("nan"), device="cuda"), **kw)
            torch.cuda.synchronize()
            if bool(got.isnan().any()):
                raise AssertionError("NaN left in the output (an entry not written)")
            if kw.get("exp") != "none":
                rel = float(((got.double() - want.double()).norm(dim=-1) / want.double().norm(dim=-1)).max())
                r["rel_l2_vs_default"] = rel
                if rel > kw.get("rtol", POLY_RTOL):
                    raise AssertionError(f"sums differ from the default kernel's by {rel:.2e} relative L2 "
                                         f"(> {kw.get('rtol', POLY_RTOL)})")
            del got
            launch(vops, perm, out16, **kw)
            ms = triton.testing.do_bench(lambda kw=kw, vops=vops: launch(vops, perm, out16, **kw), warmup=25, rep=rep,
                                         return_mode="median")
            r["ms"] = ms
            r["over_dense"] = ms * H / hc / best
            log(f"{name} pass-2 kernel {vname}: {r['over_dense']:.4f} of dense ({ms:.3f} ms on {hc} heads; "
                f"rel L2 vs default {r.get('rel_l2_vs_default', 'n/a')})")
        except Exception as err:  # noqa: BLE001 (a variant that fails is reported, the others still run)
            r["error"] = f"{type(err).__name__}: {str(err)[:300]}"
            log(f"{name} pass-2 kernel {vname}: FAILED {r['error']}")
            traceback.print_exc()
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="1.3b,14b")
    ap.add_argument("--variants", help="comma-separated VARIANTS names (default: all)")
    ap.add_argument("--rep", type=int, default=100, help="do_bench budget per measurement, ms")
    ap.add_argument("--commit", default="")
    ap.add_argument("--precompile", help="(spawn_precompile's children) compile this Gluon variant and exit")
    ap.add_argument("--go", help="(spawn_precompile's children) then check it once this file exists")
    args = ap.parse_args()
    if args.precompile:
        _precompile_one(args.precompile, args.shapes.split(","), args.go)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = list(VARIANTS) if not args.variants else [n.strip() for n in args.variants.split(",")]
    t0 = time.time()

    def log(msg):
        print(f"[{time.time() - t0:6.1f} s] {msg}", flush=True)

    report = dict(commit=args.commit, command=" ".join(sys.argv), gpu=torch.cuda.get_device_name(), shapes={})
    score = {}
    for name in args.shapes.split(","):
        res = report["shapes"][name] = run_shape(name, SHAPES[name]["H"], SHAPES[name]["grid"], args.rep, names, log)
        (out / "bench_pass2_exp.json").write_text(json.dumps(report, indent=1))
        ok = {n: r["over_dense"] for n, r in res["variants"].items() if "over_dense" in r and n != "no exp (floor)"}
        if "default" in ok:
            score[f"pass2_kernel_over_dense_{name}"] = ok["default"]
        if ok:
            bestv = min(ok, key=ok.get)
            score[f"pass2_kernel_best_variant_over_dense_{name}"] = dict(value=ok[bestv], variant=bestv)
            log(f"{name} summary: " + " | ".join(f"{n} {v:.4f}" for n, v in ok.items()) + f" | best {bestv}")
    (out / "summary.json").write_text(json.dumps(dict(commit=args.commit, command=report["command"], keys=score),
                                                    indent=1))
    log("done")


if __name__ == "__main__":
    main()
