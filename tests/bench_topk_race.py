"""select_kv's separate top-K and float8 operand pass: launch variants / flash-attn-4 dense, in one race (issue 15,
p2ops).

Not collected by pytest. At Wan2.1-1.3B 480p (tests/bench_select_race.py's inputs: S = 32760, H = 12, C = 128; the
float16 group sums of the CuTeDSL pass 2 where it runs, else the Triton one: 3072 rows of 32760 keys), for s in
``--densities``: every top-K row is CHECKED first (line "TOPK CHECKS": == the brute-force top-K of the sums,
kernels/reference/topk.py, every row; also on "twin" sums, every odd key a copy of its even neighbour), then dense and
every checked row are raced (tests/_timing.race, the method of record; line "TOPK RACE"): the top-K launches of
``TOPK`` alone on the same sums and, where the CuTeDSL pass 2 compiled, after pass 2 on precomputed float8 operands
("p2+..."; "p2 alone" beside them), and the operand pass's launch tunings of ``OPERANDS``.
Usage (checkout root, H200): python tests/bench_topk_race.py --out OUT [--commit HASH] [--densities 0.5,0.25,0.1]
[--rounds 5] [--child-wait 50] [--smoke: CPU, TRITON_INTERPRET=1, tiny shape, single calls]. The variants' Triton
compiles and the CuTeDSL pass 2 run first in two child processes beside the inputs (a variant row runs only where its
child ended cleanly). Writes OUT/bench_topk_race.json after each density. (Round s11r1 raced the CuTeDSL top-K launch
here; it lost and was removed.)
"""

from __future__ import annotations

import argparse
import json
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

# the separate top-K's launch variants (``topk.top_k_rows`` keywords; "count": select_kv's, 4 warps per row, 64
# registers since round s11r2, the bracket method; "seg": kernels/triton/topk_seg.py, select_kv's since round s13r2;
# entries named ``_X``: topk module globals for the call, ``run_topk``). Round s13r2 (1.3B, / dense, s = 0.5 / 0.1):
# count 0.0494 / 0.0404, seg 0.0444 / 0.0377, seg rev 0.0441 / 0.0372, seg at 48 registers 0.0447 / 0.0374, 8 warps
# 0.0430 / 0.0386, loads two steps ahead 0.0437 / 0.0381 (the last four removed). Raced and removed after round s11r2:
# 2 warps at 72 registers (the session-10 default), register caps 64 / 80 at 2 warps, one warp per row, the compaction
# on lane-major tiles (docs/kernels.md)
TOPK = {"count": dict(method="bracket", cand_count=1), "seg": dict(method="seg")}


def run_topk(src, kq, width, sel, kw):
    """topk.top_k_rows with a TOPK row's keywords; its ``_NAME`` entries are topk module globals set for the call."""
    glob = {n: v for n, v in kw.items() if n.startswith("_")}
    old = {n: getattr(topk, n) for n in glob}
    for n, v in glob.items():
        setattr(topk, n, v)
    try:
        return topk.top_k_rows(src, kq, width, out=sel, **{n: v for n, v in kw.items() if n not in glob})
    finally:
        for n, v in old.items():
            setattr(topk, n, v)


# the float8 operand pass's launch tuning (``selection.fp8_operands`` keywords; "operands": select_kv's, 264 statistics
# programs per tensor since round s11r2; "p528": the previous 528)
OPERANDS = {"operands": {}, "operands p528": dict(stats_programs=528)}


def compile_child(what, densities, S=32760):
    """(child) pass 2 ("pass2": the CuTeDSL kernel) compiled into the disk cache, or every ``TOPK`` launch ("topk")
    ("topk0" / "topk1": every other one) or ``OPERANDS`` config ("ops") run once on random inputs of the race's
    shapes (Triton's cache)."""
    if what == "pass2":
        from comfyui_mc_sparse_pack.kernels.cutedsl import pass2_sm90

        pass2_sm90.compiled("float16")
        return
    if what == "ops":
        q, k = (torch.randn(1, 12, S, bsr.D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        lse = torch.randn(1, 12, S, device="cuda") + 10.0
        for kw in OPERANDS.values():
            selection.fp8_operands(q, k, lse, bsr.D ** -0.5, kb_pow2=True, **kw)
        torch.cuda.synchronize()
        return
    sums = torch.rand(1, 12, 256, S, device="cuda").half()
    part = int(what[-1])  # ("topk0" / "topk1": every other variant)
    for s in densities:
        kq = int(s * S)
        width = -(-kq // bsr.KV_TILE) * bsr.KV_TILE
        sel = torch.empty(1, 12, 256, width, dtype=torch.int32, device="cuda")
        for kw in list(TOPK.values())[part::2]:
            run_topk(sums, kq, width, sel, kw)
    torch.cuda.synchronize()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    ap.add_argument("--child-wait", type=float, default=50.0, help="s from start the compile children get")
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", default="")
    ap.add_argument("--densities", default="0.5,0.25,0.1")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="TRITON_INTERPRET=1 on the CPU: a tiny shape, single calls, "
                    "no CuTeDSL rows")
    args = ap.parse_args()
    bsr.SMOKE = args.smoke
    dens = [float(x) for x in args.densities.split(",")]
    if args.child:
        return compile_child(args.child, dens)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    children = {} if args.smoke else {w: subprocess.Popen([sys.executable, __file__, "--out", "/tmp", "--child", w, "--densities",
                                     args.densities], stdout=open(out_dir / f"child_{w}.log", "w"),
                                    stderr=subprocess.STDOUT) for w in ("topk0", "topk1", "ops", "pass2")}
    t0 = time.time()
    report = dict(commit=args.commit, gpu=None if args.smoke else torch.cuda.get_device_name(), checks={}, races={},
                  errors={})

    def log(msg):
        print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)

    def save():
        (out_dir / "bench_topk_race.json").write_text(json.dumps(report, indent=1))

    q, k, v, lse, perm = bsr.make_inputs("smoke" if args.smoke else "1.3b")
    S, H = q.shape[2], q.shape[1]
    G = perm.shape[-1] // bsr.C
    scale = bsr.D ** -0.5
    ops = selection.fp8_operands(q, k, lse, scale, kb_pow2=True)
    log(f"inputs: S {S}, H {H}, G {G}")
    for w, child in children.items():  # (a child that fails or hangs only costs its rows)
        try:
            child.wait(timeout=max(1.0, args.child_wait - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    rc = {w: c.returncode for w, c in children.items()} if children else dict(topk0=0, topk1=0, ops=0, pass2=1)  # (smoke)
    log(f"compile children rc {rc}")
    sums = torch.empty(1, H, G, S, dtype=torch.float16, device=q.device)
    p2 = None
    if rc["pass2"] == 0:
        from comfyui_mc_sparse_pack.kernels.cutedsl import pass2_sm90

        p2 = lambda: pass2_sm90.group_prob_sums_fp8(*ops, perm, sums, group_size=bsr.C)  # noqa: E731
        p2()
    else:
        selection.group_prob_sums(q, k, lse, perm, group_size=bsr.C, out=sums, cute=False)
    twin = sums.clone()
    twin[..., 1::2] = twin[..., 0::2]
    log(f"sums from {'the CuTeDSL' if p2 else 'the Triton'} pass 2")
    _, dense = bsr.dense_fn(q, k, v)
    for s in dens:
        kq = int(s * S)
        width = -(-kq // bsr.KV_TILE) * bsr.KV_TILE
        rows = {name: (lambda src, sel, kq=kq, width=width, kw=kw: run_topk(src, kq, width, sel, kw))
                for i, (name, kw) in enumerate(TOPK.items()) if rc[f"topk{i % 2}"] == 0 or name == "count"}
        fns = {"dense": dense}
        for name, kw in (OPERANDS if rc["ops"] == 0 else {"operands": {}}).items():
            fns[name] = (lambda kw: lambda: selection.fp8_operands(q, k, lse, scale, kb_pow2=True, **kw))(kw)
        for tag, src in (("", sums), (" twin", twin)):
            want = ref_top_k_rows(src, kq, width)
            for name, fn in rows.items():
                sel = torch.full((1, H, G, width), -7, dtype=torch.int32, device=q.device)
                key = f"{name}{tag} s={s}"
                try:
                    fn(src, sel)
                    ok = bool(torch.equal(sel, want))
                    report["checks"][key] = dict(equal=ok, bad_rows=int((sel != want).any(-1).sum()))
                    if ok and not tag:
                        fns[name] = (lambda fn, sel: lambda: fn(sums, sel))(fn, sel)
                        if p2 is not None:
                            fns[f"p2+{name}"] = (lambda fn, sel: lambda: (p2(), fn(sums, sel)))(fn, sel)
                    if not ok:
                        log(f"TOPK CHECK FAILED {key}: {report['checks'][key]['bad_rows']} rows differ")
                except Exception as err:  # noqa: BLE001
                    report["checks"][key] = dict(error=f"{type(err).__name__}: {str(err)[:300]}")
                    log(f"TOPK CHECK FAILED {key}: {report['checks'][key]['error']}")
                    traceback.print_exc()
            del want
        if p2 is not None:
            fns["p2 alone"] = p2
        log(f"TOPK CHECKS s={s}: " + ", ".join(f"{n.rsplit(' s=', 1)[0]} {'ok' if c.get('equal') else 'FAILED'}"
                                               for n, c in report["checks"].items() if n.endswith(f" s={s}")))
        save()
        try:
            ms = bsr.race(fns, rounds=args.rounds)
        except Exception as err:  # noqa: BLE001
            report["errors"][f"race s={s}"] = f"{type(err).__name__}: {str(err)[:300]}"
            log(f"TOPK RACE FAILED s={s}: {report['errors'][f'race s={s}']}")
            save()
            break
        over = {n: x / ms["dense"] for n, x in ms.items() if n != "dense"}
        report["races"][f"s={s}"] = dict(dense_ms=ms["dense"], ms=ms, over_dense=over)
        log(f"TOPK RACE s={s} (dense {ms['dense']:.3f} ms): " + " | ".join(f"{n} {r:.4f}" for n, r in over.items()))
        save()
    log("done")


if __name__ == "__main__":
    main()
