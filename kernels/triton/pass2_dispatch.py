"""Which kernel runs the float8 pass 2 of ``selection.group_prob_sums``: the CuTeDSL sm_90 kernel
(``kernels/cutedsl/pass2_sm90.py``) where it is on and can run, else the warp-specialised sm_90 Gluon kernel
(``selection_sm90.py``) where it can, else the Triton pair kernel (``selection._group_prob_sums_pair``).

- The CuTeDSL kernel: tried first when on (``cute=True`` from the caller, else ``MC_SPARSE_PASS2_CUTE``, else
  ``CUTE_DEFAULT``) and when its module imports (nvidia-cutlass-dsl: an import failure is a refusal, reported) and
  ``pass2_sm90.refusal`` accepts the call; never with a Triton-only option (``triton_only``). It reads 2^KB
  (``fp8_operands(kb_pow2=True)``) and writes only the sums: the caller's top-K runs after it (``topk.top_k_rows``).
  Its compile or launch failure (anything but out of memory) is remembered like the Gluon kernel's (``CUTE_KEY``) and
  the call goes on to the Gluon / Triton kernel with the same operands.
- The CuTeDSL kernel with its fused top-K (``try_cute_select``: the module's ``FUSED_TOPK``; the selection written by
  the kernel from its own float16 sums, so select_kv launches no top-K): tried first where select_kv hands pass 2 a
  selection to fill (``topk.FusedRows``), the CuTeDSL kernel is on and ``MC_SPARSE_PASS2_CUTE_TOPK=1`` (off by default
  since session 10: every final-round figure ran without it, and its float16x2 sweeps failed the twin-key GPU tests
  before they were reverted; the restored sweeps are session 9's GPU-checked code), unless the
  module refuses (``select_refusal``) or has no fused top-K; its failure is remembered apart (``CUTE_TOPK_KEY``), and
  the call goes on to the CuTeDSL kernel without it (then the separate top-K), as any refusal does.

- The Triton kernel runs everywhere the Gluon kernel refuses (``selection_sm90.refusal``: not sm_90, the interpreter,
  head dim, group width, operand layout), whenever the caller asks for something only the Triton kernel has (the
  first-digit histogram, polynomial or packed exponentials, launch tuning: ``triton_only``), and when the Gluon
  kernel is off: ``gluon=False`` from the caller, else ``MC_SPARSE_PASS2_GLUON=0``, else ``GLUON_DEFAULT``.
- A Gluon compile or launch failure (anything but out of memory) runs the Triton kernel for the same call, is logged
  once, and is remembered as the registry remembers a failed backend: in the active ``registry.Record`` (key
  ``GLUON_KEY``: the run summary shows the reason, the rest of that run skips the Gluon kernel) or, without a
  record, for the process (``fallback_reason``). Both kernels write the same sums (the same float8 operands and
  arithmetic; only the order of a key's fp32 row-sum additions differs), so a fallback changes speed, not results.
"""

from __future__ import annotations

import logging
import os

from .. import registry

log = logging.getLogger(__name__)

GLUON_KEY = ("triton.gluon_sm90", "group_prob_sums")
# off: the Triton pair kernel is never slower at 14B 720p in the H200 measurements and equal at 1.3B 480p. Round 1b
# (6b752e9, / flash-attn-4 dense): the kernel alone 0.4665 vs 0.5016 (1.3B), 0.4607 vs 0.4592 (14B); select_kv 0.597 vs
# 0.599 (1.3B), 0.572 vs 0.563 (14B). Round 2 (3d95386, pass 2 with the operand pass, 4 heads): 0.537 vs 0.540 (1.3B),
# 0.527 vs 0.468 (14B). MC_SPARSE_PASS2_GLUON=1 or gluon=True turns it on (GPU tests passed in both rounds).
GLUON_DEFAULT = False
_failures = registry.FailureMemo(GLUON_KEY)

CUTE_KEY = ("cutedsl.pass2_sm90", "group_prob_sums")
# on (sm_90 with nvidia-cutlass-dsl; elsewhere its refusal sends the call to the Triton kernel): H200 round s9r2 (main
# b4160ca, tests/bench_select_race.py race 1, tests/_timing.race with lead-in, / flash-attn-4 dense, s = 0.1 / 0.15 /
# 0.25 / 0.5): at 1.3B 480p the CuTeDSL kernel + the separate top-K (counting) 0.551 / 0.549 / 0.549 / 0.558 against
# the Triton defaults 0.561 / 0.574 / 0.563 / 0.559 (its fused top-K 0.567 / 0.562 / 0.561 / 0.563: race 2, the
# kernel alone 0.484, + separate top-K 0.531, + fused 0.538); at 14B 720p two query groups per work item (pair) + the
# fused top-K 0.448 / 0.450 / 0.444 / 0.447 against 0.462 / 0.452 / 0.456 / 0.455 (without pair, fused: 0.453 / 0.462
# / 0.461 / 0.453). Selections GPU-checked == the brute-force top-K of the kernel's sums. Which of the two forms runs
# is the module's policy (``select_refusal``: the fused top-K with pair only on walks that need no key parts; p2cute's
# d0c4613), so the dispatch just asks for the fused top-K and falls to the kernel without it where refused.
CUTE_DEFAULT = True
_cute_failures = registry.FailureMemo(CUTE_KEY)
CUTE_TOPK_KEY = ("cutedsl.pass2_sm90", "group_prob_sums+top_k")
_cute_topk_failures = registry.FailureMemo(CUTE_TOPK_KEY)


_cute_import_error: list[BaseException] = []  # the module's import error, once (not retried on every call)


def _cute_module():
    if _cute_import_error:
        raise _cute_import_error[0]
    try:
        from ..cutedsl import pass2_sm90  # imported lazily: no nvidia-cutlass-dsl is a refusal reason, not a failure
    except Exception as err:
        _cute_import_error.append(err)
        raise
    return pass2_sm90


def cute_mode(requested: bool | None = None) -> bool:
    """Whether the CuTeDSL kernel is wanted: ``requested`` when not None, else ``MC_SPARSE_PASS2_CUTE`` ("1" on, "0"
    off; any other value is a ValueError), else ``CUTE_DEFAULT``."""
    return _switch(requested, "MC_SPARSE_PASS2_CUTE", CUTE_DEFAULT)


def cute_wanted(requested: bool | None = None) -> bool:
    """``cute_mode`` and the module imports (nvidia-cutlass-dsl present; the import is tried once): whether a float8
    pass 2 should make the operands the CuTeDSL kernel reads (2^KB)."""
    if not cute_mode(requested):
        return False
    try:
        _cute_module()
    except Exception:  # noqa: BLE001 (no nvidia-cutlass-dsl, a broken install: a refusal, reported by cute_refusal)
        return False
    return True


def cute_unit_qf() -> bool:
    """Whether a float8 pass 2 headed for the CuTeDSL kernel makes its operands with qf = 1 and runs the kernel's
    ``unit_qf`` form (``selection.fp8_operands(unit_qf=True)``; every other kernel reads those operands as well):
    ``MC_SPARSE_PASS2_UNIT_QF`` ("1" on, "0" off; any other value is a ValueError), else the module's ``UNIT_QF``
    (off when the module has none or does not import)."""
    try:
        default = bool(getattr(_cute_module(), "UNIT_QF", False))
    except Exception:  # noqa: BLE001 (no nvidia-cutlass-dsl: the kernel is refused anyway)
        default = False
    return _switch(None, "MC_SPARSE_PASS2_UNIT_QF", default)


def cute_fallback_reason() -> str | None:
    """The CuTeDSL kernel's failure this run (active record) or this process (no record), if any."""
    return _cute_failures.reason()


def cute_refusal(q8, k8, group_size, out, *, requested=None, only_triton=None) -> str | None:
    """Why the CuTeDSL kernel does not run this float8 pass 2 call (None: it runs)."""
    why = _not_wanted(cute_mode(requested), requested, "cute", "MC_SPARSE_PASS2_CUTE", "CUTE_DEFAULT", only_triton,
                      cute_fallback_reason)
    return why if why is not None else _module_refusal(_cute_module, q8, k8, group_size, out)


def try_cute(q8, k8, qf, lse_s, kb2, perm, out, *, group_size, requested=None, only_triton=None,
             unit_qf=False) -> bool:
    """Run the float8 pass 2 on the CuTeDSL kernel into ``out`` if it may (``cute_refusal``): True when it wrote
    ``out``; False when the caller must run another kernel (refused, or failed: then remembered and logged). ``kb2``:
    2^KB (``fp8_operands(kb_pow2=True)``); ``unit_qf``: the operands were made with ``unit_qf=True`` (the kernel's
    ``unit_qf`` form, ``cute_unit_qf``; or the form's factors themselves, fp32 ``[B*H]``: ``fp8_operands(unit_signs=
    True)``'s sixth output, then the kernel launches no check of its own); the rest as
    ``selection_sm90.group_prob_sums_fp8``. Raises: out of memory."""
    if cute_refusal(q8, k8, group_size, out, requested=requested, only_triton=only_triton) is not None:
        return False
    return _launch(_cute_module, _cute_failures, "the CuTeDSL pass-2 kernel",
                   (q8, k8, qf, lse_s, kb2, perm, out), group_size, **_unit_kw(unit_qf))


def cute_topk_mode() -> bool:
    """Whether the CuTeDSL kernel's fused top-K is wanted where the kernel runs: ``MC_SPARSE_PASS2_CUTE_TOPK`` ("1" on,
    "0" off; any other value is a ValueError), else off (the kernel + the separate top-K: the route every session-10
    H200 figure measured, docs/kernels.md; the fused top-K gives the same selection)."""
    return _switch(None, "MC_SPARSE_PASS2_CUTE_TOPK", False)


def cute_topk_fallback_reason() -> str | None:
    """The fused top-K launch's failure this run (active record) or this process (no record), if any."""
    return _cute_topk_failures.reason()


def cute_select_refusal(q8, k8, group_size, out, sel, num_keys, *, requested=None, only_triton=None) -> str | None:
    """Why the CuTeDSL kernel does not run this call with its fused top-K into ``sel`` (None: it does): the
    kernel's own refusal (``cute_refusal``), the fused top-K switched off, failed earlier, absent from the module
    (no ``FUSED_TOPK``), or refused by it (``select_refusal``)."""
    why = cute_refusal(q8, k8, group_size, out, requested=requested, only_triton=only_triton)
    if why is not None:
        return why
    if not cute_topk_mode():
        return "fused top-K off (MC_SPARSE_PASS2_CUTE_TOPK unset or 0)"
    reason = cute_topk_fallback_reason()
    if reason is not None:
        return f"fused top-K failed earlier ({reason})"
    mod = _cute_module()  # (imported: cute_refusal passed)
    if not getattr(mod, "FUSED_TOPK", False):
        return "this kernels/cutedsl/pass2_sm90.py has no fused top-K"
    return mod.select_refusal(q8, k8, group_size, out, sel, num_keys)


def try_cute_select(q8, k8, qf, lse_s, kb2, perm, out, *, group_size, sel, num_keys, requested=None,
                    only_triton=None, unit_qf=False) -> bool:
    """Run the float8 pass 2 on the CuTeDSL kernel with its fused top-K if it may (``cute_select_refusal``): True when
    it wrote the float16 sums into ``out`` and each row's ``num_keys`` largest of them into ``sel`` (int32 ``[B, H, G,
    width]``, contiguous last dim: ascending indices, ties to the lower index, then -1); False when the caller must
    run something else (refused, or failed: then remembered under ``CUTE_TOPK_KEY`` and logged). ``unit_qf``: the
    operands were made with ``unit_qf=True`` (the kernel's ``unit_qf`` form, as ``try_cute``). Raises: out of
    memory."""
    if cute_select_refusal(q8, k8, group_size, out, sel, num_keys, requested=requested,
                           only_triton=only_triton) is not None:
        return False
    return _launch(_cute_module, _cute_topk_failures, "the CuTeDSL pass-2 kernel's fused top-K",
                   (q8, k8, qf, lse_s, kb2, perm, out), group_size, then="it without the fused top-K",
                   select=(sel, num_keys), **_unit_kw(unit_qf))


def _unit_kw(unit_qf) -> dict:
    """The kernel's ``unit_qf`` keyword for a caller's ``unit_qf``: False / None none, True, or the factors tensor
    (``selection.fp8_operands(unit_signs=True)``'s sixth output) as given."""
    return {} if unit_qf is None or unit_qf is False else {"unit_qf": unit_qf}


def _gluon_module():
    from . import selection_sm90  # imported lazily: an import error is a refusal reason, not a broken backend

    return selection_sm90


def gluon_mode(requested: bool | None = None) -> bool:
    """Whether the Gluon kernel is wanted: ``requested`` when not None, else ``MC_SPARSE_PASS2_GLUON`` ("1" on, "0"
    off; any other value is a ValueError), else ``GLUON_DEFAULT``."""
    return _switch(requested, "MC_SPARSE_PASS2_GLUON", GLUON_DEFAULT)


def gluon_kb_pow2(head_dim: int) -> bool:
    """Whether the Gluon kernel's launch config for ``head_dim`` reads 2^KB (``kb_poly=2``: the operands of
    ``selection.fp8_operands(kb_pow2=True)``, as the Triton kernel's KB_POW2); False when it reads KB itself or
    cannot be imported (then it never runs)."""
    try:
        return _gluon_module().config(head_dim).get("kb_poly") == 2
    except Exception:  # noqa: BLE001 (import failure: a refusal elsewhere)
        return False


def triton_only(*, hist=None, poly=0, exp_mode=0, tuned=False) -> str | None:
    """The reason a call needs the Triton kernel whatever the GPU (None: the Gluon kernel may take it)."""
    if hist is not None:
        return "first-digit histogram requested (Triton kernel only)"
    if poly:
        return "polynomial exponentials requested (Triton kernel only)"
    if exp_mode:
        return "packed exponentials requested (Triton kernel only)"
    if tuned:
        return "launch tuning given (the Triton kernel's)"
    return None


def fallback_reason() -> str | None:
    """The Gluon failure this run (active record) or this process (no record) remembers, if any."""
    return _failures.reason()


def reset() -> None:
    """Forget the process-level Gluon and CuTeDSL failures (tests; a new record starts clean itself)."""
    _failures.reset()
    _cute_failures.reset()
    _cute_topk_failures.reset()


def gluon_refusal(q8, k8, group_size, out, *, requested=None, only_triton=None) -> str | None:
    """Why the Gluon kernel does not run this float8 pass 2 call (None: it runs)."""
    why = _not_wanted(gluon_mode(requested), requested, "gluon", "MC_SPARSE_PASS2_GLUON", "GLUON_DEFAULT", only_triton,
                      fallback_reason)
    return why if why is not None else _module_refusal(_gluon_module, q8, k8, group_size, out)


def try_gluon(q8, k8, qf, lse_s, kb, perm, out, *, group_size, requested=None, only_triton=None) -> bool:
    """Run the float8 pass 2 on the Gluon kernel into ``out`` if it may (``gluon_refusal``): True when it wrote
    ``out``; False when the caller must run the Triton kernel (refused, or failed: then remembered and logged).
    Arguments as ``selection_sm90.group_prob_sums_fp8``. Raises: out of memory."""
    if gluon_refusal(q8, k8, group_size, out, requested=requested, only_triton=only_triton) is not None:
        return False
    return _launch(_gluon_module, _failures, "the sm_90 Gluon pass-2 kernel", (q8, k8, qf, lse_s, kb, perm, out),
                   group_size)


def operand_refusal(q8, k8, group_size: int, *, capabilities, head_dims, max_group: int) -> str | None:
    """The refusal checks both float8 pass-2 kernels make on a CUDA call (None: they pass), in this order: the
    device's capability in ``capabilities``, float8_e4m3fn operands, head dim in ``head_dims``, group width in
    (64, ``max_group``], q8 / k8 contiguous and 16-byte aligned (``selection.fp8_operands``' copies)."""
    import torch

    cap = torch.cuda.get_device_capability(q8.device)
    if cap not in capabilities:
        return f"runs on sm_90 only, got sm_{cap[0]}{cap[1]}"
    if q8.dtype != torch.float8_e4m3fn or k8.dtype != torch.float8_e4m3fn:
        return f"takes float8_e4m3fn operands, got {q8.dtype} / {k8.dtype}"
    if q8.shape[-1] not in head_dims:
        return f"head dim must be one of {head_dims}, got {q8.shape[-1]}"
    if not 64 < group_size <= max_group:
        return f"group size must be in (64, {max_group}], got {group_size}"
    if not (q8.is_contiguous() and k8.is_contiguous()) or q8.data_ptr() % 16 or k8.data_ptr() % 16:
        return "q8 / k8 must be contiguous and 16-byte aligned (fp8_operands' copies)"
    return None


def _switch(requested, env_name: str, default) -> bool:
    """A kernel's on/off: ``requested`` when not None, else ``$env_name`` ("1" on, "0" off; any other value is a
    ValueError), else ``default``."""
    if requested is not None:
        return bool(requested)
    env = os.environ.get(env_name, "")
    if env not in ("", "0", "1"):
        raise ValueError(f"{env_name} must be 0 or 1, got {env!r}")
    return env == "1" if env else bool(default)


def _not_wanted(on: bool, requested, arg: str, env_name: str, default_name: str, only_triton, failed) -> str | None:
    """The reason a kernel is not tried before its module is asked (None: ask it): switched off (by the caller's
    ``arg``=False, ``$env_name``=0 or ``default_name``), a Triton-only request, or a failure remembered earlier
    (``failed()``)."""
    if not on:
        if requested is False:
            return f"off ({arg}=False)"
        return f"off ({env_name}=0)" if os.environ.get(env_name) == "0" else f"off ({default_name})"
    if only_triton is not None:
        return only_triton
    reason = failed()
    return None if reason is None else f"failed earlier ({reason})"


def _module_refusal(load, q8, k8, group_size, out) -> str | None:
    """The kernel module's own refusal; its import error (no nvidia-cutlass-dsl, a Triton without Gluon's Hopper
    modules, a broken CUDA stack) is the reason "unavailable (...)"."""
    try:
        mod = load()
    except Exception as err:  # noqa: BLE001
        return f"unavailable ({type(err).__name__}: {err})"
    return mod.refusal(q8, k8, group_size, out)


def _launch(load, failures, label: str, args: tuple, group_size: int, then: str = "the Triton kernel", **extra) -> bool:
    """Run ``load().group_prob_sums_fp8(*args, group_size=, **extra)``: True when it wrote the sums; False after a
    failure (remembered in ``failures``, logged once here with what runs ``then``), out of memory re-raised."""
    try:
        load().group_prob_sums_fp8(*args, group_size=group_size, **extra)
        return True
    except Exception as err:  # noqa: BLE001 (any compile / launch failure: the Triton kernel answers)
        if registry.is_out_of_memory(err):
            raise
        reason = f"{type(err).__name__}: {str(err)[:500]}"
        failures.remember(reason)
        log.warning("MC-Sparse: %s failed (%s); using %s", label, reason, then)
        return False
