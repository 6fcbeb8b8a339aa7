"""MXFP4 checkpoints (GPT-OSS): experts stored as 4-bit e2m1 values in groups of 32 that
share one e8m0 power-of-two scale (atom.kernels.moe_mxfp4); every other layer is
unquantized.

The experts stay packed on the device and run through `fused_moe_mxfp4`: Triton
dequantizes each weight tile in registers on GPUs; the torch reference (CPU) dequantizes
the experts a call routes to, per call.
"""

from __future__ import annotations

from collections.abc import Callable
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
    # The parameters' suffixes: the checkpoint's names for the codes and their scales.
    codes, scales = "blocks", "scales"

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
            for part, shape in ((self.codes, (*scale_shape, MXFP4_GROUP // 2)),
                                (self.scales, scale_shape)):  # fmt: skip
                param = nn.Parameter(torch.empty(shape, dtype=torch.uint8), requires_grad=False)
                set_weight_attrs(
                    param, weight_loader=self.weight_loader(layer), shard_block=shard_block
                )
                layer.register_parameter(f"{projection}_{part}", param)

    def weight_loader(self, layer) -> Callable:
        return layer.weight_loader

    def packed(self, layer, projection: str) -> tuple[torch.Tensor, torch.Tensor]:
        """A projection's (codes, scales)."""
        codes, scales = (
            getattr(layer, f"{projection}_{part}") for part in (self.codes, self.scales)
        )
        return codes, scales

    def apply(self, layer, x, topk_weights, topk_ids) -> torch.Tensor:
        return fused_moe_mxfp4(
            x, *self.packed(layer, "w13"), *self.packed(layer, "w2"),
            topk_weights, topk_ids, layer.activation,
            w13_bias=layer.w13_bias, w2_bias=layer.w2_bias,
        )  # fmt: skip

    def process_weights_after_loading(self, layer) -> None:
        pass


class Fp4ExpertsMoEMethod(Mxfp4MoEMethod):
    """DeepSeek-V4's `expert_dtype: "fp4"` experts: the same MXFP4 values, stored per
    expert as a Linear's `weight` [N, K/2] (two e2m1 codes a byte, low nibble first; int8
    or float4_e2m1fn_x2) and `scale` [N, K/32] (float8_e8m0fnu), which the model's loader
    names `weight_scale_inv` as for its FP8 layers. Held as GPT-OSS's blocks and scales."""

    codes, scales = "weight", "weight_scale_inv"

    def weight_loader(self, layer) -> Callable:
        def load(param: nn.Parameter, loaded: torch.Tensor, *args) -> None:
            if loaded.element_size() != 1:
                raise ValueError(
                    f"FP4 experts take one-byte codes and e8m0 scales, got {loaded.dtype}"
                )
            # The bytes themselves: a cast would turn e8m0 exponents into their values.
            loaded = loaded.view(torch.uint8)
            if param.dim() == 4:  # codes [N, K/2] -> blocks [N, K/32, 16]
                loaded = loaded.unflatten(-1, (-1, MXFP4_GROUP // 2))
            layer.weight_loader(param, loaded, *args)

        return load


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
