"""The sm_90 Gluon sparse kernel (kernels/triton/sparse_attention_sm90.py) on the GPU, against the float64 reference.

Called directly (a failure is a test failure, not a silent fallback) and through the op (the Triton backend's
dispatch must pick it on sm_90 with no fallback recorded). Every output element is checked written (out views of
NaN-filled buffers), every residual kind, LSE, ragged S and K, B = 2, fp16 and bf16, D = 128 and 64, group sizes
other than 128, rows with many trailing -1 slots. Marked ``gpu``; skipped without an sm_90 GPU.

Run: python3 -m pytest -q tests/test_gpu_gluon_sparse.py (about a minute on an H200, mostly compiles).
"""

from __future__ import annotations

import importlib

import pytest
import torch
from comfyui_mc_sparse_pack import kernels
from comfyui_mc_sparse_pack.kernels import reference, registry

from .test_reuse_op import make_residual
from .test_gpu_reuse_kernel import _inputs  # random groups (perm, -1 tail) and sorted selections

_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _SM90, reason="needs an sm_90 (Hopper) CUDA GPU")]


def _g90():
    return importlib.import_module("comfyui_mc_sparse_pack.kernels.triton.sparse_attention_sm90")


def _dispatch():
    return importlib.import_module("comfyui_mc_sparse_pack.kernels.triton.sparse_dispatch")


def _native(gen, B, S, H, D, dtype):
    base = torch.randn(B, S, H * D, generator=gen, device="cuda").to(dtype)
    return base.view(B, S, H, D).transpose(1, 2)


def _check(B, H, S, D, C, K, k_alloc, kind, dtype, seed, ragged_counts=False, k_ramp=0.0, **tuning):
    """k_ramp: key row j scaled by 1 + k_ramp * j / S (the sorted selections' later tiles score higher, so the
    running max of a row moves many times along it: the lazy rescale runs mid-row)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (_native(gen, B, S, H, D, dtype) for _ in range(3))
    if k_ramp:
        k = (k.float() * (1 + k_ramp * torch.arange(S, device="cuda") / S)[:, None]).to(dtype)
    perm, idx = _inputs(gen, B, H, S, C, K, k_alloc)
    if ragged_counts:  # each group keeps its own count in [1, K]: the valid-count search on every row
        counts = torch.randint(1, K + 1, idx.shape[:3], generator=gen, device="cuda")
        idx = torch.where(torch.arange(k_alloc, device="cuda") < counts[..., None], idx, -1)
    res = None
    if kind is not None:
        res = make_residual(torch.randn(B, H, S, D, generator=gen, device="cuda") * 0.05, kind, perm,
                            perm.shape[-1] // C)
    base = torch.full((B, S, H * D), float("nan"), dtype=dtype, device="cuda")
    out = base.view(B, S, H, D).transpose(1, 2)
    got, lse = _g90().sparse_attention(q, k, v, perm, idx, out=out, residual=res, return_lse=True, **tuning)
    assert got is out
    assert not base.isnan().any(), "some output element was not written"
    ref, ref_lse = reference.sparse_attention(q.double(), k.double(), v.double(), perm, idx, return_lse=True)
    if res is not None:
        ref = ref + res.dequantize(torch.float64, perm)
    err = float((got.double() - ref).norm() / ref.norm())
    lse_err = float((lse.double() - ref_lse.double()).abs().max())
    print(f"seed {seed} B{B} H{H} S{S} D{D} C{C} K{K}/{k_alloc} {kind} {dtype} {tuning}: rel_l2 {err:.2e}, "
          f"lse {lse_err:.2e}")
    assert err < 6e-3, err
    assert lse_err < 1e-3, lse_err


@pytest.mark.parametrize("kind", [None, "plain", "fp8_row", "int4_row", "int4_group"])
@pytest.mark.parametrize(("S", "K"), [(4000, 1000), (3000 + 8, 777)], ids=["S4000", "S3008-ragged"])
def test_gluon_vs_float64(kind, S, K):
    """B = 2, D = 128, C = 128, bf16: native views, NaN-poisoned out view, O = sparse + R and LSE vs float64."""
    _check(2, 3, S, 128, 128, K, -(-K // 128) * 128, kind, torch.bfloat16, seed=7)


@pytest.mark.parametrize(("D", "C", "K", "k_alloc", "dtype", "ragged"), [
    (128, 128, 300, 2048, torch.float16, True),  # many trailing -1: the probe search, counts 1..K
    (64, 128, 500, 512, torch.bfloat16, False),  # D = 64
    (128, 64, 200, 256, torch.bfloat16, False),  # C = 64: half a program's rows are past C
    (128, 192, 129, 256, torch.float16, True),  # C = 192: two programs per group, counts crossing one tile
], ids=["many-pad-fp16", "D64", "C64", "C192"])
def test_gluon_shapes_vs_float64(D, C, K, k_alloc, dtype, ragged):
    _check(2, 2, 1500 + 3, D, C, K, k_alloc, "plain", dtype, seed=11, ragged_counts=ragged)


TUNINGS = {"no-overlap": (dict(overlap=False), "int4_group"), "pipeline": (dict(pipeline=True, overlap=False), None),
           "3-stages": (dict(num_stages=3, overlap=False), "int4_group"),
           "pipeline-3-stages": (dict(pipeline=True, num_stages=3, overlap=False), "int4_row"),
           "persistent": (dict(persistent=True, overlap=False), "int4_group"),
           "persistent-pipeline": (dict(persistent=True, pipeline=True, overlap=False), None),
           # 36 items over 7 programs: 5 or 6 each
           "persistent-7-programs": (dict(persistent=True, num_sms=7, overlap=False), "int4_group"),
           "overlap": (dict(overlap=True), "plain"), "overlap-3-stages": (dict(overlap=True, num_stages=3), None),
           "overlap-persistent": (dict(overlap=True, persistent=True, num_sms=7), "fp8_row"),
           "pingpong": (dict(pingpong=True), "int4_group"),  # the plain schedule's blocks, turns between warpgroups
           "pingpong-persistent": (dict(pingpong=True, persistent=True, num_sms=7), "plain"),
           "overlap-pingpong": (dict(overlap=True, pingpong=True), "fp8_row"),
           "stage-out": (dict(stage_out=True), "int4_group"),
           "stage-out-overlap-pingpong-persistent": (dict(stage_out=True, overlap=True, pingpong=True, persistent=True,
                                                          num_sms=7), "plain"),
           "l2-hints": (dict(l2_hints=True), "int4_group"),
           "pingpong-3-stages": (dict(pingpong=True, num_stages=3), "plain"),
           "pingpong-persistent-rt8": (dict(pingpong=True, persistent=True, num_sms=7, row_threads=8), "int4_row"),
           "pingpong-persistent-l2-hints": (dict(pingpong=True, persistent=True, num_sms=7, l2_hints=True), "fp8_row"),
           "row64": (dict(row64=True), "int4_row"),  # int64 row offsets (slices past 2^31 elements)
           # one Q slot and a 3-deep ring (224 KiB): each item's first tiles go out before its queries; counts 1..300
           # of 1024 slots: 1-3 tiles per item, so the queries follow tile 0, 1 or 2
           "pingpong-persistent-3-stages": (dict(pingpong=True, persistent=True, num_sms=7, num_stages=3), "int4_group"),
           "pingpong-persistent-stage-out": (dict(pingpong=True, persistent=True, num_sms=7, stage_out=True), "plain"),
           "pingpong-persistent-l2-prefetch": (dict(pingpong=True, persistent=True, num_sms=7, l2_prefetch=True),
                                               "fp8_row"),
           # stages released and turns passed by one arrive per consumer thread (barrier counts 256 / 128)
           "pingpong-persistent-3-stages-thread-arrive": (dict(pingpong=True, persistent=True, num_sms=7, num_stages=3,
                                                               thread_arrive=True), "int4_group"),
           "pingpong-persistent-thread-arrive": (dict(pingpong=True, persistent=True, num_sms=7, thread_arrive=True),
                                                 "plain"),
           "pingpong-persistent-3-stages-thread-arrive-fp8": (dict(pingpong=True, persistent=True, num_sms=7,
                                                                   num_stages=3, thread_arrive=True), "fp8_row"),
           # the Q slot freed at each item's last QK^T, the next item's queries right behind its tile 0 (1-3 tiles per
           # item: the slot's release and the queries' gather at every position); with 2 Q slots too
           "early-q-3-stages": (dict(pingpong=True, persistent=True, num_sms=7, num_stages=3, thread_arrive=True,
                                     early_q=True), "int4_group"),
           "early-q-2-slots": (dict(pingpong=True, persistent=True, num_sms=7, thread_arrive=True, early_q=True),
                               "plain"),
           # no proxy fence between a stage's ready wait and its wgmma (flash-attn-4's sm90 cp.async pipelines)
           "no-fence-early-q": (dict(pingpong=True, persistent=True, num_sms=7, num_stages=3, thread_arrive=True,
                                     early_q=True, cp_async_fence=False), "int4_group"),
           # FA3's overlap (softmax of tile t under tile t-1's P V) with the same per-thread arrives, early Q, no fence
           "overlap-no-fence-early-q": (dict(overlap=True, pingpong=True, persistent=True, num_sms=7, num_stages=3,
                                             thread_arrive=True, early_q=True, cp_async_fence=False), "fp8_row"),
           # each tile's indices loaded two tiles ahead (single-tile items: tile 1's preload is past the count)
           "idx-ahead-2": (dict(pingpong=True, persistent=True, num_sms=7, num_stages=3, thread_arrive=True,
                                early_q=True, cp_async_fence=False, idx_ahead=2), "int4_group"),
           "q-regs-idx-ahead-3": (dict(pingpong=True, persistent=True, num_sms=7, num_stages=3, thread_arrive=True,
                                       early_q=True, cp_async_fence=False, q_regs=True, idx_ahead=3), "fp8_row"),
           # the producer at 8 threads per row (4 rows x 128 bytes per warp copy) with the indices two tiles ahead
           "rt8-idx-ahead-2": (dict(pingpong=True, persistent=True, num_sms=7, num_stages=3, thread_arrive=True,
                                    early_q=True, cp_async_fence=False, idx_ahead=2, row_threads=8), "fp8_row"),
           # + each item's first loads (count tail, first tiles' indices, perm entries) issued an item early by the
           # producer (1-3 tiles per item, 5-6 items per program: the last item's next loads masked off)
           "rt8-idx-ahead-2-next-item": (dict(pingpong=True, persistent=True, num_sms=7, num_stages=3,
                                              thread_arrive=True, early_q=True, cp_async_fence=False, idx_ahead=2,
                                              row_threads=8, next_item=True), "fp8_row"),
           "rt8-q-regs-next-item": (dict(pingpong=True, persistent=True, num_sms=7, num_stages=3, thread_arrive=True,
                                         early_q=True, cp_async_fence=False, q_regs=True, row_threads=8,
                                         next_item=True), "int4_group")}


@pytest.mark.parametrize(("tuning", "kind"), list(TUNINGS.values()), ids=list(TUNINGS))
def test_gluon_tunings_vs_float64(tuning, kind):
    """The bench's Gluon variants (next QK^T behind P V; a 3-deep K/V ring; persistent programs walking several
    groups: the ring's phases and the Q slots carried across items; FA3's overlap of softmax and P V), ragged counts
    (single-tile groups included), fp16."""
    _check(2, 2, 1100 + 8, 128, 128, 300, 1024, kind, torch.float16, seed=13, ragged_counts=True, **tuning)


NO_FENCE = {"no-fence": (dict(cp_async_fence=False), "plain"),
            "no-fence-early-q": (dict(cp_async_fence=False, early_q=True), "fp8_row"),
            "overlap-no-fence-early-q": (dict(cp_async_fence=False, early_q=True, overlap=True), "int4_row"),
            # the queries as the QK^T's register operand, the Q slot freed at each item's start
            "q-regs-no-fence-early-q": (dict(cp_async_fence=False, early_q=True, q_regs=True), "plain"),
            "idx-ahead-2-no-fence-early-q": (dict(cp_async_fence=False, early_q=True, idx_ahead=2), "plain"),
            "q-regs-idx-ahead-3": (dict(cp_async_fence=False, early_q=True, q_regs=True, idx_ahead=3), "int4_group"),
            # the producer at 8 threads per row (4 rows x 128 bytes per warp copy)
            "rt8-q-regs": (dict(cp_async_fence=False, early_q=True, q_regs=True, row_threads=8), "int4_group"),
            # + each item's first loads issued an item early by the producer
            "rt8-q-regs-next-item": (dict(cp_async_fence=False, early_q=True, q_regs=True, row_threads=8,
                                          next_item=True), "plain")}


@pytest.mark.parametrize(("tuning", "kind"), list(NO_FENCE.values()), ids=list(NO_FENCE))
def test_gluon_no_fence_long_rows_vs_float64(tuning, kind):
    """The schedules without the consumers' proxy fence (``cp_async_fence=False``) on long rows: 12 key tiles per
    group (1500 of 1536 slots), 16 persistent programs walking 12 items each, so every ring stage is refilled many
    times while the other warpgroup reads its neighbour (a stage read before its copies landed shows as an error);
    bf16, B = 2, native views, NaN-poisoned out, LSE."""
    _check(2, 3, 4000, 128, 128, 1500, 1536, kind, torch.bfloat16, seed=29, ragged_counts=False, pingpong=True,
           persistent=True, num_sms=16, num_stages=3, thread_arrive=True, **tuning)


def test_gluon_rt8_q_regs_next_item_head_dim_64():
    """The queries in registers with the producer at 8 threads per row and each item's first loads an item early at
    D = 64 (each row one 128-byte copy by 8 threads, 4 rows per warp copy), fp16, a plain residual, 7 persistent
    programs, ragged counts, LSE."""
    _check(2, 2, 1500 + 3, 64, 128, 300, 512, "plain", torch.float16, seed=37, ragged_counts=True, pingpong=True,
           persistent=True, num_sms=7, num_stages=3, thread_arrive=True, early_q=True, cp_async_fence=False,
           q_regs=True, row_threads=8, next_item=True)


@pytest.mark.parametrize("rows", ["short", "long"], ids=["split0-short", "split0-long"])
def test_auto_schedules_split_tail_vs_float64(rows):
    """The schedule with the split last round (q_regs split; merged by sparse_tail_merge) called directly where the
    split happens: "short": 36 items of 1-3 key tiles on 7 programs (5 rounds, then one item in 4
    parts, some empty), fp16, int4_group, ragged counts; "long": 192 items of 12 key tiles on 10 programs (19 rounds,
    then 2 items in 4 parts of 3 tiles), bf16, plain residual. NaN-poisoned out view, LSE."""
    d = _dispatch()
    tuning = d.GLUON_SCHEDULES["pingpong persistent 3 stages thread_arrive early_q no_fence q_regs split"]
    if rows == "short":
        _check(2, 2, 1100 + 8, 128, 128, 300, 1024, "int4_group", torch.float16, seed=13, ragged_counts=True,
               num_sms=7, **tuning)
    else:
        _check(2, 3, 4000, 128, 128, 1500, 1536, "plain", torch.bfloat16, seed=41, num_sms=10, **tuning)


CASES = {  # the shapes the schedule-option tests below share: _check's positional args, keywords besides the seed
    # scores growing along the sorted selections: the running max moves many times per row (rescales mid-row)
    "ramp": ((2, 3, 4000, 128, 128, 1500, 1536, "plain", torch.bfloat16), dict(k_ramp=7.0, num_sms=16)),
    "long": ((2, 3, 4000, 128, 128, 1500, 1536, "int4_group", torch.bfloat16), dict(num_sms=16)),  # 12 tiles per row
    # short ragged items of 1-3 key tiles (masked last tiles), many per program
    "short": ((2, 2, 1100 + 8, 128, 128, 300, 1024, "fp8_row", torch.float16),
              dict(ragged_counts=True, k_ramp=3.0, num_sms=7)),
    # 2 x 3 x 24 = 144 items on 132 programs: 1 round, then 12 items (split by a tail launch where there is one)
    "tail": ((2, 3, 3000 + 5, 128, 128, 700, 768, "int4_group", torch.bfloat16), dict(k_ramp=5.0, num_sms=132)),
    "one-round": ((2, 3, 3000 + 5, 128, 128, 700, 768, "int4_row", torch.bfloat16), dict(num_sms=132)),
    "d64": ((2, 2, 1500 + 3, 64, 128, 300, 512, "plain", torch.float16), dict(ragged_counts=True, num_sms=7)),
    # many trailing -1 slots with LSE, no residual
    "lse-pad": ((2, 2, 1500 + 3, 128, 128, 300, 2048, None, torch.float16), dict(ragged_counts=True, num_sms=7)),
}


def _case(case, seed, tuning):
    """``_check`` on the shape ``CASES[case]`` with ``seed`` and the kernel keywords ``tuning``."""
    args, kw = CASES[case]
    _check(*args, seed=seed, **kw, **tuning)


SKIP = "pingpong persistent 3 stages thread_arrive early_q no_fence q_regs skip_rescale"


@pytest.mark.parametrize("case", ["ramp", "long", "short", "tail", "d64"])
def test_skip_rescale_vs_float64(case):
    """``skip_rescale`` (each warp votes whether any of its rows' running max moved and branches over its 64
    accumulator multiplies when none did; inline PTX with the accumulator tied in and out): keys whose scores grow
    along the sorted selections (the max moves many times per row, some rows of a warp rescaling and others not),
    long rows (rescales early, then skipped), short ragged items, the tail launch with it, and D = 64 (where the
    option is ignored); the ramp and tail cases with ``max_tree`` too (the row maxima as a tree). Prints a mark for
    the round script."""
    tuning = dict(_dispatch().GLUON_SCHEDULES[SKIP])
    if case in ("ramp", "tail"):  # with the row maxima as a tree too (max_tree)
        tuning = dict(_dispatch().GLUON_SCHEDULES[SKIP + " max_tree" + (" tail_launch" if case == "tail" else "")])
    _case(case, {"ramp": 53, "long": 29, "short": 13, "tail": 5, "d64": 31}[case], tuning)
    print(f"SKIP OK skip_rescale_vs_float64[{case}]")  # the round script's mark of a passed case


FAST = SKIP + " max_tree sum_partial"


@pytest.mark.parametrize("case", ["ramp", "tail", "short", "d64", "lse-pad"])
def test_fast_softmax_vs_float64(case):
    """skip_rescale + max_tree + ``sum_partial`` (the row sums kept as each thread's partials over a group's tiles,
    finished once at the end): scores growing along the selections, the tail-launch form (its split walk keeps
    the full sums), short ragged fp8_row items, D = 64 and many trailing -1 slots with LSE (the finished sums feed
    the LSE). Prints a mark for the round script."""
    tuning = dict(_dispatch().GLUON_SCHEDULES[FAST + (" tail_launch" if case == "tail" else "")])
    _case(case, {"ramp": 59, "tail": 61, "short": 67, "d64": 71, "lse-pad": 73}[case], tuning)
    print(f"FAST OK fast_softmax_vs_float64[{case}]")  # the round script's mark of a passed case


def test_partial_sums_ramp_vs_float64():
    """skip_rescale + ``sum_partial`` without max_tree (round s9r2's raced row): scores growing along the selections
    (rescales mid-row, so the partial sums are rescaled too), plain residual, LSE from the finished sums."""
    _case("ramp", 79, dict(_dispatch().GLUON_SCHEDULES[SKIP], sum_partial=True))
    print("PSUM OK partial_sums_ramp")  # the round script's mark


@pytest.mark.parametrize("case", ["short", "long", "cfg"])
def test_tail_launch_vs_float64(case):
    """``tail_launch`` (the last, partial round's items in a second launch of the kernel split into key ranges, no
    residual / LSE there; merged by sparse_tail_merge) with q_regs in the first launch, where the split happens,
    NaN-poisoned out views, LSE: "short": 36 items of 1-3 key tiles on 7 programs (5 rounds, then 1 item in 4
    parts, some empty), fp16, int4_group, ragged counts; "long": 192 items of 12 key tiles on 10 programs (19 rounds,
    then 2 items in 4 parts), bf16, plain; "cfg": the shape whose split_tail compile failed in round s7r2 (B = 2,
    S = 3005, int4_group, bf16; 96 items on 13 programs: 7 rounds, then 5 items in 2 parts)."""
    tuning = dict(_dispatch().GLUON_SCHEDULES["pingpong persistent 3 stages thread_arrive early_q no_fence q_regs "
                                              "tail_launch"])
    if case == "short":
        _check(2, 2, 1100 + 8, 128, 128, 300, 1024, "int4_group", torch.float16, seed=13, ragged_counts=True,
               num_sms=7, **tuning)
    elif case == "long":
        _check(2, 3, 4000, 128, 128, 1500, 1536, "plain", torch.bfloat16, seed=41, num_sms=10, **tuning)
    else:
        _check(2, 2, 3000 + 5, 128, 128, 700, 768, "int4_group", torch.bfloat16, seed=5, num_sms=13, **tuning)
    print(f"TAIL OK tail_launch_vs_float64[{case}]")  # the round script's mark of a passed case


def test_gluon_persistent_c192_vs_float64():
    """Persistent with two programs' worth of rows per group (C = 192: items of 128 and 64 rows)."""
    _check(2, 2, 1500 + 3, 128, 192, 129, 256, "plain", torch.bfloat16, seed=19, ragged_counts=True, persistent=True,
           num_sms=5)


def test_op_dispatches_to_gluon_without_fallback(monkeypatch):
    """kernels.sparse_attention on sm_90 runs the Gluon kernel when it is on (compiled, no fallback recorded, no
    spills) and matches the Triton kernel on the same call."""
    monkeypatch.setenv("MC_SPARSE_GLUON", "1")
    _dispatch().reset()
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (_native(gen, 1, 2000, 2, 128, torch.bfloat16) for _ in range(3))
    perm, idx = _inputs(gen, 1, 2, 2000, 128, 400, 512)
    before = len(_g90().compiled_kernels())
    with registry.recording(registry.Record()) as record:
        got = kernels.sparse_attention(q, k, v, perm, idx, backend="triton")
    assert record.failures == {}, record.failures
    assert _dispatch().fallback_reason() is None
    assert len(_g90().compiled_kernels()) >= max(before, 1)
    tri = importlib.import_module("comfyui_mc_sparse_pack.kernels.triton.sparse_attention")
    want = tri.sparse_attention(q, k, v, perm, idx)
    assert float((got.float() - want.float()).norm() / want.float().norm()) < 6e-3
    stats = [(ck.n_regs, ck.n_spills) for ck in _g90().compiled_kernels()[before:]]  # this call's (default) kernel
    print("gluon default-config kernels compiled here (n_regs, n_spills):", stats)  # (persistent variants spill a bit)
    assert all(s == 0 for _, s in stats), stats


def test_op_auto_mode_times_every_schedule_and_matches_float64(monkeypatch):
    """The op in auto mode (the default): the first call of a shape times every AUTO_SCHEDULES entry (all compiled,
    no fallback), keeps the fastest, and every later call of the shape (the chosen kernel)
    matches float64, with an int4_group residual (the cache's smallest form)."""
    monkeypatch.delenv("MC_SPARSE_GLUON", raising=False)
    d = _dispatch()
    d.reset()
    gen = torch.Generator(device="cuda").manual_seed(5)
    B, H, S, C = 2, 2, 3000 + 5, 128
    q, k, v = (_native(gen, B, S, H, 128, torch.bfloat16) for _ in range(3))
    perm, idx = _inputs(gen, B, H, S, C, 700, 768)
    res = make_residual(torch.randn(B, H, S, 128, generator=gen, device="cuda") * 0.05, "int4_group", perm,
                        perm.shape[-1] // C)
    ref = reference.sparse_attention(q.double(), k.double(), v.double(), perm, idx) + res.dequantize(torch.float64, perm)
    with registry.recording(registry.Record()) as record:
        for _ in range(2):
            got = kernels.sparse_attention(q, k, v, perm, idx, residual=res, backend="triton")
            err = float((got.double() - ref).norm() / ref.norm())
            assert err < 6e-3, err
    assert record.failures == {}, record.failures
    (key, choice), = d.choices.items()
    print("auto mode:", choice, d._times[key], f"rel_l2 {err:.2e}")
    assert set(d._times[key]) == set(d.AUTO_SCHEDULES)
    for name in d.AUTO_SCHEDULES:  # every candidate, not only the one chosen here (same compiled kernels as the op's)
        got = _g90().sparse_attention(q, k, v, perm, idx, residual=res, **d.GLUON_SCHEDULES[name])
        err = float((got.double() - ref).norm() / ref.norm())
        print(f"auto candidate {name}: rel_l2 {err:.2e}")
        assert err < 6e-3, (name, err)
    d.reset()
    print("AUTO OK auto_mode_times_every_schedule")  # the round script's mark of a passed case


def test_op_auto_mode_tail_split_vs_float64(monkeypatch):
    """The op in auto mode at a shape whose persistent walk ends in a partial round (140 items on the H200's 132 SMs:
    one round, then 8 items), so a tail_launch candidate splits them into key ranges in a second launch and merges
    them (int4_group residual, bf16, LSE): every candidate is timed and checked against float64 through the op, into
    a NaN-poisoned out view (every element written)."""
    monkeypatch.delenv("MC_SPARSE_GLUON", raising=False)
    d = _dispatch()
    d.reset()
    gen = torch.Generator(device="cuda").manual_seed(53)
    B, H, S, C = 1, 4, 4480, 128
    q, k, v = (_native(gen, B, S, H, 128, torch.bfloat16) for _ in range(3))
    perm, idx = _inputs(gen, B, H, S, C, 700, 768)
    res = make_residual(torch.randn(B, H, S, 128, generator=gen, device="cuda") * 0.05, "int4_group", perm,
                        perm.shape[-1] // C)
    ref, ref_lse = reference.sparse_attention(q.double(), k.double(), v.double(), perm, idx, return_lse=True)
    ref = ref + res.dequantize(torch.float64, perm)
    with registry.recording(registry.Record()) as record:
        for _ in range(2):
            base = torch.full((B, S, H * 128), float("nan"), dtype=torch.bfloat16, device="cuda")
            out = base.view(B, S, H, 128).transpose(1, 2)
            got, lse = kernels.sparse_attention(q, k, v, perm, idx, residual=res, out=out, return_lse=True,
                                                backend="triton")
            assert not base.isnan().any(), "some output element was not written"
            err = float((got.double() - ref).norm() / ref.norm())
            lse_err = float((lse.double() - ref_lse.double()).abs().max())
            assert err < 6e-3 and lse_err < 1e-3, (err, lse_err)
    assert record.failures == {}, record.failures
    (key, choice), = d.choices.items()
    print("auto mode (tail split):", choice, d._times[key], f"rel_l2 {err:.2e}, lse {lse_err:.2e}")
    assert set(d._times[key]) == set(d.AUTO_SCHEDULES)
    for name in d.AUTO_SCHEDULES:
        got, lse = _g90().sparse_attention(q, k, v, perm, idx, residual=res, return_lse=True, **d.GLUON_SCHEDULES[name])
        err = float((got.double() - ref).norm() / ref.norm())
        print(f"auto candidate {name}: rel_l2 {err:.2e}")
        assert err < 6e-3, (name, err)
    d.reset()
    print("AUTO OK auto_mode_tail_split")  # the round script's mark of a passed case (read even if pytest's exit hangs)


def test_auto_first_schedule_head_dim_64():
    """The auto mode's first schedule (queries in registers since 2026-12-01 15:45: the A operand's layout depends on
    D) at D = 64, fp16, a plain residual, 7 persistent programs, ragged counts, LSE."""
    d = _dispatch()
    _check(2, 2, 1500 + 3, 64, 128, 300, 512, "plain", torch.float16, seed=31, ragged_counts=True, num_sms=7,
           **d.GLUON_SCHEDULES[d.AUTO_SCHEDULES[0]])


def test_auto_first_schedule_bf16_plain_residual_cfg_batch():
    """The auto mode's first schedule (AUTO_SCHEDULES[0]) as the 1.3B whole run calls it: bf16, B = 2 (both CFG
    branches in one launch), a plain bf16 residual, native views, out written by strides; 7 persistent programs walk
    72 items (ring phases and the one Q slot carried across items), ragged counts."""
    d = _dispatch()
    _check(2, 3, 1500 + 3, 128, 128, 400, 512, "plain", torch.bfloat16, seed=23, ragged_counts=True, num_sms=7,
           **d.GLUON_SCHEDULES[d.AUTO_SCHEDULES[0]])


MV = SKIP + " sum_partial max_vote"  # the auto schedule since s9r3 + max_vote


@pytest.mark.parametrize("case", ["ramp", "short", "tail", "lse-pad"])
def test_max_vote_vs_float64(case):
    """``max_vote`` (each thread's partial row maxima, one warp vote, the shuffles across a row's 4 threads only when
    some row's max may move): scores growing along the selections (the max moves many times per row,
    so the vote branch runs mid-row), short ragged items (masked last tiles), the tail-launch form (its split walk
    too), many trailing -1 slots with LSE (the running max finished once per item feeds the LSE). Prints a mark for
    the round script."""
    tuning = dict(_dispatch().GLUON_SCHEDULES[MV + (" tail_launch" if case == "tail" else "")])
    _case(case, {"ramp": 107, "short": 109, "tail": 113, "lse-pad": 127}[case], tuning)
    print(f"MV OK max_vote_vs_float64[{case}]")  # the round script's mark of a passed case


NT = SKIP + " sum_partial named_turns"  # the auto schedule since s9r3 + named_turns


@pytest.mark.parametrize("case", ["ramp", "short", "tail", "one-round", "both"])
def test_named_turns_vs_float64(case):
    """``named_turns`` (the pingpong turns on named barriers: warpgroup 1's arrive ahead of the walk and its dropped
    last arrive, so every arrive meets a wait): 12-tile items on 16 programs (growing scores), short ragged items of
    1-3 tiles on 7 programs (many turns per item boundary), the tail-launch form (its split launch with mbarrier
    turns), 132 programs walking 144 items (programs of one and two items), and with max_vote too. A wrong turn
    protocol deadlocks (the round script's timeout) or races the products (wrong results). NaN-poisoned out views,
    LSE. Prints a mark for the round script."""
    tuning = dict(_dispatch().GLUON_SCHEDULES[(MV + " named_turns" if case == "both" else NT)
                                               + (" tail_launch" if case == "tail" else "")])
    shape = "ramp" if case == "both" else case
    _case(shape, {"ramp": 131, "short": 137, "tail": 139, "one-round": 149}[shape], tuning)
    print(f"NT OK named_turns_vs_float64[{case}]")  # the round script's mark of a passed case
