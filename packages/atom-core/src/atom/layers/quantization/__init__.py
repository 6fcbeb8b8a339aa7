"""Quantization configs: which LinearMethod / MoE method each layer uses."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from atom.layers.quantization.awq import AwqConfig
from atom.layers.quantization.base import LinearMethod, QuantizationConfig, set_weight_attrs
from atom.layers.quantization.compressed_tensors import compressed_tensors_config
from atom.layers.quantization.fp8 import Fp8Config
from atom.layers.quantization.gptq import GptqConfig
from atom.layers.quantization.mxfp4 import Mxfp4Config
from atom.layers.quantization.unquantized import UnquantizedLinearMethod, UnquantizedMoEMethod

# HF `quant_method` -> the config it describes, read from the checkpoint's dict.
_CONFIG_READERS: dict[str, Callable[[dict], QuantizationConfig]] = {
    "fp8": Fp8Config.from_dict,
    "compressed-tensors": compressed_tensors_config,
    "mxfp4": Mxfp4Config.from_dict,
    "awq": AwqConfig.from_dict,
    "gptq": GptqConfig.from_dict,
}


def get_quant_config(hf_config: Any) -> QuantizationConfig | None:
    """The quantization config a HF `quantization_config` describes (None: unquantized)."""
    raw = getattr(hf_config, "quantization_config", None)
    if not raw:
        return None
    raw = raw if isinstance(raw, dict) else raw.to_dict()
    # DeepSeek-V4 names its experts' format at the top level, V4.1 (and transformers'
    # config, which moves V4's there) inside quantization_config.
    top_level_expert_dtype = getattr(hf_config, "expert_dtype", None)
    if top_level_expert_dtype is not None:
        raw = {"expert_dtype": top_level_expert_dtype, **raw}
    method = raw.get("quant_method")
    if method in _CONFIG_READERS:
        return _CONFIG_READERS[method](raw)
    raise ValueError(
        f"unsupported quantization method {method!r}; supported: 'fp8', "
        "'compressed-tensors' (FP8, 4-bit pack-quantized), 'awq', 'gptq' (4-bit), "
        "'mxfp4' (GPT-OSS experts)"
    )


__all__ = [
    "LinearMethod",
    "QuantizationConfig",
    "UnquantizedLinearMethod",
    "UnquantizedMoEMethod",
    "get_quant_config",
    "set_weight_attrs",
]
