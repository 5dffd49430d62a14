"""The compact metadata cache: bit-exact selections and groups, fp8 residual cost, placement, prefetch, OOM."""

import pytest
import torch
from comfyui_mc_sparse_pack import kernels
from comfyui_mc_sparse_pack.comfyui_mc_sparse import attention, encoding, engine
from comfyui_mc_sparse_pack.comfyui_mc_sparse import cache as cache_module
from comfyui_mc_sparse_pack.comfyui_mc_sparse.cache import CacheKey, MetadataCache, StoredEntry, encode_entry
from comfyui_mc_sparse_pack.comfyui_mc_sparse.config import MCSparseConfig
from comfyui_mc_sparse_pack.comfyui_mc_sparse.schedule import StepKind
from comfyui_mc_sparse_pack.comfyui_mc_sparse.tools.workload import SyntheticWorkload, WorkloadSpec

from .test_reuse_op import brute_group_rows, brute_residual


def _selection(gen, B, H, G, S, K, width):
    """Random sorted selections of exactly K tokens per group, -1 past K (the select_kv contract)."""
    scores = torch.rand(B, H, G, S, generator=gen)
    idx = torch.sort(torch.topk(scores, K, dim=-1).indices, dim=-1).values.to(torch.int32)
    pad = torch.full((B, H, G, width - K), -1, dtype=torch.int32)
    return torch.cat([idx, pad], dim=-1)


def _rel_l1(a, b):
    return ((a.double() - b.double()).abs().sum() / b.double().abs().sum()).item()


# --- encodings ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["auto", "bitmask", "uint16", "int32"])
@pytest.mark.parametrize("S,K,width", [(1000, 256, 256), (1003, 70, 128), (77, 77, 128), (9, 1, 64), (65536, 300, 320),
                                     (75600, 18944, 18944)])
def test_selection_round_trip_is_bit_exact(gen, kind, S, K, width):
    """Every encoding decodes to the identical int32 array: same indices, same order, same -1 padding."""
    kv = _selection(gen, 2, 3, 4, S, K, width)
    enc = encoding.encode_selection(kv, S, K, kind)
    out = encoding.decode_selection(enc)
    assert out.dtype == torch.int32 and torch.equal(out, kv)
    if kind != "auto":  # 16-bit indices cannot address S > 65536: int32
        assert enc.kind == ("int32" if kind == "uint16" and S > 65536 else kind)


@pytest.mark.parametrize("S,K", [(1000, 256), (77, 77), (9, 1), (32760, 4992), (75600, 11392)])
def test_bitmask_by_words_equals_bitmask_by_bytes(gen, monkeypatch, S, K):
    """encoding.PACK_BITS "words" (int32 words, scatter_add) writes the same bytes as "bytes", including each word's
    sign bit (tokens 32w + 31) and a last word cut short (S not a multiple of 32), and decodes to the selection."""
    kv = _selection(gen, 1, 2, 3, S, K, K)
    last = torch.arange(31, max(S, 31), 32, dtype=torch.int32)[:K]  # every token that is bit 31 of its word
    kv[0, 1, 2, : last.numel()] = last
    kv[0, 1, 2, last.numel():] = torch.tensor(sorted(set(range(S)) - set(last.tolist())), dtype=torch.int32)[
        : K - last.numel()]
    kv[0, 1, 2] = kv[0, 1, 2].sort().values
    got = {}
    for how in ("bytes", "words"):
        monkeypatch.setattr(encoding, "PACK_BITS", how)
        got[how] = encoding.encode_selection(kv, S, K, "bitmask", checked=True)
        assert got[how].kind == "bitmask" and got[how].data.shape == (1, 2, 3, -(-S // 8))
        assert got[how].data.is_contiguous() and torch.equal(encoding.decode_selection(got[how]), kv)
    assert torch.equal(got["words"].data, got["bytes"].data)


def test_selection_from_a_real_anchor_round_trips(gen):
    """Selections made by select_kv (ragged S, K = S at density 1) survive the bitmask exactly."""
    for S, density in ((300, 0.2), (130, 1.0)):
        q, k, v = (torch.randn(1, 2, S, 64, generator=gen) for _ in range(3))
        cfg = MCSparseConfig(density=density, group_size=64, warmup_steps=0, anchor_steps=(0,))
        _, entry = attention.anchor_attention(q, k, v, cfg)
        stored = encode_entry(entry, index_encoding="bitmask")
        back = stored.decode(q.device)
        assert torch.equal(back.kv_idx, entry.kv_idx) and torch.equal(back.perm, entry.perm)
        assert stored.selection.kind == "bitmask" and stored.groups.kind == "uint16"


def test_rows_not_k_sorted_fall_back_to_int32(gen):
    """Unsorted rows, rows with fewer than K tokens, a repeated token or a token >= S are stored as given, so the round
    trip stays exact (mutations '>=' for '>' between neighbours and '<=' for '< S' in the check passed before: the
    bitmask dropped the repeat / decoded token S, past the keys)."""
    kv = _selection(gen, 1, 2, 3, 500, 64, 64)
    unsorted = kv.flip(-1).contiguous()
    short = kv.clone()
    short[0, 0, 0, -1] = -1
    repeat, past = kv.clone(), kv.clone()
    repeat[0, 1, 2, 1] = repeat[0, 1, 2, 0]
    past[0, 0, 1, -1] = 500
    assert (repeat[0, 1, 2, 1:] >= repeat[0, 1, 2, :-1]).all() and past[0, 0, 1, -2] < 500  # still ascending
    for bad in (unsorted, short, repeat, past):
        enc = encoding.encode_selection(bad, 500, 64, "bitmask")
        assert enc.kind == "int32" and torch.equal(encoding.decode_selection(enc), bad)
    # a tail that is not -1 past K keys, and an unsorted row of K = 2 (mutations that left the suite green: the tail
    # check dropped; the order checked only from K = 3)
    wide = torch.cat([kv, torch.full((1, 2, 3, 8), -1, dtype=torch.int32)], -1)
    wide[0, 1, 0, -3] = 17
    pair = kv[..., :2].flip(-1).contiguous()
    for bad, k in ((wide, 64), (pair, 2)):
        enc = encoding.encode_selection(bad, 500, k, "bitmask")
        assert enc.kind == "int32" and torch.equal(encoding.decode_selection(enc), bad)
    with pytest.raises(ValueError, match="num_keys must be in"):
        encoding.encode_selection(kv, 500, 65)  # K past the row width


@pytest.mark.parametrize("S,K,expected", [(32760, 8192, "bitmask"), (32760, 1024, "uint16"), (32760, 2040, "uint16"),
                                          (32760, 2048, "bitmask"),
                                          (75600, 18944, "bitmask"), (200000, 1024, "int32"), (200000, 8192, "bitmask")])
def test_auto_picks_the_smallest_encoding(S, K, expected):
    """auto: bitmask (S/8 bytes) beats 16-bit indices (2K) above s = 1/16; int32 only where neither fits."""
    assert encoding.pick_selection_encoding("auto", S, K, K) == expected


def test_groups_round_trip_and_tail(gen):
    """Query groups: 16-bit for S <= 65536 with the -1 tail restored; anything else stored as int32."""
    q = torch.randn(2, 3, 200, 64, generator=gen)
    perm = kernels.pddp_groups(q, 64)
    enc = encoding.encode_groups(perm, 200)
    assert enc.kind == "uint16" and enc.nbytes == 2 * 3 * 200 * 2 == encoding.groups_nbytes(2, 3, 200, 64)
    assert torch.equal(encoding.decode_groups(enc), perm)
    odd = perm.clone()
    odd[0, 0, -1] = 5  # not the documented -1 tail
    assert encoding.encode_groups(odd, 200).kind == "int32"
    past = perm.clone()
    past[0, 1, 3] = 70000  # a query index >= S (past 16 bits): stored as given (mutation: the '< S' check dropped)
    enc = encoding.encode_groups(past, 200)
    assert enc.kind == "int32" and torch.equal(encoding.decode_groups(enc), past)
    assert [encoding.groups_kind(n) for n in (65536, 65537)] == ["uint16", "uint17"]  # 65536 tokens: indices < 2^16


@pytest.mark.parametrize("S,kind", [(75600, "uint17"), (131072, "uint17"), (131073, "int32")])
def test_groups_past_16_bits_round_trip(gen, S, kind):
    """Past 65536 tokens (Wan2.1 720p: 75600) groups keep 16 bits + one high bit per query, bit-exact."""
    C = 128
    G = -(-S // C)
    perm = torch.full((1, 2, G * C), -1, dtype=torch.int32)
    perm[..., :S] = torch.stack([torch.randperm(S, generator=gen) for _ in range(2)]).to(torch.int32)
    enc = encoding.encode_groups(perm, S)
    assert enc.kind == kind and enc.nbytes == encoding.groups_nbytes(1, 2, S, C)
    assert torch.equal(encoding.decode_groups(enc), perm)


# --- residual -------------------------------------------------------------------------------------------------


def _residual_like(gen, B=1, H=2, S=300, D=64):
    """Rows of very different sizes (1e-4 .. 10), Gaussian within a row, one zero row."""
    r = torch.randn(B, H, S, D, generator=gen) * torch.logspace(-4, 1, S).view(1, 1, S, 1)
    r[0, 0, 7] = 0
    return r


@pytest.mark.parametrize("name", ["bfloat16", "float16", "float32", "float8_e4m3fn", "int4"])
def test_residual_round_trip_error_bound(gen, name):
    """Each precision's round trip stays within its rounding bound, element by element, for rows of any size:
    bf16/fp16/fp32 one rounding; fp8 e4m3 (3 mantissa bits) 2^-4 of the value or half its subnormal step; int4
    half a step (s/2) for values inside the clip range, and exactly clipped to +-7 s outside it. Sizes and the
    kernels.Residual fields follow kernels/residual.py."""
    r = _residual_like(gen)
    B, H, S, D = r.shape
    enc = encoding.encode_residual(r, name)
    res = encoding.residual_for_kernel(enc)
    back = res.dequantize(torch.float64)
    err = (back - r.double()).abs()
    x = r.double().abs()
    assert enc.nbytes == encoding.residual_nbytes(B, H, S, D, name)
    if name in ("bfloat16", "float16", "float32"):
        assert res.kind == "plain" and res.scale is None and res.data.dtype == getattr(torch, name)
        eps, tiny = {"bfloat16": (2**-8, 0), "float16": (2**-11, 2**-25), "float32": (2**-24, 0)}[name]
        assert (err <= eps * x + tiny).all()  # fp16: half the subnormal step below 2^-14
        return
    s = res.scale.double().unsqueeze(-1)
    assert res.scale.dtype == torch.float32 and res.scale.shape == (B, H, S) and torch.isfinite(res.scale).all()
    if name == "float8_e4m3fn":
        assert res.kind == "fp8_row" and res.data.dtype == torch.float8_e4m3fn and res.data.shape == (B, H, S, D)
        amax = r.abs().amax(-1)
        assert torch.equal(res.scale, torch.where(amax > 0, amax / 448, torch.ones_like(amax)))  # max |R| -> 448
        assert (err <= torch.maximum(x * 2**-4, s * 2**-10) * 1.0001).all()
        assert _rel_l1(back, r) < 0.03
    else:
        assert res.kind == "int4_row" and res.data.dtype == torch.uint8 and res.data.shape == (B, H, S, D // 2)
        lo, hi = res.data & 0xF, res.data >> 4
        assert bool(((lo >= 1) & (lo <= 15) & (hi >= 1) & (hi <= 15)).all())  # q + 8 with q in [-7, 7]
        inside = x <= 7.5 * s
        assert (err[inside] <= s.expand_as(x)[inside] / 2 * 1.0001).all()
        assert torch.allclose(back.abs()[~inside], (7 * s).expand_as(x)[~inside])
        assert _rel_l1(back, r) < 0.12
    assert (back[0, 0, 7] == 0).all()


def test_int4_layout_is_the_kernel_contract():
    """Known values land where contract 2 says: element 2j in the low nibble of byte j, nibble q + 8; R = q * s."""
    q = torch.tensor([-7, 7, 0, 1, -1, 3, 5, -3], dtype=torch.float32)
    r = (q * 0.25).view(1, 1, 1, 8)
    enc = encoding.encode_residual(r, "int4")
    expected = [(1 | 15 << 4), (8 | 9 << 4), (7 | 11 << 4), (13 | 5 << 4)]
    assert enc.data.flatten().tolist() == expected and enc.scale.item() == pytest.approx(0.25)
    assert torch.equal(encoding.decode_residual(enc, torch.float32), r)


def test_int4_scale_search_beats_round_to_nearest_absmax(gen):
    """The per-row clipped scale never loses to round-to-nearest with max|R| / 7 (a candidate) and wins on
    Gaussian rows (the measured 0.128 -> 0.103 of docs/cache.md)."""
    r = torch.randn(1, 4, 256, 128, generator=gen)
    enc = encoding.encode_residual(r, "int4")
    ours = (encoding.decode_residual(enc, torch.float32) - r).abs().sum(-1)
    s = r.abs().amax(-1, keepdim=True) / 7
    rtn = ((r / s).round().clamp(-7, 7) * s - r).abs().sum(-1)
    assert (ours <= rtn * (1 + 1e-5)).all()
    assert ours.sum() < 0.9 * rtn.sum()


def _grouped(gen, B, H, S, D, C, spread=0.3, noise=0.2):
    """(R, perm, G): ragged random groups (S % C != 0); each group's rows are its base row times (1 + spread * n)
    plus noise * Gaussian, rows of very different sizes across groups (1e-3 .. 10), one zero row."""
    G = -(-S // C)
    perm = torch.full((B, H, G * C), -1, dtype=torch.int32)
    perm[..., :S] = torch.argsort(torch.rand(B, H, S, generator=gen), -1).to(torch.int32)
    base = torch.randn(B, H, G, D, generator=gen) * torch.logspace(-3, 1, G).view(1, 1, G, 1)
    slot_rows = base.repeat_interleave(C, 2) * (1 + spread * torch.randn(B, H, G * C, 1, generator=gen))
    slot_rows += noise * base.abs().mean(-1, keepdim=True).repeat_interleave(C, 2) * torch.randn(B, H, G * C, D, generator=gen)
    r = torch.zeros(B, H, S, D)
    valid = perm >= 0
    for b in range(B):
        for h in range(H):
            r[b, h, perm[b, h][valid[b, h]].long()] = slot_rows[b, h][valid[b, h]]
    r[0, 0, 5] = 0
    return r, perm, G


def test_int4_group_round_trip_is_the_documented_format(gen):
    """"int4_group": per group the bf16 mean of its rows (every member, none of the padding slots), per row the
    least-squares weight of that mean in e4m3, the deviation in 4 bits with a bf16 row scale: within half a step of
    it inside the clip range; bytes as ``residual_nbytes`` (the estimate's formula); kernels.Residual fields as
    kernels/residual.py defines them; a zero row decodes to zero."""
    B, H, S, D, C = 2, 3, 300, 64, 64
    r, perm, G = _grouped(gen, B, H, S, D, C)
    enc = encoding.encode_residual(r, "int4_group", perm, G)
    assert enc.nbytes == encoding.residual_nbytes(B, H, S, D, "int4_group", G) == B * H * (S * (D // 2 + 3) + G * D * 2)
    res = encoding.residual_for_kernel(enc)
    assert (res.kind, res.data.dtype, res.scale.dtype, res.coef.dtype, res.mean.dtype) == (
        "int4_group", torch.uint8, torch.bfloat16, torch.float8_e4m3fn, torch.bfloat16)
    assert res.data.shape == (B, H, S, D // 2) and res.scale.shape == res.coef.shape == (B, H, S)
    assert res.mean.shape == (B, H, G, D)
    lo, hi = res.data & 0xF, res.data >> 4
    assert bool(((lo >= 1) & (lo <= 15) & (hi >= 1) & (hi <= 15)).all())
    for b in range(B):
        for h in range(H):
            for g in range(G):
                members = perm[b, h, g * C:(g + 1) * C]
                rows = r[b, h, members[members >= 0].long()]
                assert torch.equal(res.mean[b, h, g], rows.mean(0).to(torch.bfloat16)), (b, h, g)
    means = brute_group_rows(res.mean.double(), perm, S)
    a = (r.double() * means).sum(-1) / means.pow(2).sum(-1)
    assert torch.equal(res.coef, a.float().to(torch.float8_e4m3fn))
    dev = r.double() - res.coef.double()[..., None] * means
    back = res.dequantize(torch.float64, perm)
    assert torch.equal(back, brute_residual(res, perm))
    s = res.scale.double()[..., None]
    err, inside = (back - r.double()).abs(), dev.abs() <= 7.5 * s
    assert (err[inside] <= s.expand_as(err)[inside] / 2 * 1.0001 + 1e-12).all()
    assert (back[0, 0, 5] == 0).all()


def test_int4_group_halves_int4_error_on_correlated_groups(gen):
    """On rows correlated within their query group (what PDDP groups are) the group form's residual error is under
    half of "int4"'s (docs/cache.md: 0.105 -> 0.040 on the synthetic workload); on rows with no group structure it
    loses at most 5 % (the weight of a noise mean is ~0)."""
    r, perm, G = _grouped(gen, 1, 4, 500, 128, 128)
    errors = {name: _rel_l1(encoding.decode_residual(encoding.encode_residual(r, name, perm, G), torch.float64, perm=perm), r)
              for name in ("int4", "int4_group")}
    assert errors["int4_group"] < 0.5 * errors["int4"], errors
    iid = torch.randn(1, 4, 500, 128, generator=gen)
    plain = {name: _rel_l1(encoding.decode_residual(encoding.encode_residual(iid, name, perm, G), torch.float64, perm=perm),
                           iid) for name in ("int4", "int4_group")}
    assert plain["int4_group"] < 1.05 * plain["int4"], plain


def _bits(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def test_stacked_int4_group_entries_keep_every_part(gen):
    """Two int4_group entries (both CFG branches) decoded into one stacked batch (prefetch's one-launch path): each
    entry's data, scale, coef and mean land in its rows, and the one launch equals the two separate ones."""
    from comfyui_mc_sparse_pack.comfyui_mc_sparse import prefetch
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.cache import CacheEntry

    B, H, S, D, C, K = 1, 2, 160, 64, 64, 40
    stored = []
    for _ in range(2):
        r, perm, G = _grouped(gen, B, H, S, D, C)
        stored.append(encode_entry(CacheEntry(perm, _selection(gen, B, H, G, S, K, 64), r, K, (B, H, S, D)),
                                   residual_dtype="int4_group"))
    batch = prefetch._decode_group(stored, torch.device("cpu"), torch.float32)
    assert batch.residual.kind == "int4_group" and len(batch.residual.tensors()) == 4
    q, k, v = (torch.randn(2, H, S, D, generator=gen) for _ in range(3))
    both = kernels.sparse_attention(q, k, v, batch.perm, batch.kv_idx, residual=batch.residual)
    for i, st in enumerate(stored):
        one = st.decode(torch.device("cpu"))
        for got, want in zip(batch.residual.tensors(), one.residual.tensors(), strict=True):
            assert torch.equal(_bits(got[i:i + 1]), _bits(want))
        alone = kernels.sparse_attention(q[i:i + 1], k[i:i + 1], v[i:i + 1], one.perm, one.kv_idx, residual=one.residual)
        assert torch.allclose(both[i:i + 1], alone, atol=1e-6, rtol=1e-5)


def test_int4_group_needs_the_groups():
    with pytest.raises(ValueError, match="int4_group needs the entry's int32 perm"):
        encoding.encode_residual(torch.zeros(1, 1, 4, 8), "int4_group")
    with pytest.raises(ValueError, match="int4_group needs the entry's int32 perm"):
        encoding.encode_residual(torch.zeros(1, 1, 4, 8), "int4_group", torch.zeros(1, 1, 6, dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="int4_group needs the entry's int32 perm"):  # G*C = 2 slots < S = 4
        encoding.encode_residual(torch.zeros(1, 1, 4, 8), "int4_group", torch.zeros(1, 1, 2, dtype=torch.int32), 1)
    with pytest.raises(ValueError, match="number of query groups"):
        encoding.residual_nbytes(1, 1, 4, 8, "int4_group")


def test_quantised_residuals_stay_finite_at_the_edges(gen):
    """fp8: a row whose max |R| is below fp32's reach for its scale (1e-44: amax / 448 underflows to 0) keeps scale 1
    instead of 0 / 0 = NaN (mutation that left the suite green: the underflow guard as 'amax > 0'); int4_group: a
    group whose rows almost cancel (a mean row tiny next to them: each row's weight ~4e4) decodes finite. The weight's
    clamp to e4m3's 448 before the cast is redundant with torch 2.13's cast (it saturates, even inf -> 448): kept, the
    cast's overflow rule being torch's."""
    r = torch.randn(1, 1, 4, 8, generator=gen)
    r[0, 0, 1] = torch.tensor([1e-44, -1e-44, 0, 0, 0, 0, 0, 0])
    enc = encoding.encode_residual(r, "float8_e4m3fn")
    out = encoding.decode_residual(enc, torch.float32)
    assert torch.isfinite(out).all() and float((out - r).abs().max()) < 0.1 * float(r.abs().max())
    C, D = 4, 8
    rows = torch.randn(1, 1, C, D, generator=gen) * 10
    rows[0, 0, -1] = -rows[0, 0, :-1].sum(0) + 1e-3  # the group's mean is ~2.5e-4 per element
    perm = torch.arange(C, dtype=torch.int32).view(1, 1, C)
    enc = encoding.encode_residual(rows, "int4_group", perm, 1)
    out = encoding.decode_residual(enc, torch.float32, perm=perm)
    assert torch.isfinite(out).all(), out


def test_residual_rejects_unknown_storage():
    with pytest.raises(ValueError, match="residual dtype must be one of"):
        encoding.encode_residual(torch.zeros(1, 1, 2, 4), "int8")
    with pytest.raises(ValueError, match="even head dim"):
        encoding.encode_residual(torch.zeros(1, 1, 2, 5), "int4")


def test_quantised_residual_fidelity_cost_on_reuse_output():
    """fp8 and int4 residuals: the reuse output's relative L1 against dense moves by a small share of the residual's
    gain (fp8 < 10 %, int4 < 25 %) three steps after the anchor, int4_group by less than 0.6 of int4's cost; the full
    table is tests/bench_cache.py's."""
    spec = WorkloadSpec(frames=4, height=8, width=16, heads=4, head_dim=64, num_steps=20, drift=0.8, seed=3)
    wl = SyntheticWorkload(spec)
    q0, k0, v0 = wl.qkv(10, dtype=torch.bfloat16)
    q1, k1, v1 = wl.qkv(13, dtype=torch.bfloat16)
    dense = kernels.dense_attention(q1, k1, v1)
    cfg = MCSparseConfig(density=0.2, group_size=64, warmup_steps=0, anchor_steps=(0,), residual_dtype="int4")
    _, entry = attention.anchor_attention(q0, k0, v0, cfg)
    assert entry.residual.dtype == torch.float32  # quantised later, from full precision
    errors = {}
    for name in ("bfloat16", "float8_e4m3fn", "int4", "int4_group"):
        stored = encode_entry(entry, residual_dtype=name)
        errors[name] = _rel_l1(attention.reuse_attention(q1, k1, v1, stored.decode(q1.device)), dense)
    print(errors)
    no_residual = _rel_l1(kernels.sparse_attention(q1, k1, v1, entry.perm, entry.kv_idx), dense)
    gain = no_residual - errors["bfloat16"]
    assert gain > 0
    assert abs(errors["float8_e4m3fn"] - errors["bfloat16"]) < 0.1 * gain, (errors, no_residual)
    assert 0 <= errors["int4"] - errors["bfloat16"] < 0.25 * gain, (errors, no_residual)
    assert 0 <= errors["int4_group"] - errors["bfloat16"] < 0.6 * (errors["int4"] - errors["bfloat16"]), errors


# --- placement and prefetch -----------------------------------------------------------------------------------


def _workload_run(gen, placement, steps=5, layers=3, branches=("c", "u"), residual_dtype="bfloat16"):
    cfg = MCSparseConfig(density=0.25, group_size=64, warmup_steps=1, anchor_steps=(0, 3), cache_placement=placement,
                         residual_dtype=residual_dtype)
    runner = engine.MCSparseRunner(cfg)
    inputs = {}
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    g = torch.Generator().manual_seed(seed)
    outs = []
    for step in range(steps):
        for layer in range(layers):
            for branch in branches:
                q, k, v = inputs.setdefault((step, layer, branch), [torch.randn(1, 2, 160, 64, generator=g) for _ in range(3)])
                key = CacheKey(layer, branch, None, tuple(q.shape))
                outs.append(runner.attention(q, k, v, step=step, layer=layer, key=key))
    return runner, outs


def test_cpu_placement_prefetches_in_anchor_order_and_matches_gpu_placement(gen):
    """Without CUDA the cpu path runs synchronously: every reuse load after the first of a run is a prefetch hit,
    and the outputs equal those of the resident ('gpu') placement bit for bit."""
    state = gen.get_state()
    cpu_runner, cpu_outs = _workload_run(gen, "cpu")
    gen.set_state(state)
    gpu_runner, gpu_outs = _workload_run(gen, "gpu")
    assert all(torch.equal(a, b) for a, b in zip(cpu_outs, gpu_outs))
    reuse = cpu_runner.stats.calls[StepKind.REUSE]
    assert reuse == 3 * 3 * 2  # steps 1, 2 and 4 reuse; 3 layers x 2 branches each
    # the first reuse call after each anchor finds nothing prefetched (step 1 and step 4); all others hit
    assert cpu_runner.loader.misses == 2 and cpu_runner.loader.hits == reuse - 2
    assert "2 in line" in cpu_runner.summary() and cpu_runner.cache.host_bytes > 0
    cpu_runner.close()
    assert cpu_runner.cache.nbytes == 0 and len(cpu_runner.cache) == 0


def test_stored_entries_are_compact_and_accounted(gen):
    """The runner stores encoded entries: bitmask + 16-bit groups + fp8 residual, counted in the cache's bytes."""
    for dtype, kind, note in (("int4", "int4_row", "row scale"), ("int4_group", "int4_group", "group mean + row scale")):
        runner, _ = _workload_run(gen, "auto", residual_dtype=dtype)
        entries = [runner.cache.get(CacheKey(layer, b, None, (1, 2, 160, 64))) for layer in range(3) for b in "cu"]
        assert all(isinstance(e, StoredEntry) for e in entries)
        e = entries[0]
        assert e.selection.kind == "bitmask" and e.groups.kind == "uint16" and e.residual.kind == kind
        assert runner.cache.nbytes == sum(x.nbytes for x in entries) == 6 * e.nbytes
        assert f"{dtype} ({note})" in runner.summary()


class _FakeEntry:
    """Just what placement looks at: a CUDA device and a size (no CUDA needed)."""

    device = torch.device("cuda", 0)

    def __init__(self, nbytes):
        self.nbytes = nbytes


@pytest.mark.parametrize(
    "placement,fixed,free,entry,choice,spilled",
    [
        ("cpu", None, 100 << 30, 1 << 20, "cpu", False),
        ("gpu", None, 100 << 30, 1 << 30, "gpu", False),
        ("gpu", None, 1 << 30, 1 << 30, "cpu", True),  # would leave less than the margin: moved, not OOM
        ("auto", "gpu", 40 << 30, 1 << 30, "gpu", False),  # the plan chose the GPU
        ("auto", "cpu", 100 << 30, 1 << 30, "cpu", False),  # the plan chose CPU memory: all there
        ("auto", "gpu", 4 << 30, 1 << 30, "cpu", True),  # chose the GPU, but memory got short: moved, noted
        ("auto", None, 6 << 30, 1 << 30, "gpu", False),  # no plan: per entry, fits with headroom
        ("auto", None, 4 << 30, 1 << 30, "cpu", True),  # no plan: spills once headroom is reached
    ],
)
def test_placement_decisions_follow_free_memory(placement, fixed, free, entry, choice, spilled):
    """gpu/cpu/auto from the free-memory hook, the headroom and the plan; shortage moves entries, never raises."""
    seen = []
    cache = MetadataCache(placement, headroom_bytes=4 << 30, free_memory_fn=lambda dev: seen.append(dev) or free)
    if fixed:
        cache.fix_placement(fixed)
    assert cache._choose(_FakeEntry(entry), 0) == choice
    assert (cache.moved == 1) is spilled and bool(cache.notes) is spilled
    assert all(d == torch.device("cuda", 0) for d in seen)


def test_host_buffers_never_pin_past_the_budget(gen, monkeypatch):
    """At run time the cache page-locks at most ``pin_budget_bytes``: later host buffers stay pageable, with a note
    (CUDA faked: the pinning call is what is checked)."""
    made = []

    class FakeBuffer(cache_module._HostBuffer):
        def __init__(self, nbytes, pin):
            made.append(pin)
            self.data, self.events = torch.empty(nbytes, dtype=torch.uint8), []
            self.pinned = self.registered = pin

        def release(self):
            self.pinned = self.registered = False

    monkeypatch.setattr(cache_module, "_HostBuffer", FakeBuffer)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    q, k, v = (torch.randn(1, 2, 128, 64, generator=gen) for _ in range(3))
    _, entry = attention.anchor_attention(q, k, v, MCSparseConfig(group_size=64, warmup_steps=0, anchor_steps=(0,)))
    stored = encode_entry(entry)
    one = cache_module._layout(stored.tensors())[1]
    cache = MetadataCache("cpu", pin_budget_bytes=int(2.5 * one))
    for _ in range(4):
        cache._to_host(stored, None)
    assert made == [True, True, False, False] and cache.pinned_bytes == 2 * one
    assert any("pin budget" in n for n in cache.notes)


def test_config_rejects_unknown_storage_settings():
    """New config fields validate like the old ones."""
    with pytest.raises(ValueError, match="cache_placement must be one of"):
        MCSparseConfig(cache_placement="disk")
    with pytest.raises(ValueError, match="index_encoding must be one of"):
        MCSparseConfig(index_encoding="zip")
    with pytest.raises(ValueError, match="residual_dtype must be one of"):
        MCSparseConfig(residual_dtype="int8")
    with pytest.raises(ValueError, match="cache_headroom_gib must be a finite number >= 0, got -1"):
        MCSparseConfig(cache_headroom_gib=-1)


# --- out of memory --------------------------------------------------------------------------------------------


def test_out_of_memory_falls_back_to_dense_with_settings_that_fit(gen, monkeypatch):
    """An OOM in the pack's path frees the cache, names settings that would fit, and the run continues dense."""
    cfg = MCSparseConfig(density=0.25, group_size=64, warmup_steps=0, anchor_steps=(0,))
    runner = engine.MCSparseRunner(cfg)
    runner.plan(heads=2, head_dim=64, layers=2, tokens=128, branches=1, num_steps=4)
    q, k, v = (torch.randn(1, 2, 128, 64, generator=gen) for _ in range(3))
    runner.attention(q, k, v, step=0, layer=0, key=CacheKey(0, "c", None, tuple(q.shape)))
    assert len(runner.cache) == 1

    def boom(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(engine, "anchor_attention", boom)
    out = runner.attention(q, k, v, step=0, layer=1, key=CacheKey(1, "c", None, tuple(q.shape)))
    assert torch.allclose(out, kernels.dense_attention(q, k, v))
    assert len(runner.cache) == 0 and runner.disabled_reason
    later = runner.attention(q, k, v, step=1, layer=0, key=CacheKey(0, "c", None, tuple(q.shape)))
    assert torch.allclose(later, kernels.dense_attention(q, k, v))
    text = runner.summary()
    assert "out of memory at step 1 (1-based), block 1 (CUDA out of memory. Tried to allocate 2.00 GiB)" in text
    assert "Settings that would fit: " in text
    assert "dense x2: out of memory; dense for the rest of the run" in text


def test_chunked_encodings_equal_one_chunk(gen, monkeypatch):
    """The encoders and decoders work in row chunks (``encoding._CHUNK_ELEMENTS``: many chunks at real sizes, one in
    every other test). With the budget cut to a few rows per chunk, every selection encoding (bitmask packed by bytes
    and by words, uint16), the query groups and every residual form give the same bytes and decode to the same
    tensors as in one chunk. Mutations: a chunk's rows written at the first chunk, the last partial chunk dropped."""
    B, H, S, D, C, K = 2, 3, 300, 64, 64, 40
    kv = _selection(gen, B, H, 5, S, K, 48)
    r, perm, G = _grouped(gen, B, H, S, D, C)

    def run_all():
        got = []
        for how in ("bytes", "words"):
            monkeypatch.setattr(encoding, "PACK_BITS", how)
            enc = encoding.encode_selection(kv, S, K, "bitmask", checked=True)
            got += [enc.data, encoding.decode_selection(enc)]
        enc = encoding.encode_selection(kv, S, K, "uint16", checked=True)
        got += [enc.data, encoding.decode_selection(enc)]
        groups = encoding.encode_groups(perm, S)
        got += [groups.data, encoding.decode_groups(groups)]
        for name in ("float8_e4m3fn", "int4", "int4_group"):
            res = encoding.encode_residual(r, name, perm, G)
            got += [t for t in (res.data, res.scale, res.coef, res.mean) if t is not None]
            got.append(encoding.decode_residual(res, torch.float32, perm=perm))
        return got

    whole = run_all()
    monkeypatch.setattr(encoding, "_CHUNK_ELEMENTS", 5 * S)  # a few rows (or heads) per chunk, the last partial
    for i, (want, got) in enumerate(zip(whole, run_all(), strict=True)):
        assert torch.equal(want.view(torch.uint8) if want.dtype.itemsize == 1 else want,
                           got.view(torch.uint8) if got.dtype.itemsize == 1 else got), i
