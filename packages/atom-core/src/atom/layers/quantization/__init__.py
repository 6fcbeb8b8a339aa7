"""Quantization configs: which LinearMethod / MoE method each layer uses."""

from __future__ import annotations

from typing import Any

from atom.layers.quantization.base import LinearMethod, QuantizationConfig, set_weight_attrs
from atom.layers.quantization.unquantized import UnquantizedLinearMethod


def get_quant_config(hf_config: Any) -> QuantizationConfig | None:
    """The quantization config a HF `quantization_config` describes (None: unquantized)."""
    raw = getattr(hf_config, "quantization_config", None)
    if not raw:
        return None
    raw = raw if isinstance(raw, dict) else raw.to_dict()
    method = raw.get("quant_method")
    if method == "fp8":
        from atom.layers.quantization.fp8 import Fp8Config

        return Fp8Config.from_dict(raw)
    if method == "compressed-tensors":
        from atom.layers.quantization.compressed_tensors import compressed_tensors_config

        return compressed_tensors_config(raw)
    if method == "mxfp4":
        from atom.layers.quantization.mxfp4 import Mxfp4Config

        return Mxfp4Config.from_dict(raw)
    if method == "awq":
        from atom.layers.quantization.awq import AwqConfig

        return AwqConfig.from_dict(raw)
    if method == "gptq":
        from atom.layers.quantization.gptq import GptqConfig

        return GptqConfig.from_dict(raw)
    raise ValueError(
        f"unsupported quantization method {method!r}; supported: 'fp8', "
        "'compressed-tensors' (FP8, 4-bit pack-quantized), 'awq', 'gptq' (4-bit), "
        "'mxfp4' (GPT-OSS experts)"
    )


__all__ = [
    "LinearMethod",
    "QuantizationConfig",
    "UnquantizedLinearMethod",
    "get_quant_config",
    "set_weight_attrs",
]
