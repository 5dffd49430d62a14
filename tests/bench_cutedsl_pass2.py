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
a variant is ``st<stages>`` with optional `` p<poly>``, `` c<ctas>``, `` k<ksplit>`` (else
``auto_ksplit``), `` ls`` (lse_smem), `` qs`` (qsplit 1: query-half wgmmas), `` qr`` (qsplit 2: rolled over pairs
of tiles), `` wg4`` (four consumer warpgroups), `` pr`` (two query groups per work item), `` ov`` (with pr:
overlapped wgmmas), `` tk`` (the top-K fused, K = 0.25 Sk: checked against the brute-force top-K of its own sums
too), `` nols`` / `` npr`` (those defaults off), or a timing floor `` noexp`` / `` nomma`` (wrong sums: timed
without the check).
Writes OUT/bench_cutedsl_pass2.json (after the checks, again after the race).
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
COMPILED = ("stages", "poly", "lse_smem", "qsplit", "diag", "topk", "wg4", "pair", "overlap")
FLAGS = {"ls": "lse_smem", "qs": "qsplit", "tk": "topk", "wg4": "wg4", "pr": "pair",
         "ov": "overlap"}
TOPK_DENSITY = 0.25  # the fused top-K variants ("tk") select K = 0.25 x Sk keys per group
OFF = {"nols": "lse_smem", "npr": "pair"}
DEFAULT_VARIANTS = "st4,st4 k1,st4 qr,st4 p4,st6"


def parse_variant(text: str) -> dict:
    """'st4 p8 c132 k2 qs ls' -> dict(stages=4, poly=8, num_ctas=132, ksplit=2, qsplit=True, lse_smem=True)."""
    keys = {"st": "stages", "p": "poly", "c": "num_ctas", "k": "ksplit"}
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
        if tok in ("noexp", "nomma"):  # timing floors (wrong sums: not checked, timed only)
            out["diag"] = tok
            continue
        for pre in ("st", "p", "c", "k"):
            if tok.startswith(pre) and tok[len(pre):].isdigit():
                out[keys[pre]] = int(tok[len(pre):])
                break
        else:
            raise ValueError(f"bad variant token {tok!r} in {text!r}")
    return out


def cute_rows(ops, perm, ref16, variants, log):
    """{row name: zero-argument callable} of the CuTeDSL variants whose check passed, and {name: check result}.
    ``ops``: ``fp8_operands(kb_pow2=True)``; ``ref16``: the Triton kernel's float16 sums [B, H, G, Sk]."""
    from comfyui_mc_sparse_pack.kernels.cutedsl import pass2_launch
    from comfyui_mc_sparse_pack.kernels.cutedsl import pass2_sm90 as p2

    q8, k8, qf, lse_s, kb = ops
    fns, res = {}, {}
    for text in variants:
        name = f"cute {text}"
        try:
            tun = parse_variant(text)
            t = time.time()
            p2.compiled("float16", **{key: tun[key] for key in COMPILED if key in tun})
            got = torch.full_like(ref16, float("nan"))
            run = dict(tun)
            sel_ok = True
            if run.pop("topk", False):
                kq = int(TOPK_DENSITY * ref16.shape[-1])
                width = -(-kq // bsr.KV_TILE) * bsr.KV_TILE
                sel = torch.full((*ref16.shape[:3], width), -7, dtype=torch.int32, device=ref16.device)
                run["select"] = (sel, kq)
            p2.group_prob_sums_fp8(q8, k8, qf, lse_s, kb, perm, got, group_size=bsr.C, **run)
            torch.cuda.synchronize()
            rel = float(((got.double() - ref16.double()).norm(dim=-1) / ref16.double().norm(dim=-1)).max())
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
                fns[name] = (lambda run, out: lambda: p2.group_prob_sums_fp8(
                    q8, k8, qf, lse_s, kb, perm, out, group_size=bsr.C, **run))(run, out)
            del got
        except Exception as err:  # noqa: BLE001 (a variant that fails to compile or run is reported, not timed)
            res[name] = dict(ok=False, error=f"{type(err).__name__}: {str(err)[:400]}")
            log(f"CHECK {name}: {res[name]['error']}  CHECK FAILED")
    return fns, res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="1.3b")
    ap.add_argument("--variants", default=DEFAULT_VARIANTS)
    ap.add_argument("--commit", default="")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
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
        log(f"{name}: inputs ready (H {H}, S {S}, G {G})")
        fns, checks = cute_rows(ops, perm, ref16, variants, log)
        report["shapes"][name] = dict(checks=checks)  # written now: a round's cap may stop the race
        (out_dir / "bench_cutedsl_pass2.json").write_text(json.dumps(report, indent=1, default=str))
        dname, dense = bsr.dense_fn(q, k, v)
        out16 = torch.empty_like(ref16)
        race_fns = {"dense": dense, "triton 1grp": lambda: bsr.launch_pair(ops, perm, out16, one_group=True), **fns}
        if any("topk" in parse_variant(t) for t in variants if f"cute {t}" in fns):  # today's path beside the fused
            from comfyui_mc_sparse_pack.kernels.cutedsl import pass2_sm90 as p2
            from comfyui_mc_sparse_pack.kernels.triton import topk

            kq = int(TOPK_DENSITY * S)
            sel = torch.empty(*ref16.shape[:3], -(-kq // bsr.KV_TILE) * bsr.KV_TILE, dtype=torch.int32, device="cuda")
            race_fns["cute + separate top-K count"] = lambda: topk.top_k_rows(
                p2.group_prob_sums_fp8(*ops, perm, out16, group_size=bsr.C), kq, sel.shape[-1], out=sel, cand_count=1)
        ms = bsr.race(race_fns, rounds=args.rounds, target_ms=20.0)
        ratio = {n: t / ms["dense"] for n, t in ms.items() if n != "dense"}
        log(f"{name} CUTE RACE (dense {dname} {ms['dense']:.3f} ms, all heads, kernel alone / dense): " + " | ".join(
            f"{n} {r:.4f}" for n, r in ratio.items()))
        report["shapes"][name] = dict(dense_backend=dname, dense_ms=ms["dense"], ms=ms, over_dense=ratio,
                                      checks=checks)
        (out_dir / "bench_cutedsl_pass2.json").write_text(json.dumps(report, indent=1, default=str))
        del q, k, v, lse, perm, ops, ref16, fns, race_fns
        torch.cuda.empty_cache()
    log("done")


if __name__ == "__main__":
    main()
