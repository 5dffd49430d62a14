"""Token-sparse attention forward for Hopper (sm_90) in the CUTLASS Python DSL (CuTeDSL).

MC-Sparse's reuse-step kernel (arXiv 2610.06801, sec. 3.1 and 4): one CTA per query group (C = 128 queries of one
(batch, head)), warp-specialised as in FA3/FA4:

- one producer warpgroup (128 threads, few registers) that *gathers* the group's selected K and V rows by index with
  16-byte ``cp.async`` copies into a 2-stage shared-memory pipeline (Hopper has no TMA gather: docs/kernels.md,
  sec. 0 and 3). Each thread reads one index of the next 128-key tile from the group's ``kv_idx`` row *one tile
  ahead* (the load is in flight while the current tile's rows are issued), turns it into a row address of the
  model's own ``[B, S, H, D]`` K/V layout (no page table, no copy of K or V), and the 16 threads that copy one
  256-byte row receive its address by warp shuffle. The query tile (the group's rows, gathered to group order once
  per call by ``kernels/triton/regroup.py``) arrives by TMA;
- two consumer warpgroups (64 query rows each) that run wgmma for S = Q K^T and O += P V with the online softmax
  overlapped with the MMAs (intra-warpgroup overlap, P kept in registers) and write O and the LSE by TMA.

The consumer warpgroups, the pipelines, the softmax and the epilogue are flash-attn-4's sm90 forward
(``flash_attn.cute.flash_fwd_sm90.FlashAttentionForwardSm90``, flash-attn-4 4.0.0b36, BSD-3), used as a library:
this module replaces its producer (``load``) and reads the index rows through flash-attn-4's row-copy helper
(``flash_attn.cute.paged_kv.PagedKVManager.load_KV``) with our own addresses.

Contract of one launch (``SparseFwdSm90.__call__`` via ``compile_sparse_fwd``):
    q_groups ``(N, C, 1, D)`` fp16/bf16 contiguous, N = B*H*G (one entry per (batch, head, group), group-major inside
    a head); k, v ``(B, S, H, D)`` any strides with unit stride on D and 16-byte aligned rows; out ``(N, C, 1, D)``;
    lse ``(N, 1, C)`` fp32 or None; kv_idx ``(N, K_alloc)`` int32, each row sorted with trailing -1; counts ``(N,)``
    int32, each row's number of valid slots (>= 1). Slots past a row's count are loaded from row 0 of that
    (batch, head) (finite data) and masked to -inf by flash-attn-4's sequence-length mask, so they weigh exactly 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr
from cutlass.cute import FastDivmodDivisorV2
from cutlass.pipeline import PipelineUserType, make_pipeline_state
from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90
from flash_attn.cute.paged_kv import PagedKVManager
from quack import copy_utils

TILE = 128  # query tile (= group size C) and key tile


@dataclass
class _IndexRow:
    """One query group's ``kv_idx`` row as the producer reads it: this thread's slot of the next key tile.

    ``rows`` is flash-attn-4's row-copy helper; its page / page-offset registers are set to (batch, token index),
    so its row address is ``&K[b, idx, h, 0]`` of the ``(S, D, H, B)``-ordered view. ``nxt`` holds the index of
    the tile after the one being copied (loaded one tile ahead)."""

    rows: PagedKVManager
    idx_row: cute.Tensor
    nxt: cute.Tensor
    batch: Int32
    k_alloc: Int32
    thread_idx: Int32

    @cute.jit
    def fetch(self, n_block: Int32):
        """Start loading this thread's index of key tile ``n_block`` (slot clamped to the row; -1 -> 0)."""
        rows = self.rows
        for i in cutlass.range_constexpr(1):
            row = (self.thread_idx % rows.gmem_threads_per_row) * (rows.num_threads // rows.gmem_threads_per_row) + (
                self.thread_idx // rows.gmem_threads_per_row
            )
            # past the row's end: its last slot (a -1, or a real index); either way finite data the mask drops
            slot = cutlass.min(cutlass.max(n_block, 0) * rows.n_block_size + row, self.k_alloc - 1)
            self.nxt[i] = cutlass.max(self.idx_row[slot], 0)

    @cute.jit
    def advance(self):
        """Make the fetched tile the one the next ``load_KV`` copies."""
        for i in cutlass.range_constexpr(1):
            self.rows.tPrPage[i] = self.batch
            self.rows.tPrPageOffset[i] = self.nxt[i]


class SparseFwdSm90(FlashAttentionForwardSm90):
    """flash-attn-4's sm90 forward with a gather producer (see the module docstring). Head dim 64 or 128,
    fp16/bf16, tile 128 x 128, ``stages`` K/V pipeline stages (2: 160 KiB of shared memory at D = 128; 3: 224 KiB,
    more gather latency hidden), 2 consumer warpgroups + 1 producer warpgroup.

    One CTA per group (flash-attn-4's single-tile scheduler): a persistent variant (one CTA per SM looping over groups,
    the next group's gathers overlapping the previous epilogue) measured no faster on the H200 (1.3B s = 0.1: 1.20
    vs 1.21 ms; 14B s = 0.1: 22.0 vs 21.0 ms) and was removed."""

    def __init__(self, dtype, head_dim: int, stages: int = 2):
        super().__init__(
            dtype, head_dim, head_dim, 1, is_causal=False, is_local=False, pack_gqa=False, tile_m=TILE, tile_n=TILE,
            num_stages=stages, num_threads=384, Q_in_regs=False, intra_wg_overlap=True, mma_pv_is_rs=True,
            paged_kv_non_tma=True,
        )

    @cute.jit
    def load(self, mQ, mK, mV, sQ, sK, sV, tma_atom_Q, tma_atom_K, tma_atom_V, pipeline_k, pipeline_v, pipeline_q,
             gmem_tiled_copy_Q, mPageTable, blocksparse_tensors, block_info, SeqlenInfoCls, TileSchedulerCls):
        # mQ: (C, D, 1, N) after the base class's transpose; mK/mV: (S, D, H, B); mPageTable: kv_idx (N, K_alloc)
        warp_idx_in_wg = cute.arch.make_warp_uniform(cute.arch.warp_idx()) % 4
        tidx, _, _ = cute.arch.thread_idx()
        n_heads = mK.shape[2]
        groups_per_head = mPageTable.shape[0] // (n_heads * mK.shape[3])
        k_alloc = mPageTable.shape[1]
        q_producer_phase = Int32(1)
        kv_state = make_pipeline_state(PipelineUserType.Producer, self.num_stages)
        tile_scheduler = TileSchedulerCls()
        work_tile = tile_scheduler.initial_work_tile_info()
        while work_tile.is_valid_tile:
            m_block, head_idx, entry, _ = work_tile.tile_idx
            seqlen = SeqlenInfoCls(entry)
            mQ_cur = mQ[None, None, head_idx, entry]
            gQ = cute.local_tile(mQ_cur, (self.tile_m, self.tile_hdim), (m_block, 0))
            load_Q, _, _ = copy_utils.tma_get_copy_fn(tma_atom_Q, 0, cute.make_layout(1), gQ, sQ, single_stage=True)
            bh = entry // groups_per_head
            b = bh // n_heads
            h = bh - b * n_heads
            n_block_min, n_block_max = block_info.get_n_block_min_max(seqlen, m_block)
            rows = PagedKVManager.create(
                mPageTable, mK, mV, FastDivmodDivisorV2(mK.shape[0]), entry, h, tidx,
                n_block_max * self.tile_n,  # every slot of the loaded tiles is copied (finite data); the mask drops them
                0, self.tile_n, self.tile_hdim, self.tile_hdimv, self.num_threads_per_warp_group, mK.element_type,
                arch=90,
            )
            index = _IndexRow(rows, rows.mPageTable, cute.make_rmem_tensor((1,), Int32), b, k_alloc, tidx)
            n_block = n_block_max - 1
            index.fetch(n_block)
            index.advance()
            index.fetch(n_block - 1)
            pipeline_k.producer_acquire(kv_state)
            self.load_KV(None, rows, sK, block=n_block, pipeline_kv=pipeline_k, producer_state=kv_state, K_or_V="K")
            if warp_idx_in_wg == 0:
                pipeline_q.producer_acquire_w_index_phase(0, q_producer_phase)
                load_Q(tma_bar_ptr=pipeline_q.sync_object_full.get_barrier(0))
            q_producer_phase ^= 1
            pipeline_v.producer_acquire(kv_state)
            self.load_KV(None, rows, sV, block=n_block, pipeline_kv=pipeline_v, producer_state=kv_state, K_or_V="V")
            kv_state.advance()
            for i in cutlass.range(n_block_max - 1 - n_block_min, unroll=1):
                n_block = n_block_max - 2 - i
                index.advance()
                index.fetch(n_block - 1)
                pipeline_k.producer_acquire(kv_state)
                self.load_KV(None, rows, sK, block=n_block, pipeline_kv=pipeline_k, producer_state=kv_state,
                             K_or_V="K")
                pipeline_v.producer_acquire(kv_state)
                self.load_KV(None, rows, sV, block=n_block, pipeline_kv=pipeline_v, producer_state=kv_state,
                             K_or_V="V")
                kv_state.advance()
            tile_scheduler.prefetch_next_work()
            tile_scheduler.advance_to_next_work()
            work_tile = tile_scheduler.get_current_work()
        pipeline_v.producer_tail(kv_state)
