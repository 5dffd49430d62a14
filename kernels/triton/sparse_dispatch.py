"""The Triton backend's ``sparse_attention`` op: the sm_90 Gluon kernel where it runs, else the Triton kernel.

Which kernel runs one call (the capability data are in ``sparse_attention_sm90``: ``CAPABILITIES``, ``DTYPES``,
``HEAD_DIMS``, ``refusal``):

- the warp-specialised Gluon kernel (``sparse_attention_sm90.py``) on sm_90 for fp16/bf16, D in {64, 128}, K/V rows
  16-byte aligned, when it is on (``MC_SPARSE_GLUON=1``, or ``GLUON_DEFAULT`` with the variable unset; ``0`` turns
  it off) and no launch tuning is passed (tuning is the Triton kernel's);
- the Triton kernel (``sparse_attention.py``) everywhere else, under the interpreter included.

A Gluon compile or launch failure (anything but out of memory) falls back to the Triton kernel for the same call,
is logged once, and is remembered as the registry remembers a failed backend: in the active ``registry.Record``
(key ``("triton.gluon_sm90", "sparse_attention")``, so the run summary shows the reason and the rest of that run
skips the Gluon kernel) and, without a record, for the process (``fallback_reason``).
"""

from __future__ import annotations

import logging
import os

from .. import registry
from . import sparse_attention as _triton_kernel

log = logging.getLogger(__name__)

GLUON_KEY = ("triton.gluon_sm90", "sparse_attention")
# off by default until the kernel has passed tests/test_gpu_gluon_sparse.py on an H200 (a wrong result is not an
# exception: no fallback would catch it)
GLUON_DEFAULT = False
_process_failure: str | None = None


def _gluon_module():
    from . import sparse_attention_sm90  # imported lazily: an import error is a fallback reason, not a broken backend

    return sparse_attention_sm90


def gluon_refusal(q, k, v) -> str | None:
    """Why the Gluon kernel is not tried for this call (None: it is)."""
    setting = os.environ.get("MC_SPARSE_GLUON", "")
    if setting == "0" or (setting != "1" and not GLUON_DEFAULT):
        return "off (MC_SPARSE_GLUON=1 turns it on)" if setting != "0" else "off (MC_SPARSE_GLUON=0)"
    failed = fallback_reason()
    if failed is not None:
        return f"failed earlier ({failed})"
    try:
        mod = _gluon_module()
    except Exception as err:  # a Triton without Gluon's Hopper module
        return f"unavailable ({type(err).__name__}: {err})"
    return mod.refusal(q, k, v)


def fallback_reason() -> str | None:
    """The Gluon failure this run (active record) or this process (no record) remembers, if any."""
    record = registry._RECORD.get()
    if record is not None:
        return record.failures.get(GLUON_KEY)
    return _process_failure


def _remember(reason: str) -> None:
    global _process_failure
    record = registry._RECORD.get()
    if record is not None:
        record.failures[GLUON_KEY] = reason
    else:
        _process_failure = reason


def reset() -> None:
    """Forget a process-level Gluon failure (tests; a new record starts clean by itself)."""
    global _process_failure
    _process_failure = None


def sparse_attention(q, k, v, perm, kv_idx, *, scale=None, return_lse=False, out=None, residual=None, **tuning):
    """``kernels.sparse_attention`` on the Triton backend (contract: ``sparse_attention.sparse_attention``).

    Tries the sm_90 Gluon kernel when ``gluon_refusal`` allows it and no tuning is given; on its failure runs the
    Triton kernel (same arguments, same ``out``) and remembers the reason (module docstring).
    Raises: what the Triton kernel raises; out of memory from either kernel propagates.
    """
    if not tuning and gluon_refusal(q, k, v) is None:
        try:
            return _gluon_module().sparse_attention(q, k, v, perm, kv_idx, scale=scale, return_lse=return_lse,
                                                    out=out, residual=residual)
        except Exception as err:
            if registry.is_out_of_memory(err):
                raise
            reason = f"{type(err).__name__}: {str(err)[:500]}"
            _remember(reason)
            log.warning("MC-Sparse: the sm_90 Gluon sparse kernel failed (%s); using the Triton kernel", reason)
    return _triton_kernel.sparse_attention(q, k, v, perm, kv_idx, scale=scale, return_lse=return_lse, out=out,
                                           residual=residual, **tuning)
