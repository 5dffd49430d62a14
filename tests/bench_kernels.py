"""Kernel benchmark on a CUDA GPU (not collected by pytest): prints a table and writes JSON to --out.

At the Wan2.1-1.3B 480p (B=1, H=12, S=32760, D=128) and Wan2.1-14B 720p (H=40, S=75600) attention shapes, bf16:
- dense: every dense kernel present (cuDNN SDPA with LSE through the ``cuda_sdpa`` backend, flash-attn-4 with LSE
  when importable, SDPA's default pick without LSE); the best one is the baseline of every ratio below;
- sparse: each sparse backend at densities 0.1/0.15/0.25/0.5, C = 128, each group's indices a random sorted set of
  floor(s*S) tokens padded with -1 to a multiple of 128; efficiency = best dense ms * s / sparse ms (1.0 = ideal);
- selection: Triton pass 2 alone and pass 2 + top-K (``select_kv``) as a fraction of one best dense call;
- PDDP: the grouping op's milliseconds;
- error: relative L2 / max-abs error against the torch reference in float32 on a sub-sample of heads, checked
  before any timing; the selected sets' overlap with the reference's.
Timings are ``triton.testing.do_bench`` medians over rotating input sets (no cache-warm repeats of one input).

With --reuse (issue 14) it times the reuse path instead of selection and grouping, at each density: the Triton
kernel's default config on contiguous [B, H, S, D] inputs and on the model's path (strided views of [B, S, H*D]
tensors, ``out=`` a view too, plain residual epilogue); every REUSE_CONFIGS entry (spill-free tiles, Q in shared
memory or registers, x fp32 / packed f16x2 exponentials x eager / lazy rescale) side by side in the same run, with
its error against the float32 reference and (num_warps, n_regs, n_spills); flash-attn-4's paged route when present
(``fa4_route_eff_min``); the bitmask decode kernel at s = 0.25. ``--quick`` times QUICK_CONFIGS instead of
REUSE_CONFIGS (deeper K/V prefetch and the short prologue beside the sm_90 default; about a minute); ``--gluon`` times
GLUON_CONFIGS instead: the op (on sm_90 the warp-specialised Gluon kernel, kernels/triton/sparse_attention_sm90.py,
in auto mode) beside the Triton kernel's default config called directly and the Gluon kernel's tunings, same inputs,
all timed interleaved with flash-attn-4 dense (``run_gluon_shape``), and prints the op / Triton kernel time ratio per
point; its ``triton_sparse_eff_min`` is the op's. It prints
f16x2 / fp32, lazy / eager, qreg / shared, pipelined / not (and --quick: default / config) time ratios per point,
writes ``triton_sparse_eff_min`` = the min over the points of the best spill-free config (named in the note) into
docs/results/scoreboard.json (commit: --commit, else $MC_SPARSE_COMMIT, else git HEAD), and its keys alone to
scoreboard.json next to --out (tests/_scoreboard.py).

Usage: python tests/bench_kernels.py --out bench.json [--shapes 1.3b,14b] [--densities 0.1,0.15,0.25,0.5] [--sweep]
       python tests/bench_kernels.py --out $OUT/bench_reuse.json --reuse --rep 40 --commit <hash> [--quick | --gluon]
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import os
import platform
import signal
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "comfyui_mc_sparse"))
import _standalone

_standalone.load_pack()
import triton  # noqa: E402
import triton.testing  # noqa: E402

import _scoreboard  # noqa: E402
import _timing  # noqa: E402  (tests/_timing.py: the method of record for kernel ratios)
from comfyui_mc_sparse_pack import kernels  # noqa: E402
from comfyui_mc_sparse_pack.kernels import reference, registry  # noqa: E402
from comfyui_mc_sparse_pack.kernels.triton import sparse_dispatch as _dispatch  # noqa: E402

SHAPES = {"1.3b": dict(B=1, H=12, S=32760, D=128), "14b": dict(B=1, H=40, S=75600, D=128)}
C = 128
KV_TILE = 128
DTYPE = torch.bfloat16
SPARSE_VARIANTS = {  # Triton sparse kernel options timed with --sweep (at s = 0.25)
    "default": {},
    "minimal (perm ignored: no Q gather / O scatter)": dict(permute_q=False),
    "int64 row offsets": dict(row64=True),
    "mask by -1 (every tile masked)": dict(mask_from_count=False),
    "bn64 w4 st2": dict(block_n=64, num_warps=4, num_stages=2),
    "bn64 w4 st4": dict(block_n=64, num_warps=4, num_stages=4),
    "bn32 w4 st3": dict(block_n=32, num_warps=4, num_stages=3),
    "bn32 w4 st4": dict(block_n=32, num_warps=4, num_stages=4),
    "bn64 w8 st3": dict(block_n=64, num_warps=8, num_stages=3),
    "bn64 w8 st4": dict(block_n=64, num_warps=8, num_stages=4),
    "bn128 w8 st2": dict(block_n=128, num_warps=8, num_stages=2),
    "bn128 w8 st3": dict(block_n=128, num_warps=8, num_stages=3),
    "bn64 w4 st3 .cg": dict(block_n=64, num_warps=4, num_stages=3, cache=".cg"),
}
PASS2_VARIANTS = {
    "default": {},
    "poly": dict(poly=True),
    "poly bn128 w8 st3": dict(poly=True, block_n=128, num_warps=8, num_stages=3),
    "bn32 w4 st3": dict(block_n=32, num_warps=4, num_stages=3),
    "bn64 w4 st4": dict(block_n=64, num_warps=4, num_stages=4),
    "poly bn64 w8 st3": dict(poly=True, block_n=64, num_warps=8, num_stages=3),
    "bn64 w4 st2": dict(block_n=64, num_warps=4, num_stages=2),
    "bn128 w8 st2": dict(block_n=128, num_warps=8, num_stages=2),
    "bn128 w4 st2": dict(block_n=128, num_warps=4, num_stages=2),
    "exp f16x2": dict(exp="f16x2"),
}


def bench(fn_of_inputs, inputs, rep_ms=600, warmup_ms=100):
    """Median ms of fn over rotating input sets."""
    cyc = itertools.cycle(inputs)
    return triton.testing.do_bench(lambda: fn_of_inputs(*next(cyc)), warmup=min(warmup_ms, rep_ms), rep=rep_ms,
                                   return_mode="median")


def rel_err(a, b):
    a, b = a.float(), b.float()
    return dict(rel_l2=float((a - b).norm() / b.norm().clamp_min(1e-30)), max_abs=float((a - b).abs().max()),
                mean_abs=float((a - b).abs().mean()))


def random_kv_idx(B, H, G, S, num_keys, gen):
    """Random sorted distinct indices per group, num_keys of S, -1-padded to a multiple of KV_TILE."""
    k_alloc = -(-num_keys // KV_TILE) * KV_TILE
    out = torch.full((B, H, G, k_alloc), -1, dtype=torch.int32, device="cuda")
    for b in range(B):
        for h in range(H):
            keys = torch.rand(G, S, device="cuda", generator=gen)
            top = torch.topk(keys, num_keys, dim=-1, sorted=False).indices
            out[b, h, :, :num_keys] = torch.sort(top, dim=-1).values.to(torch.int32)
    return out


def dense_kernels():
    """name -> fn(q, k, v) returning (O, LSE) or O, for each dense kernel present."""
    out = {}
    names = {b.name: b for b in registry.backends() if not b.unavailable_reason}
    if "flash_attn4" in names:
        out["flash_attn4 (LSE)"] = lambda q, k, v: kernels.dense_attention(q, k, v, return_lse=True, backend="flash_attn4")
    if "cuda_sdpa" in names:
        out["cudnn sdpa (LSE)"] = lambda q, k, v: kernels.dense_attention(q, k, v, return_lse=True, backend="cuda_sdpa")
    out["sdpa default (no LSE)"] = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v)
    return out


def sparse_kernels():
    names = {b.name: b for b in registry.backends() if not b.unavailable_reason and "sparse_attention" in b.ops}
    return {n: (lambda n: lambda q, k, v, p, i: kernels.sparse_attention(q, k, v, p, i, backend=n))(n)
            for n in names if n != "torch"}


def run_shape(name, shp, densities, sweep, rep, log):
    B, H, S, D = shp["B"], shp["H"], shp["S"], shp["D"]
    G = -(-S // C)
    gen = torch.Generator(device="cuda").manual_seed(1234)
    sets = [tuple(torch.randn(B, H, S, D, device="cuda", dtype=DTYPE, generator=gen) for _ in range(3)) for _ in range(2)]
    res = dict(shape=shp, dense={}, sparse={}, selection={}, pddp={}, errors={}, sweep={})
    sub = slice(0, 2)  # heads checked against the float32 reference
    q0, k0, v0 = sets[0]
    q32, k32, v32 = (t[:, sub].float() for t in sets[0])
    ref_o, ref_lse = reference.dense_attention(q32, k32, v32, return_lse=True)

    # dense: correctness, then timing
    for dname, fn in dense_kernels().items():
        got = fn(q0, k0, v0)
        o = got[0] if isinstance(got, tuple) else got
        err = rel_err(o[:, sub], ref_o)
        if isinstance(got, tuple):
            err["lse_max_abs"] = float((got[1][:, sub] - ref_lse).abs().max())
        res["errors"][f"dense {dname}"] = err
        ms = bench(fn, sets, rep)
        res["dense"][dname] = dict(ms=ms, tflops=4 * S * S * D * H * B / ms / 1e9)
        log(f"{name} dense {dname}: {ms:.2f} ms, {res['dense'][dname]['tflops']:.0f} TFLOP/s, err {err}")
    best_name = min((n for n in res["dense"] if "(LSE)" in n), key=lambda n: res["dense"][n]["ms"])
    best = res["dense"][best_name]["ms"]
    res["best_dense"] = dict(name=best_name, ms=best)
    _, lse0 = kernels.dense_attention(q0, k0, v0, return_lse=True)

    # PDDP grouping: the torch reference and the GPU op (kernels/torch_gpu/pddp.py); contract checked on every head
    for bname in ("torch", "torch_gpu"):
        p = kernels.pddp_groups(q0, C, backend=bname)
        ok = bool((p[..., S:] == -1).all()) and bool(torch.equal(
            torch.sort(p[..., :S], dim=-1).values, torch.arange(S, device="cuda", dtype=torch.int32).expand(B, H, S)))
        ms = bench(lambda q: kernels.pddp_groups(q, C, backend=bname), [(st[0],) for st in sets], rep_ms=max(rep, 300))
        res["pddp"][bname] = dict(ms=ms, contract_ok=ok)
        log(f"{name} pddp {bname}: {ms:.2f} ms, contract {ok}")
    ref_p, got_p = kernels.pddp_groups(q0[:, :1], C, backend="torch"), kernels.pddp_groups(q0[:, :1], C, backend="torch_gpu")
    same = sum(len(set(ref_p[0, 0, g * C:(g + 1) * C].tolist()) & set(got_p[0, 0, g * C:(g + 1) * C].tolist()))
               for g in range(G)) / S
    res["errors"]["pddp torch_gpu vs torch: queries in the same group"] = same
    with registry.recording(registry.Record()) as record:
        perms = [kernels.pddp_groups(st[0], C) for st in sets]
    res["pddp"]["default backend"] = record.choices["pddp_groups"].backend
    log(f"{name} pddp same-group fraction vs torch {same:.4f}; default {res['pddp']['default backend']}")
    perm0 = perms[0]

    # selection pass 2 (+ top-K): correctness on one head, then timing on all heads
    ref_sums = reference.group_prob_sums(q32[:, :1], k32[:, :1], ref_lse[:, :1], perm0[:, :1], group_size=C)
    got_sums = kernels.group_prob_sums(q0[:, :1], k0[:, :1], ref_lse[:, :1], perm0[:, :1], group_size=C, backend="triton")
    res["errors"]["group_prob_sums triton"] = rel_err(got_sums, ref_sums)
    kq = int(0.25 * S)
    ref_top = torch.topk(ref_sums, kq, dim=-1).indices
    from comfyui_mc_sparse_pack.kernels.triton import selection as tsel  # direct: a failure must not fall back

    got_sel = tsel.select_kv(q0[:, :1], k0[:, :1], ref_lse[:, :1], perm0[:, :1], kq, group_size=C, kv_tile=KV_TILE)
    hit = torch.zeros_like(ref_sums, dtype=torch.bool).scatter_(-1, ref_top, True)
    sel = got_sel[..., :kq].long()
    res["errors"]["select_kv triton overlap (s=0.25)"] = float(torch.gather(hit, -1, sel).float().mean())
    log(f"{name} pass-2 errors: {res['errors']['group_prob_sums triton']}, overlap {res['errors']['select_kv triton overlap (s=0.25)']:.4f}")
    lses = [lse0, kernels.dense_attention(*sets[1], return_lse=True)[1]]
    sel_inputs = [(s[0], s[1], lse, p) for s, lse, p in zip(sets, lses, perms)]
    hc = min(H, max(1, (1 << 30) // (G * S * 4)))
    ms = bench(lambda q, k, l, p: kernels.group_prob_sums(q[:, :hc], k[:, :hc], l[:, :hc], p[:, :hc], group_size=C,
                                                          backend="triton"), sel_inputs, rep) * H / hc
    res["selection"]["pass2 only (triton)"] = dict(ms=ms, frac_of_dense=ms / best)
    log(f"{name} pass 2 (triton, all heads, extrapolated from {hc}): {ms:.2f} ms = {ms / best:.3f} of dense")
    for s in densities:
        kq = int(s * S)
        ms = bench(lambda q, k, l, p: tsel.select_kv(q, k, l, p, kq, group_size=C, kv_tile=KV_TILE),
                   sel_inputs, rep_ms=max(rep, 1000))
        res["selection"][f"pass2+topk s={s}"] = dict(ms=ms, frac_of_dense=ms / best)
        log(f"{name} pass 2 + top-K s={s}: {ms:.2f} ms = {ms / best:.3f} of dense")

    # sparse attention at each density
    for s in densities:
        kq = int(s * S)
        idxs = [random_kv_idx(B, H, G, S, kq, gen) for _ in sets]
        ref = reference.sparse_attention(q32, k32, v32, perm0[:, sub], idxs[0][:, sub])
        for sname, fn in sparse_kernels().items():
            got = fn(q0, k0, v0, perm0, idxs[0])
            err = rel_err(got[:, sub], ref)
            res["errors"][f"sparse {sname} s={s}"] = err
            ms = bench(fn, [(*st, p, i) for st, p, i in zip(sets, perms, idxs)], rep)
            eff = best * (kq / S) / ms
            res["sparse"].setdefault(sname, {})[str(s)] = dict(ms=ms, efficiency=eff, speedup=best / ms)
            log(f"{name} sparse {sname} s={s}: {ms:.2f} ms, efficiency {eff:.3f}, speedup {best / ms:.2f}x, err {err}")
        if sweep and s == 0.25:
            from comfyui_mc_sparse_pack.kernels.triton import sparse_attention as tsa
            variants = dict(SPARSE_VARIANTS)
            try:  # the kernel before this change, side by side (a copy of the previous commit's file, if present)
                import importlib.util
                spec = importlib.util.spec_from_file_location("_prev_sa", Path(__file__).parent / "_prev_sparse_attention.py")
                prev = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(prev)
                variants["previous kernel (count pass, masked tiles)"] = dict(_fn=prev.sparse_attention)
            except FileNotFoundError:
                pass
            for key, kw in variants.items():
                kw = dict(kw)
                fn_v = kw.pop("_fn", tsa)
                try:
                    if kw.get("permute_q", True):  # correctness first (ref: the float32 reference at s = 0.25)
                        res["errors"][f"sweep sparse {key}"] = rel_err(fn_v(q0, k0, v0, perm0, idxs[0], **kw)[:, sub], ref)["rel_l2"]
                    ms = bench(lambda q, k, v, p, i: fn_v(q, k, v, p, i, **kw),
                               [(*st, p, i) for st, p, i in zip(sets, perms, idxs)], rep)
                    res["sweep"][f"sparse {key}"] = best * (kq / S) / ms
                except Exception as err:  # out of resources, unsupported option
                    res["sweep"][f"sparse {key}"] = f"{type(err).__name__}: {str(err)[:120]}"
                log(f"{name} sweep sparse {key}: {res['sweep'][f'sparse {key}']}")
        del idxs
    if sweep:
        from comfyui_mc_sparse_pack.kernels.triton.selection import group_prob_sums as gps
        for key, kw in PASS2_VARIANTS.items():
            try:
                out = gps(q0[:, :1], k0[:, :1], ref_lse[:, :1], perm0[:, :1], group_size=C, **kw)
                e = rel_err(out, ref_sums)["rel_l2"]
                ms = bench(lambda q, k, l, p: gps(q[:, :hc], k[:, :hc], l[:, :hc], p[:, :hc], group_size=C, **kw),
                           sel_inputs, rep) * H / hc
                res["sweep"][f"pass2 {key}"] = dict(frac=ms / best, rel_l2=e)
            except Exception as err:
                res["sweep"][f"pass2 {key}"] = f"{type(err).__name__}: {str(err)[:120]}"
            log(f"{name} sweep pass2 {key}: {res['sweep'][f'pass2 {key}']}")
    return res


# --- reuse path (issue 14) -------------------------------------------------------------------------------------

_ALL = [("fp32", False), ("fp32", True), ("f16x2", False), ("f16x2", True)]  # (exponentials, lazy rescale)
REUSE_TILES = {  # spill-free Triton tile configs on sm_90 (tests/ptxas_report.py --variants), and their softmax variants
    "bn32 w8 st3 r128": (dict(block_n=32, num_warps=8, num_stages=3, maxnreg=128), _ALL),
    "bn64 w8 st3": (dict(block_n=64, num_warps=8, num_stages=3, maxnreg=0), _ALL),
    "bn128 w8 st3": (dict(block_n=128, num_warps=8, num_stages=3, maxnreg=0), _ALL),
    "bn64 w8 st3 qreg": (dict(block_n=64, num_warps=8, num_stages=3, maxnreg=0, q_regs=True),
                         [("fp32", False), ("fp32", True), ("f16x2", True)]),
    "bn128 w8 st3 qreg": (dict(block_n=128, num_warps=8, num_stages=3, maxnreg=0, q_regs=True),
                          [("fp32", True), ("f16x2", True)]),
    "bn64 w8 st3 pipe": (dict(block_n=64, num_warps=8, num_stages=3, maxnreg=0, pipeline_qk=True), [("fp32", True)]),
    "bn64 w8 st3 qreg pipe": (dict(block_n=64, num_warps=8, num_stages=3, maxnreg=0, q_regs=True, pipeline_qk=True),
                              [("fp32", True)]),
}
# with --reuse each (tile, exponentials, rescale) below is timed at every point, side by side in one run: fp32 / packed
# f16x2 exponentials (kernels/triton/fastexp.py), eager / lazy rescale (RESCALE_LOG2 in sparse_attention.py), Q in
# shared memory / registers (q_regs), the next tile's QK^T before this tile's softmax (pipeline_qk)
REUSE_CONFIGS = {f"{t} {e}{' lazy' if lazy else ''}": dict(kw, exp=e, lazy_rescale=lazy)
                 for t, (kw, softmax) in REUSE_TILES.items() for e, lazy in softmax}
_BN128_LAZY = dict(block_n=128, num_warps=8, maxnreg=0, exp="fp32", lazy_rescale=True)
QUICK_CONFIGS = {  # --quick: the sm_90 default (BN 128 lazy, 3 stages) against 5 stages (K/V gathered two tiles ahead,
    # 225 KiB shared) and the short prologue (fast_prologue), each alone and together
    "bn128 w8 st3 fp32 lazy": dict(_BN128_LAZY, num_stages=3),
    "bn128 w8 st5 fp32 lazy": dict(_BN128_LAZY, num_stages=5),
    "bn128 w8 st3 fastpro fp32 lazy": dict(_BN128_LAZY, num_stages=3, fast_prologue=True),
    "bn128 w8 st5 fastpro fp32 lazy": dict(_BN128_LAZY, num_stages=5, fast_prologue=True),
}


GLUON_CONFIGS = {  # --gluon: the sm_90 Gluon kernel's tunings beside the op (auto mode), same inputs
    # (final round of the previous session: overlap 0.654-0.704 < plain 0.690-0.808; this session's round 1 (auto
    # timings, warm): pingpong persistent 0.778-0.833 except 1.3B s=0.5, plain 0.727-0.816, plain persistent no better)
    "gluon plain": dict(_gluon=True),  # the default config called directly
    "gluon pingpong": dict(_gluon=True, pingpong=True),  # plain schedule, turns between the consumer warpgroups
    "gluon persistent": dict(_gluon=True, persistent=True),
    "gluon pingpong persistent": dict(_gluon=True, pingpong=True, persistent=True),
    "gluon pipeline": dict(_gluon=True, pipeline=True),
    "gluon plain l2": dict(_gluon=True, l2_hints=True),  # streams evict_first (the K/V rows stay in L2)
    "gluon pingpong l2": dict(_gluon=True, pingpong=True, l2_hints=True),
    "gluon pingpong persistent l2": dict(_gluon=True, pingpong=True, persistent=True, l2_hints=True),
    "gluon pingpong 3 stages": dict(_gluon=True, pingpong=True, num_stages=3),  # 224 KiB: a deeper K/V ring
    "gluon pingpong persistent rt8": dict(_gluon=True, pingpong=True, persistent=True, row_threads=8),  # whole lines
    "gluon pingpong persistent 3 stages": dict(_gluon=True, pingpong=True, persistent=True, num_stages=3),  # 1 Q slot
    "gluon pingpong persistent prefetch": dict(_gluon=True, pingpong=True, persistent=True, l2_prefetch=True),  # K/V
    # rows prefetched to L2 (evict_last) before the ring-slot wait (the CuTeDSL producer's cp.async+evict: +2-3 % at 14B)
    "gluon pingpong persistent thread_arrive": dict(_gluon=True, pingpong=True, persistent=True, thread_arrive=True),
    "gluon pingpong persistent 3 stages thread_arrive": dict(_gluon=True, pingpong=True, persistent=True, num_stages=3,
                                                             thread_arrive=True),
    "gluon pingpong persistent 3 stages thread_arrive early_q": dict(_gluon=True, pingpong=True, persistent=True,
                                                                     num_stages=3, thread_arrive=True, early_q=True),
    # no proxy fence between a stage's ready wait and its wgmma (flash-attn-4's sm90 cp.async pipelines): alone, + early_q
    "gluon pingpong persistent 3 stages thread_arrive no_fence": dict(_gluon=True, pingpong=True, persistent=True,
                                                                      num_stages=3, thread_arrive=True,
                                                                      cp_async_fence=False),
    "gluon pingpong persistent 3 stages thread_arrive early_q no_fence": dict(_gluon=True, pingpong=True,
                                                                              persistent=True, num_stages=3,
                                                                              thread_arrive=True, early_q=True,
                                                                              cp_async_fence=False),
    # the queries in registers (QK^T's A operand), the Q slot freed at each item's start
    "gluon pingpong persistent 3 stages thread_arrive early_q no_fence q_regs": dict(
        _gluon=True, pingpong=True, persistent=True, num_stages=3, thread_arrive=True, early_q=True,
        cp_async_fence=False, q_regs=True),
    # + the accumulator's rescale skipped per warp when no row's max moved (session 9)
    "gluon pingpong persistent 3 stages thread_arrive early_q no_fence q_regs skip_rescale": dict(
        _gluon=True, pingpong=True, persistent=True, num_stages=3, thread_arrive=True, early_q=True,
        cp_async_fence=False, q_regs=True, skip_rescale=True),
    "gluon pingpong persistent 3 stages thread_arrive early_q no_fence q_regs skip_rescale max_tree": dict(
        _gluon=True, pingpong=True, persistent=True, num_stages=3, thread_arrive=True, early_q=True,
        cp_async_fence=False, q_regs=True, skip_rescale=True, max_tree=True),
    "gluon pingpong persistent 3 stages thread_arrive early_q no_fence q_regs skip_rescale sum_partial": dict(
        _gluon=True, pingpong=True, persistent=True, num_stages=3, thread_arrive=True, early_q=True,
        cp_async_fence=False, q_regs=True, skip_rescale=True, sum_partial=True),
    "gluon pingpong persistent 3 stages thread_arrive early_q no_fence q_regs skip_rescale max_tree sum_partial": dict(
        _gluon=True, pingpong=True, persistent=True, num_stages=3, thread_arrive=True, early_q=True,
        cp_async_fence=False, q_regs=True, skip_rescale=True, max_tree=True, sum_partial=True),
    # session 10: the s9r3 auto schedule (q_regs skip_rescale sum_partial) and it + the row maxima's shuffles only on a
    # warp's vote (max_vote), + the pingpong turns on named barriers (named_turns), + both; each with the tail launch
    # (active at 1.3B 480p only)
    **{"gluon " + name: dict(_gluon=True, **_dispatch.GLUON_SCHEDULES[name])
       for name in (_dispatch._SUM_PARTIAL + extra + " tail_launch"
                    for extra in ("", " max_vote", " named_turns", " max_vote named_turns"))},
    # each tile's kv_idx slots loaded two tiles ahead by the producer (two index loads in flight)
    "gluon pingpong persistent 3 stages thread_arrive early_q no_fence idx2": dict(
        _gluon=True, pingpong=True, persistent=True, num_stages=3, thread_arrive=True, early_q=True,
        cp_async_fence=False, idx_ahead=2),
    "gluon pingpong persistent 3 stages thread_arrive early_q no_fence q_regs idx3": dict(
        _gluon=True, pingpong=True, persistent=True, num_stages=3, thread_arrive=True, early_q=True,
        cp_async_fence=False, q_regs=True, idx_ahead=3),
    # the auto mode's two schedules with the producer at 8 threads per row (whole 128-byte lines per request)
    "gluon pingpong persistent 3 stages thread_arrive early_q no_fence q_regs rt8": dict(
        _gluon=True, pingpong=True, persistent=True, num_stages=3, thread_arrive=True, early_q=True,
        cp_async_fence=False, q_regs=True, row_threads=8),
    "gluon pingpong persistent 3 stages thread_arrive early_q no_fence idx2 rt8": dict(
        _gluon=True, pingpong=True, persistent=True, num_stages=3, thread_arrive=True, early_q=True,
        cp_async_fence=False, idx_ahead=2, row_threads=8),
    # + each item's first loads issued by the producer an item early (no round trip at an item boundary)
    "gluon pingpong persistent 3 stages thread_arrive early_q no_fence q_regs rt8 next_item": dict(
        _gluon=True, pingpong=True, persistent=True, num_stages=3, thread_arrive=True, early_q=True,
        cp_async_fence=False, q_regs=True, row_threads=8, next_item=True),
    "gluon pingpong persistent 3 stages thread_arrive early_q no_fence idx2 rt8 next_item": dict(
        _gluon=True, pingpong=True, persistent=True, num_stages=3, thread_arrive=True, early_q=True,
        cp_async_fence=False, idx_ahead=2, row_threads=8, next_item=True),
    # + the last, partial round split into key ranges (sparse_tail_merge), registers 216 / 72
    "gluon pingpong persistent 3 stages thread_arrive early_q no_fence q_regs rt8 next_item split": dict(
        _gluon=True, pingpong=True, persistent=True, num_stages=3, thread_arrive=True, early_q=True,
        cp_async_fence=False, q_regs=True, row_threads=8, next_item=True, split_tail=4, consumer_regs=216,
        producer_regs=72),
    "gluon pingpong persistent 3 stages thread_arrive early_q no_fence idx2 rt8 next_item split": dict(
        _gluon=True, pingpong=True, persistent=True, num_stages=3, thread_arrive=True, early_q=True,
        cp_async_fence=False, idx_ahead=2, row_threads=8, next_item=True, split_tail=4, consumer_regs=216,
        producer_regs=72),
    # the auto mode's schedules since round s7r2 (the op's own compiled kernels: no compile) and q_regs with their
    # register split (216 / 72) but no split last round
    "gluon pingpong persistent 3 stages thread_arrive early_q no_fence q_regs split": dict(
        _gluon=True, pingpong=True, persistent=True, num_stages=3, thread_arrive=True, early_q=True,
        cp_async_fence=False, q_regs=True, split_tail=4, consumer_regs=216, producer_regs=72),
    "gluon pingpong persistent 3 stages thread_arrive early_q no_fence q_regs r216": dict(
        _gluon=True, pingpong=True, persistent=True, num_stages=3, thread_arrive=True, early_q=True,
        cp_async_fence=False, q_regs=True, consumer_regs=216, producer_regs=72),
    # a diagnostic (wrong results: its error is reported, never a figure): the first auto schedule without the K/V
    # copies, i.e. the consumers alone, against the whole kernel in the same race
    "gluon pingpong persistent 3 stages thread_arrive early_q no_fence q_regs split (consumers alone)": dict(
        _gluon=True, pingpong=True, persistent=True, num_stages=3, thread_arrive=True, early_q=True,
        cp_async_fence=False, q_regs=True, split_tail=4, consumer_regs=216, producer_regs=72, diag_no_copy=True),
    # the same diagnostic on q_regs as the auto mode runs it (224 / 56, no split round)
    "gluon pingpong persistent 3 stages thread_arrive early_q no_fence q_regs (consumers alone)": dict(
        _gluon=True, pingpong=True, persistent=True, num_stages=3, thread_arrive=True, early_q=True,
        cp_async_fence=False, q_regs=True, diag_no_copy=True),
    # the register split alone (216 / 72) on q_regs rt8 next_item
    "gluon pingpong persistent 3 stages thread_arrive early_q no_fence q_regs rt8 next_item r216": dict(
        _gluon=True, pingpong=True, persistent=True, num_stages=3, thread_arrive=True, early_q=True,
        cp_async_fence=False, q_regs=True, row_threads=8, next_item=True, consumer_regs=216, producer_regs=72),
    # + the last, partial round in a second launch split into key ranges (tail_launch; round s8r2)
    "gluon pingpong persistent 3 stages thread_arrive early_q no_fence q_regs tail_launch": dict(
        _gluon=True, pingpong=True, persistent=True, num_stages=3, thread_arrive=True, early_q=True,
        cp_async_fence=False, q_regs=True, tail_launch=4),
    "gluon pingpong persistent stage_out": dict(_gluon=True, pingpong=True, persistent=True, stage_out=True),  # 16-byte
    # output stores through the Q tile (the CuTeDSL kernel's staged epilogue: +2-3 % at small s)
    "gluon overlap pingpong persistent stage_out": dict(_gluon=True, overlap=True, pingpong=True, persistent=True,
                                                        stage_out=True),
}


def config_name(kw):
    """The REUSE_CONFIGS name of a launch config dict (block_n, num_warps, num_stages, maxnreg, exp, lazy_rescale,
    q_regs, pipeline_qk, fast_prologue)."""
    tile = f"bn{kw['block_n']} w{kw['num_warps']} st{kw['num_stages']}" + (f" r{kw['maxnreg']}" if kw["maxnreg"] else "")
    tile += (" qreg" if kw.get("q_regs") else "") + (" pipe" if kw.get("pipeline_qk") else "")
    tile += " fastpro" if kw.get("fast_prologue") else ""
    return f"{tile} {kw['exp']}{' lazy' if kw['lazy_rescale'] else ''}"


_tsa = importlib.import_module("comfyui_mc_sparse_pack.kernels.triton.sparse_attention")
TRITON_KERNEL = "triton kernel, default config"  # the Triton kernel called directly (never the Gluon one)
OP_LABEL = "the op (Triton backend, auto)"  # --gluon: kernels.sparse_attention(backend="triton") (run_reuse_shape's
# "triton contiguous")


def compiled_now():
    """{id: CompiledKernel} of every sparse-kernel variant compiled in this process so far."""
    return {id(ck): ck for ck in _tsa.compiled_kernels()}


def regs_of_new(before):
    """[(num_warps, n_regs, n_spills)] of the kernels compiled since ``before`` (a ``compiled_now()`` result)."""
    return [(ck.metadata.num_warps, int(ck.n_regs), int(ck.n_spills)) for key, ck in compiled_now().items()
            if key not in before]


def make_residuals(B, H, S, D, gen):
    """A random residual in each stored form (the cache's formats; kernels/residual.py) and its float32 value."""
    r = torch.randn(B, H, S, D, device="cuda", generator=gen) * 0.05
    amax = r.abs().amax(-1)
    s8 = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    s4 = torch.where(amax > 0, amax / 7.0, torch.ones_like(amax))
    q4 = (torch.round(r / s4[..., None]).clamp(-7, 7) + 8).to(torch.uint8)
    out = {
        "plain": kernels.Residual(r.to(torch.bfloat16)),
        "fp8_row": kernels.Residual((r / s8[..., None]).to(torch.float8_e4m3fn), s8.float(), "fp8_row"),
        "int4_row": kernels.Residual(q4[..., 0::2] | (q4[..., 1::2] << 4), s4.float(), "int4_row"),
    }
    del r
    return out


def random_perm(B, H, S, gen):
    G = -(-S // C)
    perm = torch.full((B, H, G * C), -1, dtype=torch.int32, device="cuda")
    perm[..., :S] = torch.argsort(torch.rand(B, H, S, device="cuda", generator=gen), dim=-1).to(torch.int32)
    return perm


def run_reuse_shape(name, shp, densities, rep, log, configs=None):
    B, H, S, D = shp["B"], shp["H"], shp["S"], shp["D"]
    G = -(-S // C)
    gen = torch.Generator(device="cuda").manual_seed(1234)
    res = dict(shape=shp, dense={}, sparse={}, errors={}, sweep={}, kernels={}, decode={})
    sets = [tuple(torch.randn(B, H, S, D, device="cuda", dtype=DTYPE, generator=gen) for _ in range(3)) for _ in range(2)]
    native = [tuple(torch.randn(B, S, H * D, device="cuda", dtype=DTYPE, generator=gen).view(B, S, H, D).transpose(1, 2)
                    for _ in range(3)) for _ in range(2)]
    out_buf = torch.empty(B, S, H * D, device="cuda", dtype=DTYPE)
    out_v = out_buf.view(B, S, H, D).transpose(1, 2)
    perms = [random_perm(B, H, S, gen) for _ in range(2)]
    residuals = make_residuals(B, H, S, D, gen)
    sub = slice(0, 2)

    for dname, fn in dense_kernels().items():
        if "(LSE)" not in dname:
            continue
        ms = bench(fn, sets, rep)
        res["dense"][dname] = dict(ms=ms, tflops=4 * S * S * D * H * B / ms / 1e9)
        log(f"{name} dense {dname}: {ms:.2f} ms, {res['dense'][dname]['tflops']:.0f} TFLOP/s")
    best_name = min(res["dense"], key=lambda n: res["dense"][n]["ms"])
    best = res["dense"][best_name]["ms"]
    res["best_dense"] = dict(name=best_name, ms=best)

    fa4 = "flash_attn4" in {b.name for b in registry.backends() if not b.unavailable_reason}
    variants = {  # the Triton backend's op (on sm_90: the Gluon kernel, kernels/triton/sparse_dispatch.py), the
        # Triton kernel's default config called directly (side by side, same inputs), and the op on the model's path
        "triton contiguous": lambda st, p, i: kernels.sparse_attention(*st[0], p, i, backend="triton"),
        TRITON_KERNEL: lambda st, p, i: _tsa.sparse_attention(*st[0], p, i),
        "triton native, out=, residual plain": lambda st, p, i: kernels.sparse_attention(
            *st[1], p, i, out=out_v, residual=residuals["plain"], backend="triton"),
    }
    if fa4:
        variants["flash_attn4 paged route"] = lambda st, p, i: kernels.sparse_attention(*st[0], p, i, backend="flash_attn4")
    default_name = config_name(_tsa.config(D, torch.cuda.get_device_capability()))
    res["default_config"] = default_name
    both = [(st, nt) for st, nt in zip(sets, native)]
    for s in densities:
        kq = int(s * S)
        idxs = [random_kv_idx(B, H, G, S, kq, gen) for _ in sets]
        ref = reference.sparse_attention(*(t[:, sub].float() for t in sets[0]), perms[0][:, sub], idxs[0][:, sub])
        ref_n = reference.sparse_attention(*(t[:, sub].float() for t in native[0]), perms[0][:, sub], idxs[0][:, sub])
        for vname, fn in variants.items():
            before = compiled_now()
            got = fn(both[0], perms[0], idxs[0])
            got = got[0] if isinstance(got, tuple) else got
            want = ref_n if "native" in vname else ref
            for kind, r in residuals.items():
                if f"residual {kind}" in vname:
                    part = kernels.Residual(r.data[:, sub], None if r.scale is None else r.scale[:, sub], r.kind)
                    want = want + part.dequantize(torch.float32)
            res["errors"][f"{vname} s={s}"] = rel_err(got[:, sub], want)
            new = regs_of_new(before)
            if new:
                res["kernels"][vname] = new
                log(f"{name} compiled {vname}: (num_warps, n_regs, n_spills) {new}"
                    + ("  <-- SPILLS" if any(x[2] for x in new) else ""))
            ms = bench(fn, [(st, p, i) for st, p, i in zip(both, perms, idxs)], rep)
            eff = best * (kq / S) / ms
            res["sparse"].setdefault(vname, {})[str(s)] = dict(ms=ms, efficiency=eff, speedup=best / ms)
            log(f"{name} {vname} s={s}: {ms:.2f} ms, efficiency {eff:.3f}, err {res['errors'][f'{vname} s={s}']}")
        for cname, kw in (REUSE_CONFIGS if configs is None else configs).items():  # side by side, same inputs
            if cname == default_name:
                res["sweep"][cname] = f"the default config: '{TRITON_KERNEL}'"
                continue
            if isinstance(res["sweep"].get(cname), str):  # failed at an earlier density
                continue
            try:
                before = compiled_now()
                kw = dict(kw)
                kern = _gluon_kernel() if kw.pop("_gluon", False) else _tsa
                err = rel_err(kern.sparse_attention(*sets[0], perms[0], idxs[0], **kw)[:, sub], ref)
                new = regs_of_new(before) or res["sweep"].get(cname, {}).get("regs_spills")
                ms = bench(lambda st, p, i, kw=kw: kern.sparse_attention(*st[0], p, i, **kw),
                           [(st, p, i) for st, p, i in zip(both, perms, idxs)], rep)
                entry = res["sweep"].setdefault(cname, dict(efficiency={}, regs_spills=new))
                entry["efficiency"][str(s)] = best * (kq / S) / ms
                entry.setdefault("errors", {})[str(s)] = err
                log(f"{name} config {cname} s={s}: efficiency {entry['efficiency'][str(s)]:.3f}, {ms:.2f} ms, "
                    f"err {err}, (num_warps, n_regs, n_spills) {new}")
            except Exception as e:  # out of resources on this GPU
                res["sweep"][cname] = f"{type(e).__name__}: {str(e)[:120]}"
                log(f"{name} config {cname} s={s}: {res['sweep'][cname]}")
        if s == 0.25:
            # the bitmask decode kernel on this selection (what the cache's decode runs on CUDA)
            from comfyui_mc_sparse_pack.comfyui_mc_sparse import encoding

            enc = encoding.encode_selection(idxs[0], S, kq, "bitmask")
            dec = torch.empty_like(idxs[0])
            with registry.recording(registry.Record()) as record:
                kernels.decode_bitmask(enc.data, num_tokens=S, out=dec)
            ok = bool(torch.equal(dec, idxs[0]))
            ms = bench(lambda: kernels.decode_bitmask(enc.data, num_tokens=S, out=dec), [()], rep)
            res["decode"] = dict(ms=ms, bit_exact=ok, backend=record.choices["decode_bitmask"].backend,
                                 frac_of_sparse=ms / res["sparse"]["triton contiguous"][str(s)]["ms"])
            log(f"{name} decode_bitmask s=0.25: {ms:.3f} ms ({res['decode']['backend']}), bit-exact {ok}, "
                f"{res['decode']['frac_of_sparse']:.3f} of the sparse call")
        del idxs
    res["gluon"] = gluon_state()
    log(f"{name} sparse op on this GPU: {res['gluon']}")
    return res


RACE_MS = 20  # --gluon: ms of back-to-back calls per race sample (_timing.race)
HIDE_HOST_CYCLES = 2_000_000  # ~1 ms of GPU clock: a busy wait queued before each timed call (time_interleaved)


def time_interleaved(fns, reps, hide_host=True):
    """{name: median ms} of each fn() over ``reps`` rounds; each round calls every fn once, in an order rotated by one
    per round, with the L2 cache cleared before each call (as ``triton.testing.do_bench``) and CUDA events around it,
    so slow clocks or a busy L2 weigh on every variant alike and the ratios are side by side. ``hide_host``: a GPU busy
    wait (``torch.cuda._sleep``, ~1 ms) is queued between the cache clear and the start event, so the host's Python and
    launch work for the call (tens to hundreds of us: ``time_host``) is done while the GPU is still busy and the events
    time the kernels, as in a model run where the host is ahead of the GPU (without it, an event-bracketed call on an
    idle GPU also times the host's launch path: 1-2 % of a 10 ms dense call, up to ~10 % of a 1.2 ms sparse one)."""
    drv = triton.runtime.driver.active
    cache = drv.get_empty_cache_for_benchmark()
    names = list(fns)
    for n in names:
        fns[n]()
    torch.cuda.synchronize()
    events = {n: [] for n in names}
    for r in range(reps):
        for n in names[r % len(names):] + names[:r % len(names)]:
            drv.clear_cache(cache)
            if hide_host:
                torch.cuda._sleep(HIDE_HOST_CYCLES)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fns[n]()
            end.record()
            events[n].append((start, end))
    torch.cuda.synchronize()
    return {n: sorted(a.elapsed_time(b) for a, b in ev)[len(ev) // 2] for n, ev in events.items()}


def time_warm(fn, calls=2):
    """ms per call of ``calls`` back-to-back calls (no cache clear, the GPU never idles): the auto mode's view."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def time_host(fn, calls=5):
    """Host microseconds per call of fn (Python + launch, measured with the GPU idle before the first call, so the
    launches are never held by a full queue): what an L2-cleared, event-bracketed timing adds when the GPU waits."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t) / calls * 1e6
    torch.cuda.synchronize()
    return host


def host_profile(fn, calls=10, top=12):
    """Where the host time of ``calls`` calls of fn goes (cProfile, own time per function, the GPU idle before):
    the ``top`` functions as 'file:line(name) us per call'."""
    import cProfile
    import pstats

    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof).stats
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return "; ".join(f"{Path(f).name}:{line}({fname}) {tt / calls * 1e6:.0f}" for (f, line, fname), (_, _, tt, _, _)
                     in rows)


def run_gluon_shape(name, shp, densities, reps, log, configs, deadline=None, with_triton=False, res=None):
    """--reuse --gluon: per density, flash-attn-4 dense with LSE (cuDNN too at the first density), the op (auto mode),
    each GLUON_CONFIGS tuning (and with ``with_triton`` the Triton kernel called directly), timed by the method of
    record (``_timing.race``: ``reps`` rounds, each sample back-to-back calls for ~20 ms of GPU time, rotating order,
    medians; dense in the same rounds), efficiency = that race's flash-attn-4 dense ms x s / ms; each checked against
    the float32 reference (2 heads) first; each variant's host us per call at the first density (``time_host``). A
    tuning that raises is reported and dropped (the op and the dense kernels are not); past ``deadline``
    (time.time()) the tunings are dropped, so the op's figure is written within the caller's cap. Same result layout
    as ``run_reuse_shape``, filled into ``res`` density by density (a run stopped by its time cap keeps the
    densities it finished)."""
    B, H, S, D = shp["B"], shp["H"], shp["S"], shp["D"]
    G = -(-S // C)
    gen = torch.Generator(device="cuda").manual_seed(1234)
    res = {} if res is None else res
    res.update(shape=shp, dense={}, sparse={}, errors={}, sweep={}, kernels={}, decode={}, dense_per_s={},
               timing="tests/_timing.race: %d rounds, ~%d ms of back-to-back calls per sample, %s" % (
                   reps, RACE_MS, "no lead-in (MC_SPARSE_RACE_LEAD_IN=0: sessions 5-8)" if not _lead_in()
                   else "each sample led in by untimed calls (session 9)"), from_idle={})
    sets = [tuple(torch.randn(B, H, S, D, device="cuda", dtype=DTYPE, generator=gen) for _ in range(3)) for _ in range(2)]
    perms = [random_perm(B, H, S, gen) for _ in range(2)]
    sub = slice(0, 2)
    sub = slice(0, 2 if S * H < 1_000_000 else 1)  # heads checked against the float32 reference (1 at 14B: time)
    dense = {n: f for n, f in dense_kernels().items() if "(LSE)" in n}
    res["default_config"] = config_name(_tsa.config(D, torch.cuda.get_device_capability()))
    g90 = _gluon_kernel()
    for s in densities:
        kq = int(s * S)
        idxs = [random_kv_idx(B, H, G, S, kq, gen) for _ in sets]
        ref = reference.sparse_attention(*(t[:, sub].float() for t in sets[0]), perms[0][:, sub], idxs[0][:, sub])
        calls = {OP_LABEL: lambda st, p, i: kernels.sparse_attention(*st, p, i, backend="triton")}
        # (the op first: its figure is the scoreboard's)
        if with_triton:
            calls[TRITON_KERNEL] = lambda st, p, i: _tsa.sparse_attention(*st, p, i)
        late = deadline is not None and time.time() > deadline
        for cname, kw in configs.items():
            if late or isinstance(res["sweep"].get(cname), str):  # past the deadline, or failed at an earlier s
                res["sweep"].setdefault(cname, "skipped: past the bench's time budget" if late else None)
                continue
            kw = {k: v for k, v in kw.items() if k != "_gluon"}
            calls[cname] = lambda st, p, i, kw=kw: g90.sparse_attention(*st, p, i, **kw)
        fns = {}
        for vname, call in list(calls.items()):
            try:
                got = call(sets[0], perms[0], idxs[0])
            except Exception as e:  # a tuning that does not compile or launch here: reported, not fatal
                if vname not in configs:
                    raise
                res["sweep"][vname] = f"{type(e).__name__}: {str(e)[:200]}"
                log(f"{name} s={s} {vname}: FAILED {res['sweep'][vname]}")
                del calls[vname]
                continue
            err = rel_err(got[:, sub], ref)
            if vname in configs:
                res["sweep"].setdefault(vname, dict(efficiency={}, errors={}, regs_spills=None))["errors"][str(s)] = err
            else:
                res["errors"][f"{vname} s={s}"] = err
            cyc = itertools.cycle(range(len(sets)))
            fns[vname] = lambda call=call, cyc=cyc: (lambda j: call(sets[j], perms[j], idxs[j]))(next(cyc))
        del ref
        for dname, f in dense.items():
            if dname.startswith("flash_attn4") or s == densities[0]:  # cuDNN once per shape
                cyc = itertools.cycle(range(len(sets)))
                fns[dname] = lambda f=f, cyc=cyc: f(*sets[next(cyc)])
        if s == densities[0]:  # host cost per call, with the GPU idle before the first call
            res["host_us"] = {n: round(time_host(fns[n], calls=2), 1) for n in calls}
            log(f"{name} host us per call (Python + launch): {res['host_us']}")
            log(f"{name} the op's host profile (10 calls, GPU idle first): {host_profile(fns[OP_LABEL])}")
        idle = {}  # each fn's median ms per lead-in call (started right after another fn's sample)
        ms = _timing.race(fns, reps, RACE_MS, from_idle=idle)
        res["from_idle"][str(s)] = idle
        base_name = "flash_attn4 (LSE)" if "flash_attn4 (LSE)" in ms else "cudnn sdpa (LSE)"
        base = ms[base_name]
        res["dense_per_s"][str(s)] = {n: ms[n] for n in dense if n in ms}
        for dname in dense:
            if dname in ms:
                res["dense"].setdefault(dname, dict(ms=ms[dname], tflops=4 * S * S * D * H * B / ms[dname] / 1e9))
        for vname in calls:
            eff = base * (kq / S) / ms[vname]
            if vname in configs:
                res["sweep"][vname]["efficiency"][str(s)] = eff
            else:
                res["sparse"].setdefault(vname, {})[str(s)] = dict(ms=ms[vname], efficiency=eff, speedup=base / ms[vname])
            cudnn = res["dense"].get("cudnn sdpa (LSE)", {}).get("ms")
            if cudnn:  # against cuDNN too (timed in the first density's race)
                res.setdefault("vs_cudnn", {}).setdefault(vname, {})[str(s)] = cudnn * (kq / S) / ms[vname]
            log(f"{name} s={s} {vname}: {ms[vname]:.3f} ms, efficiency {eff:.3f} vs {base_name} {base:.2f} ms "
                f"(same race)" + (f"; from idle {idle[vname]:.3f} ms, {base_name} {idle[base_name]:.2f} ms"
                                  if vname in idle and base_name in idle else ""))
        log(f"{name} s={s} dense: " + ", ".join(f"{n} {ms[n]:.2f} ms" for n in dense if n in ms))
        del idxs
        best_name = "flash_attn4 (LSE)" if "flash_attn4 (LSE)" in res["dense"] else "cudnn sdpa (LSE)"
        done = sorted(v[best_name] for v in res["dense_per_s"].values())
        res["best_dense"] = dict(name=best_name, ms=done[len(done) // 2])
    res["gluon"] = gluon_state()
    log(f"{name} sparse op on this GPU: {res['gluon']}")
    return res


def _lead_in() -> bool:
    """Whether ``_timing.race`` leads each sample in with untimed calls (``MC_SPARSE_RACE_LEAD_IN``, default on)."""
    return os.environ.get("MC_SPARSE_RACE_LEAD_IN", "1") != "0"


def _gluon_kernel():
    return importlib.import_module("comfyui_mc_sparse_pack.kernels.triton.sparse_attention_sm90")


def gluon_state():
    """Which kernel the Triton backend's op ran here: the sm_90 Gluon kernel (its compiled variants' (n_regs,
    n_spills)) or the Triton kernel, with the Gluon refusal or fallback reason."""
    d = importlib.import_module("comfyui_mc_sparse_pack.kernels.triton.sparse_dispatch")
    g = importlib.import_module("comfyui_mc_sparse_pack.kernels.triton.sparse_attention_sm90")
    probe = torch.empty(1, 1, 128, 128, device="cuda", dtype=DTYPE)
    compiled = [(int(ck.n_regs), int(ck.n_spills)) for ck in g.compiled_kernels()]
    return dict(gluon_ran=bool(compiled) and d.fallback_reason() is None, gluon_kernels=compiled, mode=d.gluon_mode(),
                auto_schedules=list(d.AUTO_SCHEDULES), fallback=d.fallback_reason(), refusal=d.gluon_refusal(probe, probe, probe),
                auto_choices=[dict(k_alloc=k[4][-1], residual=k[6], lse=k[7], choice=c,
                                   ms={n: round(t, 3) for n, t in d._times[k].items()}) for k, c in d.choices.items()])


def update_scoreboard(path, keys_file, report, command, commit):
    """Write triton_sparse_eff_min (and fa4_route_eff_min) into the scoreboard ``path`` and, alone, into ``keys_file``
    (tests/_scoreboard.update); returns these entries.

    triton_sparse_eff_min is the min over the measured points of the best config that compiled without spills at every
    point: the op ("triton contiguous": the sm_90 Gluon kernel where it ran), the Triton kernel's default config or a
    REUSE_CONFIGS entry (packed or fp32 exponentials, eager or lazy
    rescale), named in the note with the other configs' minima and the winner's errors."""
    board = {}

    def effs(variant):
        return {(n, s): v["efficiency"] for n, r in report["shapes"].items() for s, v in r["sparse"].get(variant, {}).items()}

    dense = "; ".join(f"{n}: {r['best_dense']['name']} {r['best_dense']['ms']:.2f} ms" for n, r in report["shapes"].items())
    spills = sorted({x for r in report["shapes"].values() for v in r["kernels"].values() for x in v})
    default = next(iter(report["shapes"].values())).get("default_config", "default")
    gluon = [r.get("gluon", {}) for r in report["shapes"].values()]
    op_key = ("the op: sm_90 Gluon kernel (default)" if gluon and all(g.get("gluon_ran") for g in gluon)
              else "the op: Triton kernel (default)")
    default_key = f"{default} (Triton kernel)"
    # the Triton figure: the best spill-free config measured at every point (the op's default among them)
    op_name = OP_LABEL if report.get("op_only") else "triton contiguous"
    cands = {op_key: effs(op_name), default_key: effs(TRITON_KERNEL)}
    errs = {key: [e for r in report["shapes"].values() for k, e in r["errors"].items() if k.startswith(v + " ")]
            for key, v in ((op_key, op_name), (default_key, TRITON_KERNEL))}
    bad = [c for c in (op_key, default_key) if any(e["rel_l2"] > 2e-2 for e in errs[c])]
    for c in bad:  # wrong results are no figure
        cands.pop(c)
    for cname in next(iter(report["shapes"].values()))["sweep"]:
        per = [r["sweep"].get(cname) for r in report["shapes"].values()]
        if all(isinstance(v, dict) and v.get("regs_spills") and all(x[2] == 0 for x in v["regs_spills"]) for v in per):
            cands[cname] = {(n, s): e for n, r in report["shapes"].items() for s, e in r["sweep"][cname]["efficiency"].items()}
            errs[cname] = [e for v in per for e in v.get("errors", {}).values()]
    n_points = max(len(e) for e in cands.values())
    full = {c: e for c, e in cands.items() if e and len(e) == n_points}
    # --gluon: the figure is what users get, the op (the Gluon tunings are reported beside it in the note)
    pick = op_key if report.get("op_only") and op_key in full else max(full, key=lambda c: min(full[c].values()))
    for key, variant in (("triton_sparse_eff_min", pick), ("fa4_route_eff_min", "flash_attn4 paged route")):
        e = full[pick] if key.startswith("triton") else effs(variant)
        if not e:
            continue
        worst = min(e, key=e.get)
        native = effs("triton native, out=, residual plain")
        note = ((f"PARTIAL (stopped by the time cap; measured: {sorted(e)}); " if report.get("partial") else "")
                + f"min over shapes x s of best dense (with LSE) x s / sparse ms; worst at {worst[0]} s={worst[1]}; "
                f"best dense {dense}; timing: {next(iter(report['shapes'].values())).get('timing', '?')}")
        if key.startswith("triton"):
            pe = errs.get(pick, [])
            note += (f"; Triton config: {pick} ({'the op as users get it' if report.get('op_only') else 'the fastest spill-free config at its worst point'}; per-config minima "
                     f"{ {c: round(min(v.values()), 3) for c, v in full.items()} }); its error vs the float32 reference "
                     f"(2 heads): max rel_l2 {max((x['rel_l2'] for x in pe), default=float('nan')):.2e}, max abs "
                     f"{max((x['max_abs'] for x in pe), default=float('nan')):.2e}; default config with native "
                     f"[B, S, H*D] views + out= + plain residual epilogue: min "
                     f"{min(native.values()) if native else float('nan'):.3f}; "
                     f"default config compiled (num_warps, n_regs, n_spills): {spills}; the op per shape: {gluon}"
                     + (f"; excluded for rel_l2 > 2e-2: {bad}" if bad else ""))
        board[key] = _scoreboard.entry(e[worst], "ratio", note, command=command, commit=commit, gpu=report["gpu"])
    _scoreboard.update(board, keys_file, path, say=False)
    return board


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON output path")
    ap.add_argument("--shapes", default="1.3b,14b")
    ap.add_argument("--densities", default="0.1,0.15,0.25,0.5")
    ap.add_argument("--rep", type=int, default=500, help="do_bench rep budget per measurement, ms")
    ap.add_argument("--sweep", action="store_true", help="also time Triton tile configs")
    ap.add_argument("--reuse", action="store_true", help="time the reuse path (issue 14) instead of selection/grouping")
    ap.add_argument("--quick", action="store_true", help="with --reuse: QUICK_CONFIGS instead of REUSE_CONFIGS")
    ap.add_argument("--gluon", action="store_true", help="with --reuse: GLUON_CONFIGS instead of a Triton sweep (the "
                                                         "op = Gluon on sm_90, the Triton kernel's default, the routes)")
    ap.add_argument("--gluon-configs", default="", help="with --gluon: comma-separated GLUON_CONFIGS names (default all)")
    ap.add_argument("--reps", type=int, default=0, help="with --gluon: race rounds per density (default 5 at 1.3b, "
                    "--reps-14b at 14b)")
    ap.add_argument("--reps-14b", type=int, default=3, help="with --gluon, without --reps: rounds at 14b")
    ap.add_argument("--with-triton", action="store_true", help="with --gluon: also the Triton kernel called directly")
    ap.add_argument("--gluon-auto", default="", help="with --gluon: 'previous' times the op with sparse_dispatch's "
                    "PREVIOUS_AUTO_SCHEDULES instead of AUTO_SCHEDULES (a GPU round whose checks of the new auto "
                    "schedules failed); the JSON and the scoreboard note name the schedules timed")
    ap.add_argument("--budget", type=float, default=0, help="with --gluon: seconds the whole run may take; the "
                    "tunings are dropped 12 s before it, 22 s more per shape still to come (the op and dense are "
                    "always timed)")
    ap.add_argument("--commit", default="", help="commit measured (default: $MC_SPARSE_COMMIT, else git HEAD)")
    ap.add_argument("--scoreboard", default=str(_scoreboard.BOARD))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_kernels.py needs a CUDA GPU")
    densities = [float(x) for x in args.densities.split(",")]
    if args.gluon_auto == "previous":
        d = importlib.import_module("comfyui_mc_sparse_pack.kernels.triton.sparse_dispatch")
        d.AUTO_SCHEDULES = d.PREVIOUS_AUTO_SCHEDULES
    elif args.gluon_auto:
        sys.exit(f"--gluon-auto must be 'previous' or empty, got {args.gluon_auto!r}")
    report = dict(
        gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda,
        cudnn=torch.backends.cudnn.version(), python=platform.python_version(), argv=sys.argv,
        backends=registry.report(), shapes={},
    )
    try:
        from importlib.metadata import version

        import flash_attn  # noqa: F401
        report["flash_attn_4"] = version("flash-attn-4")
        report["cutlass_dsl"] = version("nvidia-cutlass-dsl")
    except Exception as err:  # optional
        report["flash_attn_4"] = f"absent ({type(err).__name__})"
    t0 = time.time()

    def log(msg):
        print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)

    log(registry.report())
    shapes = args.shapes.split(",")

    class _TimeCap(Exception):
        pass

    def on_term(signum, frame):  # `timeout` sends SIGTERM: keep what was measured (--reuse --gluon)
        raise _TimeCap()

    if args.reuse and args.gluon:
        signal.signal(signal.SIGTERM, on_term)
    try:
        _run_shapes(args, shapes, densities, report, log, t0)
    except _TimeCap:
        log("stopped by the time cap (SIGTERM): writing what was measured")
        report["partial"] = True
        for name in list(report["shapes"]):  # a shape with no finished density is no figure
            if not report["shapes"][name].get("dense_per_s"):
                del report["shapes"][name]
        for r in report["shapes"].values():
            r.setdefault("gluon", {})
        Path(args.out).write_text(json.dumps(report, indent=1))
    if args.reuse and not report["shapes"]:
        log("nothing measured: no scoreboard")
        return
    if args.reuse:
        command = "python3 tests/bench_kernels.py " + " ".join(a if a != args.out else "$OUT/" + Path(a).name
                                                                 for a in sys.argv[1:])
        board = update_scoreboard(args.scoreboard, Path(args.out).parent / "scoreboard.json", report, command,
                                  _scoreboard.measured_commit(args.commit))
        print_reuse_table(report, board)
        log("done")
        return
    print_table(report)


def _run_shapes(args, shapes, densities, report, log, t0):
    for j, name in enumerate(shapes):
        if args.reuse:
            gluon_cfgs = {n: c for n, c in GLUON_CONFIGS.items()
                          if not args.gluon_configs or n in args.gluon_configs.split(",")}
            configs = ((gluon_cfgs if torch.cuda.get_device_capability() == (9, 0) else {}) if args.gluon
                       else QUICK_CONFIGS if args.quick else REUSE_CONFIGS)
            if args.gluon:
                report["shapes"][name] = {}
                run_gluon_shape(name, SHAPES[name], densities,
                                                         args.reps or (5 if name == "1.3b" else args.reps_14b),
                                                         log, configs,
                                                         deadline=t0 + args.budget - 8 - 18 * (len(shapes) - 1 - j)
                                                         if args.budget else None, with_triton=args.with_triton,
                                                         res=report["shapes"][name])
            else:
                report["shapes"][name] = run_reuse_shape(name, SHAPES[name], densities, args.rep, log, configs)
            report["op_only"] = bool(args.gluon)
        else:
            report["shapes"][name] = run_shape(name, SHAPES[name], densities, args.sweep, args.rep, log)
        Path(args.out).write_text(json.dumps(report, indent=1))
        torch.cuda.empty_cache()


def print_table(report):
    print("\n| shape | kernel | s=" + " | s=".join(str(s) for s in next(iter(
        next(iter(report["shapes"].values()))["sparse"].values()), {}).keys()) + " |")
    for name, r in report["shapes"].items():
        print(f"| {name} | best dense: {r['best_dense']['name']} {r['best_dense']['ms']:.2f} ms |")
        for sname, per in r["sparse"].items():
            print(f"| {name} | {sname} efficiency | " + " | ".join(f"{v['efficiency']:.3f}" for v in per.values()) + " |")
        for k, v in r["selection"].items():
            print(f"| {name} | {k} | {v['ms']:.2f} ms = {v['frac_of_dense']:.3f} dense |")
        for bname in ("torch", "triton"):
            print(f"| {name} | pddp {bname} | {r['pddp'][bname]['ms']:.2f} ms |")
        for k, v in r["sweep"].items():
            print(f"| {name} | sweep {k} | {v} |")



def config_effs(r, cname):
    """{s: efficiency} of one REUSE_CONFIGS entry in one shape's result ({} when it failed); the default config's
    entry is the TRITON_KERNEL variant (the Triton kernel called directly)."""
    v = r["sweep"].get(cname)
    if cname == r.get("default_config"):
        return {x: e["efficiency"] for x, e in r["sparse"].get(TRITON_KERNEL, {}).items()}
    return dict(v["efficiency"]) if isinstance(v, dict) else {}


def print_reuse_table(report, board):
    dens = list(next(iter(next(iter(report["shapes"].values()))["sparse"].values())).keys())
    print("\n| shape | variant | s=" + " | s=".join(dens) + " |")
    for name, r in report["shapes"].items():
        print(f"| {name} | best dense: {r['best_dense']['name']} {r['best_dense']['ms']:.2f} ms |")
        for vname, per in r["sparse"].items():
            print(f"| {name} | {vname} efficiency | " + " | ".join(f"{v['efficiency']:.3f}" for v in per.values()) + " |")
        a, b = r["sparse"].get("triton contiguous", {}), r["sparse"].get(TRITON_KERNEL, {})
        if a and b:  # side by side, same inputs: the op (Gluon on sm_90) against the Triton kernel
            print(f"| {name} | the op / Triton kernel time ratio ({r.get('gluon')}) | "
                  + " | ".join(f"{a[x]['ms'] / b[x]['ms']:.3f}" for x in dens if x in a and x in b) + " |")
        for cname, v in r["sweep"].items():
            if isinstance(v, dict):
                print(f"| {name} | config {cname} {v['regs_spills']} | "
                      + " | ".join(f"{e:.3f}" for e in v["efficiency"].values()) + " |")
            else:
                print(f"| {name} | config {cname} | {v} |")
        for tile in REUSE_TILES:  # side by side, same run: packed / fp32 exponentials, lazy / eager rescale
            if " pipe" in tile:
                a, b = config_effs(r, f"{tile} fp32 lazy"), config_effs(r, f"{tile.replace(' pipe', '')} fp32 lazy")
                if a and b:
                    print(f"| {name} | {tile} fp32 lazy: pipelined / not time ratio | "
                          + " | ".join(f"{b[x] / a[x]:.3f}" for x in dens if x in a and x in b) + " |")
            for lazy in ("", " lazy"):
                a, b = config_effs(r, f"{tile} f16x2{lazy}"), config_effs(r, f"{tile} fp32{lazy}")
                if a and b:
                    print(f"| {name} | {tile}{lazy}: f16x2 / fp32 time ratio | "
                          + " | ".join(f"{b[x] / a[x]:.3f}" for x in dens if x in a and x in b) + " |")
            for e in ("fp32", "f16x2"):
                a, b = config_effs(r, f"{tile} {e} lazy"), config_effs(r, f"{tile} {e}")
                if a and b:
                    print(f"| {name} | {tile} {e}: lazy / eager time ratio | "
                          + " | ".join(f"{b[x] / a[x]:.3f}" for x in dens if x in a and x in b) + " |")
        for cname in QUICK_CONFIGS:  # --quick: each against the default config, same run
            a, b = config_effs(r, cname), config_effs(r, r.get("default_config"))
            if a and b and cname != r.get("default_config"):
                print(f"| {name} | {cname}: config / default time ratio | "
                      + " | ".join(f"{b[x] / a[x]:.3f}" for x in dens if x in a and x in b) + " |")
        for cname in REUSE_CONFIGS:  # Q in registers against Q in shared memory, same tile and softmax
            if " qreg" in cname and " pipe" not in cname:
                a, b = config_effs(r, cname), config_effs(r, cname.replace(" qreg", ""))
                if a and b:
                    print(f"| {name} | {cname}: qreg / shared time ratio | "
                          + " | ".join(f"{b[x] / a[x]:.3f}" for x in dens if x in a and x in b) + " |")
        for vname, per in r.get("vs_cudnn", {}).items():  # --gluon: against cuDNN dense with LSE
            print(f"| {name} | {vname} efficiency vs cuDNN | " + " | ".join(f"{v:.3f}" for v in per.values()) + " |")
        for vname, per in r.get("warm", {}).items():  # --gluon: back-to-back calls, no cache clear
            print(f"| {name} | {vname} warm efficiency | " + " | ".join(f"{v['efficiency']:.3f}" for v in per.values())
                  + " |")
        if r.get("decode"):
            print(f"| {name} | decode_bitmask | {r['decode']} |")
        print(f"| {name} | compiled (num_warps, n_regs, n_spills) | {r['kernels']} |")
    for key in ("triton_sparse_eff_min", "fa4_route_eff_min"):
        if key in board:
            print(f"scoreboard {key} = {board[key]['value']} ({board[key]['note']})")


if __name__ == "__main__":
    main()
