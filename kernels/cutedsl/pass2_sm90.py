"""Pass 2 of exact selection on Hopper (sm_90) in CuTeDSL: float8 group sums with the QK^T MMA overlapped with the
exponentials (MC-Sparse sec. 3.3; the sums of ``kernels/triton/selection.py``'s float8 pair kernel, ``KB_POW2``).

For a query group g of head (b, h) (C <= 128 query slots gathered through ``perm``) and every key j::

    sums[b, h, g, j] = KB2[b, h, j] * sum over the group's queries i of 2^((q8_i . k8_j) * QF[b, h] - LSE_s[i] * log2 e)

with the float8 operands of ``selection.fp8_operands(kb_pow2=True)`` (q8, k8 contiguous float8_e4m3fn copies, QF the
head's factor, LSE_s the shifted LSE, KB2 = 2^KB). Padded query slots (perm -1, or an index >= S) add exactly 0
(their LSE is +inf); keys >= Sk are never stored. The arithmetic per score is the Triton kernel's (one FFMA, one
``ex2.approx.ftz``, one FADD into a row sum; the per-key factor applied to the finished sum before the rounding to the
output dtype): only the order of the fp32 additions of a key's row sum differs. ``unit_qf`` (select_kv's default,
``UNIT_QF``): on operands with QF = 1 (``fp8_operands(unit_qf=True)``) the same sum as 2^(q8_i . k8_j) times the
query's weight 2^(-LSE_s[i] * log2 e), one FFMA per score into the row sum (no FFMA for the argument), with
``UNIT_POLY`` of every 32 columns' 2^x on the FMA pipe (a polynomial of degree ``UNIT_POLY_DEG``); heads
``selection.unit_qf_factors`` does not clear run the default form.

Schedule (the transposed form of ``selection.py``'s kernel: keys on the MMA's M, queries on N, both operands K-major
as float8 wgmma requires):

- persistent CTAs (one per SM) walk the work items (b*H + h, g) in order, groups of one head back to back (the head's
  float8 keys stay in L2 while the CTAs sweep them);
- a producer warpgroup: warp 0 issues the TMA loads of 192-key tiles (192 x D float8, 128-byte swizzle; 256 with
  ``wg4``) into a ``stages``-deep ring, warp 1 gathers each group's 128 query rows through ``perm`` (16-byte
  ``cp.async`` copies) and their LSE into a 2-slot query ring, so the next group's queries arrive while the current
  group runs;
- three consumer warpgroups (four with ``wg4``), each taking one 64-key part of every ring stage: ``S^T = K_part
  Q_g^T`` (m64n128k32 wgmmas, fp32 accumulators), waited for, then its exponentials and row sums (the tile's 64 x 128
  scores: the LSE is a per-column bias held in registers for the whole group, the key's sum is a per-row sum:
  thread-local adds in four chains and two quad shuffles); the warpgroups' wgmmas run under each other's
  exponentials (three warps per SM sub-partition share its MUFU unit). ``qsplit``: each tile as two 64 x 64
  query-half wgmmas, the second under the first half's exponentials (2: tile pairs, three of four halves so).
- ``poly``: of every 32 score columns a thread holds per row, that many take 2^x on the FMA pipe (flash-attn-4's
  degree-3 ``ex2_emulation``, relative error ~1e-4) instead of MUFU (0: none; the exact Triton arithmetic).

- ``topk`` (the top-K fused; float16 sums): producer warps 2 and 3 (idle otherwise) select the
  CTA's rows alternately while the consumers run the next items: the consumers hand over each finished row through an
  mbarrier ring (per selecting warp a full barrier every consumer thread arrives on after its last store of the row,
  and an empty barrier the warp releases once it took the row), and the warp runs ``topk.py``'s bracket method on the
  row from L2 (``_select_row``: the same sample positions and ranks, ``topk.bracket_plan``; candidates in shared
  memory; threshold by a bit search over them; compaction in ascending index order with a warp prefix count; ties to
  the lower index), writing the selection in ``select_kv``'s format. A row whose bracket the counts disprove is
  flagged and written by ``topk._radix_topk_rows`` (ONLY_FLAGGED) launched after the kernel: exact either way. With
  key parts (ksplit > 1) a row's parts come from several CTAs: the consumers fence their stores at GPU scope, each
  part's selecting warp counts it in a per-row counter (atomic, acq_rel, GPU scope) and the last one selects the row,
  reading it from L2 (``ld.global.cg``).

Contract of a launch (``Pass2Sm90.__call__``; ``group_prob_sums_fp8`` builds the views): q8 uint8 ``(B*H, S, D)``
and k8 uint8 ``(B*H, Sk, D)`` (the float8 bytes; contiguous), lse_s fp32 ``(B*H, S)``, perm int32 ``(B*H, G*C)``,
kb2 fp32 ``(B*H, Sk)``, qf fp32 ``(B*H,)`` (all unit stride on the last dim), out ``(B, H, G, Sk)`` float16 or float32
with unit stride on Sk, sel int32 ``(B, H, G, width)`` (unit stride on width) and flags int8 ``(B*H*G,)`` (with
``topk``; placeholders otherwise), the group size C (64 < C <= 128), the CTA count, the key split, and K with the
bracket plan (stride, n_samp, hi_rank, lo_rank).
Runs on CUDA sm_90 only; offline compile: ``compile_fake`` (CUTE_DSL_ARCH=sm_90a). Checked on the GPU against
float64 and the Triton kernel by tests/test_gpu_cutedsl_pass2.py.
"""

from __future__ import annotations

import math
import os
from functools import partial

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass._mlir import ir
from cutlass._mlir.dialects import vector
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.pipeline import PipelineUserType, make_pipeline_state, pipeline_init_arrive, pipeline_init_wait
from cutlass.utils import LayoutEnum
from flash_attn.cute import copy_utils as fa_copy
from flash_attn.cute import pipeline as fa_pipeline
from flash_attn.cute import utils as fa_utils
from quack import layout_utils, sm90_utils

from ..triton import pass2_dispatch
from . import pass2_launch

HEAD_DIM = 128
TILE_Q = 128  # query slots per group (the wgmma N)
HALF = 64  # keys per consumer warpgroup per stage (the wgmma M)
LOG2E = 1.4426950408889634
OUT_DTYPES = {"float16": cutlass.Float16, "float32": cutlass.Float32}
BIAS_BARRIER = 5  # named barrier 5: the consumers' in-place LSE -> bias conversion of a pair item (``pair``)
SELECT_WARPS = 2  # producer warps 2 and 3: the fused top-K's selecting warps (``topk``)
CAND_SLOTS = 16384  # each selecting warp's int16 candidate slots in shared memory (32 KiB; the bracket plan's cap at
# 14B 720p, s = 0.5: 16384)
SAMPLE_SLOTS = 1024  # the sample's slots (topk._BRACKET_MAX_SAMPLES), staged at the start of the candidate slots
KEY_TOP = 0x7C01  # one above +inf's float16 key: above every key (topk._bracket_row's ``top``)
SWEEP_BATCH = 4  # 16-byte loads per lane issued together in the selecting warps' row sweeps (latency from L2)


class _Walk:
    """The persistent walk over the work items (trace-time object; its fields are the launch's loop invariants):
    item i = (group b*H*G + ..., key part) with ``ksplit`` parts per group, parts of a group adjacent and the groups
    of one head back to back; CTA c takes items c, c + gridDim.x, ... When the grid is a multiple of ksplit (a
    group's parts then never straddle two rounds), item grp * ksplit + j of round r holds part (j + r) % ksplit, so
    a CTA's items cycle through the parts instead of all holding part c % ksplit: the fused top-K's row selection
    falls to the part that finishes last (never a short last part) and would otherwise stay on the same CTAs for
    the whole walk."""

    def __init__(self, total, n_groups, ksplit, n_tiles, part_tiles, grid):
        self.total, self.n_groups, self.ksplit = total, n_groups, ksplit
        self.n_tiles, self.part_tiles, self.grid = n_tiles, part_tiles, grid

    def at(self, item):
        """(bh, g, first key tile, tile count) of work item ``item`` (the count may be 0 for a last part)."""
        grp = item // self.ksplit
        rot = cutlass.select_(self.grid % self.ksplit == 0, item // self.grid, Int32(0))
        part = (item - grp * self.ksplit + rot) % self.ksplit
        bh = grp // self.n_groups
        p0 = part * self.part_tiles
        count = cutlass.max(cutlass.min(self.part_tiles, self.n_tiles - p0), 0)
        return bh, grp - bh * self.n_groups, p0, count

    def _fields(self):
        return (self.total, self.n_groups, self.ksplit, self.n_tiles, self.part_tiles, self.grid)

    def __extract_mlir_values__(self):
        return [v for f in self._fields() for v in cutlass.extract_mlir_values(Int32(f))]

    def __new_from_mlir_values__(self, values):
        return _Walk(*(cutlass.new_from_mlir_values(Int32(f), values[i:i + 1]) for i, f in enumerate(self._fields())))


class Pass2Sm90:
    """The kernel (module docstring). ``out_dtype``: cutlass.Float16 or Float32; ``stages``: K ring depth (24 KiB
    each, 32 with wg4); ``poly``: score columns per 32 taken by the FMA-pipe exponential (0-32)."""

    def __init__(self, out_dtype, stages: int = 4, poly: int = 0, lse_smem: bool = False, qsplit: int = 0,
                 diag: str = "", topk: bool = False, wg4: bool = False, pair: bool = False, overlap: bool = False,
                 unit_qf: bool = False, poly_deg: int = 3):
        assert out_dtype in (cutlass.Float16, cutlass.Float32), out_dtype
        assert 2 <= stages <= 8 and 0 <= poly <= 32, (stages, poly)
        self.out_dtype = out_dtype
        self.stages = stages
        self.poly = poly
        # the columns (of a thread's 32 per row) whose 2^x runs on the FMA pipe: spread evenly over the row
        self.poly_cols = frozenset((i * 32) // poly for i in range(poly)) if poly else frozenset()
        # the polynomial's degree (flash-attn-4's ``POLY_EX2``; 3: relative error ~1e-4, 2: ~2e-3 and one FFMA less)
        assert poly_deg in (2, 3), poly_deg
        self.poly_deg = poly_deg
        # the group's LSE gathered by the query-loading warp into shared memory (4-byte cp.async beside the rows;
        # padded slots copy +inf from ``mInf``) instead of 2 x 32 dependent global loads per consumer thread
        self.lse_smem = lse_smem
        # each 64-key tile as two 64 x 64 products (query halves) in the registers of one 64 x 128 accumulator: the
        # second half's wgmma runs under the first half's sums; 2: tiles two at a time, each half's wgmma issued as
        # soon as its accumulator is free
        self.qsplit = int(qsplit)
        assert self.qsplit in (0, 1, 2), qsplit
        # timing floors for the benchmark (wrong sums): "noexp" sums x itself (no MUFU), "nomma" issues no wgmma,
        # "noload" loads each CTA's first ring of key tiles only (then completes the stages without a copy: no key
        # traffic from L2; the consumers rerun stale tiles)
        assert diag in ("", "noexp", "nomma", "noload"), diag
        self.diag = diag
        # three consumer warpgroups with one accumulator each (192-key stages, one 64-key third each; 3 warps per
        # SM sub-partition, each issuing, waiting and exponentiating its own tile; H200 round s8r2: 0.484 of dense
        # against 0.534 for two warpgroups with two accumulators each, 0.571 with FA3's pingpong turns, 0.693 with
        # query-half products in four accumulators: those two-warpgroup schedules were removed in session 10)
        # wg4: four such warpgroups (256-key stages; 120 registers each, 112 with the fused top-K)
        self.nwg = 4 if wg4 else 3
        self.stage_keys = HALF * self.nwg  # keys per ring stage
        assert self.stage_keys * HEAD_DIM * stages <= 128 * 1024, "the key ring must fit 128 KiB of shared memory"
        # the fused top-K's selecting warps need more than 32 registers, and pair's query loader (two groups per item)
        # spills at 32: 152 / 56 then (offline sm_90a: no consumer spill)
        more = topk or pair
        self.mma_regs, self.producer_regs = {3: (152, 56) if more else (160, 32),
                                             4: (104, 56) if more else (112, 32)}[self.nwg]
        # (setmaxnreg moves registers only within the CTA's launch allocation: ``regs_fit``; wg4's former 120 / 24
        # and 112 / 56 asked for more than 640 threads' 96 each hold, and the unit_qf form with wg4 hung in round
        # s13r1)
        assert regs_fit(self.nwg, self.mma_regs, self.producer_regs), (self.nwg, self.mma_regs, self.producer_regs)
        self.dtype = cutlass.Float8E4M3FN
        # the top-K fused: producer warps 2 and 3 select each finished row of the CTA (``_select_rows``)
        self.topk = topk
        # pair: two query groups per work item; every key stage serves both (two wgmmas per warpgroup on the same
        # keys, half the key traffic from L2 per query); with lse_smem only
        assert not pair or lse_smem, "pair: with lse_smem"
        self.gpi = 2 if pair else 1  # query groups per work item
        assert not (pair and qsplit), "pair: no qsplit"
        # overlap (pair): both groups' wgmmas of a stage issued into two accumulators, the second group's under the
        # first group's exponentials (the consumers' 64 more registers: three warpgroups only)
        assert not overlap or (pair and self.nwg == 3), "overlap: pair without wg4"
        self.overlap = overlap
        # unit_qf: for heads whose qf is 1 (the scores come out of the wgmma in log2 units) and whose ranges allow it
        # (the host's sign of qf, ``selection.unit_qf_factors``), each score's 2^s times the query's weight
        # 2^(-LSE * log2(e)) (one per column and item) goes into the row sum by one FFMA, no FFMA for the argument
        # (MUFU + FFMA per score instead of FFMA + MUFU + FADD); other heads (qf passed negated): the default form,
        # MUFU only (``poly`` applies to the fast form then)
        # (unit_qf with pair, and with three groups per item, were measured in round s13r2 (main b2b7ec4, 1.3B 480p,
        # the kernel alone / dense 9.042 ms): 0.5117 / 0.4969 against 0.4247 without; the key stream is not what
        # limits: the "noload" floor (no key traffic) 0.4333; both removed)
        assert not (unit_qf and pair), "unit_qf: no pair"
        self.unit_qf = bool(unit_qf)
        smem = smem_bytes(stages, self.nwg, self.gpi, topk)
        assert smem <= SMEM_LIMIT, f"shared memory {smem} bytes > 227 KiB (stages {stages}, pair {pair}, topk {topk})"

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mLSE: cute.Tensor, mPerm: cute.Tensor, mKB: cute.Tensor,
                 mQF: cute.Tensor, mOut: cute.Tensor, mInf: cute.Tensor, mSel: cute.Tensor, mFlag: cute.Tensor,
                 mCnt: cute.Tensor, group_size: Int32, num_ctas: Int32, ksplit: Int32, num_keys: Int32, samp_stride: Int32,
                 n_samp: Int32, hi_rank: Int32, lo_rank: Int32, stream=None):
        # the float8 bytes as float8; (BH, S, D) -> (S, D, BH), the TMA / row-copy order
        mQ = cute.recast_tensor(mQ, self.dtype)
        mK = cute.recast_tensor(mK, self.dtype)
        mQ, mK = [layout_utils.select(t, [1, 2, 0]) for t in (mQ, mK)]
        tiled_mma = sm90_utils.make_tiled_mma(self.dtype, "K", "K", TILE_Q // 2 if const_expr(self.qsplit) else TILE_Q,
                                              "SS", (1, 1, 1))
        sQ_layout = sm90_utils.make_smem_layout(self.dtype, LayoutEnum.ROW_MAJOR, (TILE_Q, HEAD_DIM), 2 * self.gpi)
        sK_layout = sm90_utils.make_smem_layout(self.dtype, LayoutEnum.ROW_MAJOR, (self.stage_keys, HEAD_DIM),
                                                self.stages)
        tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mK, cute.select(sK_layout, mode=[0, 1]), (self.stage_keys, HEAD_DIM), 1)
        sQ_struct, sK_struct = [
            cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(layout)], 1024]
            for layout in (sQ_layout, sK_layout)
        ]
        fields = dict(mbar_k=cute.struct.MemRange[cutlass.Int64, self.stages * 2],
                      mbar_q=cute.struct.MemRange[cutlass.Int64, 2 * 2],
                      sL=cute.struct.Align[cute.struct.MemRange[Float32, 2 * self.gpi * TILE_Q], 16], sQ=sQ_struct,
                      sK=sK_struct)
        if const_expr(self.topk):  # the row ring (full / empty per selecting warp) and each warp's candidate slots
            fields["mbar_row"] = cute.struct.MemRange[cutlass.Int64, 2 * SELECT_WARPS]
            fields["sC"] = cute.struct.Align[cute.struct.MemRange[cutlass.Int16, SELECT_WARPS * CAND_SLOTS], 16]
        SharedStorage = cute.struct(type("Pass2Storage", (), {"__annotations__": fields}))
        total = mPerm.shape[0] * ((mOut.shape[2] + self.gpi - 1) // self.gpi) * ksplit
        grid_x = cutlass.min(num_ctas, total)
        self.kernel(mQ, tma_K, mLSE, mPerm, mKB, mQF, mOut, mInf, mSel, mFlag, mCnt, group_size, ksplit, num_keys,
                    samp_stride, n_samp, hi_rank, lo_rank, tma_atom_K, tiled_mma, sQ_layout, sK_layout,
                    SharedStorage).launch(grid=(grid_x, 1, 1), block=[128 * (self.nwg + 1), 1, 1],
                                                                stream=stream, min_blocks_per_mp=1)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mLSE: cute.Tensor, mPerm: cute.Tensor, mKB: cute.Tensor,
               mQF: cute.Tensor, mOut: cute.Tensor, mInf: cute.Tensor, mSel: cute.Tensor, mFlag: cute.Tensor,
               mCnt: cute.Tensor, group_size: Int32, ksplit: Int32, num_keys: Int32, samp_stride: Int32,
               n_samp: Int32, hi_rank: Int32,
               lo_rank: Int32, tma_atom_K: cute.CopyAtom,
               tiled_mma: cute.TiledMma, sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
               SharedStorage: cutlass.Constexpr):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_atom_K)
        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        Threads = partial(cutlass.pipeline.CooperativeGroup, cutlass.pipeline.Agent.Thread)
        consumer_warps = Threads(4 * self.nwg)
        pipeline_k = fa_pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_k.data_ptr(), num_stages=self.stages, producer_group=Threads(1),
            consumer_group=consumer_warps, tx_count=self.stage_keys * HEAD_DIM, defer_sync=True)
        pipeline_q = fa_pipeline.PipelineCpAsync.create(
            barrier_storage=storage.mbar_q.data_ptr(), num_stages=2, producer_group=Threads(32),
            consumer_group=consumer_warps, defer_sync=True, elect_one_release=True, syncwarp_before_release=False)
        mbar_row = None
        if const_expr(self.topk):
            mbar_row = storage.mbar_row.data_ptr()
            if warp_idx == 0:
                with cute.arch.elect_one():
                    for i in cutlass.range_constexpr(SELECT_WARPS):
                        cute.arch.mbarrier_init(mbar_row + i, 128 * self.nwg)  # full: every consumer thread
                        # empty: the selecting warp (alternate items), or both (pair: each takes one row of every item)
                        cute.arch.mbarrier_init(mbar_row + SELECT_WARPS + i, SELECT_WARPS if self.gpi == 2 else 1)
        pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sL = storage.sL.get_tensor(cute.make_layout((TILE_Q, 2 * self.gpi)))
        pipeline_init_wait(cluster_shape_mn=(1, 1))

        n_groups = mOut.shape[2]
        n_units = (n_groups + self.gpi - 1) // self.gpi  # work units (query groups, or pairs of them) per head
        total = mPerm.shape[0] * n_units * ksplit
        sk = mK.shape[0]
        n_tiles = (sk + self.stage_keys - 1) // self.stage_keys  # key tiles per group (past Sk: zeros, never stored)
        part_tiles = (n_tiles + ksplit - 1) // ksplit  # tiles per work item (a group's keys in ksplit parts)
        walk = _Walk(total, n_units, ksplit, n_tiles, part_tiles, cute.arch.grid_dim()[0])
        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                self._load_k(mK, sK, tma_atom_K, pipeline_k, walk, storage.mbar_k.data_ptr())
            if warp_idx == 1:
                self._load_q(mQ, mPerm, mLSE, mInf, sQ, sL, pipeline_q, walk, group_size, n_groups, tidx % 32)
            if const_expr(self.topk):
                if warp_idx >= 2:
                    sC = storage.sC.get_tensor(cute.make_layout((CAND_SLOTS, SELECT_WARPS)))
                    self._select_rows(mOut, mSel, mFlag, mCnt, sC, mbar_row, walk, num_keys, samp_stride, n_samp, hi_rank,
                                      lo_rank, warp_idx - 2, tidx % 32)
        else:
            cute.arch.setmaxregister_increase(self.mma_regs)
            wg = warp_idx // 4 - 1
            self._consume(tiled_mma, sQ, sK, sL, mLSE, mPerm, mKB, mQF, mOut, pipeline_k, pipeline_q, walk, group_size,
                          sk, mQ.shape[0], wg, tidx - 128 * (wg + 1), mbar_row)

    @cute.jit
    def _load_k(self, mK, sK, tma_atom_K, pipeline_k, walk, mbar_full):
        """Warp 0: the TMA loads of every work item's key tiles (tiles past Sk are zero-filled by TMA; the consumers
        compute them and store nothing); ``mbar_full``: the ring's full barriers (the "noload" floor's arrives)."""
        state = make_pipeline_state(PipelineUserType.Producer, self.stages)
        item = cute.arch.block_idx()[0]
        while item < walk.total:
            bh, _, p0, count = walk.at(item)
            gK = cute.local_tile(mK[None, None, bh], (self.stage_keys, HEAD_DIM), (None, 0))
            load, _, _ = fa_copy.tma_get_copy_fn(tma_atom_K, 0, cute.make_layout(1), gK, sK)
            load = fa_copy.tma_producer_copy_fn(load, pipeline_k)
            for j in cutlass.range(count, unroll=1):
                if const_expr(self.diag == "noload"):
                    if item == cute.arch.block_idx()[0] and j < self.stages:
                        pipeline_k.producer_acquire(state)
                        load(src_idx=p0 + j, producer_state=state)
                    else:  # the stage completed by a plain arrive (no transaction bytes): no copy
                        pipeline_k.sync_object_empty.wait(state.index, state.phase)
                        with cute.arch.elect_one():
                            cute.arch.mbarrier_arrive(mbar_full + state.index)
                else:
                    pipeline_k.producer_acquire(state)
                    load(src_idx=p0 + j, producer_state=state)
                state.advance()
            item += walk.grid

    @cute.jit
    def _load_q(self, mQ, mPerm, mLSE, mInf, sQ, sL, pipeline_q, walk, group_size, n_groups, lane):
        """Warp 1: each work item's 128 query rows through perm (16-byte cp.async copies, 8 lanes per row); padded
        slots copy row 0 (finite; their LSE of +inf makes them add 0). With ``lse_smem`` also each row's LSE (4-byte
        cp.async by the row's first lane; +inf from ``mInf`` for a padded slot) into ``sL``. With ``pair``: both
        groups of the item into the stage's two sub-slots (a group past G: all slots padded)."""
        tiled_copy = fa_copy.tiled_copy_2d(self.dtype, HEAD_DIM, 32, is_async=True)
        lse_atom = cute.make_copy_atom(cpasync.CopyG2SOp(), Float32, num_bits_per_copy=32)
        thr_copy = tiled_copy.get_slice(lane)
        state = make_pipeline_state(PipelineUserType.Producer, 2)
        n_seq = mQ.shape[0]
        cQ = cute.make_identity_tensor((TILE_Q, HEAD_DIM))
        tQcQ = thr_copy.partition_S(cQ)
        item = cute.arch.block_idx()[0]
        while item < walk.total:
            bh, unit, _, _ = walk.at(item)
            pipeline_q.producer_acquire(state)
            for gi in cutlass.range_constexpr(self.gpi):
                self._load_group(mQ, mPerm, mLSE, mInf, sQ, sL, tiled_copy, lse_atom, thr_copy, tQcQ, bh,
                                 unit * self.gpi + gi, state.index * self.gpi + gi, group_size, n_groups, n_seq, lane)
            cute.arch.cp_async_commit_group()
            pipeline_q.producer_commit(state)
            state.advance()
            item += walk.grid

    @cute.jit
    def _load_group(self, mQ, mPerm, mLSE, mInf, sQ, sL, tiled_copy, lse_atom, thr_copy, tQcQ, bh, g, slot,
                    group_size, n_groups, n_seq, lane):
        """``_load_q``'s copies of group ``g``'s rows (and LSE) into query slot ``slot``."""
        tQsQ = thr_copy.partition_D(sQ[None, None, slot])
        for m in cutlass.range_constexpr(cute.size(tQsQ, mode=[1])):
            row = tQcQ[0, m, 0][0]
            idx = Int32(-1)
            if row < group_size and g < n_groups:
                idx = mPerm[bh, g * group_size + row]
            if idx >= n_seq:
                idx = Int32(-1)
            # this thread's row of the float8 copy (16-byte aligned: D = 128 bytes), in 16-byte chunks
            row_ptr = cute.make_ptr(self.dtype, fa_utils.elem_pointer(mQ, (cutlass.max(idx, 0), 0, bh)).toint(),
                                    cute.AddressSpace.gmem, assumed_align=16)
            g_row = cute.tiled_divide(cute.make_tensor(row_ptr, cute.make_layout((HEAD_DIM,))), (16,))
            for k in cutlass.range_constexpr(cute.size(tQsQ, mode=[2])):
                chunk = tQcQ[0, m, k][1] // 16
                src = cute.make_tensor(g_row[None, chunk].iterator, tQsQ[None, m, k].layout)
                cute.copy(tiled_copy, src, tQsQ[None, m, k])
            if const_expr(self.lse_smem):
                if lane % 8 == 0:
                    l_addr = mInf.iterator.toint()
                    if idx >= 0:
                        l_addr = fa_utils.elem_pointer(mLSE, (bh, idx)).toint()
                    l_ptr = cute.make_ptr(Float32, l_addr, cute.AddressSpace.gmem, assumed_align=4)
                    l_src = cute.make_tensor(l_ptr, cute.make_layout((1,)))
                    cute.copy(lse_atom, l_src, cute.local_tile(sL[None, slot], (1,), (row,)))

    @cute.jit
    def _select_rows(self, mOut, mSel, mFlag, mCnt, sC, mbar_row, walk, num_keys, samp_stride, n_samp, hi_rank,
                     lo_rank, w, lane):
        """``topk``: selecting warp ``w`` (producer warp 2 + w) takes the CTA's items k = w, w + 2, ... (with
        ``pair``: every item k, and of it the row of group 2 * unit + w) as the row ring hands them over (slot k % 2;
        every consumer thread arrived after its last store of that item's sums) and writes each row's selection
        (``_select_row``). With ksplit > 1 a row's key parts come from several CTAs: each part's warp counts it in
        ``mCnt[row]`` (an acq_rel atomic at GPU scope; the consumers fenced their stores at GPU scope before
        arriving) and the warp that counts the last part selects the row."""
        n_heads = mOut.shape[1]
        n_groups = mOut.shape[2]
        step = 1 if const_expr(self.gpi == 2) else SELECT_WARPS  # CTA items per turn of this warp
        k = Int32(0) if const_expr(self.gpi == 2) else w
        item = cute.arch.block_idx()[0] + k * walk.grid
        while item < walk.total:
            bh, unit, _, _ = walk.at(item)
            b = bh // n_heads
            h = bh - b * n_heads
            g = unit * self.gpi + (w if const_expr(self.gpi == 2) else 0)
            row = bh * n_groups + g
            slot = k % 2
            cute.arch.mbarrier_wait(mbar_row + slot, (k // 2) % 2)
            if lane == 0:  # the slot is free again for item k + 2 (the sums of a row are never rewritten)
                cute.arch.mbarrier_arrive(mbar_row + SELECT_WARPS + slot)
            last = Int32(0)
            if g < n_groups:
                last = Int32(1)
                if walk.ksplit > 1:
                    old = Int32(0)
                    if lane == 0:
                        old = cute.arch.atomic_add((mCnt.iterator + row).llvm_ptr, Int32(1), sem="acq_rel",
                                                   scope="gpu")
                    old = cute.arch.shuffle_sync(old, 0)
                    cute.arch.fence_acq_rel_gpu()
                    last = Int32(old == walk.ksplit - 1)
            if last == 1:
                self._select_row(mOut, mSel, mFlag, sC, w, b, h, g, row, num_keys, samp_stride, n_samp, hi_rank,
                                 lo_rank, lane)
            k += step
            item += step * walk.grid

    @cute.jit
    def _load_vec(self, wsrc, v, n_vec, vec):
        """The row's 16-byte vector ``v`` (8 float16 sums as 4 int32 words) into ``vec`` (the last vector when v >=
        n_vec: an address inside the row; ``_decode`` turns those keys to -1), from L2 (``ld.global.cg``: with key
        parts from other CTAs this SM's L1 may hold stale sectors of the row)."""
        addr = (wsrc.iterator + cutlass.min(v, n_vec - 1) * 4).toint()
        ptr = cute.make_ptr(Int32, addr, cute.AddressSpace.gmem, assumed_align=16)
        v4 = cute.arch.load(ptr.llvm_ptr, ir.VectorType.get([4], Int32.mlir_type), cop="cg")  # L2: parts of other CTAs
        for k in cutlass.range_constexpr(4):
            vec[k] = Int32(vector.extract(v4, dynamic_position=[], static_position=[k]))

    @cute.jit
    def _decode(self, vec, ok, keys):
        """The 8 keys of a loaded vector (``topk._keys``: the float16 bit pattern as int16, negatives and -0.0 -> 0;
        all -1 when not ``ok``)."""
        for e in cutlass.range_constexpr(8):
            word = vec[e // 2]
            x = (word << 16) >> 16 if const_expr(e % 2 == 0) else word >> 16
            keys[e] = cutlass.select_(ok, cutlass.max(x, Int32(0)), Int32(-1))

    @cute.jit
    def _count_above(self, sC, w, lane, n, t, strict: cutlass.Constexpr):
        """How many of the first ``n`` int16 keys in ``sC[:, w]`` are >= t (> t with ``strict``), summed over the
        warp."""
        cnt = Int32(0)
        for c in cutlass.range((n + 31) // 32, unroll=1):
            idx = c * 32 + lane
            v = Int32(-1)
            if idx < n:
                v = Int32(sC[idx, w])
            if const_expr(strict):
                cnt += Int32(v > t)
            else:
                cnt += Int32(v >= t)
        return cute.arch.warp_reduction_sum(cnt)

    @cute.jit
    def _select_row(self, mOut, mSel, mFlag, sC, w, b, h, g, row, num_keys, samp_stride, n_samp, hi_rank, lo_rank,
                    lane):
        """One row's selection by ``topk.py``'s bracket method, one warp: the stratified sample (the same positions,
        staged in ``sC``) brackets the K-th largest key between its hi_rank-th and lo_rank-th largest (bit search by
        counting, both at once); one sweep (16-byte loads, 8 keys per lane, ``SWEEP_BATCH`` loads per lane issued
        before their work) counts the keys above hi and copies those in [lo, hi] to ``sC`` (ballot + popc slots); if the
        counts prove the K-th key inside (and the copies fit CAND_SLOTS) the threshold T and ``need`` come from the
        copies by a bit search, then the compaction sweep writes, in ascending index order, every index whose key is
        > T and the first ``need`` whose key == T at slots from a warp prefix count (``topk._compact_step``), then
        -1 up to the width; flag 0. Else flag 1 and the row is left to the radix launch after the kernel."""
        sk = mOut.shape[3]
        width = mSel.shape[3]
        n_vec = sk // 8
        hsrc = cute.make_tensor(
            cute.make_ptr(cutlass.Int16, fa_utils.elem_pointer(mOut, (b, h, g, 0)).toint(), cute.AddressSpace.gmem,
                          assumed_align=16), cute.make_layout((sk,)))
        wsrc = cute.make_tensor(
            cute.make_ptr(Int32, fa_utils.elem_pointer(mOut, (b, h, g, 0)).toint(), cute.AddressSpace.gmem,
                          assumed_align=16), cute.make_layout((sk // 2,)))
        # the sample (topk.sample_positions), one per samp_stride keys; -1 past n_samp
        for m in cutlass.range(SAMPLE_SLOTS // 32, unroll=4):
            jj = m * 32 + lane
            v = Int32(-1)
            if jj < n_samp:
                pos = jj * samp_stride + (jj * 97 + (jj >> 3) * 13) % samp_stride
                ptr = (hsrc.iterator + pos).llvm_ptr
                v = cutlass.max(Int32(cute.arch.load(ptr, cutlass.Int16, cop="cg")), Int32(0))
            sC[jj, w] = cutlass.Int16(v)
        # hi / lo: the largest t with at least hi_rank / lo_rank samples >= t (topk._kth_largest2; each lane reads
        # only its own samples back)
        t1 = Int32(0)
        t2 = Int32(0)
        for i in cutlass.range(15, unroll=1):
            a1 = t1 | (Int32(1) << (14 - i))
            a2 = t2 | (Int32(1) << (14 - i))
            n1 = Int32(0)
            n2 = Int32(0)
            for m in cutlass.range(SAMPLE_SLOTS // 32, unroll=8):
                v = Int32(sC[m * 32 + lane, w])
                n1 += Int32(v >= a1)
                n2 += Int32(v >= a2)
            n1 = cute.arch.warp_reduction_sum(n1)
            n2 = cute.arch.warp_reduction_sum(n2)
            t1 = cutlass.select_(n1 >= hi_rank, a1, t1)
            t2 = cutlass.select_(n2 >= lo_rank, a2, t2)
        hi = cutlass.min(t1, Int32(KEY_TOP))
        lo = cutlass.min(t2, Int32(KEY_TOP))
        cute.arch.sync_warp()  # every lane's sample reads done before the copies overwrite the slots
        vecs = [cute.make_rmem_tensor((4,), Int32) for _ in range(SWEEP_BATCH)]
        n_steps = (n_vec + 31) // 32
        n_batches = (n_steps + SWEEP_BATCH - 1) // SWEEP_BATCH
        above, n_cand = self._count_sweep(wsrc, sC, w, lane, n_vec, n_batches, lo, hi, vecs)
        above = cute.arch.warp_reduction_sum(above)
        hit = (above < num_keys) & (above + n_cand >= num_keys) & (n_cand <= CAND_SLOTS)
        if lane == 0:
            mFlag[row] = cutlass.Int8(1 - Int32(hit))
        if hit:
            cute.arch.sync_warp()  # the copies of every lane visible to all
            kk_rank = num_keys - above
            rng = hi - lo
            top = Int32(0)  # the bit length of hi - lo
            for i in cutlass.range_constexpr(16):
                if (rng >> i) > 0:
                    top = Int32(i + 1)
            thr = lo
            for i in cutlass.range(top, unroll=1):
                trial = thr + (Int32(1) << (top - 1 - i))
                cnt = self._count_above(sC, w, lane, n_cand, trial, False)
                thr = cutlass.select_(cnt >= kk_rank, trial, thr)
            need = kk_rank - self._count_above(sC, w, lane, n_cand, thr, True)
            self._compact_sweep(wsrc, mSel, b, h, g, lane, n_vec, n_batches, thr, need, num_keys, vecs)
            for c in cutlass.range((width - num_keys + 31) // 32, unroll=1):
                pos = num_keys + c * 32 + lane
                if pos < width:
                    mSel[b, h, g, pos] = Int32(-1)

    @cute.jit
    def _count_sweep(self, wsrc, sC, w, lane, n_vec, n_batches, lo, hi, vecs):
        """``_select_row``'s count / copy sweep, one key at a time: (this lane's count of keys > hi, the warp's count
        of keys in [lo, hi], copied to ``sC[:, w]`` at ballot + popc slots while they fit)."""
        lt_mask = (Int32(1) << lane) - 1
        above = Int32(0)
        n_cand = Int32(0)
        keys = cute.make_rmem_tensor((8,), Int32)
        for i in cutlass.range(n_batches, unroll=1):
            for u in cutlass.range_constexpr(SWEEP_BATCH):  # the batch's loads first: SWEEP_BATCH in flight per lane
                self._load_vec(wsrc, (i * SWEEP_BATCH + u) * 32 + lane, n_vec, vecs[u])
            for u in cutlass.range_constexpr(SWEEP_BATCH):
                self._decode(vecs[u], (i * SWEEP_BATCH + u) * 32 + lane < n_vec, keys)
                for e in cutlass.range_constexpr(8):
                    key = keys[e]
                    above += Int32(key > hi)
                    inside = (key >= lo) & (key <= hi)
                    mask = cute.arch.vote_ballot_sync(inside)
                    slot = n_cand + cute.arch.popc(mask & lt_mask)
                    if inside & (slot < CAND_SLOTS):
                        sC[slot, w] = cutlass.Int16(key)
                    n_cand += cute.arch.popc(mask)
        return above, n_cand

    @cute.jit
    def _compact_sweep(self, wsrc, mSel, b, h, g, lane, n_vec, n_batches, thr, need, num_keys, vecs):
        """``_select_row``'s compaction sweep, one key at a time: slot = (keys > T before) + min(keys == T before,
        need); every index whose key is > T and the first ``need`` whose key == T written in ascending order."""
        keys = cute.make_rmem_tensor((8,), Int32)
        n_gt = Int32(0)
        n_eq = Int32(0)
        for i in cutlass.range(n_batches, unroll=1):
            for u in cutlass.range_constexpr(SWEEP_BATCH):  # the batch's loads first
                self._load_vec(wsrc, (i * SWEEP_BATCH + u) * 32 + lane, n_vec, vecs[u])
            for u in cutlass.range_constexpr(SWEEP_BATCH):
                v = (i * SWEEP_BATCH + u) * 32 + lane
                self._decode(vecs[u], v < n_vec, keys)
                packed = Int32(0)
                for e in cutlass.range_constexpr(8):
                    packed += Int32(keys[e] > thr) + (Int32(keys[e] == thr) << 16)
                incl = packed
                for d in cutlass.range_constexpr(5):
                    up = cute.arch.shuffle_sync_up(incl, offset=1 << d)
                    if lane >= (1 << d):
                        incl += up
                excl = incl - packed
                gt_b = n_gt + (excl & 0xFFFF)
                eq_b = n_eq + (excl >> 16)
                for e in cutlass.range_constexpr(8):
                    gt = keys[e] > thr
                    eq = keys[e] == thr
                    pos = gt_b + cutlass.min(eq_b, need)
                    if (gt | (eq & (eq_b < need))) & (pos < num_keys):
                        mSel[b, h, g, pos] = v * 8 + e
                    gt_b += Int32(gt)
                    eq_b += Int32(eq)
                tot = cute.arch.shuffle_sync(incl, 31)
                n_gt += tot & 0xFFFF
                n_eq += tot >> 16

    @cute.jit
    def _bias_from_lse(self, nl2, tScS, n_cols, mLSE, mPerm, bh, g, group_size, n_seq, halves=1):
        """This thread's query columns' bias -LSE * log2(e), read through perm (-inf for padded slots: they add 0);
        ``halves`` 2 (``qsplit``): the columns of query half 0, then those of half 1 (TILE_Q // 2 further on)."""
        for c in cutlass.range_constexpr(halves * n_cols):
            col = tScS[0, c % n_cols][1] + (c // n_cols) * (TILE_Q // 2)
            idx = Int32(-1)
            if col < group_size:
                idx = mPerm[bh, g * group_size + col]
            v = -Float32.inf
            if idx >= 0 and idx < n_seq:
                v = -(mLSE[bh, idx] * Float32(LOG2E))
            nl2[c] = v

    @cute.jit
    def _bias_from_smem(self, nl2, tScS, n_cols, sL, slot, halves=1):
        """``lse_smem``: the same bias from the LSE row the query producer staged in Q slot ``slot``."""
        for c in cutlass.range_constexpr(halves * n_cols):
            nl2[c] = -(sL[tScS[0, c % n_cols][1] + (c // n_cols) * (TILE_Q // 2), slot] * Float32(LOG2E))

    @cute.jit
    def _consume(self, tiled_mma, sQ, sK, sL, mLSE, mPerm, mKB, mQF, mOut, pipeline_k, pipeline_q, walk,
                        group_size, sk, n_seq, wg, tid, mbar_row=None):
        """A consumer warpgroup: its 64-key part of every stage, one wgmma group at a time (issue,
        wait, exponentials); the warpgroups' exponentials overlap each other's wgmmas. With ``pair`` each stage serves
        the item's two groups in turn (one bias vector per group, from the LSE in shared memory; a group past G is
        computed on padded slots and not stored). With ``qsplit`` each tile is two 64 x 64 wgmmas (query halves),
        the second waited for after the first half's exponentials (qsplit 2: tile pairs, ``_qsplit_pair``). With
        ``topk``: the CTA's k-th item (its rows of sums stored) is handed to the selecting warps through the row ring
        slot k % 2 (``mbar_row``: wait for the slot's previous item to be taken, then every consumer thread arrives
        after its last store)."""
        thr_mma = tiled_mma.get_slice(tid)
        sK_part = cute.flat_divide(sK, (HALF, HEAD_DIM))[None, None, wg, 0, None]  # (64, D, stages)
        tSrK = thr_mma.make_fragment_A(thr_mma.partition_A(sK_part))
        halves = 2 if const_expr(self.qsplit) else 1  # query halves per tile (one wgmma each)
        n_q = TILE_Q // halves
        if const_expr(self.qsplit):  # (each half's B operand: the slot's query rows 0-63 / 64-127)
            sQ_h = cute.flat_divide(sQ, (n_q, HEAD_DIM))  # (64, D, 2, 1, slots)
            tSrQ = thr_mma.make_fragment_B(thr_mma.partition_B(sQ_h[None, None, 0, 0, None]))
            tSrQ1 = thr_mma.make_fragment_B(thr_mma.partition_B(sQ_h[None, None, 1, 0, None]))
        else:
            tSrQ = thr_mma.make_fragment_B(thr_mma.partition_B(sQ))
        acc0 = cute.make_rmem_tensor(thr_mma.partition_shape_C((HALF, n_q)), Float32)
        acc1 = cute.make_rmem_tensor(thr_mma.partition_shape_C((HALF, n_q)), Float32) if const_expr(
            self.overlap or self.qsplit) else acc0
        if const_expr(self.diag == "nomma"):
            self._fill_distinct(acc0, tid, 0)
            if const_expr(self.overlap or self.qsplit):
                self._fill_distinct(acc1, tid, 1)
        tScS = layout_utils.reshape_acc_to_mn(thr_mma.partition_C(cute.make_identity_tensor((HALF, n_q))))
        n_cols = cute.size(tScS, mode=[1])  # per query half with qsplit
        nl2 = cute.make_rmem_tensor((halves * n_cols,), Float32)
        part = cute.make_rmem_tensor((cute.size(tScS, mode=[0]),), Float32)
        k_state = make_pipeline_state(PipelineUserType.Consumer, self.stages)
        q_state = make_pipeline_state(PipelineUserType.Consumer, 2)
        n_heads = mOut.shape[1]
        n_groups = mOut.shape[2]
        item = cute.arch.block_idx()[0]
        k_item = Int32(0)  # this CTA's items so far (the row ring's position)
        while item < walk.total:
            bh, unit, p0, count = walk.at(item)
            b = bh // n_heads
            h = bh - b * n_heads
            qf = mQF[bh]
            if const_expr(not self.lse_smem):
                self._bias_from_lse(nl2, tScS, n_cols, mLSE, mPerm, bh, unit, group_size, n_seq, halves)
            pipeline_q.consumer_wait(q_state)
            if const_expr(self.gpi == 2):  # the item's LSE -> bias -LSE * log2(e) in place, one value per thread
                c_tid = wg * 128 + tid
                if c_tid < 2 * TILE_Q:
                    v = sL[c_tid % TILE_Q, q_state.index * 2 + c_tid // TILE_Q]
                    sL[c_tid % TILE_Q, q_state.index * 2 + c_tid // TILE_Q] = -(v * Float32(LOG2E))
                cute.arch.barrier(barrier_id=BIAS_BARRIER, number_of_threads=128 * self.nwg)
            elif const_expr(self.lse_smem):
                self._bias_from_smem(nl2, tScS, n_cols, sL, q_state.index, halves)
            if const_expr(self.unit_qf):
                if qf > Float32(0.0):  # the fast form: the columns' weights 2^bias (0 for a padded slot's -inf)
                    for c in cutlass.range_constexpr(halves * n_cols):
                        nl2[c] = cute.arch.exp2(nl2[c])
            n_rolled = Int32(0)  # tiles taken two at a time by _qsplit_pair (qsplit 2)
            if const_expr(self.qsplit == 2):
                n_rolled = count - count % 2
                for i in cutlass.range(count // 2, unroll=1):
                    k_b = k_state.clone()
                    k_b.advance()
                    self._qsplit_pair(tiled_mma, tSrK, tSrQ, tSrQ1, acc0, acc1, tScS, nl2, n_cols, part, qf, mKB, mOut,
                                      pipeline_k, k_state, k_b, q_state.index, bh, b, h, unit,
                                      (p0 + 2 * i) * self.stage_keys + wg * HALF, sk, tid)
                    k_state.advance()
                    k_state.advance()
            for i in cutlass.range(n_rolled, count, unroll=1):
                pipeline_k.consumer_wait(k_state)
                if const_expr(self.qsplit):  # both halves' wgmmas issued; the second runs under the first's sums
                    rK = tSrK[None, None, None, k_state.index]
                    self._mma(tiled_mma, acc0, rK, tSrQ[None, None, None, q_state.index])
                    self._mma(tiled_mma, acc1, rK, tSrQ1[None, None, None, q_state.index])
                    key0 = (p0 + i) * self.stage_keys + wg * HALF
                    kbv = self._kb_rows(tScS, mKB, bh, key0, sk)
                    warpgroup.wait_group(1)
                    self._rows(acc0, nl2, 0, qf, part, False)
                    warpgroup.wait_group(0)
                    pipeline_k.consumer_release(k_state)
                    self._rows(acc1, nl2, n_cols, qf, part, True)
                    self._store_rows(part, kbv, tScS, mOut, b, h, unit, key0, sk, tid)
                if const_expr(self.overlap):  # both groups' wgmmas issued; the second runs under the first's exps
                    self._mma(tiled_mma, acc0, tSrK[None, None, None, k_state.index],
                              tSrQ[None, None, None, q_state.index * 2])
                    self._mma(tiled_mma, acc1, tSrK[None, None, None, k_state.index],
                              tSrQ[None, None, None, q_state.index * 2 + 1])
                for gi in cutlass.range_constexpr(0 if const_expr(self.qsplit) else self.gpi):
                    acc = acc0
                    if const_expr(self.overlap):
                        acc = acc0 if const_expr(gi == 0) else acc1
                        warpgroup.wait_group(1 - gi)
                    else:
                        self._mma(tiled_mma, acc0, tSrK[None, None, None, k_state.index],
                                  tSrQ[None, None, None, q_state.index * self.gpi + gi])
                        warpgroup.wait_group(0)
                    if const_expr(gi == self.gpi - 1):
                        pipeline_k.consumer_release(k_state)
                    g = unit * self.gpi + gi
                    bias = nl2
                    if const_expr(self.gpi == 2):  # this group's bias row in shared memory (read per tile)
                        bias = sL[None, q_state.index * 2 + gi]
                    self._tile_sums(acc, tScS, bias, qf, mKB, mOut, bh, b, h, g,
                                    (p0 + i) * self.stage_keys + wg * HALF, sk, tid, g < n_groups,
                                    self.gpi == 2)
                k_state.advance()
            pipeline_q.consumer_release(q_state)
            q_state.advance()
            if const_expr(self.topk):
                if walk.ksplit > 1:  # the row's other parts' selecting warps read these stores (_select_rows)
                    cute.arch.fence_acq_rel_gpu()
                slot = k_item % 2
                cute.arch.mbarrier_wait(mbar_row + SELECT_WARPS + slot, ((k_item // 2) % 2) ^ 1)
                cute.arch.mbarrier_arrive(mbar_row + slot)  # release: this thread's stores of the rows before it
            k_item += 1
            item += walk.grid

    @cute.jit
    def _qsplit_pair(self, tiled_mma, tSrK, tSrQ0, tSrQ1, acc0, acc1, tScS, nl2, n_cols, part, qf, mKB, mOut, pipeline_k,
                     k_a, k_b, q_slot, bh, b, h, g, key_a, sk, tid):
        """``qsplit`` 2: two key tiles (a, then b = a + stage_keys: ring stages ``k_a``, ``k_b``) as four query-half
        wgmmas in the two half accumulators, each issued as soon as the exponentials of the half before it in the
        same accumulator are done, so every half's exponentials but tile a's first run with a wgmma in flight (none
        is in flight across the caller's loop edge)."""
        rQ0 = tSrQ0[None, None, None, q_slot]
        rQ1 = tSrQ1[None, None, None, q_slot]
        key_b = key_a + self.stage_keys
        pipeline_k.consumer_wait(k_a)
        self._mma(tiled_mma, acc0, tSrK[None, None, None, k_a.index], rQ0)
        self._mma(tiled_mma, acc1, tSrK[None, None, None, k_a.index], rQ1)
        kbv_a = self._kb_rows(tScS, mKB, bh, key_a, sk)
        kbv_b = self._kb_rows(tScS, mKB, bh, key_b, sk)
        warpgroup.wait_group(1)  # a, half 0
        self._rows(acc0, nl2, 0, qf, part, False)
        pipeline_k.consumer_wait(k_b)
        rKb = tSrK[None, None, None, k_b.index]
        self._mma(tiled_mma, acc0, rKb, rQ0)
        warpgroup.wait_group(1)  # a, half 1
        pipeline_k.consumer_release(k_a)
        self._rows(acc1, nl2, n_cols, qf, part, True)
        self._store_rows(part, kbv_a, tScS, mOut, b, h, g, key_a, sk, tid)
        self._mma(tiled_mma, acc1, rKb, rQ1)
        warpgroup.wait_group(1)  # b, half 0
        self._rows(acc0, nl2, 0, qf, part, False)
        warpgroup.wait_group(0)  # b, half 1
        pipeline_k.consumer_release(k_b)
        self._rows(acc1, nl2, n_cols, qf, part, True)
        self._store_rows(part, kbv_b, tScS, mOut, b, h, g, key_b, sk, tid)

    @cute.jit
    def _fill_distinct(self, acc, tid, j: cutlass.Constexpr):
        """The "nomma" floor's stand-in scores: distinct per element and thread (nothing the compiler can fold)."""
        for i in cutlass.range_constexpr(cute.size(acc)):
            acc[i] = Float32(tid) * Float32(-1e-3) - Float32(0.01 * (i + 64 * j))

    @cute.jit
    def _mma(self, tiled_mma, acc, rA, rB):
        """One asynchronous wgmma group acc = rA rB^T (none with the "nomma" floor)."""
        if const_expr(self.diag != "nomma"):
            sm90_utils.gemm(tiled_mma, acc, rA, rB, zero_init=True, wg_wait=-1)
        else:
            warpgroup.commit_group()

    @cute.jit
    def _exp2(self, x, c: cutlass.Constexpr, poly: cutlass.Constexpr = True):
        """2^x of column c: MUFU, or the FMA-pipe polynomial for ``poly_cols`` (with ``poly``); x itself with the
        "noexp" floor."""
        if const_expr(self.diag == "noexp"):
            return x
        elif const_expr(poly and c % 32 in self.poly_cols):
            return fa_utils.ex2_emulation(x, poly_degree=self.poly_deg)
        else:
            return cute.arch.exp2(x)

    @cute.jit
    def _row_sum(self, acc_mn, r: cutlass.Constexpr, qf, bias, c0: cutlass.Constexpr, tScS,
                 by_col: cutlass.Constexpr = False, weights: cutlass.Constexpr = False):
        """Sum over this thread's columns c of row ``r`` of 2^(acc_mn[r, c] * qf + bias[c0 + c]) (with ``by_col``:
        bias indexed by the column's query, ``tScS``) in four partial chains, each started by its first term (no add
        to zero). ``weights`` (``unit_qf``'s fast form): the sum of 2^acc_mn[r, c] * bias[c0 + c] (bias: the columns'
        weights 2^bias; qf not read)."""
        chains = [None, None, None, None]
        for c in cutlass.range_constexpr(cute.size(acc_mn, mode=[1])):
            bc = bias[tScS[0, c][1]] if const_expr(by_col) else bias[c0 + c]
            if const_expr(weights):
                e = self._exp2(acc_mn[r, c], c0 + c)
                if const_expr(c < 4):
                    chains[c] = e * bc
                else:
                    chains[c % 4] = e * bc + chains[c % 4]
            else:
                e = self._exp2(acc_mn[r, c] * qf + bc, c0 + c, not self.unit_qf)  # (unit_qf: poly in the fast form)
                if const_expr(c < 4):
                    chains[c] = e
                else:
                    chains[c % 4] = chains[c % 4] + e
        return (chains[0] + chains[1]) + (chains[2] + chains[3])

    @cute.jit
    def _part_sums(self, acc_mn, qf, bias, c0: cutlass.Constexpr, tScS, part, accumulate: cutlass.Constexpr,
                   by_col: cutlass.Constexpr = False, weights: cutlass.Constexpr = False):
        """``_row_sum`` of every row of ``acc_mn`` into ``part`` (added to it with ``accumulate``)."""
        for r in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
            s = self._row_sum(acc_mn, r, qf, bias, c0, tScS, by_col, weights)
            if const_expr(accumulate):
                part[r] = part[r] + s
            else:
                part[r] = s

    @cute.jit
    def _sums(self, acc_mn, qf, bias, c0: cutlass.Constexpr, tScS, part, accumulate: cutlass.Constexpr,
              by_col: cutlass.Constexpr = False):
        """``_part_sums``; with ``unit_qf`` the item's form by the sign of ``qf`` (uniform: one value per head): > 0
        the fast form (bias holds the weights), else the default one with qf = -qf (``group_prob_sums_fp8``)."""
        if const_expr(self.unit_qf):
            if qf > Float32(0.0):
                self._part_sums(acc_mn, qf, bias, c0, tScS, part, accumulate, by_col, True)
            else:
                self._part_sums(acc_mn, -qf, bias, c0, tScS, part, accumulate, by_col, False)
        else:
            self._part_sums(acc_mn, qf, bias, c0, tScS, part, accumulate, by_col, False)

    @cute.jit
    def _rows(self, acc, nl2, c0: cutlass.Constexpr, qf, part, accumulate: cutlass.Constexpr):
        """This thread's partial row sums of one 64 x 64 score tile (columns nl2[c0:]) into ``part`` (added to it
        with ``accumulate``)."""
        self._sums(layout_utils.reshape_acc_to_mn(acc), qf, nl2, c0, None, part, accumulate)

    @cute.jit
    def _kb_rows(self, tScS, mKB, bh, key0, sk):
        """This thread's key rows' per-key factors 2^KB (0 past Sk), loaded before the exponentials that hide them."""
        n_rows = cute.size(tScS, mode=[0])
        kbv = cute.make_rmem_tensor((n_rows,), Float32)
        for r in cutlass.range_constexpr(n_rows):
            kbv[r] = Float32(0.0)
            if key0 + tScS[r, 0][0] < sk:
                kbv[r] = mKB[bh, key0 + tScS[r, 0][0]]
        return kbv

    @cute.jit
    def _store_rows(self, part, kbv, tScS, mOut, b, h, g, key0, sk, tid, g_ok=True):
        """The quad's row sums (two shuffles) times the per-key factors ``kbv``, stored by the quad's lane 0 (not when
        ``g_ok`` is False: a pair's group past G)."""
        for r in cutlass.range_constexpr(cute.size(part)):
            key = key0 + tScS[r, 0][0]
            s = part[r]
            s += cute.arch.shuffle_sync_bfly(s, offset=1)
            s += cute.arch.shuffle_sync_bfly(s, offset=2)
            if tid % 4 == 0 and key < sk and g_ok:
                mOut[b, h, g, key] = (s * kbv[r]).to(self.out_dtype)

    @cute.jit
    def _tile_sums(self, acc, tScS, nl2, qf, mKB, mOut, bh, b, h, g, key0, sk, tid, g_ok=True,
                   bias_by_col: cutlass.Constexpr = False):
        """The group sums of this thread's two key rows of one 64 x 128 score tile, stored by the quad's lane 0 (not
        when ``g_ok`` is False: a pair's group past G). ``nl2``: this thread's column biases, or with ``bias_by_col``
        the group's 128 biases (shared memory) indexed by query column."""
        acc_mn = layout_utils.reshape_acc_to_mn(acc)
        n_rows = cute.size(acc_mn, mode=[0])
        kbv = self._kb_rows(tScS, mKB, bh, key0, sk)
        part = cute.make_rmem_tensor((n_rows,), Float32)
        self._sums(acc_mn, qf, nl2, 0, tScS, part, False, bias_by_col)
        self._store_rows(part, kbv, tScS, mOut, b, h, g, key0, sk, tid, g_ok)


# ---- host side ---------------------------------------------------------------------------------------------------

CAPABILITIES = ((9, 0),)
HEAD_DIMS = (HEAD_DIM,)
FUSED_TOPK = True  # group_prob_sums_fp8(select=...) selects each group's top-K in the same launch (select_refusal)
# the fused top-K's key split when the caller gives none: ``auto_ksplit``'s when True, else 1 (a row whole in one CTA;
# with parts, the last part's selecting warp selects the row: GPU-checked, and 2x slower at 1.3B 480p in round s9r2)
TOPK_AUTO_KSPLIT = False
# The fused top-K's config. H200 round s9r2 (main b4160ca, tests/bench_select_race.py race 1, flash-attn-4 dense,
# s = 0.1 / 0.15 / 0.25 / 0.5; all checks passed): 14B 720p select_kv with the fused top-K and pair (whole rows:
# auto_ksplit 1 there) 0.444-0.450, with the fused top-K alone 0.453-0.462, the Triton default 0.452-0.462; at
# 1.3B 480p, whose 3072 groups (1536 pairs) fill the SMs' rounds only with key parts (auto_ksplit 2 / 3), the
# CuTeDSL kernel (key parts) + the separate top-K 0.549-0.558 against the fused top-K's 0.561-0.567 (whole rows: the
# last round 27 % full; 0.94-1.08 with pair and 3 key parts) and the Triton default's 0.559-0.574. So: pair with the
# fused top-K, and the fused top-K only on walks that need no key parts (select_refusal; the caller then runs this
# kernel unfused + the separate top-K). With the unit_qf form (no pair), round s12r2 (main 3a6585e,
# tests/bench_cutedsl_pass2.py, 1.3B 480p, K = 0.5 Sk, kernel alone / dense): fused, whole rows 0.5335, with 2 key
# parts (sweeps on two keys per word) 0.8280, against this kernel + the separate top-K 0.4832 (pass2_dispatch keeps the
# fused top-K off; docs/kernels.md, session 12).
PAIR_FUSED = True
TOPK_WHOLE_WALKS_ONLY = True
# The default launch config: three consumer warpgroups with the LSE through shared memory (lse_smem), 4 stages, no
# FMA-pipe share. H200 round s8r2 (main 2a57dc8, tests/bench_select_race.py race 2, the method of record, the
# kernel alone / flash-attn-4 dense 8.954 ms at 1.3B 480p, all heads, each variant checked against the Triton sums
# first): three warpgroups + lse_smem 0.4739, without lse_smem 0.4842 (6 stages 0.4831), against 0.5336 for the two
# consumer warpgroups of session 8 (removed in session 10 with their pingpong / four-accumulator qsplit forms, 0.5714
# / 0.6933), poly 8 0.5143, and 0.5140 for the Triton one-group kernel; floors: no wgmma 0.4128 (~94 % of MUFU's 16
# exponentials per clock): the exponential side is the limit now.
STAGES = 4
# select_kv's float8 operands with qf = 1 and this kernel's unit_qf form with UNIT_POLY of every 32 columns' 2^x on
# the FMA pipe (pass2_dispatch.cute_unit_qf; MC_SPARSE_PASS2_UNIT_QF=0 restores the session-10 default: plain
# operands, the default form, POLY). H200 round s11r2 (main a2b0472, tests/bench_cutedsl_pass2.py, the kernel alone /
# flash-attn-4 dense 9.254 ms at 1.3B 480p, 7 rounds, every row checked against the Triton sums of its operands):
# the default 0.4548 (again under another name 0.4560), poly 8 0.5014; unit_qf 0.4820, + poly 4 0.4448, + poly 8
# 0.4338, + poly 12 0.4517; Mcycles per call 8.32 (default) / 7.64 (unit_qf + poly 8); floors: no wgmma 0.4112,
# unit_qf without wgmma 0.3921, no exponential 0.3221. Final round s11final (main 8d04364, dense 8.816 ms): default
# 0.4906, unit_qf + poly 8 0.4616, + poly 6 0.4647, + poly 10 0.4797; select_kv with it 0.5063-0.5174 at 1.3B
# against the session-10 route's 0.5506-0.5690 in the same races (docs/kernels.md, session 11).
UNIT_QF = True
UNIT_POLY = 8
# The polynomial's degree in the unit_qf form (the default form keeps 3). H200 round s12r2 (main 3a6585e,
# tests/bench_cutedsl_pass2.py, 1.3B 480p, the kernel alone / flash-attn-4 dense 9.123 ms, 7 rounds, every row checked
# against the Triton sums of its operands first: 5.5e-4 relative L2 with degree 2, 3.2e-4 without): unit_qf + poly 8
# 0.4422 with degree 3, 0.4270 with degree 2 (one FFMA less per polynomial exponential), poly 12 with degree 2 0.4481.
# Round s12r3 (main 9399d9e, dense 9.201 ms; its GPU test vs float64 passed first): degree 2 0.4297 (again 0.4313),
# degree 3 0.4422, poly 6 / 10 with degree 2 0.4297 / 0.4432. MC_SPARSE_PASS2_POLY_DEG=3 restores degree 3 (read at
# each call by unit_poly_degree).
UNIT_POLY_DEG = 2


def unit_poly_degree() -> int:
    """The unit_qf form's polynomial degree: ``$MC_SPARSE_PASS2_POLY_DEG`` ("2" or "3"), else ``UNIT_POLY_DEG``.

    Read at each call (not at import: a bad value at import made the module unimportable, which the pass-2 dispatch
    caches as "CuTeDSL pass 2 not available" for the whole process without naming the variable).

    Raises:
        ValueError: the variable is set to anything but "2" or "3" (the message names it).
    """
    env = os.environ.get("MC_SPARSE_PASS2_POLY_DEG", "").strip()
    if not env:
        return UNIT_POLY_DEG
    if env not in ("2", "3"):
        raise ValueError(f"MC_SPARSE_PASS2_POLY_DEG must be 2 or 3, got {env!r}")
    return int(env)


# the largest relative error of flash-attn-4's degree-2 / degree-3 polynomial 2^f on [0, 1) (numpy, 2e5 points: 2.08e-3
# / 8.8e-5): a sum of positive terms of which any share took the polynomial is within this of the MUFU sum
POLY_REL_ERROR = {2: 2.1e-3, 3: 9e-5}
# (The fast form's row sums on the tensor core instead of one FFMA per score: the exponentials converted to a
# bfloat16 A fragment (32 F2FP per 64 scores) for m64n8k16 wgmmas against the weights in shared memory, FP32-pipe
# instructions per tile 150 -> 84; round s13r3 (main 3525171, 1.3B 480p, the kernel alone / dense 9.362 ms): 0.5003,
# and with that wgmma waited for with the next tile's 0.5314, against 0.4208 / 0.4151 without: removed.)
WG4 = False  # (round s13r2: the unit_qf form with wg4 0.4543 against 0.4247 with three consumer warpgroups)
PAIR = False
OVERLAP = False
POLY = 0
LSE_SMEM = True
QSPLIT = 0
_SM_COUNT: dict = {}


def _sm_count(dev) -> int:
    """The SM count of CUDA device ``dev`` (cached)."""
    import torch

    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


SMEM_LIMIT = 227 * 1024


def config(head_dim: int = HEAD_DIM) -> dict:
    """The launch config ``group_prob_sums_fp8`` uses when the caller gives none (ksplit None: ``auto_ksplit``;
    stages: ``STAGES``, fewer where the shared memory would not hold them, ``fit_stages``)."""
    return dict(stages=STAGES, poly=POLY, lse_smem=LSE_SMEM, qsplit=0 if PAIR else QSPLIT, wg4=WG4, pair=PAIR,
                overlap=OVERLAP and PAIR and not WG4, ksplit=None)


def smem_bytes(stages: int, nwg: int, gpi: int, topk: bool) -> int:
    """Shared memory of a launch config (bytes, with 3 KiB for barriers and alignment): the key ring (64 keys per
    consumer warpgroup per stage), two query slots per group of an item, their LSE, the selecting warps' candidates."""
    return ((stages * HALF * nwg + 2 * gpi * TILE_Q) * HEAD_DIM + 2 * gpi * TILE_Q * 4
            + (SELECT_WARPS * CAND_SLOTS * 2 if topk else 0) + 3072)


def regs_fit(nwg: int, mma_regs: int, producer_regs: int) -> bool:
    """Whether ``nwg`` consumer warpgroups at ``mma_regs`` and the producer warpgroup at ``producer_regs`` registers
    per thread fit the registers the CTA is launched with: 65536 over its 128 * (nwg + 1) threads, in whole units of 8
    per thread (``setmaxnreg.inc`` only takes what ``setmaxnreg.dec`` released in the same CTA: more waits forever)."""
    threads = 128 * (nwg + 1)
    launch = (65536 // threads) // 8 * 8
    return 128 * (nwg * mma_regs + producer_regs) <= threads * launch


def fit_stages(stages: int, nwg: int, gpi: int, topk: bool) -> int:
    """``stages``, or the most below it (at least 2) whose shared memory fits ``SMEM_LIMIT``."""
    while stages > 2 and smem_bytes(stages, nwg, gpi, topk) > SMEM_LIMIT:
        stages -= 1
    return stages


def auto_ksplit(items: int, ctas: int, max_split: int = 4, target: float = 0.98) -> int:
    """Key parts per group: 1 when the walk's last round keeps the CTAs busy (items / (rounds * ctas) >= target),
    else the smallest split up to ``max_split`` that does, else the best of them (Wan2.1-1.3B 480p: 3072 groups on
    132 SMs fill 0.970 of 24 rounds; in two parts 0.990 of 47)."""
    best, best_eff = 1, 0.0
    for k in range(1, max_split + 1):
        n = items * k
        eff = n / (-(-n // ctas) * ctas)
        if eff >= target:
            return k
        if eff > best_eff + 1e-9:
            best, best_eff = k, eff
    return best


def refusal(q8, k8, group_size: int, out) -> str | None:
    """Why this kernel cannot run a float8 pass 2 call (None when it can): device, capability, operand dtype and
    layout (the contiguous float8 copies of ``selection.fp8_operands``), head dim, group width, output dtype and
    layout."""
    import torch

    if q8.device.type != "cuda":
        return f"needs a CUDA device, got {q8.device.type}"
    why = pass2_dispatch.operand_refusal(q8, k8, group_size, capabilities=CAPABILITIES, head_dims=HEAD_DIMS,
                                         max_group=TILE_Q)
    if why is not None:
        return why
    if out.dtype not in (torch.float16, torch.float32) or out.stride(-1) != 1:
        return f"sums must be float16 or float32 with a unit stride on Sk, got {out.dtype} {tuple(out.stride())}"
    return None


def compile_fake(out_dtype: str = "float16", stages: int | None = None, poly: int | None = None,
                 lse_smem: bool | None = None, qsplit: int | None = None, diag: str = "", topk: bool = False,
                 wg4: bool = False, pair: bool = False, overlap: bool = False, unit_qf: bool = False,
                 poly_deg: int | None = None):
    """Compile the kernel from fake tensors (no GPU needed with CUTE_DSL_ARCH=sm_90a); ``out_dtype`` a key of
    ``OUT_DTYPES``; ``topk``: the fused top-K. Raises KeyError for an unknown output dtype."""
    from quack.compile_utils import make_fake_stream, make_fake_tensor

    syms: dict = {}
    dtypes = dict(uint8=cutlass.Uint8, float32=Float32, int32=Int32, int8=cutlass.Int8, out=OUT_DTYPES[out_dtype])
    args = tuple(make_fake_tensor(dtypes[dt], tuple(d if isinstance(d, int) else syms.setdefault(d, cute.sym_int())
                                                    for d in shape), divisibility=div)
                 for _, dt, shape, div in pass2_launch.ARG_SHAPES)
    poly = (UNIT_POLY if unit_qf else POLY) if poly is None else poly
    poly_deg = (unit_poly_degree() if unit_qf else 3) if poly_deg is None else poly_deg
    kernel = Pass2Sm90(OUT_DTYPES[out_dtype], STAGES if stages is None else stages, poly,
                       lse_smem=LSE_SMEM if lse_smem is None else bool(lse_smem),
                       qsplit=(0 if pair else QSPLIT) if qsplit is None else int(qsplit), diag=diag or "",
                       topk=bool(topk), wg4=bool(wg4), pair=bool(pair), overlap=bool(overlap),
                       unit_qf=bool(unit_qf), poly_deg=int(poly_deg))
    return cute.compile(kernel, *args, Int32(128), Int32(1), Int32(1), Int32(1), Int32(1), Int32(1), Int32(0),
                        Int32(1), make_fake_stream(), options="--enable-tvm-ffi")


def compiled(out_dtype: str = "float16", stages: int | None = None, poly: int | None = None,
             lse_smem: bool | None = None, qsplit: int | None = None, diag: str = "", topk: bool = False,
             wg4: bool | None = None, pair: bool | None = None, overlap: bool | None = None,
             unit_qf: bool = False, poly_deg: int | None = None):
    """The compiled kernel: from memory, the disk cache of ``compile.py`` (keyed by this package's kernel sources),
    or a fresh compile (a few seconds)."""
    from . import compile as cc

    fit = stages is None
    stages = STAGES if stages is None else int(stages)
    poly = (UNIT_POLY if unit_qf else POLY) if poly is None else int(poly)
    poly_deg = (unit_poly_degree() if unit_qf else 3) if poly_deg is None else int(poly_deg)
    lse_smem = LSE_SMEM if lse_smem is None else bool(lse_smem)
    topk = bool(topk)
    pair = ((PAIR_FUSED and not unit_qf) if topk else PAIR) if pair is None else bool(pair)
    qsplit = (0 if pair else QSPLIT) if qsplit is None else int(qsplit)  # (pair runs without qsplit)
    wg4 = WG4 if wg4 is None else bool(wg4)
    overlap = (OVERLAP and pair and not wg4) if overlap is None else bool(overlap)
    if fit:  # the default: as many as fit
        stages = fit_stages(stages, 4 if wg4 else 3, 2 if pair else 1, topk)
    key = ("mc_pass2_sm90", out_dtype, stages, poly, lse_smem, qsplit, diag or "", topk, wg4, pair, overlap,
           bool(unit_qf), int(poly_deg), cc.source_hash())
    return cc._cached(key, lambda: compile_fake(out_dtype, stages, poly, lse_smem, qsplit, diag, topk, wg4, pair,
                                                overlap, unit_qf, poly_deg))


def warm(out_dtypes=("float16", "float32"), **tuning) -> dict:
    """Compile (or load from disk) the kernel for each output dtype; seconds per dtype."""
    import time

    took = {}
    for dt in out_dtypes:
        t = time.perf_counter()
        compiled(dt, **tuning)
        took[dt] = round(time.perf_counter() - t, 2)
    return took


def select_refusal(q8, k8, group_size: int, out, sel, num_keys: int, *, policy: bool = True) -> str | None:
    """Why the fused top-K cannot run this call (None when it can; ``refusal`` passed first): float16 sums with
    16-byte aligned rows (Sk and the row strides multiples of 8), int32 ``sel`` ``[B, H, G, width]`` with a unit stride
    on width, 1 <= num_keys <= min(Sk, width), the default bracket plan (``topk.bracket_plan``) within ``SAMPLE_SLOTS``
    samples and ``CAND_SLOTS`` candidate slots; with ``policy`` (the dispatch's
    question) also where it was measured slower than this kernel + the separate top-K: a walk that needs key parts
    to fill the SMs (``TOPK_WHOLE_WALKS_ONLY``; ``group_prob_sums_fp8`` asks without the policy)."""
    import torch

    from ..triton import topk

    if out.dtype != torch.float16:
        return f"the fused top-K reads float16 sums, got {out.dtype}"
    B, H, G, SK = out.shape
    if SK % 8 or any(st % 8 for st in out.stride()[:3]) or out.data_ptr() % 16:
        return f"the fused top-K needs 16-byte aligned rows of sums (Sk {SK}, strides {tuple(out.stride())})"
    if sel.dtype != torch.int32 or sel.dim() != 4 or tuple(sel.shape[:3]) != (B, H, G) or sel.stride(-1) != 1:
        return f"sel must be int32 [B, H, G, width] with a unit stride on width, got {sel.dtype} {tuple(sel.shape)}"
    if not 1 <= num_keys <= min(SK, sel.shape[3]):
        return f"num_keys must be in [1, min(Sk, width)], got {num_keys} (Sk {SK}, width {sel.shape[3]})"
    _, n_samp, _, _, cap = topk.bracket_plan(SK, num_keys, 2)
    if n_samp > SAMPLE_SLOTS or cap > CAND_SLOTS:
        return f"the bracket plan needs {n_samp} samples / {cap} candidate slots (> {SAMPLE_SLOTS} / {CAND_SLOTS})"
    if policy and TOPK_WHOLE_WALKS_ONLY:
        items = B * H * (-(-G // 2) if PAIR_FUSED else G)
        parts = auto_ksplit(items, _sm_count(out.device))
        if parts > 1:
            return (f"the walk of {items} work items needs {parts} key parts to fill the SMs; the fused top-K runs "
                    "whole rows only (TOPK_WHOLE_WALKS_ONLY: there the kernel + the separate top-K measured faster)")
    return None


def group_prob_sums_fp8(q8, k8, qf, lse_s, kb, perm, out, *, group_size: int, select=None, stages: int | None = None,
                        poly: int | None = None, lse_smem: bool | None = None, qsplit: int | None = None,
                        diag: str = "", wg4: bool | None = None, pair: bool | None = None, overlap: bool | None = None,
                        num_ctas: int | None = None, ksplit: int | None = None, bracket: tuple | None = None,
                        unit_qf: bool = False, poly_deg: int | None = None):
    """Pass 2's float8 group sums on this kernel, written into ``out`` (module docstring for the formula); with
    ``select``, also each group's top-K from the stored sums (the fused top-K).

    Args:
        q8, k8: float8_e4m3fn ``[B, H, S, D]`` / ``[B, H, Sk, D]``, contiguous (``selection.fp8_operands``); qf: fp32
        ``[B, H]``; lse_s: fp32 ``[B, H, S]`` (natural log); kb: fp32 ``[B, H, Sk]`` holding 2^KB
        (``fp8_operands(kb_pow2=True)``); perm: int32 ``[B, H, G*C]`` (-1: padded slot); out: float16 / float32
        ``[B, H, G, Sk]``, any b / h / g strides, unit stride on Sk; group_size: C. select: None, or (sel, num_keys):
        sel int32 ``[B, H, G, width]`` (unit stride on width, any other strides), num_keys K in [1, min(Sk, width)]:
        every row of sel gets the K largest of that group's stored float16 sums as ascending indices (ties: lower
        index first; ``topk.top_k_rows``'s rule), then -1 up to width (``select_refusal`` must pass: float16 sums
        with 16-byte aligned rows; ksplit 1 when not given unless ``TOPK_AUTO_KSPLIT``). stages, poly, lse_smem,
        qsplit (0, 1, 2: tile pairs rolled), wg4 (four consumer warpgroups), pair (two query groups per work item,
        sharing each key stage), overlap (with pair: the second group's wgmma under the first's exponentials),
        num_ctas, ksplit: tuning; poly_deg: the polynomial's degree (3, or 2; None: ``unit_poly_degree()`` in the
        unit_qf form, else 3); diag: a timing floor of the benchmark ("noexp" / "nomma" / "noload": WRONG sums)
        (None: ``config``; CTAs: the SM count; ksplit: ``auto_ksplit``). bracket: the fused top-K's sample plan
        (stride, n_samp, hi_rank, lo_rank) instead of ``topk.bracket_plan``'s (tests: a plan whose brackets miss
        sends rows to the radix launch; any plan gives the same selection). unit_qf (select_kv passes it with
        ``UNIT_QF``, ``pass2_dispatch.cute_unit_qf``): heads whose qf is exactly 1
        (``selection.fp8_operands(unit_qf=True)``) and whose ranges pass
        (``selection.unit_qf_factors``) take the sums as 2^score x 2^bias (``Pass2Sm90``; poly, default
        ``UNIT_POLY``, applies to this form), the others the default form (MUFU only); the same sums up to float32
        rounding and the polynomial's error. unit_qf may also be those factors themselves (fp32 ``[B*H]``,
        ``selection.fp8_operands(unit_signs=True)``'s sixth output): then no ``unit_qf_factors`` launch here.
    Returns:
        ``out``. Keys are written for every group; nothing past Sk. With ``select``: ``sel`` written in full (rows
        whose bracket the kernel's counts disproved by the radix top-K launched after it on the same stream).
    Raises:
        ValueError: a call ``refusal`` / ``select_refusal`` names, or tensors of the wrong shapes. Compile / launch
        errors propagate (the caller, ``pass2_dispatch``, falls back to the Triton kernel).
    """
    import torch

    why = refusal(q8, k8, group_size, out)
    if why is None and select is not None:
        why = select_refusal(q8, k8, group_size, out, select[0], int(select[1]), policy=False)
    if why is not None:
        raise ValueError(f"CuTeDSL pass 2 cannot run this call: {why}")
    B, H, S, D = q8.shape
    SK = k8.shape[2]
    G = perm.shape[-1] // group_size
    if tuple(out.shape) != (B, H, G, SK) or tuple(k8.shape[:2]) != (B, H) or perm.shape[-1] != G * group_size:
        raise ValueError(f"shapes: q8 {tuple(q8.shape)}, k8 {tuple(k8.shape)}, perm {tuple(perm.shape)}, "
                         f"out {tuple(out.shape)}, group size {group_size}")
    if tuple(lse_s.shape) != (B, H, S) or tuple(kb.shape) != (B, H, SK) or qf.numel() != B * H:
        raise ValueError(f"shapes: lse_s {tuple(lse_s.shape)}, kb {tuple(kb.shape)}, qf {tuple(qf.shape)}")
    if G == 0 or SK == 0:
        return out
    topk_on = select is not None
    unit_form = unit_qf is not None and unit_qf is not False  # (True, or the factors themselves)
    if pair is None:
        pair = (PAIR_FUSED and not unit_form) if topk_on else PAIR  # (the unit_qf form runs without pair)
    if topk_on and ksplit is None and not TOPK_AUTO_KSPLIT:
        ksplit = 1
    fn = compiled("float16" if out.dtype == torch.float16 else "float32", stages, poly, lse_smem, qsplit, diag, topk_on,
                  wg4, pair, overlap, unit_form, poly_deg)
    if num_ctas is None:
        num_ctas = _sm_count(q8.device)
    if ksplit is None:
        ksplit = auto_ksplit(B * H * (-(-G // 2) if pair else G), num_ctas)  # work items: groups or pairs
    if not 1 <= int(ksplit) <= 64:
        raise ValueError(f"ksplit must be in [1, 64], got {ksplit}")
    if topk_on:
        from ..triton import topk

        sel, num_keys = select[0], int(select[1])
        stride, n_samp, hi_rank, lo_rank = bracket or topk.bracket_plan(SK, num_keys, 2)[:4]
        if not (1 <= stride and 1 <= n_samp <= min(SAMPLE_SLOTS, SK // stride)):
            raise ValueError(f"bracket plan {(stride, n_samp)}: needs 1 <= n_samp <= min({SAMPLE_SLOTS}, Sk // stride)")
    else:  # (not read)
        sel, num_keys, stride, n_samp, hi_rank, lo_rank = None, 1, 1, 1, 0, 1
    if isinstance(unit_qf, torch.Tensor):
        qf = unit_qf  # (fp8_operands(unit_signs=True)'s: made by the quantising launch)
    elif unit_form:
        from ..triton import selection

        qf = selection.unit_qf_factors(qf, lse_s, kb)
    tensors = pass2_launch.launch_tensors(q8, k8, qf, lse_s, kb, perm, out, group_size=group_size, sel=sel,
                                          ksplit=int(ksplit))
    fn(*tensors, int(group_size), int(num_ctas), int(ksplit), num_keys, int(stride), int(n_samp), int(hi_rank),
       int(lo_rank))
    if topk_on:
        # the rows whose bracket the kernel's counts disproved (flag 1): radix select (topk.FusedRows.finish)
        flags = tensors[9]
        src = out.view(B, H * G, SK) if out.stride(1) == G * out.stride(2) else out.reshape(B, H * G, SK)
        dst = sel.view(B, H * G, sel.shape[3])
        topk._radix_topk_rows[(B * H * G,)](
            src, dst, flags, flags, SK, num_keys, sel.shape[3], H * G, src.stride(0), src.stride(1), dst.stride(0),
            dst.stride(1), KEY_BITS=16, BLOCK=topk._BLOCK, HAS_HIST=False, ONLY_FLAGGED=True, num_warps=4)
    return out


def compiled_kernels() -> list:
    """The compiled kernels this process holds (for the bench's report)."""
    from . import compile as cc

    return [k for k in cc._memory if k and k[0] == "mc_pass2_sm90"]
