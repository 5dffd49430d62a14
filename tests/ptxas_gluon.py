"""Offline compile report of the sm_90 Gluon sparse kernel (no GPU needed; not collected by pytest).

Compiles ``kernels/triton/sparse_attention_sm90.py``'s kernel for sm_90a at the Wan2.1 shapes (D = 128 and 64,
C = 128, q/k/v/out as [B, H, S, D] views of [B, S, H*D] tensors), for every residual kind, with the runtime's
specialisations (``ptxas_report.compile_offline`` with Gluon's AST source), then prints ptxas registers, spills,
shared memory and the ``setmaxnreg`` counts found in the PTX. Exit status 1 when a default config spills or does
not fit in shared memory.

Usage: python tests/ptxas_gluon.py [--quick] [--ptx DIR] (--quick: D = 128, plain residual only; DIR: also write each
PTX and cubin there)
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ptxas_report as pr  # noqa: E402  (loads the pack, pops TRITON_INTERPRET)
import torch  # noqa: E402

from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

g90 = importlib.import_module("comfyui_mc_sparse_pack.kernels.triton.sparse_attention_sm90")


def report(residual_kind=None, return_lse=True, D=128, S=75600, H=40, ptx_dir=None, **tuning):
    B, C = 1, 128
    q, k, v, out = pr.model_views(B, H, S, D)
    G = -(-S // C)
    perm = torch.empty(B, H, G * C, dtype=torch.int32, device="meta")
    kv_idx = torch.empty(B, H, G, 19200, dtype=torch.int32, device="meta")
    res = None
    if residual_kind == "plain":
        res = pr.Residual(torch.empty(B, H, S, D, dtype=torch.bfloat16, device="meta"))
    elif residual_kind in ("fp8_row", "int4_row"):
        data = (torch.empty(B, H, S, D, dtype=torch.float8_e4m3fn, device="meta") if residual_kind == "fp8_row"
                else torch.empty(B, H, S, D // 2, dtype=torch.uint8, device="meta"))
        res = pr.Residual(data, torch.empty(B, H, S, dtype=torch.float32, device="meta"), residual_kind)
    _, args, meta, _ = g90.launch_args(q, k, v, perm, kv_idx, return_lse=return_lse, out=out, residual=res, **tuning)
    ck = pr.compile_offline(g90._sparse_fwd_sm90, args, meta, 90, source=GluonASTSource)
    regs, st, ld = pr.ptxas_usage(ck, 90)
    ptx = ck.asm["ptx"]
    if ptx_dir:
        Path(ptx_dir).mkdir(parents=True, exist_ok=True)
        (Path(ptx_dir) / f"g90_d{D}_{residual_kind}_{int(return_lse)}.ptx").write_text(ptx)
        (Path(ptx_dir) / f"g90_d{D}_{residual_kind}_{int(return_lse)}.cubin").write_bytes(ck.asm["cubin"])
    setmax = sorted(set(re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)))
    smem = ck.metadata.shared
    return dict(D=D, residual=residual_kind, lse=return_lse, tuning=tuning, regs=regs, spill_st=st, spill_ld=ld, smem=smem,
                fits=smem <= pr.SMEM_LIMIT[90], setmaxnreg=setmax,
                cfg={k: meta[k] for k in ("NUM_STAGES", "GATHER_ROWS", "CONSUMER_REGS", "PRODUCER_REGS", "maxnreg")})


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ptx", default=None)
    ap.add_argument("--quick", action="store_true", help="D = 128, plain residual only")
    args = ap.parse_args()
    bad = 0
    cases = [(128, "plain", {})] if args.quick else (
        [(D, kind, {}) for D in (128, 64) for kind in (None, "plain", "fp8_row", "int4_row")]
        + [(128, kind, tune) for kind in ("plain", "int4_row")  # the bench's GLUON_CONFIGS
           for tune in (dict(pipeline=True), dict(num_stages=3), dict(pipeline=True, num_stages=3))])
    for D, kind, tune in cases:
        r = report(kind, D=D, ptx_dir=args.ptx, **tune)
        bad += r["spill_st"] > 0 or not r["fits"]
        print(r, flush=True)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
