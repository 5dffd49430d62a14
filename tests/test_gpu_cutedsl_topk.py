"""The CuTeDSL top-K launch (kernels/cutedsl/topk_sm90.py) on an H200 against the brute-force top-K of the same float16
sums (kernels/reference/topk.py): ascending indices, ties to the lower index, -1 padding, every slot of the selection
written (poisoned first) and nothing outside the head chunk's view; rows pulled from a bigger buffer (select_kv's
head chunks: strided views), ragged Sk (a multiple of 8, not of the 256-key sweep step), K = 1 and K = Sk, width >
K, twin keys (every sum equal to its neighbour: ties at the threshold), a constant row, negative sums and -0.0 (rank
as +0.0), rows forced to the radix launch (a bracket plan that misses) and both row orders and CTA widths; then
select_kv(topk_cute=True) == select_kv's Triton top-K. Skipped without an sm_90 GPU or without the CuTeDSL stack.
Run: ``python -m pytest -q -m gpu tests/test_gpu_cutedsl_topk.py`` (~30 s on an H200, compiles included).
"""

from __future__ import annotations

import pytest
import torch
from comfyui_mc_sparse_pack.kernels.reference.topk import top_k_rows as ref_top_k_rows

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                       reason="needs an sm_90 CUDA GPU"),
]
SEED = 20261202


def _mod():
    try:
        from comfyui_mc_sparse_pack.kernels.cutedsl import topk_sm90
    except ImportError as err:  # the CuTeDSL stack is not installed on this machine
        pytest.skip(f"CuTeDSL stack unavailable: {err}")
    return topk_sm90


def _sums(kind, B, H, G, sk, gen):
    """float16 sums in [0, 128] (group sums of C = 128 probabilities), a head-chunk view of a 1-head-wider buffer."""
    full = (torch.rand(B, H + 1, G, sk, generator=gen, device="cuda") ** 3 * 128).half()
    x = full[:, 1:]
    if kind == "twins":
        x[..., 1::2] = x[..., 0::2]
    elif kind == "constant":
        x.fill_(3.0)
    elif kind == "coarse":  # few distinct values: many ties everywhere
        x.copy_((x.float() / 16).floor().half())
    elif kind == "signs":  # negatives and -0.0 rank as +0.0
        x[..., ::5] = -x[..., ::5]
        x[..., 1::7] = -0.0
    return x


CASES = [  # (kind, B, H, G, Sk, K, width extra, opts)
    ("random", 1, 3, 40, 32760, 3276, 52, {}),
    ("random", 1, 3, 40, 32760, 16380, 4, dict(reverse=False)),
    ("random", 2, 2, 17, 4000, 1, 127, dict(warps=1)),
    ("random", 1, 2, 9, 4000, 4000, 0, dict(warps=4)),
    ("twins", 1, 3, 40, 32760, 8190, 2, {}),
    ("twins", 1, 2, 33, 3000 // 8 * 8, 1300, 12, dict(warps=1, reverse=False)),
    ("constant", 1, 2, 5, 2048, 700, 0, {}),
    ("coarse", 1, 2, 21, 32760, 4915, 13, {}),
    ("signs", 1, 2, 21, 8000, 2000, 48, {}),
    ("random", 1, 2, 21, 8000, 2000, 48, dict(bracket=(8, 500, 1, 1))),  # every bracket misses: the radix launch
    ("twins", 1, 2, 21, 8000, 2000, 48, dict(bracket=(16, 400, 90, 110))),  # a narrow bracket: some rows miss
]


@pytest.mark.parametrize(("kind", "B", "H", "G", "sk", "kq", "extra", "opts"), CASES,
                         ids=[f"{c[0]}-B{c[1]}H{c[2]}G{c[3]}Sk{c[4]}K{c[5]}-{c[7]}" for c in CASES])
def test_cutedsl_topk_equals_brute_force(kind, B, H, G, sk, kq, extra, opts):
    t = _mod()
    gen = torch.Generator(device="cuda").manual_seed(SEED)
    sums = _sums(kind, B, H, G, sk, gen)
    width = kq + extra
    big = torch.full((B, H + 2, G, width), -7, dtype=torch.int32, device="cuda")
    out = big[:, 1:H + 1]
    assert t.refusal(sums, kq, width, warps=opts.get("warps", t.WARPS)) is None
    t.top_k_rows(sums, kq, out, **opts)
    want = ref_top_k_rows(sums, kq, width)
    bad = (out != want).any(-1)
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} rows differ, first at {bad.nonzero()[0].tolist()}"
    assert (big[:, 0] == -7).all() and (big[:, H + 1] == -7).all()  # nothing outside the view
    if "bracket" in opts and opts["bracket"][2] == 1:
        from comfyui_mc_sparse_pack.kernels.cutedsl import pass2_launch

        assert int(pass2_launch.flags(sums.device, B * H * G).sum()) == B * H * G  # every row took the radix launch


def test_cutedsl_topk_refusals():
    """Not float16, Sk not a multiple of 8, unaligned rows, K out of range: refused with the reason (the dispatch then
    runs the Triton top-K); top_k_rows raises on them."""
    t = _mod()
    x = torch.rand(1, 2, 4, 1024, device="cuda").half()
    assert "float16" in t.refusal(x.float(), 10, 16)
    assert "16-byte" in t.refusal(torch.rand(1, 2, 4, 1020, device="cuda").half(), 10, 16)
    assert "16-byte" in t.refusal(x[..., 4:1020], 10, 16)
    assert "num_keys" in t.refusal(x, 0, 16) and "num_keys" in t.refusal(x, 17, 16)
    with pytest.raises(ValueError, match="cannot run"):
        t.top_k_rows(x.float(), 10, torch.empty(1, 2, 4, 16, dtype=torch.int32, device="cuda"))


def test_select_kv_with_the_cutedsl_topk_equals_triton():
    """select_kv(topk_cute=True) (the CuTeDSL top-K after the same pass 2) == select_kv with the Triton top-K, at a
    head chunk of 2 heads (views of the selection), and no failure remembered."""
    _mod()
    from comfyui_mc_sparse_pack.kernels.triton import pass2_dispatch, selection

    gen = torch.Generator(device="cuda").manual_seed(SEED)
    H, S, D, C = 3, 4096, 128, 128
    q, k = (torch.randn(1, H, S, D, generator=gen, device="cuda").bfloat16() for _ in range(2))
    lse = torch.logsumexp((q.float() @ k.float().transpose(-1, -2)) * D ** -0.5, dim=-1)
    perm = torch.stack([torch.randperm(S, generator=gen, device="cuda") for _ in range(H)])[None].int()
    pass2_dispatch.reset()
    kw = dict(group_size=C, kv_tile=128, heads_per_chunk=2, topk_fused=False)
    want = selection.select_kv(q, k, lse, perm, 1000, topk_cute=False, **kw)
    got = selection.select_kv(q, k, lse, perm, 1000, topk_cute=True, **kw)
    assert pass2_dispatch.topk_cute_fallback_reason() is None
    assert torch.equal(got, want)
