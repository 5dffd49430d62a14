"""Per-run state, the wrappers and callbacks that manage it, and ``apply_mc_sparse``.

Lifecycle (pattern of core EasyCache, ``comfy_extras/nodes_easycache.py`` L144-172 / L353-355):

* ``apply_mc_sparse`` clones the model, puts an ``MCSparsePatch`` holder (frozen settings; deep-copies to a
  fresh holder) under ``transformer_options["mc_sparse"]``, installs the override, object-patches the
  self-attention call sites (``layouts``), and registers under key "mc_sparse":
  an OUTER_SAMPLE wrapper, a CALC_COND_BATCH wrapper, ON_PREPARE_STATE and ON_CLEANUP callbacks, and (for
  Hunyuan3D 2.1 only) an APPLY_MODEL wrapper.
* OUTER_SAMPLE (once per sampler call; ``comfy/samplers.py`` L1032-1035, args ``(noise, latent, sampler,
  sigmas, ...)``) clones the guider's model_options, creates a fresh ``RunState`` (an ``MCSparseRunner``
  for this call's schedule) under ``transformer_options["mc_sparse_run"]``, and in ``finally`` logs the run
  summary, frees the caches and restores the options. Interrupts and errors go through the ``finally`` too;
  their summary then starts "run interrupted after step N (ExceptionType)" and gives the counts so far.
* CALC_COND_BATCH (per step, gets the model_options actually used) and ON_PREPARE_STATE re-assert our
  override on top, chaining whatever another node put there; a displacement is logged once and reported.
* ON_CLEANUP (``comfy/model_patcher.py`` L906-911, end of ``outer_sample``) frees the caches of active runs.

Nothing here imports ComfyUI at module level; ``apply_mc_sparse`` imports ``comfy`` when called.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter

import torch

from .layouts import install_plan, plan_for
from .override import CURRENT_OPTIONS, RUN_KEY, install_override
from .settings import RESIDUAL_PRECISIONS, PatchSettings, build_settings, resolve_schedule
from .steps import STEP_KEY, current_sigma, step_index

logger = logging.getLogger(__name__)

HOLDER_KEY = "mc_sparse"
WRAPPER_KEY = "mc_sparse"


class MCSparsePatch:
    """The node's holder in ``transformer_options["mc_sparse"]``: settings plus the runs now in progress.

    ``ModelPatcher.clone`` deep-copies model_options (``comfy/model_patcher.py`` L293), so deep-copying
    gives a fresh holder with the same settings and no runs (cheap, never copies caches).
    """

    def __init__(self, settings: PatchSettings, family: str | None = None, unsupported: str | None = None):
        self.settings = settings
        self.family = family
        self.unsupported = unsupported
        self.active_runs: list[RunState] = []

    def __deepcopy__(self, memo):
        return MCSparsePatch(self.settings, self.family, self.unsupported)

    def release(self) -> None:
        """Free the caches of every active run (ON_CLEANUP)."""
        for run in list(self.active_runs):
            run.close()


class RunState:
    """Everything MC-Sparse knows during one sampler call.

    Args:
        settings: the node's settings.
        sample_sigmas: this call's schedule (1-D, ``steps + 1`` values, descending).
        family: the model family from ``layouts.plan_for`` (None = unsupported, all dense).
        unsupported: why the model is unsupported, if it is.
        runner_factory: ``(config, backend) -> runner``; default ``engine.MCSparseRunner`` (tests inject).

    ``runner`` is None when the call has no anchor step (``dense_run_reason`` says why); every call is then
    dense. Deep copies return the same object: the state is shared by reference within a run.
    """

    def __init__(self, settings: PatchSettings, sample_sigmas, *, family: str | None = None,
                 unsupported: str | None = None, runner_factory=None):
        self.settings = settings
        self.sample_sigmas = [float(s) for s in (sample_sigmas.tolist() if isinstance(sample_sigmas, torch.Tensor) else sample_sigmas)]
        self.num_steps = max(1, len(self.sample_sigmas) - 1)
        self.family = family
        if family == "minimax_h3":  # presets follow the published H3 configuration (adapter/minimax.py)
            from .minimax import preset_for_run

            settings, self.schedule = preset_for_run(settings, self.num_steps)
            self.settings = settings
        else:
            self.schedule = resolve_schedule(settings, self.num_steps)
        self.notes: list[str] = list(self.schedule.notes)
        self.dense_reasons: Counter = Counter()  # used when there is no runner
        self.displaced: list[str] = []
        self.cache_keys: set = set()  # every CacheKey used in this run (summary: entries per window / kind)
        self.mask_memo = None  # (mask tensor, (S, latent start, stop), answer) of the latest joint call (override)
        self.closed = False
        self.last_step: int | None = None  # highest 0-based step a model evaluation reached so far
        self._sigma_step: tuple | None = None  # (sigmas tensor, its step): fallback without CALC_COND_BATCH
        self.interrupted_by: str | None = None  # exception type name when the sampler call did not finish
        self.config = None
        self.runner = None
        self.dense_run_reason = unsupported or "no anchor step in this sampler call"
        if unsupported is None and settings.density >= 1.0:
            self.dense_run_reason = "density 1 keeps every token: MC-Sparse is off (the model's own attention runs)"
        elif unsupported is None and self.schedule.anchor_steps and self.schedule.warmup_steps < self.num_steps:
            from ..config import MCSparseConfig

            self.config = MCSparseConfig(
                density=settings.density,
                group_size=settings.group_size,
                warmup_steps=self.schedule.warmup_steps,
                warmup_layers=settings.warmup_layers,
                anchor_steps=self.schedule.anchor_steps,
                cache_placement=settings.cache_placement,
                residual_dtype=RESIDUAL_PRECISIONS[settings.residual_precision],
                cache_headroom_gib=settings.memory_headroom_gib,
            )
            if family in ("hunyuan_video", "hunyuan3d"):
                self.notes.append("joint text keys: attended exactly beside the sparse latent keys (extra_kv)")
            elif family == "minimax_h3":
                self.notes.append("MiniMax-H3: only the target video rows are sparse; text, condition, reference "
                                  "and audio rows are exact, and their keys are attended exactly (extra_kv)")
            if runner_factory is None:
                runner_factory = _default_runner
            self.runner = runner_factory(self.config, self._backend_name(settings.backend))
        elif unsupported is None and self.schedule.warmup_steps >= self.num_steps:
            self.dense_run_reason = f"dense warm-up covers all {self.num_steps} steps"

    def __deepcopy__(self, memo):
        return self

    @property
    def dense_ms(self) -> dict[tuple, list[float]]:
        """Measured dense warm-up call times (ms per batch item) per chunk shape ``(H, S, D)`` (the runner's timer)."""
        return self.runner.timer.times("dense") if self.runner is not None else {}

    @property
    def reuse_ms(self) -> dict[tuple, list[float]]:
        """Measured reuse call times (ms per batch item) per call shape ``(H, S, D)`` (the runner's timer)."""
        return self.runner.timer.times("reuse") if self.runner is not None else {}

    def go_dense(self, reason: str) -> None:
        """Decide, before the first step, that this whole sampler call runs dense (``reason`` says why, once)."""
        if self.runner is not None:
            self.runner.close()
        self.runner = None
        self.dense_run_reason = reason

    def backend_line(self) -> str | None:
        """"backend: requested X; ran op=name (reason), ..." for the kernel ops this run called (the runner's
        ``kernels.registry.Record``); None under "auto" (the runner's "kernels:" line says what ran)."""
        if self.runner is None or self.settings.backend == "auto":
            return None
        used = self.runner.kernels.choices
        if not used:
            return f"backend: requested {self.settings.backend}; no kernel op ran in this sampler call"
        by_backend: dict[str, list[str]] = {}
        why: list[str] = []  # the registry's reasons for the ops another backend ran, deduplicated across ops
        for op, c in sorted(used.items()):
            by_backend.setdefault(c.backend, []).append(op)
            if c.backend == self.settings.backend:
                continue
            for clause in c.reason.split("; ")[1:]:  # why the requested backend did not run it
                if clause.startswith(self.settings.backend) and clause not in why and ": does not implement " not in clause:
                    why.append(clause)
        ran = ", ".join(f"{name} ({', '.join(ops)})" for name, ops in by_backend.items())
        return f"backend: requested {self.settings.backend}; ran {ran}" + (f"; why: {'; '.join(why)}" if why else "")

    def _backend_name(self, requested: str) -> str:
        if requested == "auto":
            return "auto"
        from ... import kernels

        names = kernels.registry.backend_names()
        if requested not in names:
            self.notes.append(f"backend '{requested}' is not registered here (have: {', '.join(names)}); using auto")
            return "auto"
        backend = next(b for b in kernels.registry.backends() if b.name == requested)
        if backend.unavailable_reason:
            self.notes.append(f"backend '{requested}' is unavailable here ({backend.unavailable_reason}); "
                              "each op falls back to the best available backend")
        return requested

    # -- called from the override ---------------------------------------------------------------------------
    def step_for(self, sigma: float) -> int:
        """0-based step of ``sigma`` in this call's schedule (``steps.step_index``); noted as reached."""
        step = step_index(sigma, self.sample_sigmas)
        self.note_step(step)
        return step

    def begin_evaluation(self, sigma: float) -> int:
        """A model evaluation at ``sigma`` starts (CALC_COND_BATCH wrapper): its 0-based step, noted as reached; the
        runner may start fetching the first cache entries that evaluation reads (``MCSparseRunner.begin_evaluation``).
        """
        step = self.step_for(sigma)
        begin = getattr(self.runner, "begin_evaluation", None)
        if begin is not None:
            begin(step)
        return step

    def step_of(self, options: dict) -> int | None:
        """The 0-based step of the model evaluation ``options`` belongs to, without a device read per call:
        ``options[STEP_KEY]`` (set once per evaluation by the CALC_COND_BATCH wrapper); for a caller that bypasses
        that wrapper, the sigma read once per ``sigmas`` tensor (one per evaluation). None: no sigma at all."""
        step = options.get(STEP_KEY)
        if step is not None:
            return step
        sigmas = options.get("sigmas")
        if sigmas is None:
            return None
        if self._sigma_step is not None and self._sigma_step[0] is sigmas:
            return self._sigma_step[1]
        sigma = current_sigma(options)
        if sigma is None:
            return None
        step = self.step_for(sigma)
        self._sigma_step = (sigmas, step)  # holds the tensor, so its identity cannot be reused by another
        return step

    def note_step(self, step: int) -> None:
        """A model evaluation of ``step`` (0-based) started: the summary of an interrupted run names it."""
        if self.last_step is None or step > self.last_step:
            self.last_step = step

    def kind(self, step: int, layer: int) -> str:
        """"dense", "anchor" or "reuse" for this step and block."""
        from ..schedule import step_kind

        return step_kind(self.config, step, layer).value

    def record_dense(self, reason: str) -> None:
        """Count a call that ran dense, with its reason."""
        if self.runner is not None:
            self.runner.record_dense(reason)
        else:
            self.dense_reasons[reason] += 1

    def internal_error(self, err: BaseException, where: str) -> None:
        """An unexpected error in the pack's attention path at ``where`` (a bug): logged with its traceback, the
        rest of the run dense, the summary's note names it (``engine.MCSparseRunner.internal_error``)."""
        if getattr(self.runner, "internal_error", None) is not None:
            self.runner.internal_error(err, where)
            return
        logger.error("MC-Sparse: internal error at %s; the rest of this run is dense", where, exc_info=err)
        note = f"internal error at {where} ({type(err).__name__}: {str(err).strip()[:300]}); this call ran dense"
        if note not in self.notes:
            self.notes.append(note)

    def timed_dense(self, reason: str, shape: tuple, fn, *, device: torch.device | None = None):
        """Run a dense warm-up call ``fn()`` of ``shape`` ``(B, H, S, D)`` on ``device`` (None: the current CUDA
        device, else the CPU), count it and time it (the runner's timer)."""
        if self.runner is None:
            self.record_dense(reason)
            return fn()
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        start = self.runner.timer.start(device)
        out = fn()
        self.record_dense(reason)
        self.runner.timer.stop(start, "dense", shape[1:], shape[0])
        return out

    def sparse_call(self, q, k, v, *, step: int, layer: int, branches, window, dense_fn, scale, kind: str = "self",
                    extra_kv=None, out=None):
        """An anchor or reuse call for a whole batch through the runner (which times it: CUDA events, read at the end).

        Args:
            q, k, v: ``[B, H, S, D]`` (any strides), B = ``len(branches)`` conditioning chunks of equal size.
            branches: each chunk's conditioning identity (uuid), in batch order. kind: ``CacheKey.kind`` ("self",
            "vace", "vace#1", ...). extra_kv: ``(k_text, v_text)`` ``[B, H, T, D]`` attended exactly. out: the
            ``[B, H, S, D]`` view of the caller's output buffer the result is written into. Other args as
            ``MCSparseRunner.attention``.
        """
        from ..cache import CacheKey

        chunk = (q.shape[0] // len(branches), *q.shape[1:])
        keys = [CacheKey(layer=layer, branch=b, window=window, shape=chunk, kind=kind) for b in branches]
        self.cache_keys.update(keys)
        result, _ = self.runner.call(q, k, v, step=step, layer=layer, keys=keys, dense_fn=dense_fn, scale=scale,
                                     extra_kv=extra_kv, out=out)
        return result

    def exact_attention(self, q, k, v, *, scale: float):
        """Exact attention ``[b, H, T, D]`` over ``[b, H, S, D]`` keys through the run's dense kernels (not counted)."""
        return self.runner.dense_attention(q, k, v, scale=scale)

    # -- end of run -------------------------------------------------------------------------------------------
    def note_displaced(self, what: str) -> None:
        """Another node wrote the override key after us; we chained it and took the top again."""
        if what not in self.displaced:
            self.displaced.append(what)
            logger.warning("MC-Sparse: another attention override (%s) was installed after the MC-Sparse Patch "
                           "node; MC-Sparse re-installed itself on top and calls it for dense attention", what)

    def counts(self) -> dict[str, int]:
        """{"sparse": reuse calls, "anchor": anchor calls, "dense": dense calls} so far."""
        if self.runner is None:
            return {"sparse": 0, "anchor": 0, "dense": sum(self.dense_reasons.values())}
        calls = {k.value: n for k, n in self.runner.stats.calls.items()}
        return {"sparse": calls.get("reuse", 0), "anchor": calls.get("anchor", 0), "dense": calls.get("dense", 0)}

    def summary(self) -> str:
        """The multi-line run summary (see ``summary.format_summary``)."""
        from .summary import format_summary

        return format_summary(self)

    def close(self) -> None:
        """Free the caches (idempotent)."""
        if self.runner is not None:
            self.runner.close()
        self.mask_memo = None
        self.closed = True


def _default_runner(config, backend: str):
    """``engine.MCSparseRunner`` for ``config``; the cache may use only the GPU memory ComfyUI has not counted
    on (``comfy.model_management.get_free_memory`` L1148 minus ``minimum_inference_memory`` L566, the headroom
    ComfyUI keeps for inference)."""
    from ..engine import MCSparseRunner

    return MCSparseRunner(config, backend=backend, free_memory_fn=_comfy_free_memory)


def _comfy_free_memory(device: torch.device) -> int:
    """GPU bytes on ``device`` the MC-Sparse cache may take: ComfyUI's free memory minus its inference reserve."""
    import comfy.model_management as mm

    return max(0, int(mm.get_free_memory(device)) - int(mm.minimum_inference_memory()))


def _plan_before_sampling(run: RunState, guider, noise, latent_shapes=None, head_split: int = 1,
                          branch_split: int = 1) -> None:
    """Before the first step: decide whether this sampler call can pay off (``payoff.dense_reason``; if not, the
    run goes dense and says why once), then log the runner's cache / speed estimate (``MCSparseRunner.plan``),
    from the model's attention geometry, device and dtype and the latent (``noise``, the latent's shape; for a
    packed multi-stream latent, v0.33.0 ``latent_shapes``, the first stream's shape: MiniMax-H3's video).
    ``head_split``: this process attends to (and caches) 1/head_split of the model's heads (raylight's Ulysses
    degree, ``adapter/raylight.py``); the cache plan counts that share, the speed estimate the whole model's.
    ``branch_split``: this process evaluates 1/branch_split of the guider's conditioning branches (raylight's CFG
    degree; rounded up); the cache plan counts those."""
    runner = run.runner
    if runner is None:
        return
    from .layouts import geometry
    from .payoff import dense_reason

    patcher = getattr(guider, "model_patcher", None)
    geo = device = dtype = None
    if patcher is not None:
        dm = patcher.get_model_object("diffusion_model")
        if isinstance(noise, torch.Tensor):
            shape = tuple(noise.shape)
            if latent_shapes is not None and len(latent_shapes) > 1:
                shape = tuple(latent_shapes[0])
            geo = geometry(dm, plan_for(dm), shape)
        device = getattr(patcher, "load_device", None)
        model = getattr(patcher, "model", None)
        dtype = getattr(model, "manual_cast_dtype", None) or (patcher.model_dtype() if model is not None else None)
    reason = dense_reason(run.config, num_steps=run.num_steps, layers=geo.layers if geo else 1,
                          requested_backend=run.settings.backend, min_tokens=run.settings.min_tokens,
                          device=device if isinstance(device, torch.device) else None, dtype=dtype,
                          head_dim=geo.head_dim if geo else None, tokens=geo.tokens if geo else None)
    if reason is not None:
        run.go_dense(reason)
        logger.warning("MC-Sparse: this sampler call runs dense: %s", reason)
        return
    if geo is None:
        return
    branches = -(-evaluated_branches(guider) // max(1, branch_split))
    try:  # the runner logs the estimate (info) and repeats it in its summary
        runner.plan(heads=geo.heads // head_split, head_dim=geo.head_dim, layers=geo.layers, tokens=geo.tokens,
                    branches=branches, batch=int(noise.shape[0]), num_steps=run.num_steps,
                    **({"model_heads": geo.heads} if head_split > 1 else {}))
    except (ValueError, TypeError) as err:  # an estimate must never stop sampling; say why it is missing
        logger.warning("MC-Sparse: no cache estimate for this run (%s)", err)


def evaluated_branches(guider) -> int:
    """How many conditionings each model evaluation of this sampler call runs (the cache holds one entry per block
    and branch), by the guider's own ``predict_noise`` (the first class in its MRO that defines one):

    * ``CFGGuider`` (``comfy/samplers.py``; also ``Guider_Basic``, which keeps it) and guiders without one: the
      positive, and the negative unless cfg is 1 (``sampling_function`` skips it);
    * ``Guider_DualCFG`` (``comfy_extras/nodes_custom_sampler.py``): negative, middle and positive; the "regular"
      style drops the negative at cfg2 1 and then the middle too at cfg1 1 (its ``cfg`` attribute stays 1.0);
    * ``Guider_PerpNeg`` (``comfy_extras/nodes_perpneg.py``): positive, negative and the empty prompt; the negative
      dropped at neg_scale 0 and then the empty prompt too at cfg 1;
    * any other guider with its own ``predict_noise``: the CFGGuider rule (its conds are not known to be evaluated).
    """
    import math

    conds = getattr(guider, "conds", {}) or {}
    owner = next((c.__name__ for c in type(guider).__mro__ if "predict_noise" in vars(c)), "CFGGuider")
    if owner == "Guider_DualCFG":
        keep = {"positive", "middle", "negative"} & set(conds)
        if not getattr(guider, "nested", False) and math.isclose(getattr(guider, "cfg2", 0.0), 1.0):
            keep.discard("negative")
            if math.isclose(getattr(guider, "cfg1", 0.0), 1.0):
                keep.discard("middle")
        return max(1, len(keep))
    if owner == "Guider_PerpNeg":
        keep = {"positive", "negative", "empty_negative_prompt"} & set(conds)
        if math.isclose(getattr(guider, "neg_scale", 1.0), 0.0):
            keep.discard("negative")
            if math.isclose(getattr(guider, "cfg", 0.0), 1.0):
                keep.discard("empty_negative_prompt")
        return max(1, len(keep))
    return 2 if ("negative" in conds and getattr(guider, "cfg", 1.0) != 1.0) else 1


def _plan_or_dense(run: RunState, guider, noise, latent_shapes=None, head_split: int = 1,
                   branch_split: int = 1) -> None:
    """``_plan_before_sampling``; an unexpected error there (a bug: a model variant without an attribute the
    geometry reads, a failing memory query) turns this sampler call dense instead of losing it: logged with its
    traceback, named in the summary. It propagates with MC_SPARSE_RAISE_ERRORS=1 and for an interrupt
    (``engine.contains``)."""
    try:
        _plan_before_sampling(run, guider, noise, latent_shapes, head_split, branch_split)
    except Exception as err:
        from ..engine import contains

        if not contains(err):
            raise
        logger.error("MC-Sparse: internal error while planning this sampler call; it runs dense", exc_info=err)
        first = str(err).strip().splitlines()[0][:300] if str(err).strip() else ""
        run.go_dense(f"internal error while planning this sampler call ({type(err).__name__}: {first}); it runs "
                     "dense (please report it with the console log)")


# -- wrappers and callbacks (called by ComfyUI) ---------------------------------------------------------------

def outer_sample_wrapper(executor, *args, **kwargs):
    """OUTER_SAMPLE: a fresh ``RunState`` for this sampler call; summary, free and restore in ``finally``."""
    return run_sampler_call(executor, args, kwargs, install=True, report=_report)


def run_sampler_call(executor, args: tuple, kwargs: dict, *, install: bool, report, head_split: int = 1,
                     branch_split: int = 1):
    """The body of an OUTER_SAMPLE wrapper (this module's, and raylight's on each rank): the sampler call
    ``executor(*args, **kwargs)`` (args ``(noise, latent, sampler, sigmas, ...)``) with a fresh ``RunState`` under
    ``RUN_KEY`` in a clone of the guider's model options (the attention override installed there when ``install``),
    after the pay-off check and cache plan (``_plan_or_dense`` for ``1 / head_split`` of the heads and
    ``1 / branch_split`` of the branches). In ``finally``:
    ``report(run)``, the run's caches freed, the guider's options restored. An exception is noted in the run
    (``interrupted_by``) and propagates. Without an MC-Sparse holder in the options: the call alone."""
    from comfy.model_patcher import create_model_options_clone

    guider = executor.class_obj
    original_options = guider.model_options
    holder = original_options.get("transformer_options", {}).get(HOLDER_KEY)
    if not isinstance(holder, MCSparsePatch):
        return executor(*args, **kwargs)
    sigmas = args[3] if len(args) > 3 else kwargs["sigmas"]
    run = None
    try:
        guider.model_options = create_model_options_clone(original_options)
        options = guider.model_options.setdefault("transformer_options", {})
        run = RunState(holder.settings, sigmas, family=holder.family, unsupported=holder.unsupported)
        options[RUN_KEY] = run
        if install:
            displaced = install_override(options)
            if displaced:
                run.note_displaced(displaced)
        holder.active_runs.append(run)
        _plan_or_dense(run, guider, args[0] if args else kwargs.get("noise"), kwargs.get("latent_shapes"),
                       head_split, branch_split)
        return executor(*args, **kwargs)
    except BaseException as err:  # ComfyUI's interrupt (InterruptProcessingException), OOM, Ctrl-C, ...
        if run is not None:
            run.interrupted_by = type(err).__name__
        raise
    finally:
        if run is not None:
            try:
                report(run)
            finally:
                run.close()
                if run in holder.active_runs:
                    holder.active_runs.remove(run)
        guider.model_options = original_options


def _report(run: RunState) -> None:
    text = run.summary()
    counts = run.counts()
    if counts["sparse"] == 0 or run.interrupted_by is not None:
        logger.warning("%s", text)
    else:
        logger.info("%s", text)
    try:  # progress text under the sampler node in the UI (server.py L1008), when a server is running
        server, context = running_server()
        if context is not None and server is not None and hasattr(server, "send_progress_text"):
            server.send_progress_text(text.splitlines()[0], context.node_id)
    except Exception as err:  # the UI message is optional; never fail a finished sampling run over it
        logger.debug("MC-Sparse: no progress text (%s)", err)


def running_server():
    """(``PromptServer.instance``, the executing node's context) of a running ComfyUI, else (None, None). Looks in
    ``sys.modules`` only: a ComfyUI with a server has imported ``server`` and ``comfy_execution.utils`` already, and
    importing them here (scripts, headless runs, the benchmark) costs a failing or heavy import of ComfyUI's whole
    server and node stack at the end of every sampler call (~0.2 s measured outside the steps of the 1.3B whole run)."""
    import sys

    server_mod, utils = sys.modules.get("server"), sys.modules.get("comfy_execution.utils")
    if server_mod is None or utils is None:
        return None, None
    return getattr(getattr(server_mod, "PromptServer", None), "instance", None), utils.get_executing_context()


def calc_cond_batch_wrapper(executor, *args, **kwargs):
    """CALC_COND_BATCH (once per model evaluation, ``comfy/samplers.py`` L209-213, args ``(model, conds, x_in,
    timestep, model_options)``): re-assert the override on the model_options this evaluation really uses, resolve
    the evaluation's step from ``timestep`` (the one host read of a sigma per evaluation) and hand it to every
    attention call below under ``steps.STEP_KEY``, on a copy of the options (the guider's stay untouched)."""
    model_options = args[4] if len(args) > 4 else kwargs.get("model_options")
    if model_options is not None:
        options = model_options.setdefault("transformer_options", {})
        displaced = install_override(options)
        run = options.get(RUN_KEY)
        if displaced and run is not None:
            run.note_displaced(displaced)
        timestep = args[3] if len(args) > 3 else kwargs.get("timestep")
        if run is not None and isinstance(timestep, torch.Tensor) and timestep.numel():
            step = None
            with contextlib.suppress(ValueError):  # NaN sigma: the attention calls then fall back per sigma
                step = run.begin_evaluation(float(timestep.detach().float().max()))
            if step is not None:
                model_options = {**model_options, "transformer_options": {**options, STEP_KEY: step}}
                if len(args) > 4:
                    args = (*args[:4], model_options, *args[5:])
                else:
                    kwargs["model_options"] = model_options
    return executor(*args, **kwargs)


def on_prepare_state(patcher, *args, **kwargs):
    """ON_PREPARE_STATE: called ``(patcher, timestep)`` in the Oct-2025 snapshot (``model_patcher.py``
    L1040-1042) and ``(patcher, timestep, model_options)`` in newer ComfyUI; re-asserts the override."""
    model_options = kwargs.get("model_options") or (args[1] if len(args) > 1 else None)
    target = model_options if isinstance(model_options, dict) else getattr(patcher, "model_options", None)
    if target is not None:
        install_override(target.setdefault("transformer_options", {}))


def on_cleanup(patcher, *args, **kwargs):
    """ON_CLEANUP: free the caches of runs still active on this patcher's holder."""
    holder = getattr(patcher, "model_options", {}).get("transformer_options", {}).get(HOLDER_KEY)
    if isinstance(holder, MCSparsePatch):
        holder.release()


def apply_model_wrapper(executor, *args, **kwargs):
    """APPLY_MODEL (Hunyuan3D 2.1 only): publish this evaluation's transformer_options in
    ``override.CURRENT_OPTIONS`` for the replaced attention forwards (args ``(x, t, c_concat, c_crossattn,
    control, transformer_options)``, ``comfy/model_base.py`` L159-164)."""
    options = kwargs.get("transformer_options", args[5] if len(args) > 5 else None)
    token = CURRENT_OPTIONS.set(options)
    try:
        return executor(*args, **kwargs)
    finally:
        CURRENT_OPTIONS.reset(token)


def apply_mc_sparse(
    model,
    *,
    preset: str = "balanced",
    density: float = 0.2,
    dense_warmup: str = "auto",
    warmup_layers: int = 1,
    anchor_steps: str = "auto",
    query_tile: int = 128,
    cache_placement: str = "auto",
    backend: str = "auto",
    min_tokens: int = 2048,
    verbose: bool = False,
    residual_precision: str = "auto",
    memory_headroom_gib: float = 4.0,
):
    """Return a clone of ``model`` (a ComfyUI ``ModelPatcher``) with MC-Sparse attention installed.

    Args: see ``settings.build_settings`` (same names; step numbers 1-based, percents of each sampler
    call). The original ``model`` is not modified; bypassing the node leaves no trace. A second MC-Sparse node
    later in the chain replaces this one (one set of wrappers, one run, one summary: the last node's settings).
    Density 1 keeps every token: ``model`` itself is returned (an exact pass-through), or, after another MC-Sparse
    node, a clone whose runs are all dense.
    Returns:
        the patched clone, or ``model``.
    Raises:
        ValueError / TypeError: a bad setting, naming the input.
    """
    import comfy.patcher_extension as pe

    settings = build_settings(preset=preset, density=density, dense_warmup=dense_warmup, warmup_layers=warmup_layers,
                              anchor_steps=anchor_steps, query_tile=query_tile, cache_placement=cache_placement,
                              backend=backend, min_tokens=min_tokens, verbose=verbose,
                              residual_precision=residual_precision, memory_headroom_gib=memory_headroom_gib)
    options = getattr(model, "model_options", {}).get("transformer_options", {})
    if settings.density >= 1.0 and HOLDER_KEY not in options:
        logger.info("MC-Sparse: density 1 keeps every token; the model passes through unpatched")
        return model
    patched = model.clone()
    plan = plan_for(patched.get_model_object("diffusion_model"))
    if plan.reason_unsupported:
        logger.warning("MC-Sparse: %s", plan.reason_unsupported)
    options = patched.model_options.setdefault("transformer_options", {})
    options[HOLDER_KEY] = MCSparsePatch(settings, plan.family, plan.reason_unsupported)
    install_override(options)
    installed = install_plan(patched, plan)
    for wrapper_type in (pe.WrappersMP.OUTER_SAMPLE, pe.WrappersMP.CALC_COND_BATCH, pe.WrappersMP.APPLY_MODEL,
                         pe.WrappersMP.DIFFUSION_MODEL):
        patched.remove_wrappers_with_key(wrapper_type, WRAPPER_KEY)  # an earlier MC-Sparse node's: the last one wins
    for callback_type in (pe.CallbacksMP.ON_PREPARE_STATE, pe.CallbacksMP.ON_CLEANUP):
        patched.remove_callbacks_with_key(callback_type, WRAPPER_KEY)
    patched.add_wrapper_with_key(pe.WrappersMP.OUTER_SAMPLE, WRAPPER_KEY, outer_sample_wrapper)
    patched.add_wrapper_with_key(pe.WrappersMP.CALC_COND_BATCH, WRAPPER_KEY, calc_cond_batch_wrapper)
    if plan.needs_context_publisher:
        patched.add_wrapper_with_key(pe.WrappersMP.APPLY_MODEL, WRAPPER_KEY, apply_model_wrapper)
    if plan.diffusion_model_wrapper is not None:
        patched.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, WRAPPER_KEY, plan.diffusion_model_wrapper)
    patched.add_callback_with_key(pe.CallbacksMP.ON_PREPARE_STATE, WRAPPER_KEY, on_prepare_state)
    patched.add_callback_with_key(pe.CallbacksMP.ON_CLEANUP, WRAPPER_KEY, on_cleanup)
    if settings.verbose:
        logger.info("MC-Sparse: patched %s (%s): %d self-attention call sites marked; %s",
                    type(patched.get_model_object("diffusion_model")).__name__, plan.family, installed, settings)
    return patched
