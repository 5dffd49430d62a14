"""kernels/triton/paged_route.py (the flash_attn4 sparse route's page table, query gather and output scatter) under
the Triton interpreter (CPU) against their torch references, on fresh random inputs (fixed seeds, in the ids)."""

from __future__ import annotations

import pytest
import torch
from comfyui_mc_sparse_pack.kernels import Residual
from comfyui_mc_sparse_pack.kernels.triton import paged_route


def _selection(B, H, G, K_alloc, S, gen):
    """Sorted distinct indices per group, a random count in [1, K_alloc] (incl. 1 and K_alloc), -1 after it."""
    counts = torch.randint(1, K_alloc + 1, (B, H, G), generator=gen)
    counts.view(-1)[0], counts.view(-1)[-1] = 1, K_alloc
    keys = torch.stack([torch.randperm(S, generator=gen)[:K_alloc].sort().values for _ in range(B * H * G)])
    keys = keys.view(B, H, G, K_alloc).to(torch.int32)
    return torch.where(torch.arange(K_alloc) < counts[..., None], keys, torch.full_like(keys, -1)), counts


def _perm(B, H, S, C, gen):
    G = -(-S // C)
    perm = torch.full((B, H, G * C), -1, dtype=torch.int32)
    perm[..., :S] = torch.stack([torch.randperm(S, generator=gen) for _ in range(B * H)]).view(B, H, S).to(torch.int32)
    return perm


@pytest.mark.parametrize("seed,K_alloc,strides", [(1, 1100, (12 * 200, 200, 1)), (2, 7, (200 * 12, 1, 12))])
def test_page_table_matches_reference(seed, K_alloc, strides):
    """Page ids for the [B, H, S, D] and the [B, S, H*D] page strides, a row of one slot and a full row, a K_alloc past
    one 1024-slot step: kills a wrong (b, h) base, a missing page_s factor and a count that stops at the first step."""
    gen = torch.Generator().manual_seed(seed)
    B, H, S = 2, 12, 200
    G = 3
    kv_idx, counts = _selection(B, H, G, min(K_alloc, S), S, gen)
    if K_alloc > S:  # pad with -1 past S slots so the row spans two steps of the kernel
        kv_idx = torch.cat([kv_idx, torch.full((B, H, G, K_alloc - S), -1, dtype=torch.int32)], -1)
    table, used = paged_route.page_table(kv_idx, strides)
    want_t, want_u = paged_route.page_table_reference(kv_idx, strides)
    assert torch.equal(used, counts.view(-1).to(torch.int32))
    assert torch.equal(used, want_u)
    assert torch.equal(table, want_t)
    assert int(table.max()) < B * H * S  # every page inside the pool


@pytest.mark.parametrize("dtype,C,layout", [(torch.bfloat16, 128, "native"), (torch.float16, 48, "contiguous")])
def test_gather_queries_matches_reference(dtype, C, layout):
    """Strided [B, S, H*D] views and contiguous q, a C that is not a power of two, ragged last group (zero rows):
    kills reading q's rows by the wrong stride, skipping the zero fill and misplacing groups."""
    gen = torch.Generator().manual_seed(11 + C)
    B, H, S, D = 2, 3, 300, 64
    if layout == "native":
        q = torch.randn(B, S, H * D, generator=gen).to(dtype).view(B, S, H, D).transpose(1, 2)
    else:
        q = torch.randn(B, H, S, D, generator=gen).to(dtype)
    perm = _perm(B, H, S, C, gen)
    got = paged_route.gather_queries(q, perm, C)
    assert got.shape == (B * H * perm.shape[-1] // C, C, 1, D) and got.is_contiguous()
    assert torch.equal(got, paged_route.gather_queries_reference(q, perm, C))


def _residuals(B, H, S, D, G, gen):
    r = torch.randn(B, H, S, D, generator=gen) * 0.05
    amax = r.abs().amax(-1)
    s8, s4 = amax / 448.0, amax / 7.0
    q4 = (torch.round(r / s4[..., None]).clamp(-7, 7) + 8).to(torch.uint8)
    packed = q4[..., 0::2] | (q4[..., 1::2] << 4)
    return {
        "none": None,
        "plain": Residual(r.to(torch.bfloat16)),
        "fp8_row": Residual((r / s8[..., None]).to(torch.float8_e4m3fn), s8.float(), "fp8_row"),
        "int4_row": Residual(packed, s4.float(), "int4_row"),
        "int4_group": Residual(packed, s4.to(torch.bfloat16), "int4_group",
                               (torch.rand(B, H, S, generator=gen) + 0.5).to(torch.float8_e4m3fn),
                               (torch.randn(B, H, G, D, generator=gen) * 0.02).to(torch.bfloat16)),
    }


@pytest.mark.parametrize("kind", ["none", "plain", "fp8_row", "int4_row", "int4_group"])
def test_scatter_output_with_residual_matches_reference(kind):
    """Every residual kind added before the rounding, out a strided [B, S, H*D] view poisoned with NaN, the LSE
    scattered with it: kills a missing residual, a residual of the wrong row (group order instead of query order),
    unwritten rows and a wrong LSE slot."""
    gen = torch.Generator().manual_seed(21 + len(kind))
    B, H, S, D, C = 2, 2, 200, 64, 32
    perm = _perm(B, H, S, C, gen)
    G = perm.shape[-1] // C
    o_groups = torch.randn(B * H * G, C, 1, D, generator=gen).to(torch.bfloat16)
    lse_groups = torch.randn(B * H * G, 1, C, generator=gen)
    res = _residuals(B, H, S, D, G, gen)[kind]
    buf = torch.full((B, S, H * D), float("nan"), dtype=torch.bfloat16)
    out = buf.view(B, S, H, D).transpose(1, 2)
    got, lse = paged_route.scatter_output(o_groups, lse_groups, perm, out, res)
    assert got.data_ptr() == buf.data_ptr() and not torch.isnan(buf).any()
    want, want_lse = paged_route.scatter_output_reference(o_groups, lse_groups, perm, torch.empty(B, H, S, D,
                                                          dtype=torch.bfloat16), res)
    assert torch.equal(lse, want_lse)
    # fp32 sum then one bf16 rounding vs float64 sum then one rounding: at most one bf16 ulp apart
    diff = (got.float() - want.float()).abs()
    assert float((diff / want.float().abs().clamp_min(1e-3)).max()) <= 2 ** -7, kind
    if res is not None:  # the residual moved the output: a kernel that dropped it fails above
        plain, _ = paged_route.scatter_output_reference(o_groups, lse_groups, perm, torch.empty_like(want), None)
        assert not torch.equal(plain, want)


def test_route_pieces_compose_to_the_reference_attention():
    """Gather -> (a torch stand-in for FA4's paged kernel reading the page table) -> scatter equals
    kernels.reference.sparse_attention: the three launches agree with each other on the layout."""
    from comfyui_mc_sparse_pack.kernels import reference

    gen = torch.Generator().manual_seed(5)
    B, H, S, D, C = 1, 2, 160, 32, 32
    q, k, v = (torch.randn(B, S, H * D, generator=gen).to(torch.bfloat16).view(B, S, H, D).transpose(1, 2)
               for _ in range(3))
    perm = _perm(B, H, S, C, gen)
    G = perm.shape[-1] // C
    kv_idx, _ = _selection(B, H, G, 40, S, gen)
    strides = tuple(x // D for x in k.stride()[:3])
    table, used = paged_route.page_table(kv_idx, strides)
    pool_k = torch.as_strided(k, (B * S * H, D), (D, 1), k.storage_offset()).double()
    pool_v = torch.as_strided(v, (B * S * H, D), (D, 1), v.storage_offset()).double()
    qg = paged_route.gather_queries(q, perm, C).double()
    og = torch.empty(B * H * G, C, 1, D, dtype=torch.float64)
    lg = torch.empty(B * H * G, 1, C)
    for n in range(B * H * G):
        pages = table[n, : used[n]].long()
        s = qg[n, :, 0] @ pool_k[pages].T / D**0.5
        og[n, :, 0] = torch.softmax(s, -1) @ pool_v[pages]
        lg[n, 0] = torch.logsumexp(s, -1).float()
    out, lse = paged_route.scatter_output(og, lg, perm, torch.empty(B, H, S, D, dtype=torch.float64))
    want, want_lse = reference.sparse_attention(q.double(), k.double(), v.double(), perm, kv_idx, return_lse=True)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)  # the scatter adds in fp32
    torch.testing.assert_close(lse, want_lse.float(), rtol=1e-5, atol=1e-5)


# ---- the flash_attn4 backend module with a stand-in flash_attn.cute (CPU: registration, K/V pages, direct launch) ----

_FA4 = "comfyui_mc_sparse_pack.kernels.flash_attn4"


@pytest.fixture
def fa4_stub(monkeypatch):
    """kernels/flash_attn4 imported against a stand-in ``flash_attn.cute`` whose ``_flash_attn_fwd`` calls a
    "compiled kernel" from its compile cache with FA4's sm90 argument list (interface.py); the registry entry and
    sys.modules are restored afterwards."""
    import importlib
    import sys
    import types

    from comfyui_mc_sparse_pack import kernels as kernels_pkg
    from comfyui_mc_sparse_pack.kernels import registry

    launches = []  # (how, args) of every kernel launch

    def compiled(*args):
        launches.append(args)

    def fwd(q, k, v, seqused_k=None, page_table=None, softmax_scale=None, return_lse=False, out=None, lse=None, **kw):
        fwd.interface_calls += 1
        cache = fwd.compile_cache
        if "key" not in cache:
            cache["key"] = compiled
        args = [q.detach(), k.detach(), v.detach(), out.detach(), lse, softmax_scale, None, None, None, seqused_k,
                page_table, None, None, None, None, object(), None, None]
        if fwd.swap:  # a build whose argument list differs from ours
            args[9], args[10] = args[10], args[9]
        if fwd.build == "scratch":  # a build that also passes a tensor of its own (a per-call scratch buffer)
            args[15] = torch.zeros(4)
        elif fwd.build == "scale_moved":  # a build whose slot 5 holds something else than the softmax scale
            args[5], args[16] = 1.0, softmax_scale
        cache["key"](*args)
        return out, lse, None, None, None

    fwd.compile_cache, fwd.interface_calls, fwd.swap, fwd.build = {}, 0, False, None
    interface = types.ModuleType("flash_attn.cute.interface")
    interface._flash_attn_fwd = fwd
    cute = types.ModuleType("flash_attn.cute")
    cute.flash_attn_func = lambda *a, **k: None
    cute.interface = interface
    pkg = types.ModuleType("flash_attn")
    pkg.cute = cute
    for name, mod in (("flash_attn", pkg), ("flash_attn.cute", cute), ("flash_attn.cute.interface", interface)):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setitem(registry._backends, "flash_attn4", registry._backends["flash_attn4"])
    sys.modules.pop(_FA4, None)
    try:
        mod = importlib.import_module(_FA4)
        yield mod, fwd, launches
    finally:
        sys.modules.pop(_FA4, None)
        if hasattr(kernels_pkg, "flash_attn4"):
            delattr(kernels_pkg, "flash_attn4")  # the import set it on the package


def test_flash_attn4_registers_and_refuses_cpu(fa4_stub):
    from comfyui_mc_sparse_pack.kernels import registry

    mod, _, _ = fa4_stub
    b = {x.name: x for x in registry.backends()}["flash_attn4"]
    assert b.unavailable_reason is None and b.priority == 30
    assert "CUDA" in mod.refuse("sparse_attention", torch.zeros(1, 1, 8, 64), False)


@pytest.mark.parametrize("layout", ["contiguous", "native", "fused_qkv"])
def test_kv_pages_are_views_and_address_every_token(fa4_stub, layout):
    """Every token (b, h, t) is page b*page_b + h*page_h + t*page_s of both pools, without a copy for the
    [B, H, S, D], [B, S, H*D] and fused [B, S, 3*H*D] layouts: kills wrong page strides or a pool off k's first row."""
    mod, _, _ = fa4_stub
    gen = torch.Generator().manual_seed(31)
    B, H, S, D = 2, 3, 10, 16
    if layout == "contiguous":
        k, v = (torch.randn(B, H, S, D, generator=gen) for _ in range(2))
    elif layout == "native":
        k, v = (torch.randn(B, S, H * D, generator=gen).view(B, S, H, D).transpose(1, 2) for _ in range(2))
    else:
        qkv = torch.randn(B, S, 3, H, D, generator=gen)
        k, v = qkv[:, :, 1].transpose(1, 2), qkv[:, :, 2].transpose(1, 2)
    kp, vp, (pb, ph, ps) = mod.kv_pages(k, v)
    assert kp.shape[1:] == (1, 1, D) and kp.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
    page = (torch.arange(B).view(B, 1, 1) * pb + torch.arange(H).view(1, H, 1) * ph + torch.arange(S) * ps).long()
    assert torch.equal(kp[:, 0, 0][page], k) and torch.equal(vp[:, 0, 0][page], v)


@pytest.mark.parametrize("S", [2**30 - 1, 2**30])
def test_kv_pages_refuse_page_ids_past_int32(fa4_stub, S):
    """K/V of 2 heads x S tokens (meta tensors): 2^31 - 1 rows are pages in place; 2^31 rows fit no int32 page id, in
    place or copied, and the route raises RuntimeError (the registry falls back to the next backend; a ValueError
    would lose the run). Mutations: the in-place bound dropped or off by one, the copy bound off by one."""
    mod, _, _ = fa4_stub
    k = torch.empty(1, 2, S, 64, device="meta", dtype=torch.bfloat16)
    if S < 2**30:
        kp, _, strides = mod.kv_pages(k, k)
        assert kp.shape[0] == 2 * S and strides == (2 * S, S, 1)
    else:
        with pytest.raises(RuntimeError, match="int32 page ids"):
            mod.kv_pages(k, k)


def test_kv_pages_copy_when_strides_differ(fa4_stub):
    mod, _, _ = fa4_stub
    B, H, S, D = 1, 2, 6, 8
    k = torch.randn(B, H, S, D)
    v = torch.randn(B, S, H * D).view(B, S, H, D).transpose(1, 2)
    kp, vp, (pb, ph, ps) = mod.kv_pages(k, v)
    assert (pb, ph, ps) == (H * S, S, 1)
    assert torch.equal(vp.view(B, H, S, D), v) and torch.equal(kp.view(B, H, S, D), k)


@pytest.mark.parametrize("which", ["k", "v"])
def test_kv_pages_copy_a_pool_off_16_byte_alignment(fa4_stub, which):
    """K and V of equal strides where one starts 4 bytes past a 16-byte boundary (a view one float in): FA4's page
    pools need 16-byte aligned storage, so both are copied (page strides of a contiguous [B, H, S, D]), equal to the
    inputs. Mutation: only k's alignment checked (v viewed in place off alignment)."""
    mod, _, _ = fa4_stub
    B, H, S, D = 1, 2, 6, 8
    gen = torch.Generator().manual_seed(37)
    aligned = torch.randn(B * H * S * D, generator=gen).view(B, H, S, D)
    shifted = torch.randn(B * H * S * D + 1, generator=gen)[1:].view(B, H, S, D)
    assert aligned.data_ptr() % 16 == 0 and shifted.data_ptr() % 16 == 4 and aligned.stride() == shifted.stride()
    k, v = (aligned, shifted) if which == "v" else (shifted, aligned)
    kp, vp, (pb, ph, ps) = mod.kv_pages(k, v)
    assert (pb, ph, ps) == (H * S, S, 1) and kp.data_ptr() % 16 == 0 and vp.data_ptr() % 16 == 0
    assert torch.equal(vp.view(B, H, S, D), v) and torch.equal(kp.view(B, H, S, D), k)


@pytest.mark.parametrize("swap", [False, True])
def test_paged_call_launches_the_recorded_kernel_directly(fa4_stub, swap):
    """The first call goes through the interface and records its compiled kernel; later calls launch it with their
    own tensors in the same slots. A build whose argument list is not the expected one (swap) is never launched
    directly: kills recording without checking, and stale tensors / scale in a direct launch."""
    mod, fwd, launches = fa4_stub
    fwd.swap = swap
    mod._DIRECT.clear()
    t = lambda *s: torch.zeros(*s)  # noqa: E731
    pools = (t(50, 1, 1, 16), t(50, 1, 1, 16))
    calls = []
    for scale in (0.25, 0.5, 0.125):
        q, out = t(4, 8, 1, 16), t(4, 8, 1, 16)
        used, table = torch.zeros(4, dtype=torch.int32), torch.zeros(4, 8, dtype=torch.int32)
        mod._paged_call(q, *pools, used, table, out, None, scale, {})
        calls.append((q, out, used, table, scale))
    assert fwd.compile_cache and "key" in fwd.compile_cache  # the interface's cache is back in place
    assert fwd.interface_calls == (3 if swap else 1)
    assert len(launches) == 3
    for args, (q, out, used, table, scale) in zip(launches, calls):
        got = dict(q=args[0], out=args[3], used=args[10 if swap else 9], table=args[9 if swap else 10])
        for name, want in dict(q=q, out=out, used=used, table=table).items():
            assert got[name].data_ptr() == want.data_ptr(), name
        assert args[5] == scale and args[1].data_ptr() == pools[0].data_ptr()


@pytest.mark.parametrize("build", ["scratch", "scale_moved"])
def test_paged_call_never_records_a_build_with_other_arguments(fa4_stub, build):
    """A build that passes a tensor of its own beside ours, or keeps something else in the scale's slot, is never
    launched directly (its recorded arguments would be stale): every call goes through the interface. Mutations: any
    other tensor accepted, the scale slot not compared."""
    mod, fwd, launches = fa4_stub
    fwd.build = build
    mod._DIRECT.clear()
    t = lambda *s: torch.zeros(*s)  # noqa: E731
    pools = (t(50, 1, 1, 16), t(50, 1, 1, 16))
    for scale in (0.25, 0.5):
        mod._paged_call(t(4, 8, 1, 16), *pools, torch.zeros(4, dtype=torch.int32),
                        torch.zeros(4, 8, dtype=torch.int32), t(4, 8, 1, 16), None, scale, {})
    assert fwd.interface_calls == 2 and len(launches) == 2 and not mod._DIRECT


def test_paged_call_keeps_kernels_with_and_without_lse_apart(fa4_stub):
    """FA4 compiles a kernel with and one without the LSE: a call with an LSE after one without goes through the
    interface (its own kernel), and only a repeat of each is launched directly. Mutation: the LSE left out of the
    direct-launch key (the no-LSE kernel launched with an LSE it never writes)."""
    mod, fwd, launches = fa4_stub
    mod._DIRECT.clear()
    t = lambda *s: torch.zeros(*s)  # noqa: E731
    pools = (t(50, 1, 1, 16), t(50, 1, 1, 16))
    for with_lse in (False, True, False, True):
        mod._paged_call(t(4, 8, 1, 16), *pools, torch.zeros(4, dtype=torch.int32),
                        torch.zeros(4, 8, dtype=torch.int32), t(4, 8, 1, 16), t(4, 1, 8) if with_lse else None,
                        0.25, {})
    assert fwd.interface_calls == 2 and len(launches) == 4 and len(mod._DIRECT) == 2


def _paged_in_torch(calls):
    """A torch stand-in for ``_paged_call`` (FA4's paged kernel): float64 attention of each group over the pages its
    table names (the first ``used`` slots); notes each call's group count in ``calls``."""

    def paged(q, k, v, used, table, out, lse, scale, tuning):
        calls.append(q.shape[0])
        for n in range(q.shape[0]):
            pages = table[n, : used[n]].long()
            s = q[n, :, 0].double() @ k[pages, 0, 0].double().T * scale
            out[n, :, 0] = (torch.softmax(s, -1) @ v[pages, 0, 0].double()).to(out.dtype)
            if lse is not None:
                lse[n, 0] = torch.logsumexp(s, -1).float()
    return paged


@pytest.mark.parametrize("kind", ["plain", "int4_group"])
def test_sparse_route_chunks_the_groups_and_equals_the_reference(fa4_stub, monkeypatch, kind):
    """The backend's ``sparse_attention`` (pages, table, gather, FA4 in chunks of at most ``_MAX_BATCH`` groups,
    scatter + residual + LSE) on native [B, S, H*D] views equals kernels.reference in float64, with FA4's kernel
    replaced by torch and the grid.z limit lowered to 3 groups (10 groups: chunks 3, 3, 3, 1). Mutations: one chunk
    only, every chunk sized to all groups."""
    from comfyui_mc_sparse_pack.kernels import reference

    mod, _, _ = fa4_stub
    calls = []
    monkeypatch.setattr(mod, "_paged_call", _paged_in_torch(calls))
    monkeypatch.setattr(mod, "_MAX_BATCH", 3)
    gen = torch.Generator().manual_seed(83)
    B, H, S, D, C = 1, 2, 150, 64, 32
    q, k, v = (torch.randn(B, S, H * D, generator=gen).to(torch.bfloat16).view(B, S, H, D).transpose(1, 2)
               for _ in range(3))
    perm = _perm(B, H, S, C, gen)
    G = perm.shape[-1] // C
    kv_idx, _ = _selection(B, H, G, 24, S, gen)
    if kind == "plain":
        res = Residual(torch.randn(B, H, S, D, generator=gen).to(torch.bfloat16))
    else:
        res = Residual(torch.randint(0, 256, (B, H, S, D // 2), generator=gen, dtype=torch.uint8),
                       torch.rand(B, H, S, generator=gen).to(torch.bfloat16), "int4_group",
                       torch.rand(B, H, S, generator=gen).to(torch.float8_e4m3fn),
                       torch.randn(B, H, G, D, generator=gen).to(torch.bfloat16))
    out, lse = mod.sparse_attention(q, k, v, perm, kv_idx, return_lse=True, residual=res)
    assert calls == [3, 3, 3, 1]
    want, want_lse = reference.sparse_attention(q.double(), k.double(), v.double(), perm, kv_idx, return_lse=True,
                                                residual=res)
    torch.testing.assert_close(out.double(), want, rtol=2**-7, atol=2**-7 * float(want.abs().max()))
    torch.testing.assert_close(lse, want_lse.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("op", "cap", "dtype", "d", "why"), [
    ("sparse_attention", (9, 0), torch.bfloat16, 128, None),
    ("sparse_attention", (10, 0), torch.float16, 64, None),
    ("sparse_attention", (8, 0), torch.bfloat16, 128, "compute capability >= 9.0"),
    ("sparse_attention", (9, 0), torch.float32, 128, "float16/bfloat16 only"),
    ("sparse_attention", (9, 0), torch.bfloat16, 96, "paged-KV route runs head dim 64 or 128"),
    ("dense_attention", (9, 0), torch.bfloat16, 96, None),
    ("dense_attention", (9, 0), torch.bfloat16, 100, "multiple of 8"),
    ("dense_attention", (9, 0), torch.bfloat16, 264, "at most 256"),
])
def test_flash_attn4_refusals_on_a_cuda_q(fa4_stub, monkeypatch, op, cap, dtype, d, why):
    """The backend's rule on a CUDA q (a stand-in: device, dtype and shape are all ``refuse`` reads) per capability,
    dtype and head dim. Mutations: the capability or head-dim bounds moved, the multiple-of-8 check dropped."""
    import types

    mod, _, _ = fa4_stub
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    q = types.SimpleNamespace(device=torch.device("cuda", 0), dtype=dtype, shape=(1, 2, 256, d))
    got = mod.refuse(op, q, False)
    assert (got is None) if why is None else (why in (got or "")), got


@pytest.mark.parametrize(("op", "error"), [("dense_attention", TypeError), ("sparse_attention", ValueError)])
def test_flash_attn4_argument_errors_fall_back_with_the_reason(fa4_stub, monkeypatch, op, error):
    """FA4 raising ValueError / TypeError on a call the public op validated (its compiled kernel's TVM-FFI argument
    checks, the DSL's DSLUserCodeTypeError, a TypeError subclass): the registered op raises RuntimeError, so the
    registry falls back once per run with the reason in the run's Record instead of losing the run (mutation: the
    ops registered unwrapped -> the error reaches the caller)."""
    from comfyui_mc_sparse_pack import kernels
    from comfyui_mc_sparse_pack.kernels import reference, registry

    mod, fwd, _ = fa4_stub

    def rejects(*args, **kwargs):
        rejects.calls += 1
        raise error("simulated FA4 argument check")

    rejects.calls = 0
    monkeypatch.setattr(mod, "flash_attn_func", rejects)
    monkeypatch.setattr(mod, "_flash_attn_fwd", rejects)
    registered = registry._backends["flash_attn4"]
    monkeypatch.setitem(registry._backends, "flash_attn4", registry.Backend(  # its ops, CPU tensors accepted
        name="flash_attn4", priority=99, ops=registered.ops))
    gen = torch.Generator().manual_seed(89)
    B, H, S, D, C = 1, 2, 96, 64, 32
    q, k, v = (torch.randn(B, H, S, D, generator=gen).to(torch.bfloat16) for _ in range(3))
    perm = _perm(B, H, S, C, gen)
    kv_idx, _ = _selection(B, H, perm.shape[-1] // C, 16, S, gen)
    args = (q, k, v) if op == "dense_attention" else (q, k, v, perm, kv_idx)
    with registry.recording(registry.Record()) as rec:
        got = getattr(kernels, op)(*args)
        again = getattr(kernels, op)(*args)
    assert rejects.calls == 1 and rec.choices[op].backend != "flash_attn4"
    assert f"RuntimeError: flash-attn-4 failed: {error.__name__}: simulated" in rec.failures["flash_attn4", op]
    want = getattr(reference, op)(*(t.double() if t.is_floating_point() else t for t in args))
    for o in (got, again):
        torch.testing.assert_close(o.double(), want, rtol=2**-7, atol=2**-7 * float(want.abs().max()))
