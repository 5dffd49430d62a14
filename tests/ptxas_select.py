"""Offline compile of pass 2 (kernels/triton/selection.py) for sm_90 with ``ptxas -v`` and a SASS census (no GPU
needed; not collected by pytest): registers, spills, shared memory, and per kernel the count of MUFU.EX2, HGMMA /
QGMMA (bf16 / fp8 wgmma), FFMA and warp-specialisation markers (setmaxnreg) in the SASS, so a variant that does
not compile, spills, or loses its wgmma / software pipeline shows up before the GPU run.

Usage: python tests/ptxas_select.py [--gluon [--quick]] [--only SUBSTRING] (``--only``: the pair-kernel variants
whose name contains it, no operand pass). Exit status 1 when a listed variant spills or does not fit.
``--gluon``: the warp-specialised Gluon kernel (``kernels/triton/selection_sm90.py``) alone, its variants (``GLUON_VARIANTS``;
``--quick``: the default only).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

_spec = importlib.util.spec_from_file_location("_ptxas_report", Path(__file__).resolve().parent / "ptxas_report.py")
pr = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pr)  # pops TRITON_INTERPRET and loads the pack
import torch  # noqa: E402
import triton  # noqa: E402

selection = importlib.import_module("comfyui_mc_sparse_pack.kernels.triton.selection")
topk = importlib.import_module("comfyui_mc_sparse_pack.kernels.triton.topk")

VARIANTS = {  # name: pair-kernel constexprs (BLOCK_N 64, 4 warps, 3 stages unless given)
    "bf16 stagger (default)": dict(FP8=False, POLY=0),
    "bf16 stagger poly 1/4": dict(FP8=False, POLY=1),
    "bf16 stagger poly 1/2": dict(FP8=False, POLY=2),
    "fp8 stagger": dict(FP8=True, POLY=0),
    "fp8 stagger poly 1/4": dict(FP8=True, POLY=1),
    "fp8 stagger poly 1/2": dict(FP8=True, POLY=2),
    "fp8 stagger st2": dict(FP8=True, POLY=0, num_stages=2),
    "fp8 stagger st4": dict(FP8=True, POLY=0, num_stages=4),
    "fp8 stagger bn128 w8": dict(FP8=True, POLY=0, BLOCK_N=128, num_warps=8),
    "fp8 stagger poly 1/4 bn128 w8": dict(FP8=True, POLY=1, BLOCK_N=128, num_warps=8),
    "bf16 stagger + hist": dict(FP8=False, POLY=0, WITH_HIST=True),
    "fp8 stagger + hist": dict(FP8=True, POLY=0, WITH_HIST=True),
    "fp8 stagger poly 1/4 + hist": dict(FP8=True, POLY=1, WITH_HIST=True),
    "fp8 unstaggered (default)": dict(FP8=True, POLY=0, STAGGER=False, KB_POW2=True),
    "fp8 unstaggered + fused top-K": dict(FP8=True, POLY=0, STAGGER=False, KB_POW2=True, TOPK=True, maxnreg=168),
    "fp8 one group + fused top-K": dict(FP8=True, POLY=0, STAGGER=False, KB_POW2=True, TOPK=True, ONE_GROUP=True),
    "fp8 one group": dict(FP8=True, POLY=0, STAGGER=False, KB_POW2=True, ONE_GROUP=True),
    "fp8 one group + fused top-K (128 regs)": dict(FP8=True, POLY=0, STAGGER=False, KB_POW2=True, TOPK=True,
                                                   ONE_GROUP=True, maxnreg=128),
    # session 7: the top-K's threshold among its candidates by counting (topk.FusedRows.cand_count)
    "fp8 one group + fused top-K count (128 regs)": dict(FP8=True, POLY=0, STAGGER=False, KB_POW2=True, TOPK=True,
                                                         ONE_GROUP=True, maxnreg=128, T_CC=True),
    # session 8: two bits per counting pass (FusedRows.cand_count = 2)
    "fp8 one group + fused top-K count2 (128 regs)": dict(FP8=True, POLY=0, STAGGER=False, KB_POW2=True, TOPK=True,
                                                          ONE_GROUP=True, maxnreg=128, T_CC=2),
}


def sass_census(ck):
    """Counts of a few SASS opcodes in the compiled cubin (cuobjdump -sass of the bundled tools)."""
    from triton.backends.nvidia.compiler import get_ptxas

    tool = Path(get_ptxas(90).path).with_name("cuobjdump")
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"mc_sparse_sel_{os.getpid()}.cubin"
    tmp.write_bytes(ck.asm["cubin"])
    sass = subprocess.run([str(tool), "-sass", str(tmp)], capture_output=True, text=True).stdout
    tmp.unlink()
    ops = ("MUFU.EX2", "HGMMA", "QGMMA", "FFMA", "FADD", "SETMAXNREG", "LDGSTS", "UTMALDG", "BAR.SYNC", "WARPGROUP")
    return {op: len(re.findall(r"\b" + re.escape(op), sass)) for op in ops}


def compile_variant(name, cfg, S=75600, H=40, D=128, C=128, arch=90):
    B = 1
    fp8 = cfg.get("FP8", False)
    dt = torch.float8_e4m3fn if fp8 else torch.bfloat16
    if fp8:
        q = torch.empty(B, H, S, D, dtype=dt, device="meta")
        k = torch.empty(B, H, S, D, dtype=dt, device="meta")
    else:
        q, k = pr.model_views(B, H, S, D)[:2]
    G = -(-S // C)
    lse = torch.empty(B, H, S, dtype=torch.float32, device="meta")
    perm = torch.empty(B, H, G * C, dtype=torch.int32, device="meta")
    sums = torch.empty(B, 5, G, S, dtype=torch.float16, device="meta")
    qf = torch.empty(B * H, dtype=torch.float32, device="meta")
    kb = torch.empty(B, H, S, dtype=torch.float32, device="meta")
    hist = torch.empty(B, 5, G, 128, dtype=torch.int32, device="meta")
    args = [q, k, lse, perm, sums, qf, kb, hist, 0.1275, H, S, S, G * C, C, G, *q.stride(), *k.stride(), *lse.stride(),
            *sums.stride()]
    warps = cfg.get("num_warps", 4)
    select = None
    if cfg.get("TOPK"):  # the fused top-K epilogue (topk.FusedRows) at s = 0.25
        kk = S // 4
        width = -(-kk // 128) * 128
        plan = topk.bracket_plan(S, kk, 2)
        select = topk.FusedRows(torch.empty(B, 5, G, width, dtype=torch.int32, device="meta"), kk, width, plan,
                                torch.empty(B * 5 * G, plan[4], dtype=torch.int16, device="meta"),
                                torch.empty(B * 5 * G, dtype=torch.int8, device="meta"),
                                rows_per_thread=cfg.get("T_RPT", 1), cand_count=cfg.get("T_CC", False))
    sel_args, sel_meta = selection._fused_topk_args(select, sums, warps, lse)
    args += list(sel_args)
    meta = dict(HEAD_DIM=D, BLOCK_M=128, BLOCK_N=cfg.get("BLOCK_N", 64), EXP_MODE=0, STAGGER=cfg.get("STAGGER", True),
                FP8=fp8, POLY=cfg.get("POLY", 0), P3_G0=cfg.get("P3_G0", 0), P3_G1=cfg.get("P3_G1", 0), KEY_BITS=16,
                WITH_HIST=cfg.get("WITH_HIST", False), num_warps=warps, num_stages=cfg.get("num_stages", 3), **sel_meta,
                KB_POW2=cfg.get("KB_POW2", False), ONE_GROUP=cfg.get("ONE_GROUP", False),
                **({"maxnreg": cfg["maxnreg"]} if "maxnreg" in cfg else {}))
    ck = pr.compile_offline(selection._group_prob_sums_pair, args, meta, arch)
    regs, st, ld = pr.ptxas_usage(ck, arch)
    if os.environ.get("PTXAS_SELECT_DUMP"):  # PTX and SASS of each variant into that folder
        dump = Path(os.environ["PTXAS_SELECT_DUMP"])
        dump.mkdir(parents=True, exist_ok=True)
        stem = re.sub(r"[^A-Za-z0-9]+", "_", name)
        (dump / f"{stem}.ptx").write_text(ck.asm["ptx"])
    waits = sorted(set(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ck.asm["ptx"])))
    return dict(variant=name, wgmma_waits=waits, regs=regs, spill_st=st, spill_ld=ld, smem=ck.metadata.shared,
                fits=ck.metadata.shared <= pr.SMEM_LIMIT[arch], sass=sass_census(ck))


def compile_operand_pass(S=75600, H=40, D=128, arch=90):
    """The float8 operand pass's three kernels (column statistics, per-head reduction, quantisation) at the
    Wan2.1-14B 720p q / k views, with the launch parameters ``fp8_operands`` uses."""
    q, k = pr.model_views(1, H, S, D)[:2]
    n, per = selection._stat_splits(H, S)
    part = torch.empty(H, 2 * n, 3, D, dtype=torch.float32, device="meta")
    m = torch.empty(H, D, dtype=torch.float32, device="meta")
    sc = torch.empty(H, dtype=torch.float32, device="meta")
    q8 = torch.empty(1, H, S, D, dtype=torch.float8_e4m3fn, device="meta")
    lse = torch.empty(1, H, S, dtype=torch.float32, device="meta")
    kernels = {
        "_fp8_partial_stats": (selection._fp8_partial_stats, [q, k, part, H, S, S, per, per, n, n, *q.stride(),
                                                               *k.stride()],
                               dict(HEAD_DIM=D, BLOCK_S=selection._STATS_BLOCK_S, num_warps=4)),
        "_fp8_stats_final": (selection._fp8_stats_final, [part, m, m, sc, sc, sc, S, S, n, n, 0.18],
                             dict(HEAD_DIM=D, NP=triton.next_power_of_2(n), TWO=True, UNIT=True, num_warps=4)),
        "_fp8_quantize": (selection._fp8_quantize, [q, k, q8, q8, m, m, sc, sc, lse, lse, lse, H, S, S, 1182,
                                                     *q.stride(), *k.stride(), *lse.stride(), -0.09, 0.13, sc],
                          dict(HEAD_DIM=D, BLOCK_S=selection._QUANT_BLOCK_S, KB_POW2=True, num_warps=4)),
        "_fp8_quantize unit check": (selection._fp8_quantize, [q, k, q8, q8, m, m, sc, sc, lse, lse, lse, H, S, S,
                                                                1182, *q.stride(), *k.stride(), *lse.stride(), -0.09,
                                                                0.13, sc],
                                     dict(HEAD_DIM=D, BLOCK_S=selection._QUANT_BLOCK_S, KB_POW2=True, UNIT_CHECK=True,
                                          num_warps=4, maxnreg=selection._QUANT_MAXNREG)),
    }
    out = []
    for name, (fn, args, meta) in kernels.items():
        ck = pr.compile_offline(fn, args, meta, arch)
        regs, st, ld = pr.ptxas_usage(ck, arch)
        out.append(dict(variant=name, regs=regs, spill_st=st, spill_ld=ld, smem=ck.metadata.shared))
    return out


def compile_gluon(D=128, S=75600, H=5, C=128, arch=90, **tuning):
    """The warp-specialised Gluon pass 2 (``selection_sm90``) at one head chunk of Wan2.1-14B 720p: ptxas registers /
    spills, shared memory, the SASS census (QGMMA, MUFU.EX2, UTMALDG, SETMAXNREG) and the local-memory instructions
    inside the consumers' MMA loop (``ptxas_gluon.hot_loop_spills``)."""
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    import ptxas_gluon

    g = importlib.import_module("comfyui_mc_sparse_pack.kernels.triton.selection_sm90")
    B = 1
    G = -(-S // C)
    q8 = torch.empty(B, H, S, D, dtype=torch.float8_e4m3fn, device="meta")
    k8 = torch.empty(B, H, S, D, dtype=torch.float8_e4m3fn, device="meta")
    lse = torch.empty(B, H, S, dtype=torch.float32, device="meta")
    kb = torch.empty(B, H, S, dtype=torch.float32, device="meta")
    qf = torch.empty(B * H, dtype=torch.float32, device="meta")
    perm = torch.empty(B, H, G * C, dtype=torch.int32, device="meta")
    sums = torch.empty(B, H, G, S, dtype=torch.float16, device="meta")
    desc = TensorDescriptor.from_tensor(k8.view(B * H * S, D), [g.BLOCK_N, D], g.k_layout(D))
    _, args, meta = g.launch_args(q8, k8, qf, lse, kb, perm, sums, group_size=C, k_desc=desc, **tuning)
    ck = pr.compile_offline(g._pass2_fwd_sm90, args, meta, arch, source=GluonASTSource)
    regs, st, ld = pr.ptxas_usage(ck, arch)
    hot, _ = ptxas_gluon.hot_loop_spills(ck.asm["cubin"])
    setmax = sorted(set(re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ck.asm["ptx"])))
    return dict(variant=f"gluon ws D{D} {tuning or 'default'}", regs=regs, spill_st=st, spill_ld=ld,
                smem=ck.metadata.shared, fits=ck.metadata.shared <= pr.SMEM_LIMIT[arch], consumer_hot_spills=hot,
                setmaxnreg=setmax, sass=sass_census(ck))


GLUON_VARIANTS = ({}, dict(poly=5, kb_poly=False), dict(kb_poly=2, poly=0), dict(D=64), dict(kb_poly=True, poly=0), dict(unroll=4, poly=0), dict(poly=1), dict(unroll=4, poly=1),
                  dict(unroll=4, poly=2), dict(unroll=4, poly=3), dict(num_stages=4, poly=0), dict(groups=3, poly=0),
                  dict(groups=3, kb_poly=True, poly=0), dict(kb_poly=2, thread_arrive=True, poly=0),
                  dict(groups=3, kb_poly=2, thread_arrive=True, poly=0), dict(poly=8, kb_poly=2), dict(poly=9, kb_poly=2),
                  dict(poly=10, kb_poly=2), dict(groups=3, poly=10, kb_poly=2), dict(poly=11, kb_poly=2),
                  dict(poly=12, kb_poly=2), dict(poly=10, kb_poly=2, pingpong=True),
                  dict(kb_poly=2, pingpong=True, thread_arrive=True, poly=0), dict(poly=10, kb_poly=2, ksplit=4),
                  dict(poly=20, kb_poly=2), dict(poly=22, kb_poly=2, pingpong=True))


def main():
    bad = 0
    if "--gluon" in sys.argv:  # the Gluon kernel only
        for tune in GLUON_VARIANTS[:1] if "--quick" in sys.argv else GLUON_VARIANTS:
            r = compile_gluon(**tune)
            bad += r["spill_st"] > 0 or r["consumer_hot_spills"] > 0 or not r["fits"]
            print(r, flush=True)
        sys.exit(1 if bad else 0)
    only = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else None
    for r in [] if only else compile_operand_pass():
        bad += r["spill_st"] > 0
        print(r, flush=True)
    for name, cfg in VARIANTS.items():
        if only and only not in name:
            continue
        try:
            r = compile_variant(name, cfg)
            bad += r["spill_st"] > 0 or not r["fits"]
        except Exception as err:  # noqa: BLE001 (report every variant)
            r = dict(variant=name, error=f"{type(err).__name__}: {str(err)[:300]}")
            bad += 1
        print(r, flush=True)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
