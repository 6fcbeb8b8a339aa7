"""compressed-tensors checkpoints with FP8 weights (`quant_method: "compressed-tensors"`)."""

from __future__ import annotations

from atom.layers.quantization.base import LinearMethod
from atom.layers.quantization.fp8 import Fp8PerTensorLinearMethod, _IgnoringConfig


class CompressedTensorsFp8Config(_IgnoringConfig):
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
