"""select_kv (pass 2 + top-K) / flash-attn-4 dense by the timing method of record, both shapes, one process (issue 15).

Not collected by pytest. For each shape (Wan2.1-1.3B 480p: S = 32760, H = 12; Wan2.1-14B 720p: S = 75600, H = 40; D = C
= 128, bf16; the inputs of tests/bench_anchor.py: structured queries, random keys, PDDP groups):

1. CHECKS on the GPU before any timing (lines with "CHECKS"; "CHECK FAILED" when one fails), on 2 heads at s = 0.25:
   first the CuTeDSL pass 2 (kernels/cutedsl/pass2_sm90.py; ``cute_checks``: its sums vs the Triton kernel's, every
   entry written, select_kv(cute=True, topk_fused=False) == the brute-force top-K of its sums by both separate top-K
   thresholds; where the module has its fused top-K and it is on (``MC_SPARSE_PASS2_CUTE_TOPK=1``: off by default
   since session 10; ``fused`` True, else the refusal reason): the kernel called
   with ``select`` writes the same sums and the brute-force top-K of them (selection poisoned first), and
   select_kv(cute=True) returns it; a failure skips its rows (a failing fused top-K alone: switched off for the run,
   MC_SPARSE_PASS2_CUTE_TOPK=0) and, where it is the default, turns it off for the run: the defaults row then measures
   the Triton pass 2, reported); then select_kv at its defaults == the brute-force top-K (kernels/reference/topk.py)
   of its own float16 sums; at 1.3B also the Triton fused top-K with every row forced to the radix fallback (16
   candidate slots) == the brute force.
2. RACE 2 (``--race2-first``: at 1.3B right after its checks; else per shape after both shapes' race 1, the scoreboard
   figures first; at 14B only with 20 s of ``--budget`` left): the parts on all heads at s = 0.25 in the same rounds
   as dense: the float8 operand pass, select_kv at its defaults (the whole beside its parts), the one-group Triton
   pass-2 kernel alone and with its fused top-K epilogue (``RACE2_TOPK``; on precomputed operands; sums checked
   against select_kv's, the fused selection against the brute force of its sums); the separate top-K alone on those
   sums (``SEPARATE_TOPK``: counting one / two bits per pass); the CuTeDSL pass 2 alone (+ ``--cute-variants``,
   p2cute's launch variants), + the separate top-K (counting one / two bits), + its fused top-K, select_kv with the
   ``RACE1_ROWS`` (``race2_cute``, each checked first); then the host time of one select_kv call enqueued behind busy
   GPU work (defaults, cute).
3. RACE 1 per shape (tests/_timing.race: sustained back-to-back samples led in by untimed calls, shuffled order,
   median; TEAM.md items 7 and 11): flash-attn-4 dense with LSE, select_kv defaults and ``RACE1_ROWS`` ("cute": the
   CuTeDSL pass 2 with its fused top-K where the module has one, else + the separate top-K counting one bit per pass;
   "bracket": the separate top-K before session 13 (``PARTS_GLOBALS``, checked first, ``fold_checks``); a row
   named "fused" (with a "fused" entry in CUTE_CONFIGS, ``CUTE_GLOBALS`` and ``ROW_ENV``: none since round s12r3):
   the CuTeDSL kernel's fused top-K, timed where it ran and passed its checks; "triton" beside a CuTeDSL default (not with ``--no-triton-row``);
   ``--p2ws-gluon-row``: the Gluon pass 2 where its child check passed), each at s = 0.1 / 0.15 / 0.25 / 0.5: ratios
   / dense from the same rounds -> ``pass2_topk_over_dense_max`` (the defaults; both shapes). Each race also prints
   ``from_idle``: each row's lead-in calls (the first of each sample, on a GPU just left by another row) / dense's.
   Their kernels compile first in child processes (``CHILD_ROWS``), waited for before the first timing.
   ``--old-method``: after each shape's race 1, dense + defaults again without lead-in (``MC_SPARSE_RACE_LEAD_IN=0``, 3
   rounds, "RACE 1 OLD METHOD"): the sessions 5-8 figure beside the new one (round s9r1).
   RACE 2b, last (a faulting kernel ends the process): issue 15's pass-2 kernel variants of tests/bench_pass2_exp.py
   (``--p2ws-variants``; each checked against that bench's reference kernel as there) with dense in their own race.
   Removed after measurement: rows "hist", "count2" (round s8r1), "s63" (the top-K bracket's pre-session-8 sample
   plan, round s8final: the defaults better or equal at every point), "s10" (select_kv of session 10, round s12r1:
   0.5430-0.5566 against the defaults' 0.4872-0.5074 at 1.3B).

Writes OUT/bench_select_race.json after each step and OUT/scoreboard.json (the key above, with command and commit).
Usage (checkout root, H200): python tests/bench_select_race.py --out OUT [--shapes 1.3b,14b] [--commit HASH]
[--p2ws-variants "default,kb pow2"] [--budget 100]; ``--budget`` (s since start) drops race 2's remaining items once
passed. Expected: ~15 s start-up, ~35 s at 1.3B, ~25 s at 14B, race 2 ~20 s (compiles dominate).
``--smoke`` (TRITON_INTERPRET=1, CPU): every code path once on a tiny shape, single calls instead of races.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "comfyui_mc_sparse"))
sys.path.insert(0, str(ROOT / "tests"))
import _scoreboard  # noqa: E402
import _standalone  # noqa: E402

_standalone.load_pack()
from comfyui_mc_sparse_pack import kernels  # noqa: E402
from comfyui_mc_sparse_pack.kernels import registry  # noqa: E402
from comfyui_mc_sparse_pack.kernels.reference.topk import top_k_rows as ref_top_k_rows  # noqa: E402
from comfyui_mc_sparse_pack.kernels.triton import grouping, pass2_dispatch, selection, topk  # noqa: E402

SHAPES = {"1.3b": dict(H=12, grid=(21, 30, 52)), "14b": dict(H=40, grid=(21, 45, 80)), "smoke": dict(H=2, grid=(2, 4, 33))}
SCORE_NAME = {"1.3b": "wan13b_480p", "14b": "wan14b_720p"}
DENSITIES = (0.1, 0.15, 0.25, 0.5)
C = D = KV_TILE = 128
SMOKE = False
ROUNDS = 3  # tests/_timing.race rounds of races 1 and 2 (--rounds)


def race(fns, rounds=3, target_ms=20.0, from_idle=None):
    """tests/_timing.race (the method of record; ``from_idle`` filled with its lead-in calls' median ms); under --smoke
    one call each, timed on the host (``from_idle``: the same figures)."""
    if not SMOKE:
        from _timing import race as _race

        return _race(fns, rounds, target_ms, from_idle=from_idle)
    out = {}
    for k, fn in fns.items():
        t = time.perf_counter()
        fn()
        out[k] = (time.perf_counter() - t) * 1000
    if from_idle is not None:
        from_idle.update(out)
    return out


def idle_ratios(idle):
    """{name: lead-in ms / dense's lead-in ms} of ``race``'s ``from_idle`` (empty without lead-in)."""
    return {n: t / idle["dense"] for n, t in idle.items() if n != "dense"} if "dense" in idle else {}


def dense_fn(q, k, v):
    names = {b.name for b in registry.backends() if not b.unavailable_reason}
    name = "flash_attn4" if "flash_attn4" in names else ("cuda_sdpa" if "cuda_sdpa" in names else "torch")
    return name, (lambda: kernels.dense_attention(q, k, v, return_lse=True, backend=name))


def checks(q, k, lse, perm, S, log, full=True, name="smoke"):
    """GPU correctness of the select paths (docstring, item 1) on 2 heads at s = 0.25; returns the dict. ``full``: also
    the fused top-K with every row forced to the radix fallback (16 candidate slots); else (14B) the defaults and two
    groups per program only (the code is shared, its shape-specific compiles are the race's)."""
    kq = int(0.25 * S)
    sub = (q[:, :2], k[:, :2], lse[:, :2], perm[:, :2])
    G = perm.shape[-1] // C
    width = -(-kq // KV_TILE) * KV_TILE
    configs = {}
    for config in CUTE_CONFIGS:  # first: a failure turns a CuTeDSL default off before the defaults' check
        if not CUTE_CHILD_OK.get((name, config), SMOKE):  # (a hang or a failure in the child: never run here)
            configs[config] = dict(ok=False, skipped="its child check did not pass (select_child_*.log)")
            log(f"CHECKS {config}: skipped (its child check did not pass)  CHECK FAILED ({config})")
            continue
        with cute_globals(config):
            configs[config] = cute_checks(sub, kq, width, log, config)
    cute = configs["cute"]
    if pass2_dispatch.cute_mode() and not cute["ok"]:
        pass2_dispatch.CUTE_DEFAULT = False
        log("CUTE DEFAULT OFF for this run: its check failed; the defaults row measures the Triton pass 2")
    sel = selection.select_kv(*sub, kq, group_size=C, kv_tile=KV_TILE)
    sums16 = torch.empty(1, 2, G, k.shape[2], dtype=torch.float16, device=q.device)  # (the scratch's dtype)
    selection.group_prob_sums(*sub, group_size=C, out=sums16)
    want = ref_top_k_rows(sums16, kq, width)
    r = dict(default_exact=bool(torch.equal(sel, want)))
    if full:
        plan = topk.bracket_plan(S, kq, 2, cap=16)
        forced = topk.FusedRows(torch.full_like(sel, -7), kq, width, plan,
                                torch.empty(2 * G, 16, dtype=torch.int16, device=q.device),
                                torch.empty(2 * G, dtype=torch.int8, device=q.device))
        sums_f = torch.full_like(sums16, float("nan"))
        selection.group_prob_sums(*sub, group_size=C, out=sums_f, select=forced, cute=False)  # (the Triton kernel)
        r["fused_ran"] = forced.done
        forced.finish(sums_f)
        r["fused_forced_fallback_exact"] = bool(torch.equal(forced.out, ref_top_k_rows(sums_f, kq, width)))
        r["fused_forced_fallback_rows"] = float(forced.flags.float().mean())
    ok = (all(v for n, v in r.items() if n != "fused_forced_fallback_rows")
          and r.get("fused_forced_fallback_rows", 1.0) == 1.0)
    log(f"CHECKS {r}" + ("" if ok else "  CHECK FAILED"))
    r["same_result_rows"] = fold_checks(q, k, lse, sub, kq, sel, log)
    r["ok"] = ok
    r["cute"] = cute
    r["cute_configs"] = configs
    r["cute_default"] = pass2_dispatch.cute_mode()
    return r


def fold_checks(q, k, lse, sub, kq, sel, log):
    """First the default's unit_qf check on the GPU (``_unit_signs_checks``, line "CHECKS unit signs"; a failure turns
    selection._UNIT_SIGNS off for the run: the defaults row then measures unit_qf_factors' launch, reported), then the
    checks of ``SAME_RESULT_ROWS`` and ``OWN_SUMS_ROWS`` (each row's failure drops it from RACE1_ROWS: not timed):
    select_kv under the row's globals on ``sub`` == the defaults' selection ``sel`` (same-result rows) or == the
    brute-force top-K of the float16 sums group_prob_sums writes under them (own-sums rows). Returns {row: its
    checks}."""
    try:
        u = _unit_signs_checks(q, k, lse)
        u["ok"] = u["signs_equal"] and u["operands_equal"]
    except Exception as err:  # noqa: BLE001
        u = dict(ok=False, error=f"{type(err).__name__}: {str(err)[:300]}")
    log(f"CHECKS unit signs {u}" + ("" if u["ok"] else "  CHECK FAILED (unit signs: _UNIT_SIGNS OFF for this run)"))
    if not u["ok"]:
        selection._UNIT_SIGNS = False
    out = {"unit signs": u}
    for row in SAME_RESULT_ROWS + OWN_SUMS_ROWS:
        if row in RACE1_ROWS:
            out[row] = _row_checks(row, q, k, lse, sub, kq, sel, log)
    return out


def _row_checks(row, q, k, lse, sub, kq, sel, log):
    """``fold_checks`` for one row (dropped from RACE1_ROWS when a check fails); returns its checks."""
    r = {}
    try:
        with cute_globals(row):
            got = selection.select_kv(*sub, kq, group_size=C, kv_tile=KV_TILE)
            if row in OWN_SUMS_ROWS:
                sums = torch.empty(*sub[3].shape[:2], sub[3].shape[-1] // C, sub[1].shape[2], dtype=torch.float16,
                                   device=got.device)
                selection.group_prob_sums(*sub, group_size=C, out=sums)
                sel = ref_top_k_rows(sums, kq, got.shape[-1])
            r["select_equal"] = bool(torch.equal(got, sel))
        r["ok"] = r["select_equal"]
    except Exception as err:  # noqa: BLE001
        r.update(ok=False, error=f"{type(err).__name__}: {str(err)[:300]}")
    if not r["ok"]:
        RACE1_ROWS.pop(row, None)
    log(f"CHECKS {row} {r}" + ("" if r["ok"] else f"  CHECK FAILED ({row}: row not timed)"))
    return r


def _unit_signs_checks(q, k, lse):
    """fp8_operands(unit_signs=True) on all heads, three times: its factors == unit_qf_factors of its operands and its
    other outputs == fp8_operands' without it (bit for bit); the count of heads in the fast form."""
    r = dict(signs_equal=True, operands_equal=True)
    for _ in range(3):
        ops = selection.fp8_operands(q, k, lse, D**-0.5, kb_pow2=True, unit_qf=True, unit_signs=True)
        plain = selection.fp8_operands(q, k, lse, D**-0.5, kb_pow2=True, unit_qf=True)
        want = selection.unit_qf_factors(*plain[2:5])
        r["signs_equal"] = r["signs_equal"] and bool(torch.equal(ops[5], want))
        r["operands_equal"] = r["operands_equal"] and all(
            bool(torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                             b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b))
            for a, b in zip(ops[:5], plain))
    r["fast_heads"] = int((want == 1).sum())
    return r


def cute_why(q8, k8, out):
    """Why the CuTeDSL pass 2 (kernels/cutedsl/pass2_sm90.py) cannot run here (None: it can)."""
    return pass2_dispatch.cute_refusal(q8, k8, C, out, requested=True)


def fused_why(q8, k8, out, sel, kq):
    """True where the CuTeDSL kernel runs its fused top-K on this call, else the reason it does not."""
    why = pass2_dispatch.cute_select_refusal(q8, k8, C, out, sel, kq, requested=True)
    return True if why is None else why


def cute_checks(sub, kq, width, log, config="cute"):
    """The CuTeDSL pass 2 on the 2 heads of ``checks``: its float16 sums (NaN-poisoned output, every entry written)
    against the Triton kernel's (cute=False; relative L2 per row <= 1e-3: the same float8 operands, fp32 sums in
    another order, two float16 roundings), select_kv(cute=True) == the brute-force top-K of its own sums (the separate top-K,
    by histograms and by counting), and no fallback remembered. ``ok`` False: its race rows are not timed (and under
    ``CUTE_DEFAULT`` the bench turns it off before race 1: the Triton default is what gets timed)."""
    q, k, lse, perm = sub
    r = {}
    try:
        unit = pass2_dispatch.cute_unit_qf()  # select_kv's operands and kernel form (qf = 1: pass2_sm90.UNIT_QF)
        ops = selection.fp8_operands(q, k, lse, D**-0.5, kb_pow2=True, unit_qf=unit)
        q8, k8, qf, lse_s, kb2 = ops
        sums16 = torch.empty(*perm.shape[:2], perm.shape[-1] // C, k.shape[2], dtype=torch.float16, device=q.device)
        if unit:  # the Triton kernel on the same operands
            launch_pair(ops, perm, sums16, one_group=True)
        else:
            selection.group_prob_sums(q, k, lse, perm, group_size=C, out=sums16, cute=False)
        got = torch.full_like(sums16, float("nan"))
        why = cute_why(q8, k8, got)
        if why is not None:
            r.update(ok=False, skipped=why)
            log(f"CHECKS cute: skipped ({why})")
            return r
        t = time.time()
        pass2_dispatch._cute_module().group_prob_sums_fp8(q8, k8, qf, lse_s, kb2, perm, got, group_size=C,
                                                           **({"unit_qf": True} if unit else {}))
        r["unit_qf"] = unit
        if not SMOKE:
            torch.cuda.synchronize()
        r["first_call_s"] = round(time.time() - t, 2)
        r["all_written"] = not bool(got.isnan().any())
        rel = ((got.double() - sums16.double()).norm(dim=-1) / sums16.double().norm(dim=-1).clamp_min(1e-30)).max()
        r["sums_rel_l2_max"] = float(rel)
        r["sums_close"] = bool(rel <= 1e-3)
        want = ref_top_k_rows(got, kq, width)
        sep = dict(group_size=C, kv_tile=KV_TILE, cute=True, topk_fused=False)
        sel_h = selection.select_kv(q, k, lse, perm, kq, topk_count=False, **sep)
        sel_c = selection.select_kv(q, k, lse, perm, kq, topk_count=True, **sep)
        sel_c2 = selection.select_kv(q, k, lse, perm, kq, topk_count=2, **sep)
        r["select_exact"] = bool(torch.equal(sel_h, want))
        r["select_count_exact"] = bool(torch.equal(sel_c, want))
        r["select_count2_exact"] = bool(torch.equal(sel_c2, want))
        r["fused"] = fused_why(q8, k8, got, sel_c, kq)
        names = ["all_written", "sums_close", "select_exact", "select_count_exact", "select_count2_exact"]
        if r["fused"] is True:  # the kernel's fused top-K: its selection == the brute force of the sums it wrote
            fsums = torch.full_like(sums16, float("nan"))
            fsel = torch.full_like(sel_c, -7)
            pass2_dispatch._cute_module().group_prob_sums_fp8(q8, k8, qf, lse_s, kb2, perm, fsums, group_size=C,
                                                               select=(fsel, kq), **({"unit_qf": True} if unit else {}))
            r["fused_all_written"] = not bool(fsums.isnan().any())
            r["fused_sums_equal"] = bool(torch.equal(fsums, got))
            r["fused_select_exact"] = bool(torch.equal(fsel, ref_top_k_rows(fsums, kq, width)))
            sel_f = selection.select_kv(q, k, lse, perm, kq, group_size=C, kv_tile=KV_TILE, cute=True, topk_fused=True)
            r["fused_select_kv_exact"] = bool(torch.equal(sel_f, fsel))
            r["fused_no_fallback"] = pass2_dispatch.cute_topk_fallback_reason() is None
            names += ["fused_all_written", "fused_select_exact", "fused_select_kv_exact", "fused_no_fallback"]
        # the default route (select_kv(cute=True) at its defaults): the fused top-K where the module's policy takes
        # the call (its direct call above made the same launch), else the kernel + the separate top-K
        sel_d = selection.select_kv(q, k, lse, perm, kq, group_size=C, kv_tile=KV_TILE, cute=True)
        r["default_route"] = "fused top-K" if r["fused"] is True else "separate top-K"
        r["default_route_exact"] = bool(torch.equal(sel_d, fsel if r["fused"] is True else want))
        names.append("default_route_exact")
        r["no_fallback"] = pass2_dispatch.cute_fallback_reason() is None
        if not r["no_fallback"]:
            r["fallback"] = pass2_dispatch.cute_fallback_reason()
        r["ok"] = all(r[n] for n in names + ["no_fallback"])
        if r["fused"] is True and not r["ok"] and all(r[n] for n in names[:5] + ["no_fallback"]):
            r["fused"] = "its check failed"  # the kernel without it still timed (separate top-K)
            r["ok"] = True
            os.environ["MC_SPARSE_PASS2_CUTE_TOPK"] = "0"
            log("CUTE FUSED TOP-K OFF for this run: its check failed")
    except Exception as err:  # noqa: BLE001 (a failing kernel is reported; the Triton rows still run)
        r.update(ok=False, error=f"{type(err).__name__}: {str(err)[:500]}")
        traceback.print_exc()
    log(f"CHECKS {config} {r}" + ("" if r["ok"] else f"  CHECK FAILED ({config})"))
    return r


# select_kv variants beside its defaults (+ "gluon": --p2ws-gluon-row): pass 2 on the CuTeDSL sm_90 kernel (p2cute,
# kernels/cutedsl/pass2_sm90.py) then the separate bracket top-K, its threshold among the candidates by histograms /
# by counting (timed only where ``cute_checks`` passed). ("hist" / "z4", the fused top-K's variants, measured in
# rounds s7r1-s7r3 and not better, are no longer raced.)
RACE1_ROWS = {"bracket": {}}
# CuTeDSL module globals a row runs under (set around each call, restored after): "cute pair" = two query groups per
# work item and the fused top-K with auto_ksplit's key parts (p2cute, round s9r2)
CUTE_GLOBALS = {"cute pair": dict(PAIR=True, TOPK_AUTO_KSPLIT=True)}
# the Triton modules' globals a row runs under (module name in kernels/triton -> {global: value}, set around each of
# the row's calls and restored after)
PARTS_GLOBALS: dict = {# the separate top-K's bracket method (topk._bracket_topk_rows), its default until session 13
                       # (the default since: "seg", kernels/triton/topk_seg.py; round s13r2: seg 0.4897 / 0.4876 /
                       # 0.4909 / 0.4956 against 0.4897 / 0.4951 / 0.4917 / 0.5109; its forms there: 48 registers
                       # or 8 warps (rows "seg r48" / "seg w8" in s13r1, gone), the loads two steps ahead ("seg p2"
                       # 0.4872 / 0.4870 / 0.4914 / 0.5016, removed); the per-thread slots of s13r1 lost: 0.4971 /
                       # 0.4998 / 0.5102 / 0.5219 against 0.4865 / 0.4948 / 0.4878 / 0.5264)
                       "bracket": {"topk": dict(_SEPARATE_METHOD="bracket")}}
# (round s13r2 / s13r3 also raced "seg rev", seg's count sweep from each quarter's end: 0.4885 / 0.5098 / 0.4884 /
# 0.4933, then 0.4959 / 0.5074 / 0.4937 / 0.5321 against seg's 0.4875 / 0.4923 / 0.4949 / 0.5006: removed; round
# s13r4 "seg evict", seg's selection stored L2 evict-first: 0.4948 / 0.5127 / 0.4967 / 0.5041 against 0.4943 / 0.4947
# / 0.4963 / 0.5013: removed)
# rows whose selection must equal the defaults' (``fold_checks``); rows that change the sums' rounding would be
# checked against the brute force of their own sums (``OWN_SUMS_ROWS``). Removed after measurement (1.3B 480p, /
# dense, s = 0.1 / 0.15 / 0.25 / 0.5): round s12r2 (defaults 0.5049 / 0.5064 / 0.5189 / 0.5143 before the unit fold):
# "quant rev" (the quantising pass's heads in reverse order) 0.5000 / 0.5069 / 0.5068 / 0.5161 (s12r1 mixed too),
# "stats acc8 p528" 0.5059 / 0.4986 / 0.5008 / 0.5129 (its per-head reduction 13 us), "ops s12", "z3" 0.5169 / 0.5023
# / 0.5073 / 0.5220; round s12r3 (defaults with the unit fold and p2cute's p8 d2: 0.4867 / 0.4892 / 0.4858 / 0.4967):
# "stats acc8" (the statistics pass with 8-row accumulators, 61 registers) 0.4973 / 0.4888 / 0.4897 / 0.4894 (s12r2
# 0.5059 / 0.5005 / 0.5054 / 0.5120), "z4" (the separate top-K's bracket at 4 sigmas) 0.4888 / 0.5066 / 0.4889 / 0.4873,
# "z4 swar" 0.4808 / 0.5024 / 0.4826 / 0.4949, "fused" (the CuTeDSL kernel's fused top-K, MC_SPARSE_PASS2_CUTE_TOPK=1
# with SWAR 8 and key parts) 0.7414 / 0.7586 / 0.7667 / 0.8187; round s12final (defaults 0.4954 / 0.5026 / 0.4949 /
# 0.5055): "no unit fold" (the unit_qf check by its own launch) 0.5045 / 0.5006 / 0.5086 / 0.5162, "swar cnt" (the
# separate top-K counting on int16 pairs, cand_count 3) 0.4915 / 0.5062 / 0.4972 / 0.5433
SAME_RESULT_ROWS = ("bracket",)
OWN_SUMS_ROWS: tuple = ()
# environment variables a row runs under (set around each of its calls, restored after)
ROW_ENV: dict = {}
CUTE_CONFIGS = ("cute",)  # each checked in a child process per shape first (``cute_child_check``)
CUTE_CHILD_OK: dict = {}  # (shape, config) -> its child check passed

class cute_globals:
    """Context: the CuTeDSL pass-2 module's globals of ``CUTE_GLOBALS[row]``, the Triton modules' of
    ``PARTS_GLOBALS[row]`` and the environment of ``ROW_ENV[row]`` set (none for other rows), restored on exit."""

    def __init__(self, row):
        self.kw = CUTE_GLOBALS.get(row, {})
        self.parts = PARTS_GLOBALS.get(row, {})
        self.env = ROW_ENV.get(row, {})

    def __enter__(self):
        self.old_env = {n: os.environ.get(n) for n in self.env}
        os.environ.update(self.env)
        self.old = []
        mods = [(pass2_dispatch._cute_module(), self.kw)] if self.kw else []
        mods += [({"topk": topk, "selection": selection}[m], kw) for m, kw in self.parts.items()]
        for mod, kw in mods:
            self.old.append((mod, {n: getattr(mod, n) for n in kw}))
            for n, v in kw.items():
                setattr(mod, n, v)
        return self

    def __exit__(self, *exc):
        for mod, old in self.old:
            for n, v in old.items():
                setattr(mod, n, v)
        for n, v in self.old_env.items():
            if v is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = v
        return False


def select_row(row, kw, q, k, lse, perm, kk):
    """A zero-argument callable: select_kv with ``kw`` under the row's CuTeDSL globals."""
    if row in CUTE_GLOBALS or row in PARTS_GLOBALS or row in ROW_ENV:
        def fn():
            with cute_globals(row):
                return selection.select_kv(q, k, lse, perm, kk, group_size=C, kv_tile=KV_TILE, **kw)
        return fn
    return lambda: selection.select_kv(q, k, lse, perm, kk, group_size=C, kv_tile=KV_TILE, **kw)


def race1(name, q, k, v, lse, perm, log, rows, rounds=None, tag=""):
    """Dense, select_kv defaults and the ``rows`` variants at every density, in the same rounds (docstring, item 2)."""
    S = q.shape[2]
    dname, dense = dense_fn(q, k, v)
    fns = {"dense": dense}
    for s in DENSITIES:
        kk = int(s * S)
        for row, kw in {"defaults": {}, **rows}.items():
            fns[f"{row} s={s}"] = select_row(row, kw, q, k, lse, perm, kk)
    idle = {}
    ms = race(fns, rounds=rounds or ROUNDS, target_ms=20.0, from_idle=idle)
    r = dict(dense_backend=dname, dense_ms=ms["dense"], ms=ms,
             over_dense={n: t / ms["dense"] for n, t in ms.items() if n != "dense"}, from_idle_ms=idle,
             from_idle_over_dense=idle_ratios(idle))
    log(f"{name} RACE 1{tag} (dense {dname} {ms['dense']:.3f} ms): " + " | ".join(
        f"s={s}: " + ", ".join(f"{row} {r['over_dense'][f'{row} s={s}']:.4f}" for row in ("defaults", *rows))
        for s in DENSITIES))
    if idle:
        log(f"{name} RACE 1{tag} from_idle (each sample's lead-in calls / dense's, dense {idle['dense']:.3f} ms): "
            + " | ".join(f"s={s}: " + ", ".join(f"{row} {r['from_idle_over_dense'][f'{row} s={s}']:.4f}"
                                                  for row in ("defaults", *rows)) for s in DENSITIES))
    return r


def race1_old(name, q, k, v, lse, perm, log):
    """Race 1's dense + defaults rows timed the sessions 5-8 way (``MC_SPARSE_RACE_LEAD_IN=0``: no lead-in calls),
    3 rounds: the figure beside the new method's for the closing note (``--old-method``, round 1 only)."""
    prev = os.environ.get("MC_SPARSE_RACE_LEAD_IN")
    os.environ["MC_SPARSE_RACE_LEAD_IN"] = "0"
    try:
        return race1(name, q, k, v, lse, perm, log, {}, rounds=3, tag=" OLD METHOD (no lead-in)")
    finally:
        if prev is None:
            os.environ.pop("MC_SPARSE_RACE_LEAD_IN")
        else:
            os.environ["MC_SPARSE_RACE_LEAD_IN"] = prev


def launch_pair(ops, perm, out, *, one_group=False, select=None):
    """The float8 pair pass-2 kernel alone on precomputed operands ``ops`` (``fp8_operands(kb_pow2=True)``), launched
    as ``selection.group_prob_sums`` launches it (unstaggered, BLOCK_N 64, 4 warps, 3 stages; with ``select`` the
    fused top-K epilogue and its register cap, then ``select.finish``)."""
    q8, k8, qf, lse_s, kb = ops
    B, H, S, _ = q8.shape
    SK = k8.shape[2]
    n_slots = perm.shape[-1]
    G = n_slots // C
    sel_args, sel_meta = selection._fused_topk_args(select, out, 4, lse_s)
    extra = {}
    if select is not None and not SMOKE:
        extra = dict(maxnreg=128 if one_group else selection._TOPK_FUSED_MAXNREG)
    selection._group_prob_sums_pair[(G if one_group else -(-G // 2), B * H)](
        q8, k8, lse_s, perm, out, qf, kb, qf, 1.0, H, S, SK, n_slots, C, G,
        *q8.stride(), *k8.stride(), *lse_s.stride(), *out.stride(), *sel_args,
        HEAD_DIM=D, BLOCK_M=128, BLOCK_N=64, EXP_MODE=0, STAGGER=False, FP8=True, POLY=0, P3_G0=0, P3_G1=0,
        KEY_BITS=16, WITH_HIST=False, KB_POW2=True, ONE_GROUP=one_group, **sel_meta, num_warps=4, num_stages=3, **extra)
    if select is not None:
        select.finish(out)
    return out


def host_ms(fn, busy, n=5):
    """Median host time (ms) of one call of ``fn`` made while the GPU is busy with ``busy`` queued twice before it:
    the enqueue cost alone (launches, allocations, Python), none of it waiting on the GPU."""
    ts = []
    for _ in range(n):
        busy()
        busy()
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1000)
        torch.cuda.synchronize() if not SMOKE else None
    return sorted(ts)[len(ts) // 2]


# race 2's fused top-K variants: (tag, one group per program, tile rows per thread, bracket z, cand_count, keys per
# sample: 63 = the plan before session 8 at 1.3B, half the samples of today's default); the first
# always, the others while the budget lasts (z4 / x2 / two groups: measured in rounds s7r1-s7r3, not better: dropped)
RACE2_TOPK = (("1grp", True, 1, topk._Z, True, None),)


# race 2's separate top-K variants (``topk.top_k_rows`` keyword arguments), timed alone on the Triton kernel's sums
# (what follows the CuTeDSL pass 2): histograms (today's separate default), counting one / two bits per pass, and with
# two bits: 4 warps per row, twice the samples (one per 32 keys: a bracket ~0.7x as wide), two 16-byte tile rows per
# thread per sweep step (block 1024: twice the bytes in flight); each checked against the brute force
SEPARATE_TOPK = (("count", dict(cand_count=1)), ("count2", dict(cand_count=2)))


def race2_topk(fns, sums, kq, width, res):
    """Race 2's separate top-K rows (``SEPARATE_TOPK``) on ``sums``, each checked first (brute force on the first 12
    heads, fallback-row share recorded); returns the selection buffer they write."""
    sel = torch.empty(*sums.shape[:3], width, dtype=torch.int32, device=sums.device)
    hc = min(sums.shape[1], 12)
    want = ref_top_k_rows(sums[:, :hc], kq, width)
    for tag, kw in SEPARATE_TOPK:
        try:
            sel.fill_(-7)
            _, fell = topk.top_k_rows(sums, kq, width, out=sel, return_fallbacks=True, **kw)
            if not torch.equal(sel[:, :hc], want):
                raise AssertionError("differs from the brute-force top-K of the sums")
            res[f"fallback rows top-K {tag}"] = float(fell.float().mean())
            fns[f"top-K {tag} alone"] = (lambda kw: lambda: topk.top_k_rows(sums, kq, width, out=sel, **kw))(kw)
        except Exception as err:  # noqa: BLE001
            res["errors"][f"top-K {tag}"] = f"{type(err).__name__}: {str(err)[:300]}"
    return sel


def race2_cute(fns, ops, perm, out16, sums, kq, width, res, sel):
    """Race 2's CuTeDSL rows (added to ``fns`` when its sums on all heads match the Triton kernel's ``sums`` and the
    separate top-K on them, by histograms and by counting, is the brute force of them on the first 12 heads): the
    kernel alone on precomputed operands, the separate top-K alone (on the Triton sums: same row lengths), and the two
    together."""
    q8, k8, qf, lse_s, kb2 = ops
    why = cute_why(q8, k8, out16)
    if why is not None:
        res["errors"]["cute"] = f"skipped: {why}"
        return
    mod = pass2_dispatch._cute_module()
    run = lambda out: mod.group_prob_sums_fp8(q8, k8, qf, lse_s, kb2, perm, out, group_size=C)  # noqa: E731
    got = run(torch.full_like(out16, float("nan")))
    rel = float(((got.double() - sums.double()).norm(dim=-1) / sums.double().norm(dim=-1).clamp_min(1e-30)).max())
    res["cute sums rel"] = rel
    if not rel <= 1e-3:  # (nan included: an entry not written)
        raise AssertionError(f"cute sums differ from select_kv's Triton pass 2 by {rel:.2e}")
    hc = min(out16.shape[1], 12)
    want = ref_top_k_rows(got[:, :hc], kq, width)
    for tag, cc in (("count", 1), ("count2", 2)):
        sel.fill_(-7)
        topk.top_k_rows(got, kq, width, out=sel, cand_count=cc)
        if not torch.equal(sel[:, :hc], want):
            raise AssertionError(f"the separate top-K ({tag}) differs from the brute-force top-K of the cute sums")
    del want
    fns["pass-2 cute alone"] = lambda: run(out16)
    for tag, cc in (("count", 1), ("count2", 2)):
        fns[f"cute + top-K {tag}"] = (lambda cc: lambda: topk.top_k_rows(run(out16), kq, width, out=sel,
                                                                          cand_count=cc))(cc)
    fused = fused_why(q8, k8, out16, sel, kq)
    res["cute fused"] = fused
    if fused is True:  # the kernel with its own top-K (checked: == the brute force of the sums it wrote)
        fsums = torch.full_like(out16, float("nan"))
        sel.fill_(-7)
        mod.group_prob_sums_fp8(q8, k8, qf, lse_s, kb2, perm, fsums, group_size=C, select=(sel, kq))
        frel = float(((fsums.double() - sums.double()).norm(dim=-1) / sums.double().norm(dim=-1).clamp_min(1e-30)).max())
        res["cute fused sums rel"] = frel
        if not (frel <= 1e-3 and torch.equal(sel[:, :hc], ref_top_k_rows(fsums[:, :hc], kq, width))):
            raise AssertionError(f"the fused top-K's sums (rel {frel:.2e} vs Triton) or selection (vs the brute force "
                                 "of its sums) differ")
        fns["pass-2 cute + fused top-K"] = lambda: mod.group_prob_sums_fp8(q8, k8, qf, lse_s, kb2, perm, out16,
                                                                           group_size=C, select=(sel, kq))
        del fsums
    del got


def race2(name, q, k, v, lse, perm, budget, t0, log, reserve=0.0, cute_variants=()):
    """The parts at s = 0.25 in the same rounds as dense (docstring, item 3; p2ws's variants: ``race2b``)."""
    S, H = q.shape[2], q.shape[1]
    G = perm.shape[-1] // C
    kq = int(0.25 * S)
    width = -(-kq // KV_TILE) * KV_TILE
    dname, dense = dense_fn(q, k, v)
    res = dict(errors={})
    fns = {"dense": dense, "operands default": lambda: selection.fp8_operands(q, k, lse, D**-0.5, kb_pow2=True)}
    sums = torch.empty(1, H, G, S, dtype=torch.float16, device=q.device)
    selection.group_prob_sums(q, k, lse, perm, group_size=C, out=sums, cute=False)  # the Triton kernel's
    ops = selection.fp8_operands(q, k, lse, D**-0.5, kb_pow2=True)
    out16 = torch.empty(1, H, G, S, dtype=torch.float16, device=q.device)
    fns["select_kv defaults"] = lambda: selection.select_kv(q, k, lse, perm, kq, group_size=C, kv_tile=KV_TILE)
    plains = {}
    for tag, one, rpt, z, cc, stride in RACE2_TOPK:
        if tag != "1grp" and time.time() - t0 > budget - reserve:
            break  # (reserve: seconds kept for race 2b)
        try:
            if one not in plains:  # the kernel without the top-K epilogue
                plain = launch_pair(ops, perm, torch.full_like(out16, float("nan")), one_group=one)
                rel = float(((plain.double() - sums.double()).norm(dim=-1) / sums.double().norm(dim=-1)).max())
                if rel > 1e-3:  # (nan included: an entry not written)
                    raise AssertionError(f"sums differ from select_kv's pass 2 by {rel:.2e}")
                plains[one] = plain
                fns[f"pass-2 kernel {tag}"] = (lambda one: lambda: launch_pair(ops, perm, out16, one_group=one))(one)
            fused = dataclasses.replace(topk.FusedRows.allocate(H * G, S, kq, width, q.device, z=z, cand_count=cc,
                                                                stride=stride),
                                        rows_per_thread=rpt)
            sel = fused.for_chunk(torch.full((1, H, G, width), -7, dtype=torch.int32, device=q.device))
            got = launch_pair(ops, perm, torch.full_like(out16, float("nan")), one_group=one, select=sel)
            hc = min(H, 12)  # the brute force on the first 12 heads (at 14B all 40 would sort 1.8e9 sums)
            if not torch.equal(sel.out[:, :hc], ref_top_k_rows(got[:, :hc], kq, width)):
                raise AssertionError("the fused top-K differs from the brute-force top-K of its sums")
            res[f"sums equal {tag}"] = bool(torch.equal(got, plains[one]))
            res[f"fallback rows {tag}"] = float(fused.flags.float().mean())
            del got
            fns[f"pass-2 kernel + fused top-K {tag}"] = (lambda one, sel: lambda: launch_pair(
                ops, perm, out16, one_group=one, select=sel))(one, sel)
        except Exception as err:  # noqa: BLE001
            res["errors"][f"pass-2 kernel {tag}"] = f"{type(err).__name__}: {str(err)[:300]}"
    del plains
    sel = race2_topk(fns, sums, kq, width, res)
    try:
        if not CUTE_CHILD_OK.get((name, "cute"), SMOKE):
            raise RuntimeError("not run: its child check did not pass")
        race2_cute(fns, ops, perm, out16, sums, kq, width, res, sel)
        for row, kw in RACE1_ROWS.items():
            if row != "fused" and CUTE_CHILD_OK.get((name, row if row in CUTE_CONFIGS else "cute"), SMOKE):
                fns[f"select_kv {row}"] = select_row(row, kw, q, k, lse, perm, kq)
    except Exception as err:  # noqa: BLE001
        res["errors"]["cute"] = f"{type(err).__name__}: {str(err)[:300]}"
    if cute_variants and "pass-2 cute alone" in fns and all(CUTE_CHILD_OK.get((name, c), SMOKE) for c in CUTE_CONFIGS):  # p2cute's launch variants (tests/bench_cutedsl_pass2.py)
        try:
            import bench_cutedsl_pass2 as bcp

            vfns, res["cute variants"] = bcp.cute_rows(ops, perm, sums, cute_variants, log)
            fns.update({f"pass-2 {n} alone": fn for n, fn in vfns.items()})
        except Exception as err:  # noqa: BLE001
            res["errors"]["cute variants"] = f"{type(err).__name__}: {str(err)[:300]}"
    idle = {}
    ms = race(fns, rounds=ROUNDS, target_ms=20.0, from_idle=idle)
    res.update(dense_backend=dname, dense_ms=ms["dense"], ms=ms,
               over_dense={n: t / ms["dense"] for n, t in ms.items() if n != "dense"}, from_idle_ms=idle,
               from_idle_over_dense=idle_ratios(idle))
    res["host_ms defaults"] = host_ms(
        lambda: selection.select_kv(q, k, lse, perm, kq, group_size=C, kv_tile=KV_TILE), dense)
    log(f"{name} RACE 2 (dense {dname} {ms['dense']:.3f} ms, all heads, s = 0.25): " + " | ".join(
        f"{n} {v:.4f}" for n, v in res["over_dense"].items()) + " | " + " | ".join(
        f"{n} {v:.3f}" for n, v in res.items() if n.startswith(("host", "fallback", "sums", "cute sums")))
        + (f" | errors {res['errors']}" if res["errors"] else ""))
    if idle:
        log(f"{name} RACE 2 from_idle (lead-in calls / dense's, dense {idle['dense']:.3f} ms): " + " | ".join(
            f"{n} {v:.4f}" for n, v in res["from_idle_over_dense"].items()))
    return res


def race2b(name, q, k, v, lse, perm, p2ws_variants, budget, t0, log, p2ws_child_rc=None):
    """p2ws's pass-2 kernel variants (tests/bench_pass2_exp.py, ``--p2ws-variants``) at s = 0.25 in their own race with
    dense, after every other measurement (a variant that faults poisons the CUDA context: nothing runs after it)."""
    import bench_pass2_exp as p2

    S, H = q.shape[2], q.shape[1]
    G = perm.shape[-1] // C
    dname, dense = dense_fn(q, k, v)
    res = dict(errors={})
    fns = {"dense": dense}
    out16 = torch.empty(1, H, G, S, dtype=torch.float16, device=q.device)
    by_pow2 = p2.variant_ops(selection.fp8_operands(q, k, lse, D**-0.5))  # {kb_pow2: operands it reads}
    # the reference: "kb pow2", the pass-2 kernel select_kv runs (p2ws, 13:30)
    ref = p2.launch_variant("kb pow2", by_pow2, perm, torch.full((1, H, G, S), float("nan"), device=q.device))
    for vname in p2ws_variants:
        if time.time() - t0 > budget:
            break
        try:
            kw = p2.VARIANTS[vname]
            rc = 0 if p2ws_child_rc is None else p2ws_child_rc.get(vname)  # None: no child / cut by the wait
            if rc != 0 and (kw.get("gluon") is not None or rc is not None):  # (a Triton variant then checked here)
                raise AssertionError(f"not run: its check in a child process ended with {rc}")
            got = p2.launch_variant(vname, by_pow2, perm, torch.full((1, H, G, S), float("nan"), device=q.device))
            if bool(got.isnan().any()):
                raise AssertionError("NaN left in the output (an entry not written)")
            if kw.get("exp") != "none":
                rel = float(((got.double() - ref.double()).norm(dim=-1) / ref.double().norm(dim=-1)).max())
                if rel > kw.get("rtol", p2.POLY_RTOL):
                    raise AssertionError(f"sums differ from the reference kernel's by {rel:.2e}")
            del got
            fns[f"p2ws {vname}"] = (lambda vname: lambda: p2.launch_variant(vname, by_pow2, perm, out16))(vname)
        except Exception as err:  # noqa: BLE001
            res["errors"][f"p2ws {vname}"] = f"{type(err).__name__}: {str(err)[:300]}"
    ms = race(fns, rounds=3, target_ms=20.0)
    res.update(dense_backend=dname, dense_ms=ms["dense"], ms=ms,
               over_dense={n: t / ms["dense"] for n, t in ms.items() if n != "dense"})
    log(f"{name} RACE 2b (p2ws; dense {dname} {ms['dense']:.3f} ms, all heads): " + " | ".join(
        f"{n} {v:.4f}" for n, v in res["over_dense"].items()) + (f" | errors {res['errors']}" if res["errors"] else ""))
    return res


# select_kv compiles for race 1 in child processes started with the bench (one per group of rows and shape, on 2
# heads of the shape: the same specialisations), so the main process loads them from Triton's disk cache instead of
# compiling one after another (~4 s each; round s6r2 lost its 14B race to the cap); "race2": race 2's kernels
CHILD_ROWS = (("defaults",) + SAME_RESULT_ROWS + OWN_SUMS_ROWS,) + tuple((f"cutecheck {c}",) for c in CUTE_CONFIGS)


def spawn_children(shapes, out_dir, with_race2, cute_variants=()):
    """The compile children (``CHILD_ROWS`` per shape, + race 2's at 1.3B, + one per CuTeDSL variant: its compile into
    the disk cache of kernels/cutedsl/compile.py); logs OUT/select_child_*.log."""
    procs = {}
    for text in cute_variants if with_race2 else ():
        log = open(out_dir / f"select_child_{len(procs)}.log", "w")
        procs[f"cute {text}"] = subprocess.Popen([sys.executable, __file__, "--out", str(out_dir), "--precompile",
                                                  "cute", "--rows", text], stdout=log, stderr=subprocess.STDOUT)
    for shape in shapes:
        for rows in CHILD_ROWS + ((("race2",),) if with_race2 and shape == "1.3b" else ()):
            tag = f"{shape}:{'+'.join(rows)}"
            log = open(out_dir / f"select_child_{len(procs)}.log", "w")
            procs[tag] = subprocess.Popen([sys.executable, __file__, "--out", str(out_dir), "--precompile", shape,
                                           "--rows", ",".join(rows)], stdout=log, stderr=subprocess.STDOUT)
    return procs


def wait_children(procs, seconds):
    """{tag: exit status} of ``spawn_children``'s processes after at most ``seconds`` (None: killed)."""
    end, rcs = time.time() + seconds, {}
    for tag, p in procs.items():
        try:
            rcs[tag] = p.wait(timeout=max(0.1, end - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            rcs[tag] = None
    return rcs


def precompile(shape, rows):
    """(child) Each row once on 2 heads of ``shape`` at s = 0.25 (random bf16 q / k, fp32 LSE, random groups); shape
    "cute": the CuTeDSL kernel's compile for the variant ``rows[0]`` (tests/bench_cutedsl_pass2.py's syntax)."""
    if shape == "cute":
        import bench_cutedsl_pass2 as bcp
        from comfyui_mc_sparse_pack.kernels.cutedsl import pass2_sm90

        tun = bcp.parse_variant(rows[0])
        pass2_sm90.compiled("float16", **{key: tun[key] for key in bcp.COMPILED if key in tun})
        return
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # (cpu: TRITON_INTERPRET=1, a check of this code)
    S = math.prod(SHAPES[shape]["grid"])
    G = -(-S // C)
    gen = torch.Generator(device=dev).manual_seed(7)
    q, k = (torch.randn(1, 2, S, D, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(2))
    lse = torch.randn(1, 2, S, device=dev, generator=gen) + 10.0
    perm = torch.full((1, 2, G * C), -1, dtype=torch.int32, device=dev)
    for h in range(2):
        perm[0, h, :S] = torch.randperm(S, device=dev, generator=gen).to(torch.int32)
    kq = int(0.25 * S)
    width = -(-kq // KV_TILE) * KV_TILE
    for row in rows:
        if row.startswith("cutecheck "):  # the CuTeDSL rows' checks (and compiles) on these 2 heads
            config = row.split(" ", 1)[1]
            with cute_globals(config):
                r = cute_checks((q, k, lse, perm), kq, width, lambda m: print(m, flush=True), config)
                if r["ok"] and config == "cute":
                    for row_name, kw in RACE1_ROWS.items():
                        if row_name in CUTE_CONFIGS or row_name in SAME_RESULT_ROWS + OWN_SUMS_ROWS:
                            continue  # (compiled by its own child / the defaults' child)
                        with cute_globals(row_name):
                            selection.select_kv(q, k, lse, perm, kq, group_size=C, kv_tile=KV_TILE, **kw)
                    mod = pass2_dispatch._cute_module()
                    if getattr(mod, "FUSED_TOPK", False) and hasattr(mod, "compiled"):  # the fused top-K's launch
                        mod.compiled("float16", topk=True)  # (the route of all heads may differ from these 2 heads':
                        # round s9final compiled it inside the 14B race and ran out of time)
            if dev == "cuda":
                torch.cuda.synchronize()
            if not r["ok"]:
                sys.exit(1)
            continue
        if row != "race2":
            with cute_globals(row):
                selection.select_kv(q, k, lse, perm, kq, group_size=C, kv_tile=KV_TILE,
                                    **({} if row == "defaults" else RACE1_ROWS[row]))
            continue
        ops = selection.fp8_operands(q, k, lse, D**-0.5, kb_pow2=True)
        out16 = torch.empty(1, 2, G, S, dtype=torch.float16, device=dev)
        sel = torch.empty(1, 2, G, width, dtype=torch.int32, device=dev)
        for _, kw in SEPARATE_TOPK:  # race 2's separate top-K
            topk.top_k_rows(out16.normal_().abs_(), kq, width, out=sel, **kw)
        for _, one, rpt, z, cc, stride in RACE2_TOPK:
            launch_pair(ops, perm, out16, one_group=one)
            fused = dataclasses.replace(topk.FusedRows.allocate(2 * G, S, kq, width, q.device, z=z, cand_count=cc,
                                                                stride=stride),
                                        rows_per_thread=rpt)
            launch_pair(ops, perm, out16, one_group=one, select=fused.for_chunk(
                torch.empty(1, 2, G, width, dtype=torch.int32, device=dev)))
    if dev == "cuda":
        torch.cuda.synchronize()


def make_inputs(name):
    from bench_anchor import structured_q  # the inputs of bench_anchor (same generator and seed)
    import bench_anchor

    bench_anchor.DEVICE = "cuda" if not SMOKE else "cpu"
    H, grid = SHAPES[name]["H"], SHAPES[name]["grid"]
    S = math.prod(grid)
    gen = torch.Generator(device=bench_anchor.DEVICE).manual_seed(20261201)
    q = structured_q(H, grid, gen)
    k, v = (torch.randn(1, H, S, D, device=bench_anchor.DEVICE, dtype=torch.bfloat16, generator=gen) for _ in range(2))
    _, dense = dense_fn(q, k, v)
    _, lse = dense()
    perm = grouping.pddp_groups(q, C) if not SMOKE else kernels.pddp_groups(q, C)
    return q, k, v, lse, perm


def write_scoreboard(report, out_dir, command):
    shapes = report["shapes"]
    if SMOKE or not all(sh.get("race1") for sh in shapes.values()) or set(shapes) != {"1.3b", "14b"}:
        return
    def worst_of(prefix):
        return max((r, n, key) for n, sh in shapes.items() for key, r in sh["race1"]["over_dense"].items()
                   if key.rsplit(" s=", 1)[0] == prefix)

    worst = worst_of("defaults")
    rows = sorted({key.rsplit(" s=", 1)[0] for sh in shapes.values() for key in sh["race1"]["over_dense"]} - {"defaults"})
    others = "; ".join(f"{p}: {w[0]:.4f} ({w[1]} {w[2]})" for p in rows for w in [worst_of(p)])
    entry = _scoreboard.entry(
        worst[0], "ratio", command=command, commit=_scoreboard.measured_commit(report["commit"]), gpu=report["gpu"],
        note=(f"select_kv defaults / flash-attn-4 dense with LSE, tests/_timing.race (sustained, interleaved, same "
              f"rounds), worst of 1.3b, 14b x s in {list(DENSITIES)}: {worst[1]} {worst[2]}; worst of the explicit "
              f"variants in the same run: {others}; dense ms "
              + ", ".join(f"{n} {sh['race1']['dense_ms']:.3f}" for n, sh in shapes.items())))
    _scoreboard.update({"pass2_topk_over_dense_max": entry}, out_dir / "scoreboard.json")


def run_race2(report, name, inputs, args, t0, log, variants, cute_variants, save):
    """``race2`` for one shape into the report (a failure is reported, not raised)."""
    try:
        report["shapes"][name]["race2"] = race2(name, *inputs, args.budget, t0, log, 30.0 if variants else 0.0,
                                                cute_variants)
    except Exception as err:  # noqa: BLE001
        report["shapes"][name]["race2_error"] = f"{type(err).__name__}: {str(err)[:500]}"
        log(f"{name} race 2 FAILED: {report['shapes'][name]['race2_error']}")
        traceback.print_exc()
    save()


def install_stand_in():
    """(--smoke, and its children under TRITON_INTERPRET=1) a stand-in for the CuTeDSL kernel (no CUDA here): the
    Triton one-group kernel on the same operands (+ the brute-force top-K as its fused selection), so the smoke runs
    the cute rows' code (checks, race rows) too."""
    def stand_in_sums(q8, k8, qf, lse_s, kb2, perm, out, *, group_size, select=None, **tuning):
        launch_pair((q8, k8, qf, lse_s, kb2), perm, out, one_group=True)
        if select is not None:  # (its fused top-K: the brute force of those sums)
            select[0].copy_(ref_top_k_rows(out, select[1], select[0].shape[-1]))
        return out

    stand_in = type("CuteStandIn", (), dict(
        FUSED_TOPK=os.environ.get("SMOKE_CUTE_FUSED", "1") == "1", PAIR=False, TOPK_AUTO_KSPLIT=False, UNIT_QF=False,
        TOPK_WHOLE_WALKS_ONLY=True,
        refusal=staticmethod(lambda q8, k8, group_size, out: None),
        select_refusal=staticmethod(lambda q8, k8, group_size, out, sel, num_keys: None),
        group_prob_sums_fp8=staticmethod(stand_in_sums)))
    pass2_dispatch._cute_module = lambda: stand_in


def main():
    global SMOKE
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="1.3b,14b")
    ap.add_argument("--commit", default=os.environ.get("MC_SPARSE_COMMIT", ""))
    ap.add_argument("--p2ws-variants", default="", help="comma-separated tests/bench_pass2_exp.py VARIANTS to race")
    ap.add_argument("--budget", type=float, default=100.0, help="s since start after which race 2 adds no more items")
    ap.add_argument("--rounds", type=int, default=3, help="tests/_timing.race rounds in races 1 and 2 (>= 3)")
    ap.add_argument("--smoke", action="store_true", help="CPU, TRITON_INTERPRET=1: code paths on a tiny shape")
    ap.add_argument("--p2ws-gluon-row", action="store_true", help="race 1 also times select_kv(gluon=True) (the Gluon "
                    "pass 2 at its default config + the separate top-K) if that config passed its child check")
    ap.add_argument("--race1-only", action="store_true", help="checks and race 1 only (no race 2 / 2b)")
    ap.add_argument("--no-triton-row", action="store_true", help="race 1 without the 'triton' row beside a CuTeDSL "
                    "default (its compiles happen inside the race: a short cap)")
    ap.add_argument("--old-method", action="store_true", help="after each shape's race 1, dense + defaults again "
                    "timed without lead-in (MC_SPARSE_RACE_LEAD_IN=0, 3 rounds): the sessions 5-8 figure beside it")
    ap.add_argument("--race2-first", action="store_true", help="race 2 at 1.3B before its race 1 (else after both "
                    "shapes' race 1: the scoreboard figures first)")
    ap.add_argument("--cute-variants", default="", help="comma-separated CuTeDSL pass-2 launch variants "
                    "(tests/bench_cutedsl_pass2.py: 'st4 p8') raced alone in race 2 at 1.3B, checked first")
    ap.add_argument("--rows-14b", default=None, help="comma-separated RACE1_ROWS timed at 14B (default: all; a 14B "
                    "row takes ~6 s of race 1 at 5 rounds)")
    ap.add_argument("--precompile", default=None, help=argparse.SUPPRESS)  # (child: a shape)
    ap.add_argument("--rows", default="", help=argparse.SUPPRESS)  # (child: its rows)
    ap.add_argument("--race2-only", action="store_true", help="no checks, no race 1, no scoreboard: race 2b "
                    "alone (p2ws's pass-2 variants beside dense)")
    args = ap.parse_args()
    global ROUNDS
    ROUNDS = max(3, args.rounds)
    if args.precompile:
        if os.environ.get("TRITON_INTERPRET") == "1":
            from _triton_interp import patch_interpreter

            patch_interpreter()
            os.environ["MC_SPARSE_PASS2_FP8"] = "1"
            install_stand_in()
            SMOKE = True
        precompile(args.precompile, args.rows.split(","))
        return
    SMOKE = args.smoke
    if SMOKE:
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("--smoke needs TRITON_INTERPRET=1 in the environment")
        os.environ["MC_SPARSE_PASS2_FP8"] = "1"  # the float8 pass 2 of the GPU (one_group needs it)
        from _triton_interp import patch_interpreter  # two Triton 3.6 interpreter fixes (tests/_triton_interp.py)

        patch_interpreter()
        install_stand_in()
    shapes = ["smoke"] if SMOKE else args.shapes.split(",")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()

    def log(msg):
        print(f"[{time.time() - t0:6.1f} s] {msg}", flush=True)

    report = dict(commit=args.commit, argv=sys.argv, gpu=torch.cuda.get_device_name() if not SMOKE else "cpu", shapes={})
    argv = [a for i, a in enumerate(sys.argv[1:]) if a != "--out" and (i == 0 or sys.argv[i] != "--out")]
    command = "python tests/bench_select_race.py --out $OUT " + " ".join(a for a in argv if "$" not in a)

    def save():
        (out_dir / "bench_select_race.json").write_text(json.dumps(report, indent=1, default=str))

    kept = {}
    cute_variants = [t.strip() for t in args.cute_variants.split(",") if t.strip()]
    children = {} if SMOKE or args.race2_only else spawn_children(shapes, out_dir, not args.race1_only, cute_variants)
    variants = [n.strip() for n in args.p2ws_variants.split(",") if n.strip()]
    precompiling = []
    child_rc = None
    if variants and "1.3b" in shapes and not SMOKE:  # p2ws's Gluon variants compile in child processes meanwhile
        import bench_pass2_exp as p2

        go_file = out_dir / "p2ws_children_go"
        go_file.touch()  # each child checks its variant right after compiling, before race 1 (waited for there)
        if args.p2ws_gluon_row and p2.GLUON_DEFAULT_VARIANT not in variants:
            variants.insert(0, p2.GLUON_DEFAULT_VARIANT)
        precompiling = p2.spawn_precompile(variants, "1.3b", go_file=go_file, log_dir=out_dir)
    for name in shapes:
        res = report["shapes"][name] = {}
        try:
            q, k, v, lse, perm = make_inputs(name)
            log(f"{name} inputs ready (S {q.shape[2]}, H {q.shape[1]})")
            if precompiling and child_rc is None:  # the children's checks end before anything is timed
                child_rc = p2.wait_precompile(precompiling, 35)
                log("p2ws children (0 = compiled and checked): " + ", ".join(f"{n} {rc}" for n, rc in child_rc.items()))
            if not args.race2_only:
                if children:  # nothing is timed while they run; the CuTeDSL checks run here only where a child ran
                    rcs = wait_children(children, max(5.0, 60.0 - (time.time() - t0)))  # them first (a hang is
                    log("select children (0 = compiled / checked): "  # killed there, not here)
                        + ", ".join(f"{t} {rc}" for t, rc in rcs.items()))
                    children = {}
                    CUTE_CHILD_OK.update({(sh, c): rcs.get(f"{sh}:cutecheck {c}") == 0 for sh in shapes
                                          for c in CUTE_CONFIGS})
                    report["children"] = rcs
                res["checks"] = checks(q, k, lse, perm, q.shape[2], log, full=name != "14b", name=name)
                save()
                gluon_row = bool(args.p2ws_gluon_row and child_rc and child_rc.get(p2.GLUON_DEFAULT_VARIANT) == 0)
                if name in ("1.3b", "smoke") and args.race2_first and not args.race1_only:  # (round s8r1 lost them)
                    run_race2(report, name, (q, k, v, lse, perm), args, t0, log, variants, cute_variants, save)
                cfg = res["checks"]["cute_configs"]
                rows = {n: kw for n, kw in RACE1_ROWS.items()  # (rows whose check failed: not timed; "fused"
                        if cfg.get(n if n in cfg else "cute", {}).get("ok")  # only where its fused top-K ran and
                        and (n != "fused" or cfg["fused"].get("fused") is True)}  # passed)
                if name == "14b" and args.rows_14b is not None:
                    keep = {r.strip() for r in args.rows_14b.split(",")}
                    rows = {n: kw for n, kw in rows.items() if n in keep}
                if pass2_dispatch.cute_mode() and not args.no_triton_row:  # the CuTeDSL pass 2 is the default: the
                    # Triton one beside it (its pass-2 and fused top-K compiles are not precompiled: ~10-20 s a shape)
                    rows["triton"] = dict(cute=False)
                res["race1"] = race1(name, q, k, v, lse, perm, log,
                                     {**rows, **({"gluon": dict(gluon=True)} if gluon_row else {})})
                save()
                if args.old_method:
                    res["race1_old_method"] = race1_old(name, q, k, v, lse, perm, log)
                    save()
            kept[name] = (q, k, v, lse, perm)
        except Exception as err:  # noqa: BLE001 (a failing shape is reported; the others still run)
            res["error"] = f"{type(err).__name__}: {str(err)[:500]}"
            log(f"{name} FAILED: {res['error']}")
            traceback.print_exc()
    if not args.race2_only:
        write_scoreboard(report, out_dir, command)
    for name, inputs in ({} if args.race2_only or args.race1_only else kept).items():
        if name in ("1.3b", "smoke") and args.race2_first:
            continue  # (run before its race 1)
        if time.time() - t0 > args.budget - (0 if name in ("1.3b", "smoke") else 20):
            log(f"{name} race 2 skipped (budget)")
            continue
        run_race2(report, name, inputs, args, t0, log, variants, cute_variants if name in ("1.3b", "smoke") else (),
                  save)
    if variants and "1.3b" in kept and time.time() - t0 < args.budget and not args.race1_only:  # last: a faulting
        # variant ends the process
        try:
            report["shapes"]["1.3b"]["race2b"] = race2b("1.3b", *kept["1.3b"], variants, args.budget, t0, log,
                                                        child_rc)
        except Exception as err:  # noqa: BLE001
            report["shapes"]["1.3b"]["race2b_error"] = f"{type(err).__name__}: {str(err)[:500]}"
            log(f"1.3b race 2b FAILED: {report['shapes']['1.3b']['race2b_error']}")
            traceback.print_exc()
        save()
    log("done")


if __name__ == "__main__":
    main()
