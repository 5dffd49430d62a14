"""flash-attn-4 paged-KV sparse route on a CUDA GPU (not collected by pytest): the route / the bare paged kernel /
flash-attn-4 dense with LSE, side by side; prints a table, writes JSON and ``fa4_route_eff_min`` to --out.

At the Wan2.1-1.3B 480p (B=1, H=12, S=32760) and 14B 720p (H=40, S=75600) shapes, D=128, bf16, C=128, each group's
indices a random sorted set of floor(s*S) tokens (-1-padded to a multiple of 128), s in {0.1, 0.15, 0.25, 0.5}.
Timing: the method of record (TEAM.md item 7, ``tests/_timing.race``): every row in turn, back-to-back calls for
about --target-ms per sample, --rounds rounds in a rotating order, medians, dense in the same race at every point;
efficiency = dense ms * (floor(s*S)/S) / row ms; dense = ``kernels.dense_attention(q, k, v, return_lse=True,
backend="flash_attn4")`` on ``[B, H, S, D]`` contiguous randn inputs. Rows:
- ``route``: ``kernels.sparse_attention(..., backend="flash_attn4")`` on those inputs (page table + counts, Q gather,
  FA4, O scatter: kernels/flash_attn4) -> ``fa4_route_eff_min`` (min over the points);
- ``route native`` / ``route native out= res``: on strided views of the model's ``[B, S, H*D]`` tensors, and with
  ``out=`` such a view and a plain bf16 residual (the reuse path's call);
- ``route <tuning>``: the backend with an FA4 tunable (``TUNINGS``: ``intra_wg_overlap``, ``mma_pv_is_rs``,
  ``tile_mn``);
- ``bare``: FA4's paged kernel alone on pre-built inputs (group-order Q, page table, seqused_k) as the route launches
  it (the compiled kernel directly): the route's ceiling; ``bare via interface``: through ``_flash_attn_fwd`` (host
  work per call); ``bare <tuning>``;
- ``pass table`` / ``pass gather`` / ``pass scatter`` (``+ res``): the route's Triton launches alone (ms and GB/s of
  their own reads and writes; not in the efficiency table; ``--no-passes`` leaves them out).
Correctness in the same run before any timing: every route row against the float32 reference on 2 heads
(``kernels.reference.sparse_attention``; the first call through FA4's interface and the second, direct, launch), the
residual row into a NaN-poisoned out; the bare rows against the route's group-order output. A point with a relative
L2 error above 2e-2 or a NaN left is marked WRONG and gives no scoreboard figure.

Usage: python tests/bench_fa4_route.py --out $OUT --commit <hash> [--shapes 1.3b,14b] [--rounds 3] [--target-ms 20]
       [--tunings "no overlap"]
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
import _scoreboard  # noqa: E402
import bench_kernels as bk  # noqa: E402  (loads the pack)
from _timing import race  # noqa: E402

from comfyui_mc_sparse_pack import kernels  # noqa: E402
from comfyui_mc_sparse_pack.kernels import reference  # noqa: E402

T0 = time.time()
TUNINGS = {  # each compiles offline for sm_90a (5-13 s: FakeTensorMode + CUTE_DSL_ARCH=sm_90a + FLASH_ATTENTION_NUM_SMS)
    "no overlap": dict(intra_wg_overlap=False),  # round 1 (gapped timing): bare +0.003-0.022 at 14B, -0.016-0 at 1.3B
    "P from smem": dict(mma_pv_is_rs=False),
    "tile 128x176": dict(tile_mn=(128, 176)),  # round 1: 0.04-0.09 below the default tile everywhere
}


def run_shape(name, shp, densities, rounds, target_ms, log, tunings, passes=True):
    from comfyui_mc_sparse_pack.kernels import flash_attn4 as fa4
    from comfyui_mc_sparse_pack.kernels.triton import paged_route
    from flash_attn.cute.interface import _flash_attn_fwd

    B, H, S, D = shp["B"], shp["H"], shp["S"], shp["D"]
    C = bk.C
    G = -(-S // C)
    scale = 1.0 / math.sqrt(D)
    gen = torch.Generator(device="cuda").manual_seed(1234)

    def randn(*size):
        return torch.randn(*size, device="cuda", dtype=torch.bfloat16, generator=gen)

    cont = [tuple(randn(B, H, S, D) for _ in range(3)) for _ in range(2)]  # TEAM.md item 7: the baseline's inputs
    nat = [tuple(randn(B, S, H * D).view(B, S, H, D).transpose(1, 2) for _ in range(3)) for _ in range(2)]
    perms = [bk.random_perm(B, H, S, gen) for _ in range(2)]
    res_plain = kernels.Residual((torch.randn(B, H, S, D, device="cuda", generator=gen) * 0.05).to(torch.bfloat16))
    out_buf = torch.empty(B, S, H * D, device="cuda", dtype=torch.bfloat16)
    out_v = out_buf.view(B, S, H, D).transpose(1, 2)
    out_c = torch.empty(B, H, S, D, device="cuda", dtype=torch.bfloat16)  # the "pass scatter" rows' target
    sub = slice(0, 2)
    r = dict(shape=shp, points={})
    for s in densities:
        kq = int(s * S)
        idxs = [bk.random_kv_idx(B, H, G, S, kq, gen) for _ in range(2)]
        pt = dict(num_keys=kq, ms={}, eff={}, err={})

        def route(j, inputs=cont, out=None, residual=None, **tun):
            if tun:  # FA4 tunables: the backend's function directly
                return fa4.sparse_attention(*inputs[j], perms[j], idxs[j], out=out, residual=residual, **tun)
            return kernels.sparse_attention(*inputs[j], perms[j], idxs[j], out=out, residual=residual,
                                            backend="flash_attn4")

        # correctness first: every route row against the float32 reference on 2 heads (first call: through
        # flash-attn-4's interface; second: the direct launch), the residual row into a NaN-poisoned out
        ref = reference.sparse_attention(*(t[:, sub].float() for t in cont[0]), perms[0][:, sub], idxs[0][:, sub])
        ref_n = reference.sparse_attention(*(t[:, sub].float() for t in nat[0]), perms[0][:, sub], idxs[0][:, sub])
        checks = {"route first call": lambda: route(0), "route": lambda: route(0)}
        for tname, tun in tunings.items():
            checks[f"route {tname}"] = lambda tun=tun: route(0, **tun)
        for cname, fn in checks.items():
            pt["err"][cname] = bk.rel_err(fn()[:, sub], ref)
        out_buf.fill_(float("nan"))
        got = route(0, nat, out=out_v, residual=res_plain)
        pt["err"]["route native out= res"] = bk.rel_err(got[:, sub], ref_n + res_plain.data[:, sub].float())
        pt["err"]["route native out= res"]["nan_left"] = bool(torch.isnan(out_buf).any())
        # pre-built inputs of the bare kernel, per input set
        bare_in = []
        for (q, k, v), p, i in zip(cont, perms, idxs):
            kp, vp, strides = fa4.kv_pages(k, v)
            table, used = paged_route.page_table(i, strides)
            qg = paged_route.gather_queries(q, p, C)
            bare_in.append(dict(q=qg, k=kp, v=vp, table=table, used=used, o=torch.empty_like(qg), strides=strides))

        def bare(j, via="direct", **tun):
            x = bare_in[j]
            if via == "direct":  # what the route launches (the compiled kernel, after its first call)
                fa4._paged_call(x["q"], x["k"], x["v"], x["used"], x["table"], x["o"], None, scale, tun)
                return x["o"]
            return _flash_attn_fwd(x["q"], x["k"], x["v"], seqused_k=x["used"], page_table=x["table"],
                                   softmax_scale=scale, out=x["o"], **tun)[0]

        want_g = paged_route.gather_queries(route(0), perms[0], C)
        valid = (perms[0].view(-1, C) >= 0)[:, :, None, None]
        rows = {"bare": lambda j: bare(j), "bare via interface": lambda j: bare(j, via="interface")}
        for tname, tun in tunings.items():
            rows[f"bare {tname}"] = lambda j, tun=tun: bare(j, **tun)
        for rname in list(rows):
            rows[rname](0)  # a first call goes through flash-attn-4's interface
            o = rows[rname](0)  # the direct launch
            pt["err"][rname] = bk.rel_err(torch.where(valid, o, 0), torch.where(valid, want_g, 0))
        ok = all(e["rel_l2"] <= 2e-2 for e in pt["err"].values()) and not pt["err"]["route native out= res"]["nan_left"]
        pt["correct"] = ok
        fns = {
            "dense": lambda j: kernels.dense_attention(*cont[j], return_lse=True, backend="flash_attn4"),
            "route": lambda j: route(j),
            "route native": lambda j: route(j, nat),
            "route native out= res": lambda j: route(j, nat, out=out_v, residual=res_plain),
            **{f"route {tname}": (lambda j, tun=tun: route(j, **tun)) for tname, tun in tunings.items()},
            **rows,
        }
        if passes:  # the route's three Triton launches alone (ms and GB/s of their own reads + writes)
            n_rows = B * H * G * C * D * 2  # bytes of one [B*H*G, C, 1, D] bf16 tensor
            pass_bytes = {"pass table": idxs[0].numel() * 8 + B * H * G * 4, "pass gather": 2 * n_rows,
                          "pass scatter": 2 * n_rows, "pass scatter + res": 2 * n_rows + B * H * S * D * 2}
            fns.update({
                "pass table": lambda j: paged_route.page_table(idxs[j], bare_in[j]["strides"]),
                "pass gather": lambda j: paged_route.gather_queries(cont[j][0], perms[j], C),
                "pass scatter": lambda j: paged_route.scatter_output(bare_in[j]["o"], None, perms[j], out_c),
                "pass scatter + res": lambda j: paged_route.scatter_output(bare_in[j]["o"], None, perms[j], out_c,
                                                                           res_plain),
            })
        turn = {n: [0] for n in fns}

        def rot(n, f):
            def call():  # alternate the two input sets (no cache-warm repeats of one input)
                j = turn[n][0] = 1 - turn[n][0]
                return f(j)
            return call

        pt["ms"] = race({n: rot(n, f) for n, f in fns.items()}, rounds, target_ms)
        dense = pt["ms"]["dense"]
        for n, ms in pt["ms"].items():
            if n.startswith("pass "):
                pt.setdefault("pass_gb_s", {})[n] = pass_bytes[n] / ms / 1e6
            elif n != "dense":
                pt["eff"][n] = dense * (kq / S) / ms
        r["points"][str(s)] = pt
        log(f"{name} s={s} [{time.time() - T0:.0f}s] dense {dense:.3f} ms | "
            + " | ".join(f"{n} {pt['ms'][n]:.3f} ms eff {pt['eff'][n]:.3f}" for n in pt["eff"])
            + f" | route/bare {pt['ms']['route'] / pt['ms']['bare']:.3f}"
            + f" | max rel_l2 {max(e['rel_l2'] for e in pt['err'].values()):.2e}" + ("" if ok else "  <-- WRONG")
            + "".join(f" | {n} {pt['ms'][n]:.3f} ms {g:.0f} GB/s" for n, g in pt.get("pass_gb_s", {}).items()))
        if not ok:
            log(f"{name} s={s} errors: {pt['err']}")
        del idxs, bare_in
    return r


def report_and_board(report, out, log):
    """Print the tables and write out/scoreboard.json (fa4_route_eff_min over the points measured so far)."""
    for name, r in report["shapes"].items():
        rows = sorted({k for pt in r["points"].values() for k in pt["eff"]}, key=lambda k: (k != "route", k))
        dense = " / ".join(f"{pt['ms']['dense']:.2f}" for pt in r["points"].values())
        log(f"\n{name}: efficiency vs flash-attn-4 dense with LSE x s (s = {', '.join(r['points'])}; dense ms {dense})")
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
        note = (f"the route (kernels.sparse_attention backend flash_attn4, [B, H, S, D] contiguous bf16, no residual) "
                f"raced with flash-attn-4 dense with LSE ({report['method']}, TEAM.md item 7); min over shapes x s "
                f"of dense ms x s / route ms; worst at {worst[0]} s={worst[1]}; route "
                f"{ {f'{n} {s}': round(v, 3) for (n, s), v in effs.items()} }; bare paged kernel "
                f"{ {f'{n} {s}': round(v, 3) for (n, s), v in bare.items()} }; best bare row per point "
                f"{ {f'{n} {s}': round(v, 3) for (n, s), v in best_bare.items()} }; dense ms "
                f"{ {n: {s: round(pt['ms']['dense'], 3) for s, pt in r['points'].items()} for n, r in report['shapes'].items()} }")
        board["fa4_route_eff_min"] = _scoreboard.entry(
            effs[worst], "ratio", note, commit=report["commit"], gpu=report["gpu"],
            command=f"python tests/bench_fa4_route.py --out $OUT --commit {report['commit']}")
        log(f"\nscoreboard fa4_route_eff_min = {effs[worst]:.4f} (worst at {worst[0]} s={worst[1]})")
    else:
        log(f"\nno scoreboard figure: wrong results at {wrong}" if wrong else "\nno points measured")
    _scoreboard.update(board, out / "scoreboard.json", board=None)  # the keys file only


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--shapes", default="1.3b,14b")
    ap.add_argument("--densities", default="0.1,0.15,0.25,0.5")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--target-ms", type=float, default=20.0)
    ap.add_argument("--tunings", default="no overlap", help="comma-separated names of TUNINGS to time")
    ap.add_argument("--no-passes", action="store_true", help="do not time the route's Triton launches alone")
    ap.add_argument("--commit", default=None)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logf = (out / "bench_fa4_route.log").open("w")

    def log(msg):
        print(msg, flush=True)
        logf.write(msg + "\n")
        logf.flush()

    densities = [float(x) for x in args.densities.split(",")]
    tunings = {n: TUNINGS[n] for n in args.tunings.split(",") if n}
    report = dict(gpu=torch.cuda.get_device_name(), commit=_scoreboard.measured_commit(args.commit), shapes={},
                  method=f"tests/_timing.race, {args.rounds} rounds x ~{args.target_ms} ms",
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"))
    for name in args.shapes.split(","):
        report["shapes"][name] = run_shape(name, bk.SHAPES[name], densities, args.rounds, args.target_ms, log, tunings,
                                           passes=not args.no_passes)
        (out / "bench_fa4_route.json").write_text(json.dumps(report, indent=1) + "\n")
        report_and_board(report, out, log)  # after each shape: a run cut by its time cap keeps a figure
    log(f"done in {time.time() - T0:.0f} s")


if __name__ == "__main__":
    main()
