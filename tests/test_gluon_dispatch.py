"""The Triton backend's sparse-attention dispatch (kernels/triton/sparse_dispatch.py) on CPU: when the sm_90 Gluon
kernel is tried, its capability refusals, and the fallback to the Triton kernel (interpreter) on a Gluon failure,
remembered once per run (registry Record) or per process; and the Gluon kernel compiled offline for sm_90a (no GPU):
no spills, the register split of the warp specialisation in the PTX. The Gluon kernel itself runs only on an sm_90
GPU (Gluon has no interpreter mode): tests/test_gpu_gluon_sparse.py."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from comfyui_mc_sparse_pack import kernels
from comfyui_mc_sparse_pack.kernels import reference, registry

from .test_reuse_op import random_groups, random_kv_idx

triton_backend = next(b for b in registry.backends() if b.name == "triton")
pytestmark = pytest.mark.skipif(
    bool(triton_backend.unavailable_reason), reason=f"triton backend unavailable: {triton_backend.unavailable_reason}"
)
ROOT = Path(__file__).resolve().parent.parent


def _dispatch():
    return importlib.import_module("comfyui_mc_sparse_pack.kernels.triton.sparse_dispatch")


def _g90():
    return importlib.import_module("comfyui_mc_sparse_pack.kernels.triton.sparse_attention_sm90")


def _fake(shape=(1, 2, 256, 128), dtype=torch.bfloat16, strides=None, ptr=0):
    """Stands in for a CUDA tensor in ``refusal`` (device, dtype, shape, strides, element size, data pointer)."""
    B, H, S, D = shape
    st = strides or (S * H * D, D, H * D, 1)
    return SimpleNamespace(device=SimpleNamespace(type="cuda"), dtype=dtype,
                           shape=shape, stride=lambda i=None: st if i is None else st[i],
                           element_size=lambda: torch.tensor([], dtype=dtype).element_size(), data_ptr=lambda: ptr)


@pytest.mark.parametrize(("cap", "q_kw", "k_kw", "want"), [
    ((9, 0), {}, {}, None),
    ((8, 9), {}, {}, "sm_90 only"),
    ((10, 0), {}, {}, "sm_90 only"),
    ((9, 0), dict(dtype=torch.float32), {}, "float16/bfloat16"),
    ((9, 0), dict(shape=(1, 2, 256, 96)), {}, "head dim"),
    ((9, 0), {}, dict(strides=(256 * 2 * 128, 128, 2 * 128 + 4, 1)), "16-byte aligned"),  # rows 8 bytes apart
    ((9, 0), {}, dict(strides=(256 * 2 * 128, 1, 2 * 128, 2)), "16-byte aligned"),  # D not unit stride
    ((9, 0), {}, dict(ptr=8), "16-byte aligned"),
    ((9, 0), dict(ptr=4), {}, "q rows"),
])
def test_gluon_refusal(monkeypatch, cap, q_kw, k_kw, want):
    """Capability data as the refusal reads them: sm_90 only, fp16/bf16, D 64/128, K/V rows 16-byte aligned."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    q = _fake(**q_kw)
    k = _fake(dtype=q.dtype, shape=q.shape, **k_kw)
    why = _g90().refusal(q, k, _fake(dtype=q.dtype, shape=q.shape))
    assert (why is None) if want is None else (want in why), why


@pytest.mark.parametrize("kind", ["plain", "fp8_row", "int4_row", "int4_group"])
def test_gluon_takes_every_residual_kind(monkeypatch, kind):
    """Every residual form the cache stores runs on the Gluon kernel (int4_group GPU-verified in round 1 of
    2026-12-01: rel_l2 2.03e-3 against float64, as the other kinds)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    q = _fake()
    assert _g90().refusal(q, q, q, SimpleNamespace(kind=kind)) is None


def test_gluon_refusal_cpu_and_env(monkeypatch):
    q = torch.zeros(1, 1, 8, 128, dtype=torch.bfloat16)
    assert "CUDA" in _g90().refusal(q, q, q)
    d = _dispatch()
    monkeypatch.setenv("MC_SPARSE_GLUON", "0")
    assert d.gluon_mode() == "off" and "MC_SPARSE_GLUON=0" in d.gluon_refusal(q, q, q)
    monkeypatch.setenv("MC_SPARSE_GLUON", "1")
    assert d.gluon_mode() == "on" and "CUDA" in d.gluon_refusal(q, q, q)  # on: the kernel's own refusal speaks
    monkeypatch.delenv("MC_SPARSE_GLUON")
    assert d.gluon_mode() == "auto" == d.GLUON_DEFAULT
    monkeypatch.setattr(d, "GLUON_DEFAULT", "off")
    assert "off (GLUON_DEFAULT)" in d.gluon_refusal(q, q, q)


def _inputs(gen, S=200, D=64, C=32, K=40):
    q, k, v = (torch.randn(1, 2, S, D, generator=gen).to(torch.float16) for _ in range(3))
    perm = random_groups(gen, 1, 2, S, C)
    idx = random_kv_idx(gen, 1, 2, perm.shape[-1] // C, S, K, 64)
    return q, k, v, perm, idx


class _Boom:
    """A Gluon kernel that fails (compile or launch): counts its calls."""

    def __init__(self, err):
        self.err, self.calls = err, 0

    def sparse_attention(self, *a, **kw):
        self.calls += 1
        raise self.err


@pytest.fixture
def failing_gluon(monkeypatch):
    d = _dispatch()
    d.reset()
    monkeypatch.setenv("MC_SPARSE_GLUON", "1")
    boom = _Boom(RuntimeError("PTX compile boom"))
    refusal = lambda q, k, v, residual=None: None  # noqa: E731  (as on sm_90)
    monkeypatch.setattr(d, "_gluon_module", lambda: SimpleNamespace(refusal=refusal,
                                                                   sparse_attention=boom.sparse_attention))
    yield boom
    d.reset()


def test_gluon_failure_falls_back_once_per_run(gen, failing_gluon):
    """A failing Gluon kernel: the call returns the Triton kernel's result (= the reference), the reason is in the
    run's Record (the run summary's 'kernel fallback' line), and the rest of the run does not try Gluon again."""
    q, k, v, perm, idx = _inputs(gen)
    ref = reference.sparse_attention(q.double(), k.double(), v.double(), perm, idx)
    with registry.recording(registry.Record()) as record:
        for _ in range(3):
            out = kernels.sparse_attention(q, k, v, perm, idx, backend="triton")
            assert float((out.double() - ref).norm() / ref.norm()) < 4e-3
    assert failing_gluon.calls == 1
    assert "PTX compile boom" in record.failures[_dispatch().GLUON_KEY]
    assert record.choices["sparse_attention"].backend == "triton"
    with registry.recording(registry.Record()):  # a new run tries again
        kernels.sparse_attention(q, k, v, perm, idx, backend="triton")
    assert failing_gluon.calls == 2


def test_gluon_failure_without_record_is_remembered_for_the_process(gen, failing_gluon):
    q, k, v, perm, idx = _inputs(gen)
    out = torch.full_like(q, float("nan"))
    for _ in range(2):
        got = _dispatch().sparse_attention(q, k, v, perm, idx, out=out)
        assert got is out and not out.isnan().any()
    assert failing_gluon.calls == 1 and "boom" in _dispatch().fallback_reason()


def test_gluon_out_of_memory_propagates(gen, failing_gluon):
    """Out of memory is not a kernel failure: it reaches the caller's out-of-memory path, nothing is remembered."""
    failing_gluon.err = torch.cuda.OutOfMemoryError("CUDA out of memory")
    q, k, v, perm, idx = _inputs(gen)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        _dispatch().sparse_attention(q, k, v, perm, idx)
    assert _dispatch().fallback_reason() is None


class _Fake:
    """A Gluon kernel that works (the Triton kernel's result), counts its calls and keeps each call's schedule
    options (``GLUON_SCHEDULES`` values)."""

    def __init__(self):
        self.calls = 0
        self.options = []

    def sparse_attention(self, *a, **kw):
        self.calls += 1
        sched = {n: kw.pop(n) for n in ("pingpong", "persistent", "overlap", "pipeline", "num_stages", "stage_out",
                                        "thread_arrive", "early_q", "cp_async_fence", "q_regs", "idx_ahead", "row_threads",
                                        "next_item", "split_tail", "consumer_regs", "producer_regs", "tail_launch",
                                        "skip_rescale", "max_tree", "sum_partial", "max_vote", "named_turns")
                 if n in kw}
        self.options.append(sched)
        return _dispatch()._triton_kernel.sparse_attention(*a, **kw)


@pytest.fixture
def auto_gluon(monkeypatch):
    """Auto mode on a CPU: a working fake Gluon kernel, and a timer that runs each candidate once and answers the next
    of ``timer.times`` for it (each Gluon schedule's time in ``AUTO_SCHEDULES`` order)."""
    d = _dispatch()
    d.reset()
    monkeypatch.delenv("MC_SPARSE_GLUON", raising=False)
    fake = _Fake()
    monkeypatch.setattr(d, "_gluon_module", lambda: SimpleNamespace(refusal=lambda q, k, v, residual=None: None,
                                                                   sparse_attention=fake.sparse_attention))
    timer = SimpleNamespace(times=[], timed=0)

    def time_candidates(fns, reps):
        out = {}
        for name, fn in fns.items():
            fn()
            timer.timed += 1
            out[name] = timer.times.pop(0)
        return out

    monkeypatch.setattr(d, "_time_candidates", time_candidates)
    yield fake, timer
    d.reset()


_SP = "pingpong persistent 3 stages thread_arrive early_q no_fence q_regs skip_rescale sum_partial"
_AUTO = (_SP + " max_vote named_turns tail_launch", _SP + " max_vote named_turns", _SP + " max_vote tail_launch",
         _SP + " max_vote")


@pytest.mark.parametrize(("times", "want"), [((1.0, 1.5, 2.0, 2.5), _AUTO[0]), ((3.0, 2.0, 1.0, 4.0), _AUTO[2])])
def test_auto_mode_times_once_per_shape_and_keeps_the_fastest(gen, auto_gluon, times, want):
    """The first call of a shape times each AUTO_SCHEDULES entry (each with its own launch options; the Triton kernel
    is not a candidate), keeps the fastest for that shape, returns the chosen kernel's result; later calls of the
    shape run the choice (its schedule's options) without timing; another K_alloc is timed anew."""
    fake, timer = auto_gluon
    d = _dispatch()
    assert d.AUTO_SCHEDULES == _AUTO
    assert list(d.GLUON_SCHEDULES)[0] == "plain"  # what "on" runs
    q, k, v, perm, idx = _inputs(gen)
    ref = reference.sparse_attention(q.double(), k.double(), v.double(), perm, idx)
    timer.times = list(times)
    out = torch.full_like(q, float("nan"))
    got = d.sparse_attention(q, k, v, perm, idx, out=out)
    assert got is out and float((out.double() - ref).norm() / ref.norm()) < 4e-3
    assert timer.timed == 4 and list(d.choices.values()) == [want]
    base = dict(pingpong=True, persistent=True, num_stages=3, thread_arrive=True, early_q=True, cp_async_fence=False)
    vote = dict(base, q_regs=True, skip_rescale=True, sum_partial=True, max_vote=True)
    named = dict(vote, named_turns=True)
    schedules = [dict(named, tail_launch=4), named, dict(vote, tail_launch=4), vote]
    assert fake.options[:4] == schedules  # each compiled and launched once
    assert fake.options[4:8] == schedules  # each timed with its own options
    calls = fake.calls
    for _ in range(2):
        d.sparse_attention(q, k, v, perm, idx)
    assert timer.timed == 4 and fake.calls == calls + 2
    assert fake.options[-1] == d.GLUON_SCHEDULES[want]
    timer.times = [1.0, 2.0, 3.0, 4.0]
    wider = torch.cat([idx, torch.full_like(idx[..., :64], -1)], -1)  # K_alloc 128: a new shape key
    d.sparse_attention(q, k, v, perm, wider)
    assert timer.timed == 8 and len(d.choices) == 2


def test_auto_mode_leaves_out_a_failing_schedule(gen, auto_gluon, monkeypatch):
    """A schedule that fails to compile or launch is left out of that shape's timing (no fallback recorded); the
    others are timed and the fastest runs."""
    fake, timer = auto_gluon
    d = _dispatch()
    works = fake.sparse_attention

    def flaky(*a, **kw):
        if not kw.get("tail_launch"):  # AUTO_SCHEDULES[1] and [3]
            raise RuntimeError("out of resource: shared memory")
        return works(*a, **kw)

    monkeypatch.setattr(d, "_gluon_module", lambda: SimpleNamespace(refusal=lambda q, k, v, residual=None: None,
                                                                   sparse_attention=flaky))
    q, k, v, perm, idx = _inputs(gen)
    timer.times = [2.0, 3.0]
    d.sparse_attention(q, k, v, perm, idx)
    assert timer.timed == 2 and list(d.choices.values()) == [d.AUTO_SCHEDULES[0]]
    assert set(d._times[next(iter(d._times))]) == {d.AUTO_SCHEDULES[0], d.AUTO_SCHEDULES[2]}
    assert d.fallback_reason() is None


def test_auto_mode_out_of_memory_in_a_schedules_first_launch_propagates(gen, auto_gluon, monkeypatch):
    """Out of memory while a schedule is tried (the auto mode's first launch of each) is not that schedule's failure:
    it reaches the caller's out-of-memory path at once; nothing is timed, chosen or remembered (mutation: the trial's
    out-of-memory re-raise dropped passed tests/test_gluon_dispatch.py)."""
    fake, timer = auto_gluon
    d = _dispatch()
    works, tried = fake.sparse_attention, []

    def oom_first(*a, **kw):  # the first schedule's trial runs out of memory, the others would work
        tried.append(1)
        if len(tried) == 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return works(*a, **kw)

    monkeypatch.setattr(d, "_gluon_module", lambda: SimpleNamespace(refusal=lambda q, k, v, residual=None: None,
                                                                   sparse_attention=oom_first))
    q, k, v, perm, idx = _inputs(gen)
    timer.times = [1.0] * len(d.AUTO_SCHEDULES)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        d.sparse_attention(q, k, v, perm, idx)
    assert tried == [1] and timer.timed == 0 and not d.choices and d.fallback_reason() is None


def test_auto_mode_runs_the_triton_kernel_under_graph_capture(gen, auto_gluon, monkeypatch):
    fake, timer = auto_gluon
    monkeypatch.setattr(_dispatch(), "_capturing", lambda: True)
    q, k, v, perm, idx = _inputs(gen)
    _dispatch().sparse_attention(q, k, v, perm, idx)
    assert timer.timed == 0 and fake.calls == 0 and not _dispatch().choices


def test_auto_mode_gluon_failure_while_timing_falls_back(gen, failing_gluon, monkeypatch):
    """A Gluon kernel that fails on its first (timed) launch: the Triton kernel's result, the reason remembered, no
    choice stored; the next call does not try Gluon again."""
    monkeypatch.delenv("MC_SPARSE_GLUON")
    q, k, v, perm, idx = _inputs(gen)
    ref = reference.sparse_attention(q.double(), k.double(), v.double(), perm, idx)
    for _ in range(2):
        out = _dispatch().sparse_attention(q, k, v, perm, idx)
        assert float((out.double() - ref).norm() / ref.norm()) < 4e-3
    n = len(_dispatch().AUTO_SCHEDULES)  # each schedule tried once, then the failure remembered
    assert failing_gluon.calls == n and "boom" in _dispatch().fallback_reason() and not _dispatch().choices


def test_early_q_only_where_the_q_slot_is_free_after_the_last_qk():
    """``early_q`` (the Q slot freed at an item's last QK^T) runs persistent; with the staged epilogue (which writes
    the output rows into that Q tile) or one item per program it is
    refused before a launch, never run (the producer would refill a Q tile still in use)."""
    g = _g90()
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 256, 128, generator=gen).to(torch.bfloat16)
    perm, idx = random_groups(gen, 1, 2, 256, 128), random_kv_idx(gen, 1, 2, 2, 256, 100, 128)
    base = dict(pingpong=True, persistent=True, num_sms=4, num_stages=3, thread_arrive=True)
    _, _, meta, _ = g.launch_args(q, q, q, perm, idx, early_q=True, **base)
    assert meta["EARLY_Q"] and meta["Q_SLOTS"] == 1 and not g.launch_args(q, q, q, perm, idx, **base)[2]["EARLY_Q"]
    for bad in (dict(stage_out=True), dict(persistent=False)):
        with pytest.raises(ValueError, match="early_q"):
            g.launch_args(q, q, q, perm, idx, early_q=True, **{**base, **bad})
    assert not g.launch_args(q, q, q, perm, idx, cp_async_fence=False, **base)[2]["CP_ASYNC_FENCE"]
    with pytest.raises(ValueError, match="q_regs"):  # the producer must send the queries right behind tile 0
        g.launch_args(q, q, q, perm, idx, q_regs=True, **base)
    assert g.launch_args(q, q, q, perm, idx, idx_ahead=2, **base)[2]["IDX_AHEAD"] == 2
    with pytest.raises(ValueError, match="idx_ahead"):
        g.launch_args(q, q, q, perm, idx, idx_ahead=4, **base)
    assert g.launch_args(q, q, q, perm, idx, next_item=True, idx_ahead=2, **base)[2]["NEXT_ITEM"]
    assert not g.launch_args(q, q, q, perm, idx, **base)[2]["NEXT_ITEM"]
    for bad in (dict(persistent=False), dict(idx_ahead=3)):  # the producer's next-item loads: persistent, 1-2 ahead
        with pytest.raises(ValueError, match="next_item"):
            g.launch_args(q, q, q, perm, idx, next_item=True, **{**base, **bad})


def test_skip_rescale_only_at_head_dim_128():
    """``skip_rescale`` (inline PTX over a thread's 64 accumulator elements) is compiled in at D = 128 and left out
    at D = 64 (32 elements per thread there), off by default; its schedules are dispatch entries (with and without
    ``max_tree``, the row maxima as a tree, at any D)."""
    g = _g90()
    gen = torch.Generator().manual_seed(0)
    perm, idx = random_groups(gen, 1, 2, 256, 128), random_kv_idx(gen, 1, 2, 2, 256, 100, 128)
    sched = _dispatch().GLUON_SCHEDULES["pingpong persistent 3 stages thread_arrive early_q no_fence q_regs skip_rescale"]
    for D, want in ((128, True), (64, False)):
        q = torch.randn(1, 2, 256, D, generator=gen).to(torch.bfloat16)
        assert g.launch_args(q, q, q, perm, idx, num_sms=4, **sched)[2]["SKIP_RESCALE"] is want
        assert g.launch_args(q, q, q, perm, idx)[2]["SKIP_RESCALE"] is False
        tree = _dispatch().GLUON_SCHEDULES["pingpong persistent 3 stages thread_arrive early_q no_fence q_regs "
                                           "skip_rescale max_tree"]
        assert g.launch_args(q, q, q, perm, idx, num_sms=4, **tree)[2]["MAX_TREE"] is True
        assert g.launch_args(q, q, q, perm, idx, num_sms=4, **sched)[2]["MAX_TREE"] is False
        fast = dict(tree, sum_partial=True)
        assert g.launch_args(q, q, q, perm, idx, num_sms=4, **fast)[2]["SUM_PARTIAL"] is True
        assert g.launch_args(q, q, q, perm, idx, num_sms=4, **tree)[2]["SUM_PARTIAL"] is False


def test_max_vote_only_with_per_thread_sums_at_head_dim_128():
    """``max_vote`` (the running max per thread, its shuffles only on a warp's vote) runs with skip_rescale and
    sum_partial (its rescale factor is per thread: refused otherwise), is left out at D = 64 (as skip_rescale), off by
    default; its schedules are dispatch entries."""
    g = _g90()
    gen = torch.Generator().manual_seed(0)
    perm, idx = random_groups(gen, 1, 2, 256, 128), random_kv_idx(gen, 1, 2, 2, 256, 100, 128)
    name = "pingpong persistent 3 stages thread_arrive early_q no_fence q_regs skip_rescale sum_partial max_vote"
    sched = _dispatch().GLUON_SCHEDULES[name]
    for D, want in ((128, True), (64, False)):
        q = torch.randn(1, 2, 256, D, generator=gen).to(torch.bfloat16)
        assert g.launch_args(q, q, q, perm, idx, num_sms=4, **sched)[2]["MAX_VOTE"] is want
        assert g.launch_args(q, q, q, perm, idx)[2]["MAX_VOTE"] is False
    q = torch.randn(1, 2, 256, 128, generator=gen).to(torch.bfloat16)
    for bad in (dict(skip_rescale=False), dict(sum_partial=False)):
        with pytest.raises(ValueError, match="max_vote"):
            g.launch_args(q, q, q, perm, idx, num_sms=4, **{**sched, **bad})
    assert _dispatch().GLUON_SCHEDULES[name + " tail_launch"]["max_vote"]


def test_named_turns_only_with_pingpong_whole_items():
    """``named_turns`` (the pingpong turns on named barriers 8 / 9) runs with pingpong, without overlap or split_tail
    (refused otherwise: the split walk's empty parts issue no blocks, so its last arrive would not be known); the
    tail launch's split launch keeps the mbarrier turns; off by default; its schedules are dispatch entries."""
    g = _g90()
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 256, 128, generator=gen).to(torch.bfloat16)
    perm, idx = random_groups(gen, 1, 2, 256, 128), random_kv_idx(gen, 1, 2, 2, 256, 100, 128)
    name = "pingpong persistent 3 stages thread_arrive early_q no_fence q_regs skip_rescale sum_partial named_turns"
    sched = _dispatch().GLUON_SCHEDULES[name]
    assert g.launch_args(q, q, q, perm, idx, num_sms=4, **sched)[2]["NAMED_TURNS"] is True
    assert g.launch_args(q, q, q, perm, idx)[2]["NAMED_TURNS"] is False
    for bad in (dict(pingpong=False), dict(overlap=True), dict(split_tail=4)):
        with pytest.raises(ValueError, match="named_turns"):
            g.launch_args(q, q, q, perm, idx, num_sms=4, **{**sched, **bad})
    tail = _dispatch().GLUON_SCHEDULES[name + " tail_launch"]
    _, _, meta, (_, _, split) = g.launch_args(q, q, q, perm, idx, num_sms=3, **tail)  # 4 items on 3: 1 round + 1
    assert meta["NAMED_TURNS"] is True and split["launch"][2]["NAMED_TURNS"] is False


def test_diag_times_buffer_checked():
    """``diag_times`` (the per-item clock-stamp diagnostic) takes the split workspace's argument slot: persistent, no
    split or tail launch, a contiguous float32 buffer of programs x ceil(items / programs) x 8; off by default; as
    ``diag_no_store`` (no output stores)."""
    g = _g90()
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 256, 128, generator=gen).to(torch.bfloat16)
    perm, idx = random_groups(gen, 1, 2, 256, 128), random_kv_idx(gen, 1, 2, 2, 256, 100, 128)  # 4 items
    base = dict(pingpong=True, persistent=True, num_sms=3, num_stages=3, thread_arrive=True)
    buf = torch.zeros(3 * 2 * 8)
    grid, args, meta, _ = g.launch_args(q, q, q, perm, idx, diag_times=buf, **base)
    assert meta["DIAG"] and args[12] is buf and not g.launch_args(q, q, q, perm, idx, **base)[2]["DIAG"]
    assert g.launch_args(q, q, q, perm, idx, diag_no_store=True, **base)[2]["NO_STORE"]  # the stores-left-out diagnostic
    assert not meta["NO_STORE"]
    for bad, kw in ((torch.zeros(3 * 2 * 8 - 1), {}), (torch.zeros(3 * 2 * 8, dtype=torch.float64), {}),
                    (buf, dict(persistent=False)), (buf, dict(tail_launch=4))):
        with pytest.raises(ValueError, match="diag_times"):
            g.launch_args(q, q, q, perm, idx, diag_times=bad, **{**base, **kw})


def test_tuning_goes_to_the_triton_kernel(gen, failing_gluon):
    """Launch tuning belongs to the Triton kernel: with it the Gluon kernel is not tried."""
    q, k, v, perm, idx = _inputs(gen)
    _dispatch().sparse_attention(q, k, v, perm, idx, block_n=32)
    assert failing_gluon.calls == 0


def test_gluon_compiles_offline_for_sm90_without_spills():
    """tests/ptxas_gluon.py --quick: the kernel compiles for sm_90a on a machine without a GPU, no spill inside the
    consumer warpgroups' MMA loop (SASS), at most 64 spilled bytes in all, and the PTX holds the partitions' register
    budgets (setmaxnreg to the config's consumer / producer counts): a Gluon API or layout error, a register budget
    that spills in the hot loop, or a lost warp specialisation fails here."""
    p = subprocess.run([sys.executable, str(ROOT / "tests" / "ptxas_gluon.py"), "--quick"], capture_output=True,
                       text=True, cwd=ROOT)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    line = p.stdout.strip().splitlines()[-1]
    print(line)
    cfg = _g90().config(128)
    assert "'consumer_hot_spills': 0" in line
    assert int(line.split("'spill_st': ")[1].split(",")[0]) <= 64
    assert f"('dec', '{cfg['producer_regs']}')" in line and f"('inc', '{cfg['consumer_regs']}')" in line
