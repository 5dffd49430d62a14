"""The CuTeDSL backend on the CPU (issue 16): its capability rules, its registration with and without the optional
libraries, the per-call refusals that make the registry fall back, and (when nvidia-cutlass-dsl and flash-attn-4 are
installed) an offline sm_90 compile of the kernel. The kernel itself is checked on the GPU: tests/test_gpu_cutedsl.py."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from comfyui_mc_sparse_pack import kernels
from comfyui_mc_sparse_pack.kernels import registry
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
    (dict(H=40, S=128 * 1700), "at most 65535 groups"),
])
def test_call_refusals(kwargs, why):
    """Calls the kernel cannot take raise RuntimeError in the op (the registry then falls back, once per run, with
    this reason in the summary); shapes and strides only, no device sync."""
    got = rules.call_refusal(*_call(**kwargs))
    assert (got is None) if why is None else (why in got), got


@pytest.mark.skipif(importlib.util.find_spec("cutlass") is None or importlib.util.find_spec("flash_attn") is None,
                    reason="nvidia-cutlass-dsl and flash-attn-4 not installed (optional; CI has neither)")
def test_offline_sm90_compile():
    """The kernel compiles for sm_90a from fake tensors without a GPU (CUTE_DSL_ARCH): catches DSL errors on CPU."""
    code = textwrap.dedent(f"""
        import os, sys
        os.environ['CUTE_DSL_ARCH'] = 'sm_90a'
        sys.path.insert(0, {str(ROOT / 'comfyui_mc_sparse')!r})
        import _standalone
        _standalone.load_pack()
        from comfyui_mc_sparse_pack.kernels.cutedsl import compile as cc
        cc.compile_fake('bfloat16', 128, True)
        print('COMPILED')
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ))
    assert "COMPILED" in p.stdout, p.stderr[-3000:]
