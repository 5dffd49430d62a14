"""Two float16 top-K keys per 32-bit word (SIMD within a register): the fused top-K's row sweeps
(``pass2_sm90.Pass2Sm90(swar=True)``) compare both float16 sums of a word with a threshold in a few integer
instructions instead of unpacking each.

A float16 sum's key is its bit pattern as an int16 with negatives (and -0.0) taken as 0 (``topk._keys``, the order of
``kernels/reference/topk.py``): for sums >= 0 the integer order of the keys is the float order, and NaN patterns rank
above +inf. Every function takes and returns int32 values holding two 16-bit halves (the word's low half is the
lower-indexed sum) and uses only ``>>``, ``<<``, ``&``, ``|``, ``~``, ``+``, ``-`` and ``*`` with wrap-around, so the same
code runs on CuTeDSL ``Int32`` values in the kernel and on numpy int32 arrays in the CPU test
(tests/test_cutedsl_pass2_swar.py). Thresholds ``t`` are keys in [0, 0x7FFF]."""

from __future__ import annotations

LOW_BITS = 0x00010001  # bit 0 of each half
TOP_BITS = -0x7FFF8000  # bit 15 of each half (0x80008000 as an int32)
HALF_MASK = 0xFFFF


def pair(t):
    """The threshold ``t`` (0 <= t <= 0x7FFF) in both halves."""
    return t | (t << 16)


def keys(w):
    """The word's two keys: each half's float16 bits, 0 where its sign bit is set (negative sums, -0.0)."""
    neg = (w >> 15) & LOW_BITS  # (an arithmetic shift: the bits above 16 are masked off)
    return w & ~(neg * HALF_MASK)


def at_least(k, t2):
    """Bit 15 of each half set where that half's key (``keys``) is >= the threshold there (``pair(t)``), else 0:
    per half 0x8000 + key - t lies in [1, 0xFFFF], so no borrow crosses the halves."""
    return ((k | TOP_BITS) - t2) & TOP_BITS


def ones(m):
    """A mask of bit-15 flags (``at_least``) as counts: 1 in bit 0 of each flagged half (sums of these add per half)."""
    return (m >> 15) & LOW_BITS


def total(c):
    """The sum of a word's two 16-bit counts (each < 0x8000)."""
    return (c & HALF_MASK) + ((c >> 16) & HALF_MASK)
