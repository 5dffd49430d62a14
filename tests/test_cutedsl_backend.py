"""The CuTeDSL backend on the CPU (issue 16): its capability rules, its registration with and without the optional
libraries, the per-call refusals that make the registry fall back, and (when nvidia-cutlass-dsl and flash-attn-4 are
installed) an offline sm_90 compile of the kernel. The kernel itself is checked on the GPU: tests/test_gpu_cutedsl.py."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch
from comfyui_mc_sparse_pack import kernels
from comfyui_mc_sparse_pack.kernels import reference, registry
from comfyui_mc_sparse_pack.kernels.cutedsl import rules

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("device", "cap", "dtype", "d", "why"),
    [
        ("cpu", None, torch.bfloat16, 128, "CUDA devices"),
        ("cuda", (8, 9), torch.bfloat16, 128, "sm_90"),
        ("cuda", (10, 0), torch.bfloat16, 128, "sm_90"),
        ("cuda", (9, 0), torch.float32, 128, "float16/bfloat16"),
        ("cuda", (9, 0), torch.bfloat16, 96, "head dim 64 or 128"),
        ("cuda", (9, 0), torch.bfloat16, 128, None),
        ("cuda", (9, 0), torch.float16, 64, None),
    ],
)
def test_capability_rules(device, cap, dtype, d, why):
    got = rules.refusal(device, cap, dtype, d)
    assert (got is None) if why is None else (why in got), got


def test_registered_and_unavailable_without_the_libraries():
    """CI has no nvidia-cutlass-dsl: the backend is listed with the import error as its reason, and the reuse op runs
    on another backend (the pack never needs the optional libraries)."""
    b = {x.name: x for x in registry.backends()}["cutedsl"]
    if importlib.util.find_spec("cutlass") is None:
        assert b.unavailable_reason and "cutlass" in b.unavailable_reason
    assert b.priority > {x.name: x for x in registry.backends()}["triton"].priority  # preferred where it runs
    assert "cutedsl" in registry.report()
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 200, 64, generator=g) for _ in range(3))
    perm = torch.cat([torch.randperm(200, generator=g), torch.full((56,), -1)]).int().expand(1, 2, 256).contiguous()
    idx = torch.arange(128, dtype=torch.int32).expand(1, 2, 2, 128).contiguous()
    with registry.recording(registry.Record()) as rec:
        kernels.sparse_attention(q, k, v, perm, idx)
    assert rec.choices["sparse_attention"].backend != "cutedsl"


def test_the_pack_imports_with_cutlass_blocked():
    """Even where nvidia-cutlass-dsl is installed, a broken one (import raising) leaves the pack importable."""
    code = textwrap.dedent(f"""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split('.')[0] in ('cutlass', 'flash_attn'):
                    raise ImportError('blocked for the test: ' + name)
        sys.meta_path.insert(0, Block())
        sys.path.insert(0, {str(ROOT / 'comfyui_mc_sparse')!r})
        import _standalone
        _standalone.load_pack()
        from comfyui_mc_sparse_pack.kernels import registry
        b = {{x.name: x for x in registry.backends()}}['cutedsl']
        print('REASON', b.unavailable_reason)
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ))
    assert p.returncode == 0, p.stderr[-2000:]
    assert "REASON" in p.stdout and "blocked for the test" in p.stdout


def _call(C=128, H=2, S=300, D=128, kv_strided=False):
    B = 1
    G = -(-S // C)
    q = torch.zeros(B, S, H * D, dtype=torch.bfloat16).view(B, S, H, D).transpose(1, 2)
    k = torch.zeros(B, S, H * D * (2 if kv_strided else 1), dtype=torch.bfloat16)
    k = (k[..., ::2] if kv_strided else k).reshape(B, S, H, D).transpose(1, 2)
    perm = torch.zeros(B, H, G * C, dtype=torch.int32)
    idx = torch.zeros(B, H, G, 128, dtype=torch.int32)
    return q, k, k, perm, idx


@pytest.mark.parametrize(("kwargs", "why"), [
    (dict(), None),
    (dict(C=64), "group size 128"),
    (dict(kv_strided=True), "unit stride on D"),
])  # the group limit: test_call_refusal_group_limit_is_exact (without allocating huge tensors)
def test_call_refusals(kwargs, why):
    """Calls the kernel cannot take raise RuntimeError in the op (the registry then falls back, once per run, with
    this reason in the summary); shapes and strides only, no device sync."""
    got = rules.call_refusal(*_call(**kwargs))
    assert (got is None) if why is None else (why in got), got


def _kv_rows(S=300, H=2, D=128, row_pad=0, offset=0):
    """k or v as the model hands it over: ``[B, S, H*D]`` (rows padded by row_pad elements, the view starting offset
    elements in) viewed ``[B, H, S, D]``."""
    flat = torch.zeros(S * (H * D + row_pad) + offset, dtype=torch.bfloat16)
    return flat[offset:].view(1, S, H * D + row_pad)[..., :H * D].reshape(1, S, H, D).transpose(1, 2)


@pytest.mark.parametrize(("name", "bad", "why"), [
    ("v", {"row_pad": 4}, "16-byte aligned rows"),  # row stride H*D + 4 elements: rows 8 bytes off
    ("k", {"offset": 4}, "16-byte aligned rows"),  # the view starts 8 bytes into its storage
    ("v", {"offset": 8}, None),  # 16 bytes in: aligned
    ("k", {"row_pad": 8}, None),  # padded rows that stay 16-byte aligned
])
def test_call_refusals_check_each_of_k_and_v(name, bad, why):
    """k and v are checked separately (a caller may hand over one aligned and one not), on the row stride and the
    view's start address as well as the unit stride on D."""
    q, k, v, perm, idx = _call()
    k, v = (_kv_rows(**bad), v) if name == "k" else (k, _kv_rows(**bad))
    got = rules.call_refusal(q, k, v, perm, idx)
    assert (got is None) if why is None else (why in got and f"reads {name} rows" in got), got


@pytest.mark.parametrize(("groups", "refused"), [(2**31 - 1, False), (2**31, True)])
def test_call_refusal_group_limit_is_exact(groups, refused):
    """Fewer than 2^31 groups in all (the kernel's int32 group index): the limit itself runs, one more falls back.
    Shapes only (zero-stride expanded tensors: nothing of that size is allocated)."""
    C, D = 128, 64
    q = torch.zeros(1, 1, 1, D, dtype=torch.bfloat16).expand(1, 1, groups * C, D)
    kv = _kv_rows(S=4, H=1, D=D)
    perm = torch.zeros(1, 1, 1, dtype=torch.int32).expand(1, 1, groups * C)
    idx = torch.zeros(1, 1, 1, 128, dtype=torch.int32).expand(1, 1, groups, 128)
    got = rules.call_refusal(q, kv, kv, perm, idx)
    assert (got is not None and "fewer than 2^31 groups" in got) if refused else got is None, got


_NEEDS_CUTE = pytest.mark.skipif(
    importlib.util.find_spec("cutlass") is None or importlib.util.find_spec("flash_attn") is None,
    reason="nvidia-cutlass-dsl and flash-attn-4 not installed (optional; CI has neither)")


@_NEEDS_CUTE
def test_stages_setting_is_checked(monkeypatch):
    """MC_SPARSE_CUTEDSL_STAGES other than 2 / 3 is a clear ValueError (the op turns it into a fallback)."""
    from comfyui_mc_sparse_pack.kernels.cutedsl import compile as cc

    for bad in ("4", "abc", ""):
        monkeypatch.setenv("MC_SPARSE_CUTEDSL_STAGES", bad)
        with pytest.raises(ValueError, match="must be 2 or 3"):
            cc.default_stages()
    monkeypatch.setenv("MC_SPARSE_CUTEDSL_STAGES", "3")
    assert cc.default_stages() == 3


@_NEEDS_CUTE
def test_an_unusable_disk_cache_still_compiles(monkeypatch):
    """A cache directory that takes no lock files (read-only file system) or a lock timeout: the kernel is compiled
    in this process (a warning says why), never an error that would keep the backend off every run."""
    from comfyui_mc_sparse_pack.kernels.cutedsl import compile as cc

    class Broken:
        def __contains__(self, key):
            raise FileNotFoundError("no lock file")

        def __setitem__(self, key, fn):
            raise RuntimeError("lock timeout")

    monkeypatch.setattr(cc, "_memory", {})
    monkeypatch.setattr(cc, "_disk_cache", Broken)
    monkeypatch.setattr(cc, "compile_fake", lambda *a: ("compiled", *a))
    assert cc.compiled("bfloat16", 128, False, stages=2) == ("compiled", "bfloat16", 128, False, "none", 2,
                                                             cc.PRODUCER, "registers", ())
    assert cc.compiled("bfloat16", 128, False, stages=2) is cc.compiled("bfloat16", 128, False, stages=2)


@_NEEDS_CUTE
def test_offline_sm90_compile(tmp_path):
    """The kernel compiles for sm_90a from fake tensors without a GPU (CUTE_DSL_ARCH): catches DSL errors on CPU.
    The compiled object lands in the disk cache, and a second process (a second ComfyUI start) loads it from there
    without compiling (its compile_fake raises)."""
    code = textwrap.dedent(f"""
        import os, sys
        os.environ['CUTE_DSL_ARCH'] = 'sm_90a'
        sys.path.insert(0, {str(ROOT / 'comfyui_mc_sparse')!r})
        import _standalone
        _standalone.load_pack()
        from comfyui_mc_sparse_pack.kernels.cutedsl import compile as cc
        if sys.argv[1] == 'again':
            def no_compile(*a):
                raise AssertionError('compiled again instead of loading from the disk cache')
            cc.compile_fake = no_compile
        cc.compiled('bfloat16', 128, True)
        print('COMPILED' if sys.argv[1] == 'first' else 'LOADED')
    """)
    env = dict(os.environ, MC_SPARSE_CUTEDSL_CACHE_DIR=str(tmp_path))
    p = subprocess.run([sys.executable, "-c", code, "first"], capture_output=True, text=True, env=env)
    assert "COMPILED" in p.stdout, p.stderr[-3000:]
    assert any(tmp_path.glob("*.o")), list(tmp_path.iterdir())
    p = subprocess.run([sys.executable, "-c", code, "again"], capture_output=True, text=True, env=env)
    assert "LOADED" in p.stdout, p.stderr[-3000:]


@_NEEDS_CUTE
def test_offline_sm90_compile_every_residual(tmp_path):
    """The kernel compiles for sm_90a without a GPU for every residual form (bf16, D 128, LSE), for fp16 / D 64
    without the LSE, with the L2-hinted producers and the staged epilogue (bf16 D 128 LSE, fp16 D 64) and with
    every option but "diag_no_copy" (the persistent staged epilogue); about 5 s per compile."""
    code = textwrap.dedent(f"""
        import os, sys
        os.environ['CUTE_DSL_ARCH'] = 'sm_90a'
        sys.path.insert(0, {str(ROOT / 'comfyui_mc_sparse')!r})
        import _standalone
        _standalone.load_pack()
        from comfyui_mc_sparse_pack.kernels.cutedsl import compile as cc
        for res in cc.RESIDUALS:
            cc.compile_fake('bfloat16', 128, True, res)
            print('COMPILED', res)
        cc.compile_fake('float16', 64, False, 'none')
        print('COMPILED fp16')
        cc.compile_fake('bfloat16', 128, True, 'none', producer='cp.async+evict', epilogue='smem')
        cc.compile_fake('float16', 64, False, 'fp8_row', producer='cp.async+l2')
        print('COMPILED hinted')
        # diag_no_copy (a diagnostic) would drop the copies compiled here
        every = tuple(o for o in cc.OPTIONS if o != 'diag_no_copy')
        cc.compile_fake('bfloat16', 128, True, 'none', epilogue='smem', options=every)
        print('COMPILED options')
    """)
    env = dict(os.environ, MC_SPARSE_CUTEDSL_CACHE_DIR=str(tmp_path))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert p.stdout.count("COMPILED") == 10, p.stdout + p.stderr[-3000:]


def _fake_launch(fn, q, k, v, out, lse, perm_rows, kv_rows, counts, res_data, res_scale, res_coef, res_mean, scale,
                 num_ctas, ws_o=None, ws_lse=None, n_parts=1):
    """A float64 torch model of one launch, on the contract of ``kernels/cutedsl/sparse_fwd_sm90.py`` (with
    the compiled kernel's argument checks: ranks, dtypes, unit strides, the residual form it was compiled for);
    with ``n_parts`` > 1 ("split_tail") the last round's groups go to the workspace in parts (``_fake_parts``)."""
    _, dtype, head_dim, with_lse, residual, epilogue = fn
    B, S, H, D = q.shape
    if epilogue == "smem":  # 16-byte stores of rounded O: no residual, 16-byte aligned out rows
        assert residual == "none" and out.data_ptr() % 16 == 0 and all(st % 8 == 0 for st in out.stride()[:3])
    N = perm_rows.shape[0]
    G = N // (B * H)
    assert D == head_dim and q.dtype == out.dtype == k.dtype == v.dtype == rules_dtype(dtype)
    assert out.shape == q.shape and k.shape == v.shape and k.shape[0] == B and k.shape[2] == H and num_ctas >= 1
    assert all(t.stride(-1) == 1 for t in (q, k, v, out, kv_rows)) and (lse is not None) == with_lse
    assert perm_rows.shape == (N, 128) and perm_rows.is_contiguous() and N == B * H * G
    assert counts.shape == (N,) and kv_rows.shape[0] == N and kv_rows.dtype == counts.dtype == torch.int32
    if lse is not None:
        assert lse.shape == (B, H, S) and lse.dtype == torch.float32 and lse.stride(-1) == 1
    kind = residual.split("_")[0] if residual != "none" else None
    if kind == "plain":
        assert res_data.shape == q.shape and str(res_data.dtype) == "torch." + residual[len("plain_"):]
    elif kind is not None:
        assert res_data.dtype == torch.uint8 and res_scale.shape == (B, H, S) and res_scale.stride(-1) == 1
        assert res_data.shape == ((B, S, H, D // 2) if residual.startswith("int4") else q.shape)
    assert (res_mean is not None) == (res_coef is not None) == (residual == "int4_group")
    if residual == "int4_group":
        assert res_coef.dtype == torch.uint8 and res_coef.shape == (B, H, S) and res_scale.dtype == torch.bfloat16
        assert res_mean.dtype == torch.bfloat16 and res_mean.shape == (B, H, G, D) and res_mean.stride(-1) == 1
    n_full = N
    if n_parts > 1:
        assert epilogue == "smem" and ws_o is not None and N > num_ctas
        n_full = N // num_ctas * num_ctas
        _fake_parts(q, k, v, perm_rows, kv_rows, counts, scale, ws_o, ws_lse, n_full, n_parts, G, H)
    for n in range(n_full):
        b, h = divmod(n // G, H)
        rows = perm_rows[n][perm_rows[n] >= 0].long()
        keys = kv_rows[n, : int(counts[n])].long()
        s = q[b, rows, h].double() @ k[b, keys, h].double().T * scale
        o = s.softmax(-1) @ v[b, keys, h].double()
        if kind == "plain":
            o = o + res_data[b, rows, h].double()
        elif residual == "fp8_row":
            o = o + res_data[b, rows, h].view(torch.float8_e4m3fn).double() * res_scale[b, h, rows, None].double()
        elif residual.startswith("int4"):
            byte = res_data[b, rows, h].long()
            nib = torch.stack((byte % 16 - 8, byte // 16 - 8), -1).flatten(-2).double()
            o = o + nib * res_scale[b, h, rows, None].double()
            if residual == "int4_group":
                coef = res_coef[b, h, rows].view(torch.float8_e4m3fn).double()
                o = o + coef[:, None] * res_mean[b, h, n % G].double()
        out[b, rows, h] = o.to(out.dtype)
        if lse is not None:
            lse[b, h, rows] = s.logsumexp(-1).float()


def _fake_parts(q, k, v, perm_rows, kv_rows, counts, scale, ws_o, ws_lse, n_full, n_parts, G, H):
    """The "split_tail" items of groups n_full..N-1 (``sparse_fwd_sm90.SparseFwdSm90._work``): part p of a group of
    T key tiles covers tiles [p*T//P, (p+1)*T//P) (an empty part: the last tile, LSE -inf); its normalised O of all
    128 slots (padded ones read query row 0) and LSE at workspace rows (j*P + p)*128 ..."""
    for j in range(perm_rows.shape[0] - n_full):
        n = n_full + j
        b, h = divmod(n // G, H)
        rows = perm_rows[n].clamp(min=0).long()
        count = int(counts[n])
        tiles = -(-count // 128)
        for p in range(n_parts):
            lo, hi = p * tiles // n_parts, (p + 1) * tiles // n_parts
            empty = lo == hi
            lo, hi = (tiles - 1, tiles) if empty else (lo, hi)
            keys = kv_rows[n, lo * 128: min(hi * 128, count)].long()
            s = q[b, rows, h].double() @ k[b, keys, h].double().T * scale
            at = slice((j * n_parts + p) * 128, (j * n_parts + p + 1) * 128)
            ws_o[at] = (s.softmax(-1) @ v[b, keys, h].double()).to(ws_o.dtype)
            ws_lse[at] = float("-inf") if empty else s.logsumexp(-1).float()


def rules_dtype(name):
    return {v: k for k, v in rules.DTYPE_NAMES.items()}[name]


@pytest.fixture
def fake_op(monkeypatch):
    """kernels/cutedsl/op.py imported with its compiled kernel replaced by ``_fake_launch`` (no cutlass needed: CI
    runs it); ``fake_op.calls`` lists the static parameters each launch was compiled for."""
    pkg = importlib.import_module("comfyui_mc_sparse_pack.kernels.cutedsl")
    fake = types.ModuleType(f"{pkg.__name__}.compile")
    fake.calls, fake.epilogues = [], []
    fake.compiled = lambda dtype, head_dim, with_lse, residual="none", stages=None, producer=None, epilogue="registers", options=(): (
        fake.calls.append((dtype, head_dim, with_lse, residual)) or fake.epilogues.append(epilogue)
        or ("fake", dtype, head_dim, with_lse, residual, epilogue))
    fake.launch = _fake_launch
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    monkeypatch.setattr(pkg, "compile", fake, raising=False)
    monkeypatch.setattr(pkg, "op", None, raising=False)
    monkeypatch.delitem(sys.modules, f"{pkg.__name__}.op", raising=False)
    op = importlib.import_module(f"{pkg.__name__}.op")
    assert op._compile is fake
    op.calls, op.epilogues = fake.calls, fake.epilogues
    return op


@pytest.mark.parametrize("ctas", [4, 5, 7])
def test_split_tail_parts_merged(fake_op, monkeypatch, ctas):
    """With "split_tail" the op splits the last round's groups (groups mod ctas of them, when at most half the CTAs)
    into parts through the kernel's workspace (the fake launch's model) and merges them (``tail_merge``, the Triton
    kernel, under the interpreter on CPU): out and LSE equal the float64 reference on every row, including groups
    with fewer key tiles than parts (5 parts of groups of 1-3 tiles: empty parts, LSE -inf) and padded query slots;
    7 CTAs (no split) as control."""
    monkeypatch.setattr(rules, "EPILOGUE", "smem")
    monkeypatch.setattr(rules, "STAGED_OPTIONS", ("persistent", "overlap", "split_tail"))
    monkeypatch.setattr(fake_op, "_sm_count", lambda device: ctas)
    gen = torch.Generator().manual_seed(29 + ctas)
    B, H, S, D, K = 1, 2, 330, 64, 300  # 3 groups per head (the last padded), up to 3 key tiles each
    q, k, v, perm, idx = _op_inputs(gen, B, H, S, D, K)
    idx[0, 1, 2, 100:] = -1  # one group of a single key tile
    out = torch.full((B, S, H * D), float("nan"), dtype=torch.bfloat16).view(B, S, H, D).transpose(1, 2)
    got, lse = fake_op.sparse_attention(q, k, v, perm, idx, out=out, return_lse=True)
    assert rules.split_parts(6, ctas) == {4: 2, 5: 5, 7: 1}[ctas]
    ref, ref_lse = reference.sparse_attention(q.double(), k.double(), v.double(), perm, idx, return_lse=True)
    assert not got.isnan().any() and not lse.isnan().any()
    assert float((got.double() - ref).abs().max()) <= 2**-7 * float(ref.abs().max())
    assert float((lse.double() - ref_lse).abs().max()) <= 1e-4


@pytest.mark.parametrize(("groups", "ctas", "want"), [
    (3072, 132, 3), (23640, 132, 11), (3036, 132, 1), (3100, 132, 2), (3130, 132, 1), (100, 132, 1), (10, 132, 1), (133, 132, 16), (6, 4, 2),
])
def test_split_parts(groups, ctas, want):
    """Parts per last-round group: only when that round is at most half full, never more than MAX_PARTS, never with
    fewer groups than CTAs (mutation: 10 groups on 132 CTAs split into 13 parts)."""
    assert rules.split_parts(groups, ctas) == want


@pytest.mark.parametrize(("default", "pad", "start", "kind", "want"), [
    ("smem", 0, 0, None, "smem"), ("smem", 8, 0, None, "smem"), ("smem", 4, 0, None, "registers"),
    ("smem", 8, 4, None, "registers"), ("smem", 0, 0, "fp8_row", "registers"), ("registers", 0, 0, None, "registers"),
])
def test_staged_epilogue_only_where_it_applies(fake_op, monkeypatch, default, pad, start, kind, want):
    """With the staged (16-byte store) epilogue as the default, a call gets it only without a residual and with
    16-byte aligned out rows (a [B, S, H*D + pad] buffer: pad 4 bf16 elements misaligns every row but the first;
    out starting ``start`` elements into it, 8 bytes, misaligns every row though the row stride is aligned:
    mutation, ``epilogue_for`` without its base-pointer check, passed the other cases); the fake launch asserts the
    same, and the output is right either way."""
    from .test_reuse_op import brute_residual, make_residual

    monkeypatch.setattr(rules, "EPILOGUE", default)
    gen = torch.Generator().manual_seed(7)
    B, H, S, D, K = 1, 2, 200, 64, 130
    q, k, v, perm, idx = _op_inputs(gen, B, H, S, D, K)
    res = None if kind is None else make_residual(torch.randn(B, H, S, D, generator=gen) * 0.1, kind, perm,
                                                  idx.shape[2])
    base = torch.full((B, S, H * D + pad), float("nan"), dtype=torch.bfloat16)
    out = base[..., start:start + H * D].view(B, S, H, D).transpose(1, 2)
    got = fake_op.sparse_attention(q, k, v, perm, idx, out=out, residual=res)
    assert fake_op.epilogues == [want]
    ref = reference.sparse_attention(q.double(), k.double(), v.double(), perm, idx)
    if res is not None:
        ref = ref + brute_residual(res, perm)
    assert float((got.double() - ref).abs().max()) <= 2**-7 * float(ref.abs().max())


def _op_inputs(gen, B, H, S, D, K, dtype=torch.bfloat16):
    """Native [B, S, H*D] views, random groups, ragged sorted indices (one group with a single key)."""
    q, k, v = (torch.randn(B, S, H * D, generator=gen).to(dtype).view(B, S, H, D).transpose(1, 2) for _ in range(3))
    G = -(-S // 128)
    perm = torch.full((B, H, G * 128), -1, dtype=torch.int32)
    perm[..., :S] = torch.argsort(torch.rand(B, H, S, generator=gen), -1).to(torch.int32)
    idx = torch.full((B, H, G, K), -1, dtype=torch.int32)
    cut = torch.randint(1, K + 1, (B, H, G), generator=gen)
    cut.view(-1)[0] = 1
    for i, n in enumerate(cut.view(-1).tolist()):
        idx.view(-1, K)[i, :n] = torch.randperm(S, generator=gen)[:n].sort().values.to(torch.int32)
    return q, k, v, perm, idx


@pytest.mark.parametrize(("kind", "idx_strided"), [
    (None, False), ("fp8_row", True), ("int4_row", False), ("plain-fp32", False), ("int4_group", True),
])
def test_op_glue_against_float64(fake_op, kind, idx_strided):
    """The op around the kernel (views handed to it, valid counts, one launch for B = 2, residual forms, LSE in query
    order) on the CPU with the kernel modelled in float64: S not a multiple of 128, ragged counts, a NaN-poisoned
    out view with padded rows written in full (the padding left alone), kv_idx also as a strided view (the kernel
    reads index rows with unit stride)."""
    from .test_reuse_op import brute_residual, make_residual

    gen = torch.Generator().manual_seed(53)
    B, H, S, D, K = 2, 3, 300, 64, 160
    q, k, v, perm, idx = _op_inputs(gen, B, H, S, D, K)
    if idx_strided:
        wide = torch.full((B, H, idx.shape[2], 2 * K), -1, dtype=torch.int32)
        wide[..., ::2] = idx
        idx = wide[..., ::2]
    r = torch.randn(B, H, S, D, generator=gen) * 0.1
    res = None if kind is None else kernels.Residual(r) if kind == "plain-fp32" else make_residual(r, kind, perm,
                                                                                                   idx.shape[2])
    base = torch.full((B, S, H * D + 8), float("nan"), dtype=torch.bfloat16)
    out = base[..., :H * D].view(B, S, H, D).transpose(1, 2)
    got, lse = fake_op.sparse_attention(q, k, v, perm, idx, scale=0.2, return_lse=True, out=out, residual=res)
    assert got is out and not out.isnan().any() and base[..., H * D:].isnan().all() and not lse.isnan().any()
    res_name = {None: "none", "plain-fp32": "plain_float32"}.get(kind, kind)
    assert fake_op.calls == [("bfloat16", D, True, res_name)]  # one launch for both batch elements
    ref, ref_lse = reference.sparse_attention(q.double(), k.double(), v.double(), perm, idx, scale=0.2,
                                              return_lse=True)
    if res is not None:
        ref = ref + brute_residual(res, perm)
    assert float((got.double() - ref).abs().max()) <= 2**-7 * float(ref.abs().max()), "output"
    assert float((lse.double() - ref_lse.double()).abs().max()) < 1e-5, "LSE"


def test_a_misaligned_q_falls_back(fake_op, monkeypatch):
    """A q the kernel cannot read (rows 8 bytes off a 16-byte boundary) falls back to the next backend with the
    reason; q, out and the residual are checked like k and v."""
    why = "reads q rows by 16-byte copies"
    gen = torch.Generator().manual_seed(59)
    q, k, v, perm, idx = _op_inputs(gen, 1, 2, 200, 64, 128)
    q = _kv_rows(S=200, D=64, offset=4)
    q.copy_(torch.randn(q.shape, generator=gen))
    _as_cutedsl(monkeypatch, fake_op)
    with registry.recording(registry.Record()) as rec:
        got = kernels.sparse_attention(q, k, v, perm, idx)
    assert rec.choices["sparse_attention"].backend != "cutedsl"
    assert why in rec.failures["cutedsl", "sparse_attention"], rec.failures
    want = reference.sparse_attention(q.double(), k.double(), v.double(), perm, idx)
    assert float((got.double() - want).abs().max()) <= 2**-7 * float(want.abs().max())


@pytest.mark.parametrize(("what", "why"), [
    ("out", "writes out rows 4 bytes at a time"), ("residual", "reads residual rows in pairs"),
    ("scale", "residual scale with unit stride"), ("mean", "group mean rows in pairs"), ("int4_odd", None),
    (None, None),
])
def test_call_refusals_of_out_and_residual(what, why):
    """The per-call checks of the outputs and the residual: an out view with rows 2 bytes off, a plain fp32 residual
    whose rows are 4 bytes off (pairs are 8-byte loads), a row scale with a non-unit stride on S, an int4_group mean
    whose rows are 2 bytes off (bf16 pairs are 4-byte loads). An int4 residual at an odd byte offset runs (the kernel
    reads one byte, a pair of elements, at a time). Mutations: the mean check dropped; int4 rows checked as 2-byte
    pairs (a needless fallback)."""
    q, k, v, perm, idx = _call(H=2, S=300, D=64)
    B, H, S, D = q.shape
    out = res = None
    if what == "out":
        out = torch.zeros(B * S * H * D + 1, dtype=torch.bfloat16)[1:].view(B, S, H, D).transpose(1, 2)
    elif what == "residual":
        res = kernels.Residual(torch.zeros(B * S * H * D + 1)[1:].view(B, S, H, D).transpose(1, 2))
    elif what == "scale":
        res = kernels.Residual(torch.zeros(B, H, S, D // 2, dtype=torch.uint8), torch.zeros(B, H, 2 * S)[..., ::2],
                               "int4_row")
    elif what == "mean":
        G = idx.shape[2]
        mean = torch.zeros(B * H * G * D + 1, dtype=torch.bfloat16)[1:].view(B, H, G, D)
        res = kernels.Residual(torch.zeros(B, H, S, D // 2, dtype=torch.uint8), torch.zeros(B, H, S, dtype=torch.bfloat16),
                               "int4_group", torch.zeros(B, H, S, dtype=torch.uint8).view(torch.float8_e4m3fn), mean)
    elif what == "int4_odd":
        data = torch.zeros(B * S * H * D // 2 + 1, dtype=torch.uint8)[1:].view(B, S, H, D // 2).transpose(1, 2)
        res = kernels.Residual(data, torch.zeros(B, H, S), "int4_row")
    got = rules.call_refusal(q, k, v, perm, idx, out=out, residual=res)
    assert (got is None) if why is None else (why in got), got


def _as_cutedsl(monkeypatch, op):
    """Register the op (fake kernel) as the cutedsl backend, accepting CPU tensors."""
    monkeypatch.setitem(registry._backends, "cutedsl", registry.Backend(
        name="cutedsl", priority=40, ops={"sparse_attention": op.sparse_attention}))


@pytest.mark.parametrize(("failure", "why"), [
    ("group64", "RuntimeError: the CuTeDSL kernel needs group size 128"),
    ("ffi_value", "ValueError: Mismatched Tensor on argument #0"),
    ("dsl_type", "TypeError: the DSL rejected an argument"),
])
def test_op_failures_fall_back_with_the_reason(fake_op, monkeypatch, failure, why):
    """Whatever the kernel cannot run (a refused call, or the compiled kernel's own argument check raising
    ValueError / TypeError, as TVM-FFI and the DSL do) falls back to the next backend once per run with the reason
    in the run's Record: never the caller's error, never a lost run."""
    gen = torch.Generator().manual_seed(43)
    B, H, S, D, K = 1, 2, 200, 64, 128
    q, k, v, perm, idx = _op_inputs(gen, B, H, S, D, K)
    if failure == "group64":
        idx = torch.cat([idx, idx], 2)  # the same rows, as G = 4 groups of C = 64 (perm's 256 slots)
    else:
        err = ValueError if failure == "ffi_value" else TypeError
        msg = "Mismatched Tensor on argument #0" if failure == "ffi_value" else "the DSL rejected an argument"

        def broken(*a, **kw):
            raise err(msg)

        monkeypatch.setattr(fake_op._compile, "launch", broken)
    _as_cutedsl(monkeypatch, fake_op)
    with registry.recording(registry.Record()) as rec:
        got = kernels.sparse_attention(q, k, v, perm, idx)
        again = kernels.sparse_attention(q, k, v, perm, idx)
    assert rec.choices["sparse_attention"].backend != "cutedsl"
    assert why in rec.failures["cutedsl", "sparse_attention"], rec.failures
    assert "failed earlier in this run" in rec.choices["sparse_attention"].reason
    want = reference.sparse_attention(q.double(), k.double(), v.double(), perm, idx)
    for o in (got, again):
        assert float((o.double() - want).abs().max()) <= 2**-7 * float(want.abs().max())


def test_registered_with_its_rules_when_the_op_imports(fake_op, monkeypatch):
    """Where the op imports (here with the fake kernel), the package registers it at priority 40 with rules.refuse:
    a CPU call is refused with the rule's reason (never run on the kernel), other ops are not its own."""
    pkg = importlib.import_module("comfyui_mc_sparse_pack.kernels.cutedsl")
    monkeypatch.setitem(registry._backends, "cutedsl", registry._backends["cutedsl"])  # restored after the test
    monkeypatch.setattr(pkg, "sparse_attention", None, raising=False)
    importlib.reload(pkg)
    b = registry._backends["cutedsl"]
    assert b.unavailable_reason is None and b.priority == 40
    assert b.ops == {"sparse_attention": fake_op.sparse_attention}
    gen = torch.Generator().manual_seed(47)
    q, k, v, perm, idx = _op_inputs(gen, 1, 2, 200, 64, 128)
    with registry.recording(registry.Record()) as rec:
        kernels.sparse_attention(q, k, v, perm, idx)
    assert rec.choices["sparse_attention"].backend != "cutedsl" and not fake_op.calls
    assert "cutedsl: runs on CUDA devices, got cpu" in rec.choices["sparse_attention"].reason
    assert "implements sparse_attention only" in rules.refuse("dense_attention", q, False)


@pytest.mark.parametrize(("options", "reg_options", "epilogue", "want"), [
    ((), (), "smem", ((), 3000)), (("persistent",), (), "smem", (("persistent",), 132)),
    (("persistent",), (), "registers", ((), 3000)),
    (("persistent", "overlap"), ("persistent", "overlap"), "registers", (("persistent", "overlap"), 132)),
    ((), ("persistent", "overlap"), "smem", ((), 3000)),
])
def test_launch_plan(monkeypatch, options, reg_options, epilogue, want):
    """Each epilogue's kernel takes its configured options (STAGED_OPTIONS, REGISTERS_OPTIONS) and a persistent grid
    of min(SMs, groups) CTAs only with "persistent", else one CTA per group."""
    monkeypatch.setattr(rules, "STAGED_OPTIONS", options)
    monkeypatch.setattr(rules, "REGISTERS_OPTIONS", reg_options)
    assert rules.launch_plan(epilogue, 3000, 132) == want
    assert rules.launch_plan(epilogue, 100, 132)[1] == 100


@pytest.mark.parametrize(("raw", "want"), [
    ("persistent, overlap,x", (("persistent", "overlap", "x"), 132)), ("none", ((), 3000)),
    ("overlap", (("overlap",), 3000)),
])
def test_options_from_the_environment(monkeypatch, raw, want):
    """$MC_SPARSE_CUTEDSL_OPTIONS replaces STAGED_OPTIONS for the staged epilogue only (the register epilogue keeps
    REGISTERS_OPTIONS), $MC_SPARSE_CUTEDSL_RES_OPTIONS REGISTERS_OPTIONS only; "none" means none."""
    monkeypatch.setattr(rules, "STAGED_OPTIONS", ("persistent",))
    monkeypatch.setattr(rules, "REGISTERS_OPTIONS", ("persistent", "y"))
    monkeypatch.setenv("MC_SPARSE_CUTEDSL_OPTIONS", raw)
    assert rules.launch_plan("smem", 3000, 132) == want
    assert rules.launch_plan("registers", 3000, 132) == (("persistent", "y"), 132)
    # and $MC_SPARSE_CUTEDSL_RES_OPTIONS the register epilogue's only
    monkeypatch.delenv("MC_SPARSE_CUTEDSL_OPTIONS")
    monkeypatch.setenv("MC_SPARSE_CUTEDSL_RES_OPTIONS", raw)
    assert rules.launch_plan("registers", 3000, 132) == want
    assert rules.launch_plan("smem", 3000, 132) == (("persistent",), 132)
