"""The denoising step of the current model evaluation, from its sigma and this sampler call's schedule.

ComfyUI gives the model the current sigma (``transformer_options["sigmas"]``, shape ``[latent batch]``, set
at ``comfy/samplers.py`` L321-323) and the schedule of *this* sampler call (``sample_sigmas``, set at
``comfy/samplers.py`` L979, ``steps + 1`` descending values; the same tensor the OUTER_SAMPLE wrapper gets).
The step is the schedule interval that holds the sigma:

* first-order samplers (euler, uni_pc, ...) evaluate exactly at ``sample_sigmas[i]`` -> step i;
* heun and other second-order samplers evaluate step i's corrector at ``sample_sigmas[i+1]`` -> counted as
  step i+1 (the same sigma as step i+1's first evaluation; both see the same attention regime);
* ancestral / SDE / dpmpp_2s samplers evaluate between entries, ``ss[i] > sigma > ss[i+1]`` -> step i;
* split samplers (KSamplerAdvanced, SplitSigmas) and denoise < 1 hand each call its own slice, so steps are
  local to the call; steps skipped by caching nodes simply never arrive.

Matching uses a relative tolerance of 1e-4, as core ``comfy/context_windows.py`` L166-171 does.

Reading a sigma that lives on the GPU is a host-device sync, so it happens once per model evaluation: the
CALC_COND_BATCH wrapper (``lifecycle.calc_cond_batch_wrapper``, args ``(model, conds, x_in, timestep,
model_options)``, ``comfy/samplers.py`` L209-213; ``timestep`` is the tensor ``_calc_cond_batch`` puts under
``transformer_options["sigmas"]``, L323) resolves the step and hands it to every attention call of that evaluation
under ``STEP_KEY``. Attention calls never read a device tensor for it.
"""

from __future__ import annotations

import torch

RTOL = 1e-4

STEP_KEY = "mc_sparse_step"
"""transformer_options key of the 0-based step of the model evaluation in progress (set by the CALC_COND_BATCH
wrapper on a copy of the options it passes down; absent outside an MC-Sparse run)."""


def step_index(sigma: float, sample_sigmas: torch.Tensor | list[float]) -> int:
    """0-based step of ``sigma`` within ``sample_sigmas`` (descending, length steps + 1), clamped to
    ``[0, steps - 1]``.

    Args:
        sigma: the current sigma (a float; for a latent batch pass its largest value).
        sample_sigmas: the sampler call's schedule, 1-D, descending.
    Raises:
        ValueError: ``sample_sigmas`` has fewer than 2 entries, or ``sigma`` is NaN.
    """
    values = [float(s) for s in (sample_sigmas.tolist() if isinstance(sample_sigmas, torch.Tensor) else sample_sigmas)]
    if len(values) < 2:
        raise ValueError(f"sample_sigmas must hold at least 2 values (1 step), got {len(values)}")
    if sigma != sigma:
        raise ValueError("sigma must be a number, got NaN")
    # Count schedule entries (excluding the final one: at most steps of them) at or above sigma, within tolerance.
    at_or_above = sum(1 for s in values[:-1] if s >= sigma * (1.0 - RTOL) - 1e-12)
    return max(at_or_above - 1, 0)


def current_sigma(transformer_options: dict) -> float | None:
    """The largest current sigma in ``transformer_options["sigmas"]``, or None when absent (a host read of a
    device tensor: call it once per model evaluation, never per attention call)."""
    sigmas = transformer_options.get("sigmas")
    if sigmas is None:
        return None
    if isinstance(sigmas, torch.Tensor):
        return float(sigmas.detach().float().max().item()) if sigmas.numel() else None
    return float(max(sigmas))
