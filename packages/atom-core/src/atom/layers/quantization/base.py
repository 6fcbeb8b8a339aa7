"""Quantization method interfaces: how a layer creates, loads and applies its weights."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
from torch import nn


class LinearMethod(ABC):
    @abstractmethod
    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        params_dtype: torch.dtype,
        weight_loader: Callable,
    ) -> None:
        """Registers the layer's parameters (at least `weight`), each with a weight_loader."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """y = x W^T + b with the layer's (possibly quantized) weights."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Turns checkpoint-format weights into the format `apply` uses."""

    def dequantize_weight(self, layer: nn.Module) -> torch.Tensor:
        """The layer's weight [N, K] in fp32, for a product no quantized kernel runs."""
        raise NotImplementedError(f"{type(self).__name__} has no dequantized weight")


class QuantizationConfig(ABC):
    name: str

    @abstractmethod
    def linear_method(self, prefix: str) -> LinearMethod: ...

    def moe_method(self, prefix: str):
        raise NotImplementedError(f"{self.name} quantization has no MoE method")


def set_weight_attrs(param: nn.Parameter, **attrs) -> nn.Parameter:
    for key, value in attrs.items():
        setattr(param, key, value)
    return param
