"""Per-item timeline of the CuTeDSL sparse kernel on an sm_90 GPU (issue 16; a diagnostic, not collected by pytest).

Launches the op's staged-epilogue kernel (``rules.staged_options()`` + the "stamps" option of
``kernels/cutedsl/sparse_fwd_sm90.py``; the op's grid, split of the last round and workspace, counts computed before)
at the Wan2.1-1.3B 480p / 14B 720p shapes of ``bench_cutedsl.py`` (bf16, D = 128, C = 128, random groups and
selections), ``--reps`` times back to back, and reads the SM clock stamps of the last launch: per work item, each
consumer warpgroup's item start, key-tile loop end, boundary waits done (next item's queries and first K), boundary
softmax done, item end, and its K / V wait cycles (and in the boundary step: its MMA turn, output staged, rows
stored); the producer's item start, first K issued, last V issued, its
K / V stage wait cycles and its next-item hook cycles (``STAMP_SLOTS``). Prints the median of each phase over the
items of the walk's inner rounds (no first or last round), in cycles and in ns (clock rate from the stamps'
globaltimer column), the loop's cycles per key tile, and the same kernel without "stamps" timed beside it (the
stamps' own cost). ``--extra``: more stamped kernels, each the op's options plus the ";"-separated option sets given
(e.g. "diag_no_copy": the consumers without the gathers; a candidate option), and each timed without stamps too.

Usage: python tests/diag_cutedsl_stamps.py --out DIR [--points 1.3b:0.1,1.3b:0.5,14b:0.1] [--reps 10]
       [--extra "diag_no_copy;stage_under_qk"] [--raw]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_cutedsl as bc  # noqa: E402  (loads the pack)

from comfyui_mc_sparse_pack.kernels.cutedsl import compile as cc  # noqa: E402
from comfyui_mc_sparse_pack.kernels.cutedsl import rules  # noqa: E402
from comfyui_mc_sparse_pack.kernels.cutedsl.sparse_fwd_sm90 import STAMP_SLOTS  # noqa: E402
from comfyui_mc_sparse_pack.kernels.triton.counts import valid_counts  # noqa: E402

C = 128


def col(name: str, wg: int = 0) -> int:
    """The column of stamp ``name`` (consumer warpgroup ``wg``'s for the c_ ones)."""
    return STAMP_SLOTS.index(name) + (8 * wg if name.startswith("c_") and name != "c_end_ns" else 0)


def phases(st: torch.Tensor, ctas: int, rounds: int, tiles: int) -> dict:
    """Median per item of each phase over the items of rounds 1 .. rounds - 2 (``st``: (items, slots) int64 of
    whole rounds only, item = round * ctas + cta); cycles."""
    st = st[: rounds * ctas].view(rounds, ctas, -1).double()
    inner = slice(1, rounds - 1)

    def d(a, b, wg=0):
        return st[inner, :, col(b, wg)] - st[inner, :, col(a, wg)]

    out = {}
    nxt = st[2:rounds, :, col("c_start")] - st[inner, :, col("c_start")]
    rows = dict(item_period=nxt)
    for wg in (0, 1):
        rows.update({
            f"wg{wg} loop": d("c_start", "c_tiles", wg),
            f"wg{wg} boundary waits (next Q, K)": d("c_tiles", "c_ready", wg),
            f"wg{wg} boundary QK+PV+softmax": d("c_ready", "c_softmax", wg),
            f"wg{wg} epilogue (+ next 2nd tile)": d("c_softmax", "c_end", wg),
            # the boundary step (the next item's second key tile, this item's output staged and stored in it)
            f"wg{wg}   softmax done -> its MMA turn": d("c_softmax", f"c{wg}_turn", wg),
            f"wg{wg}   turn -> output staged": d(f"c{wg}_turn", f"c{wg}_staged", wg),
            f"wg{wg}   staged -> stored": d(f"c{wg}_staged", f"c{wg}_stored", wg),
            f"wg{wg}   stored -> item end": d(f"c{wg}_stored", "c_end", wg),
            f"wg{wg} end -> next start": st[2:rounds, :, col("c_start", wg)] - st[inner, :, col("c_end", wg)],
            f"wg{wg} K wait sum": st[inner, :, col("c_kwait", wg)],
            f"wg{wg} V wait sum": st[inner, :, col("c_vwait", wg)],
            f"wg{wg} boundary step K+V waits": st[inner, :, col(f"c{wg}_bwait")],
        })
    rows.update({
        "wg1 start - wg0 start": st[inner, :, col("c_start", 1)] - st[inner, :, col("c_start", 0)],
        "producer start -> first K stage free": d("p_start", "p_acq"),
        "producer first K stage free -> first K": d("p_acq", "p_first"),
        "producer first K -> last V": d("p_first", "p_last"),
        "producer last V -> next start": st[2:rounds, :, col("p_start")] - st[inner, :, col("p_last")],
        "producer K stage wait sum": st[inner, :, col("p_kwait")],
        "producer V stage wait sum": st[inner, :, col("p_vwait")],
        "producer next-item hook": st[inner, :, col("p_qhook")],
        "consumer start - producer start": st[inner, :, col("c_start")] - st[inner, :, col("p_start")],
    })
    for k, v in rows.items():
        out[k] = float(v.median())
    out["wg0 loop per key tile"] = out["wg0 loop"] / max(1, tiles - 2)  # "hide_epi": 2 tiles run at the boundary
    # the clock rate: cycles / ns between a CTA's second and last-but-one item starts (WG0)
    cyc = st[rounds - 2, :, col("c_start")] - st[1, :, col("c_start")]
    ns = st[rounds - 2, :, col("c_ns")] - st[1, :, col("c_ns")]
    out["clock_ghz"] = float((cyc / ns).median())
    return out


def launch_ns(st: torch.Tensor, ctas: int, items: int) -> dict:
    """Per-launch figures in ns from the globaltimer columns (``st``: (rows, slots) int64, the walk's ``items`` work
    items): each CTA's wait for the kernel before it ("pdl": the counts launch), its first item's start after it, the
    kernel's span (first CTA start to last item end) and how far the CTAs' last item ends spread (the tail)."""
    st = st.double()
    k0, dep = st[:ctas, col("k_start_ns")], st[:ctas, col("k_dep_ns")]
    first = st[:ctas, col("c_ns")]
    ends = st[:items, col("c_end_ns")]
    cta_of = torch.arange(items) % ctas  # grid-stride: item i runs on CTA i mod ctas
    last_end = torch.zeros(ctas, dtype=torch.float64).scatter_reduce(0, cta_of, ends, "amax")
    t0 = float(k0.min())
    return {"pdl wait (median over CTAs)": float((dep - k0).median()), "pdl wait (max)": float((dep - k0).max()),
            "first item start after the wait": float((first - dep).median()),
            "kernel span (first CTA start -> last item end)": float(ends.max()) - t0,
            "CTA last item end: median": float(last_end.median()) - t0,
            "CTA last item end: min": float(last_end.min()) - t0}


def run(shape: str, s: float, reps: int, extra: tuple, raw_dir: Path | None = None) -> dict:
    shp = bc.SHAPES[shape]
    B, H, S, D = shp["B"], shp["H"], shp["S"], shp["D"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (bc.native(gen, B, S, H, D) for _ in range(3))
    out = torch.empty(B, S, H * D, device="cuda", dtype=torch.bfloat16).view(B, S, H, D).transpose(1, 2)
    perm, idx = bc.inputs(gen, B, H, S, s)
    counts = valid_counts(idx)
    n = counts.shape[0]
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    options, ctas = rules.launch_plan("smem", n, sms)
    parts = rules.split_parts(n, ctas) if "split_tail" in options else 1
    r = n % ctas
    ws = ()
    if "split_tail" in options:
        rows = 128 * (r * parts if parts > 1 else 1)
        ws = (torch.empty(rows, D, dtype=q.dtype, device=q.device), torch.empty(rows, device=q.device), parts)
    views = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), out.transpose(1, 2), None, perm.view(n, C),
             idx.view(n, -1), counts, None, None, None, None, 1 / math.sqrt(D), ctas)
    res = dict(shape=shape, s=s, groups=n, ctas=ctas, parts=parts, options=list(options))
    tiles = -(-int(counts[0]) // 128)
    rounds = n // ctas
    runs = [("default", options), ("stamps", (*options, "stamps"))]
    for x in extra:
        more = tuple(o for o in x.split(",") if o)
        if "diag_no_copy" not in more:  # a candidate: its own time without stamps too
            runs.append((f"+{x}", (*options, *more)))
        runs.append((f"stamps+{x}", (*options, "stamps", *more)))
    for tag, opts in runs:
        fn = cc.compiled("bfloat16", D, False, "none", epilogue="smem", options=opts)
        stamps = torch.zeros(n + ctas, len(STAMP_SLOTS), dtype=torch.int64, device=q.device) if "stamps" in tag \
            else None
        launch = lambda: cc.launch(fn, *views, *ws, stamps=stamps)  # noqa: E731
        launch()
        torch.cuda.synchronize()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        times = []
        for _ in range(reps):
            ev[0].record()
            launch()
            ev[1].record()
            torch.cuda.synchronize()
            times.append(ev[0].elapsed_time(ev[1]))
        times.sort()
        row = dict(ms_median=times[len(times) // 2], ms_all=times)
        if stamps is not None:
            ph = phases(stamps.cpu(), ctas, rounds, tiles)
            ghz = ph["clock_ghz"]
            row["phases_cycles"] = ph
            row["launch_ns"] = lns = launch_ns(stamps.cpu(), ctas, n + r * (parts - 1))
            if raw_dir is not None:  # every item's stamps, for offline analysis (int64, STAMP_SLOTS columns)
                raw_dir.mkdir(parents=True, exist_ok=True)
                torch.save(dict(stamps=stamps.cpu(), slots=STAMP_SLOTS, ctas=ctas, groups=n, parts=parts),
                           raw_dir / f"stamps_{shape}_s{s}_{tag.replace('+', '_').replace(',', '_')}.pt")
            print(f"{shape} s={s} {tag}: {row['ms_median']:.3f} ms; {n} groups / {ctas} CTAs, {rounds} whole rounds,"
                  f" {tiles} key tiles per group; SM clock {ghz:.3f} GHz; median per item (cycles / ns):", flush=True)
            for kk, vv in ph.items():
                if kk != "clock_ghz":
                    print(f"    {kk:40s} {vv:10.0f}  {vv / ghz:9.0f} ns", flush=True)
            for kk, vv in lns.items():
                print(f"    {kk:50s} {vv / 1000:9.2f} us", flush=True)
        else:
            print(f"{shape} s={s} {tag}: {row['ms_median']:.3f} ms", flush=True)
        res[tag] = row
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--points", default="1.3b:0.1,1.3b:0.5,14b:0.1")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--raw", action="store_true", help="also save every item's stamps (OUT/stamps_*.pt)")
    ap.add_argument("--extra", default="", help='";"-separated option sets added to the op\'s (stamped, and timed '
                    'alone unless diag_no_copy)')
    args = ap.parse_args()
    print(f"GPU {torch.cuda.get_device_name()}", flush=True)
    report = []
    for point in args.points.split(","):
        shape, s = point.split(":")
        try:
            report.append(run(shape, float(s), args.reps, tuple(x for x in args.extra.split(";") if x),
                              Path(args.out) if args.raw else None))
        except Exception as exc:  # a diagnostic: report and go on
            print(f"{point}: FAILED {type(exc).__name__}: {exc}", flush=True)
            report.append(dict(point=point, error=f"{type(exc).__name__}: {exc}"))
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "stamps.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
