from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from atom.kernels import fused_moe
from atom.layers.quantization.base import LinearMethod, set_weight_attrs


class UnquantizedLinearMethod(LinearMethod):
    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        params_dtype: torch.dtype,
        weight_loader: Callable,
    ) -> None:
        weight = nn.Parameter(
            torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype),
            requires_grad=False,
        )
        layer.register_parameter(
            "weight",
            set_weight_attrs(weight, output_dim=0, input_dim=1, weight_loader=weight_loader),
        )

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)

    def dequantize_weight(self, layer: nn.Module) -> torch.Tensor:
        return layer.weight.float()


class UnquantizedMoEMethod:
    supports_bias = True

    def create_weights(
        self, layer: nn.Module, num_experts: int, hidden: int, inter: int, dtype
    ) -> None:
        layer.w13_weight = nn.Parameter(
            torch.empty(num_experts, 2 * inter, hidden, dtype=dtype), requires_grad=False
        )
        layer.w2_weight = nn.Parameter(
            torch.empty(num_experts, hidden, inter, dtype=dtype), requires_grad=False
        )
        for param in (layer.w13_weight, layer.w2_weight):
            set_weight_attrs(param, weight_loader=layer.weight_loader)

    def apply(self, layer: nn.Module, x, topk_weights, topk_ids) -> torch.Tensor:
        return fused_moe(
            x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids, layer.activation,
            w13_bias=layer.w13_bias, w2_bias=layer.w2_bias,
        )  # fmt: skip

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass
