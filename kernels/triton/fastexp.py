"""Base-2 exponentials for the Triton softmax loops: fp32 MUFU, packed half precision, and its interpreter stand-in.

The attention kernels spend one MUFU ``ex2`` per score; MUFU issues at a quarter of the FMA rate (16 results per clock
per SM on sm_80-sm_90), so at D = 128 the exponentials of a 128 x 128 tile take about half as long as its two tensor
core products. ``ex2.approx.f16x2`` (PTX ISA 7.0, sm_75+) computes two exponentials per MUFU instruction: the
argument is rounded to fp16 (|x| < 16: absolute error <= 2^-8, i.e. <= 0.3 % relative on 2^x) and the result is
fp16 (relative precision 2^-11 plus the instruction's own approximation error, about 2^-10; PTX ISA manual,
"ex2"). The callers cast P to bf16/fp16 for the P @ V product anyway (bf16 rounding: 2^-9 relative).

Modes (the ``MODE`` constexpr of ``exp2``): 0 = fp32 ``tl.math.exp2`` (any backend, the interpreter included);
1 = packed ``ex2.approx.f16x2`` through inline PTX (CUDA only: inline assembly does not run under TRITON_INTERPRET);
2 = the same roundings as mode 1 in plain Triton (fp16 argument, fp32 exp2, fp16 result): what CPU tests run in
place of mode 1. Modes 1 and 2 return fp16, mode 0 returns fp32. ``mode_for`` is the dispatch rule.
"""

from __future__ import annotations

import triton
import triton.language as tl

FP32, F16X2, F16_EMULATED = 0, 1, 2
MODES = {"fp32": FP32, "f16x2": F16X2, "f16_emulated": F16_EMULATED}


@triton.jit
def exp2_f16x2(x):
    """2^x of an fp32 tensor as fp16, two per MUFU instruction (``ex2.approx.f16x2``; CUDA sm_75+ only)."""
    return tl.inline_asm_elementwise(
        "ex2.approx.f16x2 $0, $1;", "=r,r", [x.to(tl.float16)], dtype=tl.float16, is_pure=True, pack=2
    )


@triton.jit
def exp2_f16_emulated(x):
    """``exp2_f16x2``'s roundings in plain Triton (fp16 argument, fp16 result): runs under the interpreter."""
    return tl.math.exp2(x.to(tl.float16).to(tl.float32)).to(tl.float16)


@triton.jit
def exp2(x, MODE: tl.constexpr):
    """2^x of an fp32 tensor: fp32 for MODE 0, fp16 for MODE 1 (packed PTX) and 2 (its emulation)."""
    if MODE == 1:
        return exp2_f16x2(x)
    elif MODE == 2:
        return exp2_f16_emulated(x)
    else:
        return tl.math.exp2(x)


def mode_for(requested: str, capability: tuple[int, int] | None) -> int:
    """The ``MODE`` to compile for ``requested`` ("fp32", "f16x2", "f16_emulated") on a CUDA capability (None: the
    interpreter). "f16x2" falls back to fp32 where the PTX cannot run: under the interpreter (capability None) and
    below sm_75. "f16_emulated" is for tests and runs anywhere.

    Raises:
        ValueError: an unknown mode name.
    """
    if requested not in MODES:
        raise ValueError(f"exp mode must be one of {sorted(MODES)}, got {requested!r}")
    mode = MODES[requested]
    if mode == F16X2 and (capability is None or tuple(capability) < (7, 5)):
        return FP32
    return mode
