"""Offline compile report of the sm_90 Gluon sparse kernel (no GPU needed; not collected by pytest).

Compiles ``kernels/triton/sparse_attention_sm90.py``'s kernel for sm_90a at the Wan2.1 shapes (D = 128 and 64,
C = 128, q/k/v/out as [B, H, S, D] views of [B, S, H*D] tensors), for every residual kind, with the runtime's
specialisations (``ptxas_report.compile_offline`` with Gluon's AST source), then prints ptxas registers, spills,
shared memory, the ``setmaxnreg`` counts found in the PTX and the local-memory (spill) instructions inside the
consumer partitions' MMA loop and the producer's copy loop (SASS by cuobjdump). Exit status 1 when a config spills
in a consumer's hot loop, spills more than 64 bytes in all (the producer's 40 registers: a few spills outside the
consumers' loop), or does not fit in shared memory (the overlap + persistent configs with an int4_group residual spill
in the consumer loop and are printed 'flagged' instead: no schedule uses them).

Usage: python tests/ptxas_gluon.py [--quick] [--ptx DIR] (--quick: D = 128, the default config with a plain residual
and the auto mode's first schedule (max_vote named_turns, without its tail launch) with int4_group; DIR: also write
each PTX and cubin there)
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ptxas_report as pr  # noqa: E402  (loads the pack, pops TRITON_INTERPRET)
import torch  # noqa: E402

from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

g90 = importlib.import_module("comfyui_mc_sparse_pack.kernels.triton.sparse_attention_sm90")


def hot_loop_spills(cubin: bytes) -> tuple[int, int]:
    """(local-memory ops between the first and last HGMMA of the consumer partitions, between the first and last
    LDGSTS of the producer) in the SASS (cuobjdump): spills inside the hot loops. The SASS is split at each
    ``USETMAXREG``; a part with HGMMA is a consumer's, a part with LDGSTS and no HGMMA the producer's."""
    from triton.backends.nvidia.compiler import get_ptxas

    cuobjdump = Path(get_ptxas(90).path).with_name("cuobjdump")
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"mc_sparse_gluon_{os.getpid()}.cubin"
    tmp.write_bytes(cubin)
    sass = subprocess.run([str(cuobjdump), "-sass", str(tmp)], capture_output=True, text=True).stdout
    tmp.unlink()
    regions, cur = [], []
    for line in sass.splitlines():
        if not re.search(r"/\*[0-9a-f]{4,}\*/", line):
            continue
        if "USETMAXREG" in line:
            regions.append(cur)
            cur = []
        cur.append(line)
    regions.append(cur)
    consumer = producer = 0
    for r in regions:
        hg = [i for i, line in enumerate(r) if "HGMMA" in line]
        marks = hg or [i for i, line in enumerate(r) if "LDGSTS" in line]
        if not marks:
            continue
        n = sum(1 for line in r[min(marks):max(marks) + 1] if re.search(r"\b(STL|LDL)", line))
        if hg:
            consumer += n
        else:
            producer += n
    return consumer, producer


def _tag(tuning):
    return "".join(f"_{k}{int(v) if isinstance(v, bool) else v}" for k, v in sorted(tuning.items()))


def report(residual_kind=None, return_lse=True, D=128, S=75600, H=40, ptx_dir=None, **tuning):
    B, C = 1, 128
    q, k, v, out = pr.model_views(B, H, S, D)
    G = -(-S // C)
    perm = torch.empty(B, H, G * C, dtype=torch.int32, device="meta")
    kv_idx = torch.empty(B, H, G, 19200, dtype=torch.int32, device="meta")
    res = pr.meta_residual(residual_kind, B, H, S, D, G)
    _, args, meta, _ = g90.launch_args(q, k, v, perm, kv_idx, return_lse=return_lse, out=out, residual=res, **tuning)
    ck = pr.compile_offline(g90._sparse_fwd_sm90, args, meta, 90, source=GluonASTSource)
    regs, st, ld = pr.ptxas_usage(ck, 90)
    ptx = ck.asm["ptx"]
    if ptx_dir:
        Path(ptx_dir).mkdir(parents=True, exist_ok=True)
        (Path(ptx_dir) / f"g90_d{D}_{residual_kind}_{int(return_lse)}{_tag(tuning)}.ptx").write_text(ptx)
        (Path(ptx_dir) / f"g90_d{D}_{residual_kind}_{int(return_lse)}{_tag(tuning)}.cubin").write_bytes(ck.asm["cubin"])
    consumer_hot, producer_hot = hot_loop_spills(ck.asm["cubin"])
    setmax = sorted(set(re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)))
    smem = ck.metadata.shared
    return dict(D=D, residual=residual_kind, lse=return_lse, tuning=tuning, regs=regs, spill_st=st, spill_ld=ld, smem=smem,
                fits=smem <= pr.SMEM_LIMIT[90], setmaxnreg=setmax, consumer_hot_spills=consumer_hot,
                producer_hot_spills=producer_hot,
                cfg={k: meta[k] for k in ("NUM_STAGES", "ROW_THREADS", "CONSUMER_REGS", "PRODUCER_REGS", "maxnreg")})


def merge_report(residual_kind=None, D=128, S=32760, H=12):
    """Offline sm_90a compile of ``sparse_tail_merge._merge_parts`` (the split-tail merge, a Triton kernel) at a
    Wan2.1 shape with its launch arguments: registers, spills."""
    merge = importlib.import_module("comfyui_mc_sparse_pack.kernels.triton.sparse_tail_merge")
    B, C, n_tail, n_parts = 1, 128, 36, 3
    G = -(-S // C)
    _, _, _, out = pr.model_views(B, H, S, D)
    perm = torch.empty(B, H, G * C, dtype=torch.int32, device="meta")
    ws_o = torch.empty(n_tail * n_parts, 128, D, dtype=torch.float32, device="meta")
    ws_ml = torch.empty(n_tail * n_parts, 128, 2, dtype=torch.float32, device="meta")
    lse = torch.empty(B, H, S, dtype=torch.float32, device="meta")
    res = pr.meta_residual(residual_kind, B, H, S, D, G)
    _, args, meta = merge.merge_args(ws_o, ws_ml, B * H * G - n_tail, n_tail, n_parts, perm, out, lse, res, H, S, C,
                                     G * C, 1, False)
    ck = pr.compile_offline(merge._merge_parts, args, meta, 90)
    regs, st, ld = pr.ptxas_usage(ck, 90)
    return dict(kernel="sparse_tail_merge", D=D, residual=residual_kind, regs=regs, spill_st=st, spill_ld=ld)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ptx", default=None)
    ap.add_argument("--quick", action="store_true", help="D = 128, plain residual only")
    args = ap.parse_args()
    bad = 0
    skip = dict(pingpong=True, persistent=True, num_sms=132, num_stages=3, thread_arrive=True, early_q=True,
                cp_async_fence=False, q_regs=True, skip_rescale=True)  # inline PTX over the accumulator (session 9)
    vote = dict(skip, sum_partial=True, max_vote=True)  # the auto mode's schedules since s10final (tail launch aside)
    cases = [(128, "int4_group", dict(vote, named_turns=True)), (128, "plain", {})] if args.quick else (
        [(D, kind, {}) for D in (128, 64) for kind in (None, "plain", "fp8_row", "int4_row", "int4_group")]
        + [(128, kind, tune) for kind in ("plain", "int4_group")  # the bench's GLUON_CONFIGS
           for tune in (dict(pipeline=True), dict(num_stages=3), dict(pipeline=True, num_stages=3),
                        dict(persistent=True, num_sms=132), dict(persistent=True, num_sms=132, pipeline=True),
                        dict(overlap=True), dict(overlap=True, num_stages=3),
                        dict(overlap=True, persistent=True, num_sms=132), dict(pingpong=True),
                        dict(pingpong=True, persistent=True, num_sms=132), dict(stage_out=True),
                        dict(stage_out=True, overlap=True, pingpong=True, persistent=True, num_sms=132),
                        dict(l2_hints=True), dict(pingpong=True, persistent=True, num_sms=132, l2_hints=True),
                        # the auto mode's schedules (sparse_dispatch.AUTO_SCHEDULES) and the per-thread arrives
                        dict(pingpong=True, persistent=True, num_sms=132, num_stages=3),
                        dict(pingpong=True, persistent=True, num_sms=132, stage_out=True),
                        dict(pingpong=True, persistent=True, num_sms=132, thread_arrive=True),
                        dict(pingpong=True, persistent=True, num_sms=132, num_stages=3, thread_arrive=True),
                        dict(pingpong=True, persistent=True, num_sms=132, num_stages=3, thread_arrive=True,
                             early_q=True),
                        dict(pingpong=True, persistent=True, num_sms=132, num_stages=3, thread_arrive=True,
                             early_q=True, cp_async_fence=False),
                        # the auto mode's schedules with the producer at 8 threads per row
                        dict(pingpong=True, persistent=True, num_sms=132, num_stages=3, thread_arrive=True,
                             early_q=True, cp_async_fence=False, q_regs=True, row_threads=8),
                        dict(pingpong=True, persistent=True, num_sms=132, num_stages=3, thread_arrive=True,
                             early_q=True, cp_async_fence=False, idx_ahead=2, row_threads=8),
                        dict(pingpong=True, persistent=True, num_sms=132, num_stages=3, thread_arrive=True,
                             early_q=True, cp_async_fence=False, q_regs=True, row_threads=8, next_item=True),
                        dict(pingpong=True, persistent=True, num_sms=132, num_stages=3, thread_arrive=True,
                             early_q=True, cp_async_fence=False, idx_ahead=2, row_threads=8, next_item=True),
                        # + the split last round (registers 216 / 72)
                        dict(pingpong=True, persistent=True, num_sms=132, num_stages=3, thread_arrive=True,
                             early_q=True, cp_async_fence=False, q_regs=True, row_threads=8, next_item=True,
                             split_tail=4, consumer_regs=216, producer_regs=72),
                        dict(pingpong=True, persistent=True, num_sms=132, num_stages=3, thread_arrive=True,
                             early_q=True, cp_async_fence=False, idx_ahead=2, row_threads=8, next_item=True,
                             split_tail=4, consumer_regs=216, producer_regs=72),
                        # the auto mode's schedules since round s7r2 (sparse_dispatch.AUTO_SCHEDULES)
                        dict(pingpong=True, persistent=True, num_sms=132, num_stages=3, thread_arrive=True,
                             early_q=True, cp_async_fence=False, q_regs=True, split_tail=4, consumer_regs=216,
                             producer_regs=72),
                        dict(pingpong=True, persistent=True, num_sms=132, num_stages=3, thread_arrive=True,
                             early_q=True, cp_async_fence=False, idx_ahead=2, split_tail=4, consumer_regs=216,
                             producer_regs=72),
                        # the accumulator's rescale skipped per warp, alone and with the tail launch
                        skip, dict(skip, max_tree=True), dict(skip, max_tree=True, tail_launch=4),
                        dict(skip, max_tree=True, sum_partial=True),
                        dict(skip, max_tree=True, sum_partial=True, tail_launch=4),
                        vote, dict(vote, named_turns=True), dict(vote, named_turns=True, tail_launch=4))])
    for kind in ("int4_group",) if args.quick else (None, "plain", "fp8_row", "int4_row", "int4_group"):
        print(merge_report(kind), flush=True)  # before the Gluon kernel's lines (the CPU test reads the last one)
    for D, kind, tune in cases:
        r = report(kind, D=D, ptx_dir=args.ptx, **tune)
        fail = r["consumer_hot_spills"] > 0 or not r["fits"] or (not tune and r["spill_st"] > 64)
        if fail and kind == "int4_group" and tune.get("overlap") and tune.get("persistent"):
            r["flagged"] = "known: overlap + persistent spills in the consumer loop with int4_group; no schedule uses it"
            fail = False
        bad += fail
        print(r, flush=True)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
