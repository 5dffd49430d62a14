"""Experimental variant of the CuTeDSL sparse kernel (kernels/cutedsl/sparse_fwd_sm90.py) for the profile bench: the
producer gathers Q, K and V rows with the TMA unit, one 2-D box of 1 row x 64 columns per copy (128-byte swizzle:
the unit swizzles by the shared-memory address, so rows written one at a time land in the layout wgmma reads),
issued by the 4 producer warps (32 rows each: each lane loads one row index, the warp walks its 32 rows with a
shuffle per row and its elected lane issues the copies: a TMA copy is issued by one lane), instead of 16-byte
cp.async through the LSU.
Not part of the package until measured (tests/bench_cutedsl_profile.py)."""

from __future__ import annotations

from functools import partial

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync
from cutlass.pipeline import PipelineUserType, make_pipeline_state, pipeline_init_arrive, pipeline_init_wait
from cutlass.utils import LayoutEnum
from flash_attn.cute import pipeline as fa_pipeline
from flash_attn.cute import utils as fa_utils
from flash_attn.cute.block_info import BlockInfo
from flash_attn.cute.mask import AttentionMask
from flash_attn.cute.seqlen_info import SeqlenInfoQK
from flash_attn.cute.utils import AuxData
from quack import layout_utils, sm90_utils

from comfyui_mc_sparse_pack.kernels.cutedsl.sparse_fwd_sm90 import TILE, GroupScheduler, SparseFwdSm90, _Outputs

WARPS = 4
ROWS_PER_WARP = TILE // WARPS


class TmaRows(SparseFwdSm90):
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE, mPerm: cute.Tensor,
                 mIdx: cute.Tensor, mCounts: cute.Tensor, mRes, mScale, mCoef, mMean, softmax_scale: Float32,
                 num_ctas: Int32, stream=None):
        assert mRes is None
        tiled_mma_qk, tiled_mma_pv = self._get_tiled_mma()
        self.num_mma_threads = tiled_mma_qk.size
        self.num_threads_per_warp_group = 128
        self.num_wg_mma = self.num_mma_threads // 128
        self.num_threads = 128 * (self.num_wg_mma + 1)
        self.num_producer_threads = 32
        self.num_Q_load_threads = 128
        self.num_epilogue_threads = self.num_mma_threads
        self.num_mma_regs, self.num_producer_regs = 224, 40  # 24 spills the producer
        self.use_block_sparsity = False
        self.use_scheduler_barrier = self.tile_hdim <= 128
        self.use_tma_Q = False
        self.use_tma_O = False
        self.rescale_O_before_gemm = False
        self._setup_attributes()
        self.sQ_layout, self.sK_layout, self.sV_layout = [
            sm90_utils.make_smem_layout(self.dtype, LayoutEnum.ROW_MAJOR, shape, stage)
            for shape, stage in [((self.tile_m, self.tile_hdim), None), ((self.tile_n, self.tile_hdim), self.num_stages),
                                 ((self.tile_n, self.tile_hdimv), self.num_stages)]
        ]
        self.sP_layout = None
        SharedStorage = self._get_shared_storage_cls()
        mQ, mK, mV = [layout_utils.select(t, [1, 3, 2, 0]) for t in (mQ, mK, mV)]  # (S, D, H, B)
        row_layout = cute.make_composed_layout(self.sK_layout.inner, 0, cute.make_layout((1, 64), stride=(64, 1)))
        op = cpasync.CopyBulkTensorTileG2SOp()
        atom_q, tma_q = cpasync.make_tiled_tma_atom(op, mQ, row_layout, (1, 64))
        atom_k, tma_k = cpasync.make_tiled_tma_atom(op, mK, row_layout, (1, 64))
        atom_v, tma_v = cpasync.make_tiled_tma_atom(op, mV, row_layout, (1, 64))
        softmax_scale_log2, softmax_scale = fa_utils.compute_softmax_scale_log2(softmax_scale, None)
        total = mPerm.shape[0]
        grid_x = cutlass.min(num_ctas, total)
        self.kernel(
            mQ, mK, mV, mO, mLSE, mPerm, mIdx, mCounts, softmax_scale_log2, softmax_scale, total, atom_q, tma_q,
            atom_k, tma_k, atom_v, tma_v, tiled_mma_qk, tiled_mma_pv, self.sQ_layout, self.sK_layout,
            self.sV_layout, row_layout, SharedStorage,
        ).launch(grid=(grid_x, 1, 1), block=[self.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE, mPerm: cute.Tensor,
               mIdx: cute.Tensor, mCounts: cute.Tensor, softmax_scale_log2: Float32, softmax_scale, total: Int32,
               atom_q: cute.CopyAtom, tma_q: cute.Tensor, atom_k: cute.CopyAtom, tma_k: cute.Tensor,
               atom_v: cute.CopyAtom, tma_v: cute.Tensor, tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma,
               sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout,
               row_layout: cute.ComposedLayout, SharedStorage: cutlass.Constexpr):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for a in (atom_q, atom_k, atom_v):
                cpasync.prefetch_descriptor(a)
        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        Threads = partial(cutlass.pipeline.CooperativeGroup, cutlass.pipeline.Agent.Thread)
        mma_warps = Threads(self.num_mma_threads // cute.arch.WARP_SIZE)
        tile_bytes = TILE * self.tile_hdim * (self.dtype.width // 8)
        pipes = [
            fa_pipeline.PipelineTmaAsync.create(
                barrier_storage=bar, num_stages=n, producer_group=Threads(WARPS), consumer_group=mma_warps,
                tx_count=tile_bytes // WARPS, defer_sync=True,
            )
            for bar, n in ((storage.mbar_ptr_Q.data_ptr(), 1), (storage.mbar_ptr_K.data_ptr(), self.num_stages),
                           (storage.mbar_ptr_V.data_ptr(), self.num_stages))
        ]
        pipeline_q, pipeline_k, pipeline_v = pipes
        pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        block_info = BlockInfo(self.tile_m, self.tile_n, False, False, False, None, None, qhead_per_kvhead_packgqa=1)
        SeqlenInfoCls = partial(SeqlenInfoQK.create, seqlen_q_static=self.tile_m, seqlen_k_static=mIdx.shape[1],
                                mSeqUsedK=mCounts)
        AttentionMaskCls = partial(AttentionMask, self.tile_m, self.tile_n, window_size_left=None,
                                   window_size_right=None, qhead_per_kvhead_packgqa=1)
        TileSchedulerCls = partial(GroupScheduler.create, total)
        n_heads = mQ.shape[2]
        groups_per_head = total // (n_heads * mQ.shape[3])
        pipeline_init_wait(cluster_shape_mn=(1, 1))
        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.num_producer_regs)
            bases = (storage.sQ.data_ptr(), storage.sK.data_ptr(), storage.sV.data_ptr())
            self.load_rows(mPerm, mIdx, atom_q, tma_q, atom_k, tma_k, atom_v, tma_v, row_layout, bases,
                           pipeline_q, pipeline_k, pipeline_v, block_info, SeqlenInfoCls, TileSchedulerCls,
                           n_heads, groups_per_head, warp_idx)
        else:
            cute.arch.setmaxregister_increase(self.num_mma_regs)
            tidx, _, _ = cute.arch.thread_idx()
            outputs = _Outputs(mO, mLSE, mPerm, None, None, None, None, n_heads, groups_per_head)
            self.mma(
                tiled_mma_qk, tiled_mma_pv, outputs, mLSE, sQ, sK, layout_utils.transpose_view(sV), None, sQ, None,
                pipeline_k, pipeline_v, pipeline_q, None, None, tidx - 128, softmax_scale_log2, softmax_scale,
                block_info, SeqlenInfoCls, AttentionMaskCls, TileSchedulerCls, None, AuxData(), None,
            )

    @cute.jit
    def _fetch(self, idx_row: cute.Tensor, n_block: Int32, limit: Int32, row: Int32) -> Int32:
        """The index of row ``row`` of tile n_block (slot clamped to the row, -1 -> 0)."""
        slot = cutlass.min(cutlass.max(n_block, 0) * TILE + row, limit - 1)
        return cutlass.max(idx_row[slot], 0)

    @cute.jit
    def _issue(self, atom, tma_x, idx: Int32, base, stage: Int32, bar, b: Int32, h: Int32, warp: Int32,
               row_layout: cute.ComposedLayout):
        """TMA copies of this warp's 32 rows (lane l holds the index of row 32*warp + l; each row D/64 boxes of
        1 x 64) into stage ``stage`` of the buffer at ``base``: element (r, 64c) of a stage sits at
        r*64 + c*TILE*64 before the swizzle."""
        gX = tma_x[None, None, h, b]
        for i in cutlass.range(ROWS_PER_WARP, unroll=8):
            r = warp * ROWS_PER_WARP + i
            row_idx = cute.arch.shuffle_sync(idx, i)
            for c in cutlass.range_constexpr(self.tile_hdim // 64):
                g = cute.local_tile(gX, (1, 64), (row_idx, c))
                s = cute.make_tensor(base + (stage * TILE * self.tile_hdim + c * TILE * 64 + r * 64), row_layout)
                sp, gp = cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(s, 0, 2),
                                               cute.group_modes(g, 0, 2))
                cute.copy(atom, gp, sp, tma_bar_ptr=bar)

    @cute.jit
    def load_rows(self, mPerm, mIdx, atom_q, tma_q, atom_k, tma_k, atom_v, tma_v, row_layout, bases, pipeline_q,
                  pipeline_k, pipeline_v, block_info, SeqlenInfoCls, TileSchedulerCls, n_heads, groups_per_head,
                  warp):
        lane = cute.arch.lane_idx()
        row = warp * ROWS_PER_WARP + lane
        sQb, sKb, sVb = bases
        k_alloc = mIdx.shape[1]
        q_phase = Int32(1)
        kv_state = make_pipeline_state(PipelineUserType.Producer, self.num_stages)
        tile_scheduler = TileSchedulerCls()
        work_tile = tile_scheduler.initial_work_tile_info()
        while work_tile.is_valid_tile:
            _, _, group, _ = work_tile.tile_idx
            seqlen = SeqlenInfoCls(group)
            bh = group // groups_per_head
            b = bh // n_heads
            h = bh - b * n_heads
            n_block_min, n_block_max = block_info.get_n_block_min_max(seqlen, 0)
            idx_row = mIdx[group, None]
            n_block = n_block_max - 1
            cur = self._fetch(idx_row, n_block, k_alloc, row)
            qrow = self._fetch(mPerm[group, None], 0, Int32(TILE), row)
            nxt = self._fetch(idx_row, n_block - 1, k_alloc, row)  # one tile ahead
            pipeline_k.producer_acquire(kv_state)
            self._issue(atom_k, tma_k, cur, sKb, kv_state.index, pipeline_k.producer_get_barrier(kv_state), b, h,
                        warp, row_layout)
            pipeline_q.producer_acquire_w_index_phase(0, q_phase)
            self._issue(atom_q, tma_q, qrow, sQb, Int32(0), pipeline_q.sync_object_full.get_barrier(0), b, h, warp,
                        row_layout)
            q_phase ^= 1
            for i in cutlass.range(n_block_max - 1 - n_block_min, unroll=1):
                n_block = n_block_max - 2 - i
                prev = cur
                cur = nxt
                nxt = self._fetch(idx_row, n_block - 1, k_alloc, row)
                v_state = kv_state.clone()
                kv_state.advance()
                pipeline_k.producer_acquire(kv_state)
                self._issue(atom_k, tma_k, cur, sKb, kv_state.index, pipeline_k.producer_get_barrier(kv_state), b,
                            h, warp, row_layout)
                pipeline_v.producer_acquire(v_state)
                self._issue(atom_v, tma_v, prev, sVb, v_state.index, pipeline_v.producer_get_barrier(v_state), b,
                            h, warp, row_layout)
            pipeline_v.producer_acquire(kv_state)
            self._issue(atom_v, tma_v, cur, sVb, kv_state.index, pipeline_v.producer_get_barrier(kv_state), b, h,
                        warp, row_layout)
            kv_state.advance()
            tile_scheduler.advance_to_next_work()
            work_tile = tile_scheduler.get_current_work()
        pipeline_v.producer_tail(kv_state)
