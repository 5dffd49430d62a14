"""Anchor-step benchmark on a CUDA GPU (not collected by pytest): pass 2 + top-K, PDDP, the whole anchor call.

At the Wan2.1-1.3B 480p (B=1, H=12, S=32760 = 21x30x52, D=128) and Wan2.1-14B 720p (H=40, S=75600 = 21x45x80)
attention shapes, bf16, C = 128, each figure measured side by side in one process:
- dense: every dense kernel with LSE present (flash-attn-4 when importable, cuDNN through ``cuda_sdpa``); the best
  is the baseline of every ratio;
- pass 2 + top-K (``kernels/triton/selection.select_kv``: fused QK^T / exp2 / group sums in float16, then the
  top-K of ``kernels/triton/topk.py``) at s in {0.1, 0.15, 0.25, 0.5} / best dense (and / every dense timed), with
  select_kv's defaults (the scoreboard figure), with the fastest bf16 config and with the fastest float8 config of a
  pass-2 sweep on one head chunk (tile configs, two groups per program, polynomial exp2 shares, float8 QK^T with its
  selection quality against the bf16 sums, on the bench data and on the synthetic DiT workload); the top-K alone,
  radix vs bracket method, side by side; exactness checked on the GPU first (the selection equals the brute-force
  top-K of the kernel's own float16 sums, ties to the lower index) -- see ``select_part``;
- PDDP: the Triton grouping (``kernels/triton/grouping.py``) and every other grouping backend present, in ms per
  layer call (all heads); grouping quality = mean within-group query variance / the torch reference's, on
  structured queries (a smooth function of the token's (frame, row, column) position plus noise, as DiT queries
  are), contract (every query once, -1 tail) checked;
- the whole ``attention.anchor_attention`` call (s = 0.25, default backends) / the best dense call.
Timings: ``triton.testing.do_bench`` medians. Expected run time on an H200: ~2-3 minutes (Triton compiles included).

Writes ``<out>/bench_anchor.json``, and the scoreboard keys ``pass2_topk_over_dense_max``, ``pddp_ms_wan14b_720p``,
``pddp_ms_wan13b_480p``, ``pddp_variance_ratio_max`` into ``docs/results/scoreboard.json`` (read, update, write
back) and these keys alone to ``<out>/scoreboard.json`` (tests/_scoreboard.py).

Usage (from the checkout root): python tests/bench_anchor.py --out OUT [--shapes 1.3b,14b] [--rep 300]
[--only pddp|select] [--commit HASH]. ``--only pddp``: the PDDP part alone (~1 min on an H200): ms per call, as one
CUDA graph (GPU time without launch overhead), phase breakdown, variants (samples / power-iteration steps / bins),
variance ratio. ``--only select``: the dense baseline and pass 2 + top-K alone (~1.5 min on an H200). ``--only gluon``:
the Gluon pass-2 kernel (``kernels/triton/selection_sm90.py``) beside the Triton pair kernel: in the pass-2 sweep, alone
per ``GLUON_TUNINGS``, in select_kv at s = 0.1 / 0.25 (no scoreboard key).
The commit recorded on the scoreboard: --commit, else $MC_SPARSE_COMMIT, else git HEAD.
``--smoke`` runs every code path once on a tiny shape on the CPU (Triton interpreter; no timing, no scoreboard).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "comfyui_mc_sparse"))
import _scoreboard  # noqa: E402
import _standalone  # noqa: E402

_standalone.load_pack()
import triton  # noqa: E402
import triton.testing  # noqa: E402
from comfyui_mc_sparse_pack import kernels  # noqa: E402
from comfyui_mc_sparse_pack.comfyui_mc_sparse import attention  # noqa: E402
from comfyui_mc_sparse_pack.comfyui_mc_sparse.config import MCSparseConfig  # noqa: E402
from comfyui_mc_sparse_pack.kernels import reference, registry  # noqa: E402
from comfyui_mc_sparse_pack.kernels.reference.pddp import within_group_variance  # noqa: E402
from comfyui_mc_sparse_pack.kernels.reference.topk import top_k_rows as ref_top_k_rows  # noqa: E402
from comfyui_mc_sparse_pack.kernels.triton import grouping, pass2_dispatch, selection  # noqa: E402

SHAPES = {"1.3b": dict(H=12, grid=(21, 30, 52)), "14b": dict(H=40, grid=(21, 45, 80)), "smoke": dict(H=2, grid=(2, 4, 33))}
DEVICE = "cuda"
ONLY = None  # --only: one part of the benchmark
SCORE_SHAPE = {"1.3b": "wan13b_480p", "14b": "wan14b_720p"}
C = 128
D = 128
KV_TILE = 128
DENSITIES = (0.1, 0.15, 0.25, 0.5)
PASS2_CONFIGS = {  # group_prob_sums tuning; "fp8": float8 QK^T (approximate sums), "poly N": N/4 of exp2 on FMA
    "pair stagger bn64 w4 st3 (bf16 default)": dict(block_n=64, num_warps=4, num_stages=3, pair=True, pipelined=True,
                                                    fp8=False),
    "pair stagger poly 1/4": dict(block_n=64, num_warps=4, num_stages=3, pair=True, poly=1, fp8=False),
    "pair stagger poly 1/2": dict(block_n=64, num_warps=4, num_stages=3, pair=True, poly=2, fp8=False),
    "fp8 pair stagger bn64 w4 st3": dict(block_n=64, num_warps=4, num_stages=3, fp8=True),
    "fp8 pair stagger poly 1/4": dict(block_n=64, num_warps=4, num_stages=3, fp8=True, poly=1),
    "fp8 pair stagger poly 1/2": dict(block_n=64, num_warps=4, num_stages=3, fp8=True, poly=2),
    "fp8 pair stagger bn128 w8": dict(block_n=128, num_warps=8, num_stages=3, fp8=True),
    "fp8 pair stagger poly 1/4 bn128 w8": dict(block_n=128, num_warps=8, num_stages=3, fp8=True, poly=1),
    "fp8 pair unstaggered": dict(fp8=True, pipelined=False, gluon=False),  # the Triton pair kernel, its defaults
    "fp8 gluon ws": dict(fp8=True, gluon=True),  # the warp-specialised sm_90 kernel (selection_sm90.py)
    "pair stagger + hist": dict(block_n=64, num_warps=4, num_stages=3, pair=True, fp8=False, hist=True),
    "fp8 pair unstaggered + hist": dict(block_n=64, num_warps=4, num_stages=3, fp8=True, pipelined=False, hist=True),
}
# --quick: the sweep's configs (round 1's other figures: docs/kernels.md), no workload quality, the fp8 + hist select
QUICK_CONFIGS = ("fp8 pair unstaggered", "fp8 gluon ws")  # (6d7451e, 14B / 1.3B: bf16 0.610 / 0.627, fp8 + hist 0.601 / 0.704)
# the Gluon pass-2 kernel alone on precomputed float8 operands (selection_sm90.group_prob_sums_fp8 tuning), each
# beside the Triton pair kernel alone (its pass 2 minus the operand pass)
GLUON_ONLY_CONFIGS = ("fp8 pair unstaggered", "fp8 gluon ws")  # --only gluon: the pass-2 sweep's two float8 kernels
GLUON_TUNINGS = {"default": {}, "kb poly": dict(kb_poly=True), "3 groups": dict(groups=3),
                 "3 groups kb poly": dict(groups=3, kb_poly=True)}
QUICK = False
VARIANTS = None  # --variants: the PDDP variants timed (None: all)
TOPK_METHODS = ("radix", "bracket", "radix + pass-2 hist")
QUICK_TOPK_METHODS = ("radix", "bracket")  # --quick (round 1b: radix + hist 11.7 / 1.01 ms)
OPERAND_TUNING = {  # selection.fp8_operands launch tunings timed beside its default (264 statistics programs per
    # tensor, 64 rows x 4 warps per quantising program)
    "default again": {},
    "quant 128 rows": dict(quant_block=128),
    "quant 128 rows 8 warps": dict(quant_block=128, quant_warps=8),
    "quant 32 rows": dict(quant_block=32),
    "stats 528 programs": dict(stats_programs=528),
}
TOPK_TUNING = {  # top_k_rows variants timed at s = 0.25 beside the methods' defaults (radix 4 warps x 1024,
    # bracket 4 warps x one 16-byte row per thread, prefetch, 64 registers: topk._BRACKET_WARPS / _BRACKET_MAXNREG)
    "bracket uncapped (95 regs)": dict(method="bracket", maxnreg=0),
    "bracket w1": dict(method="bracket", num_warps=1),
    "bracket w1 no prefetch": dict(method="bracket", num_warps=1, prefetch=False),
    "bracket w2 72 regs": dict(method="bracket", num_warps=2, maxnreg=72),
    "bracket 1 sample per 32 keys": dict(method="bracket", sample_stride=32),  # 1.3B: 1023 samples (not 520)
}


def bench(fn, rep_ms):
    if DEVICE == "cpu":  # --smoke: run once, time roughly
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1000
    return triton.testing.do_bench(fn, warmup=50, rep=rep_ms, return_mode="median")


def structured_q(H, grid, gen):
    """[1, H, S, D] bf16 queries: per head a smooth random function of (frame, row, column) plus noise."""
    F, Y, X = grid
    pos = torch.stack(torch.meshgrid(*(torch.arange(n, device=DEVICE, dtype=torch.float32) for n in grid),
                                     indexing="ij"), -1).reshape(-1, 3) / torch.tensor([F, Y, X], device=DEVICE)
    heads = []
    for _ in range(H):
        freqs = torch.randn(3, D, device=DEVICE, generator=gen) * 6.0
        lin = torch.randn(3, D, device=DEVICE, generator=gen)
        heads.append(torch.sin(pos @ freqs) + pos @ lin + 0.3 * torch.randn(pos.shape[0], D, device=DEVICE, generator=gen))
    return torch.stack(heads).unsqueeze(0).to(torch.bfloat16)


def dense_fns():
    names = {b.name for b in registry.backends() if not b.unavailable_reason}
    return {n: (lambda n: lambda q, k, v: kernels.dense_attention(q, k, v, return_lse=True, backend=n))(n)
            for n in ("flash_attn4", "cuda_sdpa") if n in names}


PDDP_VARIANTS = {  # name: (pddp_groups keywords, grouping module constants set for the call), each against the
    # default (64 samples by their Gram matrix, <= 4 power steps, int8 copy of q below the root with one scale per
    # head, CUDA graph for small q)
    "graph off": ({}, dict(GRAPH=False)),
    "old default (256 samples, 8 steps, bf16 q)": (dict(samples=256, power_iters=8),
                                                   dict(COMPACT=False, POWER_ITERS_MAX=8)),
    "bf16 q (no int8 copy)": ({}, dict(COMPACT=False)),
    "int8 copy with a scale per query": ({}, dict(HEAD_SCALE=False)),
    "i2": (dict(power_iters=2), {}),
    "i8": (dict(power_iters=8), dict(POWER_ITERS_MAX=8)),
    "sq8 (3 squarings)": (dict(power_iters=8), dict(SQUARE=True, POWER_ITERS_MAX=8)),
    # sortN: nodes of up to N groups split once per level by a one-round _subtree program (sort, no histogram)
    "sort3": ({}, dict(SORTSPLIT=3)),
    "sort4": ({}, dict(SORTSPLIT=4)),
    "sort16": ({}, dict(SORTSPLIT=16)),
    "tile 2048": ({}, dict(_TILE=2048)),  # slots per program of _count / _apply
    "local histogram": ({}, dict(LOCAL_HIST=True)),  # _bin: one atomic per distinct bin of its block
    "sort3 i2": (dict(power_iters=2), dict(SORTSPLIT=3)),
}


@contextlib.contextmanager
def patched(module, values):
    old = {k: getattr(module, k) for k in values}
    for k, v in values.items():
        setattr(module, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(module, k, v)


def run_pddp(name, q, res, rep, log):
    """PDDP: contract, determinism, quality against the torch reference, ms per call, CUDA-graph ms (GPU time only),
    phase breakdown, and the variants of ``PDDP_VARIANTS``."""
    _, H, S, _ = q.shape
    ref_perm = reference.pddp_groups(q, C)
    ref_var = within_group_variance(q, ref_perm, C)
    groupers = {"triton grouping": lambda x: grouping.pddp_groups(x, C)}
    for b in registry.backends():
        if not b.unavailable_reason and "pddp_groups" in b.ops and b.name not in ("torch", "triton"):
            groupers[f"backend {b.name}"] = (lambda n: lambda x: kernels.pddp_groups(x, C, backend=n))(b.name)
    groupers["torch reference"] = lambda x: reference.pddp_groups(x, C)
    arange = torch.arange(S, device=DEVICE, dtype=torch.int32).expand(1, H, S)
    for gname, fn in groupers.items():
        with section(res, f"pddp {gname}", log):
            perm = fn(q)
            ok = bool((perm[..., S:] == -1).all()) and bool(torch.equal(torch.sort(perm[..., :S], dim=-1).values, arange))
            ratio = float(within_group_variance(q, perm, C).sum() / ref_var.sum())
            ms = bench(lambda: fn(q), rep)
            res["pddp"][gname] = dict(ms=ms, variance_ratio=ratio, contract_ok=ok,
                                      deterministic=bool(torch.equal(perm, fn(q))))
            log(f"{name} pddp {gname}: {ms:.3f} ms, within-group variance / reference {ratio:.4f}, contract {ok}, "
                f"deterministic {res['pddp'][gname]['deterministic']}")
    if DEVICE == "cuda":
        with section(res, "pddp graph", log):
            res["pddp_graph_ms"] = graph_ms(lambda: grouping.pddp_groups(q, C), rep)
            log(f"{name} pddp triton grouping as one CUDA graph (GPU time, no launch overhead): {res['pddp_graph_ms']}")
        with section(res, "pddp phases", log):
            res["pddp_phases_ms"] = pddp_phases(q)
            log(f"{name} pddp phases (ms, summed over levels, event-timed, launch gaps included): "
                f"{res['pddp_phases_ms']}")
    for vname, (kw, consts) in PDDP_VARIANTS.items():
        if VARIANTS is not None and vname not in VARIANTS:
            continue
        with section(res, f"pddp {vname}", log), patched(grouping, consts):
            fn = (lambda kw: lambda x: grouping.pddp_groups(x, C, **kw))(kw)
            perm = fn(q)
            ok = bool((perm[..., S:] == -1).all()) and bool(torch.equal(torch.sort(perm[..., :S], dim=-1).values, arange))
            ratio = float(within_group_variance(q, perm, C).sum() / ref_var.sum())
            res["pddp"][f"triton grouping {vname}"] = r = dict(ms=bench(lambda: fn(q), rep), variance_ratio=ratio,
                                                               contract_ok=ok)
            r["graph_ms"] = graph_ms(lambda: fn(q), rep) if DEVICE == "cuda" else None
            r["phases_ms"] = pddp_phases(q, **kw) if DEVICE == "cuda" else None
            log(f"{name} pddp {vname}: {r['ms']:.3f} ms (graph {r['graph_ms']}), variance ratio {ratio:.4f}, "
                f"contract {ok}, GPU phases {r['phases_ms'] and {k: t for k, t in r['phases_ms'].items() if k != 'per_launch'} }")


def run_shape(name, H, grid, rep, log, only=None):
    S = math.prod(grid)
    G = -(-S // C)
    gen = torch.Generator(device=DEVICE).manual_seed(20261201)
    q = structured_q(H, grid, gen)
    if only == "pddp":
        res = dict(S=S, H=H, pddp={})
        run_pddp(name, q, res, rep, log)
        return res
    k, v = (torch.randn(1, H, S, D, device=DEVICE, dtype=torch.bfloat16, generator=gen) for _ in range(2))
    res = dict(S=S, H=H, dense={}, pddp={}, pass2_sweep={}, select={}, anchor={})

    for dname, fn in dense_fns().items():
        fn(q, k, v)
        res["dense"][dname] = bench(lambda: fn(q, k, v), rep)
        log(f"{name} dense {dname} (LSE): {res['dense'][dname]:.2f} ms")
    best_name = min(res["dense"], key=res["dense"].get)
    best = res["dense"][best_name]
    res["best_dense"] = dict(name=best_name, ms=best)
    _, lse = kernels.dense_attention(q, k, v, return_lse=True, backend=best_name)
    if only in ("select", "gluon"):
        with section(res, "grouping for pass 2", log):
            perm = grouping.pddp_groups(q, C)
        return select_part(name, q, k, lse, perm, res, best, rep, log)

    run_pddp(name, q, res, rep, log)
    perm = None
    with section(res, "grouping for pass 2", log):
        perm = grouping.pddp_groups(q, C)
    if perm is None:
        perm = reference.pddp_groups(q, C)

    select_part(name, q, k, lse, perm, res, best, rep, log)

    # the whole anchor call
    with section(res, "anchor call", log):
        cfg = MCSparseConfig(density=0.25, group_size=C, kv_tile=KV_TILE)
        with registry.recording(registry.Record()) as record:
            ms = bench(lambda: attention.anchor_attention(q, k, v, cfg, check_finite=False), rep)
        res["anchor"] = dict(ms=ms, over_dense=ms / best, backends={op: c.backend for op, c in record.choices.items()})
        log(f"{name} anchor_attention (s=0.25): {ms:.2f} ms = {ms / best:.3f} of dense; kernels {res['anchor']['backends']}")
    return res


def select_part(name, q, k, lse, perm, res, best, rep, log):
    """Pass 2 + top-K figures into ``res`` (see the module docstring); returns ``res``.

    1. exactness on the GPU: select_kv (defaults) == brute-force top-K of its own float16 sums;
    2. pass-2 sweep (PASS2_CONFIGS) on ``hc`` heads, extrapolated to all heads, / best dense; each config's sums
       checked against the bf16 default's (rel. L2 <= 1e-5 for MUFU exponentials, 2e-4 with the polynomial share,
       0.3 for float8), and for float8 ``selection_quality`` against the bf16 sums (bench data, 1 head) and on the
       synthetic DiT workload (``workload_quality``); ``fp8_operands`` timed alone;
    3. top-K alone, all heads, radix vs bracket at each s (ms, / dense, bracket fallback rate, identical outputs);
    4. select_kv at each s with its defaults (the scoreboard figure), the fastest bf16 and the fastest fp8 config.
    """
    from comfyui_mc_sparse_pack.kernels.triton import topk

    H, S = q.shape[1], q.shape[2]
    G = -(-S // C)
    kq = int(0.25 * S)
    with section(res, "select exactness", log):
        sel = selection.select_kv(q[:, :2], k[:, :2], lse[:, :2], perm[:, :2], kq, group_size=C, kv_tile=KV_TILE)
        sums16 = selection.group_prob_sums(q[:, :2], k[:, :2], lse[:, :2], perm[:, :2], group_size=C).half()
        exact = bool(torch.equal(sel, ref_top_k_rows(sums16, kq, sel.shape[-1])))
        res["select_exact_vs_bruteforce_fp16_sums"] = exact
        log(f"{name} select_kv == brute-force top-K of its float16 sums: {exact}")
        fused_sel = selection.select_kv(q[:, :2], k[:, :2], lse[:, :2], perm[:, :2], kq, group_size=C, kv_tile=KV_TILE,
                                        topk_fused=True)
        # the fused top-K's radix launch on every row (8 candidate slots: each bracket overflows), and the standalone
        # bracket kernel's (the same), against the brute force on the same sums
        width = sel.shape[-1]
        plan = topk.bracket_plan(S, kq, 2, cap=16)
        rows = 2 * G
        forced = topk.FusedRows(torch.full_like(sel, -7), kq, width, plan,
                                torch.empty(rows, 16, dtype=torch.int16, device=DEVICE),
                                torch.empty(rows, dtype=torch.int8, device=DEVICE))
        sums_f = torch.full_like(sums16, float("nan"))
        selection.group_prob_sums(q[:, :2], k[:, :2], lse[:, :2], perm[:, :2], group_size=C, out=sums_f, select=forced)
        ran = forced.done
        forced.finish(sums_f)
        checks = dict(
            fused_equal=bool(torch.equal(fused_sel, sel)),
            fused_forced_fallback_exact=bool(torch.equal(forced.out, ref_top_k_rows(sums_f, kq, width))),
            fused_forced_fallback_rows=float(forced.flags.float().mean()), fused_ran=ran,
            bracket_forced_fallback_exact=bool(torch.equal(topk.top_k_rows(sums16, kq, width, method="bracket", cap=16),
                                                           ref_top_k_rows(sums16, kq, width))))
        res["select_checks"] = checks
        log(f"{name} CHECKS select_kv fused == unfused, forced fallback (fused, standalone) == brute force: {checks}")
        if not (exact and all(v for k_, v in checks.items() if k_ != "fused_forced_fallback_rows")):
            log(f"{name} CHECK FAILED")
    hc = min(H, 4)
    sub = (q[:, :hc], k[:, :hc], lse[:, :hc], perm[:, :hc])
    sums_ref = selection.group_prob_sums(*(t[:, :1] for t in sub), group_size=C, fp8=False, pair=True)
    res["pass2_sweep"], res["pass2_quality"] = {}, {}
    hist_buf = torch.empty(1, hc, G, 128, dtype=torch.int32, device=DEVICE)
    for cname, cfg in PASS2_CONFIGS.items():
        if (QUICK and cname not in QUICK_CONFIGS) or (ONLY == "gluon" and cname not in GLUON_ONLY_CONFIGS):
            continue
        try:
            kw = {k_: v_ for k_, v_ in cfg.items() if k_ != "hist"}
            if cfg.get("hist"):
                kw["hist"] = hist_buf
            fn = (lambda kw: lambda: selection.group_prob_sums(*sub, group_size=C, **kw))(kw)
            got = fn()[:, :1]
            if cfg.get("gluon") and pass2_dispatch.fallback_reason() is not None:
                raise AssertionError(f"the Gluon kernel fell back: {pass2_dispatch.fallback_reason()}")
            err = float((got - sums_ref).norm() / sums_ref.norm())
            bound = 0.3 if cfg.get("fp8") else (2e-4 if cfg.get("poly") else 1e-5)
            if not err <= bound:  # a config must compute the same sums (fp8: approximately)
                raise AssertionError(f"sums differ from the bf16 default config's by {err:.2e}")
            if cfg.get("fp8"):
                res["pass2_quality"][cname] = qual = selection_quality(sums_ref, got, S)
                log(f"{name} pass 2 {cname} vs the bf16 sums (1 head, bench data): rel L2 {err:.4f}, {qual}")
            res["pass2_sweep"][cname] = bench(fn, rep) * H / hc / best
        except Exception as err:  # out of resources for this config
            res["pass2_sweep"][cname] = f"{type(err).__name__}: {str(err)[:100]}"
        log(f"{name} pass 2 {cname}: {res['pass2_sweep'][cname]} of dense (extrapolated from {hc} heads)")
    with section(res, "fp8 operands alone", log):
        res["fp8_operands_over_dense"] = bench(lambda: selection.fp8_operands(sub[0], sub[1], sub[2], D**-0.5),
                                               rep) * H / hc / best
        log(f"{name} fp8_operands alone (smoothing + quantisation, in the fp8 figures above): "
            f"{res['fp8_operands_over_dense']:.4f} of dense")
        res["fp8_operands_tuning"] = tuned = {}
        want = selection.fp8_operands(sub[0], sub[1], sub[2], D**-0.5)
        for tname, tune in OPERAND_TUNING.items():  # beside the default, all heads as select_kv's chunks run it
            try:
                got = selection.fp8_operands(sub[0], sub[1], sub[2], D**-0.5, **tune)
                same = all(torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                                       b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
                           for a, b in zip(got, want))
                if not same and "stats_programs" not in tune:
                    raise AssertionError("differs from the default")
                tuned[tname] = round(bench(lambda tune=tune: selection.fp8_operands(
                    sub[0], sub[1], sub[2], D**-0.5, **tune), rep) * H / hc / best, 5)
            except Exception as err:  # noqa: BLE001 (a tuning that fails is reported)
                tuned[tname] = f"{type(err).__name__}: {str(err)[:100]}"
        log(f"{name} fp8_operands tunings (/ dense, 4 heads extrapolated): {tuned}")
    del sums_ref
    if not (QUICK and ONLY == "select"):  # --only select --quick: the Gluon kernel's tunings are --only gluon's job
        gluon_part(name, sub, res, best, rep, log)
    if ONLY == "gluon":  # select_kv with each pass-2 kernel at two densities, then done
        for s in (0.1, 0.25):
            kk = int(s * S)
            with section(res, f"select s={s}", log):
                for gname, gkw in (("defaults", {}), ("gluon", dict(gluon=True)), ("triton", dict(gluon=False))):
                    ms = bench(lambda gkw=gkw: selection.select_kv(q, k, lse, perm, kk, group_size=C, kv_tile=KV_TILE,
                                                                   **gkw), rep)
                    res.setdefault(f"select_{gname}", {})[str(s)] = dict(ms=ms, over_dense=ms / best)
                log(f"{name} pass 2 + top-K s={s}: " + ", ".join(
                    f"{g} {res[f'select_{g}'][str(s)]['over_dense']:.4f}" for g in ("defaults", "gluon", "triton"))
                    + f" of {res['best_dense']['name']} (pass-2 kernel forced; select_kv defaults otherwise)"
                    + ("" if pass2_dispatch.fallback_reason() is None else
                       f" (GLUON FELL BACK: {pass2_dispatch.fallback_reason()})"))
        return res
    if not QUICK:
        with section(res, "fp8 quality on the synthetic workload", log):
            res["fp8_workload_quality"] = workload_quality(S)
            log(f"{name} fp8 selection quality on the synthetic workload (kept mass / bf16 top-K's, set overlap): "
                f"{res['fp8_workload_quality']}")

    res["topk"] = {}
    with section(res, "top-K alone", log):
        sums = torch.empty(1, H, G, S, dtype=torch.float16, device=DEVICE)
        hist = torch.empty(1, H, G, 128, dtype=torch.int32, device=DEVICE)
        for h0 in range(0, H, hc):
            selection.group_prob_sums(q[:, h0:h0 + hc], k[:, h0:h0 + hc], lse[:, h0:h0 + hc], perm[:, h0:h0 + hc],
                                      group_size=C, out=sums[:, h0:h0 + hc], hist=hist[:, h0:h0 + hc], pair=True)
        for s in DENSITIES:
            kk = int(s * S)
            width = -(-kk // KV_TILE) * KV_TILE
            outs, row = {}, {}
            methods = QUICK_TOPK_METHODS if QUICK else TOPK_METHODS
            for m in methods:
                kw = dict(method="radix", hist=hist) if "hist" in m else dict(method=m)
                outs[m], fb = topk.top_k_rows(sums, kk, width, return_fallbacks=True, **kw)
                ms = bench(lambda kw=kw: topk.top_k_rows(sums, kk, width, **kw), rep)
                row[m] = dict(ms=ms, over_dense=ms / best)
                if m == "bracket":
                    row[m]["fallback_rows"] = float(fb.float().mean())
            row["identical"] = all(torch.equal(outs["radix"], o) for o in outs.values())
            res["topk"][str(s)] = row
            log(f"{name} top-K alone s={s}, all heads: " + ", ".join(
                f"{m} {row[m]['ms']:.2f} ms = {row[m]['over_dense']:.4f}" for m in methods)
                + "; fallback rows " + ", ".join(f"{m} {row[m]['fallback_rows']:.4f}" for m in methods
                                                 if "fallback_rows" in row[m]) + f"; identical {row['identical']}")
            if s != 0.25:
                continue
            for tname, tune in TOPK_TUNING.items():
                try:
                    got, fb = topk.top_k_rows(sums, kk, width, return_fallbacks=True, **tune)
                    if not torch.equal(got, outs["radix"]):
                        raise AssertionError("differs from the radix method")
                    ms = bench(lambda tune=tune: topk.top_k_rows(sums, kk, width, **tune), rep)
                    row[tname] = dict(ms=ms, over_dense=ms / best, fallback_rows=float(fb.float().mean()))
                except Exception as err:  # noqa: BLE001 (a config that does not fit is reported)
                    row[tname] = f"{type(err).__name__}: {str(err)[:100]}"
                log(f"{name} top-K alone s={s} {tname}: {row[tname]}")
        del sums, outs, hist

    with section(res, "select parts", log):
        res["select_parts"] = select_parts(name, q, k, lse, perm, best, rep, log)

    timed = {c: r for c, r in res["pass2_sweep"].items() if isinstance(r, float) and "fp8" not in c}
    pick = min(timed, key=timed.get) if timed else "pair stagger bn64 w4 st3 (bf16 default)"
    timed8 = {c: r for c, r in res["pass2_sweep"].items() if isinstance(r, float) and "fp8" in c}
    pick8 = min(timed8, key=timed8.get) if timed8 else "fp8 pair stagger bn64 w4 st3"
    if QUICK:  # the top-K's gain from the pass-2 histogram shows only in select_kv
        pick8 = "fp8 pair unstaggered + hist"
    res["pass2_config"], res["pass2_config_fp8"] = pick, pick8
    res["select_best_config"], res["select_best_fp8"] = {}, {}
    for s in DENSITIES:
        kk = int(s * S)
        with section(res, f"select s={s}", log):
            ms = bench(lambda: selection.select_kv(q, k, lse, perm, kk, group_size=C, kv_tile=KV_TILE), rep)
            res["select"][str(s)] = dict(ms=ms, over_dense=ms / best)
            ms2 = ms3 = float("nan")  # --quick: not timed (round 1b: bf16 0.716-0.752, fp8 + hist 0.628-0.701)
            if not QUICK:
                ms2 = bench(lambda: selection.select_kv(q, k, lse, perm, kk, group_size=C, kv_tile=KV_TILE,
                                                        **select_kw(PASS2_CONFIGS[pick])), rep)
                res["select_best_config"][str(s)] = dict(ms=ms2, over_dense=ms2 / best)
                ms3 = bench(lambda: selection.select_kv(q, k, lse, perm, kk, group_size=C, kv_tile=KV_TILE,
                                                        **select_kw(PASS2_CONFIGS[pick8])), rep)
                res["select_best_fp8"][str(s)] = dict(ms=ms3, over_dense=ms3 / best)
            forced = (("gluon", dict(gluon=True)), ("triton", dict(gluon=False)))[QUICK:]  # --quick: gluon = defaults
            forced += (("fused", dict(topk_fused=True)), ("unfused", dict(topk_fused=False)))
            for gname, gkw in forced:  # pass 2 kernel forced
                if s != 0.25 and gname == "triton":  # (the round's time budget: the Triton pass 2 at s = 0.25 only)
                    continue
                msg = bench(lambda gkw=gkw: selection.select_kv(q, k, lse, perm, kk, group_size=C, kv_tile=KV_TILE,
                                                                **gkw), rep)
                res.setdefault(f"select_{gname}", {})[str(s)] = dict(ms=msg, over_dense=msg / best)
            log(f"{name} pass 2 + top-K s={s}: top-K fused into pass 2 "
                f"{res['select_fused'][str(s)]['over_dense']:.4f}, separate "
                f"{res['select_unfused'][str(s)]['over_dense']:.4f} (defaults: {ms / best:.4f}) of "
                f"{res['best_dense']['name']}")
            log(f"{name} pass 2 + top-K s={s} (defaults otherwise): with the Gluon pass-2 kernel "
                f"{res.get('select_gluon', {}).get(str(s), {}).get('over_dense', float('nan')):.3f}, with the Triton "
                "pass-2 kernel "
                f"{res.get('select_triton', {}).get(str(s), {}).get('over_dense', float('nan')):.3f} of "
                f"{res['best_dense']['name']}"
                + ("" if pass2_dispatch.fallback_reason() is None else
                   f" (GLUON FELL BACK: {pass2_dispatch.fallback_reason()})"))
            others = "; ".join(f"{n} {ms / t:.3f}" for n, t in res["dense"].items())
            log(f"{name} pass 2 + top-K s={s}: defaults {ms:.2f} ms = {ms / best:.3f} of {res['best_dense']['name']} "
                f"({others}); with {pick}: {ms2:.2f} ms = {ms2 / best:.3f}; with {pick8}: {ms3:.2f} ms = "
                f"{ms3 / best:.3f}")
    res["radix_topk_failed"] = list(selection._RADIX_FAILED)  # non-empty: select_kv fell back to torch.topk
    return res


def gluon_part(name, sub, res, best, rep, log):
    """The warp-specialised Gluon pass 2 (``selection_sm90``) on ``sub`` (q, k, lse, perm of the sweep's head chunk):
    refusal, its float16 sums against the Triton pair kernel's on the same float8 operands (must agree to one fp16
    rounding), and the kernel alone per ``GLUON_TUNINGS`` (ms extrapolated to all heads / best dense) beside the
    Triton pair kernel alone (its sweep figure minus the operand pass). Results in ``res["gluon"]``."""
    from comfyui_mc_sparse_pack.kernels.triton import selection_sm90

    H = res["H"]
    hc = sub[0].shape[1]
    out = res["gluon"] = {}
    with section(res, "gluon pass 2", log):
        q8, k8, qf, lse_s, kb = selection.fp8_operands(sub[0], sub[1], sub[2], D**-0.5)
        perm = sub[3].contiguous()
        G = perm.shape[-1] // C
        want = torch.empty(1, hc, G, k8.shape[2], dtype=torch.float16, device=DEVICE)
        selection.group_prob_sums(*sub, group_size=C, fp8=True, gluon=False, out=want)
        why = pass2_dispatch.gluon_refusal(q8, k8, C, want, requested=True)
        out["refusal"] = why
        log(f"{name} Gluon pass 2 refusal: {why}")
        if why is not None:
            return
        t_op = res["fp8_operands_over_dense"]
        t_tri = res["pass2_sweep"].get("fp8 pair unstaggered")
        if isinstance(t_tri, float):
            out["triton_kernel_alone_over_dense"] = t_tri - t_op
        for tname, tune in GLUON_TUNINGS.items():
            try:
                got = torch.full_like(want, float("nan"))
                selection_sm90.group_prob_sums_fp8(q8, k8, qf, lse_s, kb, perm, got, group_size=C, **tune)
                torch.cuda.synchronize()
                bad = int((~torch.isclose(got.float(), want.float(), rtol=2**-10, atol=1e-7)).sum())
                if bad:
                    raise AssertionError(f"{bad} of {got.numel()} sums differ from the Triton kernel's by more than "
                                         f"one fp16 rounding (max abs {float((got.float() - want.float()).abs().max()):.3e})")
                ms = bench(lambda tune=tune: selection_sm90.group_prob_sums_fp8(q8, k8, qf, lse_s, kb, perm, got,
                                                                                group_size=C, **tune), rep)
                out[tname] = ms * H / hc / best
            except Exception as err:  # noqa: BLE001 (a variant that fails is reported, the others still run)
                out[tname] = f"{type(err).__name__}: {str(err)[:300]}"
            log(f"{name} Gluon pass-2 kernel alone {tname}: {out[tname]} of dense (Triton pair kernel alone "
                f"{out.get('triton_kernel_alone_over_dense')}, operand pass {t_op:.4f}; extrapolated from {hc} heads)")
        stats = [(ck.n_regs, ck.n_spills) for ck in selection_sm90.compiled_kernels()]
        out["regs_spills"] = stats
        log(f"{name} Gluon pass-2 kernels compiled (n_regs, n_spills): {stats}")


def select_parts(name, q, k, lse, perm, best, rep, log, s=0.25):
    """select_kv at its defaults, part by part, each / the best dense call, side by side in one process: the float8
    operand pass (``fp8_operands`` per head chunk as select_kv runs it), pass 2 with it (``group_prob_sums`` per
    chunk into the float16 scratch), the pass-2 kernel alone (the difference), the top-K (``top_k_rows`` per chunk at
    its default method), their sum, and the whole ``select_kv`` timed three ways: back to back (``do_bench``),
    isolated (a host sync before each call, CUDA events around it: what one anchor call sees, host launch gaps
    included) and the host's own time to issue one call (perf_counter, no sync)."""
    from comfyui_mc_sparse_pack.kernels.triton import topk

    B, H, S = q.shape[0], q.shape[1], q.shape[2]
    G = perm.shape[-1] // C
    kk = int(s * S)
    width = -(-kk // KV_TILE) * KV_TILE
    hc = selection.head_chunk(B, H, G, S)
    chunks = [(h0, min(H, h0 + hc)) for h0 in range(0, H, hc)]
    scratch = torch.empty(B, hc, G, S, dtype=torch.float16, device=DEVICE)
    out = torch.empty(B, H, G, width, dtype=torch.int32, device=DEVICE)
    fp8 = selection.fp8_default(selection._capability(q.device))

    def operands():
        for h0, h1 in chunks:
            selection.fp8_operands(q[:, h0:h1], k[:, h0:h1], lse[:, h0:h1], D**-0.5)

    def pass2():
        for h0, h1 in chunks:
            selection.group_prob_sums(q[:, h0:h1], k[:, h0:h1], lse[:, h0:h1], perm[:, h0:h1], group_size=C,
                                      out=scratch[:, : h1 - h0])

    def top_k():
        for h0, h1 in chunks:
            topk.top_k_rows(scratch[:, : h1 - h0], kk, width, out=out[:, h0:h1])

    def select(**kw):
        return selection.select_kv(q, k, lse, perm, kk, group_size=C, kv_tile=KV_TILE, **kw)

    pass2()
    r = dict(s=s, heads_per_chunk=hc, fp8=fp8)
    r["operands"] = bench(operands, rep) / best if fp8 else 0.0
    r["pass2"] = bench(pass2, rep) / best
    r["pass2_kernel"] = r["pass2"] - r["operands"]
    r["topk"] = bench(top_k, rep) / best
    r["sum_of_parts"] = r["pass2"] + r["topk"]
    r["select_back_to_back"] = bench(select, rep) / best
    r["select_fused_back_to_back"] = bench(lambda: select(topk_fused=True), rep) / best
    for tag, kw in (("", {}), ("_fused", dict(topk_fused=True))):
        iso, host = [], []
        for _ in range(1 if DEVICE == "cpu" else 15):
            if DEVICE == "cuda":
                torch.cuda.synchronize()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
            t = time.perf_counter()
            select(**kw)
            host.append((time.perf_counter() - t) * 1000)
            if DEVICE == "cuda":
                b.record()
                torch.cuda.synchronize()
                iso.append(a.elapsed_time(b))
        r[f"select{tag}_isolated"] = (sorted(iso)[len(iso) // 2] / best) if iso else None
        r[f"host{tag}_ms_per_call"] = sorted(host)[len(host) // 2]
    log(f"{name} select_kv parts at s={s} (/ dense, {hc} heads per chunk): operand pass {r['operands']:.4f} | pass-2 "
        f"kernel {r['pass2_kernel']:.4f} | top-K {r['topk']:.4f} | sum {r['sum_of_parts']:.4f} | select_kv back to "
        f"back {r['select_back_to_back']:.4f}, isolated {r['select_isolated']}, host issue {r['host_ms_per_call']:.3f} ms"
        f" | top-K fused into pass 2: back to back {r['select_fused_back_to_back']:.4f}, isolated "
        f"{r['select_fused_isolated']}, host issue {r['host_fused_ms_per_call']:.3f} ms")
    return r


def select_kw(cfg):
    """select_kv keywords of a PASS2_CONFIGS entry ("hist": the pass-2 histogram for the radix top-K)."""
    kw = {k: v for k, v in cfg.items() if k != "hist"}
    if cfg.get("hist"):
        kw["topk_hist"] = True
    return kw


def selection_quality(exact, approx, S):
    """Kept probability mass of ``approx``'s top-K / ``exact``'s top-K mass (both [.., G, Sk] sums, the mass read
    from ``exact``) and the share of ``exact``'s top-K set kept, min and mean over groups, at each density."""
    out = {}
    for s in DENSITIES:
        kk = int(s * S)
        best_idx = exact.topk(kk, -1).indices
        best = exact.gather(-1, best_idx).sum(-1)
        idx = approx.topk(kk, -1).indices
        kept = exact.gather(-1, idx).sum(-1) / best
        mark = torch.zeros_like(exact, dtype=torch.bool).scatter_(-1, best_idx, True)
        overlap = mark.gather(-1, idx).float().sum(-1) / kk
        out[str(s)] = dict(kept_min=round(float(kept.min()), 6), kept_mean=round(float(kept.mean()), 6),
                           overlap_min=round(float(overlap.min()), 4), overlap_mean=round(float(overlap.mean()), 4))
    return out


def workload_quality(S, heads=5):
    """fp8 vs bf16 pass-2 selection on the synthetic DiT workload (comfyui_mc_sparse/tools/workload.py) at the shape's
    token grid: ``heads`` heads (every head kind), step 2 of 20, the Triton grouping; ``selection_quality`` of the
    float8 sums against the bf16 kernel's fp32 sums (the exact selection up to fp32 exponentials)."""
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.tools.workload import SyntheticWorkload, WorkloadSpec

    grid = next(sh["grid"] for sh in SHAPES.values() if math.prod(sh["grid"]) == S)
    spec = WorkloadSpec(frames=grid[0], height=grid[1], width=grid[2], heads=heads, head_dim=D, seed=20261201)
    wq, wk, wv = SyntheticWorkload(spec, device=DEVICE).qkv(2, dtype=torch.bfloat16)
    _, wl = kernels.dense_attention(wq, wk, wv, return_lse=True)
    wp = grouping.pddp_groups(wq, C)
    exact = selection.group_prob_sums(wq, wk, wl, wp, group_size=C, fp8=False, pair=True)
    approx = selection.group_prob_sums(wq, wk, wl, wp, group_size=C, fp8=True)
    return selection_quality(exact, approx, S)


@contextlib.contextmanager
def section(res, what, log):
    """Run one part of the benchmark; a failure is recorded under res['errors'] and logged, the rest still runs."""
    try:
        yield
    except Exception as err:  # noqa: BLE001 (a benchmark reports every failure and goes on)
        res.setdefault("errors", {})[what] = f"{type(err).__name__}: {str(err)[:300]}"
        log(f"FAILED {what}: {res['errors'][what]}")
        traceback.print_exc()


def pddp_phases(q, **kw):
    """GPU milliseconds per phase of the Triton grouping (direction, bin, count, apply, leaf, copy), summed over the
    tree's levels, plus "total" and "per_launch" ([phase, ms] pairs, level by level): CUDA events recorded after each
    launch through ``grouping.pddp_groups``'s ``phase_hook``, with the stream held by a ~20 ms ``torch.cuda._sleep``
    first so the host queues every launch before the GPU starts (event gaps are GPU time, not host launch time; one
    warm-up call first)."""
    times, launches = {}, []

    def run():
        times.clear()
        launches.clear()
        torch.cuda.synchronize()
        torch.cuda._sleep(int(2e7))  # ~10-20 ms at H200 clocks: longer than the host needs to queue the tree
        marks = [(None, torch.cuda.Event(enable_timing=True))]
        marks[0][1].record()

        def hook(name):
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            marks.append((name, ev))

        grouping.pddp_groups(q, C, phase_hook=hook, **kw)
        torch.cuda.synchronize()
        for (_, a), (name, b) in zip(marks, marks[1:]):
            times[name] = times.get(name, 0.0) + a.elapsed_time(b)
            launches.append([name, round(a.elapsed_time(b), 4)])
        times["total"] = marks[0][1].elapsed_time(marks[-1][1])

    run()
    run()
    return dict({k: round(t, 4) for k, t in times.items()}, per_launch=launches)


def graph_ms(fn, rep_ms):
    """Median ms of ``fn`` replayed as one CUDA graph (GPU time without the host's launch overhead), or an error."""
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        return bench(g.replay, rep_ms)
    except Exception as err:  # noqa: BLE001
        return f"{type(err).__name__}: {str(err)[:200]}"


COMMIT = None  # --commit


def write_scoreboard(report, out_dir, command):
    common = dict(command=command, commit=_scoreboard.measured_commit(COMMIT), gpu=report["gpu"])
    board = {}
    shapes = report["shapes"]
    if shapes and all(len(sh.get("select", {})) == len(DENSITIES) for sh in shapes.values()):
        worst = max((r["over_dense"], n, s) for n, sh in shapes.items() for s, r in sh["select"].items())
        board["pass2_topk_over_dense_max"] = _scoreboard.entry(worst[0], "ratio", **common, note=(
            f"worst of {', '.join(shapes)} x s in {list(DENSITIES)}: {worst[1]} s={worst[2]}; select_kv defaults "
            f"(kernels/triton/selection.py: float8 QK^T {selection.fp8_default((9, 0))}, topk.top_k_rows' default "
            "method by row length); fastest bf16 pass-2 sweep config "
            + "; ".join(f"{n}: {sh.get('pass2_config')}" for n, sh in shapes.items())
            + "; worst with the fastest fp8 config: " + "; ".join(
                f"{n} {sh.get('pass2_config_fp8')} {max(r['over_dense'] for r in sh.get('select_best_fp8', {}).values()):.4f}"
                for n, sh in shapes.items() if sh.get("select_best_fp8"))
            + "; worst with the Gluon pass-2 kernel forced: " + "; ".join(
                f"{n} {max(r['over_dense'] for r in sh['select_gluon'].values()):.4f}"
                for n, sh in shapes.items() if sh.get("select_gluon"))
            + "; baseline "
            + "; ".join(f"{n}: {sh['best_dense']['name']} {sh['best_dense']['ms']:.2f} ms" for n, sh in shapes.items())))
    if shapes and all(sh["pddp"].get("triton grouping", {}).get("contract_ok") for sh in shapes.values()):
        ratios = []
        for n, sh in shapes.items():
            p = sh["pddp"]["triton grouping"]
            ratios.append((p["variance_ratio"], n))
            board[f"pddp_ms_{SCORE_SHAPE[n]}"] = _scoreboard.entry(p["ms"], "ms", **common, note=(
                "kernels/triton/grouping.py, all heads, structured synthetic queries; one CUDA graph: "
                f"{sh.get('pddp_graph_ms')} ms; phases (ms, launch gaps included) "
                f"{ {k: t for k, t in sh.get('pddp_phases_ms', {}).items() if k != 'per_launch'} }"))
        board["pddp_variance_ratio_max"] = _scoreboard.entry(max(ratios)[0], "ratio", **common, note=(
            f"mean within-group variance / torch reference's, structured synthetic queries; worst: {max(ratios)[1]}"))
    _scoreboard.update(board, out_dir / "scoreboard.json")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--shapes", default="1.3b,14b")
    ap.add_argument("--rep", type=int, default=300, help="do_bench budget per measurement, ms")
    ap.add_argument("--smoke", action="store_true", help="tiny shape on the CPU under TRITON_INTERPRET=1 (code paths)")
    ap.add_argument("--only", choices=["pddp", "select", "gluon"],
                    help="measure one part only (pddp: ~1 min on an H200; select: pass 2 + top-K, ~1.5 min; gluon: the "
                    "Gluon pass-2 kernel beside the Triton one, alone per GLUON_TUNINGS and in select_kv, ~40 s)")
    ap.add_argument("--variants", help="PDDP variants to time, comma-separated names of PDDP_VARIANTS (default: all; "
                    "'none': the default only)")
    ap.add_argument("--quick", action="store_true",
                    help="with --only select: QUICK_CONFIGS only, no workload quality (~45 s per run on an H200)")
    ap.add_argument("--commit", help="commit measured, recorded on the scoreboard (default $MC_SPARSE_COMMIT, git HEAD)")
    args = ap.parse_args()
    global DEVICE, COMMIT, ONLY, QUICK, VARIANTS
    COMMIT, ONLY, QUICK = args.commit, args.only, args.quick
    if args.variants is not None:
        VARIANTS = set() if args.variants == "none" else set(args.variants.split(","))
        unknown = VARIANTS - set(PDDP_VARIANTS)
        if unknown:
            sys.exit(f"unknown --variants {sorted(unknown)}; known: {list(PDDP_VARIANTS)}")
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("--smoke needs TRITON_INTERPRET=1 in the environment")
        DEVICE, args.shapes = "cpu", "smoke"
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from _triton_interp import patch_interpreter  # two Triton 3.6 interpreter fixes (tests/_triton_interp.py)

        patch_interpreter()
    elif not torch.cuda.is_available():
        sys.exit("bench_anchor.py needs a CUDA GPU")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = dict(gpu=torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (smoke)", torch=torch.__version__, triton=triton.__version__,
                  python=platform.python_version(), argv=sys.argv, commit=_scoreboard.measured_commit(COMMIT),
                  backends=registry.report(), shapes={})
    t0 = time.time()

    def log(msg):
        print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)

    for name in args.shapes.split(","):
        report["shapes"][name] = run_shape(name, SHAPES[name]["H"], SHAPES[name]["grid"], args.rep, log, args.only)
        (out_dir / "bench_anchor.json").write_text(json.dumps(report, indent=1))
        torch.cuda.empty_cache()
    if not args.smoke:
        write_scoreboard(report, out_dir, "python tests/bench_anchor.py --out $OUT"
                         + (f" --only {args.only}" if args.only else "") + (" --quick" if args.quick else ""))
    log("summary: " + json.dumps({n: dict(pass2_topk=[round(r["over_dense"], 3) for r in sh.get("select", {}).values()],
                                          pass2_topk_gluon=[round(r["over_dense"], 3)
                                                            for r in sh.get("select_gluon", {}).values()],
                                          gluon_alone={t: (round(v, 4) if isinstance(v, float) else v)
                                                       for t, v in sh.get("gluon", {}).items() if t != "regs_spills"},
                                          pddp=sh["pddp"].get("triton grouping"),
                                          anchor_over_dense=sh.get("anchor", {}).get("over_dense"),
                                          errors=sh.get("errors", {}))
                                  for n, sh in report["shapes"].items()}))


if __name__ == "__main__":
    main()
