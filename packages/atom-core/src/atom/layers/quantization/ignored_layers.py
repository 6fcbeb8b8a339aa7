"""A quantization config whose checkpoint names layers that stay unquantized (e.g. lm_head):
the FP8, compressed-tensors and 4-bit weight-only formats."""

from __future__ import annotations

from atom.layers.quantization.base import LinearMethod, QuantizationConfig
from atom.layers.quantization.unquantized import UnquantizedLinearMethod


class IgnoredLayersConfig(QuantizationConfig):
    def __init__(self, ignored: list[str]):
        self.ignored = ignored

    def is_ignored(self, prefix: str) -> bool:
        return any(
            prefix == name or prefix.endswith("." + name) or name in prefix.split(".")
            for name in self.ignored
        )

    def linear_method(self, prefix: str) -> LinearMethod:
        if self.is_ignored(prefix):
            return UnquantizedLinearMethod()
        return self.quantized_method(prefix)

    def quantized_method(self, prefix: str) -> LinearMethod:
        raise NotImplementedError
