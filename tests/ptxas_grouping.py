"""Offline compile of the Triton PDDP kernels (kernels/triton/grouping.py) for sm_90 / sm_80 with ``ptxas -v``: registers,
spills, shared memory (no GPU needed; not collected by pytest). The interpreter misses GPU-only compile errors.

Usage: python tests/ptxas_grouping.py [--samples 256] [--bins 512] [--sq 3] [--warps 4] [--arch 90]. Exit status 1 when a kernel spills or does not fit.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from pathlib import Path

_spec = importlib.util.spec_from_file_location("_ptxas_report", Path(__file__).resolve().parent / "ptxas_report.py")
pr = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pr)  # pops TRITON_INTERPRET and loads the pack
import torch  # noqa: E402

grouping = importlib.import_module("comfyui_mc_sparse_pack.kernels.triton.grouping")
pr._TYPES.setdefault(torch.int64, "i64")  # the leaf's sort keys


def kernels(samples, bins, pairs, first, H=40, S=75600, N=296, D=128, C=128, compact=False, arch=90, sq=0,
            subtree_np=1024, subtree_levels=3):
    """(name, jit fn, args, meta) of every launch of one tree level at the Wan2.1-14B 720p shape."""
    meta_t = dict(device="meta")
    B = 1
    q = torch.empty(B, S, H * D, dtype=torch.bfloat16, **meta_t).view(B, S, H, D).transpose(1, 2)
    n_slots = -(-S // C) * C
    i32 = dict(dtype=torch.int32, **meta_t)
    perm, bins_t = torch.empty(B * H, n_slots, **i32), torch.empty(B * H, n_slots, **i32)
    start, size, count = (torch.empty(N, **i32) for _ in range(3))
    v = torch.empty(B * H * N * D, dtype=torch.float32, **meta_t)
    off = torch.empty(B * H * N, dtype=torch.float32, **meta_t)
    hist, cnt = torch.empty(B * H * N * bins, **i32), torch.empty(B * H * N * 2 * 80, **i32)
    keys = torch.empty(B * H * N * 2 * C, dtype=torch.int64, **meta_t)
    q8 = torch.empty(B * H * S * D, dtype=torch.int8, **meta_t)
    sc, mu = torch.empty(B * H * S, dtype=torch.float32, **meta_t), torch.empty(B * H * D, dtype=torch.float32, **meta_t)
    code8 = 2 if grouping.HEAD_SCALE else 1  # int8 copy with one scale per head / per query
    r8, w8 = code8 * (compact and not first), code8 * (compact and first)
    warps = grouping._DIR_WARPS or grouping.direction_warps(arch // 10, compact)
    strides = q.stride()
    return [
        ("_direction", grouping._direction,
         [q, q8, sc, mu, perm, start, count, v, off, hist, H, N, S, n_slots, *strides],
         dict(PAIRS=pairs, M=samples, D=D, SCHUNK=min(samples, 64), NB=bins, FIRST=first,
              GRAM=samples <= grouping._GRAM_MAX, READ8=r8, WRITE8=w8, SQ=sq, num_warps=warps)),
        ("_bin", grouping._bin, [q, q8, sc, mu, perm, start, count, v, off, hist, bins_t, H, N, S, n_slots, *strides],
         dict(BLOCK=grouping._BLOCK_BIN, D=D, NB=bins, FIRST=first, READ8=r8, WRITE8=w8, LOCAL=grouping.LOCAL_HIST,
              num_warps=4)),
        ("_count", grouping._count, [bins_t, hist, start, size, count, cnt, N, n_slots, 74, C],
         dict(TILE=grouping._TILE, NB=bins, num_warps=4)),
        ("_apply", grouping._apply, [perm, perm, bins_t, hist, start, size, count, cnt, S, N, n_slots, 74, C],
         dict(TILE=grouping._TILE, NB=bins, PREFIX=grouping._PREFIX, FIRST=first, num_warps=4)),
        ("_leaf", grouping._leaf, [q, q8, sc, perm, perm, keys, start, count, H, N, S, n_slots, C, *strides],
         dict(PAIRS=pairs, M=samples, D=D, SCHUNK=min(samples, 64), CHUNK=64, NP=2 * C, FIRST=first,
              GRAM=samples <= grouping._GRAM_MAX, READ8=r8, SQ=sq, num_warps=warps)),
        ("_subtree", grouping._subtree,
         [q, q8, sc, perm, perm, perm, keys, v, start, size, count, H, N, S, n_slots, C, *strides],
         dict(PAIRS=pairs, M=samples, D=D, SCHUNK=min(samples, 64), CHUNK=64, NP=subtree_np, LEVELS=subtree_levels,
              FIRST=first, GRAM=samples <= grouping._GRAM_MAX, READ8=r8, SQ=sq, num_warps=warps)),
    ]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=grouping.SAMPLES)
    ap.add_argument("--bins", type=int, default=grouping.BINS)
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--sq", type=int, default=0, help="squarings of the direction kernels (0: power iteration)")
    ap.add_argument("--arch", type=int, nargs="+", default=[90, 80])
    ap.add_argument("--only", nargs="+", help="kernel names to compile (default: all)")
    ap.add_argument("--local", action="store_true", help="_bin with its block's histogram (LOCAL_HIST)")
    ap.add_argument("--subtree", type=int, nargs=2, default=[1024, 3], metavar=("NP", "LEVELS"),
                    help="_subtree's slots per program and rounds")
    ap.add_argument("--warps", type=int, help="warps of _direction / _leaf (default: grouping.direction_warps)")
    args = ap.parse_args()
    grouping._DIR_WARPS = args.warps
    grouping.LOCAL_HIST = args.local or grouping.LOCAL_HIST
    bad = 0
    for arch in args.arch:
        for first, compact in ((True, False), (False, False), (True, True), (False, True)):
            for name, fn, a, meta in kernels(args.samples, args.bins, args.pairs, first, compact=compact, arch=arch, sq=args.sq,
                                             subtree_np=args.subtree[0], subtree_levels=args.subtree[1]):
                if args.only and name not in args.only:
                    continue
                ck = pr.compile_offline(fn, a, meta, arch)
                regs, st, ld = pr.ptxas_usage(ck, arch)
                smem = ck.metadata.shared
                ok = st == 0 and smem <= pr.SMEM_LIMIT[arch]
                bad += not ok
                print(dict(arch=arch, kernel=name, first=first, compact=compact, regs=regs, spill_st=st, spill_ld=ld, smem=smem,
                           ok=ok), flush=True)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
