"""Each GPU backend's ``refuse`` rule (device, capability, dtype, head dim, requested by name) against the capability
matrix of docs/kernels.md, on stand-in CUDA tensors (a rule reads only device, dtype and shape; the capability comes
from a patched ``torch.cuda.get_device_capability``), so the CPU suite checks what only a GPU would otherwise see.
The cutedsl and flash_attn4 rules are pinned in tests/test_cutedsl_backend.py and tests/test_fa4_route.py."""

from __future__ import annotations

import types

import pytest
import torch
from comfyui_mc_sparse_pack.kernels import cuda_sdpa, torch_gpu
from comfyui_mc_sparse_pack.kernels import triton as triton_backend


def _q(device: str, dtype=torch.bfloat16, d: int = 128):
    return types.SimpleNamespace(device=torch.device(device, 0) if device == "cuda" else torch.device(device),
                                 dtype=dtype, shape=(1, 2, 256, d))


@pytest.fixture
def capability(monkeypatch):
    """Set the capability every rule reads for a CUDA q."""
    def set_to(cap):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    return set_to


@pytest.mark.parametrize(("cap", "dtype", "d", "why"), [
    ((9, 0), torch.bfloat16, 128, None),
    ((8, 0), torch.float16, 40, None),  # a multiple of 8, not a power of two
    ((7, 5), torch.bfloat16, 128, "compute capability >= 8.0"),
    ((9, 0), torch.float32, 128, "float16/bfloat16 only"),
    ((9, 0), torch.bfloat16, 100, "multiple of 8 and at most 256"),
    ((9, 0), torch.bfloat16, 264, "multiple of 8 and at most 256"),
])
def test_cuda_sdpa_rule(capability, cap, dtype, d, why):
    """Dense on CUDA sm80+, fp16/bf16, head dim a multiple of 8 up to 256; never a CPU tensor. Mutations: the
    multiple-of-8 or capability bound moved."""
    capability(cap)
    got = cuda_sdpa.refuse("dense_attention", _q("cuda", dtype, d), False)
    assert (got is None) if why is None else (why in (got or "")), got
    assert "CUDA devices" in cuda_sdpa.refuse("dense_attention", _q("cpu"), True)


@pytest.mark.parametrize(("device", "cap", "dtype", "d", "requested", "why"), [
    ("cuda", (9, 0), torch.bfloat16, 128, False, None),
    ("cuda", (8, 6), torch.float16, 16, False, None),
    ("cuda", (8, 0), torch.bfloat16, 256, False, None),
    ("cuda", (7, 5), torch.bfloat16, 128, False, "compute capability >= 8.0"),
    ("cuda", (9, 0), torch.float32, 128, False, "float16/bfloat16 only"),
    ("cuda", (9, 0), torch.bfloat16, 96, False, "power of two in [16, 256]"),
    ("cuda", (9, 0), torch.bfloat16, 8, False, "power of two in [16, 256]"),
    ("cuda", (9, 0), torch.bfloat16, 512, False, "power of two in [16, 256]"),
    ("cpu", None, torch.bfloat16, 128, False, "only when backend='triton' is requested"),
    ("meta", None, torch.bfloat16, 128, True, "runs on CUDA devices"),
])
def test_triton_rule(monkeypatch, capability, device, cap, dtype, d, requested, why):
    """Triton: CUDA sm80+ (compiled, not the interpreter), fp16/bf16, head dim a power of two in [16, 256]; CPU
    tensors only when asked for by name (the interpreter). Mutations: the power-of-two or capability check
    dropped or moved."""
    monkeypatch.setattr(triton_backend, "_INTERPRETER", False)
    capability(cap)
    got = triton_backend.refuse("sparse_attention", _q(device, dtype, d), requested)
    assert (got is None) if why is None else (why in (got or "")), got


def test_triton_rule_under_the_interpreter(monkeypatch, capability):
    """With TRITON_INTERPRET=1 (the CPU tests) a CUDA tensor is refused (the interpreter runs CPU tensors only) and a
    CPU tensor runs when Triton is asked for by name; decode_bitmask (q is the uint8 bitmask) has only the device
    rules. Mutations: the interpreter's CUDA refusal dropped; the dtype rule applied to the bitmask."""
    capability((9, 0))
    monkeypatch.setattr(triton_backend, "_INTERPRETER", True)
    assert "interpreter runs CPU tensors only" in triton_backend.refuse("select_kv", _q("cuda"), False)
    assert triton_backend.refuse("select_kv", _q("cpu"), True) is None
    monkeypatch.setattr(triton_backend, "_INTERPRETER", False)
    assert "need Triton's interpreter" in triton_backend.refuse("select_kv", _q("cpu"), True)
    bits = types.SimpleNamespace(device=torch.device("cuda", 0), dtype=torch.uint8, shape=(1, 2, 3, 32))
    assert triton_backend.refuse("decode_bitmask", bits, False) is None


@pytest.mark.parametrize(("device", "cap", "requested", "why"), [
    ("cuda", (8, 0), False, None),
    ("cuda", (7, 0), False, "compute capability >= 8.0"),
    ("cpu", None, False, "only when backend='torch_gpu' is requested"),
    ("cpu", None, True, None),
    ("meta", None, True, "runs on CUDA devices"),
])
def test_torch_gpu_rule(capability, device, cap, requested, why):
    """The Triton-free GPU grouping: CUDA sm80+; a CPU tensor only when asked for by name. Mutation: CPU tensors
    accepted under "auto" (the torch-ops grouping would then run ahead of the reference in CPU runs)."""
    capability(cap)
    got = torch_gpu.refuse("pddp_groups", _q(device), requested)
    assert (got is None) if why is None else (why in (got or "")), got
