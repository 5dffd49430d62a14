"""The CuTeDSL pass-2 kernel (kernels/cutedsl/pass2_sm90.py) compiles for sm_90a without a GPU (CUTE_DSL_ARCH), for
both output dtypes and the FMA-pipe exponential share, and lands in the disk cache; skipped without the CuTeDSL
stack. The kernel's results are checked on the GPU: tests/test_gpu_cutedsl_pass2.py."""

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
    """float16 and float32 sums, qsplit 1 with poly = 8 and the LSE read through perm, the fused top-K, qsplit 2 (tile
    pairs rolled) with poly = 4 and unit_qf with poly = 8 (degree 2, the default, and 3) compile offline (~6 s each)
    and the second ``compiled`` call of the same config is served from memory."""
    code = textwrap.dedent(f"""
        import os, sys
        os.environ['CUTE_DSL_ARCH'] = 'sm_90a'
        sys.path.insert(0, {str(ROOT / 'comfyui_mc_sparse')!r})
        import _standalone
        _standalone.load_pack()
        from comfyui_mc_sparse_pack.kernels.cutedsl import pass2_sm90 as p2
        print('WARM', p2.warm())
        p2.compiled('float16', poly=8, qsplit=1, lse_smem=False)
        p2.compiled('float16', topk=True)
        p2.compiled('float16', qsplit=2, poly=4)
        p2.compiled('float16', unit_qf=True, poly=8)
        p2.compiled('float16', unit_qf=True, poly=8, poly_deg=3)
        assert p2.compiled('float16') is p2.compiled('float16')
        print('KERNELS', len(p2.compiled_kernels()))
    """)
    env = dict(os.environ, MC_SPARSE_CUTEDSL_CACHE_DIR=str(tmp_path))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert "KERNELS 7" in p.stdout, p.stdout + p.stderr[-3000:]
    assert any(tmp_path.glob("*.o")), list(tmp_path.iterdir())


@_NEEDS_CUTE
def test_register_split_fits_the_launch():
    """Every warpgroup layout's setmaxnreg split fits the registers the CTA is launched with (``regs_fit``; an increase
    beyond what the decreases released waits forever: the unit_qf form with four consumer warpgroups at 120 / 24 hung
    in round s13r1): three and four consumer warpgroups, with and without the fused top-K / pair."""
    sys.path.insert(0, str(ROOT / "comfyui_mc_sparse"))
    import _standalone

    _standalone.load_pack()
    from comfyui_mc_sparse_pack.kernels.cutedsl import pass2_sm90 as p2

    assert p2.regs_fit(3, 160, 32) and not p2.regs_fit(3, 168, 32)
    assert not p2.regs_fit(4, 120, 24) and not p2.regs_fit(4, 112, 56)
    for wg4 in (False, True):
        for kw in (dict(), dict(topk=True), dict(pair=True), dict(unit_qf=True)):
            k = p2.Pass2Sm90(p2.cutlass.Float16, 3, lse_smem=True, wg4=wg4, **kw)
            assert p2.regs_fit(k.nwg, k.mma_regs, k.producer_regs), (wg4, kw, k.mma_regs, k.producer_regs)


@_NEEDS_CUTE
def test_unit_poly_degree_switch(monkeypatch):
    """``MC_SPARSE_PASS2_POLY_DEG``: unset or blank -> ``UNIT_POLY_DEG`` (2), "3" -> 3; any other value is a ValueError
    naming the variable at the call (not at import, where the dispatch cached the failed import as "not available"
    for the whole process without saying why), and the module stays importable."""
    sys.path.insert(0, str(ROOT / "comfyui_mc_sparse"))
    import _standalone

    _standalone.load_pack()
    from comfyui_mc_sparse_pack.kernels.cutedsl import pass2_sm90 as p2

    monkeypatch.delenv("MC_SPARSE_PASS2_POLY_DEG", raising=False)
    assert p2.unit_poly_degree() == p2.UNIT_POLY_DEG == 2
    monkeypatch.setenv("MC_SPARSE_PASS2_POLY_DEG", " ")
    assert p2.unit_poly_degree() == 2
    monkeypatch.setenv("MC_SPARSE_PASS2_POLY_DEG", "3")
    assert p2.unit_poly_degree() == 3
    for bad in ("4", "x", "2.0"):
        monkeypatch.setenv("MC_SPARSE_PASS2_POLY_DEG", bad)
        with pytest.raises(ValueError, match="MC_SPARSE_PASS2_POLY_DEG"):
            p2.unit_poly_degree()
