"""The reuse step's call path: no host-device sync per attention call, the step resolved once per model evaluation
(issue 14 item 4, issue 9 defect 5).

A fake sampler run drives the adapter the way ComfyUI does (``comfy/samplers.py`` L209-323): the CALC_COND_BATCH
wrapper gets ``(model, conds, x_in, timestep, model_options)`` and the model evaluation below it calls the installed
override once per block with a per-call copy of transformer_options (``cond_or_uncond``, ``uuids``, ``sigmas``, the
self-attention mark). During the reuse evaluations every host read of a tensor raises, so a per-call ``.item()``
(or ``.tolist()``, ``bool()``, ``float()``, ``torch.cuda.synchronize``, ``nonzero``) on the reuse path fails the test
even on CPU tensors.
"""

import contextlib

import pytest
import torch
from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter import lifecycle, override, settings
from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter.callsite import MARK_KEY, CallSite
from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter.steps import STEP_KEY

from ._comfy_standins import raw_attention

SEED = 1234


class HostReadError(AssertionError):
    """A host-device sync (a host read of a tensor) happened where none may."""


@contextlib.contextmanager
def no_host_reads():
    """Make every host read of a tensor value raise (the calls that sync with the GPU on CUDA tensors)."""

    def forbid(name):
        def raiser(*args, **kwargs):
            raise HostReadError(f"{name} called on the reuse path (a host-device sync per call on a GPU)")

        return raiser

    patches = [(torch.Tensor, name) for name in ("item", "tolist", "__bool__", "__float__", "__int__", "nonzero")]
    patches += [(torch, "nonzero"), (torch.cuda, "synchronize")]
    saved = [(obj, name, getattr(obj, name)) for obj, name in patches]
    try:
        for obj, name in patches:
            setattr(obj, name, forbid(f"{getattr(obj, '__name__', obj)}.{name}"))
        yield
    finally:
        for obj, name, fn in saved:
            setattr(obj, name, fn)


def _settings(**over):
    base = dict(preset="custom", density=0.5, dense_warmup="1", warmup_layers=0, anchor_steps="1", query_tile=64,
                cache_placement="auto", backend="auto", min_tokens=0, verbose=False)
    return settings.build_settings(**{**base, **over})


def _fake_sampler_run(run, *, layers, steps, batch_orders, qkv, heads, guard_from_step):
    """Evaluate the model ``steps`` times through the CALC_COND_BATCH wrapper. ``batch_orders``: the forwards of one
    evaluation as lists of cond_or_uncond indices (``[[1, 0]]`` batched CFG, ``[[1], [0]]`` split). Host reads raise
    inside evaluations of step >= ``guard_from_step``. Returns the outputs of the last evaluation, per forward."""
    model_options = {"transformer_options": {override.RUN_KEY: run}}
    override.install_override(model_options["transformer_options"])
    seen_steps = []
    outs = []

    def evaluate(model, conds, x_in, timestep, model_options):
        topts = model_options["transformer_options"]
        seen_steps.append(topts.get(STEP_KEY))
        guard = no_host_reads() if topts.get(STEP_KEY, -1) >= guard_from_step else contextlib.nullcontext()
        result = []
        with guard:
            for order in batch_orders:
                q, k, v = (torch.cat([t[i] for i in order]) for t in qkv)
                for layer in range(layers):
                    call_options = dict(topts, cond_or_uncond=list(order), uuids=[f"uuid{i}" for i in order],
                                        sigmas=timestep)
                    call_options[MARK_KEY] = CallSite(layer, "wan")
                    fn = call_options["optimized_attention_override"]
                    out = fn(raw_attention, q, k, v, heads=heads, transformer_options=call_options)
                result.append(out)
        return result

    for step in range(steps):
        timestep = run.sample_sigmas[step] * torch.ones(1)
        outs = lifecycle.calc_cond_batch_wrapper(evaluate, None, [], None, timestep, model_options)
    return outs, seen_steps


@pytest.mark.parametrize("batch_orders", [[[1, 0]], [[1], [0]]], ids=["cfg-batched", "cfg-split"])
def test_reuse_calls_do_no_host_reads(batch_orders):
    """Reuse evaluations run every attention call without one host read of a tensor (batched and split CFG);
    the step each evaluation sees comes from the CALC_COND_BATCH wrapper, and the reuse output is finite."""
    print(f"seed {SEED}")
    g = torch.Generator().manual_seed(SEED)
    heads, seq, dim = 2, 192, 64
    qkv = [[torch.randn(1, seq, heads * dim, generator=g) for _ in range(2)] for _ in range(3)]  # [tensor][cond]
    run = lifecycle.RunState(_settings(), torch.tensor([1.0, 0.8, 0.6, 0.4, 0.0]))
    outs, seen = _fake_sampler_run(run, layers=3, steps=4, batch_orders=batch_orders, qkv=qkv, heads=heads,
                                   guard_from_step=1)
    assert seen == [0, 1, 2, 3]
    counts = run.counts()
    assert counts["sparse"] == 3 * 3 * 2 and counts["anchor"] == 3 * 2  # anchor at step 0 (the warm-up step), reuse 1-3
    assert all(bool(torch.isfinite(o).all()) for o in outs)


def test_host_read_guard_catches_a_per_call_item():
    """The guard is live: a dispatch that reads the sigma per call (the defect) raises under it."""
    run = lifecycle.RunState(_settings(), torch.tensor([1.0, 0.8, 0.6, 0.0]))
    opts = {override.RUN_KEY: run, "sigmas": torch.tensor([0.8])}
    with no_host_reads(), pytest.raises(HostReadError):
        run.step_of(opts)  # no STEP_KEY: falls back to reading the sigma
