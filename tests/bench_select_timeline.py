"""select_kv's launches on the GPU timeline: each kernel's duration and the idle gap before it (issue 15, p2ops).

Not collected by pytest. At the shape of tests/bench_select_race.py's inputs (``--shape``, default Wan2.1-1.3B 480p),
for each row of ``--rows`` (bench_select_race's race-1 rows: "defaults", or a row name of its RACE1_ROWS, run under
that row's globals / environment) and each s in ``--densities``: select_kv is warmed up (compiles), then one flash-attn-4 dense call
and ``--calls`` select_kv calls are enqueued back to back under torch.profiler (CUDA activity only: the kernels'
start / end stamps from CUPTI; the host stays ahead of the GPU after the dense call, as in a model run and in
tests/_timing.race). Lines "TIMELINE": per launch position of a call (the calls after the first two), the kernel's
name, its mean duration and the mean idle gap before it (after the previous kernel's end; for the first launch, after
the previous call's last kernel), in microseconds; then the call's span (first start to last end), the sum of its
kernel durations and of its gaps. Profiled durations are a timeline's, not the method of record's figures
(tests/_timing.race): they say where the time of a select_kv call goes, not how fast it is.
Usage (checkout root, H200): python tests/bench_select_timeline.py --out OUT [--shape 1.3b] [--densities 0.5,0.1]
[--calls 12] [--rows "defaults,bracket"] [--commit HASH]. Bad flags (a shape, row or density it does not know,
fewer than 3 calls) stop it before the inputs are made (``check_args``). Writes OUT/select_timeline.json (and
OUT/trace_<shape>_<row>_<s>.json, the chrome traces). Expected ~25 s at 1.3B for one row (inputs ~10 s, compiles
~10 s), ~3 s per further row with warm compiles.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_select_race as bsr  # noqa: E402  (loads the pack)

GPU_CATS = ("kernel", "gpu_memset", "gpu_memcpy")


def gpu_events(trace: dict) -> list[tuple[str, float, float]]:
    """(name, start us, duration us) of the GPU work in a chrome trace (kernels, memsets, copies), by start."""
    ev = [(e["name"], float(e["ts"]), float(e.get("dur", 0.0))) for e in trace.get("traceEvents", [])
          if e.get("cat") in GPU_CATS]
    return sorted(ev, key=lambda e: e[1])


def split_calls(events, first: str) -> list[list[tuple[str, float, float]]]:
    """The events cut into calls, each starting at a kernel whose name contains ``first`` (events before the first
    such kernel, e.g. the dense call, dropped)."""
    calls: list = []
    for e in events:
        if first in e[0]:
            calls.append([])
        if calls:
            calls[-1].append(e)
    return calls


def table(calls, skip: int = 2) -> dict:
    """Per launch position (calls with the most common launch count, after the first ``skip``): name, mean duration,
    mean gap before it (position 0: after the previous call's last end); the mean span, kernel sum and gap sum."""
    prev_end = {i: calls[i - 1][-1][1] + calls[i - 1][-1][2] for i in range(1, len(calls))}
    n = statistics.mode(len(c) for c in calls)
    use = [i for i in range(max(1, skip), len(calls)) if len(calls[i]) == n]
    rows = []
    for p in range(n):
        durs = [calls[i][p][2] for i in use]
        gaps = [calls[i][p][1] - (prev_end[i] if p == 0 else calls[i][p - 1][1] + calls[i][p - 1][2]) for i in use]
        rows.append(dict(name=calls[use[0]][p][0][:90], dur_us=statistics.mean(durs), gap_us=statistics.mean(gaps)))
    span = [calls[i][-1][1] + calls[i][-1][2] - calls[i][0][1] for i in use]
    return dict(calls=len(use), launches=n, rows=rows, span_us=statistics.mean(span),
                kernels_us=sum(r["dur_us"] for r in rows), gaps_us=sum(r["gap_us"] for r in rows[1:]),
                gap_before_call_us=rows[0]["gap_us"] if rows else 0.0)


def check_args(args) -> str | None:
    """What is wrong with the flags (None: nothing), checked before the inputs are made (~10 s of GPU time at 1.3B):
    ``--shape`` a key of bench_select_race.SHAPES, each ``--rows`` entry "defaults" or a race-1 row
    (``RACE1_ROWS``), each ``--densities`` entry a number in (0, 1], ``--calls`` >= 3 (the table drops the first
    two calls)."""
    if args.shape not in bsr.SHAPES:
        return f"--shape must be one of {', '.join(bsr.SHAPES)}, got {args.shape!r}"
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r != "defaults" and r not in bsr.RACE1_ROWS]
    if not rows or unknown:
        return f"--rows: unknown {unknown or 'empty'}; known: defaults, {', '.join(bsr.RACE1_ROWS)}"
    try:
        dens = [float(x) for x in args.densities.split(",")]
    except ValueError:
        return f"--densities must be comma-separated numbers, got {args.densities!r}"
    if not all(0.0 < s <= 1.0 for s in dens):
        return f"--densities must each be in (0, 1], got {args.densities!r}"
    if args.calls < 3:
        return f"--calls must be >= 3 (the first two calls are left out of the table), got {args.calls}"
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="1.3b")
    ap.add_argument("--densities", default="0.5,0.1")
    ap.add_argument("--calls", type=int, default=12)
    ap.add_argument("--commit", default="")
    ap.add_argument("--rows", default="defaults")
    args = ap.parse_args()
    why = check_args(args)
    if why:
        ap.error(why)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    q, k, v, lse, perm = bsr.make_inputs(args.shape)
    S = q.shape[2]
    _, dense = bsr.dense_fn(q, k, v)
    report = dict(commit=args.commit, shape=args.shape, gpu=torch.cuda.get_device_name(), rows={})
    print(f"[{time.time() - t0:5.1f} s] inputs ready (S {S}, H {q.shape[1]})", flush=True)
    for row in (r.strip() for r in args.rows.split(",") if r.strip()):
        for s in (float(x) for x in args.densities.split(",")):
            profile(row, s, (q, k, lse, perm), dense, args, out, report, t0)
    print(f"[{time.time() - t0:5.1f} s] done", flush=True)


def profile(row, s, inputs, dense, args, out, report, t0):
    """One row at density s: warm-up, then dense + ``args.calls`` calls under the profiler; prints and records the
    table (report["rows"][row][s])."""
    q, k, lse, perm = inputs
    kk = int(s * q.shape[2])
    fn = bsr.select_row(row, {} if row == "defaults" else bsr.RACE1_ROWS[row], q, k, lse, perm, kk)  # (its globals)
    fn()
    fn()
    torch.cuda.synchronize()
    act = torch.profiler.ProfilerActivity
    with torch.profiler.profile(activities=[act.CUDA if torch.cuda.is_available() else act.CPU]) as prof:
        dense()
        for _ in range(args.calls):
            fn()
        torch.cuda.synchronize()
    path = out / f"trace_{args.shape}_{row.replace(' ', '_')}_{s}.json"
    prof.export_chrome_trace(str(path))
    events = gpu_events(json.loads(path.read_text()))
    calls = split_calls(events, "_fp8_partial_stats")
    dense_us = sum(e[2] for e in events if calls and e[1] < calls[0][0][1])  # (one call from idle: a scale only)
    tag = f"{args.shape} {row} s={s}"
    if len(calls) < 3:
        print(f"TIMELINE {tag}: only {len(calls)} calls found in the trace", flush=True)
        return
    t = report["rows"].setdefault(row, {})[str(s)] = dict(table(calls), dense_us=dense_us)
    print(f"[{time.time() - t0:5.1f} s] TIMELINE {tag} ({t['calls']} calls, {t['launches']} launches): span "
          f"{t['span_us']:.1f} us = kernels {t['kernels_us']:.1f} + gaps {t['gaps_us']:.1f}; gap before the call "
          f"{t['gap_before_call_us']:.1f}; dense (one call) {dense_us:.1f}", flush=True)
    for r in t["rows"]:
        print(f"TIMELINE   {r['dur_us']:9.1f} us  (gap {r['gap_us']:6.1f})  {r['name']}", flush=True)
    (out / "select_timeline.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
