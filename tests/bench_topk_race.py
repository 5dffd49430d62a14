"""The separate top-K (``topk.top_k_rows``) launch variants / flash-attn-4 dense, in one race (issue 15, p2ops).

Not collected by pytest. At Wan2.1-1.3B 480p (tests/bench_select_race.py's inputs: S = 32760, H = 12, C = 128; the
float16 group sums of the Triton pass-2 kernel, 3072 rows of 32760 keys) for s in ``--densities``: each variant of
``VARIANTS`` (``--variants``: names, comma-separated; default all) is checked first (== the brute-force top-K of the
sums, kernels/reference/topk.py, every row; the share of rows that fell back to the radix launch recorded), then
dense and every checked variant are raced (tests/_timing.race, the method of record) at each density, with the
float8 operand pass (``selection.fp8_operands``) in its two program orders (rows "operands", "operands rev": the
quantising pass from the last head; ``quant_reverse``). Prints lines
"TOPK CHECK" / "TOPK RACE" and writes OUT/bench_topk_race.json.
``--select``: last, select_kv at each density with the launch of the variant whose worst ratio was lowest
(``topk_launch``) beside its defaults (checked equal first), dense in the same race (line "SELECT RACE").
Usage (checkout root, H200): python tests/bench_topk_race.py --out OUT [--commit HASH] [--variants a,b] [--rounds 5]
[--select]
The variants compile first in child processes (one per variant, Triton's cache), beside the inputs' making.
Expected: ~30 s start-up, ~5 s per density's checks and race.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
if "--smoke" in sys.argv:  # the CPU smoke run: Triton's interpreter with the tests' fixes
    import _triton_interp

    _triton_interp.patch_interpreter()
import bench_select_race as bsr  # noqa: E402  (loads the pack)

topk = bsr.topk
selection = bsr.selection
ref_top_k_rows = bsr.ref_top_k_rows

# name -> top_k_rows keyword arguments. "count": select_kv's separate top-K today (2 warps, one 16-byte tile row per
# thread per step, the threshold among the candidates counted from memory one bit per pass); "regs": the copies held
# in registers (``_cand_threshold_regs``); wN: warps per row, bN: keys per sweep step (256 x warps: one 16-byte tile
# row per thread), rN: register cap (0: none). Offline sm_90 (ptxas): count 96 registers uncapped (72 capped, the
# default), count w8 b2048 121, regs w8 b2048 156, regs w16 b4096 114, regs w16 b8192 128, all without spills; l2:
# the row prefetched into L2 first (``topk._prefetch_l2``); persist: one program per SM looping over rows, each
# prefetching its next row into L2 before this one (offline: w8 255 registers, w16 128 with 72 bytes spilled);
# split: kernels/triton/topk_split.py (rows x chunks programs; c16: 16 chunks, w4: 4 warps per chunk program)
VARIANTS = {
    "count": dict(cand_count=1),
    "count w8 b2048 r128": dict(cand_count=1, num_warps=8, block=2048, maxnreg=128),
    "regs w8 b2048": dict(cand_regs=True, num_warps=8, block=2048, maxnreg=0),
    "regs w8 b2048 r128": dict(cand_regs=True, num_warps=8, block=2048, maxnreg=128),
    "regs w16 b4096": dict(cand_regs=True, num_warps=16, block=4096, maxnreg=0),
    "regs w16 b8192": dict(cand_regs=True, num_warps=16, block=8192, maxnreg=0),
    "regs w8 b2048 l2": dict(cand_regs=True, num_warps=8, block=2048, maxnreg=0, l2_prefetch=True),
    "regs w16 b4096 l2": dict(cand_regs=True, num_warps=16, block=4096, maxnreg=0, l2_prefetch=True),
    "regs w8 b2048 l2 persist": dict(cand_regs=True, num_warps=8, block=2048, maxnreg=0, l2_prefetch=True, persist=1),
    "regs w16 b4096 l2 persist": dict(cand_regs=True, num_warps=16, block=4096, maxnreg=0, l2_prefetch=True,
                                      persist=1),
    "split": dict(split={}),
    "split c16": dict(split=dict(chunks=16)),
    "split w4": dict(split=dict(num_warps=4)),
}


def compile_only(names, densities, S=32760, H=12, G=256):
    """(child) each variant's kernels compiled into Triton's cache: the launches of the race's shapes on random sums."""
    sums = torch.rand(1, H, G, S, device="cuda").half()
    for s in densities:
        kq = int(s * S)
        width = -(-kq // bsr.KV_TILE) * bsr.KV_TILE
        sel = torch.empty(1, H, G, width, dtype=torch.int32, device="cuda")
        for name in names:
            topk.top_k_rows(sums, kq, width, out=sel, **VARIANTS[name])
    torch.cuda.synchronize()


def spawn_compiles(names, densities):
    """One child process per variant compiling its kernels (``compile_only``) while the parent makes its inputs."""
    return [subprocess.Popen([sys.executable, __file__, "--out", "/tmp", "--compile-only", "--variants", name,
                              "--densities", densities], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for name in names]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compile-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child-wait", type=float, default=45.0, help="s from start the compile children get")
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", default="")
    ap.add_argument("--variants", default="")
    ap.add_argument("--densities", default="0.1,0.25,0.5")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="TRITON_INTERPRET=1 on the CPU: a tiny shape, single calls")
    ap.add_argument("--select", action="store_true", help="last, select_kv with the best variant's launch "
                    "(topk_launch) beside its defaults and dense (the CuTeDSL pass 2 compiled in a child first)")
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    shape = "smoke" if args.smoke else "1.3b"
    bsr.SMOKE = args.smoke
    names = [n for n in args.variants.split(",") if n] or list(VARIANTS)
    if args.compile_only:
        return compile_only(names, [float(x) for x in args.densities.split(",")])
    children = [] if args.smoke else spawn_compiles(names, args.densities)
    if args.select and not args.smoke:  # select_kv's defaults compiled (CuTeDSL pass 2 into its disk cache) and checked
        children.append(subprocess.Popen([sys.executable, str(Path(__file__).with_name("bench_select_race.py")),
                                          "--out", str(out_dir), "--precompile", "1.3b", "--rows", "defaults"],
                                         stdout=open(out_dir / "select_child.log", "w"), stderr=subprocess.STDOUT))
    t0 = time.time()
    report = dict(commit=args.commit, gpu=None if args.smoke else torch.cuda.get_device_name(), checks={}, races={})

    def log(msg):
        print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)

    def save():
        (out_dir / "bench_topk_race.json").write_text(json.dumps(report, indent=1))

    q, k, v, lse, perm = bsr.make_inputs(shape)
    S, H = q.shape[2], q.shape[1]
    G = perm.shape[-1] // bsr.C
    sums = torch.empty(1, H, G, S, dtype=torch.float16, device=q.device)
    selection.group_prob_sums(q, k, lse, perm, group_size=bsr.C, out=sums, cute=False)
    log(f"inputs {shape}: S {S}, H {H}, G {G}, sums {tuple(sums.shape)}")
    for child in children:  # (a child that fails or hangs only costs the compile in this process)
        try:
            child.wait(timeout=max(1.0, args.child_wait - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            child.kill()
    log(f"compile children: rc {[c.returncode for c in children]}")
    # a variant whose child did not end cleanly (a compile error, a fault, a hang) is not run here: a faulting
    # kernel would end this process
    names = [n for n, c in zip(names, children) if c.returncode == 0] if children else names
    _, dense = bsr.dense_fn(q, k, v)
    for s in (float(x) for x in args.densities.split(",")):
        kq = int(s * S)
        width = -(-kq // bsr.KV_TILE) * bsr.KV_TILE
        want = ref_top_k_rows(sums, kq, width)
        fns = {"dense": dense}
        for tag, rev in (("operands", False), ("operands rev", True)):  # the float8 operand pass, in each race
            fns[tag] = (lambda rev: lambda: selection.fp8_operands(q, k, lse, bsr.D**-0.5, kb_pow2=True,
                                                                   quant_reverse=rev))(rev)
        for name in names:
            kw = VARIANTS[name]
            sel = torch.full((1, H, G, width), -7, dtype=torch.int32, device=q.device)
            try:
                _, fell = topk.top_k_rows(sums, kq, width, out=sel, return_fallbacks=True, **kw)
                ok = bool(torch.equal(sel, want))
                report["checks"][f"{name} s={s}"] = dict(equal=ok, fallback_rows=float(fell.float().mean()))
                if ok:
                    fns[name] = (lambda kw, sel: lambda: topk.top_k_rows(sums, kq, width, out=sel, **kw))(kw, sel)
                else:
                    log(f"TOPK CHECK FAILED {name} s={s}: differs from the brute-force top-K")
            except Exception as err:  # noqa: BLE001
                report["checks"][f"{name} s={s}"] = dict(error=f"{type(err).__name__}: {str(err)[:300]}")
                log(f"TOPK CHECK FAILED {name} s={s}: {type(err).__name__}: {str(err)[:300]}")
                traceback.print_exc()
        del want
        log(f"TOPK CHECKS s={s}: " + ", ".join(
            f"{n} {'ok' if c.get('equal') else 'FAILED'} fb {c.get('fallback_rows', float('nan')):.4f}"
            for n, c in report["checks"].items() if n.endswith(f" s={s}")))
        save()
        ms = bsr.race(fns, rounds=args.rounds)
        over = {n: t / ms["dense"] for n, t in ms.items() if n != "dense"}
        report["races"][f"s={s}"] = dict(dense_ms=ms["dense"], ms=ms, over_dense=over)
        log(f"TOPK RACE s={s} (dense {ms['dense']:.3f} ms): " + " | ".join(f"{n} {r:.4f}" for n, r in over.items()))
        save()
    if args.select:
        try:
            report["select"] = select_race(report, names, q, k, v, lse, perm, dense, args,
                                           cute_ok=args.smoke or children[-1].returncode == 0, log=log)
        except Exception as err:  # noqa: BLE001
            report["select"] = dict(error=f"{type(err).__name__}: {str(err)[:300]}")
            log(f"SELECT FAILED: {report['select']['error']}")
            traceback.print_exc()
        save()
    log("done")


def select_race(report, names, q, k, v, lse, perm, dense, args, cute_ok, log):
    """select_kv with the launch of the variant whose worst top-K ratio over the densities was lowest (``topk_launch``)
    beside select_kv's defaults, at each density in one race with dense; its selection checked == the defaults' first
    (the same pass 2: the same sums). Without the CuTeDSL child's pass (compile / check), both rows take the Triton
    pass 2 without its fused top-K (cute=False, topk_fused=False)."""
    worst = {n: max(report["races"][f"s={float(s)}"]["over_dense"].get(n, math.inf)
                    for s in args.densities.split(",")) for n in names}
    best = min(worst, key=worst.get)
    launch = {key: val for key, val in VARIANTS[best].items() if key != "cand_count"}
    extra = dict(topk_count=VARIANTS[best]["cand_count"]) if "cand_count" in VARIANTS[best] else {}
    kw = {} if cute_ok else dict(cute=False, topk_fused=False)  # (the Triton pass 2 + the separate top-K)
    S = q.shape[2]
    fns = {"dense": dense}
    for s in (float(x) for x in args.densities.split(",")):
        kq = int(s * S)
        run = lambda kq, more: lambda: selection.select_kv(q, k, lse, perm, kq, group_size=bsr.C,  # noqa: E731
                                                           kv_tile=bsr.KV_TILE, **kw, **more)
        if not torch.equal(run(kq, {})(), run(kq, dict(topk_launch=launch, **extra))()):
            raise AssertionError(f"select_kv with {best}'s launch differs from its defaults at s={s}")
        fns[f"defaults s={s}"] = run(kq, {})
        fns[f"{best} s={s}"] = run(kq, dict(topk_launch=launch, **extra))
    ms = bsr.race(fns, rounds=args.rounds)
    over = {n: t / ms["dense"] for n, t in ms.items() if n != "dense"}
    log(f"SELECT RACE (dense {ms['dense']:.3f} ms, cute {cute_ok}, best top-K '{best}' worst {worst[best]:.4f}): "
        + " | ".join(f"{n} {r:.4f}" for n, r in over.items()))
    return dict(best=best, worst=worst, cute=cute_ok, dense_ms=ms["dense"], ms=ms, over_dense=over)


if __name__ == "__main__":
    main()
