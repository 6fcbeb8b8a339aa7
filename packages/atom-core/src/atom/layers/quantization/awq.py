"""AWQ checkpoints (`quant_method: "awq"`, the GEMM version AutoAWQ and llm-compressor write).

Per layer: `qweight` int32 [K, N/8], codes packed along the output axis in AWQ's
interleaved nibble order; `qzeros` int32 [K/g, N/8], packed the same way; `scales`
[K/g, N]. The weight is (code - zero) * scale, zero points stored as they are.
"""

from __future__ import annotations

from typing import Any

import torch

from atom.config import ConfigError
from atom.layers.quantization.w4a16 import (
    LayerShape,
    W4A16Config,
    W4A16LinearMethod,
    checkpoint_param,
    drop_params,
    grouped_zeros_and_scales,
    unpack_int4,
)

# Nibble p of a word holds output column AWQ_PACK_ORDER[p] of its eight.
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


class AwqLinearMethod(W4A16LinearMethod):
    format = "awq"

    def create_format_weights(self, layer, shape: LayerShape, scale_dtype, weight_loader):
        k, n = shape.input_size, shape.output_size
        checkpoint_param(
            layer, "qweight", (k, n // 8), torch.int32, (0, 1), {1: 8}, weight_loader
        )  # fmt: skip
        grouped_zeros_and_scales(layer, shape, scale_dtype, weight_loader)

    def decode(self, layer):
        qweight, qzeros, scales = drop_params(layer, "qweight", "qzeros", "scales")
        codes = unpack_int4(qweight, dim=1, order=AWQ_PACK_ORDER)
        zeros = unpack_int4(qzeros, dim=1, order=AWQ_PACK_ORDER)
        return codes, zeros, scales, None


class AwqConfig(W4A16Config):
    name = "awq"
    format = "awq"
    method_class = AwqLinearMethod

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> AwqConfig:
        version = str(raw.get("version", "gemm")).lower()
        if version != "gemm":
            raise ConfigError(
                f"awq: version={raw.get('version')!r} is unsupported; supported: 'gemm'"
            )
        if raw.get("zero_point", True) is not True:
            raise ConfigError(
                "awq: zero_point=False (no zero points) is unsupported; AWQ GEMM checkpoints "
                "store qzeros (zero_point: true)"
            )
        bits = raw.get("bits", raw.get("w_bit"))
        group_size = raw.get("group_size", raw.get("q_group_size"))
        for field, value in (("bits", bits), ("group_size", group_size)):
            if value is None:
                raise ConfigError(f"awq: quantization_config has no {field!r}")
        return cls(bits, group_size, False, raw.get("modules_to_not_convert") or [])
