"""The reuse-path Triton kernels (kernels/residual.py) against float64 brute force, under TRITON_INTERPRET=1 on CPU:
the sparse kernel reading q/k/v in ComfyUI's native layout and writing ``out`` by strides with the residual epilogue
(plain / fp8_row / int4_row / int4_group), B = 2 (both CFG branches in one launch), ragged tails, fp16/bf16, NaN-poisoned
outputs; and the bitmask decode kernel, bit-exact. Tolerances: see tests/test_triton_kernels.py."""

from __future__ import annotations

import importlib

import pytest
import torch
from comfyui_mc_sparse_pack import kernels
from comfyui_mc_sparse_pack.kernels import registry

from ._triton_interp import patch_interpreter
from .test_reuse_op import (
    brute_decode,
    brute_residual,
    brute_sparse,
    make_residual,
    random_bitmask,
    random_groups,
    random_kv_idx,
)

triton_backend = next(b for b in registry.backends() if b.name == "triton")
pytestmark = pytest.mark.skipif(
    bool(triton_backend.unavailable_reason), reason=f"triton backend unavailable: {triton_backend.unavailable_reason}"
)
patch_interpreter()

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BOUND = {torch.float16: 4e-3, torch.bfloat16: 2e-2}
tsa = importlib.import_module("comfyui_mc_sparse_pack.kernels.triton.sparse_attention")


class LaunchSpy:
    """Stands in for the JIT kernel: records the tensors each launch received, then launches the real kernel."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **meta):
            self.launches.append(args)
            return self.kernel[grid](*args, **meta)

        return launch


def _native(gen, B, S, H, D, dtype, pad=0, fill=None):
    """[B, H, S, D] view of a [B, S, H*D + pad] tensor (random, or filled with ``fill``), and the base tensor."""
    if fill is None:
        base = torch.randn(B, S, H * D + pad, generator=gen).to(dtype).to(DEVICE)
    else:
        base = torch.full((B, S, H * D + pad), fill, dtype=dtype, device=DEVICE)
    return base[..., :H * D].view(B, S, H, D).transpose(1, 2), base


# (S, D, C, K, K_alloc): ragged S (S % C != 0), K not a multiple of the 64-slot tile, K_alloc past K
CASES = [(45, 16, 16, 21, 32), (70, 32, 32, 64, 80), (33, 16, 8, 5, 5)]


# every residual kind in both dtypes, every case at least twice
COMBOS = [(0, torch.float16, None), (0, torch.bfloat16, "int4_row"), (1, torch.bfloat16, "plain"),
          (1, torch.float16, "fp8_row"), (2, torch.bfloat16, "fp8_row"), (2, torch.float16, "int4_row"),
          (0, torch.float16, "plain"), (1, torch.bfloat16, None), (0, torch.bfloat16, "int4_group"),
          (1, torch.float16, "int4_group"), (2, torch.bfloat16, "int4_group")]


@pytest.mark.parametrize(("case", "dtype", "kind"), COMBOS,
                         ids=[f"S{CASES[c][0]}-K{CASES[c][3]}-{str(d)[6:]}-{k}" for c, d, k in COMBOS])
def test_native_layout_out_view_residual_b2(gen, monkeypatch, case, dtype, kind):
    """B = 2 stacked branches in one launch: q/k/v read in place from [B, S, H*D] views, out written through a view
    of a NaN-poisoned [B, S, H*D + 8] buffer (every element of the view written, the 8 extra columns untouched),
    out returned itself, no tensor allocated but the LSE; O = sparse + R and LSE match float64 brute force."""
    S, D, C, K, k_alloc = CASES[case]
    B, H = 2, 2
    (q, _), (k, _), (v, _) = (_native(gen, B, S, H, D, dtype) for _ in range(3))
    out, base = _native(gen, B, S, H, D, dtype, pad=8, fill=float("nan"))
    perm = random_groups(gen, B, H, S, C).to(DEVICE)
    idx = random_kv_idx(gen, B, H, perm.shape[-1] // C, S, K, k_alloc).to(DEVICE)
    G = perm.shape[-1] // C
    res = None if kind is None else make_residual(torch.randn(B, H, S, D, generator=gen), kind, perm.cpu(), G)
    if res is not None:
        res = res.with_tensors(t.to(DEVICE) for t in res.tensors())
    spy = LaunchSpy(tsa._sparse_attn_fwd)
    monkeypatch.setattr(tsa, "_sparse_attn_fwd", spy)
    made = []
    for name in ("empty", "empty_like", "empty_strided", "zeros", "zeros_like", "full"):
        real = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, _real=real, **kw: made.append(_real(*a, **kw)) or made[-1])
    with registry.recording(registry.Record()) as record:
        got, lse = kernels.sparse_attention(q, k, v, perm, idx, out=out, residual=res, return_lse=True, backend="triton")
    monkeypatch.undo()
    assert record.choices["sparse_attention"].backend == "triton"
    assert got is out and len(spy.launches) == 1
    args = spy.launches[0]
    assert [a.data_ptr() for a in args[:3]] == [q.data_ptr(), k.data_ptr(), v.data_ptr()]  # read in place
    assert args[5] is out
    assert [tuple(t.shape) for t in made] == [(B, H, S)]  # only the LSE
    assert not out.isnan().any() and base[..., H * D:].isnan().all()
    ref, ref_lse = brute_sparse(q.cpu(), k.cpu(), v.cpu(), perm.cpu(), idx.cpu())
    if res is not None:
        ref = ref + brute_residual(res.with_tensors(t.cpu() for t in res.tensors()), perm.cpu())
    err = float((out.cpu().double() - ref).norm() / ref.norm())
    assert err < BOUND[dtype], err
    assert (lse.cpu().double() - ref_lse).abs().max() < 1e-4


def test_epilogue_adds_residual_in_original_query_order(gen):
    """R of query i lands on output row i (not on the permuted slot): a residual that is nonzero on one query only
    changes that query's output row, by R (added in fp32 before the one rounding: within an fp16 ulp of base + R)."""
    B, H, S, D, C, K = 1, 1, 40, 16, 8, 12
    q, k, v = (torch.randn(B, H, S, D, generator=gen).to(torch.float16).to(DEVICE) for _ in range(3))
    perm = random_groups(gen, B, H, S, C).to(DEVICE)
    idx = random_kv_idx(gen, B, H, perm.shape[-1] // C, S, K, 16).to(DEVICE)
    base = kernels.sparse_attention(q, k, v, perm, idx, backend="triton")
    r = torch.zeros(B, H, S, D, dtype=torch.float16, device=DEVICE)
    target = int(perm[0, 0, 3])  # a query that is not in slot `target` of the permuted order
    r[0, 0, target] = 1.0
    with_r = kernels.sparse_attention(q, k, v, perm, idx, residual=kernels.Residual(r), backend="triton")
    changed = (with_r != base).any(-1)[0, 0]
    assert changed.nonzero().flatten().tolist() == [target]
    assert ((with_r[0, 0, target].float() - base[0, 0, target].float() - 1.0).abs() <= 2.0**-9).all()


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("kind", ["plain", "fp8_row", "int4_row", "int4_group"])
def test_epilogue_dequantises_each_residual_form_to_the_ulp(gen, kind, backend):
    """With v = 0 the sparse part is exactly 0, so the output is R itself, dequantised in fp32 and rounded once to
    fp16: within half an fp16 ulp (2^-11 relative) of the float64 brute force of the documented format, element by
    element, every row of a [B, S, H*D] view written. The test above bounds R + sparse by a 4e-3 relative norm, which
    R's own scale errors can hide in (mutation: the fp8_row scale multiplied by 255 instead of 256, 0.4 %, passed it
    and fails here)."""
    B, H, S, D, C, K = 2, 2, 70, 32, 32, 40
    q, k = (_native(gen, B, S, H, D, torch.float16)[0] for _ in range(2))
    v = torch.zeros_like(q)
    out, base = _native(gen, B, S, H, D, torch.float16, pad=8, fill=float("nan"))
    perm = random_groups(gen, B, H, S, C).to(DEVICE)
    idx = random_kv_idx(gen, B, H, perm.shape[-1] // C, S, K, 64).to(DEVICE)
    res = make_residual(torch.randn(B, H, S, D, generator=gen) * 4, kind, perm.cpu(), perm.shape[-1] // C)
    res = res.with_tensors(t.to(DEVICE) for t in res.tensors())
    with registry.recording(registry.Record()) as record:
        kernels.sparse_attention(q, k, v, perm, idx, out=out, residual=res, backend=backend)
    assert record.choices["sparse_attention"].backend == backend
    assert not out.isnan().any() and base[..., H * D:].isnan().all()
    ref = brute_residual(res.with_tensors(t.cpu() for t in res.tensors()), perm.cpu())
    err = (out.cpu().double() - ref).abs() - 2.0**-11 * ref.abs()
    assert float(err.max()) <= 1e-6, float(err.max())


@pytest.mark.parametrize("variant", ["bits", "bytes"])
@pytest.mark.parametrize(("S", "K", "width"), [(37, 9, 16), (64, 64, 64), (3001, 700, 768), (13, 1, 5), (2100, 2100, 2100),
                                              (9001, 4000, 4096)])
def test_decode_bitmask_kernel_bit_exact(gen, S, K, width, variant, monkeypatch):
    """The Triton decode equals the reference and brute force bit for bit, ragged S (stray bits past S ignored),
    rows longer than one step, into half of a stacked [2, ...] buffer (the other half untouched), -1 tails written."""
    from comfyui_mc_sparse_pack.kernels.triton import bitmask

    monkeypatch.setattr(bitmask, "VARIANT", variant)
    bits = random_bitmask(gen, (2, 3), S, K)
    if S % 8:
        bits[..., -1] |= 0xFF << (S % 8) & 0xFF
    bits = bits.to(DEVICE)
    stacked = torch.full((2, 2, 3, width), 7, dtype=torch.int32, device=DEVICE)
    with registry.recording(registry.Record()) as record:
        got = kernels.decode_bitmask(bits, num_tokens=S, out=stacked[1], backend="triton")
    assert record.choices["decode_bitmask"].backend == "triton"
    assert got.data_ptr() == stacked[1].data_ptr()
    assert torch.equal(stacked[1].cpu(), brute_decode(bits.cpu(), S, width))
    assert (stacked[0] == 7).all()
    ref = kernels.decode_bitmask(bits, num_tokens=S, width=width, backend="torch")
    assert torch.equal(ref, stacked[1])


@pytest.mark.parametrize("variant", ["bits", "bytes"])
def test_decode_bitmask_kernel_keeps_the_first_width_tokens_of_an_overfull_row(gen, variant, monkeypatch):
    """A row with more set tokens than ``width`` (the cache never stores one; the public op does not check, that
    would cost a device sync) keeps its first ``width`` tokens, as documented and as the reference does, and writes
    nothing past its row: decoded into the first half of a stacked [2, ...] buffer, the second half stays untouched
    (mutation: the kernel's store without its rank < width mask wrote the extra tokens into the next rows)."""
    from comfyui_mc_sparse_pack.kernels.triton import bitmask

    monkeypatch.setattr(bitmask, "VARIANT", variant)
    S, K, width = 3001, 700, 512  # 700 set tokens per row, 512 slots (past one 256-byte step)
    bits = random_bitmask(gen, (2, 3), S, K).to(DEVICE)
    stacked = torch.full((2, 2, 3, width), 7, dtype=torch.int32, device=DEVICE)
    kernels.decode_bitmask(bits, num_tokens=S, out=stacked[0], backend="triton")
    assert torch.equal(stacked[0].cpu(), brute_decode(bits.cpu(), S, width))
    assert (stacked[1] == 7).all()
    assert torch.equal(kernels.decode_bitmask(bits, num_tokens=S, width=width, backend="torch"), stacked[0])


# exponential modes x rescale policies (kernels/triton/fastexp.py; sparse_attention.py RESCALE_LOG2): "f16_emulated"
# has the packed PTX path's roundings (fp16 argument and P) and runs under the interpreter; the PTX itself runs on
# the GPU (tests/test_gpu_reuse_kernel.py). Same bounds as the fp32 path: P is rounded to the input dtype anyway.
# LSE bound (natural log): fp32 exponentials 1e-4; fp16 ones sum P rounded at argument |x| <= 16 (absolute error
# <= 2^-8, so <= 0.27 % relative on 2^x) and result (2^-11; the PTX adds ~2^-10): <= 4e-3 on log(l)
LSE_BOUND = {"fp32": 1e-4, "f16_emulated": 4e-3, "f16x2": 4e-3}
EXP_COMBOS = [("f16_emulated", True, 0, torch.bfloat16, "plain"), ("f16_emulated", False, 1, torch.float16, None),
              ("fp32", True, 1, torch.bfloat16, "int4_row"), ("f16_emulated", True, 2, torch.float16, "fp8_row")]


@pytest.mark.parametrize(("q_regs", "pipeline_qk"), [(False, False), (True, False), (True, True)],
                         ids=["q-shared", "q-regs", "q-regs-pipelined"])
@pytest.mark.parametrize(("exp", "lazy", "case", "dtype", "kind"), EXP_COMBOS,
                         ids=[f"{e}-{'lazy' if z else 'eager'}-S{CASES[c][0]}-{str(d)[6:]}-{k}"
                              for e, z, c, d, k in EXP_COMBOS])
def test_exp_modes_and_lazy_rescale_vs_float64(gen, exp, lazy, case, dtype, kind, q_regs, pipeline_qk):
    """Native views in, a NaN-poisoned out view written in full, ragged S and K, O = sparse + R and LSE against
    float64 brute force, for the emulated packed exponentials, the lazy rescale (BLOCK_N 16: several tiles), Q
    held in registers and the next tile's QK^T issued before this tile's softmax."""
    S, D, C, K, k_alloc = CASES[case]
    B, H = 2, 2
    (q, _), (k, _), (v, _) = (_native(gen, B, S, H, D, dtype) for _ in range(3))
    out, _ = _native(gen, B, S, H, D, dtype, fill=float("nan"))
    perm = random_groups(gen, B, H, S, C).to(DEVICE)
    idx = random_kv_idx(gen, B, H, perm.shape[-1] // C, S, K, k_alloc).to(DEVICE)
    G = perm.shape[-1] // C
    res = None if kind is None else make_residual(torch.randn(B, H, S, D, generator=gen), kind, perm.cpu(), G)
    if res is not None:
        res = res.with_tensors(t.to(DEVICE) for t in res.tensors())
    got, lse = tsa.sparse_attention(q, k, v, perm, idx, out=out, residual=res, return_lse=True, exp=exp,
                                    lazy_rescale=lazy, q_regs=q_regs, pipeline_qk=pipeline_qk, block_n=16)
    assert got is out and not out.isnan().any()
    ref, ref_lse = brute_sparse(q.cpu(), k.cpu(), v.cpu(), perm.cpu(), idx.cpu())
    if res is not None:
        ref = ref + brute_residual(res.with_tensors(t.cpu() for t in res.tensors()), perm.cpu())
    err = float((out.cpu().double() - ref).norm() / ref.norm())
    assert err < BOUND[dtype], err
    assert (lse.cpu().double() - ref_lse).abs().max() < LSE_BOUND[exp]


@pytest.mark.parametrize("exp", ["fp32", "f16_emulated"])
@pytest.mark.parametrize("lazy", [False, True])
def test_rescale_when_the_row_max_jumps(gen, exp, lazy):
    """Scores whose row max grows tile by tile by ~5 (kept stale under the lazy policy: P up to 2^5), then by ~17
    (past RESCALE_LOG2: O and l must be rescaled, else the early tiles count 2^17 times too much; a stale max there
    would give P = 2^22, past fp16's range), then by ~2: output and LSE match float64 brute force."""
    B, H, S, D, C = 1, 1, 64, 16, 16
    u = torch.ones(D)
    jump = torch.tensor([0.0, 0.9, 3.9, 4.25]).repeat_interleave(16)  # per 16-key tile; score = 4 * c * log2(e) bits
    k = (u * jump[:, None] + 0.3 * torch.randn(S, D, generator=gen)).to(torch.float16)
    q = (u + 0.1 * torch.randn(S, D, generator=gen)).to(torch.float16)
    v = torch.randn(S, D, generator=gen).to(torch.float16)
    q, k, v = (t.view(B, H, S, D).to(DEVICE) for t in (q, k, v))
    perm = random_groups(gen, B, H, S, C).to(DEVICE)
    idx = torch.arange(S, dtype=torch.int32).expand(B, H, S // C, S).contiguous().to(DEVICE)
    got, lse = tsa.sparse_attention(q, k, v, perm, idx, return_lse=True, exp=exp, lazy_rescale=lazy, block_n=16)
    ref, ref_lse = brute_sparse(q.cpu(), k.cpu(), v.cpu(), perm.cpu(), idx.cpu())
    s_log2 = (q.double() @ k.double().transpose(-1, -2) / 4 * 1.4426950408889634)[0, 0]
    tile_max = s_log2.view(S, 4, 16).amax(-1).mean(0)
    jumps = tile_max.diff()  # the premise, in log2 units: stale, rescale, stale
    assert 3 < jumps[0] < 8 and jumps[1] > 12 and 0 < jumps[2] < 8, jumps
    err = float((got.cpu().double() - ref).norm() / ref.norm())
    assert err < BOUND[torch.float16], err
    assert (lse.cpu().double() - ref_lse).abs().max() < LSE_BOUND[exp]


@pytest.mark.parametrize(("exp", "capability", "mode"), [("f16x2", None, 0), ("f16x2", (7, 0), 0), ("f16x2", (8, 0), 1),
                                                         ("f16x2", (9, 0), 1), ("fp32", (9, 0), 0), (None, (9, 0), None)])
def test_launch_args_exp_dispatch(exp, capability, mode):
    """The launch's EXP_MODE: packed PTX only on CUDA sm_75+ (the interpreter, capability None, runs fp32); exp=None
    takes the architecture's config()."""
    q = torch.empty(1, 1, 32, 16, dtype=torch.float16)
    perm = torch.zeros(1, 1, 32, dtype=torch.int32)
    idx = torch.zeros(1, 1, 2, 16, dtype=torch.int32)
    _, _, meta, _ = tsa.launch_args(q, q, q, perm, idx, exp=exp, capability=capability)
    cfg = tsa.config(16, capability)
    want = mode if mode is not None else {"fp32": 0, "f16x2": 1}[cfg["exp"]]
    assert meta["EXP_MODE"] == want
    assert meta["LAZY_RESCALE"] == cfg["lazy_rescale"] and meta["Q_REGS"] == cfg["q_regs"]
    assert meta["PIPELINE_QK"] == cfg["pipeline_qk"]


def test_packed_request_runs_fp32_under_the_interpreter(gen, monkeypatch):
    """exp="f16x2" through the op on the interpreter: launched with EXP_MODE 0 (inline PTX cannot run there)."""
    if DEVICE == "cuda":
        pytest.skip("interpreter only")
    seen = []
    real = tsa._sparse_attn_fwd

    class Spy:
        def __getitem__(self, grid):
            return lambda *a, **meta: seen.append(meta) or real[grid](*a, **meta)

    monkeypatch.setattr(tsa, "_sparse_attn_fwd", Spy())
    q, k, v = (torch.randn(1, 1, 32, 16, generator=gen).to(torch.float16) for _ in range(3))
    perm = random_groups(gen, 1, 1, 32, 16)
    idx = random_kv_idx(gen, 1, 1, 2, 32, 10, 16)
    tsa.sparse_attention(q, k, v, perm, idx, exp="f16x2")
    assert seen[0]["EXP_MODE"] == 0


def test_q_regs_is_exact(gen):
    """Q held in registers (times a runtime 1.0) gives the same output and LSE as Q read from shared memory, bit for
    bit under the interpreter (bf16 -> fp32 -> bf16 of q * 1.0 is exact)."""
    S, D, C, K, k_alloc = CASES[1]
    q, k, v = (torch.randn(1, 2, S, D, generator=gen).to(torch.bfloat16).to(DEVICE) for _ in range(3))
    perm = random_groups(gen, 1, 2, S, C).to(DEVICE)
    idx = random_kv_idx(gen, 1, 2, perm.shape[-1] // C, S, K, k_alloc).to(DEVICE)
    a = tsa.sparse_attention(q, k, v, perm, idx, return_lse=True, q_regs=False)
    b = tsa.sparse_attention(q, k, v, perm, idx, return_lse=True, q_regs=True)
    if DEVICE == "cpu":
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    else:  # another wgmma form on sm_90: the same sums, possibly in another order
        assert (a[0].float() - b[0].float()).abs().max() < 1e-2


@pytest.mark.parametrize("lazy", [False, True])
def test_pipelined_qk_masking_by_the_loaded_indices(gen, lazy):
    """pipeline_qk with mask_from_count=False (-1 slots anywhere, masked by the loaded index; a tile may be all -1
    before any valid slot): O and LSE against float64 brute force."""
    B, H, S, D, C, K = 1, 2, 40, 16, 8, 9
    q, k, v = (torch.randn(B, H, S, D, generator=gen).to(torch.float16).to(DEVICE) for _ in range(3))
    perm = random_groups(gen, B, H, S, C).to(DEVICE)
    G = perm.shape[-1] // C
    idx = torch.full((B, H, G, 64), -1, dtype=torch.int32)
    for g in range(G):  # valid slots scattered from slot 20 on (tile 0 all -1 at BLOCK_N 16)
        slots = torch.sort(torch.randperm(44, generator=gen)[:K]).values + 20
        idx[0, :, g, slots] = torch.sort(torch.randperm(S, generator=gen)[:K]).values.to(torch.int32)
    idx = idx.to(DEVICE)
    got, lse = tsa.sparse_attention(q, k, v, perm, idx, return_lse=True, mask_from_count=False, pipeline_qk=True,
                                    lazy_rescale=lazy, block_n=16)
    ref, ref_lse = brute_sparse(q.cpu(), k.cpu(), v.cpu(), perm.cpu(), idx.cpu())
    assert float((got.cpu().double() - ref).norm() / ref.norm()) < BOUND[torch.float16]
    assert (lse.cpu().double() - ref_lse).abs().max() < 1e-4


@pytest.mark.parametrize(("K", "k_alloc", "lazy"), [(21, 32, True), (5, 300, True), (130, 160, False), (20, 200, True),
                                                     (1, 1, True)])
def test_fast_prologue_vs_float64(gen, K, k_alloc, lazy):
    """fast_prologue: the valid count from the row's last 128 slots when the first of them is valid (K_alloc - K <
    128: (21, 32), (130, 160), (1, 1)), else the two-level search ((5, 300), (20, 200): slots 172 / 72 are -1),
    and the pad slots' score from tile 0's product: O and LSE against float64 brute force, ragged tails."""
    B, H, S, D, C = 1, 1, 200, 16, 64
    q, k, v = (torch.randn(B, H, S, D, generator=gen).to(torch.bfloat16).to(DEVICE) for _ in range(3))
    perm = random_groups(gen, B, H, S, C).to(DEVICE)
    idx = random_kv_idx(gen, B, H, perm.shape[-1] // C, S, K, k_alloc).to(DEVICE)
    got, lse = tsa.sparse_attention(q, k, v, perm, idx, return_lse=True, fast_prologue=True, lazy_rescale=lazy,
                                    block_n=32)
    ref, ref_lse = brute_sparse(q.cpu(), k.cpu(), v.cpu(), perm.cpu(), idx.cpu())
    assert float((got.cpu().double() - ref).norm() / ref.norm()) < BOUND[torch.bfloat16]
    assert (lse.cpu().double() - ref_lse).abs().max() < 1e-4
