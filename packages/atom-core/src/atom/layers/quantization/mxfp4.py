"""MXFP4 checkpoints (GPT-OSS): experts stored as 4-bit e2m1 values in groups of 32 that
share one e8m0 power-of-two scale (atom.kernels.moe_mxfp4); every other layer is
unquantized.

The experts stay packed on the device and run through `fused_moe_mxfp4`: Triton
dequantizes each weight tile in registers on GPUs; the torch reference (CPU) dequantizes
the experts a call routes to, per call.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from atom.kernels.moe_mxfp4 import MXFP4_GROUP, fused_moe_mxfp4
from atom.layers.quantization.base import LinearMethod, QuantizationConfig, set_weight_attrs
from atom.layers.quantization.unquantized import UnquantizedLinearMethod


class Mxfp4MoEMethod:
    """Experts as blocks [E, N, K/32, 16] and scales [E, N, K/32] (uint8) per projection:
    w13 (N = gate rows then up rows, K = hidden) and w2 (N = hidden, K = intermediate).
    Tensor parallelism splits w13 along N, as for unquantized experts, and w2 along K in
    whole groups of 32, so each rank's intermediate size must be a multiple of 32."""

    supports_bias = True
    kernel_op = "fused_moe_mxfp4"

    def create_weights(self, layer, num_experts: int, hidden: int, inter: int, dtype) -> None:
        if hidden % MXFP4_GROUP or inter % MXFP4_GROUP:
            raise ValueError(
                f"{layer.prefix}: MXFP4 experts group {MXFP4_GROUP} values along each input, "
                f"so hidden_size ({hidden}) and the intermediate size per rank ({inter}: "
                f"intermediate_size / tensor parallel size {layer.tp.world_size}) must be "
                f"multiples of {MXFP4_GROUP}"
            )
        shapes = {
            "w13": ((num_experts, 2 * inter, hidden // MXFP4_GROUP), 1),
            "w2": ((num_experts, hidden, inter // MXFP4_GROUP), MXFP4_GROUP),
        }
        for projection, (scale_shape, shard_block) in shapes.items():
            for part, shape in (("blocks", (*scale_shape, MXFP4_GROUP // 2)),
                                ("scales", scale_shape)):  # fmt: skip
                param = nn.Parameter(torch.empty(shape, dtype=torch.uint8), requires_grad=False)
                set_weight_attrs(param, weight_loader=layer.weight_loader, shard_block=shard_block)
                layer.register_parameter(f"{projection}_{part}", param)

    def apply(self, layer, x, topk_weights, topk_ids) -> torch.Tensor:
        return fused_moe_mxfp4(
            x, layer.w13_blocks, layer.w13_scales, layer.w2_blocks, layer.w2_scales,
            topk_weights, topk_ids, layer.activation,
            w13_bias=layer.w13_bias, w2_bias=layer.w2_bias,
        )  # fmt: skip

    def process_weights_after_loading(self, layer) -> None:
        pass


class Mxfp4Config(QuantizationConfig):
    """Unquantized dense layers; packed MXFP4 experts."""

    name = "mxfp4"

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Mxfp4Config:
        return cls()

    def linear_method(self, prefix: str) -> LinearMethod:
        return UnquantizedLinearMethod()

    def moe_method(self, prefix: str) -> Mxfp4MoEMethod:
        return Mxfp4MoEMethod()
