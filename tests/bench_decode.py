"""The reuse path's bitmask decode (``kernels.decode_bitmask``, Triton) at the model's shapes: the two kernel variants
of ``kernels/triton/bitmask.py`` side by side, bit-exact checks, and how much of a decode's GPU time leaks into the
compute stream when it runs on the prefetch's side stream. A benchmark, not a test (not collected).

Per shape (Wan2.1-1.3B 480p 'fast', 14B 720p 'fast' and 'quality': one cache entry's rows, S, K, K_alloc as the
runner stores them; random sorted selections of exactly K keys per row, encoded by ``encoding.encode_selection``):
1. each variant's output against the torch reference decode, bit for bit, into half of a stacked buffer (CHECK);
2. ms per call of each variant, sustained interleaved timing (``tests/_timing.race``, TEAM.md item 7), and the
   bytes moved per second (bitmask read + int32 written);
3. leakage: a chain of bf16 GEMMs of the 14B FFN's shape on the current stream, timed alone and with ``n`` decodes
   queued at once on a high-priority side stream (as ``prefetch.ReuseLoader`` does): (chain with - chain alone) / n
   = compute-stream ms lost per decode, beside the decode's own ms.
Writes ``--out`` (JSON). H200: ~40 s.

Usage: python tests/bench_decode.py --out $OUT/decode.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "comfyui_mc_sparse"))
import _standalone  # noqa: E402

_standalone.load_pack()
import importlib  # noqa: E402

from comfyui_mc_sparse_pack import kernels  # noqa: E402
from comfyui_mc_sparse_pack.comfyui_mc_sparse import encoding  # noqa: E402
from comfyui_mc_sparse_pack.comfyui_mc_sparse.selection import keys_for_density  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import race  # noqa: E402

bitmask = importlib.import_module("comfyui_mc_sparse_pack.kernels.triton.bitmask")

SHAPES = {  # name: (heads, tokens, density); C = 128, kv_tile = 64 (node defaults)
    "wan13b_480p_fast": (12, 32760, 0.15),
    "wan14b_720p_fast": (40, 75600, 0.15),
    "wan14b_720p_quality": (40, 75600, 0.25),
}


def entry(heads: int, tokens: int, density: float, seed: int = 0):
    """(bitmask uint8 [1, H, G, ceil(S/8)], reference int32 [1, H, G, K_alloc], K) of one random cache entry."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    groups = -(-tokens // 128)
    k = keys_for_density(density, tokens, 64)
    width = -(-k // 64) * 64
    idx = torch.full((1, heads, groups, width), -1, dtype=torch.int32, device="cuda")
    for h in range(heads):  # one head at a time: the random scores of all rows would take ~7 GB at 720p
        keys = torch.rand(groups, tokens, generator=g, device="cuda").topk(k, -1).indices.sort(-1).values
        idx[0, h, :, :k] = keys.to(torch.int32)
    enc = encoding.encode_selection(idx, tokens, k, "bitmask")
    return enc.data, idx, k


def leakage(decode, n: int, gemm_ms_target: float = 200.0) -> dict:
    """Compute-stream ms lost per decode queued on a high-priority side stream during a GEMM chain."""
    a = torch.randn(16384, 5120, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(5120, 13824, device="cuda", dtype=torch.bfloat16)
    torch.matmul(a, b)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.matmul(a, b)
    torch.cuda.synchronize()
    reps = max(10, int(gemm_ms_target / max((time.perf_counter() - t0) * 1000, 0.1)))
    side = torch.cuda.Stream(priority=-1)
    ev = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731

    def chain(with_decodes: bool) -> float:
        torch.cuda.synchronize()
        s, e = ev(), ev()
        s.record()
        if with_decodes:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(n):
                    decode()
        for _ in range(reps):
            torch.matmul(a, b)
        e.record()
        torch.cuda.synchronize()
        return s.elapsed_time(e)

    alone, withd = [], []
    for _ in range(3):
        alone.append(chain(False))
        withd.append(chain(True))
    lost = (statistics.median(withd) - statistics.median(alone)) / n
    return {"gemms": reps, "chain_alone_ms": statistics.median(alone), "chain_with_ms": statistics.median(withd),
            "decodes": n, "lost_ms_per_decode": lost}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench_decode.json")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    report = {"gpu": torch.cuda.get_device_name(), "variants": list(bitmask.VARIANTS), "shapes": {}}
    ok = True
    for name, (heads, tokens, density) in SHAPES.items():
        bits, idx, k = entry(heads, tokens, density)
        width = idx.shape[-1]
        r = {"rows": int(idx[0, :, :, 0].numel()), "tokens": tokens, "keys": k, "width": width,
             "bits_mb": bits.numel() / 1e6, "out_mb": idx.numel() * 4 / 1e6}
        stacked = torch.full((2, *idx.shape), 5, dtype=torch.int32, device="cuda")
        checks = {}
        for v in bitmask.VARIANTS:
            stacked[1].fill_(7)
            bitmask.decode_bitmask(bits, stacked[1], num_tokens=tokens, variant=v)
            checks[v] = bool(torch.equal(stacked[1], idx) and (stacked[0] == 5).all())
        ref = kernels.decode_bitmask(bits, num_tokens=tokens, width=width, backend="torch")
        checks["reference"] = bool(torch.equal(ref, idx))
        r["check"] = checks
        ok &= all(checks.values())
        out = torch.empty_like(idx)
        fns = {v: (lambda v=v: bitmask.decode_bitmask(bits, out, num_tokens=tokens, variant=v)) for v in bitmask.VARIANTS}
        ms = race(fns, args.rounds, 20.0)
        r["ms"] = ms
        r["gb_per_s"] = {v: (bits.numel() + idx.numel() * 4) / (t / 1000) / 1e9 for v, t in ms.items()}
        r["leak"] = {v: leakage(fns[v], 20) for v in bitmask.VARIANTS}
        report["shapes"][name] = r
        print(f"{name}: rows {r['rows']}, S {tokens}, K {k} (width {width}); bitmask {r['bits_mb']:.1f} MB -> int32 "
              f"{r['out_mb']:.1f} MB; CHECK {'OK' if all(checks.values()) else 'FAILED'} {checks}", flush=True)
        for v in bitmask.VARIANTS:
            lk = r["leak"][v]
            print(f"  {v:6s} {ms[v]:8.3f} ms/call ({r['gb_per_s'][v]:7.1f} GB/s); on a side stream during "
                  f"{lk['gemms']} GEMMs ({lk['chain_alone_ms']:.1f} ms alone): {lk['lost_ms_per_decode']:+.3f} ms "
                  f"lost per decode", flush=True)
        v0, v1 = list(bitmask.VARIANTS)[:2]
        print(f"  {v1} / {v0}: {ms[v1] / ms[v0]:.3f}", flush=True)
        del bits, idx, stacked, out, ref
        torch.cuda.empty_cache()
    report["ok"] = ok
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"CHECK all variants bit-exact: {'OK' if ok else 'FAILED'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
