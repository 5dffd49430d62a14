"""The float8 pass-2 dispatch (kernels/triton/pass2_dispatch.py, hooked into selection.group_prob_sums) on CPU: when
the warp-specialised sm_90 Gluon kernel (kernels/triton/selection_sm90.py) is tried, its refusals, what it is handed
(the float8 operands of fp8_operands), and the fallback to the Triton pair kernel (interpreter) on a Gluon failure,
remembered once per run (registry Record) or per process; and the Gluon kernel compiled offline for sm_90a (no GPU).
The Gluon kernel itself runs only on an sm_90 GPU (Gluon has no interpreter mode): tests/test_gpu_pass2_gluon.py."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from comfyui_mc_sparse_pack.kernels import reference, registry
from comfyui_mc_sparse_pack.kernels.reference.topk import top_k_rows as ref_top_k_rows

from .test_reuse_op import random_groups

triton_backend = next(b for b in registry.backends() if b.name == "triton")
pytestmark = pytest.mark.skipif(
    bool(triton_backend.unavailable_reason), reason=f"triton backend unavailable: {triton_backend.unavailable_reason}"
)
ROOT = Path(__file__).resolve().parent.parent


def _mod(name):
    return importlib.import_module(f"comfyui_mc_sparse_pack.kernels.triton.{name}")


def _fake(shape=(1, 2, 256, 128), dtype=torch.float8_e4m3fn, contiguous=True, ptr=0, device="cuda"):
    """Stands in for a CUDA tensor in ``selection_sm90.refusal``."""
    return SimpleNamespace(device=SimpleNamespace(type=device), dtype=dtype, shape=shape, data_ptr=lambda: ptr,
                           is_contiguous=lambda: contiguous)


@pytest.mark.parametrize(("cap", "q_kw", "C", "out_dtype", "want"), [
    ((9, 0), {}, 128, torch.float16, None),
    ((9, 0), {}, 100, torch.float32, None),
    ((9, 0), dict(shape=(1, 2, 256, 64)), 128, torch.float16, None),
    ((8, 9), {}, 128, torch.float16, "sm_90 only"),
    ((10, 0), {}, 128, torch.float16, "sm_90 only"),
    ((9, 0), dict(dtype=torch.bfloat16), 128, torch.float16, "float8_e4m3fn"),
    ((9, 0), dict(shape=(1, 2, 256, 96)), 128, torch.float16, "head dim"),
    ((9, 0), {}, 64, torch.float16, "group size"),
    ((9, 0), {}, 192, torch.float16, "group size"),
    ((9, 0), dict(contiguous=False), 128, torch.float16, "contiguous"),
    ((9, 0), dict(ptr=8), 128, torch.float16, "16-byte aligned"),
    ((9, 0), {}, 128, torch.bfloat16, "float16 or float32"),
    ((9, 0), dict(device="cpu"), 128, torch.float16, "CUDA"),
])
def test_gluon_pass2_refusal(monkeypatch, cap, q_kw, C, out_dtype, want):
    """sm_90 only, float8 operands as fp8_operands makes them (contiguous, aligned), D 64 / 128, 64 < C <= 128,
    float16 / float32 sums; never under the Triton interpreter."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if q_kw.get("device") != "cpu":
        assert "interpreter" in _mod("selection_sm90").refusal(_fake(**q_kw), _fake(), C,
                                                                SimpleNamespace(dtype=out_dtype))
    monkeypatch.delenv("TRITON_INTERPRET")
    q8 = _fake(**q_kw)
    why = _mod("selection_sm90").refusal(q8, _fake(), C, SimpleNamespace(dtype=out_dtype))
    assert (why is None) if want is None else (want in why), why


@pytest.mark.parametrize(("k_kw", "want"), [
    (dict(dtype=torch.bfloat16), "float8_e4m3fn"),
    (dict(contiguous=False), "contiguous"),
    (dict(ptr=8), "16-byte aligned"),
])
def test_pass2_refusal_checks_k8_too(monkeypatch, k_kw, want):
    """The operand checks both float8 pass-2 kernels share (pass2_dispatch.operand_refusal) look at k8 as well as q8
    (mutations: a k8 check dropped)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    why = _mod("selection_sm90").refusal(_fake(), _fake(**k_kw), 128, SimpleNamespace(dtype=torch.float16))
    assert why is not None and want in why, why
    d = _mod("pass2_dispatch")
    why = d.operand_refusal(_fake(), _fake(**k_kw), 128, capabilities=((9, 0),), head_dims=(128,), max_group=128)
    assert why is not None and want in why, why


def test_gluon_pass2_mode(monkeypatch):
    d = _mod("pass2_dispatch")
    monkeypatch.delenv("MC_SPARSE_PASS2_GLUON", raising=False)
    assert d.gluon_mode() == d.GLUON_DEFAULT
    assert d.gluon_mode(True) and not d.gluon_mode(False)
    monkeypatch.setenv("MC_SPARSE_PASS2_GLUON", "0")
    assert not d.gluon_mode() and d.gluon_mode(True)
    assert "MC_SPARSE_PASS2_GLUON=0" in d.gluon_refusal(None, None, 128, None)
    monkeypatch.setenv("MC_SPARSE_PASS2_GLUON", "1")
    assert d.gluon_mode() and not d.gluon_mode(False)
    assert "gluon=False" in d.gluon_refusal(None, None, 128, None, requested=False)
    monkeypatch.setenv("MC_SPARSE_PASS2_GLUON", "yes")
    with pytest.raises(ValueError, match="MC_SPARSE_PASS2_GLUON"):
        d.gluon_mode()


class _Gluon:
    """A stand-in Gluon kernel: records what it is handed; ``err`` set: fails (compile or launch)."""

    def __init__(self, err=None, kb_poly=False):
        self.err, self.calls, self.kb_poly = err, [], kb_poly

    def config(self, head_dim):
        return dict(kb_poly=self.kb_poly)

    def refusal(self, q8, k8, group_size, out):
        return None  # as on sm_90

    def group_prob_sums_fp8(self, q8, k8, qf, lse_s, kb, perm, out, *, group_size):
        self.calls.append(dict(q8=q8, k8=k8, qf=qf, lse_s=lse_s, kb=kb, perm=perm, out=out, C=group_size))
        if self.err is not None:
            raise self.err
        out.fill_(7.0)
        return out


@pytest.fixture
def gluon(monkeypatch):
    d = _mod("pass2_dispatch")
    d.reset()
    monkeypatch.delenv("MC_SPARSE_PASS2_GLUON", raising=False)
    fake = _Gluon()
    monkeypatch.setattr(d, "_gluon_module", lambda: fake)
    yield fake
    d.reset()


def _inputs(gen, S=150, D=32, C=32, H=2):
    q, k = (torch.randn(1, H, S, D, generator=gen).to(torch.bfloat16) for _ in range(2))
    _, lse = reference.dense_attention(q.double(), k.double(), k.double(), return_lse=True)
    return q, k, lse.float(), random_groups(gen, 1, H, S, C), C


@pytest.mark.parametrize("kb_poly", [False, 2])
def test_gluon_is_handed_the_float8_operands(gen, gluon, kb_poly):
    """gluon=True on the float8 path: the Gluon kernel gets fp8_operands' outputs (the same the Triton kernel would
    read), perm contiguous, the caller's ``out``, and its result is returned without a Triton launch; 2^KB in place
    of KB exactly when its config reads that (``kb_poly=2``)."""
    sel = _mod("selection")
    gluon.kb_poly = kb_poly
    q, k, lse, perm, C = _inputs(gen)
    out = torch.full((1, 2, perm.shape[-1] // C, q.shape[2]), float("nan"), dtype=torch.float16)
    got = sel.group_prob_sums(q, k, lse, perm[..., :], group_size=C, out=out, fp8=True, gluon=True)
    assert got is out and bool((out == 7.0).all()) and len(gluon.calls) == 1
    call = gluon.calls[0]
    q8, k8, qf, lse_s, kb = sel.fp8_operands(q, k, lse, q.shape[-1] ** -0.5, kb_pow2=kb_poly == 2)
    for name, want in (("q8", q8), ("k8", k8), ("qf", qf), ("lse_s", lse_s), ("kb", kb)):
        assert torch.equal(call[name].float(), want.float()), name
    assert call["perm"].is_contiguous() and torch.equal(call["perm"], perm) and call["out"] is out and call["C"] == C


@pytest.mark.parametrize("kw", [dict(gluon=False), dict(fp8=False), dict(hist=True), dict(poly=1), dict(block_n=64),
                                dict(exp="f16_emulated")])
def test_gluon_is_not_tried(gen, gluon, kw):
    """Not tried: turned off, the bf16 path, or an option only the Triton kernel has (histogram, polynomial or packed
    exponentials, launch tuning); the Triton kernel's sums come back."""
    sel = _mod("selection")
    q, k, lse, perm, C = _inputs(gen)
    kw = dict(fp8=True, gluon=True) | kw
    if kw.get("hist"):
        kw["hist"] = torch.zeros(1, 2, perm.shape[-1] // C, 128, dtype=torch.int32)
    out = sel.group_prob_sums(q, k, lse, perm, group_size=C, **kw)
    assert not gluon.calls and not bool((out == 7.0).any())


@pytest.mark.parametrize("kb_poly", [False, 2])
def test_gluon_failure_falls_back_once_per_run(gen, gluon, kb_poly):
    """A failing Gluon kernel: the call returns the Triton kernel's sums (bitwise those of gluon=False, whichever KB
    form the Gluon config reads), the reason is in the run's Record, the rest of the run does not try it again; a new
    run does."""
    sel = _mod("selection")
    gluon.err, gluon.kb_poly = RuntimeError("PTX compile boom"), kb_poly
    q, k, lse, perm, C = _inputs(gen, S=64)
    want = sel.group_prob_sums(q, k, lse, perm, group_size=C, fp8=True, gluon=False)
    with registry.recording(registry.Record()) as record:
        sel.select_kv(q, k, lse, perm, 20, group_size=C, kv_tile=16, fp8=True, gluon=True)  # select_kv passes it on
        assert len(gluon.calls) == 1
        for _ in range(2):
            assert torch.equal(sel.group_prob_sums(q, k, lse, perm, group_size=C, fp8=True, gluon=True), want)
    assert len(gluon.calls) == 1
    assert "PTX compile boom" in record.failures[_mod("pass2_dispatch").GLUON_KEY]
    with registry.recording(registry.Record()):  # a new run tries again
        sel.group_prob_sums(q, k, lse, perm, group_size=C, fp8=True, gluon=True)
    assert len(gluon.calls) == 2


def test_gluon_failure_without_record_is_remembered_for_the_process(gen, gluon):
    sel = _mod("selection")
    gluon.err = RuntimeError("launch boom")
    q, k, lse, perm, C = _inputs(gen)
    for _ in range(2):
        out = torch.full((1, 2, perm.shape[-1] // C, q.shape[2]), float("nan"))
        sel.group_prob_sums(q, k, lse, perm, group_size=C, out=out, fp8=True, gluon=True)
        assert not out.isnan().any()
    d = _mod("pass2_dispatch")
    assert len(gluon.calls) == 1 and "boom" in d.fallback_reason()
    assert "failed earlier" in d.gluon_refusal(None, None, C, None, requested=True)


def test_gluon_out_of_memory_propagates(gen, gluon):
    """Out of memory is not a kernel failure: it reaches the caller, nothing is remembered."""
    sel = _mod("selection")
    gluon.err = torch.cuda.OutOfMemoryError("CUDA out of memory")
    q, k, lse, perm, C = _inputs(gen)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        sel.group_prob_sums(q, k, lse, perm, group_size=C, fp8=True, gluon=True)
    assert _mod("pass2_dispatch").fallback_reason() is None


def test_gluon_pass2_compiles_offline_for_sm90_without_spills():
    """tests/ptxas_select.py --gluon --quick: the kernel compiles for sm_90a without a GPU, no spills (ptxas and the
    consumers' MMA loop in the SASS), the warp specialisation's register split in the PTX, e4m3 wgmma and TMA in the
    SASS: a Gluon API or layout error, a register budget that spills, or a lost producer fails here."""
    p = subprocess.run([sys.executable, str(ROOT / "tests" / "ptxas_select.py"), "--gluon", "--quick"],
                       capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    line = p.stdout.strip().splitlines()[-1]
    print(line)
    cfg = _mod("selection_sm90").config(128)
    assert "'spill_st': 0" in line and "'consumer_hot_spills': 0" in line
    assert f"('dec', '{cfg['producer_regs']}')" in line and f"('inc', '{cfg['consumer_regs']}')" in line
    assert "'QGMMA': 16" in line and "'UTMALDG': 0" not in line


# --- the CuTeDSL pass 2 (kernels/cutedsl/pass2_sm90.py) in the same dispatch, tried before the Gluon kernel ---

class _Cute:
    """A stand-in CuTeDSL pass-2 kernel: records what it is handed and writes float16 sums drawn from a few levels (ties
    at the K-th value: the top-K after it must be the brute-force one); ``err`` set: fails (compile or launch)."""

    def __init__(self, err=None, seed=5):
        self.err, self.calls, self.seed = err, [], seed

    def refusal(self, q8, k8, group_size, out):
        return None  # as on sm_90 with nvidia-cutlass-dsl

    def group_prob_sums_fp8(self, q8, k8, qf, lse_s, kb, perm, out, *, group_size, **extra):
        self.calls.append(dict(q8=q8, k8=k8, qf=qf, lse_s=lse_s, kb=kb, perm=perm, out=out, C=group_size, **extra))
        if self.err is not None:
            raise self.err
        g = torch.Generator().manual_seed(self.seed + len(self.calls))
        levels = torch.rand(12, generator=g, dtype=torch.float64) * group_size
        out.copy_(levels[torch.randint(0, 12, tuple(out.shape), generator=g)].to(out.dtype))
        return out


@pytest.fixture
def cute(monkeypatch):
    d = _mod("pass2_dispatch")
    d.reset()
    monkeypatch.delenv("MC_SPARSE_PASS2_CUTE", raising=False)
    monkeypatch.delenv("MC_SPARSE_PASS2_GLUON", raising=False)
    fake = _Cute()
    monkeypatch.setattr(d, "_cute_module", lambda: fake)
    yield fake
    d.reset()


def test_cute_module_refusal_is_the_reason_and_nothing_runs(cute, monkeypatch):
    """The CuTeDSL module refusing a call (here: a head dim it does not run) is cute_refusal's answer; try_cute then
    launches nothing, remembers no failure and leaves the call to the next kernel. Mutation: the module's refusal
    ignored (the kernel launched on a call it cannot run)."""
    d = _mod("pass2_dispatch")
    monkeypatch.setattr(cute, "refusal", lambda q8, k8, group_size, out: "runs head dim 128 only, got 64")
    assert d.cute_refusal(None, None, 128, None, requested=True) == "runs head dim 128 only, got 64"
    assert not d.try_cute(None, None, None, None, None, None, None, group_size=128, requested=True)
    assert not cute.calls and d.cute_fallback_reason() is None


def test_cute_pass2_mode(monkeypatch):
    d = _mod("pass2_dispatch")
    monkeypatch.delenv("MC_SPARSE_PASS2_CUTE", raising=False)
    assert d.cute_mode() == d.CUTE_DEFAULT
    assert d.cute_mode(True) and not d.cute_mode(False)
    monkeypatch.setenv("MC_SPARSE_PASS2_CUTE", "0")
    assert not d.cute_mode() and d.cute_mode(True)
    assert "MC_SPARSE_PASS2_CUTE=0" in d.cute_refusal(None, None, 128, None)
    monkeypatch.setenv("MC_SPARSE_PASS2_CUTE", "1")
    assert d.cute_mode() and not d.cute_mode(False)
    assert "cute=False" in d.cute_refusal(None, None, 128, None, requested=False)
    for bad in ("on", "2", " 1"):
        monkeypatch.setenv("MC_SPARSE_PASS2_CUTE", bad)
        with pytest.raises(ValueError, match="MC_SPARSE_PASS2_CUTE"):
            d.cute_mode()


@pytest.mark.parametrize(("env", "module", "want"), [(None, None, False), (None, True, True), (None, False, False),
                                                     ("1", None, True), ("0", True, False)])
def test_cute_unit_qf_hands_the_kernel_operands_with_qf_1(gen, cute, monkeypatch, env, module, want):
    """cute_unit_qf: MC_SPARSE_PASS2_UNIT_QF, else the module's UNIT_QF (off when it has none). On: the CuTeDSL
    kernel gets fp8_operands(kb_pow2=True, unit_qf=True)'s outputs and unit_qf=True; off: the plain operands and no
    unit_qf argument. A bad value is a ValueError. Mutations: the switch not passed to fp8_operands, or not to the
    kernel, each fail a case."""
    d, sel = _mod("pass2_dispatch"), _mod("selection")
    monkeypatch.delenv("MC_SPARSE_PASS2_UNIT_QF", raising=False)
    if env is not None:
        monkeypatch.setenv("MC_SPARSE_PASS2_UNIT_QF", env)
    if module is not None:
        monkeypatch.setattr(cute, "UNIT_QF", module, raising=False)
    assert d.cute_unit_qf() == want
    q, k, lse, perm, C = _inputs(gen)
    out = torch.empty((1, 2, perm.shape[-1] // C, q.shape[2]), dtype=torch.float16)
    sel.group_prob_sums(q, k, lse, perm, group_size=C, out=out, fp8=True, cute=True)
    call = cute.calls[-1]
    unit = call.get("unit_qf", False)  # (True, or the factors themselves: selection._UNIT_SIGNS)
    assert (unit is not False) == want and (not want or unit is True or sel._UNIT_SIGNS)
    ops = sel.fp8_operands(q, k, lse, q.shape[-1] ** -0.5, kb_pow2=True, unit_qf=want)
    for name, t in zip(("q8", "k8", "qf", "lse_s", "kb"), ops):
        assert torch.equal(call[name].float(), t.float()), name
    if want:
        assert bool((call["qf"] == 1).all())
    monkeypatch.setenv("MC_SPARSE_PASS2_UNIT_QF", "yes")
    with pytest.raises(ValueError, match="MC_SPARSE_PASS2_UNIT_QF"):
        d.cute_unit_qf()


@pytest.mark.parametrize("fused", [False, True])
def test_unit_signs_hand_the_kernel_its_factors(gen, cute, monkeypatch, fused):
    """selection._UNIT_SIGNS on (with the unit_qf form): the CuTeDSL kernel's launch, plain or fused, gets unit_qf =
    the factors made by fp8_operands' quantising launch (a tensor == unit_qf_factors of the operands it was handed)
    instead of True, so it launches no check of its own. Mutation: the sixth output not handed on (unit_qf True)."""
    d, sel = _mod("pass2_dispatch"), _mod("selection")
    monkeypatch.delenv("MC_SPARSE_PASS2_UNIT_QF", raising=False)
    monkeypatch.setattr(cute, "UNIT_QF", True, raising=False)
    monkeypatch.setattr(sel, "_UNIT_SIGNS", True)
    q, k, lse, perm, C = _inputs(gen)
    out = torch.empty((1, 2, perm.shape[-1] // C, q.shape[2]), dtype=torch.float16)
    if fused:
        monkeypatch.setenv("MC_SPARSE_PASS2_CUTE_TOPK", "1")
        monkeypatch.setattr(cute, "FUSED_TOPK", True, raising=False)
        monkeypatch.setattr(cute, "select_refusal", lambda *a: None, raising=False)
        monkeypatch.setattr(sel, "_TOPK_FUSED_DEFAULT", True)
        monkeypatch.setattr(sel, "_capability", lambda device: (9, 0))  # (the fused top-K's switch)
        sel.select_kv(q, k, lse, perm, 40, group_size=C, kv_tile=16, fp8=True, cute=True)
    else:
        sel.group_prob_sums(q, k, lse, perm, group_size=C, out=out, fp8=True, cute=True)
    call = cute.calls[-1]
    assert ("select" in call) == fused
    assert isinstance(call.get("unit_qf"), torch.Tensor)
    assert torch.equal(call["unit_qf"], sel.unit_qf_factors(call["qf"], call["lse_s"], call["kb"]))


def test_cute_unavailable_without_cutlass_is_a_refusal(gen, monkeypatch):
    """nvidia-cutlass-dsl blocked (its import fails): the CuTeDSL kernel is refused with the import error as the reason,
    nothing is remembered as a failure, and select_kv(cute=True) returns the Triton kernel's selection."""
    d = _mod("pass2_dispatch")
    d.reset()
    for name in ("cutlass", "cutlass.cute"):
        monkeypatch.setitem(sys.modules, name, None)  # import cutlass -> ImportError
    for name in [m for m in sys.modules if m.endswith("kernels.cutedsl.pass2_sm90")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(d, "_cute_import_error", [])
    why = d.cute_refusal(None, None, 128, None, requested=True)
    assert why.startswith("unavailable (") and "Error" in why, why
    assert d.cute_refusal(None, None, 128, None, requested=True) == why and len(d._cute_import_error) == 1  # once
    sel = _mod("selection")
    q, k, lse, perm, C = _inputs(gen, S=64)
    got = sel.select_kv(q, k, lse, perm, 20, group_size=C, kv_tile=16, fp8=True, cute=True)
    assert torch.equal(got, sel.select_kv(q, k, lse, perm, 20, group_size=C, kv_tile=16, fp8=True, cute=False))
    assert d.cute_fallback_reason() is None


@pytest.mark.parametrize("gluon_on", [False, True])
def test_cute_is_handed_the_float8_operands_with_2_pow_kb(gen, cute, gluon, gluon_on):
    """cute=True on the float8 path: the CuTeDSL kernel gets fp8_operands(kb_pow2=True)'s outputs (2^KB, also when
    the Gluon kernel is on with a config that reads KB), perm contiguous, the caller's ``out``; its sums are returned
    without a Gluon or Triton launch."""
    sel = _mod("selection")
    q, k, lse, perm, C = _inputs(gen)
    out = torch.full((1, 2, perm.shape[-1] // C, q.shape[2]), float("nan"), dtype=torch.float16)
    got = sel.group_prob_sums(q, k, lse, perm, group_size=C, out=out, fp8=True, cute=True, gluon=gluon_on)
    assert got is out and not out.isnan().any() and len(cute.calls) == 1 and not gluon.calls
    call = cute.calls[0]
    q8, k8, qf, lse_s, kb = sel.fp8_operands(q, k, lse, q.shape[-1] ** -0.5, kb_pow2=True)
    for name, want in (("q8", q8), ("k8", k8), ("qf", qf), ("lse_s", lse_s), ("kb", kb)):
        assert torch.equal(call[name].float(), want.float()), name
    assert call["perm"].is_contiguous() and torch.equal(call["perm"], perm) and call["out"] is out and call["C"] == C


@pytest.mark.parametrize("topk_count", [None, False, True])
def test_select_kv_with_cute_is_the_top_k_of_its_sums(gen, cute, topk_count, monkeypatch):
    """select_kv(cute=True): the CuTeDSL kernel writes each head chunk's sums (float16 scratch, chunks of 1 head here)
    and the separate top-K selects from them: the brute-force top-K (ties to the lower index) of exactly those sums,
    by histograms or by counting; the fused top-K (forced on, as on sm_90) is not run on them."""
    sel = _mod("selection")
    monkeypatch.setattr(sel, "_TOPK_FUSED_DEFAULT", True)
    monkeypatch.setattr(sel, "_capability", lambda device: (9, 0))  # the fused path's switch (fp8 given explicitly)
    seen = []
    real = sel.top_k_rows
    monkeypatch.setattr(sel, "top_k_rows", lambda sums, *a, **kw: seen.append((sums.clone(), kw)) or real(sums, *a, **kw))
    q, k, lse, perm, C = _inputs(gen, S=150)
    got = sel.select_kv(q, k, lse, perm, 40, group_size=C, kv_tile=16, fp8=True, cute=True, heads_per_chunk=1,
                        topk_count=topk_count)
    assert len(cute.calls) == 2 and len(seen) == 2
    assert [kw["cand_count"] for _, kw in seen] == [sel._TOPK_SEPARATE_COUNT_DEFAULT if topk_count is None
                                                    else topk_count] * 2
    sums = torch.cat([s for s, _ in seen], dim=1)
    assert torch.equal(got, ref_top_k_rows(sums, 40, got.shape[-1]))


@pytest.mark.parametrize("kw", [dict(cute=False), dict(fp8=False), dict(poly=1), dict(block_n=64),
                                dict(exp="f16_emulated"), dict(one_group=True)])
def test_cute_is_not_tried(gen, cute, kw):
    """Not tried: turned off, the bf16 path, or an option only the Triton kernel has; the Triton sums come back."""
    sel = _mod("selection")
    q, k, lse, perm, C = _inputs(gen)
    sel.group_prob_sums(q, k, lse, perm, group_size=C, **(dict(fp8=True, cute=True) | kw))
    assert not cute.calls


def test_cute_failure_falls_back_once_per_run(gen, cute, gluon, monkeypatch):
    """A failing CuTeDSL kernel: the call returns the Triton kernel's sums (bitwise those of cute=False), the reason is
    in the run's Record, the rest of the run does not try it again, a new run does. With the Gluon kernel on (a
    config reading KB, not the 2^KB made for the CuTeDSL kernel) the fallback skips it for the Triton kernel; with
    MC_SPARSE_PASS2_CUTE=1 the same."""
    sel = _mod("selection")
    d = _mod("pass2_dispatch")
    cute.err = RuntimeError("cute DSL compile boom")
    q, k, lse, perm, C = _inputs(gen, S=64)
    want = sel.group_prob_sums(q, k, lse, perm, group_size=C, fp8=True, cute=False)
    monkeypatch.setenv("MC_SPARSE_PASS2_CUTE", "1")
    with registry.recording(registry.Record()) as record:
        sel.select_kv(q, k, lse, perm, 20, group_size=C, kv_tile=16, fp8=True, gluon=True)
        assert len(cute.calls) == 1 and not gluon.calls
        for _ in range(2):
            assert torch.equal(sel.group_prob_sums(q, k, lse, perm, group_size=C, fp8=True), want)
        assert "failed earlier (RuntimeError: cute DSL compile boom)" == d.cute_refusal(None, None, C, None)
    assert len(cute.calls) == 1
    assert "cute DSL compile boom" in record.failures[d.CUTE_KEY] and d.GLUON_KEY not in record.failures
    assert d.cute_fallback_reason() is None and d.fallback_reason() is None  # the run's, not the process's
    with registry.recording(registry.Record()):  # a new run tries again
        sel.group_prob_sums(q, k, lse, perm, group_size=C, fp8=True)
    assert len(cute.calls) == 2


def test_cute_failure_without_record_goes_to_gluon_when_it_reads_2_pow_kb(gen, cute, gluon):
    """Without a record the failure is remembered for the process; a Gluon config that reads 2^KB (kb_poly=2) then
    takes the call with the same operands."""
    sel = _mod("selection")
    d = _mod("pass2_dispatch")
    cute.err, gluon.kb_poly = RuntimeError("launch boom"), 2
    q, k, lse, perm, C = _inputs(gen)
    for _ in range(2):
        out = sel.group_prob_sums(q, k, lse, perm, group_size=C, fp8=True, cute=True, gluon=True)
        assert bool((out == 7.0).all())
    assert len(cute.calls) == 1 and len(gluon.calls) == 2 and "boom" in d.cute_fallback_reason()
    assert torch.equal(gluon.calls[0]["kb"], cute.calls[0]["kb"])


def test_cute_out_of_memory_propagates(gen, cute):
    sel = _mod("selection")
    cute.err = torch.cuda.OutOfMemoryError("CUDA out of memory")
    q, k, lse, perm, C = _inputs(gen)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        sel.group_prob_sums(q, k, lse, perm, group_size=C, fp8=True, cute=True)
    assert _mod("pass2_dispatch").cute_fallback_reason() is None


def test_cute_default_routes_select_kv(gen, cute, gluon, monkeypatch):
    """CUTE_DEFAULT on (what a measured win sets): select_kv at its defaults runs the CuTeDSL kernel, the Gluon kernel
    is not tried, and MC_SPARSE_PASS2_CUTE=0 / cute=False turn it off again."""
    sel = _mod("selection")
    d = _mod("pass2_dispatch")
    monkeypatch.setattr(d, "CUTE_DEFAULT", True)
    q, k, lse, perm, C = _inputs(gen, S=64)
    sel.select_kv(q, k, lse, perm, 20, group_size=C, kv_tile=16, fp8=True)
    assert len(cute.calls) == 1 and not gluon.calls
    sel.select_kv(q, k, lse, perm, 20, group_size=C, kv_tile=16, fp8=True, cute=False)
    monkeypatch.setenv("MC_SPARSE_PASS2_CUTE", "0")
    sel.select_kv(q, k, lse, perm, 20, group_size=C, kv_tile=16, fp8=True)
    assert len(cute.calls) == 1


# --- the CuTeDSL kernel's fused top-K (pass2_dispatch.try_cute_select, reached from select_kv's FusedRows) ---

class _CuteFused(_Cute):
    """A stand-in CuTeDSL module with a fused top-K: with ``select`` = (sel, num_keys) it also writes each row's
    brute-force top-K of the sums it wrote (``select_err`` set: that launch fails; ``select_why``: refused)."""

    FUSED_TOPK = True

    def __init__(self, **kw):
        super().__init__(**kw)
        self.select_err, self.select_why = None, None

    def select_refusal(self, q8, k8, group_size, out, sel, num_keys):
        return self.select_why

    def group_prob_sums_fp8(self, q8, k8, qf, lse_s, kb, perm, out, *, group_size, select=None, **tuning):
        if select is not None and self.select_err is not None:
            self.calls.append(dict(out=out, select=select, C=group_size, tuning=tuning))
            raise self.select_err
        super().group_prob_sums_fp8(q8, k8, qf, lse_s, kb, perm, out, group_size=group_size)
        self.calls[-1]["select"] = select
        self.calls[-1]["tuning"] = tuning
        self.calls[-1]["sums"] = out.clone()
        if select is not None:
            sel, num_keys = select
            sel.copy_(ref_top_k_rows(out, num_keys, sel.shape[-1]))
        return out


@pytest.fixture
def cute_fused(monkeypatch):
    d = _mod("pass2_dispatch")
    d.reset()
    sel = _mod("selection")
    for name in ("MC_SPARSE_PASS2_CUTE", "MC_SPARSE_PASS2_GLUON", "MC_SPARSE_PASS2_CUTE_TOPK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MC_SPARSE_PASS2_CUTE_TOPK", "1")  # opted in: off by default since session 10
    fake = _CuteFused()
    monkeypatch.setattr(d, "_cute_module", lambda: fake)
    monkeypatch.setattr(sel, "_TOPK_FUSED_DEFAULT", True)
    monkeypatch.setattr(sel, "_capability", lambda device: (9, 0))  # the fused top-K's switch (fp8 given explicitly)
    seen = []
    real = sel.top_k_rows
    monkeypatch.setattr(sel, "top_k_rows", lambda sums, *a, **kw: seen.append(sums.clone()) or real(sums, *a, **kw))
    fake.separate = seen
    yield fake
    d.reset()


def _select(sel, q, k, lse, perm, C, **kw):
    return sel.select_kv(q, k, lse, perm, 40, group_size=C, kv_tile=16, fp8=True, cute=True, heads_per_chunk=1, **kw)


def test_select_kv_with_cute_runs_its_fused_top_k(gen, cute_fused):
    """select_kv(cute=True) where the CuTeDSL module has a fused top-K: each head chunk is one kernel call handed the
    chunk's view of the selection (int32, width = K rounded up to kv_tile) and K; no separate top-K runs, and the
    result is the brute-force top-K of the sums the kernel wrote. Mutations: the fused route never tried (a separate
    top-K runs), the chunk's selection view or K wrong (rows of another head / width)."""
    sel = _mod("selection")
    q, k, lse, perm, C = _inputs(gen, S=150)
    got = _select(sel, q, k, lse, perm, C)
    assert len(cute_fused.calls) == 2 and not cute_fused.separate
    for h, call in enumerate(cute_fused.calls):
        view, num_keys = call["select"]
        assert num_keys == 40 and view.data_ptr() == got[:, h:h + 1].data_ptr() and view.shape == got[:, h:h + 1].shape
    sums = torch.cat([c["sums"] for c in cute_fused.calls], dim=1)
    assert torch.equal(got, ref_top_k_rows(sums, 40, got.shape[-1]))
    assert _mod("pass2_dispatch").cute_topk_fallback_reason() is None


@pytest.mark.parametrize("unit", [True, False])
def test_cute_fused_top_k_gets_the_unit_qf_form(gen, cute_fused, monkeypatch, unit):
    """The fused launch is told the operands' form as the plain one is (``cute_unit_qf``): unit_qf=True with the
    operands of fp8_operands(unit_qf=True) (qf = 1), else no unit_qf argument. Mutation: unit_qf not passed on by
    select_kv or by try_cute_select (the kernel's fused launch runs its default form on qf = 1 operands)."""
    sel = _mod("selection")
    monkeypatch.delenv("MC_SPARSE_PASS2_UNIT_QF", raising=False)
    monkeypatch.setattr(cute_fused, "UNIT_QF", unit, raising=False)
    q, k, lse, perm, C = _inputs(gen, S=150)
    _select(sel, q, k, lse, perm, C)
    assert [c["select"] is not None for c in cute_fused.calls] == [True, True]
    assert [c["tuning"].get("unit_qf", False) is not False for c in cute_fused.calls] == [unit, unit]
    assert all(bool((c["qf"] == 1).all()) == unit for c in cute_fused.calls)


@pytest.mark.parametrize("how", ["refused", "env off", "env unset (the default)", "no module support", "topk_fused=False"])
def test_cute_fused_top_k_not_used(gen, cute_fused, monkeypatch, how):
    """The fused top-K refused by the module, switched off (MC_SPARSE_PASS2_CUTE_TOPK=0, or unset: off by default),
    absent from the module (no FUSED_TOPK) or not asked for (topk_fused=False): the CuTeDSL kernel writes the sums
    only and the separate top-K selects from them (the brute force of those sums); nothing is remembered as a
    failure."""
    sel = _mod("selection")
    d = _mod("pass2_dispatch")
    kw = {}
    if how == "refused":
        cute_fused.select_why = "fused top-K takes Sk <= 65536"
        assert d.cute_select_refusal(None, None, 128, None, None, 40, requested=True) == cute_fused.select_why
    elif how == "env off":
        monkeypatch.setenv("MC_SPARSE_PASS2_CUTE_TOPK", "0")
        assert "fused top-K off" in d.cute_select_refusal(None, None, 128, None, None, 40, requested=True)
    elif how == "env unset (the default)":
        monkeypatch.delenv("MC_SPARSE_PASS2_CUTE_TOPK")
        assert "fused top-K off" in d.cute_select_refusal(None, None, 128, None, None, 40, requested=True)
    elif how == "no module support":
        monkeypatch.setattr(_CuteFused, "FUSED_TOPK", False)
        assert "no fused top-K" in d.cute_select_refusal(None, None, 128, None, None, 40, requested=True)
    else:
        kw = dict(topk_fused=False)
    q, k, lse, perm, C = _inputs(gen, S=150)
    got = _select(sel, q, k, lse, perm, C, **kw)
    assert [c["select"] for c in cute_fused.calls] == [None, None] and len(cute_fused.separate) == 2
    assert torch.equal(got, ref_top_k_rows(torch.cat(cute_fused.separate, dim=1), 40, got.shape[-1]))
    assert d.cute_topk_fallback_reason() is None and d.cute_fallback_reason() is None


def test_cute_fused_top_k_failure_falls_back_to_the_kernel_without_it(gen, cute_fused):
    """The fused launch failing: that call runs the CuTeDSL kernel without the fused top-K + the separate top-K (the
    brute force of those sums), the reason is in the run's Record under CUTE_TOPK_KEY (not CUTE_KEY: the kernel
    itself stays on), the rest of the run does not try the fused launch again, a new run does."""
    sel = _mod("selection")
    d = _mod("pass2_dispatch")
    cute_fused.select_err = RuntimeError("fused top-K compile boom")
    q, k, lse, perm, C = _inputs(gen, S=150)
    with registry.recording(registry.Record()) as record:
        got = _select(sel, q, k, lse, perm, C)
        assert [c["select"] is not None for c in cute_fused.calls] == [True, False, False]
        assert "fused top-K failed earlier" in d.cute_select_refusal(None, None, C, None, None, 40, requested=True)
    assert "fused top-K compile boom" in record.failures[d.CUTE_TOPK_KEY] and d.CUTE_KEY not in record.failures
    assert len(cute_fused.separate) == 2
    sums = torch.cat([c["sums"] for c in cute_fused.calls[1:]], dim=1)
    assert torch.equal(got, ref_top_k_rows(sums, 40, got.shape[-1]))
    cute_fused.select_err = None
    with registry.recording(registry.Record()):  # a new run tries the fused launch again
        _select(sel, q, k, lse, perm, C)
    assert cute_fused.calls[3]["select"] is not None


def test_cute_select_refusal_starts_with_the_kernels_own(cute_fused, monkeypatch):
    """cute_select_refusal answers the kernel's own refusal first (switched off, a Triton-only option, the module's
    refusal of the operands) and try_cute_select then launches nothing, fused or not. Mutation: that first check
    dropped (the fused launch asked only the top-K's own conditions)."""
    d = _mod("pass2_dispatch")
    assert d.cute_select_refusal(None, None, 128, None, None, 40, requested=False) == "off (cute=False)"
    only = "first-digit histogram requested (Triton kernel only)"
    assert d.cute_select_refusal(None, None, 128, None, None, 40, requested=True, only_triton=only) == only
    monkeypatch.setattr(cute_fused, "refusal", lambda q8, k8, group_size, out: "runs head dim 128 only, got 64")
    assert d.cute_select_refusal(None, None, 128, None, None, 40, requested=True) == "runs head dim 128 only, got 64"
    assert not d.try_cute_select(None, None, None, None, None, None, None, group_size=128, sel=None, num_keys=40,
                                 requested=True)
    assert not cute_fused.calls and d.cute_topk_fallback_reason() is None


def test_cute_wanted_needs_the_switch_and_the_module(monkeypatch):
    """cute_wanted (whether a float8 pass 2 makes the operands the CuTeDSL kernel reads, 2^KB): only when the kernel is
    switched on AND its module imports; a failing import (no nvidia-cutlass-dsl) is False, not an error. Mutations:
    the switch ignored, an import failure read as wanted."""
    d = _mod("pass2_dispatch")
    monkeypatch.delenv("MC_SPARSE_PASS2_CUTE", raising=False)
    imports = []
    monkeypatch.setattr(d, "_cute_module", lambda: imports.append(1) or object())
    assert d.cute_wanted(True) and not d.cute_wanted(False)
    monkeypatch.setenv("MC_SPARSE_PASS2_CUTE", "0")
    assert not d.cute_wanted() and len(imports) == 1  # switched off: the module is not even imported

    def missing():
        raise ImportError("No module named 'cutlass'")

    monkeypatch.setattr(d, "_cute_module", missing)
    assert not d.cute_wanted(True)
