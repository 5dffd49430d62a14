"""Registers the optional GPU backends; a missing or broken toolchain becomes an unavailable reason."""

from __future__ import annotations

import importlib

from .registry import Backend, register

# (package inside kernels/, backend name, priority)
_OPTIONAL = (("torch_gpu", "torch_gpu", 15), ("triton", "triton", 20), ("cuda_sdpa", "cuda_sdpa", 25), ("flash_attn4", "flash_attn4", 30), ("cutedsl", "cutedsl", 40))

for _module, _name, _priority in _OPTIONAL:
    try:
        importlib.import_module(f".{_module}", __package__)  # the package registers itself
    except Exception as err:  # ImportError, or a toolchain that breaks at import: never break ours
        register(Backend(name=_name, priority=_priority, unavailable_reason=f"{type(err).__name__}: {err}"))
