"""SM clock and board power while each CuTeDSL op row runs back to back (issue 16's 14B per-tile gap; not collected by
pytest, not a method-of-record figure).

The race (``_timing.race``) gives each row's time; this asks what the GPU ran at meanwhile: per row, calls back to
back for ``--seconds`` while ``nvidia-smi`` samples the SM clock, board power, temperature and the active clock-event
(throttle) reasons every ``--sample-ms``; the first ``--settle`` seconds of each segment are left out. Rows (the
shapes and inputs of ``bench_cutedsl.py``): flash-attn-4 dense with LSE, the op (``rules.STAGED_OPTIONS``), the op
with every group of a head on its first group's key set ("shared": same bytes, every row read by all the head's
groups), the op with every group's keys drawn from its head's first half ("half": same bytes, half the rows in
flight), the op without its K/V copies ("diag": wrong output by construction, the consumers' own speed), then the op
and dense again (drift); ``--op-options``: the op under each of these staged-epilogue option sets too
($MC_SPARSE_CUTEDSL_OPTIONS; each checked against the op's output first, rel. diff < 1e-2). Printed per row: ms per call, cycles per key tile (ms x mean SM MHz / tiles per SM) and us
per key tile, so rows that run at different clocks compare per cycle. If the op runs at a lower clock than dense at
the same power, the gap is power (energy per key tile), not latency.

Usage: python tests/bench_cutedsl_clocks.py --out $OUT/clocks.json [--points 14b:0.1,14b:0.5,1.3b:0.1]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import signal
import subprocess
import sys
import time

import torch

import bench_cutedsl as bc  # noqa: E402 (loads the pack)

kernels, rules = bc.kernels, bc.rules
FIELDS = "timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"


def sampler(sample_ms: int, path: str):
    """nvidia-smi sampling FIELDS every sample_ms into the file ``path`` (falls back to the older throttle field
    name, then to none): (process, fields)."""
    for fields in (FIELDS, FIELDS.replace("clocks_event_reasons", "clocks_throttle_reasons"), FIELDS.rsplit(",", 1)[0]):
        p = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True)
        if p.returncode == 0 and "Not Supported" not in p.stdout and "not a valid" not in p.stdout:
            return subprocess.Popen(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits",
                                     "-lms", str(sample_ms)], stdout=open(path, "w")), fields
    raise SystemExit("nvidia-smi gives none of " + FIELDS)


def parse(lines):
    """[(epoch s, MHz, W, C, reasons str)] from nvidia-smi CSV lines (timestamp in local time)."""
    rows = []
    for ln in lines:
        parts = [x.strip() for x in ln.split(",")]
        try:
            t = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            rows.append((t, float(parts[1]), float(parts[2]), float(parts[3]), parts[4] if len(parts) > 4 else ""))
        except (ValueError, IndexError):
            continue
    return rows


def segment(fn, seconds):
    """Calls of fn back to back for about ``seconds``: (host start, host end, ms per call by CUDA events)."""
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    torch.cuda.synchronize()
    n = max(3, round(seconds * 1e3 / max(a.elapsed_time(b), 1e-3)))
    t0 = time.time()
    a.record()
    for _ in range(n):
        fn()
    b.record()
    torch.cuda.synchronize()
    return t0, time.time(), a.elapsed_time(b) / n


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--points", default="14b:0.1,14b:0.5,1.3b:0.1")
    ap.add_argument("--seconds", type=float, default=1.2)
    ap.add_argument("--settle", type=float, default=0.3)
    ap.add_argument("--sample-ms", type=int, default=20)
    ap.add_argument("--op-options", default="", help='";"-separated staged-epilogue option sets timed as op rows')
    args = ap.parse_args()
    from comfyui_mc_sparse_pack.kernels.cutedsl import op as cop
    smi_log = os.path.splitext(os.path.abspath(args.out))[0] + ".smi.csv"
    os.makedirs(os.path.dirname(smi_log), exist_ok=True)
    proc, fields = sampler(args.sample_ms, smi_log)
    print(f"GPU {torch.cuda.get_device_name()}; nvidia-smi fields {fields}", flush=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    segs = []
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))  # timeout(1): stop, but summarise what was measured
    try:
        for point in args.points.split(","):
            name, s = point.split(":")
            s = float(s)
            shp = bc.SHAPES[name]
            B, H, S, D = shp["B"], shp["H"], shp["S"], shp["D"]
            gen = torch.Generator(device="cuda").manual_seed(0)
            q, k, v = (bc.native(gen, B, S, H, D) for _ in range(3))
            qc, kc, vc = (t.contiguous() for t in (q, k, v))
            out = torch.empty_like(q)
            perm, idx = bc.inputs(gen, B, H, S, s)
            idx_sh = idx[:, :, :1].expand_as(idx).contiguous()
            idx_half = bc.half_footprint(gen, idx, S, s)
            diag_raw = ",".join((*rules.staged_options(), "diag_no_copy"))
            rows = [
                ("dense", lambda: kernels.dense_attention(qc, kc, vc, return_lse=True, backend="flash_attn4")),
                ("op", lambda: kernels.sparse_attention(q, k, v, perm, idx, out=out, backend="cutedsl")),
                ("shared", lambda: kernels.sparse_attention(q, k, v, perm, idx_sh, out=out, backend="cutedsl")),
                ("half", lambda: kernels.sparse_attention(q, k, v, perm, idx_half, out=out, backend="cutedsl")),
                ("diag", bc.with_options(diag_raw, lambda: cop.sparse_attention(q, k, v, perm, idx, out=out))),
                ("op again", lambda: kernels.sparse_attention(q, k, v, perm, idx, out=out, backend="cutedsl")),
                ("dense again", lambda: kernels.dense_attention(qc, kc, vc, return_lse=True, backend="flash_attn4")),
            ]
            for raw in [x for x in args.op_options.split(";") if x]:
                fn = bc.with_options(raw, lambda: kernels.sparse_attention(q, k, v, perm, idx, out=out,
                                                                          backend="cutedsl"))
                want = rows[1][1]().clone()
                with bc.registry.recording(bc.registry.Record()) as rec:
                    got = fn()
                rel = float((got.float() - want.float()).norm() / want.float().norm())
                bad = rec.choices["sparse_attention"].backend != "cutedsl" or not rel < 1e-2
                print(f"{point} op ({raw}): rel diff to the op {rel:.2e}" + (": WRONG or fell back, not timed"
                                                                             if bad else ""), flush=True)
                if not bad:
                    rows.insert(-2, (f"op ({raw})", fn))
            with bc.registry.recording(bc.registry.Record()) as rec:  # a fallback would be timed instead
                rows[1][1]()
            if rec.choices["sparse_attention"].backend != "cutedsl":
                raise SystemExit(f"the cutedsl kernel did not run: {rec.choices} {rec.failures}")
            groups = B * H * math.ceil(S / bc.C)
            tiles = {"dense": math.ceil(S / 128), "sparse": math.ceil(int(s * S) / 128)}
            for tag, fn in rows:
                t0, t1, ms = segment(fn, args.seconds)
                per_sm = groups * tiles["dense" if tag.startswith("dense") else "sparse"] / sms
                segs.append(dict(point=point, row=tag, t0=t0 + args.settle, t1=t1, ms=ms, tiles_per_sm=per_sm))
                print(f"{point} {tag}: {ms:.3f} ms per call, host {t0:.3f} .. {t1:.3f} s", flush=True)
            del q, k, v, qc, kc, vc, out, perm, idx, idx_sh
            torch.cuda.empty_cache()
    finally:  # also on a timeout's SIGTERM (the handler above): the segments measured so far
        time.sleep(0.2)
        proc.terminate()
        proc.wait()
        with open(smi_log) as f:
            samples = parse(f.read().splitlines())
        summarize(segs, samples, fields, args.out)


def summarize(segs, samples, fields, out):
    """Per segment: the nvidia-smi samples inside it (mean SM MHz, W, max temperature, reasons), cycles per key
    tile; printed and written to ``out`` (JSON)."""
    report = []
    for sg in segs:
        inside = [x for x in samples if sg["t0"] <= x[0] <= sg["t1"]]
        if not inside:
            print(f"{sg['point']} {sg['row']}: {sg['ms']:.3f} ms, no nvidia-smi sample inside", flush=True)
            report.append(sg)
            continue
        mhz = sum(x[1] for x in inside) / len(inside)
        sg.update(n_samples=len(inside), sm_mhz=mhz, mhz_min=min(x[1] for x in inside),
                  watts=sum(x[2] for x in inside) / len(inside), temp_c=max(x[3] for x in inside),
                  reasons=sorted({x[4] for x in inside}),
                  us_per_tile=sg["ms"] * 1e3 / sg["tiles_per_sm"],
                  cycles_per_tile=sg["ms"] * 1e3 / sg["tiles_per_sm"] * mhz)
        print(f"{sg['point']} {sg['row']}: {sg['ms']:.3f} ms, {sg['us_per_tile']:.3f} us / "
              f"{sg['cycles_per_tile']:.0f} cycles per key tile; SM {mhz:.0f} MHz (min {sg['mhz_min']:.0f}), "
              f"{sg['watts']:.0f} W, {sg['temp_c']:.0f} C, reasons {sg['reasons']} ({len(inside)} samples)",
              flush=True)
        report.append(sg)
    with open(out, "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), fields=fields, segments=report), f, indent=1)


if __name__ == "__main__":
    main()
