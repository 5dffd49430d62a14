"""One warp selects one row's top-K from float16 sums in global memory (``topk.py``'s bracket method, exact): the row
routine shared by the CuTeDSL pass 2's fused top-K (``pass2_sm90.py``, producer warps 2 and 3) and the standalone
top-K launch (``topk_sm90.py``, one warp per row).

``WarpRowSelect._select_row``: the stratified sample of ``topk.sample_positions`` (staged in the warp's candidate
slots) brackets the K-th largest key between two sample order statistics (``topk.bracket_plan``'s ranks); one sweep
counts the keys above the bracket and copies those inside it to the warp's ``cand_slots`` int16 slots in shared
memory; the threshold T and ``need`` come from the copies by a bit search; the compaction sweep writes every index
whose key is > T and the first ``need`` whose key == T (ties: lower index first) in ascending order, then -1 up to the
width. A row whose bracket the counts disprove (or whose copies overflow ``cand_slots``) is flagged 1 and left to
``topk._radix_topk_rows`` (ONLY_FLAGGED) after the kernel: the selection equals the brute-force top-K of the sums
(``kernels/reference/topk.py``) either way. A class using it sets ``cand_slots`` (a Python int: the slots per warp,
>= ``SAMPLE_SLOTS``).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr
from cutlass._mlir import ir
from cutlass._mlir.dialects import vector
from flash_attn.cute import utils as fa_utils

SAMPLE_SLOTS = 1024  # the sample's slots (topk._BRACKET_MAX_SAMPLES), staged at the start of the candidate slots
KEY_TOP = 0x7C01  # one above +inf's float16 key: above every key (topk._bracket_row's ``top``)
SWEEP_BATCH = 4  # 16-byte loads per lane issued together in the row sweeps (latency from L2)


class WarpRowSelect:
    """The one-warp row selection (module docstring); ``cand_slots``: each warp's int16 candidate slots."""

    cand_slots: int = 0
    sweep_batch: int = SWEEP_BATCH  # 16-byte loads per lane issued together in each sweep
    sweep_ahead: bool = False  # each sweep issues the next batch's loads before this batch's work (16 more registers)

    @cute.jit
    def _next_batch(self, wsrc, i, n_vec, lane, vecs, ahead):
        """Batch ``i`` of a row sweep into ``vecs`` (``sweep_batch`` 16-byte vectors per lane, vector (i * batch + u) *
        32 + lane): loaded now, or with ``sweep_ahead`` taken from ``ahead`` (loaded one batch earlier; batch 0 by
        the caller) while batch i + 1's loads are issued into it."""
        nb = self.sweep_batch
        if const_expr(self.sweep_ahead):
            for u in cutlass.range_constexpr(nb):
                for k in cutlass.range_constexpr(4):
                    vecs[u][k] = ahead[u][k]
            for u in cutlass.range_constexpr(nb):
                self._load_vec(wsrc, ((i + 1) * nb + u) * 32 + lane, n_vec, ahead[u])
        else:
            for u in cutlass.range_constexpr(nb):  # the batch's loads first: sweep_batch in flight per lane
                self._load_vec(wsrc, (i * nb + u) * 32 + lane, n_vec, vecs[u])

    @cute.jit
    def _first_batch(self, wsrc, n_vec, lane, ahead):
        """With ``sweep_ahead``: batch 0's loads into ``ahead`` (``_next_batch``)."""
        if const_expr(self.sweep_ahead):
            for u in cutlass.range_constexpr(self.sweep_batch):
                self._load_vec(wsrc, u * 32 + lane, n_vec, ahead[u])

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
        counting, both at once); one sweep (16-byte loads, 8 keys per lane, ``sweep_batch`` loads per lane issued
        before their work) counts the keys above hi and copies those in [lo, hi] to ``sC`` (ballot + popc slots); if the
        counts prove the K-th key inside (and the copies fit ``cand_slots``) the threshold T and ``need`` come from the
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
        # the count / copy sweep
        lt_mask = (Int32(1) << lane) - 1
        above = Int32(0)
        n_cand = Int32(0)
        keys = cute.make_rmem_tensor((8,), Int32)
        nb = self.sweep_batch
        vecs = [cute.make_rmem_tensor((4,), Int32) for _ in range(nb)]
        ahead = [cute.make_rmem_tensor((4,), Int32) for _ in range(nb)] if const_expr(self.sweep_ahead) else None
        n_steps = (n_vec + 31) // 32
        n_batches = (n_steps + nb - 1) // nb
        self._first_batch(wsrc, n_vec, lane, ahead)
        for i in cutlass.range(n_batches, unroll=1):
            self._next_batch(wsrc, i, n_vec, lane, vecs, ahead)
            for u in cutlass.range_constexpr(nb):
                self._decode(vecs[u], (i * nb + u) * 32 + lane < n_vec, keys)
                for e in cutlass.range_constexpr(8):
                    key = keys[e]
                    above += Int32(key > hi)
                    inside = (key >= lo) & (key <= hi)
                    mask = cute.arch.vote_ballot_sync(inside)
                    slot = n_cand + cute.arch.popc(mask & lt_mask)
                    if inside & (slot < self.cand_slots):
                        sC[slot, w] = cutlass.Int16(key)
                    n_cand += cute.arch.popc(mask)
        above = cute.arch.warp_reduction_sum(above)
        hit = (above < num_keys) & (above + n_cand >= num_keys) & (n_cand <= self.cand_slots)
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
            # the compaction sweep: slot = (keys > T before) + min(keys == T before, need)
            n_gt = Int32(0)
            n_eq = Int32(0)
            self._first_batch(wsrc, n_vec, lane, ahead)
            for i in cutlass.range(n_batches, unroll=1):
                self._next_batch(wsrc, i, n_vec, lane, vecs, ahead)
                for u in cutlass.range_constexpr(nb):
                    v = (i * nb + u) * 32 + lane
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
            for c in cutlass.range((width - num_keys + 31) // 32, unroll=1):
                pos = num_keys + c * 32 + lane
                if pos < width:
                    mSel[b, h, g, pos] = Int32(-1)
