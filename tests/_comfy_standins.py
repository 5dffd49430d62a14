"""Small stand-ins of ComfyUI (Oct-2025 snapshot) contracts shared by the adapter's unit tests.

* ``raw_attention``: a raw attention backend as ``wrap_attn`` hands it to an override,
  ``comfy/ldm/modules/attention.py`` L476-516 (``attention_pytorch``): q/k/v (B, S, H*D) or, with skip_reshape,
  (B, H, S, D); output (B, S, H*D) unless skip_output_reshape. Computed in float64 (the tests' reference).
* ``transformer_options``: what ``comfy/samplers.py`` L321-323 adds per model call (cond_or_uncond, uuids, sigmas),
  plus the pack's run state and the self-attention mark.
"""

import math

import torch
from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter import override
from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter.callsite import MARK_KEY


def raw_attention(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
                  **kwargs):
    """Reference dense attention in float64 with ComfyUI's layout contract."""
    if not skip_reshape:
        b, s, hd = q.shape
        q, k, v = (t.view(b, -1, heads, hd // heads).transpose(1, 2) for t in (q, k, v))
    scores = q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores + mask.double()
    out = (torch.softmax(scores, -1) @ v.double()).to(q.dtype)
    if skip_output_reshape:  # [B, H, S, D] whatever the input layout (comfy/ldm/modules/attention.py)
        return out
    b, h, s, d = out.shape
    return out.transpose(1, 2).reshape(b, s, h * d)


def transformer_options(run, site, chunks=2, sigma=0.5):
    """transformer_options of one model call with ``chunks`` conditioning chunks (uncond first) at ``sigma``."""
    return {override.RUN_KEY: run, MARK_KEY: site, "cond_or_uncond": [1, 0][:chunks],
            "uuids": [f"u{i}" for i in range(chunks)], "sigmas": torch.tensor([sigma])}


class ModelPatcher:
    """``comfy/model_patcher.py`` ModelPatcher, the parts the pack uses: ``clone`` (L284-330: model_options
    deep-copied, object_patches copied, wrappers and callbacks copied per key), wrappers and callbacks by key
    (L916-950), ``add_object_patch`` (L453), ``get_model_object``, ``load_device`` and ``model_dtype``."""

    def __init__(self, diffusion_model):
        import types

        self.model = types.SimpleNamespace(diffusion_model=diffusion_model, manual_cast_dtype=None)
        self.model_options = {"transformer_options": {}}
        self.object_patches, self.wrappers, self.callbacks = {}, {}, {}
        self.load_device = torch.device("cpu")

    def clone(self):
        import copy

        n = ModelPatcher.__new__(ModelPatcher)
        n.model, n.load_device = self.model, self.load_device
        n.object_patches = self.object_patches.copy()
        n.model_options = copy.deepcopy(self.model_options)
        n.wrappers = {t: {k: list(v) for k, v in w.items()} for t, w in self.wrappers.items()}
        n.callbacks = {t: {k: list(v) for k, v in c.items()} for t, c in self.callbacks.items()}
        return n

    def model_dtype(self):
        return torch.float32

    def get_model_object(self, name):
        if name in self.object_patches:
            return self.object_patches[name]
        obj = self.model
        for part in name.split("."):
            obj = getattr(obj, part)
        return obj

    def add_object_patch(self, name, obj):
        self.object_patches[name] = obj

    def add_wrapper_with_key(self, wrapper_type, key, wrapper):
        self.wrappers.setdefault(wrapper_type, {}).setdefault(key, []).append(wrapper)

    def remove_wrappers_with_key(self, wrapper_type, key):
        self.wrappers.get(wrapper_type, {}).pop(key, None)

    def get_all_wrappers(self, wrapper_type):
        return [w for ws in self.wrappers.get(wrapper_type, {}).values() for w in ws]

    def add_callback_with_key(self, call_type, key, callback):
        self.callbacks.setdefault(call_type, {}).setdefault(key, []).append(callback)

    def remove_callbacks_with_key(self, call_type, key):
        self.callbacks.get(call_type, {}).pop(key, None)


def install_comfy_modules(monkeypatch):
    """``comfy.patcher_extension`` (WrappersMP / CallbacksMP names) and ``comfy.model_patcher``
    (``create_model_options_clone``) as the adapter imports them, in ``sys.modules`` for one test."""
    import copy
    import sys
    import types

    comfy = types.ModuleType("comfy")
    pe = types.ModuleType("comfy.patcher_extension")
    pe.WrappersMP = types.SimpleNamespace(OUTER_SAMPLE="outer_sample", CALC_COND_BATCH="calc_cond_batch",
                                          APPLY_MODEL="apply_model", DIFFUSION_MODEL="diffusion_model")
    pe.CallbacksMP = types.SimpleNamespace(ON_PREPARE_STATE="on_prepare_state", ON_CLEANUP="on_cleanup")
    mp = types.ModuleType("comfy.model_patcher")
    mp.create_model_options_clone = lambda o: {**o, "transformer_options": copy.copy(o.get("transformer_options", {}))}
    comfy.patcher_extension, comfy.model_patcher = pe, mp
    for name, module in (("comfy", comfy), ("comfy.patcher_extension", pe), ("comfy.model_patcher", mp)):
        monkeypatch.setitem(sys.modules, name, module)


def wan_model(blocks: int = 3, heads: int = 12, dim: int = 1536):
    """A stand-in of ComfyUI's ``WanModel`` (the class name the adapter's layouts key on) with what the run's
    geometry reads: ``blocks[i].self_attn``, ``patch_size`` (1, 2, 2), ``num_heads`` and ``dim`` (Wan2.1-1.3B's by
    default: 12 heads of 128)."""
    import torch

    dm = type("WanModel", (torch.nn.Module,), {})()
    dm.blocks = torch.nn.ModuleList(torch.nn.Module() for _ in range(blocks))
    for block in dm.blocks:
        block.self_attn = torch.nn.Identity()
    dm.patch_size, dm.num_heads, dm.dim = (1, 2, 2), heads, dim
    return dm


class Executor:
    """``comfy/patcher_extension.py`` WrapperExecutor (L91-121): calls ``wrappers[i](next_executor, *args)``, the
    last one ``original``; ``class_obj`` is the guider for OUTER_SAMPLE wrappers."""

    def __init__(self, original, class_obj, wrappers, idx=0):
        self.original, self.class_obj, self.wrappers, self.idx = original, class_obj, wrappers, idx

    def __call__(self, *args, **kwargs):
        if self.idx == len(self.wrappers):
            return self.original(*args, **kwargs)
        return self.wrappers[self.idx](Executor(self.original, self.class_obj, self.wrappers, self.idx + 1),
                                       *args, **kwargs)
