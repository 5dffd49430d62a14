"""The CuTeDSL pass-2 kernel's launch tensors (kernels/cutedsl/pass2_launch.py) on the CPU: every launch path
(sums only; the fused top-K without and with key parts; strided views) satisfies ``ARG_SHAPES``, the symbolic
shapes the kernel is compiled with (the compiled function rejects a launch whose dims that share a name differ:
round s9r1 lost every CuTeDSL row to the flags and the part counters sharing one), and ``ARG_SHAPES`` lists
``Pass2Sm90.__call__``'s tensor parameters in order (read from the source: no CuTeDSL stack needed)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from comfyui_mc_sparse_pack.kernels.cutedsl import pass2_launch as launch

ROOT = Path(__file__).resolve().parent.parent


def _operands(B, H, S, SK, C, G, gen):
    q8 = torch.randn(B, H, S, 128, generator=gen).to(torch.float8_e4m3fn)
    k8 = torch.randn(B, H, SK, 128, generator=gen).to(torch.float8_e4m3fn)
    qf = torch.rand(B, H, generator=gen)
    lse = torch.randn(B, H, S, generator=gen)
    kb = torch.rand(B, H, SK, generator=gen)
    perm = torch.randint(-1, S, (B, H, G * C), generator=gen, dtype=torch.int32)
    return q8, k8, qf, lse, kb, perm


@pytest.mark.parametrize(("B", "H", "S", "SK", "C", "fused", "ksplit"), [
    (1, 2, 300, 256, 128, False, 1), (2, 3, 290, 200, 100, True, 1), (2, 3, 290, 200, 100, True, 2),
    (1, 12, 1000, 1000, 128, True, 5), (1, 1, 64, 64, 128, False, 3)])
def test_launch_tensors_fit_the_compiled_shapes(B, H, S, SK, C, fused, ksplit):
    """No mismatch on any path, with the sums a strided head slice of a padded buffer and the selection a head slice
    of a wider one (select_kv's chunks); the flags and counters have one entry per row when fused."""
    gen = torch.Generator().manual_seed(B * 1000 + S + ksplit)
    G = -(-S // C)
    ops = _operands(B, H, S, SK, C, G, gen)
    out = torch.empty(B, H + 1, G, SK + 8, dtype=torch.float16)[:, 1:, :, :SK]
    sel = torch.empty(B, H + 2, G, 128, dtype=torch.int32)[:, 2:] if fused else None
    t = launch.launch_tensors(*ops, out, group_size=C, sel=sel, ksplit=ksplit)
    assert launch.shape_mismatches(t) == []
    if fused:
        assert t[9].shape == (B * H * G,) and t[9].dtype == torch.int8
        if ksplit > 1:
            assert t[10].shape == (B * H * G,) and int(t[10].abs().sum()) == 0  # zeroed per call


def test_shape_mismatches_names_each_break():
    """The check itself: a wrong rank, a wrong fixed extent and two extents of one name are each reported."""
    gen = torch.Generator().manual_seed(1)
    ops = _operands(1, 2, 256, 256, 128, 2, gen)
    t = list(launch.launch_tensors(*ops, torch.empty(1, 2, 2, 256, dtype=torch.float16), group_size=128,
                                   sel=torch.empty(1, 2, 2, 128, dtype=torch.int32), ksplit=2))
    assert launch.shape_mismatches(t) == []
    bad = list(t)
    bad[10] = torch.zeros(3, dtype=torch.int32)  # counters: fine alone (own name)
    assert launch.shape_mismatches(bad) == []
    bad[5] = torch.zeros(3)  # qf: bh = 3 != 2
    assert any("mQF" in m for m in launch.shape_mismatches(bad))
    bad = list(t)
    bad[7] = torch.zeros(5)
    assert any("mInf" in m for m in launch.shape_mismatches(bad))
    bad = list(t)
    bad[8] = torch.zeros(2, 2, 128, dtype=torch.int32)
    assert any("rank" in m for m in launch.shape_mismatches(bad))


def test_arg_shapes_follow_the_kernel_signature():
    """``ARG_SHAPES`` names ``Pass2Sm90.__call__``'s tensor parameters in order (compile_fake passes them
    positionally)."""
    tree = ast.parse((ROOT / "kernels" / "cutedsl" / "pass2_sm90.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Pass2Sm90")
    call = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__call__")
    tensors = [a.arg for a in call.args.args[1:]
               if a.annotation is not None and ast.unparse(a.annotation) == "cute.Tensor"]
    assert tensors == [name for name, *_ in launch.ARG_SHAPES]
