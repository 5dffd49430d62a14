"""Offline per-key-tile instruction counts of the CuTeDSL sparse kernel against flash-attn-4's dense sm90 forward (issue
16; no GPU needed; not collected by pytest).

Compiles, for sm_90a on the CPU (``CUTE_DSL_ARCH``), flash-attn-4's sm90 forward as the races time it (bf16, head dim
128, its default 128 x 128 tiles, LSE; built from FakeTensors with ``FLASH_ATTENTION_ARCH=sm_90``) and our
staged-epilogue kernel (``kernels/cutedsl/compile.compile_fake``, bf16, D = 128, LSE) with each option set given
(default: ``rules.STAGED_OPTIONS``), disassembles both (the bundled cuobjdump) and finds their loops (a backward branch
and its target): the consumers' key-tile step (the smallest loop with 16 HGMMA: the Q K^T and P V of one 64-row
warpgroup) and, for ours, the producer's K/V loop (the smallest loop without HGMMA and with at least 32 LDGSTS; it
includes the once-per-item query hook). Prints each loop's instructions per warp by opcode, side by side.

Usage (the offline CuTeDSL site on PYTHONPATH, as tests/test_cutedsl_backend.py's offline compiles):
    python tests/sass_cutedsl_loops.py [--options "a,b;c,d"] [--no-dense]
(the cubins stay in $CUTE_DSL_DUMP_DIR, a fresh temporary directory unless set)
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
os.environ.setdefault("FLASH_ATTENTION_ARCH", "sm_90")
os.environ.setdefault("FLASH_ATTENTION_NUM_SMS", "132")
os.environ["CUTE_DSL_KEEP"] = "cubin"
DUMP = Path(os.environ.setdefault("CUTE_DSL_DUMP_DIR", tempfile.mkdtemp(prefix="sass_cutedsl_")))  # read at import

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "comfyui_mc_sparse"))
import _standalone  # noqa: E402

_standalone.load_pack()
import torch  # noqa: E402

from comfyui_mc_sparse_pack.kernels.cutedsl import rules  # noqa: E402

_LINE = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);")
_BRA = re.compile(r"\bBRA(?:\.\w+)*\s+(?:`\(.*?\)\s*)?0x([0-9a-f]+)")


def sass_of(cubin: Path) -> list[tuple[int, str]]:
    """(address, instruction) of every SASS instruction in ``cubin`` (cuobjdump -sass)."""
    import triton.backends.nvidia as tn
    tool = Path(tn.__file__).parent / "bin" / "cuobjdump"
    text = subprocess.run([str(tool), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    return [(int(m.group(1), 16), m.group(2).strip()) for m in map(_LINE.match, text.splitlines()) if m]


def opcode(ins: str) -> str:
    """The opcode of one instruction, its predicate guard dropped."""
    return re.sub(r"^@!?U?P\w+\s+", "", ins).split()[0]


def loops(sass):
    """Histogram (Counter of opcodes) of every loop: the instructions from a backward branch's target to it."""
    out = []
    for addr, ins in sass:
        m = _BRA.search(ins)
        if m and int(m.group(1), 16) <= addr:
            lo = int(m.group(1), 16)
            out.append((lo, addr, collections.Counter(opcode(i) for a, i in sass if lo <= a <= addr)))
    return out


def pick(found, hgmma: int, min_ldgsts: int = 0):
    """The smallest loop with ``hgmma`` HGMMA and at least ``min_ldgsts`` LDGSTS (None if none)."""
    def count(c, prefix):
        return sum(v for k, v in c.items() if k.startswith(prefix))
    fit = [f for f in found if count(f[2], "HGMMA") == hgmma and count(f[2], "LDGSTS") >= min_ldgsts]
    return min(fit, key=lambda f: sum(f[2].values()), default=None)


def new_cubin(build) -> Path:
    """The cubin that ``build()`` (one compile) writes to the dump directory (kernels of one signature share a file
    name: the newest one)."""
    t0 = time.time() - 1
    build()
    return max((p for p in DUMP.glob("*.cubin") if p.stat().st_mtime >= t0), key=lambda p: p.stat().st_mtime)


def dense_build():
    """flash-attn-4's sm90 forward (bf16, D 128, LSE) compiled from FakeTensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from flash_attn.cute.interface import _flash_attn_fwd
    with FakeTensorMode():
        q, k, v = (torch.empty(1, 4096, 12, 128, dtype=torch.bfloat16, device="cuda") for _ in range(3))
        _flash_attn_fwd(q, k, v, return_lse=True)


def ours_build(options: tuple):
    from comfyui_mc_sparse_pack.kernels.cutedsl import compile as cc
    return lambda: cc.compile_fake("bfloat16", 128, True, "none", epilogue="smem", options=options)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--options", default=",".join(rules.STAGED_OPTIONS), help='";"-separated option sets')
    ap.add_argument("--no-dense", action="store_true", help="ours only (no flash-attn-4 compile)")
    args = ap.parse_args()
    cols = {} if args.no_dense else {"fa4 step": pick(loops(sass_of(new_cubin(dense_build))), 16)}
    for i, raw in enumerate(x for x in args.options.split(";") if x):
        found = loops(sass_of(new_cubin(ours_build(tuple(o for o in raw.split(",") if o)))))
        cols[f"[{i}] step"] = pick(found, 16)
        cols[f"[{i}] producer"] = pick(found, 0, 32)
        print(f"[{i}] = {raw}")
    names = [n for n, f in cols.items() if f is not None]
    ops = sorted({k for n in names for k in cols[n][2]}, key=lambda k: -sum(cols[n][2][k] for n in names))
    print(f"{'opcode':32s}" + "".join(f"{n:>14s}" for n in names))
    for k in ops:
        print(f"{k:32s}" + "".join(f"{cols[n][2][k]:14d}" for n in names))
    print(f"{'total':32s}" + "".join(f"{sum(cols[n][2].values()):14d}" for n in names))
    for n in names:  # where each loop sits (the kernel's speed depends on it: docs/kernels.md, session 12)
        print(f"loop {n}: {cols[n][0]:#x}-{cols[n][1]:#x}")
    print(f"cubins in {DUMP}")


if __name__ == "__main__":
    main()
