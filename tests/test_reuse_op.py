"""The reuse-path op (kernels/residual.py) on the torch reference: ``sparse_attention(..., out=, residual=)``,
``kernels.Residual`` in its four stored forms, and ``decode_bitmask``; each against brute force in float64."""

from __future__ import annotations

import math

import pytest
import torch
from comfyui_mc_sparse_pack import kernels
from comfyui_mc_sparse_pack.kernels import Residual


def make_residual(r: torch.Tensor, kind: str, perm: torch.Tensor | None = None, num_groups: int | None = None) -> Residual:
    """A residual of ``kind`` encoding the float tensor r ``[B, H, S, D]`` (the cache's formats; round to nearest).

    "int4_group" needs the query groups ``perm`` ``[B, H, G*C]`` and G: each group's mean row is the row of its first
    query, each row's coef one of -2 .. 2 (steps of 0.5, exact in e4m3), the rest 4-bit with a bf16 row scale."""
    if kind == "plain":
        return Residual(r.to(torch.bfloat16))
    if kind == "int4_group":
        B, H, S, D = r.shape
        C = perm.shape[-1] // num_groups
        first = perm[..., ::C].long().to(r.device)  # slot g*C holds a query for every g (padding is at the tail)
        mean = torch.gather(r, 2, first[..., None].expand(-1, -1, -1, D)).to(torch.bfloat16)
        coef = ((torch.arange(S, device=r.device) % 9 - 4) / 2).expand(B, H, S).to(torch.float8_e4m3fn)
        dev = r - coef.float()[..., None] * brute_group_rows(mean, perm.to(r.device), S)
        scale = torch.where(dev.abs().amax(-1) > 0, dev.abs().amax(-1) / 7.0, torch.ones_like(dev[..., 0]))
        scale = scale.to(torch.bfloat16)
        q = torch.round(dev / scale.float()[..., None]).clamp(-7, 7).to(torch.int16) + 8
        packed = (q[..., 0::2] | (q[..., 1::2] << 4)).to(torch.uint8)
        return Residual(packed, scale, "int4_group", coef, mean)
    amax = r.abs().amax(-1).float()
    if kind == "fp8_row":
        scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
        return Residual((r / scale[..., None]).to(torch.float8_e4m3fn), scale, "fp8_row")
    scale = torch.where(amax > 0, amax / 7.0, torch.ones_like(amax))
    q = torch.round(r / scale[..., None]).clamp(-7, 7).to(torch.int16) + 8
    packed = (q[..., 0::2] | (q[..., 1::2] << 4)).to(torch.uint8)
    return Residual(packed, scale, "int4_row")


def brute_group_rows(mean: torch.Tensor, perm: torch.Tensor, S: int) -> torch.Tensor:
    """``[B, H, S, D]``: row s = mean[b, h, slot // C] for the slot of perm holding query s (a loop over slots)."""
    B, H, G, D = mean.shape
    C = perm.shape[-1] // G
    out = torch.full((B, H, S, D), float("nan"), dtype=mean.dtype, device=mean.device)
    for b in range(B):
        for h in range(H):
            valid = perm[b, h] >= 0
            slots = torch.arange(perm.shape[-1], device=perm.device)[valid]
            out[b, h, perm[b, h][valid].long()] = mean[b, h, slots // C]
    return out


def brute_residual(res: Residual, perm: torch.Tensor | None = None) -> torch.Tensor:
    """R in float64, element by element from the documented format (independent of Residual.dequantize); perm for
    "int4_group"."""
    if res.kind == "plain":
        return res.data.double()
    if res.kind == "fp8_row":
        return res.data.double() * res.scale.double()[..., None]
    B, H, S, half = res.data.shape
    out = torch.empty(B, H, S, 2 * half, dtype=torch.float64, device=res.data.device)
    for j in range(half):
        byte = res.data[..., j].long()
        out[..., 2 * j] = (byte % 16 - 8).double()
        out[..., 2 * j + 1] = (byte // 16 - 8).double()
    out = out * res.scale.double()[..., None]
    if res.kind == "int4_group":
        out += res.coef.double()[..., None] * brute_group_rows(res.mean.double(), perm.to(res.data.device), S)
    return out


def brute_sparse(q, k, v, perm, kv_idx, scale=None):
    """Float64 masked-softmax attention per query (the definition), and its LSE."""
    B, H, S, D = q.shape
    scale = 1 / math.sqrt(D) if scale is None else scale
    G = kv_idx.shape[2]
    C = perm.shape[-1] // G
    out = torch.full((B, H, S, D), float("nan"), dtype=torch.float64)
    lse = torch.full((B, H, S), float("nan"), dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for g in range(G):
                keys = kv_idx[b, h, g][kv_idx[b, h, g] >= 0].long()
                rows = perm[b, h, g * C:(g + 1) * C]
                rows = rows[rows >= 0].long()
                s = q[b, h, rows].double() @ k[b, h, keys].double().T * scale
                lse[b, h, rows] = torch.logsumexp(s, -1)
                out[b, h, rows] = torch.softmax(s, -1) @ v[b, h, keys].double()
    return out, lse


def random_groups(gen, B, H, S, C):
    G = -(-S // C)
    perm = torch.full((B, H, G * C), -1, dtype=torch.int32)
    for b in range(B):
        for h in range(H):
            perm[b, h, :S] = torch.randperm(S, generator=gen).to(torch.int32)
    return perm


def random_kv_idx(gen, B, H, G, S, K, k_alloc):
    idx = torch.full((B, H, G, k_alloc), -1, dtype=torch.int32)
    for b in range(B):
        for h in range(H):
            for g in range(G):
                idx[b, h, g, :K] = torch.sort(torch.randperm(S, generator=gen)[:K]).values.to(torch.int32)
    return idx


def native_views(gen, B, S, H, D, dtype):
    """q, k, v as [B, H, S, D] views of [B, S, H*D] tensors (ComfyUI's layout), and an out view likewise."""
    qkv = [torch.randn(B, S, H * D, generator=gen).to(dtype) for _ in range(3)]
    views = [t.view(B, S, H, D).transpose(1, 2) for t in qkv]
    return views


@pytest.mark.parametrize("kind", ["plain", "fp8_row", "int4_row", "int4_group"])
def test_residual_dequantize_matches_format(gen, kind):
    """Residual.dequantize reads each stored form as kernels/residual.py defines it (nibble order, scales; each
    query adds its own group's mean row, ragged last group)."""
    r = torch.randn(2, 3, 7, 16, generator=gen)
    perm = random_groups(gen, 2, 3, 7, 3)  # G = 3 groups of C = 3, two padding slots
    res = make_residual(r, kind, perm, 3)
    assert torch.equal(res.dequantize(torch.float64, perm), brute_residual(res, perm))
    bound = {"plain": 1e-2, "fp8_row": 7e-2, "int4_row": 0.1, "int4_group": 0.15}[kind]  # the format's own rounding
    assert (res.dequantize(perm=perm) - r).norm() / r.norm() < bound
    if kind == "int4_group":
        with pytest.raises(ValueError, match="needs perm"):
            res.dequantize()


def test_residual_rejects_malformed():
    """Clear errors for an unknown kind, data that is no 4-D tensor, wrong dtypes, a missing or misshapen scale, or a
    shape not q's."""
    x = torch.zeros(1, 2, 5, 8)
    with pytest.raises(ValueError, match="kind"):
        Residual(x, None, "int8")
    for data in (x[0], x.numpy()):  # (mutation: the 4-D check dropped passed the suite)
        with pytest.raises(ValueError, match=r"Residual data must be a 4-D tensor \[B, H, S, D or D//2\]"):
            Residual(data)
    with pytest.raises(TypeError, match="bfloat16, float16 or float32"):
        Residual(x.double())
    with pytest.raises(ValueError, match="no scale"):
        Residual(x, torch.ones(1, 2, 5))
    with pytest.raises(TypeError, match="float32 scale"):
        Residual(x.to(torch.float8_e4m3fn), None, "fp8_row")
    with pytest.raises(ValueError, match=r"\[B, H, S\]"):
        Residual(x.to(torch.float8_e4m3fn), torch.ones(1, 2, 5, 1), "fp8_row")
    with pytest.raises(TypeError, match="uint8"):
        Residual(x.half(), torch.ones(1, 2, 5), "int4_row")
    q = torch.zeros(1, 2, 5, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"\(1, 2, 5, 4\)"):
        Residual(torch.zeros(1, 2, 5, 8, dtype=torch.uint8), torch.ones(1, 2, 5), "int4_row").check(q)
    with pytest.raises(ValueError, match="even head dim"):  # D = 9: 4 bytes would drop the 9th element
        Residual(torch.zeros(1, 2, 5, 4, dtype=torch.uint8), torch.ones(1, 2, 5), "int4_row").check(
            torch.zeros(1, 2, 5, 9, dtype=torch.float16))
    packed, bf = torch.full((1, 2, 5, 4), 0x88, dtype=torch.uint8), torch.ones(1, 2, 5, dtype=torch.bfloat16)
    coef, mean = torch.zeros(1, 2, 5).to(torch.float8_e4m3fn), torch.zeros(1, 2, 3, 8, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="bfloat16 scale"):
        Residual(packed, torch.ones(1, 2, 5), "int4_group", coef, mean)
    with pytest.raises(TypeError, match="float8_e4m3fn coef"):
        Residual(packed, bf, "int4_group", None, mean)
    with pytest.raises(TypeError, match="bfloat16 mean"):
        Residual(packed, bf, "int4_group", coef, mean.float())
    with pytest.raises(ValueError, match=r"mean \[B, H, G, D\]"):
        Residual(packed, bf, "int4_group", coef, torch.zeros(1, 2, 3, 6, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"coef \[B, H, S\]"):
        Residual(packed, bf, "int4_group", coef[..., :4], mean)
    with pytest.raises(ValueError, match="int4_group only"):
        Residual(packed, torch.ones(1, 2, 5), "int4_row", coef, mean)
    with pytest.raises(TypeError, match="float8_e4m3fn coef"):  # a coef of another dtype (the kernels read bytes)
        Residual(packed, bf, "int4_group", coef.to(torch.bfloat16), mean)
    for i, name in enumerate(("scale", "coef", "mean")):  # each per-row / per-group tensor on data's device
        parts = [bf, coef, mean]
        parts[i] = parts[i].to("meta")
        with pytest.raises(ValueError, match=f"Residual {name} must be on data's device"):
            Residual(packed, parts[0], "int4_group", parts[1], parts[2])
    group = Residual(packed, bf, "int4_group", coef, mean)
    group.check(q)
    with pytest.raises(ValueError, match="on q's device"):
        group.check(q.to("meta"))
    with pytest.raises(ValueError, match="do not divide perm's width"):  # 3 mean rows, 5 slots
        group.dequantize(torch.float32, torch.arange(5, dtype=torch.int32).view(1, 1, 5).expand(1, 2, 5))
    # a query no perm slot holds (4 of 0-4 here) adds no group's mean row: R = q * scale = 0 there, mean 1 elsewhere
    ones = Residual(packed, bf, "int4_group", torch.ones(1, 2, 5).to(torch.float8_e4m3fn), torch.ones_like(mean))
    held = torch.tensor([0, 1, 2, 3, -1, -1], dtype=torch.int32).view(1, 1, 6).expand(1, 2, 6)
    r = ones.dequantize(torch.float32, held)
    assert torch.equal(r[:, :, :4], torch.ones(1, 2, 4, 8)) and torch.equal(r[:, :, 4], torch.zeros(1, 2, 8))
    perm5 = torch.arange(5, dtype=torch.int32).view(1, 1, 5).expand(1, 2, 5).contiguous()
    idx1 = torch.arange(5, dtype=torch.int32).view(1, 1, 1, 5).expand(1, 2, 1, 5).contiguous()
    with pytest.raises(ValueError, match="mean must have kv_idx's G = 1"):
        kernels.sparse_attention(q, q, q, perm5, idx1, residual=group)
    perm = torch.arange(5, dtype=torch.int32).view(1, 1, 5).expand(1, 2, 5).contiguous()
    idx = torch.arange(5, dtype=torch.int32).view(1, 1, 1, 5).expand(1, 2, 1, 5).contiguous()
    with pytest.raises(TypeError, match="kernels.Residual"):
        kernels.sparse_attention(q, q, q, perm, idx, residual=x.half())
    with pytest.raises(ValueError, match="out must be a tensor of q's shape"):
        kernels.sparse_attention(q, q, q, perm, idx, out=torch.empty(1, 2, 5, 4, dtype=torch.float16))
    with pytest.raises(TypeError, match="out must have q's dtype"):
        kernels.sparse_attention(q, q, q, perm, idx, out=torch.empty(1, 2, 5, 8))
    with pytest.raises(ValueError, match="share memory"):
        kernels.sparse_attention(q, q.clone(), q.clone(), perm, idx, out=q)


@pytest.mark.parametrize("kind", [None, "plain", "fp8_row", "int4_row", "int4_group"])
def test_reference_writes_native_out_view_with_residual(gen, kind):
    """Native-layout views in, an out view of a wider [B, S, H*D + 8] buffer written in place (every element of the
    view, nothing else), result = float64 sparse attention + R, B = 2."""
    B, S, H, D, C, K = 2, 37, 2, 16, 8, 11
    q, k, v = native_views(gen, B, S, H, D, torch.bfloat16)
    perm = random_groups(gen, B, H, S, C)
    idx = random_kv_idx(gen, B, H, perm.shape[-1] // C, S, K, 16)
    res = None if kind is None else make_residual(torch.randn(B, H, S, D, generator=gen), kind, perm, idx.shape[2])
    base = torch.full((B, S, H * D + 8), float("nan"), dtype=torch.bfloat16)
    out = base[..., :H * D].view(B, S, H, D).transpose(1, 2)
    got, lse = kernels.sparse_attention(q, k, v, perm, idx, out=out, residual=res, return_lse=True, backend="torch")
    assert got is out
    ref, ref_lse = brute_sparse(q, k, v, perm, idx)
    if res is not None:
        ref = ref + brute_residual(res, perm)
    assert not got.isnan().any() and base[..., H * D:].isnan().all()
    assert (got.double() - ref).norm() / ref.norm() < 8e-3
    assert (lse.double() - ref_lse).abs().max() < 1e-4


def brute_decode(bits: torch.Tensor, num_tokens: int, width: int) -> torch.Tensor:
    rows = bits.reshape(-1, bits.shape[-1])
    out = torch.full((rows.shape[0], width), -1, dtype=torch.int32)
    for r in range(rows.shape[0]):
        toks = [8 * b + j for b in range(rows.shape[1]) for j in range(8)
                if (int(rows[r, b]) >> j) & 1 and 8 * b + j < num_tokens][:width]
        out[r, :len(toks)] = torch.tensor(toks, dtype=torch.int32)
    return out.reshape(*bits.shape[:-1], width)


def random_bitmask(gen, lead, S, K):
    """uint8 [*lead, ceil(S/8)] with exactly K of the S tokens set per row (little bit order)."""
    rows = math.prod(lead)
    nbytes = -(-S // 8)
    bits = torch.zeros(rows, nbytes * 8, dtype=torch.uint8)
    for r in range(rows):
        bits[r, torch.randperm(S, generator=gen)[:K]] = 1
    packed = (bits.view(rows, nbytes, 8).long() << torch.arange(8)).sum(-1).to(torch.uint8)
    return packed.view(*lead, nbytes)


@pytest.mark.parametrize(("S", "K", "width"), [(37, 9, 16), (64, 64, 64), (1000, 250, 256), (13, 1, 5)])
def test_decode_bitmask_reference(gen, S, K, width):
    """Reference decode equals brute force, incl. ragged S (stray bits past S ignored) and into a stacked buffer."""
    bits = random_bitmask(gen, (2, 3), S, K)
    if S % 8:
        bits[..., -1] |= 0xFF << (S % 8) & 0xFF  # bits of tokens >= S must be ignored
    stacked = torch.full((2, 2, 3, width), 7, dtype=torch.int32)
    got = kernels.decode_bitmask(bits, num_tokens=S, out=stacked[1])
    assert got.data_ptr() == stacked[1].data_ptr()
    assert torch.equal(stacked[1], brute_decode(bits, S, width)) and (stacked[0] == 7).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reference_adds_the_residual_before_its_one_rounding(gen, dtype):
    """The torch reference (the backend of last resort, and every fused kernel's model): sparse + R summed in fp32 and
    rounded once to q's dtype, bit for bit (mutation: the sparse part and R each rounded to q's dtype before the sum
    passed every test after the unfused helper that pinned this was deleted as dead code)."""
    B, H, S, D, C, K = 1, 2, 70, 32, 16, 24
    q, k, v = (torch.randn(B, H, S, D, generator=gen).to(dtype) for _ in range(3))
    perm = random_groups(gen, B, H, S, C)
    idx = random_kv_idx(gen, B, H, perm.shape[-1] // C, S, K, 32)
    r = torch.randn(B, H, S, D, generator=gen) / 3
    got = kernels.sparse_attention(q, k, v, perm, idx, residual=Residual(r), backend="torch")
    sparse = kernels.sparse_attention(q.float(), k.float(), v.float(), perm, idx, backend="torch")
    assert got.dtype == dtype and torch.equal(got, (sparse + r).to(dtype))
