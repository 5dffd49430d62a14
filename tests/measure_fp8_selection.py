"""Selection quality of pass 2's float8 QK^T on the synthetic DiT workload (CPU, Triton interpreter; not collected).

For ``comfyui_mc_sparse/tools/workload.py`` workloads (every head kind, bf16 q / k, PDDP groups of C = 128 from the
torch reference), compares three selections per query group at densities s in {0.1, 0.15, 0.25, 0.5}:
- exact: the top-K of the float64 group sums (``kernels.reference.group_prob_sums``);
- bf16: the top-K of those sums rounded to float16 (what the default bf16 kernel's scratch ranks, up to its fp32
  exponentials' ~1e-6);
- fp8: the top-K of the float16-rounded sums of ``selection.fp8_operands``' smoothed float8 copies, dequantised, in
  float64 (what the float8 kernel computes, up to fp32 accumulation: tests/test_anchor_kernels.py checks it to 2e-5);
- fp8 unsmoothed: the same with plain head-scaled float8 copies (no mean removal), for comparison.
Per selection: kept probability mass / the exact top-K's (min and mean over groups and heads) and the share of the
exact set kept (set overlap). Writes JSON to --out (default: stdout only).

Usage: TRITON_INTERPRET=1 python tests/measure_fp8_selection.py [--grid 12,24,32] [--heads 10] [--out FILE]
About 1-2 minutes on a CPU at the default size.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "comfyui_mc_sparse"))
sys.path.insert(0, str(ROOT / "tests"))
import _standalone  # noqa: E402

_standalone.load_pack()
from _triton_interp import patch_interpreter  # noqa: E402

patch_interpreter()
import torch  # noqa: E402
from comfyui_mc_sparse_pack.comfyui_mc_sparse.tools.workload import SyntheticWorkload, WorkloadSpec  # noqa: E402
from comfyui_mc_sparse_pack.kernels import reference  # noqa: E402
from comfyui_mc_sparse_pack.kernels.triton import selection  # noqa: E402

C = 128
DENSITIES = (0.1, 0.15, 0.25, 0.5)


def quality(exact, approx, kk):
    """(kept mass / exact top-K mass, share of the exact top-K set kept), each [B, H, G]."""
    best_idx = exact.topk(kk, -1).indices
    best = exact.gather(-1, best_idx).sum(-1)
    idx = approx.topk(kk, -1).indices
    kept = exact.gather(-1, idx).sum(-1) / best
    mark = torch.zeros_like(exact, dtype=torch.bool).scatter_(-1, best_idx, True)
    overlap = mark.gather(-1, idx).sum(-1) / kk
    return kept, overlap


def smoothed_fp8_sums(q, k, lse, perm, scale):
    """float64 group sums of the float8 kernel's operands (``fp8_operands``: smoothed, dequantised)."""
    q8, k8, _, lse_s, kb = selection.fp8_operands(q, k, lse, scale)
    qs, ks = selection.fp8_stats(q)[1].double(), selection.fp8_stats(k)[1].double()
    sums = reference.group_prob_sums(q8.double() * qs[..., None, None], k8.double() * ks[..., None, None],
                                     lse_s.double(), perm, group_size=C, scale=scale)
    return sums * torch.exp2(kb.double())[:, :, None, :]


def plain_fp8_sums(q, k, lse, perm):
    """float64 group sums of float8 copies without smoothing (x / (head amax / 448)), for comparison."""
    def deq(x):
        s = x.double().abs().amax((-2, -1), keepdim=True) / 448
        return (x.double() / s).float().to(torch.float8_e4m3fn).double() * s
    return reference.group_prob_sums(deq(q), deq(k), lse, perm, group_size=C)


def measure(spec, step):
    wl = SyntheticWorkload(spec)
    q, k, _ = wl.qkv(step, dtype=torch.bfloat16)
    _, lse = reference.dense_attention(q.double(), k.double(), k.double(), return_lse=True)
    perm = reference.pddp_groups(q, C)
    exact = reference.group_prob_sums(q.double(), k.double(), lse, perm, group_size=C).double()
    scale = q.shape[-1] ** -0.5
    fp8 = smoothed_fp8_sums(q, k, lse.float(), perm, scale)
    plain = plain_fp8_sums(q, k, lse, perm)
    rel = float((fp8.double() - exact).norm() / exact.norm())
    res = dict(rel_l2_fp8_sums=rel, densities={})
    S = q.shape[2]
    for s in DENSITIES:
        kk = int(s * S)
        row = {}
        for name, sums in (("bf16", exact.half()), ("fp8", fp8.half()), ("fp8 unsmoothed", plain.half())):
            kept, overlap = quality(exact, sums.double() + 0.0, kk)  # fp16 sums: ties resolved by topk's order
            row[name] = dict(kept_mass_min=float(kept.min()), kept_mass_mean=float(kept.mean()),
                             overlap_min=float(overlap.min()), overlap_mean=float(overlap.mean()))
        res["densities"][str(s)] = row
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--grid", default="12,24,32")
    ap.add_argument("--heads", type=int, default=10)
    ap.add_argument("--steps", default="2,10")
    ap.add_argument("--sharpness", default="1.0,1.5")
    ap.add_argument("--out")
    args = ap.parse_args()
    frames, height, width = (int(x) for x in args.grid.split(","))
    report = {}
    for sharp in (float(x) for x in args.sharpness.split(",")):
        for step in (int(x) for x in args.steps.split(",")):
            spec = WorkloadSpec(frames=frames, height=height, width=width, heads=args.heads, head_dim=128,
                                sharpness=sharp, seed=20261201)
            r = measure(spec, step)
            report[f"sharpness {sharp} step {step}"] = r
            print(f"sharpness {sharp} step {step}: fp8 sums rel L2 {r['rel_l2_fp8_sums']:.4f}", flush=True)
            for s, row in r["densities"].items():
                print(f"  s={s}: " + "; ".join(
                    f"{n} kept mass min {v['kept_mass_min']:.5f} mean {v['kept_mass_mean']:.6f}, set overlap min "
                    f"{v['overlap_min']:.4f} mean {v['overlap_mean']:.4f}" for n, v in row.items()), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
