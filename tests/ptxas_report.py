"""Offline register / spill / shared-memory report of the Triton sparse kernel (no GPU needed; not collected by pytest).

Compiles ``kernels/triton/sparse_attention.py``'s kernel for sm_80, sm_89 and sm_90 with the specialisations the
runtime would apply to the model's call (pointers 16-byte aligned, integer arguments divisible by 16 marked so, unit
strides turned into constants), at the Wan2.1 shapes (D = 128, C = 128, q/k/v/out as [B, H, S, D] views of
[B, S, H*D] tensors), then runs the bundled ``ptxas -v`` on the PTX and prints registers, spill stores/loads and
shared memory. Exit status 1 when a default config, or the packed-exponential / lazy-rescale path at the default
tile, spills or does not fit.

Usage: python tests/ptxas_report.py [--variants] (--variants also compiles a few tile configs on sm_90)
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "comfyui_mc_sparse"))
import _standalone  # noqa: E402

_standalone.load_pack()
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from comfyui_mc_sparse_pack.kernels import Residual  # noqa: E402
import importlib  # noqa: E402

tsa = importlib.import_module("comfyui_mc_sparse_pack.kernels.triton.sparse_attention")

_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32", torch.uint8: "u8",
          torch.int8: "i8", torch.int16: "i16",
          torch.float8_e4m3fn: "fp8e4nv"}
SMEM_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}


def compile_offline(fn, args, meta, arch, source=ASTSource):
    """CompiledKernel of the JIT ``fn`` for (args, meta) on sm_<arch>, specialised as the runtime would.

    ``source``: the AST source class (Gluon kernels: ``triton.experimental.gluon._runtime.GluonASTSource``; their
    ``num_warps`` is a constexpr parameter, taken from meta like the others)."""
    names = fn.arg_names
    signature, constexprs, attrs = {}, {}, {}
    for i, (name, val) in enumerate(zip(names, list(args) + [meta.get(n) for n in names[len(args):]])):
        if name in meta and name not in ("maxnreg", "num_stages"):
            signature[name], constexprs[name] = "constexpr", meta[name]
        elif isinstance(val, torch.Tensor):
            signature[name] = "*" + _TYPES[val.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif hasattr(val, "block_shape") and hasattr(val, "layout"):  # a Gluon host TensorDescriptor (TMA)
            signature[name] = (f"tensordesc<{_TYPES[val.base.dtype]}[{', '.join(map(str, val.block_shape))}],"
                               f"{val.layout!r}>")
        elif isinstance(val, bool) or val is None:
            signature[name], constexprs[name] = "constexpr", val
        elif isinstance(val, int):
            if val == 1:
                signature[name], constexprs[name] = "constexpr", 1
            else:
                signature[name] = "i32" if -(2**31) <= val < 2**31 else "i64"
                if val % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32"
    src = source(fn, signature, constexprs, attrs)
    target = GPUTarget("cuda", arch, 32)
    opts = {k: meta[k] for k in ("num_warps", "num_stages", "maxnreg") if k in meta}
    return triton.compile(src, target=target, options=opts)


def ptxas_usage(ck, arch):
    """(registers, spill store bytes, spill load bytes) from ``ptxas -v`` on the kernel's PTX."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(arch).path
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"mc_sparse_ptxas_{os.getpid()}.ptx"
    tmp.write_text(ck.asm["ptx"])
    gpu = f"sm_{arch}a" if arch == 90 else f"sm_{arch}"
    res = subprocess.run([ptxas, "-v", f"--gpu-name={gpu}", str(tmp), "-o", os.devnull], capture_output=True, text=True)
    tmp.unlink()
    text = res.stderr + res.stdout
    regs = int(re.search(r"Used (\d+) registers", text).group(1))
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    return regs, int(spill.group(1)), int(spill.group(2))


def model_views(B, H, S, D, dtype=torch.bfloat16):
    base = [torch.empty(B, S, H * D, dtype=dtype, device="meta") for _ in range(4)]
    return [t.view(B, S, H, D).transpose(1, 2) for t in base]


def meta_residual(kind, B, H, S, D, G):
    """A ``Residual`` of ``kind`` (None: no residual) on the meta device, the cache's shapes and dtypes."""
    if kind == "plain":
        return Residual(torch.empty(B, H, S, D, dtype=torch.bfloat16, device="meta"))
    if kind in ("fp8_row", "int4_row"):
        data = (torch.empty(B, H, S, D, dtype=torch.float8_e4m3fn, device="meta") if kind == "fp8_row"
                else torch.empty(B, H, S, D // 2, dtype=torch.uint8, device="meta"))
        return Residual(data, torch.empty(B, H, S, dtype=torch.float32, device="meta"), kind)
    if kind == "int4_group":
        return Residual(torch.empty(B, H, S, D // 2, dtype=torch.uint8, device="meta"),
                        torch.empty(B, H, S, dtype=torch.bfloat16, device="meta"), kind,
                        torch.empty(B, H, S, dtype=torch.float8_e4m3fn, device="meta"),
                        torch.empty(B, H, G, D, dtype=torch.bfloat16, device="meta"))
    return None


def report(arch, residual_kind=None, return_lse=True, S=75600, H=40, **tuning):
    B, D, C = 1, 128, 128
    q, k, v, out = model_views(B, H, S, D)
    G = -(-S // C)
    perm = torch.empty(B, H, G * C, dtype=torch.int32, device="meta")
    kv_idx = torch.empty(B, H, G, 19200, dtype=torch.int32, device="meta")
    res = meta_residual(residual_kind, B, H, S, D, G)
    _, args, meta, _ = tsa.launch_args(q, k, v, perm, kv_idx, return_lse=return_lse, out=out, residual=res,
                                       capability=(arch // 10, arch % 10), **tuning)
    ck = compile_offline(tsa._sparse_attn_fwd, args, meta, arch)
    regs, st, ld = ptxas_usage(ck, arch)
    smem = ck.metadata.shared
    cfg = (f"BN {meta['BLOCK_N']} w{meta['num_warps']} st{meta['num_stages']} r{meta.get('maxnreg', 0)} exp mode "
           f"{meta['EXP_MODE']}" + (" lazy" if meta["LAZY_RESCALE"] else "") + (" qreg" if meta["Q_REGS"] else "")
           + (" pipe" if meta["PIPELINE_QK"] else "") + (" fastpro" if meta["FAST_PROLOGUE"] else ""))
    return dict(arch=arch, residual=residual_kind, cfg=cfg, regs=regs, spill_st=st, spill_ld=ld, smem=smem,
                fits=smem <= SMEM_LIMIT[arch])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", action="store_true")
    args = ap.parse_args()
    bad = 0
    # the default config, then the packed-exponential (fastexp "f16x2": inline ex2.approx.f16x2) and lazy-rescale
    # paths at the default tile: every residual kind, every architecture
    for exp, lazy in ((None, None), ("f16x2", False), ("f16x2", True), ("fp32", True)):
        for arch in (90, 80, 89):
            for kind in (None, "plain", "fp8_row", "int4_row", "int4_group"):
                r = report(arch, kind, exp=exp, lazy_rescale=lazy)
                bad += r["spill_st"] > 0 or not r["fits"]
                print(r, flush=True)
    if args.variants:  # bench_kernels.py --reuse's other tiles (REUSE_TILES) and a few more, on sm_90
        for bn, w, st in ((64, 8, 3), (128, 8, 3), (64, 4, 2), (32, 4, 3)):
            for exp, lazy in (("fp32", False), ("f16x2", False), ("fp32", True), ("f16x2", True)):
                print(report(90, "plain", block_n=bn, num_warps=w, num_stages=st, maxnreg=0, exp=exp,
                             lazy_rescale=lazy), flush=True)
        for st, fp in ((5, False), (3, True), (5, True)):  # bench_kernels --quick: 5 stages, short prologue
            for kind in (None, "plain", "fp8_row", "int4_row"):
                print(report(90, kind, num_stages=st, fast_prologue=fp), flush=True)
        for bn, qr in ((32, False), (64, False), (64, True)):  # next tile's QK^T first (pipeline_qk)
            for kind in ("plain", "int4_row"):
                print(report(90, kind, block_n=bn, num_warps=8, num_stages=3, maxnreg=0, exp="fp32", lazy_rescale=True,
                             q_regs=qr, pipeline_qk=True), flush=True)
        for bn, cap in ((32, 128), (32, 0), (64, 0), (128, 0)):  # Q in registers (q_regs)
            for exp, lazy in (("fp32", False), ("fp32", True), ("f16x2", True)):
                for kind in ("plain", "int4_row"):
                    print(report(90, kind, block_n=bn, num_warps=8, num_stages=3, maxnreg=cap, exp=exp,
                                 lazy_rescale=lazy, q_regs=True), flush=True)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
