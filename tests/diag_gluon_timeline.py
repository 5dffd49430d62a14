"""Per-item timeline of the sm_90 Gluon sparse kernel on the GPU (a diagnostic; not collected by pytest).

Runs the auto mode's first kernel (q_regs, persistent pingpong, 3-deep ring) at Wan2.1-1.3B 480p (B = 1, H = 12,
S = 32760, D = 128, bf16, C = 128, random groups and selections as tests/bench_kernels.py) with ``diag_times``: each
program stamps its SM clock at every item's start, queries in registers, mainloop end and epilogue end (consumer
warpgroup 0), warpgroup 1's mainloop end, and the producer's item start, count known and last copies issued
(``sparse_attention_sm90.launch_args``). The stamps of the last of ``--reps`` back-to-back launches (sustained clocks)
give the median cycles per item of each phase, per key tile of the mainloop, and how far the producer runs ahead;
the same with the K/V copies left out (``diag_no_copy``: the consumers alone). The SM clock rate comes from the
clock span of the launch against its CUDA-event time. Writes ``--out`` (JSON) and prints a table.

Usage: python tests/diag_gluon_timeline.py --out DIR [--densities 0.1,0.5] [--reps 20] [--schedule NAME] [--whole-only]
[--no-store-too] (NAME: a ``sparse_dispatch.GLUON_SCHEDULES`` entry without a split or tail launch, default the q_regs
schedule below; --whole-only: no "consumers alone" runs; --no-store-too: also the whole kernel without its output
stores, ``diag_no_store``)
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_kernels as bk  # noqa: E402  (loads the pack from the checkout)

from comfyui_mc_sparse_pack.kernels import reference  # noqa: E402

SCHEDULE = dict(pingpong=True, persistent=True, num_stages=3, thread_arrive=True, early_q=True, cp_async_fence=False,
                q_regs=True)
SLOTS = ("c_start", "c_q", "c_main", "c_epi", "c1_main", "p_start", "p_count", "p_last")


def _phases(st: torch.Tensor, n_tiles: int) -> dict:
    """Median cycles per item (items 1 .. n - 3 of every program: no launch ramp, none of the last round) of each
    phase; ``st``: (programs, items, 8) stamps (every program has items - 1 items; the last round only some)."""
    st = st[:, :-1].contiguous().view(torch.int32).to(torch.int64)  # the clock bits
    d = lambda a, b: (st[..., SLOTS.index(b)] - st[..., SLOTS.index(a)]) % (1 << 32)  # noqa: E731
    inner = slice(1, st.shape[1] - 1)
    period = (st[:, 2:, 0] - st[:, 1:-1, 0]) % (1 << 32)  # item i + 1's start - item i's start
    rows = dict(item_period=period, q_wait=d("c_start", "c_q")[:, inner], mainloop=d("c_q", "c_main")[:, inner],
                epilogue=d("c_main", "c_epi")[:, inner], wg1_after_wg0=d("c_main", "c1_main")[:, inner],
                producer_count=d("p_start", "p_count")[:, inner], producer_item=d("p_start", "p_last")[:, inner],
                producer_lead=((st[:, inner, 0] - st[:, inner, 5]) % (1 << 32)))
    out = {k: float(v.double().median()) for k, v in rows.items()}
    out["mainloop_per_tile"] = out["mainloop"] / n_tiles
    out["outside_mainloop"] = out["item_period"] - out["mainloop"]
    return out


def run(density: float, reps: int, no_copy: bool, schedule: dict = SCHEDULE, no_store: bool = False) -> dict:
    g90 = bk._gluon_kernel()
    B, H, S, D, C = 1, 12, 32760, 128, 128
    G = -(-S // C)
    gen = torch.Generator(device="cuda").manual_seed(1234)
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    perm = bk.random_perm(B, H, S, gen)
    kq = int(density * S)
    idx = bk.random_kv_idx(B, H, G, S, kq, gen)
    programs = torch.cuda.get_device_properties(0).multi_processor_count
    n_work = B * H * G
    items = -(-n_work // programs)
    diag = torch.zeros(programs * items * 8, dtype=torch.float32, device="cuda")
    tune = dict(schedule, diag_times=diag, diag_no_copy=no_copy, diag_no_store=no_store)
    out = g90.sparse_attention(q, k, v, perm, idx, **tune)
    if not (no_copy or no_store):  # the stamps change no result (2 heads vs the float32 reference)
        ref = reference.sparse_attention(*(t[:, :2].float() for t in (q, k, v)), perm[:, :2], idx[:, :2])
        err = float((out[:, :2].float() - ref).norm() / ref.norm())
        assert err < 2e-2, err
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(reps - 1):
        g90.sparse_attention(q, k, v, perm, idx, **tune)
    a.record()
    g90.sparse_attention(q, k, v, perm, idx, **tune)
    b.record()
    torch.cuda.synchronize()
    ms = a.elapsed_time(b)
    st = diag.view(programs, items, 8).cpu()
    clk = st.view(torch.int32).to(torch.int64)
    span = [int((clk[p, -1, 3] - clk[p, 0, 0]) % (1 << 32)) for p in range(programs) if n_work > p + (items - 1) * programs]
    mhz = statistics.median(span) / (ms * 1e3)
    n_tiles = -(-kq // 128)
    res = dict(density=density, no_copy=no_copy, no_store=no_store, ms=ms, sm_mhz_est=mhz, items_per_program=items, n_tiles=n_tiles,
               cycles=_phases(st, n_tiles))
    res["us"] = {k: v / mhz for k, v in res["cycles"].items()}
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--densities", default="0.1,0.5")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--schedule", default="", help="a sparse_dispatch.GLUON_SCHEDULES name (default: SCHEDULE)")
    ap.add_argument("--whole-only", action="store_true", help="no 'consumers alone' (diag_no_copy) runs")
    ap.add_argument("--no-store-too", action="store_true", help="also each whole-kernel run without its O / LSE "
                    "stores (diag_no_store: wrong results, the epilogue's stores' share of the item time)")
    args = ap.parse_args()
    schedule = SCHEDULE
    if args.schedule:
        d = importlib.import_module("comfyui_mc_sparse_pack.kernels.triton.sparse_dispatch")
        schedule = d.GLUON_SCHEDULES[args.schedule]
    rows = []
    for s in (float(x) for x in args.densities.split(",")):
        runs = [(False, False)] + ([(False, True)] if args.no_store_too else []) + ([] if args.whole_only
                                                                                    else [(True, False)])
        for no_copy, no_store in runs:
            r = run(s, args.reps, no_copy, schedule, no_store)
            r["schedule"] = args.schedule or "q_regs (SCHEDULE)"
            rows.append(r)
            c = r["cycles"]
            what = "consumers alone" if no_copy else "whole kernel, no O stores" if no_store else "whole kernel"
            print(f"s={s} {what}: {r['ms']:.3f} ms, ~{r['sm_mhz_est']:.0f} MHz, "
                  f"{r['n_tiles']} tiles/item; cycles per item: period {c['item_period']:.0f}, mainloop "
                  f"{c['mainloop']:.0f} ({c['mainloop_per_tile']:.0f}/tile), outside mainloop {c['outside_mainloop']:.0f} "
                  f"(q wait {c['q_wait']:.0f}, epilogue {c['epilogue']:.0f}), wg1 after wg0 {c['wg1_after_wg0']:.0f}, "
                  f"producer: count {c['producer_count']:.0f}, item {c['producer_item']:.0f}, lead {c['producer_lead']:.0f}",
                  flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"gluon_timeline{'_' + args.schedule.split()[-1] if args.schedule else ''}.json").write_text(
        json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
