"""The CuTeDSL top-K launch (kernels/cutedsl/topk_sm90.py) compiles for sm_90a without a GPU (CUTE_DSL_ARCH) for one,
two and four rows per CTA, 4 / 8 loads per lane in flight, the next batch's loads issued early or not, lands in the disk cache and is served from memory the second time; its refusals that need
no GPU. Skipped without the CuTeDSL stack. Its results are checked on the GPU: tests/test_gpu_cutedsl_topk.py."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_NEEDS_CUTE = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("cutlass", "flash_attn", "quack")),
    reason="the CuTeDSL stack (nvidia-cutlass-dsl, flash-attn-4, quack) is not installed")


@_NEEDS_CUTE
def test_offline_sm90a_compile(tmp_path):
    code = textwrap.dedent(f"""
        import os, sys
        os.environ['CUTE_DSL_ARCH'] = 'sm_90a'
        sys.path.insert(0, {str(ROOT / 'comfyui_mc_sparse')!r})
        import _standalone
        _standalone.load_pack()
        from comfyui_mc_sparse_pack.kernels.cutedsl import topk_sm90 as t
        for warps, slots, batch, ahead in ((1, 1024, 4, False), (2, 8192, 8, True), (4, 16384, 4, True)):
            t.compiled(warps, slots, batch, ahead)
        assert t.compiled(2, 8192) is t.compiled(2, 8192)
        print('SLOTS', t.cand_slots(32760, 3276), t.cand_slots(75600, 37800), t.cand_slots(2000, 10))
    """)
    env = dict(os.environ, MC_SPARSE_CUTEDSL_CACHE_DIR=str(tmp_path))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert "SLOTS 8192 16384 1024" in p.stdout, p.stdout + p.stderr[-3000:]
    assert len(list(tmp_path.glob("*.o"))) >= 3, list(tmp_path.iterdir())


@_NEEDS_CUTE
def test_refuses_off_cuda_and_with_a_clear_error():
    """A CPU tensor is refused with the reason, and top_k_rows raises ValueError naming it (the dispatch never calls
    it then: pass2_dispatch.topk_cute_refusal asks first)."""
    import torch
    from comfyui_mc_sparse_pack.kernels.cutedsl import topk_sm90 as t

    x = torch.rand(1, 2, 4, 1024).half()
    assert "CUDA" in t.refusal(x, 10, 16)
    with pytest.raises(ValueError, match="CUDA"):
        t.top_k_rows(x, 10, torch.empty(1, 2, 4, 16, dtype=torch.int32))
