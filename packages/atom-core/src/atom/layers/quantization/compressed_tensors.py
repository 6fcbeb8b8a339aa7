"""compressed-tensors checkpoints (`quant_method: "compressed-tensors"`): FP8 weights here,
4-bit "pack-quantized" weights in `pack_quantized`."""

from __future__ import annotations

from atom.config import ConfigError
from atom.layers.quantization.base import LinearMethod, QuantizationConfig
from atom.layers.quantization.fp8 import Fp8PerTensorLinearMethod
from atom.layers.quantization.ignored_layers import IgnoredLayersConfig
from atom.layers.quantization.pack_quantized import PackQuantizedConfig

PACK_QUANTIZED = "pack-quantized"


def compressed_tensors_config(raw: dict) -> QuantizationConfig:
    """The config of a compressed-tensors checkpoint: FP8, or 4-bit pack-quantized."""
    groups = list((raw.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise ConfigError(f"compressed-tensors: expected one config group, got {len(groups)}")
    if (groups[0].get("format") or raw.get("format")) != PACK_QUANTIZED:
        return CompressedTensorsFp8Config.from_dict(raw)
    if groups[0].get("input_activations"):
        raise ConfigError(
            "compressed-tensors pack-quantized: quantized input_activations are unsupported; "
            "ATOM loads weight-only (W4A16) schemes"
        )
    return PackQuantizedConfig.from_dict(raw, groups[0].get("weights") or {})


class CompressedTensorsFp8Config(IgnoredLayersConfig):
    name = "compressed-tensors"
    format = "compressed-tensors-fp8"

    def __init__(self, weight_strategy: str, dynamic_input: bool, ignored: list[str]):
        super().__init__(ignored)
        self.weight_strategy = weight_strategy
        self.dynamic_input = dynamic_input

    @classmethod
    def from_dict(cls, raw: dict) -> CompressedTensorsFp8Config:
        groups = list((raw.get("config_groups") or {}).values())
        if len(groups) != 1:
            raise ValueError(f"compressed-tensors: expected one config group, got {len(groups)}")
        weights = groups[0].get("weights") or {}
        inputs = groups[0].get("input_activations") or {}
        if weights.get("num_bits") != 8 or weights.get("type") != "float":
            raise ValueError(
                "compressed-tensors: only FP8 weights (num_bits 8, type float) are supported, "
                f"got {weights}"
            )
        strategy = weights.get("strategy", "tensor")
        if strategy not in ("tensor", "channel"):
            raise ValueError(f"compressed-tensors: unsupported FP8 weight strategy {strategy!r}")
        return cls(strategy, bool(inputs.get("dynamic", True)), raw.get("ignore") or [])

    def quantized_method(self, prefix: str) -> LinearMethod:
        return Fp8PerTensorLinearMethod(
            static_input_scale=not self.dynamic_input,
            per_channel=self.weight_strategy == "channel",
        )
