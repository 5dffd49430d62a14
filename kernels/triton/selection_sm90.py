"""Warp-specialised pass 2 for Hopper (sm_90) in Gluon: the float8 group sums of ``selection._group_prob_sums_pair``.

Same contract, operands and arithmetic as the Triton pair kernel with ``FP8=True`` (MC-Sparse sec. 3.3; the float8
operands of ``selection.fp8_operands``): for two query groups of one (b, h) per program,
``sums[b, h, g, j] = 2^KB[b, h, j] x sum over the group's queries i of 2^((q8_i . k8_j) * QF[b*H + h] - LSE_s[i] *
log2(e))``, stored in the output's dtype (float16 in ``select_kv``'s scratch). With ``poly`` 0 each score is one
FFMA, one MUFU ex2 and one FADD as in the Triton kernel (the same fp32 accumulator from the same e4m3 wgmma, the same
ex2.approx; only the order of the fp32 additions of a key's row sum may differ). ``poly`` 10-22 sum the rows on
the tensor cores instead: the tile's exponentials rounded to bfloat16 (the register A operand) times a [queries, 8]
bfloat16 tile with ones in column 0 (m64n8k16 wgmmas into fp32), one F2FP per two scores instead of one FADD per
score and no reduction chains (20-22: each tile's row-sum wgmma waited for after the next tile's exponentials). Their
sums differ from the fp32 ones by the bfloat16 rounding of each term (relative L2 per group ~3.5e-4 on the H200);
they measured far slower there (round s6r2, see ``config``): every such wgmma is a warpgroup-wide operation.

What is different is the schedule. The Triton kernel runs one warpgroup that issues the wgmma, waits for it, then
takes the exponentials, so the tensor cores and the MUFU units mostly take turns (docs/kernels.md, "select_kv").
Here one program is three warpgroups (``gl.warp_specialize``):

- a producer warpgroup (few registers; one thread issues) streams the head's keys with TMA, ``BLOCK_N`` = 64 keys x
  D float8 per stage, into a ``NUM_STAGES``-deep shared-memory ring (mbarriers ``k_ready`` with the TMA transaction
  count, ``k_empty`` released by both consumers). Keys are contiguous rows of the float8 copy, so a stage is one
  TMA tile; the ring always holds a whole number of consumer steps (tiles past Sk are read, computed, not stored);
- two consumer warpgroups, one per query group (the default partition takes group 2i, a worker group 2i + 1): each
  gathers its 128 query rows through ``perm`` into shared memory and its queries' LSE into registers once, then per
  pair of key tiles issues both ``S^T = K_tile Q^T`` wgmmas (64 keys x 128 queries, fp32), waits for the first,
  releases its stage and takes its exponentials and row sums while the second is still on the tensor cores, then
  the second. The two warpgroups run independently, so one's exponentials also overlap the other's products.

Options (``launch_args``): ``pingpong`` (the consumers take turns issuing their products, FA3's schedule),
``thread_arrive`` (stage releases per thread, no warpgroup barrier per tile), ``ksplit`` (a program takes 1/ksplit
of the keys: the sums over a group's queries are complete per key, so splits need no merge), ``poly`` shares of the
exponentials on the FMA pipe, ``groups`` 3, ``unroll`` 1 / 4, and two timing floors (no exponential; no product).

Shared memory: 2 x 128 x D (queries) + NUM_STAGES x 64 x D (keys) bytes + 2 x 2 KiB (the ones tiles): D = 128,
8 stages: ~100 KiB.
Runs on CUDA sm_90 only (wgmma, TMA, ``setmaxnreg``); Gluon has no interpreter mode in Triton 3.6, so CPU tests cover
the dispatch, refusals and fallback in ``selection.group_prob_sums`` and the offline compile
(``tests/ptxas_select.py --gluon``); ``tests/test_gpu_pass2_gluon.py`` checks it against float64 and the Triton
kernel on the GPU.
"""

from __future__ import annotations

import os

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from . import pass2_dispatch

CAPABILITIES = ((9, 0),)
HEAD_DIMS = (64, 128)
BLOCK_M = 128  # queries per group (one consumer warpgroup's wgmma N)
BLOCK_N = 64  # keys per ring stage (one wgmma's M)
_LOG2E = 1.4426950408889634


def config(head_dim: int) -> dict:
    """Launch config: ring depth and the register split (12 warps: 2 consumer warpgroups + 1 producer warpgroup)."""
    # poly 0 (FADD row sums), kb_poly False (2^KB by MUFU): the configuration measured in session 5 (kernel alone
    # 0.5225 of flash-attn-4 dense at 1.3B 480p, s5r2). The tensor-core row sums (poly 20, with 2^KB precomputed) were
    # this config for round s6r2 and measured far slower there: select_kv(gluon=True) 0.752-0.779 of dense at 1.3B
    # 480p against 0.559-0.568 for the Triton default (race 1, the method of record; correct: within 3.5e-4 of the
    # Triton kernel's sums). The kernel runs only with gluon=True / MC_SPARSE_PASS2_GLUON=1 (GLUON_DEFAULT is off).
    return dict(num_stages=8, consumer_regs=232, producer_regs=40, maxnreg=168, unroll=2, poly=0, kb_poly=False, groups=2,
                thread_arrive=False, pingpong=False, ksplit=1)


def refusal(q8: torch.Tensor, k8: torch.Tensor, group_size: int, out: torch.Tensor) -> str | None:
    """Why this kernel cannot run a float8 pass 2 call (None when it can): device, the interpreter, capability,
    operand dtype and layout (the contiguous float8 copies of ``fp8_operands``), head dim, group width, output dtype."""
    if q8.device.type != "cuda":
        return f"needs a CUDA device, got {q8.device.type}"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "not under the Triton interpreter (Gluon has no interpreter mode)"
    why = pass2_dispatch.operand_refusal(q8, k8, group_size, capabilities=CAPABILITIES, head_dims=HEAD_DIMS,
                                         max_group=BLOCK_M)
    if why is not None:
        return why
    if out.dtype not in (torch.float16, torch.float32):
        return f"sums must be float16 or float32, got {out.dtype}"
    return None


@gluon.jit
def _producer(k_desc, k_smem, k_ready, k_empty, row0, n_tiles, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr):
    """TMA loads of key tiles row0 + t * BLOCK_N (t < n_tiles) into the ring (stage t % NUM_STAGES)."""
    for t in range(n_tiles):
        s = t % NUM_STAGES
        mbarrier.wait(k_empty.index(s), ((t // NUM_STAGES) & 1) ^ 1)  # a fresh barrier passes parity 1
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [row0 + t * BLOCK_N, 0], k_ready.index(s), k_smem.index(s))


@gluon.jit
def _release(bar, THREAD_ARRIVE: gl.constexpr):
    """A consumer warpgroup's release of a key stage: one elected thread after a warpgroup barrier (barrier count 1
    per warpgroup), or THREAD_ARRIVE: every thread on its own after its own wgmma wait, no warpgroup barrier (count
    128 per warpgroup; ``cp.async.mbarrier.arrive.noinc`` arrives at once: these threads have no cp.async in flight)."""
    if THREAD_ARRIVE:
        async_copy.mbarrier_arrive(bar, increment_count=False)
    else:
        mbarrier.arrive(bar, count=1)


@gluon.jit
def _exp2_fma(x):
    """2^x on the FMA/ALU pipes (no MUFU), as ``selection._exp2_fma`` (the same operations, so the same bits):
    relative error < 5e-5 for x in [-125, 0.5]; smaller x gives ~0."""
    x = gl.maximum(x, -125.0)
    t = x + 12582912.0  # 1.5 * 2^23: the add rounds x to an integer n held in t's low mantissa bits
    f = x - (t - 12582912.0)  # [-0.5, 0.5]
    p = 0.009618129 * f + 0.05550411  # Taylor series of 2^f to degree 4
    p = p * f + 0.2402265
    p = p * f + 0.6931472
    p = p * f + 1.0
    return (p.to(gl.int32, bitcast=True) + (t.to(gl.int32, bitcast=True) << 23)).to(gl.float32, bitcast=True)


@gluon.jit
def _exp2_poly3(x):
    """2^x on the FMA/ALU pipes by ``selection._exp2_poly3``'s degree-3 minimax polynomial (the same operations, so
    the same bits): relative error < 7.6e-5 for x in [-125, 127]; x < -125 gives 2^-125."""
    x = gl.maximum(x, -125.0)
    t = x + 12582912.0
    f = x - (t - 12582912.0)
    p = 0.0551716685295105 * f + 0.2426111400127411
    p = p * f + 0.6932609677314758
    p = p * f + 0.9999280571937561
    return (p.to(gl.int32, bitcast=True) + (t.to(gl.int32, bitcast=True) << 23)).to(gl.float32, bitcast=True)


@gluon.jit
def _exp2_soft(x, DEG3: gl.constexpr):
    """``_exp2_poly3`` (DEG3) or ``_exp2_fma``."""
    if DEG3:
        return _exp2_poly3(x)
    else:
        return _exp2_fma(x)


@gluon.jit
def _exp2_share(x, SHARE: gl.constexpr):
    """2^x of an S^T tile [rows, 128 queries] with SHARE eighths of it (0, 1 or 2) on the FMA pipe
    (``_exp2_poly3``) and the rest on MUFU, returned in x's layout. The accumulator column c = 16 m + 8 n + 2
    (lane % 4) + r: n, r and m are this thread's registers, so the split moves no data: 1/4 = (n, r) = (1, 1), 1/8 =
    those with odd m."""
    if SHARE == 0:
        return gl.exp2(x)
    R: gl.constexpr = x.shape[0]
    x5 = gl.permute(gl.reshape(x, [R, x.shape[1] // 16, 2, 4, 2]), (0, 1, 3, 4, 2))  # [R, m, lane, r, n]
    a, b = gl.split(x5)  # n = 0 / 1: [R, m, lane, r]
    b0, b1 = gl.split(b)  # r = 0 / 1: [R, m, lane]
    if SHARE == 2:
        e1 = _exp2_poly3(b1)
    else:
        b1m = gl.permute(gl.reshape(b1, [R, x.shape[1] // 32, 2, 4]), (0, 1, 3, 2))  # [R, m // 2, lane, m % 2]
        ev, od = gl.split(b1m)
        e1 = gl.reshape(gl.permute(gl.join(gl.exp2(ev), _exp2_poly3(od)), (0, 1, 3, 2)), [R, x.shape[1] // 16, 4])
        e1 = gl.convert_layout(e1, b1.type.layout)
    e5 = gl.join(gl.exp2(a), gl.join(gl.exp2(b0), e1))  # [R, m, lane, r, n]
    return gl.convert_layout(gl.reshape(gl.permute(e5, (0, 1, 4, 2, 3)), [R, x.shape[1]]), x.type.layout)


@gluon.jit
def _kb(kb_base, keys, SK):
    """The keys' KB terms (0 past Sk)."""
    return gl.load(kb_base + keys, mask=keys < SK, other=0.0)


@gluon.jit
def _tile_sums(acc, f, l2, kbv, s_ptr, stride_sn, keys, SK, has_g, POLY: gl.constexpr = 0,
               KB_POLY: gl.constexpr = False, ones=None):
    """One tile's group sums: row sums of 2^(acc * f - l2) (acc: S^T, keys x queries), x 2^kbv (the keys' KB),
    stored. POLY: 0 every exponential on MUFU; 1 a quarter of them on the FMA pipe (``_exp2_fma``: one of the 4
    columns a thread holds per 16, so each warp interleaves both kinds); 2 all of them on the FMA pipe; 5 / 6 as
    1 / 2 with the degree-3 ``_exp2_poly3``; 10: the row sums on the tensor cores (the exponentials rounded to
    bfloat16, times ``ones``, a [queries, 8] bfloat16 tile of ones in column 0, by a wgmma into fp32); 11 / 12: 10
    with 1/8 / 1/4 of the exponentials on the FMA pipe (``_exp2_share``). KB_POLY: the
    per-key factor 2^kbv on the FMA pipe too (each of the 4 threads of a row computes it: 3 % of the MUFU work)."""
    x = acc * f - l2[None, :]
    DEG3: gl.constexpr = POLY >= 4  # POLY 5 / 6: POLY 1 / 2 with the degree-3 polynomial (``_exp2_poly3``)
    if POLY == 8:  # no exponential at all: the timing floor of everything else (wrong sums; benchmarks only)
        col = gl.sum(x, 1)
    elif POLY >= 10:  # row sums by a wgmma: P (bf16, registers) x a column of ones (no FADD per score)
        sum_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, 8, 16])
        p16 = gl.convert_layout(_exp2_share(x, POLY - 10).to(gl.bfloat16),
                                gl.DotOperandLayout(operand_index=0, parent=sum_layout, k_width=2))
        tok = warpgroup_mma(p16, ones, gl.zeros([x.shape[0], 8], gl.float32, layout=sum_layout), use_acc=False,
                            is_async=True)
        rs, _ = warpgroup_mma_wait(num_outstanding=0, deps=(tok, p16))
        col = gl.convert_layout(gl.sum(rs, 1), gl.SliceLayout(1, acc.type.layout))
    elif POLY % 4 == 1:
        # accumulator column c = 16 * m + 8 * n + 2 * (lane % 4) + r: n and r are this thread's registers
        x5 = gl.permute(gl.reshape(x, [x.shape[0], x.shape[1] // 16, 2, 4, 2]), (0, 1, 3, 4, 2))
        a, b = gl.split(x5)  # n = 0 / 1: [rows, m, lane, r]
        b0, b1 = gl.split(b)  # r = 0 / 1: [rows, m, lane]
        p = gl.sum(gl.exp2(a), 3) + gl.exp2(b0) + _exp2_soft(b1, DEG3)
        col = gl.sum(gl.sum(p, 1), 1)  # registers first, then the 4 lanes of a row
        col = gl.convert_layout(col, gl.SliceLayout(1, acc.type.layout))
    elif POLY % 4 == 2:
        col = gl.sum(_exp2_soft(x, DEG3), 1)
    else:
        col = gl.sum(gl.exp2(x), 1)
    ok = keys < SK
    if KB_POLY == 2:  # KB holds 2^KB already (``selection.fp8_operands(kb_pow2=True)``)
        col = col * kbv
    elif KB_POLY:
        col = col * _exp2_fma(kbv)
    else:
        col = col * gl.exp2(kbv)
    gl.store(s_ptr + keys.to(gl.int64) * stride_sn, col.to(s_ptr.dtype.element_ty), mask=ok & has_g)


@gluon.jit
def _tile_p16(acc, f, l2, SHARE: gl.constexpr):
    """2^(acc * f - l2) of one tile (``_exp2_share``) in bfloat16 as the row-sum wgmma's register A operand."""
    sum_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 8, 16])
    return gl.convert_layout(_exp2_share(acc * f - l2[None, :], SHARE).to(gl.bfloat16),
                             gl.DotOperandLayout(operand_index=0, parent=sum_layout, k_width=2))


@gluon.jit
def _store_rows(rs, kbv, s_ptr, stride_sn, keys, SK, has_g, KB_POLY: gl.constexpr):
    """One tile's sums from the row-sum wgmma's accumulator ``rs`` ([keys, 8], the sum in column 0) x the keys'
    KB factor (``_tile_sums``' KB_POLY), stored."""
    col = gl.convert_layout(gl.sum(rs, 1), keys.type.layout)
    if KB_POLY == 2:
        col = col * kbv
    elif KB_POLY:
        col = col * _exp2_fma(kbv)
    else:
        col = col * gl.exp2(kbv)
    gl.store(s_ptr + keys.to(gl.int64) * stride_sn, col.to(s_ptr.dtype.element_ty), mask=(keys < SK) & has_g)


@gluon.jit
def _consumer(Q, LSE, PERM, SUMS, QF, KB, q_smem, ones_smem, k_smem, k_ready, k_empty, turn, bh, g0, S, SK, K0, n_slots,
              C, G, n_tiles, stride_sb, stride_sh, stride_sg, stride_sn, H,
              HALF: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              NUM_STAGES: gl.constexpr, UNROLL: gl.constexpr,
              POLY: gl.constexpr, KB_POLY: gl.constexpr, THREAD_ARRIVE: gl.constexpr, PINGPONG: gl.constexpr):
    """One consumer warpgroup: query group g0 + HALF against every key tile of the ring, two tiles per step.
    PINGPONG (two groups, unroll 2): the two warpgroups take turns issuing their step's products (mbarriers ``turn``:
    step j of warpgroup 0 after step j - 1 of warpgroup 1, step j of warpgroup 1 after step j of warpgroup 0), so
    the tensor cores take the products in alternation and each warpgroup's exponentials run under the other's."""
    g = g0 + HALF
    has_g = g < G  # odd G: the last program's second group computes on padding and stores nothing
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 32])
    ld: gl.constexpr = gl.BlockedLayout([1, 16], [32 // (HEAD_DIM // 16), HEAD_DIM // 16], [4, 1], [1, 0])
    bh64 = bh.to(gl.int64)
    perm_base = PERM + bh64 * n_slots + g.to(gl.int64) * C

    # the group's query rows (float8) through perm into this warpgroup's Q tile; invalid slots are zero rows
    offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ld))
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, ld))
    qi = gl.load(perm_base + offs_m, mask=(offs_m < C) & has_g, other=-1)
    q_ok = (qi >= 0) & (qi < S)
    q_rows = gl.where(q_ok, qi, 0).to(gl.int64)
    q = gl.load(Q + bh64 * S * HEAD_DIM + q_rows[:, None] * HEAD_DIM + offs_d[None, :], mask=q_ok[:, None],
                other=0.0)
    q_tile = q_smem.index(HALF)
    q_tile.store(q)
    fence_async_shared()  # generic-proxy stores, read by wgmma through the async proxy
    q_t = q_tile.permute((1, 0))  # [D, BLOCK_M]: the wgmma's B operand, K-major
    ones_k = ones_smem.index(HALF if POLY >= 10 else 0)
    if POLY >= 10:  # the row-sum wgmma's B operand, stored K-major as [8, queries]: ones in row 0, zeros elsewhere
        lo: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [1, 4], [1, 0])
        orow = gl.arange(0, 8, layout=gl.SliceLayout(1, lo))
        ocol = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, lo))
        ones_k.store(gl.where((orow[:, None] == 0) & (ocol[None, :] >= 0), 1.0, 0.0).to(gl.bfloat16))
        fence_async_shared()
    ones = ones_k.permute((1, 0))  # [queries, 8], K-major (as q_t)

    # the queries' LSE in base 2, one per accumulator column; padded / missing queries +inf (they add exactly 0)
    offs_c = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
    ci = gl.load(perm_base + offs_c, mask=(offs_c < C) & has_g, other=-1)
    c_ok = (ci >= 0) & (ci < S)
    l2 = gl.load(LSE + bh64 * S + gl.where(c_ok, ci, 0), mask=c_ok, other=float("inf")) * 1.4426950408889634
    f = gl.load(QF + bh)  # the head's q scale x k scale x softmax scale x log2(e)
    kb_base = KB + bh64 * SK + K0
    s_ptr = SUMS + (bh // H).to(gl.int64) * stride_sb + (bh % H).to(gl.int64) * stride_sh + g.to(gl.int64) * stride_sg
    s_ptr += K0.to(gl.int64) * stride_sn
    SK = SK - K0  # this program's keys from K0 on (a key split), counted from 0 below
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
    zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=s_layout)
    zero8 = gl.zeros([BLOCK_N, 8], gl.float32,
                     layout=gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 8, 16]))

    if UNROLL == 1:  # one tile per step (GROUPS = 3: the other warpgroups' exponentials overlap this product)
        for t in range(0, n_tiles):
            kv = _kb(kb_base, t * BLOCK_N + offs_n, SK)
            sk = t % NUM_STAGES
            k0 = k_smem.index(sk)
            mbarrier.wait(k_ready.index(sk), (t // NUM_STAGES) & 1)
            tok0 = warpgroup_mma(k0, q_t, zero, use_acc=False, is_async=True)
            acc0, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(tok0, k0, q_tile))
            _release(k_empty.index(sk), THREAD_ARRIVE)
            _tile_sums(acc0, f, l2, kv, s_ptr, stride_sn, t * BLOCK_N + offs_n, SK, has_g, POLY, KB_POLY, ones)
    elif UNROLL == 4:
        # four tiles per step, each product issued one tile ahead of its exponentials: tile t + 2's QK^T is issued
        # before tile t + 1's exponentials (at most two accumulators live), the pipeline drains once per 4 tiles
        for t in range(0, n_tiles, 4):
            kva = _kb(kb_base, t * BLOCK_N + offs_n, SK)
            kvb = _kb(kb_base, (t + 1) * BLOCK_N + offs_n, SK)
            kvc = _kb(kb_base, (t + 2) * BLOCK_N + offs_n, SK)
            kvd = _kb(kb_base, (t + 3) * BLOCK_N + offs_n, SK)
            ka = k_smem.index(t % NUM_STAGES)
            kb_ = k_smem.index((t + 1) % NUM_STAGES)
            kc = k_smem.index((t + 2) % NUM_STAGES)
            kd = k_smem.index((t + 3) % NUM_STAGES)
            mbarrier.wait(k_ready.index(t % NUM_STAGES), (t // NUM_STAGES) & 1)
            tok_a = warpgroup_mma(ka, q_t, zero, use_acc=False, is_async=True)
            mbarrier.wait(k_ready.index((t + 1) % NUM_STAGES), ((t + 1) // NUM_STAGES) & 1)
            tok_b = warpgroup_mma(kb_, q_t, zero, use_acc=False, is_async=True)
            acc, _ = warpgroup_mma_wait(num_outstanding=1, deps=(tok_a, ka))
            mbarrier.arrive(k_empty.index(t % NUM_STAGES), count=1)
            _tile_sums(acc, f, l2, kva, s_ptr, stride_sn, t * BLOCK_N + offs_n, SK, has_g,
                       1 if POLY == 1 else 0, KB_POLY)
            mbarrier.wait(k_ready.index((t + 2) % NUM_STAGES), ((t + 2) // NUM_STAGES) & 1)
            tok_c = warpgroup_mma(kc, q_t, zero, use_acc=False, is_async=True)
            acc, _ = warpgroup_mma_wait(num_outstanding=1, deps=(tok_b, kb_))
            mbarrier.arrive(k_empty.index((t + 1) % NUM_STAGES), count=1)
            _tile_sums(acc, f, l2, kvb, s_ptr, stride_sn, (t + 1) * BLOCK_N + offs_n, SK, has_g,
                       2 if POLY == 3 else (1 if POLY == 1 else 0), KB_POLY)
            mbarrier.wait(k_ready.index((t + 3) % NUM_STAGES), ((t + 3) // NUM_STAGES) & 1)
            tok_d = warpgroup_mma(kd, q_t, zero, use_acc=False, is_async=True)
            acc, _ = warpgroup_mma_wait(num_outstanding=1, deps=(tok_c, kc))
            mbarrier.arrive(k_empty.index((t + 2) % NUM_STAGES), count=1)
            _tile_sums(acc, f, l2, kvc, s_ptr, stride_sn, (t + 2) * BLOCK_N + offs_n, SK, has_g,
                       1 if POLY == 1 else 0, KB_POLY)
            acc, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(tok_d, kd, q_tile))
            mbarrier.arrive(k_empty.index((t + 3) % NUM_STAGES), count=1)
            _tile_sums(acc, f, l2, kvd, s_ptr, stride_sn, (t + 3) * BLOCK_N + offs_n, SK, has_g,
                       2 if POLY >= 2 else POLY, KB_POLY)
    else:
        # (the KB terms are loaded where they are used, as in the schedule measured in round 1b: the variant that
        # loaded them a step ahead measured slower at 14B 720p in round 2, 0.527 against 0.474 of dense)
        for t in range(0, n_tiles, 2):  # two tiles per step: tile t's exponentials under tile t + 1's product
            s0 = t % NUM_STAGES
            s1 = (t + 1) % NUM_STAGES
            k0 = k_smem.index(s0)
            k1 = k_smem.index(s1)
            mbarrier.wait(k_ready.index(s0), (t // NUM_STAGES) & 1)
            mbarrier.wait(k_ready.index(s1), ((t + 1) // NUM_STAGES) & 1)
            if PINGPONG:  # my turn to issue (block t // 2)
                if HALF == 0:
                    mbarrier.wait(turn.index(0), ((t // 2) & 1) ^ 1)  # a fresh barrier passes parity 1
                else:
                    mbarrier.wait(turn.index(1), (t // 2) & 1)
            if POLY >= 20:
                # the row sums' wgmmas deferred: tile t's waited for after tile t + 1's exponentials (POLY - 20:
                # ``_exp2_share``'s eighths on the FMA pipe)
                tok0 = warpgroup_mma(k0, q_t, zero, use_acc=False, is_async=True)
                tok1 = warpgroup_mma(k1, q_t, zero, use_acc=False, is_async=True)
                if PINGPONG:
                    _release(turn.index(1 - HALF), THREAD_ARRIVE)
                acc0, _ = warpgroup_mma_wait(num_outstanding=1, deps=(tok0, k0))
                _release(k_empty.index(s0), THREAD_ARRIVE)
                p0 = _tile_p16(acc0, f, l2, POLY - 20)
                ts0 = warpgroup_mma(p0, ones, zero8, use_acc=False, is_async=True)
                acc1, _ = warpgroup_mma_wait(num_outstanding=1, deps=(tok1, k1))  # QK^T of t + 1 done
                _release(k_empty.index(s1), THREAD_ARRIVE)
                p1 = _tile_p16(acc1, f, l2, POLY - 20)
                ts1 = warpgroup_mma(p1, ones, zero8, use_acc=False, is_async=True)
                rs0, _ = warpgroup_mma_wait(num_outstanding=1, deps=(ts0, p0))
                _store_rows(rs0, _kb(kb_base, t * BLOCK_N + offs_n, SK), s_ptr, stride_sn, t * BLOCK_N + offs_n, SK,
                            has_g, KB_POLY)
                rs1, _, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(ts1, p1, ones_k, q_tile))
                _store_rows(rs1, _kb(kb_base, (t + 1) * BLOCK_N + offs_n, SK), s_ptr, stride_sn,
                            (t + 1) * BLOCK_N + offs_n, SK, has_g, KB_POLY)
            else:
                if POLY == 9:  # no product: the exponentials of a made-up tile (the timing floor of the MUFU work alone)
                    acc0 = zero + (offs_n - t % 7).to(gl.float32)[:, None]
                    acc1 = zero + (offs_n - t % 5).to(gl.float32)[:, None]
                else:
                    tok0 = warpgroup_mma(k0, q_t, zero, use_acc=False, is_async=True)
                    tok1 = warpgroup_mma(k1, q_t, zero, use_acc=False, is_async=True)
                    if PINGPONG:
                        _release(turn.index(1 - HALF), THREAD_ARRIVE)
                    acc0, _ = warpgroup_mma_wait(num_outstanding=1, deps=(tok0, k0))  # tile t done, tile t + 1 in flight
                _release(k_empty.index(s0), THREAD_ARRIVE)
                _tile_sums(acc0, f, l2, _kb(kb_base, t * BLOCK_N + offs_n, SK), s_ptr, stride_sn, t * BLOCK_N + offs_n, SK,
                           has_g, 0 if POLY == 9 else POLY, KB_POLY, ones)
                if POLY != 9:
                    acc1, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(tok1, k1, q_tile))
                _release(k_empty.index(s1), THREAD_ARRIVE)
                _tile_sums(acc1, f, l2, _kb(kb_base, (t + 1) * BLOCK_N + offs_n, SK), s_ptr, stride_sn,
                           (t + 1) * BLOCK_N + offs_n, SK, has_g, 0 if POLY == 9 else POLY, KB_POLY, ones)


@gluon.jit
def _pass2_fwd_sm90(
    k_desc, Q, LSE, PERM, SUMS, QF, KB,
    H, S, SK, n_slots, C, G, TILES_PER_SPLIT,
    stride_sb, stride_sh, stride_sg, stride_sn,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, UNROLL: gl.constexpr,
    POLY: gl.constexpr, KB_POLY: gl.constexpr, GROUPS: gl.constexpr, THREAD_ARRIVE: gl.constexpr,
    PINGPONG: gl.constexpr,
    num_warps: gl.constexpr,
):
    g0 = gl.program_id(0) * GROUPS
    bh = gl.program_id(1)
    # keys [K0, K0 + n_tiles * BLOCK_N) of the head (program_id 2: the key split; a group's sum over its queries is
    # complete for each key, so splits need no merge): whole steps; tiles past Sk are read, computed, not stored
    K0 = gl.program_id(2) * TILES_PER_SPLIT * BLOCK_N
    n_tiles = gl.minimum(gl.cdiv(gl.maximum(SK - K0, 0), UNROLL * BLOCK_N) * UNROLL, TILES_PER_SPLIT)
    row0 = bh * SK + K0  # first key row of this program in the [B * H * Sk, D] view of k8

    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], gl.float8e4nv)
    q_smem = gl.allocate_shared_memory(gl.float8e4nv, [GROUPS, BLOCK_M, HEAD_DIM], q_layout)
    k_smem = gl.allocate_shared_memory(gl.float8e4nv, [NUM_STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    ones_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([8, BLOCK_M], gl.bfloat16)
    ones_smem = gl.allocate_shared_memory(gl.bfloat16, [GROUPS if POLY >= 10 else 1, 8, BLOCK_M], ones_layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(j), count=1)  # the producer's expect; TMA completes the transaction
        mbarrier.init(k_empty.index(j), count=GROUPS * (128 if THREAD_ARRIVE else 1))  # per warpgroup / thread
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(2):
        mbarrier.init(turn.index(j), count=128 if THREAD_ARRIVE else 1)  # PINGPONG: arrives by the other warpgroup

    # worker arguments are spelled out (a tuple built with + loses its constexpr wrappers in Triton 3.6)
    if GROUPS == 3:
        gl.warp_specialize([
            (_consumer, (Q, LSE, PERM, SUMS, QF, KB, q_smem, ones_smem, k_smem, k_ready, k_empty, turn, bh, g0, S, SK,
                         K0, n_slots, C, G, n_tiles, stride_sb, stride_sh, stride_sg, stride_sn, H, 0, HEAD_DIM,
                         BLOCK_M, BLOCK_N,
                         NUM_STAGES, UNROLL, POLY, KB_POLY, THREAD_ARRIVE, PINGPONG)),
            (_consumer, (Q, LSE, PERM, SUMS, QF, KB, q_smem, ones_smem, k_smem, k_ready, k_empty, turn, bh, g0, S, SK,
                         K0, n_slots, C, G, n_tiles, stride_sb, stride_sh, stride_sg, stride_sn, H, 1, HEAD_DIM,
                         BLOCK_M, BLOCK_N,
                         NUM_STAGES, UNROLL, POLY, KB_POLY, THREAD_ARRIVE, PINGPONG)),
            (_consumer, (Q, LSE, PERM, SUMS, QF, KB, q_smem, ones_smem, k_smem, k_ready, k_empty, turn, bh, g0, S, SK,
                         K0, n_slots, C, G, n_tiles, stride_sb, stride_sh, stride_sg, stride_sn, H, 2, HEAD_DIM,
                         BLOCK_M, BLOCK_N,
                         NUM_STAGES, UNROLL, POLY, KB_POLY, THREAD_ARRIVE, PINGPONG)),
            (_producer, (k_desc, k_smem, k_ready, k_empty, row0, n_tiles, BLOCK_N, NUM_STAGES)),
        ], [4, 4, 4], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])
        return
    gl.warp_specialize([
        (_consumer, (Q, LSE, PERM, SUMS, QF, KB, q_smem, ones_smem, k_smem, k_ready, k_empty, turn, bh, g0, S, SK, K0,
                     n_slots, C, G, n_tiles, stride_sb, stride_sh, stride_sg, stride_sn, H, 0, HEAD_DIM, BLOCK_M, BLOCK_N,
                     NUM_STAGES, UNROLL, POLY, KB_POLY, THREAD_ARRIVE, PINGPONG)),
        (_consumer, (Q, LSE, PERM, SUMS, QF, KB, q_smem, ones_smem, k_smem, k_ready, k_empty, turn, bh, g0, S, SK, K0,
                     n_slots, C, G, n_tiles, stride_sb, stride_sh, stride_sg, stride_sn, H, 1, HEAD_DIM, BLOCK_M, BLOCK_N,
                     NUM_STAGES, UNROLL, POLY, KB_POLY, THREAD_ARRIVE, PINGPONG)),
        (_producer, (k_desc, k_smem, k_ready, k_empty, row0, n_tiles, BLOCK_N, NUM_STAGES)),
    ], [4, 4], [CONSUMER_REGS, PRODUCER_REGS])


def k_layout(head_dim: int):
    """The shared-memory layout of a key tile (and of the TMA descriptor that fills it)."""
    return gl.NVMMASharedLayout.get_default_for([BLOCK_N, head_dim], gl.float8e4nv)


def launch_args(q8, k8, qf, lse_s, kb, perm, out, *, group_size, num_stages=None, consumer_regs=None,
                producer_regs=None, maxnreg=None, unroll=None, poly=None, kb_poly=None,
                groups=None, thread_arrive=None, pingpong=None, ksplit=None, k_desc=None):
    """(grid, positional args, meta) of one launch; the op and the offline compile share it. ``k_desc``: a prebuilt
    descriptor (the offline compile passes one on the meta device)."""
    B, H, S, D = q8.shape
    SK = k8.shape[2]
    C = group_size
    n_slots = perm.shape[-1]
    G = n_slots // C
    cfg = config(D)
    stages = num_stages or cfg["num_stages"]
    groups = int(groups or cfg["groups"])
    if groups not in (2, 3):
        raise ValueError(f"groups must be 2 or 3, got {groups}")
    if groups == 3:  # 16 warps: 3 consumer warpgroups of 160 registers, a producer of 24 (65 536 in all)
        unroll = unroll or 1
        consumer_regs = consumer_regs or 160
        producer_regs = producer_regs or 24
        maxnreg = maxnreg or 128
    unroll = int(unroll or cfg["unroll"])
    if unroll not in (1, 2, 4):
        raise ValueError(f"unroll must be 1, 2 or 4, got {unroll}")
    poly = int(cfg["poly"] if poly is None else poly)
    if poly >= 10 and unroll == 4:
        raise ValueError("poly 10 (row sums on the tensor cores) runs with unroll 1 or 2")
    if poly >= 20 and unroll != 2:
        raise ValueError("poly 20-22 (deferred row-sum wgmmas) runs with unroll 2")
    if (poly not in (0, 1, 2, 3, 5, 8, 9, 10, 11, 12, 20, 21, 22) or (poly in (2, 3) and unroll != 4)
            or (poly == 5 and unroll == 4)):
        raise ValueError(f"poly must be 0, 1, 2 / 3 with unroll 4, 5 / 10-12 without, or 8 / 9, got {poly} (unroll {unroll})")
    thread_arrive = bool(cfg["thread_arrive"] if thread_arrive is None else thread_arrive)
    pingpong = bool(cfg["pingpong"] if pingpong is None else pingpong)
    if pingpong and (unroll != 2 or groups != 2 or poly == 9):
        raise ValueError("pingpong runs with two groups, unroll 2 and the products (not poly 9)")
    if thread_arrive and unroll == 4:
        raise ValueError("thread_arrive runs with unroll 1 or 2, not 4")
    if poly == 9 and unroll != 2:
        raise ValueError("poly 9 (no product: timing floor) runs with unroll 2 only")
    if k_desc is None:
        k_desc = TensorDescriptor.from_tensor(k8.view(B * H * SK, D), [BLOCK_N, D], k_layout(D))
    ksplit = int(cfg["ksplit"] if ksplit is None else ksplit)
    if not 1 <= ksplit <= 64:
        raise ValueError(f"ksplit must be in [1, 64], got {ksplit}")
    tiles_per_split = triton.cdiv(triton.cdiv(triton.cdiv(SK, BLOCK_N), ksplit), unroll) * unroll
    grid = (triton.cdiv(G, groups), B * H, ksplit)
    args = (k_desc, q8, lse_s, perm, out, qf, kb, H, S, SK, n_slots, C, G, tiles_per_split, *out.stride())
    meta = dict(HEAD_DIM=D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, NUM_STAGES=stages,
                CONSUMER_REGS=consumer_regs or cfg["consumer_regs"], PRODUCER_REGS=producer_regs or cfg["producer_regs"],
                UNROLL=unroll, POLY=poly, KB_POLY=int(cfg["kb_poly"] if kb_poly is None else kb_poly), GROUPS=groups,
                THREAD_ARRIVE=thread_arrive, PINGPONG=pingpong,
                num_warps=4, maxnreg=maxnreg or cfg["maxnreg"])
    return grid, args, meta


def group_prob_sums_fp8(q8, k8, qf, lse_s, kb, perm, out, *, group_size, **tuning):
    """The float8 pass 2 on the warp-specialised kernel, writing ``out`` (``selection.group_prob_sums``' contract for
    the float8 path).

    Args:
        q8, k8: float8_e4m3fn ``[B, H, S, D]`` / ``[B, H, Sk, D]``, contiguous (``selection.fp8_operands``), D in
            ``HEAD_DIMS``; qf: fp32 ``[B * H]``; lse_s: fp32 ``[B, H, S]`` contiguous (natural log); kb: fp32
            ``[B, H, Sk]`` contiguous; perm: int32 ``[B, H, G * C]`` contiguous; out: fp16 / fp32 ``[B, H, G, Sk]``,
            any strides; group_size: C in (64, 128].
        tuning: ``groups`` (query groups per program = consumer warpgroups: 2, or 3 with one tile per step and
            160 registers each), ``num_stages``, ``unroll`` (1, 2 or 4 key tiles per consumer step), ``poly``
            (exponentials on the FMA pipe, ``_exp2_fma``, relative error < 5e-5, so sums within ~5e-5 of the MUFU
            ones: 1 a quarter of every tile's, with unroll 4 also 2 all of one tile in 4, 3 all of two tiles in 4;
            5 as 1 with the degree-3 ``_exp2_poly3``, 7.6e-5, unroll 1 or 2),
            ``kb_poly`` (the per-key factor on the FMA pipe; 2: ``kb`` holds 2^KB, ``fp8_operands(kb_pow2=True)``),
            ``thread_arrive`` (each consumer thread releases a key stage itself: no warpgroup barrier per tile;
            unroll 1 or 2), timing floors that write wrong sums (benchmarks only): ``poly=8`` no exponential,
            ``poly=9`` no product (unroll 2); ``pingpong`` (the two consumer warpgroups take turns issuing
            their products; two groups, unroll 2), ``ksplit`` (each program takes 1/ksplit of the keys: more,
            shorter programs, a smaller last partial wave); ``poly=10``: the row sums on the tensor cores from bfloat16
            exponentials (relative L2 of the sums ~2e-4 - 8e-4), 11 / 12 with 1/8 / 1/4 of them on ``_exp2_poly3``,
            20 / 21 / 22 as 10 / 11 / 12 with each tile's row-sum wgmma waited for after the next tile's exponentials
            (unroll 2),
            ``consumer_regs``, ``producer_regs``, ``maxnreg``.
    Returns:
        ``out``.
    Raises:
        ValueError: an odd ``num_stages``. Compile / launch errors of Triton propagate (the caller falls back).
    """
    grid, args, meta = launch_args(q8, k8, qf, lse_s, kb, perm, out, group_size=group_size, **tuning)
    _pass2_fwd_sm90[grid](*args, **meta)
    return out


def compiled_kernels() -> list:
    """Every compiled variant of the kernel in this process (triton ``CompiledKernel``), for the GPU test and the
    benchmark to read ``n_regs`` / ``n_spills`` (triton 3.x internals)."""
    out = []
    for caches in getattr(_pass2_fwd_sm90, "device_caches", {}).values():
        for ck in caches[0].values():
            ck._init_handles()
            out.append(ck)
    return out
