"""flash-attn-4 paged-KV sparse route on a CUDA GPU (not collected by pytest): the route / the bare paged kernel /
flash-attn-4 dense with LSE, side by side; prints a table, writes JSON and ``fa4_route_eff_min`` to --out.

At the Wan2.1-1.3B 480p (B=1, H=12, S=32760) and 14B 720p (H=40, S=75600) shapes, D=128, bf16, C=128, q/k/v strided
``[B, H, S, D]`` views of the model's ``[B, S, H*D]`` tensors, each group's indices a random sorted set of
floor(s*S) tokens (-1-padded to a multiple of 128), s in {0.1, 0.15, 0.25, 0.5}. Every row is timed interleaved with
the dense kernel (``bench_kernels.time_interleaved``: L2 cleared before each call, rounds rotated, medians), so the
ratios are side by side; efficiency = dense ms * (floor(s*S)/S) / row ms. Rows:
- ``route``: ``kernels.sparse_attention(..., backend="flash_attn4")`` (page table + counts, Q gather, FA4, O scatter:
  kernels/flash_attn4) -> ``fa4_route_eff_min`` (min over the points);
- ``route out= res``: the same with ``out=`` a ``[B, S, H*D]`` view and a plain bf16 residual (the reuse path);
- ``bare``: FA4's paged kernel alone on pre-built inputs (group-order Q, page table, seqused_k), the route's limit;
- ``bare const``: the same with no ``seqused_k``: the page table cut to the K valid slots (every group has K here);
- ``bare <tuning>``: FA4 tunables the interface takes (``tile_mn``, ``intra_wg_overlap``, ``mma_pv_is_rs``), same
  inputs; one that fails to compile is reported and dropped.
Correctness in the same run before any timing: the route (and the residual row) on 2 heads against the float32
reference (``kernels.reference.sparse_attention``), relative L2 <= 2e-2 or the point is marked failed; the bare
kernel's output against the route's groups. Warm back-to-back ms of route and bare are printed beside.
Stops adding tunables past --budget-s (the scoreboard is always written).

Usage: python tests/bench_fa4_route.py --out $OUT --commit <hash> [--shapes 1.3b,14b] [--reps 12,4] [--budget-s 80]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_kernels as bk  # noqa: E402  (loads the pack)

from comfyui_mc_sparse_pack import kernels  # noqa: E402
from comfyui_mc_sparse_pack.kernels import reference  # noqa: E402

TUNINGS = {  # each compiles offline for sm_90a (5-13 s each: FakeTensorMode + CUTE_DSL_ARCH=sm_90a)
    "bare tile 128x176": dict(tile_mn=(128, 176)),
    "bare no intra-wg overlap": dict(intra_wg_overlap=False),
    "bare P from smem": dict(mma_pv_is_rs=False),
    "bare tile 128x64": dict(tile_mn=(128, 64)),
    "bare tile 128x192": dict(tile_mn=(128, 192)),
}
DEFAULT_TUNINGS = "bare tile 128x176,bare no intra-wg overlap"  # two compiles fit the ~100 s round


def run_shape(name, shp, densities, reps, budget_s, t0, log, tunings):
    from comfyui_mc_sparse_pack.kernels import flash_attn4 as fa4
    from comfyui_mc_sparse_pack.kernels.triton import paged_route
    from flash_attn.cute.interface import _flash_attn_fwd

    B, H, S, D = shp["B"], shp["H"], shp["S"], shp["D"]
    C = bk.C
    G = -(-S // C)
    scale = 1.0 / math.sqrt(D)
    gen = torch.Generator(device="cuda").manual_seed(1234)

    def native():
        return torch.randn(B, S, H * D, device="cuda", dtype=torch.bfloat16, generator=gen).view(B, S, H, D).transpose(1, 2)

    sets = [tuple(native() for _ in range(3)) for _ in range(2)]
    perms = [bk.random_perm(B, H, S, gen) for _ in range(2)]
    res_plain = kernels.Residual((torch.randn(B, H, S, D, device="cuda", generator=gen) * 0.05).to(torch.bfloat16))
    out_buf = torch.empty(B, S, H * D, device="cuda", dtype=torch.bfloat16)
    out_v = out_buf.view(B, S, H, D).transpose(1, 2)
    sub = slice(0, 2)
    r = dict(shape=shp, points={}, failed_tunings={})
    alive = dict(tunings)
    for s in densities:
        kq = int(s * S)
        idxs = [bk.random_kv_idx(B, H, G, S, kq, gen) for _ in sets]
        pt = dict(num_keys=kq, ms={}, eff={}, err={}, warm_ms={})
        # correctness first
        got = kernels.sparse_attention(*sets[0], perms[0], idxs[0], backend="flash_attn4")
        ref = reference.sparse_attention(*(t[:, sub].float() for t in sets[0]), perms[0][:, sub], idxs[0][:, sub])
        pt["err"]["route"] = bk.rel_err(got[:, sub], ref)
        out_buf.fill_(float("nan"))
        got = kernels.sparse_attention(*sets[0], perms[0], idxs[0], out=out_v, residual=res_plain, backend="flash_attn4")
        pt["err"]["route out= res"] = bk.rel_err(got[:, sub], ref + res_plain.data[:, sub].float())
        pt["err"]["route out= res"]["nan_left"] = bool(torch.isnan(out_buf).any())
        # pre-built inputs of the bare kernel, per input set
        bare_in = []
        for (q, k, v), p, i in zip(sets, perms, idxs):
            kp, vp, strides = fa4.kv_pages(k, v)
            table, used = paged_route.page_table(i, strides)
            qg = paged_route.gather_queries(q, p, C)
            bare_in.append(dict(q=qg, k=kp, v=vp, table=table, used=used, o=torch.empty_like(qg)))

        def bare(j, const=False, **tun):
            x = bare_in[j]
            if const:  # every group has kq valid slots here: no seqused_k, the table cut to them (row stride K_alloc)
                return _flash_attn_fwd(x["q"], x["k"], x["v"], page_table=x["table"][:, :kq], softmax_scale=scale,
                                       out=x["o"], **tun)[0]
            return _flash_attn_fwd(x["q"], x["k"], x["v"], seqused_k=x["used"], page_table=x["table"],
                                   softmax_scale=scale, out=x["o"], **tun)[0]

        want_g = paged_route.gather_queries(kernels.sparse_attention(*sets[0], perms[0], idxs[0],
                                                                     backend="flash_attn4"), perms[0], C)
        rows = {"bare": lambda j: bare(j), "bare const": lambda j: bare(j, const=True)}
        for tname, tun in list(alive.items()):
            if time.time() - t0 > budget_s:
                log(f"{name} s={s}: budget {budget_s} s reached, tunable {tname} not timed")
                continue
            rows[tname] = lambda j, tun=tun: bare(j, **tun)
        for rname in list(rows):
            try:
                o = rows[rname](0)
                valid = perms[0].view(-1, C)[:, :, None, None].expand(-1, -1, 1, D).reshape(o.shape) >= 0
                e = bk.rel_err(torch.where(valid, o, 0), torch.where(valid, want_g, 0))
                pt["err"][rname] = e
                if e["rel_l2"] > 1e-2:
                    raise RuntimeError(f"output differs from the route's: {e}")
            except Exception as err:  # a tunable this kernel does not take
                msg = f"{type(err).__name__}: {str(err)[:200]}"
                log(f"{name} s={s} {rname}: dropped ({msg})")
                rows.pop(rname)
                if rname in alive:
                    r["failed_tunings"][rname] = msg
                    alive.pop(rname)
        fns = {"dense": None, "route": None, "route out= res": None, **{n: None for n in rows}}
        cyc = {n: [0] for n in fns}

        def rot(n, f):
            def call():
                j = cyc[n][0] = (cyc[n][0] + 1) % 2
                return f(j)
            return call

        fns["dense"] = rot("dense", lambda j: kernels.dense_attention(*sets[j], return_lse=True, backend="flash_attn4"))
        fns["route"] = rot("route", lambda j: kernels.sparse_attention(*sets[j], perms[j], idxs[j], backend="flash_attn4"))
        fns["route out= res"] = rot("route out= res", lambda j: kernels.sparse_attention(
            *sets[j], perms[j], idxs[j], out=out_v, residual=res_plain, backend="flash_attn4"))
        for n, f in rows.items():
            fns[n] = rot(n, f)
        pt["ms"] = bk.time_interleaved(fns, reps)
        dense = pt["ms"]["dense"]
        for n, ms in pt["ms"].items():
            if n != "dense":
                pt["eff"][n] = dense * (kq / S) / ms
        for n in ("route", "bare"):
            pt["warm_ms"][n] = bk.time_warm(fns[n], calls=3)
        pt["warm_ms"]["dense"] = bk.time_warm(fns["dense"], calls=2)
        ok = pt["err"]["route"]["rel_l2"] <= 2e-2 and pt["err"]["route out= res"]["rel_l2"] <= 2e-2 \
            and not pt["err"]["route out= res"]["nan_left"]
        pt["correct"] = ok
        r["points"][str(s)] = pt
        log(f"{name} s={s} [{time.time() - t0:.0f}s] dense {dense:.3f} ms | "
            + " | ".join(f"{n} {pt['ms'][n]:.3f} ms eff {pt['eff'][n]:.3f}" for n in pt["eff"])
            + f" | warm route/bare/dense {pt['warm_ms']['route']:.3f}/{pt['warm_ms']['bare']:.3f}/"
              f"{pt['warm_ms']['dense']:.3f} ms | route/bare {pt['ms']['route'] / pt['ms']['bare']:.3f}"
            + f" | err route {pt['err']['route']['rel_l2']:.2e}, res {pt['err']['route out= res']['rel_l2']:.2e}"
            + ("" if ok else "  <-- WRONG"))
        del idxs, bare_in
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--shapes", default="1.3b,14b")
    ap.add_argument("--densities", default="0.1,0.15,0.25,0.5")
    ap.add_argument("--reps", default="12,4", help="interleaved rounds per shape (in --shapes order)")
    ap.add_argument("--budget-s", type=float, default=70.0, help="no new tunables timed past this many seconds")
    ap.add_argument("--tunings", default=DEFAULT_TUNINGS, help="comma-separated names of TUNINGS to time")
    ap.add_argument("--commit", default=None)
    args = ap.parse_args()
    t0 = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logf = (out / "bench_fa4_route.log").open("w")

    def log(msg):
        print(msg, flush=True)
        logf.write(msg + "\n")
        logf.flush()

    shapes = args.shapes.split(",")
    reps = [int(x) for x in args.reps.split(",")]
    densities = [float(x) for x in args.densities.split(",")]
    tunings = {n: TUNINGS[n] for n in args.tunings.split(",") if n}
    report = dict(gpu=torch.cuda.get_device_name(), commit=bk.measured_commit(args.commit), shapes={},
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"))
    for n, name in enumerate(shapes):
        report["shapes"][name] = run_shape(name, bk.SHAPES[name], densities, reps[min(n, len(reps) - 1)],
                                           args.budget_s, t0, log, tunings)
        (out / "bench_fa4_route.json").write_text(json.dumps(report, indent=1) + "\n")
    # table
    for name, r in report["shapes"].items():
        rows = sorted({k for pt in r["points"].values() for k in pt["eff"]}, key=lambda k: (k != "route", k))
        log(f"\n{name}: efficiency vs flash-attn-4 dense with LSE x s (s = {', '.join(r['points'])})")
        for row in rows:
            log(f"  {row:28s} " + " ".join(f"{r['points'][s]['eff'].get(row, float('nan')):.3f}" for s in r["points"]))
        log(f"  {'route / bare (time)':28s} " + " ".join(
            f"{pt['ms']['route'] / pt['ms']['bare']:.3f}" for pt in r["points"].values()))
    effs = {(n, s): pt["eff"]["route"] for n, r in report["shapes"].items() for s, pt in r["points"].items()}
    bare = {(n, s): pt["eff"]["bare"] for n, r in report["shapes"].items() for s, pt in r["points"].items()}
    wrong = [f"{n} s={s}" for n, r in report["shapes"].items() for s, pt in r["points"].items() if not pt["correct"]]
    board = {}
    if effs and not wrong:
        worst = min(effs, key=effs.get)
        best_bare = {k: max(v for n2, v in report["shapes"][k[0]]["points"][k[1]]["eff"].items() if n2.startswith("bare"))
                     for k in effs}
        note = (f"the route (kernels.sparse_attention backend flash_attn4, model-layout [B, S, H*D] views, no residual) "
                f"timed interleaved with flash-attn-4 dense with LSE (L2 cleared per call, medians); min over shapes x s "
                f"of dense ms x s / route ms; worst at {worst[0]} s={worst[1]}; route "
                f"{ {f'{n} {s}': round(v, 3) for (n, s), v in effs.items()} }; bare paged kernel "
                f"{ {f'{n} {s}': round(v, 3) for (n, s), v in bare.items()} }; best bare row per point "
                f"{ {f'{n} {s}': round(v, 3) for (n, s), v in best_bare.items()} }; dense ms "
                f"{ {n: {s: round(pt['ms']['dense'], 3) for s, pt in r['points'].items()} for n, r in report['shapes'].items()} }")
        board["fa4_route_eff_min"] = dict(
            value=round(effs[worst], 4), unit="ratio", commit=report["commit"], gpu=report["gpu"],
            date=datetime.date.today().isoformat(), note=note,
            command=f"python tests/bench_fa4_route.py --out $OUT --commit {report['commit']}")
        log(f"\nscoreboard fa4_route_eff_min = {effs[worst]:.4f} (worst at {worst[0]} s={worst[1]})")
    else:
        log(f"\nno scoreboard figure: wrong results at {wrong}" if wrong else "\nno points measured")
    (out / "scoreboard.json").write_text(json.dumps(board, indent=2) + "\n")
    log(f"done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
