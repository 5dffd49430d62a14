"""The metadata cache's CUDA-only placement paths (``comfyui_mc_sparse/cache.py``: ``MetadataCache.put`` replacing
an entry, ``_to_host``), on real CUDA tensors and page-locked host memory (marked ``gpu``; any CUDA GPU).

The CPU suite reaches ``put`` only with CPU entries (kept as given) and ``_choose`` with a fake entry; these paths
need a CUDA entry: the replaced entry's GPU bytes counted as free for its replacement (an anchor refreshing a
block must not spill to CPU memory because the cache itself holds the old entry), only when the old entry was on
the GPU; a same-size replacement in CPU memory rewriting the old page-locked buffer (no new pinning, pinned bytes
unchanged); the old buffer unlocked when the replacement is placed on the GPU or needs another size. Free memory
comes from a ``free_memory_fn`` returning a set figure: what the device reports at that moment, the old entry
still resident (as ``torch.cuda.mem_get_info`` would). Values are checked after every replacement in CPU memory:
the entry decoded from it equals the one put, bit for bit.
Run: python3 -m pytest -q tests/test_gpu_cache_placement.py (seconds on an H200).
"""

from __future__ import annotations

import pytest
import torch
from comfyui_mc_sparse_pack.comfyui_mc_sparse import cache as cache_module
from comfyui_mc_sparse_pack.comfyui_mc_sparse.cache import CacheEntry, CacheKey, MetadataCache, encode_entry

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

KEY = CacheKey(3, "c", None, (1, 2, 256, 64))


def _stored(seed: int, tokens: int = 256, group: int = 64, keys: int = 64):
    """An entry as an anchor leaves it (random query groups, K sorted selected tokens per group, a bf16 residual
    [1, 2, tokens, 64]), encoded on the GPU with int32 selections (no Triton kernel: torch ops only)."""
    gen = torch.Generator().manual_seed(seed)
    B, H, G = 1, 2, tokens // group
    perm = torch.stack([torch.randperm(tokens, generator=gen) for _ in range(B * H)]).view(B, H, tokens)
    scores = torch.rand(B, H, G, tokens, generator=gen)
    kv_idx = torch.sort(torch.topk(scores, keys, dim=-1).indices, dim=-1).values
    residual = torch.randn(B, H, tokens, 64, generator=gen).to(torch.bfloat16)
    entry = CacheEntry(perm.int().cuda(), kv_idx.int().cuda(), residual.cuda(), keys, (B, H, tokens, 64))
    return encode_entry(entry, index_encoding="int32")


def _same(cache: MetadataCache, stored) -> bool:
    """The cached entry decodes to what ``stored`` decodes to, bit for bit."""
    dev = torch.device("cuda", torch.cuda.current_device())
    got, want = cache.peek(KEY, dev), stored.decode(dev)
    torch.cuda.synchronize()
    r_got, r_want = (e.residual.tensors() for e in (got, want))
    return (torch.equal(got.perm, want.perm) and torch.equal(got.kv_idx, want.kv_idx)
            and all(torch.equal(a, b) for a, b in zip(r_got, r_want)))


def _cache(placement: str, free: list, **kw) -> MetadataCache:
    """A cache whose device reports ``free[0]`` free bytes."""
    return MetadataCache(placement, free_memory_fn=lambda dev: free[0], **kw)


@pytest.mark.parametrize("placement", ["gpu", "auto"])
def test_a_replacement_counts_the_old_entrys_gpu_bytes_as_free(placement):
    """With the old entry resident, the device has the margin / headroom free and not the new entry's bytes: the
    second anchor's entry for the same key replaces the first on the GPU (the old bytes are freed by the
    replacement), nothing moves to CPU memory (mutation: the old entry's bytes not credited -> moved)."""
    a, b = _stored(1), _stored(2)
    assert a.nbytes == b.nbytes
    headroom = 1 << 20
    slack = cache_module._GPU_MARGIN if placement == "gpu" else headroom
    free = [1 << 40]
    cache = _cache(placement, free, headroom_bytes=headroom)
    cache.put(KEY, a)
    free[0] = slack
    cache.put(KEY, b)
    assert cache.moved == 0 and not cache.notes, cache.notes
    assert cache.gpu_bytes == cache.nbytes == b.nbytes and cache.host_bytes == 0
    assert cache.get(KEY).device.type == "cuda" and _same(cache, b)


def test_an_old_entry_in_cpu_memory_frees_no_gpu_memory():
    """The old entry lived in CPU memory (the plan chose it; then the GPU): its bytes are not GPU memory, so a
    replacement that does not fit the GPU's free bytes alone spills to CPU memory, noted (mutation: every old
    entry's bytes credited as free GPU memory -> placed on the GPU past the headroom)."""
    a, b = _stored(3), _stored(4)
    headroom = 1 << 20
    free = [b.nbytes + headroom - 1]
    cache = _cache("auto", free, headroom_bytes=headroom)
    cache.fix_placement("cpu")
    cache.put(KEY, a)
    assert cache.get(KEY).device.type == "cpu" and cache.gpu_bytes == 0
    cache.fix_placement("gpu")
    cache.put(KEY, b)
    assert cache.moved == 1 and any("GPU memory short" in n for n in cache.notes), cache.notes
    assert cache.get(KEY).device.type == "cpu" and cache.host_bytes == cache.nbytes == b.nbytes
    assert _same(cache, b)
    cache.clear()


def test_a_same_size_replacement_in_cpu_memory_rewrites_the_old_pinned_buffer():
    """placement cpu: a replacement of the same size reuses the old host buffer (no second page-locking; pinned
    bytes stay one buffer's) and holds the new values; a replacement of another size gets a new buffer and the old
    one is unlocked (mutation: the reuse or the release dropped)."""
    a, b = _stored(5), _stored(6)
    cache = MetadataCache("cpu")
    cache.put(KEY, a)
    buf = cache.get(KEY).host
    assert buf is not None and buf.registered, "cudaHostRegister failed on this machine"
    one = buf.nbytes
    assert cache.pinned_bytes == one and _same(cache, a)
    cache.put(KEY, b)
    assert cache.get(KEY).host is buf and cache.pinned_bytes == one and buf.pinned
    assert _same(cache, b) and cache.host_bytes == cache.nbytes == b.nbytes
    c = _stored(7, tokens=384)
    cache.put(KEY, c)
    new = cache.get(KEY).host
    assert new is not buf and not buf.pinned and not buf.registered
    assert cache.pinned_bytes == new.nbytes and _same(cache, c)
    cache.clear()
    assert cache.pinned_bytes == 0 and not new.registered


def test_the_old_host_buffer_is_unlocked_when_the_replacement_goes_to_the_gpu():
    """placement auto, CPU memory first, then the GPU: the replaced entry's page-locked buffer is unlocked and its
    bytes leave the pinned count (mutation: the release skipped -> pinned memory leaks for the rest of the run)."""
    a, b = _stored(8), _stored(9)
    cache = _cache("auto", [1 << 40])
    cache.fix_placement("cpu")
    cache.put(KEY, a)
    buf = cache.get(KEY).host
    assert buf is not None and buf.registered and cache.pinned_bytes == buf.nbytes
    cache.fix_placement("gpu")
    cache.put(KEY, b)
    assert cache.get(KEY).device.type == "cuda" and cache.get(KEY).host is None
    assert cache.pinned_bytes == 0 and not buf.pinned and not buf.registered
    assert cache.gpu_bytes == cache.nbytes == b.nbytes and cache.host_bytes == 0 and _same(cache, b)
