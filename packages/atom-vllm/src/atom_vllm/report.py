"""What serves a vLLM engine: `llm.apply_model(atom_vllm.report.describe_model)`.

Runs in each worker (vLLM pickles the function by reference, so it must live in an
importable module; `apply_model` needs VLLM_ALLOW_INSECURE_SERIALIZATION=1). Returns the
model class, the ATOM model class inside it (None for vLLM's own classes) and, per
attention layer, its backend, impl, KV-cache shape and dtype, sliding window (such layers
get vLLM's sliding-window KV spec), the fp8 KV-cache scales ATOM's impl applies and how
often it ran; for a state (mamba) layer, the shapes and dtypes of its bound states; per
ATOM MoE layer, the experts this rank holds ([first, count], or None: every expert,
sliced).
"""

from __future__ import annotations

from typing import Any

from torch import nn


def describe_model(model: nn.Module) -> dict[str, Any]:
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    inner = getattr(model, "atom_model", None)
    layers = []
    for name, module in model.named_modules():
        if not isinstance(module, AttentionLayerBase):
            continue
        backend = module.get_attn_backend()
        impl = getattr(module, "impl", None)
        kv_cache = getattr(module, "kv_cache", None)
        layers.append(
            {
                "module": name,
                "layer": getattr(module, "layer_name", name),
                "layer_class": type(module).__name__,
                "backend": f"{backend.__module__}.{backend.__qualname__}",
                "backend_name": backend.get_name(),
                "impl": type(impl).__name__ if impl is not None else None,
                "calls": getattr(impl, "num_calls", getattr(module, "num_calls", None)),
                "kv_cache_shape": list(kv_cache.shape) if hasattr(kv_cache, "shape") else None,
                "states": (
                    [[list(state.shape), str(state.dtype)] for state in kv_cache]
                    if isinstance(kv_cache, tuple)
                    else None
                ),
                "kv_cache_dtype": getattr(module, "kv_cache_dtype", None),
                "kv_scales": [getattr(impl, "k_scale", None), getattr(impl, "v_scale", None)],
                "sliding_window": getattr(module, "sliding_window", None),
            }
        )
    from atom.layers.moe import FusedMoE

    experts = [
        [m.placement.first, m.placement.count] if m.placement is not None else None
        for m in model.modules()
        if isinstance(m, FusedMoE)
    ]
    return {
        "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
        "atom_class": f"{type(inner).__module__}.{type(inner).__qualname__}" if inner else None,
        "attention": layers,
        "experts": experts,
    }
