"""CuTeDSL sparse kernel benchmark on an sm_90 GPU (issue 16; not collected by pytest).

At the Wan2.1-1.3B 480p (B=1, H=12, S=32760) and 14B 720p (H=40, S=75600) shapes, D = 128, bf16, C = 128, for
s in {0.1, 0.15, 0.25, 0.5} (each group's indices a random sorted set of floor(s*S) tokens, -1-padded to a multiple of
128), measured side by side in one process, interleaved (``race``: every row in turn, ``--rounds`` rounds of about
``--target-ms`` each, median; the dense baseline moves ~10 % between runs, so it is timed in the same race at every
point):
- dense with LSE: flash-attn-4 (the baseline of every ratio: "flash-attn-4 dense x s"; cuDNN SDPA without it);
- ``cutedsl op``: ``kernels.sparse_attention(..., backend="cutedsl")`` on the model's native [B, S, H*D] views
  writing an ``out=`` view (what the reuse path calls: counts launch + kernel), twice (``cutedsl op (again)``: the
  same call in another place of the race's order), and with a plain bf16 residual;
- ``counts + op kernel``: the op's counts launch and its compiled kernel (``rules``' epilogue, options and grid)
  launched directly: the op without its host work (the host microseconds per op call are printed too);
- the compiled kernel's launch alone (counts computed before) in the ``VARIANTS`` named by ``--variants``
  (producer L2 hints, the staged epilogue, 3 K/V stages, a persistent grid of one CTA per SM, two groups in flight
  per CTA; "res ..." with the plain bf16 residual); efficiency = FA4 dense ms * s /
  sparse ms;
- the op's counts launch alone (``counts launch``: ms only; ``--op-rows`` "counts", not raced by default);
- the compile time (a compile from fake tensors, never the disk cache) and the disk-cache load time (a fresh
  process).
Every row's output is checked before timing (into a NaN-filled out: relative error against the float32 torch
reference on a sub-sample of heads and the count of NaN left); a wrong kernel variant is reported and not timed.
It writes --out JSON and the scoreboard key ``cutedsl_sparse_eff_min`` (the op's minimum; command and --commit).

Usage: python tests/bench_cutedsl.py --out $OUT/bench_cutedsl.json --commit <hash> [--shapes 1.3b,14b]
       [--variants kernel,...] [--rounds 3] [--target-ms 30]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "comfyui_mc_sparse"))
import _standalone  # noqa: E402
import _scoreboard  # noqa: E402
from _timing import race  # noqa: E402

_standalone.load_pack()
from comfyui_mc_sparse_pack import kernels  # noqa: E402
from comfyui_mc_sparse_pack.kernels import reference, registry  # noqa: E402
from comfyui_mc_sparse_pack.kernels.cutedsl import rules  # noqa: E402

SHAPES = {"1.3b": dict(B=1, H=12, S=32760, D=128), "14b": dict(B=1, H=40, S=75600, D=128)}
C = 128
T0 = time.perf_counter()  # the run's start (the log's wall seconds: where a round's time goes)


def native(gen, B, S, H, D):
    return torch.randn(B, S, H * D, generator=gen, device="cuda", dtype=torch.bfloat16).view(B, S, H, D).transpose(1, 2)


def inputs(gen, B, H, S, s):
    G = -(-S // C)
    num = int(s * S)
    k_alloc = -(-num // 128) * 128
    perm = torch.full((B, H, G * C), -1, dtype=torch.int32, device="cuda")
    perm[..., :S] = torch.argsort(torch.rand(B, H, S, generator=gen, device="cuda"), -1).to(torch.int32)
    idx = torch.full((B, H, G, k_alloc), -1, dtype=torch.int32, device="cuda")
    for h in range(H):
        top = torch.rand(B, G, S, generator=gen, device="cuda").topk(num, -1, sorted=False).indices
        idx[:, h, :, :num] = top.sort(-1).values.to(torch.int32)
    return perm, idx


def half_footprint(gen, idx, S, s):
    """A selection like ``inputs``' (same shape, count per group and sorted rows) with every group's keys drawn from
    its head's first S // 2 tokens only: half the head's K/V rows in flight (19.4 MB at 14B 720p instead of 38.7),
    the same bytes gathered, each row read by twice as many groups. Needs s <= 0.5."""
    B, H, G, _ = idx.shape
    num = int(s * S)
    half = torch.full_like(idx, -1)
    for h in range(H):
        top = torch.rand(B, G, S // 2, generator=gen, device="cuda").topk(num, -1, sorted=False).indices
        half[:, h, :, :num] = top.sort(-1).values.to(torch.int32)
    return half


VARIANTS = {  # name -> (producer, epilogue, stages, options) of the compiled kernel timed alone (counts computed
    # before); "persistent" variants run one CTA per SM (grid stride over the groups)
    "kernel": ("cp.async", "registers", 2, ()),
    "kernel smem epi": ("cp.async", "smem", 2, ()),
    "kernel l2 256B": ("cp.async+l2", "registers", 2, ()),
    "kernel evict": ("cp.async+evict", "registers", 2, ()),
    "kernel evict + smem epi": ("cp.async+evict", "smem", 2, ()),
    "kernel 3 stages": ("cp.async", "registers", 3, ()),
    "evict smem 3 stages": ("cp.async+evict", "smem", 3, ()),
    "evict smem persistent": ("cp.async+evict", "smem", 2, ("persistent",)),
    # two groups in flight per CTA (query ring, next group's first Q K^T with this group's last P V)
    "evict smem overlap": ("cp.async+evict", "smem", 2, ("overlap", "persistent")),
    # + the staged output's global stores under the next group's second Q K^T and first P V
    "evict smem hide": ("cp.async+evict", "smem", 2, ("overlap", "persistent", "hide_epi")),
    # + the next group's count / perm / first index entries loaded during this group
    # with the plain bf16 residual (the reuse path's call: the register epilogue): the op's kernel, then overlap
    "res kernel": ("cp.async+evict", "registers", 2, (), "plain"),
    "res overlap": ("cp.async+evict", "registers", 2, ("overlap", "persistent"), "plain"),
}


OP_ROWS = ("again", "residual", "counts + kernel", "options")  # the op's default extra rows (``--op-rows``; also
# "counts": the counts launch alone, see run_shape)
# "contiguous": the op on the dense baseline's head-contiguous [B, H, S, D] copies of q / k / v (out the same) instead
# of the model's [B, S, H*D] views: how much the gathers' address spread costs (a 14B head's K rows lie 10 KiB apart
# over 774 MB; head-contiguous, 256 B apart over 19 MB); not an op figure. "diag": the op with its default options
# + "diag_no_copy" (the producer skips the K/V copies: WRONG output, not checked; the kernel without its gathers)
# "shared": the op with every group of a head selecting its head's first group's key set (the same count and bytes,
# every row then read by all the head's groups: L2 reuse as good as it gets; checked first like the op): beside the
# op and "diag", whether the gathers are bound by L2 misses (shared ~ diag) or by their issue / latency (shared ~ op)
# "half": the op with every group's keys drawn from its head's first half of the tokens (``half_footprint``: the
# same count and bytes, half the head's rows in flight; checked first like the op): beside the op and "shared",
# whether the gathers' clock cost follows the rows in flight (L2 capacity) or the access pattern
# "residual check": the op with a plain residual checked (not timed) at each point, one more compile
# "options": the op with each of these staged-epilogue option sets ($MC_SPARSE_CUTEDSL_OPTIONS,
# rules.staged_options; ``--op-options``, ";"-separated): candidate defaults beside the op's
OP_OTHER_OPTIONS = "persistent,overlap"  # the default before round s7r2


def with_options(raw, fn, env="MC_SPARSE_CUTEDSL_OPTIONS"):
    """fn run with $env (the staged epilogue's options; MC_SPARSE_CUTEDSL_RES_OPTIONS: the register epilogue's) = raw
    (restored after)."""
    def run():
        old = os.environ.get(env)
        os.environ[env] = raw
        try:
            return fn()
        finally:
            if old is None:
                del os.environ[env]
            else:
                os.environ[env] = old
    return run


def run_shape(name, shp, densities, rounds, target_ms, variants, log, op_rows=OP_ROWS,
              other_options=(OP_OTHER_OPTIONS,), res_options=(), order="random", warm_up=True):
    B, H, S, D = shp["B"], shp["H"], shp["S"], shp["D"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (native(gen, B, S, H, D) for _ in range(3))
    res = kernels.Residual(torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2) * 0.01)
    out = torch.empty(B, S, H * D, device="cuda", dtype=torch.bfloat16).view(B, S, H, D).transpose(1, 2)
    qc, kc, vc = (t.contiguous() for t in (q, k, v))
    avail = {b.name for b in registry.backends() if not b.unavailable_reason}
    dense_fns = {f"dense {nm}": (lambda be=be: kernels.dense_attention(qc, kc, vc, return_lse=True, backend=be))
                 for nm, be in (("flash_attn4", "flash_attn4"), ("cudnn", "cuda_sdpa")) if be in avail}
    if "dense flash_attn4" in dense_fns:
        dense_fns.pop("dense cudnn", None)  # the baseline only: cuDNN's 200 ms per call at 14B cost the race time
    base_name = "dense flash_attn4" if "dense flash_attn4" in dense_fns else next(iter(dense_fns))
    rows = {}
    from comfyui_mc_sparse_pack.kernels.cutedsl import compile as cc
    from comfyui_mc_sparse_pack.kernels.triton.counts import valid_counts
    for s in densities:
        perm, idx = inputs(gen, B, H, S, s)
        # the first and the last head (the "split_tail" groups of the last, partial round are in the last head)
        heads = [0, H - 1]
        ref = reference.sparse_attention(q[:, heads].float(), k[:, heads].float(), v[:, heads].float(),
                                         perm[:, heads], idx[:, heads])

        def err(got, plus=None):
            want = ref if plus is None else ref + plus[:, heads].float()
            return float((got[:, heads].float() - want).norm() / want.norm())

        r_err = {}
        out.fill_(float("nan"))
        with registry.recording(registry.Record()) as rec:
            got = kernels.sparse_attention(q, k, v, perm, idx, out=out, backend="cutedsl")
        if rec.choices["sparse_attention"].backend != "cutedsl":  # a fallback would be timed instead of the kernel
            raise SystemExit(f"the cutedsl kernel did not run: {rec.choices} {rec.failures}")
        r_err["cutedsl op"] = (err(got), int(out.isnan().sum()))
        if "residual" in op_rows or "residual check" in op_rows:
            got = kernels.sparse_attention(q, k, v, perm, idx, out=out, residual=res, backend="cutedsl")
            r_err["cutedsl op + plain residual"] = (err(got, res.data), 0)
        fns = dict(dense_fns)
        # "counts": the op's counts launch timed alone (ms only, no ratio). Not raced by default since round s13r1:
        # its samples (host-bound launches, the GPU mostly idle) let the next row's sample start cool, 4.0 % faster
        # on average (64 samples; tests/race_spread.py), which biased whichever row followed it
        if "counts" in op_rows:
            fns["counts launch"] = lambda: valid_counts(idx)
        fns["cutedsl op"] = lambda: kernels.sparse_attention(q, k, v, perm, idx, out=out, backend="cutedsl")
        if "residual" in op_rows:
            fns["cutedsl op + plain residual"] = lambda: kernels.sparse_attention(q, k, v, perm, idx, out=out,
                                                                                  residual=res, backend="cutedsl")
        for raw in other_options if "options" in op_rows else ():  # checked first like the op: output, no fallback
            op_pf = with_options(raw, lambda: kernels.sparse_attention(q, k, v, perm, idx, out=out, backend="cutedsl"))
            out.fill_(float("nan"))
            with registry.recording(registry.Record()) as rec:
                got = op_pf()
            tag = f"cutedsl op ({raw})"
            r_err[tag] = (err(got), int(out.isnan().sum()))
            if rec.choices["sparse_attention"].backend != "cutedsl" or r_err[tag][0] > 1e-2 or r_err[tag][1]:
                log(f"{name} s={s}: {tag} WRONG or fell back ({r_err[tag]}, {rec.failures}): not timed")
            else:
                fns[tag] = op_pf
        for raw in res_options:  # the op with the plain residual (register epilogue) under other options, checked
            op_pf = with_options(raw, lambda: kernels.sparse_attention(q, k, v, perm, idx, out=out, residual=res,
                                                                       backend="cutedsl"),
                                 "MC_SPARSE_CUTEDSL_RES_OPTIONS")
            out.fill_(float("nan"))
            with registry.recording(registry.Record()) as rec:
                got = op_pf()
            tag = f"cutedsl op + plain residual ({raw})"
            r_err[tag] = (err(got, res.data), int(out.isnan().sum()))
            if rec.choices["sparse_attention"].backend != "cutedsl" or r_err[tag][0] > 1e-2 or r_err[tag][1]:
                log(f"{name} s={s}: {tag} WRONG or fell back ({r_err[tag]}, {rec.failures}): not timed")
            else:
                fns[tag] = op_pf
        if "contiguous" in op_rows:  # checked first like the op
            out_c = torch.empty_like(qc)
            op_c = lambda: kernels.sparse_attention(qc, kc, vc, perm, idx, out=out_c, backend="cutedsl")  # noqa: E731
            out_c.fill_(float("nan"))
            with registry.recording(registry.Record()) as rec:
                got = op_c()
            tag = "cutedsl op (head-contiguous q/k/v)"
            r_err[tag] = (err(got), int(out_c.isnan().sum()))
            if rec.choices["sparse_attention"].backend != "cutedsl" or r_err[tag][0] > 1e-2 or r_err[tag][1]:
                log(f"{name} s={s}: {tag} WRONG or fell back ({r_err[tag]}, {rec.failures}): not timed")
            else:
                fns[tag] = op_c
        other_sets = {"shared": ("cutedsl op (shared key set per head)", lambda: idx[:, :, :1].expand_as(idx).contiguous()),
                      "half": ("cutedsl op (keys from half the head)", lambda: half_footprint(gen, idx, S, s))}
        for row, (tag, make) in other_sets.items():
            if row not in op_rows:
                continue
            idx_x = make()
            want = reference.sparse_attention(q[:, heads].float(), k[:, heads].float(), v[:, heads].float(),
                                              perm[:, heads], idx_x[:, heads])
            op_x = lambda idx_x=idx_x: kernels.sparse_attention(q, k, v, perm, idx_x, out=out,  # noqa: E731
                                                                backend="cutedsl")
            out.fill_(float("nan"))
            with registry.recording(registry.Record()) as rec:
                got = op_x()
            r_err[tag] = (float((got[:, heads].float() - want).norm() / want.norm()), int(out.isnan().sum()))
            del want
            if rec.choices["sparse_attention"].backend != "cutedsl" or r_err[tag][0] > 1e-2 or r_err[tag][1]:
                log(f"{name} s={s}: {tag} WRONG or fell back ({r_err[tag]}, {rec.failures}): not timed")
            else:
                fns[tag] = op_x
        if "diag" in op_rows:  # not checked: its output is wrong by construction; the backend's op directly (a
            # failure raises here instead of turning the registry's cutedsl off for the other rows)
            from comfyui_mc_sparse_pack.kernels.cutedsl import op as cop_diag
            raw = ",".join((*rules.staged_options(), "diag_no_copy"))
            diag = with_options(raw, lambda: cop_diag.sparse_attention(q, k, v, perm, idx, out=out))
            try:
                diag()
                torch.cuda.synchronize()
                fns["DIAG op without K/V copies"] = diag
            except Exception as exc:  # a diagnostic row: report and go on
                log(f"{name} s={s}: DIAG row failed ({type(exc).__name__}: {exc}): not timed")
        # the op's rows twice: two rows of the same call differ only by their place in the race's order
        if "again" in op_rows:
            fns["cutedsl op (again)"] = fns["cutedsl op"]
        counts = valid_counts(idx)
        if not torch.equal(counts, (idx >= 0).sum(-1, dtype=torch.int32).view(-1)):  # sorted rows, trailing -1
            raise SystemExit(f"{name} s={s}: valid_counts WRONG")
        n = counts.shape[0]
        views = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), out.transpose(1, 2), None, perm.view(n, C),
                 idx.view(n, -1), counts, None, None, None, None, 1 / math.sqrt(D), n)
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count
        # the op's own kernel and grid (rules), launched directly after the counts launch: the op minus its host work
        epi = rules.epilogue_for("none", out)
        op_options, op_ctas = rules.launch_plan(epi, n, sms)
        op_fn = cc.compiled("bfloat16", D, False, "none", epilogue=epi, options=op_options)
        # a "split_tail" kernel takes its workspace; launched here with one part per group (no split, no merge)
        ws = ((torch.empty(128, D, dtype=q.dtype, device=q.device), torch.empty(128, device=q.device), 1)
              if "split_tail" in op_options else ())
        if "counts + kernel" in op_rows:
            fns["counts + op kernel"] = lambda: cc.launch(op_fn, *views[:7], valid_counts(idx), *views[8:-1], op_ctas,
                                                          *ws)
        from comfyui_mc_sparse_pack.kernels.cutedsl import op as cop
        r_host = {} if s != densities[0] else {  # where the op's host time goes (each behind a dense call)
            "op": host_us(lambda: kernels.sparse_attention(q, k, v, perm, idx, out=out, backend="cutedsl"), dense_fns),
            "registry candidates": host_us(lambda: registry.candidates("sparse_attention", q, "cutedsl"), dense_fns),
            "backend op": host_us(lambda: cop.sparse_attention(q, k, v, perm, idx, out=out), dense_fns),
            "counts launch": host_us(lambda: valid_counts(idx), dense_fns),
            "kernel launch": host_us(lambda: cc.launch(op_fn, *views[:-1], op_ctas, *ws), dense_fns),
        }
        for tag in variants:
            producer, epilogue, stages, options, *res_mode = VARIANTS[tag]
            plain = res_mode == ["plain"]
            fn = cc.compiled("bfloat16", D, False, "plain_bfloat16" if plain else "none", stages, producer, epilogue,
                             options)
            args = (views[:8] + ((res.data.transpose(1, 2),) if plain else (None,)) + views[9:-1]
                    + ((sms if "persistent" in options else n),))
            out.fill_(float("nan"))
            cc.launch(fn, *args)
            r_err[tag] = (err(out, res.data if plain else None), int(out.isnan().sum()))
            if r_err[tag][0] > 1e-2 or r_err[tag][1]:
                log(f"{name} s={s}: {tag} WRONG (rel err {r_err[tag][0]:.2e}, NaN left {r_err[tag][1]}): not timed")
                continue
            fns[tag] = lambda fn=fn, args=args: cc.launch(fn, *args)
        idle, smp = {}, {}
        r = race(fns, rounds, target_ms, from_idle=idle, samples=smp, order=order, warm_up=warm_up)
        base = r[base_name]
        eff = {kk: base * s / vv for kk, vv in r.items() if not kk.startswith(("dense", "counts"))}
        eff_paired = paired_efficiency(smp, base_name, s)
        # the lead-in calls' median (each started on an idle GPU after another row's sample; empty without lead-in)
        eff_idle = {kk: idle[base_name] * s / vv for kk, vv in idle.items()
                    if base_name in idle and not kk.startswith(("dense", "counts"))}
        if r_host:
            log(f"{name} s={s}: host us per call (issued behind a dense call): "
                + ", ".join(f"{kk} {vv:.0f}" for kk, vv in r_host.items()))
        log(f"{name} s={s}: " + ", ".join(f"{kk} {vv:.3f} ms" + (f" (eff {eff[kk]:.3f})" if kk in eff else "")
                                           for kk, vv in r.items())
            + "; rel err / NaN left " + ", ".join(f"{kk} {e:.2e}/{nn}" for kk, (e, nn) in r_err.items()))
        log(f"{name} s={s}: samples (at {time.perf_counter() - T0:.0f} s of the run): "
            + sample_summary(smp, base_name, s))
        if idle:
            log(f"{name} s={s}: from idle (lead-in calls' median): " + ", ".join(
                f"{kk} {vv:.3f} ms" + (f" (eff {eff_idle[kk]:.3f})" if kk in eff_idle else "") for kk, vv in idle.items()))
        rows[s] = dict(ms=r, efficiency=eff, err=r_err, host_us_per_op_call=r_host, from_idle_ms=idle,
                       efficiency_from_idle=eff_idle, samples=smp, efficiency_paired=eff_paired)
    return dict(baseline=base_name, densities=rows)


def paired_efficiency(smp, base_name, s):
    """Per row (not the baseline or "counts") the median over the race's rounds of the baseline's sample x s over
    the row's sample of the same round: the ratio taken within a round, so a drift of the clock between rounds
    that moves both cancels (``race``'s ``samples``; the method of record takes the ratio of the two medians)."""
    base = {rnd: ms for rnd, _, _, ms in smp[base_name]}
    return {kk: statistics.median(base[rnd] * s / ms for rnd, _, _, ms in v) for kk, v in smp.items()
            if not kk.startswith(("dense", "counts"))}


def sample_summary(smp, base_name, s):
    """One log line from ``race``'s samples: the baseline's ms per round, then per other row (not "counts") its
    paired efficiency (``paired_efficiency``) and its efficiency per round against the baseline's sample of the same
    round with its place in that round's order (eff@position), so a row's spread can be read beside its
    neighbours' (docs/kernels.md, session 13)."""
    base = {rnd: ms for rnd, _, _, ms in smp[base_name]}
    paired = paired_efficiency(smp, base_name, s)
    parts = [f"{base_name} ms " + "/".join(f"{base[rnd]:.3f}" for rnd in sorted(base))]
    for kk, v in smp.items():
        if kk.startswith(("dense", "counts")):
            continue
        parts.append(f"{kk} paired {paired[kk]:.3f}: " + " ".join(f"{base[rnd] * s / ms:.3f}@{pos}"
                                                                 for rnd, pos, _, ms in v))
    return "; ".join(parts)


def shape_rounds(raw: str, shape: str) -> int:
    """--rounds for ``shape``: ``raw`` is a count ("6") or per-shape counts ("1.3b=18,14b=6"; a shape not named: 3).
    Raises ValueError on anything else."""
    if "=" not in raw:
        return int(raw)
    per = dict(part.split("=") for part in raw.split(","))
    return int(per.get(shape, 3))


def host_us(fn, dense_fns, calls=20):
    """Host microseconds per call of fn, issued while the GPU runs a dense call queued before (so the launch queue is
    neither empty nor full): above the kernel's own time, the op would be host-bound in a back-to-back race."""
    dense = next(iter(dense_fns.values()))
    fn()
    torch.cuda.synchronize()
    dense()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    took = (time.perf_counter() - t) / calls * 1e6
    torch.cuda.synchronize()
    return took


def compile_times(log):
    """Compile seconds (``compile_fake``: always a compile, whatever the disk cache holds) in this process and
    disk-cache load seconds in a fresh one."""
    from comfyui_mc_sparse_pack.kernels.cutedsl import compile as cc
    t = time.perf_counter()
    cc.compile_fake("bfloat16", 64, True)  # compiled() would load a cache left by an earlier run: not a compile
    cold = time.perf_counter() - t
    t = time.perf_counter()
    cc.compile_fake("bfloat16", 128, True, "plain_bfloat16")
    cold_res = time.perf_counter() - t
    cc.compiled("bfloat16", 64, True)  # now on disk (a compile or a load) for the fresh process below
    code = ("import sys,time; sys.path.insert(0, %r); import _standalone; _standalone.load_pack(); "
            "from comfyui_mc_sparse_pack.kernels.cutedsl import compile as cc; t=time.perf_counter(); "
            "cc.compiled('bfloat16', 64, True); print(time.perf_counter()-t)") % str(ROOT / "comfyui_mc_sparse")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ.copy())
    warm = float(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 and p.stdout.strip() else None
    log(f"compile: {cold:.1f} s (with a residual: {cold_res:.1f} s); from the disk cache "
        f"({cc.cache_dir()}) in a fresh process: {warm} s "
        f"({p.stderr.strip()[-300:]})")
    return dict(first_compile_s=cold, residual_compile_s=cold_res, disk_cache_load_s=warm,
                cache_dir=str(cc.cache_dir()))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="1.3b,14b")
    ap.add_argument("--densities", default="0.1,0.15,0.25,0.5")
    ap.add_argument("--rounds", default="3",
                    help='interleaved timing rounds (median): a count, or per shape ("1.3b=18,14b=6"; a shape left out: 3)')
    ap.add_argument("--target-ms", type=float, default=30.0,
                    help="time per fn per round (TEAM.md: >= ~20 ms; the first call's host latency is exposed once "
                         "per sample)")
    ap.add_argument("--no-compile-times", action="store_true", help="skip the compile / disk-cache timing (~9 s)")
    ap.add_argument("--variants", default="evict smem persistent,evict smem overlap",
                    help="kernel variants timed alone: " + ", ".join(VARIANTS))
    ap.add_argument("--op-rows", default=",".join(OP_ROWS), help="the op's extra rows: " + ", ".join(OP_ROWS))
    ap.add_argument("--op-options", default=OP_OTHER_OPTIONS,
                    help='";"-separated staged-epilogue option sets of the "options" op rows')
    ap.add_argument("--res-options", default="",
                    help='";"-separated register-epilogue option sets: the op with the plain residual under each '
                         '($MC_SPARSE_CUTEDSL_RES_OPTIONS), beside the "residual" op row')
    ap.add_argument("--order", default="random", choices=("random", "balanced"),
                    help="the race's order of rows per round (tests/_timing.race): random (seed 0, the same sequence "
                         "at every point) or balanced (a Williams design: give --rounds = the row count, or twice it "
                         "for an odd count)")
    ap.add_argument("--no-warm-up", action="store_true",
                    help="no untimed warm-up sample before each point's race (tests/_timing.race warm_up; without it "
                         "the race's first sample starts on a GPU idle since the point's setup)")
    ap.add_argument("--commit", default=_scoreboard.measured_commit())
    ap.add_argument("--scoreboard", default=str(_scoreboard.BOARD))
    args = ap.parse_args()
    lines = []

    def log(msg):
        print(msg, flush=True)
        lines.append(msg)

    log(f"GPU {torch.cuda.get_device_name()}; backends:\n{registry.report()}")
    report = dict(gpu=torch.cuda.get_device_name(), commit=args.commit, shapes={})
    report["compile"] = None if args.no_compile_times else compile_times(log)
    for name in args.shapes.split(","):
        report["shapes"][name] = run_shape(name, SHAPES[name], [float(x) for x in args.densities.split(",")],
                                           shape_rounds(args.rounds, name), args.target_ms,
                                           [x for x in args.variants.split(",") if x], log,
                                           [x for x in args.op_rows.split(",") if x],
                                           [x for x in args.op_options.split(";") if x],
                                           [x for x in args.res_options.split(";") if x], args.order,
                                           not args.no_warm_up)
    effs = {(n, s): r["efficiency"]["cutedsl op"] for n, sh in report["shapes"].items()
            for s, r in sh["densities"].items()}
    worst = min(effs, key=effs.get)
    report["cutedsl_sparse_eff_min"] = effs[worst]
    wrong = [(n, s) for n, sh in report["shapes"].items() for s, r in sh["densities"].items()
             if r["err"]["cutedsl op"][0] > 1e-2 or r["err"]["cutedsl op"][1]]
    if wrong:  # a wrong op's speed is no figure
        log(f"the cutedsl op is WRONG at {wrong}: scoreboard not written")
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(dict(report, log=lines), indent=1, default=str))
        sys.exit(1)
    kerns = {}
    for sh in report["shapes"].values():
        for r in sh["densities"].values():
            for kk, e in r["efficiency"].items():
                kerns[kk] = min(kerns.get(kk, e), e)
    paired = {}
    for sh in report["shapes"].values():
        for r in sh["densities"].values():
            for kk, e in r["efficiency_paired"].items():
                paired[kk] = min(paired.get(kk, e), e)
    log(f"cutedsl_sparse_eff_min {effs[worst]:.3f} at {worst}; minimum over the points per row: "
        + ", ".join(f"{kk} {e:.3f}" for kk, e in kerns.items())
        + "; paired (per-round ratios' median): " + ", ".join(f"{kk} {e:.3f}" for kk, e in paired.items()))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(report, log=lines), indent=1, default=str))
    bases = "; ".join(f"{n}: {sh['baseline']} " + "/".join(f"{r['ms'][sh['baseline']]:.2f}" for r in sh["densities"].values())
                      + " ms" for n, sh in report["shapes"].items())
    entries = {"cutedsl_sparse_eff_min": _scoreboard.entry(
        effs[worst], "ratio", command=" ".join(["python tests/bench_cutedsl.py"] + sys.argv[1:]), commit=args.commit,
        gpu=report["gpu"],
        note=(f"min over shapes x s of dense with LSE x s / CuTeDSL op (native views, out=, counts launch + kernel; "
              f"dense timed interleaved with it at each point, median of {args.rounds} rounds, {args.order} order, "
              f"{'no warm-up' if args.no_warm_up else 'warm-up'}); "
              f"worst at {worst[0]} s={worst[1]}; staged-epilogue options {rules.staged_options()}; dense baseline "
              f"{bases}; minimum per row: " + ", ".join(f"{kk} {e:.3f}" for kk, e in kerns.items())
              + "; paired minimum per row: " + ", ".join(f"{kk} {e:.3f}" for kk, e in paired.items())
              + f"; compile {report['compile']}"))}
    _scoreboard.update(entries, Path(args.out).with_name("scoreboard.json"), args.scoreboard)


if __name__ == "__main__":
    main()
