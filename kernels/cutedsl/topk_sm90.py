"""select_kv's separate top-K as one CuTeDSL launch on Hopper (sm_90): float16 group sums -> the KV selection.

The same result as ``kernels/triton/topk.py``'s ``top_k_rows`` (each row's K largest sums as ascending int32 indices,
ties to the lower index, then -1 up to the width; negatives and -0.0 rank as +0.0): exact, the brute-force top-K of
the sums (``kernels/reference/topk.py``). One warp per row, ``warps`` rows per CTA, each warp running the row routine
of the CuTeDSL pass 2's fused top-K (``row_select.WarpRowSelect._select_row``: ``topk.py``'s bracket method with the
same sample plan, ``topk.bracket_plan``; candidates in the warp's shared-memory slots; only warp-level syncs: ballot,
popc and shuffles, no block barrier per sweep step). Rows whose bracket the counts disprove are flagged and written by
``topk._radix_topk_rows`` (ONLY_FLAGGED) launched right after on the same stream.

Why a second form beside the Triton one: the Triton launch (2 warps per row, 14 programs per SM) runs at about a third
of both its issue rate and the H200's bandwidth (~0.045-0.051 of a flash-attn-4 dense call at Wan2.1-1.3B 480p,
docs/kernels.md, session 10): each 512-key step of its sweeps ends in a cross-warp prefix scan (shared memory and a
barrier). Here a warp's prefix counts are shuffles, the copies go to shared memory, and each lane keeps 4 16-byte
loads in flight (``row_select.SWEEP_BATCH``).

``reverse``: the CTAs take the rows from the last one (the rows pass 2 wrote last, still in L2 when this launch
follows it). Contract of a launch (``TopKSm90.__call__``): sums float16 ``(B, H, G, Sk)`` (unit stride on Sk, Sk and
the other strides multiples of 8, 16-byte aligned), sel int32 ``(B, H, G, width)`` (unit stride on width), flags
int8 ``(B*H*G,)``, K and the bracket plan (stride, n_samp, hi_rank, lo_rank). Runs on CUDA sm_90 only; offline
compile: ``compile_fake`` (CUTE_DSL_ARCH=sm_90a). Checked on the GPU by tests/test_gpu_cutedsl_topk.py.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from .row_select import SAMPLE_SLOTS, WarpRowSelect

WARPS = 2  # rows (one warp each) per CTA: with 8192 candidate slots (16 KiB per warp) 7 CTAs, 14 warps per SM
REVERSE = True  # the rows from the last one (pass 2's last rows are still in L2)
BATCH = 4  # 16-byte loads per lane issued together in each row sweep (row_select.WarpRowSelect.sweep_batch)
AHEAD = False  # each sweep issues the next batch's loads before this batch's work (sweep_ahead)
SMEM_LIMIT = 227 * 1024
CAPABILITIES = ((9, 0),)


class TopKSm90(WarpRowSelect):
    """The launch (module docstring): ``warps`` rows per CTA, ``cand_slots`` int16 candidate slots per warp (>=
    ``SAMPLE_SLOTS``, a multiple of 8), ``batch`` loads per lane in flight in the sweeps, ``ahead``: the next batch's
    loads issued before this batch's work."""

    def __init__(self, warps: int = WARPS, cand_slots: int = 8192, batch: int = BATCH, ahead: bool = AHEAD):
        assert 1 <= warps <= 32 and cand_slots >= SAMPLE_SLOTS and cand_slots % 8 == 0, (warps, cand_slots)
        assert warps * cand_slots * 2 <= SMEM_LIMIT, (warps, cand_slots)
        assert 1 <= batch <= 16, batch
        self.warps = warps
        self.cand_slots = cand_slots
        self.sweep_batch = batch
        self.sweep_ahead = bool(ahead)

    @cute.jit
    def __call__(self, mOut: cute.Tensor, mSel: cute.Tensor, mFlag: cute.Tensor, num_keys: Int32, samp_stride: Int32,
                 n_samp: Int32, hi_rank: Int32, lo_rank: Int32, reverse: Int32, stream=None):
        fields = dict(sC=cute.struct.Align[cute.struct.MemRange[cutlass.Int16, self.warps * self.cand_slots], 16])
        SharedStorage = cute.struct(type("TopKStorage", (), {"__annotations__": fields}))
        rows = mOut.shape[0] * mOut.shape[1] * mOut.shape[2]
        self.kernel(mOut, mSel, mFlag, num_keys, samp_stride, n_samp, hi_rank, lo_rank, reverse,
                    SharedStorage).launch(grid=((rows + self.warps - 1) // self.warps, 1, 1),
                                          block=[32 * self.warps, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mOut: cute.Tensor, mSel: cute.Tensor, mFlag: cute.Tensor, num_keys: Int32, samp_stride: Int32,
               n_samp: Int32, hi_rank: Int32, lo_rank: Int32, reverse: Int32, SharedStorage: cutlass.Constexpr):
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        sC = storage.sC.get_tensor(cute.make_layout((self.cand_slots, self.warps)))
        n_heads = mOut.shape[1]
        n_groups = mOut.shape[2]
        rows = mOut.shape[0] * n_heads * n_groups
        r = cute.arch.block_idx()[0] * self.warps + warp
        if r < rows:
            row = cutlass.select_(reverse != 0, rows - 1 - r, r)
            bh = row // n_groups
            g = row - bh * n_groups
            b = bh // n_heads
            h = bh - b * n_heads
            self._select_row(mOut, mSel, mFlag, sC, warp, b, h, g, row, num_keys, samp_stride, n_samp, hi_rank,
                             lo_rank, tidx % 32)


def cand_slots(sk: int, num_keys: int) -> int:
    """The candidate slots per warp for rows of ``sk`` float16 sums and K = ``num_keys``: the bracket plan's cap
    (``topk.bracket_plan``: 8192 at Wan2.1-1.3B 480p for s = 0.1-0.5, 16384 at 14B 720p), at least ``SAMPLE_SLOTS``."""
    from ..triton import topk

    return max(SAMPLE_SLOTS, topk.bracket_plan(sk, num_keys, 2)[4])


def compile_fake(warps: int = WARPS, slots: int = 8192, batch: int = BATCH, ahead: bool = AHEAD):
    """Compile the launch from fake tensors (no GPU needed with CUTE_DSL_ARCH=sm_90a)."""
    from quack.compile_utils import make_fake_stream, make_fake_tensor

    b, h, g, sk, w, n = (cute.sym_int() for _ in range(6))
    sums = make_fake_tensor(cutlass.Float16, (b, h, g, sk), divisibility=8)
    sel = make_fake_tensor(Int32, (b, h, g, w), divisibility=1)
    flags = make_fake_tensor(cutlass.Int8, (n,), divisibility=1)
    return cute.compile(TopKSm90(warps, slots, batch, ahead), sums, sel, flags, Int32(1), Int32(1), Int32(1), Int32(0), Int32(1),
                        Int32(0), make_fake_stream(), options="--enable-tvm-ffi")


def compiled(warps: int = WARPS, slots: int = 8192, batch: int = BATCH, ahead: bool = AHEAD):
    """The compiled launch: from memory, ``compile.py``'s disk cache (keyed by the kernel sources), or a fresh
    compile (a few seconds)."""
    from . import compile as cc

    key = ("mc_topk_sm90", int(warps), int(slots), int(batch), bool(ahead), cc.source_hash())
    return cc._cached(key, lambda: compile_fake(int(warps), int(slots), int(batch), bool(ahead)))


def refusal(sums, num_keys: int, width: int, *, warps: int = WARPS) -> str | None:
    """Why this launch cannot run the call (None when it can): CUDA sm_90, float16 ``[B, H, G, Sk]`` sums with
    16-byte aligned rows (Sk and the row strides multiples of 8), 1 <= K <= min(Sk, width), the bracket plan within
    ``SAMPLE_SLOTS`` samples and its candidate slots within the shared memory."""
    import torch

    if sums.device.type != "cuda":
        return f"needs a CUDA device, got {sums.device.type}"
    cap = torch.cuda.get_device_capability(sums.device)
    if cap not in CAPABILITIES:
        return f"needs sm_90, got sm_{cap[0]}{cap[1]}"
    if sums.dtype != torch.float16 or sums.dim() != 4:
        return f"needs float16 [B, H, G, Sk] sums, got {sums.dtype} {tuple(sums.shape)}"
    sk = sums.shape[-1]
    if sk % 8 or sums.stride(-1) != 1 or any(st % 8 for st in sums.stride()[:3]) or sums.data_ptr() % 16:
        return f"needs 16-byte aligned rows of sums (Sk {sk}, strides {tuple(sums.stride())})"
    if not 1 <= num_keys <= min(sk, width):
        return f"num_keys must be in [1, min(Sk, width)], got {num_keys} (Sk {sk}, width {width})"
    from ..triton import topk

    n_samp = topk.bracket_plan(sk, num_keys, 2)[1]
    slots = cand_slots(sk, num_keys)
    if n_samp > SAMPLE_SLOTS or warps * slots * 2 > SMEM_LIMIT:
        return f"the bracket plan needs {n_samp} samples / {warps} x {slots} candidate slots (> {SAMPLE_SLOTS} / smem)"
    return None


def top_k_rows(sums, num_keys: int, out, *, warps: int | None = None, reverse: bool | None = None,
               bracket: tuple | None = None, batch: int | None = None, ahead: bool | None = None):
    """Each row's K largest float16 sums as sorted int32 indices with -1 padding, written into ``out``
    (``topk.top_k_rows``'s contract and result).

    Args:
        sums: float16 ``[B, H, G, Sk]`` (``refusal`` must pass); num_keys: K; out: int32 ``[B, H, G, width]``, unit
        stride on width, the other dims any strides. warps: rows per CTA (None: ``WARPS``); reverse: rows from the
        last one (None: ``REVERSE``); batch, ahead: the sweeps' loads per lane in flight and the next batch's
        issued early (None: ``BATCH``, ``AHEAD``); bracket: (stride, n_samp, hi_rank, lo_rank) instead of ``topk.bracket_plan``'s
        (tests: a plan whose brackets miss sends rows to the radix launch; the result is the same).
    Returns:
        ``out``.
    Raises:
        ValueError: a call ``refusal`` names or a bad ``out``. Compile / launch errors propagate (the caller,
        ``pass2_dispatch.try_cute_topk``, falls back to the Triton top-K).
    """
    import torch

    from . import pass2_launch
    from ..triton import topk

    warps = WARPS if warps is None else int(warps)
    width = out.shape[-1]
    why = refusal(sums, num_keys, width, warps=warps)
    if why is None and (out.dtype != torch.int32 or tuple(out.shape[:3]) != tuple(sums.shape[:3])
                        or out.stride(-1) != 1):
        why = f"out must be int32 {(*sums.shape[:3], width)} with a unit stride on width, got {out.dtype} " \
              f"{tuple(out.shape)}"
    if why is not None:
        raise ValueError(f"CuTeDSL top-K cannot run this call: {why}")
    B, H, G, SK = sums.shape
    rows = B * H * G
    if rows == 0:
        return out
    stride, n_samp, hi_rank, lo_rank = bracket or topk.bracket_plan(SK, num_keys, 2)[:4]
    if not (1 <= stride and 1 <= n_samp <= min(SAMPLE_SLOTS, SK // stride)):
        raise ValueError(f"bracket plan {(stride, n_samp)}: needs 1 <= n_samp <= min({SAMPLE_SLOTS}, Sk // stride)")
    flags = pass2_launch.flags(sums.device, rows)
    fn = compiled(warps, cand_slots(SK, num_keys), BATCH if batch is None else int(batch),
                  AHEAD if ahead is None else bool(ahead))
    fn(sums, out, flags, int(num_keys), int(stride), int(n_samp), int(hi_rank), int(lo_rank),
       int(REVERSE if reverse is None else bool(reverse)))
    src = sums.view(B, H * G, SK) if sums.stride(1) == G * sums.stride(2) else sums.reshape(B, H * G, SK)
    dst = out.view(B, H * G, width)
    topk._radix_topk_rows[(rows,)](src, dst, flags, flags, SK, num_keys, width, H * G, src.stride(0), src.stride(1),
                                   dst.stride(0), dst.stride(1), KEY_BITS=16, BLOCK=topk._BLOCK, HAS_HIST=False,
                                   ONLY_FLAGGED=True, num_warps=4)
    return out
