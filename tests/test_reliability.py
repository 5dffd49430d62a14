"""Reliability fixes of issue 9, each with the test that failed before its fix (the defect number is in each
docstring). Inputs are fresh random tensors from fixed, printed seeds (``gen`` in conftest)."""

from __future__ import annotations

import torch
from comfyui_mc_sparse_pack.kernels.torch_gpu import pddp


def test_gpu_grouping_plans_are_bounded(gen):
    """Defect 10: the GPU grouping op's per-shape tree tables are a bounded memo, not a per-process dict that grows
    with every resolution a ComfyUI session meets."""
    pddp._PLANS.clear()
    for S in range(100, 100 + 8 * 37, 37):  # 8 shapes
        perm = pddp.pddp_groups(torch.randn(1, 1, S, 16, generator=gen), 16)
        assert torch.equal(torch.sort(perm[0, 0, :S]).values, torch.arange(S, dtype=torch.int32))
    assert 0 < len(pddp._PLANS) <= pddp.MAX_PLANS
