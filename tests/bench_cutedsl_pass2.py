"""The CuTeDSL pass-2 kernel (kernels/cutedsl/pass2_sm90.py) alone / flash-attn-4 dense, its launch variants side by
side with the Triton one-group pass-2 kernel, by the timing method of record (tests/_timing.race; issue 15).

Not collected by pytest. Inputs: tests/bench_select_race.py's (Wan2.1-1.3B 480p: S = 32760, H = 12; 14B 720p: S =
75600, H = 40; D = C = 128, bf16, structured queries, PDDP groups). On the float8 operands of
``selection.fp8_operands(kb_pow2=True)`` (computed once, not timed):

1. CHECK per variant before any timing: its float16 sums against the Triton one-group kernel's on all heads (every
   entry written: NaN-poisoned output; max relative L2 per group <= 1e-3, poly <= 2e-3); a failing variant is not
   timed ("CHECK FAILED").
2. RACE: flash-attn-4 dense with LSE (``kernels.dense_attention(..., backend="flash_attn4")``), the Triton one-group
   kernel alone (``bench_select_race.launch_pair``) and every checked CuTeDSL variant alone, in the same rounds;
   ratios / dense printed side by side with the dense ms.

``cute_rows`` is what tests/bench_select_race.py can import for its own race 2. Usage (checkout root, H200):
``python tests/bench_cutedsl_pass2.py --out OUT [--shapes 1.3b] [--variants "st4,st4 p8,st6"] [--commit HASH]``;
a variant is ``st<stages>`` with optional `` p<poly>`` (`` d2``: of degree 2), `` c<ctas>``, `` k<ksplit>`` (else
``auto_ksplit``), `` ls`` (lse_smem), `` qs`` (qsplit 1: query-half wgmmas), `` qr`` (qsplit 2: rolled over pairs
of tiles), `` wg4`` (four consumer warpgroups), `` pr`` (two query groups per work item), `` ov`` (with pr:
overlapped wgmmas), `` u1`` (``unit_qf``: on ``fp8_operands(unit_qf=True)``'s operands, checked against the
Triton sums of those), `` tk`` (the top-K fused, K = --topk-density x Sk: checked against the brute-force top-K of
its own sums too; raced beside the same variant without it at auto ksplit + the separate top-K, select_kv's route;
with `` u1`` also `` npr``: unit_qf runs without pair), `` nols`` / `` npr`` (those defaults off), or a timing floor
`` noexp`` / `` nomma`` / `` noload`` (no key tiles from L2 after the first ring) (wrong sums: timed without the
check).
Writes OUT/bench_cutedsl_pass2.json (after the checks, again after the race). ``--clocks SEC``: then each raced row
back to back for SEC seconds under nvidia-smi sampling (lines "CLOCKS": ms, SM MHz, W, Mcycles per call; the H200
runs power-capped, so a row's clock says its energy per call).
Expected at 1.3B: ~10 s inputs, ~5 s per variant compile (first process on a machine), ~2 s race.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
import bench_select_race as bsr  # noqa: E402  (loads the pack)

from comfyui_mc_sparse_pack.kernels.triton import selection  # noqa: E402

# the compile-time keys
COMPILED = ("stages", "poly", "lse_smem", "qsplit", "diag", "topk", "wg4", "pair", "overlap", "unit_qf", "poly_deg")
FLAGS = {"ls": "lse_smem", "qs": "qsplit", "tk": "topk", "wg4": "wg4", "pr": "pair",
         "ov": "overlap", "u1": "unit_qf"}
TOPK_DENSITY = 0.25  # the fused top-K variants ("tk") select K = 0.25 x Sk keys per group (--topk-density)
OFF = {"nols": "lse_smem", "npr": "pair"}
DEFAULT_VARIANTS = "st4,st4 k1,st4 qr,st4 p4,st6"


def parse_variant(text: str) -> dict:
    """'st4 p8 c132 k2 qs ls' -> dict(stages=4, poly=8, num_ctas=132, ksplit=2, qsplit=True, lse_smem=True)."""
    keys = {"st": "stages", "p": "poly", "c": "num_ctas", "k": "ksplit", "d": "poly_deg"}
    out = {}
    for tok in text.split():
        if tok in FLAGS:
            out[FLAGS[tok]] = True
            continue
        if tok in OFF:  # a default option turned off
            out[OFF[tok]] = False
            continue
        if tok == "qr":  # qsplit 2: the query halves' wgmmas rolled over tile pairs
            out["qsplit"] = 2
            continue
        if tok in ("noexp", "nomma", "noload"):  # timing floors (wrong sums: not checked, timed only)
            out["diag"] = tok
            continue
        for pre in ("st", "p", "c", "k", "d"):
            if tok.startswith(pre) and tok[len(pre):].isdigit():
                out[keys[pre]] = int(tok[len(pre):])
                break
        else:
            raise ValueError(f"bad variant token {tok!r} in {text!r}")
    return out


def cute_rows(ops, perm, ref16, variants, log, ref_u1=None):
    """{row name: zero-argument callable} of the CuTeDSL variants whose check passed, and {name: check result}.
    ``ops``: ``fp8_operands(kb_pow2=True)``; ``ref16``: the Triton kernel's float16 sums [B, H, G, Sk]; ``ref_u1``:
    (``fp8_operands(kb_pow2=True, unit_qf=True)``, the Triton sums of those) for the ``u1`` variants."""
    from comfyui_mc_sparse_pack.kernels.cutedsl import pass2_launch
    from comfyui_mc_sparse_pack.kernels.cutedsl import pass2_sm90 as p2
    from comfyui_mc_sparse_pack.kernels.triton import topk

    fns, res = {}, {}
    for text in variants:
        name = f"cute {text}"
        q8, k8, qf, lse_s, kb = ops
        ref = ref16
        try:
            tun = parse_variant(text)
            if tun.get("unit_qf"):
                (q8, k8, qf, lse_s, kb), ref = ref_u1
            t = time.time()
            p2.compiled("float16", **{key: tun[key] for key in COMPILED if key in tun})
            got = torch.full_like(ref, float("nan"))
            run = dict(tun)
            sel_ok = True
            if run.pop("topk", False):
                kq = int(TOPK_DENSITY * ref16.shape[-1])
                width = -(-kq // bsr.KV_TILE) * bsr.KV_TILE
                sel = torch.full((*ref16.shape[:3], width), -7, dtype=torch.int32, device=ref16.device)
                run["select"] = (sel, kq)
            p2.group_prob_sums_fp8(q8, k8, qf, lse_s, kb, perm, got, group_size=bsr.C, **run)
            torch.cuda.synchronize()
            rel = float(((got.double() - ref.double()).norm(dim=-1) / ref.double().norm(dim=-1)).max())
            if "select" in run:  # the fused selection == the brute-force top-K of the kernel's own sums
                rows_bad = int((sel != bsr.ref_top_k_rows(got, kq, width)).any(-1).sum())
                flagged = int(pass2_launch.flags(got.device, sel[..., 0].numel()).sum())
                sel_ok = rows_bad == 0
                log(f"CHECK {name}: selection rows differing from the brute-force top-K {rows_bad} of "
                    f"{sel[..., 0].numel()} (radix-launch rows {flagged})")
            ok = sel_ok and (rel <= (2e-3 if tun.get("poly") else 1e-3) or bool(tun.get("diag")))  # (nan -> False)
            res[name] = dict(rel_l2=rel, ok=ok, compile_s=round(time.time() - t, 1))
            log(f"CHECK {name}: max rel L2 per group vs Triton {rel:.2e} ({res[name]['compile_s']} s)"
                + ("" if ok else "  CHECK FAILED"))
            if ok:
                out = torch.empty_like(ref16)
                fns[name] = (lambda run, out, o: lambda: p2.group_prob_sums_fp8(
                    *o, perm, out, group_size=bsr.C, **run))(run, out, (q8, k8, qf, lse_s, kb))
                if "select" in run:  # today's route beside it: the same kernel unfused (auto ksplit) + the top-K
                    sep = {key: val for key, val in run.items() if key not in ("select", "ksplit")}
                    sep_text = " ".join(t for t in text.split()
                                        if t != "tk" and not (t[0] == "k" and t[1:].isdigit()))
                    fns[f"cute {sep_text} + separate top-K"] = (lambda sep, out, o, sel, kq: lambda: topk.top_k_rows(
                        p2.group_prob_sums_fp8(*o, perm, out, group_size=bsr.C, **sep), kq, sel.shape[-1], out=sel,
                        cand_count=1))(sep, out, (q8, k8, qf, lse_s, kb), torch.empty_like(sel), kq)
            del got
        except Exception as err:  # noqa: BLE001 (a variant that fails to compile or run is reported, not timed)
            res[name] = dict(ok=False, error=f"{type(err).__name__}: {str(err)[:400]}")
            log(f"CHECK {name}: {res[name]['error']}  CHECK FAILED")
    return fns, res


def clocks(fns, seconds, smi_path, log):
    """Each of ``fns`` called back to back for ~``seconds`` while nvidia-smi samples the SM clock and board power
    (tests/bench_cutedsl_clocks.py's sampler; the first 0.3 s of each segment left out): {row: ms, MHz, W, reasons,
    Mcycles per call}. Not the method of record (rows run one after another): it says at which clock each row ran."""
    import bench_cutedsl_clocks as bcc

    proc, _ = bcc.sampler(20, str(smi_path))
    segs = []
    try:
        for row, fn in fns.items():
            t0, t1, ms = bcc.segment(fn, seconds)
            segs.append((row, t0 + 0.3, t1, ms))
    finally:
        time.sleep(0.2)
        proc.terminate()
        proc.wait()
    samples = bcc.parse(Path(smi_path).read_text().splitlines())
    out = {}
    for row, t0, t1, ms in segs:
        inside = [x for x in samples if t0 <= x[0] <= t1]
        if not inside:
            out[row] = dict(ms=ms)
            continue
        mhz = sum(x[1] for x in inside) / len(inside)
        out[row] = dict(ms=ms, mhz=mhz, watts=sum(x[2] for x in inside) / len(inside),
                        reasons=sorted({x[4] for x in inside}), mcycles=ms * mhz / 1e3, samples=len(inside))
        log(f"CLOCKS {row}: {ms:.3f} ms at {mhz:.0f} MHz, {out[row]['watts']:.0f} W = {out[row]['mcycles']:.3f} "
            f"Mcycles per call; reasons {out[row]['reasons']}")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="1.3b")
    ap.add_argument("--variants", default=DEFAULT_VARIANTS)
    ap.add_argument("--commit", default="")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--target-ms", type=float, default=20.0)
    ap.add_argument("--topk-density", type=float, default=0.25,
                    help="the tk variants' K / Sk (and their separate top-K rows')")
    ap.add_argument("--clocks", type=float, default=0.0,
                    help="after the race: each raced row back to back for this many seconds under nvidia-smi "
                         "sampling (SM MHz, W): ms, MHz and cycles per call (0: off)")
    args = ap.parse_args()
    global TOPK_DENSITY
    TOPK_DENSITY = args.topk_density
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = dict(commit=args.commit, command=" ".join(sys.argv), shapes={})
    t0 = time.time()

    def log(msg):
        print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)

    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    import _cute_pass2_warm

    configs, seen = [], set()
    for text in variants:  # each distinct compiled config once, in parallel with the input build
        try:
            tun = parse_variant(text)
        except ValueError:
            continue  # reported by cute_rows
        c = dict(out_dtype="float16", **{k: v for k, v in tun.items() if k in COMPILED})
        if repr(c) not in seen:
            seen.add(repr(c))
            configs.append(c)
    children = _cute_pass2_warm.start(configs)
    for name in args.shapes.split(","):
        q, k, v, lse, perm = bsr.make_inputs(name)
        if children:
            log(f"parallel compiles: {_cute_pass2_warm.wait(children, 60.0)}")
            children = {}
        H, S = q.shape[1], q.shape[2]
        G = perm.shape[-1] // bsr.C
        ops = selection.fp8_operands(q, k, lse, bsr.D**-0.5, kb_pow2=True)
        ref16 = bsr.launch_pair(ops, perm, torch.empty(1, H, G, S, dtype=torch.float16, device="cuda"),
                                one_group=True)
        ref_u1 = None
        if any(" u1 " in f" {t} " for t in variants):
            ops_u1 = selection.fp8_operands(q, k, lse, bsr.D**-0.5, kb_pow2=True, unit_qf=True)
            ref_u1 = (ops_u1, bsr.launch_pair(ops_u1, perm, torch.empty_like(ref16), one_group=True))
            fac = selection.unit_qf_factors(ops_u1[2], ops_u1[3], ops_u1[4])
            log(f"u1 operands: {int((fac > 0).sum())} of {fac.numel()} heads take the fast form (qf {fac.tolist()})")
        log(f"{name}: inputs ready (H {H}, S {S}, G {G})")
        fns, checks = cute_rows(ops, perm, ref16, variants, log, ref_u1)
        report["shapes"][name] = dict(checks=checks)  # written now: a round's cap may stop the race
        (out_dir / "bench_cutedsl_pass2.json").write_text(json.dumps(report, indent=1, default=str))
        dname, dense = bsr.dense_fn(q, k, v)
        out16 = torch.empty_like(ref16)
        race_fns = {"dense": dense, "triton 1grp": lambda: bsr.launch_pair(ops, perm, out16, one_group=True), **fns}
        ms = bsr.race(race_fns, rounds=args.rounds, target_ms=args.target_ms)
        ratio = {n: t / ms["dense"] for n, t in ms.items() if n != "dense"}
        log(f"{name} CUTE RACE (dense {dname} {ms['dense']:.3f} ms, all heads, kernel alone / dense): " + " | ".join(
            f"{n} {r:.4f}" for n, r in ratio.items()))
        report["shapes"][name] = dict(dense_backend=dname, dense_ms=ms["dense"], ms=ms, over_dense=ratio,
                                      checks=checks)
        (out_dir / "bench_cutedsl_pass2.json").write_text(json.dumps(report, indent=1, default=str))
        if args.clocks > 0:
            report["shapes"][name]["clocks"] = clocks(race_fns, args.clocks, out_dir / f"smi_{name}.csv", log)
            (out_dir / "bench_cutedsl_pass2.json").write_text(json.dumps(report, indent=1, default=str))
        del q, k, v, lse, perm, ops, ref16, fns, race_fns
        torch.cuda.empty_cache()
    log("done")


if __name__ == "__main__":
    main()
