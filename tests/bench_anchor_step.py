"""Where the anchor step's time goes at Wan2.1-1.3B 480p, and the pack's host work outside the steps (issue 15).

A benchmark, not a test (not collected). No ComfyUI needed. The whole 50-step 1.3B 480p 'fast' run (1.5497x, main
aad9348) spent its anchor step 1.788 s against an ideal 1.632 s: 58 anchor calls (29 sparse blocks x 2 CFG chunks)
of 21.6 ms each against 11.3 ms for the caller's dense attention of one chunk, where the ideal is dense x (1 + 0.5 +
s) = 18.8 ms; and it spent 0.095 s outside the steps against 0.055 s unpatched. This script measures, side by side in
one process, on random bf16 q/k/v that are strided [B, H, S, D] views of [B, S, H*D] tensors (as ComfyUI passes
them), H = 12, S = 32760, D = 128, preset 'fast' (s = 0.15, C = 128, kv_tile 64):

1. ``[anchor parts]``: each part of one anchor call on one CFG chunk (B = 1), sustained interleaved timing
   (``tests/_timing.race``, TEAM.md item 7), beside the caller's dense attention (SDPA without LSE on the views, then
   ComfyUI's reshape to [B, S, H*D]): pass 1 (``kernels.dense_attention`` with LSE), the finite check (before
   session 6: 3 min/max reductions + one device read; now 3 sums, in line or on a side stream), PDDP, select_kv, the sparse pass of the residual, R = O - O_sparse, the cache entry's
   encoding (and the bitmask alone, ``encoding.PACK_BITS`` "bytes" vs "words"), the copy into the caller's buffer,
   ``attention.anchor_attention`` whole (with the check beside pass 1, in line, none), the reuse path's bitmask decode
   (``kernels/triton/bitmask.py`` variants "bits" / "bytes");
2. ``[anchor step]``: 29 runner calls at batch 2 (two keys each, ``out=`` a view of a [2, S, H*D] buffer), a fresh
   ``engine.MCSparseRunner`` planned as the adapter plans it, as the model's anchor step makes them, wall clock and
   the runner's own CUDA-event spans, variants interleaved (as is = the finite check beside pass 1 on a side stream,
   ``attention.FINITE_BESIDE``, and the bitmask by words; the check in line; by bytes; both as before session 6; no
   finite check), 2 rounds,
   beside 29 caller dense calls at batch 2;
3. ``[host]``: the pack's host work outside the steps: ``runner.plan``, the summary lines and ``runner.close`` with a
   full anchor step's cache (part 2), the end-of-run read of a run's worth of CUDA-event pairs
   (``timing.CallTimer.times``) with the pairs read as the run goes (``CallTimer.DRAIN``) and all at the end.
CHECKs (GPU): the "words" bitmask equals the "bytes" one bit for bit on the anchor's real selection; both decode
variants equal the selection; the anchor step's outputs and stored selections are identical across variants.

Writes ``<out>/anchor_step.json`` (no scoreboard key: a profile). H200: ~45 s.
Usage (checkout root): python tests/bench_anchor_step.py --out $OUT [--commit HASH] [--kernels triton-only] (pass 1 on
cuDNN as in the 1.3B whole-run bar; by default the fastest dense kernel installed); ``--smoke`` runs every code path
once on a tiny shape on the CPU (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "comfyui_mc_sparse"))
import _standalone  # noqa: E402

_standalone.load_pack()
import importlib  # noqa: E402

from comfyui_mc_sparse_pack import kernels  # noqa: E402
from comfyui_mc_sparse_pack.comfyui_mc_sparse import attention, cache, encoding, engine, timing  # noqa: E402
from comfyui_mc_sparse_pack.comfyui_mc_sparse.config import MCSparseConfig  # noqa: E402
from comfyui_mc_sparse_pack.comfyui_mc_sparse.selection import keys_for_density  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import race  # noqa: E402

SHAPES = {"1.3b": dict(H=12, S=32760, layers=30), "smoke": dict(H=2, S=300, layers=3)}
D = 128
DENSITY = 0.15  # preset 'fast'
STEPS = 50


def now(device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def qkv(batch: int, H: int, S: int, device, seed: int):
    """q, k, v: strided [B, H, S, D] bf16 views of [B, S, H*D] tensors (ComfyUI's layout)."""
    g = torch.Generator(device=device).manual_seed(seed)
    return tuple(torch.randn(batch, S, H * D, generator=g, device=device, dtype=torch.bfloat16)
                 .view(batch, S, H, D).transpose(1, 2) for _ in range(3))


def caller_dense(q, k, v):
    """ComfyUI's ``attention_pytorch`` on the views: SDPA, then the [B, S, H*D] reshape (a copy)."""
    B, H, S, _ = q.shape
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, S, H * D)


def timed(fns: dict, device, rounds: int = 5, target_ms: float = 20.0) -> dict:
    if device.type != "cuda":  # --smoke: every path once
        out = {}
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            out[name] = (time.perf_counter() - t) * 1000.0
        return out
    return race(fns, rounds=rounds, target_ms=target_ms)


def anchor_parts(H: int, S: int, device, log) -> dict:
    """Part 1 (module docstring)."""
    cfg = MCSparseConfig(density=DENSITY, group_size=128, warmup_steps=0, warmup_layers=0, anchor_steps=(0,),
                         residual_dtype="bfloat16")
    q, k, v = qkv(1, H, S, device, seed=1)
    scale = 1.0 / math.sqrt(D)
    K = keys_for_density(cfg.density, S, cfg.kv_tile)
    record = kernels.registry.Record()
    with kernels.registry.recording(record):
        out_d, lse = kernels.dense_attention(q, k, v, scale=scale, return_lse=True)
        perm = kernels.pddp_groups(q, cfg.group_size, power_iters=cfg.power_iters)
        kv_idx = kernels.select_kv(q, k, lse, perm, K, group_size=cfg.group_size, kv_tile=cfg.kv_tile, scale=scale)
        sparse = kernels.sparse_attention(q, k, v, perm, kv_idx, scale=scale)
    ran = {op: c.backend for op, c in sorted(record.choices.items())}
    o, entry = attention.anchor_attention(q, k, v, cfg, scale=scale)
    dst = torch.empty(1, S, H * D, device=device, dtype=torch.bfloat16).view(1, S, H, D).transpose(1, 2)
    checks = {}
    saved = encoding.PACK_BITS
    try:
        encoding.PACK_BITS = "bytes"
        a = encoding.encode_selection(kv_idx, S, K, "bitmask", checked=True)
        encoding.PACK_BITS = "words"
        b = encoding.encode_selection(kv_idx, S, K, "bitmask", checked=True)
    finally:
        encoding.PACK_BITS = saved
    checks["bitmask words == bytes"] = bool(torch.equal(a.data, b.data))
    bitmask = importlib.import_module(f"{kernels.__name__}.triton.bitmask") if device.type == "cuda" else None
    variants = tuple(bitmask.VARIANTS) if bitmask is not None else ()
    dec_out = torch.empty_like(kv_idx)
    for name in variants:
        dec_out.fill_(-7)
        bitmask.decode_bitmask(a.data, dec_out, num_tokens=S, variant=name)
        checks[f"decode {name} == selection"] = bool(torch.equal(dec_out, kv_idx))

    def flagged(module, name, value, fn):
        def run():
            saved_ = getattr(module, name)
            setattr(module, name, value)
            try:
                fn()
            finally:
                setattr(module, name, saved_)
        return run

    def aminmax_check():  # the finite check before session 6: one aminmax per tensor on the views, one read
        extremes = torch.stack([torch.stack(torch.aminmax(t)).float() for t in (q, k, v)])
        torch.isfinite(extremes).all(dim=1).tolist()

    def encode_bits(how):
        def fn():
            saved_ = encoding.PACK_BITS
            encoding.PACK_BITS = how
            try:
                encoding.encode_selection(kv_idx, S, K, "bitmask", checked=True)
            finally:
                encoding.PACK_BITS = saved_
        return fn

    fns = {
        "caller dense (SDPA no LSE + reshape)": lambda: caller_dense(q, k, v),
        "pass 1 dense + LSE (kernels auto)": lambda: kernels.dense_attention(q, k, v, scale=scale, return_lse=True),
        "finite check before s6 (3 aminmax + 1 read)": aminmax_check,
        "finite check, sums, in line": flagged(attention, "FINITE_BESIDE", False, lambda: attention._FiniteCheck(
            (("q", q), ("k", k), ("v", v))).result()),
        "finite check, sums, side stream": flagged(attention, "FINITE_BESIDE", True, lambda: attention._FiniteCheck(
            (("q", q), ("k", k), ("v", v))).result()),
        "PDDP": lambda: kernels.pddp_groups(q, cfg.group_size, power_iters=cfg.power_iters),
        "select_kv (pass 2 + top-K)": lambda: kernels.select_kv(q, k, lse, perm, K, group_size=cfg.group_size,
                                                                kv_tile=cfg.kv_tile, scale=scale),
        "sparse (residual pass)": lambda: kernels.sparse_attention(q, k, v, perm, kv_idx, scale=scale),
        "R = O - O_sparse": lambda: attention._residual(out_d, sparse, "bfloat16"),
        "encode_entry (groups, bitmask, R)": lambda: cache.encode_entry(entry, index_encoding=cfg.index_encoding,
                                                                        residual_dtype="bfloat16"),
        "bitmask by bytes": encode_bits("bytes"),
        "bitmask by words": encode_bits("words"),
        "copy into the caller's buffer": lambda: dst.copy_(o),
        "anchor_attention": lambda: attention.anchor_attention(q, k, v, cfg, scale=scale),
        "anchor_attention, no finite check": lambda: attention.anchor_attention(q, k, v, cfg, scale=scale,
                                                                                check_finite=False),
        "anchor_attention, finite check in line": flagged(attention, "FINITE_BESIDE", False, lambda:
                                                          attention.anchor_attention(q, k, v, cfg, scale=scale)),
    }
    for name in variants:
        fns[f"decode bitmask {name}"] = (lambda n: lambda: bitmask.decode_bitmask(a.data, dec_out, num_tokens=S,
                                                                                variant=n))(name)
    ms = timed(fns, device)
    base = ms["caller dense (SDPA no LSE + reshape)"]
    parts = ("pass 1 dense + LSE (kernels auto)", "finite check, sums, side stream", "PDDP",
             "select_kv (pass 2 + top-K)", "sparse (residual pass)", "R = O - O_sparse",
             "encode_entry (groups, bitmask, R)", "copy into the caller's buffer")
    total = sum(ms[p] for p in parts)
    ideal = base * (1 + 0.5 + DENSITY)
    log(f"[anchor parts] one chunk [1, {H}, {S}, {D}] bf16, K {K}, method of record (race, median of 5 rounds); "
        f"caller dense {base:.3f} ms; ideal anchor call dense x (1.5 + s) = {ideal:.3f} ms; backends {ran}")
    for name, t in ms.items():
        log(f"  {t:9.3f} ms  {t / base:6.3f} x caller dense  {name}")
    log(f"  parts of an anchor call + the copy: {total:.3f} ms ({total / base:.3f} x caller dense); whole "
        f"anchor_attention + copy {ms['anchor_attention'] + ms[parts[-1]]:.3f} ms; ideal {ideal:.3f} ms")
    for name, ok in checks.items():
        log(f"[anchor parts] CHECK {name}: {'OK' if ok else 'FAILED'}")
    del q, k, v, out_d, lse, sparse, o, entry, dst, dec_out
    return {"ms": ms, "backends": ran, "caller_dense_ms": base, "ideal_anchor_call_ms": ideal, "parts_total_ms": total,
            "num_keys": K, "checks": checks}


def _runner(H: int, S: int, layers: int, device):
    cfg = MCSparseConfig(density=DENSITY, group_size=128, warmup_steps=1, warmup_layers=1, anchor_steps=(0,))
    runner = engine.MCSparseRunner(cfg, backend="auto")
    t0 = time.perf_counter()
    runner.plan(heads=H, head_dim=D, layers=layers, tokens=S, branches=2, batch=1, num_steps=STEPS,
                device=device if device.type == "cuda" else None)
    return runner, (time.perf_counter() - t0) * 1000.0


def anchor_step(H: int, S: int, layers: int, device, log) -> dict:
    """Part 2 and 3 (module docstring)."""
    q, k, v = qkv(2, H, S, device, seed=2)
    buf = torch.empty(2, S, H * D, device=device, dtype=torch.bfloat16)
    out = buf.view(2, S, H, D).transpose(1, 2)
    variants = {  # "as is": the defaults (finite check beside pass 1, bitmask by words)
        "as is": {},
        "check in line": {"beside": False},
        "bitmask by bytes": {"pack": "bytes"},
        "before s6 (both)": {"beside": False, "pack": "bytes"},
        "no finite check": {"finite": False},
    }
    res = {name: {"wall_ms": [], "span_ms": [], "plan_ms": [], "summary_ms": [], "close_ms": []} for name in variants}
    res["caller dense"] = {"wall_ms": []}
    outputs, selections = {}, {}
    rounds = 2 if device.type == "cuda" else 1
    for r in range(rounds + 1):  # round 0 warms up (compiles, grows the allocator's pools); not counted
        for name, var in variants.items():
            saved_pack, saved_anchor, saved_ov = encoding.PACK_BITS, engine.anchor_attention, attention.FINITE_BESIDE
            encoding.PACK_BITS = var.get("pack", saved_pack)
            attention.FINITE_BESIDE = var.get("beside", saved_ov)
            if var.get("finite") is False:
                engine.anchor_attention = functools.partial(attention.anchor_attention, check_finite=False)
            try:
                runner, plan_ms = _runner(H, S, layers, device)
                t0 = now(device)
                for layer in range(1, layers):
                    keys = [cache.CacheKey(layer=layer, branch=b, window=None, shape=(1, H, S, D))
                            for b in ("cond", "uncond")]
                    runner.call(q, k, v, step=0, layer=layer, keys=keys, out=out)
                wall = (now(device) - t0) * 1000.0
            finally:
                encoding.PACK_BITS, engine.anchor_attention = saved_pack, saved_anchor
                attention.FINITE_BESIDE = saved_ov
            t0 = time.perf_counter()
            lines = runner.summary_lines()
            summary_ms = (time.perf_counter() - t0) * 1000.0
            spans = [ms for v_ in runner.timer.times("anchor").values() for ms in v_]
            if r == rounds:
                outputs[name] = buf.clone()
                last = runner.cache.get(keys[0])
                selections[name] = last.selection.data.clone() if hasattr(last, "selection") else None
            t0 = now(device)
            runner.close()
            close_ms = (now(device) - t0) * 1000.0
            if r:
                res[name]["wall_ms"].append(wall)
                res[name]["span_ms"].append(sum(spans))
                res[name]["plan_ms"].append(plan_ms)
                res[name]["summary_ms"].append(summary_ms)
                res[name]["close_ms"].append(close_ms)
                res[name]["calls"] = len(spans)
                res[name]["summary_lines"] = len(lines)
            del runner
        t0 = now(device)
        for _ in range(1, layers):
            caller_dense(q, k, v)
        if r:
            res["caller dense"]["wall_ms"].append((now(device) - t0) * 1000.0)
    dense = statistics.median(res["caller dense"]["wall_ms"])
    ideal = dense * (1 + 0.5 + DENSITY)
    log(f"[anchor step] {layers - 1} runner calls at batch 2 ([2, {H}, {S}, {D}] views, out= view), fresh planned "
        f"runner each, {rounds} rounds interleaved (+1 warm-up); {layers - 1} caller dense calls {dense:.1f} ms; "
        f"ideal anchor calls dense x (1.5 + s) = {ideal:.1f} ms")
    for name in variants:
        r_ = res[name]
        w, s_ = statistics.median(r_["wall_ms"]), statistics.median(r_["span_ms"])
        r_["median_wall_ms"], r_["median_span_ms"] = w, s_
        log(f"  {name:18s} wall {w:8.1f} ms ({w / dense:.3f} x dense, {w - ideal:+.1f} ms vs ideal; rounds "
            + ", ".join(f"{x:.1f}" for x in r_["wall_ms"]) + f"); call spans {s_:.1f} ms ({r_.get('calls')} chunk "
            f"calls, {s_ / max(1, r_.get('calls', 1)):.3f} ms each); plan {statistics.median(r_['plan_ms']):.2f} ms, "
            f"summary {statistics.median(r_['summary_ms']):.2f} ms, close {statistics.median(r_['close_ms']):.2f} ms")
    base = "as is"
    for name in list(variants)[1:]:
        same_out = bool(torch.equal(outputs[name], outputs[base]))
        sel_a, sel_b = selections[name], selections[base]
        same_sel = sel_a is not None and sel_b is not None and bool(torch.equal(sel_a, sel_b))
        res[name]["check"] = {"outputs_equal": same_out, "selection_equal": same_sel}
        log(f"[anchor step] CHECK {name} vs {base}: outputs {'equal' if same_out else 'DIFFER'}, stored selection "
            f"{'equal' if same_sel else 'DIFFERS'} -> {'OK' if same_out and same_sel else 'FAILED'}")
    res["caller_dense_ms"] = dense
    res["ideal_ms"] = ideal
    del q, k, v, buf, out, outputs, selections
    return res


def host_phases(device, log, pairs: int = 1530, kernel_us: float = 1000.0) -> dict:
    """The end-of-run read of a whole run's CUDA-event pairs (``CallTimer.times``; the 1.3B whole run records 1529:
    311 timed dense + 58 anchor + 1160 reuse calls), with the pairs read as the run goes (``CallTimer.DRAIN``) and all
    at the end (drain 0), side by side: host time of the recording loop around a kernel of ~``kernel_us`` (a busy
    device, as in a run), and of the read at the end."""
    out = {}
    x = torch.zeros(1024, device=device)
    spin = None
    if device.type == "cuda":  # a kernel that keeps the device busy ~kernel_us, like an attention call
        spin = lambda: torch.cuda._sleep(int(kernel_us * 1000 * 1.4))  # noqa: E731  (cycles at ~1.4-2 GHz)
    for drain in (0, timing.CallTimer.DRAIN):
        timer = timing.CallTimer(drain=drain)
        t0 = now(device)
        host = 0.0
        for i in range(pairs):
            h0 = time.perf_counter()
            start = timer.start(device)
            if spin is not None:
                spin()
            x.add_(1.0)
            timer.stop(start, ("dense", "anchor", "reuse")[i % 3], (12, 32760, 128), 2)
            host += time.perf_counter() - h0
            if device.type == "cuda" and i % 64 == 63:
                torch.cuda.synchronize()  # keep the launch queue short (a step syncs at its end)
        loop_ms = (now(device) - t0) * 1000.0
        left = timer.pending
        t0 = time.perf_counter()
        n = sum(len(v) for kind in ("dense", "anchor", "reuse") for v in timer.times(kind).values())
        read_ms = (time.perf_counter() - t0) * 1000.0
        out.setdefault(f"drain {drain}", []).append({"loop_ms": loop_ms, "host_ms_per_call": host * 1000 / pairs,
                                                     "pending_at_end": left, "read_ms": read_ms, "values": n})
    for name, runs in out.items():
        r = runs[-1]
        log(f"[host] {pairs} CUDA-event pairs, {name}: host per call {r['host_ms_per_call'] * 1000:.1f} us (loop "
            f"{r['loop_ms']:.0f} ms on a busy device), pending at the end {r['pending_at_end']}, read at the end "
            f"{r['read_ms']:.2f} ms")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--commit", help="the commit measured (recorded in the JSON)")
    ap.add_argument("--smoke", action="store_true", help="tiny shape on the CPU under TRITON_INTERPRET=1 (code paths)")
    ap.add_argument("--kernels", choices=["installed", "triton-only"], default="installed",
                    help="triton-only: turn off cutedsl and flash_attn4 (the 1.3B whole-run bar's kernels: pass 1 on "
                         "cuDNN through SDPA), as bench_comfyui_speedup.py --kernels triton-only")
    args = ap.parse_args()
    if args.kernels == "triton-only":
        import dataclasses

        reg = kernels.registry
        for b in reg.backends():
            if b.name in ("cutedsl", "flash_attn4"):
                reg.register(dataclasses.replace(b, unavailable_reason="turned off by --kernels triton-only"))
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("--smoke needs TRITON_INTERPRET=1 in the environment")
        from _triton_interp import patch_interpreter  # Triton 3.6 interpreter fixes (tests/_triton_interp.py)

        patch_interpreter()
        device, shape = torch.device("cpu"), SHAPES["smoke"]
    elif not torch.cuda.is_available():
        sys.exit("bench_anchor_step.py needs a CUDA GPU (or --smoke)")
    else:
        device, shape = torch.device("cuda"), SHAPES["1.3b"]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.time()

    def log(msg):
        print(f"[{time.time() - t_start:6.1f}s] {msg}", flush=True)

    report = {"argv": sys.argv, "commit": args.commit, "kernels": args.kernels, "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke)", "shape": shape,
              "density": DENSITY, "backends": kernels.registry.report()}
    for key, fn in (("anchor_parts", lambda: anchor_parts(shape["H"], shape["S"], device, log)),
                    ("anchor_step", lambda: anchor_step(shape["H"], shape["S"], shape["layers"], device, log)),
                    ("host", lambda: host_phases(device, log, pairs=1530 if device.type == "cuda" else 30))):
        try:
            report[key] = fn()
        except Exception as err:  # one part failing must not lose the others
            import traceback

            traceback.print_exc()
            report[key] = {"error": f"{type(err).__name__}: {err}"}
            log(f"[{key}] FAILED: {type(err).__name__}: {err}")
        (out_dir / "anchor_step.json").write_text(json.dumps(report, indent=1, default=str))
    log(f"wall {time.time() - t_start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
