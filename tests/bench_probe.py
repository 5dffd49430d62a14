"""The MC-Sparse Probe's computation at Wan2.1-14B 720p on one GPU: time and peak memory (not collected by pytest).

Inputs: **random q/k/v of the real shape**, not model weights: for each of the 40 blocks, bf16 ``[1, 40, 75600, 128]``
(Wan2.1-14B, 1280x720, 81 frames: 21 x 45 x 80 latent tokens after the 1x2x2 patch; 40 heads of 128) at the probe
(anchor) step, and for the reuse step the same tensors moved by a random perturbation (0.95 x + 0.31 noise), so the
anchor's selection is stale as it would be a few steps later. Random inputs make attention nearly uniform: the recall
and error numbers are not those of a real model (run the node on your model for those); time and memory are, since
the work does not depend on the values.

What runs is exactly what the node runs per block (``adapter/probe.py``): the probed heads (the node's default 8 of
40, evenly spaced) are copied out, ``tools/probe.anchor_scores`` (dense with LSE, the pack's anchor step with Fast
PDDP + exact top-K + residual, vanilla BSA, token oracle, per-query oracle on 512 queries per head, each scored by a
sparse attention with LSE), the anchor entry packed to the CPU; after all blocks, every block's reuse step
(``reuse_scores``: the cached selection and residual over the perturbed q/k/v). Then one block with all 40 heads.
Before timing, the fast path is checked against the exact diagnostics on a slice (2 heads x 4096 tokens).

Reported (stdout and ``<out>/bench_probe.json``): seconds per block (anchor, reuse), total probe seconds for all 40
blocks, peak GPU memory above the resident block inputs (``torch.cuda.max_memory_allocated``), CPU bytes kept between
the steps, the kernel backends used, and the mean numbers of the table.

Usage: python tests/bench_probe.py --out DIR [--blocks 40] [--heads 8] [--density 0.2] [--shape 14b-720p|tiny]
Expected on an H200: about 1-2 minutes (first Triton compilations included).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "comfyui_mc_sparse"))
import _standalone  # noqa: E402

_standalone.load_pack()
from comfyui_mc_sparse_pack import kernels  # noqa: E402
from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter.probe import choose_heads  # noqa: E402
from comfyui_mc_sparse_pack.comfyui_mc_sparse.tools import probe  # noqa: E402

SHAPES = {"14b-720p": dict(H=40, S=21 * 45 * 80, D=128), "tiny": dict(H=4, S=1024, D=128)}


_RECORD = kernels.registry.Record()


def _block_inputs(H, S, D, device, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    qkv = [torch.randn(1, H, S, D, generator=g, device=device, dtype=torch.bfloat16) for _ in range(3)]
    return qkv


def _perturb(t, seed):
    g = torch.Generator(device=t.device).manual_seed(seed)
    return (0.95 * t.float() + 0.31 * torch.randn(t.shape, generator=g, device=t.device)).to(t.dtype)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check(device, settings) -> dict:
    """Fast path vs exact diagnostics on 2 heads x 4096 tokens (bf16): differences per method, and ok."""
    q, k, v = (t[:, :, :4096].contiguous() for t in _block_inputs(2, 4096, 128, device, 123))
    q = q * 3  # sharper attention than plain randn, so the rows differ
    fast, entry = probe.anchor_scores(q, k, v, settings)
    exact, entry2 = probe.exact_anchor_scores(q, k, v, settings)
    same_selection = bool(torch.equal(entry.kv_idx, entry2.kv_idx))
    q2, k2, v2 = (_perturb(t, 7) for t in (q, k, v))
    fast.update(probe.reuse_scores(q2, k2, v2, entry, settings))
    exact.update(probe.exact_reuse_scores(q2, k2, v2, entry, settings))
    diffs = {m: {"recall": fast[m].recall - exact[m].recall, "rel_l1": fast[m].rel_l1 - exact[m].rel_l1,
                 "rel_l1_exact": exact[m].rel_l1} for m in fast}
    # bf16 outputs: rel L1 agrees to bf16 rounding (~4e-3 of the output), not to fp32 precision
    ok = all(abs(d["recall"]) < 5e-3 and abs(d["rel_l1"]) < max(5e-3, 0.05 * d["rel_l1_exact"]) for d in diffs.values())
    return {"per_method": diffs, "same_mc_selection": same_selection, "ok": ok}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for bench_probe.json")
    parser.add_argument("--blocks", type=int, default=40)
    parser.add_argument("--heads", type=int, default=8, help="heads probed per block (the node's default 8; 0 = all)")
    parser.add_argument("--density", type=float, default=0.2)
    parser.add_argument("--oracle-queries", type=int, default=512)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="14b-720p")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    shape = SHAPES[args.shape]
    H, S, D = shape["H"], shape["S"], shape["D"]
    settings = probe.ProbeSettings(density=args.density, group_size=128, oracle_queries=args.oracle_queries)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"shape": {"B": 1, **shape}, "inputs": "random bf16 q/k/v of the real shape (not model weights)",
              "blocks": args.blocks, "heads_probed": args.heads or H, "density": args.density,
              "oracle_queries": args.oracle_queries, "gpu": torch.cuda.get_device_name(device) if device.type == "cuda"
              else platform.processor(), "torch": torch.__version__}
    start_all = time.perf_counter()
    result["check"] = check(device, probe.ProbeSettings(density=args.density, group_size=128, oracle_queries=0))
    print(f"check vs exact diagnostics (2 heads x 4096 tokens): {json.dumps(result['check'], indent=1)}", flush=True)

    heads = choose_heads(H, args.heads)
    packed, anchor_s, reuse_s, reports = {}, [], [], []
    peak_extra, cpu_bytes = 0, 0
    for block in range(args.blocks):
        q, k, v = _block_inputs(H, S, D, device, block)  # the block's inputs, resident as in the model
        if device.type == "cuda":
            _sync(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        t0 = time.perf_counter()
        qh, kh, vh = (t[:, heads].contiguous() for t in (q, k, v))
        scores, entry = probe.anchor_scores(qh, kh, vh, settings)
        packed[block] = probe.PackedEntry.pack(entry, "cpu")
        cpu_bytes = packed[block].nbytes
        del entry, qh, kh, vh
        _sync(device)
        anchor_s.append(time.perf_counter() - t0)
        if device.type == "cuda":
            peak_extra = max(peak_extra, torch.cuda.max_memory_allocated(device) - base)
        reports.append(probe.BlockReport(block=block, heads=heads, tokens=S, step=0, reuse_step=1, scores=scores,
                                         seconds=anchor_s[-1]))
        del q, k, v
        print(f"block {block}: anchor {anchor_s[-1]:.2f} s", flush=True)
    for block in range(args.blocks):
        q, k, v = (_perturb(t, 1000 + block) for t in _block_inputs(H, S, D, device, block))
        if device.type == "cuda":
            _sync(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        t0 = time.perf_counter()
        qh, kh, vh = (t[:, heads].contiguous() for t in (q, k, v))
        reports[block].scores.update(probe.reuse_scores(qh, kh, vh, packed.pop(block).unpack(device), settings))
        _sync(device)
        reuse_s.append(time.perf_counter() - t0)
        reports[block].seconds += reuse_s[-1]
        if device.type == "cuda":
            peak_extra = max(peak_extra, torch.cuda.max_memory_allocated(device) - base)
        del q, k, v, qh, kh, vh
    report = probe.ProbeReport(settings, blocks=reports, header=[f"bench_probe: {args.shape}, random inputs"])
    report.seconds = sum(anchor_s) + sum(reuse_s)
    # all heads, one block
    q, k, v = _block_inputs(H, S, D, device, 999)
    if device.type == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    t0 = time.perf_counter()
    probe.anchor_scores(q, k, v, settings)
    _sync(device)
    all_heads_s = time.perf_counter() - t0
    all_heads_peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else None
    del q, k, v
    result.update({
        "anchor_s_per_block_mean": sum(anchor_s) / len(anchor_s), "anchor_s_first_block": anchor_s[0],
        "reuse_s_per_block_mean": sum(reuse_s) / len(reuse_s), "probe_s_total": report.seconds,
        "peak_gpu_gib_above_inputs": None if device.type != "cuda" else peak_extra / 2**30,
        "cpu_mib_per_block_between_steps": cpu_bytes / 2**20,
        "all_heads_one_block_s": all_heads_s,
        "all_heads_one_block_peak_gpu_gib_above_inputs": None if all_heads_peak is None else all_heads_peak / 2**30,
        "wall_s": time.perf_counter() - start_all,
        "kernels": {op: c.backend for op, c in _RECORD.choices.items()},
        "mean": {m: {"recall": report.mean(m, "recall"), "rel_l1": report.mean(m, "rel_l1")} for m in report.methods()},
    })
    print(report.table())
    print(json.dumps({k: v for k, v in result.items() if k != "mean"}, indent=1))
    (out / "bench_probe.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return 0 if result["check"]["ok"] else 1


if __name__ == "__main__":
    with kernels.registry.recording(_RECORD):  # which backend ran each op in this benchmark (kernels below)
        sys.exit(main())
