"""The fused top-K's two-keys-per-word sweeps (``kernels/cutedsl/swar16.py``, ``Pass2Sm90(swar=True)``) on the CPU:
the same helper functions the kernel traces, applied to numpy int32 words, in a lane-by-lane emulation of the two
sweeps of ``Pass2Sm90._count_sweep_swar`` / ``_compact_sweep_swar`` (32 lanes, 16-byte vectors v = step * 32 + lane,
a ragged last step, the warp's prefix counts); their result against ``kernels/reference/topk.py`` on float16 rows with
ties, twin keys (every sum equal to its neighbour's), zeros, -0.0, subnormals, +inf and K from 1 to Sk. The kernel's
transcription of the same steps is checked on the GPU (tests/test_gpu_cutedsl_pass2.py, fused cases with ``swar``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from comfyui_mc_sparse_pack.kernels.cutedsl import swar16
from comfyui_mc_sparse_pack.kernels.reference.topk import top_k_rows

LANES = 32


def _keys_ref(row16: np.ndarray) -> np.ndarray:
    """``topk._keys``: the float16 bits as int16, negatives and -0.0 -> 0."""
    return np.maximum(row16.view(np.int16).astype(np.int32), 0)


def _words(row16: np.ndarray) -> np.ndarray:
    """The row as [vectors, 4] int32 words (low half = the lower-indexed sum), as the kernel's 16-byte loads."""
    return row16.view(np.int32).reshape(-1, 4)


def _count_sweep(words, lo, hi):
    """``_count_sweep_swar``: (keys > hi, the keys in [lo, hi] as copied). Per step the lanes' vectors."""
    n_vec = words.shape[0]
    hi2, lo2 = swar16.pair(np.int32(hi + 1)), swar16.pair(np.int32(lo))
    above = np.zeros(LANES, np.int32)
    copies = []
    for step in range(-(-n_vec // LANES)):
        v = step * LANES + np.arange(LANES)
        valid = (np.int32(0) - (v < n_vec).astype(np.int32)).astype(np.int32)
        w = words[np.minimum(v, n_vec - 1)]  # past the row: the last vector again (masked)
        for k in range(4):
            kk = swar16.keys(w[:, k])
            a = swar16.at_least(kk, hi2) & valid
            m = swar16.ones(swar16.at_least(kk, lo2) & ~a & valid)
            above += swar16.ones(a)
            for hh in range(2):
                inside = (m >> (16 * hh)) & 1
                copies += list(((kk >> (16 * hh)) & swar16.HALF_MASK)[inside != 0])
    return int(sum(swar16.total(above))), sorted(int(c) for c in copies)


def _compact_sweep(words, thr, need, num_keys):
    """``_compact_sweep_swar``: the selected indices in the order written (slots 0 .. num_keys - 1)."""
    n_vec = words.shape[0]
    t1, t0 = swar16.pair(np.int32(thr + 1)), swar16.pair(np.int32(thr))
    sel = np.full(num_keys, -1, np.int64)
    n_gt = n_eq = 0
    for step in range(-(-n_vec // LANES)):
        v = step * LANES + np.arange(LANES)
        valid = (np.int32(0) - (v < n_vec).astype(np.int32)).astype(np.int32)
        w = words[np.minimum(v, n_vec - 1)]
        gsum = np.zeros(LANES, np.int32)
        esum = np.zeros(LANES, np.int32)
        gbits = np.zeros(LANES, np.int32)
        ebits = np.zeros(LANES, np.int32)
        for k in range(4):
            kk = swar16.keys(w[:, k])
            gt = swar16.at_least(kk, t1) & valid
            eq = swar16.ones(swar16.at_least(kk, t0) & ~gt & valid)
            gt = swar16.ones(gt)
            gsum += gt
            esum += eq
            gbits |= gt << k
            ebits |= eq << k
        packed = swar16.total(gsum) + (swar16.total(esum) << 16)
        incl = np.cumsum(packed).astype(np.int32)
        excl = incl - packed
        for lane in range(LANES):
            eq_b = n_eq + (int(excl[lane]) >> 16)
            pos = n_gt + (int(excl[lane]) & 0xFFFF) + min(eq_b, need)
            boundary = eq_b < need < eq_b + (int(packed[lane]) >> 16)  # the vector where the keys == T run out
            takes = int(gbits[lane] | (ebits[lane] & (np.int32(0) - np.int32(eq_b < need))))  # all or none
            for e in range(8):
                bit = 16 * (e % 2) + e // 2
                if boundary:
                    take = ((int(gbits[lane]) >> bit) & 1) | (((int(ebits[lane]) >> bit) & 1) & int(eq_b < need))
                    eq_b += (int(ebits[lane]) >> bit) & 1
                else:
                    take = (takes >> bit) & 1
                if take and pos < num_keys:
                    assert sel[pos] == -1, "a slot written twice"
                    sel[pos] = int(v[lane]) * 8 + e
                pos += take
        n_gt += int(incl[-1]) & 0xFFFF
        n_eq += int(incl[-1]) >> 16
    return sel


def _row(rng, sk, kind):
    x = rng.standard_exponential(sk) * 10.0 ** rng.uniform(-9, 0, sk)  # spans float16 subnormals to ~10
    if kind == "coarse":  # few distinct values: ties everywhere
        x = np.round(rng.uniform(0, 4, sk)) * 0.25
    if kind == "twins":
        x[1::2] = x[0::2][: sk // 2]
    r = x.astype(np.float16)
    if kind == "specials":
        r[rng.integers(0, sk, 8)] = np.float16("inf")
        r[rng.integers(0, sk, 8)] = np.float16(-0.0)
        r[rng.integers(0, sk, 8)] = np.float16(0.0)
        r[rng.integers(0, sk, 8)] = np.float16(6e-8)  # the smallest subnormal
    return r


@pytest.mark.parametrize("kind", ["plain", "coarse", "twins", "specials"])
@pytest.mark.parametrize("sk", [8, 264, 4000])
def test_swar_sweeps_equal_the_reference_top_k(kind, sk):
    """Count sweep: keys > hi and the copies of the keys in [lo, hi] equal the per-key definition for random
    brackets; then (threshold and need from the copies, as ``_select_row``) the compaction sweep's selection equals
    ``reference.top_k_rows`` for K in {1, random, Sk}, every slot written once."""
    rng = np.random.default_rng(sk * 7 + len(kind))
    for trial in range(6):
        row = _row(rng, sk, kind)
        ref_keys = _keys_ref(row)
        words = _words(row)
        for num_keys in sorted({1, int(rng.integers(1, sk + 1)), sk}):
            kth = int(np.sort(ref_keys)[::-1][num_keys - 1])
            lo = int(rng.integers(0, kth + 1))  # a bracket that holds the K-th key: lo <= kth <= hi
            hi = int(min(kth + rng.integers(0, 3000), 0x7C01))
            above, copies = _count_sweep(words, lo, hi)
            assert above == int((ref_keys > hi).sum())
            assert copies == sorted(ref_keys[(ref_keys >= lo) & (ref_keys <= hi)].tolist())
            kk_rank = num_keys - above
            cand = np.array(copies)
            thr = max(t for t in range(lo, hi + 1) if (cand >= t).sum() >= kk_rank)
            need = kk_rank - int((cand > thr).sum())
            got = _compact_sweep(words, thr, need, num_keys)
            want = top_k_rows(torch.from_numpy(row.astype(np.float32))[None], num_keys, num_keys)[0].numpy()
            assert np.array_equal(got, want), (kind, sk, num_keys, trial)


def test_swar_helpers_per_half():
    """``keys`` / ``at_least`` / ``ones`` / ``total`` on every pair of edge keys and thresholds, half by half."""
    edge = np.array([0x0000, 0x0001, 0x03FF, 0x0400, 0x3C00, 0x7BFF, 0x7C00, 0x7C01, 0x7E00, 0x7FFF,
                     0x8000, 0x8001, 0xBC00, 0xFC00, 0xFE00, 0xFFFF], np.uint32)
    lo_h, hi_h = np.meshgrid(edge, edge)
    words = (lo_h.ravel() | (hi_h.ravel() << 16)).view(np.int32)
    want_keys = [np.where(h >= 0x8000, 0, h).astype(np.int32) for h in (lo_h.ravel(), hi_h.ravel())]
    kk = swar16.keys(words)
    assert np.array_equal(kk & 0xFFFF, want_keys[0]) and np.array_equal((kk >> 16) & 0xFFFF, want_keys[1])
    for t in (0, 1, 0x3C00, 0x7C00, 0x7C01, 0x7C02, 0x7FFF):
        c = swar16.ones(swar16.at_least(kk, swar16.pair(np.int32(t))))
        assert np.array_equal(c & 0xFFFF, (want_keys[0] >= t).astype(np.int32))
        assert np.array_equal(c >> 16, (want_keys[1] >= t).astype(np.int32))
        assert np.array_equal(swar16.total(c), (want_keys[0] >= t).astype(np.int32) + (want_keys[1] >= t))
